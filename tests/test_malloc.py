"""specc.malloc and the CLI's exit: what the process asks of glibc and of Python's collector."""
from __future__ import annotations

import subprocess
import sys

import pytest

_TRIM = """
import ctypes, re, sys
from specc.malloc import trim
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
blocks = [libc.malloc(64 << 10) for _ in range(800)]  # 50 MiB in the heap (under the mmap threshold)
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
pin = libc.malloc(64 << 10)  # the heap's top stays in use: only malloc_trim can give the rest back
for b in blocks:
    libc.free(b)
before = rss()
gave = trim() if sys.argv[1] == "1" else None
print(gave, before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_trim_gives_freed_heap_pages_back():
    """Freed heap memory below the heap's top stays in the process's RSS until trimmed."""
    def run(apply):
        proc = subprocess.run([sys.executable, "-c", _TRIM, apply], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        gave, dropped_kb = proc.stdout.split()
        return gave, int(dropped_kb)

    gave, dropped = run("1")
    assert gave == "True" and dropped > 40 * 1024, (gave, dropped)  # most of the 50 MiB
    gave, dropped = run("0")
    assert gave == "None" and dropped < 10 * 1024, dropped  # without it, the pages stay


_EXIT = """
import atexit, gc, sys
atexit.register(lambda: print("frozen at exit:", gc.get_freeze_count() > 0))  # runs after specc's (LIFO)
from specc.cli import main
if sys.argv[1] == "1":
    main(["validate", "gpt2-small"])
"""


@pytest.mark.parametrize("invoke", ["1", "0"])
def test_the_cli_freezes_the_heap_at_exit(invoke):
    """The command's process skips the interpreter's final collections (about 1.5 s after a build);
    importing specc.cli alone changes nothing."""
    proc = subprocess.run([sys.executable, "-c", _EXIT, invoke], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == f"frozen at exit: {invoke == '1'}"
