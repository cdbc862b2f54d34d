"""The merge_products pass (specc/export/passes/merge_products.py): an integer build's products
that read one input (q, k and v; gate and up) become one MatMulNBits and a Split, and the graphs
compute what the unmerged build's compute bit for bit (array equality, not a tolerance): model.onnx
on a prompt, and the in-place graph's prefill, single steps and a several-position call. At int4
(fp32 and int8 activations), and on a GGUF file's Q4_1 blocks, whose offset form merges too."""
from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

import specc
from specc.builder import pipeline
from specc.export import passes
from specc.runtime import Session
from specc.runtime.generate import InplaceRunner

ort = pytest.importorskip("onnxruntime")

PROMPT = [5, 17, 3, 90, 42, 8, 64, 23, 11, 70, 2, 31]


def _build(spec, out, merged: bool, monkeypatch, **options):
    with monkeypatch.context() as m:
        if not merged:
            m.setattr(pipeline, "QUANTIZED_PASSES", {})
        specc.build(spec, out, progress=None, **options)
    return Session(out)


def _ops(session: Session, graph: str) -> dict[str, int]:
    path = session.dir / f"{graph}.onnx"
    ops: dict[str, int] = {}
    for n in onnx.load(str(path), load_external_data=False).graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return ops


def _outputs(session: Session) -> list[np.ndarray]:
    """model.onnx's logits on PROMPT; the in-place graph's prefill, 4 single steps and one call of 5."""
    got = [session.run(input_ids=[PROMPT])["logits"]]
    runner = InplaceRunner(session, [PROMPT], 12)
    got.append(runner.prefill())
    for token in (7, 19, 4, 60):
        got.append(runner.step(np.array([token])))
    got.append(runner.extend(np.array([[9, 1, 88, 14, 6]])))
    return got


def _same(a: Session, b: Session) -> None:
    for x, y in zip(_outputs(a), _outputs(b), strict=True):
        assert x.shape == y.shape and np.array_equal(x, y), float(np.abs(x - y).max())


@pytest.mark.parametrize("precision, activations", [("int4", "fp32"), ("int4", "int8"), ("int8", None)])
def test_an_integer_build_merges_q_k_v_and_gate_up_and_computes_the_same_bits(tmp_path, monkeypatch, precision,
                                                                              activations):
    """int4 (blocks of 32, no zero points) at fp32 and int8 activations; int8 (blocks of 16 with
    zero points)."""
    options = {"precision": precision, **({"activations": activations} if activations else {})}
    merged = _build("tiny-llama", tmp_path / "merged", True, monkeypatch, **options)
    plain = _build("tiny-llama", tmp_path / "plain", False, monkeypatch, **options)
    layers = 2
    for graph in ("model", "inplace"):
        before, after = _ops(plain, graph), _ops(merged, graph)
        # per layer q, k, v -> 1 and gate, up -> 1; o, down and the head stay
        assert after["MatMulNBits"] == before["MatMulNBits"] - 3 * layers, (graph, before, after)
        assert after.get("Split", 0) == before.get("Split", 0) + 2 * layers
    fusions = [o["fusions"] for o in merged.manifest["optimizations"] if "merge_products" in o.get("fusions", {})]
    assert fusions == [{"merge_products": 2 * layers}]
    _same(merged, plain)


def test_a_q4_1_file_merges_its_offset_form_and_computes_the_same_bits(tmp_path, monkeypatch):
    """Q4_1's minima: each product is codes + (block sums) @ offsets, added; the merged products'
    offsets merge too, one Add before the Split."""
    pytest.importorskip("gguf", reason="the gguf package (make install-real-models)")
    from specc.importers.gguf import import_gguf
    from tests.helpers.ggufwrite import write_gguf
    from tests.importers.test_gguf_import import hf_model

    file = tmp_path / "tiny-llama.Q4_1.gguf"
    write_gguf(hf_model("llama"), file, "Q4_1")
    spec, _ = import_gguf(file, tmp_path / "m.yaml")
    merged = _build(spec, tmp_path / "merged", True, monkeypatch, precision="gguf")
    plain = _build(spec, tmp_path / "plain", False, monkeypatch, precision="gguf")
    before, after = _ops(plain, "model"), _ops(merged, "model")
    assert after["MatMulNBits"] == before["MatMulNBits"] - 6  # 2 layers: q, k, v and gate, up
    assert after["Add"] == before["Add"] - 6 and after["MatMul"] == before["MatMul"] - 6  # their offsets' too
    _same(merged, plain)


def _product(name: str, x: str, n: int, k: int, bits: int, level: int, rng) -> tuple:
    blocks = k // 32
    codes = numpy_helper.from_array(rng.integers(0, 256, (n, blocks, 32 * bits // 8), dtype=np.uint8), f"{name}.codes")
    scales = numpy_helper.from_array(rng.random(n * blocks, dtype=np.float32) / 16, f"{name}.scales")
    node = helper.make_node("MatMulNBits", [x, codes.name, scales.name], [name], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=32, accuracy_level=level)
    return node, [codes, scales]


def test_only_products_alike_that_read_one_input_merge():
    """Products of x: two alike at 4 bits and level 4, one at level 1, one at 8 bits, one whose N
    is no multiple of 16, one whose result is a graph output (a head); one of another input. The
    two alike merge, nothing else, and every result is what it was."""
    rng = np.random.default_rng(0)
    k = 64
    made = [_product("a", "x", 32, k, 4, 4, rng), _product("b", "x", 48, k, 4, 4, rng),
            _product("c", "x", 16, k, 4, 1, rng), _product("d", "x", 16, k, 8, 4, rng),
            _product("e", "x", 24, k, 4, 4, rng), _product("f", "x", 16, k, 4, 4, rng),
            _product("g", "z", 16, k, 4, 4, rng)]
    read = [helper.make_node("Neg", [name], [f"{name}.out"]) for name in "abcdeg"]  # f: a graph output itself
    outputs = [f"{name}.out" for name in "abcdeg"] + ["f"]
    graph = helper.make_graph(
        [node for node, _ in made] + read, "g",
        [helper.make_tensor_value_info(v, TensorProto.FLOAT, [1, 3, k]) for v in ("x", "z")],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs],
        [t for _, ts in made for t in ts])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    feed = {v: rng.standard_normal((1, 3, k)).astype(np.float32) for v in ("x", "z")}

    def run(p):
        return ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feed)

    want = run(proto)
    model = ir.serde.deserialize_model(proto)
    assert passes.apply(model, ["merge_products"], quantized=True) == {"merge_products": 1}
    products = [n for n in model.graph if n.op_type == "MatMulNBits"]
    assert len(products) == 6 and sum(n.op_type == "Split" for n in model.graph) == 1
    assert sorted(n.attributes["N"].value for n in products) == [16, 16, 16, 16, 24, 80]  # a + b: 80
    assert [o.name for o in model.graph.outputs] == outputs
    got = run(ir.serde.serialize_model(model))
    for w, g in zip(want, got, strict=True):
        assert np.array_equal(w, g)
