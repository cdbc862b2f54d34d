"""What each of specc's graph passes (specc/export/passes) buys: bert-base exported by specc, then
run by onnxruntime with no pass, each pass alone and all of them, and the int8 build of no pass and
of all passes, next to the plain route (the Hugging Face model through torch.onnx.export),
interleaved in one process. Writes docs/benchmarks_passes.md.

    .venv/bin/python benchmarks/passes.py [--repeats 20] [--batches 1 8]

Needs transformers (the test extra has it) for the Hugging Face baseline; nothing is downloaded.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from specc.fileio import write_atomic  # noqa: E402
from suite import WORK, _cpu, feeds_for, hf_export, hf_model, interleaved, med, ort_session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def specc_variants(spec: str) -> dict[str, tuple[Path, dict]]:
    """The spec's model graph with no pass, each pass alone, and all passes: name -> (file, fired)."""
    import onnx
    import onnx_ir as ir

    from specc import load_spec, resolve
    from specc.export import onnx as onnx_export
    from specc.export import passes
    from specc.nn import to_torch

    r = resolve(load_spec(spec))
    sig = r.graphs[0]
    program = onnx_export.export_graph(to_torch(r, seed=0).eval(), sig, onnx_export.example_inputs(r, sig))
    program.optimize()
    base = WORK / f"passes-{spec}.onnx"
    ir.save(program.model, base)  # the exporter's shapes kept: the passes read them
    del program
    choices = {"specc, no pass": []} | {f"specc, {n} only": [n] for n in passes.PASSES}
    if len(passes.PASSES) > 1:
        choices["specc, all passes"] = list(passes.PASSES)
    out = {}
    for name, names in choices.items():
        model = ir.load(base)
        fired = passes.apply(model, names) if names else {}
        path = WORK / f"passes-{spec}-{len(out)}.onnx"
        proto = ir.serde.serialize_model(model)
        # written as a build writes it: without the exporter's intermediate shapes, which
        # onnxruntime would otherwise use to fuse Add + LayerNormalization into its
        # SkipLayerNormalization (3-4x slower on CPU here), as no build's graph lets it
        del proto.graph.value_info[:]
        onnx.save(proto, str(path))
        out[name] = (path, fired)
    # the int8 build quantizes the graph the passes made: no pass against all of them
    from specc.export.quantize import quantize_file

    for name in ("specc, no pass", list(choices)[-1]):  # the last choice: all passes (or the one)
        path, fired = out[name]
        q = path.with_name(path.stem + "-int8.onnx")
        q.write_bytes(path.read_bytes())
        quantize_file(q, "int8", sig)
        out[name.replace("specc,", "specc int8,")] = (q, fired)
    return out


def _base(name: str) -> str:
    """The variant a row is compared with: the same precision's graph with no pass."""
    return "specc int8, no pass" if name.startswith("specc int8") else "specc, no pass"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks_passes.md"))
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    import onnxruntime
    import torch
    import transformers

    import specc

    log = lambda m: print(f"[passes] {m}", file=sys.stderr, flush=True)  # noqa: E731
    log("bert-base: specc's graph with and without each pass")
    variants = specc_variants("bert-base")
    log("bert-base: the Hugging Face export")
    sessions = {"HF export + ORT": ort_session(hf_export("bert-base", hf_model("bert-base")))}
    sessions |= {name: ort_session(path) for name, (path, _) in variants.items()}
    rng = np.random.default_rng(0)
    rows = []
    for batch in args.batches:
        ids = rng.integers(1000, 20000, (batch, 128)).astype(np.int64)
        feeds = {name: feeds_for(s, ids) for name, s in sessions.items()}
        refs = {b: sessions[b].run(None, feeds[b])[0] for b in {_base(n) for n in sessions if n.startswith("specc")}}
        diffs = {name: float(np.abs(s.run(None, feeds[name])[0] - refs[_base(name)]).max())
                 for name, s in sessions.items() if name.startswith("specc")}
        log(f"batch {batch}: timing")
        times = interleaved({name: (lambda s=s, f=feeds[name]: s.run(None, f)) for name, s in sessions.items()},
                            args.repeats)
        rows.append((batch, times, diffs))

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Graph passes: what each buys",
        "",
        "Written by `benchmarks/passes.py`; do not edit by hand. bert-base (random weights of the real "
        "shapes), sequence 128, onnxruntime CPU with all graph optimizations; every variant measured "
        "interleaved in one process (one call of each per round); medians, ranges and ratios to specc's "
        "graph with no pass (its int8 build for the int8 rows: `--precision int8` quantizes the graph the "
        "passes made). specc builds run every pass listed under \"specc, all passes\" (or the one pass).",
        "",
        f"Command: `{' '.join([Path(sys.executable).parent.parent.name + '/bin/python', 'benchmarks/passes.py'] + sys.argv[1:])}`",
        "",
        f"Run: {date}; {_cpu()}, {os.cpu_count()} cores; python {platform.python_version()}, specc "
        f"{specc.__version__}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
        f"transformers {transformers.__version__}.",
        "",
        "Fired: " + "; ".join(f"{name}: " + (", ".join(f"{k} x{v}" for k, v in fired.items()) or "-")
                              for name, (_, fired) in variants.items()) + ".",
    ]
    for batch, times, diffs in rows:
        lines += ["", f"Batch {batch}, sequence 128: medians of {args.repeats}.", "",
                  "| variant | median | range | vs no pass (same precision) | max abs diff vs no pass |", "|---|---|---|---|---|"]
        for name, ts in times.items():
            diff = f"{diffs[name]:.1e}" if name in diffs else "-"
            lines.append(f"| {name} | {med(ts) * 1e3:.1f} ms | {min(ts) * 1e3:.1f}-{max(ts) * 1e3:.1f} | "
                         f"{med(ts) / med(times[_base(name)]):.3f}x | {diff} |")
    out = write_atomic(args.out, "\n".join(lines) + "\n")
    log(f"wrote {out}")


if __name__ == "__main__":
    main()
