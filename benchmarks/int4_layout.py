"""What onnxruntime holds and reads for one int4 weight: MatMulNBits' prepacked layout against the
block size, beside llama.cpp's Q4_0 (4.5 bits a weight: an fp16 scale per 32 codes).

    .venv/bin/python benchmarks/int4_layout.py [--repeats 40]

One [K, N] = [4096, 11008] weight (llama-2-7b's feed-forward up-projection), random codes,
accuracy level 4 (int8 compute, what specc's int4 builds use), 2 threads. For each block size, with
and without zero points:
- resident: the growth of a fresh process's resident memory over creating the session and one
  call, in bits per weight, with onnxruntime's prepacking on (as specc runs) and off (what the
  graph's own tensors hold);
- decode call: the time of one [1, K] x [K, N] product (a decode step's shape), the minimum over
  interleaved repeats, as a ratio to block 32 with zero points, and the read rate it implies if
  the call read the prepacked bits once.
Writes docs/benchmarks_int4_layout.md.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks_int4_layout.md"
K, N = 4096, 11008
THREADS = 2
CONFIGS = [(32, True), (32, False), (64, True), (128, True), (128, False)]


def write_model(path: Path, block: int, zero_points: bool) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    blocks = K // block
    inits = [numpy_helper.from_array(rng.integers(0, 256, size=(N, blocks, block // 2), dtype=np.uint8), "codes"),
             numpy_helper.from_array(rng.random(N * blocks, dtype=np.float32) * 0.01, "scales")]
    if zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, size=(N * -(-blocks // 2),), dtype=np.uint8), "zeros"))
    node = helper.make_node("MatMulNBits", ["x"] + [t.name for t in inits], ["y"], domain="com.microsoft",
                            K=K, N=N, bits=4, block_size=block, accuracy_level=4)
    graph = helper.make_graph([node], "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, K])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, N])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path), save_as_external_data=True, location=path.name + ".data", size_threshold=0)


def session(path: Path, prepack: bool = True):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = THREADS
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.disable_prepacking", "0" if prepack else "1")
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def resident_bits(path: Path, prepack: bool) -> float:
    """Run in a fresh process (this file with --one): the session's resident growth per weight."""
    out = subprocess.run([sys.executable, __file__, "--one", str(path), str(int(prepack))],
                         capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def _one(path: Path, prepack: bool) -> None:
    def rss() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    s = session(path, prepack)
    s.run(None, {"x": np.ones((1, K), np.float32)})
    print((rss() - before) * 8 / (K * N))


def call_times(paths: dict, repeats: int) -> dict:
    sessions = {c: session(p) for c, p in paths.items()}
    x = np.random.default_rng(1).standard_normal((1, K)).astype(np.float32)
    best = {c: float("inf") for c in paths}
    for _ in range(repeats):
        for c, s in sessions.items():
            t0 = time.perf_counter()
            s.run(None, {"x": x})
            best[c] = min(best[c], time.perf_counter() - t0)
    return best


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--one":
        _one(Path(sys.argv[2]), sys.argv[3] == "1")
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=40)
    args = ap.parse_args()
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        paths = {}
        for block, zp in CONFIGS:
            paths[(block, zp)] = Path(tmp) / f"b{block}{'z' if zp else ''}.onnx"
            write_model(paths[(block, zp)], block, zp)
        rows = {c: {"packed": resident_bits(p, True), "unpacked": resident_bits(p, False)} for c, p in paths.items()}
        times = call_times(paths, args.repeats)
    base = times[(32, True)]
    load = os.getloadavg()[0]
    lines = [
        "# int4 weights in onnxruntime: what the kernel holds and reads",
        "",
        "Written by `benchmarks/int4_layout.py`; do not edit by hand. One [4096, 11008] MatMulNBits weight "
        "(llama-2-7b's feed-forward up-projection), random codes, accuracy level 4 (int8 compute), "
        f"{THREADS} threads. Resident: a fresh process's growth over creating the session and one call, in bits "
        "per weight, with onnxruntime's prepacking (as specc runs) and without it (the graph's tensors). Decode "
        "call: one [1, 4096] x [4096, 11008] product, the minimum of interleaved repeats. llama.cpp's Q4_0 "
        "stores 4.5 bits a weight (an fp16 scale per 32 codes) and its decode reads those.",
        "",
        f"Run {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on {platform.machine()}, "
        f"onnxruntime {ort.__version__}, {args.repeats} repeats, load average {load:.1f} when it ended; "
        "command: `.venv/bin/python benchmarks/int4_layout.py`.",
        "",
        "| block | zero points | resident, prepacked | resident, not prepacked | decode call | vs block 32 with zero points |",
        "|---|---|---|---|---|---|",
    ]
    for (block, zp), r in rows.items():
        t = times[(block, zp)]
        lines.append(f"| {block} | {'yes' if zp else 'no'} | {r['packed']:.2f} bits | {r['unpacked']:.2f} bits | "
                     f"{t * 1e3:.3f} ms | {t / base:.2f}x |")
    DOC.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps({f"{b}{'z' if z else ''}": t for (b, z), t in times.items()}))


if __name__ == "__main__":
    main()
