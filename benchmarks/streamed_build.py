"""Build memory against model size: peak memory (the build's whole process tree) and wall time of
`specc build`, held whole or streamed (one layer of the deep stacks at a time, docs/build.md), for
decoders from gpt2-small to llama-3-8b. Each build runs in its own process
(suite.run_measured); its build folder is deleted after it is measured (a 7B build writes
27 GB of fp32 weights file). Writes docs/benchmarks_streamed.md.

    .venv-bench/bin/python benchmarks/streamed_build.py                  # the default rows (hours)
    .venv-bench/bin/python benchmarks/streamed_build.py --rows gpt2-small:fp32:whole llama-2-7b:int4:stream

`optimum` rows (SPEC:fp32:optimum) export a Hugging Face checkpoint of the same shape with
Optimum's main_export (the bench environment has it); they are where it fits in memory.
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
from specc.nn import as_resolved  # noqa: E402
from specc.spec.costs import inspect_spec  # noqa: E402
from suite import WORK, _cpu, run_measured  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
GIB = 1024**3
ROWS = ["gpt2-small:fp32:whole", "gpt2-small:fp32:stream", "gpt2-small:fp32:optimum", "gpt2-medium:fp32:stream",
        "gpt2-medium:fp32:optimum", "llama-style-1b:int4:whole", "llama-style-1b:int4:stream",
        "llama-style-1b:fp32:optimum", "open-llama-3b:int4:stream", "llama-2-7b:int4:stream", "llama-2-7b:fp16:stream",
        "llama-3-8b:int4:stream"]


def measure(spec: str, precision: str, how: str, keep: bool = False, activations: str | None = None) -> dict:
    """One build in its own process: wall seconds, peak bytes, the manifest's stage times. With
    `keep`, its build folder stays (build/bench/streamed-SPEC-PRECISION-HOW[-ACTIVATIONS]) for a
    run after; `activations`: specc build --activations."""
    out = WORK / f"streamed-{spec}-{precision}-{how}{'-' + activations if activations else ''}"
    cmd = [str(Path(sys.executable).parent / "specc"), "build", spec, "-o", str(out), "--quiet", "--force",
           "--precision", precision, "--stream" if how == "stream" else "--no-stream",
           *(["--activations", activations] if activations else [])]
    print(f"[streamed_build] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    try:
        seconds, peak = run_measured(cmd)
        manifest = json.loads((out / "manifest.json").read_text())
        return {"seconds": seconds, "peak": peak, "timings": manifest["timings_s"],
                "parameters": manifest["parameters"], "error": None}
    except SystemExit as failed:  # run_measured's word on a build that failed: its last lines
        return {"error": str(failed).strip().splitlines()[-1]}
    finally:
        if not keep:
            shutil.rmtree(out, ignore_errors=True)


def hf_checkpoint(spec: str) -> Path:
    """A Hugging Face checkpoint of the spec's shape (random weights, saved once), for Optimum's
    export: GPT-2 and LLaMA shapes."""
    import torch
    import transformers as T

    path = WORK / f"hf-{spec}"
    if (path / "config.json").exists():
        return path
    r = as_resolved(spec)
    stack = r.decoder
    layer = stack.layers[0]
    if r.position.kind == "learned":
        config = T.GPT2Config(n_embd=r.d_model, n_layer=len(stack.layers), n_head=layer.attention.heads,
                              n_positions=r.position.max_length, vocab_size=stack.vocab_size)
        cls = T.GPT2LMHeadModel
    else:
        config = T.LlamaConfig(hidden_size=r.d_model, intermediate_size=layer.ffn.d_ff,
                               num_hidden_layers=len(stack.layers), num_attention_heads=layer.attention.heads,
                               num_key_value_heads=layer.attention.kv_heads, vocab_size=stack.vocab_size,
                               max_position_embeddings=r.position.max_length, rope_theta=r.position.base)
        cls = T.LlamaForCausalLM
    torch.manual_seed(0)
    cls(config).save_pretrained(path)
    return path


def measure_optimum(spec: str) -> dict:
    """Optimum's ONNX export (fp32, with its KV cache graph and its own validation) of the same
    shape, in its own process."""
    out = WORK / f"streamed-optimum-{spec}"
    code = ("from optimum.exporters.onnx import main_export; "
            f"main_export({str(hf_checkpoint(spec))!r}, {str(out)!r}, task='text-generation-with-past', "
            "local_files_only=True)")
    print(f"[streamed_build] optimum {spec}", file=sys.stderr, flush=True)
    try:
        seconds, peak = run_measured([sys.executable, "-c", code])
        return {"seconds": seconds, "peak": peak, "timings": {}, "error": None,
                "parameters": inspect_spec(as_resolved(spec))["parameters"]}
    except SystemExit as failed:
        return {"error": str(failed).strip().splitlines()[-1]}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=ROWS, help="SPEC:PRECISION:whole|stream")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_streamed.md"))
    ap.add_argument("--keep", action="store_true", help="keep each build folder (build/bench/streamed-*) for "
                                                        "specc generate or a peer run after")
    ap.add_argument("--activations", choices=["fp32", "int8"], help="specc build --activations, for every row")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    rows = []
    for row in args.rows:
        spec, precision, how = row.split(":")
        rows.append((spec, precision, how, measure_optimum(spec) if how == "optimum" else measure(spec, precision, how, args.keep, args.activations)))
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Build memory against model size",
        "",
        "Written by `benchmarks/streamed_build.py`; do not edit by hand. Peak memory of the build's whole "
        "process tree (its own RSS, plus the private memory of the reference run it forks) and wall time, "
        "one build per process, seeded weights. `whole`: the build holds the model (`--no-stream`); "
        "`stream`: one layer of each deep stack at a time (`--stream`; docs/build.md); `optimum`: Optimum's "
        "`main_export` (fp32, with its KV-cache graph and its own validation) of a Hugging Face checkpoint of "
        "the same shape, random weights.",
        "",
        f"Run {date} on {platform.machine()}, {_cpu()}; command: `.venv-bench/bin/python benchmarks/streamed_build.py "
        f"--rows {' '.join(args.rows)}{' --activations ' + args.activations if args.activations else ''}`.",
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
