"""Generation speed of a specc build on onnxruntime against the same model in PyTorch eager, in
one process, interleaved: tokens per second and time to first token.

    .venv/bin/python benchmarks/generate_speed.py [SPEC] [--prompt 32] [--new 64] [--repeats 5]

Builds SPEC (default gpt2-small) into build/bench-SPEC (a cache hit after the first time). Both
sides decode greedily with their KV cache from the same random prompt; time to first token is the
prefill plus the first choice. Prints a Markdown table with medians, ranges and the ratio.
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np
import torch

import specc
from specc.runtime import Session
from specc.spec.io import present_to_past


def torch_greedy(model, prompt: list[int], new: int) -> tuple[list[int], float]:
    """The torch model's own cached greedy loop; returns (new ids, seconds to the first token)."""
    t0 = time.perf_counter()
    ids = torch.tensor([prompt])
    out_ids, ttft = [], 0.0
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
        for step in range(new):
            token = int(out["logits"][0, -1].argmax())
            out_ids.append(token)
            if step == 0:
                ttft = time.perf_counter() - t0
            if step == new - 1:
                break
            past = present_to_past(out)
            mask = torch.ones(1, len(prompt) + step + 1, dtype=torch.int64)
            out = model(input_ids=torch.tensor([[token]]), attention_mask=mask, **past)
    return out_ids, ttft


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec", nargs="?", default="gpt2-small")
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    result = specc.build(args.spec, f"build/bench-{args.spec}", progress=None)
    session = Session(result.out_dir)
    model = specc.to_torch(args.spec, seed=0)
    vocab = result.manifest["spec"]["vocab"]["size"]
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt).tolist()

    first: list[float] = []

    def on_token(step, new):
        if step == 0:
            first.append(time.perf_counter())

    runs = {"specc + onnxruntime": [], "PyTorch eager": []}
    ttfts = {"specc + onnxruntime": [], "PyTorch eager": []}
    ids = {}
    for _ in range(args.repeats + 1):  # the first round warms up
        first.clear()
        t0 = time.perf_counter()
        gen = session.generate(prompt, max_new_tokens=args.new, on_token=on_token)
        runs["specc + onnxruntime"].append(time.perf_counter() - t0)
        ttfts["specc + onnxruntime"].append(first[0] - t0)
        ids["specc + onnxruntime"] = gen.new_ids[0]
        t0 = time.perf_counter()
        new, ttft = torch_greedy(model, prompt, args.new)
        runs["PyTorch eager"].append(time.perf_counter() - t0)
        ttfts["PyTorch eager"].append(ttft)
        ids["PyTorch eager"] = new
    same = ids["specc + onnxruntime"] == ids["PyTorch eager"]
    print(f"{args.spec}, greedy, prompt {args.prompt} + {args.new} new tokens, batch 1; "
          f"median of {args.repeats} after one warm-up; {platform.processor() or platform.machine()}, "
          f"torch {torch.__version__}, onnxruntime {session.graphs['model'].ort.__version__}, "
          f"{torch.get_num_threads()} threads; ids identical: {same}\n")
    print("| variant | tokens/s (median) | range | time to first token (median) | vs PyTorch |")
    print("|---|---|---|---|---|")
    base = statistics.median(runs["PyTorch eager"][1:])
    for name in runs:
        ts = runs[name][1:]
        med = statistics.median(ts)
        print(f"| {name} | {args.new / med:.1f} | {args.new / max(ts):.1f}-{args.new / min(ts):.1f} | "
              f"{statistics.median(ttfts[name][1:]) * 1e3:.1f} ms | {base / med:.2f}x |")


if __name__ == "__main__":
    main()
