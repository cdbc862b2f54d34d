"""Integer precisions: the MatMul weights of an exported fp32 graph rewritten as weight-only
integer blocks, one tensor at a time.

Every MatMul whose weight is a constant [K, N] fp32 tensor becomes onnxruntime's com.microsoft
MatMulNBits: the weight is stored as `bits`-bit codes in blocks of consecutive rows of one
column, each block with its own float scale and an integer zero point, and dequantizes as
(code - zero_point) x scale. The range of each block includes 0 (so the zero point is one of the
codes). Activations stay fp32 outside the kernel; with accuracy_level 4 the kernel computes in
int8, quantizing its input per block along K as well (the weight's block length), so an outlier
channel only coarsens the block it sits in.

- int8: 8-bit codes in blocks of 16. Chosen over dynamic quantization (DynamicQuantizeMatMul, one
  int8 scale for the whole input tensor), which a trained model's outlier channels break, and
  over blocks of 32, whose activation blocks cost SmolLM2-135M a point of next-token agreement
  for a tenth of the decode time (docs/benchmarks_quality.md; the choice: docs/build.md).
- int4: 4-bit codes in blocks of 32 (Q4_1's blocks, so a checkpoint distributed as Q4_1 keeps
  its grid), for decoders, whose decode speed is the weight bytes read per token.

Gather (the embedding tables), the attention products and a MatMul whose weight is computed (a
tied output projection reads the transposed embedding) stay fp32. The graph is written back in
place, normalized again so identical inputs give identical bytes.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specc.errors import BuildError
from specc.spec.targets import PRECISIONS

INT_PRECISIONS = tuple(name for name, p in PRECISIONS.items() if p.quantized)  # int8, int4
BLOCK = 32  # rows of one column that share a scale and a zero point, unless a scheme says otherwise
ACCURACY_LEVEL = 4  # MatMulNBits computes in int8 (0: dequantizes the weight at every call, 30x slower)


@dataclass(frozen=True)
class Scheme:
    """One integer precision's weight format."""

    bits: int
    block: int = BLOCK
    accuracy_level: int = ACCURACY_LEVEL

    @property
    def top(self) -> int:
        return (1 << self.bits) - 1


SCHEMES = {"int8": Scheme(bits=8, block=16), "int4": Scheme(bits=4)}


def describe(precision: str) -> dict:
    """The quantization an integer precision applies, as the manifest's options record it (and
    the build's cache key hashes: a build made with another scheme is not up to date)."""
    scheme = SCHEMES[precision]
    return {"op": "MatMulNBits", "bits": scheme.bits, "block": scheme.block, "accuracy_level": scheme.accuracy_level,
            "offset_form": scheme.bits <= 4}


@dataclass(frozen=True)
class Packed:
    """MatMulNBits' inputs for one [K, N] weight: codes [N, blocks, block * bits / 8] uint8,
    scales [N * blocks] float32, zero points [N * ceil(blocks * bits / 8)] uint8; with `offsets`
    [blocks, N] float32 (the offset form), the zero points are all 0 and each block's minimum is
    added back outside the kernel."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray
    offsets: np.ndarray | None = None


def pack(w: np.ndarray, scheme: Scheme, offsets: bool = False) -> Packed:
    """Blockwise asymmetric quantization of a [K, N] weight along K (rows past K in the last
    block are zeros). Deterministic: the same weight gives the same bytes.

    The integer form spans each block's range widened to include 0 with an integer zero point.
    The offset form spans the block's own [min, max] with codes from its minimum, which stays a
    float (llama.cpp's Q4_1 has this form): exact for weights that already sit on such a grid,
    as those of a checkpoint distributed as Q4_1 do."""
    k, n = w.shape
    blocks = -(-k // scheme.block)
    cols = np.zeros((n, blocks * scheme.block), dtype=np.float32)
    cols[:, :k] = w.T
    cols = cols.reshape(n, blocks, scheme.block)
    lo, hi = cols.min(axis=2), cols.max(axis=2)
    if not offsets:
        lo, hi = np.minimum(lo, 0.0), np.maximum(hi, 0.0)
    scale = (hi - lo) / scheme.top
    scale[scale == 0] = 1.0  # a constant block: any scale, codes all at the zero point (or the offset)
    if offsets:
        zero = np.zeros((n, blocks), np.uint8)
        codes = np.clip(np.rint((cols - lo[..., None]) / scale[..., None]), 0, scheme.top).astype(np.uint8)
    else:
        zero = np.clip(np.rint(-lo / scale), 0, scheme.top).astype(np.uint8)
        codes = np.clip(np.rint(cols / scale[..., None]) + zero[..., None], 0, scheme.top).astype(np.uint8)
    if scheme.bits == 4:  # two codes a byte, the first in the low nibble; zero points likewise, a row padded to bytes
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        if blocks % 2:
            zero = np.concatenate([zero, np.zeros((n, 1), np.uint8)], axis=1)
        zero = zero[:, 0::2] | (zero[:, 1::2] << 4)
    elif scheme.bits != 8:
        raise BuildError(f"no {scheme.bits}-bit packing")
    return Packed(np.ascontiguousarray(codes), scale.astype(np.float32).reshape(-1), np.ascontiguousarray(zero).reshape(-1),
                  np.ascontiguousarray(lo.T, dtype=np.float32) if offsets else None)


def unpack(p: Packed, scheme: Scheme, k: int) -> np.ndarray:
    """The [K, N] weight a Packed dequantizes to (what MatMulNBits multiplies by)."""
    n, blocks = p.codes.shape[:2]
    codes, zero = p.codes, p.zero_points.reshape(n, -1)
    if scheme.bits == 4:
        codes = np.stack([codes & 15, codes >> 4], axis=-1).reshape(n, blocks, scheme.block)
        zero = np.stack([zero & 15, zero >> 4], axis=-1).reshape(n, -1)[:, :blocks]
    w = (codes.astype(np.float32) - zero[..., None]) * p.scales.reshape(n, blocks)[..., None]
    if p.offsets is not None:
        w += p.offsets.T[..., None]
    return w.reshape(n, -1)[:, :k].T


def block_sums(k: int, block: int) -> np.ndarray:
    """[K, blocks] of 0 and 1: x @ block_sums(K) is the sum of x over each block of K, what the
    offset form's minima multiply."""
    blocks = -(-k // block)
    return np.kron(np.eye(blocks, dtype=np.float32), np.ones((block, 1), np.float32))[:k]


def choose(w: np.ndarray, scheme: Scheme) -> Packed:
    """The offset form where it at least halves the weight's quantization error (it costs two more
    nodes a MatMul and a float per block), else the integer form. Only 4-bit codes are worth it:
    at 8 bits both forms are within rounding of the weight."""
    plain = pack(w, scheme)
    if scheme.bits > 4:
        return plain
    k = w.shape[0]
    offset = pack(w, scheme, offsets=True)
    err = lambda p: float(np.square(unpack(p, scheme, k) - w).sum())  # noqa: E731
    return offset if err(offset) * 2 <= err(plain) else plain


def quantize(path: Path, precision: str, sig) -> dict:
    """Quantize the graph at `path` in place; returns facts for the manifest."""
    import onnx

    from specc.export.onnx import _normalize

    scheme = SCHEMES.get(precision)
    if scheme is None:
        raise BuildError(f"no quantizer for precision {precision!r}")
    proto = onnx.load(str(path))
    try:
        count, offset_count = _rewrite(proto.graph, scheme)
    except BuildError:
        raise
    except Exception as exc:  # onnx's and numpy's own errors on a graph this module does not expect
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BuildError(f"quantizing the {sig.name} graph to {precision} failed: {first}") from None
    if not any(o.domain == "com.microsoft" for o in proto.opset_import):
        proto.opset_import.append(onnx.helper.make_opsetid("com.microsoft", 1))
    _normalize(proto, sig)
    onnx.save(proto, str(path))
    ops: dict[str, int] = {}
    for n in proto.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"graph": sig.name, "precision": precision, "float_matmuls_left": ops.get("MatMul", 0),
            "quantized_ops": {"MatMulNBits": count}, "offset_form": offset_count, "bits": scheme.bits,
            "block": scheme.block, "accuracy_level": scheme.accuracy_level}


def _rewrite(graph, scheme: Scheme) -> tuple[int, int]:
    """Every MatMul with a constant 2-D fp32 weight becomes MatMulNBits; returns how many, and how
    many of them are in the offset form. A weight that no other node reads is dropped from the graph."""
    from onnx import TensorProto, helper, numpy_helper

    inits = {t.name: t for t in graph.initializer}
    readers: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            readers[name] = readers.get(name, 0) + 1
    nodes, count, offset_count, dropped, packed, summed = [], 0, 0, set(), {}, set()
    for node in graph.node:
        weight = inits.get(node.input[1]) if node.op_type == "MatMul" and len(node.input) == 2 else None
        if weight is None or weight.data_type != TensorProto.FLOAT or len(weight.dims) != 2:
            nodes.append(node)
            continue
        k, n = weight.dims
        base = f"{node.input[1]}_q{scheme.bits}"
        if base not in packed:  # a weight two MatMuls read is packed once
            p = choose(numpy_helper.to_array(weight), scheme)
            for suffix, array in (("codes", p.codes), ("scales", p.scales), ("zero_points", p.zero_points),
                                  ("offsets", p.offsets)):
                if array is not None:
                    graph.initializer.append(numpy_helper.from_array(array, f"{base}.{suffix}"))
            packed[base] = p.offsets is not None
        x, (y,) = node.input[0], node.output
        offsets = packed[base]
        nodes.append(helper.make_node(
            "MatMulNBits", [x, f"{base}.codes", f"{base}.scales", f"{base}.zero_points"], [f"{y}.codes" if offsets else y],
            name=node.name, domain="com.microsoft", K=k, N=n, bits=scheme.bits, block_size=scheme.block,
            accuracy_level=scheme.accuracy_level))
        if offsets:  # y = x @ (scale * codes) + (block sums of x) @ minima
            sums = f"{x}.block_sums{k}"
            if sums not in summed:  # once per input: the projections that read one input share it
                graph.initializer.append(numpy_helper.from_array(block_sums(k, scheme.block), f"{sums}.ones"))
                nodes.append(helper.make_node("MatMul", [x, f"{sums}.ones"], [sums], name=f"{node.name}.block_sums"))
                summed.add(sums)
            nodes.append(helper.make_node("MatMul", [sums, f"{base}.offsets"], [f"{y}.offsets"], name=f"{node.name}.offsets"))
            nodes.append(helper.make_node("Add", [f"{y}.codes", f"{y}.offsets"], [y], name=f"{node.name}.add"))
            offset_count += 1
        count += 1
        readers[node.input[1]] -= 1
        if readers[node.input[1]] == 0:
            dropped.add(node.input[1])
    del graph.node[:]
    graph.node.extend(nodes)
    kept = [t for t in graph.initializer if t.name not in dropped]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    return count, offset_count
