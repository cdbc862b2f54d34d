"""What an int4 build spends on one qwen3-30b-a3b layer's routed experts, in CPU seconds of the
build's own functions (specc/export/quantize.py), seeded weights:

    .venv/bin/python benchmarks/expert_packing.py [--experts 128]

- drawn: the layer's stacked weights drawn as a streamed build draws them (specc/nn/blocks.py);
- packed: QMoE's codes and scales, expert by expert (pack() of each expert's [K, N] weight, what
  the save did before pack_experts) and for the whole stack at once (pack_experts, what it does);
- dequantized: the weights the torch reference of the build multiplies by, expert by expert
  (each expert packed and unpacked, what dequantized_experts did before) and at once (now).
Both ways are checked to give the same bytes. Prints a markdown table; the figures are in
docs/benchmarks_streamed.md.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from specc.export import quantize as q
from specc.nn.blocks import _randn_into

D_MODEL, D_FF = 2048, 768  # qwen3-30b-a3b's widths


def cpu(fn) -> tuple[float, object]:
    t = time.process_time()
    out = fn()
    return time.process_time() - t, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--experts", type=int, default=128)
    args = ap.parse_args()
    scheme = q.SCHEMES["int4"]
    fc1 = torch.empty(args.experts, 2 * D_FF, D_MODEL)  # gate and up, as the MoE node holds them
    fc2 = torch.empty(args.experts, D_MODEL, D_FF)
    gen = torch.Generator().manual_seed(0)
    drawn, _ = cpu(lambda: [_randn_into(w, gen).mul_(0.02) for w in (fc1, fc2)])

    def per_expert(w: np.ndarray) -> np.ndarray:
        return np.stack([q.pack(np.ascontiguousarray(w[e].T), scheme).codes.reshape(w.shape[1], -1)
                         for e in range(w.shape[0])])

    pack_old, old = cpu(lambda: [per_expert(w.numpy()) for w in (fc1, fc2)])
    pack_new, new = cpu(lambda: [q.pack_experts(w.numpy(), scheme)["codes"] for w in (fc1, fc2)])
    assert all(np.array_equal(a, b) for a, b in zip(old, new))
    del old, new
    parts = (fc1[:, :D_FF], fc1[:, D_FF:], fc2)  # the module's gate, up and down

    def deq_per_expert(w: torch.Tensor) -> torch.Tensor:
        return torch.stack([q._unpacked_rows(q.pack(w[e].T.contiguous().numpy(), scheme), scheme, w.shape[2])
                            for e in range(w.shape[0])])

    deq_old, old = cpu(lambda: [deq_per_expert(w) for w in parts])
    deq_new, new = cpu(lambda: [q.dequantized_experts(w, "int4") for w in parts])
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    print(f"one layer: {args.experts} experts of [{2 * D_FF}, {D_MODEL}] and [{D_MODEL}, {D_FF}], int4, "
          f"{torch.get_num_threads()} torch threads, CPU seconds\n")
    print("| | expert by expert | the stack at once |\n|---|---|---|")
    print(f"| drawn | {drawn:.1f} s | |")
    print(f"| packed for QMoE | {pack_old:.1f} s | {pack_new:.1f} s |")
    print(f"| dequantized for the torch reference | {deq_old:.1f} s | {deq_new:.1f} s |")


if __name__ == "__main__":
    main()
