"""Interrupted and concurrent builds, in real processes.

`specc build` is killed (SIGKILL, SIGINT, SIGTERM) at seeded moments after a stage line appears on stderr;
DIR must then hold either the previous good build byte for byte, or a complete new build whose
manifest hashes match its files, or nothing where there was nothing; the next build succeeds and
leaves no staging directories. Two builds started together into one DIR: one wins, the other
fails clearly, and DIR is a valid build."""
from __future__ import annotations

import hashlib
import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import specc
from specc.export.outdir import MANIFEST

from tests.helpers.spectext import DEC

SPECC = Path(sys.executable).with_name("specc")

pytestmark = pytest.mark.skipif(not SPECC.exists(), reason="the specc console script is not installed next to this Python")


def start(spec: Path, out: Path, *args: str) -> tuple[subprocess.Popen, queue.Queue]:
    env = {k: v for k, v in os.environ.items() if k != "SPECC_DEBUG"}
    proc = subprocess.Popen([str(SPECC), "build", str(spec), "-o", str(out), *args], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stderr:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines


def wait_for_stage(lines: queue.Queue, stage: str, timeout: float = 120) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = lines.get(timeout=deadline - time.monotonic())
        if line is None:
            return seen  # the process ended first
        seen.append(line)
        if line.startswith(f"specc: {stage} "):
            return seen
    raise AssertionError(f"no {stage!r} line within {timeout} s: {seen}")


def drain(lines: queue.Queue, timeout: float = 30) -> str:
    """The rest of a process's stderr, once it has ended."""
    rest = []
    while (line := lines.get(timeout=timeout)) is not None:
        rest.append(line)
    return "".join(rest)


def listing(root: Path) -> dict[str, bytes] | None:
    if not root.exists():
        return None
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def is_complete_build(root: Path) -> bool:
    """The manifest lists every file in DIR with its sha256, and nothing else is there."""
    files = listing(root)
    manifest = json.loads(files.pop(MANIFEST))
    hashes = {a["path"]: a["sha256"] for a in manifest["artifacts"]}
    return hashes == {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}


def leftovers(parent: Path, out: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{out.name}.specc-") and not p.name.endswith("-lock"))


@pytest.fixture(scope="module")
def spec(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("spec") / "small.yaml"
    path.write_text(DEC)
    return path


# (signal, stage line to wait for, most seconds to wait after it): seeded delays inside the
# following stage; "build module" reaches into export, "export" into optimize/verify, "verify"
# into the write and the commit (rename) itself; "resolve" lands in the module's construction
KILLS = [
    (signal.SIGINT, "build module", 2.0),
    (signal.SIGTERM, "resolve", 1.0),
    (signal.SIGKILL, "verify", 0.05),
]
EXIT = {signal.SIGINT: (130, "specc: interrupted"), signal.SIGTERM: (143, "specc: terminated")}


def test_killed_builds_leave_the_previous_build_or_nothing(spec, tmp_path):
    rng = random.Random(20261123)
    fresh = tmp_path / "fresh"
    out = tmp_path / "out"
    specc.build(spec, out)  # the previous good build (seed 0)
    good = listing(out)
    assert is_complete_build(out)
    outcomes = []

    # a build into a DIR that does not exist yet, killed after the export: nothing is left
    proc, lines = start(spec, fresh)
    wait_for_stage(lines, "export")
    time.sleep(rng.uniform(0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=60)
    assert listing(fresh) is None or is_complete_build(fresh)
    outcomes.append(("fresh", proc.returncode, listing(fresh) is None))

    for sig, stage, most in KILLS:
        proc, lines = start(spec, out, "--seed", "1")  # another seed: a real rebuild
        seen = wait_for_stage(lines, stage)
        time.sleep(rng.uniform(0, most))
        proc.send_signal(sig)
        rc = proc.wait(timeout=60)
        now = listing(out)
        assert now is not None, f"DIR vanished after {sig.name} at {stage}"
        if now != good:
            # the kill came after the commit: the new build, complete
            assert rc == 0 or is_complete_build(out), f"DIR is neither the old build nor a complete new one after {sig.name}"
            assert is_complete_build(out)
            good = now
        if sig in EXIT and rc != 0:
            code, line = EXIT[sig]
            err = drain(lines)
            assert rc == code, (rc, seen, err)
            assert line in "".join(seen) + err and "Traceback" not in err
            assert leftovers(tmp_path, out) == []  # Ctrl-C and SIGTERM clean their own staging dir
        outcomes.append((sig.name, stage, rc, now == good))

    # the next build succeeds and removes whatever killed builds left
    proc = subprocess.run([str(SPECC), "build", str(spec), "-o", str(out), "--seed", "1"],
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    assert is_complete_build(out)
    assert leftovers(tmp_path, out) == []
    # the fresh build and the one interrupted mid-export were really stopped (the kill after
    # verify may land after the process finished: then DIR is its complete build, checked above)
    assert outcomes[0][1] != 0 and outcomes[1][2] == 130 and outcomes[2][2] == 143, outcomes


def test_two_builds_into_one_dir(spec, tmp_path):
    out = tmp_path / "out"
    procs = [start(spec, out, "--seed", str(seed)) for seed in (5, 6)]
    results = []
    for proc, lines in procs:
        rc = proc.wait(timeout=180)
        text = []
        while (line := lines.get(timeout=10)) is not None:
            text.append(line)
        results.append((rc, "".join(text)))
    codes = sorted(rc for rc, _ in results)
    assert codes[0] == 0, results
    for rc, text in results:
        assert "Traceback" not in text
        if rc != 0:
            assert rc == 1 and "another specc build is writing" in text, text
    assert is_complete_build(out)
    assert leftovers(tmp_path, out) == []
    seed = json.loads((out / MANIFEST).read_text())["options"]["weights"]["seed"]
    winners = [s for s, (rc, _) in zip((5, 6), results) if rc == 0]
    assert seed in winners


# --- a Ctrl-C that lands in a finalizer ----------------------------------------------------------


class _Finalizer:
    """Stands for a weakref callback or __del__ that is running when SIGINT arrives: Python
    raises the KeyboardInterrupt inside it and reports it as unraisable."""

    def __del__(self):
        raise KeyboardInterrupt


def test_a_swallowed_interrupt_is_raised_again_at_the_next_check(capfd, monkeypatch):
    from specc import interrupts

    monkeypatch.setattr(sys, "unraisablehook", sys.__unraisablehook__)  # Python's own, not pytest's
    _Finalizer()  # outside watch(): Python prints it and carries on
    interrupts.check()
    assert "Exception ignored" in capfd.readouterr().err
    with interrupts.watch():
        _Finalizer()
        assert capfd.readouterr().err == ""  # recorded, not printed
        with pytest.raises(KeyboardInterrupt):
            interrupts.check()
        interrupts.check()  # raised once


def test_a_build_interrupted_inside_a_finalizer_stops_before_its_commit(spec, tmp_path, capfd):
    out = tmp_path / "out"

    def progress(stage, event, facts):
        if (stage, event) == ("export", "start"):
            _Finalizer()

    with pytest.raises(KeyboardInterrupt):
        specc.build(spec, out, progress=progress)
    assert not out.exists()
    assert leftovers(tmp_path, out) == []
    assert "Exception ignored" not in capfd.readouterr().err
    specc.build(spec, out)  # the hook was put back: the next build runs through
    assert is_complete_build(out)


# --- Ctrl-C at a terminal, with the torch reference running in a forked child ------------------------

# wide enough that the forked reference run (one thread, 2048 tokens) takes a second or two
WIDE = DEC.replace("d_model: 64", "d_model: 1024").replace("heads: 4", "heads: 16") + \
    "serving:\n  length: {min: 1, opt: 64, max: 2048}\n"


def processes_with(token: str) -> list[int]:
    """The processes whose environment holds `token` (a build and whatever it forked)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if token.encode() in environ and state not in ("Z", "X"):
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the reference run is forked on Linux only")
def test_ctrl_c_at_a_terminal_ends_the_build_and_its_reference_run(tmp_path):
    spec = tmp_path / "wide.yaml"
    spec.write_text(WIDE)
    out = tmp_path / "out"
    token = f"SPECC_TEST_TOKEN=ctrl-c-{os.getpid()}-{time.monotonic_ns()}"
    env = {k: v for k, v in os.environ.items() if k != "SPECC_DEBUG"}
    env.update({"SPECC_REFERENCE_PROCESS": "fork", "SPECC_TEST_TOKEN": token.split("=", 1)[1]})
    # its own process group, as a shell gives a foreground job: a terminal's Ctrl-C reaches all of it
    proc = subprocess.Popen([str(SPECC), "build", str(spec), "-o", str(out)], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    err = []
    try:
        for line in proc.stderr:
            err.append(line)
            if line.startswith("specc: build module "):
                break
        # the child is forked once the module is built and the exporter imported; it then has a
        # second or more of its run left
        deadline, children = time.monotonic() + 60, []
        while not children and time.monotonic() < deadline and proc.poll() is None:
            children = [p for p in processes_with(token) if p != proc.pid]
            time.sleep(0.02)
        assert len(children) == 1, (children, err)  # the forked reference run, running
        time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGINT)
        err.append(proc.stderr.read())
        rc = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(err)
    assert rc == 130, text
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
    assert processes_with(token) == []
    assert not out.exists()
    assert leftovers(tmp_path, out) == []


# --- SIGTERM and the shield, in this process --------------------------------------------------------


def test_sigterm_raises_terminated_only_inside_and_where_it_has_its_default_action():
    from specc import interrupts

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    with interrupts.terminate_as_interrupt():
        with pytest.raises(interrupts.Terminated):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler runs at the next bytecode; never reached
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    mine = []
    previous = signal.signal(signal.SIGTERM, lambda *_: mine.append(1))
    try:
        with interrupts.terminate_as_interrupt():  # a program's own handler is left alone
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
        assert mine == [1]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_shield_holds_signals_until_its_block_is_done():
    from specc import interrupts

    done = []
    with pytest.raises(KeyboardInterrupt):
        with interrupts.shielded():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            done.append("block")  # the interrupt did not cut it short
    assert done == ["block"]
    with interrupts.terminate_as_interrupt():
        with pytest.raises(interrupts.Terminated):
            with interrupts.shielded():
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)
                done.append("again")
    assert done == ["block", "again"]
    # an error already leaving the block wins over a held signal
    with pytest.raises(ValueError):
        with interrupts.shielded():
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.05)
            raise ValueError
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
