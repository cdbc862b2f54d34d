"""Qwen3-MoE: Qwen3's layers (RMSNorm on each head's q and k, LLaMA's biases) whose feed-forward
blocks are routed SwiGLU experts under a softmax router (`norm_topk_prob`: the chosen weights
renormalised), no shared expert (Qwen Team 2025, arXiv:2505.09388; transformers'
Qwen3MoeSparseMoeBlock); dense layers as Qwen2-MoE's. The GGUF row `qwen3moe` is
specc.importers.families.qwen2_moe's neighbour here: every layer routed, the weights renormalised,
as llama.cpp computes it."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_extra, rotary_config, rotary_inverse
from specc.importers.families.qwen2_moe import (DENSE_SOURCES, GGUF_MOE, MOE_NAMES, dense_inverse, gguf_experts,
                                                set_dense_layers)
from specc.importers.gguftable import Arch, Meta
from specc.importers.families.qwen3 import QWEN3
from specc.importers.layers import window_layers
from specc.importers.table import BOOL, INT, NUMBER, Field_, Registered, overridden, read


def _qwen3_moe_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (head_dim, rope_theta and its scalings); where `use_sliding_window` is true,
    every layer sees the token and the `sliding_window` - 1 before it. Dense layers as
    Qwen2-MoE's (`mlp_only_layers`, `decoder_sparse_step`, of `intermediate_size`)."""
    slides = read(cfg, "use_sliding_window", BOOL, False)
    llama_extra(spec, {k: v for k, v in cfg.items() if k != "sliding_window" or slides})
    set_dense_layers(spec, cfg, read(cfg, "num_hidden_layers", INT))


QWEN3_MOE = replace(
    QWEN3,
    model_types=("qwen3_moe",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name not in ("intermediate_size", "mlp_bias")), (
        Field_("position.max_length", "max_position_embeddings", 32768, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-6, kind=NUMBER))) + (
        Field_("decoder.ffn.d_ff", "moe_intermediate_size", 768, kind=INT),
        Field_("decoder.ffn.experts", "num_experts", 128, kind=INT, aliases=("num_local_experts",)),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", 8, kind=INT),
        Field_("decoder.ffn.router.normalize", "norm_topk_prob", False, kind=BOOL),
    ),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"qk_norm": "head"}, "ffn": {
        "kind": "moe", "bias": False, "router": {"kind": "softmax"}}}},
    heads={"Qwen3MoeForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=QWEN3.names + MOE_NAMES,
    extra=_qwen3_moe_extra,
    sources={**LLAMA.sources, **DENSE_SOURCES},
)


def _qwen3_moe_inverse(spec: dict, config: dict) -> None:
    """Qwen3-MoE: LLaMA's rotary rules, a window in every layer or none, the dense layers."""
    rotary_inverse(spec, config)
    kinds, window = window_layers(spec)
    if len(set(kinds)) > 1:
        raise ValueError("a window in every layer, or none")
    config["use_sliding_window"] = window is not None
    config["sliding_window"] = window
    dense_inverse(spec, config)


def _qwen3moe_config(m: Meta) -> dict:
    """Qwen3-MoE: LLaMA's (rotary_config, the head size `attention.key_length`), every layer
    routed and the chosen weights renormalised (llama.cpp's qwen3moe always divides them by their
    sum)."""
    cfg = rotary_config(m, "qwen3_moe", "Qwen3MoeForCausalLM")
    gguf_experts(m, cfg, "num_experts", "moe_intermediate_size")
    cfg.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return cfg


REGISTERED = Registered(
    QWEN3_MOE,
    inverse={"qwen3_moe": _qwen3_moe_inverse},
    gguf={"qwen3moe": Arch("qwen3_moe", "Qwen3MoeForCausalLM", _qwen3moe_config, {**GGUF_LAYER, **GGUF_MOE}, GGUF_TOP)},
)
