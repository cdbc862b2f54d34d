"""Phi-3: LLaMA's layers with q, k, v fused in one projection and gate and up in another (split at
import), LongRoPE; the GGUF row `phi3` (the converter keeps both fused; its long-context factors,
rope_factors_long / _short, are refused with the rope scalings by specc.importers.gguf)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_TOP, LLAMA, llama_extra
from specc.importers.gguftable import Arch, Meta, common, head_size, rotary_fraction
from specc.importers.rope import rope_kind
from specc.importers.table import NUMBER, OBJECT_OR_NULL, Field_, Name, Registered, linear, norm, overridden, read


def _phi3_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's, with Phi-3's rope types: default or longrope (its older names su and yarn read
    as longrope, as transformers reads them; any other refused, as transformers' Phi-3 refuses it),
    its `original_max_position_embeddings` the config's top-level one (default 4096). A generation
    whose length passes it keeps the keys the short factors turned in its cache (transformers'
    Phi-3 recomputes its cache at that step)."""
    params = read(cfg, "rope_scaling", OBJECT_OR_NULL, None)
    label = "rope_scaling" if params else "rope_parameters"
    params = params or read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    kind = rope_kind(params, label)
    if kind not in ("default", "longrope", "su", "yarn"):
        raise ValueError(f"{label}.rope_type {kind!r}: Phi-3's rope types are default and longrope (su, yarn)")
    llama_extra(spec, cfg, original_default=4096, renamed={"su": "longrope", "yarn": "longrope"})


_PHI3 = "layers.{i}."
PHI3 = replace(
    LLAMA,
    model_types=("phi3",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name not in ("attention_bias", "mlp_bias")),
                       (Field_("norm.eps", "rms_norm_eps", 1e-5, kind=NUMBER),)),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"bias": False}, "ffn": {"bias": False}}},
    heads={"Phi3ForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embed_tokens.weight",)),
        *(Name(f"decoder.layers.{{i}}.attention.{p}.weight", (_PHI3 + "self_attn.qkv_proj.weight",), f"rows_{p}",
               "decoder") for p in "qkv"),
        *linear("decoder.layers.{i}.attention.o", _PHI3 + "self_attn.o_proj", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention_norm", _PHI3 + "input_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", _PHI3 + "post_attention_layernorm", "decoder", bias=False),
        Name("decoder.layers.{i}.ffn.gate.weight", (_PHI3 + "mlp.gate_up_proj.weight",), "halves0", "decoder"),
        Name("decoder.layers.{i}.ffn.up.weight", (_PHI3 + "mlp.gate_up_proj.weight",), "halves1", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", _PHI3 + "mlp.down_proj", "decoder", bias=False),
        *norm("decoder.final_norm", "norm", bias=False),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    extra=_phi3_extra,
)


# --- GGUF ---------------------------------------------------------------------------------------


def _phi3_config(m: Meta) -> dict:
    """Phi-3: LLaMA's with q/k/v and gate/up fused (kept fused by the converter), partial rotary
    from `rope.dimension_count`, a sliding window where `attention.sliding_window` is not 0.
    Its long-context rope (rope_factors_long / _short tensors) is refused with the tensors."""
    cfg = common(m, "phi3", "Phi3ForCausalLM", context=4096)
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "silu"
    fraction = rotary_fraction(m, head_size(m, cfg))
    if fraction != 1.0:
        cfg["partial_rotary_factor"] = fraction
    window = int(m.number("attention.sliding_window", 0))
    cfg["sliding_window"] = window or None
    return cfg


_GGUF_LAYER = {"attn_norm": "input_layernorm", "attn_qkv": "self_attn.qkv_proj", "attn_output": "self_attn.o_proj",
               "ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"}

REGISTERED = Registered(
    PHI3,
    gguf={"phi3": Arch("phi3", "Phi3ForCausalLM", _phi3_config, _GGUF_LAYER, GGUF_TOP)},
)
