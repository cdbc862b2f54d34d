"""Arrays into and out of the runtime: token ids checked once (their form and their range), prompt
rows padded into a batch, and outputs saved as NPZ."""
from __future__ import annotations

import io
from pathlib import Path

import numpy as np

from specc.fileio import write_atomic
from specc.runtime.errors import RunError


def check_vocab(ids, vocab: int) -> None:
    """Refuse token ids outside 0..vocab-1, naming (up to five of) them. `ids`: an integer array,
    or an iterable of Python ints (of any size)."""
    if isinstance(ids, np.ndarray):
        bad = np.unique(ids[(ids < 0) | (ids >= vocab)]).tolist()
    else:
        bad = sorted({x for x in ids if not 0 <= x < vocab})
    if bad:
        raise RunError(f"token id(s) {bad[:5]} outside the vocabulary (0..{vocab - 1})")


def id_array(x, vocab: int | None = None) -> np.ndarray:
    """input_ids for run(): a [batch, sequence] (or [sequence]) integer array or nested list, as
    int64 [batch, sequence], with every id below `vocab` where it is given."""
    ids = np.asarray(x)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise RunError(f"input_ids must be a non-empty [batch, sequence] array of integers, got shape {list(ids.shape)}")
    ids = ids.astype(np.int64)
    if vocab is not None:
        check_vocab(ids, vocab)
    return ids


def prompt_rows(input_ids, vocab: int) -> list[list[int]]:
    """Prompts for generate(): a list of ids, a list of lists (any lengths) or an int array
    [batch, seq], as rows of ints, each non-empty and every id in the vocabulary."""
    if isinstance(input_ids, np.ndarray):
        if input_ids.ndim == 1:
            input_ids = input_ids[None, :]
        if input_ids.ndim != 2 or not np.issubdtype(input_ids.dtype, np.integer):
            raise RunError(f"input_ids must be an integer array [batch, seq], got {input_ids.dtype} {list(input_ids.shape)}")
        rows = input_ids.tolist()
    elif isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(x, (int, np.integer)) for x in input_ids):
        rows = [list(input_ids)]
    elif isinstance(input_ids, (list, tuple)) and input_ids and all(isinstance(r, (list, tuple, np.ndarray)) for r in input_ids):
        rows = [list(r) for r in input_ids]
    else:
        raise RunError("input_ids must be a list of ids, a list of lists of ids, or an int array [batch, seq]")
    if any(len(r) == 0 for r in rows):
        raise RunError("every prompt needs at least one token")
    if any(not isinstance(x, (int, np.integer)) or isinstance(x, bool) for r in rows for x in r):
        raise RunError("token ids must be integers")
    rows = [[int(x) for x in r] for r in rows]
    check_vocab((x for r in rows for x in r), vocab)
    return rows


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
