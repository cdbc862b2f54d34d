"""specc: declarative Transformer specs compiled to verified PyTorch and ONNX artifacts.

Public API: load_spec, loads_spec, resolve, to_torch, build, import_hf, export_weights,
save_weights. Heavy imports (torch, onnx) happen
on first use.
"""
from specc.errors import BuildError, SpecError, SpeccError, VerificationError, WeightsError
from specc.spec import load_spec, loads_spec, resolve
from specc.version import __version__


def to_torch(spec, *, weights=None, seed: int = 0):
    """The spec as a torch.nn.Module in eval mode (see specc.nn.to_torch)."""
    from specc.nn import to_torch as _to_torch

    return _to_torch(spec, weights=weights, seed=seed)


def build(spec, out_dir, **options):
    """Build, verify and write a spec's artifacts; returns a BuildResult (see specc.builder.pipeline.build)."""
    from specc.builder.pipeline import build as _build

    return _build(spec, out_dir, **options)


def import_hf(src_dir, out_spec, *, name=None, force=False):
    """A Hugging Face checkpoint folder as OUT.yaml + OUT.safetensors; returns both paths
    (see specc.importers.hf; `specc import hf`)."""
    from specc.importers.hf import import_hf as _import

    return _import(src_dir, out_spec, name=name, force=force)


def save_weights(model, path):
    """A module from to_torch() (trained or not) as safetensors in specc's parameter names, for
    `specc build SPEC --weights FILE` or the spec's `weights:` key."""
    from specc.weights import save_module

    save_module(model, path)


def export_weights(spec, path, *, weights=None, seed: int = 0):
    """The weights SPEC builds with (its `weights:` key or the file given, else seeded random
    initialisation) written to PATH, like `specc export-weights`."""
    save_weights(to_torch(spec, weights=weights, seed=seed), path)


__all__ = [
    "BuildError", "SpecError", "SpeccError", "VerificationError", "WeightsError",
    "build", "export_weights", "import_hf", "load_spec", "save_weights", "loads_spec", "resolve", "to_torch", "__version__",
]
