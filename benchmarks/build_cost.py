"""Build cost: wall time and peak memory (RSS) of `specc build` for bert-base and gpt2-small, each
in its own process, against the fp32 weight bytes, and next to Optimum's export-plus-validation
of the same model where Optimum is installed (`make bench`'s environment). Writes
docs/benchmarks_build.md.

    .venv/bin/python benchmarks/build_cost.py          # specc only
    .venv-bench/bin/python benchmarks/build_cost.py    # specc and Optimum, interleaved per model
"""
from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from specc.fileio import write_atomic  # noqa: E402
from suite import WORK, _cpu, hf_checkpoint, optimum_export, specc_build  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", nargs="+", default=["bert-base", "gpt2-small"])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_build.md"))
    ap.add_argument("--repeats", type=int, default=2, help="rounds per model (specc, then Optimum); best time, highest peak")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    import torch

    import specc
    from specc import load_spec, resolve

    have_optimum = importlib.util.find_spec("optimum") is not None
    rows = []
    for spec in args.models:
        weights = sum(p.numel() for p in specc.to_torch(resolve(load_spec(spec)), seed=0).parameters()) * 4
        s_runs, o_runs = [], []
        for i in range(args.repeats):
            print(f"[build_cost] {spec}: specc build ({i + 1}/{args.repeats})", file=sys.stderr, flush=True)
            out, s_s, s_rss = specc_build(spec, force=True)
            stages = json.loads((out / "manifest.json").read_text())["timings_s"]
            s_runs.append((s_s, s_rss, stages))
            if have_optimum:
                print(f"[build_cost] {spec}: Optimum export ({i + 1}/{args.repeats})", file=sys.stderr, flush=True)
                hf_checkpoint(spec)
                _, o_s, o_rss = optimum_export(spec)
                o_runs.append((o_s, o_rss))
        best = min(s_runs, key=lambda run: run[0])
        o = (min(t for t, _ in o_runs), max(m for _, m in o_runs)) if o_runs else None
        rows.append((spec, weights, best[0], max(m for _, m, _ in s_runs), best[2], o))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Build cost",
        "",
        "Written by `benchmarks/build_cost.py`; do not edit by hand. Wall time and peak memory of one command "
        "each: `specc build SPEC --force` (load, export, optimize and passes, save, verify, write; random weights of "
        "the real shapes) and, where Optimum is installed, `optimum.exporters.onnx.main_export` with its "
        "validation (O2 for bert-base). Peak memory counts everything the process holds, the Python "
        "interpreter and the torch and onnxruntime libraries included (about 0.2 GiB before any model), and the "
        "private memory of any process it forks (specc's reference run beside the export), sampled every 50 ms. "
        f"{args.repeats} rounds per model, specc then Optimum in turn: the best time and the highest peak. "
        "specc's stages are those of its best run, from the manifest's timings_s (export: torch.export, "
        "its decompositions and the ONNX translation, of two layers per stack with the rest copied in (specc.stitch); verify: onnxruntime's session and every case, the "
        "longest at the spec's serving.length.max; the torch reference outputs are taken in a forked process beside the export, "
        "the verify stage waits for them if they are not done).",
        "",
        f"Command: `{' '.join([Path(sys.executable).parent.parent.name + '/bin/python', 'benchmarks/build_cost.py'] + sys.argv[1:])}`",
        "",
        f"Run: {date}; {_cpu()}, {os.cpu_count()} cores; python {platform.python_version()}, specc "
        f"{specc.__version__}, torch {torch.__version__}.",
        "",
        "| model | fp32 weights | specc build | of which export / verify | specc peak / weights "
        "| Optimum export + validation | specc time / Optimum |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec, weights, s_s, s_rss, stages, o in rows:
        opt = f"{o[0]:.0f} s, {o[1] / GIB:.2f} GiB" if o else "not run (Optimum not installed here)"
        ratio = f"{s_s / o[0]:.2f}x" if o else "-"
        split = f"{stages.get('export', 0):.0f} s / {stages.get('verify', 0):.0f} s"
        lines.append(f"| {spec} | {weights / GIB:.2f} GiB | {s_s:.0f} s, {s_rss / GIB:.2f} GiB | {split} | "
                     f"{s_rss / weights:.2f}x | {opt} | {ratio} |")
    out = write_atomic(args.out, "\n".join(lines) + "\n")
    print(f"[build_cost] wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
