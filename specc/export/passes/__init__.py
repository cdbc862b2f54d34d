"""specc's own graph passes over an exported graph (onnx_ir), run after onnxscript's optimizer and
before the graph is saved and verified, so the graph that is verified is the graph that ships.
One pass per module; each takes the graph and returns how many times it fired. A pass is kept
only if it measurably helps onnxruntime: benchmarks/passes.py measures each on and off, and
docs/benchmarks.md records what each buys and which candidates were dropped.

The passes emit onnxruntime's com.microsoft operators, so they run for onnxruntime targets only
(onnx, and triton without TensorRT engines), never for the tensorrt target.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from specc.export.passes import fuse_gelu

# name -> pass, in the order they run
PASSES: dict[str, Callable] = {
    "fuse_gelu": fuse_gelu.run,
}


def apply(model, names: Iterable[str] | None = None) -> dict[str, int]:
    """Run the named passes (all by default) on an onnx_ir Model in place; {pass: times fired}."""
    chosen = list(PASSES) if names is None else list(names)
    unknown = [n for n in chosen if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown graph pass {unknown[0]!r}; choose from {', '.join(PASSES)}")
    return {name: PASSES[name](model.graph) for name in chosen}


__all__ = ["PASSES", "apply"]
