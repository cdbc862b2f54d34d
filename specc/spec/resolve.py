"""Resolution: ModelSpec -> ResolvedSpec, the one explicit form every later stage reads.

Every default is filled and every derived value computed here, once: per-layer entries, d_k,
d_v, kv_heads, the final-norm decision, the output list, BigBird's random blocks, and the IO
signature of each graph (named tensors with dtypes and symbolic dims). Later stages never
re-derive any of these.

Graphs and their tensors (names follow Optimum's ONNX conventions):

  encoder                 model:   input_ids, attention_mask[, token_type_ids] -> outputs
  decoder                 model:   input_ids, attention_mask (over past + new tokens)[, position_ids]
                                   [, token_type_ids], past_key_values.N.key/.value
                                -> outputs, present.N.key/.value
  encoder-decoder         encoder: input_ids, attention_mask[, token_type_ids]
                                -> last_hidden_state, present.N.encoder.key/.value (cross-attention K/V,
                                   computed once per source)
                          decoder: input_ids, encoder_attention_mask, past_key_values.N.decoder.key/.value,
                                   past_key_values.N.encoder.key/.value
                                -> outputs, present.N.decoder.key/.value

A decoder-only model's sliding-window layers keep window caches (ResolvedAttention.cache_window):
their past / present dims are the windowed forms of past_sequence / total_sequence (spec/io.py).
A stack of latent attention caches past_key_values.N.latent [batch, 1, past, kv_rank] and
.rope_key [batch, 1, past, rope_dims] in place of .key / .value (spec/io.py's cache pairs).
"""
from __future__ import annotations

import math
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict

from specc.spec.derive import (
    attention_rotary_dims,
    effective_outputs,
    effective_tie,
    head_dims,
    override_aspects,
    stacks,
)
from specc.spec import io
from specc.spec.io import (
    ATTENTION_MASK,
    BATCH,
    CROSS,
    ENC_SEQ,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    KEY,
    LAST_HIDDEN_STATE,
    LATENT,
    OWN,
    PAST,
    PAST_PREFIX,
    POSITION_IDS,
    PRESENT_PREFIX,
    SELF,
    SEQ,
    TOKEN_TYPE_IDS,
    TOTAL,
    cache_pair,
    cache_slots,
    float_dtype,
    windowed,
)
from specc.spec.schema import (
    AttentionKind,
    DropoutSpec,
    FFNKind,
    FullPattern,
    ModelSpec,
    NormSpec,
    OutputSpec,
    PatternSpec,
    NoScaling,
    PositionSpec,
    RotaryScaling,
    ServingSpec,
    TokensSpec,
    VocabSpec,
)

Dim = int | str  # a fixed size, or a symbolic dim of specc/spec/io.py
ABSOLUTE_POSITIONS = ("sinusoidal", "learned", "rotary")


class Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ResolvedAttention(Frozen):
    kind: Literal["multi_head", "latent"] = "multi_head"
    heads: int
    kv_heads: int
    d_k: int
    d_v: int
    score: Literal["scaled_dot", "dot", "bilinear", "additive"]
    merge: Literal["project", "concat", "mean"]
    share_kv: bool
    bias: bool
    output_bias: bool  # the output projection's (AttentionSpec.output_bias, or bias)
    qk_norm: Literal["none", "head", "full"] = "none"
    scale: float | None = None  # AttentionSpec.scale
    softcap: float | None = None  # AttentionSpec.softcap
    sinks: bool = False  # a learned logit per head joins the softmax (AttentionSpec.sinks)
    # latent attention (LatentAttentionSpec): the queries' rank (None: projected directly), the
    # latent's, its norms' eps; rotary_dims is its rope_dims, the last dims of each q / k head
    q_rank: int | None = None
    kv_rank: int = 0
    latent_eps: float = 1.0e-6
    pattern: PatternSpec
    causal: bool  # decoder self-attention
    cross: bool  # attends to the encoder's output
    rotary_dims: int = 0  # rotary positions: dims of each q/k head that rotate (leading; latent: last)
    rotary_base: float = 0.0  # their base: position.base, or the layer's override
    rotary_scaling: RotaryScaling = NoScaling()  # their scaling: position.scaling, or the layer's override
    # BigBird: for each query block, the key blocks it also attends to (drawn once, seeded).
    random_blocks: tuple[tuple[int, ...], ...] = ()
    # a decoder-only model's self-attention under a local pattern: the window W its cache keeps
    # (the last W positions; specc/spec/io.py), None where the cache holds the whole sequence
    cache_window: int | None = None


class ResolvedLayer(Frozen):
    index: int
    attention: ResolvedAttention
    cross_attention: ResolvedAttention | None = None
    ffn: FFNKind  # the stack's, or the override's that chooses this layer
    parallel: Literal["none", "one_norm", "two_norms"] = "none"  # StackSpec.parallel


class ResolvedStack(Frozen):
    role: Literal["encoder", "decoder"]
    layers: tuple[ResolvedLayer, ...]
    final_norm: bool
    vocab_size: int  # rows of this stack's token embedding table


class TensorSig(Frozen):
    name: str
    dtype: Literal["int64", "int32", "float32", "float16", "bfloat16"]
    dims: tuple[Dim, ...]


class GraphSig(Frozen):
    name: str  # model | encoder | decoder
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...]

    def input(self, name: str) -> TensorSig:
        return next(t for t in self.inputs if t.name == name)


class ResolvedSpec(Frozen):
    spec: ModelSpec  # explicit: every default written out, derived dims filled in
    source: str | None = None
    weights_path: str | None = None
    tokenizer_path: str | None = None  # the spec's tokenizer: folder, absolute
    encoder: ResolvedStack | None
    decoder: ResolvedStack | None
    outputs: tuple[OutputSpec, ...]
    dropout: DropoutSpec
    tie_output: bool
    graphs: tuple[GraphSig, ...]

    # --- shortcuts to the explicit spec ---
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def architecture(self) -> str:
        return self.spec.architecture

    @property
    def d_model(self) -> int:
        return self.spec.d_model

    @property
    def vocab(self) -> VocabSpec:
        return self.spec.vocab

    @property
    def position(self) -> PositionSpec:
        return self.spec.position

    @property
    def norm(self) -> NormSpec:
        return self.spec.norm

    @property
    def tokens(self) -> TokensSpec:
        return self.spec.tokens

    @property
    def serving(self) -> ServingSpec:
        return self.spec.serving

    @property
    def target_vocab_size(self) -> int:
        return self.spec.vocab.target_size or self.spec.vocab.size

    def graph(self, name: str) -> GraphSig:
        return next(g for g in self.graphs if g.name == name)

    @property
    def lm_output(self) -> str | None:
        """The output generation reads (spec/io.py's rule), None where the spec has none."""
        main = self.graph(io.main_graph([g.name for g in self.graphs]))
        return io.lm_output(((o.name, o.kind) for o in self.outputs), (t.name for t in main.outputs))

    def input_vocab_size(self, graph: str) -> int:
        """The vocabulary graph `graph`'s input_ids index: the encoder's token table for the
        encoder graph and an encoder-only model, the decoder's (an encoder-decoder's target
        vocabulary) for the others."""
        return self.stack("encoder" if graph == "encoder" or self.decoder is None else "decoder").vocab_size

    @property
    def output_vocab_size(self) -> int:
        """The vocabulary the lm and mlm outputs score: the last stack's (the decoder's where
        there is one)."""
        return (self.decoder or self.encoder).vocab_size

    @property
    def cache_pair(self) -> tuple[str, str]:
        """The names of the two cache tensors of each decoder layer's self-attention (spec/io.py):
        key and value, or a latent attention's latent and rotary key."""
        return cache_pair(self.decoder.layers[0].attention.kind if self.decoder is not None else "multi_head")

    @property
    def cache_windows(self) -> tuple[int | None, ...]:
        """Each decoder layer's window cache: the W positions it keeps (spec/io.py), None where
        its cache holds the whole sequence; () without a decoder."""
        return () if self.decoder is None else tuple(layer.attention.cache_window for layer in self.decoder.layers)

    @property
    def routed_layers(self) -> tuple[tuple[str, int], ...]:
        """(role, index) of each layer whose FFN routes experts, in forward order (the encoder's,
        then the decoder's): the order their routers run in."""
        return tuple((role, layer.index) for role in ("encoder", "decoder") if getattr(self, role) is not None
                     for layer in getattr(self, role).layers if layer.ffn.kind == "moe")

    def stack(self, role: str) -> ResolvedStack:
        found = getattr(self, role)
        if found is None:
            raise KeyError(f"{self.name} has no {role}")
        return found


# --- attention and layers -------------------------------------------------------------------


def bigbird_random_blocks(
    n_blocks: int, random_per_row: int, global_blocks: int, causal: bool, seed: str
) -> tuple[tuple[int, ...], ...]:
    """For each query block, `random_per_row` key blocks drawn without replacement from those it
    does not already see as global (and, in a decoder, not from the future). Seeded by a string,
    so the same spec always gives the same blocks (Python's random with a str seed is stable)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n_blocks):
        candidates = [j for j in range(n_blocks) if j >= global_blocks and j != i and (not causal or j < i)]
        rows.append(tuple(sorted(rng.sample(candidates, min(random_per_row, len(candidates))))))
    return tuple(rows)


def _attention(
    att: AttentionKind, spec: ModelSpec, role: str, layer: int, stack: str, override=None
) -> ResolvedAttention:
    if override is not None and override.pattern is not None:
        att = att.model_copy(update={"pattern": override.pattern})
    d_k, d_v, kv = head_dims(att, spec.d_model)
    cross = role == "cross"
    rot, base, scaling = 0, 0.0, NoScaling()
    if spec.position.kind == "rotary" and not cross:
        rot = attention_rotary_dims(att, spec.d_model, spec.position.fraction)
        base = override.rotary_base if override is not None and override.rotary_base is not None else spec.position.base
        scaling = spec.position.scaling
        if override is not None and override.rotary_scaling is not None:
            scaling = override.rotary_scaling
    blocks: tuple = ()
    if att.pattern.kind == "bigbird":
        p = att.pattern
        n = math.ceil(spec.position.max_length / p.block)
        blocks = bigbird_random_blocks(n, p.random, p.global_, role == "causal", f"bigbird/{stack}/{layer}")
    # an encoder-decoder's decoder takes no mask over its own past, from which a window cache's
    # layers would learn the past's length: its caches hold the whole sequence
    window = att.pattern.window if (att.pattern.kind == "local" and role == "causal"
                                    and spec.architecture == "decoder") else None
    latent = att.kind == "latent"
    return ResolvedAttention(
        kind=att.kind,
        heads=att.heads,
        kv_heads=kv,
        d_k=d_k,
        d_v=d_v,
        score="scaled_dot" if latent else att.score,
        merge="project" if latent else att.merge,
        share_kv=False if latent else att.share_kv,
        bias=att.bias,
        output_bias=att.bias if att.output_bias is None else att.output_bias,
        qk_norm="none" if latent else att.qk_norm,
        scale=att.scale,
        softcap=att.softcap,
        sinks=att.sinks,
        q_rank=att.q_rank if latent else None,
        kv_rank=att.kv_rank if latent else 0,
        latent_eps=att.latent_eps if latent else 1.0e-6,
        pattern=att.pattern,
        causal=role == "causal",
        cross=cross,
        rotary_dims=rot,
        rotary_base=base,
        rotary_scaling=scaling,
        random_blocks=blocks,
        cache_window=window,
    )


def overridden(st, i: int, aspect: str = "attention"):
    """The stack's LayerOverride that configures `aspect` ("attention" or "ffn",
    rules.override_aspects) of layer i, or None (rules.overrides_fit: at most one)."""
    for ov in st.overrides:
        if aspect in override_aspects(ov) and ((ov.indices is not None and i in ov.indices) or (
                ov.every is not None and i >= ov.first and (i - ov.first) % ov.every == 0)):
            return ov
    return None


def _explicit_attention(att: AttentionKind, d_model: int) -> AttentionKind:
    d_k, d_v, kv = head_dims(att, d_model)
    if att.kind == "latent":
        return att.model_copy(update={"d_v": d_v})
    return att.model_copy(update={"d_k": d_k, "d_v": d_v, "kv_heads": kv})


def explicit(spec: ModelSpec) -> ModelSpec:
    """The same model with every default written out: what `specc resolve` prints. Loading
    its YAML gives back an equal spec."""
    update: dict = {"extends": None, "outputs": effective_outputs(spec)}
    for name in stacks(spec):
        st = getattr(spec, name)
        st_update = {"attention": _explicit_attention(st.attention, spec.d_model)}
        if name == "decoder" and spec.architecture == "encoder-decoder":
            # null = same as attention; the pattern is full (a local or bigbird self-attention
            # pattern relates positions of one sequence and has no meaning across two)
            cross = st.cross_attention or st.attention.model_copy(update={"pattern": FullPattern()})
            st_update["cross_attention"] = _explicit_attention(cross, spec.d_model)
        update[name] = st.model_copy(update=st_update)
    final = spec.norm.final if spec.norm.final != "auto" else spec.norm.placement in ("pre", "sandwich", "sublayer_output")
    update["norm"] = spec.norm.model_copy(update={"final": final})
    update["vocab"] = spec.vocab.model_copy(update={"tie_output": effective_tie(spec)})
    data = spec.model_copy(update=update).model_dump(by_alias=True, mode="json")
    out = ModelSpec.model_validate(data)
    out._path, out._weights_path, out._tokenizer_path = spec.path, spec.weights_path, spec.tokenizer_path
    return out


# --- the IO signature (names, dims and dtypes: specc/spec/io.py) ----------------------------


def _output_sigs(spec: ModelSpec, outputs, vocab: int, seq: str, fdt: str) -> list[TensorSig]:
    sigs = []
    for o in outputs:
        dims = {
            "hidden": (BATCH, seq, spec.d_model),
            "lm": (BATCH, seq, vocab),
            "mlm": (BATCH, seq, vocab),
            "classifier": (BATCH, getattr(o, "classes", 0)),
            "pooled": (BATCH, spec.d_model),
            "token_classifier": (BATCH, seq, getattr(o, "classes", 0)),
        }[o.kind]
        sigs.append(TensorSig(name=o.name, dtype=fdt, dims=dims))
    return sigs


def _cache_sigs(prefix: str, stack: ResolvedStack, part: str, seq: str, fdt: str) -> list[TensorSig]:
    """The `prefix` (past or present) cache tensors of the stack's layers for one cache part."""
    sigs = []
    kind = stack.layers[0].cross_attention.kind if part == CROSS else stack.layers[0].attention.kind
    for slot in cache_slots(len(stack.layers), part, cache_pair(kind)):
        layer = stack.layers[slot.layer]
        att = layer.cross_attention if slot.cross else layer.attention
        length = seq if att.cache_window is None or slot.cross else windowed(seq, att.cache_window)
        if att.kind == "latent":  # one latent and one rotary key per position, shared by the heads
            width = att.kv_rank if slot.which == LATENT else att.rotary_dims
            sigs.append(TensorSig(name=slot.name(prefix), dtype=fdt, dims=(BATCH, 1, length, width)))
            continue
        width = att.d_k if slot.which == KEY else att.d_v
        sigs.append(TensorSig(name=slot.name(prefix), dtype=fdt, dims=(BATCH, att.kv_heads, length, width)))
    return sigs


def _graphs(spec: ModelSpec, enc: ResolvedStack | None, dec: ResolvedStack | None, outputs) -> tuple[GraphSig, ...]:
    fdt = float_dtype(spec.serving.precision)
    i64 = "int64"
    types = spec.vocab.type_size > 0
    vocab = (dec or enc).vocab_size  # what the lm and mlm outputs score (ResolvedSpec.output_vocab_size)

    def source_inputs(seq: str) -> list[TensorSig]:
        sigs = [TensorSig(name=INPUT_IDS, dtype=i64, dims=(BATCH, seq)),
                TensorSig(name=ATTENTION_MASK, dtype=i64, dims=(BATCH, seq))]
        if types:
            sigs.append(TensorSig(name=TOKEN_TYPE_IDS, dtype=i64, dims=(BATCH, seq)))
        return sigs

    if spec.architecture == "encoder":
        return (GraphSig(name="model", inputs=tuple(source_inputs(SEQ)), outputs=tuple(_output_sigs(spec, outputs, vocab, SEQ, fdt))),)
    if spec.architecture == "decoder":
        ins = [TensorSig(name=INPUT_IDS, dtype=i64, dims=(BATCH, SEQ)),
               TensorSig(name=ATTENTION_MASK, dtype=i64, dims=(BATCH, TOTAL))]
        if spec.position.kind in ABSOLUTE_POSITIONS:
            ins.append(TensorSig(name=POSITION_IDS, dtype=i64, dims=(BATCH, SEQ)))
        if types:
            ins.append(TensorSig(name=TOKEN_TYPE_IDS, dtype=i64, dims=(BATCH, SEQ)))
        ins += _cache_sigs(PAST_PREFIX, dec, SELF, PAST, fdt)
        outs = _output_sigs(spec, outputs, vocab, SEQ, fdt) + _cache_sigs(PRESENT_PREFIX, dec, SELF, TOTAL, fdt)
        return (GraphSig(name="model", inputs=tuple(ins), outputs=tuple(outs)),)
    enc_outs = [TensorSig(name=LAST_HIDDEN_STATE, dtype=fdt, dims=(BATCH, ENC_SEQ, spec.d_model))]
    enc_outs += _cache_sigs(PRESENT_PREFIX, dec, CROSS, ENC_SEQ, fdt)
    dec_ins = [TensorSig(name=INPUT_IDS, dtype=i64, dims=(BATCH, SEQ)),
               TensorSig(name=ENCODER_ATTENTION_MASK, dtype=i64, dims=(BATCH, ENC_SEQ))]
    dec_ins += _cache_sigs(PAST_PREFIX, dec, OWN, PAST, fdt)
    dec_ins += _cache_sigs(PAST_PREFIX, dec, CROSS, ENC_SEQ, fdt)
    dec_outs = _output_sigs(spec, outputs, vocab, SEQ, fdt) + _cache_sigs(PRESENT_PREFIX, dec, OWN, TOTAL, fdt)
    return (
        GraphSig(name="encoder", inputs=tuple(source_inputs(ENC_SEQ)), outputs=tuple(enc_outs)),
        GraphSig(name="decoder", inputs=tuple(dec_ins), outputs=tuple(dec_outs)),
    )


# --- entry point ----------------------------------------------------------------------------


def resolve(spec: ModelSpec) -> ResolvedSpec:
    """The explicit, frozen form of a valid spec (see the module doc)."""
    if isinstance(spec, ResolvedSpec):
        return spec
    full = explicit(spec)
    built: dict[str, ResolvedStack] = {}
    for name in stacks(full):
        st = getattr(full, name)
        role = "causal" if name == "decoder" else "self"
        layers = tuple(
            ResolvedLayer(
                index=i,
                attention=_attention(st.attention, full, role, i, name, overridden(st, i)),
                cross_attention=(
                    _attention(st.cross_attention, full, "cross", i, name) if st.cross_attention is not None else None
                ),
                ffn=(overridden(st, i, "ffn") or st).ffn,
                parallel=st.parallel,
            )
            for i in range(st.layers)
        )
        vocab_size = full.vocab.size if name == "encoder" or full.architecture == "decoder" else (
            full.vocab.target_size or full.vocab.size
        )
        built[name] = ResolvedStack(role=name, layers=layers, final_norm=bool(full.norm.final), vocab_size=vocab_size)
    outputs = tuple(full.outputs)
    return ResolvedSpec(
        spec=full,
        source=spec.path,
        weights_path=spec.weights_path,
        tokenizer_path=spec.tokenizer_path,
        encoder=built.get("encoder"),
        decoder=built.get("decoder"),
        outputs=outputs,
        dropout=full.dropout,
        tie_output=full.vocab.tie_output,
        graphs=_graphs(full, built.get("encoder"), built.get("decoder"), outputs),
    )
