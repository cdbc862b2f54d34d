"""The families specc imports, as tables (docs/import.md prints them: specc.importers.hf.describe()).

Each family is one `Family` record (the row types are in specc.importers.hf.table):

- fields: spec key <- config field (with a default where Hugging Face has one, and a converter);
- fixed: what the family always is (GPT-2 is pre-norm with learned positions, ...);
- refuse: config values specc cannot express, each with the values it can;
- heads: the `architectures` entry -> the spec's outputs;
- names: specc parameter name <- checkpoint tensor name(s) (+ a transform);
- ignore: checkpoint buffers that carry no weights (causal-mask buffers, rotary inv_freq);
- extra: the family's rules that are not one field to one key, stated in the hook's docstring.

Contract: this module is data. It reads no files, imports no torch, and raises nothing at import;
a hook refuses a config by raising ValueError (or KeyError for a missing field), which
specc.importers.hf.convert reports against config.json. Every field is read with its JSON type
checked (a `Field_`'s kind, a hook's `read`): config.json is untrusted input.
"""
from __future__ import annotations

import math
from dataclasses import replace

from specc.importers.hf.table import (BOOL, INT, INT_OR_NULL, LIST_OR_NULL, MISSING, NUMBER, NUMBER_OR_NULL,
                                     OBJECT_OR_NULL, STR, STR_OR_NULL, TOKEN, Family, Field_, Name, Refuse, fused_qkv,
                                     has_tensor, linear, lookup, norm, read, set_key)

# Hugging Face activation names (transformers' ACT2FN) that specc computes exactly.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}
# LLaMA's MLP is act(gate(x)) * up(x): the gated forms
GATED = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_python": "geglu"}


# --- BERT ---------------------------------------------------------------------------------------


def _bert_heads_model(cfg: dict, tensors: dict) -> list:
    outs = [{"kind": "hidden", "name": "last_hidden_state"}]
    if has_tensor(tensors, "pooler.dense.weight", ("bert.", "")):
        outs.append({"kind": "pooled", "name": "pooler_output", "pool": "first", "pooler": "tanh"})
    return outs


def _classes(cfg: dict) -> int:
    labels = read(cfg, "id2label", OBJECT_OR_NULL, None)
    if labels is not None:
        return len(labels)
    return read(cfg, "num_labels", INT, 2)


BERT = Family(
    model_types=("bert",),
    architecture="encoder",
    fields=(
        Field_("d_model", "hidden_size", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.type_size", "type_vocab_size", 2, kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", kind=INT),
        Field_("norm.eps", "layer_norm_eps", 1e-12, kind=NUMBER),
        Field_("dropout.hidden", "hidden_dropout_prob", 0.1, kind=NUMBER),
        Field_("dropout.attention", "attention_probs_dropout_prob", 0.1, kind=NUMBER),
        Field_("encoder.layers", "num_hidden_layers", kind=INT),
        Field_("encoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("encoder.ffn.d_ff", "intermediate_size", kind=INT),
        Field_("encoder.ffn.activation", "hidden_act", "gelu", lookup(ACTIVATIONS, "hidden_act"), kind=STR),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
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
        *norm("encoder.embed_norm", "embeddings.LayerNorm"),
        *linear("encoder.layers.{i}.attention.q", "encoder.layer.{i}.attention.self.query", "encoder"),
        *linear("encoder.layers.{i}.attention.k", "encoder.layer.{i}.attention.self.key", "encoder"),
        *linear("encoder.layers.{i}.attention.v", "encoder.layer.{i}.attention.self.value", "encoder"),
        *linear("encoder.layers.{i}.attention.o", "encoder.layer.{i}.attention.output.dense", "encoder"),
        *norm("encoder.layers.{i}.attention_norm", "encoder.layer.{i}.attention.output.LayerNorm", "encoder"),
        *linear("encoder.layers.{i}.ffn.up", "encoder.layer.{i}.intermediate.dense", "encoder"),
        *linear("encoder.layers.{i}.ffn.down", "encoder.layer.{i}.output.dense", "encoder"),
        *norm("encoder.layers.{i}.ffn_norm", "encoder.layer.{i}.output.LayerNorm", "encoder"),
        *linear("heads.{head}.pooler", "pooler.dense"),
        *linear("heads.{head}.transform", "cls.predictions.transform.dense"),
        *norm("heads.{head}.norm", "cls.predictions.transform.LayerNorm"),
        Name("heads.{head}.bias", ("cls.predictions.bias", "cls.predictions.decoder.bias")),
        Name("heads.{head}.proj.weight", ("cls.predictions.decoder.weight", "classifier.weight")),
        Name("heads.{head}.proj.bias", ("classifier.bias",)),
    ),
    prefixes=("bert.", ""),
    ignore=(r"embeddings\.position_ids$", r"embeddings\.token_type_ids$"),
    sources={"classes": "id2label (or num_labels)"},
)


# --- RoBERTa: BERT's layers, positions counted from the padding id + 1 ----------------------------


def _roberta_extra(spec: dict, cfg: dict) -> None:
    """Positions count from `pad_token_id` + 1 (transformers' create_position_ids_from_input_ids):
    with the padding id 1, position p reads row p + 2 of the table, and `position.max_length` is
    `max_position_embeddings` - 2. Another padding id is refused. A padded position's own output
    differs (transformers gives it the padding row; specc the next position's), never a real
    token's."""
    pad = read(cfg, "pad_token_id", INT_OR_NULL, 1)
    if pad != 1:
        raise ValueError(f"pad_token_id {pad}: RoBERTa's positions are imported for the padding id 1 (rows from 2)")
    set_key(spec, "position.max_length", read(cfg, "max_position_embeddings", INT) - 2)


def _roberta_heads_model(cfg: dict, tensors: dict) -> list:
    outs = [{"kind": "hidden", "name": "last_hidden_state"}]
    if has_tensor(tensors, "pooler.dense.weight", ("roberta.", "")):
        outs.append({"kind": "pooled", "name": "pooler_output", "pool": "first", "pooler": "tanh"})
    return outs


ROBERTA = replace(
    BERT,
    model_types=("roberta",),
    heads={"RobertaModel": _roberta_heads_model,
           "RobertaForMaskedLM": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"},
                                                 {"kind": "mlm", "name": "logits"}]},
    names=tuple(
        Name(n.specc, ("embeddings.position_embeddings.weight",), "offset2") if n.specc == "encoder.positions.weight" else n
        for n in BERT.names if not n.hf[0].startswith("cls.")) + (
        *linear("heads.{head}.transform", "lm_head.dense"),
        *norm("heads.{head}.norm", "lm_head.layer_norm"),
        Name("heads.{head}.bias", ("lm_head.bias", "lm_head.decoder.bias")),
        Name("heads.{head}.proj.weight", ("lm_head.decoder.weight",)),
    ),
    prefixes=("roberta.", ""),
    extra=_roberta_extra,
    sources={"position.max_length": "max_position_embeddings"},
)


# --- ELECTRA: BERT's layers, no pooler ------------------------------------------------------------


def _electra_extra(spec: dict, cfg: dict) -> None:
    """An `embedding_size` other than `hidden_size` (ELECTRA-small's 128 into 256, through
    embeddings_project) is refused: specc's embeddings are d_model wide."""
    size = read(cfg, "embedding_size", INT, 128)
    if size != read(cfg, "hidden_size", INT):
        raise ValueError(f"embedding_size {size}: embeddings narrower than hidden_size, projected up, are not expressible")


ELECTRA = replace(
    BERT,
    model_types=("electra",),
    heads={"ElectraModel": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"}]},
    names=tuple(n for n in BERT.names if not n.specc.startswith("heads.")),
    prefixes=("electra.", ""),
    extra=_electra_extra,
    sources={},
)


# --- DistilBERT: BERT's layers under other names, no token types -------------------------------------

_DB = "transformer.layer.{i}."
DISTILBERT = Family(
    model_types=("distilbert",),
    architecture="encoder",
    fields=(
        Field_("d_model", "dim", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", kind=INT),
        Field_("dropout.hidden", "dropout", 0.1, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.1, kind=NUMBER),
        Field_("encoder.layers", "n_layers", kind=INT),
        Field_("encoder.attention.heads", "n_heads", kind=INT),
        Field_("encoder.ffn.d_ff", "hidden_dim", kind=INT),
        Field_("encoder.ffn.activation", "activation", "gelu", lookup(ACTIVATIONS, "activation"), kind=STR),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    # sinusoidal_pos_embds only chooses how the table was initialised: the table is in the checkpoint
    fixed={"architecture": "encoder", "vocab": {"norm": True, "type_size": 0}, "position": {"kind": "learned"},
           "norm": {"kind": "layernorm", "placement": "post", "eps": 1e-12},
           "encoder": {"attention": {"bias": True}, "ffn": {"bias": True}}},
    refuse=(),
    heads={"DistilBertModel": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"}],
           "DistilBertForMaskedLM": lambda cfg, t: [{"kind": "hidden", "name": "last_hidden_state"},
                                                    {"kind": "mlm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embeddings.word_embeddings.weight",)),
        Name("encoder.positions.weight", ("embeddings.position_embeddings.weight",)),
        *norm("encoder.embed_norm", "embeddings.LayerNorm"),
        *linear("encoder.layers.{i}.attention.q", _DB + "attention.q_lin", "encoder"),
        *linear("encoder.layers.{i}.attention.k", _DB + "attention.k_lin", "encoder"),
        *linear("encoder.layers.{i}.attention.v", _DB + "attention.v_lin", "encoder"),
        *linear("encoder.layers.{i}.attention.o", _DB + "attention.out_lin", "encoder"),
        *norm("encoder.layers.{i}.attention_norm", _DB + "sa_layer_norm", "encoder"),
        *linear("encoder.layers.{i}.ffn.up", _DB + "ffn.lin1", "encoder"),
        *linear("encoder.layers.{i}.ffn.down", _DB + "ffn.lin2", "encoder"),
        *norm("encoder.layers.{i}.ffn_norm", _DB + "output_layer_norm", "encoder"),
        *linear("heads.{head}.transform", "vocab_transform"),
        *norm("heads.{head}.norm", "vocab_layer_norm"),
        Name("heads.{head}.bias", ("vocab_projector.bias",)),
        Name("heads.{head}.proj.weight", ("vocab_projector.weight",)),
    ),
    prefixes=("distilbert.", ""),
    ignore=(r"embeddings\.position_ids$",),
)


# --- GPT-2 --------------------------------------------------------------------------------------


def _gpt2_extra(spec: dict, cfg: dict) -> None:
    """`decoder.ffn.d_ff` = `n_inner`, else 4 x `n_embd`; `decoder.attention.score` = scaled_dot,
    or dot when `scale_attn_weights` is false."""
    d_ff = read(cfg, "n_inner", INT_OR_NULL, None)
    set_key(spec, "decoder.ffn.d_ff", d_ff if d_ff is not None else 4 * read(cfg, "n_embd", INT))
    set_key(spec, "decoder.attention.score", "scaled_dot" if read(cfg, "scale_attn_weights", BOOL, True) else "dot")


GPT2 = Family(
    model_types=("gpt2",),
    architecture="decoder",
    fields=(
        Field_("d_model", "n_embd", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "n_positions", kind=INT),
        Field_("norm.eps", "layer_norm_epsilon", 1e-5, kind=NUMBER),
        Field_("dropout.hidden", "resid_pdrop", 0.1, kind=NUMBER),
        Field_("dropout.attention", "attn_pdrop", 0.1, kind=NUMBER),
        Field_("decoder.layers", "n_layer", kind=INT),
        Field_("decoder.attention.heads", "n_head", kind=INT),
        Field_("decoder.ffn.activation", "activation_function", "gelu_new", lookup(ACTIVATIONS, "activation_function"), kind=STR),
        Field_("tokens.bos", "bos_token_id", None, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", None, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
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
        *norm("decoder.layers.{i}.attention_norm", "h.{i}.ln_1", "decoder"),
        Name("decoder.layers.{i}.attention.q.weight", ("h.{i}.attn.c_attn.weight",), "qkv0", "decoder"),
        Name("decoder.layers.{i}.attention.k.weight", ("h.{i}.attn.c_attn.weight",), "qkv1", "decoder"),
        Name("decoder.layers.{i}.attention.v.weight", ("h.{i}.attn.c_attn.weight",), "qkv2", "decoder"),
        Name("decoder.layers.{i}.attention.q.bias", ("h.{i}.attn.c_attn.bias",), "qkv0", "decoder"),
        Name("decoder.layers.{i}.attention.k.bias", ("h.{i}.attn.c_attn.bias",), "qkv1", "decoder"),
        Name("decoder.layers.{i}.attention.v.bias", ("h.{i}.attn.c_attn.bias",), "qkv2", "decoder"),
        *linear("decoder.layers.{i}.attention.o", "h.{i}.attn.c_proj", "decoder", "transpose"),
        *norm("decoder.layers.{i}.ffn_norm", "h.{i}.ln_2", "decoder"),
        *linear("decoder.layers.{i}.ffn.up", "h.{i}.mlp.c_fc", "decoder", "transpose"),
        *linear("decoder.layers.{i}.ffn.down", "h.{i}.mlp.c_proj", "decoder", "transpose"),
        *norm("decoder.final_norm", "ln_f"),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("transformer.", ""),
    ignore=(r"h\.\d+\.attn\.(masked_)?bias$",),
    extra=_gpt2_extra,
    sources={"decoder.ffn.d_ff": "n_inner (or 4 x n_embd)"},
)


# --- LLaMA --------------------------------------------------------------------------------------


# rope types (`rope_scaling` / `rope_parameters` rope_type) specc computes, as the kinds of
# position.scaling; "dynamic" NTK scaling is refused (its frequencies follow each call's length)
ROPE_SCALINGS = ("linear", "llama3", "yarn", "longrope")
SCALING_SOURCE = "rope_scaling (or rope_parameters)"


def _rope_kind(params: dict, label: str) -> str:
    return (read(params, "rope_type", STR_OR_NULL, None, label=f"{label}.rope_type")
            or read(params, "type", STR_OR_NULL, None, label=f"{label}.type") or "default")


def _number(params: dict, key: str, label: str, default=MISSING):
    value = read(params, key, NUMBER_OR_NULL if default is not MISSING else NUMBER, default, label=f"{label}.{key}")
    return None if value is None else float(value)


def _scaling(params: dict, label: str, cfg: dict, spec: dict, *, original_default: int | None = None,
             renamed: dict | None = None, nested: bool = False) -> dict | None:
    """position.scaling for one rope mapping (`label`: its field, named in every refusal), None for
    rope_type default. As transformers reads it: `original_max_position_embeddings` from the
    config's top level where it has one (Phi-3's default 4096: `original_default`), else the
    mapping's, else `max_position_embeddings` (a mapping per layer kind, `nested`: the mapping's,
    else max_position_embeddings); yarn's factor (null: max_position_embeddings / original),
    beta_fast and beta_slow (null or 0: 32 and 1) and attention factor (null: from `mscale` /
    `mscale_all_dim` where both are given, else the spec's 0.1 ln(factor) + 1)."""
    kind = _rope_kind(params, label)
    kind = (renamed or {}).get(kind, kind)
    if kind == "default":
        return None
    if kind == "dynamic":
        raise ValueError(f"{label}.rope_type 'dynamic': dynamic NTK scaling recomputes the frequencies from each "
                         "call's sequence length and keeps them for later calls, which a graph with a KV cache "
                         "does not reproduce")
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"{label}.rope_type {kind!r}: specc computes rope types default, "
                         + ", ".join(ROPE_SCALINGS))
    if kind == "linear":
        return {"kind": "linear", "factor": _number(params, "factor", label)}
    max_length = spec["position"]["max_length"]
    top = None if nested else read(cfg, "original_max_position_embeddings", INT, original_default)
    original = top if top is not None else read(params, "original_max_position_embeddings", INT, max_length,
                                                 label=f"{label}.original_max_position_embeddings")
    if kind == "llama3":
        return {"kind": "llama3", "factor": _number(params, "factor", label),
                "low_freq_factor": _number(params, "low_freq_factor", label),
                "high_freq_factor": _number(params, "high_freq_factor", label), "original_max_length": original}
    if kind == "yarn":
        factor = _number(params, "factor", label, None)
        if factor is None:
            factor = max_length / original
        out = {"kind": "yarn", "factor": factor, "original_max_length": original,
               "beta_fast": _number(params, "beta_fast", label, None) or 32.0,
               "beta_slow": _number(params, "beta_slow", label, None) or 1.0,
               "truncate": True if nested else read(params, "truncate", BOOL, True, label=f"{label}.truncate")}
        scale = _number(params, "attention_factor", label, None)
        mscale, mscale_all = _number(params, "mscale", label, None), _number(params, "mscale_all_dim", label, None)
        if scale is None and mscale and mscale_all:  # DeepSeek's form: a ratio of two of YaRN's factors
            def yarn_scale(m: float) -> float:
                return 0.1 * m * math.log(factor) + 1.0 if factor > 1 else 1.0
            scale = yarn_scale(mscale) / yarn_scale(mscale_all)
        if scale is not None:
            out["attention_factor"] = scale
        return out
    lists = {}
    for key in ("short_factor", "long_factor"):
        values = read(params, key, LIST_OR_NULL, label=f"{label}.{key}")
        if values is None or any(type(v) not in (int, float) for v in values):
            raise ValueError(f"{label}.{key}: expected a list of numbers")
        lists[key] = [float(v) for v in values]
    out = {"kind": "longrope", **lists, "original_max_length": original}
    for key in ("factor", "attention_factor"):
        value = _number(params, key, label, None)
        if value is not None:
            out[key] = value
    return out


def _rope(cfg: dict, spec: dict, theta_field: str, fraction_field: str, fraction_default: float,
          **scaling) -> tuple[float, float, dict | None]:
    """(rope_theta, partial_rotary_factor, position.scaling) from `rope_scaling` (older configs)
    over `rope_parameters` (transformers 5 configs), or the family's own older fields; `scaling`:
    _scaling's options."""
    scaling_map = read(cfg, "rope_scaling", OBJECT_OR_NULL, None)
    field_name = "rope_scaling" if scaling_map else "rope_parameters"
    params = scaling_map or read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    scaled = _scaling(params, field_name, cfg, spec, **scaling)
    params = {**(read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}), **params}
    theta = read(params, "rope_theta", NUMBER, None, label="rope_parameters.rope_theta")
    if theta is None:
        theta = read(cfg, theta_field, NUMBER, 10000.0)
    fraction = read(params, "partial_rotary_factor", NUMBER, None, label="rope_parameters.partial_rotary_factor")
    if fraction is None:
        fraction = read(cfg, fraction_field, NUMBER, fraction_default)
    return float(theta), float(fraction), scaled


def _set_rope(spec: dict, base: float, fraction: float | None, scaled: dict | None) -> None:
    set_key(spec, "position.base", base)
    if fraction is not None:
        set_key(spec, "position.fraction", fraction)
    if scaled is not None:
        set_key(spec, "position.scaling", scaled)


def _llama_extra(spec: dict, cfg: dict, **scaling) -> None:
    """`decoder.attention.d_k` = `head_dim` where it is not hidden_size / heads; `position.base` =
    `rope_theta` (or `rope_parameters.rope_theta`); `position.fraction` = `partial_rotary_factor`;
    `position.scaling` from `rope_scaling` / `rope_parameters` (rope_type linear: factor; llama3:
    factor, low_freq_factor, high_freq_factor; yarn: factor, beta_fast, beta_slow, attention_factor
    or mscale / mscale_all_dim, truncate; longrope: short_factor, long_factor, factor,
    attention_factor; each with `original_max_position_embeddings`, the config's top-level one first,
    else max_position_embeddings); rope_type dynamic, whose frequencies follow each call's length,
    is refused. Mistral: a
    `sliding_window` W shorter than `max_position_embeddings` (a token sees itself and the W - 1
    before it) is `decoder.attention.pattern: {kind: local, window: W - 1}`; null, or as long as the
    context, is full attention."""
    heads = read(cfg, "num_attention_heads", INT)
    window = read(cfg, "sliding_window", INT_OR_NULL, None)
    if window is not None and window < read(cfg, "max_position_embeddings", INT, 2048):
        if window < 2:
            raise ValueError(f"sliding_window {window}: a window must hold more than the token itself")
        set_key(spec, "decoder.attention.pattern", {"kind": "local", "window": window - 1})
    head_dim = read(cfg, "head_dim", INT_OR_NULL, None)
    if head_dim is not None and head_dim * heads != read(cfg, "hidden_size", INT):
        set_key(spec, "decoder.attention.d_k", head_dim)
    _set_rope(spec, *_rope(cfg, spec, "rope_theta", "partial_rotary_factor", 1.0, **scaling))


LLAMA = Family(
    model_types=("llama", "mistral"),
    architecture="decoder",
    fields=(
        Field_("d_model", "hidden_size", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", False, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 2048, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-6, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("decoder.layers", "num_hidden_layers", kind=INT),
        Field_("decoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("decoder.attention.kv_heads", "num_key_value_heads", None, kind=INT_OR_NULL),
        Field_("decoder.attention.bias", "attention_bias", False, kind=BOOL),
        Field_("decoder.ffn.d_ff", "intermediate_size", kind=INT),
        Field_("decoder.ffn.activation", "hidden_act", "silu", lookup(GATED, "hidden_act"), kind=STR),
        Field_("decoder.ffn.bias", "mlp_bias", False, kind=BOOL),
        Field_("tokens.bos", "bos_token_id", None, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", None, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "rotary"}, "dropout": {"hidden": 0.0},
           "norm": {"kind": "rmsnorm", "placement": "pre", "final": True}},
    refuse=(),
    heads={"LlamaForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}],
           "MistralForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embed_tokens.weight",)),
        *linear("decoder.layers.{i}.attention.q", "layers.{i}.self_attn.q_proj", "decoder"),
        *linear("decoder.layers.{i}.attention.k", "layers.{i}.self_attn.k_proj", "decoder"),
        *linear("decoder.layers.{i}.attention.v", "layers.{i}.self_attn.v_proj", "decoder"),
        *linear("decoder.layers.{i}.attention.o", "layers.{i}.self_attn.o_proj", "decoder"),
        *norm("decoder.layers.{i}.attention_norm", "layers.{i}.input_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", "layers.{i}.post_attention_layernorm", "decoder", bias=False),
        *linear("decoder.layers.{i}.ffn.gate", "layers.{i}.mlp.gate_proj", "decoder"),
        *linear("decoder.layers.{i}.ffn.up", "layers.{i}.mlp.up_proj", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", "layers.{i}.mlp.down_proj", "decoder"),
        *norm("decoder.final_norm", "norm", bias=False),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("model.", ""),
    ignore=(r"rotary_emb\.inv_freq$",),
    extra=_llama_extra,
    sources={"decoder.attention.d_k": "head_dim", "position.base": "rope_theta (or rope_parameters.rope_theta)",
             "position.fraction": "partial_rotary_factor (or rope_parameters.partial_rotary_factor)",
             "decoder.attention.pattern.window": "sliding_window", "position.scaling": SCALING_SOURCE},
)


# --- Qwen2: LLaMA's layers with biased q, k, v projections ----------------------------------------


def _qwen2_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (head_dim, rope_theta, partial_rotary_factor, rope_type), without its sliding
    window: Qwen2 slides only where `use_sliding_window` is true, and then only in the layers from
    `max_window_layers` on (`layer_types` "sliding_attention"): layers that differ within a stack,
    refused."""
    slides = read(cfg, "use_sliding_window", BOOL, False)
    kinds = read(cfg, "layer_types", LIST_OR_NULL, None) or []
    if slides or any(k != "full_attention" for k in kinds):
        field_name = "use_sliding_window" if slides else "layer_types"
        raise ValueError(f"{field_name}: sliding-window attention in some layers and not others is not "
                         "expressible (every layer of a stack is configured alike)")
    _llama_extra(spec, {k: v for k, v in cfg.items() if k != "sliding_window"})


QWEN2 = replace(
    LLAMA,
    model_types=("qwen2",),
    fields=tuple(f for f in LLAMA.fields if f.name not in ("attention_bias", "mlp_bias")),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"bias": True, "output_bias": False}, "ffn": {"bias": False}}},
    heads={"Qwen2ForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    extra=_qwen2_extra,
    sources={k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
)


# --- Qwen3: Qwen2's windows, LLaMA's unbiased projections, RMSNorm on each head's q and k ---------

QWEN3 = replace(
    QWEN2,
    model_types=("qwen3",),
    fields=LLAMA.fields,
    fixed={**LLAMA.fixed, "decoder": {"attention": {"qk_norm": "head"}}},
    heads={"Qwen3ForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=LLAMA.names + (
        *norm("decoder.layers.{i}.attention.q_norm", "layers.{i}.self_attn.q_norm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention.k_norm", "layers.{i}.self_attn.k_norm", "decoder", bias=False),
    ),
)


# --- Gemma: LLaMA's layers with GeGLU (tanh), a scaled embedding and 1 + weight norms --------------

def _overridden(fields: tuple[Field_, ...], changed: tuple[Field_, ...]) -> tuple[Field_, ...]:
    """`fields` with the rows for the same spec keys as `changed` replaced by them."""
    by_key = {f.key: f for f in changed}
    return tuple(by_key.get(f.key, f) for f in fields)


# Gemma's configs say "gelu" for the tanh approximation (transformers rewrites it so)
GEMMA_GATED = {"gelu": "geglu_tanh", "gelu_pytorch_tanh": "geglu_tanh"}
GEMMA = replace(
    LLAMA,
    model_types=("gemma",),
    fields=_overridden(LLAMA.fields, (
        Field_("decoder.ffn.activation", "hidden_act", "gelu_pytorch_tanh", lookup(GEMMA_GATED, "hidden_act"), kind=STR),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 8192, kind=INT))),
    fixed={**LLAMA.fixed, "vocab": {"scale": "sqrt_d_model"},
           "norm": {**LLAMA.fixed["norm"], "unit_offset": True}},
    refuse=(Refuse("use_bidirectional_attention", (None, False), None, "Gemma attending both ways (an encoder)"),),
    heads={"GemmaForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    sources={k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
)


# --- OLMo 2: LLaMA's layers with each sublayer's output normalised, QK-norm over all heads ----------

OLMO2 = replace(
    LLAMA,
    model_types=("olmo2",),
    fields=_overridden(tuple(f for f in LLAMA.fields if f.name != "mlp_bias"), (
        Field_("norm.eps", "rms_norm_eps", 1e-5, kind=NUMBER),
        Field_("tokens.pad", "pad_token_id", 1, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 50279, kind=TOKEN))),
    fixed={**LLAMA.fixed, "norm": {"kind": "rmsnorm", "placement": "sublayer_output", "final": True},
           "decoder": {"attention": {"qk_norm": "full"}, "ffn": {"bias": False}}},
    heads={"Olmo2ForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=tuple(r for r in LLAMA.names if "norm" not in r.specc) + (
        *norm("decoder.layers.{i}.attention_norm", "layers.{i}.post_attention_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", "layers.{i}.post_feedforward_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention.q_norm", "layers.{i}.self_attn.q_norm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention.k_norm", "layers.{i}.self_attn.k_norm", "decoder", bias=False),
        *norm("decoder.final_norm", "norm", bias=False),
    ),
    sources={k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
)


# --- Gemma 2 and 3: Gemma's layers under sandwich norms, sliding-window and global layers mixed ---


def _layer_kinds(cfg: dict, every: int) -> list[str]:
    """`layer_types` (each layer's "sliding_attention" or "full_attention"), else every `every`-th
    layer global (Gemma 2: every 2nd; Gemma 3: `sliding_window_pattern`, default 6)."""
    n = read(cfg, "num_hidden_layers", INT)
    kinds = read(cfg, "layer_types", LIST_OR_NULL, None)
    if kinds is None:
        return ["full_attention" if (i + 1) % every == 0 else "sliding_attention" for i in range(n)]
    if len(kinds) != n or any(k not in ("sliding_attention", "full_attention") for k in kinds):
        raise ValueError(f"layer_types: expected {n} entries of 'sliding_attention' or 'full_attention', got "
                         f"{kinds[:4]}{'...' if len(kinds) > 4 else ''}")
    return kinds


def _gemma_rope(cfg: dict, spec: dict, gemma3: bool) -> dict[str, tuple[float, dict | None]]:
    """(rotary base, position.scaling) per layer kind: `rope_parameters` keyed by layer kind (Gemma 3
    in transformers 5), one `rope_parameters` / `rope_theta` for every layer (Gemma 2), or Gemma 3's
    older `rope_theta` and `rope_scaling` (its global layers) and `rope_local_base_freq` (its sliding
    ones); each scaling as LLaMA's."""
    params = read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    per_kind = {k: params[k] for k in ("full_attention", "sliding_attention") if isinstance(params.get(k), dict)}
    labels = {k: f"rope_parameters.{k}" for k in per_kind}
    nested = bool(per_kind)
    if not per_kind:
        scaling = read(cfg, "rope_scaling", OBJECT_OR_NULL, None) or {}
        glob = dict(scaling or params)  # as transformers reads it: rope_scaling in place of rope_parameters
        glob.setdefault("rope_theta", params.get("rope_theta", read(cfg, "rope_theta", NUMBER,
                                                                    1000000.0 if gemma3 else 10000.0)))
        local = {"rope_theta": read(cfg, "rope_local_base_freq", NUMBER, glob["rope_theta"])} if gemma3 else glob
        per_kind = {"full_attention": glob, "sliding_attention": local}
        label = "rope_scaling" if scaling else "rope_parameters"
        labels = {"full_attention": label, "sliding_attention": label if not gemma3 else "rope_local_base_freq"}
    out = {}
    for kind, p in per_kind.items():
        default = 1000000.0 if gemma3 and kind == "full_attention" else 10000.0
        theta = float(read(p, "rope_theta", NUMBER, default, label=f"{labels[kind]}.rope_theta"))
        out[kind] = theta, _scaling(p, labels[kind], cfg, spec, nested=nested)
    return out


def _gemma2_extra(spec: dict, cfg: dict, gemma3: bool = False) -> None:
    """`decoder.attention.d_k` = `head_dim`; `scale` = `query_pre_attn_scalar`^-1/2;
    `softcap` = `attn_logit_softcapping`. Layers: the sliding ones (`layer_types`, else every
    layer but each 2nd: Gemma 2, each 6th or `sliding_window_pattern`-th: Gemma 3) see the token
    and the `sliding_window` - 1 before it (`pattern: {kind: local}`); the global ones are
    `overrides` with a full pattern and their own rotary base and scaling where they differ
    (Gemma 3's `rope_theta` 1e6 against the sliding layers' 10000; its 4B and larger models scale
    the global layers' frequencies alone, linearly by 8), each scaling as LLaMA's."""
    heads = read(cfg, "num_attention_heads", INT)
    head_dim = read(cfg, "head_dim", INT_OR_NULL, None)
    if head_dim is not None and head_dim * heads != read(cfg, "hidden_size", INT):
        set_key(spec, "decoder.attention.d_k", head_dim)
    scalar = read(cfg, "query_pre_attn_scalar", NUMBER, 256)
    if scalar <= 0:
        raise ValueError(f"query_pre_attn_scalar {scalar}: must be positive")
    set_key(spec, "decoder.attention.scale", float(scalar) ** -0.5)
    # Gemma 3's attention keeps attn_logit_softcapping in its config and never applies it
    cap = None if gemma3 else read(cfg, "attn_logit_softcapping", NUMBER_OR_NULL, 50.0)
    if cap is not None:
        set_key(spec, "decoder.attention.softcap", float(cap))
    kinds = _layer_kinds(cfg, read(cfg, "sliding_window_pattern", INT, 6 if gemma3 else 2))
    ropes = _gemma_rope(cfg, spec, gemma3)
    window = read(cfg, "sliding_window", INT_OR_NULL, 4096)
    sliding = [i for i, k in enumerate(kinds) if k == "sliding_attention"] if window is not None else []
    if window is not None and window < 2:
        raise ValueError(f"sliding_window {window}: a window must hold more than the token itself")
    if not sliding:  # every layer global
        _set_rope(spec, ropes["full_attention"][0], None, ropes["full_attention"][1])
        return
    set_key(spec, "decoder.attention.pattern", {"kind": "local", "window": window - 1})
    _set_rope(spec, ropes["sliding_attention"][0], None, ropes["sliding_attention"][1])
    full = [i for i, k in enumerate(kinds) if k == "full_attention" or window is None]
    if full:
        override: dict = {"pattern": {"kind": "full"}}
        step = full[1] - full[0] if len(full) > 1 else len(kinds)
        if full == list(range(full[0], len(kinds), step)):
            override = {"every": step, "first": full[0], **override}
        else:
            override = {"indices": full, **override}
        (base, scaled), (local_base, local_scaled) = ropes["full_attention"], ropes["sliding_attention"]
        if base != local_base:
            override["rotary_base"] = base
        if scaled != local_scaled:
            override["rotary_scaling"] = scaled or {"kind": "none"}
        set_key(spec, "decoder.overrides", [override])


def _gemma3_extra(spec: dict, cfg: dict) -> None:
    """As Gemma 2's, with every 6th layer global by default (their rotary base 1e6 unless the
    config says), QK-norm (`qk_norm: head`), and no soft-capping of the scores: Gemma 3's
    attention does not apply `attn_logit_softcapping` (transformers' Gemma3Attention)."""
    _gemma2_extra(spec, cfg, gemma3=True)


def _softcapped_lm(cfg: dict, t: dict, default: float | None = 30.0) -> list:
    """The lm head, its logits capped by `final_logit_softcapping` (Gemma 2's default 30)."""
    cap = read(cfg, "final_logit_softcapping", NUMBER_OR_NULL, default)
    return [{"kind": "lm", "name": "logits", **({"softcap": float(cap)} if cap is not None else {})}]


_G2 = "layers.{i}."
GEMMA2 = replace(
    GEMMA,
    model_types=("gemma2",),
    fields=_overridden(GEMMA.fields, (
        Field_("decoder.ffn.activation", "hidden_activation", "gelu_pytorch_tanh", lookup(GEMMA_GATED, "hidden_activation"),
               kind=STR),)),
    fixed={**GEMMA.fixed, "norm": {**GEMMA.fixed["norm"], "placement": "sandwich"}},
    heads={"Gemma2ForCausalLM": _softcapped_lm},
    names=tuple(r for r in LLAMA.names if "norm" not in r.specc) + (
        *norm("decoder.layers.{i}.attention_norm", _G2 + "input_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention_post_norm", _G2 + "post_attention_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", _G2 + "pre_feedforward_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_post_norm", _G2 + "post_feedforward_layernorm", "decoder", bias=False),
        *norm("decoder.final_norm", "norm", bias=False),
    ),
    extra=_gemma2_extra,
    sources={"decoder.attention.d_k": "head_dim", "decoder.attention.scale": "query_pre_attn_scalar",
             "decoder.attention.softcap": "attn_logit_softcapping", "position.base": "rope_parameters",
             "decoder.attention.pattern.window": "sliding_window", "decoder.overrides": "layer_types",
             "position.scaling": "rope_parameters (or rope_scaling)",
             "decoder.overrides.0.rotary_scaling": "rope_parameters.full_attention (or rope_scaling)"},
)
GEMMA3 = replace(
    GEMMA2,
    model_types=("gemma3_text",),
    fixed={**GEMMA2.fixed, "decoder": {"attention": {"qk_norm": "head"}}},
    heads={"Gemma3ForCausalLM": lambda cfg, t: _softcapped_lm(cfg, t, None)},
    names=GEMMA2.names + (
        *norm("decoder.layers.{i}.attention.q_norm", _G2 + "self_attn.q_norm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention.k_norm", _G2 + "self_attn.k_norm", "decoder", bias=False),
    ),
    extra=_gemma3_extra,
)


# --- Phi-3: LLaMA's layers with q, k, v fused in one projection, and gate and up in another --------


def _phi3_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's, with Phi-3's rope types: default or longrope (its older names su and yarn read
    as longrope, as transformers reads them; any other refused, as transformers' Phi-3 refuses it),
    its `original_max_position_embeddings` the config's top-level one (default 4096). A generation
    whose length passes it keeps the keys the short factors turned in its cache (transformers'
    Phi-3 recomputes its cache at that step)."""
    params = read(cfg, "rope_scaling", OBJECT_OR_NULL, None)
    label = "rope_scaling" if params else "rope_parameters"
    params = params or read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    kind = _rope_kind(params, label)
    if kind not in ("default", "longrope", "su", "yarn"):
        raise ValueError(f"{label}.rope_type {kind!r}: Phi-3's rope types are default and longrope (su, yarn)")
    _llama_extra(spec, cfg, original_default=4096, renamed={"su": "longrope", "yarn": "longrope"})


_PHI3 = "layers.{i}."
PHI3 = replace(
    LLAMA,
    model_types=("phi3",),
    fields=_overridden(tuple(f for f in LLAMA.fields if f.name not in ("attention_bias", "mlp_bias")),
                       (Field_("norm.eps", "rms_norm_eps", 1e-5, kind=NUMBER),)),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"bias": False}, "ffn": {"bias": False}}},
    heads={"Phi3ForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embed_tokens.weight",)),
        *(Name(f"decoder.layers.{{i}}.attention.{p}.weight", (_PHI3 + "self_attn.qkv_proj.weight",), f"rows_{p}",
               "decoder") for p in "qkv"),
        *linear("decoder.layers.{i}.attention.o", _PHI3 + "self_attn.o_proj", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention_norm", _PHI3 + "input_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", _PHI3 + "post_attention_layernorm", "decoder", bias=False),
        Name("decoder.layers.{i}.ffn.gate.weight", (_PHI3 + "mlp.gate_up_proj.weight",), "halves0", "decoder"),
        Name("decoder.layers.{i}.ffn.up.weight", (_PHI3 + "mlp.gate_up_proj.weight",), "halves1", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", _PHI3 + "mlp.down_proj", "decoder", bias=False),
        *norm("decoder.final_norm", "norm", bias=False),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    extra=_phi3_extra,
)


# --- StableLM: LLaMA's layers under LayerNorm, q, k, v biased or not, a quarter of dims rotated ----

def _stablelm_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (rope_theta, partial_rotary_factor, rope_type); `use_parallel_residual` true:
    `decoder.parallel: one_norm` (input_layernorm feeds both)."""
    params = read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    if "partial_rotary_factor" not in cfg and "partial_rotary_factor" not in params:
        cfg = {**cfg, "partial_rotary_factor": 0.25}  # StableLM's default
    _llama_extra(spec, {k: v for k, v in cfg.items() if k != "sliding_window"})
    if read(cfg, "use_parallel_residual", BOOL, False):
        set_key(spec, "decoder.parallel", "one_norm")


_SLM = "decoder.layers.{i}."
STABLELM = replace(
    LLAMA,
    model_types=("stablelm",),
    fields=_overridden(tuple(f for f in LLAMA.fields if f.name != "mlp_bias"), (
        Field_("norm.eps", "layer_norm_eps", 1e-5, kind=NUMBER),
        Field_("decoder.attention.bias", "use_qkv_bias", False, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 4096, kind=INT))),
    fixed={**LLAMA.fixed, "norm": {"kind": "layernorm", "placement": "pre", "final": True},
           "decoder": {"attention": {"output_bias": False}, "ffn": {"bias": False}}},
    refuse=(
        Refuse("qk_layernorm", (False,), False, "a LayerNorm of its own for each head's queries and keys"),
    ),
    heads={"StableLmForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=tuple(r for r in LLAMA.names if "norm" not in r.specc) + (
        *norm(_SLM + "attention_norm", "layers.{i}.input_layernorm", "decoder"),
        *norm(_SLM + "ffn_norm", "layers.{i}.post_attention_layernorm", "decoder"),
        *norm("decoder.final_norm", "norm"),
    ),
    extra=_stablelm_extra,
    sources={**{k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
             "decoder.parallel": "use_parallel_residual"},
)


# --- BLOOM: ALiBi, a LayerNorm on the embeddings, q, k, v fused per head -------------------------


def _bloom_extra(spec: dict, cfg: dict) -> None:
    """`d_model` = `hidden_size` (older configs: `n_embed`); the feed-forward is 4 x d_model. ALiBi
    needs no position table: `position.max_length` (the longest input served) is `seq_length`
    where the config has it, else 2048 (BLOOM's training length)."""
    d = read(cfg, "hidden_size", INT, None)
    if d is None:
        d = read(cfg, "n_embed", INT, label="hidden_size (or n_embed)")
    spec["d_model"] = d
    set_key(spec, "decoder.ffn.d_ff", 4 * d)
    set_key(spec, "position.max_length", read(cfg, "seq_length", INT, 2048))


_BLOOM = "h.{i}."
BLOOM = Family(
    model_types=("bloom",),
    architecture="decoder",
    fields=(
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("norm.eps", "layer_norm_epsilon", 1e-5, kind=NUMBER),
        Field_("dropout.hidden", "hidden_dropout", 0.0, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("decoder.layers", "n_layer", kind=INT),
        Field_("decoder.attention.heads", "n_head", kind=INT),
        Field_("tokens.bos", "bos_token_id", None, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", None, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "alibi"}, "vocab": {"norm": True},
           "norm": {"kind": "layernorm", "placement": "pre", "final": True},
           "decoder": {"attention": {"bias": True}, "ffn": {"activation": "gelu_tanh", "bias": True}}},
    refuse=(
        Refuse("apply_residual_connection_post_layernorm", (False,), False, "the residual taken after the norm"),
        Refuse("slow_but_exact", (False,), False, "tensor-parallel slices summed one by one"),
    ),
    heads={"BloomForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("word_embeddings.weight",)),
        *norm("decoder.embed_norm", "word_embeddings_layernorm"),
        *norm("decoder.layers.{i}.attention_norm", _BLOOM + "input_layernorm", "decoder"),
        *fused_qkv("decoder.layers.{i}.attention", _BLOOM + "self_attention.query_key_value", "decoder"),
        *linear("decoder.layers.{i}.attention.o", _BLOOM + "self_attention.dense", "decoder"),
        *norm("decoder.layers.{i}.ffn_norm", _BLOOM + "post_attention_layernorm", "decoder"),
        *linear("decoder.layers.{i}.ffn.up", _BLOOM + "mlp.dense_h_to_4h", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", _BLOOM + "mlp.dense_4h_to_h", "decoder"),
        *norm("decoder.final_norm", "ln_f"),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("transformer.", ""),
    extra=_bloom_extra,
    sources={"d_model": "hidden_size (or n_embed)", "decoder.ffn.d_ff": "4 x hidden_size",
             "position.max_length": "seq_length"},
)


# --- GPT-NeoX: attention and feed-forward side by side, q, k, v fused per head, partial rotary -----

def _neox_extra(spec: dict, cfg: dict) -> None:
    """`position.base` and `position.fraction` from `rope_parameters` (rope_theta,
    partial_rotary_factor) or the older `rotary_emb_base` and `rotary_pct` (default 0.25), and
    `position.scaling` as LLaMA's;
    `use_parallel_residual` true (the default): `decoder.parallel: two_norms`."""
    _set_rope(spec, *_rope(cfg, spec, "rotary_emb_base", "rotary_pct", 0.25))
    if read(cfg, "use_parallel_residual", BOOL, True):
        set_key(spec, "decoder.parallel", "two_norms")


_NEOX = "layers.{i}."
GPT_NEOX = Family(
    model_types=("gpt_neox",),
    architecture="decoder",
    fields=(
        Field_("d_model", "hidden_size", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", False, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 2048, kind=INT),
        Field_("norm.eps", "layer_norm_eps", 1e-5, kind=NUMBER),
        Field_("dropout.hidden", "hidden_dropout", 0.0, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("decoder.layers", "num_hidden_layers", kind=INT),
        Field_("decoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("decoder.attention.bias", "attention_bias", True, kind=BOOL),
        Field_("decoder.ffn.d_ff", "intermediate_size", kind=INT),
        Field_("decoder.ffn.activation", "hidden_act", "gelu", lookup(ACTIVATIONS, "hidden_act"), kind=STR),
        Field_("tokens.bos", "bos_token_id", 0, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 2, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "rotary"},
           "norm": {"kind": "layernorm", "placement": "pre", "final": True}, "decoder": {"ffn": {"bias": True}}},
    refuse=(),
    heads={"GPTNeoXForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("embed_in.weight",)),
        *norm("decoder.layers.{i}.attention_norm", _NEOX + "input_layernorm", "decoder"),
        *fused_qkv("decoder.layers.{i}.attention", _NEOX + "attention.query_key_value", "decoder"),
        *linear("decoder.layers.{i}.attention.o", _NEOX + "attention.dense", "decoder"),
        *norm("decoder.layers.{i}.ffn_norm", _NEOX + "post_attention_layernorm", "decoder"),
        *linear("decoder.layers.{i}.ffn.up", _NEOX + "mlp.dense_h_to_4h", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", _NEOX + "mlp.dense_4h_to_h", "decoder"),
        *norm("decoder.final_norm", "final_layer_norm"),
        Name("heads.{head}.proj.weight", ("embed_out.weight",)),
    ),
    prefixes=("gpt_neox.", ""),
    ignore=(r"attention\.(masked_)?bias$", r"rotary_emb\.inv_freq$"),
    extra=_neox_extra,
    sources={"position.base": "rope_parameters.rope_theta (or rotary_emb_base)",
             "position.fraction": "rope_parameters.partial_rotary_factor (or rotary_pct)",
             "decoder.parallel": "use_parallel_residual", "position.scaling": SCALING_SOURCE},
)


# --- GPT-J: attention and feed-forward side by side from one norm, interleaved partial rotary -----


def _gptj_extra(spec: dict, cfg: dict) -> None:
    """`position.fraction` = `rotary_dim` / head size (null: every dim), rotated in interleaved
    pairs (rotate_every_two); `decoder.ffn.d_ff` = `n_inner` or 4 x `n_embd`. The lm head has a
    bias of its own."""
    d, heads = read(cfg, "n_embd", INT), read(cfg, "n_head", INT)
    rot = read(cfg, "rotary_dim", INT_OR_NULL, 64)
    if heads <= 0 or d % heads:
        raise ValueError(f"n_embd {d} does not split into n_head {heads} heads")
    if rot is not None and not 0 < rot <= d // heads:
        raise ValueError(f"rotary_dim {rot}: must be between 1 and the head size {d // heads}")
    set_key(spec, "position.fraction", 1.0 if rot is None else rot / (d // heads))
    set_key(spec, "decoder.ffn.d_ff", read(cfg, "n_inner", INT_OR_NULL, None) or 4 * d)


_GPTJ = "h.{i}."
GPTJ = Family(
    model_types=("gptj",),
    architecture="decoder",
    fields=(
        Field_("d_model", "n_embd", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", False, kind=BOOL),
        Field_("position.max_length", "n_positions", 2048, kind=INT),
        Field_("norm.eps", "layer_norm_epsilon", 1e-5, kind=NUMBER),
        Field_("dropout.hidden", "resid_pdrop", 0.0, kind=NUMBER),
        Field_("dropout.attention", "attn_pdrop", 0.0, kind=NUMBER),
        Field_("decoder.layers", "n_layer", kind=INT),
        Field_("decoder.attention.heads", "n_head", kind=INT),
        Field_("decoder.ffn.activation", "activation_function", "gelu_new", lookup(ACTIVATIONS, "activation_function"),
               kind=STR),
        Field_("tokens.bos", "bos_token_id", 50256, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 50256, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "rotary", "base": 10000.0, "layout": "interleaved"},
           "norm": {"kind": "layernorm", "placement": "pre", "final": True},
           "decoder": {"parallel": "one_norm", "attention": {"bias": False}, "ffn": {"bias": True}}},
    refuse=(),
    heads={"GPTJForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits", "bias": True}]},
    names=(
        Name("embeddings.tokens.weight", ("wte.weight",)),
        *norm("decoder.layers.{i}.attention_norm", _GPTJ + "ln_1", "decoder"),
        *(linear(f"decoder.layers.{{i}}.attention.{p}", _GPTJ + f"attn.{p}_proj", "decoder", bias=False)[0] for p in "qkv"),
        *linear("decoder.layers.{i}.attention.o", _GPTJ + "attn.out_proj", "decoder", bias=False),
        *linear("decoder.layers.{i}.ffn.up", _GPTJ + "mlp.fc_in", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", _GPTJ + "mlp.fc_out", "decoder"),
        *norm("decoder.final_norm", "ln_f"),
        *linear("heads.{head}.proj", "lm_head"),
    ),
    prefixes=("transformer.", ""),
    ignore=(r"attn\.(masked_)?bias$", r"embed_positions$"),
    extra=_gptj_extra,
    sources={"position.fraction": "rotary_dim", "decoder.ffn.d_ff": "n_inner (or 4 x n_embd)"},
)


# --- Falcon: one fused q, k, v by key-value group, attention and feed-forward side by side --------


def _falcon_extra(spec: dict, cfg: dict) -> None:
    """`d_model` = `hidden_size` (older configs: `n_embed`). Key-value heads: `num_kv_heads` with
    `new_decoder_architecture`, else 1 with `multi_query`, else every head. Layers: the new
    architecture's are side by side from `num_ln_in_parallel_attn` norms (null: 2); the older
    ones side by side from one norm with `parallel_attn`, else one after the other. Rotary
    positions from `rope_parameters` (rope_theta, and `position.scaling` as LLaMA's); `decoder.ffn.d_ff` = `ffn_hidden_size` or 4 x
    d_model; `bias` gives every projection a bias or none. ALiBi (`alibi` true) is refused: Falcon
    adds it before the 1/sqrt(d_k) scaling, so its slopes are scaled too, which the language's
    ALiBi (Press et al.) does not do."""
    d = read(cfg, "hidden_size", INT, None)
    if d is None:
        d = read(cfg, "n_embed", INT, label="hidden_size (or n_embed)")
    spec["d_model"] = d
    if read(cfg, "alibi", BOOL, False):
        raise ValueError("alibi true: Falcon's ALiBi is scaled with the scores by 1/sqrt(d_k), not "
                         "expressible (the language's alibi adds the slopes after the scaling)")
    heads = read(cfg, "num_attention_heads", INT)
    new = read(cfg, "new_decoder_architecture", BOOL, False)
    parallel = read(cfg, "parallel_attn", BOOL, True)
    if new:
        kv = read(cfg, "num_kv_heads", INT_OR_NULL, None) or heads
        norms = read(cfg, "num_ln_in_parallel_attn", INT_OR_NULL, None) or 2
        if norms not in (1, 2) or not parallel:
            raise ValueError(f"new_decoder_architecture with num_ln_in_parallel_attn {norms} and parallel_attn "
                             f"{str(parallel).lower()}: transformers' Falcon defines 1 or 2 norms, with parallel_attn true")
        mode = "two_norms" if norms == 2 else "one_norm"
    else:
        kv = 1 if read(cfg, "multi_query", BOOL, True) else heads
        mode = "one_norm" if parallel else "none"
    set_key(spec, "decoder.attention.kv_heads", kv)
    set_key(spec, "decoder.parallel", mode)
    set_key(spec, "decoder.ffn.d_ff", read(cfg, "ffn_hidden_size", INT_OR_NULL, None) or 4 * d)
    bias = read(cfg, "bias", BOOL, False)
    set_key(spec, "decoder.attention.bias", bias)
    set_key(spec, "decoder.ffn.bias", bias)
    base, _, scaled = _rope(cfg, spec, "rope_theta", "partial_rotary_factor", 1.0)
    _set_rope(spec, base, None, scaled)


_FALCON = "h.{i}."
FALCON = Family(
    model_types=("falcon",),
    architecture="decoder",
    fields=(
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 2048, kind=INT),
        Field_("norm.eps", "layer_norm_epsilon", 1e-5, kind=NUMBER),
        Field_("dropout.hidden", "hidden_dropout", 0.0, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("decoder.layers", "num_hidden_layers", kind=INT),
        Field_("decoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("decoder.ffn.activation", "activation", "gelu", lookup(ACTIVATIONS, "activation"), kind=STR),
        Field_("tokens.bos", "bos_token_id", 11, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 11, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "rotary"},
           "norm": {"kind": "layernorm", "placement": "pre", "final": True}},
    refuse=(),
    heads={"FalconForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("word_embeddings.weight",)),
        # the new architecture's two norms, else the older layers' (input_layernorm alone where parallel)
        *(Name(f"decoder.layers.{{i}}.{ours}.{w}", tuple(f"{_FALCON}{t}.{w}" for t in theirs), stack="decoder")
          for ours, theirs in (("attention_norm", ("ln_attn", "input_layernorm")),
                               ("ffn_norm", ("ln_mlp", "post_attention_layernorm"))) for w in ("weight", "bias")),
        *fused_qkv("decoder.layers.{i}.attention", _FALCON + "self_attention.query_key_value", "decoder"),
        *linear("decoder.layers.{i}.attention.o", _FALCON + "self_attention.dense", "decoder"),
        *linear("decoder.layers.{i}.ffn.up", _FALCON + "mlp.dense_h_to_4h", "decoder"),
        *linear("decoder.layers.{i}.ffn.down", _FALCON + "mlp.dense_4h_to_h", "decoder"),
        *norm("decoder.final_norm", "ln_f"),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("transformer.", ""),
    extra=_falcon_extra,
    sources={"d_model": "hidden_size (or n_embed)", "decoder.attention.kv_heads": "num_kv_heads / multi_query",
             "decoder.parallel": "parallel_attn / num_ln_in_parallel_attn", "decoder.ffn.d_ff": "ffn_hidden_size",
             "position.base": "rope_parameters.rope_theta", "position.scaling": SCALING_SOURCE},
)


# --- OPT: a pre-norm decoder with learned positions from row 2 -------------------------------------


def _opt_extra(spec: dict, cfg: dict) -> None:
    """`do_layer_norm_before` true: pre-norm with a final norm (none with `_remove_final_layer_norm`);
    false (OPT-350m): post-norm. Positions count the attention mask (transformers' cumsum - 1) and
    read the table from row 2. A `word_embed_proj_dim` other than `hidden_size` (project_in /
    project_out) is refused."""
    pre = read(cfg, "do_layer_norm_before", BOOL, True)
    final = pre and not read(cfg, "_remove_final_layer_norm", BOOL, False)
    spec["norm"] = {"kind": "layernorm", "placement": "pre" if pre else "post", "eps": 1e-5, "final": final}
    proj = read(cfg, "word_embed_proj_dim", INT_OR_NULL, None)
    if proj is not None and proj != read(cfg, "hidden_size", INT):
        raise ValueError(f"word_embed_proj_dim {proj}: an embedding narrower than hidden_size, projected in and "
                         "out, is not expressible")
    bias = read(cfg, "enable_bias", BOOL, True)
    set_key(spec, "decoder.attention.bias", bias)
    set_key(spec, "decoder.ffn.bias", bias)


_OPT = "decoder.layers.{i}."
OPT = Family(
    model_types=("opt",),
    architecture="decoder",
    fields=(
        Field_("d_model", "hidden_size", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 2048, kind=INT),
        Field_("dropout.hidden", "dropout", 0.1, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("decoder.layers", "num_hidden_layers", kind=INT),
        Field_("decoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("decoder.ffn.d_ff", "ffn_dim", kind=INT),
        Field_("decoder.ffn.activation", "activation_function", "relu", lookup(ACTIVATIONS, "activation_function"),
               kind=STR),
        Field_("tokens.bos", "bos_token_id", None, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", None, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={"architecture": "decoder", "position": {"kind": "learned"}},
    refuse=(Refuse("layer_norm_elementwise_affine", (True,), True, "LayerNorms without a gain and bias"),),
    heads={"OPTForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=(
        Name("embeddings.tokens.weight", ("decoder.embed_tokens.weight",)),
        Name("decoder.positions.weight", ("decoder.embed_positions.weight",), "offset2"),
        *linear(_OPT + "attention.q", _OPT + "self_attn.q_proj", "decoder"),
        *linear(_OPT + "attention.k", _OPT + "self_attn.k_proj", "decoder"),
        *linear(_OPT + "attention.v", _OPT + "self_attn.v_proj", "decoder"),
        *linear(_OPT + "attention.o", _OPT + "self_attn.out_proj", "decoder"),
        *norm(_OPT + "attention_norm", _OPT + "self_attn_layer_norm", "decoder"),
        *linear(_OPT + "ffn.up", _OPT + "fc1", "decoder"),
        *linear(_OPT + "ffn.down", _OPT + "fc2", "decoder"),
        *norm(_OPT + "ffn_norm", _OPT + "final_layer_norm", "decoder"),
        *norm("decoder.final_norm", "decoder.final_layer_norm"),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("model.", ""),
    extra=_opt_extra,
    sources={"norm.placement": "do_layer_norm_before"},
)


# --- Marian / BART / mBART / Pegasus: encoder-decoders ------------------------------------------


def _seq2seq_extra(spec: dict, cfg: dict) -> None:
    """By `model_type`: bart / mbart have learned positions (the checkpoint's first 2 rows are
    an offset and are dropped) and an embedding LayerNorm; marian / pegasus fixed sinusoids in
    the halves layout (a stored table must equal the formula). mbart / pegasus are pre-norm with
    a final norm per stack, bart / marian post-norm; LayerNorm eps 1e-5. `decoder_vocab_size`
    other than `vocab_size`, or `share_encoder_decoder_embeddings: false`, gives
    `vocab.share: false` and `vocab.target_size`. `final_logits_bias` must be zero."""
    mt = read(cfg, "model_type", STR)
    length = read(cfg, "max_position_embeddings", INT)
    if mt in ("bart", "mbart"):
        # BART's learned table has 2 extra rows in front: position p reads row p + 2
        spec["position"] = {"kind": "learned", "max_length": length}
    else:  # marian, pegasus: fixed sinusoids, every sine before the cosines
        spec["position"] = {"kind": "sinusoidal", "layout": "halves", "base": 10000.0, "max_length": length}
    pre = mt in ("mbart", "pegasus")
    spec["norm"] = {"kind": "layernorm", "placement": "pre" if pre else "post", "eps": 1e-5, "final": pre}
    set_key(spec, "vocab.norm", mt in ("bart", "mbart"))
    vocab = read(cfg, "vocab_size", INT)
    target = read(cfg, "decoder_vocab_size", INT_OR_NULL, None) or vocab
    share = read(cfg, "share_encoder_decoder_embeddings", BOOL, True)
    if target != vocab or not share:
        set_key(spec, "vocab.share", False)
        set_key(spec, "vocab.target_size", target)


_ENC = "encoder.layers.{i}."
_DEC = "decoder.layers.{i}."


def _attn(specc: str, hf: str, stack: str) -> tuple[Name, ...]:
    return (*linear(specc + ".q", hf + ".q_proj", stack), *linear(specc + ".k", hf + ".k_proj", stack),
            *linear(specc + ".v", hf + ".v_proj", stack), *linear(specc + ".o", hf + ".out_proj", stack))


SEQ2SEQ = Family(
    model_types=("bart", "mbart", "marian", "pegasus"),
    architecture="encoder-decoder",
    fields=(
        Field_("d_model", "d_model", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("vocab.scale", "scale_embedding", False, lambda v: "sqrt_d_model" if v else "none", kind=BOOL),
        Field_("dropout.hidden", "dropout", 0.1, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("encoder.layers", "encoder_layers", kind=INT),
        Field_("encoder.attention.heads", "encoder_attention_heads", kind=INT),
        Field_("encoder.ffn.d_ff", "encoder_ffn_dim", kind=INT),
        Field_("encoder.ffn.activation", "activation_function", "gelu", lookup(ACTIVATIONS, "activation_function"), kind=STR),
        Field_("decoder.layers", "decoder_layers", kind=INT),
        Field_("decoder.attention.heads", "decoder_attention_heads", kind=INT),
        Field_("decoder.ffn.d_ff", "decoder_ffn_dim", kind=INT),
        Field_("decoder.ffn.activation", "activation_function", "gelu", lookup(ACTIVATIONS, "activation_function"), kind=STR),
        Field_("tokens.bos", "bos_token_id", None, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", None, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
        Field_("tokens.decoder_start", "decoder_start_token_id", None, kind=TOKEN),
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
        *norm("encoder.embed_norm", "encoder.layernorm_embedding"),
        *norm("decoder.embed_norm", "decoder.layernorm_embedding"),
        *_attn(_ENC + "attention", "encoder.layers.{i}.self_attn", "encoder"),
        *norm(_ENC + "attention_norm", "encoder.layers.{i}.self_attn_layer_norm", "encoder"),
        *linear(_ENC + "ffn.up", "encoder.layers.{i}.fc1", "encoder"),
        *linear(_ENC + "ffn.down", "encoder.layers.{i}.fc2", "encoder"),
        *norm(_ENC + "ffn_norm", "encoder.layers.{i}.final_layer_norm", "encoder"),
        *_attn(_DEC + "attention", "decoder.layers.{i}.self_attn", "decoder"),
        *norm(_DEC + "attention_norm", "decoder.layers.{i}.self_attn_layer_norm", "decoder"),
        *_attn(_DEC + "cross_attention", "decoder.layers.{i}.encoder_attn", "decoder"),
        *norm(_DEC + "cross_attention_norm", "decoder.layers.{i}.encoder_attn_layer_norm", "decoder"),
        *linear(_DEC + "ffn.up", "decoder.layers.{i}.fc1", "decoder"),
        *linear(_DEC + "ffn.down", "decoder.layers.{i}.fc2", "decoder"),
        *norm(_DEC + "ffn_norm", "decoder.layers.{i}.final_layer_norm", "decoder"),
        *norm("encoder.final_norm", "encoder.layer_norm"),
        *norm("decoder.final_norm", "decoder.layer_norm"),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("model.", ""),
    zero=("final_logits_bias",),
    extra=_seq2seq_extra,
    sources={"position.max_length": "max_position_embeddings", "vocab.target_size": "decoder_vocab_size"},
)

# --- T5: an RMSNorm encoder-decoder with bucketed relative positions and unscaled scores ------------

# feed_forward_proj -> the FFN's activation (transformers: "gated-gelu" computes gelu_new)
T5_FFN = {"relu": "relu", "gelu": "gelu", "silu": "silu", "gated-gelu": "geglu_tanh", "gated-silu": "swiglu"}


def _t5_extra(spec: dict, cfg: dict) -> None:
    """Both stacks: `num_heads` heads of `d_kv` dims, `d_ff`, the activation of
    `feed_forward_proj`; the decoder has `num_decoder_layers` (null: `num_layers`). Scores are
    not scaled (`score: dot`); a bucketed bias per stack (`relative_attention_num_buckets`,
    `relative_attention_max_distance`) replaces positions; `position.max_length` (the longest
    input served) is `n_positions` where the config has it, else 512. Decoding starts from
    `decoder_start_token_id` (null: `pad_token_id`)."""
    act = lookup(T5_FFN, "feed_forward_proj")(read(cfg, "feed_forward_proj", STR, "relu"))
    layers = read(cfg, "num_layers", INT)
    stack = {"attention": {"heads": read(cfg, "num_heads", INT), "d_k": read(cfg, "d_kv", INT), "score": "dot",
                           "bias": False},
             "ffn": {"d_ff": read(cfg, "d_ff", INT), "activation": act, "bias": False}}
    spec["encoder"] = {"layers": layers, **stack}
    spec["decoder"] = {"layers": read(cfg, "num_decoder_layers", INT_OR_NULL, None) or layers, **stack}
    set_key(spec, "position.max_length", read(cfg, "n_positions", INT, 512))
    start = read(cfg, "decoder_start_token_id", TOKEN, None)
    set_key(spec, "tokens.decoder_start", start if start is not None else read(cfg, "pad_token_id", TOKEN, 0))


def _t5_heads(cfg: dict, t: dict) -> list:
    """The lm head; its input scaled by d_model^-1/2 where `scale_decoder_outputs` (absent: where
    the embeddings are tied), as transformers' T5 does."""
    scaled = read(cfg, "scale_decoder_outputs", BOOL, None)
    if scaled is None:
        scaled = read(cfg, "tie_word_embeddings", BOOL, True)
    d = read(cfg, "d_model", INT)
    return [{"kind": "lm", "name": "logits", **({"scale": d ** -0.5} if scaled else {})}]


def _t5_layer(stack: str, sub: str, n_ffn: int) -> tuple[Name, ...]:
    """A T5 block's rows: self-attention (block.{i}.layer.0), for the decoder cross-attention
    (layer.1), then the feed-forward (layer.n_ffn)."""
    ours, theirs = f"{stack}.layers.{{i}}.", f"{stack}.block.{{i}}.layer."
    rows = [*(linear(f"{ours}attention.{p}", f"{theirs}0.SelfAttention.{p}", stack, bias=False)[0] for p in "qkvo"),
            *norm(f"{ours}attention_norm", f"{theirs}0.layer_norm", stack, bias=False)]
    if sub:
        rows += [*(linear(f"{ours}cross_attention.{p}", f"{theirs}1.EncDecAttention.{p}", stack, bias=False)[0]
                   for p in "qkvo"),
                 *norm(f"{ours}cross_attention_norm", f"{theirs}1.layer_norm", stack, bias=False)]
    ffn = f"{theirs}{n_ffn}.DenseReluDense."
    rows += [Name(f"{ours}ffn.gate.weight", (ffn + "wi_0.weight",), stack=stack),
             Name(f"{ours}ffn.up.weight", (ffn + "wi.weight", ffn + "wi_1.weight"), stack=stack),
             Name(f"{ours}ffn.down.weight", (ffn + "wo.weight",), stack=stack),
             *norm(f"{ours}ffn_norm", f"{theirs}{n_ffn}.layer_norm", stack, bias=False)]
    return tuple(rows)


T5 = Family(
    model_types=("t5",),
    architecture="encoder-decoder",
    fields=(
        Field_("d_model", "d_model", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("norm.eps", "layer_norm_epsilon", 1e-6, kind=NUMBER),
        Field_("dropout.hidden", "dropout_rate", 0.1, kind=NUMBER),
        Field_("dropout.attention", "dropout_rate", 0.1, kind=NUMBER),
        Field_("position.buckets", "relative_attention_num_buckets", 32, kind=INT),
        Field_("position.max_distance", "relative_attention_max_distance", 128, kind=INT),
        Field_("tokens.pad", "pad_token_id", 0, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 1, kind=TOKEN),
    ),
    fixed={"architecture": "encoder-decoder", "position": {"kind": "bucketed"}, "vocab": {"share": True},
           "norm": {"kind": "rmsnorm", "placement": "pre", "final": True}},
    refuse=(),
    heads={"T5ForConditionalGeneration": _t5_heads},
    names=(
        Name("embeddings.tokens.weight", ("shared.weight", "encoder.embed_tokens.weight")),
        Name("encoder.relative_bias.weight", ("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
        Name("decoder.relative_bias.weight", ("decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight",)),
        *_t5_layer("encoder", "", 1),
        *_t5_layer("decoder", "cross", 2),
        *norm("encoder.final_norm", "encoder.final_layer_norm", bias=False),
        *norm("decoder.final_norm", "decoder.final_layer_norm", bias=False),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("",),
    extra=_t5_extra,
    sources={"encoder": "num_layers, num_heads, d_kv, d_ff, feed_forward_proj",
             "decoder": "num_decoder_layers, num_heads, d_kv, d_ff, feed_forward_proj",
             "position.max_length": "n_positions", "tokens.decoder_start": "decoder_start_token_id"},
)


FAMILIES = (BERT, ROBERTA, ELECTRA, DISTILBERT, GPT2, OPT, LLAMA, QWEN2, QWEN3, OLMO2, GEMMA, GEMMA2, GEMMA3, PHI3, STABLELM, BLOOM, GPT_NEOX, GPTJ, FALCON, SEQ2SEQ, T5)
BY_TYPE = {mt: fam for fam in FAMILIES for mt in fam.model_types}
