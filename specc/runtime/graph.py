"""One graph of a build in onnxruntime: the execution providers it asks for, the session options,
and Graph, an onnxruntime session run through IO binding with its IO signature from the manifest.

onnxruntime arrives as a parameter (the caller's `require_onnxruntime`), so importing this module
loads no onnxruntime.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specc.runtime.errors import RunError
from specc.spec.io import numpy_dtype
from specc.spec.manifest import GraphInfo, TensorInfo

# most capable first; onnxruntime would otherwise fall back silently
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")


def choose_providers(available: Sequence[str], requested: Sequence[str] | None = None) -> list[str]:
    """The providers to ask for, in order: `requested` (each must be available), else the
    preferred ones that are available. CPU always ends the list."""
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise RunError(f"execution provider(s) {', '.join(missing)} not available here; "
                           f"available: {', '.join(available)}")
        chosen = list(requested)
    else:
        chosen = [p for p in PREFERRED_PROVIDERS if p in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


def session_options(ort, threads: int | None = None):
    """onnxruntime options specc runs with: every graph optimization, quiet logs, intra-op
    threads = `threads`, else onnxruntime's own default."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    return options


class Graph:
    """One onnxruntime session with its IO signature from the manifest (`info`). inputs and
    output_sig map names to their TensorInfo; outputs lists the output names in order."""

    def __init__(self, ort, path: Path, info: GraphInfo, providers: list[str], options):
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime's own exception types
            raise RunError(f"{path}: onnxruntime cannot load it: {str(exc).strip().splitlines()[0]}") from None
        self.ort = ort
        self.info = info
        self.inputs: dict[str, TensorInfo] = {t.name: t for t in info.inputs}
        self.outputs: list[str] = [t.name for t in info.outputs]
        self.output_sig: dict[str, TensorInfo] = {t.name: t for t in info.outputs}
        self.provider = self.session.get_providers()[0]
        self.device = "cuda" if self.provider in GPU_PROVIDERS else "cpu"

    def value(self, name: str, array: np.ndarray):
        """An OrtValue for an input, in the graph's dtype, on the graph's device."""
        array = np.ascontiguousarray(array, dtype=numpy_dtype(self.inputs[name].dtype))
        return self.ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)

    def run(self, feeds: dict[str, Any], into: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Run with IO binding. Feeds are numpy arrays or OrtValues; the result holds OrtValues
        (on the graph's device), keyed by output name. `into` (CPU only): preallocated contiguous
        arrays of the exact output shapes, which onnxruntime writes those outputs into."""
        missing = sorted(set(self.inputs) - set(feeds))
        if missing:
            raise RunError(f"missing input(s): {', '.join(missing)}")
        binding = self.session.io_binding()
        for name in self.inputs:
            val = feeds[name]
            if not isinstance(val, self.ort.OrtValue):
                val = self.value(name, val)
            binding.bind_ortvalue_input(name, val)
        for name in self.outputs:
            if into and name in into:
                binding.bind_ortvalue_output(name, self.ort.OrtValue.ortvalue_from_numpy(into[name]))
            else:
                binding.bind_output(name, self.device)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime failed: {str(exc).strip().splitlines()[0]}") from None
        return dict(zip(self.outputs, binding.get_outputs()))


def shape_of(value) -> tuple[int, ...]:
    """The shape of a numpy array or an OrtValue (whose shape is a method)."""
    shape = getattr(value, "shape", None)
    return tuple(shape()) if callable(shape) else tuple(np.shape(value))
