"""Which exporter and which opset `specc build` uses, by measurement.

For representative tiny specs, export each graph with the dynamo exporter at every opset from 17
to 23 and with the TorchScript exporter (dynamo=False) at 18, then for each file: which opset it
really declares (the dynamo exporter emits 18+ and converts down), does onnxruntime load it, does it pass specc's verification (all cases), how many nodes it has, and the
median latency of one forward pass at batch 2, sequence 32. Prints a Markdown table.

    .venv/bin/python benchmarks/opset_probe.py [SPEC ...]
"""
from __future__ import annotations

import contextlib
import io
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

from specc.errors import SpeccError, first_line
from specc.export import onnx as onnx_export
from specc.export.verify import verify
from specc.nn import as_resolved, to_torch
from specc.spec.io import (
    ATTENTION_MASK,
    BATCH,
    ENC_SEQ,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    PAST,
    POSITION_IDS,
    SEQ,
    TOTAL,
    concrete_dims,
)

SPECS = ["tiny-gpt2", "tiny-llama", "tiny-bert", "tiny-transformer", "tiny-shaw-relative"]
VARIANTS = [("dynamo", o) for o in range(17, 24)] + [("torchscript", 18)]


def _torchscript(model, sig, example, opset, path):
    wrapper = onnx_export.GraphModule(model, sig).eval()
    args = tuple(example[n] for n in wrapper.input_names)
    axes = {t.name: {i: d for i, d in enumerate(t.dims) if isinstance(d, str)} for t in (*sig.inputs, *sig.outputs)}
    torch.onnx.export(wrapper, args, str(path), dynamo=False, opset_version=opset, input_names=wrapper.input_names,
                      output_names=wrapper.output_names, dynamic_axes=axes)


# batch 2, sequence 32 with nothing cached (and a 32-token source)
_SIZES = {BATCH: 2, SEQ: 32, ENC_SEQ: 32, TOTAL: 32, PAST: 0}


def _latency(sess, sig, r) -> float:
    feed = {}
    rng = np.random.default_rng(0)
    for t in sig.inputs:
        dims = concrete_dims(t.dims, _SIZES)
        if t.dtype.startswith("float"):
            feed[t.name] = rng.standard_normal(dims).astype(np.float32)
        elif t.name == INPUT_IDS:
            feed[t.name] = rng.integers(0, 50, dims)
        elif t.name == POSITION_IDS:
            feed[t.name] = np.broadcast_to(np.arange(dims[1]), dims).copy()
        elif t.name in (ATTENTION_MASK, ENCODER_ATTENTION_MASK):
            feed[t.name] = np.ones(dims, dtype=np.int64)
        else:
            feed[t.name] = np.zeros(dims, dtype=np.int64)
    times = []
    for _ in range(25):
        t0 = time.perf_counter()
        sess.run(None, feed)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[5:]) * 1e3)


def probe(name: str, tmp: Path) -> list[list[str]]:
    r = as_resolved(name)
    model = to_torch(r, seed=0)
    rows = []
    for exporter, opset in VARIANTS:
        sessions, nodes, lat, written = {}, 0, 0.0, set()
        t0 = time.perf_counter()
        try:
            for sig in r.graphs:
                path = tmp / f"{name}-{exporter}-{opset}-{sig.name}.onnx"
                example = onnx_export.example_inputs(r, sig)
                with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    if exporter == "dynamo":
                        prog = onnx_export.export_graph(model, sig, example, opset)
                        onnx_export.optimize(prog)
                        onnx_export.save(prog, sig, path, 0)
                    else:
                        _torchscript(model, sig, example, opset, path)
                proto = onnx.load(str(path))
                nodes += len(proto.graph.node)
                written |= {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")}
                try:
                    sessions[sig.name] = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
                except Exception as exc:  # noqa: BLE001 - the probe records every failure
                    raise RuntimeError("ORT load: " + first_line(exc)[:90]) from None
            export_s = time.perf_counter() - t0
            report = verify(r, model, sessions)
            lat = sum(_latency(s, sig, r) for sig, s in zip(r.graphs, sessions.values()))
            rows.append([name, exporter, str(opset), ",".join(map(str, sorted(written))), "yes", f"{report.max_abs:.1e}", str(nodes), f"{export_s:.1f}", f"{lat:.2f}"])
        except (SpeccError, RuntimeError, Exception) as exc:  # noqa: BLE001
            msg = (first_line(exc) or type(exc).__name__)[:100]
            rows.append([name, exporter, str(opset), "", f"no: {msg}", "", "", "", ""])
        print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
    return rows


def main(argv: list[str]) -> None:
    specs = argv or SPECS
    header = ["spec", "exporter", "opset asked", "opset written", "loads + verifies", "max abs diff", "nodes", "export s", "ORT ms (B2, T32)"]
    with tempfile.TemporaryDirectory() as d:
        rows = [row for name in specs for row in probe(name, Path(d))]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(f"\nonnxruntime {ort.__version__}, torch {torch.__version__}")


if __name__ == "__main__":
    main(sys.argv[1:])
