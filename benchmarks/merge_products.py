"""What the merge_products pass (specc/export/passes/merge_products.py) buys a decoder: the gguf
builds at int8 activations of benchmarks/speculative.py (SmolLM2-135M-Instruct's Q4_1 file, Gemma
3 270M's Q4_K_M file), built as specc builds them (merged) and again with the pass off (unmerged),
both run in one process in turn: a plain decode step and a check of 8 drafts through the in-place
cache graph after the quotation task's prompt, and greedy tokens of Session.generate; with
--specs, catalog specs cut to their first layers too (seeded weights, int4 at int8 activations,
random prompt ids). Writes its section of docs/benchmarks_passes.md.

    .venv/bin/python benchmarks/merge_products.py [--text FILE] [--models smollm2 gemma3]
        [--specs llama-2-7b:4 qwen3-30b-a3b:3] [--steps 32] [--rounds 7]
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import onnx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402
import speculative as sp  # noqa: E402
from speculative_cost import timed_calls  # noqa: E402
from suite import WORK as BENCH  # noqa: E402

import specc  # noqa: E402
from specc.builder import pipeline  # noqa: E402
from specc.runtime import Session  # noqa: E402
from specc.runtime.generate import InplaceRunner  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks_passes.md"
THREADS = 2
DRAFTS = 8
PROMPT = 128  # a seeded spec's prompt: random token ids


def built(spec, out: Path, merged: bool, **options) -> Path:
    """`spec` built to `out` with the pass (as specc builds it) or without it (kept when up to
    date: the cache key lists the passes)."""
    saved = pipeline.QUANTIZED_PASSES
    if not merged:
        pipeline.QUANTIZED_PASSES = {}
    try:
        specc.build(spec, out, progress=None, **options)
    finally:
        pipeline.QUANTIZED_PASSES = saved
    return out


def seeded(row: str) -> Path:
    """NAME:LAYERS: a catalog spec with its first LAYERS layers, written under build/bench."""
    name, layers = row.split(":")
    spec = BENCH / f"merge-{name}-{layers}.yaml"
    spec.parent.mkdir(parents=True, exist_ok=True)
    spec.write_text(f"specc: 1\nname: {name}-{layers}-layers\nextends: {name}\ndecoder: {{layers: {layers}}}\n")
    return spec


def products(build: Path, reading: str = "") -> int:
    """The MatMulNBits nodes of BUILD's in-place graph (those whose input's name ends in `reading`)."""
    graph = onnx.load(str(build / "inplace.onnx"), load_external_data=False).graph
    return sum(n.op_type == "MatMulNBits" and n.input[0].endswith(reading) for n in graph.node)


def calls(session: Session, prompt: list[int], repeats: int) -> tuple[float, float]:
    """(a plain step's seconds, a check of DRAFTS drafts' seconds) after the prompt, each the median
    of `repeats` calls (speculative_cost.timed_calls: each cut back after it)."""
    runner = InplaceRunner(session, [prompt], DRAFTS + 2)
    runner.prefill()
    vocab = session.limits.vocab
    return timed_calls(runner, 1, repeats, vocab), timed_calls(runner, DRAFTS + 1, repeats, vocab)


def arguments(doc: str, new: int) -> argparse.ArgumentParser:
    """The options of an A/B of two builds of the packaged GGUF files (this script's and
    spare_rows.py's): the models, calls a round, rounds, greedy tokens, the text of the tasks."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"])
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--new", type=int, default=new)
    ap.add_argument("--text", type=Path, default=None, help="the text the tasks' paragraph is taken from")
    return ap


def in_turn(sessions: dict, prompt: list[int], steps: int, rounds: int) -> tuple[dict, dict, list[dict]]:
    """(a plain step's median seconds, a check's median seconds, each round's plain-step seconds)
    for each of `sessions` {name: Session}, `rounds` rounds of `calls` after an untimed one (first
    calls, weights paged in, run slow), the sessions in turn in each round."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in sessions}
    for session in sessions.values():
        calls(session, prompt, steps)
    for _ in range(rounds):
        for name, session in sessions.items():
            times[name].append(calls(session, prompt, steps))
    step = {n: statistics.median(t[0] for t in ts) for n, ts in times.items()}
    check = {n: statistics.median(t[1] for t in ts) for n, ts in times.items()}
    return step, check, [{n: ts[i][0] for n, ts in times.items()} for i in range(rounds)]


def main() -> None:
    ap = arguments(__doc__, new=64)
    ap.add_argument("--specs", nargs="*", default=[], metavar="NAME:LAYERS",
                    help="catalog specs with their first LAYERS layers, seeded, int4 at int8 activations")
    args = ap.parse_args()
    source = args.text.read_text() if args.text else rm.reference_text()
    quote = sp.tasks(sp.paragraph(source))["quote"]
    cases = []  # (label, unmerged build, merged build, prompt)
    for model in args.models:
        merged, _ = sp.build(model, "gguf", "int8")
        spec = sp.WORK / f"{sp.spec_name(model, 'gguf')}.yaml"
        plain = built(spec, merged.parent / f"{merged.name}-unmerged", False, precision="gguf", activations="int8")
        session = Session(merged)
        prompt = session.prompts([quote], chat=session.tokenizer.chat_template is not None)[0]
        cases.append((f"{model} (gguf)", plain, merged, prompt))
    for row in args.specs:
        spec = seeded(row)
        merged = built(spec, spec.with_suffix(""), True, precision="int4", activations="int8", stream=True)
        plain = built(spec, spec.parent / f"{spec.stem}-unmerged", False, precision="int4", activations="int8", stream=True)
        vocab = Session(merged).limits.vocab
        prompt = np.random.default_rng(0).integers(0, vocab, PROMPT).tolist()
        cases.append((f"{row.replace(':', ', ')} layers (int4, seeded)", plain, merged, prompt))
    rows = []
    for label, plain, merged, prompt in cases:
        sessions = {"unmerged": Session(plain, threads=THREADS), "merged": Session(merged, threads=THREADS)}
        tokens = {name: s.generate(prompt, args.new, eos_id=-1).new_ids for name, s in sessions.items()}
        step, check, by_round = in_turn(sessions, prompt, args.steps, args.rounds)
        ratios = [r["unmerged"] / r["merged"] for r in by_round]
        rows.append(f"| {label} | {products(plain)} -> {products(merged)} | {step['unmerged'] * 1e3:.2f} ms | "
                    f"{step['merged'] * 1e3:.2f} ms | {step['unmerged'] / step['merged']:.3f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) | {check['unmerged'] * 1e3:.2f} ms | "
                    f"{check['merged'] * 1e3:.2f} ms | {check['unmerged'] / check['merged']:.3f}x | "
                    f"{'yes' if tokens['merged'] == tokens['unmerged'] else 'NO'} |")
        print(rows[-1], flush=True)
        del sessions
    command = ".venv/bin/python benchmarks/merge_products.py" + (f" --text {args.text.name}" if args.text else "") + \
        f" --models {' '.join(args.models)}" + (f" --specs {' '.join(args.specs)}" if args.specs else "") + \
        f" --steps {args.steps} " \
              f"--rounds {args.rounds} --new {args.new}"
    rm.write_section(DOC, "merge_products", [
        "## merge_products: a decoder's products that read one input, merged", "",
        f"`{command}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, {THREADS} threads.", "",
        "The gguf builds at int8 activations of benchmarks/speculative.py (gguf), and catalog specs cut to their "
        "first layers with seeded weights at int4 with int8 activations (seeded), each as specc builds it (merged: "
        "q, k and v one MatMulNBits, gate and up one, a Q4_1 file's offsets products with them) and with the pass "
        "off (unmerged), in one process, in turn, round by round. Through the in-place cache graph after a prompt "
        f"(gguf: the quotation task's; seeded: {PROMPT} random token ids): a plain step and a check of {DRAFTS} drafts (one call of {DRAFTS + 1} "
        f"positions), each the median of {args.steps} calls a round at the prompt's depth (each cut back after it), then "
        f"the median over {args.rounds} rounds after an untimed one; "
        "speed-up: unmerged over merged (in brackets its range by round). Same tokens: "
        f"{args.new} greedy tokens of Session.generate equal.", "",
        "| model | MatMulNBits in the in-place graph | plain step, unmerged | merged | speed-up | "
        f"check of {DRAFTS}, unmerged | merged | speed-up | same tokens |",
        "|---|---|---|---|---|---|---|---|---|", *rows])


if __name__ == "__main__":
    main()
