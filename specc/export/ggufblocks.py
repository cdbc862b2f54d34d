"""A GGUF file's quantized blocks as onnxruntime's MatMulNBits inputs, keeping the file's values.

Contract: `blocks(name, qtype, raw, k)` turns one GGUF matrix (RAW: its bytes, one row of K
weights after another, each row a run of the format's blocks) into a `Blocks`: codes read about
the middle code (MatMulNBits without a zero-point input, the kernel's symmetric path: onnxruntime
1.32's float zero points are many times slower at 4 bits and refused at 8), a float32 scale per block, and where the format has a minimum, a float32 offset
per block added to each of its weights (outside the kernel: the block sums of the input times the
offsets, specc/export/quantize.py's offset form). `Blocks.dequantize()` is what the graph
multiplies by; it equals gguf's own dequantization (gguf.quants.dequantize) exactly, or for the
4-bit formats with a minimum (Q4_1, Q4_K) to fp32 rounding of the block's terms, as
tests/export/test_ggufblocks.py holds it to.

        format   MatMulNBits block  bits  code           scale        offset
        Q4_0     32                 4     q              d            -
        Q4_1     32                 4     q              d            m + 8 d
        Q5_0     32                 8     q + 112        d            -
        Q5_1     32                 8     q + 128        d            m
        Q8_0     32                 8     q + 128        d            -
        Q2_K     16                 4     q + 8          d sc         -dmin m
        Q3_K     16                 4     q + 8          d (sc - 32)  -
        Q4_K     32                 4     q              d sc         8 d sc - dmin m
        Q5_K     32                 8     q + 128        d sc         -dmin m
        Q6_K     16                 8     q + 96         d sc         -

(q: the format's code as gguf reads it, signed where the format centres it; the scales and
minima are fp32 products of the fp16 and 6-bit fields, as gguf computes them.) Any other block
type (the IQ formats' lattices, Q8_1, ternary and FP4 blocks) has no such form and is refused
naming the tensor and its type. Nothing here opens a file.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specc.errors import BuildError

QK_K = 256  # weights of a K-quant super-block


@dataclass(frozen=True)
class Format:
    bits: int  # MatMulNBits' code width
    block: int  # MatMulNBits' block (the format's block, or its sub-block)
    type_size: int  # bytes of one of the format's blocks
    type_block: int  # weights of one of the format's blocks
    offsets: bool  # whether a block has an offset (the format has a minimum)


FORMATS = {
    "Q4_0": Format(4, 32, 18, 32, False), "Q4_1": Format(4, 32, 20, 32, True),
    "Q5_0": Format(8, 32, 22, 32, False), "Q5_1": Format(8, 32, 24, 32, True),
    "Q8_0": Format(8, 32, 34, 32, False),
    "Q2_K": Format(4, 16, 84, QK_K, True), "Q3_K": Format(4, 16, 110, QK_K, False),
    "Q4_K": Format(4, 32, 144, QK_K, True), "Q5_K": Format(8, 32, 176, QK_K, True),
    "Q6_K": Format(8, 16, 210, QK_K, False),
}
FLOAT_TYPES = ("F32", "F16", "BF16")  # read as floats, as an import reads them


@dataclass(frozen=True)
class Blocks:
    """MatMulNBits' inputs for one GGUF matrix of N rows of K weights: codes [N, K / block,
    block * bits / 8] uint8 (4-bit codes two a byte, the first in the low nibble), read about the
    middle code (8, or 128 at 8 bits); scales [N, K / block] float32; offsets [N, K / block]
    float32 added to every weight of the block, or None."""

    bits: int
    block: int
    codes: np.ndarray
    scales: np.ndarray
    offsets: np.ndarray | None

    @property
    def mid(self) -> int:
        return 1 << (self.bits - 1)

    def unpacked(self) -> np.ndarray:
        """The codes one a byte, [N, K / block, block]."""
        if self.bits == 8:
            return self.codes
        return np.stack([self.codes & 15, self.codes >> 4], axis=-1).reshape(*self.codes.shape[:2], self.block)

    def dequantize(self) -> np.ndarray:
        """The [N, K] float32 weights the graph multiplies by: (code - mid) x scale (+ offset)."""
        w = (self.unpacked().astype(np.float32) - np.float32(self.mid)) * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(w.shape[0], -1)

    def planes(self) -> tuple[np.ndarray, np.ndarray]:
        """8-bit codes as two 4-bit planes packed as 4-bit codes are ([N, K / block, block / 2]
        each): the high nibbles, read about 8, and the low ones, read about 0; code - 128 =
        16 (high - 8) + low, so the weights are 16 x scale x (high - 8) + scale x low (+ offset)."""
        assert self.bits == 8, "planes split 8-bit codes"
        return _packed(self.codes >> np.uint8(4)), _packed(self.codes & np.uint8(15))

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scales.nbytes + (0 if self.offsets is None else self.offsets.nbytes)


def readable(qtype: str) -> bool:
    """Whether a tensor of this GGUF type is kept as blocks (else it is a float tensor, or refused)."""
    return qtype in FORMATS


def refuse(name: str, qtype: str) -> BuildError:
    """The error for a tensor whose block type has no exact MatMulNBits form."""
    return BuildError(f"{name}: GGUF type {qtype} has no exact MatMulNBits form; --precision gguf keeps "
                      f"{', '.join(FORMATS)} blocks and {', '.join(FLOAT_TYPES)} tensors")


def blocks(name: str, qtype: str, raw: np.ndarray, k: int) -> Blocks:
    """The Blocks of the GGUF matrix NAME of type QTYPE (a GGMLQuantizationType's name), rows of K
    weights; RAW: its bytes (any shape, uint8, row after row)."""
    fmt = FORMATS.get(qtype)
    if fmt is None:
        raise refuse(name, qtype)
    if k % fmt.type_block:
        raise BuildError(f"{name}: rows of {k} weights are not whole {qtype} blocks of {fmt.type_block}")
    raw = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    per_row = k // fmt.type_block * fmt.type_size
    if raw.size % per_row:
        raise BuildError(f"{name}: {raw.size} bytes are not whole rows of {k} {qtype} weights")
    n = raw.size // per_row
    b = raw.reshape(-1, fmt.type_size)
    codes, scales, offsets = _DECODE[qtype](b)  # codes [n_blocks, type_block] one a byte; scales, offsets per block
    sub = fmt.type_block // fmt.block
    codes = codes.reshape(n, -1, fmt.block)
    if fmt.bits == 4:
        codes = _packed(codes)
    shape = (n, k // fmt.block)
    assert scales.size == n * (k // fmt.type_block) * sub
    return Blocks(fmt.bits, fmt.block, np.ascontiguousarray(codes), scales.astype(np.float32).reshape(shape),
                  None if offsets is None else offsets.astype(np.float32).reshape(shape))


def _packed(codes: np.ndarray) -> np.ndarray:
    """4-bit codes one a byte ([..., block]) packed two a byte, the first in the low nibble."""
    return np.ascontiguousarray(codes[..., 0::2] | (codes[..., 1::2] << np.uint8(4)))


def _f16(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 field at byte AT of each block, as float32 [n, 1]."""
    return np.ascontiguousarray(b[:, at:at + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray, run: int) -> np.ndarray:
    """Codes of 4 bits packed in runs: each RUN bytes hold RUN codes in their low nibbles, then RUN
    in their high ones ([n, bytes] -> [n, 2 * bytes])."""
    n = qs.shape[0]
    q = qs.reshape(n, -1, 1, run) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & np.uint8(15)).reshape(n, -1)


def _bits(field: np.ndarray, width: int, run: int) -> np.ndarray:
    """Codes of WIDTH bits packed in runs of RUN bytes: the first RUN codes in the lowest bits of
    each byte of the run, the next RUN in the next bits, and so on."""
    n, per = field.shape[0], 8 // width
    q = field.reshape(n, -1, 1, run) >> (np.arange(per, dtype=np.uint8) * width).reshape(1, 1, per, 1)
    return (q & np.uint8((1 << width) - 1)).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """One bit per weight: weight i's is bit i // len of byte i % len ([n, len] -> [n, count])."""
    n, length = qh.shape
    q = qh.reshape(n, 1, length) >> np.arange(count // length, dtype=np.uint8).reshape(1, -1, 1)
    return (q & np.uint8(1)).reshape(n, -1)


def _q4_0(b):
    return _nibbles(b[:, 2:18], 16), _f16(b, 0), None


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    return _nibbles(b[:, 4:20], 16), d, m + np.float32(8) * d


def _q5(b, at):
    """Q5_0's and Q5_1's 5-bit codes: 32 high bits (a little-endian uint32) after byte AT, then the nibbles."""
    high = np.unpackbits(np.ascontiguousarray(b[:, at:at + 4]), axis=1, bitorder="little")
    return _nibbles(b[:, at + 4:at + 20], 16) | (high << np.uint8(4))


def _q5_0(b):
    return _q5(b, 2) + np.uint8(112), _f16(b, 0), None


def _q5_1(b):
    return _q5(b, 4) + np.uint8(128), _f16(b, 0), _f16(b, 2)


def _q8_0(b):
    return b[:, 2:34] ^ np.uint8(128), _f16(b, 0), None  # int8 q + 128, as its byte


def _q2_k(b):
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    return _bits(b[:, 16:80], 2, 32) + np.uint8(8), d * (sc & 15).astype(np.float32), -(dmin * (sc >> 4).astype(np.float32))


def _q3_k(b):
    low = _nibbles(b[:, 96:104], 8)  # the 16 sub-block scales' low 4 bits
    high = _bits(b[:, 104:108], 2, 4)  # and their high 2 bits
    sc = ((low | (high << np.uint8(4))).astype(np.int16) - 32).astype(np.float32)
    q = _bits(b[:, 32:96], 2, 32) + np.uint8(4) - (np.uint8(4) * (np.uint8(1) - _high_bits(b[:, 0:32], QK_K)))
    return q + np.uint8(4), _f16(b, 108) * sc, None


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's and Q5_K's 8 sub-block scales and minima (6 bits each) from their 12 bytes."""
    a, m, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([a & 63, (hi & 15) | ((a >> 6) << 4)], axis=1)
    mn = np.concatenate([m & 63, (hi >> 4) | ((m >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q4_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    dl = d * sc
    return _nibbles(b[:, 16:144], 32), dl, np.float32(8) * dl - dmin * mn


def _q5_k(b):
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    q = _nibbles(b[:, 48:176], 32) | (_high_bits(b[:, 16:48], QK_K) << np.uint8(4))
    return q + np.uint8(128), d * sc, -(dmin * mn)


def _q6_k(b):
    low = _nibbles(b[:, 0:128], 64)
    high = _bits(b[:, 128:192], 2, 32)
    sc = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    return (low | (high << np.uint8(4))) + np.uint8(96), _f16(b, 208) * sc, None


_DECODE = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
           "Q2_K": _q2_k, "Q3_K": _q3_k, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k}
