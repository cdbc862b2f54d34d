"""Ctrl-C that Python would otherwise swallow.

Python raises SIGINT's KeyboardInterrupt in whatever Python code runs next. When that code is a
finalizer or a weakref callback (importlib's module-lock callbacks, torch's caches, both common
during an export), the interpreter cannot propagate it: it prints "Exception ignored in ..." with
a traceback and carries on, and a build interrupted at that instant would run to the end and exit
0. Inside `watch()`, such an interrupt is recorded instead of printed, and `check()` (called by
the build between stages and before its commit) raises it again where it can propagate."""
from __future__ import annotations

import contextlib
import sys

_pending = False


@contextlib.contextmanager
def watch():
    """Record KeyboardInterrupts that Python reports as unraisable while inside; other unraisable
    exceptions go to the hook that was there before."""
    global _pending
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        global _pending
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            _pending = True
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        _pending = False


def check() -> None:
    """Raise KeyboardInterrupt if one was swallowed since the last check."""
    global _pending
    if _pending:
        _pending = False
        raise KeyboardInterrupt
