"""What onnxruntime's MatMulNBits costs by rows at an output projection's shape (Gemma 3 270M's
head by default: K 640, N 262144, blocks of 32, accuracy level 4, int8 compute): 8-bit codes,
8-bit codes' width as two 4-bit planes added (the high nibbles about 8, the low ones about a zero
point of 0, as ggufgraph writes codes wider than a level's kernel), and 4-bit codes. Seeded codes
and scales, each plane its own (a kernel's time does not hang on the values); medians of
--repeats calls after one, 2 threads. Prints a Markdown table in ms.

    .venv/bin/python benchmarks/head_rows.py [--k 640] [--n 262144] [--rows 1 2 5 9] [--repeats 15]

A speculative check of k drafts runs k + 1 rows through the head; where each further row costs
about what one does, the check's cost grows with k whatever it keeps (docs/benchmarks_speculative.md).
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

BLOCK, LEVEL, THREADS = 32, 4, 2


def product(name: str, x: str, k: int, n: int, bits: int, rng, zero_points: bool = False):
    """A MatMulNBits node of seeded codes and scales, and its initializers."""
    codes = rng.integers(0, 256, size=(n, k // BLOCK, BLOCK * bits // 8), dtype=np.uint8)
    scales = rng.random(n * (k // BLOCK), dtype=np.float32) * 0.01 + 0.001
    inits = [numpy_helper.from_array(codes, f"{name}.codes"), numpy_helper.from_array(scales, f"{name}.scales")]
    if zero_points:  # 0 for every block, two a byte
        inits.append(numpy_helper.from_array(np.zeros(n * ((k // BLOCK + 1) // 2), np.uint8), f"{name}.zero_points"))
    node = helper.make_node("MatMulNBits", [x, *(i.name for i in inits)], [f"{name}.y"], domain="com.microsoft",
                            K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=LEVEL)
    return node, inits


def model(form: str, k: int, n: int, rng) -> bytes:
    if form == "planes":
        high, hi = product("high", "x", k, n, 4, rng)
        low, lo = product("low", "x", k, n, 4, rng, zero_points=True)
        nodes, inits = [high, low, helper.make_node("Add", ["high.y", "low.y"], ["y"])], hi + lo
    else:
        node, inits = product("w", "x", k, n, 8 if form == "8-bit" else 4, rng)
        node.output[0] = "y"
        nodes = [node]
    graph = helper.make_graph(nodes, form, [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)]).SerializeToString()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--k", type=int, default=640)
    ap.add_argument("--n", type=int, default=262144)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 5, 9])
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = THREADS
    print(f"MatMulNBits, K {args.k}, N {args.n}, blocks of {BLOCK}, accuracy level {LEVEL}, {THREADS} threads, "
          f"onnxruntime {ort.__version__}: ms a call by rows\n")
    print("| codes | " + " | ".join(f"{m} rows" for m in args.rows) + " |")
    print("|---|" + "---|" * len(args.rows))
    for form in ("8-bit", "planes", "4-bit"):
        session = ort.InferenceSession(model(form, args.k, args.n, rng), options, providers=["CPUExecutionProvider"])
        cells = []
        for m in args.rows:
            x = rng.standard_normal((m, args.k), dtype=np.float32)
            session.run(None, {"x": x})
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                session.run(None, {"x": x})
                times.append(time.perf_counter() - start)
            cells.append(f"{statistics.median(times) * 1e3:.1f}")
        print(f"| {form} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
