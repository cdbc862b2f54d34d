"""Qwen2-MoE: Qwen2's layers (biased q, k, v) whose feed-forward blocks are routed SwiGLU experts
under a softmax router (`norm_topk_prob`: the chosen weights renormalised) beside a shared expert
that every token passes through, weighed by its own sigmoid gate (transformers'
Qwen2MoeSparseMoeBlock); the layers in `mlp_only_layers`, and those off `decoder_sparse_step`, are
dense SwiGLU blocks of `intermediate_size`. Sliding windows in the layers `layer_types` names.
The GGUF row `qwen2moe` (the converter stacks the experts and squeezes the shared expert's gate to
a vector; every layer routed). Qwen3-MoE and OLMoE are built on this module's rules and GGUF names."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_extra, rotary_config, rotary_inverse
from specc.importers.families.qwen2 import QWEN2
from specc.importers.gguftable import Arch, Meta
from specc.importers.layers import dense_layers, layer_kinds, set_dense, set_windows, window_layers
from specc.importers.table import (BOOL, INT, INT_OR_NULL, LIST_OR_NULL, NUMBER, Field_, Registered, expert_rows, linear,
                                   overridden, read)


def dense_moe_layers(cfg: dict, layers: int, experts: int) -> list[int]:
    """The layers transformers' Qwen MoE decoders make dense: those in `mlp_only_layers`, and
    every layer i where (i + 1) is not a multiple of `decoder_sparse_step` (every layer where
    EXPERTS, num_experts, is 0)."""
    step = read(cfg, "decoder_sparse_step", INT, 1)
    if step < 1:
        raise ValueError(f"decoder_sparse_step {step}: must be at least 1")
    only = read(cfg, "mlp_only_layers", LIST_OR_NULL, None) or []
    if any(type(i) is not int for i in only):
        raise ValueError(f"mlp_only_layers: expected a list of layer indices, got {only[:4]}")
    return [i for i in range(layers) if i in only or experts == 0 or (i + 1) % step]


def set_dense_layers(spec: dict, cfg: dict, layers: int) -> None:
    """The dense layers (dense_moe_layers) as overrides of a dense feed-forward block of
    `intermediate_size`, the experts' activation, unbiased."""
    dense = dense_moe_layers(cfg, layers, spec["decoder"]["ffn"]["experts"])
    if dense:
        ffn = {"kind": "dense", "d_ff": read(cfg, "intermediate_size", INT),
               "activation": spec["decoder"]["ffn"]["activation"], "bias": False}
        set_dense(spec, dense, layers, ffn)


def _qwen2_moe_windows(spec: dict, cfg: dict, layers: int) -> None:
    """Sliding windows where `use_sliding_window` is true, in the layers `layer_types` names
    "sliding_attention" (transformers' default: the even layers below `max_window_layers`)."""
    slides = read(cfg, "use_sliding_window", BOOL, False)
    kinds = layer_kinds(cfg, layers, lambda: read(cfg, "layer_types", LIST_OR_NULL, None))
    if not kinds:
        below = read(cfg, "max_window_layers", INT, 28)
        kinds = ["sliding_attention" if (i + 1) % 2 and i < below and slides else "full_attention"
                 for i in range(layers)]
    if "sliding_attention" in kinds and not slides:
        raise ValueError("layer_types: sliding layers without use_sliding_window (transformers gives them a "
                         "window of 0)")
    set_windows(spec, kinds, read(cfg, "sliding_window", INT_OR_NULL, 4096) if slides else None,
                spec["position"]["max_length"])


def _qwen2_moe_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (head_dim, rope_theta and its scalings), windows where `use_sliding_window` is
    true: each layer `layer_types` names "sliding_attention" (else each even layer below
    `max_window_layers`) sees the token and the `sliding_window` - 1 before it, the others every
    earlier token (`overrides`). Dense layers: those in `mlp_only_layers`, and each layer i where
    i + 1 is not a multiple of `decoder_sparse_step`, are `overrides` with a dense SwiGLU of
    `intermediate_size`."""
    layers = read(cfg, "num_hidden_layers", INT)
    llama_extra(spec, {k: v for k, v in cfg.items() if k != "sliding_window"})
    _qwen2_moe_windows(spec, cfg, layers)
    set_dense_layers(spec, cfg, layers)


_L = "layers.{i}."
# the routed experts' rows, the router's and the stacked form (a GGUF file's) of Qwen MoE and OLMoE
MOE_NAMES = (
    *linear("decoder.layers.{i}.ffn.router", _L + "mlp.gate", "decoder", bias=False),
    *expert_rows("decoder.layers.{i}.ffn.experts",
                 {p: _L + f"mlp.experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")},
                 {p: _L + f"mlp.experts.{p}_proj.weight" for p in ("gate", "up", "down")}),
)
DENSE_SOURCES = {"decoder.overrides": "mlp_only_layers (or decoder_sparse_step)"}

QWEN2_MOE = replace(
    QWEN2,
    model_types=("qwen2_moe",),
    fields=overridden(tuple(f for f in QWEN2.fields if f.name != "intermediate_size"), (
        Field_("position.max_length", "max_position_embeddings", 32768, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-6, kind=NUMBER))) + (
        Field_("decoder.attention.bias", "qkv_bias", True, kind=BOOL),
        Field_("decoder.ffn.d_ff", "moe_intermediate_size", 1408, kind=INT),
        Field_("decoder.ffn.experts", "num_experts", 60, kind=INT),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", 4, kind=INT),
        Field_("decoder.ffn.router.normalize", "norm_topk_prob", False, kind=BOOL),
        Field_("decoder.ffn.shared.d_ff", "shared_expert_intermediate_size", 5632, kind=INT),
    ),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"output_bias": False}, "ffn": {
        "kind": "moe", "bias": False, "router": {"kind": "softmax"}, "shared": {"gate": True}}}},
    heads={"Qwen2MoeForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=QWEN2.names + MOE_NAMES + (
        *(n for p in ("gate", "up", "down")
          for n in linear(f"decoder.layers.{{i}}.ffn.shared.{p}", _L + f"mlp.shared_expert.{p}_proj", "decoder",
                          bias=False)),
        *linear("decoder.layers.{i}.ffn.shared_gate", _L + "mlp.shared_expert_gate", "decoder", bias=False),
    ),
    extra=_qwen2_moe_extra,
    sources={**QWEN2.sources, **DENSE_SOURCES, "decoder.attention.pattern.window": "sliding_window",
             "decoder.overrides.0.pattern": "layer_types"},
)


# --- config.json, backwards ---------------------------------------------------------------------


def dense_inverse(spec: dict, config: dict) -> None:
    """The dense layers as `mlp_only_layers` and their `intermediate_size` (decoder_sparse_step
    1); a dense block of another activation, or biased, is not one transformers' Qwen MoE makes."""
    dense, ffn = dense_layers(spec)
    config["decoder_sparse_step"] = 1
    config["mlp_only_layers"] = dense
    if ffn is not None:
        if ffn["bias"] or ffn["activation"] != spec["decoder"]["ffn"]["activation"]:
            raise ValueError("a dense layer of the experts' activation, unbiased")
        config["intermediate_size"] = ffn["d_ff"]


def _qwen2_moe_inverse(spec: dict, config: dict) -> None:
    """Qwen2-MoE: LLaMA's rotary rules, the windows as layer_types, the dense layers."""
    rotary_inverse(spec, config)
    kinds, window = window_layers(spec)
    config["use_sliding_window"] = "sliding_attention" in kinds
    config["layer_types"] = kinds
    config["sliding_window"] = window
    dense_inverse(spec, config)


# --- GGUF ---------------------------------------------------------------------------------------


def gguf_experts(m: Meta, cfg: dict, count: str, width: str) -> None:
    """The routed experts as llama.cpp's files say them: `expert_count` (the config's COUNT
    field), `expert_used_count`, `expert_feed_forward_length` (WIDTH: each expert's; where absent,
    feed_forward_length), every layer routed."""
    cfg[count] = int(m.number("expert_count"))
    cfg["num_experts_per_tok"] = int(m.number("expert_used_count"))
    cfg[width] = int(m.number("expert_feed_forward_length", m.number("feed_forward_length")))


def _qwen2moe_config(m: Meta) -> dict:
    """Qwen2-MoE: LLaMA's (rotary_config), q, k and v biased where the file has their biases,
    every layer routed (llama.cpp's qwen2moe builds none dense), the chosen weights as they are
    (llama.cpp does not renormalise them), the shared expert `expert_shared_feed_forward_length`
    wide under its sigmoid gate."""
    cfg = rotary_config(m, "qwen2_moe", "Qwen2MoeForCausalLM")
    gguf_experts(m, cfg, "num_experts", "moe_intermediate_size")
    cfg.update(shared_expert_intermediate_size=int(m.number("expert_shared_feed_forward_length")),
               norm_topk_prob=False, use_sliding_window=False, decoder_sparse_step=1, mlp_only_layers=[],
               qkv_bias=m.has("blk.0.attn_q.bias"))
    return cfg


def _fix_qwen2moe(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """The shared expert's gate, [1, D], squeezed to [D] by the converter: its row again."""
    return w.reshape(1, -1) if kind == "ffn_gate_inp_shexp" and w.ndim == 1 else w


def _qwen2moe_shape(kind: str, part: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    return (1, *shape) if kind == "ffn_gate_inp_shexp" and len(shape) == 1 else shape


# llama.cpp's routed experts (stacked, [E, ., .]) and router, under the names its converter gives
# the merged tensors
GGUF_MOE = {"ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
            "ffn_down_exps": "mlp.experts.down_proj"}
_GGUF_QWEN2MOE = {**GGUF_LAYER, **GGUF_MOE, "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                  **{f"ffn_{p}_shexp": f"mlp.shared_expert.{p}_proj" for p in ("gate", "up", "down")}}

REGISTERED = Registered(
    QWEN2_MOE,
    inverse={"qwen2_moe": _qwen2_moe_inverse},
    gguf={"qwen2moe": Arch("qwen2_moe", "Qwen2MoeForCausalLM", _qwen2moe_config, _GGUF_QWEN2MOE, GGUF_TOP,
                           fix=_fix_qwen2moe, shaped=_qwen2moe_shape)},
)
