"""The build directory, written safely.

A build writes into a hidden sibling `.<DIR>.specc-tmp-*` and only a finished, verified build is
moved to DIR: with an atomic exchange (Linux renameat2 RENAME_EXCHANGE) where the file system
has one, else two renames. A killed build leaves DIR as it was (or, in the two-rename window,
absent), never half-written; its leftovers are removed by the next build into DIR. A lock file
`.<DIR>.specc-lock` keeps two builds from writing DIR at once: the second fails clearly.
"""
from __future__ import annotations

import ctypes
import errno
import glob
import os
import shutil
import tempfile
from pathlib import Path

from specc.errors import BuildError

MANIFEST = "manifest.json"


class Staging:
    """`with Staging(out_dir) as stage:` ... write into stage.tmp ... `stage.commit()`."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out = Path(out_dir).absolute()
        self.tmp: Path | None = None
        self._lock_fd: int | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> "Staging":
        check_replaceable(self.out)
        parent = self.out.parent
        try:
            parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BuildError(f"cannot create {parent}: {exc.strerror}") from None
        self._lock()
        self._clean_leftovers()
        try:
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.specc-tmp-", dir=parent))
        except OSError as exc:
            self._unlock()
            raise BuildError(f"cannot write in {parent}: {exc.strerror}") from None
        return self

    def __exit__(self, *exc) -> None:
        try:
            if self.tmp is not None and self.tmp.exists():
                shutil.rmtree(self.tmp, ignore_errors=True)
        finally:
            self._unlock()

    def commit(self) -> None:
        """Move the finished build to DIR, replacing a previous build there."""
        assert self.tmp is not None
        os.chmod(self.tmp, 0o755)  # mkdtemp makes it 0700
        if self.out.exists():
            if not _exchange(self.tmp, self.out):
                old = self.out.with_name(f".{self.out.name}.specc-old-{os.getpid()}")
                os.rename(self.out, old)
                os.rename(self.tmp, self.out)
                self.tmp = old
            # self.tmp now holds the previous build; __exit__ removes it
        else:
            os.rename(self.tmp, self.out)
            self.tmp = None
        _fsync_dir(self.out.parent)

    # --- helpers -----------------------------------------------------------------------------

    def _lock(self) -> None:
        import fcntl

        path = self.out.with_name(f".{self.out.name}.specc-lock")
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise BuildError(f"another specc build is writing {self.out}; wait for it to finish") from None
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing releases the flock
            self._lock_fd = None

    def _clean_leftovers(self) -> None:
        """Temporary and replaced directories of earlier builds into DIR that were killed (we hold
        the lock, so no live build owns them)."""
        name = glob.escape(self.out.name)  # a DIR named like b[1] must not match b1's files
        for pattern in (f".{name}.specc-tmp-*", f".{name}.specc-old-*"):
            for p in self.out.parent.glob(pattern):
                shutil.rmtree(p, ignore_errors=True)


def check_replaceable(out: Path) -> None:
    """DIR may be absent, an empty directory, or an earlier specc build; nothing else is replaced."""
    if not out.exists():
        return
    if not out.is_dir():
        raise BuildError(f"{out} exists and is not a directory; choose another -o")
    if any(out.iterdir()) and not (out / MANIFEST).is_file():
        raise BuildError(f"{out} exists and is not a specc build (no {MANIFEST}); choose another -o or remove it")


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    rc = renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EPERM, errno.EOPNOTSUPP):
        return False
    raise BuildError(f"cannot move the build into {b}: {os.strerror(err)}")


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
