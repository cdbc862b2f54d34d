"""Optimum's ORTModelForCausalLM on a build folder, run by a test in the clients environment
(.venv-clients, where optimum-onnx is): `python optimum_generate.py BUILD PROMPTS.json NEW` prints
the greedy tokens Optimum generates after each prompt (a list of token ids), one prompt at a
time, NEW at most, stopping at the eos the build's generation_config.json names, as one JSON
list. Nothing here judges; the test compares."""
from __future__ import annotations

import json
import sys

import torch
from optimum.onnxruntime import ORTModelForCausalLM


def main(build: str, prompts_file: str, new: int) -> None:
    model = ORTModelForCausalLM.from_pretrained(build)
    out = []
    for prompt in json.loads(open(prompts_file).read()):
        ids = torch.tensor([prompt])
        got = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                             do_sample=False, num_beams=1)
        out.append(got[0, ids.shape[1]:].tolist())
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
