"""What a build asks of glibc's malloc, so that its peak memory is the same from run to run.

Both are no-ops on other C libraries (and off Linux): they change where freed memory goes, never
what is computed.
"""
from __future__ import annotations

import ctypes
import functools
import os
import sys

_M_ARENA_MAX = -8  # glibc's malloc.h


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
