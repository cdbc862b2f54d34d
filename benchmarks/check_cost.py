"""What a speculative check costs a build against a plain decode step: calls of its in-place
cache graph after a prompt, one token (a plain step) and k + 1 tokens (a check of k drafts), each
the median of several, printed as a Markdown table in milliseconds and in plain steps.

    .venv/bin/python benchmarks/check_cost.py BUILD_DIR [--prompt 190] [--repeats 9] [--threads 2]

A check's calls run several positions through every product; where onnxruntime computes
several rows by another path than one (MatMulNBits at fp32 compute dequantizes its weight for
them), a check costs several steps whatever it accepts, and speculative decoding pays only
where drafts are long and kept (specc/decoding/speculation.py weighs each check in steps).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from specc.runtime import Session
from specc.runtime.generate import InplaceRunner, checks_drafts
from specc.runtime.speculative import MAX_DRAFT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build")
    ap.add_argument("--prompt", type=int, default=190)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    session = Session(args.build, threads=args.threads)
    if not checks_drafts(session):
        raise SystemExit(f"{args.build}: its in-place graph does not check drafts (no LM output of a call's last positions)")
    rng = np.random.default_rng(0)
    vocab = session.limits.vocab
    prompt = rng.integers(0, vocab, args.prompt).tolist()
    runner = InplaceRunner(session, [prompt], MAX_DRAFT + 1)
    runner.prefill()
    rows = []
    for k in (0, 1, 2, 4, MAX_DRAFT):
        times = []
        for _ in range(args.repeats):
            runner.truncate(len(prompt))
            start = time.perf_counter()
            runner.extend(rng.integers(0, vocab, (1, k + 1)))
            times.append(time.perf_counter() - start)
        rows.append((k, statistics.median(times)))
    step = rows[0][1]
    print(f"{args.build}: calls of its in-place graph after a {args.prompt}-token prompt, "
          f"{args.threads} threads, each the median of {args.repeats}\n")
    print("| call | ms | in plain steps |\n|---|---|---|")
    for k, seconds in rows:
        what = "plain step (1 token)" if k == 0 else f"check of {k} drafts ({k + 1} tokens)"
        print(f"| {what} | {seconds * 1e3:.1f} | {seconds / step:.2f} |")


if __name__ == "__main__":
    main()
