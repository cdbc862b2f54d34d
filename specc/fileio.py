"""Files, with the standard library only (the spec layer, the runtime and the exporters all use it):
writing one atomically (the bytes go to a temporary file beside it, which then replaces the file
in one rename, so a reader or a killed process never sees half a file; a whole build directory is
staged and swapped by specc.export.outdir instead), and their sha256 digests."""
from __future__ import annotations

import hashlib
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
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


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def sha256s(paths: list[Path]) -> list[str]:
    """The files' sha256 digests, hashed side by side (hashlib leaves the GIL while hashing)."""
    if not paths:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(file_sha256, paths))
