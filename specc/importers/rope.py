"""Rotary positions in Hugging Face configs, both ways: the rope fields a family's `extra` reads
into the spec's `position` (base, fraction, scaling), and a spec's `position.scaling` written back
as transformers' `rope_scaling` (specc.importers.hf.as_config's inverse rules).

        rope_scaling / rope_parameters / rope_theta / partial_rotary_factor
            --read_rope, read_scaling--> position.base, position.fraction, position.scaling
        position.scaling --as_rope_scaling--> rope_scaling

The families that read these (LLaMA and the families built on it, Gemma 2 and 3, GPT-NeoX, Falcon)
call them from their own modules (specc.importers.families). Like the tables, this refuses by
raising ValueError (or KeyError for a missing field), reads no files and imports no torch.
"""
from __future__ import annotations

import math

from specc.importers.table import (BOOL, INT, LIST_OR_NULL, MISSING, NUMBER, NUMBER_OR_NULL, OBJECT_OR_NULL,
                                   STR_OR_NULL, read, set_key)

# rope types (`rope_scaling` / `rope_parameters` rope_type) specc computes, as the kinds of
# position.scaling; "dynamic" NTK scaling is refused (its frequencies follow each call's length)
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")
SCALING_SOURCE = "rope_scaling (or rope_parameters)"


def rope_kind(params: dict, label: str) -> str:
    """The rope type of one rope mapping (`rope_type`, older configs' `type`, else default)."""
    return (read(params, "rope_type", STR_OR_NULL, None, label=f"{label}.rope_type")
            or read(params, "type", STR_OR_NULL, None, label=f"{label}.type") or "default")


def _number(params: dict, key: str, label: str, default=MISSING):
    value = read(params, key, NUMBER_OR_NULL if default is not MISSING else NUMBER, default, label=f"{label}.{key}")
    return None if value is None else float(value)


def read_scaling(params: dict, label: str, cfg: dict, spec: dict, *, original_default: int | None = None,
                 renamed: dict | None = None, nested: bool = False) -> dict | None:
    """position.scaling for one rope mapping (`label`: its field, named in every refusal), None for
    rope_type default. As transformers reads it: `original_max_position_embeddings` from the
    config's top level where it has one (Phi-3's default 4096: `original_default`), else the
    mapping's, else `max_position_embeddings` (a mapping per layer kind, `nested`: the mapping's,
    else max_position_embeddings); yarn's factor (null: max_position_embeddings / original),
    beta_fast and beta_slow (null or 0: 32 and 1) and attention factor (null: from `mscale` /
    `mscale_all_dim` where both are given, else the spec's 0.1 ln(factor) + 1)."""
    kind = rope_kind(params, label)
    kind = (renamed or {}).get(kind, kind)
    if kind == "default":
        return None
    if kind == "dynamic":
        raise ValueError(f"{label}.rope_type 'dynamic': dynamic NTK scaling recomputes the frequencies from each "
                         "call's sequence length and keeps them for later calls, which a graph with a KV cache "
                         "does not reproduce")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{label}.rope_type {kind!r}: specc computes rope types default, "
                         + ", ".join(ROPE_SCALINGS))
    if kind == "linear":
        return {"kind": "linear", "factor": _number(params, "factor", label)}
    max_length = spec["position"]["max_length"]
    top = None if nested else read(cfg, "original_max_position_embeddings", INT, original_default)
    original = top if top is not None else read(params, "original_max_position_embeddings", INT, max_length,
                                                 label=f"{label}.original_max_position_embeddings")
    if kind == "llama3":
        return {"kind": "llama3", "factor": _number(params, "factor", label),
                "low_freq_factor": _number(params, "low_freq_factor", label),
                "high_freq_factor": _number(params, "high_freq_factor", label), "original_max_length": original}
    if kind == "yarn":
        factor = _number(params, "factor", label, None)
        if factor is None:
            factor = max_length / original
        out = {"kind": "yarn", "factor": factor, "original_max_length": original,
               "beta_fast": _number(params, "beta_fast", label, None) or 32.0,
               "beta_slow": _number(params, "beta_slow", label, None) or 1.0,
               "truncate": True if nested else read(params, "truncate", BOOL, True, label=f"{label}.truncate")}
        scale = _number(params, "attention_factor", label, None)
        mscale, mscale_all = _number(params, "mscale", label, None), _number(params, "mscale_all_dim", label, None)
        if scale is None and mscale and mscale_all:  # DeepSeek's form: a ratio of two of YaRN's factors
            def yarn_scale(m: float) -> float:
                return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale = yarn_scale(mscale) / yarn_scale(mscale_all)
        if scale is not None:
            out["attention_factor"] = scale
        return out
    lists = {}
    for key in ("short_factor", "long_factor"):
        values = read(params, key, LIST_OR_NULL, label=f"{label}.{key}")
        if values is None or any(type(v) not in (int, float) for v in values):
            raise ValueError(f"{label}.{key}: expected a list of numbers")
        lists[key] = [float(v) for v in values]
    out = {"kind": "longrope", **lists, "original_max_length": original}
    for key in ("factor", "attention_factor"):
        value = _number(params, key, label, None)
        if value is not None:
            out[key] = value
    return out


def read_rope(cfg: dict, spec: dict, theta_field: str, fraction_field: str, fraction_default: float,
              theta_default: float = 10000.0, **scaling) -> tuple[float, float, dict | None]:
    """(rope_theta, partial_rotary_factor, position.scaling) from `rope_scaling` (older configs)
    over `rope_parameters` (transformers 5 configs), or the family's own older fields (the base
    THETA_DEFAULT where a config names none: the family config's default_theta); `scaling`:
    read_scaling's options."""
    scaling_map = read(cfg, "rope_scaling", OBJECT_OR_NULL, None)
    field_name = "rope_scaling" if scaling_map else "rope_parameters"
    params = scaling_map or read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    scaled = read_scaling(params, field_name, cfg, spec, **scaling)
    params = {**(read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}), **params}
    theta = read(params, "rope_theta", NUMBER, None, label="rope_parameters.rope_theta")
    if theta is None:
        theta = read(cfg, theta_field, NUMBER, theta_default)
    fraction = read(params, "partial_rotary_factor", NUMBER, None, label="rope_parameters.partial_rotary_factor")
    if fraction is None:
        fraction = read(cfg, fraction_field, NUMBER, fraction_default)
    return float(theta), float(fraction), scaled


def set_rope(spec: dict, base: float, fraction: float | None, scaled: dict | None) -> None:
    """position.base, position.fraction (unless None) and position.scaling (unless None)."""
    set_key(spec, "position.base", base)
    if fraction is not None:
        set_key(spec, "position.fraction", fraction)
    if scaled is not None:
        set_key(spec, "position.scaling", scaled)


# --- backwards: a spec's position.scaling as transformers' rope_scaling -------------------------

# position.scaling's keys by the name transformers gives them in rope_scaling
_ROPE_KEYS = {"original_max_length": "original_max_position_embeddings"}


def as_rope_scaling(scaling: dict) -> dict:
    """transformers' rope_scaling for a spec's position.scaling (what read_scaling reads):
    rope_type = the kind, each parameter under its transformers name."""
    return {"rope_type": scaling["kind"],
            **{_ROPE_KEYS.get(k, k): v for k, v in scaling.items() if k != "kind" and v is not None}}
