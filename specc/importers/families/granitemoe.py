"""GraniteMoE: LLaMA's layers (attention_bias on every projection) whose feed-forward blocks are
routed SwiGLU experts chosen by a softmax over the top `num_experts_per_tok` logits (transformers'
GraniteMoeMoE), the scores scaled by `attention_multiplier` in place of 1/sqrt(d_k) and the logits
divided by `logits_scaling`. A checkpoint stacks the experts (input_linear: gate and up, [E, 2F, D];
output_linear: down). Its embedding and residual multipliers have no spec key: refused unless 1."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import LLAMA, llama_extra, llama_inverse
from specc.importers.table import (INT, NUMBER, NUMBER_OR_NULL, TOKEN, Field_, Name, Refuse, Registered, linear,
                                   overridden, read, set_key)

_WHY = "specc's residual stream is unscaled: no spec key multiplies it"


def _granitemoe_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (rope_theta and its scalings); `decoder.attention.scale` = `attention_multiplier`
    (transformers' GraniteMoE scales the scores by it alone)."""
    llama_extra(spec, cfg)
    scale = read(cfg, "attention_multiplier", NUMBER_OR_NULL, 1.0)
    set_key(spec, "decoder.attention.scale", 1.0 if scale is None else float(scale))


def _granite_lm(cfg: dict, t: dict) -> list:
    """The lm head, its logits divided by `logits_scaling` (its input scaled by 1 / logits_scaling)."""
    scaling = read(cfg, "logits_scaling", NUMBER_OR_NULL, 1.0)
    scaling = 1.0 if scaling is None else float(scaling)
    if not scaling > 0:
        raise ValueError(f"logits_scaling {scaling}: must be positive")
    return [{"kind": "lm", "name": "logits", **({"scale": 1.0 / scaling} if scaling != 1.0 else {})}]


_G = "layers.{i}.block_sparse_moe."
GRANITEMOE = replace(
    LLAMA,
    model_types=("granitemoe",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name != "mlp_bias"), (
        Field_("norm.eps", "rms_norm_eps", 1e-6, kind=NUMBER),
        Field_("tokens.bos", "bos_token_id", 1, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 2, kind=TOKEN))) + (
        Field_("decoder.ffn.experts", "num_local_experts", 8, kind=INT),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", 2, kind=INT),
    ),
    fixed={**LLAMA.fixed, "decoder": {"ffn": {"kind": "moe", "bias": False, "router": {"kind": "top_k_softmax"}}}},
    refuse=(Refuse("embedding_multiplier", (1.0, 1), 1.0, "the token embeddings multiplied: " + _WHY),
            Refuse("residual_multiplier", (1.0, 1), 1.0, "each sublayer's output multiplied: " + _WHY)),
    heads={"GraniteMoeForCausalLM": _granite_lm},
    names=tuple(r for r in LLAMA.names if ".ffn." not in r.specc) + (
        *linear("decoder.layers.{i}.ffn.router", _G + "router.layer", "decoder", bias=False),
        Name("decoder.layers.{i}.ffn.experts.gate", (_G + "input_linear.weight",), "experts_halves0", "decoder"),
        Name("decoder.layers.{i}.ffn.experts.up", (_G + "input_linear.weight",), "experts_halves1", "decoder"),
        Name("decoder.layers.{i}.ffn.experts.down", (_G + "output_linear.weight",), "copy", "decoder"),
    ),
    extra=_granitemoe_extra,
    sources={**LLAMA.sources, "decoder.attention.scale": "attention_multiplier"},
)


def _granitemoe_inverse(spec: dict, config: dict) -> None:
    """GraniteMoE: LLaMA's rules, attention_multiplier the spec's score scale."""
    llama_inverse(spec, config)
    config["attention_multiplier"] = spec["decoder"]["attention"]["scale"]
    head = spec["outputs"][0]
    config["logits_scaling"] = 1.0 / head["scale"] if head.get("scale") else 1.0


REGISTERED = Registered(GRANITEMOE, inverse={"granitemoe": _granitemoe_inverse})
