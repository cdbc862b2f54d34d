"""Whether a build fits the machine, decided from the resolved spec before anything is allocated.

The estimate of a build that holds the whole model: the fp32 weights held about four times
(module, exported graph, onnxruntime session, weights file buffer), the activations of the
longest verification case, and 1 GiB for the libraries. Of a streamed build (one layer of the
deep stacks at a time, specc/nn/streamed.py): the larger of its two phases, building (the short
module's fp32 weights; the exported graph's copy of them: all of them in the export dtype where
that is not fp32, else the tables outside the layers (embeddings, heads), held again as the graph's
constants until they are written; and three layers made at once: the exporter's, the writer's and
the reference run's) and verifying (onnxruntime's
session holding the written graph's weights as stored where that is no more than building holds,
else a segment at a time: one layer's written weights and those outside the layers, see
specc/export/segments.py; plus the activations). Either is compared
with the memory available (/proc/meminfo) or the limit given (`--max-memory`).
"""
from __future__ import annotations

import math
import os
import shutil
from pathlib import Path

from specc.errors import BuildError
from specc.export.quantize import SCHEMES, TIED_HEAD
from specc.export.stitch import KEEP, deep_stacks, streamable
from specc.report import human_bytes
from specc.spec.costs import inspect_spec, parameter_shapes
from specc.spec.resolve import ResolvedSpec
from specc.spec.targets import PRECISIONS

LIBRARIES = 1024**3  # torch, onnxruntime, the exporter: what a build's process holds before any weight
# A streamed build's verification cases stop at this many tokens (serving.length.max otherwise):
# each case makes every layer again, and the long case's cost grows with the square of its length.
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


def estimate_memory(r: ResolvedSpec) -> dict:
    """Bytes a build that holds the whole model needs at its peak, from the spec alone: the fp32
    weights held about four times (module, exported graph, onnxruntime session, weights file
    buffer) plus the verification activations at the longest case, plus LIBRARIES."""
    facts = inspect_spec(r)
    weights = facts["weight_bytes"]["fp32"]
    activations = _activations(r, verified_length(r, streamed=False))
    total = 4 * weights + activations + LIBRARIES
    return {"bytes": total, "weights": weights, "activations": activations}


def estimate_streamed(r: ResolvedSpec) -> dict:
    """Bytes a streamed build needs at its peak (see the module's doc)."""
    precision = PRECISIONS[r.serving.precision]
    scheme = SCHEMES.get(precision.name)
    linear = scheme.bytes_per_weight if scheme else precision.dtype_bytes
    stored = 0  # the written graph's weights: linear weights as above, tables and vectors in the dtype (and a packed tied head)
    outside = 0  # of those, the ones in no layer (embeddings, heads, final norms)
    short = 0  # the short module's fp32 weights
    outside_fp32 = 0  # of those, the ones in no layer
    plans = streamable(r)
    kept = {role: p.kept for role, p in plans.items()} if isinstance(plans, dict) else {}  # layers the short module has
    per_layer: dict[str, int] = {}  # each layer's fp32 weights
    stored_layer: dict[str, int] = {}  # each layer's weights as written
    for name, shape in parameter_shapes(r).items():
        n = math.prod(shape)
        table = name.startswith("embeddings.") or ".positions." in name or len(shape) != 2
        written = n * precision.dtype_bytes if table else math.ceil(n * linear)
        stored += written
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit():
            key = ".".join(parts[:3])
            per_layer[key] = per_layer.get(key, 0) + 4 * n
            stored_layer[key] = stored_layer.get(key, 0) + written
            if int(parts[2]) >= kept.get(parts[0], KEEP):
                continue
        else:
            outside += written
            outside_fp32 += 4 * n
        short += 4 * n
    head = SCHEMES.get(TIED_HEAD.get(precision.name))
    if head is not None and r.tie_output and any(o.kind in ("lm", "mlm") for o in r.outputs):
        packed = math.ceil(r.output_vocab_size * r.d_model * head.bytes_per_weight)  # beside the table it reads
        stored += packed
        outside += packed
    layer = max(per_layer.values(), default=0)  # the largest layer's fp32 weights
    # the exported graph's copy: cast to the export dtype, else (fp32) the tables outside the layers
    export_copy = short * precision.dtype_bytes // 4 if precision.dtype != "float32" else outside_fp32
    building = short + export_copy + 3 * layer
    activations = _activations(r, verified_length(r, streamed=True))
    # verified whole where onnxruntime holding every written weight needs no more than building
    # does (or than the libraries: a small model is never cut), else a segment at a time: at most
    # one layer and the weights outside the layers
    whole = stored <= max(building, LIBRARIES)
    verifying = (stored if whole else outside + max(stored_layer.values(), default=0)) + activations
    total = max(building, verifying) + LIBRARIES
    return {"bytes": total, "building": building, "verifying": verifying, "stored": stored, "layer": layer,
            "activations": activations, "whole": whole}


def verifies_whole(r: ResolvedSpec) -> bool:
    """Whether a streamed build's graph is verified whole by onnxruntime (every written weight
    held at once), rather than a layer at a time (specc/export/segments.py): where that needs no
    more memory than building it does, or than LIBRARIES."""
    return estimate_streamed(r)["whole"]


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


def check_memory(r: ResolvedSpec, max_memory: int | None = None, streamed: bool = False) -> None:
    """Refuse up front a build that cannot fit, with the estimate."""
    have = max_memory if max_memory is not None else available_memory()
    if streamed:
        need = estimate_streamed(r)
        if have is not None and need["bytes"] > have:
            raise BuildError(
                f"building {r.name} streamed needs about {human_bytes(need['bytes'])} "
                f"({human_bytes(need['stored'])} of weights as {r.serving.precision} in onnxruntime during verification, "
                f"{human_bytes(need['building'])} while building), but {human_bytes(have)} is available; "
                "build a smaller precision (int4 holds the least), free memory, or raise the limit with --max-memory")
        return
    need = estimate_memory(r)
    if have is not None and need["bytes"] > have:
        raise BuildError(
            f"building {r.name} needs about {human_bytes(need['bytes'])} "
            f"({human_bytes(need['weights'])} of fp32 weights held ~4 times during export and verification, "
            f"{human_bytes(need['activations'])} of activations), but {human_bytes(have)} is available"
            f"{_streamed_hint(r)}; free memory, build on a larger machine, or raise the limit with --max-memory"
        )


DISK_MARGIN = 256 * 1024**2  # the graph skeletons, the manifest, the verification's spilled outputs


def check_disk(r: ResolvedSpec, out_dir: Path, keep_weights: bool = False) -> None:
    """Refuse up front a build whose files cannot fit on the disk that will hold DIR: the graph's
    weights as written, plus model.safetensors (every parameter in fp32) where the build keeps it,
    plus DISK_MARGIN. The build is staged beside DIR (specc/export/outdir.py), so a previous build
    there still counts."""
    kept = inspect_spec(r)["weight_bytes"]["fp32"] if keep_weights else 0
    need = estimate_streamed(r)["stored"] + kept + DISK_MARGIN
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
                         f"{r.serving.precision}{' and model.safetensors in fp32' if keep_weights else ''}), but {where} has {human_bytes(free)} "
                         "free; free disk space or build into another directory (-o)")


def streamed_fits(r: ResolvedSpec, max_memory: int | None = None) -> bool:
    have = max_memory if max_memory is not None else available_memory()
    return have is None or estimate_streamed(r)["bytes"] <= have


def _streamed_hint(r: ResolvedSpec) -> str:
    """What a streamed build of this spec would need, where it can be streamed; why it cannot be,
    where it has a stack deep enough that streaming would matter."""
    why = streamable(r)
    if isinstance(why, str):
        return f" (it cannot be built streamed, one layer at a time: {why})" if deep_stacks(r) else ""
    need = estimate_streamed(r)["bytes"]
    return f" (built streamed, one layer at a time, it would need about {human_bytes(need)})"
