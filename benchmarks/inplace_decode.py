"""Decode steps through the in-place cache graph (inplace.onnx: each layer's cache one buffer that
GroupQueryAttention writes the new positions into) against the model graph (model.onnx: a Concat
of past and new copies the whole cache into a new present every step), on one build, in one run.

    .venv/bin/python benchmarks/inplace_decode.py [--prompts 64 512 2000] [--new 32] [--rounds 3]

The models: LLaMA's layers at d_model 1024, 8 layers, d_ff 2816, vocabulary 32000, served up to
4096 positions, with 16 heads each their own kv head (MHA) and with 16 query heads over 2 kv heads
(GQA); seeded weights, fp32 and int4. Each side decodes --new greedy tokens after a random prompt
of each length, in turn, --rounds times; the figure is the median decode step over all rounds
(2 threads each; the model graph's side: Session(..., inplace=False)).
Appends its table to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import specc  # noqa: E402
from gqa_decode import steps  # noqa: E402  (a generation's decode steps, timed)
from specc.runtime import Session  # noqa: E402
from specc.spec.load import loads_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "bench-inplace"
DOC = ROOT / "docs" / "benchmarks.md"
THREADS = 2
SPEC = """specc: 1
name: inplace-bench-{kv}
extends: tiny-llama
d_model: 1024
vocab: {{size: 32000}}
position: {{kind: rotary, max_length: 4096}}
decoder: {{layers: 8, attention: {{heads: 16, kv_heads: {kv}}}, ffn: {{d_ff: 2816}}}}
serving: {{length: {{min: 1, opt: 512, max: 4096}}}}
"""
MODELS = {"MHA": 16, "GQA 16/2": 2}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 512, 2000])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int4"])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(10, 32000, n).tolist() for n in args.prompts}
    rows = []
    for model, kv in MODELS.items():
        for precision in args.precisions:
            out = specc.build(loads_spec(SPEC.format(kv=kv)), WORK / f"{kv}-{precision}", precision=precision).out_dir
            inplace, plain = Session(out, threads=THREADS), Session(out, threads=THREADS, inplace=False)
            assert inplace.inplace is not None, f"{out}: no in-place graph"
            got: dict = {(side, n): [] for side in ("inplace", "model") for n in args.prompts}
            for _ in range(args.rounds):
                for n in args.prompts:
                    for side, session in (("inplace", inplace), ("model", plain)):
                        got[(side, n)] += steps(session, prompts[n], args.new)
            for n in args.prompts:
                a, b = (statistics.median(got[(side, n)]) * 1e3 for side in ("inplace", "model"))
                rows.append(f"| {model} | {precision} | {n} | {a:.1f} ms | {b:.1f} ms | {b / a:.2f}x |")
                print(rows[-1], flush=True)
            del inplace, plain
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "`.venv/bin/python benchmarks/inplace_decode.py " + " ".join(sys.argv[1:]) + "`"
    lines = ["", "## The in-place cache graph: a decode step against the model graph's (benchmarks/inplace_decode.py)",
             "", f"{command}, {now}, {platform.machine()}, {THREADS} threads, {args.rounds} rounds of {args.new} "
             "tokens after each prompt. LLaMA's layers at d_model 1024, 8 layers, 16 heads (MHA: each its own kv "
             "head; GQA: over 2 kv heads), seeded weights. inplace: the build's inplace.onnx, each layer's cache "
             "one buffer written in place; model: the same build's model.onnx, whose Concat copies the cache "
             "into a new present every step (docs/build.md, the in-place cache graph).",
             "", "| model | precision | prompt | inplace: decode step (median) | model graph | model / inplace |",
             "|---|---|---|---|---|---|", *rows]
    text = "\n".join(lines) + "\n"
    print(text)
    with open(DOC, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
