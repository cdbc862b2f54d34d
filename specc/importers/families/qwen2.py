"""Qwen2: LLaMA's layers with biased q, k, v projections (the output's without); LLaMA's inverse
and GGUF names (the row `qwen2`: nothing changed by the converter)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_extra, llama_inverse, rotary_config
from specc.importers.gguftable import Arch, Meta
from specc.importers.table import BOOL, LIST_OR_NULL, Registered, read


def _qwen2_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (head_dim, rope_theta, partial_rotary_factor, rope_type), without its sliding
    window: Qwen2 slides only where `use_sliding_window` is true, and then only in the layers from
    `max_window_layers` on (`layer_types` "sliding_attention"): layers that differ within a stack,
    refused."""
    slides = read(cfg, "use_sliding_window", BOOL, False)
    kinds = read(cfg, "layer_types", LIST_OR_NULL, None) or []
    if slides or any(k != "full_attention" for k in kinds):
        field_name = "use_sliding_window" if slides else "layer_types"
        raise ValueError(f"{field_name}: sliding-window attention in some layers and not others is not "
                         "expressible (every layer of a stack is configured alike)")
    llama_extra(spec, {k: v for k, v in cfg.items() if k != "sliding_window"})


QWEN2 = replace(
    LLAMA,
    model_types=("qwen2",),
    fields=tuple(f for f in LLAMA.fields if f.name not in ("attention_bias", "mlp_bias")),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"bias": True, "output_bias": False}, "ffn": {"bias": False}}},
    heads={"Qwen2ForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    extra=_qwen2_extra,
    sources={k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
)


def _qwen2_config(m: Meta) -> dict:
    """Qwen2: LLaMA's (rotary_config), attending to every earlier token in every layer."""
    cfg = rotary_config(m, "qwen2", "Qwen2ForCausalLM")
    cfg["use_sliding_window"] = False
    return cfg


REGISTERED = Registered(
    QWEN2,
    inverse={"qwen2": llama_inverse},
    gguf={"qwen2": Arch("qwen2", "Qwen2ForCausalLM", _qwen2_config, GGUF_LAYER, GGUF_TOP)},
)
