"""The spec language: pydantic models, loading with located errors, resolution.

Pure data: nothing here imports torch, onnx or onnxruntime.
"""
from specc.spec.load import catalog_dir, catalog_names, find_spec, load_spec, loads_spec
from specc.spec.schema import ModelSpec

__all__ = ["ModelSpec", "catalog_dir", "catalog_names", "find_spec", "load_spec", "loads_spec"]
from specc.spec.resolve import GraphSig, ResolvedSpec, TensorSig, resolve  # noqa: E402

__all__ += ["GraphSig", "ResolvedSpec", "TensorSig", "resolve"]
