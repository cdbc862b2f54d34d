"""Weights: safetensors in specc's parameter names (docs/weights.md), read with strict checks."""
from specc.weights.io import load_into, read_safetensors, save_module, save_tensors

__all__ = ["load_into", "read_safetensors", "save_module", "save_tensors"]
