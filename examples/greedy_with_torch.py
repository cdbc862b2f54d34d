"""Compile a spec to PyTorch and decode greedily with the KV cache.

    python examples/greedy_with_torch.py [SPEC] [--tokens N]

SPEC is a YAML file or a catalog name (default: examples/custom-architecture.yaml).
Weights are seeded random: the ids are meaningless, the mechanics are not.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

import specc


def greedy(model, prompt: list[int], new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    past: dict[str, torch.Tensor] = {}
    out_ids = list(prompt)
    with torch.no_grad():
        for _ in range(new_tokens):
            out = model(input_ids=ids, use_cache=True, **past)
            # the cache comes back as present.N.key/.value and goes in as past_key_values.N.key/.value
            past = {k.replace("present", "past_key_values", 1): v for k, v in out.items() if k.startswith("present.")}
            next_id = int(out["logits"][0, -1].argmax())
            out_ids.append(next_id)
            ids = torch.tensor([[next_id]])
    return out_ids


def main() -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("spec", nargs="?", default=str(here / "custom-architecture.yaml"))
    parser.add_argument("--tokens", type=int, default=8)
    args = parser.parse_args()
    model = specc.to_torch(args.spec, seed=0)
    n = sum(p.numel() for p in model.parameters())
    print(f"{model.resolved.name}: {n:,} parameters")
    print("ids:", greedy(model, [1, 2, 3], args.tokens))


if __name__ == "__main__":
    main()
