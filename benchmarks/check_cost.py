"""What a speculative check costs a build against a plain decode step: calls of its in-place
cache graph after a prompt, one token (a plain step) and k + 1 tokens (a check of k drafts), each
the median of several (speculative_cost.py's timing, 2 threads), printed as a Markdown table in milliseconds and in plain steps.

    .venv/bin/python benchmarks/check_cost.py BUILD_DIR [--prompt 190] [--repeats 9]

A check's calls run several positions through every product; where onnxruntime computes
several rows by another path than one (MatMulNBits at fp32 compute dequantizes its weight for
them), a check costs several steps whatever it accepts, and speculative decoding pays only
where drafts are long and kept (specc/decoding/speculation.py weighs each check in steps).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from speculative_cost import KS, THREADS, costs  # noqa: E402

from specc.runtime import Session  # noqa: E402
from specc.runtime.generate import checks_drafts  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", type=Path)
    ap.add_argument("--prompt", type=int, default=190)
    ap.add_argument("--repeats", type=int, default=9)
    args = ap.parse_args()
    session = Session(args.build, threads=THREADS)
    if not checks_drafts(session):
        raise SystemExit(f"{args.build}: its in-place graph does not check drafts (no LM output of a call's last positions)")
    vocab = session.limits.vocab
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()
    seconds = costs(args.build, prompt, args.repeats, vocab, KS)
    step = seconds["step"]
    print(f"{args.build}: calls of its in-place graph after a {args.prompt}-token prompt, "
          f"{THREADS} threads, each the median of {args.repeats}\n")
    print("| call | ms | in plain steps |\n|---|---|---|")
    for k in ("step", *KS):
        what = "plain step (1 token)" if k == "step" else f"check of {k} drafts ({k + 1} tokens)"
        print(f"| {what} | {seconds[k] * 1e3:.1f} | {seconds[k] / step:.2f} |")


if __name__ == "__main__":
    main()
