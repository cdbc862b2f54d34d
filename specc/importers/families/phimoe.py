"""PhiMoE (Phi-3.5-MoE): LLaMA's layers under LayerNorm (biased), attention_bias on every
projection, each feed-forward block 16 routed SwiGLU experts chosen by the sparsemixer router
(Liu et al. 2024, arXiv:2409.12136; transformers' phimoe.sparsemixer, at inference), an lm head
biased with `lm_head_bias`. Its LongRoPE as transformers computes it: the short factors at every
length (PhimoeRotaryEmbedding recomputes the frequencies without the length), the cos and sin
scaled by `short_mscale`, which must equal `long_mscale`."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import LLAMA, llama_extra, llama_inverse
from specc.importers.families.mixtral import MIXTRAL
from specc.importers.rope import rope_kind
from specc.importers.table import (BOOL, INT, LIST_OR_NULL, NUMBER, NUMBER_OR_NULL, OBJECT_OR_NULL, Field_, Name,
                                   Registered, norm, overridden, read, set_key)

THETA = 1000000.0  # PhimoeConfig's default_theta


def _phimoe_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (rope_theta, default 1000000; a `sliding_window` W shorter than the context is a
    local pattern of W - 1). `rope_parameters` (or `rope_scaling`) of rope_type longrope: its
    `short_factor` for both of the spec's factor lists, `original_max_position_embeddings`, and
    `short_mscale` as the attention factor (refused unless it equals `long_mscale`, which
    transformers applies past the original length); any other rope_type but default refused."""
    params = read(cfg, "rope_scaling", OBJECT_OR_NULL, None)
    label = "rope_scaling" if params else "rope_parameters"
    params = params or read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    kind = rope_kind(params, label)
    if kind not in ("default", "longrope", "su"):
        raise ValueError(f"{label}.rope_type {kind!r}: PhiMoE's rope types are default and longrope")
    plain = {k: v for k, v in cfg.items() if k not in ("rope_scaling", "rope_parameters")}
    plain["rope_parameters"] = {k: v for k, v in params.items() if k == "rope_theta"}
    llama_extra(spec, plain, THETA)
    if kind == "default":
        return
    short = read(params, "short_factor", LIST_OR_NULL, label=f"{label}.short_factor")
    if short is None or any(type(v) not in (int, float) for v in short):
        raise ValueError(f"{label}.short_factor: expected a list of numbers")
    mscales = [read(params, k, NUMBER_OR_NULL, None, label=f"{label}.{k}") for k in ("short_mscale", "long_mscale")]
    if mscales[0] is None or mscales[0] != mscales[1]:
        raise ValueError(f"{label}.short_mscale {mscales[0]} and long_mscale {mscales[1]}: transformers' PhiMoE "
                         "switches the scale alone at the original length; specc computes one attention factor")
    original = read(params, "original_max_position_embeddings", INT, label=f"{label}.original_max_position_embeddings")
    factors = [float(v) for v in short]
    set_key(spec, "position.scaling", {"kind": "longrope", "short_factor": factors, "long_factor": factors,
                                       "original_max_length": original, "attention_factor": float(mscales[0])})


def _phimoe_lm(cfg: dict, t: dict) -> list:
    """The lm head, biased where `lm_head_bias` is true."""
    return [{"kind": "lm", "name": "logits", **({"bias": True} if read(cfg, "lm_head_bias", BOOL, False) else {})}]


_P = "layers.{i}."
PHIMOE = replace(
    MIXTRAL,
    model_types=("phimoe",),
    fields=overridden(tuple(f for f in MIXTRAL.fields if f.key != "decoder.ffn.experts"), (
        Field_("norm.eps", "rms_norm_eps", 1e-5, kind=NUMBER),)) + (
        Field_("decoder.attention.bias", "attention_bias", False, kind=BOOL),
        Field_("decoder.ffn.experts", "num_local_experts", 16, kind=INT, aliases=("num_experts",)),
        Field_("decoder.ffn.router.jitter_eps", "router_jitter_noise", 0.01, kind=NUMBER),
    ),
    fixed={**LLAMA.fixed, "norm": {"kind": "layernorm", "placement": "pre", "final": True},
           "decoder": {"ffn": {"kind": "moe", "bias": False, "router": {"kind": "sparsemixer"}}}},
    heads={"PhimoeForCausalLM": _phimoe_lm},
    names=tuple(r for r in MIXTRAL.names if "norm" not in r.specc) + (
        *norm("decoder.layers.{i}.attention_norm", _P + "input_layernorm", "decoder"),
        *norm("decoder.layers.{i}.ffn_norm", _P + "post_attention_layernorm", "decoder"),
        *norm("decoder.final_norm", "norm"),
        Name("heads.{head}.proj.bias", ("lm_head.bias",)),
        Name("heads.{head}.bias", ("lm_head.bias",)),
    ),
    extra=_phimoe_extra,
    sources={**LLAMA.sources, "decoder.ffn.router.jitter_eps": "router_jitter_noise"},
)


def _phimoe_inverse(spec: dict, config: dict) -> None:
    """PhiMoE: LLaMA's rules, its lm head's bias."""
    llama_inverse(spec, config)
    config["lm_head_bias"] = bool(spec["outputs"][0].get("bias"))


REGISTERED = Registered(PHIMOE, inverse={"phimoe": _phimoe_inverse})
