"""The language reference (docs/language.md), rendered from the pydantic models in schema.py so
that it cannot drift from them. Regenerate with::

    .venv/bin/python -m specc.spec.language_doc > docs/language.md

Every example below is checked by tests/spec/test_reference_doc.py: it is appended to a small
spec extending ``base`` and must load and resolve.
"""
from __future__ import annotations

import inspect
import types
import typing
from typing import Any, Literal, Union

from annotated_types import Ge, Gt, Le, Lt, MaxLen
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from specc.spec import schema

REGENERATE = ".venv/bin/python -m specc.spec.language_doc > docs/language.md"


# (title, base spec, YAML appended to `specc: 1 / name: example / extends: <base>`)
EXAMPLES: dict[str, list[tuple[str, str, str]]] = {
    "position": [
        ("sinusoidal", "tiny-transformer", "position: {kind: sinusoidal, layout: halves, max_length: 256}\n"),
        ("learned", "tiny-gpt2", "position: {kind: learned, max_length: 128}\n"),
        ("relative", "tiny-bert", "position: {kind: relative, clip: 8, values: false}\n"),
        ("rotary", "tiny-llama", "position: {kind: rotary, base: 10000.0, fraction: 0.5, layout: interleaved}\n"),
        ("alibi", "tiny-gpt2", "position: {kind: alibi, max_length: 128}\n"),
        ("bucketed", "tiny-transformer", "position: {kind: bucketed, buckets: 32, max_distance: 128, max_length: 512}\n"),
        ("none", "tiny-gpt2", "position: {kind: none}\n"),
    ],
    "scaling": [
        ("none", "tiny-llama", "position: {kind: rotary, scaling: {kind: none}}\n"),
        ("linear", "tiny-llama", "position: {kind: rotary, scaling: {kind: linear, factor: 4.0}}\n"),
        ("llama3", "tiny-llama",
         "position:\n  kind: rotary\n  base: 500000.0\n  max_length: 131072\n"
         "  scaling: {kind: llama3, factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, "
         "original_max_length: 8192}\n"),
        ("yarn", "tiny-llama",
         "position:\n  kind: rotary\n  base: 1000000.0\n  max_length: 131072\n"
         "  scaling: {kind: yarn, factor: 4.0, original_max_length: 32768}\n"),
        ("longrope", "tiny-llama",
         "position:\n  kind: rotary\n  max_length: 1024\n  scaling:\n    kind: longrope\n"
         "    original_max_length: 256\n"
         "    short_factor: [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]  # one per rotated pair (d_k 16)\n"
         "    long_factor: [1.0, 1.2, 1.6, 2.0, 2.5, 3.0, 4.0, 4.0]\n"),
    ],
    "pattern": [
        ("full", "tiny-bert", "encoder:\n  attention:\n    pattern: {kind: full}\n"),
        ("local", "tiny-bert", "encoder:\n  attention:\n    pattern: {kind: local, window: 8}\n"),
        ("linformer", "tiny-bert", "encoder:\n  attention:\n    pattern: {kind: linformer, k: 32}\n"),
        ("bigbird", "tiny-bert",
         "encoder:\n  attention:\n    pattern: {kind: bigbird, block: 8, window: 3, global: 1, random: 1}\n"),
    ],
    "score": [
        (s, "tiny-gpt2", f"decoder:\n  attention: {{score: {s}}}\n")
        for s in ("scaled_dot", "dot", "bilinear", "additive")
    ],
    "merge": [
        ("project", "tiny-gpt2", "decoder:\n  attention: {merge: project}\n"),
        ("concat", "tiny-gpt2", "decoder:\n  attention: {merge: concat}\n"),
        ("mean", "tiny-gpt2", "decoder:\n  attention: {merge: mean, d_k: 64, d_v: 64}\n"),
    ],
    "norm": [
        (f"{k}, {p}", "tiny-gpt2", f"norm: {{kind: {k}, placement: {p}}}\n")
        for k in ("layernorm", "rmsnorm") for p in ("post", "pre", "sandwich", "sublayer_output")
    ] + [("rmsnorm, unit offset", "tiny-llama", "norm: {kind: rmsnorm, placement: pre, unit_offset: true}\n"),
         ("layernorm without bias", "tiny-gpt2", "norm: {kind: layernorm, placement: pre, bias: false}\n")],
    "stack": [
        (f"parallel: {p}", "tiny-llama", f"decoder:\n  parallel: {p}\n") for p in ("none", "one_norm", "two_norms")
    ] + [("overrides", "tiny-llama",
          "decoder:\n  layers: 4\n  attention: {pattern: {kind: local, window: 7}}\n  overrides:\n"
          "    - {every: 2, first: 1, pattern: {kind: full}, rotary_base: 1000000.0}\n"),
         ("overrides with rotary scaling", "tiny-llama",
          "decoder:\n  layers: 6\n  attention: {pattern: {kind: local, window: 511}}\n  overrides:\n"
          "    - {every: 6, first: 5, pattern: {kind: full}, rotary_base: 1000000.0,\n"
          "       rotary_scaling: {kind: linear, factor: 8.0}}\n")],
    "activation": [
        (a, "tiny-gpt2", f"decoder:\n  ffn: {{activation: {a}}}\n")
        for a in ("relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu", "geglu_tanh")
    ],
    "attention": [
        ("multi_head", "tiny-llama", "decoder:\n  attention: {kind: multi_head, heads: 4, kv_heads: 2, sinks: true}\n"),
        ("latent", "tiny-llama",
         "position: {kind: rotary, layout: interleaved}\n"
         "decoder:\n  attention: {kind: latent, heads: 4, d_k: 24, d_v: 16, rope_dims: 8, q_rank: 32, kv_rank: 16}\n"),
    ],
    "ffn": [
        ("dense", "tiny-llama", "decoder:\n  ffn: {kind: dense, d_ff: 128, activation: swiglu, bias: false}\n"),
        ("moe", "tiny-llama",
         "decoder:\n  layers: 4\n  ffn:\n    kind: moe\n    experts: 8\n    top_k: 2\n    d_ff: 32\n"
         "    router: {kind: softmax, normalize: true}\n    shared: {d_ff: 64, gate: true}\n"
         "  overrides:\n    - {indices: [0], ffn: {kind: dense, d_ff: 128, activation: swiglu, bias: false}}\n"),
    ],
    "router": [
        ("softmax", "tiny-llama",
         "decoder:\n  ffn: {kind: moe, experts: 8, top_k: 2, d_ff: 32,\n"
         "        router: {kind: softmax, normalize: true, groups: 4, top_groups: 2, scale: 1.5}}\n"),
        ("top_k_softmax", "tiny-llama",
         "decoder:\n  ffn: {kind: moe, experts: 8, top_k: 2, d_ff: 32, activation: clamped_swiglu,\n"
         "        swiglu_alpha: 1.702, swiglu_limit: 7.0, bias: true, router: {kind: top_k_softmax, bias: true}}\n"),
        ("sigmoid", "tiny-llama",
         "decoder:\n  ffn: {kind: moe, experts: 16, top_k: 4, d_ff: 32, shared: {d_ff: 32},\n"
         "        router: {kind: sigmoid, normalize: true, scale: 2.5, groups: 4, top_groups: 2}}\n"),
        ("sparsemixer", "tiny-llama",
         "decoder:\n  ffn: {kind: moe, experts: 8, top_k: 2, d_ff: 32, router: {kind: sparsemixer, jitter_eps: 0.01}}\n"),
    ],
    "outputs": [
        ("hidden", "tiny-bert", "outputs:\n  - {kind: hidden, name: last_hidden_state}\n"),
        ("lm", "tiny-gpt2", "outputs:\n  - {kind: lm, name: logits, bias: false}\n"),
        ("mlm", "tiny-bert", "outputs:\n  - {kind: mlm}\n"),
        ("classifier", "tiny-bert", "outputs:\n  - {kind: classifier, classes: 3, pool: first, pooler: tanh}\n"),
        ("token_classifier", "tiny-bert", "outputs:\n  - {kind: token_classifier, classes: 9}\n"),
        ("pooled", "tiny-bert", "outputs:\n  - {kind: pooled, pool: first, pooler: tanh}\n"
                                "  - {kind: pooled, name: sentence_embedding, pool: mean, normalize: true}\n"),
    ],
}


# How the language states today's mixtures of experts, attention sinks and latent attention, and
# which keys a Hugging Face config's fields become (the importers read configs this way).
GUIDE = """\
## Mixtures of experts, latent attention and attention sinks

**Routed experts** (`ffn: {kind: moe}`). A sparsely-gated mixture of experts (Shazeer et al. 2017,
"Outrageously Large Neural Networks", arXiv:1701.06538) replaces a layer's FFN by `experts` FFNs
of `d_ff` each and a router, a linear map to one logit per expert, that chooses `top_k` of them
for each token and weighs their outputs; the Switch Transformer (Fedus et al. 2021,
arXiv:2101.03961) routes each token to one expert. Only the chosen experts compute: a token
reads and multiplies top_k / experts of the experts' weights (`specc inspect` counts the
*active parameters*, every parameter but the experts a token's router does not choose, and
FLOPs per token of the chosen experts alone). The experts' weights are stacked, one tensor per
projection and layer (docs/weights.md). The [kinds of router](#kinds-of-router) say how logits
become a choice and weights:

| family (transformers' config) | `ffn:` |
|---|---|
| Mixtral (`num_local_experts`, `num_experts_per_tok`) | `{kind: moe, router: {kind: softmax, normalize: true}}` |
| Qwen2-MoE, Qwen3-MoE, OLMoE (`norm_topk_prob`) | `router: {kind: softmax, normalize: <norm_topk_prob>}`; Qwen2-MoE's `shared_expert_intermediate_size` with its `shared_expert_gate`: `shared: {d_ff: ..., gate: true}` |
| gpt-oss | `activation: clamped_swiglu, swiglu_alpha: 1.702, swiglu_limit: <swiglu_limit>, bias: true, router: {kind: top_k_softmax, bias: true}` |
| GraniteMoE | `router: {kind: top_k_softmax}` |
| PhiMoE (`router_jitter_noise`) | `router: {kind: sparsemixer, jitter_eps: <router_jitter_noise>}`, `top_k: 2` |
| DeepSeek-V2 (`topk_method`, `n_group`, `topk_group`, `routed_scaling_factor`) | `router: {kind: softmax, scale: ..., groups: ..., top_groups: ..., group_score: max}` (groups with `group_limited_greedy` only), `shared: {d_ff: <n_shared_experts x moe_intermediate_size>}` |
| DeepSeek-V3 (`noaux_tc`, `e_score_correction_bias`, `norm_topk_prob`) | `router: {kind: sigmoid, selection_bias: true, normalize: ..., scale: ..., groups: ..., top_groups: ..., group_score: top2_sum}`, `shared` as V2's |

Which layers are dense: an override's `ffn` gives its layers a dense FFN of their own (or any FFN).
DeepSeek's `first_k_dense_replace: k` is `overrides: [{indices: [0, ..., k-1], ffn: {kind: dense,
d_ff: <intermediate_size>, activation: swiglu, bias: false}}]`; Qwen2-MoE's experts sit in the
layers i with (i + 1) % `decoder_sparse_step` == 0 and not in `mlp_only_layers`: the other layers
are overrides with the dense `intermediate_size` (with step 2, `{every: 2, first: 0, ffn: ...}`).
An override may choose a layer for its `ffn` that another chooses for its attention.

**Attention sinks** (`attention: {sinks: true}`): a learned logit per head that joins each row's
softmax and takes no value (gpt-oss's model card, OpenAI 2025, arXiv:2508.10925). gpt-oss's layers
are banded (`pattern: {kind: local, window: <sliding_window - 1>}`) and dense in turn
(`overrides: [{every: 2, first: 1, pattern: {kind: full}}]`).

**Multi-head latent attention** (`attention: {kind: latent}`; DeepSeek-V2, arXiv:2405.04434,
section 2.1, and DeepSeek-V3, arXiv:2412.19437, section 2.1.1). Queries are projected from x
directly (`q_rank: null`, V2-Lite's `q_lora_rank: null`) or through a rank-`q_rank` latent with
its RMSNorm; keys and values come from one latent of `kv_rank` per token (`kv_lora_rank`), with
its RMSNorm (eps `latent_eps`: transformers' DeepseekV2/V3RMSNorm default, 1e-6, whatever
`rms_norm_eps` is), expanded for every head. Each query and key head has `d_k` = qk_nope_head_dim
+ qk_rope_head_dim dims, the last `rope_dims` (qk_rope_head_dim) rotated, the key's rotated part
one per token shared by the heads; each value head has `d_v` (v_head_dim). The cache holds, per
layer and token, the latent and the rotary key: `past_key_values.N.latent` [batch, 1, past,
kv_rank] and `past_key_values.N.rope_key` [batch, 1, past, rope_dims] in place of `.key` /
`.value` (512 + 64 values a token in DeepSeek-V3, against 128 x (192 + 128) for its expanded keys
and values). Positions must be rotary: DeepSeek's pairs are `layout: interleaved` (V3's
`rope_interleave: true`, and V2), else `halves`. Under DeepSeek's YaRN (`rope_scaling` with
`mscale_all_dim`), transformers multiplies the softmax scale d_k^-1/2 by mscale^2, mscale = 0.1
mscale_all_dim ln(factor) + 1 (yarn_apply_mscale): write the product in `scale`; the scaling's
`attention_factor` is mscale(factor, mscale) / mscale(factor, mscale_all_dim), 1 where the two
are equal. Latent attention has no `kv_heads`, `score`, `merge`, `share_kv` or `qk_norm`; its
`bias` is DeepSeek's attention_bias, on the down projections (`q_a`, `kv_a`) and (through
`output_bias`) the output projection.
"""


def example_text(base: str, snippet: str) -> str:
    """The whole spec an example stands for."""
    return f"specc: 1\nname: example\nextends: {base}\n{snippet}"


def _type(ann: Any) -> str:
    origin = typing.get_origin(ann)
    if origin is typing.Annotated:
        return _type(typing.get_args(ann)[0])
    if origin is Literal:
        return " \\| ".join(f"`{a}`" if not isinstance(a, bool) else f"`{str(a).lower()}`" for a in typing.get_args(ann))
    if origin in (Union, types.UnionType):
        args = typing.get_args(ann)
        if all(inspect.isclass(a) and issubclass(a, schema.KindNode) for a in args):
            for anchor, _, union, _ in _kinds():
                if set(_union_members(union)) == set(args):
                    return f"one of the [kinds of {anchor}](#kinds-of-{anchor.replace(' ', '-')})"
            return "one of the kinds below"
        return " \\| ".join("null" if a is type(None) else _type(a) for a in args)
    if origin is list:
        return f"list of {_type(typing.get_args(ann)[0])}"
    if inspect.isclass(ann) and issubclass(ann, BaseModel):
        return f"mapping ([{ann.__name__}](#{ann.__name__.lower()}))"
    return {int: "integer", float: "number", str: "string", bool: "boolean"}.get(ann, str(ann))


def _constraints(info: FieldInfo) -> str:
    parts = []
    metas = list(info.metadata)
    anns = [info.annotation]
    if typing.get_origin(info.annotation) in (Union, types.UnionType):
        anns = list(typing.get_args(info.annotation))  # `NonNegInt | None`: the constraints of each
    for ann in anns:
        if typing.get_origin(ann) is typing.Annotated:
            for a in typing.get_args(ann)[1:]:
                metas.extend(getattr(a, "metadata", [a]))
    for m in metas:
        if isinstance(m, Ge):
            parts.append(f">= {m.ge}")
        elif isinstance(m, Gt):
            parts.append(f"> {m.gt}")
        elif isinstance(m, Le):
            parts.append(f"<= {m.le}")
        elif isinstance(m, Lt):
            parts.append(f"< {m.lt}")
        elif isinstance(m, MaxLen):
            parts.append(f"at most {m.max_length} characters")
        elif getattr(m, "pattern", None):
            parts.append(f"matches `{m.pattern}`")
    return ", ".join(dict.fromkeys(parts))


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "**required**"
    value = info.default
    if value is PydanticUndefined:
        return ""
    if value is None:
        return "null"
    if value == "":
        return '`""`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, BaseModel):
        kind = getattr(value, "kind", None)
        if kind:
            return f"`{{kind: {kind}}}`"
        items = value.model_dump(by_alias=True)
        if all(isinstance(v, (int, float, str)) for v in items.values()):
            return "`{" + ", ".join(f"{k}: {v}" for k, v in items.items()) + "}`"
        return "defaults of each key"
    return f"`{value}`"


# What the models say in code comments rather than docstrings.
NOTES = {
    "ModelSpec": "The top level of a spec file. `architecture` decides which stacks exist: `encoder`, "
                 "`decoder`, or both for `encoder-decoder`. `outputs: null` means an lm head "
                 "for anything with a decoder, the last hidden state for encoders. `weights` is a `.safetensors` file, relative "
                 "to the spec's file. `tokenizer` is a folder, relative to the spec's file, holding a Hugging Face "
                 "tokenizer: `tokenizer.json` (required), and where there are `tokenizer_config.json`, "
                 "`special_tokens_map.json` and `chat_template.jinja`; `specc build` copies them into the build "
                 "folder's root under those names, and `specc run` / `specc generate` read them for `--text` and "
                 "`--chat`. `specc import` writes it beside the spec (`NAME.tokenizer`).",
    "VocabSpec": "`tie_output` defaults to tying the lm / mlm head to the embeddings wherever one "
                 "exists; written as `true` without such an output it is an error. `target_size` is the "
                 "target vocabulary of an encoder-decoder.",
    "NormSpec": "`placement`: `post` x = Norm(x + f(x)) (Vaswani et al. 2017), `pre` x = x + f(Norm(x)) "
                "(GPT-2, LLaMA), `sandwich` x = x + PostNorm(f(Norm(x))) (CogView, Ding et al. 2021; Gemma 2), "
                "`sublayer_output` x = x + Norm(f(x)) (Swin Transformer V2's res-post-norm, Liu et al. 2022, "
                "arXiv:2111.09883; OLMo 2, arXiv:2501.00656, section 3.2). "
                "`unit_offset: true` makes an rmsnorm's gain 1 + weight, its weight initialised to 0: "
                "Gemma's RMSNorm, whose checkpoints store the gain less one (Gemma Team 2024, "
                "arXiv:2403.08295; transformers' GemmaRMSNorm). `bias: false` leaves a layernorm "
                "without its bias, a gain alone (torch.nn.LayerNorm(bias=False); the option "
                "transformers' per-head q / k LayerNorms use); an rmsnorm has no bias.",
    "DropoutSpec": "`dropout: 0.1` is short for `{hidden: 0.1, attention: 0.1}`.",
    "StackSpec": "`cross_attention` exists only in the decoder of an encoder-decoder; null there means "
                 "the same settings as `attention`. `parallel` puts attention and feed-forward side by "
                 "side, both reading the layer's input, their outputs added to it: "
                 "x + Attn(Norm(x)) + FFN(Norm(x)) with `one_norm` (GPT-J, Wang & Komatsuzaki 2021; "
                 "PaLM, Chowdhery et al. 2022, arXiv:2204.02311, section 2), "
                 "x + Attn(Norm(x)) + FFN(FFNNorm(x)) with `two_norms` (GPT-NeoX-20B, Black et al. 2022, "
                 "arXiv:2204.06745, section 2.1; Falcon's new architecture). Pre-norm layers only, "
                 "without cross-attention. `overrides` configures some layers apart from `attention`: "
                 "each entry chooses layers by `every` (from `first`) or by `indices` and gives them their "
                 "own `pattern` and (rotary positions) `rotary_base` and `rotary_scaling`, as Gemma 2 "
                 "interleaves global layers with sliding-window ones (Gemma Team 2024, arXiv:2408.00118, "
                 "section 2) and Gemma 3 gives its global layers a rotary base of 1e6 against 1e4, "
                 "scaled linearly by 8 in the 4B and larger models (arXiv:2503.19786, section 3.2; "
                 "transformers' Gemma3TextConfig rope_parameters). See [LayerOverride](#layeroverride). Where the overrides repeat with a period P (every P "
                 "layers, as Gemma's do), the stack is exported from its first 2P layers traced and the rest "
                 "copied block by block, and can be streamed; where they do not (`indices` that repeat "
                 "nothing), it is exported whole and cannot be streamed. In a decoder-only model, "
                 "a layer whose pattern is `local` (window W: a token sees itself and the W before it) "
                 "keeps a window cache, as Hugging Face's sliding layers do: its present.N.key/.value "
                 "hold the last W positions (fewer while the sequence is shorter), with cache dims of "
                 "their own (`past_sequence_windowW`, `total_sequence_windowW`), while the other layers' "
                 "caches hold the whole sequence (docs/runtime.md, \"The KV cache\"); an encoder-decoder's "
                 "decoder, which takes no mask over its own past, keeps whole caches in every layer. "
                 "`attention` is one of the [kinds of attention](#kinds-of-attention) (multi-head by default, "
                 "or DeepSeek's latent attention), `ffn` one of the [kinds of ffn](#kinds-of-ffn) (dense by "
                 "default, or a mixture of routed experts); an override's `ffn` gives its layers an FFN of their "
                 "own in place of the stack's: see [Mixtures of experts, latent attention and attention sinks]"
                 "(#mixtures-of-experts-latent-attention-and-attention-sinks).",
    "AttentionSpec": "`d_k` defaults to `d_model / heads` and `d_v` to `d_k`; `kv_heads` (grouped-query "
                     "attention) defaults to `heads`. `bias` gives the q, k, v and output projections "
                     "biases; `output_bias` (null: as `bias`) sets the output projection's alone, as Qwen2 "
                     "has biased q, k and v projections and an output projection without (Qwen2 technical "
                     "report, Yang et al. 2024, arXiv:2407.10671, section 2.2). `qk_norm` normalises the "
                     "queries and keys with the model's norm (its kind, eps and unit_offset) before the "
                     "scores and rotary positions: `head` over each head's d_k (Qwen3, arXiv:2505.09388; "
                     "Gemma 3), `full` over all heads' at once (OLMo 2, arXiv:2501.00656); the cache "
                     "holds the normalised keys, the values are not normalised. `scale` replaces scaled_dot's "
                     "1/sqrt(d_k) (Gemma 2 and 3 scale by query_pre_attn_scalar^-1/2); `softcap` caps the "
                     "scores smoothly, softcap * tanh(scores / softcap), after the scaling and before the "
                     "mask (Gemma 2, arXiv:2408.00118, section 2; an lm output's `softcap` does the same "
                     "to the logits). `sinks` gives each head a learned logit that joins every row of its "
                     "softmax and takes no value, so that a query may attend to nothing in particular "
                     "(gpt-oss, its model card arXiv:2508.10925, section 2.1; the attention sinks of Xiao et al. "
                     "2023, arXiv:2309.17453, learned): the weights of the keys sum to less than one. It "
                     "composes with every pattern (gpt-oss's banded layers are `local`), grouped-query heads, "
                     "biases and scores, and latent attention has it too.",
}


def _doc(model: type[BaseModel]) -> str:
    if model.__name__ in NOTES:
        return NOTES[model.__name__]
    doc = model.__doc__ or ""
    if doc.startswith(("Base of every", "A member of a union")) or not doc.strip():
        return ""
    return " ".join(inspect.cleandoc(doc).split())


def _table(model: type[BaseModel]) -> list[str]:
    lines = ["| key | type | default | constraints |", "|---|---|---|---|"]
    for name, info in model.model_fields.items():
        key = info.alias or name
        if key == "kind" and issubclass(model, schema.KindNode):
            continue
        lines.append(f"| `{key}` | {_type(info.annotation)} | {_default(info)} | {_constraints(info)} |")
    return lines if len(lines) > 2 else ["(no other keys)"]


def _union_members(ann: Any) -> list[type[BaseModel]]:
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    return [a for a in typing.get_args(ann) if inspect.isclass(a) and issubclass(a, BaseModel)]


def _examples(group: str) -> list[str]:
    out = []
    for title, base, snippet in EXAMPLES.get(group, []):
        out += [f"Example ({title}, on `{base}`):", "", "```yaml", snippet.rstrip("\n"), "```", ""]
    return out


def _models() -> list[tuple[type[BaseModel], str | None]]:
    """The mappings of the language in document order, with their example group."""
    s = schema
    return [
        (s.ModelSpec, None), (s.VocabSpec, None), (s.NormSpec, "norm"), (s.DropoutSpec, None),
        (s.StackSpec, "stack"), (s.LayerOverride, None), (s.AttentionSpec, "score"), (s.FFNSpec, "activation"),
        (s.SharedExpertSpec, None), (s.TokensSpec, None), (s.ServingSpec, None), (s.RangeSpec, None),
        (s.GenerationServingSpec, None),
    ]


def _kinds() -> list[tuple[str, str, Any, str]]:
    s = schema
    return [
        ("position", "`position:` (top level)", s.PositionSpec, "position"),
        ("rotary scaling", "`position.scaling:` (rotary positions) and an override's `rotary_scaling:`",
         s.RotaryScaling, "scaling"),
        ("pattern", "`attention.pattern:`", s.PatternSpec, "pattern"),
        ("attention", "a stack's `attention:` and `cross_attention:`", s.AttentionKind, "attention"),
        ("ffn", "a stack's `ffn:` and an override's", s.FFNKind, "ffn"),
        ("router", "a `moe` FFN's `router:`", s.RouterSpec, "router"),
        ("outputs", "each item of `outputs:`", s.OutputSpec, "outputs"),
    ]


def render() -> str:
    lines = [
        "# The spec language (v1): reference",
        "",
        "<!-- Generated from specc/spec/schema.py by specc/spec/language_doc.py; do not edit by hand.",
        f"     Regenerate: {REGENERATE} -->",
        "",
        "A spec is a YAML mapping. Every mapping forbids unknown keys (a misspelt key is an error",
        "with a suggestion), values are strict (`\"8\"` is not a number, `yes` is not `true`), and a",
        "spec may `extends:` a catalog name or a file, overriding keys mapping by mapping. The rules",
        "that relate several fields are listed in [errors.md](errors.md#cross-field-rules).",
        "Every example on this page is loaded and resolved by tests/spec/test_reference_doc.py.",
        "",
    ]
    for model, group in _models():
        lines += [f"## {model.__name__}", ""]
        if _doc(model):
            lines += [_doc(model), ""]
        lines += _table(model) + [""]
        if group == "score":
            lines += ["`merge` examples:", ""] + _examples("merge")
            lines += ["`score` examples:", ""]
        lines += _examples(group) if group else []
    for anchor, where, union, group in _kinds():
        lines += [f"## Kinds of {anchor}", "", f"Chosen by `kind:` in {where}.", ""]
        examples = {t: (b, y) for t, b, y in EXAMPLES[group]}
        described = {model for model, _ in _models()}
        for member in _union_members(union):
            kind = typing.get_args(member.model_fields["kind"].annotation)[0]
            lines += [f"### kind: {kind}", ""]
            if member in described:  # its table is above, under its own name
                lines += [f"The keys of [{member.__name__}](#{member.__name__.lower()}).", ""]
            else:
                if _doc(member):
                    lines += [_doc(member), ""]
                lines += _table(member) + [""]
            if kind in examples:
                base, snippet = examples[kind]
                lines += [f"Example (on `{base}`):", "", "```yaml", snippet.rstrip("\n"), "```", ""]
    lines += GUIDE.splitlines()
    return "\n".join(lines).rstrip("\n") + "\n"


if __name__ == "__main__":
    print(render(), end="")
