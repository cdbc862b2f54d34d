"""safetensors I/O with a strict name, shape and dtype check.

Only safetensors is read here (a format that cannot execute code); other checkpoint layouts go
through the importer (specc.importers.hf), which reads `pytorch_model.bin` with torch.load(weights_only=True).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from specc.errors import WeightsError
from specc.fileio import umask

_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def read_safetensors(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    if not path.is_file():
        raise WeightsError(f"{path}: no such weights file")
    if path.suffix != ".safetensors":
        raise WeightsError(f"{path}: weights must be a .safetensors file (use `specc import` for other formats)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise WeightsError(f"{path}: cannot read safetensors ({exc}); the file may be truncated or not safetensors") from None


def load_into(module: nn.Module, path: str | os.PathLike) -> None:
    """Copy a safetensors file into the module's parameters; every name and shape must match."""
    tensors = read_safetensors(path)
    params = dict(module.named_parameters())
    missing = sorted(set(params) - set(tensors))
    unexpected = sorted(set(tensors) - set(params))
    wrong = [
        f"{n}: file {tuple(tensors[n].shape)}, model {tuple(p.shape)}"
        for n, p in params.items()
        if n in tensors and tuple(tensors[n].shape) != tuple(p.shape)
    ]
    bad_dtype = [f"{n}: {tensors[n].dtype}" for n in params if n in tensors and tensors[n].dtype not in _FLOATS]
    problems = []
    for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong), ("not a float dtype", bad_dtype)):
        if items:
            shown = ", ".join(items[:8]) + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
            problems.append(f"{title}: {shown}")
    if problems:
        raise WeightsError(f"{path}: weights do not match the spec's parameters; " + "; ".join(problems))
    with torch.no_grad():
        for n, p in params.items():
            p.copy_(tensors[n].to(p.dtype))


def save_module(module: nn.Module, path: str | os.PathLike) -> None:
    """Write the module's parameters as safetensors, atomically (temp file, then rename)."""
    save_tensors({n: p.detach() for n, p in module.named_parameters()}, path)


def save_tensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write named tensors as safetensors, atomically (temp file, then rename), byte-reproducibly."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tensors = {n: t.contiguous().cpu() for n, t in tensors.items()}
    try:
        # one metadata key: safetensors writes a metadata map in no fixed order, and identical
        # builds must give identical bytes
        try:
            save_file(tensors, str(tmp), metadata={"format": "pt"})
        except SafetensorError as exc:  # its I/O errors (a missing folder, a full disk) come as this
            raise WeightsError(f"{path}: cannot write it ({str(exc).split(' at path ')[0]})") from None
        os.chmod(tmp, 0o666 & ~umask())  # the writer makes 0600; follow the umask like other files
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
