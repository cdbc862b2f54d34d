"""specc's own graph passes over an exported graph (onnx_ir), run after onnxscript's optimizer and
before the graph is saved and verified, so the graph that is verified is the graph that ships.
One pass per module; each takes the graph and returns how many times it fired. A pass is kept
only if it measurably helps onnxruntime: benchmarks/passes.py measures each on and off, and
docs/benchmarks.md records what each buys and which candidates were dropped.

The passes emit onnxruntime's com.microsoft operators, so they run for onnxruntime targets only
(onnx, and triton without TensorRT engines), never for the tensorrt target.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable


def _lazy(name: str) -> Callable:
    """The run(graph) of specc/export/passes/<name>.py, imported on its first call: the passes use
    onnx_ir, whose slow import (sympy with it) a build makes beside the module's construction
    (specc.export.onnx.preload), not when it lists the passes for its cache key."""

    def run(graph) -> int:
        return importlib.import_module(f"specc.export.passes.{name}").run(graph)

    run.__name__ = run.__qualname__ = name
    return run


# name -> pass, in the order they run
PASSES: dict[str, Callable] = {
    "fuse_gelu": _lazy("fuse_gelu"),
    "fuse_attention": _lazy("fuse_attention"),
}


def apply(model, names: Iterable[str] | None = None) -> dict[str, int]:
    """Run the named passes (all by default) on an onnx_ir Model in place; {pass: times fired}."""
    chosen = list(PASSES) if names is None else list(names)
    unknown = [n for n in chosen if n not in PASSES]
    if unknown:
        raise ValueError(f"unknown graph pass {unknown[0]!r}; choose from {', '.join(PASSES)}")
    return {name: PASSES[name](model.graph) for name in chosen}


__all__ = ["PASSES", "apply"]
