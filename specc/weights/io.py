"""safetensors I/O with a strict name, shape and dtype check.

Only safetensors is read here (a format that cannot execute code); other checkpoint layouts go
through the importer (specc.importers.hf), which reads `pytorch_model.bin` with torch.load(weights_only=True).
"""
from __future__ import annotations

import json
import os
import struct
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import nn

from specc.errors import WeightsError
from specc.fileio import INDEX_SUFFIX, read_bounded, umask

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


# safetensors' dtype names, in the order its writer lays tensors out (wider first, then by name)
DTYPE_NAMES = {torch.float64: "F64", torch.int64: "I64", torch.float32: "F32", torch.int32: "I32",
               torch.bfloat16: "BF16", torch.float16: "F16", torch.int16: "I16", torch.int8: "I8",
               torch.uint8: "U8", torch.bool: "BOOL"}
_LAYOUT = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")
_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


HEADER_LIMIT = 100 * 2**20  # what safetensors itself accepts of a header


class SafetensorsFile(Mapping):
    """A safetensors file read lazily: names, dtypes and shapes come from its header, and a
    tensor's bytes are read (not mapped: mapped pages would count in the process's resident
    memory) only when it is asked for, so a 10 GB shard costs the memory of the tensor in hand.
    The header is checked before anything else is read: its size, every dtype, shape and byte
    range (inside the file, and as long as the shape and dtype say)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise WeightsError(f"{self.path}: no such weights file")
        if self.path.suffix != ".safetensors":
            raise WeightsError(f"{self.path}: weights must be a .safetensors file (use `specc import` for other formats)")
        self._entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
                if not 0 < n <= min(HEADER_LIMIT, size - 8):
                    raise ValueError(f"a header of {n} bytes in a file of {size}")
                header = json.loads(f.read(n))
        except (OSError, ValueError) as exc:  # json's errors are ValueErrors
            raise WeightsError(f"{self.path}: cannot read safetensors ({exc}); the file may be truncated or not "
                               "safetensors") from None
        if not isinstance(header, dict):
            raise WeightsError(f"{self.path}: the safetensors header is not a JSON object")
        start, end = 8 + n, size
        meta = header.get("__metadata__")
        self.metadata: dict[str, str] = {k: v for k, v in meta.items() if isinstance(v, str)} if isinstance(meta, dict) else {}
        for name, e in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype, shape, (a, b) = _DTYPES[e["dtype"]], tuple(e["shape"]), e["data_offsets"]
                if not all(type(x) is int and x >= 0 for x in (*shape, a, b)):
                    raise ValueError
            except (KeyError, TypeError, ValueError):
                raise WeightsError(f"{self.path}: tensor {name!r} has a malformed or unknown header entry") from None
            nbytes = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
            if b - a != nbytes or start + b > end:
                raise WeightsError(f"{self.path}: cannot read safetensors: tensor {name!r}'s bytes [{a}, {b}) do not hold its {e['dtype']} "
                                   f"{list(shape)} inside the file; it may be truncated")
            self._entries[name] = (dtype, shape, start + a, nbytes)

    def __getitem__(self, name: str) -> torch.Tensor:
        dtype, shape, at, nbytes = self._entries[name]
        if not nbytes:
            return torch.empty(shape, dtype=dtype)
        buf = bytearray(nbytes)
        try:
            with open(self.path, "rb") as f:
                f.seek(at)
                got = f.readinto(buf)
        except OSError as exc:
            raise WeightsError(f"{self.path}: cannot read tensor {name} ({exc.strerror or exc})") from None
        if got != nbytes:
            raise WeightsError(f"{self.path}: tensor {name} was cut short; the file may be truncated")
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor to answer
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def meta(self, name: str) -> torch.Tensor:
        """The tensor's dtype and shape, as an empty tensor on torch's meta device."""
        dtype, shape, _, _ = self._entries[name]
        return torch.empty(shape, dtype=dtype, device="meta")


INDEX_LIMIT = 64 * 2**20  # bytes: a real index is a few MB (thousands of names); refused past this


def index_files(weight_map, where: str, error: type[Exception] = WeightsError) -> list[str]:
    """The shard file names an index's `weight_map` ({tensor: file}) names, sorted, each a relative
    name that stays inside the index's folder; raises `error` naming `where` (the index) and the
    entry otherwise."""
    if not isinstance(weight_map, dict):
        raise error(f"{where}: not a weights index (no weight_map object)")
    for tensor, entry in weight_map.items():
        what = f"{where}: weight_map[{json.dumps(tensor)[:80]}] = {json.dumps(entry)[:80]}"
        if type(entry) is not str or not entry:
            raise error(f"{what}: expected a file name")
        name = PurePosixPath(entry)
        if "\0" in entry or name.is_absolute() or ".." in name.parts:
            raise error(f"{what}: not a file name inside the checkpoint folder; refused")
    return sorted(set(weight_map.values()))


class ShardedSafetensors(Mapping):
    """A sharded weights file read as one SafetensorsFile: NAME.safetensors.index.json
    ({"weight_map": {tensor: shard}}, as Hugging Face writes a large checkpoint) and the shards it
    names beside it. Each tensor is read from the shard the map names, when asked for; a map that
    names a tensor its shard lacks, or a shard holding tensors the map does not give it, is refused."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            data = json.loads(read_bounded(self.path, INDEX_LIMIT).decode("utf-8"))
        except FileNotFoundError:
            raise WeightsError(f"{self.path}: no such weights file") from None
        except (OSError, ValueError, RecursionError) as exc:  # NotARegularFile is an OSError; json's are ValueErrors
            raise WeightsError(f"{self.path}: cannot read the weights index ({str(exc)[:200]})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        folder = self.path.parent
        self._shards = {}
        for f in index_files(weight_map, str(self.path)):
            try:
                self._shards[f] = SafetensorsFile(folder / f)
            except WeightsError as exc:
                raise WeightsError(f"{exc} (named by {self.path})") from None
        self._map: dict[str, str] = dict(weight_map)
        for f, shard in self._shards.items():
            named = {t for t, where in self._map.items() if where == f}
            lacking, extra = sorted(named - set(shard)), sorted(set(shard) - named)
            if lacking or extra:
                what = (f"lacks {', '.join(lacking[:4])}" if lacking else
                        f"holds {', '.join(extra[:4])}, which the index does not give it")
                raise WeightsError(f"{self.path}: shard {f} {what}")

    @property
    def files(self) -> list[Path]:
        """The index, then each shard."""
        return [self.path, *(shard.path for shard in self._shards.values())]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._shards[self._map[name]][name]

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor to answer
        return name in self._map

    def __iter__(self) -> Iterator[str]:
        return iter(self._map)

    def __len__(self) -> int:
        return len(self._map)

    def meta(self, name: str) -> torch.Tensor:
        return self._shards[self._map[name]].meta(name)


def open_weights(path: str | os.PathLike) -> SafetensorsFile | ShardedSafetensors:
    """A weights file (.safetensors) or a sharded one (its .safetensors.index.json), read a tensor
    at a time."""
    path = Path(path)
    return ShardedSafetensors(path) if path.name.endswith(INDEX_SUFFIX) else SafetensorsFile(path)


def check_weights(file, shapes: Mapping[str, tuple[int, ...]]) -> None:
    """The weights file's header against a model's parameters: every name there and none extra,
    the shapes right, float dtypes; nothing is read past the headers."""
    missing = sorted(set(shapes) - set(file))
    unexpected = sorted(set(file) - set(shapes))
    wrong = [f"{n}: file {tuple(file.meta(n).shape)}, model {tuple(shapes[n])}" for n in shapes
             if n in file and tuple(file.meta(n).shape) != tuple(shapes[n])]
    not_float = [f"{n}: {file.meta(n).dtype}" for n in shapes if n in file and file.meta(n).dtype not in _FLOATS]
    problems = [f"{title}: {', '.join(items[:8])}" + (f", ... ({len(items)} in all)" if len(items) > 8 else "")
                for title, items in (("missing", missing), ("unexpected", unexpected), ("wrong shape", wrong),
                                     ("not a float dtype", not_float)) if items]
    if problems:
        raise WeightsError(f"{file.path}: weights do not match the spec's parameters; " + "; ".join(problems))


def write_safetensors(entries: Mapping[str, torch.Tensor], tensor_of: Callable[[str], torch.Tensor],
                      path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> None:
    """Write a safetensors file one tensor at a time, atomically (temp file, then rename): the
    header from `entries` (name -> a tensor of the right dtype and shape, such as a meta one), then
    each tensor's bytes from `tensor_of(name)`, released before the next. The bytes are those
    safetensors' own writer makes of the same tensors (with the metadata {"format": "pt"}, and
    METADATA's strings beside it: SafetensorsFile.metadata reads them back)."""
    path = Path(path)
    order = sorted(entries, key=lambda n: (_LAYOUT.index(DTYPE_NAMES[entries[n].dtype]), n))
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name in order:
        t = entries[name]
        size = t.numel() * t.element_size()
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        try:
            with open(tmp, "wb") as f:
                f.write(struct.pack("<Q", len(text)) + text)
                for name in order:
                    t = tensor_of(name).contiguous()
                    want = entries[name]
                    if t.dtype != want.dtype or tuple(t.shape) != tuple(want.shape):
                        raise WeightsError(f"{path}: {name} came as {t.dtype} {tuple(t.shape)}, "
                                           f"not the {want.dtype} {tuple(want.shape)} its header says")
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else b"")
                    del t
        except OSError as exc:
            raise WeightsError(f"{path}: cannot write it ({exc.strerror or exc})") from None
        os.chmod(tmp, 0o666 & ~umask())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_into(module: nn.Module, path: str | os.PathLike) -> None:
    """Copy a weights file (or a sharded one) into the module's parameters, a tensor at a time;
    every name and shape must match (check_weights)."""
    tensors = open_weights(path)
    params = dict(module.named_parameters())
    check_weights(tensors, {n: tuple(p.shape) for n, p in params.items()})
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
