"""--precision int8 and int4 (weight-only integer blocks, MatMulNBits): the packing is the layout
onnxruntime's kernel reads, the graphs really are quantized, pass the quality bar against the
fp32 torch model, are byte-reproducible, and a quantized graph with a planted defect (a wrong
scale, swapped blocks) fails the build."""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import onnx
import pytest

import specc
from specc.errors import VerificationError
from specc.export import quantize as q
from specc.spec.targets import DEQUANTIZED_BAR
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


def _matmul_nbits(p: q.Packed, k: int, n: int, scheme: q.Scheme, accuracy_level: int):
    """A one-node graph: onnxruntime's own MatMulNBits on a Packed weight."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(p.codes, "B"), numpy_helper.from_array(p.scales, "S")]
    if p.zero_points is not None:
        inits.append(numpy_helper.from_array(p.zero_points, "Z"))
    node = helper.make_node("MatMulNBits", ["X", *(t.name for t in inits)], ["Y"], domain="com.microsoft", K=k, N=n,
                            bits=scheme.bits, block_size=scheme.block, accuracy_level=accuracy_level)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, ["M", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("com.microsoft", 1)])
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("k", [64, 100, 33])
def test_packing_is_the_layout_onnxruntime_reads(precision, k):
    """onnxruntime's MatMulNBits (at accuracy level 0: fp32 arithmetic) multiplies by exactly the
    weight unpack() says the codes hold, and that weight is within half a step of the original
    (int4's symmetric form: a step, for weights at the far end from the block's extreme, which
    clamp to the top code as Q4_0's do)."""
    scheme = q.SCHEMES[precision]
    rng = np.random.default_rng(k)
    w = rng.standard_normal((k, 24)).astype(np.float32)
    p = q.pack(w, scheme)
    assert (p.zero_points is None) == (precision == "int4")
    deq = q.unpack(p, scheme, k)
    step = np.abs(np.repeat(p.scales.reshape(24, -1), scheme.block, axis=1)[:, :k].T)
    assert np.all(np.abs(deq - w) <= step * (0.5 if scheme.zero_points else 1.0) + 1e-6)
    if not scheme.zero_points:  # only the clamped ones are past half a step: opposite the extreme, the scale's sign
        far = np.abs(deq - w) > step / 2 + 1e-6
        assert np.all(np.sign(w[far]) == np.sign(np.repeat(p.scales.reshape(24, -1), scheme.block, axis=1)[:, :k].T[far]))
    x = rng.standard_normal((3, k)).astype(np.float32)
    y = _matmul_nbits(p, k, 24, scheme, accuracy_level=0).run(None, {"X": x})[0]
    np.testing.assert_allclose(y, x @ deq, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("offsets", [False, True])
def test_bytes_per_weight_is_what_pack_writes(precision, offsets):
    """The memory estimate's bytes a weight (Scheme.bytes_per_weight) are the packed arrays'
    bytes over the weight's elements, the offset form's float a block beside them."""
    scheme = q.SCHEMES[precision]
    k, n = 4 * scheme.block, 24
    p = q.pack(np.random.default_rng(1).standard_normal((k, n)).astype(np.float32), scheme, offsets=offsets)
    arrays = [p.codes, p.scales, p.zero_points]
    written = sum(a.nbytes for a in arrays if a is not None)
    assert written == scheme.bytes_per_weight * k * n
    if offsets:
        assert p.offsets.nbytes == 4 * k * n / scheme.block


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_inspect_and_the_memory_estimate_count_a_weight_as_pack_writes_it(precision):
    """One figure for an integer weight's bytes, the targets table's (Precision.weight_bytes): what
    pack writes for a weight of the spec, what `specc inspect` counts each weight at, and what the
    memory estimate counts each quantized (2-D, not embedding) weight at."""
    import math

    from specc.builder.memory import estimate_streamed
    from specc.spec import load_spec, resolve
    from specc.spec.costs import inspect_spec, parameter_shapes
    from specc.spec.targets import PRECISIONS

    scheme = q.SCHEMES[precision]
    assert scheme.bytes_per_weight == PRECISIONS[precision].weight_bytes
    r = resolve(load_spec("tiny-llama").model_copy(update={"serving": load_spec("tiny-llama").serving.model_copy(
        update={"precision": precision})}))
    shapes = parameter_shapes(r)
    out, k = shapes["decoder.layers.0.ffn.up.weight"]  # [out, in]: the graph multiplies by its [in, out]
    p = q.pack(np.random.default_rng(2).standard_normal((k, out)).astype(np.float32), scheme)
    per_weight = sum(a.nbytes for a in (p.codes, p.scales, p.zero_points) if a is not None) / (k * out)
    facts = inspect_spec(r)
    assert facts["weight_bytes"][precision] == int(facts["parameters"] * per_weight)
    quantized = {name: math.prod(s) for name, s in shapes.items() if len(s) == 2 and not name.startswith("embeddings.")}
    kept = sum(math.prod(s) for name, s in shapes.items() if name not in quantized)  # fp32 in the graph
    assert estimate_streamed(r)["stored"] == 4 * kept + sum(n * per_weight for n in quantized.values())


def test_int4_symmetric_form_is_llama_cpp_q4_0():
    """int4's symmetric form rounds as llama.cpp's Q4_0 does (the reference: the gguf package's
    own Q4_0 quantizer, a port of llama.cpp's): the same codes, and the same weights up to Q4_0's
    fp16 scale (specc keeps the scale in fp32)."""
    from gguf import GGMLQuantizationType, quants

    scheme = q.SCHEMES["int4"]
    rng = np.random.default_rng(3)
    w = rng.standard_normal((256, 48)).astype(np.float32)  # [K, N]: 8 blocks down each column
    ours = q.unpack(q.pack(w, scheme), scheme, 256)
    rows = np.ascontiguousarray(w.T)  # llama.cpp quantizes each row of a [N, K] tensor in blocks of 32
    theirs = quants.dequantize(quants.quantize(rows, GGMLQuantizationType.Q4_0), GGMLQuantizationType.Q4_0).T
    d = np.repeat(np.abs(q.pack(w, scheme).scales).reshape(48, -1), 32, axis=1).T
    codes_ours, codes_theirs = np.round(ours / d), np.round(theirs / d)
    assert np.mean(codes_ours == codes_theirs) > 0.999
    same = codes_ours == codes_theirs
    np.testing.assert_allclose(ours[same], theirs[same], rtol=2e-3, atol=1e-6)  # fp16's 11-bit scale


@pytest.mark.parametrize("precision", ["int8", "int4"])
def test_stacked_experts_are_packed_as_each_expert_alone(precision, monkeypatch):
    """QMoE's stacked [E, N, K] expert weights, packed for every expert at once (in pieces that
    cross experts' boundaries), hold each expert's own pack of its [K, N] weight (the layout
    MatMulNBits reads, the test above), and dequantized_experts() is what those codes unpack to
    (what the torch reference of an integer build multiplies by)."""
    import torch

    monkeypatch.setattr(q, "PACK_ELEMENTS", 5 * 96)  # 5 rows of K at a time: pieces across experts
    scheme = q.SCHEMES[precision]
    w = np.random.default_rng(4).standard_normal((3, 7, 96)).astype(np.float32)  # [E, N, K]
    packed = q.pack_experts(w, scheme)
    for e in range(3):
        alone = q.pack(np.ascontiguousarray(w[e].T), scheme)
        np.testing.assert_array_equal(packed["codes"][e], alone.codes.reshape(7, -1))
        np.testing.assert_array_equal(packed["scales"][e], alone.scales.reshape(7, -1))
        if scheme.zero_points:
            np.testing.assert_array_equal(packed["zero_points"][e], alone.zero_points.reshape(7, -1))
        else:
            assert "zero_points" not in packed
        deq = q.dequantized_experts(torch.from_numpy(w), precision)[e].numpy()
        np.testing.assert_array_equal(deq, q.unpack(alone, scheme, 96).T)
        assert 0 < np.abs(deq - w[e]).max() <= np.abs(alone.scales).max()  # quantized, within a step


def test_offset_form_is_exact_on_a_q4_1_grid_and_chosen_only_there():
    """Weights that sit on Q4_1's grid (4-bit codes from a float minimum per block of 32) come back
    exactly in the offset form; gaussian weights keep the symmetric form, about as good there."""
    scheme = q.SCHEMES["int4"]
    rng = np.random.default_rng(0)
    d = rng.uniform(0.01, 0.1, size=(4, 16)).astype(np.float32)
    m = rng.uniform(-1, 0, size=(4, 16)).astype(np.float32)
    codes = rng.integers(0, 16, size=(4, 32, 16))
    codes[:, 0], codes[:, 1] = 0, 15  # every block spans its whole range, as Q4_1's do
    grid = (codes * d[:, None] + m[:, None]).reshape(128, 16).astype(np.float32)
    chosen = q.choose(grid, scheme)
    assert chosen.offsets is not None
    np.testing.assert_allclose(q.unpack(chosen, scheme, 128), grid, atol=1e-6)
    gauss = rng.standard_normal((128, 16)).astype(np.float32)
    assert q.choose(gauss, scheme).offsets is None
    assert q.choose(grid, q.SCHEMES["int8"]).offsets is None


def test_offset_form_costs_no_more_than_its_weights_under_int8_activations():
    """At accuracy level 4 the kernel rounds the input to int8 per block, an error e that reaches
    the output as e @ (what the kernel's codes hold). With codes about the middle of the range
    (zero point 8, the centre added back as the offset), that is the weight less its block's
    centre; codes from the minimum would carry the whole block's offset, about twice the error.
    Reference: the exact product and numpy's own per-block int8 rounding of the input
    (amax / 127 steps), times the true weight, as llama.cpp's Q4_1 x Q8_1 dot product does."""
    scheme = q.SCHEMES["int4"]
    rng = np.random.default_rng(1)
    k, n = 256, 64
    d = rng.uniform(0.01, 0.02, size=(k // 32, n)).astype(np.float32)
    codes = rng.integers(0, 16, size=(k // 32, 32, n))
    codes[:, 0], codes[:, 1] = 0, 15
    w = (codes * d[:, None] - 7.5 * d[:, None]).reshape(k, n).astype(np.float32)  # blocks about 0
    p = q.pack(w, scheme, offsets=True)
    x = rng.standard_normal((16, k)).astype(np.float32)
    x[:, 5] *= 30  # an outlier channel, as trained models have
    blocks = x.reshape(16, k // 32, 32)
    step = np.abs(blocks).max(-1, keepdims=True) / 127
    rounding = (np.round(blocks / step) * step).reshape(16, k) - x
    expected = np.sqrt(np.mean((rounding @ w) ** 2))
    y = _matmul_nbits_offsets(p, k, n, scheme, x)
    got = np.sqrt(np.mean((y - x @ w) ** 2))
    assert got < 1.5 * expected, (got, expected)


def _matmul_nbits_offsets(p: q.Packed, k: int, n: int, scheme: q.Scheme, x: np.ndarray) -> np.ndarray:
    """The offset form as the build writes it: MatMulNBits (accuracy level 4) plus the input's
    block sums times the offsets."""
    y = _matmul_nbits(p, k, n, scheme, accuracy_level=4).run(None, {"X": x})[0]
    return y + (x @ q.block_sums(k, scheme.block)) @ p.offsets

@pytest.mark.parametrize("spec", ["tiny-bert", "tiny-gpt2", "tiny-transformer"])
def test_int8_quantizes_every_matmul_weight_and_verifies(builds, spec):
    res = builds(spec, "int8")
    fp32 = builds(spec, "fp32")
    assert res.manifest["options"]["precision"] == "int8"
    for name, g in res.manifest["graphs"].items():
        ops = _ops(res.out_dir / g["file"])
        fp32_ops = _ops(fp32.out_dir / g["file"])
        # every MatMul with a constant weight became MatMulNBits; the activation x activation
        # products of attention stay float
        assert ops.get("MatMulNBits", 0) >= 1, (name, ops)
        assert ops.get("MatMul", 0) < fp32_ops.get("MatMul", 0) + fp32_ops.get("FusedMatMul", 0)
        assert (res.out_dir / g["file"]).stat().st_size < (fp32.out_dir / g["file"]).stat().st_size
    v = res.manifest["verification"]
    assert v["precision"] == "int8" and v["max_abs_diff"] > 0  # it did change the numbers
    # seeded weights: compared with torch on the graph's own dequantized weights
    assert v["quality_bar"] == vars(DEQUANTIZED_BAR) and v["compared_with"] == "dequantized" and "tolerance" not in v
    for case in v["cases"]:
        for out in case["outputs"].values():
            assert DEQUANTIZED_BAR.cosine_min <= out["cosine_min"] <= out["cosine_mean"] <= 1 + 1e-9


@pytest.mark.parametrize("spec", ["tiny-gpt2", "tiny-llama"])
def test_int4_is_weight_only_matmulnbits_and_generates(builds, spec):
    res = builds(spec, "int4")
    ops = _ops(res.out_dir / "model.onnx")
    assert ops.get("MatMulNBits", 0) >= 1, ops
    assert "MatMulInteger" not in ops
    # no zero points: onnxruntime's symmetric path (docs/benchmarks_int4_layout.md); a tied head
    # (tiny-gpt2's) is in int8's blocks, with them
    nodes = [n for n in onnx.load(str(res.out_dir / "model.onnx"), load_external_data=False).graph.node
             if n.op_type == "MatMulNBits"]
    assert all(len(n.input) == (4 if n.input[1].endswith(".T_q8.codes") else 3) for n in nodes)
    assert any(len(n.input) == 3 for n in nodes)
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


def _wrong_scale(node):
    """The node's scales, four times what they should be."""
    _edit(node.inputs[2], lambda a: a * 4)


def _swapped_blocks(node):
    """The codes of each column's first two blocks, exchanged."""
    _edit(node.inputs[1], lambda a: np.concatenate([a[:, 1:2], a[:, 0:1], a[:, 2:]], axis=1))


def _edit(value, change):
    """The initializer's value, changed when it is written."""
    import onnx_ir as ir

    inner = value.const_value
    value.const_value = ir.LazyTensor(lambda: ir.tensor(np.ascontiguousarray(change(inner.numpy()))),
                                      dtype=inner.dtype, shape=inner.shape, name=inner.name)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("defect", [_wrong_scale, _swapped_blocks])
def test_a_planted_defect_in_the_last_layer_fails_the_build(tmp_path, monkeypatch, precision, defect):
    real = q._rewrite

    def planted(graph, *args):
        counts = real(graph, *args)
        last = [n for n in graph if n.op_type == "MatMulNBits"][-1]  # the last layer's FFN output projection
        defect(last)
        return counts

    monkeypatch.setattr(q, "_rewrite", planted)
    with pytest.raises(VerificationError, match="too far from torch for quantization noise"):
        specc.build("tiny-llama", tmp_path / "out", precision=precision, progress=None)
    assert not (tmp_path / "out").exists()


def test_graphs_without_a_cache_compute_in_fp32_and_decoders_in_int8(tmp_path):
    """MatMulNBits' accuracy level by graph: 4 (int8 compute, the decode speed) where the graph
    takes a KV cache, 1 (fp32 compute, faster and closer on whole sequences) where it takes none:
    an encoder, an encoder-decoder's encoder; the manifest's facts and options say so."""
    import onnx

    want = {("tiny-bert", "model"): 1, ("tiny-gpt2", "model"): 4, ("tiny-transformer", "encoder"): 1,
            ("tiny-transformer", "decoder"): 4}
    for spec in ("tiny-bert", "tiny-gpt2", "tiny-transformer"):
        result = specc.build(spec, tmp_path / spec, precision="int8", progress=None)
        facts = {o["graph"]: o["accuracy_level"] for o in result.manifest["optimizations"] if "precision" in o}
        for graph, info in result.manifest["graphs"].items():
            levels = {a.i for n in onnx.load(str(tmp_path / spec / info["file"]), load_external_data=False).graph.node
                      if n.op_type == "MatMulNBits" for a in n.attribute if a.name == "accuracy_level"}
            assert levels == {want[(spec, graph)]} and facts[graph] == want[(spec, graph)], (spec, graph)
        assert result.manifest["options"]["quantization"]["accuracy_level_without_cache"] == q.WHOLE_SEQUENCE_ACCURACY_LEVEL


def test_a_tied_head_is_packed_from_the_table_the_lookup_keeps_in_fp32(builds):
    """tiny-gpt2's head is its token table: at int4 the projection is a MatMulNBits packed from the
    table transposed in 8-bit blocks (a decode reads its codes, not the fp32 table), the lookup
    still reads the fp32 table, and the build verifies against torch computing its head with the
    table as packed, within the rounding of the head's int8 activations (level 4, verified with
    the weights prepacked, as served)."""
    import torch

    from specc.nn import to_torch
    from specc.builder.pipeline import _release

    res = builds("tiny-gpt2", "int4")
    graph = onnx.load(str(res.out_dir / "model.onnx")).graph
    table = "model.embeddings.tokens.weight"
    assert [n.op_type for n in graph.node if table in n.input] == ["Gather"]
    head = [n for n in graph.node if n.op_type == "MatMulNBits" and n.input[1] == f"{table}.T_q8.codes"]
    assert len(head) == 1 and head[0].output[0] in {o.name for o in graph.output}
    bits = {a.name: a.i for a in head[0].attribute}
    assert (bits["bits"], bits["block_size"]) == (8, 16) and len(head[0].input) == 4  # with zero points
    assert res.manifest["verification"]["max_abs_diff"] < 1e-2
    assert res.manifest["options"]["quantization"]["tied_head"] == q.TIED_HEAD["int4"] == "int8"

    model = to_torch("tiny-gpt2")
    before = model.embeddings.tokens.weight.detach().clone()
    q.dequantize_linears(model, "int4")
    projection = model.heads["logits"].tied_projection
    assert torch.equal(model.embeddings.tokens.weight, before)  # the lookup's table untouched
    assert projection.shape == before.shape and not torch.equal(projection, before)
    assert torch.equal(projection, q.dequantized(before, "int8"))
    assert "heads.logits.tied_projection" not in model.state_dict()  # never saved
    _release(model)  # what a build does with its reference once verified: the copy goes too
    assert model.heads["logits"].tied_projection.numel() == 0


def test_an_int4_decoder_computes_in_fp32_and_its_tied_head_in_int8(builds):
    """int4's own weights are computed at accuracy level 1 even where the graph decodes a token at
    a time: the activations meet the 4-bit weights unrounded (rounded to 8 bits per block, level 4,
    they changed 3 of 8 greedy chat answers of SmolLM2, docs/benchmarks_quality.md); the tied head,
    in int8's blocks, keeps int8's level 4. Read from the written graphs (the model and the
    in-place one) and the manifest."""
    res = builds("tiny-gpt2", "int4")
    assert q.SCHEMES["int4"].accuracy_level == 1 and q.SCHEMES[q.TIED_HEAD["int4"]].accuracy_level == 4
    for graph in ("model.onnx", "inplace.onnx"):
        levels: dict[bool, set[int]] = {}
        for n in onnx.load(str(res.out_dir / graph), load_external_data=False).graph.node:
            if n.op_type == "MatMulNBits":
                attrs = {a.name: a.i for a in n.attribute}
                head = n.input[1].endswith(".T_q8.codes")
                assert attrs["bits"] == (8 if head else 4)
                levels.setdefault(head, set()).add(attrs["accuracy_level"])
        assert levels == {False: {1}, True: {4}}, (graph, levels)
    options = res.manifest["options"]["quantization"]
    assert (options["accuracy_level"], options["tied_head_accuracy_level"]) == (1, 4)
    assert [o["accuracy_level"] for o in res.manifest["optimizations"] if "precision" in o] == [1]


def test_an_int8_build_keeps_a_tied_head_in_fp32(builds):
    """int8 is the precision that keeps a trained model's next tokens (docs/build.md): its tied
    head stays the fp32 table, read through the Transpose, and torch's reference computes with
    the table itself."""
    res = builds("tiny-gpt2", "int8")
    graph = onnx.load(str(res.out_dir / "model.onnx")).graph
    table = "model.embeddings.tokens.weight"
    assert sorted(n.op_type for n in graph.node if table in n.input) == ["Gather", "Transpose"]
    assert res.manifest["options"]["quantization"]["tied_head"] == "fp32"
    from specc.nn import to_torch

    model = to_torch("tiny-gpt2")
    q.dequantize_linears(model, "int8")
    assert model.heads["logits"].tied_projection is None
