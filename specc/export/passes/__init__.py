"""specc's own graph passes over an exported graph (onnx_ir), run after onnxscript's optimizer and
before the graph is saved and verified, so the graph that is verified is the graph that ships:
PASSES on the fp32 graph, QUANTIZED_PASSES after an integer build's quantizer (they read the
products it writes). One pass per module; each takes the graph and returns how many times it fired. A pass is kept
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
QUANTIZED_PASSES: dict[str, Callable] = {
    "merge_products": _lazy("merge_products"),
}


def apply(model, names: Iterable[str] | None = None, quantized: bool = False) -> dict[str, int]:
    """Run the named passes (all by default) of PASSES, or of QUANTIZED_PASSES where `quantized`,
    on an onnx_ir Model in place; {pass: times fired}. Names of the other table are skipped, so a
    build's one list serves both."""
    table, other = (QUANTIZED_PASSES, PASSES) if quantized else (PASSES, QUANTIZED_PASSES)
    chosen = list(table) if names is None else [n for n in names if n not in other]
    unknown = [n for n in chosen if n not in table]
    if unknown:
        raise ValueError(f"unknown graph pass {unknown[0]!r}; choose from {', '.join([*PASSES, *QUANTIZED_PASSES])}")
    return {name: table[name](model.graph) for name in chosen}


__all__ = ["PASSES", "QUANTIZED_PASSES", "apply"]
