"""The peer benchmark (benchmarks/llama_cpp_peer.py) runs the same model in llama.cpp as specc
builds: a small LLaMA-shaped build's weights written as a GGUF by its streamed writer give
llama.cpp's logits equal to the build's (to fp32 rounding: 8e-5 on logits of 0.6). The rotary layouts differ (specc's
rotates each head's halves, llama.cpp's adjacent pairs); without the row interleave the logits
are off by 4e-3, above this test's bound."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specc.cli import main as cli
from specc.runtime import Session

llama_cpp = pytest.importorskip("llama_cpp", reason="llama.cpp's Python binding (the bench extra, built from source)")
pytest.importorskip("gguf", reason="gguf (make install-real-models)")

from benchmarks import llama_cpp_peer  # noqa: E402

SPECS = Path(__file__).resolve().parents[2] / "specs"


def test_gguf_written_from_a_build_computes_the_builds_logits(tmp_path):
    build = tmp_path / "b"
    with pytest.raises(SystemExit) as done:
        cli(["build", str(SPECS / "tiny-llama.yaml"), "-o", str(build), "-q", "--keep-weights"])
    assert done.value.code in (0, None)
    spec = json.loads((build / "manifest.json").read_text())["spec"]
    path = tmp_path / "tiny.gguf"
    llama_cpp_peer.write_gguf(build / "model.safetensors", spec, path, dtype=np.float32)
    ids = np.random.default_rng(1).integers(3, spec["vocab"]["size"], size=20)
    ours = Session(build, check_hashes=False).run(input_ids=ids[None])["logits"][0]
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=64, logits_all=True, verbose=False)
    llm.eval(ids.tolist())
    theirs = np.array(llm.scores[: len(ids)], dtype=np.float32)
    assert np.abs(ours - theirs).max() < 2e-3 * np.abs(ours).max()


def test_a_spec_llama_cpp_would_compute_differently_is_refused():
    spec = {"name": "x", "architecture": "decoder", "position": {"kind": "learned"},
            "norm": {"kind": "layernorm", "placement": "pre"},
            "decoder": {"attention": {"bias": True, "pattern": {"kind": "full"}, "score": "scaled_dot"},
                        "ffn": {"bias": True, "activation": "gelu"}}}
    with pytest.raises(SystemExit, match="not LLaMA-shaped: needs rotary positions, rmsnorm, no biases, swiglu"):
        llama_cpp_peer.check_llama_shaped(spec)
