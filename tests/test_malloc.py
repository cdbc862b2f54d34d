"""specc.malloc and the CLI's entry and exit: what the process asks of glibc and of Python's collector."""
from __future__ import annotations

import subprocess
import sys

import pytest

from specc import malloc

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


# --- huge pages for the processes that run a model ------------------------------------------------------------


def _glibc(monkeypatch, version=(2, 36), mode="madvise"):
    monkeypatch.setattr(malloc, "_glibc_version", lambda: version)
    monkeypatch.setattr(malloc, "_thp_mode", lambda: mode)


def test_huge_pages_environment_adds_the_tunable_beside_the_users(monkeypatch):
    _glibc(monkeypatch)
    env = malloc.huge_pages_environment({"PATH": "/bin"})
    assert env == {"PATH": "/bin", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
    env = malloc.huge_pages_environment({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"}


@pytest.mark.parametrize("version, mode, environ", [
    ((2, 36), "madvise", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}),  # the user's choice
    ((2, 36), "madvise", {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}),  # set: a started-again process
    ((2, 34), "madvise", {}),  # before the tunable
    ((), "madvise", {}),  # not glibc
    ((2, 36), "always", {}),  # huge pages already
    ((2, 36), "never", {}),  # refused
    ((2, 36), None, {}),  # not Linux
])
def test_huge_pages_environment_is_none_where_it_changes_nothing(monkeypatch, version, mode, environ):
    _glibc(monkeypatch, version, mode)
    assert malloc.huge_pages_environment(environ) is None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and the kernel's settings")
def test_this_machines_glibc_and_kernel_are_read():
    assert malloc._glibc_version() >= (2, 17)
    assert malloc._thp_mode() in ("always", "madvise", "never")


@pytest.mark.parametrize("argv, starts_again", [(["specc", "generate", "B"], True), (["specc", "run", "B"], True),
                                                (["specc", "serve", "B"], True), (["specc", "build", "S"], False),
                                                (["specc", "validate", "S"], False), (["specc"], False)])
def test_entry_starts_a_model_running_command_again_in_huge_pages(monkeypatch, argv, starts_again):
    """The console script: `run`, `generate` and `serve` exec the same arguments in the huge-pages
    environment (where there is one); other commands go straight to main()."""
    from specc import cli

    calls = []
    monkeypatch.setattr(sys, "argv", argv)
    monkeypatch.setattr(sys, "orig_argv", ["/venv/bin/python", "/venv/bin/specc", *argv[1:]])
    monkeypatch.setattr(malloc, "huge_pages_environment", lambda: {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    monkeypatch.setattr(cli.os, "execve", lambda *a: calls.append(("exec", *a)))
    monkeypatch.setattr(cli, "main", lambda: calls.append(("main",)))
    cli.entry()
    if starts_again:
        assert calls[0] == ("exec", sys.executable, [sys.executable, "/venv/bin/specc", *argv[1:]],
                            {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"})
    else:
        assert calls == [("main",)]
