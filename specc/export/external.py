"""Initializers shared between graph files of one build folder: a graph composed from a build's
verified graphs (Optimum's merged decoder, the in-place cache graph) refers to the bytes those
graphs' files already hold, as ONNX external data, instead of writing every weight again.
"""
from __future__ import annotations

import mmap
from pathlib import Path

from specc.errors import BuildError

# smaller initializers stay in a graph's own file (onnx's own threshold); a composed graph copies them
INLINE_BYTES = 1024


def referenced(tensor, root: Path, file: str, name: str):
    """TENSOR as an initializer named NAME of a graph made from FILE's: external data where FILE (or its
    own external data) already holds the bytes, a copy where it is small."""
    import onnx

    out = onnx.TensorProto()
    out.CopyFrom(tensor)
    out.name = name
    if tensor.data_location == onnx.TensorProto.EXTERNAL or len(tensor.raw_data) < INLINE_BYTES:
        return out  # already a reference into a file of the same folder, or small
    offset, length = _raw_offsets(root / file)[tensor.name]
    out.ClearField("raw_data")
    out.data_location = onnx.TensorProto.EXTERNAL
    for key, val in (("location", file), ("offset", str(offset)), ("length", str(length))):
        item = out.external_data.add()
        item.key, item.value = key, val
    return out


_OFFSETS: dict[tuple[str, float], dict[str, tuple[int, int]]] = {}


def _raw_offsets(path: Path) -> dict[str, tuple[int, int]]:
    """initializer name -> (offset, length) of its raw_data in an .onnx file, read off the
    protobuf wire format: ModelProto.graph (field 7) -> GraphProto.initializer (5) ->
    TensorProto.name (8) and raw_data (9). Cached per file and modification time."""
    key = (str(path), path.stat().st_mtime)
    if key not in _OFFSETS:
        out: dict[str, tuple[int, int]] = {}
        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            for field, start, end in _fields(buf, 0, len(buf)):
                if field != 7:
                    continue
                for field2, start2, end2 in _fields(buf, start, end):
                    if field2 != 5:
                        continue
                    name = raw = None
                    for field3, start3, end3 in _fields(buf, start2, end2):
                        if field3 == 8:
                            name = bytes(buf[start3:end3]).decode()
                        elif field3 == 9:
                            raw = (start3, end3 - start3)
                    if name is not None and raw is not None:
                        out[name] = raw
        _OFFSETS[key] = out
    return _OFFSETS[key]


def _fields(buf, pos: int, end: int):
    """(field number, start, end) of each length-delimited field between POS and END; others skipped."""
    while pos < end:
        key, pos = _varint(buf, pos)
        wire = key & 7
        if wire == 0:
            _, pos = _varint(buf, pos)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 2:
            n, pos = _varint(buf, pos)
            yield key >> 3, pos, pos + n
            pos += n
        else:
            raise BuildError(f"unreadable protobuf wire type {wire}")


def _varint(buf, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
