"""specc/fileio.py: files read by size, never without end (issue 30: `--input /dev/zero` and
`--tokenizer /dev/zero` read until the machine's memory ran out; a `weights:` of /proc/self/pagemap
was hashed for ever)."""
from __future__ import annotations

import hashlib
import os
import time

import pytest

from specc.fileio import NotARegularFile, file_sha256, read_bounded, regular_size


@pytest.fixture
def fifo(tmp_path):
    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


@pytest.mark.parametrize("which, kind", [("/dev/zero", "a character device"), ("fifo", "a FIFO"), ("dir", "a directory")])
def test_what_is_not_a_regular_file_is_refused_at_once(tmp_path, fifo, which, kind):
    path = {"fifo": fifo, "dir": tmp_path}.get(which, which)
    t0 = time.perf_counter()
    for read in (regular_size, lambda p: read_bounded(p, 1 << 20), file_sha256):
        with pytest.raises(NotARegularFile, match=kind):
            read(path)
    assert time.perf_counter() - t0 < 1.0


def test_a_regular_file_is_read_and_hashed_whole_within_its_limit(tmp_path):
    path = tmp_path / "f.bin"
    data = os.urandom(3 << 20)
    path.write_bytes(data)
    assert regular_size(path) == len(data)
    assert read_bounded(path, 4 << 20) == data
    assert file_sha256(path) == hashlib.sha256(data).hexdigest()
    with pytest.raises(NotARegularFile, match="more than"):
        read_bounded(path, 1 << 20)


@pytest.mark.skipif(not os.path.exists("/proc/self/pagemap"), reason="no /proc/self/pagemap here")
def test_a_proc_file_is_read_no_further_than_its_size():
    """/proc files say they are regular and of size 0, and yield data without end."""
    t0 = time.perf_counter()
    assert file_sha256("/proc/self/pagemap") == hashlib.sha256(b"").hexdigest()
    with pytest.raises(NotARegularFile, match="more than the 1024 bytes"):
        read_bounded("/proc/self/pagemap", 1 << 10)  # it yields more than its size says: refused at the limit
    assert time.perf_counter() - t0 < 1.0
