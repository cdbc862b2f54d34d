"""Ctrl-C and SIGTERM during a build: never swallowed, never half a cleanup.

- SIGTERM (what `timeout`, `kill` and CI cancellation send) ends a process at once by default,
  with no cleanup. Inside `terminate_as_interrupt()` it raises `Terminated`, a KeyboardInterrupt,
  so every cleanup written for Ctrl-C runs for it too; the CLI exits 143 on it, 130 on Ctrl-C.
- Python raises an interrupt in whatever Python code runs next. When that code is a finalizer or
  a weakref callback (importlib's module-lock callbacks, torch's caches, both common during an
  export), the interpreter cannot propagate it: it prints "Exception ignored in ..." and carries
  on, and a build interrupted at that instant would run to the end and exit 0. Inside `watch()`
  such an interrupt is recorded instead, and `check()` (called by the build between stages and
  before its commit) raises it again where it can propagate.
- Inside `shielded()` (a commit, the removal of a staging directory) both signals wait until the
  block is done, then act as they would have.

Signal handlers belong to the main thread: elsewhere the context managers change nothing.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading


class Terminated(KeyboardInterrupt):
    """Raised by SIGTERM inside terminate_as_interrupt()."""


_pending: type[BaseException] | None = None


def _raise_terminated(signum, frame) -> None:
    raise Terminated


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def terminate_as_interrupt():
    """SIGTERM raises Terminated while inside, where SIGTERM still has its default action (a
    program that handles SIGTERM itself keeps its handler)."""
    if not _main_thread() or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def watch():
    """Record interrupts that Python reports as unraisable while inside; other unraisable
    exceptions go to the hook that was there before."""
    global _pending
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        global _pending
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            _pending = unraisable.exc_type
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        with terminate_as_interrupt():
            yield
    finally:
        sys.unraisablehook = previous
        _pending = None


def check() -> None:
    """Raise the interrupt (KeyboardInterrupt or Terminated) swallowed since the last check."""
    global _pending
    if _pending is not None:
        pending, _pending = _pending, None
        raise pending


@contextlib.contextmanager
def shielded():
    """Hold SIGINT and SIGTERM until the block is done, then deliver them to the handlers they
    had. An exception already leaving the block wins over a held signal."""
    signals = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    if not _main_thread():
        yield
        return
    held: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: held.append(signum)) for s in signals}
    try:
        yield
    except BaseException:
        _restore(previous)
        raise
    _restore(previous)
    for signum in dict.fromkeys(held):
        handler = previous[signum]
        if callable(handler):
            handler(signum, None)  # raises KeyboardInterrupt / Terminated
        elif handler == signal.SIG_DFL:
            os.kill(os.getpid(), signum)  # the default action: end the process


def _restore(previous: dict) -> None:
    for signum, handler in previous.items():
        signal.signal(signum, handler)
