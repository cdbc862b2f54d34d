"""The rules that relate several fields of a spec (the language doc's "What validation must
reject"). Each rule is a function that yields ``(key_path, message)`` for every violation, so a
file with several problems reports them all. The table RULES lists them; tests cover each."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

from specc.spec.derive import (
    attention_rotary_dims,
    effective_outputs,
    head_dims,
    override_aspects,
    rotary_dims,
    stacks,
    tied_kinds,
)
from specc.spec.io import INPUT_NAMES
from specc.spec.manifest import MANIFEST, WEIGHTS_FILE
from specc.spec.schema import AttentionKind, FFNKind, ModelSpec
from specc.spec.targets import PRECISIONS

Path = tuple
Problem = tuple[Path, str]


def _attentions(spec: ModelSpec, overrides: bool = False) -> Iterator[tuple[Path, AttentionKind, str]]:
    """(path, attention spec, role) for every attention block; role: self | causal | cross. With
    `overrides`, also each override's pattern as its layers' attention, at the override's path
    (for the rules about patterns; the others would repeat the stack's own problems there)."""
    for name, role in (("encoder", "self"), ("decoder", "causal")):
        st = getattr(spec, name)
        if st is None:
            continue
        yield (name, "attention"), st.attention, role
        for n, ov in enumerate(st.overrides if overrides else ()):
            if ov.pattern is not None:
                yield (name, "overrides", n), st.attention.model_copy(update={"pattern": ov.pattern}), role
        if name == "decoder" and st.cross_attention is not None:
            yield ("decoder", "cross_attention"), st.cross_attention, "cross"


def stacks_match_architecture(spec: ModelSpec) -> Iterable[Problem]:
    need = stacks(spec)
    for stack in ("encoder", "decoder"):
        present = getattr(spec, stack) is not None
        if stack in need and not present:
            yield (stack,), f"architecture {spec.architecture!r} needs {'an' if stack == 'encoder' else 'a'} {stack} stack"
        elif stack not in need and present:
            yield (stack,), f"architecture {spec.architecture!r} has no {stack}; remove this stack"


def cross_attention_only_in_encoder_decoder(spec: ModelSpec) -> Iterable[Problem]:
    if spec.encoder is not None and spec.encoder.cross_attention is not None:
        yield ("encoder", "cross_attention"), "only the decoder of an encoder-decoder has cross-attention"
    if spec.architecture != "encoder-decoder" and spec.decoder is not None:
        if spec.decoder.cross_attention is not None:
            yield (
                ("decoder", "cross_attention"),
                f"cross-attention needs architecture 'encoder-decoder', not {spec.architecture!r}",
            )


def head_dimensions(spec: ModelSpec) -> Iterable[Problem]:
    d = spec.d_model
    for path, att, _ in _attentions(spec):
        if att.kind == "latent":  # latent_attention_fits
            continue
        if att.d_k is None and d % att.heads:
            yield path + ("heads",), (
                f"d_model {d} is not divisible by heads {att.heads}; set d_k (and d_v) or change heads"
            )
            continue
        d_k, d_v, kv = head_dims(att, d)
        if att.heads % kv:
            yield path + ("kv_heads",), f"heads {att.heads} is not divisible by kv_heads {kv}"
        if att.merge == "concat" and att.heads * d_v != d:
            yield path + ("merge",), (
                f"merge: concat needs heads * d_v == d_model, but {att.heads} * {d_v} = {att.heads * d_v} != {d}"
            )
        if att.merge == "mean" and d_v != d:
            yield path + ("merge",), f"merge: mean needs d_v == d_model, but d_v is {d_v} and d_model {d}"
        if att.share_kv and d_k != d_v:
            yield path + ("share_kv",), f"share_kv needs d_k == d_v (one matrix), but d_k {d_k} != d_v {d_v}"


def rotary_even(spec: ModelSpec) -> Iterable[Problem]:
    pos = spec.position
    if pos.kind != "rotary":
        return
    for path, att, role in _attentions(spec):
        if role == "cross" or att.kind == "latent" or (att.d_k is None and spec.d_model % att.heads):
            continue
        d_k = head_dims(att, spec.d_model)[0]
        rot = rotary_dims(d_k, pos.fraction)
        if rot == 0 or rot % 2:
            yield ("position", "fraction"), (
                f"rotary rotates floor(d_k * fraction) = floor({d_k} * {pos.fraction}) = {rot} dims of each "
                f"head of {'.'.join(path)}; that must be even and positive"
            )


def patterns_fit_roles(spec: ModelSpec) -> Iterable[Problem]:
    for path, att, role in _attentions(spec, overrides=True):
        kind = att.pattern.kind
        if role == "causal" and kind == "linformer":
            yield path + ("pattern", "kind"), (
                "linformer projects keys and values over the whole sequence, so a decoder cannot "
                "cache them token by token; use full, local or bigbird in a decoder"
            )
        if role == "cross" and kind in ("local", "bigbird"):
            yield path + ("pattern", "kind"), (
                f"{kind} relates positions of one sequence; cross-attention spans two sequences "
                "(use full or linformer)"
            )
        if kind == "linformer" and att.pattern.k > spec.position.max_length:
            yield path + ("pattern", "k"), (
                f"linformer k {att.pattern.k} exceeds position.max_length {spec.position.max_length}"
            )


def lengths_fit(spec: ModelSpec) -> Iterable[Problem]:
    longest = spec.serving.length.max
    if spec.position.kind == "learned" and spec.position.max_length < longest:
        yield ("position", "max_length"), (
            f"learned positions cover {spec.position.max_length} tokens, shorter than "
            f"serving.length.max {longest}"
        )
    for path, att, _ in _attentions(spec, overrides=True):
        if att.pattern.kind in ("linformer", "bigbird") and spec.position.max_length < longest:
            yield ("position", "max_length"), (
                f"{att.pattern.kind} attention in {'.'.join(path)} is sized for position.max_length "
                f"{spec.position.max_length}, shorter than serving.length.max {longest}"
            )
            break


def serving_ranges_ordered(spec: ModelSpec) -> Iterable[Problem]:
    for name in ("batch", "length"):
        r = getattr(spec.serving, name)
        if not (r.min <= r.opt <= r.max):
            yield ("serving", name), f"needs min <= opt <= max, got min {r.min}, opt {r.opt}, max {r.max}"


def generation_fits_the_batch(spec: ModelSpec) -> Iterable[Problem]:
    """The scheduler's batched step runs the graphs at no more rows than they are built for."""
    g = spec.serving.generation
    if g.max_sequences is not None and g.max_sequences > spec.serving.batch.max:
        yield ("serving", "generation", "max_sequences"), (
            f"{g.max_sequences} sequences decoded at once, more than serving.batch.max "
            f"{spec.serving.batch.max} (the most rows the graphs are built for)")


def activations_are_an_integer_builds(spec: ModelSpec) -> Iterable[Problem]:
    """serving.activations chooses an integer kernel's arithmetic: a float build has none."""
    if spec.serving.activations is not None and not PRECISIONS[spec.serving.precision].quantized:
        yield ("serving", "activations"), (
            f"{spec.serving.activations} activations are an integer build's (int8, int4, gguf); this spec builds "
            f"{spec.serving.precision} (set serving.precision, or build with --precision)")


def outputs_consistent(spec: ModelSpec) -> Iterable[Problem]:
    outs = effective_outputs(spec)
    if spec.outputs is not None and not outs:
        yield ("outputs",), "needs at least one output"
    seen: dict[str, int] = {}
    for i, out in enumerate(outs):
        if out.name in seen:
            yield ("outputs", i, "name"), f"output name {out.name!r} is already used by outputs[{seen[out.name]}]"
        elif out.name in INPUT_NAMES:  # a graph whose output is named like its input cannot be exported
            yield ("outputs", i, "name"), f"output name {out.name!r} is a graph input's name; choose another"
        seen.setdefault(out.name, i)
    if "tie_output" in spec.vocab.model_fields_set and spec.vocab.tie_output:
        if not any(o.kind in tied_kinds() for o in outs):
            yield ("vocab", "tie_output"), "tie_output: true needs an lm or mlm output to tie"


def vocab_consistent(spec: ModelSpec) -> Iterable[Problem]:
    v = spec.vocab
    if v.target_size is not None and spec.architecture != "encoder-decoder":
        yield ("vocab", "target_size"), "a separate target vocabulary needs architecture 'encoder-decoder'"
    if spec.architecture == "encoder-decoder" and v.share and v.target_size not in (None, v.size):
        yield ("vocab", "share"), (
            f"source ({v.size}) and target ({v.target_size}) vocabularies differ in size, so they "
            "cannot share one table; set share: false"
        )
    target = v.target_size or v.size
    for key in ("bos", "eos", "pad", "decoder_start"):
        tid = getattr(spec.tokens, key)
        if tid is not None and tid >= max(v.size, target):
            yield ("tokens", key), f"token id {tid} is outside the vocabulary (size {max(v.size, target)})"
    if spec.tokens.decoder_start is not None and spec.architecture != "encoder-decoder":
        yield ("tokens", "decoder_start"), "decoder_start is for encoder-decoder models"


def name_is_not_an_artifact(spec: ModelSpec) -> Iterable[Problem]:
    """A Triton repository (--target triton) holds a folder named after the spec beside the
    build's own files: the name may not be one of theirs."""
    if spec.name in (MANIFEST, WEIGHTS_FILE):
        yield ("name",), f"name {spec.name!r} is the name of a file every build writes; choose another"


RULES: tuple[Callable[[ModelSpec], Iterable[Problem]], ...] = (
    name_is_not_an_artifact,
    stacks_match_architecture,
    cross_attention_only_in_encoder_decoder,
    head_dimensions,
    rotary_even,
    patterns_fit_roles,
    lengths_fit,
    serving_ranges_ordered,
    generation_fits_the_batch,
    activations_are_an_integer_builds,
    outputs_consistent,
    vocab_consistent,
)


def check_rules(spec: ModelSpec) -> list[Problem]:
    return [problem for rule in RULES for problem in rule(spec)]


def linformer_positions(spec: ModelSpec) -> Iterable[Problem]:
    """Linformer projects the key axis, so relative distances between a query and a key do not
    exist after the projection: relative, ALiBi and bucketed positions cannot apply."""
    if spec.position.kind not in ("relative", "alibi", "bucketed"):
        return
    for path, att, role in _attentions(spec, overrides=True):
        if att.pattern.kind == "linformer" and role != "cross":
            yield path + ("pattern", "kind"), (
                f"linformer projects the key axis, so {spec.position.kind} positions (which need the "
                "distance between each query and key) cannot apply; use full, local or bigbird"
            )


def unit_offset_is_rmsnorms(spec: ModelSpec) -> Iterable[Problem]:
    """The 1 + weight gain is Gemma's RMSNorm; a LayerNorm's gain has no such form in any family."""
    if spec.norm.unit_offset and spec.norm.kind != "rmsnorm":
        yield ("norm", "unit_offset"), f"unit_offset (a gain of 1 + weight) is for rmsnorm, not {spec.norm.kind}"


def parallel_layers(spec: ModelSpec) -> Iterable[Problem]:
    """Attention and feed-forward side by side both read the layer's normalised input: pre-norm
    layers with no cross-attention (a third sublayer would have no defined place)."""
    for name in ("encoder", "decoder"):
        st = getattr(spec, name)
        if st is None or st.parallel == "none":
            continue
        if spec.norm.placement != "pre":
            yield (name, "parallel"), f"parallel layers are pre-norm; norm.placement is {spec.norm.placement}"
        if st.cross_attention is not None or (name == "decoder" and spec.architecture == "encoder-decoder"):
            yield (name, "parallel"), "parallel layers have no cross-attention (the decoder of an encoder-decoder has)"


def scale_is_scaled_dots(spec: ModelSpec) -> Iterable[Problem]:
    """`scale` replaces scaled_dot's 1/sqrt(d_k); the other scores have no such factor."""
    for path, att, _ in _attentions(spec):
        if att.scale is not None and getattr(att, "score", "scaled_dot") != "scaled_dot":
            yield path + ("scale",), f"scale is scaled_dot's factor on q.k; score is {att.score}"


def overrides_fit(spec: ModelSpec) -> Iterable[Problem]:
    """Each override chooses layers of its stack by `every` or by `indices` (not both), changes
    something, and no layer is chosen twice; `rotary_base` needs rotary positions. (Its pattern
    meets the pattern rules through _attentions, as the stack's `attention` does.)"""
    for name in ("encoder", "decoder"):
        st = getattr(spec, name)
        if st is None:
            continue
        chosen: dict[tuple[str, int], int] = {}  # (what it configures, layer) -> the override
        for n, ov in enumerate(st.overrides):
            path = (name, "overrides", n)
            if (ov.every is None) == (ov.indices is None):
                yield path, "an override chooses its layers by `every` or by `indices` (one of them)"
                continue
            aspects = override_aspects(ov)
            if not aspects:
                yield path, "an override sets `pattern`, `rotary_base`, `rotary_scaling` or `ffn` (it changes nothing)"
            layers = ov.indices if ov.indices is not None else range(ov.first, st.layers, ov.every)
            for i in layers:
                if i >= st.layers:
                    yield path + ("indices",), f"layer {i} is past the stack's {st.layers} layers (0..{st.layers - 1})"
                    continue
                again = next((chosen[(a, i)] for a in aspects if (a, i) in chosen), None)
                if again is not None:
                    yield path, f"layer {i} is also chosen by override {again}"
                for a in aspects:
                    chosen.setdefault((a, i), n)
            if ov.every is not None and ov.first >= st.layers:
                yield path + ("first",), f"first {ov.first} is past the stack's {st.layers} layers"
            for key in ("rotary_base", "rotary_scaling"):
                if getattr(ov, key) is not None and spec.position.kind != "rotary":
                    yield path + (key,), f"{key} needs rotary positions; position.kind is {spec.position.kind}"


def buckets_reach(spec: ModelSpec) -> Iterable[Problem]:
    """T5's buckets are exact below half of them (in a decoder), then log-spaced up to
    max_distance: which must lie beyond the exact ones (else the spacing divides by log 1)."""
    p = spec.position
    if p.kind == "bucketed" and p.max_distance <= p.buckets // 2:
        yield ("position", "max_distance"), (f"max_distance {p.max_distance} must exceed half the buckets "
                                             f"({p.buckets // 2}), where the log-spaced buckets begin")


RULES = RULES + (linformer_positions, unit_offset_is_rmsnorms, parallel_layers, scale_is_scaled_dots, overrides_fit,
                 buckets_reach)


def _scalings(spec: ModelSpec) -> Iterator[tuple[Path, object, list[int]]]:
    """(path, rotary scaling, the rotated dims of the layers it applies to) for position.scaling
    and each override's rotary_scaling (under rotary positions)."""
    if spec.position.kind != "rotary":
        return
    dims: dict[Path, list[int]] = {("position", "scaling"): []}
    for name in ("encoder", "decoder"):
        st = getattr(spec, name)
        if st is None or (st.attention.d_k is None and spec.d_model % st.attention.heads):
            continue  # head_dimensions reports it
        rot = attention_rotary_dims(st.attention, spec.d_model, spec.position.fraction)
        chosen = set()
        for n, ov in enumerate(st.overrides):
            if ov.rotary_scaling is not None:
                dims[(name, "overrides", n, "rotary_scaling")] = [rot]
                chosen |= set(ov.indices if ov.indices is not None else range(ov.first, st.layers, ov.every or 1))
        if set(range(st.layers)) - chosen:
            dims[("position", "scaling")].append(rot)
    yield ("position", "scaling"), spec.position.scaling, dims[("position", "scaling")]
    for name in ("encoder", "decoder"):
        st = getattr(spec, name)
        for n, ov in enumerate(st.overrides if st is not None else ()):
            if ov.rotary_scaling is not None:
                yield (name, "overrides", n, "rotary_scaling"), ov.rotary_scaling, dims.get(
                    (name, "overrides", n, "rotary_scaling"), [])


def rotary_scaling_fits(spec: ModelSpec) -> Iterable[Problem]:
    """A rotary scaling's fields make a frequency for every rotated pair: llama3's blend needs
    high_freq_factor above low_freq_factor (it divides by their difference), YaRN's ramp runs from
    beta_fast down to beta_slow turns, and LongRoPE's lists hold one factor per rotated pair
    (R / 2) of every layer they apply to."""
    for path, sc, rots in _scalings(spec):
        if sc.kind == "llama3" and sc.high_freq_factor <= sc.low_freq_factor:
            yield path + ("high_freq_factor",), (f"high_freq_factor {sc.high_freq_factor:g} must exceed "
                                                 f"low_freq_factor {sc.low_freq_factor:g} (the blend divides by "
                                                 "their difference)")
        if sc.kind == "yarn" and sc.beta_fast <= sc.beta_slow:
            yield path + ("beta_fast",), (f"beta_fast {sc.beta_fast:g} must exceed beta_slow {sc.beta_slow:g} "
                                          "(the ramp runs from the pairs that turn beta_fast times to those "
                                          "that turn beta_slow times)")
        if sc.kind == "longrope":
            for key in ("short_factor", "long_factor"):
                n = len(getattr(sc, key))
                for rot in sorted(set(rots)):
                    if n != rot // 2:
                        yield path + (key,), (f"{n} factors for {rot // 2} rotated pairs (rotary rotates {rot} "
                                              "dims of each head): one factor per pair")


def norm_bias_is_layernorms(spec: ModelSpec) -> Iterable[Problem]:
    """`bias: false` removes a LayerNorm's bias; an RMSNorm has none to remove."""
    if not spec.norm.bias and spec.norm.kind != "layernorm":
        yield ("norm", "bias"), f"bias: false removes a layernorm's bias; {spec.norm.kind} has none"


RULES = RULES + (rotary_scaling_fits, norm_bias_is_layernorms)


def _ffns(spec: ModelSpec) -> Iterator[tuple[Path, FFNKind]]:
    """(path, ffn) for every stack's `ffn` and every override's."""
    for name in ("encoder", "decoder"):
        st = getattr(spec, name)
        if st is None:
            continue
        yield (name, "ffn"), st.ffn
        for n, ov in enumerate(st.overrides):
            if ov.ffn is not None:
                yield (name, "overrides", n, "ffn"), ov.ffn


def experts_fit(spec: ModelSpec) -> Iterable[Problem]:
    """A routed-experts FFN chooses at most its experts; its groups split the experts evenly and
    leave top_k experts to choose from; clamped_swiglu has its alpha and limit and nothing else
    does; sparsemixer chooses two."""
    for path, f in _ffns(spec):
        if f.kind != "moe":
            continue
        if f.top_k > f.experts:
            yield path + ("top_k",), f"top_k {f.top_k} exceeds the {f.experts} experts"
        r = f.router
        if r.kind == "sparsemixer" and f.top_k != 2:
            yield path + ("top_k",), f"the sparsemixer router chooses 2 experts (PhiMoE's), not top_k {f.top_k}"
        if getattr(r, "groups", None) is not None or getattr(r, "top_groups", None) is not None:
            yield from _groups_fit(path + ("router",), f, r)
        clamped = f.activation == "clamped_swiglu"
        for key in ("swiglu_alpha", "swiglu_limit"):
            if clamped and getattr(f, key) is None:
                yield path + ("activation",), f"clamped_swiglu needs {key} (gpt-oss: alpha 1.702, limit 7.0)"
            elif not clamped and getattr(f, key) is not None:
                yield path + (key,), f"{key} is clamped_swiglu's; activation is {f.activation}"


def _groups_fit(path: Path, f, r) -> Iterable[Problem]:
    if (r.groups is None) != (r.top_groups is None):
        yield path + ("groups" if r.groups is None else "top_groups",), (
            "group-limited routing needs both `groups` and `top_groups`")
        return
    if f.experts % r.groups:
        yield path + ("groups",), f"{f.experts} experts do not split into {r.groups} equal groups"
        return
    per = f.experts // r.groups
    if r.top_groups > r.groups:
        yield path + ("top_groups",), f"top_groups {r.top_groups} exceeds the {r.groups} groups"
    elif f.top_k > r.top_groups * per:
        yield path + ("top_groups",), (f"the {r.top_groups} best groups hold {r.top_groups * per} experts, "
                                       f"fewer than top_k {f.top_k}")
    if r.group_score == "top2_sum" and per < 2:
        yield path + ("group_score",), f"top2_sum scores a group by its two best experts; a group holds {per}"


def latent_attention_fits(spec: ModelSpec) -> Iterable[Problem]:
    """Latent attention is a stack's self-attention (its cache holds the stack's own latents) under
    rotary positions, which rotate its `rope_dims` (even, at most d_k) and nothing chosen by
    `position.fraction`; its keys are not projected along the sequence (linformer)."""
    dec = spec.decoder
    if (spec.architecture == "encoder-decoder" and dec is not None and dec.attention.kind == "latent"
            and dec.cross_attention is None):
        yield ("decoder", "cross_attention"), ("cross-attention defaults to the decoder's attention, latent here, "
                                               "which is self-attention only; give cross_attention (multi_head)")
    for path, att, role in _attentions(spec, overrides=True):
        if att.kind != "latent":
            continue
        if role == "cross":
            yield path + ("kind",), ("latent attention is self-attention (its cache holds the stack's own "
                                     "latents); cross-attention is multi_head")
            continue
        if att.rope_dims > att.d_k or att.rope_dims % 2:
            yield path + ("rope_dims",), (f"rope_dims {att.rope_dims} must be even and at most d_k {att.d_k} "
                                          "(the rotated part of each query and key head)")
        if att.pattern.kind == "linformer":
            yield path + ("pattern", "kind"), "latent attention's keys come from a per-token latent; linformer is multi_head's"
        if len(path) > 2:
            continue  # an override's pattern: the position rules were said at the stack's path
        if spec.position.kind != "rotary":
            yield path + ("kind",), (f"latent attention rotates its rope_dims; position.kind is "
                                     f"{spec.position.kind}, not rotary")
        elif spec.position.fraction != 1.0:
            yield ("position", "fraction"), ("latent attention rotates its rope_dims, whatever the fraction; "
                                             "leave fraction at 1.0")


RULES = RULES + (experts_fit, latent_attention_fits)
