"""What the in-place graph's spare rows cost and buy (specc/export/inplace.py, `spare`): the gguf
builds at int8 activations of benchmarks/speculative.py (SmolLM2-135M-Instruct's Q4_1 file, Gemma 3
270M's Q4_K_M file), built as specc builds them (each 4-bit MatMulNBits given a lone row twice)
and again without those rows (inplace._single_row_spares off), both run in one process in turn:
a plain decode step and a check of 8 drafts through the in-place cache graph after the quotation
task's prompt, and, for each build, whether speculative decoding (prompt lookup) gives plain
greedy decoding's tokens on the four grounded tasks. Writes its section of
docs/benchmarks_speculative.md.

    .venv/bin/python benchmarks/spare_rows.py [--text FILE] [--models smollm2 gemma3] [--steps 32] [--rounds 7]
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402
import speculative as sp  # noqa: E402
from merge_products import DRAFTS, THREADS, arguments, in_turn, products  # noqa: E402

import specc  # noqa: E402
from specc.export import inplace  # noqa: E402
from specc.runtime import Session  # noqa: E402

DOC = sp.DOC


def without_rows(spec: Path, out: Path) -> Path:
    """`spec` built at gguf with int8 activations, its 4-bit products given no spare row (kept when
    up to date: the cache key does not see the switch, so a build is made once per folder)."""
    saved = inplace._single_row_spares
    inplace._single_row_spares = lambda g, nodes: []
    try:
        specc.build(spec, out, precision="gguf", activations="int8", progress=None)
    finally:
        inplace._single_row_spares = saved
    return out


def main() -> None:
    args = arguments(__doc__, new=128).parse_args()
    source = args.text.read_text() if args.text else rm.reference_text()
    tasks = {k: v for k, v in sp.tasks(sp.paragraph(source)).items() if k != "free"}
    rows = []
    for model in args.models:
        spared, _ = sp.build(model, "gguf", "int8")
        spec = sp.WORK / f"{sp.spec_name(model, 'gguf')}.yaml"
        bare = without_rows(spec, spared.parent / f"{spared.name}-no-spare-rows")
        sessions = {"without": Session(bare, threads=THREADS), "with": Session(spared, threads=THREADS)}
        chat = sessions["with"].tokenizer.chat_template is not None
        prompts = {task: sessions["with"].prompts([text], chat=chat)[0] for task, text in tasks.items()}
        same = {name: sum(s.generate(p, args.new, eos_id=-1, speculative="ngram").new_ids ==
                          s.generate(p, args.new, eos_id=-1).new_ids for p in prompts.values())
                for name, s in sessions.items()}
        step, check, by_round = in_turn(sessions, prompts["quote"], args.steps, args.rounds)
        ratios = [r["with"] / r["without"] for r in by_round]
        rows.append(f"| {model} (gguf) | {products(spared, '/single/in')} | {step['without'] * 1e3:.2f} ms | "
                    f"{step['with'] * 1e3:.2f} ms | {step['with'] / step['without']:.3f}x "
                    f"({min(ratios):.2f}-{max(ratios):.2f}) | {check['without'] * 1e3:.2f} ms | "
                    f"{check['with'] * 1e3:.2f} ms | {same['without']} of {len(prompts)} | "
                    f"{same['with']} of {len(prompts)} |")
        print(rows[-1], flush=True)
        del sessions
    command = ".venv/bin/python benchmarks/spare_rows.py" + (f" --text {args.text.name}" if args.text else "") + \
        f" --models {' '.join(args.models)} --steps {args.steps} --rounds {args.rounds} --new {args.new}"
    rm.write_section(DOC, "spare_rows", [
        "## Spare rows for 4-bit products at int8 activations", "",
        f"`{command}`, {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
        f"{os.cpu_count()} cores, {THREADS} threads, onnxruntime's CPU flags: {cpu_flags()}.", "",
        "The gguf builds at int8 activations of benchmarks/speculative.py, each as specc builds it (with: every "
        "4-bit MatMulNBits of the in-place graph given a call's lone row twice, docs/build.md) and without those "
        "rows, in one process, in turn, round by round. Through the in-place cache graph after the quotation task's "
        f"prompt: a plain step and a check of {DRAFTS} drafts (one call of {DRAFTS + 1} positions), each the median "
        f"of {args.steps} calls a round at the prompt's depth, then the median over {args.rounds} rounds after an "
        "untimed one; cost: with over without (in brackets its range by round). Exact: grounded tasks (repeat, "
        f"rewrite, extract, quote) whose {args.new} greedy tokens with prompt lookup equal plain decoding's.", "",
        "| model | 4-bit products given a spare row | plain step, without | with | cost | "
        f"check of {DRAFTS}, without | with | exact, without | exact, with |",
        "|---|---|---|---|---|---|---|---|---|", *rows])


def cpu_flags() -> str:
    """Which of AVX2, AVX-512 and VNNI this CPU has (/proc/cpuinfo), the instruction sets that pick
    onnxruntime's kernels."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return ", ".join(f for f in ("avx2", "avx512f", "avx512_vnni", "avx_vnni") if f in flags) or "none of AVX2/AVX-512"


if __name__ == "__main__":
    main()
