"""A BERT-style sentence classifier from Python: PyTorch first, then the verified ONNX build.

The spec extends tiny-bert (the structure of bert-base, shrunk) and replaces its outputs with a
three-class classifier on the first token through BERT's tanh pooler. The script

1. makes the PyTorch module with specc.to_torch and classifies a padded batch of two sequences,
2. builds the same spec (same seed, so the same weights) with specc.build into a directory,
   which exports ONNX and verifies it against PyTorch,
3. runs that directory with specc.runtime.Session (onnxruntime) and checks that both give the
   same class probabilities.

    python examples/bert_classification.py [--out DIR]

Weights are seeded random (no checkpoint): the probabilities show the plumbing, not a trained
model. Pass trained weights with to_torch(..., weights="model.safetensors").
"""
from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np
import torch

import specc
from specc.runtime import Session

SPEC = """
specc: 1
name: tiny-bert-classifier
description: tiny-bert with a 3-class classifier head on the pooled first token
extends: tiny-bert
outputs:
  - {name: logits, kind: classifier, classes: 3, pool: first, pooler: tanh}
"""

LABELS = ["negative", "neutral", "positive"]


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="build directory (default: a temporary one)")
    args = parser.parse_args(argv)

    spec = specc.loads_spec(SPEC, file="tiny-bert-classifier.yaml")
    # two sequences, the second right-padded (mask 0) to the length of the first
    input_ids = np.array([[2, 17, 93, 410, 8, 3], [2, 55, 21, 3, 0, 0]], dtype=np.int64)
    attention_mask = np.array([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]], dtype=np.int64)
    token_type_ids = np.zeros_like(input_ids)

    model = specc.to_torch(spec, seed=0)
    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention_mask),
                    token_type_ids=torch.from_numpy(token_type_ids))
    torch_probs = softmax(out["logits"].numpy().astype(np.float64))

    with tempfile.TemporaryDirectory() as tmp:
        result = specc.build(spec, args.out or f"{tmp}/build", seed=0)
        session = Session(result.out_dir)
        ort_out = session.run(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        ort_probs = softmax(np.asarray(ort_out["logits"], dtype=np.float64))
        del session

    print(f"{spec.name}: verified build, max |onnxruntime - torch| {result.manifest['verification']['max_abs_diff']:.2e}")
    print("sequence  " + "  ".join(f"{l:>9}" for l in LABELS) + "  (PyTorch; onnxruntime)")
    for i in range(len(input_ids)):
        print(f"{i:<8}  " + "  ".join(f"{p:9.4f}" for p in torch_probs[i])
              + "  ; " + " ".join(f"{p:.4f}" for p in ort_probs[i]))
    diff = float(np.abs(torch_probs - ort_probs).max())
    print(f"max |probability difference| {diff:.2e}")
    if torch_probs.shape != (2, len(LABELS)) or diff > 1e-4:
        print("PyTorch and onnxruntime disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
