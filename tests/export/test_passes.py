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
from specc.builder.pipeline import _builds_engines, _ort_passes
from specc.spec.load import load_spec
from specc.spec.resolve import resolve

ort = pytest.importorskip("onnxruntime")


def _run(model: ir.Model, feed: dict) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def _exported(spec: str, dtype: torch.dtype = torch.float32) -> tuple[ir.Model, dict]:
    r = resolve(load_spec(spec))
    sig = r.graphs[0]
    program = onnx_export.export_graph(to_torch(r, seed=0).eval().to(dtype), sig, onnx_export.example_inputs(r, sig))
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
    assert _ort_passes(_builds_engines("onnx", "fp32")) == [*passes.PASSES, *passes.QUANTIZED_PASSES]
    assert _ort_passes(_builds_engines("tensorrt", "fp16")) == []


# --- fuse_attention ---------------------------------------------------------------------------------


def _attention_graph(*, heads=4, d=8, dv=8, t=5, s=5, scale_op="Div", mask=True, bias=True, bias_read_elsewhere=False,
                     causal=False, dtype=TensorProto.FLOAT, softmax_fp32=False) -> onnx.ModelProto:
    """Multi-head attention as the exporter writes it (tests/export/test_passes.py's reading of a
    specc encoder layer): q3/k3/v3 [B,N,H*D] (+ bias) -> Reshape -> Transpose -> MatMul ->
    (Div|Mul|none) -> (Where over keep [B,S] unsqueezed to [B,1,1,S] | causal [T,S]) -> Softmax ->
    MatMul -> Transpose -> Reshape [B,T,H*Dv]. softmax_fp32: the Softmax between a Cast to fp32 and
    one back (an fp16 graph, as specc's modules write it)."""
    B = "batch"
    nodes, inits, outputs = [], [], []
    inputs = [helper.make_tensor_value_info("xq", dtype, [B, t, heads * d]),
              helper.make_tensor_value_info("xk", dtype, [B, s, heads * d]),
              helper.make_tensor_value_info("xv", dtype, [B, s, heads * dv])]
    rng = np.random.default_rng(3)
    np_dtype = np.float32 if dtype == TensorProto.FLOAT else np.float16
    for name, width in (("q", heads * d), ("k", heads * d), ("v", heads * dv)):
        if bias:
            inits.append(helper.make_tensor(f"b{name}", dtype, [width], rng.normal(size=width).astype(np_dtype).tobytes(), raw=True))
            nodes.append(helper.make_node("Add", [f"x{name}", f"b{name}"], [f"{name}3"]))
        else:
            nodes.append(helper.make_node("Identity", [f"x{name}"], [f"{name}3"]))
    if bias_read_elsewhere:
        outputs.append(helper.make_tensor_value_info("q3", dtype, [B, t, heads * d]))
    inits += [helper.make_tensor("shape_q", TensorProto.INT64, [4], [0, t, heads, d]),
              helper.make_tensor("shape_k", TensorProto.INT64, [4], [0, s, heads, d]),
              helper.make_tensor("shape_v", TensorProto.INT64, [4], [0, s, heads, dv]),
              helper.make_tensor("shape_o", TensorProto.INT64, [3], [0, t, heads * dv])]
    if scale_op:
        c = math.sqrt(d) if scale_op == "Div" else 1 / math.sqrt(d)
        inits.append(helper.make_tensor("c", dtype, [], np.array(c, np_dtype).tobytes(), raw=True))
    nodes += [helper.make_node("Reshape", ["q3", "shape_q"], ["q4"]), helper.make_node("Transpose", ["q4"], ["qh"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["k3", "shape_k"], ["k4"]), helper.make_node("Transpose", ["k4"], ["kt"], perm=[0, 2, 3, 1]),
              helper.make_node("Reshape", ["v3", "shape_v"], ["v4"]), helper.make_node("Transpose", ["v4"], ["vh"], perm=[0, 2, 1, 3]),
              helper.make_node("MatMul", ["qh", "kt"], ["qk"])]
    scores = "qk"
    if scale_op:
        nodes.append(helper.make_node(scale_op, ["qk", "c"], ["scaled"]))
        scores = "scaled"
    if mask:
        inputs.append(helper.make_tensor_value_info("attention_mask", TensorProto.INT64, [B, s]))
        inits += [helper.make_tensor("axes", TensorProto.INT64, [2], [1, 2]),
                  helper.make_tensor("fill", dtype, [], np.array(np.finfo(np_dtype).min, np_dtype).tobytes(), raw=True)]
        nodes += [helper.make_node("Cast", ["attention_mask"], ["keep"], to=TensorProto.BOOL),
                  helper.make_node("Unsqueeze", ["keep", "axes"], ["keep4"])]
        cond = "keep4"
        if causal:
            inits.append(helper.make_tensor("tril", TensorProto.BOOL, [t, s], np.tril(np.ones((t, s), bool)).reshape(-1).tolist()))
            nodes.append(helper.make_node("And", ["keep4", "tril"], ["allowed"]))
            cond = "allowed"
        nodes.append(helper.make_node("Where", [cond, scores, "fill"], ["masked"]))
        scores = "masked"
    if softmax_fp32:
        nodes += [helper.make_node("Cast", [scores], ["scores32"], to=TensorProto.FLOAT),
                  helper.make_node("Softmax", ["scores32"], ["probs32"], axis=-1),
                  helper.make_node("Cast", ["probs32"], ["probs"], to=dtype)]
    else:
        nodes.append(helper.make_node("Softmax", [scores], ["probs"], axis=-1))
    nodes += [helper.make_node("MatMul", ["probs", "vh"], ["o4"]),
              helper.make_node("Transpose", ["o4"], ["o"], perm=[0, 2, 1, 3]),
              helper.make_node("Reshape", ["o", "shape_o"], ["out"])]
    outputs.insert(0, helper.make_tensor_value_info("out", dtype, [B, t, heads * dv]))
    graph = helper.make_graph(nodes, "attention", inputs, outputs, initializer=inits)
    return onnx.shape_inference.infer_shapes(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]))


def _attention_feed(t=5, s=5, heads=4, d=8, dv=8, mask=True) -> dict:
    rng = np.random.default_rng(0)
    feed = {"xq": rng.normal(size=(3, t, heads * d)).astype(np.float32),
            "xk": rng.normal(size=(3, s, heads * d)).astype(np.float32),
            "xv": rng.normal(size=(3, s, heads * dv)).astype(np.float32)}
    if mask:
        feed["attention_mask"] = np.ones((3, s), np.int64)
        feed["attention_mask"][1, s - 2:] = 0  # padding
        feed["attention_mask"][2] = 0  # nothing to attend to: the row averages the values
    return feed


def _torch_attention(proto: onnx.ModelProto, feed: dict, heads: int, scale: float) -> np.ndarray:
    """PyTorch's own scaled_dot_product_attention on the same inputs, masked as specc's modules
    mask (an additive mask of the dtype's minimum)."""
    biases = {i.name: torch.from_numpy(onnx.numpy_helper.to_array(i).copy()) for i in proto.graph.initializer}

    def split(name: str) -> torch.Tensor:
        x = torch.from_numpy(feed[f"x{name}"]) + biases.get(f"b{name}", 0)
        b, n, width = x.shape
        return x.reshape(b, n, heads, width // heads).transpose(1, 2)

    q, k, v = split("q"), split("k"), split("v")
    mask = None
    if "attention_mask" in feed:
        keep = torch.from_numpy(feed["attention_mask"]).bool()[:, None, None, :]
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1).numpy()


@pytest.mark.parametrize("scale_op", ["Div", "Mul", None])
@pytest.mark.parametrize("mask", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_fuse_attention_matches_torch_attention(scale_op, mask, bias):
    proto = _attention_graph(scale_op=scale_op, mask=mask, bias=bias)
    model = ir.from_proto(proto)
    feed = _attention_feed(mask=mask)
    before = _run(model, feed)[0]
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 1}
    ops = _ops(model)
    assert ops.count("MultiHeadAttention") == 1 and not {"Softmax", "Where", "Transpose", "Reshape", "MatMul"} & set(ops)
    if bias:
        assert "Add" not in ops  # the biases went into the fused node
    (fused,) = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
    folded = fused.inputs[3] if len(fused.inputs) > 3 else None
    assert (folded is not None) == bias
    assert not [name for name in model.graph.initializers if name in ("c", "fill", "axes", "shape_q")]
    after = _run(model, feed)[0]
    want = _torch_attention(proto, feed, heads=4, scale=1.0 if scale_op is None else 1 / math.sqrt(8))
    np.testing.assert_allclose(after, want, atol=1e-5, rtol=1e-5)
    np.testing.assert_allclose(after, before, atol=1e-5, rtol=1e-5)


def test_fuse_attention_takes_d_v_apart_from_d_k_and_cross_lengths():
    proto = _attention_graph(d=8, dv=6, t=3, s=7)
    model = ir.from_proto(proto)
    feed = _attention_feed(d=8, dv=6, t=3, s=7)
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 1}
    got = _run(model, feed)[0]
    assert got.shape == (3, 3, 24)
    np.testing.assert_allclose(got, _torch_attention(proto, feed, heads=4, scale=1 / math.sqrt(8)), atol=1e-5, rtol=1e-5)


def test_fuse_attention_keeps_a_bias_that_is_read_elsewhere():
    model = ir.from_proto(_attention_graph(bias_read_elsewhere=True))
    feed = _attention_feed()
    before = _run(model, feed)
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 1}
    (fused,) = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
    assert fused.inputs[3] is None  # no folded bias: q3 is a graph output too
    assert _ops(model).count("Add") == 3
    for a, b in zip(before, _run(model, feed)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("softmax_fp32", [True, False])
def test_fuse_attention_takes_fp16(softmax_fp32):
    """An fp16 graph, its softmax in fp32 between two Casts (as an fp16 build writes it) or in
    fp16: one fp16 MultiHeadAttention, within fp16's rounding of torch's fp32 attention."""
    proto = _attention_graph(dtype=TensorProto.FLOAT16, softmax_fp32=softmax_fp32)
    model = ir.from_proto(proto)
    feed = {k: v.astype(np.float16) if v.dtype == np.float32 else v for k, v in _attention_feed().items()}
    before = _run(model, feed)[0]
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 1}
    ops = _ops(model)
    assert ops.count("MultiHeadAttention") == 1 and not {"Softmax", "Cast", "Where", "MatMul"} & (set(ops) - {"Cast"})
    assert ops.count("Cast") == 2  # the mask to bool and to int32: the softmax's two are gone
    (fused,) = [n for n in model.graph if n.op_type == "MultiHeadAttention"]
    assert fused.inputs[3].dtype == ir.DataType.FLOAT16  # the folded bias in the graph's dtype
    after = _run(model, feed)[0]
    assert after.dtype == np.float16
    want = _torch_attention(proto, {k: v.astype(np.float32) if v.dtype == np.float16 else v for k, v in feed.items()},
                            heads=4, scale=1 / math.sqrt(8))
    np.testing.assert_allclose(after.astype(np.float32), want, atol=2e-2, rtol=2e-2)
    np.testing.assert_allclose(after.astype(np.float32), before.astype(np.float32), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["causal", "fp16-causal", "half-cast"])
def test_fuse_attention_leaves_what_the_kernel_cannot_take(case):
    """A causal mask (fp32 or fp16); a softmax whose Cast does not go back to the graph's dtype."""
    if case == "half-cast":
        proto = _attention_graph(dtype=TensorProto.FLOAT16, softmax_fp32=True)
        (back,) = [n for n in proto.graph.node if n.output == ["probs"]]
        back.attribute[0].i = TensorProto.DOUBLE
    else:
        proto = _attention_graph(causal=True, dtype=TensorProto.FLOAT16 if case == "fp16-causal" else TensorProto.FLOAT,
                                 softmax_fp32=case == "fp16-causal")
    model = ir.from_proto(proto)
    ops = _ops(model)
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 0}
    assert _ops(model) == ops


def test_both_passes_on_an_exported_fp16_encoder():
    """tiny-bert exported in fp16 (norms and softmax in fp32 between Casts): every layer's GELU and
    attention fused (some twenty nodes fewer a layer), the fp16 outputs kept within fp16's rounding."""
    model, feed = _exported("tiny-bert", torch.float16)
    before = _run(model, feed)
    nodes = len(list(model.graph))
    layers = len(resolve(load_spec("tiny-bert")).encoder.layers)
    assert passes.apply(model) == {"fuse_gelu": layers, "fuse_attention": layers}
    ops = _ops(model)
    assert "Softmax" not in ops and "Erf" not in ops and ops.count("MultiHeadAttention") == layers
    assert len(ops) <= nodes - 20 * layers
    for a, b in zip(before, _run(model, feed)):
        assert b.dtype == a.dtype
        np.testing.assert_allclose(b.astype(np.float32), a.astype(np.float32), atol=1e-2, rtol=1e-2)


def test_fuse_attention_on_exported_graphs():
    """tiny-bert: every layer's attention, the same outputs (padding and an all-masked row);
    tiny-transformer's model graph: the encoder's self-attention only; tiny-gpt2's causal
    attention with its cache stays written out."""
    model, feed = _exported("tiny-bert")
    feed["attention_mask"][0] = 0
    before = _run(model, feed)
    layers = len(resolve(load_spec("tiny-bert")).encoder.layers)
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": layers}
    ops = _ops(model)
    assert ops.count("MultiHeadAttention") == layers and "Softmax" not in ops and "Where" not in ops
    assert ops.count("Cast") == 2  # the keep mask to bool, and once to int32 for every layer
    for a, b in zip(before, _run(model, feed)):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)

    r = resolve(load_spec("tiny-transformer"))
    program = onnx_export.export_graph(to_torch(r, seed=0).eval(), r.graphs[0], onnx_export.example_inputs(r, r.graphs[0]))
    program.optimize()
    assert passes.apply(program.model, ["fuse_attention"]) == {"fuse_attention": len(r.encoder.layers)}

    model, _ = _exported("tiny-gpt2")
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 0}


def test_fuse_attention_needs_the_head_split_proven_by_the_shapes():
    """A Reshape whose leading dims are unknown could fold the batch into the sequence: not fused."""
    proto = _attention_graph()
    for vi in proto.graph.value_info:
        if vi.name in ("q3", "k3", "v3", "q4", "k4", "v4"):
            for dim in vi.type.tensor_type.shape.dim[:2]:
                dim.Clear()
    model = ir.from_proto(proto)
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 0}


def test_fuse_attention_leaves_a_mask_broadcast_over_the_batch():
    proto = _attention_graph()
    (mask,) = [i for i in proto.graph.input if i.name == "attention_mask"]
    mask.type.tensor_type.shape.dim[0].Clear()
    mask.type.tensor_type.shape.dim[0].dim_value = 1
    proto = onnx.shape_inference.infer_shapes(proto)
    model = ir.from_proto(proto)
    assert passes.apply(model, ["fuse_attention"]) == {"fuse_attention": 0}
