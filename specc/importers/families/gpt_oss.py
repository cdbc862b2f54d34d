"""gpt-oss: a pre-norm decoder (RMSNorm) whose attention is grouped-query, biased, with a learned
sink logit per head joining each softmax, banded (`sliding_window`) and dense in the layers
`layer_types` names, its rotary positions extended by YaRN without truncation; each feed-forward
block routed experts of the clamped SwiGLU, biased, chosen by a softmax over the top
`num_experts_per_tok` biased router logits (OpenAI 2025, arXiv:2508.10925; transformers'
GptOssMLP). A checkpoint holds the experts stacked: gate_up_proj [E, D, 2F], gate and up in
alternate columns, and down_proj [E, F, D], as x @ W; the published checkpoints as MXFP4 blocks
and scales (`*_blocks`, `*_scales`: [E, out, in], gate and up in alternate rows), dequantized to
bfloat16 at import, exactly. The GGUF row `gpt-oss` (the converter
splits gate from up and transposes the experts to [E, out, in], often MXFP4 blocks, which gguf's
own routines dequantize)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_extra, rotary_inverse
from specc.importers.families.qwen2_moe import gguf_experts
from specc.importers.gguftable import Arch, Meta, common, head_size
from specc.importers.layers import layer_kinds, set_windows, window_layers
from specc.importers.table import (BOOL, INT, INT_OR_NULL, LIST_OR_NULL, NUMBER, OBJECT_OR_NULL, Field_, Name,
                                   Registered, linear, overridden, read)

THETA = 150000.0  # GptOssConfig's default_theta
# GptOssConfig's rope_parameters where a config names none
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 4096}


def _gpt_oss_extra(spec: dict, cfg: dict) -> None:
    """`decoder.attention.d_k` = `head_dim` (default 64); `position.base` = `rope_theta` (default
    150000) and `position.scaling` from `rope_parameters` as LLaMA's (where the config has neither
    rope_parameters nor rope_scaling, GptOssConfig's YaRN: factor 32 over 4096 positions, beta
    32 and 1, not truncated). Layers: each `layer_types` names "sliding_attention" (by default the
    even ones) sees the token and the `sliding_window` - 1 before it, the others every earlier
    token (`overrides`)."""
    layers = read(cfg, "num_hidden_layers", INT)
    plain = {k: v for k, v in cfg.items() if k != "sliding_window"}
    plain.setdefault("head_dim", 64)
    if not (read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or read(cfg, "rope_scaling", OBJECT_OR_NULL, None)):
        plain["rope_parameters"] = {**YARN, "rope_theta": read(cfg, "rope_theta", NUMBER, THETA)}
    llama_extra(spec, plain, THETA)
    kinds = layer_kinds(cfg, layers, lambda: read(cfg, "layer_types", LIST_OR_NULL, None)) or [
        "sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    set_windows(spec, kinds, read(cfg, "sliding_window", INT_OR_NULL, 128), spec["position"]["max_length"])


_E = "layers.{i}.mlp.experts."


def _mx(p: str) -> str:
    """The published checkpoints' MXFP4 experts: blocks [E, out, in / 32, 16], scales [E, out, in / 32]."""
    return f"{_E}{p}_blocks+{_E}{p}_scales"


GPT_OSS = replace(
    LLAMA,
    model_types=("gpt_oss",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name not in ("mlp_bias", "hidden_act")), (
        Field_("position.max_length", "max_position_embeddings", 131072, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-5, kind=NUMBER),
        Field_("decoder.attention.bias", "attention_bias", True, kind=BOOL))) + (
        Field_("decoder.ffn.experts", "num_local_experts", 128, kind=INT, aliases=("num_experts",)),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", 4, kind=INT),
        Field_("decoder.ffn.swiglu_alpha", "swiglu_alpha", 1.702, kind=NUMBER),
        Field_("decoder.ffn.swiglu_limit", "swiglu_limit", 7.0, kind=NUMBER),
    ),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"sinks": True}, "ffn": {
        "kind": "moe", "activation": "clamped_swiglu", "bias": True, "router": {"kind": "top_k_softmax", "bias": True}}}},
    heads={"GptOssForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=tuple(r for r in LLAMA.names if ".ffn." not in r.specc) + (
        Name("decoder.layers.{i}.attention.sinks", ("layers.{i}.self_attn.sinks", "layers.{i}.self_attn.sinks.weight"),
             "copy", "decoder"),
        *linear("decoder.layers.{i}.ffn.router", "layers.{i}.mlp.router", "decoder"),
        Name("decoder.layers.{i}.ffn.experts.gate", (_E + "gate_up_proj",), "alternate0_t", "decoder",
             alt=((_mx("gate_up_proj"), "mxfp4_rows0"), (_E + "gate_proj.weight", "copy"))),
        Name("decoder.layers.{i}.ffn.experts.up", (_E + "gate_up_proj",), "alternate1_t", "decoder",
             alt=((_mx("gate_up_proj"), "mxfp4_rows1"), (_E + "up_proj.weight", "copy"))),
        Name("decoder.layers.{i}.ffn.experts.down", (_E + "down_proj",), "transpose_last", "decoder",
             alt=((_mx("down_proj"), "mxfp4"), (_E + "down_proj.weight", "copy"))),
        Name("decoder.layers.{i}.ffn.experts.gate_bias", (_E + "gate_up_proj_bias",), "alternate0", "decoder",
             alt=((_E + "gate_proj.bias", "copy"),)),
        Name("decoder.layers.{i}.ffn.experts.up_bias", (_E + "gate_up_proj_bias",), "alternate1", "decoder",
             alt=((_E + "up_proj.bias", "copy"),)),
        Name("decoder.layers.{i}.ffn.experts.down_bias", (_E + "down_proj_bias",), "copy", "decoder",
             alt=((_E + "down_proj.bias", "copy"),)),
    ),
    extra=_gpt_oss_extra,
    sources={**LLAMA.sources, "decoder.overrides": "layer_types", "position.max_length": "max_position_embeddings"},
)


def _gpt_oss_inverse(spec: dict, config: dict) -> None:
    """gpt-oss: LLaMA's rotary rules, the windows as layer_types and sliding_window."""
    rotary_inverse(spec, config)
    kinds, window = window_layers(spec)
    config["layer_types"] = kinds
    config["sliding_window"] = window
    if "rope_scaling" not in config:  # GptOssConfig fills in its YaRN where none is named
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": config["rope_theta"]}


# --- GGUF ---------------------------------------------------------------------------------------


def _gpt_oss_config(m: Meta) -> dict:
    """gpt-oss: LLaMA's sizes, the head size `attention.key_length`, `attention.sliding_window`
    (128 when absent) in the even layers (llama.cpp's pattern, transformers' default), biased
    attention where the file has the biases, the experts `expert_feed_forward_length` wide, the
    clamped SwiGLU at llama.cpp's alpha 1.702 and limit 7 (the file has no key for them), rotary at
    `rope.freq_base` (150000 when absent) under YaRN (`rope.scaling.factor`,
    `rope.scaling.original_context_length`, `rope.scaling.yarn_beta_fast` / `_slow`, 32 and 1 when
    absent) not truncated, as the model's reference and transformers compute it (llama.cpp rounds
    the correction range)."""
    cfg = common(m, "gpt_oss", "GptOssForCausalLM", context=131072, ffn=False)
    head_size(m, cfg)
    gguf_experts(m, cfg, "num_local_experts", "intermediate_size")
    cfg.update(sliding_window=int(m.number("attention.sliding_window", 128)), attention_bias=m.has("blk.0.attn_q.bias"),
               swiglu_alpha=1.702, swiglu_limit=7.0)
    theta = float(m.number("rope.freq_base", THETA))
    if m.raw(f"{m.arch}.rope.scaling.type") == "yarn":
        cfg["rope_parameters"] = {
            "rope_type": "yarn", "rope_theta": theta, "factor": float(m.number("rope.scaling.factor")),
            "original_max_position_embeddings": int(m.number("rope.scaling.original_context_length")),
            "beta_fast": float(m.number("rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(m.number("rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}
    else:
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}
    return cfg


_GGUF_LAYER = {**{k: v for k, v in GGUF_LAYER.items() if k != "ffn_norm"}, "post_attention_norm": "post_attention_layernorm",
               "attn_sinks": "self_attn.sinks", "ffn_gate_inp": "mlp.router",
               **{f"ffn_{p}_exps": f"mlp.experts.{p}_proj" for p in ("gate", "up", "down")}}

REGISTERED = Registered(
    GPT_OSS,
    inverse={"gpt_oss": _gpt_oss_inverse},
    # tokenizer: transformers (5.24) fails reading a gpt-oss file's rope scaling metadata, and with it
    # the tokenizer's conversion
    gguf={"gpt-oss": Arch("gpt_oss", "GptOssForCausalLM", _gpt_oss_config, _GGUF_LAYER, GGUF_TOP, tokenizer=False,
                          rope_scalings=frozenset({"yarn"}))},
)
