"""`specc import gguf`: a llama.cpp GGUF file as a spec plus safetensors weights.

Contract: `import_gguf(path, out_spec)` reads the file with the `gguf` package's reader (memory
mapped), turns its metadata into the Hugging Face config of the same model and its tensors into
Hugging Face's names and layouts, each dequantized to fp32 by gguf's own routines when it is
asked for (one tensor in memory at a time, never the model), and hands both to the Hugging Face
importer's writer (specc.importers.hf.importer.write_import): the same family tables, refusals and
all-or-nothing writing as `specc import hf`.

Architectures (`general.architecture`, ARCHITECTURES): the decoders llama (LLaMA, Mistral and
the models converted as llama), qwen2, qwen3, gemma, gemma2, gemma3 (its text model), phi3,
stablelm, gptneox, falcon, bloom, gpt2, olmo2; the encoder bert (BERT, and the DistilBERT,
RoBERTa and XLM-RoBERTa checkpoints the converter writes as bert: each is computed as the BERT
it is stored as); the encoder-decoder t5. Any other is refused naming `general.architecture`.
Every change llama.cpp's converter (convert_hf_to_gguf.py) makes to a tensor is undone here,
exactly, or needs no undoing:

- llama: the q and k rows (weights and biases) are permuted for llama.cpp's rotary layout
  (adjacent dims paired); they are permuted back to Hugging Face's (each head's halves);
- gemma, gemma2, gemma3: 1 is added to every RMSNorm weight (Hugging Face's norms compute with
  1 + weight); it is taken off again;
- gpt2: the Conv1D weights (stored [in, out]) are transposed; they are transposed back;
- bloom, gptneox, falcon: the fused q/k/v rows, which Hugging Face groups per head (per
  key-value group for Falcon: its query heads, its key head, its value head), are stored as all
  q rows, then all k, then all v; they are grouped back;
- bert: RoBERTa's position rows before its padding id + 1 are cut off (llama.cpp counts
  positions from 0, Hugging Face's RoBERTa from the padding id + 1): the table left is the
  table of a BERT that computes what the RoBERTa computes for every real token, and is imported
  as that BERT; the pooler and the MLM head are not written (the spec's outputs are the last
  hidden state and, where the file names a pooling type, the pooled embedding llama.cpp gives);
- t5: nothing changed; of the embedding tables (shared, and the encoder's and decoder's copies)
  one is written.

What the file does not say is what llama.cpp assumes, stated at each architecture below (Gemma 2
and 3's query scale, Gemma 3's layer pattern and local rotary base). Metadata specc cannot compute
is refused naming its GGUF key (rope scaling, per-layer values, OLMo 3's sliding windows); so are
tensors with no place in the model (llama 3's `rope_freqs`, Phi-3's long-context factors,
StableLM's per-head q/k norms, UMT5's relative-position table per layer, BERT's classifier
without its pooler). The tokenizer in the file's metadata is carried as import hf carries a
folder's (OUT.tokenizer/), converted to a tokenizer.json by
specc.importers.hf.tokenizer.gguf_tokenizer where transformers converts it (not bert's, gemma's,
gptneox's or olmo2's).
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from specc.importers.hf.checkpoint import CheckpointError
from specc.importers.hf.importer import check_outputs, write_import
from specc.importers.hf.tokenizer import gguf_tokenizer

_MISSING = object()


class _Meta:
    """One file's metadata and tensor names, read for its architecture ARCH; each refusal names
    the file and the GGUF key."""

    def __init__(self, reader, arch: str, where: str):
        self.reader, self.arch, self.where = reader, arch, where
        self.tensors = {t.name: t for t in reader.tensors}

    def raw(self, key: str, default: Any = None) -> Any:
        """The value of KEY (a full GGUF key) as Python, or DEFAULT when absent."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def number(self, key: str, default: Any = _MISSING) -> int | float:
        """`ARCH.KEY` as one number; DEFAULT when absent (refused when there is none)."""
        full = f"{self.arch}.{key}"
        value = self.raw(full, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise CheckpointError(f"{self.where}: no {full} in the file's metadata")
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"{self.where}: {full} is {str(value)[:40]}; specc reads one number here "
                                  "(a value per layer is not expressible)")
        return value

    def flag(self, key: str, default: bool) -> bool:
        full = f"{self.arch}.{key}"
        value = self.raw(full, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where}: {full} is {str(value)[:40]}; expected true or false")
        return value

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def refuse(self, key: str, why: str):
        raise CheckpointError(f"{self.where}: {key}: {why}")


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q or k (a weight or a bias) from llama.cpp's rotary layout (adjacent dims paired)
    back to Hugging Face's (each head's halves): per head, row j*d/2 + i of the result is row
    2i + j."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _regroup(w: np.ndarray, heads: int, kv: int) -> np.ndarray:
    """Fused q/k/v rows (a weight or a bias) from llama.cpp's order (every query head, then every
    key head, then every value head) back to Hugging Face's: per key-value group, its heads/kv
    query heads, its key head, its value head (Falcon; with kv = heads, q, k, v per head: BLOOM,
    GPT-NeoX)."""
    d = w.shape[0] // (heads + 2 * kv)
    rest = w.shape[1:]
    q = w[:heads * d].reshape(kv, heads // kv, d, *rest)
    k = w[heads * d:(heads + kv) * d].reshape(kv, 1, d, *rest)
    v = w[(heads + kv) * d:].reshape(kv, 1, d, *rest)
    return np.concatenate([q, k, v], axis=1).reshape(w.shape)


@dataclass(frozen=True)
class _Arch:
    """How one `general.architecture` maps to a Hugging Face model: the config from the metadata,
    GGUF tensor names to Hugging Face's (`blk.N.KIND` -> LAYER[KIND] under PREFIX with {i} = N,
    TOP for the rest; `enc.blk.N.KIND` and `dec.blk.N.KIND`, T5's stacks, as LAYER["enc.KIND"],
    LAYER["dec.KIND"]; {i} may stand in LAYER's names too; `variant(meta)` gives LAYER where it
    depends on the file), the converter's changes to undo (`fix(kind, part, array, config)`,
    `transposed`: kinds whose 2-D weights the converter transposed), `outputs(meta)`: spec
    outputs the file's metadata adds to the family head's, and whether the file's tokenizer is
    carried."""
    model_type: str
    head: str
    config: Callable[[_Meta], dict]
    layer: Mapping[str, str]
    top: Mapping[str, str]
    prefix: str = "model.layers.{i}."
    fix: Callable[[str, str, np.ndarray, dict], np.ndarray] | None = None
    transposed: frozenset[str] = field(default_factory=frozenset)
    variant: Callable[[_Meta], Mapping[str, str]] | None = None  # LAYER for this file, where it depends on it
    outputs: Callable[[_Meta], list[dict]] | None = None  # outputs after the family head's (a pooled embedding)
    # whether the file's tokenizer is carried: transformers (5.24) converts the tokenizers of the
    # architectures its GGUF loading reads, not bert's, gemma's, gptneox's or olmo2's
    tokenizer: bool = True


# --- metadata -> config, by architecture -------------------------------------------------------


def _refuse_rope_scaling(m: _Meta) -> None:
    scaling = m.raw(f"{m.arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        m.refuse(f"{m.arch}.rope.scaling.type", f"{scaling!r}: specc implements plain rotary positions only")


def _common(m: _Meta, model_type: str, head: str, *, rms: bool = True, context: int = 2048,
            ffn: bool = True) -> dict:
    """The fields most architectures share, under LLaMA's config names: sizes, heads, the norm's
    eps (RMSNorm's or LayerNorm's key), the context length (CONTEXT when absent), the feed-forward
    width (required where FFN), the vocabulary (token_embd's rows), tying (no output.weight:
    llama.cpp computes the logits with token_embd), the special token ids."""
    heads = int(m.number("attention.head_count"))
    if heads < 1:
        m.refuse(f"{m.arch}.attention.head_count", f"{heads}: a model has at least one head")
    cfg = {
        "model_type": model_type, "architectures": [head],
        "hidden_size": int(m.number("embedding_length")), "num_hidden_layers": int(m.number("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(m.number("attention.head_count_kv", heads)),
        "max_position_embeddings": int(m.number("context_length", context)),
        "vocab_size": int(m.tensors["token_embd.weight"].shape[1]),  # ggml's shape: [d_model, vocab]
        "tie_word_embeddings": not m.has("output.weight"),
    }
    if rms:
        cfg["rms_norm_eps"] = float(m.number("attention.layer_norm_rms_epsilon"))
    else:
        cfg["layer_norm_eps"] = float(m.number("attention.layer_norm_epsilon"))
    if ffn or m.raw(f"{m.arch}.feed_forward_length") is not None:
        cfg["intermediate_size"] = int(m.number("feed_forward_length"))
    # the file's ids, or none: a family's defaults (OLMo 2's eos 50279) describe Hugging Face's
    # checkpoints, not this file's vocabulary
    for ours, key in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = m.raw(f"tokenizer.ggml.{key}_token_id")
        cfg[ours] = None if value is None else int(value)
    cfg["pad_token_id"] = None
    return cfg


def _head_dim(m: _Meta, cfg: dict) -> int:
    """`attention.key_length` (written where a head is not d_model / heads), else d_model / heads."""
    d = m.raw(f"{m.arch}.attention.key_length")
    if d is not None:
        cfg["head_dim"] = int(m.number("attention.key_length"))
        return cfg["head_dim"]
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def _rotary_fraction(m: _Meta, head_dim: int, default: float = 1.0) -> float:
    """`rope.dimension_count` (the rotated dims of a head) over the head size."""
    dims = m.raw(f"{m.arch}.rope.dimension_count")
    return default if dims is None else int(m.number("rope.dimension_count")) / head_dim


def _llama(model_type: str, head: str) -> Callable[[_Meta], dict]:
    def config(m: _Meta) -> dict:
        """LLaMA and Qwen: SiLU-gated, RMSNorm, rotary at `rope.freq_base` (10000 when absent,
        as llama.cpp), partial where `rope.dimension_count` is less than a head; LLaMA's biases
        where the file has them."""
        cfg = _common(m, model_type, head)
        cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
        cfg["hidden_act"] = "silu"
        fraction = _rotary_fraction(m, _head_dim(m, cfg))
        if fraction != 1.0:
            cfg["partial_rotary_factor"] = fraction
        if model_type == "qwen2":
            cfg["use_sliding_window"] = False
        elif model_type == "llama":  # biases where the file has them (LLaMA's attention_bias, mlp_bias)
            cfg["attention_bias"] = m.has("blk.0.attn_q.bias")
            cfg["mlp_bias"] = m.has("blk.0.ffn_up.bias")
        return cfg
    return config


def _gemma(m: _Meta) -> dict:
    """Gemma: GeGLU (tanh), head size `attention.key_length`; the converter writes no rotary
    base, and llama.cpp's is 10000 (Gemma's)."""
    cfg = _common(m, "gemma", "GemmaForCausalLM", context=8192)
    _head_dim(m, cfg)
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "gelu_pytorch_tanh"
    return cfg


# llama.cpp takes the 27B Gemma 2 and Gemma 3 by their layer counts (46, 62) and scales their
# queries by (d_model / heads)^-1/2, every other size by head_size^-1/2 (query_pre_attn_scalar
# 144 and 168 against 256); the file has no key for it
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _gemma2(m: _Meta) -> dict:
    """Gemma 2: Gemma's, sandwich norms, a sliding window (`attention.sliding_window`, 4096 when
    absent) in every other layer, the scores and logits soft-capped (`attn_logit_softcapping`,
    `final_logit_softcapping`; llama.cpp's 50 and 30 when absent); Gemma 3: a window in five
    layers of six (llama.cpp's pattern; `attention.sliding_window_pattern` where the file has
    one), the global layers' rotary base `rope.freq_base`, the sliding ones' `rope.freq_base_swa`
    (llama.cpp's 10000 when absent), the logits capped only where the file says."""
    g3 = m.arch == "gemma3"
    cfg = _common(m, "gemma3_text" if g3 else "gemma2", "Gemma3ForCausalLM" if g3 else "Gemma2ForCausalLM",
                  context=131072 if g3 else 8192)
    head_dim = _head_dim(m, cfg)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]
                                    if cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[m.arch] else head_dim)
    if g3:
        cfg["sliding_window"] = int(m.number("attention.sliding_window"))
        cfg["rope_theta"] = float(m.number("rope.freq_base", 1000000.0))
        cfg["rope_local_base_freq"] = float(m.number("rope.freq_base_swa", 10000.0))
        cap = m.raw("gemma3.final_logit_softcapping")
        cfg["final_logit_softcapping"] = None if cap is None else float(m.number("final_logit_softcapping"))
        pattern = m.raw("gemma3.attention.sliding_window_pattern")
        if isinstance(pattern, list):  # one flag per layer, true where the layer slides
            if len(pattern) != cfg["num_hidden_layers"] or not all(isinstance(p, bool) for p in pattern):
                m.refuse("gemma3.attention.sliding_window_pattern", f"{str(pattern)[:60]}: expected one "
                         f"true/false per layer ({cfg['num_hidden_layers']})")
            cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
        elif pattern is not None:
            cfg["sliding_window_pattern"] = int(m.number("attention.sliding_window_pattern"))
    else:
        cfg["sliding_window"] = int(m.number("attention.sliding_window", 4096))
        cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
        cfg["attn_logit_softcapping"] = float(m.number("attn_logit_softcapping", 50.0))
        cfg["final_logit_softcapping"] = float(m.number("final_logit_softcapping", 30.0))
    return cfg


def _phi3(m: _Meta) -> dict:
    """Phi-3: LLaMA's with q/k/v and gate/up fused (kept fused by the converter), partial rotary
    from `rope.dimension_count`, a sliding window where `attention.sliding_window` is not 0.
    Its long-context rope (rope_factors_long / _short tensors) is refused with the tensors."""
    cfg = _common(m, "phi3", "Phi3ForCausalLM", context=4096)
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "silu"
    fraction = _rotary_fraction(m, _head_dim(m, cfg))
    if fraction != 1.0:
        cfg["partial_rotary_factor"] = fraction
    window = int(m.number("attention.sliding_window", 0))
    cfg["sliding_window"] = window or None
    return cfg


def _stablelm(m: _Meta) -> dict:
    """StableLM: LayerNorm, a quarter of each head rotated (`rope.dimension_count`), q/k/v biased
    where the file has their biases, attention and feed-forward side by side from one norm
    (`use_parallel_residual`, else: no ffn_norm). Per-head q/k LayerNorms are refused."""
    if m.has("blk.0.attn_q_norm.weight"):
        m.refuse("blk.0.attn_q_norm.weight", "a LayerNorm of its own for each head's queries and keys "
                 "(StableLM 2 12B's qk_layernorm) is not expressible")
    cfg = _common(m, "stablelm", "StableLmForCausalLM", rms=False, context=4096)
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "silu"
    cfg["partial_rotary_factor"] = _rotary_fraction(m, _head_dim(m, cfg), 0.25)
    cfg["use_qkv_bias"] = m.has("blk.0.attn_q.bias")
    cfg["use_parallel_residual"] = m.flag("use_parallel_residual", not m.has("blk.0.ffn_norm.weight"))
    return cfg


def _gptneox(m: _Meta) -> dict:
    """GPT-NeoX (Pythia): `use_parallel_residual` (true when absent), partial rotary, GELU (exact:
    the model's own; llama.cpp computes its tanh approximation)."""
    cfg = _common(m, "gpt_neox", "GPTNeoXForCausalLM", rms=False)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["rotary_pct"] = _rotary_fraction(m, head_dim, 0.25)
    cfg["rotary_emb_base"] = float(m.number("rope.freq_base", 10000.0))
    cfg["use_parallel_residual"] = m.flag("use_parallel_residual", True)
    cfg["attention_bias"] = m.has("blk.0.attn_qkv.bias")
    cfg["hidden_act"] = "gelu"
    return cfg


def _falcon(m: _Meta) -> dict:
    """Falcon: attention and feed-forward side by side (llama.cpp's only form), from two norms
    where the file has attn_norm_2 (the new decoder architecture: 40B, 180B), else from one;
    `attention.head_count_kv` key-value groups (1: 7B's multi-query); biases where the file has
    them; GELU (exact: the model's own; llama.cpp computes its tanh approximation)."""
    cfg = _common(m, "falcon", "FalconForCausalLM", rms=False, ffn=False)
    heads, kv = cfg["num_attention_heads"], cfg.pop("num_key_value_heads")
    if kv < 1 or heads % kv:
        m.refuse("falcon.attention.head_count_kv", f"{kv} does not divide the {heads} heads into groups")
    two = m.has("blk.0.attn_norm_2.weight")
    if two or kv not in (1, heads):
        cfg.update(new_decoder_architecture=True, num_kv_heads=kv, num_ln_in_parallel_attn=2 if two else 1)
    else:  # the older layout: multi-query, or one key-value head per query head
        cfg.update(new_decoder_architecture=False, multi_query=kv == 1, num_kv_heads=kv)
    cfg["layer_norm_epsilon"] = cfg.pop("layer_norm_eps")
    cfg["ffn_hidden_size"] = cfg.pop("intermediate_size", 4 * cfg["hidden_size"])
    cfg.update(parallel_attn=True, alibi=False, bias=m.has("blk.0.attn_qkv.bias"), activation="gelu",
               rope_theta=float(m.number("rope.freq_base", 10000.0)))
    return cfg


def _falcon_layer(m: _Meta) -> Mapping[str, str]:
    """llama.cpp names the new architecture's norms by what they feed in its graph: attn_norm is
    Hugging Face's ln_mlp (it normalises the feed-forward's input), attn_norm_2 is ln_attn."""
    if m.has("blk.0.attn_norm_2.weight"):
        return {**_FUSED, "attn_norm": "ln_mlp", "attn_norm_2": "ln_attn"}
    return _FUSED


def _bloom(m: _Meta) -> dict:
    """BLOOM: ALiBi, LayerNorm on the embeddings, every head its own keys and values."""
    cfg = _common(m, "bloom", "BloomForCausalLM", rms=False, ffn=False)
    if cfg["num_key_value_heads"] != cfg["num_attention_heads"]:
        m.refuse("bloom.attention.head_count_kv", f"{cfg['num_key_value_heads']}: BLOOM has a key and a value "
                 f"head per query head ({cfg['num_attention_heads']})")
    return {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": cfg["hidden_size"],
            "n_layer": cfg["num_hidden_layers"], "n_head": cfg["num_attention_heads"],
            "layer_norm_epsilon": cfg["layer_norm_eps"], "seq_length": cfg["max_position_embeddings"],
            **{k: cfg[k] for k in ("vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                                   "pad_token_id")}}


def _gpt2(m: _Meta) -> dict:
    """GPT-2: learned positions (`context_length` rows), GELU (tanh), `feed_forward_length`."""
    cfg = _common(m, "gpt2", "GPT2LMHeadModel", rms=False, context=1024, ffn=False)
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": cfg["hidden_size"],
            "n_layer": cfg["num_hidden_layers"], "n_head": cfg["num_attention_heads"],
            "n_positions": cfg["max_position_embeddings"], "n_ctx": cfg["max_position_embeddings"],
            "n_inner": cfg.get("intermediate_size"), "layer_norm_epsilon": cfg["layer_norm_eps"],
            "activation_function": "gelu_new",
            **{k: cfg[k] for k in ("vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                                   "pad_token_id")}}


def _olmo2(m: _Meta) -> dict:
    """OLMo 2: LLaMA's with each sublayer's output normalised and RMSNorm over all heads' q and k.
    OLMo 3 (the same architecture with sliding windows) is refused."""
    if m.raw("olmo2.attention.sliding_window") is not None:
        m.refuse("olmo2.attention.sliding_window", "sliding windows in some layers (OLMo 3) are not imported")
    cfg = _common(m, "olmo2", "Olmo2ForCausalLM")
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "silu"
    _head_dim(m, cfg)
    return cfg


# --- encoders and encoder-decoders --------------------------------------------------------------


def _same_tensor(m: _Meta, a: str, b: str) -> bool:
    """Whether tensors A and B hold the same bytes in the same type and shape."""
    ta, tb = m.tensors[a], m.tensors[b]
    return (ta.tensor_type == tb.tensor_type and list(ta.shape) == list(tb.shape)
            and np.array_equal(ta.data, tb.data))


def _rows(m: _Meta, tensor: str) -> int:
    """The rows of a 2-D table (ggml's shape is [columns, rows])."""
    return int(m.tensors[tensor].shape[1])


def _heads(m: _Meta) -> int:
    """`attention.head_count`, at least 1; `attention.head_count_kv`, where present, the same
    (these encoders have a key and a value head per query head)."""
    heads = int(m.number("attention.head_count"))
    if heads < 1:
        m.refuse(f"{m.arch}.attention.head_count", f"{heads}: a model has at least one head")
    kv = int(m.number("attention.head_count_kv", heads))
    if kv != heads:
        m.refuse(f"{m.arch}.attention.head_count_kv", f"{kv}: {m.arch} has a key and a value head per query head "
                 f"({heads})")
    return heads


def _token(m: _Meta, key: str) -> int | None:
    """`tokenizer.ggml.KEY`, a token id, or None where absent."""
    full = f"tokenizer.ggml.{key}"
    value = m.raw(full)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        m.refuse(full, f"{str(value)[:40]}: expected a token id")
    return value


def _bert(m: _Meta) -> dict:
    """BERT's body (post-norm LayerNorm, learned positions, token types where the file has
    token_types: DistilBERT has none), computed both ways (`attention.causal` true is refused),
    GELU (exact: BERT's, RoBERTa's and DistilBERT's; llama.cpp computes its tanh approximation).
    Positions: the table's rows (the converter's context_length; RoBERTa's less the rows it cut).
    A classifier (cls.weight, cls.output.weight: RoBERTa's dense + tanh + projection on the first
    token) is BertForSequenceClassification's pooler and classifier; BERT's own classifier, whose
    pooler the converter drops (cls.output.weight alone), is refused."""
    if m.flag("attention.causal", False):
        m.refuse("bert.attention.causal", "true: a BERT used as a causal decoder is not imported")
    cfg = {
        "model_type": "bert", "architectures": ["BertModel"], "hidden_size": int(m.number("embedding_length")),
        "num_hidden_layers": int(m.number("block_count")), "num_attention_heads": _heads(m),
        "intermediate_size": int(m.number("feed_forward_length")),
        "layer_norm_eps": float(m.number("attention.layer_norm_epsilon")), "hidden_act": "gelu",
        "vocab_size": _rows(m, "token_embd.weight"),
        "type_vocab_size": _rows(m, "token_types.weight") if m.has("token_types.weight") else 0,
        "max_position_embeddings": (_rows(m, "position_embd.weight") if m.has("position_embd.weight")
                                    else int(m.number("context_length"))),
        "pad_token_id": _token(m, "padding_token_id"),
    }
    if m.has("cls.output.weight"):
        if not m.has("cls.weight"):
            m.refuse("cls.output.weight", "BERT's classifier reads its pooler (dense + tanh), which llama.cpp's "
                     "converter does not write; import the Hugging Face checkpoint with specc import hf")
        cfg["architectures"] = ["BertForSequenceClassification"]
        cfg["num_labels"] = _rows(m, "cls.output.weight")
    return cfg


# llama.cpp's pooling types (gguf.PoolingType) specc pools with, as the pooled output's `pool`
_POOLING = {1: "mean", 2: "first", 3: "last"}


def _bert_outputs(m: _Meta) -> list[dict]:
    """The embedding llama.cpp gives for `bert.pooling_type` (the sentence-transformers pooling
    the converter read): mean, the first token's or the last's hidden state, unprojected. None
    (0, or no key): no pooled output. Rank (4): the classifier's logits (cls tensors required)."""
    kind = m.raw("bert.pooling_type")
    if kind in (None, 0):
        return []
    if kind == 4 and m.has("cls.output.weight"):
        return []
    if kind not in _POOLING:
        why = ("rank pooling without a classification head (cls.output.weight)" if kind == 4
               else "not one of llama.cpp's pooling types specc pools with (0 none, 1 mean, 2 cls, 3 last)")
        m.refuse("bert.pooling_type", f"{str(kind)[:40]}: {why}")
    return [{"kind": "pooled", "name": "sentence_embedding", "pool": _POOLING[kind]}]


# llama.cpp's T5 bucket distance (llama_relative_position_bucket's max_distance): no key in the file
_T5_MAX_DISTANCE = 128


def _t5(m: _Meta) -> dict:
    """T5 (T5ForConditionalGeneration): `block_count` encoder and `decoder_block_count` (else as
    many) decoder layers of `attention.head_count` heads of `attention.key_length` dims,
    `attention.relative_buckets_count` buckets (to a distance of 128: llama.cpp's, no key), RMSNorm
    at `attention.layer_norm_rms_epsilon`, decoding from `decoder_start_token_id`. The feed-forward
    is what llama.cpp computes: gated GELU (tanh) where the file has ffn_gate (T5 v1.1, FLAN-T5),
    else ReLU (the original T5). The head: output.weight where the file has one that is not the
    embedding table's bytes; else the table, tied, its input scaled by d_model^-1/2 as Hugging
    Face's tied T5 does (llama.cpp does not scale: its logits are sqrt(d_model) times these, the
    same tokens). A relative-position table in every layer (UMT5) is refused."""
    for name in m.tensors:
        hit = re.fullmatch(r"(enc|dec)\.blk\.(\d+)\.(attn_rel_b|cross_attn_rel_b)\.weight", name)
        if hit and (hit.group(2) != "0" or hit.group(3) == "cross_attn_rel_b"):
            m.refuse(name, "a relative-position table in more than the first layer's self-attention (UMT5) is not "
                     "expressible: specc's t5 has one table per stack")
    heads, d_model = _heads(m), int(m.number("embedding_length"))
    layers = int(m.number("block_count"))
    tied = not m.has("output.weight") or _same_tensor(m, "output.weight", "token_embd.weight")
    return {
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": d_model,
        "num_layers": layers, "num_decoder_layers": int(m.number("decoder_block_count", layers)), "num_heads": heads,
        "d_kv": int(m.number("attention.key_length", d_model // heads)), "d_ff": int(m.number("feed_forward_length")),
        "layer_norm_epsilon": float(m.number("attention.layer_norm_rms_epsilon")),
        "relative_attention_num_buckets": int(m.number("attention.relative_buckets_count")),
        "relative_attention_max_distance": _T5_MAX_DISTANCE,
        "feed_forward_proj": "gated-gelu" if m.has("enc.blk.0.ffn_gate.weight") else "relu",
        "n_positions": int(m.number("context_length", 512)), "vocab_size": _rows(m, "token_embd.weight"),
        "tie_word_embeddings": tied, "scale_decoder_outputs": tied,
        "decoder_start_token_id": int(m.number("decoder_start_token_id")),
        "pad_token_id": _token(m, "padding_token_id"), "eos_token_id": _token(m, "eos_token_id"),
    }


_BERT = {"attn_q": "attention.self.query", "attn_k": "attention.self.key", "attn_v": "attention.self.value",
         "attn_output": "attention.output.dense", "attn_output_norm": "attention.output.LayerNorm",
         "ffn_up": "intermediate.dense", "ffn_down": "output.dense", "layer_output_norm": "output.LayerNorm"}
_BERT_TOP = {"token_embd": "embeddings.word_embeddings", "token_types": "embeddings.token_type_embeddings",
             "position_embd": "embeddings.position_embeddings", "token_embd_norm": "embeddings.LayerNorm",
             "cls": "pooler.dense", "cls.output": "classifier"}


def _t5_layer(m: _Meta) -> Mapping[str, str]:
    """A T5 block's sublayers (block.{i}.layer.N): self-attention, the decoder's cross-attention,
    the feed-forward, whose up projection is wi_1 beside a gate wi_0, else wi."""
    up = "wi_1" if m.has("enc.blk.0.ffn_gate.weight") else "wi"
    table = {}
    for stack, hf, ffn in (("enc", "encoder", 1), ("dec", "decoder", 2)):
        block = f"{hf}.block.{{i}}.layer."
        table.update({f"{stack}.attn_norm": block + "0.layer_norm", f"{stack}.attn_rel_b":
                      block + "0.SelfAttention.relative_attention_bias",
                      **{f"{stack}.attn_{p}": f"{block}0.SelfAttention.{p}" for p in "qkvo"},
                      f"{stack}.ffn_norm": f"{block}{ffn}.layer_norm", f"{stack}.ffn_gate": f"{block}{ffn}.DenseReluDense.wi_0",
                      f"{stack}.ffn_up": f"{block}{ffn}.DenseReluDense.{up}",
                      f"{stack}.ffn_down": f"{block}{ffn}.DenseReluDense.wo"})
    table.update({"dec.cross_attn_norm": "decoder.block.{i}.layer.1.layer_norm",
                  **{f"dec.cross_attn_{p}": f"decoder.block.{{i}}.layer.1.EncDecAttention.{p}" for p in "qkvo"}})
    return table


# --- the converter's changes, undone -----------------------------------------------------------


def _fix_llama(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    if kind == "attn_q":
        return _unpermute(w, cfg["num_attention_heads"])
    if kind == "attn_k":
        return _unpermute(w, cfg["num_key_value_heads"])
    return w


def _fix_gemma(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    return w - np.float32(1.0) if kind.endswith("norm") and part == "weight" else w


def _fix_gpt2(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    return np.ascontiguousarray(w.T) if kind in _GPT2_CONV1D and part == "weight" else w


def _fix_fused(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    if kind != "attn_qkv":
        return w
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    return _regroup(w, heads, cfg.get("num_kv_heads") or heads)


_LLAMA = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_LLAMA_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Gemma 2 / 3 and OLMo 2 name their norms after where they sit
_SANDWICH = {**_LLAMA, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
             "post_ffw_norm": "post_feedforward_layernorm"}
_OLMO2 = {k: v for k, v in _SANDWICH.items() if k not in ("attn_norm", "ffn_norm")}
_PHI3 = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
         "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}
_GPT2_CONV1D = frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})
# BLOOM's and Falcon's (under transformer.) and GPT-NeoX's (under gpt_neox.) blocks
_FUSED = {"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
          "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm",
          "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}

ARCHITECTURES: dict[str, _Arch] = {
    "llama": _Arch("llama", "LlamaForCausalLM", _llama("llama", "LlamaForCausalLM"), _LLAMA, _LLAMA_TOP,
                   fix=_fix_llama),
    "qwen2": _Arch("qwen2", "Qwen2ForCausalLM", _llama("qwen2", "Qwen2ForCausalLM"), _LLAMA, _LLAMA_TOP),
    "qwen3": _Arch("qwen3", "Qwen3ForCausalLM", _llama("qwen3", "Qwen3ForCausalLM"), _LLAMA, _LLAMA_TOP),
    "gemma": _Arch("gemma", "GemmaForCausalLM", _gemma, _LLAMA, _LLAMA_TOP, fix=_fix_gemma, tokenizer=False),
    "gemma2": _Arch("gemma2", "Gemma2ForCausalLM", _gemma2, _SANDWICH, _LLAMA_TOP, fix=_fix_gemma),
    "gemma3": _Arch("gemma3_text", "Gemma3ForCausalLM", _gemma2, _SANDWICH, _LLAMA_TOP, fix=_fix_gemma),
    "phi3": _Arch("phi3", "Phi3ForCausalLM", _phi3, _PHI3, _LLAMA_TOP),
    "stablelm": _Arch("stablelm", "StableLmForCausalLM", _stablelm, _LLAMA, _LLAMA_TOP),
    "olmo2": _Arch("olmo2", "Olmo2ForCausalLM", _olmo2, _OLMO2, _LLAMA_TOP, tokenizer=False),
    "gptneox": _Arch("gpt_neox", "GPTNeoXForCausalLM", _gptneox,
                     {**_FUSED, "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense"},
                     {"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm",
                      "output": "embed_out"}, prefix="gpt_neox.layers.{i}.", fix=_fix_fused, tokenizer=False),
    "falcon": _Arch("falcon", "FalconForCausalLM", _falcon, _FUSED,
                    {"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f",
                     "output": "lm_head"}, prefix="transformer.h.{i}.", fix=_fix_fused, variant=_falcon_layer),
    "bloom": _Arch("bloom", "BloomForCausalLM", _bloom, _FUSED,
                   {"token_embd": "transformer.word_embeddings",
                    "token_embd_norm": "transformer.word_embeddings_layernorm",
                    "output_norm": "transformer.ln_f", "output": "lm_head"},
                   prefix="transformer.h.{i}.", fix=_fix_fused),
    "gpt2": _Arch("gpt2", "GPT2LMHeadModel", _gpt2,
                  {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj", "ffn_norm": "ln_2",
                   "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                  {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                   "output_norm": "transformer.ln_f", "output": "lm_head"},
                  prefix="transformer.h.{i}.", fix=_fix_gpt2, transposed=_GPT2_CONV1D),
    "bert": _Arch("bert", "BertModel", _bert, _BERT, _BERT_TOP, prefix="encoder.layer.{i}.", outputs=_bert_outputs,
                  tokenizer=False),
    "t5": _Arch("t5", "T5ForConditionalGeneration", _t5, {}, {
        "token_embd": "shared", "output": "lm_head", "enc.output_norm": "encoder.final_layer_norm",
        "dec.output_norm": "decoder.final_layer_norm"}, prefix="", variant=_t5_layer),
}

# architectures of families `import hf` reads whose GGUF form is not read
_NOT_READ = {"t5encoder": "a T5 encoder alone (T5EncoderModel); specc's t5 family imports T5ForConditionalGeneration"}
# tensors some converters write for rope scaling: refused by name rather than as "no place"
_ROPE_FACTORS = {"rope_freqs.weight": "llama 3's rope scaling (per-frequency factors)",
                 "rope_factors_long.weight": "Phi-3's long-context rope scaling (longrope)",
                 "rope_factors_short.weight": "Phi-3's long-context rope scaling (longrope)"}


def _config(reader, where: str) -> tuple[dict, _Arch, Mapping[str, str], list[dict]]:
    """The Hugging Face config of the file's model, its architecture's table, the layer names for
    this file, and the outputs its metadata adds."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        why = _NOT_READ.get(arch, "no specc family computes it")
        raise CheckpointError(f"{where}: general.architecture {arch!r} has no importer ({why}); specc import gguf "
                              "reads " + ", ".join(sorted(ARCHITECTURES)))
    m = _Meta(reader, arch, where)
    _refuse_rope_scaling(m)
    for name, what in _ROPE_FACTORS.items():
        if m.has(name):
            m.refuse(name, f"{what}: specc implements plain rotary positions only")
    if not m.has("token_embd.weight") or len(m.tensors["token_embd.weight"].shape) != 2:
        raise CheckpointError(f"{where}: no token_embd.weight tensor (a table of [d_model, vocab])")
    table = ARCHITECTURES[arch]
    return (table.config(m), table, table.variant(m) if table.variant else table.layer,
            table.outputs(m) if table.outputs else [])


# the config fields the families keep the context length in (GPT-2's and T5's n_positions,
# BLOOM's seq_length): the carried tokenizer's model_max_length
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "seq_length")


def _field(reader, key: str, default=None):
    """A metadata value as Python (a string, a number or a list), or DEFAULT when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


class GGUFTensors(Mapping):
    """A GGUF file's tensors under Hugging Face's names, each dequantized to fp32 (gguf's own
    routines) and the converter's change undone (its architecture's `fix`) when asked for."""

    def __init__(self, reader, config: dict, arch: _Arch, layer: Mapping[str, str], where: str):
        self._by_name: dict[str, tuple[object, str, str]] = {}  # HF name -> (tensor, kind, part)
        self._config, self._arch = config, arch
        for t in reader.tensors:
            hf, kind, part = _hf_name(arch, layer, t.name)
            if hf is None:
                raise CheckpointError(f"{where}: tensor {t.name} has no place in a {config['model_type']} model")
            self._by_name[hf] = (t, kind, part)

    def __getitem__(self, name: str):
        import torch
        from gguf import quants

        t, kind, part = self._by_name[name]
        data = quants.dequantize(t.data, t.tensor_type)  # a new array, or (F32) a view of the mapped file
        data = np.array(data, dtype=np.float32, copy=not data.flags.writeable or data.dtype != np.float32)
        data = data.reshape(tuple(int(d) for d in reversed(t.shape)))
        if self._arch.fix is not None:
            data = self._arch.fix(kind, part, data, self._config)
        return torch.from_numpy(np.ascontiguousarray(data))

    def meta(self, name: str):
        import torch

        t, kind, part = self._by_name[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        if kind in self._arch.transposed and part == "weight" and len(shape) == 2:
            shape = shape[::-1]
        return torch.empty(shape, dtype=torch.float32, device="meta")

    def __contains__(self, name) -> bool:  # Mapping's would dequantize the tensor to answer
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


def _hf_name(arch: _Arch, layer: Mapping[str, str], name: str) -> tuple[str | None, str, str]:
    """(Hugging Face name, GGUF kind, weight/bias) of a GGUF tensor name; None where it has no place."""
    m = re.fullmatch(r"((?:enc|dec)\.)?blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    kind = m and (m.group(1) or "") + m.group(3)
    if m and kind in layer:
        return f"{(arch.prefix + layer[kind]).format(i=m.group(2))}.{m.group(4)}", kind, m.group(4)
    m = re.fullmatch(r"(\w+(?:\.\w+)?)\.(weight|bias)", name)
    if m and m.group(1) in arch.top:
        return f"{arch.top[m.group(1)]}.{m.group(2)}", m.group(1), m.group(2)
    return None, "", ""


def import_gguf(path: str | os.PathLike, out_spec: str | os.PathLike, *, name: str | None = None,
                force: bool = False, max_length: int | None = None, tokenizer: bool = True) -> tuple[Path, Path]:
    """Write OUT.yaml and OUT.safetensors for the GGUF file PATH, and OUT.tokenizer/ from its
    tokenizer metadata (unless tokenizer=False); all or none. max_length: as import_hf's."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF needs the gguf package: pip install gguf (or specc[gguf])") from None
    path = Path(path)
    weights = check_outputs(out_spec, force)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a GGUF file gguf can read ({exc})") from None
    where = str(path)
    config, arch, layer, outputs = _config(reader, where)
    tensors = GGUFTensors(reader, config, arch, layer, where)
    stem = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._") or "imported"
    label = path.name.replace("{", "{{").replace("}", "}}")  # write_import formats the description
    context = next((config[k] for k in _CONTEXT_FIELDS if config.get(k) is not None), None)
    carry = (lambda vocab: gguf_tokenizer(path, reader, vocab, context)) if tokenizer and arch.tokenizer else None
    return write_import(config, tensors, where, Path(out_spec), weights, name or stem,
                        f"Imported from a GGUF file ({config['model_type']}, {label}) by specc import gguf",
                        max_length=max_length, tokenizer=carry, outputs=outputs)
