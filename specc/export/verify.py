"""Proof that an exported graph computes what the PyTorch graph computes.

onnxruntime runs the artifact and torch eager runs the same inputs, case by case (see CASES):
a padded batch, one token, the longest sequence the spec serves, and for graphs with a KV cache a
decode step that feeds each side its own `present.*` from the step before. Every output of every
case is compared; one beyond TOLERANCES fails the build, naming the output, the shape and the
difference.

A difference passes when  max|ort - torch| <= atol + rtol * max|torch|  (per output and case);
max_rel in the figures is max|ort - torch| / max|torch|.

An integer build's graph differs from its fp32 model by its quantization noise: with trained
weights it is compared with the fp32 model within the precision's QUALITY_BARS; with seeded ones
with torch computing with the graph's own dequantized weights (the reference run's `prepare`,
specc/builder/pipeline.py) within DEQUANTIZED_BAR. Both judge by what the outputs mean: the cosine similarity of
each row (a token's hidden state, a cache entry, a logit vector centered) with torch's, and for
scores the KL divergence of their softmax and the argmax agreement (a figure, not a bar).

The graphs are run by verification_session(): onnxruntime with the options specc runs a build
with (specc/runtime/graph.py), on the provider `--verify-provider` names.
"""
from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specc.deps import require_onnxruntime
from specc.errors import BuildError, VerificationError, first_line
from specc.malloc import trim
from specc.runtime.graph import provider_entries, session_options
from specc.spec.io import (
    ATTENTION_MASK,
    BATCH,
    ENC_SEQ,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    PAST,
    POSITION_IDS,
    SEQ,
    TOKEN_TYPE_IDS,
    cache_slots,
    concrete_dims,
    empty_cache_dims,
    numpy_dtype,
    parse_cache,
    positions_from_mask,
)
from specc.spec.resolve import GraphSig, ResolvedSpec
from specc.spec.targets import DEQUANTIZED_BAR, PRECISIONS, QUALITY_BARS, VERIFY_PROVIDERS, QualityBar, decode_activations, quality_bar
# (target, precision) -> (atol, rtol), from the targets table: on onnxruntime's CPU and CUDA providers
from specc.spec.targets import CUDA_TOLERANCES, TOLERANCES

SCORE_KINDS = ("lm", "mlm", "classifier", "token_classifier")  # outputs whose rows are logits over classes
# A reference case's entry beside its outputs: [routed layers, tokens], each token's gap between
# the k-th and (k+1)-th of its router's choice values, in standard deviations of those values
# (the reference's own routing, recorded by its `routing()`; tokens in the case's [B, S] order).
ROUTING_GAPS = "routing.gaps"
# A token whose gap is below this was a near tie for its router: a rounding of the graph's
# (int8 activations upstream) may choose the other expert there, and that row's output is then
# another expert's. Where a layer is verified from torch's own input (a segment, segments.py),
# such a row of its output may fall below an integer build's row bar, and is left out of the
# mean (counted). Measured (gpt-oss-20b's widths, seeded, int8 activations): flips at gaps up to
# 0.023; docs/build.md, "Verifying integer builds"
NEAR_TIE = 0.05


def tolerance(target: str, precision: str, provider: str = "cpu") -> tuple[float, float]:
    """(atol, rtol) of `target`'s graphs at `precision`, verified on `provider` ("cpu" or "cuda")."""
    try:
        return (CUDA_TOLERANCES if provider == "cuda" else TOLERANCES)[(target, precision)]
    except KeyError:
        on = " on CUDA" if provider == "cuda" else ""
        raise VerificationError(f"no verification tolerance for target {target!r} at precision {precision!r}{on}") from None


@dataclass(frozen=True)
class Case:
    """One verification run of one graph. `pad`: padded positions in the last row (right padding
    for source sequences, left padding for decoder prompts). `after`: the case whose present.*
    become this case's past (a decode step). `source`: the encoder case an encoder-decoder's
    decoder case reads."""

    name: str
    graph: str
    batch: int
    sequence: int
    pad: int = 0
    after: str | None = None
    source: str | None = None


def cases(r: ResolvedSpec, longest: int | None = None) -> list[Case]:
    """The verification cases for the spec's graphs, in the order they must run. No case runs
    past serving.length.max (a prefill and its decode step together included), nor past
    `longest` where given (a streamed build's cap, specc/builder/pipeline.py)."""
    longest = r.serving.length.max if longest is None else min(longest, r.serving.length.max)
    short = min(9, longest)
    pad = min(3, short - 1)  # the padded row keeps at least one real token
    if r.architecture == "encoder":
        return [Case("padded", "model", 2, short, pad), Case("one-token", "model", 1, 1),
                Case("longest", "model", 1, longest)]
    prompt = max(1, min(8 if r.architecture == "decoder" else 6, longest - 1))
    prefill = [Case("padded-prefill", "model", 2, prompt, min(3, prompt - 1))]
    if longest >= 2:
        prefill.append(Case("decode-step", "model", 2, 1, after="padded-prefill"))
    singles = [Case("one-token", "model", 1, 1), Case("longest", "model", 1, longest)]
    if r.architecture == "decoder":
        return prefill + window_cases(r, longest) + singles
    encoder = [Case("padded", "encoder", 2, short, pad), Case("one-token", "encoder", 1, 1),
               Case("longest", "encoder", 1, longest)]
    decoder = [replace(c, graph="decoder", source={"padded-prefill": "padded", "decode-step": "padded"}.get(c.name, c.name))
               for c in prefill + singles]
    return encoder + decoder


def window_cases(r: ResolvedSpec, longest: int) -> list[Case]:
    """Where a layer keeps a window cache (spec/io.py) of W positions with W + 3 <= `longest`: a
    left-padded prompt of W + 1 tokens, whose present the window cuts, and two steps from it
    (single tokens), which read the cut cache and shift it again. None where the padded prefill
    and its step already do that (W below the prefill's length)."""
    windows = [w for w in r.cache_windows if w]
    if not windows:
        return []
    w = min(windows)
    if w + 3 > longest or w < min(8, longest - 1):
        return []
    return [Case("window-prefill", "model", 2, w + 1, 1), Case("window-step", "model", 2, 1, after="window-prefill"),
            Case("window-step-2", "model", 2, 1, after="window-step")]


@dataclass
class Report:
    target: str
    precision: str
    atol: float
    rtol: float
    cases: list[dict] = field(default_factory=list)
    bar: QualityBar | None = None  # an integer precision's, instead of atol and rtol
    dequantized: bool = False  # the reference computed with the graph's dequantized weights
    segments: list[dict] = field(default_factory=list)  # a streamed build's, by segment and case (segments.py)
    provider: str = "cpu"  # onnxruntime's execution provider that ran the graphs: cpu or cuda

    @property
    def max_abs(self) -> float:
        return max((o["max_abs"] for c in (*self.cases, *self.segments) for o in c["outputs"].values()), default=0.0)

    def to_dict(self) -> dict:
        judged = ({"quality_bar": vars(self.bar), "compared_with": "dequantized" if self.dequantized else "fp32"}
                  if self.bar is not None
                  else {"tolerance": {"atol": self.atol, "rtol": self.rtol}})
        return {"target": self.target, "precision": self.precision, "provider": self.provider, **judged,
                "passed": True, "max_abs_diff": self.max_abs, "cases": self.cases,
                **({"segments": self.segments} if self.segments else {})}

    def compare(self, name: str, scores: bool, got: np.ndarray, want, where: str, gaps: np.ndarray | None = None) -> dict:
        """One output of one case against torch's, by this report's tolerance or bar: its figures,
        or VerificationError naming `where`. `gaps`: each row's token's routing gap, where its
        rows are a routed layer's output (an integer build's bar, _compare_quality)."""
        if self.bar is None:
            return _compare(name, got, want, self.atol, self.rtol, where)
        return _compare_quality(name, scores, got, want, self.bar, where, gaps)


def new_report(r: ResolvedSpec, target: str, precision: str, dequantized: bool = False,
               provider: str = "cpu") -> Report:
    """The empty report a build's outputs are judged into: the tolerance of (target, precision) on
    `provider` (cpu or cuda), or an integer precision's quality bar (targets.quality_bar against fp32, DEQUANTIZED_BAR
    against the graph's own dequantized weights)."""
    # the onnx target's graphs are what integer builds verify (a TensorRT engine is never integer)
    integer = target == "onnx" and precision in PRECISIONS and PRECISIONS[precision].quantized
    activations = decode_activations(precision, r.serving.activations) if integer else None
    bar = (DEQUANTIZED_BAR if dequantized else quality_bar(precision, activations)) if integer else None
    atol, rtol = tolerance(target, precision, provider) if bar is None else (0.0, 0.0)
    return Report(target, precision, atol, rtol, bar=bar, dequantized=dequantized and bar is not None, provider=provider)


def scored(r: ResolvedSpec) -> set[str]:
    """The outputs whose rows are logits over classes (judged by KL and argmax as well)."""
    return {o.name for o in r.outputs if o.kind in SCORE_KINDS}


def _base_feed(r: ResolvedSpec, sig: GraphSig, case: Case, rng: np.random.Generator,
               prev_mask: np.ndarray | None, source_mask: np.ndarray | None) -> dict[str, np.ndarray]:
    """The integer inputs of one case; float inputs (caches) come from earlier cases' outputs."""
    b, t = case.batch, case.sequence
    vocab = r.input_vocab_size(sig.name)
    feed: dict[str, np.ndarray] = {INPUT_IDS: rng.integers(0, vocab, size=(b, t), dtype=np.int64)}
    names = {s.name for s in sig.inputs}
    if ATTENTION_MASK in names:
        mask = np.ones((b, t), dtype=np.int64)
        if case.pad:
            if sig.name == "model" and r.architecture == "decoder":
                mask[-1, : case.pad] = 0  # decoder prompts are left-padded
            else:
                mask[-1, t - case.pad:] = 0  # source sequences are right-padded
        if prev_mask is not None:
            mask = np.concatenate([prev_mask, mask], axis=1)  # [B, past + T]
        feed[ATTENTION_MASK] = mask
        if POSITION_IDS in names:
            feed[POSITION_IDS] = positions_from_mask(mask, t)
    if TOKEN_TYPE_IDS in names:
        feed[TOKEN_TYPE_IDS] = rng.integers(0, r.vocab.type_size, size=(b, t), dtype=np.int64)
    if ENCODER_ATTENTION_MASK in names:
        feed[ENCODER_ATTENTION_MASK] = source_mask
    return feed


def _cache_inputs(sig: GraphSig, case: Case, past_out: dict | None, source_out: dict | None) -> dict[str, np.ndarray]:
    """past_key_values.* for a case: the previous step's present.* (or empty), and the encoder's
    cross-attention K/V for a decoder graph."""
    feed = {}
    for s in sig.inputs:
        parsed = parse_cache(s.name)
        if parsed is None:
            continue
        slot = parsed[1]
        if slot.cross:
            feed[s.name] = source_out[slot.present]
        elif past_out is not None:
            feed[s.name] = past_out[slot.present]
        else:
            feed[s.name] = np.zeros(empty_cache_dims(s.dims, case.batch), dtype=np.float32)
    return feed


def case_feed(step: "_Step", past_out: dict | None, source_out: dict | None) -> dict[str, np.ndarray]:
    """Every input of one case: its integer inputs, its caches (from `past_out` / `source_out`,
    the outputs of the cases it continues), the float ones in the graph's precision."""
    feed = {**step.base, **_cache_inputs(step.sig, step.case, past_out, source_out)}
    for s in step.sig.inputs:
        if s.dtype.startswith("float"):
            feed[s.name] = feed[s.name].astype(numpy_dtype(s.dtype))
    return feed


_CHUNK = 1 << 18  # elements compared at a time (1 MiB of fp32): a large output (a long prompt's logits) is never copied whole
SPILL_BYTES = 16 << 20  # a case's reference outputs this large together are kept on disk until compared


class Spilled:
    """A reference output kept on disk (a long case's logits), so that it is not in memory beside
    onnxruntime's session and its own output for the same case; read back a chunk at a time."""

    def __init__(self, path: Path, array: np.ndarray):
        self.path, self.shape, self.dtype = Path(path), tuple(array.shape), array.dtype
        with open(self.path, "wb") as f:
            np.ascontiguousarray(array).tofile(f)

    @classmethod
    def existing(cls, path: Path, shape: tuple[int, ...], dtype: np.dtype) -> Spilled:
        """One written before (by another process: specc/export/reference.py), checked for size."""
        self = cls.__new__(cls)
        self.path, self.shape, self.dtype = Path(path), tuple(shape), np.dtype(dtype)
        want = self.size * self.dtype.itemsize
        if not self.path.is_file():
            raise VerificationError(f"{self.path}: the spilled reference output is missing")
        if self.path.stat().st_size != want:
            raise VerificationError(f"{self.path}: the spilled reference output is {self.path.stat().st_size} bytes, "
                                    f"not the {want} of {list(self.shape)} {self.dtype}")
        return self

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def read(self) -> np.ndarray:
        """The whole array (an input fed to a graph: a hidden state, a cache)."""
        return next(self.chunks(self.size)).reshape(self.shape) if self.size else np.empty(self.shape, self.dtype)

    def chunks(self, n: int) -> Iterator[np.ndarray]:
        with open(self.path, "rb") as f:
            for i in range(0, self.size, n):
                chunk = np.fromfile(f, dtype=self.dtype, count=min(n, self.size - i))
                if chunk.size != min(n, self.size - i):
                    raise VerificationError(f"{self.path}: the spilled reference output was cut short")
                yield chunk


def _chunks(x: np.ndarray | Spilled) -> Iterator[np.ndarray]:
    if isinstance(x, Spilled):
        yield from x.chunks(_CHUNK)
        return
    flat = x.reshape(-1)
    for i in range(0, flat.size, _CHUNK):
        yield flat[i:i + _CHUNK]


def _compare(name: str, got: np.ndarray, want: np.ndarray | Spilled, atol: float, rtol: float, where: str) -> dict:
    if tuple(got.shape) != tuple(want.shape):
        raise VerificationError(f"{where}: output {name!r} has shape {list(got.shape)} in onnxruntime, "
                                f"{list(want.shape)} in torch")
    for side, x in (("onnxruntime", got), ("torch", want)):
        if any(np.isnan(c).any() for c in _chunks(x)):
            raise VerificationError(f"{where}: output {name!r} {list(got.shape)} has NaN in {side}")
    max_abs = scale = 0.0
    for g, w in zip(_chunks(got), _chunks(want)):
        g = g.astype(np.float32, copy=False)
        w = w.astype(np.float32, copy=False)
        finite = np.isfinite(w)
        if not (finite.all() and np.isfinite(g).all()):  # rare: the infinities apart, then the finite values
            if not np.array_equal(np.isfinite(g), finite) or not np.array_equal(g[~finite], w[~finite]):
                raise VerificationError(f"{where}: output {name!r} {list(got.shape)} has infinities where the other "
                                        f"side does not (or of the other sign)")
            g, w = g[finite], w[finite]
        if g.size:  # one scratch buffer per chunk, no masked copies
            d = np.subtract(g, w)
            max_abs = max(max_abs, float(np.abs(d, out=d).max()))
            scale = max(scale, float(np.abs(w, out=d).max()))
    max_rel = max_abs / scale if scale > 0 else max_abs
    if max_abs > atol + rtol * scale:
        raise VerificationError(
            f"{where}: output {name!r} {list(got.shape)} differs from torch by {max_abs:.3g} "
            f"(relative {max_rel:.3g}; tolerance {atol:g} + {rtol:g} x {scale:.3g})"
        )
    return {"shape": list(got.shape), "max_abs": max_abs, "max_rel": max_rel}


def _rows(x: np.ndarray | Spilled, width: int) -> Iterator[np.ndarray]:
    """`x` as [rows, width] float64 blocks of whole rows, about _CHUNK elements each."""
    n = max(1, _CHUNK // width) * width
    if isinstance(x, Spilled):
        chunks = x.chunks(n)
    else:
        flat = x.reshape(-1)
        chunks = (flat[i:i + n] for i in range(0, flat.size, n))
    for c in chunks:
        yield c.astype(np.float64).reshape(-1, width)


def _cosines(g: np.ndarray, w: np.ndarray, scores: bool) -> np.ndarray:
    """Each row's cosine of g with w ([rows, width] float64; scores centered first)."""
    if scores:
        g, w = g - g.mean(1, keepdims=True), w - w.mean(1, keepdims=True)
    ng, nw = np.linalg.norm(g, axis=1), np.linalg.norm(w, axis=1)
    both = (ng > 0) & (nw > 0)
    return np.where(both, (g * w).sum(1) / np.where(both, ng * nw, 1.0), (ng == nw).astype(np.float64))


def _compare_quality(name: str, scores: bool, got: np.ndarray, want: np.ndarray | Spilled, bar: QualityBar,
                     where: str, gaps: np.ndarray | None = None) -> dict:
    """An integer graph's output against torch's, row by row (see QualityBar). With `gaps` (a
    routed layer's output, segments.py: [rows], each row's token's routing gap): a near tie's row
    (gap below NEAR_TIE) below the row bar is left out of every figure (`rows_flipped`, the
    largest such gap `flipped_gap_max`), and any near tie's row out of the mean and KL
    (`rows_near_tie`); every other row is judged as without."""
    if tuple(got.shape) != tuple(want.shape):
        raise VerificationError(f"{where}: output {name!r} has shape {list(got.shape)} in onnxruntime, "
                                f"{list(want.shape)} in torch")
    width = got.shape[-1] if got.ndim else 1
    cos_sum = rows = agree = flipped = near_tie = start = 0
    cos_min, kl_sum, max_abs, flipped_gap = 1.0, 0.0, 0.0, 0.0
    for g, w in zip(_rows(got, width), _rows(want, width)):
        if not (np.isfinite(g).all() and np.isfinite(w).all()):
            raise VerificationError(f"{where}: output {name!r} {list(got.shape)} is not finite in "
                                    f"{'onnxruntime' if not np.isfinite(g).all() else 'torch'}")
        start += len(g)
        mean = np.ones(len(g), bool)  # the rows the mean counts
        if gaps is not None:
            gap = gaps[start - len(g):start]
            near = gap < NEAR_TIE
            keep = ~near | (_cosines(g, w, scores) >= bar.cosine_min)
            flipped += int((~keep).sum())
            flipped_gap = max([flipped_gap, *gap[~keep].tolist()])
            g, w, mean = g[keep], w[keep], ~near[keep]
            if not len(g):
                continue
        max_abs = max(max_abs, float(np.abs(g - w).max()))
        if scores:
            # ort's top class is torch's top class, or ties with it (a flat row has many)
            top = w.max(1)
            agree += int((w[np.arange(len(w)), g.argmax(1)] >= top - 1e-6 * np.maximum(np.abs(top), 1.0))[mean].sum())
            lw = w - w.max(1, keepdims=True)
            lw -= np.log(np.exp(lw).sum(1, keepdims=True))
            lg = g - g.max(1, keepdims=True)
            lg -= np.log(np.exp(lg).sum(1, keepdims=True))
            kl_sum += float((np.exp(lw) * (lw - lg)).sum(1)[mean].sum())
        cos = _cosines(g, w, scores)
        cos_sum += float(cos[mean].sum())
        cos_min = min(cos_min, float(cos.min()))
        rows += int(mean.sum())
        near_tie += len(g) - int(mean.sum())
    figures = {"shape": list(got.shape), "max_abs": max_abs, "cosine_mean": cos_sum / rows if rows else 1.0,
               "cosine_min": cos_min}
    if scores:
        figures.update(kl_mean=kl_sum / max(rows, 1), argmax_agreement=agree / rows if rows else 1.0)
    if gaps is not None:
        figures.update(rows_near_tie=near_tie + flipped, rows_flipped=flipped)
        if flipped:
            figures["flipped_gap_max"] = flipped_gap
    failed = [f"mean cosine {figures['cosine_mean']:.4f} < {bar.cosine_mean}" if figures["cosine_mean"] < bar.cosine_mean else "",
              f"worst row's cosine {cos_min:.4f} < {bar.cosine_min}" if cos_min < bar.cosine_min else "",
              f"mean KL {figures['kl_mean']:.3g} > {bar.kl_mean}" if scores and figures["kl_mean"] > bar.kl_mean else ""]
    if any(failed):
        raise VerificationError(f"{where}: output {name!r} {list(got.shape)} is too far from torch for "
                                f"quantization noise: {'; '.join(f for f in failed if f)}")
    return figures


@dataclass
class _Step:
    """One case with its integer inputs and where its cache inputs come from."""
    case: Case
    sig: GraphSig
    key: tuple[str, str]
    prev: tuple[str, str] | None
    src: tuple[str, str] | None
    base: dict
    shapes: dict

    @property
    def where(self) -> str:
        return f"{self.case.graph} graph, case {self.case.name} ({', '.join(f'{k} {v}' for k, v in self.shapes.items())})"


def _steps(r: ResolvedSpec, seed: int, longest: int | None = None) -> list[_Step]:
    """Every case's inputs, the same for the reference and for the graph under test."""
    sigs = {g.name: g for g in r.graphs}
    masks: dict[tuple[str, str], np.ndarray] = {}  # each case's attention_mask
    totals: dict[tuple[str, str], int] = {}  # each case's past + new tokens
    steps = []
    for i, case in enumerate(cases(r, longest)):
        sig = sigs[case.graph]
        key = (case.graph, case.name)
        prev = (case.graph, case.after) if case.after else None
        src = ("encoder", case.source) if case.source else None
        base = _base_feed(r, sig, case, np.random.default_rng([seed, i]), masks.get(prev), masks.get(src))
        totals[key] = (totals[prev] if prev else 0) + case.sequence
        if ATTENTION_MASK in base:
            masks[key] = base[ATTENTION_MASK]
        shapes = {BATCH: case.batch, SEQ: case.sequence}
        if prev:
            shapes[PAST] = totals[prev]
        if src:
            shapes[ENC_SEQ] = totals[src]
        steps.append(_Step(case, sig, key, prev, src, base, shapes))
    return steps


def _continued(steps: list[_Step]) -> set[tuple[str, str]]:
    """The cases a later case continues from (its caches, or the encoder output it reads)."""
    return {s.prev for s in steps if s.prev} | {s.src for s in steps if s.src}


def reference_outputs(r: ResolvedSpec, reference, seed: int = 0, spill: Path | None = None,
                      spill_all: bool = False, longest: int | None = None, layers: tuple[str, ...] = (),
                      lockstep=None) -> dict[tuple[str, str], dict[str, np.ndarray | Spilled]]:
    """The reference's outputs for every case, (graph, case) -> {output: array}: `reference` is
    the fp32 SpeccModel in eval mode, its caches fed from its own earlier outputs. A build takes
    these first, so that the module can be released before the graph is loaded for comparison.
    With `spill` (a directory), the outputs of a case that no later case reads, when they are
    SPILL_BYTES or more together (a long case's logits, or its many present.*), are written there
    and come back as Spilled, read in chunks when compared; with `spill_all`, every output is
    (the outputs of a forked reference run, specc/export/reference.py). `layers`: stacks of a
    streamed model (specc/nn/streamed.py) whose every layer's output is kept too, as
    "{role}.layers.{i}" (what a streamed build's segments read and are compared with, segments.py).
    `lockstep`: for a streamed decoder with one cut stack, specc/nn/streamed.py's in_lockstep, which
    runs every case at once making each layer once (_lockstep_outputs)."""
    import torch

    steps = _steps(r, seed, longest)
    continued = _continued(steps)
    if lockstep is not None and r.architecture == "decoder":
        out = _lockstep_outputs(r, reference, steps, layers, lockstep)
        if spill is not None:
            for step in steps:
                if spill_all or sum(v.nbytes for v in out[step.key].values()) >= SPILL_BYTES:
                    _spill(out, step.key, spill)
        return out
    out: dict[tuple[str, str], dict[str, np.ndarray | Spilled]] = {}
    for step in steps:
        feed = {**step.base, **_cache_inputs(step.sig, step.case, out.get(step.prev), out.get(step.src))}
        with torch.no_grad():
            with recording(reference, layers) as recorded, _routing(reference) as routed:
                result = _forward(reference, step, _tensors(feed))
            out[step.key] = _case_outputs(result, recorded, routed)
            del result, recorded
        large = step.key not in continued and sum(v.nbytes for v in out[step.key].values()) >= SPILL_BYTES
        if spill is not None and large:
            _spill(out, step.key, spill)
    if spill is not None and spill_all:  # the rest, once no later case reads them
        for key in out:
            _spill(out, key, spill)
    return out


def _tensors(feed: dict[str, np.ndarray]) -> dict:
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32 if v.dtype.kind == "f" else v.dtype))
            for k, v in feed.items()}


def _case_outputs(result: dict, recorded: dict[str, list], routed: list) -> dict[str, np.ndarray]:
    """A case's outputs as arrays, with each recorded stack's layer outputs as "{role}.layers.{i}"
    and, where it routes, its ROUTING_GAPS."""
    out = {k: v.float().numpy() for k, v in result.items()}
    for role, hidden in recorded.items():
        out.update({f"{role}.layers.{i}": h for i, h in enumerate(hidden)})
    if routed:
        out[ROUTING_GAPS] = np.stack([_gaps(k, values) for k, values in routed])
    return out


def _routing(reference):
    """The reference's recorder of its routers' choices (SpeccModel.routing), else one that records none."""
    make = getattr(reference, "routing", None)
    return make() if make is not None else contextlib.nullcontext([])


def _gaps(k: int, values: np.ndarray) -> np.ndarray:
    """[N]: each row's gap between its k-th and (k+1)-th largest of `values` [N, E], in standard
    deviations of the row (inf where k chooses every expert)."""
    if k >= values.shape[1]:
        return np.full(values.shape[0], np.inf, np.float32)
    top = -np.partition(-values.astype(np.float64), (k - 1, k), axis=1)
    spread = values.std(axis=1, dtype=np.float64)
    return ((top[:, k - 1] - top[:, k]) / np.maximum(spread, 1e-30)).astype(np.float32)


def layer_gaps(r: ResolvedSpec, key: str, gaps) -> np.ndarray | None:
    """[B * S] for the layer output `key` ("{role}.layers.{i}", run from torch's own input, so
    that its rows change with its own routing alone): each token's routing gap at that layer
    (`gaps`: a case's ROUTING_GAPS; the layer's row is its router's ordinal among the model's, in
    forward order: the encoder's then the decoder's), where the layer routes; else None."""
    role, _, index = key.split(".")
    routed = r.routed_layers
    if gaps is None or (role, int(index)) not in routed:
        return None
    gaps = gaps.read() if isinstance(gaps, Spilled) else gaps
    return gaps[routed.index((role, int(index)))]


def by_layers(r: ResolvedSpec) -> bool:
    """Whether `r`'s build is verified a layer at a time (streamed, by segments) where it can be:
    a spec with routed experts that decodes with int8 activations, whose rounding flips some near
    tie's routing. Verified whole, a flipped token's changed keys and values reach every later
    token's rows; a layer at a time, from torch's own input, only its own row changes, and only
    where torch's routing of it was a near tie (layer_gaps, NEAR_TIE)."""
    return bool(r.routed_layers) and decode_activations(r.serving.precision, r.serving.activations) == "int8"


def _forward(reference, step: _Step, tensors: dict) -> dict:
    if step.case.graph == "encoder":
        return reference.encode(**tensors)
    if step.case.graph == "decoder":
        return reference.decode(**tensors)
    return reference(**tensors)


def _lockstep_outputs(r: ResolvedSpec, reference, steps: list[_Step], layers: tuple[str, ...], in_lockstep) -> dict:
    """reference_outputs of a decoder streamed with one cut stack: every case's forward at once,
    in lockstep (specc/nn/streamed.py), so that each layer is made once rather than once a case.
    A case's caches are made empty at its signature's shape and filled, layer by layer, from the
    presents of the case it continues as that case runs the layer (before this one does)."""
    import torch

    role = "decoder"
    slots = cache_slots(len(getattr(r, role).layers), pair=r.cache_pair)
    pasts = {step.key: {s.name: torch.empty(concrete_dims(s.dims, step.shapes)) for s in step.sig.inputs
                        if parse_cache(s.name) is not None}
             for step in steps if step.prev}
    after = {step.prev: pasts[step.key] for step in steps if step.prev}  # a case -> the caches it fills

    def job(step: _Step):
        def run() -> dict:
            tensors = _tensors({**step.base, **_cache_inputs(step.sig, step.case, None, None)})
            tensors.update(pasts.get(step.key, {}))
            fills = after.get(step.key)

            def fill(i: int, out: tuple) -> None:
                for slot, value in zip(slots[2 * i:2 * i + 2], out[1]):
                    fills[slot.past].copy_(value)

            with torch.no_grad(), recording(reference, layers) as recorded, _routing(reference) as routed, \
                    (getattr(reference, role).layers.tap(fill) if fills else contextlib.nullcontext()):
                result = _forward(reference, step, tensors)
            return _case_outputs(result, recorded, routed)
        return run

    results = in_lockstep(reference, [job(step) for step in steps])
    return {step.key: outputs for step, outputs in zip(steps, results)}


@contextlib.contextmanager
def recording(model, roles) -> Iterator[dict[str, list]]:
    """While inside, each layer's output of the `roles` stacks of a streamed model (their
    StreamedLayers' taps, specc/nn/streamed.py), appended as this thread's forward runs:
    {role: [[B, T, D] fp32 arrays, in layer order]}."""
    got: dict[str, list] = {role: [] for role in roles}
    with contextlib.ExitStack() as taps:
        for role in roles:
            taps.enter_context(getattr(model, role).layers.tap(
                lambda _i, out, role=role: got[role].append(out[0].float().numpy().copy())))
        yield got


def _spill(out: dict, key: tuple[str, str], spill: Path) -> None:
    for k, v in out[key].items():
        if not isinstance(v, Spilled):
            out[key][k] = Spilled(Path(spill) / f"{list(out).index(key) + 1}.{k}.bin", v)


def verify(r: ResolvedSpec, reference, sessions: dict, target: str = "onnx", precision: str = "fp32",
           seed: int = 0, longest: int | None = None, dequantized: bool = False, provider: str = "cpu") -> Report:
    """Run every case through `sessions` (graph name -> onnxruntime.InferenceSession or anything
    with the same run(), on `provider`: cpu or cuda) and compare with `reference`: the fp32
    SpeccModel in eval mode, or its reference_outputs() taken before."""
    refs = reference if isinstance(reference, dict) else reference_outputs(r, reference, seed, longest=longest)
    # `dequantized`: the reference computed with the graph's own integer weights (seeded builds)
    report = new_report(r, target, precision, dequantized, provider)
    scores = scored(r)
    steps = _steps(r, seed, longest)
    # outputs are kept only for the cases a later case continues from (a long case's logits are large)
    needed = _continued(steps)
    kept: dict[tuple[str, str], dict] = {}
    for step in steps:
        feed = case_feed(step, kept.get(step.prev), kept.get(step.src))
        names = [s.name for s in step.sig.outputs]
        trim()  # the last case's freed outputs go back to the system before this one allocates
        try:
            got = dict(zip(names, sessions[step.case.graph].run(names, feed)))
        except Exception as exc:  # onnxruntime's own exception types
            msg = first_line(exc) or type(exc).__name__
            raise VerificationError(f"{step.where}: onnxruntime failed to run the graph: {msg}") from None
        want = refs[step.key]
        try:
            figures = {n: report.compare(n, n in scores, got[n], want[n], step.where) for n in names}
        except VerificationError as failed:
            if not by_layers(r):
                raise
            raise VerificationError(f"{failed} (a model with routed experts decoding with int8 activations, verified "
                                    "whole, where a near tie's flipped routing reaches later tokens: it is verified a "
                                    "layer at a time only where it can be streamed; build it with --activations fp32, "
                                    "or as a spec that streams)") from None
        report.cases.append({"graph": step.case.graph, "case": step.case.name, "shapes": step.shapes, "outputs": figures})
        if step.key in needed:
            kept[step.key] = got
        del got, want
    return report


# --- the session a build verifies a graph with --------------------------------------------------

VERIFY_DISABLED_OPTIMIZERS = ["ConstantFolding"]


def prepacks(precision: str) -> bool:
    """Whether a build's graphs are verified with their weights prepacked: an integer build's,
    whose MatMulNBits and QMoE compute at their accuracy level (int8 activations at level 4) only
    with a prepacked weight (without one they dequantize it and multiply in fp32 whatever the
    level), so that what is verified is the arithmetic a served session runs."""
    return PRECISIONS[precision].quantized


def verification_session(path: Path, graph: str, provider: str = "cpu", prepack: bool = False):
    """The onnxruntime session a build verifies `graph` with: on `provider` (cpu, or cuda with the
    options specc runs it with, specc/runtime/graph.py), every graph optimization but constant
    folding, weight prepacking only where `prepack` (`prepacks`). BuildError where onnxruntime
    cannot load the graph, or would run it on another provider."""
    ort = require_onnxruntime("verifying a build")
    opts = session_options(ort)
    # Neither of these changes what a float graph computes (beyond float rounding), only where its
    # weights lie: prepacking keeps a packed copy of a weight beside the one a Gather still reads
    # (a tied embedding), and constant folding turns a tied LM head's Transpose into a transposed
    # copy of the embedding (what that costs: docs/build.md). tests/test_pipeline.py checks that
    # a graph gives the same outputs with them and without. An integer graph's kernels compute as
    # served only prepacked (`prepacks`); its tied head is its own packed codes, no Gather's.
    if not prepack:
        opts.add_session_config_entry("session.disable_prepacking", "1")
    try:
        session = ort.InferenceSession(str(path), opts, providers=provider_entries([VERIFY_PROVIDERS[provider]]),
                                       disabled_optimizers=VERIFY_DISABLED_OPTIMIZERS)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise BuildError(f"onnxruntime cannot load the exported {graph} graph: {first_line(exc)}") from None
    if session.get_providers()[0] != VERIFY_PROVIDERS[provider]:  # onnxruntime fell back without a word
        raise BuildError(f"onnxruntime ran the {graph} graph on {session.get_providers()[0]}, not the "
                         f"{VERIFY_PROVIDERS[provider]} --verify-provider {provider} asked for")
    return session


__all__ = ["CUDA_TOLERANCES", "QUALITY_BARS", "ROUTING_GAPS", "SCORE_KINDS", "TOLERANCES", "Case", "Report", "Spilled",
           "by_layers", "cases", "layer_gaps", "prepacks", "reference_outputs", "tolerance", "verification_session", "verify"]
