"""Tiny specs covering every kind of the language, for the nn tests (imported as `speclib`)."""
from __future__ import annotations

import copy

from specc.spec import loads_spec
from specc.spec.yamlio import dump_yaml

BASE = {
    "specc": 1,
    "name": "tiny",
    "architecture": "decoder",
    "d_model": 32,
    "vocab": {"size": 61},
    "dropout": 0.0,
    "position": {"kind": "learned", "max_length": 64},
    "serving": {"length": {"min": 1, "opt": 16, "max": 64}},
    "decoder": {"layers": 2, "attention": {"heads": 4}, "ffn": {"d_ff": 48}},
}


def merge(a, b):
    if isinstance(a, dict) and isinstance(b, dict):
        out = dict(a)
        for k, v in b.items():
            out[k] = merge(a[k], v) if k in a else v
        return out
    return copy.deepcopy(b)


def tiny(overrides: dict | None = None, drop: tuple[str, ...] = ()):
    data = merge(BASE, overrides or {})
    if data["architecture"] == "encoder":
        data.pop("decoder", None)
    for key in drop:
        data.pop(key, None)
    return loads_spec(dump_yaml(data))


def stack(att: dict | None = None, ffn: dict | None = None, layers: int = 2) -> dict:
    return {"layers": layers, "attention": {"heads": 4, **(att or {})}, "ffn": {"d_ff": 48, **(ffn or {})}}


ENC = {"architecture": "encoder", "encoder": stack()}
ENC_DEC = {"architecture": "encoder-decoder", "encoder": stack()}

# name -> overrides; every kind of the language appears at least once
KINDS: dict[str, dict] = {
    "decoder-default": {},
    "encoder-default": ENC,
    "encdec-default": ENC_DEC,
    "gqa": {"decoder": stack({"kv_heads": 2})},
    "mqa": {"decoder": stack({"kv_heads": 1})},
    "dk-dv-apart": {"decoder": stack({"d_k": 12, "d_v": 10})},
    "score-dot": {"decoder": stack({"score": "dot"})},
    "score-bilinear": {"decoder": stack({"score": "bilinear"})},
    "score-additive": {"decoder": stack({"score": "additive"})},
    "merge-concat": {"decoder": stack({"merge": "concat"})},
    "merge-mean": {"decoder": stack({"merge": "mean", "d_v": 32})},
    "share-kv": {"decoder": stack({"share_kv": True})},
    "no-bias": {"decoder": stack({"bias": False}, {"bias": False})},
    "local": {"decoder": stack({"pattern": {"kind": "local", "window": 3}})},
    "linformer-encoder": {**ENC, "encoder": stack({"pattern": {"kind": "linformer", "k": 8}})},
    "bigbird": {"decoder": stack({"pattern": {"kind": "bigbird", "block": 4, "window": 2, "global": 1, "random": 1}})},
    "bigbird-encoder": {**ENC, "encoder": stack({"pattern": {"kind": "bigbird", "block": 4, "window": 2, "global": 1, "random": 2}})},
    "sinusoidal": {"position": {"kind": "sinusoidal"}},
    "relative": {"position": {"kind": "relative", "clip": 4}},
    "relative-novalues": {"position": {"kind": "relative", "clip": 4, "values": False}},
    "rotary": {"position": {"kind": "rotary"}},
    "rotary-half": {"position": {"kind": "rotary", "fraction": 0.5}},
    "alibi": {"position": {"kind": "alibi"}},
    "no-position": {"position": {"kind": "none"}},
    "rmsnorm-pre": {"norm": {"kind": "rmsnorm", "placement": "pre"}},
    "sandwich": {"norm": {"placement": "sandwich"}},
    "post-final": {"norm": {"placement": "post", "final": True}},
    "embed-norm-types": {"vocab": {"size": 61, "norm": True, "type_size": 2}},
    "scaled-untied": {"vocab": {"size": 61, "scale": "sqrt_d_model", "tie_output": False}},
    "ffn-gelu": {"decoder": stack(ffn={"activation": "gelu"})},
    "ffn-gelu-tanh": {"decoder": stack(ffn={"activation": "gelu_tanh"})},
    "ffn-silu": {"decoder": stack(ffn={"activation": "silu"})},
    "ffn-swiglu": {"decoder": stack(ffn={"activation": "swiglu"})},
    "ffn-geglu": {"decoder": stack(ffn={"activation": "geglu"})},
    "encdec-separate-vocab": {**ENC_DEC, "vocab": {"size": 61, "target_size": 47, "share": False}},
    "encdec-cross-linformer": {**ENC_DEC, "decoder": {**stack(), "cross_attention": {"heads": 2, "pattern": {"kind": "linformer", "k": 8}}}},
    # today's families: parallel layers (GPT-J, GPT-NeoX), interleaved partial rotary, norms on the
    # sublayer outputs (OLMo 2), layers that differ (Gemma 2 / 3), soft-capping, T5's buckets
    "parallel-one-norm": {"norm": {"placement": "pre"}, "decoder": {**stack(), "parallel": "one_norm"}},
    "parallel-two-norms": {"norm": {"placement": "pre"}, "decoder": {**stack(), "parallel": "two_norms"}},
    "rotary-interleaved": {"position": {"kind": "rotary", "fraction": 0.5, "layout": "interleaved"}},
    "sublayer-output": {"norm": {"kind": "rmsnorm", "placement": "sublayer_output"},
                        "decoder": stack({"qk_norm": "full"})},
    "overrides": {"position": {"kind": "rotary"}, "decoder": {
        **stack({"pattern": {"kind": "local", "window": 2}, "scale": 0.3, "softcap": 2.0}, layers=3),
        "overrides": [{"every": 2, "first": 1, "pattern": {"kind": "full"}, "rotary_base": 100.0}]}},
    "bucketed": {"position": {"kind": "bucketed", "buckets": 8, "max_distance": 8, "max_length": 64},
                 "decoder": stack({"score": "dot"})},
    "bucketed-encdec": {**ENC_DEC, "position": {"kind": "bucketed", "buckets": 8, "max_distance": 8, "max_length": 64}},
    # rotary scaling (Chen et al.'s linear, Llama 3.1's, YaRN, Phi-3's LongRoPE: its long factors
    # past 8 tokens), Gemma 3's scaled global layers, and a LayerNorm without bias
    "rotary-linear": {"position": {"kind": "rotary", "scaling": {"kind": "linear", "factor": 2.0}}},
    "rotary-llama3": {"position": {"kind": "rotary", "base": 500.0, "scaling": {
        "kind": "llama3", "factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_length": 8}}},
    "rotary-yarn": {"position": {"kind": "rotary", "fraction": 0.5, "layout": "interleaved", "scaling": {
        "kind": "yarn", "factor": 4.0, "original_max_length": 8, "beta_fast": 4.0}}},
    "rotary-longrope": {"position": {"kind": "rotary", "max_length": 64, "scaling": {
        "kind": "longrope", "short_factor": [1.0, 1.5, 2.0, 3.0], "long_factor": [2.0, 4.0, 8.0, 16.0],
        "original_max_length": 8}}},
    "overrides-scaling": {"position": {"kind": "rotary"}, "decoder": {
        **stack({"pattern": {"kind": "local", "window": 2}}, layers=3),
        "overrides": [{"every": 2, "first": 1, "pattern": {"kind": "full"}, "rotary_base": 100.0,
                       "rotary_scaling": {"kind": "linear", "factor": 8.0}}]}},
    "layernorm-no-bias": {"norm": {"kind": "layernorm", "placement": "pre", "bias": False}},
    "lm-bias-scale-softcap": {"vocab": {"size": 61, "tie_output": False},
                              "outputs": [{"name": "logits", "kind": "lm", "bias": True, "scale": 0.5, "softcap": 4.0}]},
    "outputs-encoder": {**ENC, "vocab": {"size": 61, "type_size": 2}, "outputs": [
        {"name": "last_hidden_state", "kind": "hidden"},
        {"name": "mlm_logits", "kind": "mlm"},
        {"name": "cls", "kind": "classifier", "classes": 3, "pool": "first", "pooler": "tanh"},
        {"name": "cls_mean", "kind": "classifier", "classes": 2, "pool": "mean"},
        {"name": "cls_last", "kind": "classifier", "classes": 2, "pool": "last"},
        {"name": "tags", "kind": "token_classifier", "classes": 5},
        {"name": "pooler_output", "kind": "pooled", "pooler": "tanh"},
    ]},
    "outputs-decoder": {"outputs": [{"name": "logits", "kind": "lm"}, {"name": "score", "kind": "classifier", "classes": 2, "pool": "last"}]},
}

DECODER_KINDS = [k for k, v in KINDS.items() if v.get("architecture", "decoder") == "decoder"]

# Kinds the torch reference computes whose ONNX export forms are not written yet: attention sinks and
# latent attention (tests/nn only; tests/export builds KINDS), with routed experts among them
# (built per router kind by tests/export/test_moe_export.py)
ROPE = {"kind": "rotary", "layout": "interleaved"}
MOE = {"kind": "moe", "experts": 4, "top_k": 2, "d_ff": 24}
LATENT = {"kind": "latent", "heads": 4, "d_k": 12, "d_v": 10, "rope_dims": 4, "q_rank": 20, "kv_rank": 14}
TORCH_KINDS: dict[str, dict] = {
    "moe-softmax": {"decoder": {**stack(), "ffn": {**MOE, "router": {"kind": "softmax", "normalize": True}}}},
    "moe-sigmoid-groups-shared": {"norm": {"kind": "rmsnorm", "placement": "pre"}, "decoder": {
        **stack(layers=3), "ffn": {**MOE, "experts": 8, "top_k": 3, "shared": {"d_ff": 16, "gate": True}, "router": {
            "kind": "sigmoid", "normalize": True, "scale": 2.5, "groups": 4, "top_groups": 2}},
        "overrides": [{"indices": [0], "ffn": {"d_ff": 40, "activation": "swiglu"}}]}},
    "moe-gpt-oss": {"position": {"kind": "rotary"}, "decoder": {
        **stack({"kv_heads": 2, "sinks": True, "pattern": {"kind": "local", "window": 3}}, layers=3),
        "ffn": {**MOE, "activation": "clamped_swiglu", "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "bias": True,
                "router": {"kind": "top_k_softmax", "bias": True}},
        "overrides": [{"every": 2, "first": 1, "pattern": {"kind": "full"}}]}},
    "moe-sparsemixer-encoder": {**ENC, "encoder": {**stack(), "ffn": {**MOE, "router": {"kind": "sparsemixer"}}},
                                "outputs": [{"kind": "hidden", "name": "last_hidden_state"}, {"kind": "mlm"}]},
    "latent": {"position": ROPE, "norm": {"kind": "rmsnorm", "placement": "pre"}, "decoder": {
        "layers": 2, "attention": LATENT, "ffn": {**MOE, "shared": {"d_ff": 24}}}},
    "latent-direct-q-window-sinks": {"position": {"kind": "rotary"}, "decoder": {
        "layers": 3, "attention": {**LATENT, "q_rank": None, "sinks": True, "bias": True,
                                   "pattern": {"kind": "local", "window": 2}},
        "ffn": {"d_ff": 48}, "overrides": [{"indices": [1], "pattern": {"kind": "full"}}]}},
    "sinks-qk-norm-yarn": {"norm": {"kind": "rmsnorm", "placement": "pre"}, "position": {
        "kind": "rotary", "scaling": {"kind": "yarn", "factor": 4.0, "original_max_length": 8}}, "decoder": {
        **stack({"kv_heads": 2, "qk_norm": "head", "sinks": True, "bias": False}),
        "ffn": {**MOE, "experts": 6, "top_k": 3, "router": {"kind": "softmax", "normalize": True}}}},
    "sinks-encdec": {**ENC_DEC, "encoder": stack({"sinks": True}),
                     "decoder": {**stack({"sinks": True}), "cross_attention": {"heads": 2, "sinks": True}}},
    "latent-encdec": {**ENC_DEC, "position": ROPE, "decoder": {
        "layers": 2, "attention": LATENT, "cross_attention": {"heads": 4}, "ffn": {"d_ff": 48}}},
}
TORCH_DECODER_KINDS = [k for k, v in TORCH_KINDS.items() if v.get("architecture", "decoder") == "decoder"]
