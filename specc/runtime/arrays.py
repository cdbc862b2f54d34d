"""Arrays into and out of the runtime: prompt rows padded into a batch, and outputs saved as NPZ.
(What the arrays may hold is checked in specc/runtime/inputs.py.)"""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from specc.fileio import write_atomic


def pad_rows(rows: list[list[int]], pad: int, left: bool) -> tuple[np.ndarray, np.ndarray]:
    """[B, T] ids and mask, padded on the left (decoder prompts) or right (encoder sources)."""
    t = max(len(r) for r in rows)
    ids = np.full((len(rows), t), pad, dtype=np.int64)
    mask = np.zeros((len(rows), t), dtype=np.int64)
    for i, r in enumerate(rows):
        sl = slice(t - len(r), t) if left else slice(0, len(r))
        ids[i, sl], mask[i, sl] = r, 1
    return ids, mask


def save_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Write arrays as NPZ atomically (temp file, then rename)."""
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_atomic(path, buf.getvalue())
