"""Decode steps of a decoder with grouped key-value heads (GQA) at a short and a long context: the
graph specc writes (each kv head's keys and values broadcast over its query heads, the cache
read once) against the same model written as specc wrote it before 2026-11-26 (the kv
heads repeated H/Hkv times before the product: a copy of the whole cache every step). Both built
in this run, the baseline by patching the attention module in this process only.

    .venv/bin/python benchmarks/gqa_decode.py [--prompts 64 2000] [--new 32] [--rounds 3]

The model: d_model 1024, 8 layers, 16 query heads over 2 kv heads, d_ff 2816, vocabulary 32000
(LLaMA's layers, seeded weights, fp32), served up to 4096 positions. Each side decodes --new
greedy tokens after a random prompt of each length, in turn, --rounds times; the figure is the
median decode step over all rounds (2 threads each). Appends its table to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

import specc
from specc.nn.attention import Attention
from specc.runtime import Session
from specc.spec.load import loads_spec

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "bench-gqa"
DOC = ROOT / "docs" / "benchmarks.md"
THREADS = 2
SPEC = """specc: 1
name: gqa-bench
extends: tiny-llama
d_model: 1024
vocab: {size: 32000}
position: {kind: rotary, max_length: 4096}
decoder: {layers: 8, attention: {heads: 16, kv_heads: 2}, ffn: {d_ff: 2816}}
serving: {length: {min: 1, opt: 512, max: 4096}}
"""


def build(repeated: bool) -> Path:
    """The spec built as specc writes it, or (REPEATED) with the kv heads repeated before the
    attention products, as it wrote them before."""
    out = WORK / ("repeated" if repeated else "grouped")
    original = Attention._attention

    def repeat_first(self, q, k, v, *args, **kwargs):
        return original(self, q, self._repeat(k), self._repeat(v), *args, **kwargs)

    if repeated:
        Attention._attention = repeat_first
    try:
        return specc.build(loads_spec(SPEC), out).out_dir
    finally:
        Attention._attention = original


def steps(session: Session, prompt: list[int], new: int) -> list[float]:
    times: list[float] = []
    session.generate([prompt], max_new_tokens=new + 1, on_token=lambda step, tokens: times.append(time.perf_counter()))
    return list(np.diff(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, nargs="+", default=[64, 2000])
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    # model.onnx on both sides (the attention forms compared are its own; the in-place graph has neither)
    sessions = {name: Session(build(name == "repeated"), threads=THREADS, inplace=False) for name in ("grouped", "repeated")}
    rng = np.random.default_rng(0)
    prompts = {n: rng.integers(10, 32000, n).tolist() for n in args.prompts}
    got: dict = {(name, n): [] for name in sessions for n in args.prompts}
    for _ in range(args.rounds):
        for n in args.prompts:
            for name, session in sessions.items():
                got[(name, n)] += steps(session, prompts[n], args.new)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "`.venv/bin/python benchmarks/gqa_decode.py " + " ".join(sys.argv[1:]) + "`"
    lines = ["", "## Grouped key-value heads: a decode step at a long context (benchmarks/gqa_decode.py)", "",
             f"{command}, {now}, {platform.machine()}, {THREADS} threads, {args.rounds} rounds of {args.new} "
             "tokens after each prompt. gqa-bench (d_model 1024, 8 layers, 16 query heads over 2 kv heads, "
             "fp32): the graph specc writes (each kv head's keys and values read once, broadcast over its 8 "
             "query heads) against the same model with the kv heads repeated before the products (specc's "
             "graph before 2026-11-26: the cache copied 8 times over every step), both built in this run.",
             "", "| prompt | grouped: decode step (median) | repeated | repeated / grouped |", "|---|---|---|---|"]
    for n in args.prompts:
        grouped, repeated = (statistics.median(got[(name, n)]) * 1e3 for name in ("grouped", "repeated"))
        lines.append(f"| {n} | {grouped:.1f} ms | {repeated:.1f} ms | {repeated / grouped:.2f}x |")
    text = "\n".join(lines) + "\n"
    print(text)
    with open(DOC, "a") as f:
        f.write(text)


if __name__ == "__main__":
    main()
