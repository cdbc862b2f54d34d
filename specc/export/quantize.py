"""Integer precisions: the MatMul weights of an exported fp32 graph rewritten as weight-only
integer blocks, one tensor at a time.

Every MatMul whose weight is a constant [K, N] fp32 tensor becomes onnxruntime's com.microsoft
MatMulNBits: the weight is stored as `bits`-bit codes in blocks of consecutive rows of one
column, each block with its own float scale, and dequantizes as (code - zero_point) x scale.
Activations stay fp32 outside the kernel. Inside it, each scheme has its accuracy level for graphs
with a KV cache, which decode a token at a time: int8's is 4 (the kernel computes in int8,
quantizing its input per block along K as well, the weight's block length, so an outlier channel
only coarsens the block it sits in), int4's is 1 (fp32: the input meets the 4-bit weights
unrounded; rounded to 8 bits it changed 3 of SmolLM2's 8 greedy chat answers, at about two thirds
of the decode speed, docs/benchmarks_quality.md). A graph without a cache (an encoder) computes in
fp32 (level 1: accuracy_level()); a tied head (below) at its own scheme's level.

- int8: 8-bit codes in blocks of 16, an integer zero point per block (the block's range widened
  to include 0). Chosen over dynamic quantization (DynamicQuantizeMatMul, one int8 scale for the
  whole input tensor), which a trained model's outlier channels break, and over blocks of 32,
  whose activation blocks cost SmolLM2-135M a point of next-token agreement for a tenth of the
  decode time (docs/benchmarks_quality.md; the choice: docs/build.md).
- int4: 4-bit codes in blocks of 32 (Q4_0's and Q4_1's blocks, so a checkpoint distributed in
  them keeps its grid), for decoders, whose decode speed is the weight bytes read per token.
  No zero-point input: the kernel's default (the middle code, 8) lets onnxruntime take its
  symmetric path, which decodes about twice as fast as blocks with their own zero points
  (docs/benchmarks_int4_layout.md). Each weight takes the symmetric form (Q4_0's: the block's
  largest magnitude, with its sign, is code 0) or, where that at least halves the error, the
  offset form (the block's [min, max], Q4_1's: its centre added back outside the kernel).

A tied output projection (a MatMul reading the embedding table through a Transpose) is packed
in an int4 build, from the table transposed as it is written, in int8's blocks (TIED_HEAD): the
decode then reads its codes, not the fp32 table, at every token, while Gather (the embedding
lookup) keeps the table in fp32. An int8 build keeps it fp32.
The attention products (activation by activation) stay fp32. The graph is written back in place,
normalized again so identical inputs give identical bytes.

Routed experts (a MoE node, specc/export/moe.py) become onnxruntime's QMoE: each expert's
weights packed by the same scheme, row by row along K ([E, N, K] as MoE holds them: codes
[E, N, K * bits / 8], scales [E, N, K / block], int8's zero points [E, N, K / block]), always in
the scheme's own form (QMoE has no offset form), at the graph's accuracy level, where the block
divides both d_model and the experts' d_ff (else the experts stay fp32). The router stays fp32
(a Gemm, which this module leaves alone), so an integer build chooses the experts the fp32 model
would for the same input.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specc.errors import BuildError, first_line
from specc.spec.io import is_past
from specc.spec.targets import ACTIVATION_LEVELS, PRECISIONS

BLOCK = 32  # rows of one column that share a scale and a zero point, unless a scheme says otherwise
# a graph that takes no KV cache runs whole sequences, never one token at a time (an encoder, an
# encoder-decoder's encoder): its products are large enough that the kernel's fp32 path, which
# dequantizes each weight block once per call and leaves the activations unquantized, is both
# faster there and closer to fp32 (all-MiniLM-L6-v2, 32 sentences, int8: 0.80 s against 1.12 at
# level 4, embedding cosine 0.99992 against 0.99981; int4: 0.75 s against 0.88)
WHOLE_SEQUENCE_ACCURACY_LEVEL = 1


@dataclass(frozen=True)
class Scheme:
    """One integer precision's weight format."""

    bits: int
    # where a graph decodes a token at a time and serving.activations gives none: the precision's
    # own activations (specc/spec/targets.py; int8 computes in int8: level 0 would dequantize the
    # weight at every call, 30x slower at 8 bits)
    accuracy_level: int
    block: int = BLOCK
    zero_points: bool = True  # an integer zero point per block; False: every code read about the middle code

    @property
    def top(self) -> int:
        return (1 << self.bits) - 1

    @property
    def mid(self) -> int:
        """The middle code: MatMulNBits' zero point where the graph gives none."""
        return (self.top + 1) // 2

    @property
    def bytes_per_weight(self) -> float:
        """Bytes a weight takes as this scheme packs it (Packed): its code, and per block a float
        scale (and a code of zero point, where the scheme has them). The offset form, where a
        weight takes it, adds a float per block beside these."""
        return self.bits / 8 + (4 + (self.bits / 8 if self.zero_points else 0)) / self.block


SCHEMES = {"int8": Scheme(bits=8, block=16, accuracy_level=ACTIVATION_LEVELS[PRECISIONS["int8"].activations]),
           "int4": Scheme(bits=4, zero_points=False, accuracy_level=ACTIVATION_LEVELS[PRECISIONS["int4"].activations])}
# the scheme a tied output projection is packed in, by precision (None: it stays fp32). Measured on
# SmolLM2-135M (docs/build.md): at 4 bits its tied head failed the build's verification, at 8 bits
# an int4 build kept its next tokens and perplexity (llama.cpp too keeps an output projection at 6
# or 8 bits in its 4-bit files), while an int8 build lost a point of next-token agreement, below
# its bar of 97%, to the head's 8-bit activations
TIED_HEAD = {"int4": "int8", "int8": None}


def describe(precision: str, activations: str | None = None) -> dict:
    """The quantization an integer precision applies (with serving.activations), as the
    manifest's options record it (and the build's cache key hashes: a build made with another
    scheme is not up to date)."""
    scheme = SCHEMES[precision]
    level = ACTIVATION_LEVELS[activations] if activations else scheme.accuracy_level
    return {"op": "MatMulNBits", "bits": scheme.bits, "block": scheme.block, "accuracy_level": level,
            "accuracy_level_without_cache": WHOLE_SEQUENCE_ACCURACY_LEVEL,
            "zero_points": scheme.zero_points, "offset_form": scheme.bits <= 4, "tied_head": TIED_HEAD[precision] or "fp32",
            **({"tied_head_accuracy_level": SCHEMES[TIED_HEAD[precision]].accuracy_level} if TIED_HEAD[precision] else {}),
            "routed_experts": "QMoE"}


def accuracy_level(scheme: Scheme, sig, activations: str | None = None) -> int:
    """MatMulNBits' accuracy level for a graph: where the graph takes a KV cache (it decodes a
    token at a time), `activations`' (serving.activations) or else the scheme's; else
    WHOLE_SEQUENCE_ACCURACY_LEVEL."""
    if not any(is_past(t.name) for t in sig.inputs):
        return WHOLE_SEQUENCE_ACCURACY_LEVEL
    return ACTIVATION_LEVELS[activations] if activations else scheme.accuracy_level


@dataclass(frozen=True)
class Packed:
    """MatMulNBits' inputs for one [K, N] weight: codes [N, blocks, block * bits / 8] uint8,
    scales [N * blocks] float32, zero points [N * ceil(blocks * bits / 8)] uint8 (None where the
    scheme has none: every code is read about the middle code); with `offsets` [blocks, N] float32
    (the offset form), each block's centre is added back outside the kernel."""

    codes: np.ndarray
    scales: np.ndarray
    zero_points: np.ndarray | None
    offsets: np.ndarray | None = None


def pack(w: np.ndarray, scheme: Scheme, offsets: bool = False) -> Packed:
    """Blockwise asymmetric quantization of a [K, N] weight along K (rows past K in the last
    block are zeros). Deterministic: the same weight gives the same bytes.

    With zero points (int8), each block spans its range widened to include 0, with an integer
    zero point. Without them (int4) the symmetric form is llama.cpp's Q4_0: the scale is the
    block's largest-magnitude weight, with its sign, over -mid, so that weight is code 0 exactly
    and the others round to the nearest code (those at the opposite end clamp to the top code,
    at most a step away). The offset form spans the block's own [min, max] with codes from its
    minimum (llama.cpp's Q4_1 has this form): exact for weights that already sit on such a grid,
    as those of a checkpoint distributed as Q4_1 do. The kernel reads the codes about the middle
    code and the block's centre stays a float, added back outside it: the int8 rounding of the
    input inside the kernel (accuracy level 4) then meets the weight less its centre, not less
    its minimum, about half the error (on SmolLM2: next-token agreement 94.9% -> 97.5%,
    docs/build.md).

    Columns are packed PACK_ELEMENTS weights at a time (each column is quantized alone), so that
    the working copies stay small beside a large weight (a 128256-token head is 2 GiB in fp32)."""
    if scheme.bits not in (4, 8):
        raise BuildError(f"no {scheme.bits}-bit packing")
    k, n = w.shape
    step = max(1, PACK_ELEMENTS // max(k, 1))
    if n <= step:
        return _pack_columns(w, scheme, offsets)
    parts = [_pack_columns(w[:, i:i + step], scheme, offsets) for i in range(0, n, step)]
    return Packed(np.concatenate([p.codes for p in parts]), np.concatenate([p.scales for p in parts]),
                  np.concatenate([p.zero_points for p in parts]) if scheme.zero_points else None,
                  np.concatenate([p.offsets for p in parts], axis=1) if offsets else None)


PACK_ELEMENTS = 1 << 24  # weights packed at once (64 MiB in fp32): see pack


def _pack_columns(w: np.ndarray, scheme: Scheme, offsets: bool) -> Packed:
    """pack() of one range of columns."""
    import torch  # its kernels use every core where numpy's use one (a 7B build packs 6.5e9 weights)

    return _pack_rows(torch.from_numpy(np.asarray(w, dtype=np.float32)).T, scheme, offsets)


def _pack_rows(rows, scheme: Scheme, offsets: bool) -> Packed:
    """pack() of the [K, n] weight whose transpose is `rows` (a torch float32 [n, K], a view is
    read, never changed): each row quantized along K."""
    import torch

    codes, scale, zero, lo = _codes(rows, scheme, offsets)
    n, blocks = scale.shape
    codes = codes.to(torch.uint8)
    if scheme.bits == 4:  # two codes a byte, the first in the low nibble; zero points likewise, a row padded to bytes
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
        if blocks % 2:
            zero = torch.cat([zero, torch.zeros((n, 1), dtype=torch.uint8)], dim=1)
        zero = zero[:, 0::2] | (zero[:, 1::2] << 4)
    return Packed(codes.contiguous().numpy(), scale.reshape(-1).numpy(),
                  zero.contiguous().reshape(-1).numpy() if scheme.zero_points else None,
                  lo.T.contiguous().numpy() if offsets else None)


def _codes(rows, scheme: Scheme, offsets: bool):
    """_pack_rows' quantization before the codes are packed into bytes: (codes [n, blocks, block]
    as float32 integers, scales [n, blocks], zero points [n, blocks] uint8, the offset form's
    centres [n, blocks] (else the blocks' minima))."""
    import torch

    n, k = rows.shape
    blocks = -(-k // scheme.block)
    cols = torch.zeros((n, blocks * scheme.block), dtype=torch.float32)
    cols[:, :k] = rows
    cols = cols.reshape(n, blocks, scheme.block)
    lo, hi = cols.amin(dim=2), cols.amax(dim=2)
    if offsets:
        scale = (hi - lo) / scheme.top
        scale[scale == 0] = 1.0  # a constant block: any scale, codes all at the zero point (or the offset)
        zero = torch.full((n, blocks), scheme.mid, dtype=torch.uint8)
        codes = cols.sub_(lo[..., None]).div_(scale[..., None]).round_().clamp_(0, scheme.top)
        lo = lo + scheme.mid * scale
    elif scheme.zero_points:
        lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
        scale = (hi - lo) / scheme.top
        scale[scale == 0] = 1.0
        zero = (-lo / scale).round_().clamp_(0, scheme.top).to(torch.uint8)
        codes = cols.div_(scale[..., None]).round_().add_(zero[..., None]).clamp_(0, scheme.top)
    else:  # symmetric: the largest magnitude, signed, is code 0
        extreme = torch.where(-lo > hi, lo, hi)
        scale = extreme / -scheme.mid
        scale[scale == 0] = 1.0
        zero = torch.full((n, blocks), scheme.mid, dtype=torch.uint8)
        codes = cols.div_(scale[..., None]).round_().add_(scheme.mid).clamp_(0, scheme.top)
    return codes, scale, zero, lo


def unpack(p: Packed, scheme: Scheme, k: int) -> np.ndarray:
    """The [K, N] weight a Packed dequantizes to (what MatMulNBits multiplies by)."""
    return _unpacked_rows(p, scheme, k).T.numpy()


def block_sums(k: int, block: int) -> np.ndarray:
    """[K, blocks] of 0 and 1: x @ block_sums(K) is the sum of x over each block of K, what the
    offset form's minima multiply."""
    blocks = -(-k // block)
    return np.kron(np.eye(blocks, dtype=np.float32), np.ones((block, 1), np.float32))[:k]


SAMPLE_COLUMNS = 256  # columns of a weight its form is chosen on (every k-th, k = ceil(N / 256))


def choose(w: np.ndarray, scheme: Scheme) -> Packed:
    """w packed in the form offset_form() chooses."""
    return pack(w, scheme, offsets=offset_form(w, scheme))


def offset_form(w: np.ndarray, scheme: Scheme) -> bool:
    """Whether the offset form at least halves the weight's quantization error against the
    scheme's own form (it costs two more nodes a MatMul and a float per block), judged on an
    even sample of SAMPLE_COLUMNS of its columns (a weight on Q4_1's grid is exact in it, a
    gaussian one about as good in either: the sample tells them apart at a fraction of packing
    the whole weight twice). Only 4-bit codes are worth it: at 8 bits both forms are within
    rounding of the weight."""
    if scheme.bits > 4:
        return False
    step = -(-w.shape[1] // SAMPLE_COLUMNS)
    sample = np.ascontiguousarray(w[:, ::step], dtype=np.float32)
    plain, offset = pack(sample, scheme), pack(sample, scheme, offsets=True)
    return _squared_error(offset, scheme, sample) * 2 <= _squared_error(plain, scheme, sample)


def _squared_error(p: Packed, scheme: Scheme, w: np.ndarray) -> float:
    """sum((unpack(p) - w)^2), in torch (all cores) and summed in float64."""
    import torch

    deq = _unpacked_rows(p, scheme, w.shape[0])
    return float(deq.sub_(torch.from_numpy(np.asarray(w, dtype=np.float32)).T).square_().sum(dtype=torch.float64))


def _unpacked_rows(p: Packed, scheme: Scheme, k: int):
    """unpack(p).T as a torch float32 tensor [N, K] (a Linear's [out, in] layout), in torch."""
    import torch

    n, blocks = p.codes.shape[:2]
    codes = torch.from_numpy(p.codes)
    if p.zero_points is None:
        zero = torch.full((n, blocks), scheme.mid, dtype=torch.uint8)
    else:
        zero = torch.from_numpy(p.zero_points).reshape(n, -1)
    if scheme.bits == 4:
        codes = torch.stack([codes & 15, codes >> 4], dim=-1).reshape(n, blocks, scheme.block)
        if p.zero_points is not None:
            zero = torch.stack([zero & 15, zero >> 4], dim=-1).reshape(n, -1)[:, :blocks]
    deq = (codes.float() - zero[..., None].float()).mul_(torch.from_numpy(p.scales).reshape(n, blocks)[..., None])
    if p.offsets is not None:
        deq += torch.from_numpy(p.offsets).T[..., None]
    return deq.reshape(n, -1)[:, :k]


def dequantized(weight, precision: str):
    """The [out, in] torch weight of a Linear as an integer build's MatMulNBits multiplies by it:
    the graph reads it as its transpose [in, out], packed in the form offset_form() chooses."""
    scheme = SCHEMES[precision]
    w = weight.detach().float().T.contiguous().numpy()
    return _unpacked_rows(pack(w, scheme, offsets=offset_form(w, scheme)), scheme, w.shape[0]).contiguous()


def experts_packed(d_model: int, d_ff: int, scheme: Scheme) -> bool:
    """Whether routed experts of these widths are packed (QMoE's blocks divide both)."""
    return d_model % scheme.block == 0 and d_ff % scheme.block == 0


def dequantized_experts(weight, precision: str):
    """Stacked expert weights [E, N, K] (torch) as QMoE multiplies by them: each expert's rows
    packed along K in the scheme's own form and unpacked."""
    import torch

    scheme = SCHEMES[precision]
    w = weight.detach().float()
    e, n, k = w.shape
    rows = w.reshape(e * n, k)
    out = torch.empty_like(rows)
    for i in range(0, e * n, _stack_rows(k)):
        part = rows[i:i + _stack_rows(k)]
        codes, scale, zero, _ = _codes(part, scheme, False)  # what the packed codes unpack to, never packed
        out[i:i + len(part)] = codes.sub_(zero[..., None].float()).mul_(scale[..., None]).reshape(len(part), -1)[:, :k]
    return out.reshape(e, n, k)


def _stack_rows(k: int) -> int:
    """Rows of a stacked expert weight packed at once: PACK_ELEMENTS weights (pack's working copies)."""
    return max(1, PACK_ELEMENTS // max(k, 1))


def pack_experts(w: np.ndarray, scheme: Scheme) -> dict[str, np.ndarray]:
    """Stacked expert weights [E, N, K] as QMoE reads them: each expert's rows packed along K in
    the scheme's own form (what pack(w[e].T) makes, for every expert at once, read in their own
    row order: no transposed copy): codes [E, N, K * bits / 8], scales [E, N, blocks], with the
    scheme's zero points [E, N, ceil(blocks * bits / 8)]."""
    import torch

    e, n, k = w.shape
    rows = torch.from_numpy(np.asarray(w, dtype=np.float32)).reshape(e * n, k)
    step = _stack_rows(k)
    parts = [_pack_rows(rows[i:i + step], scheme, False) for i in range(0, e * n, step)]
    arrays = {"codes": np.concatenate([p.codes.reshape(len(p.codes), -1) for p in parts]),
              "scales": np.concatenate([p.scales.reshape(len(p.codes), -1) for p in parts])}
    if scheme.zero_points:
        arrays["zero_points"] = np.concatenate([p.zero_points.reshape(len(p.codes), -1) for p in parts])
    return {field: a.reshape(e, n, -1) for field, a in arrays.items()}


def dequantize_linears(module, precision: str) -> None:
    """Every Linear weight of `module` that an integer build quantizes replaced, in place, by
    dequantized() (and routed experts' stacked weights, where a MoE node holds them, by
    dequantized_experts()), and a tied lm head given the embedding table so dequantized (TIED_HEAD) as its projection
    (the lookup keeps the table itself): torch then computes with the weights the build's graph
    holds (what verification compares it with). Not quantized: the Linears of a pooled head
    (Head.pooled_linears: the exporter writes those as Gemm)."""
    from torch import nn

    pooled = {id(m) for sub in module.modules() for m in getattr(sub, "pooled_linears", [])}
    for sub in module.modules():
        if isinstance(sub, nn.Linear) and id(sub) not in pooled:
            sub.weight.data = dequantized(sub.weight, precision)
        for name in getattr(sub, "routed_weights", ()):  # Experts' stacked [E, N, K] weights that a MoE node holds
            param = getattr(sub, name)
            if experts_packed(sub.up.shape[2], sub.down.shape[2], SCHEMES[precision]):
                param.data = dequantized_experts(param, precision)
    if hasattr(module, "heads") and hasattr(module, "embeddings"):  # the whole model (a SpeccModel), not a layer
        tied = [h for h in module.heads.values() if h.kind in ("lm", "mlm") and h.proj is None]
        if tied and TIED_HEAD[precision]:
            table = module.embeddings.table("decoder" if module.decoder is not None else "encoder").weight
            projection = dequantized(table, TIED_HEAD[precision])  # one table, however many heads read it
            for head in tied:
                head.tied_projection = projection


def quantize(model, precision: str, sig, activations: str | None = None) -> dict:
    """Quantize an onnx_ir Model's MatMul weights in place (before it is saved), decoding in
    `activations` (serving.activations; None: the scheme's own); returns facts for the manifest. The packed tensors are lazy: each weight is packed when the graph is written
    (and once here, to choose its form), so no more than one weight's codes exist at a time."""
    scheme = SCHEMES.get(precision)
    if scheme is None:
        raise BuildError(f"no quantizer for precision {precision!r}")
    try:
        level = accuracy_level(scheme, sig, activations)
        head = SCHEMES.get(TIED_HEAD[precision])
        count, offset_count = _rewrite(model.graph, scheme, level, head, accuracy_level(head, sig) if head else None)
        experts = _rewrite_experts(model.graph, scheme, level)
    except BuildError:
        raise
    except Exception as exc:  # onnx_ir's and numpy's own errors on a graph this module does not expect
        first = first_line(exc) or type(exc).__name__
        raise BuildError(f"quantizing the {sig.name} graph to {precision} failed: {first}") from None
    model.opset_imports.setdefault("com.microsoft", 1)
    ops: dict[str, int] = {}
    for n in model.graph:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    return {"graph": sig.name, "precision": precision, "float_matmuls_left": ops.get("MatMul", 0),
            "quantized_ops": {"MatMulNBits": count, **({"QMoE": experts} if experts else {})},
            **({"moe_left_fp32": ops["MoE"]} if "MoE" in ops else {}), "offset_form": offset_count, "bits": scheme.bits,
            "block": scheme.block, "accuracy_level": level}


def quantize_file(path: Path, precision: str, sig, activations: str | None = None) -> dict:
    """quantize() on the graph saved at `path`, written back in place (benchmarks/passes.py)."""
    import onnx_ir as ir

    from specc.export.onnx import _normalize, write_streaming

    model = ir.load(str(path))
    facts = quantize(model, precision, sig, activations)
    write_streaming(model, path, lambda proto: _normalize(proto, sig))
    return facts


@dataclass(frozen=True)
class _Weight:
    """A MatMul's constant [K, N] fp32 weight: an initializer, or the transpose of one (`transposed`:
    a tied output projection reads the embedding table [V, D] as [D, V])."""

    value: object  # the onnx_ir initializer Value
    transposed: bool

    @property
    def name(self) -> str:
        return f"{self.value.name}.T" if self.transposed else self.value.name

    @property
    def shape(self) -> tuple[int, int]:
        k, n = self.value.const_value.shape
        return (n, k) if self.transposed else (k, n)

    def numpy(self) -> np.ndarray:
        w = self.value.const_value.numpy()
        return w.T if self.transposed else w  # a view: pack() copies a range of columns at a time


def _matmul_weight(graph, node) -> _Weight | None:
    """The constant weight a MatMul multiplies by (its second input): an initializer, or a tied
    output projection's table (the Transpose of an initializer that a Gather, the lookup, reads
    too); None where it is computed from activations or is not a 2-D fp32 tensor."""
    import onnx_ir as ir

    if node.op_type != "MatMul" or node.domain != "" or len(node.inputs) != 2:
        return None
    value, transposed = node.inputs[1], False
    producer = value.producer() if value is not None else None
    if (producer is not None and producer.op_type == "Transpose" and producer.domain == ""
            and list(producer.attributes.get_ints("perm", [1, 0])) == [1, 0] and producer.inputs[0] is not None
            and any(user.op_type == "Gather" for user, _ in producer.inputs[0].uses())):
        value, transposed = producer.inputs[0], True
    if (value is None or value.name not in graph.initializers or value.const_value is None
            or value.const_value.dtype != ir.DataType.FLOAT or len(value.const_value.shape) != 2):
        return None
    return _Weight(value, transposed)


class _Packs:
    """Each weight's Packed, made when first asked for and kept until another weight's is: the
    lazy codes, scales, zero points (and offsets) of one weight are written one after another."""

    def __init__(self):
        self.forms: dict[str, tuple[Scheme, bool]] = {}  # weight -> its scheme, and whether it takes the offset form
        self._last: tuple[str, Packed] | None = None

    def choose(self, weight: _Weight, scheme: Scheme) -> tuple[bool, dict[str, tuple]]:
        """The weight's form in `scheme`, and the dtype and shape of each of its packed tensors."""
        w = weight.numpy()
        offsets = offset_form(w, scheme)
        self.forms[weight.name] = (scheme, offsets)
        k, n = w.shape
        blocks = -(-k // scheme.block)
        shapes = {"codes": (np.uint8, (n, blocks, scheme.block * scheme.bits // 8)),
                  "scales": (np.float32, (n * blocks,))}
        if scheme.zero_points:
            shapes["zero_points"] = (np.uint8, (n * -(-blocks * scheme.bits // 8),))
        if offsets:
            shapes["offsets"] = (np.float32, (blocks, n))
        return offsets, shapes

    def get(self, weight: _Weight) -> Packed:
        if self._last is None or self._last[0] != weight.name:
            self._last = None
            scheme, offsets = self.forms[weight.name]
            self._last = (weight.name, pack(weight.numpy(), scheme, offsets=offsets))
        return self._last[1]


def _lazy(packs: _Packs, weight, field: str, dtype, shape: tuple, name: str):
    """An initializer holding `field` of the weight's Packed, made when it is written."""
    import onnx_ir as ir

    tensor = ir.LazyTensor(lambda: ir.tensor(getattr(packs.get(weight), field), name=name),
                           dtype=ir.DataType.from_numpy(np.dtype(dtype)), shape=ir.Shape(shape), name=name)
    return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype), const_value=tensor)


def _rewrite(graph, scheme: Scheme, level: int, head: Scheme | None = None,
             head_level: int | None = None) -> tuple[int, int]:
    """Every MatMul with a constant 2-D fp32 weight (_matmul_weight) becomes MatMulNBits, in
    `scheme` at accuracy `level`, or a tied head's in `head` at `head_level` (default: `level`;
    head None: left fp32); returns how many, and how many of them are in the offset form. A
    weight, or a Transpose, that no other node reads is dropped from the graph."""
    import onnx_ir as ir

    packs = _Packs()
    count, offset_count, packed, summed = 0, 0, {}, {}
    for node in list(graph):
        weight = _matmul_weight(graph, node)
        if weight is None or (weight.transposed and head is None):
            continue
        own = head if weight.transposed else scheme
        k, n = weight.shape
        read = node.inputs[1]  # the initializer, or the Transpose's output
        base = f"{weight.name}_q{own.bits}"
        if base not in packed:  # a weight two MatMuls read is packed once
            _, shapes = packs.choose(weight, own)
            values = {}
            for field, (dtype, shape) in shapes.items():
                values[field] = _lazy(packs, weight, field, dtype, shape, f"{base}.{field}")
                graph.register_initializer(values[field])
            packed[base] = values
        values = packed[base]
        x, y = node.inputs[0], node.outputs[0]
        inputs = [x, values["codes"], values["scales"]] + ([values["zero_points"]] if own.zero_points else [])
        matmul = ir.node("MatMulNBits", inputs,
                         attributes={"K": k, "N": n, "bits": own.bits, "block_size": own.block,
                                     "accuracy_level": head_level if weight.transposed and head_level is not None else level},
                         domain="com.microsoft", name=node.name)
        new = [matmul]
        if "offsets" in values:  # y = x @ (scale * codes) + (block sums of x) @ minima
            matmul.outputs[0].name = f"{y.name}.codes"
            sums = summed.get((x.name, k))
            if sums is None:  # once per input: the projections that read one input share it
                ones = ir.Value(name=f"{x.name}.block_sums{k}.ones", const_value=ir.tensor(block_sums(k, own.block)))
                ones.shape, ones.type = ones.const_value.shape, ir.TensorType(ir.DataType.FLOAT)
                graph.register_initializer(ones)
                total = ir.node("MatMul", [x, ones], name=f"{node.name}.block_sums")
                total.outputs[0].name = f"{x.name}.block_sums{k}"
                new.append(total)
                sums = summed[(x.name, k)] = total.outputs[0]
            offsets = ir.node("MatMul", [sums, values["offsets"]], name=f"{node.name}.offsets")
            offsets.outputs[0].name = f"{y.name}.offsets"
            add = ir.node("Add", [matmul.outputs[0], offsets.outputs[0]], name=f"{node.name}.add")
            new += [offsets, add]
            offset_count += 1
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, [y], [new[-1].outputs[0]])
        count += 1
        if weight.transposed and not read.uses():
            graph.remove(read.producer(), safe=True)
        if not weight.value.uses():
            graph.initializers.pop(weight.value.name)
    return count, offset_count


def _rewrite_experts(graph, scheme: Scheme, level: int) -> int:
    """Every MoE node whose expert weights are fp32 initializers whose widths the scheme's block
    divides (experts_packed) becomes QMoE, at accuracy `level`; returns how many."""
    import onnx_ir as ir

    count = 0
    for node in list(graph):
        if node.op_type != "MoE" or node.domain != "com.microsoft":
            continue
        fc1, fc2 = node.inputs[2], node.inputs[4]
        weights = [w for w in (fc1, fc2) if w is not None and w.name in graph.initializers and w.const_value is not None
                   and w.const_value.dtype == ir.DataType.FLOAT and len(w.const_value.shape) == 3]
        if len(weights) != 2:
            continue
        d_model, d_ff = fc1.const_value.shape[2], fc2.const_value.shape[2]
        if not experts_packed(d_model, d_ff, scheme):
            continue
        cache = _ExpertPacks(scheme)
        packed = [_expert_values(graph, cache, w, scheme) for w in (fc1, fc2)]
        bias = [node.inputs[i] if len(node.inputs) > i else None for i in (3, 5)]
        inputs = [node.inputs[0], node.inputs[1], packed[0]["codes"], packed[0]["scales"], bias[0],
                  packed[1]["codes"], packed[1]["scales"], bias[1], None, None, None]
        inputs += [packed[0]["zero_points"], packed[1]["zero_points"]] if scheme.zero_points else [None, None]
        attributes = {a.name: a.value for a in node.attributes.values()}
        attributes.update(expert_weight_bits=scheme.bits, block_size=scheme.block, accuracy_level=level)
        new = []
        if not attributes.get("normalize_routing_weights", 0):
            # QMoE (CPU) weighs by the softmax of the top k alone, unless it is given router_weights,
            # whose values at the chosen experts it uses as they are: MoE's softmax over every logit
            weights = ir.node("Softmax", [node.inputs[1]], attributes={"axis": -1}, name=f"{node.name}.router_weights")
            weights.outputs[0].name = f"{node.name}.router_weights"
            new.append(weights)
            inputs += [None, weights.outputs[0]]  # fc3_zero_points, router_weights
        qmoe = ir.node("QMoE", inputs, attributes=attributes, domain="com.microsoft", name=node.name)
        new.append(qmoe)
        ir.convenience.replace_nodes_and_values(graph, node, [node], new, [node.outputs[0]], [qmoe.outputs[0]])
        for w in (fc1, fc2):
            if not w.uses():
                graph.initializers.pop(w.name)
        count += 1
    return count


class _ExpertPacks:
    """Stacked expert weights [E, N, K] packed expert by expert, the last one kept: its codes,
    scales and zero points are written one after another."""

    def __init__(self, scheme: Scheme):
        self.scheme = scheme
        self._last: tuple[str, dict[str, np.ndarray]] | None = None

    def get(self, value) -> dict[str, np.ndarray]:
        if self._last is None or self._last[0] != value.name:
            self._last = None
            self._last = (value.name, pack_experts(value.const_value.numpy(), self.scheme))
        return self._last[1]


def _expert_values(graph, cache: _ExpertPacks, value, scheme: Scheme) -> dict:
    """QMoE's initializers for one stacked weight [E, N, K], made when written."""
    import onnx_ir as ir

    e, n, k = value.const_value.shape
    blocks = k // scheme.block
    shapes = {"codes": (np.uint8, (e, n, k * scheme.bits // 8)), "scales": (np.float32, (e, n, blocks))}
    if scheme.zero_points:
        shapes["zero_points"] = (np.uint8, (e, n, -(-blocks * scheme.bits // 8)))
    values = {}
    for field, (dtype, shape) in shapes.items():
        name = f"{value.name}_q{scheme.bits}.{field}"
        tensor = ir.LazyTensor(lambda f=field, name=name: ir.tensor(cache.get(value)[f], name=name),
                               dtype=ir.DataType.from_numpy(np.dtype(dtype)), shape=ir.Shape(shape), name=name)
        values[field] = ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(tensor.dtype), const_value=tensor)
        graph.register_initializer(values[field])
    return values
