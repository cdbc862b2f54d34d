"""Build memory against model size: peak memory (the build's whole process tree) and wall time of
`specc build`, held whole or streamed (one layer of the deep stacks at a time, docs/build.md), for
decoders from gpt2-small to llama-3-8b. Each build runs in its own process
(suite.run_measured); its build folder is deleted after it is measured (a 7B build writes
27 GB of fp32 weights file). Writes docs/benchmarks_streamed.md.

    .venv/bin/python benchmarks/streamed_build.py                        # the default rows (hours)
    .venv/bin/python benchmarks/streamed_build.py --rows gpt2-small:fp32:whole llama-2-7b:int4:stream
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from specc.fileio import write_atomic  # noqa: E402
from suite import WORK, _cpu, run_measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
ROWS = ["gpt2-small:fp32:whole", "gpt2-small:fp32:stream", "gpt2-medium:fp32:stream", "llama-style-1b:int4:whole",
        "llama-style-1b:int4:stream", "llama-2-7b:int4:stream", "llama-2-7b:fp16:stream", "llama-3-8b:int4:stream"]


def measure(spec: str, precision: str, how: str) -> dict:
    """One build in its own process: wall seconds, peak bytes, the manifest's stage times."""
    out = WORK / f"streamed-{spec}-{precision}-{how}"
    cmd = [str(Path(sys.executable).parent / "specc"), "build", spec, "-o", str(out), "--quiet", "--force",
           "--precision", precision, "--stream" if how == "stream" else "--no-stream"]
    print(f"[streamed_build] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    try:
        seconds, peak = run_measured(cmd)
        manifest = json.loads((out / "manifest.json").read_text())
        return {"seconds": seconds, "peak": peak, "timings": manifest["timings_s"],
                "parameters": manifest["parameters"], "error": None}
    except SystemExit as failed:  # run_measured's word on a build that failed: its last lines
        return {"error": str(failed).strip().splitlines()[-1]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=ROWS, help="SPEC:PRECISION:whole|stream")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_streamed.md"))
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in args.rows:
        spec, precision, how = row.split(":")
        rows.append((spec, precision, how, measure(spec, precision, how)))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Build memory against model size",
        "",
        "Written by `benchmarks/streamed_build.py`; do not edit by hand. Peak memory of the build's whole "
        "process tree (its own RSS, plus the private memory of the reference run it forks) and wall time, "
        "one build per process, seeded weights. `whole`: the build holds the model (`--no-stream`); "
        "`stream`: one layer of each deep stack at a time (`--stream`; docs/build.md).",
        "",
        f"Run {date} on {platform.machine()}, {_cpu()}; command: `.venv/bin/python benchmarks/streamed_build.py "
        f"--rows {' '.join(args.rows)}`.",
        "",
        "| model | parameters | precision | how | wall | peak | peak / fp32 weights | quantize / save / verify |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for spec, precision, how, m in rows:
        if m["error"]:
            lines.append(f"| {spec} | | {precision} | {how} | failed: {m['error']} | | | |")
            continue
        t = m["timings"]
        stages = " / ".join(f"{t[k]:.0f} s" if k in t else "-" for k in ("quantize", "save", "verify"))
        lines.append(f"| {spec} | {m['parameters'] / 1e9:.2f}B | {precision} | {how} | {m['seconds'] / 60:.1f} min | "
                     f"{m['peak'] / GIB:.2f} GiB | {m['peak'] / (4 * m['parameters']):.2f}x | {stages} |")
    out = write_atomic(args.out, "\n".join(lines) + "\n")
    print(f"[streamed_build] wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
