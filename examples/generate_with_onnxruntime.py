"""Greedy generation from a specc build with nothing but onnxruntime and numpy.

    specc build tiny-gpt2 -o build/tiny-gpt2
    python examples/generate_with_onnxruntime.py build/tiny-gpt2 5,6,7 --max-new-tokens 8

The build directory stands alone: model.onnx takes input_ids, attention_mask, position_ids (for
absolute positions) and past_key_values.N.key / .value, and returns logits and present.N.key /
.value. The first call passes an empty cache (past length 0); each later call passes one token
and the previous call's present.* as past_key_values.*. Nothing here imports specc.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort

NUMPY = {"float32": np.float32, "float16": np.float16}


def greedy(build_dir: str, prompt: list[int], max_new_tokens: int) -> list[int]:
    manifest = json.loads((Path(build_dir) / "manifest.json").read_text())
    graph = manifest["graphs"]["model"]  # a decoder build has one graph
    session = ort.InferenceSession(str(Path(build_dir) / graph["file"]), providers=["CPUExecutionProvider"])
    inputs = {t["name"]: t for t in graph["inputs"]}

    ids = np.array([prompt], dtype=np.int64)
    mask = np.ones_like(ids)
    # an empty cache: [batch, kv_heads, 0, head_dim] for each past_key_values.* input
    past = {name: np.zeros([1 if d == "batch" else 0 if d == "past_sequence" else d for d in t["dims"]],
                           dtype=NUMPY[t["dtype"]])
            for name, t in inputs.items() if name.startswith("past_key_values.")}
    out_names = [o.name for o in session.get_outputs()]
    new = []
    for _ in range(max_new_tokens):
        feed = {"input_ids": ids, "attention_mask": mask, **past}
        if "position_ids" in inputs:
            feed["position_ids"] = np.arange(mask.shape[1] - ids.shape[1], mask.shape[1], dtype=np.int64)[None]
        outputs = dict(zip(out_names, session.run(out_names, feed)))
        token = int(outputs["logits"][0, -1].argmax())
        new.append(token)
        ids = np.array([[token]], dtype=np.int64)
        mask = np.concatenate([mask, np.ones((1, 1), dtype=np.int64)], axis=1)
        past = {"past_key_values." + k[len("present."):]: v for k, v in outputs.items() if k.startswith("present.")}
    return new


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("build_dir")
    parser.add_argument("ids", help="prompt token ids, comma-separated")
    parser.add_argument("--max-new-tokens", type=int, default=8)
    args = parser.parse_args()
    prompt = [int(x) for x in args.ids.split(",")]
    print(",".join(map(str, greedy(args.build_dir, prompt, args.max_new_tokens))))


if __name__ == "__main__":
    main()
