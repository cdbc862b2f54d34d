"""GGUF blocks as MatMulNBits inputs (specc/export/ggufblocks.py) and the graph rewrite on them
(specc/export/ggufgraph.py): for every format, the weights onnxruntime's graph multiplies by
equal gguf's own dequantization of the same bytes (exactly, or to fp32 rounding of a block's
terms where the format has a minimum and 4-bit codes), and the embedding's dequantizing Gather
reads the same rows; IQ and unknown types are refused naming the tensor and the type."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
ort = pytest.importorskip("onnxruntime")
ir = pytest.importorskip("onnx_ir")

from gguf import GGMLQuantizationType, quants  # noqa: E402

from specc.errors import BuildError  # noqa: E402
from specc.export import ggufblocks, ggufgraph  # noqa: E402

# the byte offsets of each K-quant's fp16 fields (d, dmin), made finite in random blocks
_FLOAT_FIELDS = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
# formats whose graph weights are gguf's values to fp32 rounding, not bit for bit (4-bit codes
# with a minimum: the code is read about 8, the minimum's share added back in the offset)
_ROUNDED = {"Q4_1", "Q4_K"}


def crafted(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Valid blocks of format FMT for an [n, k] matrix, as bytes [n, row bytes]: gguf's own
    quantizer where it has one, else random bytes with finite fp16 scales."""
    rng = np.random.default_rng(seed)
    qtype = GGMLQuantizationType[fmt]
    if fmt not in _FLOAT_FIELDS:
        return quants.quantize(rng.standard_normal((n, k)).astype(np.float32), qtype)
    f = ggufblocks.FORMATS[fmt]
    raw = rng.integers(0, 256, (n, k // f.type_block * f.type_size), dtype=np.uint8)
    b = raw.reshape(-1, f.type_size)
    for at in _FLOAT_FIELDS[fmt]:
        b[:, at:at + 2] = (rng.standard_normal((b.shape[0], 1)) * 0.01).astype(np.float16).view(np.uint8)
    return raw


def reference(fmt: str, raw: np.ndarray, n: int, k: int) -> np.ndarray:
    return quants.dequantize(raw, GGMLQuantizationType[fmt]).reshape(n, k)


def tolerance(b: ggufblocks.Blocks) -> np.ndarray:
    """fp32 rounding of a block's terms: a few ulps of its largest term, per weight."""
    terms = np.float32(b.mid) * np.abs(b.scales) + (0 if b.offsets is None else np.abs(b.offsets))
    return np.repeat(4 * np.finfo(np.float32).eps * terms, b.block, axis=1)


@dataclass
class _Tensor:
    name: str
    shape: tuple  # GGUF's order: (K, N)
    data: np.ndarray
    fmt: str

    @property
    def tensor_type(self):
        return GGMLQuantizationType[self.fmt]


class _Source(ggufgraph.GGUFSource):
    """One crafted matrix, found by its values as GGUFSource finds a file's."""

    def __init__(self, fmt: str, raw: np.ndarray, n: int, k: int):
        self.path = ggufgraph.Path("crafted.gguf")
        self.tensors = {"w": _Tensor("w", (k, n), raw, fmt)}
        self.index = {ggufgraph._digest(reference(fmt, raw, n, k)): ("w", None)}


def _run(model, feeds: dict) -> np.ndarray:
    proto = ir.serde.serialize_model(model)
    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


def _matmul_model(w: np.ndarray) -> ir.Model:
    """y = x @ w, w a [K, N] initializer."""
    k, n = w.shape
    x = ir.Value(name="x", shape=ir.Shape([None, k]), type=ir.TensorType(ir.DataType.FLOAT))
    weight = ir.Value(name="weight", const_value=ir.tensor(w), shape=ir.Shape([k, n]),
                      type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node("MatMul", [x, weight], name="proj")
    node.outputs[0].name, node.outputs[0].type = "y", ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([x], node.outputs, nodes=[node], initializers=[weight], opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=10)


def _gather_model(table: np.ndarray) -> ir.Model:
    """y = table[ids], ids [1, S]."""
    ids = ir.Value(name="ids", shape=ir.Shape([1, None]), type=ir.TensorType(ir.DataType.INT64))
    value = ir.Value(name="table", const_value=ir.tensor(table), shape=ir.Shape(list(table.shape)),
                     type=ir.TensorType(ir.DataType.FLOAT))
    node = ir.node("Gather", [value, ids], attributes={"axis": 0}, name="embed")
    node.outputs[0].name, node.outputs[0].type = "y", ir.TensorType(ir.DataType.FLOAT)
    graph = ir.Graph([ids], node.outputs, nodes=[node], initializers=[value], opset_imports={"": 18}, name="g")
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("fmt", sorted(ggufblocks.FORMATS))
def test_blocks_dequantize_as_gguf(fmt):
    n, k = 6, 512
    raw = crafted(fmt, n, k)
    b = ggufblocks.blocks("blk.0.ffn_up.weight", fmt, raw, k)
    ref = reference(fmt, raw, n, k)
    got = b.dequantize()
    if fmt in _ROUNDED:
        assert (np.abs(got - ref) <= tolerance(b)).all()
    else:
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("level", [1, 4])
@pytest.mark.parametrize("fmt", sorted(ggufblocks.FORMATS))
def test_graph_weights_are_the_files_values(fmt, level):
    """The rewritten MatMul, run by onnxruntime on the identity, gives back the weights it
    multiplies by: gguf's dequantization of the blocks. At accuracy level 1 (fp32 compute, the
    build's) exactly where the format is exact; codes wider than the kernel takes at the level
    are two 4-bit MatMulNBits on their nibbles, added (16 scale (high - 8) + scale low: each term
    and their sum exact for the formats' scales). At level 4 the kernel rounds its input to int8,
    which the identity's ones survive to fp32 rounding."""
    n, k = 48, 256
    raw = crafted(fmt, n, k, seed=1)
    ref = reference(fmt, raw, n, k)
    model = _matmul_model(np.ascontiguousarray(ref.T))
    facts = ggufgraph._rewrite(model.graph, _Source(fmt, raw, n, k), level=level)
    kernel = ggufblocks.FORMATS[fmt].bits <= ggufgraph.KERNEL_BITS[level]
    assert (facts["matmuls"], facts["split"]) == ((1, 0) if kernel else (1, 1))
    assert [n.op_type for n in model.graph].count("MatMulNBits") == (1 if kernel else 2)
    assert all(n.attributes.get_int("bits") == (ggufblocks.FORMATS[fmt].bits if kernel else 4)
               for n in model.graph if n.op_type == "MatMulNBits")
    assert "weight" not in model.graph.initializers
    model.opset_imports["com.microsoft"] = 1
    got = _run(model, {"x": np.eye(k, dtype=np.float32)}).T  # [N, K]: row i is weight row i
    b = ggufblocks.blocks("w", fmt, raw, k)
    if level == 4 and kernel:
        assert (np.abs(got - ref) <= tolerance(b) + 1e-6 * np.abs(ref)).all()
    elif fmt in _ROUNDED:
        assert (np.abs(got - ref) <= tolerance(b)).all()
    else:
        np.testing.assert_array_equal(got, ref)


@pytest.mark.parametrize("fmt", ["Q4_1", "Q8_0", "Q2_K", "Q6_K"])
def test_gathered_rows_are_the_files_values(fmt):
    n, k = 40, 256
    raw = crafted(fmt, n, k, seed=2)
    ref = reference(fmt, raw, n, k)
    model = _gather_model(ref)
    facts = ggufgraph._rewrite(model.graph, _Source(fmt, raw, n, k), level=1)
    assert facts["gathers"] == 1 and "table" not in model.graph.initializers
    ids = np.array([[3, 0, 39, 3, 17]], dtype=np.int64)
    got = _run(model, {"ids": ids})
    np.testing.assert_array_equal(got[0], ggufblocks.blocks("w", fmt, raw, k).dequantize()[ids[0]])
    if fmt not in _ROUNDED:
        np.testing.assert_array_equal(got[0], ref[ids[0]])


def test_a_weight_that_is_no_files_matrix_stays_fp32():
    raw = crafted("Q4_0", 8, 64)
    model = _matmul_model(np.ones((64, 8), np.float32))
    facts = ggufgraph._rewrite(model.graph, _Source("Q4_0", raw, 8, 64), level=1)
    assert facts["matmuls"] == 0 and [n.op_type for n in model.graph] == ["MatMul"]


def test_a_graph_that_holds_none_of_the_files_matrices_is_refused():
    """The file the weights record was replaced after the import: nothing matches, said so."""
    raw = crafted("Q4_0", 8, 64)
    model = _matmul_model(np.ones((64, 8), np.float32))

    class Sig:
        name = "model"

    with pytest.raises(BuildError, match=r"crafted\.gguf: none of its quantized matrices is a weight of the model graph"):
        ggufgraph.quantize_gguf(model, Sig, _Source("Q4_0", raw, 8, 64))


@pytest.mark.parametrize("qtype", ["IQ2_XS", "IQ4_NL", "Q8_1", "TQ1_0", "MXFP4", "no such type"])
def test_other_block_types_are_refused_naming_tensor_and_type(qtype):
    with pytest.raises(BuildError, match=rf"blk\.3\.attn_q\.weight: GGUF type {qtype} has no exact MatMulNBits form"):
        ggufblocks.blocks("blk.3.attn_q.weight", qtype, np.zeros(1024, np.uint8), 256)


def test_rows_that_are_not_whole_blocks_are_refused():
    with pytest.raises(BuildError, match=r"blk\.0\.ffn_down\.weight: rows of 100 weights"):
        ggufblocks.blocks("blk.0.ffn_down.weight", "Q6_K", np.zeros(210, np.uint8), 100)
