"""specc's graph passes (specc/export/passes): each one changes the graph as it says and leaves
what the graph computes unchanged (onnxruntime before vs after, and against PyTorch's own GELU)."""
from __future__ import annotations

import math

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from specc.export import onnx as onnx_export
from specc.export import passes
from specc.nn import to_torch
from specc.pipeline import _builds_engines, _ort_passes
from specc.spec.load import load_spec
from specc.spec.resolve import resolve

ort = pytest.importorskip("onnxruntime")


def _run(model: ir.Model, feed: dict) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def _exported(spec: str) -> tuple[ir.Model, dict]:
    r = resolve(load_spec(spec))
    sig = r.graphs[0]
    program = onnx_export.export_graph(to_torch(r, seed=0).eval(), sig, onnx_export.example_inputs(r, sig))
    program.optimize()
    rng = np.random.default_rng(0)
    feed = {"input_ids": rng.integers(0, r.vocab.size, size=(2, 9)), "attention_mask": np.ones((2, 9), np.int64),
            "token_type_ids": np.zeros((2, 9), np.int64), "position_ids": np.tile(np.arange(9), (2, 1))}
    feed["attention_mask"][1, 6:] = 0
    return program.model, {t.name: feed[t.name] for t in sig.inputs if t.name in feed}


def _ops(model: ir.Model) -> list[str]:
    return [n.op_type for n in model.graph]


def test_fuse_gelu_on_an_exported_encoder_fires_once_per_layer_and_keeps_the_outputs():
    model, feed = _exported("tiny-bert")
    before = _run(model, feed)
    layers = len(resolve(load_spec("tiny-bert")).encoder.layers)
    assert _ops(model).count("Erf") == layers
    fired = passes.apply(model, ["fuse_gelu"])
    assert fired == {"fuse_gelu": layers}
    ops = _ops(model)
    assert "Erf" not in ops and ops.count("BiasGelu") == layers
    assert model.graph.opset_imports.get("com.microsoft") == 1
    after = _run(model, feed)
    for a, b in zip(before, after):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_fuse_gelu_leaves_the_tanh_form_alone():
    model, _ = _exported("tiny-gpt2")
    ops = _ops(model)
    assert passes.apply(model, ["fuse_gelu"]) == {"fuse_gelu": 0}
    assert _ops(model) == ops


def _gelu_graph(order: str, extra_use: bool) -> onnx.ModelProto:
    """y = Add(x, b); GELU(y) as the exporter writes it, in one of its two node orders; with
    extra_use, y is also a graph output (so the bias Add must stay)."""
    c = lambda name, v: helper.make_tensor(name, TensorProto.FLOAT, [], [v])  # noqa: E731
    nodes = [helper.make_node("Add", ["x", "b"], ["y"]),
             helper.make_node("Div", ["y", "sqrt2"], ["s"]),
             helper.make_node("Erf", ["s"], ["e"]),
             helper.make_node("Add", ["e", "one"], ["e1"])]
    if order == "half_first":
        nodes += [helper.make_node("Mul", ["half", "e1"], ["h"]), helper.make_node("Mul", ["y", "h"], ["out"])]
    else:
        nodes += [helper.make_node("Mul", ["y", "e1"], ["h"]), helper.make_node("Mul", ["h", "half"], ["out"])]
    outputs = [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 3, 8])]
    if extra_use:
        outputs.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 8]))
    bias = helper.make_tensor("b", TensorProto.FLOAT, [8], np.linspace(-1, 1, 8).astype(np.float32))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8])], outputs,
                              initializer=[bias, c("sqrt2", math.sqrt(2)), c("one", 1.0), c("half", 0.5)])
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


@pytest.mark.parametrize("order", ["half_first", "half_last"])
@pytest.mark.parametrize("extra_use", [False, True])
def test_fuse_gelu_matches_torch_gelu(order, extra_use):
    model = ir.from_proto(_gelu_graph(order, extra_use))
    assert passes.apply(model, ["fuse_gelu"]) == {"fuse_gelu": 1}
    assert _ops(model) == (["Add", "Gelu"] if extra_use else ["BiasGelu"])
    x = np.random.default_rng(1).normal(scale=3.0, size=(2, 3, 8)).astype(np.float32)
    b = np.linspace(-1, 1, 8).astype(np.float32)
    got = _run(model, {"x": x})[0]
    want = torch.nn.functional.gelu(torch.from_numpy(x + b)).numpy()  # the exact (erf) GELU
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5)


def test_a_wrong_constant_is_not_fused():
    proto = _gelu_graph("half_first", False)
    for init in proto.graph.initializer:
        if init.name == "half":
            init.float_data[:] = [0.25]
    model = ir.from_proto(proto)
    assert passes.apply(model, ["fuse_gelu"]) == {"fuse_gelu": 0}
    assert "Erf" in _ops(model)


def test_unknown_pass_is_refused():
    with pytest.raises(ValueError, match="unknown graph pass 'nope'"):
        passes.apply(ir.from_proto(_gelu_graph("half_first", False)), ["nope"])


def test_onnxruntime_passes_never_reach_tensorrt():
    assert _ort_passes(_builds_engines("onnx", "fp32")) == list(passes.PASSES)
    assert _ort_passes(_builds_engines("tensorrt", "fp16")) == []
