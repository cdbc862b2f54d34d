"""Specs that fuzzing (test_fuzz_specs.py) found to break specc, kept as they were generated.
Each must build and pass verification; a case not fixed yet is a strict xfail."""
from __future__ import annotations

import pytest

import specc
from specc.spec import loads_spec

# cross-attention with share_kv: key and value were one tensor, so the exporter wrote a single
# graph output with an alias name ('present.0.encoder.value_alias_2') that is not in the IO
# signature, and the build failed
CROSS_SHARE_KV = """\
specc: 1
name: fuzz
architecture: encoder-decoder
d_model: 32
vocab:
  size: 17
  scale: none
  norm: true
  tie_output: true
position:
  kind: none
  max_length: 16
norm:
  eps: 1e-05
dropout: 0.0
encoder:
  layers: 2
  attention:
    heads: 2
    kv_heads: 2
    d_k: 8
    merge: mean
    d_v: 32
    pattern:
      kind: linformer
      k: 4
  ffn:
    d_ff: 16
    activation: gelu
    bias: true
decoder:
  layers: 2
  attention:
    heads: 1
    kv_heads: 1
    merge: mean
    d_v: 32
    score: bilinear
    bias: false
    pattern:
      kind: local
      window: 2
  ffn:
    d_ff: 32
    activation: swiglu
  cross_attention:
    heads: 1
    kv_heads: 1
    share_kv: true
    score: additive
    bias: true
outputs:
- name: out0
  kind: mlm
- name: out1
  kind: hidden
- name: out2
  kind: token_classifier
  classes: 1
tokens:
  bos: 15
  eos: 13
serving:
  batch:
    min: 1
    opt: 1
    max: 2
  length:
    min: 1
    opt: 6
    max: 16
  precision: fp16
"""

# int8 (dynamic quantization) of a d_model-16 encoder-decoder: the encoder's cross-attention key
# cache differed from torch by 0.033 (relative 0.118) against a tolerance of 0.001 + 0.1 x 0.284,
# and the build refused a valid spec. The cause: onnxruntime's u8 x s8 kernels saturate int16
# pair sums on x86 CPUs without VNNI (this machine: AVX2 only) with full-range int8 weights; the
# quantizer now uses the reduced 7-bit weight range (specc/export/quantize.py).
INT8_ENCDEC_TINY = """\
specc: 1
name: fuzz
architecture: encoder-decoder
d_model: 16
vocab:
  size: 63
  scale: none
  norm: true
  tie_output: false
position:
  kind: relative
  max_length: 32
  clip: 4
  values: true
norm:
  placement: post
  eps: 1e-05
  final: true
dropout: 0.1
encoder:
  layers: 2
  attention:
    heads: 2
    kv_heads: 1
    score: bilinear
    bias: false
    pattern:
      kind: local
      window: 1
  ffn:
    d_ff: 8
    activation: relu
    bias: true
decoder:
  layers: 1
  attention:
    heads: 1
    kv_heads: 1
    merge: concat
    d_v: 16
  ffn:
    d_ff: 8
    activation: relu
outputs:
- name: out0
  kind: hidden
tokens:
  eos: 47
  pad: 0
  decoder_start: 43
serving:
  batch:
    min: 1
    opt: 1
    max: 2
  length:
    min: 1
    opt: 3
    max: 16
  precision: int8
"""

FOUND = {
    "cross-attention-share-kv": CROSS_SHARE_KV,
    "int8-encoder-decoder-tiny": INT8_ENCDEC_TINY,
}


@pytest.mark.parametrize("text", list(FOUND.values()), ids=list(FOUND))
def test_found_spec_builds_and_verifies(text, tmp_path):
    spec = loads_spec(text, file="found.yaml")
    result = specc.build(spec, tmp_path / "out", seed=0)
    assert result.verification["passed"] is True
    outputs = {o["name"] for g in result.manifest["graphs"].values() for o in g["outputs"]}
    assert not any("alias" in o for o in outputs), outputs
