"""--precision int8 (dynamic quantization) and int4 (weight-only MatMulNBits): the graphs really
are quantized, stay within the integer tolerance of the fp32 torch model, are byte-reproducible,
and a quantized graph that computes something else fails the build."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

import specc
from specc.errors import VerificationError
from specc.export import quantize as q
from specc.runtime import Session


def _ops(path: Path) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in onnx.load(str(path)).graph.node:
        out[n.op_type] = out.get(n.op_type, 0) + 1
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    root = tmp_path_factory.mktemp("quant")
    cache = {}

    def get(spec: str, precision: str):
        if (spec, precision) not in cache:
            cache[(spec, precision)] = specc.build(spec, root / f"{spec}-{precision}", precision=precision, progress=None)
        return cache[(spec, precision)]

    return get


@pytest.mark.parametrize("spec", ["tiny-bert", "tiny-gpt2", "tiny-transformer"])
def test_int8_quantizes_every_matmul_weight_and_verifies(builds, spec):
    res = builds(spec, "int8")
    fp32 = builds(spec, "fp32")
    assert res.manifest["options"]["precision"] == "int8"
    for name, g in res.manifest["graphs"].items():
        ops = _ops(res.out_dir / g["file"])
        quantized = ops.get("MatMulInteger", 0) + ops.get("DynamicQuantizeMatMul", 0)
        fp32_ops = _ops(fp32.out_dir / g["file"])
        # every MatMul with a constant weight became an integer one; the activation x activation
        # products of attention stay float
        assert quantized >= 1, (name, ops)
        assert ops.get("MatMul", 0) < fp32_ops.get("MatMul", 0) + fp32_ops.get("FusedMatMul", 0)
        assert (res.out_dir / g["file"]).stat().st_size < (fp32.out_dir / g["file"]).stat().st_size
    v = res.manifest["verification"]
    assert v["precision"] == "int8" and v["max_abs_diff"] > 0  # it did change the numbers
    worst = max(o["max_rel"] for c in v["cases"] for o in c["outputs"].values())
    assert 0 < worst <= v["tolerance"]["rtol"] + 1e-3


@pytest.mark.parametrize("spec", ["tiny-gpt2", "tiny-llama"])
def test_int4_is_weight_only_matmulnbits_and_generates(builds, spec):
    res = builds(spec, "int4")
    ops = _ops(res.out_dir / "model.onnx")
    assert ops.get("MatMulNBits", 0) >= 1, ops
    assert "MatMulInteger" not in ops
    out = Session(res.out_dir).generate([1, 2, 3], max_new_tokens=4)
    assert len(out.new_ids[0]) == 4


def test_int8_output_is_close_to_fp32_but_not_equal(builds):
    ids = [[5, 6, 7, 8, 9]]
    a = Session(builds("tiny-bert", "fp32").out_dir).run(input_ids=ids)["last_hidden_state"]
    b = Session(builds("tiny-bert", "int8").out_dir).run(input_ids=ids)["last_hidden_state"]
    diff = float(np.abs(a - b).max())
    assert 0 < diff < 0.1 * float(np.abs(a).max())


def test_int8_builds_are_byte_reproducible(tmp_path):
    digests = []
    for i in range(2):
        res = specc.build("tiny-gpt2", tmp_path / f"b{i}", precision="int8", progress=None)
        digests.append(hashlib.sha256((res.out_dir / "model.onnx").read_bytes()).hexdigest())
    assert digests[0] == digests[1]


def test_a_quantized_graph_that_computes_something_else_fails_the_build(tmp_path, monkeypatch):
    real = q._dynamic_int8

    def broken(src, tmp):
        proto = real(src, tmp)
        # the vocabulary projection, its columns in reverse order: every logit lands on another token
        init = max((i for i in proto.graph.initializer if i.name.endswith("_quantized")), key=lambda i: len(i.raw_data))
        arr = onnx.numpy_helper.to_array(init)
        init.CopyFrom(onnx.numpy_helper.from_array(np.ascontiguousarray(arr[:, ::-1]), init.name))
        return proto

    monkeypatch.setattr(q, "_dynamic_int8", broken)
    with pytest.raises(VerificationError):
        specc.build("tiny-gpt2", tmp_path / "out", precision="int8", progress=None)
    assert not (tmp_path / "out").exists()
