"""fp16 safety: a model whose hidden values are large (position embeddings ~N(0, 1000), so
mean(x^2) and var(x) are ~1e6, far past fp16's 65504) stays finite and within the fp16
tolerance of the fp32 torch module in specc's fp16 build, where a naive conversion of the fp32
graph (every float initializer, constant, cast and IO to fp16) does not.

The graphs are run by onnx's reference evaluator, which computes every op in its declared type:
onnxruntime's CPU provider runs many fp16 ops in fp32 internally (inserted casts, fused norms),
which would hide the overflow that a GPU provider or another runtime shows. specc's build is also
run through onnxruntime, as a user would."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

import specc
from specc.export.verify import tolerance

pytestmark = pytest.mark.xdist_group("test_fp16_safety")  # one worker: the module's shared builds are made once

SPEC = """\
specc: 1
name: big-activations
architecture: decoder
d_model: 64
vocab:
  size: 100
position:
  kind: learned
  max_length: 64
norm:
  kind: {norm}
  placement: pre
decoder:
  layers: 2
  attention:
    heads: 4
  ffn:
    d_ff: 128
serving:
  length: {{min: 1, opt: 16, max: 64}}
"""
BATCH, SEQ = 2, 16


def naive_fp16(src, dst) -> None:
    """What a plain float->half cast of a graph does: no op is kept in fp32."""
    g = onnx.load(str(src))
    for init in g.graph.initializer:
        if init.data_type == TensorProto.FLOAT:
            with np.errstate(over="ignore"):
                init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init).astype(np.float16), init.name))
    for node in g.graph.node:
        for at in node.attribute:
            if at.type == onnx.AttributeProto.TENSOR and at.t.data_type == TensorProto.FLOAT:
                with np.errstate(over="ignore"):
                    at.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(at.t).astype(np.float16), at.t.name))
            if node.op_type == "Cast" and at.name == "to" and at.i == TensorProto.FLOAT:
                at.i = TensorProto.FLOAT16
    for v in [*g.graph.input, *g.graph.output]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.FLOAT16
    del g.graph.value_info[:]
    onnx.save(g, str(dst))


def float_values(path) -> dict[str, np.ndarray]:
    g = onnx.load(str(path))
    values = {i.name: numpy_helper.to_array(i) for i in g.graph.initializer}
    for node in g.graph.node:
        for at in node.attribute:
            if at.type == onnx.AttributeProto.TENSOR:
                values[node.output[0]] = numpy_helper.to_array(at.t)
    return {k: v for k, v in values.items() if v.dtype.kind == "f"}


@pytest.fixture(scope="module", params=["rmsnorm", "layernorm"])
def builds(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    spec = tmp / "spec.yaml"
    spec.write_text(SPEC.format(norm=request.param))
    model = specc.to_torch(spec, seed=0)
    with torch.no_grad():
        model.decoder.positions.weight.normal_(0.0, 1000.0, generator=torch.Generator().manual_seed(1))
    weights = tmp / "big.safetensors"
    specc.save_weights(model, weights)
    specc.build(spec, tmp / "fp32", weights=weights)
    result = specc.build(spec, tmp / "fp16", weights=weights, precision="fp16")
    naive_fp16(tmp / "fp32" / "model.onnx", tmp / "naive.onnx")
    return model, tmp, result


def feed(padded: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    ids = rng.integers(0, 100, (BATCH, SEQ))
    mask = np.ones_like(ids)
    if padded:
        mask[0, :5] = 0  # left padding: those query rows see no key at all
    out = {"input_ids": ids, "attention_mask": mask,
           "position_ids": np.broadcast_to(np.arange(SEQ), (BATCH, SEQ)).copy()}
    for layer in range(2):
        for kv in ("key", "value"):
            out[f"past_key_values.{layer}.{kv}"] = np.zeros((BATCH, 4, 0, 16), np.float32)
    return out


def torch_logits(model, inputs) -> np.ndarray:
    with torch.no_grad():
        out = model(**{k: torch.from_numpy(v) for k, v in inputs.items() if not k.startswith("past")})
    return out["logits"].float().numpy()


def evaluate(path, inputs) -> np.ndarray:
    f16 = {k: (v.astype(np.float16) if v.dtype.kind == "f" else v) for k, v in inputs.items()}
    with np.errstate(all="ignore"):
        return ReferenceEvaluator(str(path)).run(["logits"], f16)[0].astype(np.float32)


def within(got, want) -> bool:
    atol, rtol = tolerance("onnx", "fp16")
    return bool(np.isfinite(got).all() and (np.abs(got - want) <= atol + rtol * np.abs(want)).all())


def test_hidden_values_are_past_fp16_range(builds):
    # the premise: the squares the norms average overflow fp16
    model, _, _ = builds
    x = model.decoder.positions.weight.detach()
    assert float(x.pow(2).mean(-1).min()) > float(torch.finfo(torch.float16).max)


@pytest.mark.parametrize("padded", [False, True])
def test_fp16_build_stays_finite_where_a_naive_cast_does_not(builds, padded):
    model, tmp, result = builds
    assert result.verification["passed"]
    inputs = feed(padded)
    want = torch_logits(model, inputs)
    assert np.isfinite(want).all()
    specc16 = evaluate(tmp / "fp16" / "model.onnx", inputs)
    naive = evaluate(tmp / "naive.onnx", inputs)
    assert within(specc16, want), float(np.nanmax(np.abs(specc16 - want)))
    assert not within(naive, want)  # overflowed: inf/NaN, or norms that collapsed to 0


def test_fp16_build_through_onnxruntime(builds):
    import onnxruntime as ort

    model, tmp, _ = builds
    inputs = feed(padded=True)
    session = ort.InferenceSession(str(tmp / "fp16" / "model.onnx"), providers=["CPUExecutionProvider"])
    f16 = {k: (v.astype(np.float16) if v.dtype.kind == "f" else v) for k, v in inputs.items()}
    assert within(session.run(["logits"], f16)[0].astype(np.float32), torch_logits(model, inputs))


def test_mask_constant_is_finite_in_fp16(builds):
    _, tmp, _ = builds
    f16 = float_values(tmp / "fp16" / "model.onnx")
    half = {k: v for k, v in f16.items() if v.dtype == np.float16}
    assert half and all(np.isfinite(v).all() for v in half.values())
    # fp32 constants left in the fp16 graph are the norms' own (eps, the exponent), all finite
    assert all(np.isfinite(v).all() for v in f16.values())
    # the mask fill is fp16's most negative finite value; the naive cast turns fp32's into -inf
    assert any(v.size == 1 and float(v) == float(np.finfo(np.float16).min) for v in half.values())
    naive = float_values(tmp / "naive.onnx")
    assert any(v.size == 1 and np.isneginf(v).all() for v in naive.values())
