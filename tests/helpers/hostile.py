"""Hostile input files shared by the tests of the runtime and of the CLI."""
from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np


def npz_bomb(path: Path, n: int = 134_217_728) -> Path:
    """An NPZ of about 1 MB whose input_ids [1, n] int64 unpack to n * 8 bytes (1 GiB for 134M ids)."""
    if not path.exists():
        with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            with z.open("input_ids.npy", "w", force_zip64=True) as f:
                np.lib.format.write_array_header_1_0(f, {"descr": "<i8", "fortran_order": False, "shape": (1, n)})
                chunk = bytes(1 << 24)
                for _ in range(n * 8 // len(chunk)):
                    f.write(chunk)
    return path
