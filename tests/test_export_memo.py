"""The suite's export memo (tests/conftest.py): a build whose trace comes from it writes the bytes
a fresh process writes, and the key tells apart what the trace reads."""
from __future__ import annotations

import os
import subprocess
import sys

from tests import conftest
import pytest
import specc
from specc.export import onnx as onnx_export
from specc.nn import to_torch
from specc.builder.pipeline import _load, _resolve


@pytest.mark.skipif(bool(os.environ.get("SPECC_TESTS_NO_EXPORT_MEMO")), reason="the export memo is off")
def test_a_build_from_the_memo_writes_what_a_fresh_process_does(tmp_path):
    specc.build("tiny-llama", tmp_path / "fp32")  # traced here, or earlier in this process
    hits = conftest._EXPORT_MEMO.get("hits", 0)
    specc.build("tiny-llama", tmp_path / "memo", precision="int8")
    assert conftest._EXPORT_MEMO.get("hits", 0) == hits + 1  # the int8 build traced nothing
    code = f"import specc; specc.build('tiny-llama', {str(tmp_path / 'fresh')!r}, precision='int8')"
    subprocess.run([sys.executable, "-c", code], check=True)
    files = sorted(p.name for p in (tmp_path / "fresh").iterdir() if p.suffix in (".onnx", ".data"))
    assert files == sorted(p.name for p in (tmp_path / "memo").iterdir() if p.suffix in (".onnx", ".data"))
    for name in files:
        assert (tmp_path / "memo" / name).read_bytes() == (tmp_path / "fresh" / name).read_bytes(), name


def test_the_key_sees_weights_and_dtype_but_not_the_integer_precision():
    keys = {}
    for precision, seed in (("fp32", 0), ("int8", 0), ("int4", 0), ("fp32", 1), ("fp16", 0)):
        r = _resolve(_load("tiny-llama"), precision, "onnx")
        model = to_torch(r, seed=seed)
        if precision == "fp16":
            model = model.half()
        sig = r.graphs[0]
        keys[precision, seed] = conftest._export_key(model, sig, onnx_export.example_inputs(r, sig), 18)
    assert keys["fp32", 0] == keys["int8", 0] == keys["int4", 0]
    assert len({keys["fp32", 0], keys["fp32", 1], keys["fp16", 0]}) == 3
