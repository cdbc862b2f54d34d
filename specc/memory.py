"""Whether a build fits the machine, decided from the resolved spec before anything is allocated.

The estimate: the fp32 weights held about four times (module, exported graph, onnxruntime
session, weights file buffer), the activations of the longest verification case, and 1 GiB for
the libraries; compared with the memory available (/proc/meminfo) or the limit given
(`--max-memory`).
"""
from __future__ import annotations

import os

from specc.errors import BuildError
from specc.report import human_bytes
from specc.spec.costs import inspect_spec
from specc.spec.resolve import ResolvedSpec


def estimate_memory(r: ResolvedSpec) -> dict:
    """Bytes a build needs at its peak, from the spec alone: the fp32 weights held about four
    times (module, exported graph, onnxruntime session, weights file buffer) plus the
    verification activations at the longest case, plus a fixed 1 GiB for the libraries."""
    facts = inspect_spec(r)
    weights = facts["weight_bytes"]["fp32"]
    length = r.serving.length.max
    widest = max((l.ffn.d_ff for s in (r.encoder, r.decoder) if s for l in s.layers), default=r.d_model)
    heads = max((l.attention.heads for s in (r.encoder, r.decoder) if s for l in s.layers), default=1)
    vocab = max(s.vocab_size for s in (r.encoder, r.decoder) if s)  # the widest token table
    # per layer kept by ORT's arena at once: scores [H,T,T] and the widest activations, in fp32
    activations = 4 * 4 * (heads * length * length + length * (4 * r.d_model + 2 * widest + vocab))
    total = 4 * weights + activations + 1024**3
    return {"bytes": total, "weights": weights, "activations": activations}


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


def check_memory(r: ResolvedSpec, max_memory: int | None = None) -> None:
    """Refuse up front a build that cannot fit, with the estimate."""
    need = estimate_memory(r)
    have = max_memory if max_memory is not None else available_memory()
    if have is not None and need["bytes"] > have:
        raise BuildError(
            f"building {r.name} needs about {human_bytes(need['bytes'])} "
            f"({human_bytes(need['weights'])} of fp32 weights held ~4 times during export and verification, "
            f"{human_bytes(need['activations'])} of activations), but {human_bytes(have)} is available; "
            "free memory, build on a larger machine, or raise the limit with --max-memory"
        )
