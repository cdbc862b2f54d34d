"""What specc asks of glibc's malloc: of a build, that its peak memory be the same from run to run
(one_arena, trim); of a process that runs a model, that its weights sit in huge pages
(huge_pages_environment).

All are no-ops on other C libraries (and off Linux): they change where memory comes from and where
freed memory goes, never what is computed.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

_M_ARENA_MAX = -8  # glibc's malloc.h
HUGE_PAGES_TUNABLE = "glibc.malloc.hugetlb"
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


@functools.cache
def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):  # not glibc
        return None
    return libc


def one_arena() -> bool:
    """Have glibc's malloc serve every thread of this process from one heap, unless the user set
    MALLOC_ARENA_MAX. By default each thread that allocates (torch's and onnxruntime's workers)
    gets a heap of its own, and memory freed in one is not reused by another (docs/reliability.md).
    A build's threads allocate large tensors, not many small objects, so they do not contend for
    the one heap. `specc build` calls it first; a process that embeds specc.build() decides for
    itself. Returns whether the setting was made (not on other C libraries, nor where the user
    chose)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    return libc is not None and libc.mallopt(_M_ARENA_MAX, 1) == 1


def trim() -> bool:
    """Give the heap's free pages back to the system (glibc's malloc_trim): memory that torch,
    numpy or onnxruntime freed between two large steps stays in the process otherwise, counted
    in its RSS, while the next step allocates afresh beside it. Verification calls it before each
    onnxruntime run (a few ms). Returns whether any memory was given back."""
    libc = _libc()
    return libc is not None and libc.malloc_trim(0) == 1


def huge_pages_environment(environ=None) -> dict[str, str] | None:
    """The environment in which glibc's malloc backs this process's large allocations with
    transparent huge pages (its tunable glibc.malloc.hugetlb=1, glibc 2.35 on; read when a program
    starts, so it takes a new process), or None where it would change nothing: not glibc or an
    older one, the kernel's transparent huge pages not in `madvise` mode (`always` gives them
    already, `never` refuses them), or GLIBC_TUNABLES naming the tunable already (the user's choice,
    glibc.malloc.hugetlb=0 included).

    Why: onnxruntime copies a build's integer weights into its own packed layout when a session
    opens, and a decode step then reads those GBs once, a routed model's experts in an order the
    router picks. In 4 KiB pages each of them is a translation to look up, most of them missed;
    in 2 MiB pages they are 512 times fewer (what it gains: docs/benchmarks_streamed.md)."""
    environ = os.environ if environ is None else environ
    if HUGE_PAGES_TUNABLE in environ.get("GLIBC_TUNABLES", "") or _glibc_version() < (2, 35) or _thp_mode() != "madvise":
        return None
    return with_tunable(environ, f"{HUGE_PAGES_TUNABLE}=1")


def with_tunable(environ, setting: str) -> dict[str, str]:
    """`environ` with `setting` (NAME=VALUE) appended to its GLIBC_TUNABLES."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return {**environ, "GLIBC_TUNABLES": ":".join(t for t in (tunables, setting) if t)}


def _glibc_version() -> tuple[int, ...]:
    libc = _libc()
    if libc is None:
        return ()
    try:
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        return tuple(int(part) for part in libc.gnu_get_libc_version().decode().split(".")[:2])
    except (AttributeError, ValueError):  # not glibc
        return ()


def _thp_mode() -> str | None:
    """The kernel's transparent huge page mode (the bracketed word of THP_MODE), None off Linux."""
    try:
        with open(THP_MODE) as f:
            words = f.read().split()
    except OSError:
        return None
    return next((w[1:-1] for w in words if w.startswith("[")), None)
