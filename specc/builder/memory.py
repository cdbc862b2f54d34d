"""Whether a build fits the machine, decided from the resolved spec before anything is allocated.

The estimate of a build that holds the whole model: the fp32 weights held about four times
(module, exported graph, onnxruntime session, weights file buffer), the activations of the
longest verification case, and 1 GiB for the libraries. Of a streamed build (one layer of the
deep stacks at a time, specc/nn/streamed.py): the larger of its two phases, building (the short
module's fp32 weights: where the graph is exported in fp32, those outside the layers alone, its
traced layers being hollow; the exported graph's copy of them: all of them in the export dtype where
that is not fp32, else the tables outside the layers (embeddings, heads), held again as the graph's
constants until they are written; and three layers made at once: the exporter's, the writer's and
the reference run's) and verifying (onnxruntime's
session holding the written graph's weights as stored where that is no more than building holds,
else a segment at a time: one layer's written weights and those outside the layers, see
specc/export/segments.py; plus the activations). Either is compared
with the memory available (/proc/meminfo) or the limit given (`--max-memory`).

A build computes each estimate once, in its plan (specc/builder/plan.py), and hands it to the
checks here.
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from specc.errors import BuildError
from specc.export.quantize import SCHEMES, TIED_HEAD, experts_packed
from specc.export.stitch import KEEP, Plan, deep_stacks, streamable
from specc.export.verify import by_layers
from specc.report import human_bytes
from specc.spec.costs import inspect_spec, parameter_shapes
from specc.spec.resolve import ResolvedSpec
from specc.spec.targets import PRECISIONS

LIBRARIES = 1024**3  # torch, onnxruntime, the exporter: what a build's process holds before any weight
# A streamed build's verification cases stop at this many tokens (serving.length.max otherwise):
# the long case's cost grows with the square of its length, and every case runs every layer.
# What that leaves unproved: docs/build.md, "Streamed builds".
STREAMED_LONGEST = 128
# A whole build's verification cases stop at this many tokens: an imported checkpoint serves its
# whole context (8192 and more), whose longest case's activations (scores [H, T, T], logits
# [T, vocab]) would take tens of GB and the square of the time. Longer inputs run the same graph;
# the manifest's verification.length and the build's summary say the length verified.
VERIFIED_LONGEST = 2048


def verified_length(r: ResolvedSpec, streamed: bool) -> int:
    """The longest sequence a build verifies: serving.length.max, capped at STREAMED_LONGEST (a
    streamed build) or VERIFIED_LONGEST."""
    return min(r.serving.length.max, STREAMED_LONGEST if streamed else VERIFIED_LONGEST)


def hollow(r: ResolvedSpec) -> bool:
    """Whether a streamed build's short module holds no values in its traced layers
    (specc/nn/streamed.py): where the graph is exported in fp32, the module traced as it is."""
    return PRECISIONS[r.serving.precision].dtype == "float32"


def estimate_memory(r: ResolvedSpec) -> dict:
    """Bytes a build that holds the whole model needs at its peak, from the spec alone: the fp32
    weights held about four times (module, exported graph, onnxruntime session, weights file
    buffer) plus the verification activations at the longest case, plus LIBRARIES."""
    facts = inspect_spec(r)
    weights = facts["weight_bytes"]["fp32"]
    activations = _activations(r, verified_length(r, streamed=False))
    total = 4 * weights + activations + LIBRARIES
    return {"bytes": total, "weights": weights, "activations": activations}


def estimate_streamed(r: ResolvedSpec, stacks: dict[str, Plan] | str | None = None) -> dict:
    """Bytes a streamed build needs at its peak (see the module's doc). `stacks`: the spec's
    stitch.streamable, where the caller has it."""
    precision = PRECISIONS[r.serving.precision]
    linear = precision.weight_bytes  # an integer precision's packed layout
    stored = 0  # the written graph's weights: linear weights (and routed experts) as above, tables and vectors in the dtype (and a packed tied head)
    outside = 0  # of those, the ones in no layer (embeddings, heads, final norms)
    short = 0  # the short module's fp32 weights (an fp32 export's: outside the layers alone)
    outside_fp32 = 0  # of those, the ones in no layer
    plans = streamable(r) if stacks is None else stacks
    kept = {role: p.kept for role, p in plans.items()} if isinstance(plans, dict) else {}  # layers the short module has
    per_layer: dict[str, int] = {}  # each layer's fp32 weights
    stored_layer: dict[str, int] = {}  # each layer's weights as written
    for name, shape in parameter_shapes(r).items():
        n = math.prod(shape)
        table = name.startswith("embeddings.") or ".positions." in name or (len(shape) != 2 and not _routed(name, shape, precision.name))
        written = n * precision.dtype_bytes if table else math.ceil(n * linear)
        stored += written
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit():
            key = ".".join(parts[:3])
            per_layer[key] = per_layer.get(key, 0) + 4 * n
            stored_layer[key] = stored_layer.get(key, 0) + written
            if int(parts[2]) >= kept.get(parts[0], KEEP) or hollow(r):
                continue  # a layer the short module does not hold (or holds hollow)
        else:
            outside += written
            outside_fp32 += 4 * n
        short += 4 * n
    head = TIED_HEAD.get(precision.name)  # the precision a tied head is packed in, if any
    if head is not None and r.tie_output and any(o.kind in ("lm", "mlm") for o in r.outputs):
        packed = math.ceil(r.output_vocab_size * r.d_model * PRECISIONS[head].weight_bytes)  # beside the table it reads
        stored += packed
        outside += packed
    layer = max(per_layer.values(), default=0)  # the largest layer's fp32 weights
    # the exported graph's copy: cast to the export dtype, else (fp32) the tables outside the layers
    export_copy = short * precision.dtype_bytes // 4 if precision.dtype != "float32" else outside_fp32
    building = short + export_copy + 3 * layer
    activations = _activations(r, verified_length(r, streamed=True))
    # verified whole where onnxruntime holding every written weight needs no more than building
    # does (or than the libraries: a small model is never cut), else a segment at a time: at most
    # one layer and the weights outside the layers. An integer build's sessions prepack its weights
    # (verify.prepacks): packed copies in memory of their own beside the mapped file and the short
    # module, more than its stored size (gpt-oss-20b int4 at int8 activations was killed at 24 GB
    # verifying whole), so a large one is verified a segment at a time
    whole = (stored <= LIBRARIES or (stored <= building and not precision.quantized)) and not by_layers(r)
    verifying = (stored if whole else outside + max(stored_layer.values(), default=0)) + activations
    total = max(building, verifying) + LIBRARIES
    return {"bytes": total, "building": building, "verifying": verifying, "stored": stored, "layer": layer,
            "activations": activations, "whole": whole}


def _routed(name: str, shape: tuple[int, ...], precision: str) -> bool:
    """Whether `name` is a stack of routed experts' weights [E, N, K] that the build writes as
    linear weights are: packed (QMoE) in an integer build whose blocks divide both widths, else in
    the export dtype."""
    if len(shape) != 3 or not name.endswith((".experts.up", ".experts.down", ".experts.gate")):
        return False
    scheme = SCHEMES.get(precision)
    return scheme is None or experts_packed(shape[1], shape[2], scheme)


def _activations(r: ResolvedSpec, length: int) -> int:
    """The verification activations at `length` tokens."""
    widest = max((l.ffn.d_ff for s in (r.encoder, r.decoder) if s for l in s.layers), default=r.d_model)
    heads = max((l.attention.heads for s in (r.encoder, r.decoder) if s for l in s.layers), default=1)
    vocab = max(s.vocab_size for s in (r.encoder, r.decoder) if s)  # the widest token table
    # per layer kept by ORT's arena at once: scores [H,T,T] and the widest activations, in fp32
    return 4 * 4 * (heads * length * length + length * (4 * r.d_model + 2 * widest + vocab))


def available_memory() -> int | None:
    """The memory the system can give without swapping (MemAvailable), None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(r: ResolvedSpec, need: dict, have: int | None, streamed: bool = False, hint: str = "") -> None:
    """Refuse up front a build that cannot fit in `have` bytes (None: unknown, anything fits), with
    `need`, the estimate (estimate_streamed's where `streamed`, else estimate_memory's). `hint`:
    what a streamed build would need, or why there is none (streamed_hint), for a whole build."""
    if streamed:
        if have is not None and need["bytes"] > have:
            raise BuildError(
                f"building {r.name} streamed needs about {human_bytes(need['bytes'])} "
                f"({human_bytes(need['stored'])} of weights as {r.serving.precision} in onnxruntime during verification, "
                f"{human_bytes(need['building'])} while building), but {human_bytes(have)} is available; "
                "build a smaller precision (int4 holds the least), free memory, or raise the limit with --max-memory")
        return
    if have is not None and need["bytes"] > have:
        raise BuildError(
            f"building {r.name} needs about {human_bytes(need['bytes'])} "
            f"({human_bytes(need['weights'])} of fp32 weights held ~4 times during export and verification, "
            f"{human_bytes(need['activations'])} of activations), but {human_bytes(have)} is available"
            f"{hint}; free memory, build on a larger machine, or raise the limit with --max-memory"
        )


DISK_MARGIN = 256 * 1024**2  # the graph skeletons, the manifest, the verification's spilled outputs


def check_disk(r: ResolvedSpec, out_dir: Path, stored: int, kept: int | None = None) -> None:
    """Refuse up front a build whose files cannot fit on the disk that will hold DIR: the graph's
    weights as written (`stored`, estimate_streamed's), plus model.safetensors (`kept`: every
    parameter in fp32, estimate_memory's weights; None where the build does not keep it), plus DISK_MARGIN. The
    build is staged beside DIR (specc/export/outdir.py), so a previous build there still counts."""
    need = stored + (kept or 0) + DISK_MARGIN
    where = Path(out_dir).absolute()
    try:
        while not where.exists() and where != where.parent:
            where = where.parent
        usage = shutil.disk_usage(where)
    except OSError:
        return  # nothing to go by (a name too long, no permission): the build's own writes will say
    free = usage.free
    if usage.total and need > free:  # a filesystem of no size (/proc) says nothing either
        raise BuildError(f"building {r.name} writes about {human_bytes(need)} (the graph's weights as "
                         f"{r.serving.precision}{' and model.safetensors in fp32' if kept is not None else ''}), but {where} has {human_bytes(free)} "
                         "free; free disk space or build into another directory (-o)")


def fits(need: dict, have: int | None) -> bool:
    """Whether an estimate fits in `have` bytes (None: unknown, anything fits)."""
    return have is None or need["bytes"] <= have


def streamed_hint(r: ResolvedSpec, stacks: dict[str, Plan] | str, streamed: dict) -> str:
    """What a streamed build of this spec would need (`streamed`, its estimate), where it can be
    streamed; why it cannot be (`stacks`, stitch.streamable's), where it has a stack deep enough
    that streaming would matter."""
    if isinstance(stacks, str):
        return f" (it cannot be built streamed, one layer at a time: {stacks})" if deep_stacks(r) else ""
    return f" (built streamed, one layer at a time, it would need about {human_bytes(streamed['bytes'])})"
