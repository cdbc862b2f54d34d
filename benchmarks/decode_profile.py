"""Where a decode step's time goes: onnxruntime's own profile of a build's in-place cache graph,
a prompt then single-token steps as Session.generate runs them, summed by operator type over
the steps (the prompt's call left out) and printed as a table of milliseconds per step.

    .venv/bin/python benchmarks/decode_profile.py BUILD_DIR [--prompt 128] [--steps 16] [--threads 2]

The session is the one Session opens (specc's options, weights prepacked as served) with
onnxruntime's profiling on; profiling adds a little to each node, so the per-step total is a
little above an unprofiled step's. Node events are assigned to the model_run event that holds
them; the first run (the prompt) is left out.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from specc.runtime import Session
from specc.runtime import session as session_module
from specc.runtime.generate import InplaceRunner


def profiled_options(prefix: str):
    """session_options with onnxruntime's profiling written under `prefix`."""
    plain = session_module.session_options

    def options(ort, threads=None):
        o = plain(ort, threads)
        o.enable_profiling = True
        o.profile_file_prefix = prefix
        return o

    return options


def by_op(events: list[dict]) -> tuple[dict[str, float], dict[str, int], int, dict[str, float]]:
    """(op type -> microseconds, op type -> node calls, runs, node -> microseconds) over the model
    runs after the first."""
    runs = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    if len(runs) < 2:
        raise SystemExit("the profile holds fewer than two runs")
    starts = np.array([r[0] for r in runs])
    total: dict[str, float] = collections.defaultdict(float)
    calls: dict[str, int] = collections.defaultdict(int)
    nodes: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        run = int(np.searchsorted(starts, e["ts"], side="right")) - 1
        if run < 1:
            continue  # the prompt's call
        op = e.get("args", {}).get("op_name", "?")
        total[op] += e["dur"]
        calls[op] += 1
        nodes[f"{op} {e['name'][:-len('_kernel_time')]}"] += e["dur"]
    return dict(total), dict(calls), len(runs) - 1, dict(nodes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", type=Path)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=0, help="also list the N slowest nodes")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        session_module.session_options = profiled_options(str(Path(tmp) / "profile"))
        session = Session(args.build, threads=args.threads, check_hashes=False)
        vocab = session.limits.vocab
        prompt = np.random.default_rng(0).integers(3, vocab, size=args.prompt).tolist()
        runner = InplaceRunner(session, [prompt], args.steps + 1)
        token = int(runner.prefill().argmax(-1)[0])
        start = time.perf_counter()
        for _ in range(args.steps):
            token = int(runner.step(np.array([token]))[0].argmax())
        wall = (time.perf_counter() - start) / args.steps
        path = session.inplace.session.end_profiling()
        events = json.loads(Path(path).read_text())
    total, calls, runs, nodes = by_op(events)
    step = sum(total.values()) / runs
    print(f"{args.build.name}: {runs} steps after a {args.prompt}-token prompt, {args.threads} threads; "
          f"a step {wall * 1e3:.1f} ms wall, its nodes {step / 1e3:.1f} ms")
    print("| operator | ms a step | share of the nodes' time | nodes a step |")
    print("|---|---|---|---|")
    for op, us in sorted(total.items(), key=lambda kv: -kv[1]):
        print(f"| {op} | {us / runs / 1e3:.2f} | {us / sum(total.values()):.1%} | {calls[op] // runs} |")
    if args.nodes:
        print("\n| node | ms a step |\n|---|---|")
        for name, us in sorted(nodes.items(), key=lambda kv: -kv[1])[:args.nodes]:
            print(f"| {name} | {us / runs / 1e3:.2f} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
