"""The build directory, written safely.

A build writes into a hidden sibling `.<DIR>.specc-tmp-*` and only a finished, verified build is
moved to DIR: with an atomic exchange (Linux renameat2 RENAME_EXCHANGE) where the file system
has one, else two renames. What DIR may be, checked before any work:

- absent, or an empty directory: the build creates it;
- a specc build (its manifest.json parses as specc's, specc/spec/manifest.py): a rebuild replaces
  the files that build's manifest lists and keeps every other file and folder (a user's notes,
  results), hard-linked (else copied) into the new build before the exchange. A kept path that
  the new build also writes is refused before anything moves;
- anything else (a file, a folder with other content, another tool's manifest.json): refused.

`-o` through a symbolic link builds where the link points. A lock file `.<DIR>.specc-lock` keeps
two builds from writing DIR at once (the second fails clearly); it is removed when the build ends.
The commit and the removal of a staging directory finish before Ctrl-C or SIGTERM act
(specc/interrupts.py). A killed build (SIGKILL, a power cut) leaves DIR as it was, or, in the
two-rename window, the previous build under `.<DIR>.specc-old-*`; the next build into DIR puts
such a previous build back and removes the rest of what killed builds left.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import shutil
import stat
import tempfile
from pathlib import Path

from specc.errors import BuildError
from specc.interrupts import shielded
from specc.spec.manifest import MANIFEST, NotAManifest, artifact_paths, read_manifest

__all__ = ["MANIFEST", "Staging", "check_replaceable"]


class Staging:
    """`with Staging(out_dir) as stage:` ... write into stage.tmp ... `stage.commit()`."""

    def __init__(self, out_dir: str | os.PathLike):
        self.out = Path(os.path.realpath(out_dir))  # through a symbolic link: where it points
        self.tmp: Path | None = None
        self.kept: list[str] = []  # DIR's files that are not the previous build's artifacts
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
        try:
            self._clean_leftovers()
            self.kept = kept_paths(self.out)  # again, now that no other build can change DIR
            self.tmp = Path(tempfile.mkdtemp(prefix=f".{self.out.name}.specc-tmp-", dir=parent))
        except OSError as exc:
            self._unlock()
            raise BuildError(f"cannot write in {parent}: {exc.strerror}") from None
        except BaseException:
            self._unlock()
            raise
        return self

    def __exit__(self, *exc) -> None:
        with shielded():
            try:
                if self.tmp is not None:
                    _remove(self.tmp)
            finally:
                self._unlock()

    def commit(self) -> None:
        """Move the finished build to DIR, replacing a previous build there and keeping its
        other files."""
        assert self.tmp is not None
        self._carry_kept()
        with shielded():
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

    def _carry_kept(self) -> None:
        """Link DIR's kept files into the staged build (DIR itself is untouched until the
        exchange, so a kill before it loses nothing)."""
        for rel in self.kept:
            src, dst = self.out / rel, self.tmp / rel
            if os.path.lexists(dst) or _file_on_the_way(self.tmp, rel):
                raise BuildError(f"{src} is not a file of the previous build, and the new build writes "
                                 f"{rel}; move it away and build again (nothing was changed)")
            st = os.lstat(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            if stat.S_ISDIR(st.st_mode):
                dst.mkdir()
                shutil.copystat(src, dst)
            elif stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(src), dst)
            else:
                try:
                    os.link(src, dst)
                except OSError:
                    shutil.copy2(src, dst)

    def _lock(self) -> None:
        path = self._lock_path()
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                os.close(fd)
                raise BuildError(f"another specc build is writing {self.out}; wait for it to finish") from None
            # the build that held it may have removed the file after we opened it: then this lock
            # is on a name no one else sees, and we take the lock again
            try:
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            try:
                self._lock_path().unlink(missing_ok=True)  # still ours: we hold the lock
            finally:
                os.close(self._lock_fd)  # closing releases the flock
                self._lock_fd = None

    def _lock_path(self) -> Path:
        return self.out.with_name(f".{self.out.name}.specc-lock")

    def _clean_leftovers(self) -> None:
        """Staging and replaced directories of earlier builds into DIR that were killed (we hold
        the lock, so no live build owns them). A build killed between its two renames left no DIR
        and the previous build as `.specc-old-*`: that previous build is put back."""
        name = glob.escape(self.out.name)  # a DIR named like b[1] must not match b1's files
        for old in sorted(self.out.parent.glob(f".{name}.specc-old-*")):
            if not os.path.lexists(self.out) and old.is_dir() and not old.is_symlink():
                os.rename(old, self.out)
            else:
                _remove(old)
        for p in self.out.parent.glob(f".{name}.specc-tmp-*"):
            _remove(p)


def clean_leftovers(out: Path) -> None:
    """What killed builds into `out` left (Staging._clean_leftovers), where no build holds its
    lock now; a build that is up to date does this instead of staging. A build killed between
    exchanging DIR and removing the previous build leaves that previous build as a staging
    directory beside a complete DIR, which the next build, a cache hit, would otherwise keep."""
    staging = Staging(out)
    if not any(staging.out.parent.glob(f".{glob.escape(staging.out.name)}.specc-*")):
        return
    try:
        staging._lock()
    except BuildError:  # a live build holds it: its staging is its own
        return
    try:
        staging._clean_leftovers()
    finally:
        staging._unlock()


def check_replaceable(out: Path) -> None:
    """DIR may be absent, an empty directory, or a specc build; nothing else is written into."""
    kept_paths(out)


def kept_paths(out: Path) -> list[str]:
    """What a build into `out` keeps there: the relative paths of the entries of a previous build
    that its manifest does not list (parents before children). Raises BuildError where `out` may
    not be built into."""
    if os.path.islink(out):  # os.path.realpath left it: a loop, or too deep
        raise BuildError(f"{out} is a symbolic link that does not resolve; choose another -o")
    if not os.path.lexists(out):
        return []
    if not out.is_dir():
        raise BuildError(f"{out} exists and is not a directory; choose another -o")
    try:
        if not any(out.iterdir()):
            return []
        manifest = read_manifest(out / MANIFEST)
    except NotAManifest as exc:
        raise BuildError(f"{out} is not a specc build, and specc builds only into an empty or absent "
                         f"folder or an earlier build ({out / MANIFEST}: {exc}); choose another -o") from None
    except OSError as exc:
        raise BuildError(f"cannot read {exc.filename or out}: {exc.strerror}") from None
    owned = {MANIFEST, *artifact_paths(manifest)}
    kept = []
    for root, dirs, files in os.walk(out):
        dirs.sort()
        for name in sorted(dirs) + sorted(files):
            path = Path(root, name)
            rel = path.relative_to(out).as_posix()
            if rel in owned:
                continue
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                # a folder that holds none of the build's files is the user's own (what is in it
                # follows); one that does (a Triton model's folder) is the build's, and only
                # what else is in it is kept
                if not any(a.startswith(rel + "/") for a in owned):
                    kept.append(rel)
            elif stat.S_ISREG(mode) or stat.S_ISLNK(mode):
                kept.append(rel)
            else:
                raise BuildError(f"{path} is not a regular file, folder or link and not a file of the build; "
                                 "move it away and build again")
    return kept


def _file_on_the_way(root: Path, rel: str) -> bool:
    """Whether a proper prefix of `rel` is something other than a directory under `root`."""
    path = root
    for part in Path(rel).parts[:-1]:
        path = path / part
        if os.path.lexists(path) and (path.is_symlink() or not path.is_dir()):
            return True
    return False


def _remove(path: Path) -> None:
    """Remove a staging entry, whatever it is (a directory, or a link a killed build left)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


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
