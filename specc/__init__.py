"""specc: declarative Transformer specs compiled to verified PyTorch and ONNX artifacts.

Public API: load_spec, loads_spec, resolve, to_torch, build. Heavy imports (torch, onnx) happen
on first use.
"""
__version__ = "0.1.0"

from specc.errors import BuildError, SpecError, SpeccError, VerificationError, WeightsError  # noqa: E402
from specc.spec import load_spec, loads_spec, resolve  # noqa: E402


def to_torch(spec, *, weights=None, seed: int = 0):
    """The spec as a torch.nn.Module in eval mode (see specc.nn.to_torch)."""
    from specc.nn import to_torch as _to_torch

    return _to_torch(spec, weights=weights, seed=seed)


def build(spec, out_dir, **options):
    """Build, verify and write a spec's artifacts; returns a BuildResult (see specc.pipeline.build)."""
    from specc.pipeline import build as _build

    return _build(spec, out_dir, **options)


__all__ = [
    "BuildError", "SpecError", "SpeccError", "VerificationError", "WeightsError",
    "build", "load_spec", "loads_spec", "resolve", "to_torch", "__version__",
]
