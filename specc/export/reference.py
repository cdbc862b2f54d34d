"""A build's reference run (verify.reference_outputs) and its weights file (model.safetensors),
taken in a forked process while the build exports the graph.

Why: the export is single-threaded Python (torch.export's tracing and decompositions, the ONNX
translation, the optimizer) and leaves a core idle for seconds, while the reference run is torch's
own kernels at the spec's longest sequence, which would otherwise run after the export (its share
of a build: docs/build.md). Forked once the module is built, the child shares the module's weights with
the build (copy-on-write; nothing writes to them) and holds only its own activations; it runs
torch on one thread beside the export and writes every output into the staging directory, where
verification reads it back a chunk at a time (verify.Spilled).

The fork is taken only on Linux, only where the reference run is long enough to repay it
(FORK_MIN_WORK), and only from a process with no other Python thread (forks()); elsewhere the job runs in the build's own process when its result is asked for,
as builds did before. SPECC_REFERENCE_PROCESS=fork|inline overrides the choice (tests, debugging);
a streamed build never forks (specc/builder/pipeline.py).

The child never outlives the build: it is killed if the build stops before asking for the result
(an error, Ctrl-C) and, through PR_SET_PDEATHSIG, if the build's process dies (kill -9). It ignores
nothing: Ctrl-C at a terminal reaches it too and ends it without a word. It reports a failure
through a file in the spill directory, which the build raises as its own error.
"""
from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

import numpy as np

from specc import errors
from specc.errors import BuildError, SpeccError
from specc.export import verify  # through the module, so that a test can stand in for its functions
from specc.interrupts import Terminated

ENV = "SPECC_REFERENCE_PROCESS"
# parameters x longest sequence (about half the reference run's FLOPs) from which the run is forked:
# below it the run is short and a fork (which copies the parent's page tables) buys little; the
# test suite's tiny specs stay below it, the catalog's base-size models above
FORK_MIN_WORK = 1e10
INDEX = "index.json"
FAILURE = "failure.json"
LOG = "reference.log"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def forks(n_params: int, longest: int) -> bool:
    """Whether a build of this size takes its reference run in a forked process: on Linux, where
    the run is long, and only from a process whose one Python thread is the build's (the CLI). A
    program that calls specc.build() with threads of its own gets the run in its own process: a
    child forked while one of those threads held a lock (an import, a log handler, an object of
    theirs) could wait on it for ever. SPECC_REFERENCE_PROCESS=fork or inline decides instead."""
    choice = os.environ.get(ENV, "").strip().lower()
    if choice not in ("", "fork", "inline"):
        raise BuildError(f"{ENV}={os.environ[ENV]!r}: choose fork or inline (or leave it unset)")
    possible = sys.platform.startswith("linux") and hasattr(os, "fork")
    if choice:
        return choice == "fork" and possible
    return possible and n_params * longest >= FORK_MIN_WORK and threading.active_count() == 1


class ReferenceJob:
    """verify.reference_outputs(r, model, seed) with every output spilled into `spill`, and
    save_module(model, weights_file): forked at once where `forks()` says so, else run by
    result(). Use as a context manager: leaving it kills a child still running."""

    def __init__(self, r, model, seed: int, spill: Path, weights_file: Path, fork: bool | None = None, *,
                 longest: int | None = None, n_params: int | None = None, write_weights=None, prepare=None,
                 layers: tuple[str, ...] = (), lockstep=None):
        """longest: the cases' cap (verify.cases). n_params and write_weights(path): the model's
        parameter count and its weights file's writer where `model` does not hold its weights (a
        streamed build's, specc/nn/streamed.py); by default counted and save_module().
        prepare(model): changes the model after its weights file is written and before the
        reference run (an integer build's dequantized weights, pipeline._reference_weights).
        layers: the stacks whose layer outputs are kept too, lockstep: how a streamed model runs its
        cases at once (verify.reference_outputs)."""
        self.r, self.model, self.seed, self.longest, self.prepare = r, model, seed, longest, prepare
        self.lockstep = lockstep
        self.layers = tuple(layers)
        self.spill, self.weights_file = Path(spill), Path(weights_file)
        self.write_weights = write_weights or self._save_module
        self.pid: int | None = None
        self.seconds: float | None = None  # the child's own time, where it ran forked
        if n_params is None:
            n_params = sum(p.numel() for p in model.parameters())
        if fork is None:
            fork = forks(n_params, min(longest or r.serving.length.max, r.serving.length.max))
        if fork:
            self._fork()

    @property
    def forked(self) -> bool:
        return self.pid is not None

    def __enter__(self) -> ReferenceJob:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill the child if it is still running, and reap it."""
        if self.pid is None:
            return
        pid, self.pid = self.pid, None
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        _reap(pid)

    def result(self) -> dict:
        """The reference outputs, (graph, case) -> {output: array or Spilled}; model.safetensors is
        written when this returns. Waits for the child where there is one."""
        if self.pid is None:
            self.write_weights(self.weights_file)
            if self.prepare is not None:
                self.prepare(self.model)
            return verify.reference_outputs(self.r, self.model, self.seed, spill=self.spill, longest=self.longest,
                                             layers=self.layers, lockstep=self.lockstep)
        pid = self.pid
        status = _reap(pid)
        self.pid = None
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
            return self._read_index()
        raise self._failure(status)

    def _save_module(self, path: Path) -> None:
        from specc.weights import save_module  # torch

        save_module(self.model, path)

    # --- the child ---------------------------------------------------------------------------------

    def _fork(self) -> None:
        parent = os.getpid()
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid:
            self.pid = pid
            return
        code = 1
        try:
            code = self._child(parent)
        finally:
            os._exit(code)

    def _child(self, parent: int) -> int:
        # Ctrl-C and SIGTERM end the child as the default action does, without a traceback
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _die_with_parent(parent)
        # the child's own stdout and stderr: the build's are written by the build alone; file
        # objects of its own (the parent's may have been locked by another thread at the fork)
        fd = os.open(self.spill / LOG, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
        sys.stdout = sys.stderr = open(1, "w", closefd=False)
        try:
            import torch

            # one thread beside the export's one; torch's thread pool is not forked with the
            # process, and one thread never asks for it
            torch.set_num_threads(1)
            t0 = time.perf_counter()
            self.write_weights(self.weights_file)
            if self.prepare is not None:
                self.prepare(self.model)
            refs = verify.reference_outputs(self.r, self.model, self.seed, spill=self.spill, spill_all=True,
                                            longest=self.longest, layers=self.layers, lockstep=self.lockstep)
            index = {"seconds": round(time.perf_counter() - t0, 3),
                     "cases": [{"graph": g, "case": c, "outputs": {k: _entry(v, self.spill) for k, v in outs.items()}}
                               for (g, c), outs in refs.items()]}
            _write(self.spill / INDEX, index)
            return 0
        except BaseException as exc:  # reported to the build, which raises it as its own
            failure = {"type": type(exc).__name__, "message": str(exc).strip(),
                       "specc": isinstance(exc, SpeccError), "traceback": traceback.format_exc()}
            _write(self.spill / FAILURE, failure)
            return 1

    # --- back in the build -------------------------------------------------------------------------

    def _read_index(self) -> dict:
        try:
            index = json.loads((self.spill / INDEX).read_text())
        except (OSError, ValueError) as exc:
            raise BuildError(f"the reference run ended without its results ({exc})") from None
        self.seconds = index["seconds"]
        return {(c["graph"], c["case"]): {k: verify.Spilled.existing(self.spill / e["file"], tuple(e["shape"]), np.dtype(e["dtype"]))
                                          for k, e in c["outputs"].items()}
                for c in index["cases"]}

    def _failure(self, status: int) -> Exception:
        try:
            failure = json.loads((self.spill / FAILURE).read_text())
        except (OSError, ValueError):
            failure = None
        if failure is None:
            how = (f"was killed by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status)
                   else f"exited with status {os.waitstatus_to_exitcode(status)}")
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGINT:
                return KeyboardInterrupt()
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM:
                return Terminated()
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                how += " (by the system when it runs out of memory, or from outside)"
            last = _last_line(self.spill / LOG)
            return BuildError(f"the reference run of the PyTorch module (a child process) {how}"
                              + (f"; its last words: {last}" if last else ""))
        if failure["type"] in ("KeyboardInterrupt", "Terminated"):
            return Terminated() if failure["type"] == "Terminated" else KeyboardInterrupt()
        cls = getattr(errors, failure["type"], None) if failure["specc"] else None
        if isinstance(cls, type) and issubclass(cls, SpeccError) and cls is not errors.SpecError:
            return cls(failure["message"])
        return BuildError(f"the reference run of the PyTorch module failed: {failure['type']}: "
                          f"{failure['message'].splitlines()[0] if failure['message'] else ''}".rstrip(": "))


def _entry(value, spill: Path) -> dict:
    return {"file": value.path.relative_to(spill).as_posix(), "shape": list(value.shape), "dtype": value.dtype.str}


def _last_line(path: Path) -> str:
    """The last line the child wrote (its log is removed with the staging directory)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 4096))
            lines = f.read().decode(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1].strip() if lines else ""


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _reap(pid: int) -> int:
    """waitpid, retried when a signal handler returns normally (PEP 475 does that already) and
    tolerant of a child someone else reaped."""
    try:
        return os.waitpid(pid, 0)[1]
    except ChildProcessError:
        return 0


def _die_with_parent(parent: int) -> None:
    """Have the kernel send SIGKILL to this process when the build's process dies; and if it died
    between the fork and here, go at once."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


__all__ = ["ENV", "FORK_MIN_WORK", "ReferenceJob", "forks"]
