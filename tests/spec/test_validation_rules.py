"""Every rejection listed in the language doc ("What validation must reject"), one case each: the
spec is loaded from a file, and the error names the key path, the 1-based line and column of the
offending YAML node (an unknown key: the key; a missing key: the mapping that lacks it; anything
else: the value) and says what is wrong. Each case has exactly that one problem, so exactly one
issue comes back."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from specc.errors import SpecError
from specc.spec import load_spec
from specc.spec.rules import RULES

from tests.helpers.spectext import DEC

ENC = """\
specc: 1
name: t
architecture: encoder
d_model: 64
vocab:
  size: 100
encoder:
  layers: 1
  attention:
    heads: 4
"""

ED = """\
specc: 1
name: t
architecture: encoder-decoder
d_model: 64
vocab:
  size: 100
encoder:
  layers: 1
  attention:
    heads: 4
decoder:
  layers: 1
  attention:
    heads: 4
"""


@dataclass(frozen=True)
class Case:
    id: str
    text: str
    key: str
    at: str  # needle in text; "^" marks the expected line:column (default: the needle's start)
    fragment: str  # part of the message
    rule: str | None = None  # the rules.RULES function that reports it (None: structural)


def _without(text: str, line: str) -> str:
    assert line in text
    return text.replace(line, "", 1)


CASES = [
    # --- YAML, keys, types, ranges, required fields ---------------------------------------
    Case("yaml-does-not-parse", "specc: 1\nvocab:\n\tsize: 3\n", "", "\tsize", "invalid YAML"),
    Case(
        "unknown-key-did-you-mean",
        DEC.replace("  attention:\n", "  atention:\n"),
        "decoder.atention",
        "atention:",
        "unknown key 'atention'; did you mean 'attention'?",
    ),
    Case(
        "unknown-top-level-key-did-you-mean",
        DEC + "d_modle: 32\n",
        "d_modle",
        "d_modle:",
        "did you mean 'd_model'?",
    ),
    Case("wrong-type-int", DEC.replace("layers: 2", "layers: two"), "decoder.layers", "layers: ^two", "integer"),
    Case(
        "wrong-type-bool",
        DEC.replace("  size: 100\n", "  size: 100\n  share: maybe\n"),
        "vocab.share",
        "share: ^maybe",
        "true or false",
    ),
    Case(
        "wrong-type-mapping",
        DEC + "position: sinusoidal\n",
        "position",
        "position: ^sinusoidal",
        "dictionary",
    ),
    Case(
        "unknown-kind-did-you-mean",
        DEC + "position:\n  kind: learnt\n",
        "position.kind",
        "kind: ^learnt",
        "did you mean 'learned'",
    ),
    Case(
        "unknown-choice-did-you-mean",
        DEC + "serving:\n  precision: fp33\n",
        "serving.precision",
        "precision: ^fp33",
        "did you mean 'fp32'",
    ),
    Case("out-of-range-int", DEC.replace("size: 100", "size: 0"), "vocab.size", "size: ^0", "greater than or equal to 1"),
    Case(
        "out-of-range-float",
        DEC + "norm:\n  eps: 0\n",
        "norm.eps",
        "eps: ^0",
        "greater than 0",
    ),
    Case(
        "out-of-range-dropout",
        DEC + "dropout: {hidden: 0.1, attention: 1.5}\n",
        "dropout.attention",
        "attention: ^1.5",
        "less than 1",
    ),
    Case(
        "bad-name-pattern",
        DEC.replace("name: t", "name: My_Model"),
        "name",
        "name: ^My_Model",
        "pattern",
    ),
    Case("missing-specc", _without(DEC, "specc: 1\n"), "specc", "^name: t", "missing required key 'specc'"),
    Case(
        "missing-name",
        "# a comment first: the root mapping starts on line 2\n" + _without(DEC, "name: t\n"),
        "name",
        "^specc: 1",
        "missing required key 'name'",
    ),
    Case(
        "missing-architecture",
        _without(DEC, "architecture: decoder\n"),
        "architecture",
        "^specc: 1",
        "missing required key 'architecture'",
    ),
    Case("missing-d_model", _without(DEC, "d_model: 64\n"), "d_model", "^specc: 1", "missing required key 'd_model'"),
    Case("missing-vocab", _without(DEC, "vocab:\n  size: 100\n"), "vocab", "^specc: 1", "missing required key 'vocab'"),
    Case(
        "missing-vocab-size",
        DEC.replace("  size: 100\n", "  type_size: 2\n"),
        "vocab.size",
        "vocab:\n  ^type_size",
        "missing required key 'size'",
    ),
    # --- attention dimensions -----------------------------------------------------------------
    Case(
        "d_model-not-divisible-by-heads",
        DEC.replace("heads: 4", "heads: 5"),
        "decoder.attention.heads",
        "heads: ^5",
        "d_model 64 is not divisible by heads 5",
        "head_dimensions",
    ),
    Case(
        "heads-not-divisible-by-kv_heads",
        DEC + "    kv_heads: 3\n",
        "decoder.attention.kv_heads",
        "kv_heads: ^3",
        "heads 4 is not divisible by kv_heads 3",
        "head_dimensions",
    ),
    Case(
        "rotary-odd-rotated-dimension",
        # d_k 20, fraction 0.75: floor(15.0) = 15 dims rotate, an odd number
        DEC + "    d_k: 20\nposition:\n  kind: rotary\n  fraction: 0.75\n",
        "position.fraction",
        "fraction: ^0.75",
        "= 15 dims",
        "rotary_even",
    ),
    Case(
        "merge-concat-heads-times-d_v",
        DEC + "    merge: concat\n    d_v: 8\n",
        "decoder.attention.merge",
        "merge: ^concat",
        "heads * d_v == d_model",
        "head_dimensions",
    ),
    Case(
        "merge-mean-d_v",
        DEC + "    merge: mean\n",
        "decoder.attention.merge",
        "merge: ^mean",
        "d_v == d_model",
        "head_dimensions",
    ),
    Case(
        "share_kv-d_k-ne-d_v",
        DEC + "    share_kv: true\n    d_v: 8\n",
        "decoder.attention.share_kv",
        "share_kv: ^true",
        "d_k == d_v",
        "head_dimensions",
    ),
    # --- stacks -------------------------------------------------------------------------------
    Case(
        "stack-missing-encoder",
        ED.replace("encoder:\n  layers: 1\n  attention:\n    heads: 4\n", "", 1),
        "encoder",
        "^specc: 1",
        "needs an encoder stack",
        "stacks_match_architecture",
    ),
    Case(
        "stack-missing-decoder",
        _without(DEC, "decoder:\n  layers: 2\n  attention:\n    heads: 4\n"),
        "decoder",
        "^specc: 1",
        "decoder stack",
        "stacks_match_architecture",
    ),
    Case(
        "stack-present-without-architecture",
        DEC + "encoder:\n  layers: 1\n",
        "encoder",
        "encoder:\n  ^layers: 1",
        "has no encoder",
        "stacks_match_architecture",
    ),
    Case(
        "cross_attention-in-decoder-only",
        DEC + "  cross_attention:\n    heads: 4\n",
        "decoder.cross_attention",
        "cross_attention:\n    ^heads",
        "encoder-decoder",
        "cross_attention_only_in_encoder_decoder",
    ),
    Case(
        "cross_attention-under-encoder",
        ED.replace("    heads: 4\ndecoder:", "    heads: 4\n  cross_attention:\n    heads: 4\ndecoder:"),
        "encoder.cross_attention",
        "cross_attention:\n    ^heads",
        "only the decoder",
        "cross_attention_only_in_encoder_decoder",
    ),
    # --- lengths and serving ------------------------------------------------------------------
    Case(
        "learned-positions-shorter-than-serving",
        DEC + "position:\n  kind: learned\n  max_length: 256\n",
        "position.max_length",
        "max_length: ^256",
        "shorter than serving.length.max 512",
        "lengths_fit",
    ),
    Case(
        "bigbird-positions-shorter-than-serving",
        ENC + "    pattern: {kind: bigbird, block: 8, window: 1, global: 1, random: 1}\n"
        "position:\n  max_length: 256\n",
        "position.max_length",
        "max_length: ^256",
        "shorter than serving.length.max 512",
        "lengths_fit",
    ),
    Case(
        "serving-min-gt-opt",
        DEC + "serving:\n  batch: {min: 9, opt: 8, max: 32}\n",
        "serving.batch",
        "batch: ^{",
        "min <= opt <= max",
        "serving_ranges_ordered",
    ),
    Case(
        "serving-opt-gt-max",
        DEC + "serving:\n  length:\n    min: 1\n    opt: 600\n    max: 512\n",
        "serving.length",
        "length:\n    ^min",
        "min <= opt <= max",
        "serving_ranges_ordered",
    ),
    Case(
        "generation-more-sequences-than-the-batch",
        DEC + "serving:\n  batch: {min: 1, opt: 2, max: 4}\n  generation:\n    max_sequences: 8\n",
        "serving.generation.max_sequences",
        "max_sequences: ^8",
        "more than serving.batch.max 4",
        "generation_fits_the_batch",
    ),
    Case(
        "int8-activations-of-a-float-build",
        DEC + "serving:\n  precision: fp16\n  activations: int8\n",
        "serving.activations",
        "activations: ^int8",
        "this spec builds fp16",
        "activations_are_an_integer_builds",
    ),
    # --- outputs ------------------------------------------------------------------------------
    Case(
        "tie_output-without-lm-output",
        DEC.replace("  size: 100\n", "  size: 100\n  tie_output: true\n") + "outputs:\n  - {name: h, kind: hidden}\n",
        "vocab.tie_output",
        "tie_output: ^true",
        "lm or mlm output",
        "outputs_consistent",
    ),
    Case(
        "classifier-without-classes",
        ENC + "outputs:\n  - name: cls\n    kind: classifier\n",
        "outputs.0.classes",
        "- ^name: cls",
        "missing required key 'classes'",
    ),
    Case(
        "token_classifier-without-classes",
        ENC + "outputs:\n  - {name: h, kind: hidden}\n  - {name: tags, kind: token_classifier}\n",
        "outputs.1.classes",
        "^{name: tags",
        "missing required key 'classes'",
    ),
    Case(
        "duplicate-output-name",
        DEC + "outputs:\n  - {name: logits, kind: lm}\n  - {name: logits, kind: hidden}\n",
        "outputs.1.name",
        "{name: ^logits, kind: hidden}",
        "already used by outputs[0]",
        "outputs_consistent",
    ),
    Case(
        "output-named-like-an-input",
        DEC + "outputs:\n  - {name: attention_mask, kind: lm}\n",
        "outputs.0.name",
        "{name: ^attention_mask, kind: lm}",
        "output name 'attention_mask' is a graph input's name",
        "outputs_consistent",
    ),
    Case(
        "name-of-a-build-file",
        DEC.replace("name: ", "name: model.safetensors # ", 1),
        "name",
        "name: ^model.safetensors",
        "name 'model.safetensors' is the name of a file every build writes",
        "name_is_not_an_artifact",
    ),
    Case(
        "no-outputs",
        DEC + "outputs: []\n",
        "outputs",
        "outputs: ^[]",
        "at least one output",
        "outputs_consistent",
    ),
    # --- attention patterns -------------------------------------------------------------------
    Case(
        "pattern-foreign-key-full-window",
        DEC + "    pattern:\n      kind: full\n      window: 4\n",
        "decoder.attention.pattern.window",
        "^window: 4",
        "unknown key 'window' for kind 'full'",
    ),
    Case(
        "pattern-foreign-key-local-block",
        ENC + "    pattern: {kind: local, window: 4, block: 8}\n",
        "encoder.attention.pattern.block",
        "^block: 8",
        "unknown key 'block' for kind 'local'",
    ),
    Case(
        "pattern-local-without-window",
        DEC + "    pattern:\n      kind: local\n",
        "decoder.attention.pattern.window",
        "pattern:\n      ^kind: local",
        "missing required key 'window'",
    ),
    Case(
        "pattern-bigbird-without-block",
        DEC + "    pattern: {kind: bigbird, window: 1, global: 1, random: 1}\n",
        "decoder.attention.pattern.block",
        "pattern: ^{kind: bigbird",
        "missing required key 'block'",
    ),
    Case(
        "pattern-linformer-without-k",
        ENC + "    pattern: {kind: linformer}\n",
        "encoder.attention.pattern.k",
        "pattern: ^{kind: linformer",
        "missing required key 'k'",
    ),
    Case(
        "linformer-in-decoder",
        DEC + "    pattern: {kind: linformer, k: 32}\n",
        "decoder.attention.pattern.kind",
        "kind: ^linformer",
        "decoder cannot cache",
        "patterns_fit_roles",
    ),
    Case(
        "local-in-cross_attention",
        ED + "  cross_attention:\n    heads: 4\n    pattern: {kind: local, window: 2}\n",
        "decoder.cross_attention.pattern.kind",
        "kind: ^local",
        "cross-attention spans two sequences",
        "patterns_fit_roles",
    ),
    Case(
        "bigbird-in-cross_attention",
        ED + "  cross_attention:\n    pattern: {kind: bigbird, block: 8, window: 1, global: 1, random: 1}\n",
        "decoder.cross_attention.pattern.kind",
        "kind: ^bigbird",
        "cross-attention spans two sequences",
        "patterns_fit_roles",
    ),
    Case(
        "linformer-k-longer-than-positions",
        ENC + "    pattern: {kind: linformer, k: 1000}\n",
        "encoder.attention.pattern.k",
        "k: ^1000",
        "exceeds position.max_length 512",
        "patterns_fit_roles",
    ),
    Case(
        "linformer-with-relative-positions",
        ENC + "    pattern: {kind: linformer, k: 32}\nposition:\n  kind: relative\n",
        "encoder.attention.pattern.kind",
        "kind: ^linformer",
        "relative positions",
        "linformer_positions",
    ),
    Case(
        "linformer-with-alibi-positions",
        ENC + "    pattern: {kind: linformer, k: 32}\nposition:\n  kind: alibi\n",
        "encoder.attention.pattern.kind",
        "kind: ^linformer",
        "alibi positions",
        "linformer_positions",
    ),
    Case(
        "unit-offset-on-layernorm",
        DEC + "norm:\n  kind: layernorm\n  unit_offset: true\n",
        "norm.unit_offset",
        "unit_offset: ^true",
        "for rmsnorm, not layernorm",
        "unit_offset_is_rmsnorms",
    ),
    Case(
        "scale-on-a-dot-score",
        DEC.replace("    heads: 4\n", "    heads: 4\n    score: dot\n    scale: 0.5\n"),
        "decoder.attention.scale",
        "scale: ^0.5",
        "scale is scaled_dot's factor on q.k; score is dot",
        "scale_is_scaled_dots",
    ),
    Case(
        "override-chooses-by-every-and-indices",
        DEC + "  overrides:\n    - {every: 2, indices: [1], pattern: {kind: full}}\n",
        "decoder.overrides.0",
        "- ^{every",
        "by `every` or by `indices` (one of them)",
        "overrides_fit",
    ),
    Case(
        "override-pattern-linformer-in-a-decoder",
        DEC + "  overrides:\n    - {indices: [1], pattern: {kind: linformer, k: 4}}\n",
        "decoder.overrides.0.pattern.kind",
        "kind: ^linformer",
        "a decoder cannot cache them token by token",
        "patterns_fit_roles",
    ),
    Case(
        "override-past-the-last-layer",
        DEC + "  overrides:\n    - {indices: [5], pattern: {kind: full}}\n",
        "decoder.overrides.0.indices",
        "indices: ^[5]",
        "layer 5 is past the stack's 2 layers",
        "overrides_fit",
    ),
    Case(
        "buckets-past-max-distance",
        DEC + "position: {kind: bucketed, buckets: 32, max_distance: 16}\n",
        "position.max_distance",
        "max_distance: ^16",
        "max_distance 16 must exceed half the buckets (16)",
        "buckets_reach",
    ),
    Case(
        "parallel-layers-post-norm",
        DEC.replace("  layers: 2\n", "  layers: 2\n  parallel: one_norm\n"),  # placement defaults to post
        "decoder.parallel",
        "parallel: ^one_norm",
        "parallel layers are pre-norm; norm.placement is post",
        "parallel_layers",
    ),
    Case(
        "parallel-layers-with-cross-attention",
        ED + "  parallel: two_norms\nnorm:\n  placement: pre\n",
        "decoder.parallel",
        "parallel: ^two_norms",
        "no cross-attention",
        "parallel_layers",
    ),
    # --- rotary scaling, norm bias -------------------------------------------------------------
    Case(
        "rotary-scaling-without-kind",
        DEC + "position:\n  kind: rotary\n  scaling: {factor: 2.0}\n",
        "position.scaling",
        "scaling: ^{factor",
        "missing 'kind' (one of: none, linear, llama3, yarn, longrope)",
    ),
    Case(
        "rotary-scaling-factor-below-one",
        DEC + "position:\n  kind: rotary\n  scaling: {kind: linear, factor: 0.5}\n",
        "position.scaling.factor",
        "factor: ^0.5",
        "greater than or equal to 1",
    ),
    Case(
        "llama3-high-freq-factor-not-above-low",
        DEC + "position:\n  kind: rotary\n  scaling: {kind: llama3, factor: 8.0, original_max_length: 8192, "
              "low_freq_factor: 4.0, high_freq_factor: 2.0}\n",
        "position.scaling.high_freq_factor",
        "high_freq_factor: ^2.0",
        "high_freq_factor 2 must exceed low_freq_factor 4",
        "rotary_scaling_fits",
    ),
    Case(
        "yarn-beta-fast-not-above-slow",
        DEC + "position:\n  kind: rotary\n  scaling: {kind: yarn, factor: 4.0, original_max_length: 32768, "
              "beta_fast: 1.0, beta_slow: 2.0}\n",
        "position.scaling.beta_fast",
        "beta_fast: ^1.0",
        "beta_fast 1 must exceed beta_slow 2",
        "rotary_scaling_fits",
    ),
    Case(
        "longrope-factors-not-one-per-pair",
        # d_k 16: 8 rotated pairs
        DEC + "position:\n  kind: rotary\n  scaling: {kind: longrope, original_max_length: 8, short_factor: [1.0, 2.0], "
              "long_factor: [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]}\n",
        "position.scaling.short_factor",
        "short_factor: ^[1.0",
        "2 factors for 8 rotated pairs",
        "rotary_scaling_fits",
    ),
    Case(
        "longrope-in-an-override-not-one-per-pair",
        DEC + "  overrides:\n    - {indices: [1], rotary_scaling: {kind: longrope, original_max_length: 8, "
              "short_factor: [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], long_factor: [2.0]}}\n"
              "position:\n  kind: rotary\n",
        "decoder.overrides.0.rotary_scaling.long_factor",
        "long_factor: ^[2.0]",
        "1 factors for 8 rotated pairs",
        "rotary_scaling_fits",
    ),
    Case(
        "override-rotary-scaling-without-rotary-positions",
        DEC + "  overrides:\n    - {indices: [1], rotary_scaling: {kind: linear, factor: 8.0}}\n",
        "decoder.overrides.0.rotary_scaling",
        "rotary_scaling: ^{kind",
        "rotary_scaling needs rotary positions; position.kind is sinusoidal",
        "overrides_fit",
    ),
    Case(
        "norm-bias-on-rmsnorm",
        DEC + "norm:\n  kind: rmsnorm\n  bias: false\n",
        "norm.bias",
        "bias: ^false",
        "rmsnorm has none",
        "norm_bias_is_layernorms",
    ),
    # --- routed experts, latent attention, sinks -----------------------------------------------
    Case(
        "experts-top-k-over-the-experts",
        DEC + "  ffn: {kind: moe, experts: 8, top_k: 9, d_ff: 32}\n",
        "decoder.ffn.top_k",
        "top_k: ^9",
        "top_k 9 exceeds the 8 experts",
        "experts_fit",
    ),
    Case(
        "experts-without-top-k",
        DEC + "  ffn:\n    kind: moe\n    experts: 8\n    d_ff: 32\n",
        "decoder.ffn.top_k",
        "ffn:\n    ^kind: moe",
        "missing required key 'top_k'",
    ),
    Case(
        "experts-router-kind-misspelt",
        DEC + "  ffn: {kind: moe, experts: 8, top_k: 2, d_ff: 32, router: {kind: sigmoidal}}\n",
        "decoder.ffn.router.kind",
        "kind: ^sigmoidal",
        "did you mean 'sigmoid'",
    ),
    Case(
        "experts-normalize-on-top-k-softmax",
        DEC + "  ffn: {kind: moe, experts: 8, top_k: 2, d_ff: 32, router: {kind: top_k_softmax, normalize: true}}\n",
        "decoder.ffn.router.normalize",
        "^normalize: true",
        "unknown key 'normalize' for kind 'top_k_softmax' (it belongs to kind 'softmax' / 'sigmoid')",
    ),
    Case(
        "experts-groups-uneven",
        DEC + "  ffn: {kind: moe, experts: 8, top_k: 2, d_ff: 32, router: {kind: sigmoid, groups: 3, top_groups: 1}}\n",
        "decoder.ffn.router.groups",
        "groups: ^3",
        "8 experts do not split into 3 equal groups",
        "experts_fit",
    ),
    Case(
        "experts-top-groups-too-few",
        DEC + "  ffn: {kind: moe, experts: 8, top_k: 4, d_ff: 32, router: {kind: softmax, groups: 4, top_groups: 1}}\n",
        "decoder.ffn.router.top_groups",
        "top_groups: ^1",
        "the 1 best groups hold 2 experts, fewer than top_k 4",
        "experts_fit",
    ),
    Case(
        "experts-clamped-swiglu-without-its-limit",
        DEC + "  ffn: {kind: moe, experts: 8, top_k: 2, d_ff: 32, activation: clamped_swiglu, swiglu_alpha: 1.702}\n",
        "decoder.ffn.activation",
        "activation: ^clamped_swiglu",
        "clamped_swiglu needs swiglu_limit",
        "experts_fit",
    ),
    Case(
        "experts-sparsemixer-chooses-two",
        DEC + "  ffn: {kind: moe, experts: 8, top_k: 3, d_ff: 32, router: {kind: sparsemixer}}\n",
        "decoder.ffn.top_k",
        "top_k: ^3",
        "chooses 2 experts",
        "experts_fit",
    ),
    Case(
        "experts-in-an-override",
        DEC + "  overrides:\n    - {indices: [1], ffn: {kind: moe, experts: 2, top_k: 3, d_ff: 8}}\n",
        "decoder.overrides.0.ffn.top_k",
        "top_k: ^3",
        "top_k 3 exceeds the 2 experts",
        "experts_fit",
    ),
    Case(
        "override-ffn-chosen-twice",
        DEC + "  overrides:\n    - {indices: [0], ffn: {d_ff: 8}}\n    - {indices: [1, 0], ffn: {d_ff: 16}}\n",
        "decoder.overrides.1",
        "- ^{indices: [1, 0]",
        "layer 0 is also chosen by override 0",
        "overrides_fit",
    ),
    Case(
        "latent-attention-with-kv-heads",
        DEC.replace("    heads: 4\n", "    kind: latent\n    heads: 4\n    kv_heads: 2\n    d_k: 24\n    rope_dims: 8\n"
                                    "    kv_rank: 16\n") + "position: {kind: rotary}\n",
        "decoder.attention.kv_heads",
        "^kv_heads: 2",
        "unknown key 'kv_heads' for kind 'latent' (it belongs to kind 'multi_head')",
    ),
    Case(
        "latent-attention-without-rotary-positions",
        DEC.replace("    heads: 4\n", "    kind: latent\n    heads: 4\n    d_k: 24\n    rope_dims: 8\n    kv_rank: 16\n"),
        "decoder.attention.kind",
        "kind: ^latent",
        "position.kind is sinusoidal, not rotary",
        "latent_attention_fits",
    ),
    Case(
        "latent-attention-rope-dims-odd",
        DEC.replace("    heads: 4\n", "    kind: latent\n    heads: 4\n    d_k: 24\n    rope_dims: 7\n    kv_rank: 16\n")
        + "position: {kind: rotary}\n",
        "decoder.attention.rope_dims",
        "rope_dims: ^7",
        "rope_dims 7 must be even and at most d_k 24",
        "latent_attention_fits",
    ),
    Case(
        "latent-cross-attention",
        ED + "  cross_attention: {kind: latent, d_k: 24, rope_dims: 8, kv_rank: 16}\nposition: {kind: rotary}\n",
        "decoder.cross_attention.kind",
        "kind: ^latent, d_k",
        "latent attention is self-attention",
        "latent_attention_fits",
    ),
    Case(
        "sinks-not-a-boolean",
        DEC.replace("    heads: 4\n", "    heads: 4\n    sinks: 4\n"),
        "decoder.attention.sinks",
        "sinks: ^4",
        "true or false",
    ),
    # --- vocabulary and tokens ----------------------------------------------------------------
    Case(
        "token-id-outside-vocabulary",
        DEC + "tokens:\n  eos: 100\n",  # ids are 0..99
        "tokens.eos",
        "eos: ^100",
        "outside the vocabulary (size 100)",
        "vocab_consistent",
    ),
    Case(
        "target_size-outside-encoder-decoder",
        DEC.replace("  size: 100\n", "  size: 100\n  target_size: 50\n"),
        "vocab.target_size",
        "target_size: ^50",
        "encoder-decoder",
        "vocab_consistent",
    ),
    Case(
        "share-with-different-target-size",
        # share is not written: the issue points at the nearest written ancestor, vocab's mapping
        ED.replace("  size: 100\n", "  size: 100\n  target_size: 200\n"),
        "vocab.share",
        "vocab:\n  ^size",
        "set share: false",
        "vocab_consistent",
    ),
    Case(
        "decoder_start-outside-encoder-decoder",
        DEC + "tokens:\n  decoder_start: 0\n",
        "tokens.decoder_start",
        "decoder_start: ^0",
        "encoder-decoder",
        "vocab_consistent",
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_rejected_with_location(case: Case, spec_file, position_of):
    path = spec_file(case.text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    issues = info.value.issues
    assert len(issues) == 1, "\n".join(map(str, issues))
    issue = issues[0]
    assert issue.key == case.key
    assert issue.file == str(path)
    assert (issue.line, issue.column) == position_of(case.text, case.at), str(issue)
    assert case.fragment in issue.message
    # the printed form is FILE:LINE:COL: key: message
    assert str(issue).startswith(f"{path}:{issue.line}:{issue.column}:")


def test_case_ids_are_unique():
    ids = [c.id for c in CASES]
    assert len(ids) == len(set(ids))


def test_every_rule_has_a_case():
    """A rule added to rules.RULES needs a case here."""
    covered = {c.rule for c in CASES}
    missing = {r.__name__ for r in RULES} - covered
    assert not missing, f"rules without a test case: {sorted(missing)}"


@pytest.mark.parametrize("base", [DEC, ENC, ED], ids=["decoder", "encoder", "encoder-decoder"])
def test_base_specs_are_valid(base, spec_file):
    """The bases the cases above are built from are valid on their own: each case's error comes
    from its own change."""
    spec = load_spec(spec_file(base))
    assert spec.d_model == 64


# --- several errors in one file ----------------------------------------------------------------


def test_several_structural_errors_all_reported_in_line_order(spec_file, position_of):
    text = """\
specc: 1
name: t
architecture: decoder
d_model: big
vocab:
  size: 100
  sizee: 3
decoder:
  layers: 2
  attention:
    heads: 0
"""
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(text))
    issues = info.value.issues
    assert [i.key for i in issues] == ["d_model", "vocab.sizee", "decoder.attention.heads"]
    assert [(i.line, i.column) for i in issues] == [
        position_of(text, "d_model: ^big"),
        position_of(text, "sizee"),
        position_of(text, "heads: ^0"),
    ]


def test_several_rule_errors_all_reported_in_line_order(spec_file, position_of):
    # written in an order unlike the RULES table's, so the line order is the loader's doing
    text = """\
specc: 1
name: t
architecture: decoder
d_model: 64
tokens:
  bos: 5000
serving:
  batch: {min: 4, opt: 2, max: 8}
vocab:
  size: 100
decoder:
  layers: 2
  attention:
    heads: 4
    kv_heads: 3
"""
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(text))
    issues = info.value.issues
    assert [i.key for i in issues] == ["tokens.bos", "serving.batch", "decoder.attention.kv_heads"]
    assert [(i.line, i.column) for i in issues] == [
        position_of(text, "bos: ^5000"),
        position_of(text, "batch: ^{"),
        position_of(text, "kv_heads: ^3"),
    ]
    # the exception's text lists them all, one per line
    assert str(info.value).count("\n") == 2


def test_rule_issues_in_both_stacks_are_each_reported(spec_file):
    text = ED.replace("heads: 4", "heads: 5")  # both stacks: 64 % 5 != 0
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(text))
    assert [i.key for i in info.value.issues] == ["encoder.attention.heads", "decoder.attention.heads"]
    assert info.value.issues[0].line < info.value.issues[1].line


def test_dropout_true_is_rejected(spec_file, position_of):
    """A bool is not a rate (it used to load as 1.0, then crash resolve() with a raw pydantic error)."""
    text = DEC + "dropout: true\n"
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(text))
    [issue] = info.value.issues
    assert issue.key == "dropout"
    assert (issue.line, issue.column) == position_of(text, "dropout: ^true")


LAX = [
    # YAML says "2" is a string; `dropout: "0.5"` is already rejected, `layers: "2"` should be too
    ("quoted-int", DEC.replace("layers: 2", 'layers: "2"'), "decoder.layers", 'layers: ^"2"'),
    # in YAML 1.2 (what the loader reads) `yes` is the string "yes", not a boolean
    ("yes-as-bool", DEC + "norm: {final: yes}\n", "norm.final", "final: ^yes"),
    # an infinite rotary base makes every frequency 0
    ("infinite-base", DEC + "position: {kind: rotary, base: .inf}\n", "position.base", "base: ^.inf"),
]


@pytest.mark.parametrize("text,key,at", [c[1:] for c in LAX], ids=[c[0] for c in LAX])
def test_wrong_type_is_not_coerced(text, key, at, spec_file, position_of):
    with pytest.raises(SpecError) as info:
        load_spec(spec_file(text))
    [issue] = info.value.issues
    assert issue.key == key
    assert (issue.line, issue.column) == position_of(text, at)
