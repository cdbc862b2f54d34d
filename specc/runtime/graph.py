"""One graph of a build in onnxruntime: the execution providers it asks for (and whether a GPU one
really works here), the session options, and Graph, an onnxruntime session run through IO binding
with its IO signature from the manifest.

onnxruntime arrives as a parameter (the caller's `require_onnxruntime`), so importing this module
loads no onnxruntime.
"""
from __future__ import annotations

import contextlib
import io
import sys
import threading
import warnings
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from specc.errors import first_line
from specc.runtime.errors import RunError
from specc.spec.io import numpy_dtype
from specc.spec.manifest import GraphInfo, TensorInfo

# most capable first; onnxruntime would otherwise fall back silently
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
GPU_PROVIDERS = ("CUDAExecutionProvider", "TensorrtExecutionProvider")
CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"
# the short names a provider may be given by (any case); full onnxruntime names are taken too
SHORT_NAMES = {"cuda": "CUDAExecutionProvider", "tensorrt": "TensorrtExecutionProvider",
               "trt": "TensorrtExecutionProvider", "cpu": CPU}
# what a GPU provider that cannot be created lacks, for the notice
LACKS = {"CUDAExecutionProvider": "no CUDA GPU or CUDA libraries",
         "TensorrtExecutionProvider": "no CUDA GPU, or no CUDA or TensorRT libraries"}


def provider_name(name: str, available: Sequence[str] = ()) -> str:
    """onnxruntime's full name for a provider given by a short name ("cuda", "tensorrt" or "trt",
    "cpu"; any case) or by its full name (any case, where `available` has it); else `name` as given."""
    key = name.strip().lower()
    if key in SHORT_NAMES:
        return SHORT_NAMES[key]
    return next((a for a in available if a.lower() == key), name.strip())


def choose_providers(available: Sequence[str], requested: Sequence[str] | None = None) -> list[str]:
    """The providers to ask for, in order: `requested` (short names or full ones, see
    provider_name; each must be available), else the preferred ones that are available. CPU
    always ends the list. Whether a GPU provider really works here is usable_providers'."""
    if requested:
        names = list(dict.fromkeys(provider_name(p, available) for p in requested))
        missing = [p for p in names if p not in available]
        if missing:
            raise RunError(f"execution provider(s) {', '.join(missing)} not available here; "
                           f"available: {', '.join(available)} (or cuda, tensorrt, cpu for short)")
        chosen = names
    else:
        chosen = [p for p in PREFERRED_PROVIDERS if p in available]
    if CPU not in chosen:
        chosen.append(CPU)
    return chosen


# (id(ort), provider) -> (ort, whether it can be created); ort is kept so that its id stays its own
_PROBED: dict[tuple[int, str], tuple[Any, bool]] = {}
_NOTICED: set[str] = set()  # the GPU providers named in the notice (one per process)
_LOCK = threading.Lock()  # sessions opened on several threads probe and give notice once


def provider_usable(ort, provider: str) -> bool:
    """Whether onnxruntime can really create `provider` here, probed once per process: a tiny
    in-memory model opened with that provider alone, onnxruntime's logging and Python's warnings
    silenced. onnxruntime-gpu lists CUDA (and TensorRT) among its available providers on any
    machine; without a GPU or the CUDA libraries it logs the failed library loads and falls back
    to CPU, which is what this detects (get_providers()[0] is not the provider)."""
    key = (id(ort), provider)
    with _LOCK:
        if key not in _PROBED:
            _PROBED[key] = (ort, _probe(ort, provider))
        return _PROBED[key][1]


def _probe(ort, provider: str) -> bool:
    options = ort.SessionOptions()
    options.log_severity_level = 4  # fatal only
    quiet = getattr(ort, "set_default_logger_severity", None)
    try:
        if quiet:
            quiet(4)  # the provider library loads log on the default logger
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):  # its fallback prints
            warnings.simplefilter("ignore")
            session = ort.InferenceSession(_probe_model(), options, providers=provider_entries([provider]))
            return session.get_providers()[0] == provider
    except Exception:  # onnxruntime's own exception types: the provider cannot be created
        return False
    finally:
        if quiet:
            quiet(2)  # onnxruntime's default: warnings and above


def _probe_model() -> bytes:
    """A one-node model (y = x + x, float [1]), serialized: small enough for any provider."""
    from onnx import TensorProto, helper

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    graph = helper.make_graph([helper.make_node("Add", ["x", "x"], ["y"])], "specc_probe", [x], [y])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    return model.SerializeToString()


def unusable_provider(ort, provider: str) -> str | None:
    """Why `provider` (a short or full name) cannot run graphs here, in words, or None where it
    can: not available in this onnxruntime, or a GPU provider that cannot be created
    (provider_usable)."""
    available = ort.get_available_providers()
    name = provider_name(provider, available)
    if name not in available:
        return f"{name} is not available in this onnxruntime (available: {', '.join(available)})"
    if name in GPU_PROVIDERS and not provider_usable(ort, name):
        return f"{name} is not usable here ({LACKS[name]})"
    return None


# the options specc gives a provider, where it gives any: on CUDA, TF32 off (onnxruntime's default
# is on), so that an fp32 graph computes in fp32 as it was verified (`specc build --verify-provider cuda`)
PROVIDER_OPTIONS = {"CUDAExecutionProvider": {"use_tf32": "0"}}


def provider_entries(providers: Sequence[str], extra: Mapping[str, Mapping[str, str]] | None = None) -> list:
    """onnxruntime's `providers=` argument for providers given by short or full names: their full
    names, in order, each once, with PROVIDER_OPTIONS where it has some and `extra`'s options for
    a provider (full name -> options) added to them ((name, options) pairs)."""
    names = dict.fromkeys(provider_name(p) for p in providers)
    extra = extra or {}
    entries = []
    for n in names:
        options = {**PROVIDER_OPTIONS.get(n, {}), **extra.get(n, {})}
        entries.append((n, options) if options else n)
    return entries


def usable_providers(ort, chosen: Sequence[str]) -> list[str]:
    """`chosen` (choose_providers') without the GPU providers that cannot be created here
    (provider_usable), so that a graph runs on the next one, CPU at the latest. The first time a
    session falls back to the CPU so in a process, one line on stderr says so (naming those
    dropped); later sessions fall back quietly, and so does TensorRT's fall back to CUDA (what runs
    is the session's `provider`)."""
    dropped = [p for p in chosen if p in GPU_PROVIDERS and not provider_usable(ort, p)]
    kept = [p for p in chosen if p not in dropped] or [CPU]
    with _LOCK:
        if not dropped or _NOTICED or kept[0] != CPU:
            return kept
        _NOTICED.update(dropped)
    lacks = LACKS["TensorrtExecutionProvider" if "TensorrtExecutionProvider" in dropped else dropped[0]]
    print(f"specc: {' and '.join(dropped)} {'is' if len(dropped) == 1 else 'are'} not usable here ({lacks}); "
          f"running on {kept[0]}", file=sys.stderr, flush=True)
    return kept


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
    output_sig map names to their TensorInfo; outputs lists the output names in order.
    provider_options: options added to a provider's (full name -> options), e.g. CUDA graph
    capture for the in-place graph on a GPU (specc/runtime/captured.py)."""

    def __init__(self, ort, path: Path, info: GraphInfo, providers: list[str], options,
                 provider_options: Mapping[str, Mapping[str, str]] | None = None):
        try:
            self.session = ort.InferenceSession(str(path), options,
                                                providers=provider_entries(providers, provider_options))
        except Exception as exc:  # onnxruntime's own exception types
            raise RunError(f"{path}: onnxruntime cannot load it: {first_line(exc)}") from None
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
            raise RunError(f"onnxruntime failed: {first_line(exc)}") from None
        return dict(zip(self.outputs, binding.get_outputs()))


def shape_of(value) -> tuple[int, ...]:
    """The shape of a numpy array or an OrtValue (whose shape is a method)."""
    shape = getattr(value, "shape", None)
    return tuple(shape()) if callable(shape) else tuple(np.shape(value))
