"""Compile a resolved spec to a torch.nn.Module."""
from __future__ import annotations

import os

from specc.nn.blocks import default_init_skipped, init_weights, stack_depths
from specc.nn.model import SpeccModel
from specc.spec.load import load_spec
from specc.spec.resolve import ResolvedSpec, resolve
from specc.spec.schema import ModelSpec


def as_resolved(spec: str | os.PathLike | ModelSpec | ResolvedSpec) -> ResolvedSpec:
    if isinstance(spec, ResolvedSpec):
        return spec
    if not isinstance(spec, ModelSpec):
        spec = load_spec(spec)
    return resolve(spec)


def to_torch(spec, *, weights: str | os.PathLike | None = None, seed: int = 0) -> SpeccModel:
    """The spec (a path, a catalog name, a ModelSpec or a ResolvedSpec) as an nn.Module in eval
    mode. Weights: `weights=` (safetensors), else the spec's `weights:` key, else seeded random
    initialisation (same seed, same weights)."""
    r = as_resolved(spec)
    with default_init_skipped():
        model = SpeccModel(r)
    init_weights(model, seed, depth=stack_depths(r))
    path = weights if weights is not None else r.weights_path
    if path is not None:
        from specc.weights import load_into

        load_into(model, path)
    return model.eval()


__all__ = ["SpeccModel", "as_resolved", "to_torch"]
