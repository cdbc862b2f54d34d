"""The reference run forked beside the export (specc/export/reference.py): the same outputs and
weights file as the run in the build's own process, its failures raised as the build's own, and
no child process outliving the build (an error, Ctrl-C, the build's process killed)."""
from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

import specc
from specc.errors import BuildError, VerificationError
from specc.export import reference as ref
from specc.export.reference import ReferenceJob, forks
from specc.export.verify import Spilled, _chunks
from specc.spec import load_spec, resolve

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reference run is forked on Linux only")

SPECS = ["tiny-gpt2", "tiny-transformer", "tiny-bert"]


def array(x) -> np.ndarray:
    return np.concatenate(list(_chunks(x))).reshape(x.shape) if isinstance(x, Spilled) else x


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def alive(pid: int) -> bool:
    """Running (a zombie nobody reaped counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def left(parent: Path) -> list[str]:
    """What a build left in its parent directory, but the lock file every build keeps there."""
    return [p.name for p in parent.iterdir() if not p.name.endswith("-lock")]


def job(tmp_path: Path, name: str = "tiny-gpt2", fork: bool = True, **kw) -> ReferenceJob:
    r = resolve(load_spec(name))
    spill = tmp_path / f"spill-{fork}"
    spill.mkdir()
    return ReferenceJob(r, specc.to_torch(r, seed=3), 3, spill, tmp_path / f"weights-{fork}.safetensors", fork=fork, **kw)


@pytest.mark.parametrize("name", SPECS)
def test_the_forked_run_gives_what_the_run_in_process_gives(tmp_path, name):
    with job(tmp_path, name, fork=True) as forked, job(tmp_path, name, fork=False) as inline:
        assert forked.forked and not inline.forked
        got, want = forked.result(), inline.result()
    assert forked.seconds is not None and forked.seconds > 0
    assert got.keys() == want.keys() and len(got) >= 3
    for key in want:
        assert got[key].keys() == want[key].keys()
        for out in want[key]:
            assert isinstance(got[key][out], Spilled)  # every output waits on disk
            a, b = array(got[key][out]), array(want[key][out])
            assert a.shape == b.shape and a.dtype == b.dtype == np.float32
            # one torch thread in the child, several here: float rounding apart, the same
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"{key} {out}")
    assert sha(tmp_path / "weights-True.safetensors") == sha(tmp_path / "weights-False.safetensors")


def test_forks_where_the_reference_run_is_long(monkeypatch):
    import threading

    monkeypatch.delenv(ref.ENV, raising=False)
    monkeypatch.setattr(threading, "active_count", lambda: 1)  # pytest-xdist's workers have threads of their own
    assert forks(124_439_808, 1024)  # gpt2-small at its longest case
    assert not forks(300_000, 128)  # a tiny spec: the fork would cost more than it hides
    monkeypatch.setattr(threading, "active_count", lambda: 2)  # a program with a thread of its own
    assert not forks(124_439_808, 1024)
    monkeypatch.setenv(ref.ENV, "inline")
    assert not forks(124_439_808, 1024)
    monkeypatch.setenv(ref.ENV, "fork")
    assert forks(300_000, 128)
    monkeypatch.setenv(ref.ENV, "threads")
    with pytest.raises(BuildError, match="SPECC_REFERENCE_PROCESS='threads': choose fork or inline"):
        forks(1, 1)


def test_a_specc_error_in_the_child_is_raised_as_itself(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise VerificationError("case longest: the reference gave NaN")

    monkeypatch.setattr("specc.export.verify.reference_outputs", broken)
    with job(tmp_path) as j, pytest.raises(VerificationError, match="^case longest: the reference gave NaN$"):
        j.result()


def test_any_other_failure_in_the_child_is_a_build_error(tmp_path, monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x64 and 32x64)\nmore")

    monkeypatch.setattr("specc.export.verify.reference_outputs", broken)
    with job(tmp_path) as j, pytest.raises(BuildError) as info:
        j.result()
    assert str(info.value) == ("the reference run of the PyTorch module failed: RuntimeError: "
                               "mat1 and mat2 shapes cannot be multiplied (2x64 and 32x64)")


def test_a_child_killed_from_outside_fails_the_build(tmp_path, monkeypatch):
    def talking(*a, **k):
        print("case longest: 1024 tokens", flush=True)
        time.sleep(60)

    monkeypatch.setattr("specc.export.verify.reference_outputs", talking)
    with job(tmp_path) as j:
        deadline = time.monotonic() + 30
        log = j.spill / ref.LOG
        while not (log.exists() and "longest" in log.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(j.pid, signal.SIGKILL)
        with pytest.raises(BuildError) as info:
            j.result()
    assert str(info.value) == ("the reference run of the PyTorch module (a child process) was killed by signal 9 "
                               "(by the system when it runs out of memory, or from outside); "
                               "its last words: case longest: 1024 tokens")


def test_leaving_early_kills_and_reaps_the_child(tmp_path, monkeypatch):
    monkeypatch.setattr("specc.export.verify.reference_outputs", lambda *a, **k: time.sleep(60))
    with pytest.raises(KeyboardInterrupt):
        with job(tmp_path) as j:
            pid = j.pid
            assert alive(pid)
            t0 = time.monotonic()
            raise KeyboardInterrupt
    assert time.monotonic() - t0 < 30  # killed, not waited for (it would sleep 60 s)
    assert not alive(pid)
    with pytest.raises(ChildProcessError):  # reaped, not left a zombie
        os.waitpid(pid, os.WNOHANG)


def test_the_child_dies_with_the_build_process(tmp_path):
    """kill -9 of the build: nothing runs cleanup code, the kernel ends the child (PDEATHSIG)."""
    script = textwrap.dedent(f"""
        import sys, time
        import specc
        from specc.export.reference import ReferenceJob
        from specc.spec import load_spec, resolve
        import specc.export.verify as v
        def running(*a, **k):
            open({str(tmp_path / 'running')!r}, "w").close()
            time.sleep(120)
        v.reference_outputs = running
        r = resolve(load_spec("tiny-gpt2"))
        j = ReferenceJob(r, specc.to_torch(r), 0, {str(tmp_path)!r}, {str(tmp_path / 'w.safetensors')!r}, fork=True)
        print(j.pid, flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        deadline = time.monotonic() + 60
        while not (tmp_path / "running").exists() and time.monotonic() < deadline:  # past its start
            time.sleep(0.05)
        assert alive(pid) and (tmp_path / "running").exists()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not alive(pid)


# --- in a build -------------------------------------------------------------------------------------


def test_a_build_with_the_forked_run_is_the_same_build(tmp_path, monkeypatch):
    monkeypatch.setenv(ref.ENV, "inline")
    inline = specc.build("tiny-gpt2", tmp_path / "inline", keep_weights=True)  # model.safetensors compared too
    events = []
    monkeypatch.setenv(ref.ENV, "fork")
    forked = specc.build("tiny-gpt2", tmp_path / "forked", keep_weights=True, progress=lambda s, e, f: events.append((s, e, dict(f))))
    assert [a["sha256"] for a in forked.manifest["artifacts"]] == [a["sha256"] for a in inline.manifest["artifacts"]]
    verify = next(f for s, e, f in events if (s, e) == ("verify", "done"))
    assert verify["reference_s"] > 0
    cases = lambda m: [(c["graph"], c["case"], sorted(c["outputs"])) for c in m["verification"]["cases"]]  # noqa: E731
    assert cases(forked.manifest) == cases(inline.manifest)
    assert forked.max_abs_diff < 1e-4
    assert not (tmp_path / "forked" / ".references").exists()
    assert sorted(p.name for p in (tmp_path / "forked").iterdir()) == sorted(p.name for p in (tmp_path / "inline").iterdir())


def test_a_failed_forked_run_leaves_no_build(tmp_path, monkeypatch):
    monkeypatch.setenv(ref.ENV, "fork")

    def broken(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr("specc.export.verify.reference_outputs", broken)
    with pytest.raises(BuildError, match="the reference run of the PyTorch module failed: RuntimeError: boom"):
        specc.build("tiny-gpt2", tmp_path / "out")
    assert left(tmp_path) == []


def test_a_build_interrupted_during_the_export_ends_its_child(tmp_path, monkeypatch):
    monkeypatch.setenv(ref.ENV, "fork")
    monkeypatch.setattr("specc.export.verify.reference_outputs", lambda *a, **k: time.sleep(60))
    jobs = []
    real = ReferenceJob.__init__

    def recording(self, *a, **k):
        real(self, *a, **k)
        jobs.append(self.pid)

    monkeypatch.setattr(ReferenceJob, "__init__", recording)

    def progress(stage, event, facts):
        if (stage, event) == ("export", "start"):
            raise KeyboardInterrupt

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        specc.build("tiny-gpt2", tmp_path / "out", progress=progress)
    assert time.monotonic() - t0 < 45  # the child killed, not waited for (it would sleep 60 s)
    assert len(jobs) == 1 and jobs[0] is not None
    assert not alive(jobs[0])
    assert left(tmp_path) == []


def test_spilled_outputs_read_back_are_checked_for_size(tmp_path):
    path = tmp_path / "x.bin"
    Spilled(path, np.arange(6, dtype=np.float32).reshape(2, 3))
    back = Spilled.existing(path, (2, 3), np.dtype("<f4"))
    assert array(back).tolist() == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(VerificationError, match=r"x\.bin: the spilled reference output is 24 bytes, not the 32"):
        Spilled.existing(path, (2, 4), np.dtype("<f4"))
    with pytest.raises(VerificationError, match=r"gone\.bin: the spilled reference output is missing"):
        Spilled.existing(tmp_path / "gone.bin", (1,), np.dtype("<f4"))


def test_the_exporter_is_imported_beside_the_module_and_before_the_fork(tmp_path, monkeypatch):
    """A child forked while another thread holds an import lock could wait on it for ever: the
    preloading thread (specc.export.onnx.preload) is done before the fork."""
    import threading

    monkeypatch.setenv(ref.ENV, "fork")
    at_fork = []
    real = ReferenceJob._fork

    def recording(self):
        at_fork.append([t.name for t in threading.enumerate()])
        real(self)

    monkeypatch.setattr(ReferenceJob, "_fork", recording)
    specc.build("tiny-gpt2", tmp_path / "out")
    assert len(at_fork) == 1 and "specc-preload" not in at_fork[0]


def test_preload_imports_the_exporter_and_listing_the_passes_does_not():
    code = ("import sys; from specc.builder import pipeline; from specc.export import onnx as ox; "
            "before = pipeline._ort_passes(False), 'onnx_ir' in sys.modules, 'torch._dynamo' in sys.modules; "
            "ox.preload().join(); print(before, [m for m in ox.EXPORTER_MODULES if m not in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(['fuse_gelu', 'fuse_attention', 'merge_products'], False, False) []"
