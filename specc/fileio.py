"""Files, with the standard library only (the spec layer, the runtime and the exporters all use it):
writing one atomically (the bytes go to a temporary file beside it, which then replaces the file
in one rename, so a reader or a killed process never sees half a file; a whole build directory is
staged and swapped by specc.export.outdir instead), and their sha256 digests."""
from __future__ import annotations

import hashlib
import os
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


INDEX_SUFFIX = ".safetensors.index.json"  # a sharded weights file's index, as Hugging Face names it


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


class NotARegularFile(ValueError):
    """A path specc was to read is a device, FIFO, directory or socket, or larger than allowed; the
    message names the path and why."""


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def not_regular(mode: int) -> str:
    """What a file of this st_mode is, for a refusal: "a FIFO, not a regular file"."""
    return next((name for test, name in _KINDS if test(mode)), "not a plain file") + ", not a regular file"


def regular_size(path: str | os.PathLike, limit: int | None = None) -> int:
    """The size of `path` (links followed) if it is a regular file of at most `limit` bytes. A
    device (/dev/zero), a FIFO or a directory would be read without end or block for ever: raises
    NotARegularFile; OSError where it cannot be looked at."""
    st = os.stat(path)
    if not stat.S_ISREG(st.st_mode):
        raise NotARegularFile(f"{path}: {not_regular(st.st_mode)}; refused")
    if limit is not None and st.st_size > limit:
        raise NotARegularFile(f"{path}: {st.st_size} bytes, more than the {limit} this file may have; refused")
    return st.st_size


def read_bounded(path: str | os.PathLike, limit: int) -> bytes:
    """A regular file's bytes, at most `limit` of them (a file that grows, or one of /proc whose
    size says 0, is read no further than its size or the limit)."""
    size = regular_size(path, limit)
    # O_NONBLOCK: should the path have become a FIFO since the stat, the open returns at once and
    # the descriptor's own stat refuses it
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotARegularFile(f"{path}: {not_regular(mode)}; refused")
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > max(size, limit):
        raise NotARegularFile(f"{path}: more than the {limit} bytes this file may have; refused")
    return data


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a regular file's bytes, as many as its size says (nothing past it is read)."""
    left = regular_size(path)
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while left > 0 and (block := f.read(min(left, 1 << 20))):
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def sha256s(paths: list[Path]) -> list[str]:
    """The files' sha256 digests, hashed side by side (hashlib leaves the GIL while hashing)."""
    if not paths:
        return []
    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(file_sha256, paths))
