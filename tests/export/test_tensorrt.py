"""The TensorRT target. Without TensorRT (and a GPU) here, the tested parts are the pure ones:
optimization profiles from the spec's serving ranges, precision flags, the compatibility check
of our real exported graphs against specc/export/tensorrt_ops.py, the parser-error report, and
`specc build --target tensorrt` failing up front. Engine build + verification is marked
`tensorrt` and skips without TensorRT and CUDA."""
from __future__ import annotations

import importlib.util
import time

import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from specc.cli import main
from specc.errors import BuildError
from specc.export import tensorrt as trtx
from specc.export import tensorrt_ops
from specc.builder import pipeline
from specc.builder.pipeline import _ort_passes as real_ort_passes
from specc.builder.pipeline import build
from specc.spec.load import load_spec
from specc.spec.resolve import resolve
from specc.spec.schema import LocalPattern

HAVE_TRT = importlib.util.find_spec("tensorrt") is not None


@pytest.fixture(scope="module")
def graphs(tmp_path_factory):
    """Our real exported graphs as the tensorrt target exports them (without the onnxruntime
    passes, pipeline._ort_passes(engines=True)): a decoder with KV cache and an encoder-decoder.
    (`build` itself refuses the tensorrt target where TensorRT is missing.)"""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pipeline, "_ort_passes", lambda engines: real_ort_passes(True))
        for name in ("tiny-llama", "tiny-transformer"):
            d = tmp_path_factory.mktemp("b") / name
            build(name, d)
            out[name] = {sig.name: onnx.load(str(d / f"{sig.name}.onnx")) for sig in resolve(load_spec(name)).graphs}
    return out


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-transformer"])
def test_profiles_cover_serving_ranges(name):
    r = resolve(load_spec(name))
    b, n = r.serving.batch, r.serving.length
    for sig in r.graphs:
        prof = trtx.profile_shapes(r, sig)
        assert list(prof) == [t.name for t in sig.inputs]
        for t in sig.inputs:
            lo, mid, hi = prof[t.name]
            assert len(lo) == len(mid) == len(hi) == len(t.dims)
            for d, a, m, c in zip(t.dims, lo, mid, hi):
                assert 0 <= a <= m <= c, (t.name, d)
                if isinstance(d, int):
                    assert a == m == c == d
                elif d == "batch":
                    assert (a, m, c) == (b.min, b.opt, b.max)
                elif d == "past_sequence":  # empty at prefill, at most length.max - 1 before the last step
                    assert a == 0 and c == n.max - 1
                else:
                    assert (a, c) == (n.min, n.max)
    if name == "tiny-gpt2":  # the KV cache inputs are in the profile
        assert any(k.startswith("past_key_values.") for k in trtx.profile_shapes(r, r.graphs[0]))


def _qdq_graph():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", 4])
    s = helper.make_tensor("s", TensorProto.FLOAT, [], [0.1])
    z = helper.make_tensor("z", TensorProto.INT8, [], [0])
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"], name="q0"),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], name="dq0")]
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y], [s, z]), opset_imports=[helper.make_opsetid("", 18)])


def test_precision_flags():
    assert trtx.precision_flags("fp32") == ()
    assert trtx.precision_flags("fp16") == ("FP16",)
    assert trtx.precision_flags("bf16") == ("BF16",)
    assert trtx.precision_flags("int8", _qdq_graph()) == ("INT8",)
    with pytest.raises(BuildError, match="QuantizeLinear/DequantizeLinear"):
        trtx.precision_flags("int8", helper.make_model(helper.make_graph([], "g", [], [])))
    with pytest.raises(BuildError, match="int4"):
        trtx.precision_flags("int4")


def test_our_exported_graphs_pass_the_check(graphs):
    for name, by_graph in graphs.items():
        for graph, model in by_graph.items():
            assert trtx.findings(model) == [], f"{name} {graph}"
            kinds = {n.op_type for n in model.graph.node}
            assert kinds <= tensorrt_ops.SUPPORTED
            trtx.check_compatible(model, graph)


def _graph_with(nodes, opset=18, extra_opsets=()):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])
    return helper.make_model(helper.make_graph(nodes, "g", [x], [y]),
                             opset_imports=[helper.make_opsetid("", opset), *extra_opsets])


def test_unsupported_ops_named_in_error():
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="ok_relu"),
             helper.make_node("MatMulInteger", ["a", "a"], ["b"], name="layer0/mm_int"),
             helper.make_node("FusedMatMul", ["b", "b"], ["c"], name="ms_fused", domain="com.microsoft"),
             helper.make_node("Unique", ["c"], ["y"], name="uniq")]
    model = _graph_with(nodes, extra_opsets=[helper.make_opsetid("com.microsoft", 1)])
    found = trtx.findings(model)
    assert len(found) == 3
    with pytest.raises(BuildError) as err:
        trtx.check_compatible(model, "decoder")
    msg = str(err.value)
    for node in ("layer0/mm_int", "ms_fused", "uniq"):
        assert node in msg
    assert "ok_relu" not in msg and "decoder graph" in msg


def test_control_flow_attributes_and_opset_refused():
    body = helper.make_graph([], "body", [], [])
    nodes = [helper.make_node("Loop", ["", ""], [], name="loop0", body=body),
             helper.make_node("Einsum", ["x", "x"], ["y"], name="ein0", equation="...ij,...jk->...ik")]
    found = trtx.findings(_graph_with(nodes, opset=21))
    assert any(f.startswith("opset 21") for f in found)
    assert any("loop0" in f and "control flow" in f for f in found)
    assert any("ein0" in f and "ellipsis" in f for f in found)
    ok = _graph_with([helper.make_node("Einsum", ["x", "x"], ["y"], name="e", equation="ij,jk->ik")])
    assert trtx.findings(ok) == []


def test_parser_error_report():
    class Err:  # the attributes of TensorRT's ParserError this report reads
        def __init__(self, node, name, op, desc):
            self._v = (node, name, op, desc)

        def node(self): return self._v[0]
        def node_name(self): return self._v[1]
        def node_operator(self): return self._v[2]
        def desc(self): return self._v[3]

    class Parser:
        errors = [Err(3, "attn/Einsum_3", "Einsum", "unsupported equation"), Err(7, "", "", "bad weights")]
        num_errors = 2

        def get_error(self, i): return self.errors[i]

    lines = trtx.parser_errors(Parser()).split("\n  ")
    assert lines == ["node attn/Einsum_3 (Einsum): unsupported equation", "node #7: bad weights"]


def test_timing_cache_path(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECC_CACHE_DIR", str(tmp_path))
    assert trtx.timing_cache_path() == tmp_path / "tensorrt" / "timing.cache"
    monkeypatch.delenv("SPECC_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert trtx.timing_cache_path() == tmp_path / "x" / "specc" / "tensorrt" / "timing.cache"


@pytest.mark.skipif(HAVE_TRT, reason="TensorRT is installed; this checks the message without it")
def test_build_without_tensorrt_fails_up_front(tmp_path):
    out = tmp_path / "engine"
    t0 = time.perf_counter()
    result = CliRunner().invoke(main, ["build", "tiny-gpt2", "--target", "tensorrt", "-o", str(out)])
    assert result.exit_code == 1
    assert "TensorRT" in result.output and "pip install 'specc[gpu,tensorrt]'" in result.output
    assert "Traceback" not in result.output and "export" not in result.output  # before any export work
    assert time.perf_counter() - t0 < 5
    assert not out.exists()


@pytest.mark.tensorrt
@pytest.mark.skipif(not HAVE_TRT, reason="TensorRT is not installed (it comes from NVIDIA's index with a CUDA GPU)")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_engine_builds_and_matches(tmp_path, monkeypatch, precision):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("TensorRT engines need a CUDA GPU")
    monkeypatch.setenv("SPECC_CACHE_DIR", str(tmp_path / "cache"))
    result = build("tiny-gpt2", tmp_path / "out", target="tensorrt", precision=precision)
    assert (tmp_path / "out" / "model.plan").stat().st_size > 0
    assert (tmp_path / "cache" / "tensorrt" / "timing.cache").stat().st_size > 0
    assert result.manifest["verification_tensorrt"]["passed"]
    assert len(result.manifest["verification_tensorrt"]["cases"]) == len(result.manifest["verification"]["cases"])


def test_window_cache_profiles_are_capped_at_the_window():
    spec = load_spec("tiny-llama")
    att = spec.decoder.attention.model_copy(update={"pattern": LocalPattern(window=10)})
    r = resolve(spec.model_copy(update={"decoder": spec.decoder.model_copy(update={"attention": att})}))
    prof = trtx.profile_shapes(r, r.graphs[0])
    lo, mid, hi = prof["past_key_values.0.key"]
    n = r.serving.length
    assert (lo[2], mid[2], hi[2]) == (0, min(10, n.opt), 10)
    assert prof["attention_mask"][2][1] == n.max  # the mask still covers the whole sequence
