"""Gemma 2: Gemma's layers under sandwich norms, sliding-window and global layers mixed, scores and
logits soft-capped; the GGUF row `gemma2` (the converter's change as Gemma's). Gemma 3 is built on
this module's rules and GGUF reading."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.gemma import GEMMA, GEMMA_GATED, fix_gemma
from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA
from specc.importers.gguftable import Arch, Meta, common, head_size
from specc.importers.rope import read_scaling, set_rope
from specc.importers.table import (INT, INT_OR_NULL, LIST_OR_NULL, NUMBER, NUMBER_OR_NULL, OBJECT_OR_NULL, STR, Field_,
                                   Registered, lookup, norm, overridden, read, set_key)


def _layer_kinds(cfg: dict, every: int) -> list[str]:
    """`layer_types` (each layer's "sliding_attention" or "full_attention"), else every `every`-th
    layer global (Gemma 2: every 2nd; Gemma 3: `sliding_window_pattern`, default 6)."""
    n = read(cfg, "num_hidden_layers", INT)
    kinds = read(cfg, "layer_types", LIST_OR_NULL, None)
    if kinds is None:
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    if len(kinds) != n or any(k not in ("sliding_attention", "full_attention") for k in kinds):
        raise ValueError(f"layer_types: expected {n} entries of 'sliding_attention' or 'full_attention', got "
                         f"{kinds[:4]}{'...' if len(kinds) > 4 else ''}")
    return kinds


def _gemma_rope(cfg: dict, spec: dict, gemma3: bool) -> dict[str, tuple[float, dict | None]]:
    """(rotary base, position.scaling) per layer kind: `rope_parameters` keyed by layer kind (Gemma 3
    in transformers 5), one `rope_parameters` / `rope_theta` for every layer (Gemma 2), or Gemma 3's
    older `rope_theta` and `rope_scaling` (its global layers) and `rope_local_base_freq` (its sliding
    ones); each scaling as LLaMA's."""
    params = read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    per_kind = {k: params[k] for k in ("full_attention", "sliding_attention") if isinstance(params.get(k), dict)}
    labels = {k: f"rope_parameters.{k}" for k in per_kind}
    nested = bool(per_kind)
    if not per_kind:
        scaling = read(cfg, "rope_scaling", OBJECT_OR_NULL, None) or {}
        glob = dict(scaling or params)  # as transformers reads it: rope_scaling in place of rope_parameters
        glob.setdefault("rope_theta", params.get("rope_theta", read(cfg, "rope_theta", NUMBER,
                                                                    1000000.0 if gemma3 else 10000.0)))
        local = {"rope_theta": read(cfg, "rope_local_base_freq", NUMBER, glob["rope_theta"])} if gemma3 else glob
        per_kind = {"full_attention": glob, "sliding_attention": local}
        label = "rope_scaling" if scaling else "rope_parameters"
        labels = {"full_attention": label, "sliding_attention": label if not gemma3 else "rope_local_base_freq"}
    out = {}
    for kind, p in per_kind.items():
        default = 1000000.0 if gemma3 and kind == "full_attention" else 10000.0
        theta = float(read(p, "rope_theta", NUMBER, default, label=f"{labels[kind]}.rope_theta"))
        out[kind] = theta, read_scaling(p, labels[kind], cfg, spec, nested=nested)
    return out


def gemma2_extra(spec: dict, cfg: dict, gemma3: bool = False) -> None:
    """`decoder.attention.d_k` = `head_dim`; `scale` = `query_pre_attn_scalar`^-1/2;
    `softcap` = `attn_logit_softcapping`. Layers: the sliding ones (`layer_types`, else every
    layer but each 2nd: Gemma 2, each 6th or `sliding_window_pattern`-th: Gemma 3) see the token
    and the `sliding_window` - 1 before it (`pattern: {kind: local}`); the global ones are
    `overrides` with a full pattern and their own rotary base and scaling where they differ
    (Gemma 3's `rope_theta` 1e6 against the sliding layers' 10000; its 4B and larger models scale
    the global layers' frequencies alone, linearly by 8), each scaling as LLaMA's."""
    heads = read(cfg, "num_attention_heads", INT)
    head_dim = read(cfg, "head_dim", INT_OR_NULL, None)
    if head_dim is not None and head_dim * heads != read(cfg, "hidden_size", INT):
        set_key(spec, "decoder.attention.d_k", head_dim)
    scalar = read(cfg, "query_pre_attn_scalar", NUMBER, 256)
    if scalar <= 0:
        raise ValueError(f"query_pre_attn_scalar {scalar}: must be positive")
    set_key(spec, "decoder.attention.scale", float(scalar) ** -0.5)
    # Gemma 3's attention keeps attn_logit_softcapping in its config and never applies it
    cap = None if gemma3 else read(cfg, "attn_logit_softcapping", NUMBER_OR_NULL, 50.0)
    if cap is not None:
        set_key(spec, "decoder.attention.softcap", float(cap))
    kinds = _layer_kinds(cfg, read(cfg, "sliding_window_pattern", INT, 6 if gemma3 else 2))
    ropes = _gemma_rope(cfg, spec, gemma3)
    window = read(cfg, "sliding_window", INT_OR_NULL, 4096)
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"] if window is not None else []
    if window is not None and window < 2:
        raise ValueError(f"sliding_window {window}: a window must hold more than the token itself")
    if not sliding:  # every layer global
        set_rope(spec, ropes["full_attention"][0], None, ropes["full_attention"][1])
        return
    set_key(spec, "decoder.attention.pattern", {"kind": "local", "window": window - 1})
    set_rope(spec, ropes["sliding_attention"][0], None, ropes["sliding_attention"][1])
    full = [i for i, k in enumerate(kinds) if k == "full_attention" or window is None]
    if full:
        override: dict = {"pattern": {"kind": "full"}}
        step = full[1] - full[0] if len(full) > 1 else len(kinds)
        if full == list(range(full[0], len(kinds), step)):
            override = {"every": step, "first": full[0], **override}
        else:
            override = {"indices": full, **override}
        (base, scaled), (local_base, local_scaled) = ropes["full_attention"], ropes["sliding_attention"]
        if base != local_base:
            override["rotary_base"] = base
        if scaled != local_scaled:
            override["rotary_scaling"] = scaled or {"kind": "none"}
        set_key(spec, "decoder.overrides", [override])


def softcapped_lm(cfg: dict, t: dict, default: float | None = 30.0) -> list:
    """The lm head, its logits capped by `final_logit_softcapping` (Gemma 2's default 30)."""
    cap = read(cfg, "final_logit_softcapping", NUMBER_OR_NULL, default)
    return [{"kind": "lm", "name": "logits", **({"softcap": float(cap)} if cap is not None else {})}]


_G2 = "layers.{i}."
GEMMA2 = replace(
    GEMMA,
    model_types=("gemma2",),
    fields=overridden(GEMMA.fields, (
        Field_("decoder.ffn.activation", "hidden_activation", "gelu_pytorch_tanh", lookup(GEMMA_GATED, "hidden_activation"),
               kind=STR),)),
    fixed={**GEMMA.fixed, "norm": {**GEMMA.fixed["norm"], "placement": "sandwich"}},
    heads={"Gemma2ForCausalLM": softcapped_lm},
    names=tuple(r for r in LLAMA.names if "norm" not in r.specc) + (
        *norm("decoder.layers.{i}.attention_norm", _G2 + "input_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention_post_norm", _G2 + "post_attention_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", _G2 + "pre_feedforward_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_post_norm", _G2 + "post_feedforward_layernorm", "decoder", bias=False),
        *norm("decoder.final_norm", "norm", bias=False),
    ),
    extra=gemma2_extra,
    sources={"decoder.attention.d_k": "head_dim", "decoder.attention.scale": "query_pre_attn_scalar",
             "decoder.attention.softcap": "attn_logit_softcapping", "position.base": "rope_parameters",
             "decoder.attention.pattern.window": "sliding_window", "decoder.overrides": "layer_types",
             "position.scaling": "rope_parameters (or rope_scaling)",
             "decoder.overrides.0.rotary_scaling": "rope_parameters.full_attention (or rope_scaling)"},
)


# --- GGUF ---------------------------------------------------------------------------------------


def gemma2_config(m: Meta, model_type: str, head: str, *, context: int, layers_27b: int) -> dict:
    """What Gemma 2 and 3 files share: Gemma's, GeGLU (tanh) under `hidden_activation`, and the
    query scale llama.cpp assumes (the file has no key for it): it takes the 27B model by its layer
    count (LAYERS_27B: Gemma 2's 46, Gemma 3's 62) and scales its queries by (d_model / heads)^-1/2,
    every other size's by head_size^-1/2 (query_pre_attn_scalar 144 and 168 against 256)."""
    cfg = common(m, model_type, head, context=context)
    size = head_size(m, cfg)
    cfg["hidden_activation"] = "gelu_pytorch_tanh"
    cfg["query_pre_attn_scalar"] = (cfg["hidden_size"] // cfg["num_attention_heads"]
                                    if cfg["num_hidden_layers"] == layers_27b else size)
    return cfg


def _gemma2_config(m: Meta) -> dict:
    """Gemma 2: Gemma's, sandwich norms, a sliding window (`attention.sliding_window`, 4096 when
    absent) in every other layer, the scores and logits soft-capped (`attn_logit_softcapping`,
    `final_logit_softcapping`; llama.cpp's 50 and 30 when absent)."""
    cfg = gemma2_config(m, "gemma2", "Gemma2ForCausalLM", context=8192, layers_27b=46)
    cfg["sliding_window"] = int(m.number("attention.sliding_window", 4096))
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["attn_logit_softcapping"] = float(m.number("attn_logit_softcapping", 50.0))
    cfg["final_logit_softcapping"] = float(m.number("final_logit_softcapping", 30.0))
    return cfg


# Gemma 2 and 3 name their norms after where they sit
GGUF_SANDWICH = {**GGUF_LAYER, "post_attention_norm": "post_attention_layernorm",
                 "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

REGISTERED = Registered(
    GEMMA2,
    gguf={"gemma2": Arch("gemma2", "Gemma2ForCausalLM", _gemma2_config, GGUF_SANDWICH, GGUF_TOP, fix=fix_gemma)},
)
