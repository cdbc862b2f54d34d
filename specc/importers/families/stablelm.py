"""StableLM: LLaMA's layers under LayerNorm, q, k, v biased or not, a quarter of each head rotated,
attention and feed-forward side by side from one norm or one after the other; its config.json
inverse, and the GGUF row `stablelm` (nothing changed by the converter; StableLM 2 12B's per-head
q/k LayerNorms refused)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_extra, llama_inverse
from specc.importers.gguftable import Arch, Meta, common, head_size, rotary_fraction
from specc.importers.table import (BOOL, INT, NUMBER, OBJECT_OR_NULL, Field_, Refuse, Registered, norm, overridden,
                                   read, set_key)


def _stablelm_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (rope_theta, partial_rotary_factor, rope_type); `use_parallel_residual` true:
    `decoder.parallel: one_norm` (input_layernorm feeds both)."""
    params = read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    if "partial_rotary_factor" not in cfg and "partial_rotary_factor" not in params:
        cfg = {**cfg, "partial_rotary_factor": 0.25}  # StableLM's default
    llama_extra(spec, {k: v for k, v in cfg.items() if k != "sliding_window"})
    if read(cfg, "use_parallel_residual", BOOL, False):
        set_key(spec, "decoder.parallel", "one_norm")


_SLM = "decoder.layers.{i}."
STABLELM = replace(
    LLAMA,
    model_types=("stablelm",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name != "mlp_bias"), (
        Field_("norm.eps", "layer_norm_eps", 1e-5, kind=NUMBER),
        Field_("decoder.attention.bias", "use_qkv_bias", False, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 4096, kind=INT))),
    fixed={**LLAMA.fixed, "norm": {"kind": "layernorm", "placement": "pre", "final": True},
           "decoder": {"attention": {"output_bias": False}, "ffn": {"bias": False}}},
    refuse=(
        Refuse("qk_layernorm", (False,), False, "a LayerNorm of its own for each head's queries and keys"),
    ),
    heads={"StableLmForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=tuple(r for r in LLAMA.names if "norm" not in r.specc) + (
        *norm(_SLM + "attention_norm", "layers.{i}.input_layernorm", "decoder"),
        *norm(_SLM + "ffn_norm", "layers.{i}.post_attention_layernorm", "decoder"),
        *norm("decoder.final_norm", "norm"),
    ),
    extra=_stablelm_extra,
    sources={**{k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
             "decoder.parallel": "use_parallel_residual"},
)


# --- config.json, backwards ---------------------------------------------------------------------


def _stablelm_inverse(spec: dict, config: dict) -> None:
    """StableLM: LLaMA's rules, its rotated fraction always written (absent, StableLM reads 0.25),
    and use_parallel_residual (one norm feeding attention and feed-forward side by side)."""
    llama_inverse(spec, config)
    config["partial_rotary_factor"] = spec["position"]["fraction"]
    config["use_parallel_residual"] = spec["decoder"].get("parallel") == "one_norm"


# --- GGUF ---------------------------------------------------------------------------------------


def _stablelm_config(m: Meta) -> dict:
    """StableLM: LayerNorm, a quarter of each head rotated (`rope.dimension_count`), q/k/v biased
    where the file has their biases, attention and feed-forward side by side from one norm
    (`use_parallel_residual`, else: no ffn_norm). Per-head q/k LayerNorms are refused."""
    if m.has("blk.0.attn_q_norm.weight"):
        m.refuse("blk.0.attn_q_norm.weight", "a LayerNorm of its own for each head's queries and keys "
                 "(StableLM 2 12B's qk_layernorm) is not expressible")
    cfg = common(m, "stablelm", "StableLmForCausalLM", rms=False, context=4096)
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "silu"
    cfg["partial_rotary_factor"] = rotary_fraction(m, head_size(m, cfg), 0.25)
    cfg["use_qkv_bias"] = m.has("blk.0.attn_q.bias")
    cfg["use_parallel_residual"] = m.flag("use_parallel_residual", not m.has("blk.0.ffn_norm.weight"))
    return cfg


REGISTERED = Registered(
    STABLELM,
    inverse={"stablelm": _stablelm_inverse},
    gguf={"stablelm": Arch("stablelm", "StableLmForCausalLM", _stablelm_config, GGUF_LAYER, GGUF_TOP)},
)
