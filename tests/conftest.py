"""Shared fixtures. Add new fixtures below; keep existing ones as they are."""
from __future__ import annotations

import functools
import os
import textwrap
from pathlib import Path
from typing import Callable

import pytest


@pytest.fixture
def spec_file(tmp_path: Path) -> Callable[..., Path]:
    """Write YAML text (dedented) to a file under tmp_path and return its path.

    ``spec_file(text, name="spec.yaml")``; ``name`` may contain sub-folders. Bytes are written as is.
    """

    def write(text: str | bytes, name: str = "spec.yaml") -> Path:
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(text, bytes):
            path.write_bytes(text)
        else:
            path.write_text(textwrap.dedent(text), encoding="utf-8")
        return path

    return write


def text_position(text: str, needle: str, occurrence: int = 1) -> tuple[int, int]:
    """1-based (line, column) of the ``occurrence``-th ``needle`` in ``text`` (dedented first).

    A ``^`` in needle marks the spot within it (``"size: ^0"`` is the 0); without one, the start."""
    text = textwrap.dedent(text)
    offset = max(needle.find("^"), 0)
    needle = needle.replace("^", "", 1)
    at = -1
    for _ in range(occurrence):
        at = text.index(needle, at + 1)
    at += offset
    line = text.count("\n", 0, at) + 1
    column = at - (text.rfind("\n", 0, at) + 1) + 1
    return line, column


@pytest.fixture
def position_of() -> Callable[..., tuple[int, int]]:
    """``position_of(text, needle, occurrence=1)`` -> 1-based (line, column) of needle in text;
    a ``^`` in needle marks the spot."""
    return text_position


# --- one trace per distinct module in a test run ------------------------------------------------
# torch.onnx.export's trace is most of a small build's time, and the suite builds the same tiny
# specs (same weights, same signature) at several precisions and targets, in many tests. Within a
# test process, export_graph's result for inputs it has seen is a copy of the first trace's, keyed
# by everything the trace reads: the module pickled whole (its structure, every attribute and
# weight), the signature, the example inputs and the opset. A module that does not pickle, or
# one past MEMO_PARAMETERS, is traced every time; the MEMO_ENTRIES last used are kept. A test that
# changes the modules' code (a monkeypatched method, which the pickle does not show) takes the
# `fresh_export` marker; SPECC_TESTS_NO_EXPORT_MEMO=1 turns the memo off. tests/test_export_memo.py
# checks that a build from the memo writes the bytes a fresh process does.
MEMO_PARAMETERS = 5_000_000
MEMO_ENTRIES = 64


def _export_key(model, sig, example, opset):
    import hashlib
    import io
    import pickle
    import types

    import torch

    from specc.spec.schema import ServingSpec

    if sum(p.numel() for p in model.parameters()) > MEMO_PARAMETERS:
        return None

    class Pickler(pickle.Pickler):  # a tensor by its dtype, shape and bytes (torch's own pickle is not deterministic)
        def persistent_id(self, obj):
            if isinstance(obj, torch.Tensor):
                t = obj.detach()
                data = t.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                return (str(t.dtype), tuple(t.shape), hashlib.sha256(data).hexdigest())
            return None

        def reducer_override(self, obj):
            if isinstance(obj, ServingSpec) and not _nn_reads_precision():  # fp32, int8 and int4 trace alike
                return str, ("ServingSpec",), obj.model_dump(exclude={"precision"})
            if isinstance(obj, types.FunctionType):  # a function (a lambda too) by its code and what it closes over
                cells = tuple(c.cell_contents for c in obj.__closure__ or ())
                return str, (f"{obj.__module__}.{obj.__qualname__}",), (obj.__code__.co_code, repr(obj.__code__.co_consts), cells)
            return NotImplemented

    buffer = io.BytesIO()
    try:
        Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump((model, sig, opset, example))
    except Exception:  # noqa: BLE001 - an unpicklable module is traced every time
        return None
    return hashlib.sha256(buffer.getvalue()).hexdigest()


@functools.cache
def _nn_reads_precision() -> bool:
    """Whether the modules' code mentions the precision (it does not: an integer build traces the
    fp32 module, an fp16 one a copy in fp16, whose weights the key holds)."""
    import specc.nn

    return any("precision" in p.read_text() for p in Path(specc.nn.__file__).parent.glob("*.py"))


@pytest.fixture(autouse=True)
def _export_memo(request, monkeypatch):
    from specc.export import onnx as onnx_export

    if request.node.get_closest_marker("fresh_export") or os.environ.get("SPECC_TESTS_NO_EXPORT_MEMO"):
        return
    real, memo = _EXPORT_MEMO.setdefault("real", onnx_export.export_graph), _EXPORT_MEMO.setdefault("memo", {})

    def export_graph(model, sig, example, opset=onnx_export.DEFAULT_OPSET):
        key = _export_key(model, sig, example, opset)
        if key is None:
            return real(model, sig, example, opset)
        if key not in memo:
            program = real(model, sig, example, opset)
            memo[key] = _copied(program.model)
            while len(memo) > MEMO_ENTRIES:
                del memo[next(iter(memo))]
            return program
        from torch.onnx import ONNXProgram

        memo[key] = memo.pop(key)  # the last used, last out
        _EXPORT_MEMO["hits"] = _EXPORT_MEMO.get("hits", 0) + 1
        return ONNXProgram(_copied(memo[key]), None)

    monkeypatch.setattr(onnx_export, "export_graph", export_graph)


_EXPORT_MEMO: dict = {}


def _copied(model):
    """A copy of an exported onnx_ir Model whose weights are its own (the exporter's tensors wrap
    the module's parameters, which a build empties when it is done: pipeline._release) and whose
    graph names new nodes and values as the original's would (its counters: a clone starts them
    at 0, and the optimizer's new constants would take other names)."""
    import copy as copying

    copy = model.clone()
    copy.graph._name_authority = copying.deepcopy(model.graph._name_authority)
    for value in copy.graph.initializers.values():
        tensor = value.const_value
        if tensor is not None and hasattr(tensor, "raw") and hasattr(tensor.raw, "detach"):
            value.const_value = type(tensor)(tensor.raw.detach().clone(), name=tensor.name)
    return copy
