"""Writing one file atomically: the bytes go to a temporary file beside it, which then replaces the
file in one rename, so a reader (or a killed process) never sees half a file. Standard library
only: the spec layer, the runtime and the exporters all use it. (A whole build directory is staged
and swapped by specc.export.outdir instead.)"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


def umask() -> int:
    """The process umask (reading it means setting it; it is set straight back)."""
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write `data` (text as UTF-8) to `path` atomically, with the mode a plain open() would give."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
        os.chmod(tmp, 0o666 & ~umask())  # mkstemp makes 0600
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
