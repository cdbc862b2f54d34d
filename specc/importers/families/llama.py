"""LLaMA and Mistral: their Hugging Face table (rotary positions and their scalings, grouped-query
attention, Mistral's sliding window), its config.json inverse, and the GGUF row `llama` (LLaMA,
Mistral and the models converted as llama: the converter permutes the q and k rows, weights and
biases, for llama.cpp's rotary layout, adjacent dims paired; they are permuted back to Hugging
Face's, each head's halves; Mixtral's files, the llama architecture with routed experts, too). Qwen2,
Qwen3, Gemma, OLMo 2, Phi-3, StableLM and the mixtures of experts are built on this module's
table, rules and GGUF names."""
from __future__ import annotations

import numpy as np

from specc.importers.gguftable import Arch, Meta, common, head_size, rotary_fraction
from specc.importers.rope import SCALING_SOURCE, as_rope_scaling, read_rope, set_rope
from specc.importers.table import (BOOL, INT, INT_OR_NULL, NUMBER, STR, TOKEN, Family, Field_, Name, Registered, linear,
                                   lookup, norm, read, set_key)

# LLaMA's MLP is act(gate(x)) * up(x): the gated forms
GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_python": "geglu"}


def llama_extra(spec: dict, cfg: dict, theta: float = 10000.0, **scaling) -> None:
    """`decoder.attention.d_k` = `head_dim` where it is not hidden_size / heads; `position.base` =
    `rope_theta` (or `rope_parameters.rope_theta`); `position.fraction` = `partial_rotary_factor`;
    `position.scaling` from `rope_scaling` / `rope_parameters` (rope_type linear: factor; llama3:
    factor, low_freq_factor, high_freq_factor; yarn: factor, beta_fast, beta_slow, attention_factor
    or mscale / mscale_all_dim, truncate; longrope: short_factor, long_factor, factor,
    attention_factor; each with `original_max_position_embeddings`, the config's top-level one first,
    else max_position_embeddings); rope_type dynamic, whose frequencies follow each call's length,
    is refused. Mistral: a
    `sliding_window` W shorter than `max_position_embeddings` (a token sees itself and the W - 1
    before it) is `decoder.attention.pattern: {kind: local, window: W - 1}`; null, or as long as the
    context, is full attention."""
    heads = read(cfg, "num_attention_heads", INT)
    window = read(cfg, "sliding_window", INT_OR_NULL, None)
    if window is not None and window < read(cfg, "max_position_embeddings", INT, 2048):
        if window < 2:
            raise ValueError(f"sliding_window {window}: a window must hold more than the token itself")
        set_key(spec, "decoder.attention.pattern", {"kind": "local", "window": window - 1})
    head_dim = read(cfg, "head_dim", INT_OR_NULL, None)
    if head_dim is not None and head_dim * heads != read(cfg, "hidden_size", INT):
        set_key(spec, "decoder.attention.d_k", head_dim)
    set_rope(spec, *read_rope(cfg, spec, "rope_theta", "partial_rotary_factor", 1.0, theta, **scaling))


LLAMA = Family(
    model_types=("llama", "mistral"),
    architecture="decoder",
    fields=(
        Field_("d_model", "hidden_size", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", False, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 2048, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-6, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("decoder.layers", "num_hidden_layers", kind=INT),
        Field_("decoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("decoder.attention.kv_heads", "num_key_value_heads", None, kind=INT_OR_NULL),
        Field_("decoder.attention.bias", "attention_bias", False, kind=BOOL),
        Field_("decoder.ffn.d_ff", "intermediate_size", kind=INT),
        Field_("decoder.ffn.activation", "hidden_act", "silu", lookup(GATED, "hidden_act"), kind=STR),
        Field_("decoder.ffn.bias", "mlp_bias", False, kind=BOOL),
        Field_("tokens.bos", "bos_token_id", None, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", None, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "rotary"}, "dropout": {"hidden": 0.0},
           "norm": {"kind": "rmsnorm", "placement": "pre", "final": True}},
    refuse=(),
    heads={"LlamaForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}],
           "MistralForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embed_tokens.weight",)),
        *linear("decoder.layers.{i}.attention.q", "layers.{i}.self_attn.q_proj", "decoder"),
        *linear("decoder.layers.{i}.attention.k", "layers.{i}.self_attn.k_proj", "decoder"),
        *linear("decoder.layers.{i}.attention.v", "layers.{i}.self_attn.v_proj", "decoder"),
        *linear("decoder.layers.{i}.attention.o", "layers.{i}.self_attn.o_proj", "decoder"),
        *norm("decoder.layers.{i}.attention_norm", "layers.{i}.input_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", "layers.{i}.post_attention_layernorm", "decoder", bias=False),
        *linear("decoder.layers.{i}.ffn.gate", "layers.{i}.mlp.gate_proj", "decoder"),
        *linear("decoder.layers.{i}.ffn.up", "layers.{i}.mlp.up_proj", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", "layers.{i}.mlp.down_proj", "decoder"),
        *norm("decoder.final_norm", "norm", bias=False),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("model.", ""),
    ignore=(r"rotary_emb\.inv_freq$",),
    extra=llama_extra,
    sources={"decoder.attention.d_k": "head_dim", "position.base": "rope_theta (or rope_parameters.rope_theta)",
             "position.fraction": "partial_rotary_factor (or rope_parameters.partial_rotary_factor)",
             "decoder.attention.pattern.window": "sliding_window", "position.scaling": SCALING_SOURCE},
)


# --- config.json, backwards ---------------------------------------------------------------------


def rotary_inverse(spec: dict, config: dict) -> None:
    """LLaMA and the families that read its rules: head_dim, rope_theta, partial_rotary_factor
    (where not 1), rope_scaling (where the spec scales its frequencies)."""
    attention = spec["decoder"]["attention"]
    config["head_dim"] = attention["d_k"]
    position = spec["position"]
    if position.get("kind") == "rotary":
        config["rope_theta"] = position["base"]
        if position["fraction"] != 1.0:
            config["partial_rotary_factor"] = position["fraction"]
        scaling = position.get("scaling") or {}
        if scaling.get("kind", "none") != "none":
            config["rope_scaling"] = as_rope_scaling(scaling)


def mistral_inverse(spec: dict, config: dict) -> None:
    """Mistral: LLaMA's rules and its sliding_window (a window W is a local pattern of W - 1)."""
    rotary_inverse(spec, config)
    pattern = spec["decoder"]["attention"]["pattern"]
    config["sliding_window"] = pattern["window"] + 1 if pattern.get("kind") == "local" else None


def llama_inverse(spec: dict, config: dict) -> None:
    """LLaMA: as Mistral without a window (transformers' LlamaConfig has none: a local pattern is
    Mistral's)."""
    if spec["decoder"]["attention"]["pattern"].get("kind") != "full":
        raise ValueError("a LLaMA config attends to every earlier token")
    rotary_inverse(spec, config)


# --- GGUF ---------------------------------------------------------------------------------------


def rotary_config(m: Meta, model_type: str, head: str) -> dict:
    """LLaMA, Qwen 2 and 3: SiLU-gated, RMSNorm, rotary at `rope.freq_base` (10000 when absent, as
    llama.cpp), partial where `rope.dimension_count` is less than a head."""
    cfg = common(m, model_type, head)
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "silu"
    fraction = rotary_fraction(m, head_size(m, cfg))
    if fraction != 1.0:
        cfg["partial_rotary_factor"] = fraction
    return cfg


def _llama_config(m: Meta) -> dict:
    """LLaMA: rotary_config's, with LLaMA's biases (attention_bias, mlp_bias) where the file has
    them. Mixtral (a file with `expert_count`, its experts stacked): rotary_config's, each expert
    `feed_forward_length` wide, `expert_used_count` of them a token, their weights renormalised
    (as llama.cpp computes them)."""
    if m.raw(f"{m.arch}.expert_count") is not None:
        cfg = rotary_config(m, "mixtral", "MixtralForCausalLM")
        cfg.update(num_local_experts=int(m.number("expert_count")), num_experts_per_tok=int(m.number("expert_used_count")))
        return cfg
    cfg = rotary_config(m, "llama", "LlamaForCausalLM")
    cfg["attention_bias"] = m.has("blk.0.attn_q.bias")
    cfg["mlp_bias"] = m.has("blk.0.ffn_up.bias")
    return cfg


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q or k (a weight or a bias) from llama.cpp's rotary layout (adjacent dims paired)
    back to Hugging Face's (each head's halves): per head, row j*d/2 + i of the result is row
    2i + j."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _fix_llama(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    if kind == "attn_q":
        return _unpermute(w, cfg["num_attention_heads"])
    if kind == "attn_k":
        return _unpermute(w, cfg["num_key_value_heads"])
    return w


GGUF_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# Mixtral's router and stacked experts, in a llama file
_GGUF_MIXTRAL = {"ffn_gate_inp": "block_sparse_moe.gate", "ffn_gate_exps": "block_sparse_moe.experts.w1",
                 "ffn_up_exps": "block_sparse_moe.experts.w3", "ffn_down_exps": "block_sparse_moe.experts.w2"}

REGISTERED = Registered(
    LLAMA,
    inverse={"llama": llama_inverse, "mistral": mistral_inverse},
    gguf={"llama": Arch("llama", "LlamaForCausalLM", _llama_config, {**GGUF_LAYER, **_GGUF_MIXTRAL}, GGUF_TOP,
                        fix=_fix_llama)},
)
