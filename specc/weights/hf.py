"""Import a Hugging Face checkpoint folder: config.json + weights -> a spec and a safetensors file
in specc's parameter names (docs/weights.md), or a refusal naming what specc cannot express.

Each family is data (docs/import.md prints these tables):

- FIELDS: spec key <- config field (with a default where Hugging Face has one, and a converter);
- FIXED: what the family always is (GPT-2 is pre-norm with learned positions, ...);
- REFUSE: config values specc cannot express, each with the values it can;
- HEADS: the `architectures` entry -> the spec's outputs;
- NAMES: specc parameter name <- checkpoint tensor name(s) (+ a transform);
- IGNORE: checkpoint buffers that carry no weights (causal-mask buffers, rotary inv_freq).

Every parameter of the spec must be filled and every tensor of the checkpoint used (or named
in IGNORE), so a model never runs computing something else. Checkpoints are read from
safetensors, or from pytorch_model.bin with torch.load(weights_only=True), never plain pickle.
"""
from __future__ import annotations

import copy
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from specc.errors import SpeccError
from specc.fileio import write_atomic


class CheckpointError(SpeccError):
    """A checkpoint folder that cannot be imported, or a config specc cannot express."""


MISSING = object()

# Hugging Face activation names (transformers' ACT2FN) that specc computes exactly.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}
# LLaMA's MLP is act(gate(x)) * up(x): the gated forms
GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_python": "geglu"}


def _lookup(table: dict, what: str) -> Callable[[Any], Any]:
    def convert(value):
        if value not in table:
            raise ValueError(f"{what} {value!r} is not one specc computes exactly; it supports "
                             + ", ".join(map(repr, sorted(table))))
        return table[value]
    return convert


def _same(v):
    return v


@dataclass(frozen=True)
class Field_:
    key: str                   # dotted spec key
    name: str                  # config field
    default: Any = MISSING     # Hugging Face's default when the field is absent
    convert: Callable[[Any], Any] = _same


@dataclass(frozen=True)
class Refuse:
    name: str                  # config field
    allowed: tuple             # the values specc can express
    default: Any = None        # Hugging Face's default when absent
    why: str = ""


@dataclass(frozen=True)
class Name:
    specc: str                 # template: {i} = layer; {s} = stack; {head} = output name
    hf: tuple[str, ...]        # candidates, the first present wins
    transform: str = "copy"    # copy | transpose | qkv0 / qkv1 / qkv2 (GPT-2's fused Conv1D) | offset2
    stack: str = ""            # "encoder" / "decoder": {i} runs over that stack's layers


@dataclass(frozen=True)
class Family:
    model_types: tuple[str, ...]
    architecture: str
    fields: tuple[Field_, ...]
    fixed: dict
    refuse: tuple[Refuse, ...]
    heads: dict[str, Callable[[dict, dict], list]]
    names: tuple[Name, ...]
    prefixes: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    # tensors that must be zero (specc has no place for them), and tables that must equal a formula
    zero: tuple[str, ...] = ()
    extra: Callable[[dict, dict], None] | None = None  # spec <- config adjustments that are not 1:1


def _linear(specc: str, hf: str, stack: str = "", transform: str = "copy", bias: bool = True) -> tuple[Name, ...]:
    rows = (Name(specc + ".weight", (hf + ".weight",), transform, stack),)
    if bias:
        rows += (Name(specc + ".bias", (hf + ".bias",), "copy", stack),)
    return rows


def _norm(specc: str, hf: str, stack: str = "", bias: bool = True) -> tuple[Name, ...]:
    return _linear(specc, hf, stack, bias=bias)


# --- BERT ---------------------------------------------------------------------------------------


def _bert_heads_model(cfg: dict, tensors: dict) -> list:
    outs = [{"kind": "hidden", "name": "last_hidden_state"}]
    if _has(tensors, "pooler.dense.weight", ("bert.", "")):
        outs.append({"kind": "pooled", "name": "pooler_output", "pool": "first", "pooler": "tanh"})
    return outs


def _classes(cfg: dict) -> int:
    if "id2label" in cfg:
        return len(cfg["id2label"])
    return int(cfg.get("num_labels", 2))


BERT = Family(
    model_types=("bert",),
    architecture="encoder",
    fields=(
        Field_("d_model", "hidden_size"),
        Field_("vocab.size", "vocab_size"),
        Field_("vocab.type_size", "type_vocab_size", 2),
        Field_("vocab.tie_output", "tie_word_embeddings", True),
        Field_("position.max_length", "max_position_embeddings"),
        Field_("norm.eps", "layer_norm_eps", 1e-12),
        Field_("dropout.hidden", "hidden_dropout_prob", 0.1),
        Field_("dropout.attention", "attention_probs_dropout_prob", 0.1),
        Field_("encoder.layers", "num_hidden_layers"),
        Field_("encoder.attention.heads", "num_attention_heads"),
        Field_("encoder.ffn.d_ff", "intermediate_size"),
        Field_("encoder.ffn.activation", "hidden_act", "gelu", _lookup(ACTIVATIONS, "hidden_act")),
        Field_("tokens.pad", "pad_token_id", None),
    ),
    fixed={"architecture": "encoder", "vocab": {"norm": True},
           "position": {"kind": "learned"}, "norm": {"kind": "layernorm", "placement": "post"},
           "encoder": {"attention": {"bias": True}, "ffn": {"bias": True}}},
    refuse=(
        Refuse("position_embedding_type", ("absolute",), "absolute",
               "relative_key / relative_key_query are not Shaw et al.'s clipped relative positions"),
        Refuse("is_decoder", (False,), False, "a BERT used as a causal decoder"),
        Refuse("add_cross_attention", (False,), False, "BERT layers with cross-attention"),
    ),
    heads={
        "BertModel": _bert_heads_model,
        "BertForMaskedLM": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"},
                                           {"kind": "mlm", "name": "logits"}],
        "BertForSequenceClassification": lambda cfg, t: [
            {"kind": "hidden", "name": "last_hidden_state"},
            {"kind": "classifier", "name": "logits", "classes": _classes(cfg), "pool": "first", "pooler": "tanh"}],
    },
    names=(
        Name("embeddings.tokens.weight", ("embeddings.word_embeddings.weight",)),
        Name("embeddings.types.weight", ("embeddings.token_type_embeddings.weight",)),
        Name("encoder.positions.weight", ("embeddings.position_embeddings.weight",)),
        *_norm("encoder.embed_norm", "embeddings.LayerNorm"),
        *_linear("encoder.layers.{i}.attention.q", "encoder.layer.{i}.attention.self.query", "encoder"),
        *_linear("encoder.layers.{i}.attention.k", "encoder.layer.{i}.attention.self.key", "encoder"),
        *_linear("encoder.layers.{i}.attention.v", "encoder.layer.{i}.attention.self.value", "encoder"),
        *_linear("encoder.layers.{i}.attention.o", "encoder.layer.{i}.attention.output.dense", "encoder"),
        *_norm("encoder.layers.{i}.attention_norm", "encoder.layer.{i}.attention.output.LayerNorm", "encoder"),
        *_linear("encoder.layers.{i}.ffn.up", "encoder.layer.{i}.intermediate.dense", "encoder"),
        *_linear("encoder.layers.{i}.ffn.down", "encoder.layer.{i}.output.dense", "encoder"),
        *_norm("encoder.layers.{i}.ffn_norm", "encoder.layer.{i}.output.LayerNorm", "encoder"),
        *_linear("heads.{head}.pooler", "pooler.dense"),
        *_linear("heads.{head}.transform", "cls.predictions.transform.dense"),
        *_norm("heads.{head}.norm", "cls.predictions.transform.LayerNorm"),
        Name("heads.{head}.bias", ("cls.predictions.bias", "cls.predictions.decoder.bias")),
        Name("heads.{head}.proj.weight", ("cls.predictions.decoder.weight", "classifier.weight")),
        Name("heads.{head}.proj.bias", ("classifier.bias",)),
    ),
    prefixes=("bert.", ""),
    ignore=(r"embeddings\.position_ids$", r"embeddings\.token_type_ids$"),
)


# --- GPT-2 --------------------------------------------------------------------------------------


def _gpt2_extra(spec: dict, cfg: dict) -> None:
    """`decoder.ffn.d_ff` = `n_inner`, else 4 x `n_embd`; `decoder.attention.score` = scaled_dot,
    or dot when `scale_attn_weights` is false."""
    d_ff = cfg.get("n_inner")
    _set(spec, "decoder.ffn.d_ff", d_ff if d_ff is not None else 4 * cfg["n_embd"])
    _set(spec, "decoder.attention.score", "scaled_dot" if cfg.get("scale_attn_weights", True) else "dot")


GPT2 = Family(
    model_types=("gpt2",),
    architecture="decoder",
    fields=(
        Field_("d_model", "n_embd"),
        Field_("vocab.size", "vocab_size"),
        Field_("vocab.tie_output", "tie_word_embeddings", True),
        Field_("position.max_length", "n_positions"),
        Field_("norm.eps", "layer_norm_epsilon", 1e-5),
        Field_("dropout.hidden", "resid_pdrop", 0.1),
        Field_("dropout.attention", "attn_pdrop", 0.1),
        Field_("decoder.layers", "n_layer"),
        Field_("decoder.attention.heads", "n_head"),
        Field_("decoder.ffn.activation", "activation_function", "gelu_new", _lookup(ACTIVATIONS, "activation_function")),
        Field_("tokens.bos", "bos_token_id", None),
        Field_("tokens.eos", "eos_token_id", None),
        Field_("tokens.pad", "pad_token_id", None),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "learned"},
           "norm": {"kind": "layernorm", "placement": "pre", "final": True},
           "decoder": {"attention": {"bias": True}, "ffn": {"bias": True}}},
    refuse=(
        Refuse("scale_attn_by_inverse_layer_idx", (False,), False, "scores divided by the layer index"),
        Refuse("add_cross_attention", (False,), False, "GPT-2 layers with cross-attention"),
    ),
    heads={"GPT2LMHeadModel": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("wte.weight",)),
        Name("decoder.positions.weight", ("wpe.weight",)),
        *_norm("decoder.layers.{i}.attention_norm", "h.{i}.ln_1", "decoder"),
        Name("decoder.layers.{i}.attention.q.weight", ("h.{i}.attn.c_attn.weight",), "qkv0", "decoder"),
        Name("decoder.layers.{i}.attention.k.weight", ("h.{i}.attn.c_attn.weight",), "qkv1", "decoder"),
        Name("decoder.layers.{i}.attention.v.weight", ("h.{i}.attn.c_attn.weight",), "qkv2", "decoder"),
        Name("decoder.layers.{i}.attention.q.bias", ("h.{i}.attn.c_attn.bias",), "qkv0", "decoder"),
        Name("decoder.layers.{i}.attention.k.bias", ("h.{i}.attn.c_attn.bias",), "qkv1", "decoder"),
        Name("decoder.layers.{i}.attention.v.bias", ("h.{i}.attn.c_attn.bias",), "qkv2", "decoder"),
        *_linear("decoder.layers.{i}.attention.o", "h.{i}.attn.c_proj", "decoder", "transpose"),
        *_norm("decoder.layers.{i}.ffn_norm", "h.{i}.ln_2", "decoder"),
        *_linear("decoder.layers.{i}.ffn.up", "h.{i}.mlp.c_fc", "decoder", "transpose"),
        *_linear("decoder.layers.{i}.ffn.down", "h.{i}.mlp.c_proj", "decoder", "transpose"),
        *_norm("decoder.final_norm", "ln_f"),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("transformer.", ""),
    ignore=(r"h\.\d+\.attn\.(masked_)?bias$",),
    extra=_gpt2_extra,
)


# --- LLaMA --------------------------------------------------------------------------------------


def _llama_extra(spec: dict, cfg: dict) -> None:
    """`decoder.attention.d_k` = `head_dim` where it is not hidden_size / heads; `position.base` =
    `rope_theta` (or `rope_parameters.rope_theta`); `position.fraction` = `partial_rotary_factor`;
    a `rope_scaling` / `rope_parameters` rope_type other than default is refused."""
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim")
    if head_dim is not None and head_dim * heads != cfg["hidden_size"]:
        _set(spec, "decoder.attention.d_k", head_dim)
    scaling = cfg.get("rope_scaling") or {}
    params = cfg.get("rope_parameters") or {}
    kind = scaling.get("rope_type", scaling.get("type")) or params.get("rope_type") or "default"
    if kind != "default":
        field_name = "rope_scaling" if scaling else "rope_parameters"
        raise ValueError(f"{field_name}.rope_type {kind!r}: specc implements plain rotary positions "
                         "(rope_type 'default') only")
    theta = cfg.get("rope_theta", params.get("rope_theta", 10000.0))
    _set(spec, "position.base", float(theta))
    fraction = cfg.get("partial_rotary_factor", params.get("partial_rotary_factor", 1.0))
    _set(spec, "position.fraction", float(fraction))


LLAMA = Family(
    model_types=("llama",),
    architecture="decoder",
    fields=(
        Field_("d_model", "hidden_size"),
        Field_("vocab.size", "vocab_size"),
        Field_("vocab.tie_output", "tie_word_embeddings", False),
        Field_("position.max_length", "max_position_embeddings", 2048),
        Field_("norm.eps", "rms_norm_eps", 1e-6),
        Field_("dropout.attention", "attention_dropout", 0.0),
        Field_("decoder.layers", "num_hidden_layers"),
        Field_("decoder.attention.heads", "num_attention_heads"),
        Field_("decoder.attention.kv_heads", "num_key_value_heads", None),
        Field_("decoder.attention.bias", "attention_bias", False),
        Field_("decoder.ffn.d_ff", "intermediate_size"),
        Field_("decoder.ffn.activation", "hidden_act", "silu", _lookup(GATED, "hidden_act")),
        Field_("decoder.ffn.bias", "mlp_bias", False),
        Field_("tokens.bos", "bos_token_id", None),
        Field_("tokens.eos", "eos_token_id", None),
        Field_("tokens.pad", "pad_token_id", None),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "rotary"}, "dropout": {"hidden": 0.0},
           "norm": {"kind": "rmsnorm", "placement": "pre", "final": True}},
    refuse=(),
    heads={"LlamaForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embed_tokens.weight",)),
        *_linear("decoder.layers.{i}.attention.q", "layers.{i}.self_attn.q_proj", "decoder"),
        *_linear("decoder.layers.{i}.attention.k", "layers.{i}.self_attn.k_proj", "decoder"),
        *_linear("decoder.layers.{i}.attention.v", "layers.{i}.self_attn.v_proj", "decoder"),
        *_linear("decoder.layers.{i}.attention.o", "layers.{i}.self_attn.o_proj", "decoder"),
        *_norm("decoder.layers.{i}.attention_norm", "layers.{i}.input_layernorm", "decoder", bias=False),
        *_norm("decoder.layers.{i}.ffn_norm", "layers.{i}.post_attention_layernorm", "decoder", bias=False),
        *_linear("decoder.layers.{i}.ffn.gate", "layers.{i}.mlp.gate_proj", "decoder"),
        *_linear("decoder.layers.{i}.ffn.up", "layers.{i}.mlp.up_proj", "decoder"),
        *_linear("decoder.layers.{i}.ffn.down", "layers.{i}.mlp.down_proj", "decoder"),
        *_norm("decoder.final_norm", "norm", bias=False),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("model.", ""),
    ignore=(r"rotary_emb\.inv_freq$",),
    extra=_llama_extra,
)


# --- Marian / BART / mBART / Pegasus: encoder-decoders ------------------------------------------


def _seq2seq_extra(spec: dict, cfg: dict) -> None:
    """By `model_type`: bart / mbart have learned positions (the checkpoint's first 2 rows are
    an offset and are dropped) and an embedding LayerNorm; marian / pegasus fixed sinusoids in
    the halves layout (a stored table must equal the formula). mbart / pegasus are pre-norm with
    a final norm per stack, bart / marian post-norm; LayerNorm eps 1e-5. `decoder_vocab_size`
    other than `vocab_size`, or `share_encoder_decoder_embeddings: false`, gives
    `vocab.share: false` and `vocab.target_size`. `final_logits_bias` must be zero."""
    mt = cfg["model_type"]
    if mt in ("bart", "mbart"):
        # BART's learned table has 2 extra rows in front: position p reads row p + 2
        spec["position"] = {"kind": "learned", "max_length": cfg["max_position_embeddings"]}
    else:  # marian, pegasus: fixed sinusoids, every sine before the cosines
        spec["position"] = {"kind": "sinusoidal", "layout": "halves", "base": 10000.0,
                            "max_length": cfg["max_position_embeddings"]}
    pre = mt in ("mbart", "pegasus")
    spec["norm"] = {"kind": "layernorm", "placement": "pre" if pre else "post", "eps": 1e-5, "final": pre}
    _set(spec, "vocab.norm", mt in ("bart", "mbart"))
    target = cfg.get("decoder_vocab_size") or cfg["vocab_size"]
    share = cfg.get("share_encoder_decoder_embeddings", True)
    if target != cfg["vocab_size"] or not share:
        _set(spec, "vocab.share", False)
        _set(spec, "vocab.target_size", target)


_ENC = "encoder.layers.{i}."
_DEC = "decoder.layers.{i}."


def _attn(specc: str, hf: str, stack: str) -> tuple[Name, ...]:
    return (*_linear(specc + ".q", hf + ".q_proj", stack), *_linear(specc + ".k", hf + ".k_proj", stack),
            *_linear(specc + ".v", hf + ".v_proj", stack), *_linear(specc + ".o", hf + ".out_proj", stack))


SEQ2SEQ = Family(
    model_types=("bart", "mbart", "marian", "pegasus"),
    architecture="encoder-decoder",
    fields=(
        Field_("d_model", "d_model"),
        Field_("vocab.size", "vocab_size"),
        Field_("vocab.tie_output", "tie_word_embeddings", True),
        Field_("vocab.scale", "scale_embedding", False, lambda v: "sqrt_d_model" if v else "none"),
        Field_("dropout.hidden", "dropout", 0.1),
        Field_("dropout.attention", "attention_dropout", 0.0),
        Field_("encoder.layers", "encoder_layers"),
        Field_("encoder.attention.heads", "encoder_attention_heads"),
        Field_("encoder.ffn.d_ff", "encoder_ffn_dim"),
        Field_("encoder.ffn.activation", "activation_function", "gelu", _lookup(ACTIVATIONS, "activation_function")),
        Field_("decoder.layers", "decoder_layers"),
        Field_("decoder.attention.heads", "decoder_attention_heads"),
        Field_("decoder.ffn.d_ff", "decoder_ffn_dim"),
        Field_("decoder.ffn.activation", "activation_function", "gelu", _lookup(ACTIVATIONS, "activation_function")),
        Field_("tokens.bos", "bos_token_id", None),
        Field_("tokens.eos", "eos_token_id", None),
        Field_("tokens.pad", "pad_token_id", None),
        Field_("tokens.decoder_start", "decoder_start_token_id", None),
    ),
    fixed={"architecture": "encoder-decoder",
           "encoder": {"attention": {"bias": True}, "ffn": {"bias": True}},
           "decoder": {"attention": {"bias": True}, "ffn": {"bias": True}}},
    refuse=(
        Refuse("add_final_layer_norm", (False, None), None, "an old BART option"),
        Refuse("normalize_before", (None,), None, "an old BART/Marian option; current configs fix the placement by model_type"),
        Refuse("static_position_embeddings", (None,), None, "an old BART/Marian option"),
        Refuse("add_bias_logits", (False, None), None, "a bias on the output logits"),
    ),
    heads={name: (lambda cfg, t: [{"kind": "lm", "name": "logits"}])
           for name in ("BartForConditionalGeneration", "MBartForConditionalGeneration", "MarianMTModel",
                        "PegasusForConditionalGeneration")},
    names=(
        Name("embeddings.tokens.weight", ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")),
        Name("embeddings.target_tokens.weight", ("decoder.embed_tokens.weight",)),
        Name("encoder.positions.weight", ("encoder.embed_positions.weight",), "offset2"),
        Name("decoder.positions.weight", ("decoder.embed_positions.weight",), "offset2"),
        *_norm("encoder.embed_norm", "encoder.layernorm_embedding"),
        *_norm("decoder.embed_norm", "decoder.layernorm_embedding"),
        *_attn(_ENC + "attention", "encoder.layers.{i}.self_attn", "encoder"),
        *_norm(_ENC + "attention_norm", "encoder.layers.{i}.self_attn_layer_norm", "encoder"),
        *_linear(_ENC + "ffn.up", "encoder.layers.{i}.fc1", "encoder"),
        *_linear(_ENC + "ffn.down", "encoder.layers.{i}.fc2", "encoder"),
        *_norm(_ENC + "ffn_norm", "encoder.layers.{i}.final_layer_norm", "encoder"),
        *_attn(_DEC + "attention", "decoder.layers.{i}.self_attn", "decoder"),
        *_norm(_DEC + "attention_norm", "decoder.layers.{i}.self_attn_layer_norm", "decoder"),
        *_attn(_DEC + "cross_attention", "decoder.layers.{i}.encoder_attn", "decoder"),
        *_norm(_DEC + "cross_attention_norm", "decoder.layers.{i}.encoder_attn_layer_norm", "decoder"),
        *_linear(_DEC + "ffn.up", "decoder.layers.{i}.fc1", "decoder"),
        *_linear(_DEC + "ffn.down", "decoder.layers.{i}.fc2", "decoder"),
        *_norm(_DEC + "ffn_norm", "decoder.layers.{i}.final_layer_norm", "decoder"),
        *_norm("encoder.final_norm", "encoder.layer_norm"),
        *_norm("decoder.final_norm", "decoder.layer_norm"),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("model.", ""),
    zero=("final_logits_bias",),
    extra=_seq2seq_extra,
)

FAMILIES = (BERT, GPT2, LLAMA, SEQ2SEQ)
_BY_TYPE = {mt: fam for fam in FAMILIES for mt in fam.model_types}


# --- reading a checkpoint folder ----------------------------------------------------------------


def read_checkpoint(src: str | os.PathLike) -> tuple[dict, dict]:
    """(config, {name: tensor}) from a folder: config.json plus model.safetensors (or a sharded
    model.safetensors.index.json), else pytorch_model.bin (weights_only=True, or its index)."""
    import torch

    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: not a checkpoint folder")
    cfg_path = src / "config.json"
    try:
        config = json.loads(cfg_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{src}: no config.json") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{cfg_path}: cannot read it ({exc})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{cfg_path}: not a JSON object")

    def shards(index: Path) -> list[Path]:
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: not a weights index ({exc})") from None
        return [src / f for f in files]

    if (src / "model.safetensors").is_file():
        files, kind = [src / "model.safetensors"], "safetensors"
    elif (src / "model.safetensors.index.json").is_file():
        files, kind = shards(src / "model.safetensors.index.json"), "safetensors"
    elif (src / "pytorch_model.bin").is_file():
        files, kind = [src / "pytorch_model.bin"], "bin"
    elif (src / "pytorch_model.bin.index.json").is_file():
        files, kind = shards(src / "pytorch_model.bin.index.json"), "bin"
    else:
        raise CheckpointError(f"{src}: no model.safetensors or pytorch_model.bin (nor a sharded index)")
    tensors: dict[str, Any] = {}
    for f in files:
        if kind == "safetensors":
            from specc.weights.io import read_safetensors
            from specc.errors import WeightsError
            try:
                tensors.update(read_safetensors(f))
            except WeightsError as exc:
                raise CheckpointError(str(exc)) from None
        else:
            try:
                # weights_only: tensors and plain containers only; never runs pickled code
                state = torch.load(f, map_location="cpu", weights_only=True)
            except FileNotFoundError:
                raise CheckpointError(f"{f}: missing (named by the index)") from None
            except Exception as exc:  # torch raises UnpicklingError, RuntimeError, ...
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise CheckpointError(f"{f}: cannot load it with torch.load(weights_only=True): {first}") from None
            if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise CheckpointError(f"{f}: not a state dict of tensors")
            tensors.update(state)
    # old BERT checkpoints name LayerNorm parameters gamma / beta
    return config, {re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", k)): v for k, v in tensors.items()}


# --- config -> spec ----------------------------------------------------------------------------


def _set(spec: dict, key: str, value: Any) -> None:
    *path, last = key.split(".")
    node = spec
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def _merge(into: dict, data: dict) -> None:
    for k, v in data.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            _merge(into[k], v)
        else:
            into[k] = copy.deepcopy(v)


def _has(tensors: dict, name: str, prefixes: tuple[str, ...]) -> bool:
    return any(p + name in tensors for p in prefixes)


def family_of(config: dict, where: str = "config.json") -> tuple[Family, str]:
    mt = config.get("model_type")
    fam = _BY_TYPE.get(mt)
    if fam is None:
        raise CheckpointError(f"{where}: model_type {mt!r} has no importer; specc imports "
                              + ", ".join(sorted(_BY_TYPE)))
    archs = config.get("architectures") or [next(iter(fam.heads))]
    arch = archs[0]
    if arch not in fam.heads:
        raise CheckpointError(f"{where}: architectures {arch!r} is not imported for model_type {mt!r}; "
                              f"specc imports " + ", ".join(fam.heads))
    return fam, arch


def config_to_spec(config: dict, tensors: dict, name: str, where: str = "config.json") -> dict:
    """The spec (plain data) for a checkpoint's config; refuses what specc cannot express."""
    fam, arch = family_of(config, where)
    for r in fam.refuse:
        value = config.get(r.name, r.default)
        if value not in r.allowed:
            why = f" ({r.why})" if r.why else ""
            raise CheckpointError(f"{where}: {r.name} = {json.dumps(value)}: specc cannot express this{why}; "
                                  f"it imports {' or '.join(json.dumps(a) for a in r.allowed)}")
    spec: dict = {"specc": 1, "name": name}
    _merge(spec, fam.fixed)
    for f in fam.fields:
        value = config.get(f.name, f.default)
        if value is MISSING:
            raise CheckpointError(f"{where}: {f.name} is missing (specc's {f.key} comes from it)")
        try:
            value = f.convert(value)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {f.name}: {exc}") from None
        _set(spec, f.key, value)
    if fam.extra is not None:
        try:
            fam.extra(spec, config)
        except ValueError as exc:
            raise CheckpointError(f"{where}: {exc}") from None
        except KeyError as exc:
            raise CheckpointError(f"{where}: {exc.args[0]} is missing") from None
    spec["outputs"] = fam.heads[arch](config, tensors)
    if not any(o["kind"] in ("lm", "mlm") for o in spec["outputs"]):
        spec["vocab"].pop("tie_output", None)  # nothing to tie (BertModel, classifiers)
    _check_tokens(spec, config, where)
    length = spec.get("position", {}).get("max_length", 512)
    spec["serving"] = {"length": {"min": 1, "opt": min(128, length), "max": min(512, length)}}
    return spec


def _check_tokens(spec: dict, config: dict, where: str) -> None:
    size = spec["vocab"]["size"]
    target = spec["vocab"].get("target_size") or size
    fields = {"bos": "bos_token_id", "eos": "eos_token_id", "pad": "pad_token_id", "decoder_start": "decoder_start_token_id"}
    for key, value in list(spec.get("tokens", {}).items()):
        if value is None:
            del spec["tokens"][key]
            continue
        if isinstance(value, list):  # several EOS ids (LLaMA 3): specc stops on one
            raise CheckpointError(f"{where}: {fields[key]} = {json.dumps(value)}: specc takes one id per special token")
        limit = target if key == "decoder_start" or spec["architecture"] != "encoder-decoder" else size
        if not 0 <= value < limit:
            raise CheckpointError(f"{where}: {fields[key]} = {value} is outside the vocabulary (0..{limit - 1})")


# --- tensors -> specc's names -------------------------------------------------------------------


def _transform(t, how: str, where: str):
    if how == "copy":
        return t
    if how == "transpose":  # GPT-2's Conv1D stores [in, out]
        return t.t()
    if how.startswith("qkv"):
        part = int(how[3:])
        if t.dim() == 2:  # Conv1D [D, 3D] -> q, k, v as [D, D] Linear weights
            if t.shape[1] % 3:
                raise CheckpointError(f"{where}: shape {tuple(t.shape)} does not split into q, k, v")
            return t.t().chunk(3, dim=0)[part]
        return t.chunk(3, dim=0)[part]
    if how == "offset2":  # BART's learned positions: position p is row p + 2
        return t[2:]
    raise AssertionError(how)


def expand(fam: Family, resolved, heads: list[str]) -> dict[str, tuple[tuple[str, ...], str]]:
    """specc name -> (checkpoint name candidates, transform), every template expanded."""
    counts = {"encoder": len(resolved.encoder.layers) if resolved.encoder else 0,
              "decoder": len(resolved.decoder.layers) if resolved.decoder else 0}
    out = {}
    for row in fam.names:
        layers = range(counts[row.stack]) if row.stack else [None]
        for i in layers:
            for head in heads if "{head}" in row.specc else [None]:
                key = row.specc.format(i=i, head=head)
                out.setdefault(key, (tuple(c.format(i=i) for c in row.hf), row.transform))
    return out


def convert_tensors(fam: Family, config: dict, tensors: dict, resolved, where: str) -> dict:
    """specc's parameters from the checkpoint's tensors; every parameter filled, every tensor used."""
    from specc.spec.costs import parameter_shapes

    shapes = parameter_shapes(resolved)
    table = expand(fam, resolved, [o.name for o in resolved.outputs])
    used: set[str] = set()

    def find(candidates: tuple[str, ...]) -> str | None:
        for c in candidates:
            for p in fam.prefixes:
                if p + c in tensors:
                    return p + c
        return None

    out = {}
    for name, shape in shapes.items():
        if name not in table:
            raise CheckpointError(f"{where}: no checkpoint tensor maps to specc's {name} (an importer gap)")
        candidates, how = table[name]
        src = find(candidates)
        if src is None:
            raise CheckpointError(f"{where}: the checkpoint has none of {', '.join(candidates)} (for specc's {name})")
        t = _transform(tensors[src], how, src)
        if tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"{where}: {src} has shape {tuple(tensors[src].shape)}; specc's {name} "
                                  f"needs {tuple(shape)} from this config")
        used.add(src)
        out[name] = t.contiguous() if how == "copy" else t.contiguous().clone()  # views would share storage
    _check_leftovers(fam, resolved, table, tensors, out, used, find, where)
    return out


def _check_leftovers(fam, resolved, table, tensors, out, used, find, where) -> None:
    import torch

    # tied copies some checkpoints keep (pytorch_model.bin stores every alias) must equal the table
    tied_aliases = {}
    for name, (candidates, how) in table.items():
        if name in out:
            for c in candidates:
                for p in fam.prefixes:
                    if p + c in tensors and p + c not in used:
                        tied_aliases[p + c] = name
    for head in ("lm_head.weight", "cls.predictions.decoder.weight"):
        src = find((head,))
        if src and src not in used and "embeddings.tokens.weight" in out:
            role = "embeddings.target_tokens.weight" if "embeddings.target_tokens.weight" in out else "embeddings.tokens.weight"
            tied_aliases[src] = role
    for src, name in tied_aliases.items():
        t = tensors[src]
        if tuple(t.shape) == tuple(out[name].shape) and torch.equal(t.to(out[name].dtype), out[name]):
            used.add(src)
        elif src.endswith(("lm_head.weight", "decoder.weight")):
            raise CheckpointError(f"{where}: {src} differs from the embedding table, but the config ties "
                                  "them (tie_word_embeddings); specc would compute with the table")
    for z in fam.zero:
        src = find((z,))
        if src is not None:
            if torch.count_nonzero(tensors[src]):
                raise CheckpointError(f"{where}: {src} is not zero; specc's lm output has no bias on the logits")
            used.add(src)
    for src in tensors:
        if src not in used and any(re.search(p, src) for p in fam.ignore):
            used.add(src)
    if resolved.position.kind == "sinusoidal":
        _check_sinusoids(tensors, used, find, resolved, where)
    left = sorted(set(tensors) - used)
    if left:
        shown = ", ".join(left[:6]) + (f", ... ({len(left)} in all)" if len(left) > 6 else "")
        raise CheckpointError(f"{where}: checkpoint tensor(s) with no place in the spec: {shown}; "
                              "specc refuses rather than compute without them")


def _check_sinusoids(tensors, used, find, resolved, where) -> None:
    """Marian and Pegasus store their fixed sinusoid tables: they must be the formula's."""
    import torch

    from specc.nn.positions import sinusoidal

    pos = resolved.position
    for stack in ("encoder", "decoder"):
        src = find((f"{stack}.embed_positions.weight",))
        if src is None:
            continue
        t = tensors[src].to(torch.float32)
        want = sinusoidal(torch.arange(t.shape[0])[None], t.shape[1], pos.base, pos.layout)[0]
        if t.shape[1] != resolved.d_model or float((t - want).abs().max()) > 1e-4:
            raise CheckpointError(f"{where}: {src} is not the sinusoid table of d_model {resolved.d_model} "
                                  f"(layout {pos.layout}); specc computes that table and would differ")
        used.add(src)


# --- the whole import ---------------------------------------------------------------------------


def _name_from(src: Path) -> str:
    name = re.sub(r"[^a-z0-9._-]+", "-", src.resolve().name.lower()).strip("-._")
    return name or "imported"


def import_hf(src: str | os.PathLike, out_spec: str | os.PathLike, *, name: str | None = None,
              force: bool = False) -> tuple[Path, Path]:
    """Write OUT.yaml and OUT.safetensors (beside it) for the checkpoint folder SRC; returns both
    paths. Nothing is written unless the import succeeds and the spec validates."""
    from specc.spec import loads_spec, resolve
    from specc.spec.yamlio import dump_yaml
    from specc.weights.io import save_tensors

    src, out_spec = Path(src), Path(out_spec)
    if out_spec.suffix not in (".yaml", ".yml"):
        raise CheckpointError(f"{out_spec}: the spec file must end in .yaml or .yml")
    weights = out_spec.with_suffix(".safetensors")
    if not force:
        for p in (out_spec, weights):
            if p.exists():
                raise CheckpointError(f"{p} exists; pass --force (force=True) to replace it")
    if not out_spec.parent.is_dir():
        raise CheckpointError(f"{out_spec.parent}: no such directory")
    config, tensors = read_checkpoint(src)
    where = str(src / "config.json")
    data = config_to_spec(config, tensors, name or _name_from(src), where)
    arch = (config.get("architectures") or ["?"])[0]
    data = {"specc": 1, "name": data.pop("name"),
            "description": f"Imported from a Hugging Face {arch} checkpoint (model_type {config.get('model_type')}) by specc import hf",
            **{k: v for k, v in data.items() if k != "specc"}, "weights": weights.name}
    text = dump_yaml(_kind_first(data))
    spec = loads_spec(text, file=str(out_spec), base_dir=out_spec.parent)
    resolved = resolve(spec)
    fam, _ = family_of(config, where)
    params = convert_tensors(fam, config, tensors, resolved, where)
    save_tensors(params, weights)
    try:
        write_atomic(out_spec, text)
    except BaseException:
        weights.unlink(missing_ok=True)
        raise
    return out_spec, weights


# the order people read a spec in (the language doc's); other keys keep theirs, after these
_TOP = ("specc", "name", "description", "architecture", "d_model", "vocab", "position", "norm", "dropout",
        "encoder", "decoder", "outputs", "tokens", "weights", "serving")
_NESTED = ("kind", "name", "size", "target_size", "type_size", "share", "tie_output", "scale", "norm",
           "max_length", "base", "layout", "fraction", "placement", "eps", "final", "hidden", "layers",
           "attention", "heads", "kv_heads", "d_k", "score", "bias", "ffn", "d_ff", "activation")


def _kind_first(data: Any, order: tuple[str, ...] = _TOP) -> Any:
    if isinstance(data, dict):
        keys = sorted(data, key=lambda k: order.index(k) if k in order else len(order))
        return {k: _kind_first(data[k], _NESTED) for k in keys}
    if isinstance(data, list):
        return [_kind_first(v, _NESTED) for v in data]
    return data


def _flat(data: dict, prefix: str = ""):
    for k, v in data.items():
        if isinstance(v, dict):
            yield from _flat(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def describe() -> str:
    """The families as Markdown tables (docs/import.md is this text)."""
    lines = []
    for fam in FAMILIES:
        lines.append(f"### {', '.join(fam.model_types)} ({fam.architecture}): {', '.join(fam.heads)}\n")
        lines.append("| spec key | config field | default |")
        lines.append("|---|---|---|")
        for f in fam.fields:
            default = "required" if f.default is MISSING else json.dumps(f.default)
            lines.append(f"| `{f.key}` | `{f.name}` | {default} |")
        lines.append("")
        lines.append("Always: " + ", ".join(f"`{k}: {json.dumps(v)}`" for k, v in _flat(fam.fixed)) + ".\n")
        if fam.extra is not None:
            lines.append(" ".join(fam.extra.__doc__.split()) + "\n")
        if fam.refuse:
            lines.append("Refused: " + "; ".join(f"`{r.name}` other than {' / '.join(json.dumps(a) for a in r.allowed)}"
                                                  for r in fam.refuse) + ".\n")
        lines.append("Checkpoint names are tried with the prefixes " + ", ".join(f"`{p}`" if p else "none"
                                                                         for p in fam.prefixes) + ".\n")
        lines.append("| specc parameter | checkpoint tensor | transform |")
        lines.append("|---|---|---|")
        for n in fam.names:
            lines.append(f"| `{n.specc}` | {' or '.join(f'`{c}`' for c in n.hf)} | {n.transform} |")
        lines.append("")
    return "\n".join(lines)

