"""Layers that differ within a stack, both ways: a Hugging Face config's per-layer choices (each
layer's attention, `layer_types`: sliding-window layers among full ones; which layers are dense
among mixtures of experts: first_k_dense_replace, decoder_sparse_step, mlp_only_layers) as the
stack's `attention.pattern` and `ffn` plus `overrides`, and those read back from a spec
(specc.importers.hf.as_config's inverse rules).

        layer_types + sliding_window --set_windows--> decoder.attention.pattern + overrides [pattern]
        dense layer indices + dense ffn --set_dense--> decoder.ffn (all dense) or overrides [ffn]
        decoder.overrides --window_layers, dense_layers--> the config's fields again

The families that read these (gpt-oss, Qwen2-MoE, Qwen3-MoE, DeepSeek) call them from their own
modules (specc.importers.families). Like the tables, this refuses by raising ValueError (or
KeyError for a missing field), reads no files and imports no torch.
"""
from __future__ import annotations

from specc.importers.table import set_key


def selector(indices: list[int], layers: int) -> dict:
    """The override keys that choose INDICES among LAYERS layers: `every` and `first` where they
    are first, first + every, ... to the last layer, else `indices`."""
    if len(indices) > 1:
        step = indices[1] - indices[0]
        if step > 0 and indices == list(range(indices[0], layers, step)):
            return {"every": step, "first": indices[0]}
    return {"indices": list(indices)}


def _add_override(spec: dict, override: dict) -> None:
    overrides = spec.setdefault("decoder", {}).setdefault("overrides", [])
    overrides.append(override)


def set_windows(spec: dict, kinds: list[str], window: int | None, max_length: int) -> None:
    """Each layer's attention from its kind ("sliding_attention": the token and the `window` - 1
    before it; "full_attention": every earlier token): the stack's pattern local where any layer
    slides, overrides with a full pattern for the full layers among them. A window of at least
    MAX_LENGTH, or none, is full attention everywhere."""
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"]
    if window is None or window >= max_length or not sliding:
        return
    if window < 2:
        raise ValueError(f"sliding_window {window}: a window must hold more than the token itself")
    set_key(spec, "decoder.attention.pattern", {"kind": "local", "window": window - 1})
    full = [i for i, k in enumerate(kinds) if k != "sliding_attention"]
    if full:
        _add_override(spec, {**selector(full, len(kinds)), "pattern": {"kind": "full"}})


def set_dense(spec: dict, dense: list[int], layers: int, ffn: dict) -> None:
    """The layers DENSE (indices) computed by FFN (a dense feed-forward's keys) in place of the
    stack's mixture of experts: the stack's own ffn where every layer is dense, overrides where
    some are."""
    dense = sorted(set(dense))
    if not dense:
        return
    if len(dense) == layers:
        set_key(spec, "decoder.ffn", dict(ffn))
        return
    _add_override(spec, {**selector(dense, layers), "ffn": dict(ffn)})


def layer_kinds(cfg: dict, layers: int, read_kinds) -> list[str]:
    """`layer_types` checked: LAYERS entries of "sliding_attention" or "full_attention"
    (READ_KINDS: how the family reads the field, None where the config has none)."""
    kinds = read_kinds()
    if kinds is None:
        return []
    if len(kinds) != layers or any(k not in ("sliding_attention", "full_attention") for k in kinds):
        raise ValueError(f"layer_types: expected {layers} entries of 'sliding_attention' or 'full_attention', got "
                         f"{kinds[:4]}{'...' if len(kinds) > 4 else ''}")
    return kinds


# --- backwards: a spec's overrides as a config's per-layer fields --------------------------------


def _chosen(override: dict, layers: int) -> list[int]:
    """The layers an override (as spec_to_data dumps it) chooses."""
    if override.get("indices") is not None:
        return sorted(i for i in override["indices"] if i < layers)
    return list(range(override.get("first", 0), layers, override["every"]))


def _only(override: dict, key: str) -> bool:
    """Whether OVERRIDE sets KEY and nothing else a layer computes differently."""
    others = ("pattern", "rotary_base", "rotary_scaling", "ffn")
    return override.get(key) is not None and all(override.get(k) is None for k in others if k != key)


def window_layers(spec: dict) -> tuple[list[str], int | None]:
    """(layer_types, sliding_window) for a decoder whose layers are local (window W: a
    sliding_window of W + 1) or full, the full ones set by overrides of the pattern alone;
    ValueError for any other form."""
    stack = spec["decoder"]
    layers, pattern = stack["layers"], stack["attention"].get("pattern") or {}
    kind = pattern.get("kind", "full")  # a dumped spec leaves a default kind out
    if kind == "full":
        kinds, window = ["full_attention"] * layers, None
    elif kind == "local":
        kinds, window = ["sliding_attention"] * layers, pattern["window"] + 1
    else:
        raise ValueError(f"a {kind} pattern is not a sliding window")
    for override in stack.get("overrides") or []:
        if override.get("pattern") is None:
            continue
        if not _only(override, "pattern") or override["pattern"].get("kind", "full") != "full":
            raise ValueError("layers of their own other than full-attention ones")
        for i in _chosen(override, layers):
            kinds[i] = "full_attention"
    return kinds, window


def dense_layers(spec: dict) -> tuple[list[int], dict | None]:
    """(the dense layers' indices, their ffn) for a decoder of routed experts whose other layers
    are set by overrides of the ffn alone, all alike; every layer where the stack's own ffn is
    dense; ValueError for any other form."""
    stack = spec["decoder"]
    layers = stack["layers"]
    if stack["ffn"].get("kind", "dense") == "dense":
        return list(range(layers)), stack["ffn"]
    dense, ffn = [], None
    for override in stack.get("overrides") or []:
        if override.get("ffn") is None:
            continue
        dense_kind = override["ffn"].get("kind", "dense") == "dense"
        if not _only(override, "ffn") or not dense_kind or ffn not in (None, override["ffn"]):
            raise ValueError("layers of their own other than dense feed-forward ones, all alike")
        dense += _chosen(override, layers)
        ffn = override["ffn"]
    return sorted(set(dense)), ffn
