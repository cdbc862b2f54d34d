"""specc's torch module of a spec, asked what the import tests ask a built Session: where a test
holds an import (the spec and its weights) to Hugging Face's model without building it (a build
holds its graphs to this same module: its verification)."""
from __future__ import annotations

import pytest
import torch

import specc
from specc.nn import as_resolved
from specc.spec.manifest import Tokens


class TorchModel:
    """run() gives the module's outputs as numpy, as Session.run does; greedy() the new ids of a
    full-recompute greedy loop (an encoder-decoder's decoder from its start token), stopping after
    the spec's eos, as Session.generate does."""

    def __init__(self, spec):
        self.model, self.r = specc.to_torch(spec), as_resolved(spec)

    def run(self, **inputs) -> dict:
        with torch.no_grad():
            out = self.model(**{k: torch.as_tensor(v, dtype=torch.int64) for k, v in inputs.items()})
        return {k: v.numpy() for k, v in out.items()}

    def greedy(self, prompt: list[int], new: int) -> list[int]:
        tokens = Tokens(**self.r.tokens.model_dump(include={"bos", "eos", "pad", "decoder_start"}))
        start = tokens.start_for(tokens.pad_for(tokens.eos))  # as a Session starts it
        ids: list[int] = []
        for _ in range(new):
            inputs = ({"input_ids": [prompt], "decoder_input_ids": [[start] + ids]}
                      if self.r.architecture == "encoder-decoder" else {"input_ids": [prompt + ids]})
            ids.append(int(self.run(**inputs)["logits"][0, -1].argmax()))
            if ids[-1] == tokens.eos:
                break
        return ids


TORCH, ONNX = "torch", "onnx"


def paths(runs, in_torch, marks=lambda values: ()) -> list:
    """Each of `runs` (argument tuples or pytest.params) with the path it takes appended: ONNX
    (built) where it is slow already or not in_torch(values); else TORCH in make test and ONNX
    under the slow marker. marks(values): marks of a built run besides its own."""
    out = []
    for run in runs:
        values, own = (tuple(run.values), tuple(run.marks)) if hasattr(run, "values") else (tuple(run), ())
        if own or not in_torch(values):
            out.append(pytest.param(*values, ONNX, marks=own + tuple(marks(values))))
        else:
            out += [pytest.param(*values, TORCH), pytest.param(*values, ONNX, marks=pytest.mark.slow)]
    return out
