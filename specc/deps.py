"""Optional dependencies, imported lazily, with errors that say what to install.

onnxruntime comes from exactly one of two extras (as Optimum does): `specc[cpu]` (onnxruntime)
or `specc[gpu]` (onnxruntime-gpu). The two wheels install the same `onnxruntime` package and
overwrite each other's files, so having both is an error too.
"""
from __future__ import annotations

from importlib import metadata

from specc.errors import RuntimeMissingError

ORT_DISTRIBUTIONS = ("onnxruntime", "onnxruntime-gpu")
INSTALL_HINT = "install one runtime extra: pip install 'specc[cpu]' (CPU), or pip install 'specc[gpu]' (CUDA), never both"


def installed_runtimes() -> list[str]:
    """Which onnxruntime distributions are installed (by their package metadata)."""
    found = []
    for dist in ORT_DISTRIBUTIONS:
        try:
            metadata.version(dist)
            found.append(dist)
        except metadata.PackageNotFoundError:
            pass
    return found


def require_onnxruntime(purpose: str = "this command"):
    """The onnxruntime module, or RuntimeMissingError naming the extra to install."""
    found = installed_runtimes()
    if len(found) > 1:
        raise RuntimeMissingError(
            f"both {' and '.join(found)} are installed; they overwrite each other's files. "
            f"Uninstall both, then {INSTALL_HINT}"
        )
    try:
        import onnxruntime
    except ImportError:
        raise RuntimeMissingError(f"{purpose} needs onnxruntime, which is not installed; {INSTALL_HINT}") from None
    return onnxruntime


# what building needs and running a build does not: PyTorch and the ONNX exporter. A serving
# environment (`make install-serve`) has none of them; `specc run`, `generate` and `serve` import none.
BUILD_MODULES = ("torch", "onnx", "onnxscript", "onnx_ir", "safetensors")


def missing_for_building(exc: ImportError) -> str | None:
    """The one line for a command that needs what only building needs, run where it is not
    installed (a serving environment); None for any other missing module."""
    name = (getattr(exc, "name", None) or "").split(".")[0]
    if name not in BUILD_MODULES:
        return None
    return (f"this command needs {name}, which is not installed here: building (and anything that runs the "
            "compiler or PyTorch) needs specc's own dependencies (pip install 'specc[cpu]', or `make install`); "
            "an environment without them runs and serves builds only (specc run, generate, serve)")


def require_tensorrt(purpose: str = "this command"):
    """The tensorrt module, or RuntimeMissingError saying where TensorRT comes from."""
    try:
        import tensorrt
    except ImportError:
        raise RuntimeMissingError(
            f"{purpose} needs TensorRT, which is not installed. It needs an NVIDIA GPU and comes from "
            "NVIDIA's package index: pip install 'specc[gpu,tensorrt]' on a CUDA machine (see docs/serving.md)"
        ) from None
    return tensorrt
