"""A decode step of one routed-experts layer against the same layer with a dense FFN of the
routed experts' active size: does the exported graph read only the experts a token chose?

    .venv/bin/python benchmarks/moe_decode.py [--variants moe moe-loop dense] [--precisions fp32 int8 int4]
                                              [--prompt 32] [--new 32] [--rounds 3] [--reuse] [--doc]

The model: qwen3-30b-a3b's layer (d_model 2048, 32 query heads over 4 kv heads of 128, QK-norm,
128 SwiGLU experts of d_ff 768, 8 chosen per token by a softmax router renormalised), one layer,
a vocabulary of 1024 (so that the head does not hide the layer), seeded weights. Variants:
`moe`, the layer as specc builds it (the routed experts one MoE node, QMoE in integer builds:
specc/export/moe.py); `moe-loop`, the same layer with the experts exported as the torch loop over
experts (patched in this process only: each expert a Gather of its rows and its own products,
which an integer build leaves fp32, being Gemm); `dense`, the same attention with one SwiGLU FFN
of d_ff 8 x 768 = 6144: the arithmetic and weight bytes of the 8 chosen experts. Each is built by
`specc.build` at each precision and decoded with specc.runtime.Session (model.onnx, 2 threads):
--new greedy tokens after a random prompt of --prompt tokens, in turn, --rounds times; the figure
is the median decode step. For an integer build of a variant also built at fp32, its logits over
a random sequence of 128 tokens against the fp32 build's: the positions whose argmax agrees, the
mean cosine and the largest difference. Prints markdown tables; --doc appends them to
docs/benchmarks_moe.md.
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
import onnxruntime

import specc
from specc.nn import experts
from specc.runtime import Session
from specc.spec.load import loads_spec

from gqa_decode import steps  # one decode step timing for both benchmarks (a script beside it)

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "bench-moe"
DOC = ROOT / "docs" / "benchmarks_moe.md"
THREADS = 2
VOCAB = 1024
SPEC = """specc: 1
name: moe-bench-{variant}
extends: qwen3-30b-a3b
vocab: {{size: {vocab}, tie_output: false}}
position: {{kind: rotary, max_length: 512, base: 1000000.0}}
decoder:
  layers: 1
  ffn: {ffn}
tokens: {{bos: 1, eos: 2}}
serving: {{batch: {{min: 1, opt: 1, max: 1}}, length: {{min: 1, opt: 64, max: 512}}, precision: fp32}}
"""
MOE = "{kind: moe, experts: 128, top_k: 8, d_ff: 768, activation: swiglu, router: {kind: softmax, normalize: true}}"
FFNS = {"moe": MOE, "moe-loop": MOE, "dense": "{kind: dense, d_ff: 6144, activation: swiglu, bias: false}"}
QUALITY_TOKENS = 128


def spec_text(variant: str) -> str:
    return SPEC.format(variant=variant, vocab=VOCAB, ffn=FFNS[variant])


def build(variant: str, precision: str, reuse: bool = False) -> tuple[Path, float]:
    """The variant built at `precision` (seed 0), or with `reuse` the build there if it is up to
    date (its cache key sees neither the export's form nor specc's code: a run with --reuse must
    follow one without it, on the same code); returns its folder and the build's seconds."""
    start = time.perf_counter()
    fused = experts.FUSED_ACTIVATIONS
    if variant == "moe-loop":
        experts.FUSED_ACTIVATIONS = ()  # the loop over experts: Experts.forward, in this process only
    try:
        out = specc.build(loads_spec(spec_text(variant)), WORK / f"{variant}-{precision}", precision=precision,
                          force=not reuse).out_dir
    finally:
        experts.FUSED_ACTIVATIONS = fused
    return out, time.perf_counter() - start


def quality(out: Path, reference: Path, ids: list[int]) -> str:
    """Argmax agreement, mean cosine and largest difference of the logits over `ids` (one
    prefill) of the build `out` against the build `reference`."""
    got, want = (Session(d, threads=THREADS, inplace=False).run(input_ids=[ids])["logits"][0] for d in (out, reference))
    cos = np.sum(got * want, -1) / (np.linalg.norm(got, axis=-1) * np.linalg.norm(want, axis=-1))
    agree = np.mean(got.argmax(-1) == want.argmax(-1))
    return f"{agree * 100:.1f}% | {cos.mean():.5f} | {np.abs(got - want).max():.3g}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", default=["moe", "dense"], choices=list(FFNS))
    ap.add_argument("--precisions", nargs="+", default=["fp32", "int4"])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reuse", action="store_true", help="take the builds an earlier run left, where up to date")
    ap.add_argument("--doc", action="store_true", help="append the tables to docs/benchmarks_moe.md")
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    prompt = rng.integers(10, VOCAB, args.prompt).tolist()
    sequence = rng.integers(10, VOCAB, QUALITY_TOKENS).tolist()
    rows, quality_rows, built = [], [], {}
    for precision in args.precisions:
        for v in args.variants:
            built[(v, precision)] = build(v, precision, args.reuse)
        sessions = {v: Session(built[(v, precision)][0], threads=THREADS, inplace=False) for v in args.variants}
        got: dict[str, list[float]] = {v: [] for v in args.variants}
        for _ in range(args.rounds):
            for v, session in sessions.items():
                got[v] += steps(session, prompt, args.new)
        del sessions
        dense = statistics.median(got["dense"]) if "dense" in got else None
        for v in args.variants:
            step = statistics.median(got[v])
            ratio = f"{step / dense:.2f}x" if dense else "-"
            rows.append(f"| {precision} | {v} | {step * 1e3:.2f} ms | {ratio} | {_ops(built[(v, precision)][0] / 'model.onnx')} "
                        f"| {built[(v, precision)][1]:.0f} s |")
            if precision != "fp32" and (v, "fp32") in built:
                quality_rows.append(f"| {v} | {precision} | {quality(built[(v, precision)][0], built[(v, 'fp32')][0], sequence)} |")
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "`.venv/bin/python benchmarks/moe_decode.py " + " ".join(a for a in sys.argv[1:] if a != "--doc") + "`"
    lines = [f"{command}, {now}, {platform.machine()}, onnxruntime {onnxruntime.__version__} CPU, {THREADS} threads, "
             f"{args.rounds} rounds of {args.new} tokens after a {args.prompt}-token prompt, batch 1.", "",
             "| precision | variant | decode step (median) | / dense | graph: nodes (MoE, QMoE) | build |",
             "|---|---|---|---|---|---|", *rows]
    if quality_rows:
        lines += ["", f"Logits of the integer builds over {QUALITY_TOKENS} random tokens against the fp32 build's:", "",
                  "| variant | precision | argmax agrees | mean cosine | largest difference |", "|---|---|---|---|---|",
                  *quality_rows]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.doc:
        with open(DOC, "a") as f:
            f.write("\n" + text)


def _ops(path: Path) -> str:
    """The graph's node count, and its MoE and QMoE nodes."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    return f"{len(graph.node)} ({sum(n.op_type == 'MoE' for n in graph.node)}, {sum(n.op_type == 'QMoE' for n in graph.node)})"


if __name__ == "__main__":
    main()
