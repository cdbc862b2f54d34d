"""A resolved spec as a Hugging Face config.json: a family's table (families.py) read backwards,
kept only where importing it again gives back the spec.

Contract: `hf_config(r)` is a Described: `config`, the config.json of the first family (in the
tables' order) whose config imports (convert.config_to_spec, the importer's own reading, itself
checked against transformers) as a spec that resolves to r's computation; else None, with `why`
naming what no family can say. So a config.json specc writes never describes another model than
the one built. Compared: every resolved key but the ones that do not change what the graph
computes (name, description, extends, weights, serving, dropout, tokens: the special ids go to
the config where the family has fields for them, and to generation_config.json).

How a config is made: each field of the table is the spec's value at its key, or the config value
the field's converter maps onto it (an activation name through the family's lookup table, a bool
for a spec string); the family's own rules (its `extra`, which no table states backwards) are
inverted for the families below (INVERSE), and every other family is tried with its table alone.
Pure data: no file is read, no torch imported.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from specc.errors import SpecError
from specc.importers.hf.checkpoint import CheckpointError
from specc.importers.hf.convert import config_to_spec
from specc.importers.hf.families import ACTIVATIONS, FAMILIES, GATED, GEMMA_GATED, T5_FFN
from specc.importers.hf.table import MISSING, Family
from specc.spec.dump import spec_to_data
from specc.spec.load import loads_spec
from specc.spec.resolve import ResolvedSpec, resolve
from specc.spec.yamlio import dump_yaml

# resolved keys that do not change what a graph computes (see the module's contract)
IGNORED = ("specc", "name", "description", "extends", "weights", "serving", "dropout", "tokens")

# config values a converter may map onto a spec value (besides the spec's own value and the
# field's default): the lookup tables' names and the two bools
_CANDIDATES = (True, False, *ACTIVATIONS, *GATED, *GEMMA_GATED, *T5_FFN)


@dataclass(frozen=True)
class Described:
    """hf_config's answer: the config (None where no family describes the spec) and, then, why."""

    config: dict | None
    why: str = ""


def _get(data: dict, key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _config_value(field, value: Any) -> Any:
    """The config value the field reads as VALUE: the value itself, the field's default or a
    candidate, the first the field's type admits and its converter maps onto VALUE; MISSING when
    none does."""
    for candidate in (value, field.default, *_CANDIDATES):
        if candidate is MISSING or not field.kind.ok(candidate):
            continue
        try:
            if field.convert(candidate) == value and type(field.convert(candidate)) is type(value):
                return candidate
        except (ValueError, TypeError, KeyError):
            continue
    return MISSING


# --- the families' own rules, backwards ---------------------------------------------------------


def _gpt2(spec: dict, config: dict) -> None:
    """GPT-2: n_inner and scale_attn_weights (what _gpt2_extra reads)."""
    config["n_inner"] = spec["decoder"]["ffn"]["d_ff"]
    config["scale_attn_weights"] = spec["decoder"]["attention"]["score"] == "scaled_dot"


def _rotary(spec: dict, config: dict) -> None:
    """LLaMA and the families that read its rules: head_dim, rope_theta, partial_rotary_factor
    (where not 1), rope_scaling (where the spec scales its frequencies)."""
    attention = spec["decoder"]["attention"]
    config["head_dim"] = attention["d_k"]
    position = spec["position"]
    if position.get("kind") == "rotary":
        config["rope_theta"] = position["base"]
        if position["fraction"] != 1.0:
            config["partial_rotary_factor"] = position["fraction"]
        scaling = position.get("scaling") or {}
        if scaling.get("kind", "none") != "none":
            config["rope_scaling"] = _rope_scaling(scaling)


# position.scaling's keys by the name transformers gives them in rope_scaling
_ROPE_KEYS = {"original_max_length": "original_max_position_embeddings"}


def _rope_scaling(scaling: dict) -> dict:
    """transformers' rope_scaling for a spec's position.scaling (what the importer's _scaling reads):
    rope_type = the kind, each parameter under its transformers name."""
    return {"rope_type": scaling["kind"],
            **{_ROPE_KEYS.get(k, k): v for k, v in scaling.items() if k != "kind" and v is not None}}


def _mistral(spec: dict, config: dict) -> None:
    """Mistral: LLaMA's rules and its sliding_window (a window W is a local pattern of W - 1)."""
    _rotary(spec, config)
    pattern = spec["decoder"]["attention"]["pattern"]
    config["sliding_window"] = pattern["window"] + 1 if pattern.get("kind") == "local" else None


def _llama(spec: dict, config: dict) -> None:
    """LLaMA: as Mistral without a window (transformers' LlamaConfig has none: a local pattern is
    Mistral's)."""
    if spec["decoder"]["attention"]["pattern"].get("kind") != "full":
        raise ValueError("a LLaMA config attends to every earlier token")
    _rotary(spec, config)


def _neox(spec: dict, config: dict) -> None:
    """GPT-NeoX: rotary_emb_base, rotary_pct, rope_scaling and use_parallel_residual (its two
    norms side by side), what _neox_extra reads."""
    position = spec["position"]
    if position.get("kind") != "rotary":
        raise ValueError("GPT-NeoX rotates its queries and keys")
    config["rotary_emb_base"] = position["base"]
    config["rotary_pct"] = position["fraction"]
    scaling = position.get("scaling") or {}
    if scaling.get("kind", "none") != "none":
        config["rope_scaling"] = _rope_scaling(scaling)
    config["use_parallel_residual"] = spec["decoder"].get("parallel") == "two_norms"


def _stablelm(spec: dict, config: dict) -> None:
    """StableLM: LLaMA's rules, its rotated fraction always written (absent, StableLM reads 0.25),
    and use_parallel_residual (one norm feeding attention and feed-forward side by side)."""
    _llama(spec, config)
    config["partial_rotary_factor"] = spec["position"]["fraction"]
    config["use_parallel_residual"] = spec["decoder"].get("parallel") == "one_norm"


def _bloom(spec: dict, config: dict) -> None:
    """BLOOM: hidden_size and seq_length, the longest input (what _bloom_extra reads)."""
    config["hidden_size"] = spec["d_model"]
    config["seq_length"] = spec["position"]["max_length"]


def _falcon(spec: dict, config: dict) -> None:
    """Falcon: hidden_size, ffn_hidden_size, bias, its rotary base and scaling, and the layer form
    (what _falcon_extra reads): two norms side by side, or grouped key-value heads, are the new
    architecture's; one shared key-value head (multi_query) or one per head, the older layers',
    side by side from one norm (parallel_attn) or one after the other."""
    decoder = spec["decoder"]
    attention = decoder["attention"]
    config["hidden_size"] = spec["d_model"]
    config["ffn_hidden_size"] = decoder["ffn"]["d_ff"]
    if attention["bias"] != decoder["ffn"]["bias"]:
        raise ValueError("Falcon's bias is one flag for every projection")
    config["bias"] = attention["bias"]
    position = spec["position"]
    if position.get("kind") != "rotary":
        raise ValueError("Falcon rotates its queries and keys")
    config["rope_theta"] = position["base"]
    scaling = position.get("scaling") or {}
    if scaling.get("kind", "none") != "none":
        config["rope_scaling"] = _rope_scaling(scaling)
    parallel, heads, kv = decoder.get("parallel", "none"), attention["heads"], attention["kv_heads"]
    if parallel == "two_norms" or (parallel == "one_norm" and kv not in (1, heads)):
        config.update(new_decoder_architecture=True, num_kv_heads=kv, parallel_attn=True,
                      num_ln_in_parallel_attn=2 if parallel == "two_norms" else 1)
    elif kv in (1, heads):
        config.update(new_decoder_architecture=False, multi_query=kv == 1, parallel_attn=parallel == "one_norm")
    else:
        raise ValueError("Falcon's older layers have one key-value head or one per head")


def _seq2seq(model_type: str) -> Callable[[dict, dict], None]:
    """BART / mBART (learned positions) and Marian / Pegasus (fixed sinusoids in the halves
    layout): max_position_embeddings, and a target vocabulary of its own (what _seq2seq_extra
    reads); the round trip checks the norms each model type fixes."""
    learned = model_type in ("bart", "mbart")

    def inverse(spec: dict, config: dict) -> None:
        position = spec["position"]
        if position.get("kind") != ("learned" if learned else "sinusoidal") or (
                not learned and position.get("layout") != "halves"):
            raise ValueError(f"{model_type}'s positions are not the spec's")
        config["max_position_embeddings"] = position["max_length"]
        vocab = spec["vocab"]
        if not vocab.get("share", True):
            config["share_encoder_decoder_embeddings"] = False
            config["decoder_vocab_size"] = vocab.get("target_size") or vocab["size"]

    return inverse


def _t5(spec: dict, config: dict) -> None:
    """T5: both stacks' sizes and activation, the longest input and the decoder's start (what
    _t5_extra reads); one head count and head size for both stacks, as T5's config has."""
    enc, dec = spec["encoder"], spec["decoder"]
    config["num_layers"] = enc["layers"]
    config["num_decoder_layers"] = dec["layers"]
    config["num_heads"] = enc["attention"]["heads"]
    config["d_kv"] = enc["attention"]["d_k"]
    config["d_ff"] = enc["ffn"]["d_ff"]
    config["feed_forward_proj"] = next(k for k, v in T5_FFN.items() if v == enc["ffn"]["activation"])
    config["n_positions"] = spec["position"]["max_length"]
    if spec["tokens"].get("decoder_start") is not None:  # else T5's own: the pad token
        config["decoder_start_token_id"] = spec["tokens"]["decoder_start"]


INVERSE: dict[str, Callable[[dict, dict], None]] = {
    "gpt2": _gpt2, "llama": _llama, "mistral": _mistral, "qwen2": _llama, "qwen3": _llama, "gemma": _llama,
    "gpt_neox": _neox, "stablelm": _stablelm, "bloom": _bloom, "falcon": _falcon, **{mt: _seq2seq(mt) for mt in ("bart", "mbart", "marian", "pegasus")}, "t5": _t5,
}


class _Tensors(Mapping):
    """What the round trip passes for a checkpoint's tensors: a head that asks whether a tensor is
    there (BERT's pooler) is told `present`; the count is large enough for any layer count."""

    def __init__(self, present: bool):
        self.present = present

    def __contains__(self, name: object) -> bool:
        return self.present

    def __getitem__(self, name: str):
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return sys.maxsize


def _computed(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in IGNORED}


def _attempts(fam: Family, spec: dict) -> Iterator[dict]:
    """Each config of FAM for SPEC: one per model type and head the family has."""
    for model_type in fam.model_types:
        config: dict = {}
        missing = False
        for f in fam.fields:
            value = _config_value(f, _get(spec, f.key))
            if value is MISSING:
                missing = True
                break
            config[f.name] = value
        if missing:
            return
        inverse = INVERSE.get(model_type)
        if inverse is not None:
            try:
                inverse(spec, config)
            except (ValueError, KeyError, TypeError):
                continue
        for arch in _heads(fam, model_type):
            yield {"model_type": model_type, "architectures": [arch], **config}


def _heads(fam: Family, model_type: str) -> list[str]:
    """The family's heads that a config of MODEL_TYPE names (LlamaForCausalLM for llama,
    MistralForCausalLM for mistral), else all of them (one head for several types)."""
    prefix = model_type.replace("_", "").lower()
    own = [arch for arch in fam.heads if arch.lower().startswith(prefix)]
    return own or list(fam.heads)


def _imports_as(config: dict, name: str, want: dict) -> bool:
    """Whether CONFIG imports as a spec that computes WANT."""
    for present in (True, False):
        try:
            data = config_to_spec(config, _Tensors(present), name)
            spec = loads_spec(dump_yaml(data))
            got = spec_to_data(resolve(spec).spec)
        except (CheckpointError, SpecError, ValueError, KeyError, TypeError):
            continue
        if _computed(got) == want:
            return True
    return False


def hf_config(r: ResolvedSpec) -> Described:
    """The config.json of the first family that describes R (the module's contract)."""
    spec = spec_to_data(r.spec)
    want = _computed(spec)
    tried = []
    for fam in FAMILIES:
        if fam.architecture != r.architecture:
            continue
        tried.append("/".join(fam.model_types))
        for config in _attempts(fam, spec):
            if _imports_as(config, r.name, want):
                return Described(config)
    families = ", ".join(tried) if tried else "none"
    return Described(None, f"no Hugging Face family computes this {r.architecture} as specc does "
                           f"(tried: {families})")
