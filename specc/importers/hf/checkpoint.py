"""Reading a Hugging Face checkpoint folder: config.json and its tensors, nothing interpreted.

Contract: `read_checkpoint(folder)` returns (config, Checkpoint) or raises CheckpointError
naming the file. A Checkpoint maps names to tensors and reads each when it is asked for: from
model.safetensors (or the shards a model.safetensors.index.json names), memory-mapped, one
tensor at a time, in its stored dtype (bf16, fp16, fp32); else from pytorch_model.bin (or its
index) through torch.load(weights_only=True), whole: tensors and plain containers only, never
pickled code. `meta(name)` gives a tensor's dtype and shape without reading it. Nothing is
downloaded. The only rewrite is of old BERT names (LayerNorm `gamma` / `beta` -> `weight` / `bias`).

The folder is untrusted input. Every file read (config.json, an index, the weights) must be a
regular file, checked before it is opened (a FIFO would block the open for ever, a device such as
/dev/zero never ends) and again on the descriptor, which is opened with O_NONBLOCK; it must lie
in the folder once links are followed (or, for a Hugging Face cache snapshot, in that
repository's blobs/), so an index entry such as `../../x.safetensors`, `/abs/x.safetensors` or a
link out of the folder is refused, naming the entry; JSON files are capped at JSON_LIMIT bytes.
"""
from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from specc.errors import WeightsError, first_line
from specc.fileio import not_regular
from specc.importers.errors import CheckpointError

# config.json is a few KB and a weights index a few MB (some thousands of tensor names at ~100
# bytes each, for the largest sharded models); 64 MiB is far above any real one and small enough
# to refuse, before reading it, a hostile file that would take the memory (a 5 GB "config").
# Weights files have no cap: their size is the model's (many GB), safetensors files are mapped,
# not read, and a .bin is read by torch.load only when it is a regular file.
JSON_LIMIT = 64 * 2**20


def _check_regular(path: Path, note: str = "") -> os.stat_result:
    """stat PATH (following links) and refuse anything but a regular file, before it is opened.
    NOTE (" (named by INDEX)") is added to a message about a file an index names."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        link = " (a link to nowhere)" if path.is_symlink() else ""
        raise CheckpointError(f"{path}: missing{link}{note}") from None
    except (OSError, ValueError) as exc:  # a link loop, no permission
        raise CheckpointError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc}){note}") from None
    if not stat.S_ISREG(st.st_mode):
        raise CheckpointError(f"{path}: {not_regular(st.st_mode)}{note}")
    return st


def _open_regular(path: Path, note: str = "") -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file PATH and its stat. O_NONBLOCK: should PATH have
    become a FIFO since it was checked, the open returns at once instead of waiting for a writer,
    and the check on the descriptor refuses it (no effect on a regular file's reads)."""
    _check_regular(path, note)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise CheckpointError(f"{path}: {not_regular(st.st_mode)}{note}")
    return fd, st


def _read_json(path: Path) -> Any:
    """A JSON file of at most JSON_LIMIT bytes, decoded as Hugging Face does (UTF-8)."""
    fd, st = _open_regular(path)
    with os.fdopen(fd, "rb") as f:
        if st.st_size > JSON_LIMIT:
            raise CheckpointError(f"{path}: {st.st_size} bytes; a JSON file of a checkpoint is refused over "
                                  f"{JSON_LIMIT // 2**20} MiB")
        try:
            data = f.read(JSON_LIMIT + 1)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > JSON_LIMIT:  # it grew after the stat
        raise CheckpointError(f"{path}: over {JSON_LIMIT // 2**20} MiB; a JSON file of a checkpoint is refused over that")
    try:
        return json.loads(data.decode("utf-8"))
    except RecursionError:  # json recurses once per bracket: 200,000 of them
        raise CheckpointError(f"{path}: cannot read it (JSON nested too deeply)") from None
    except ValueError as exc:  # not JSON, not UTF-8, an integer of over 4300 digits
        raise CheckpointError(f"{path}: cannot read it ({str(exc)[:200]})") from None


def _roots(src: Path) -> tuple[Path, ...]:
    """Where the files of SRC may lie once links are followed: SRC itself, and for a snapshot of
    the Hugging Face cache (HUB/models--ORG--NAME/snapshots/REV/, whose files are links to
    ../../blobs/HASH) that repository's blobs/."""
    real = src.resolve()
    if real.parent.name == "snapshots" and real.parent.parent.name.startswith("models--"):
        return real, real.parent.parent / "blobs"
    return (real,)


def _inside(src: Path, path: Path, what: str, note: str = "") -> Path:
    """PATH, refused (naming WHAT) where it is not a regular file (checked first: /dev/zero is
    named a device) or lies outside the folder once links are followed."""
    _check_regular(path, note)
    try:
        real = path.resolve()
    except (OSError, RuntimeError) as exc:  # a link loop (RuntimeError before Python 3.13)
        raise CheckpointError(f"{what}: cannot follow it ({exc})") from None
    if not any(real.is_relative_to(root) for root in _roots(src)):
        raise CheckpointError(f"{what}: leads to {real}, outside the checkpoint folder {src}; refused")
    return path


def read_optional(src: Path, name: str, limit: int) -> bytes | None:
    """The bytes of the file NAME in the folder SRC, None where there is none; refused (naming it)
    where it is not a regular file, lies outside the folder once links are followed, or holds more
    than `limit` bytes. For the files an import carries beside the weights (the tokenizer's)."""
    path = src / name
    if not os.path.lexists(path):
        return None
    fd, st = _open_regular(_inside(src, path, str(path)))
    with os.fdopen(fd, "rb") as f:
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes; refused over {limit // 2**20} MiB")
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise CheckpointError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if len(data) > limit:
        raise CheckpointError(f"{path}: over {limit // 2**20} MiB; refused")
    return data


def _shards(src: Path, index: Path) -> list[Path]:
    """The files an index's weight_map names, each a relative name inside SRC."""
    from specc.weights.io import index_files  # imports torch

    data = _read_json(index)
    names = index_files(data.get("weight_map") if isinstance(data, dict) else None, str(index), CheckpointError)
    return [_inside(src, src / entry, f"{index}: weight_map entry {json.dumps(entry)[:80]}", f" (named by {index.name})")
            for entry in names]


class Checkpoint(Mapping):
    """A checkpoint's tensors by name (old BERT names rewritten), each read when asked for."""

    def __init__(self):
        self._where: dict[str, tuple[Mapping, str]] = {}  # name -> (its file, its name there)

    def add(self, source: Mapping, note: str = "") -> None:
        for name in source:  # a name in two shards: the later one, as a dict update would
            self._where[re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", name))] = (source, name)

    def __getitem__(self, name: str):
        source, stored = self._where[name]
        return source[stored]

    def __contains__(self, name) -> bool:  # Mapping's would read the tensor to answer
        return name in self._where

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    def meta(self, name: str):
        """The tensor's dtype and shape (an empty tensor on torch's meta device), not read."""
        source, stored = self._where[name]
        return source.meta(stored) if hasattr(source, "meta") else source[stored].to("meta")


def read_checkpoint(src: str | os.PathLike) -> tuple[dict, Checkpoint]:
    """(config, Checkpoint) from a folder: config.json plus model.safetensors (or a sharded
    model.safetensors.index.json), else pytorch_model.bin (weights_only=True, or its index)."""
    # torch (and specc.weights.io, which imports it) only when tensors are read: the rest of
    # specc.importers.hf (the tables, describe(), config -> spec) works without it
    import torch

    from specc.weights.io import SafetensorsFile

    src = Path(src)
    if not src.is_dir():
        if src.suffix.lower() == ".gguf" and src.is_file():
            raise CheckpointError(f"{src}: a GGUF file, not a checkpoint folder; import it with "
                                  f"`specc import gguf {src} -o SPEC.yaml`")
        raise CheckpointError(f"{src}: not a checkpoint folder")
    cfg_path = src / "config.json"
    if not os.path.lexists(cfg_path):
        ggufs = sorted(p.name for p in src.glob("*.gguf"))[:3]
        if ggufs:
            raise CheckpointError(f"{src}: no config.json, but a GGUF file ({', '.join(ggufs)}); import it with "
                                  f"`specc import gguf {src / ggufs[0]} -o SPEC.yaml`")
        raise CheckpointError(f"{src}: no config.json")
    config = _read_json(_inside(src, cfg_path, str(cfg_path)))
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")

    # the first of these present is read (a link to nowhere or a FIFO is present, and refused)
    for name, kind in (("model.safetensors", "safetensors"), ("model.safetensors.index.json", "safetensors"),
                       ("pytorch_model.bin", "bin"), ("pytorch_model.bin.index.json", "bin")):
        first = src / name
        if os.path.lexists(first):
            _inside(src, first, str(first))
            note = f" (named by {first.name})" if name.endswith(".json") else ""
            files = _shards(src, first) if note else [first]
            break
    else:
        raise CheckpointError(f"{src}: no model.safetensors or pytorch_model.bin (nor a sharded index)")
    tensors = Checkpoint()
    for f in files:
        if kind == "safetensors":  # a regular file inside the folder (_inside); safetensors maps it by name
            try:
                tensors.add(SafetensorsFile(f))
            except WeightsError as exc:
                raise CheckpointError(f"{exc}{note}") from None
        else:
            fd, _ = _open_regular(f, note)
            try:
                with os.fdopen(fd, "rb") as fh:
                    # weights_only: tensors and plain containers only; never runs pickled code
                    state = torch.load(fh, map_location="cpu", weights_only=True)
            except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
                first = first_line(exc) or type(exc).__name__
                raise CheckpointError(f"{f}: cannot load it with torch.load(weights_only=True): {first}{note}") from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CheckpointError(f"{f}: not a state dict of tensors{note}")
            tensors.add(state)
    return config, tensors
