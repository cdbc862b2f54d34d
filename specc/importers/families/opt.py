"""OPT: a pre-norm (or, OPT-350m, post-norm) decoder with learned positions from row 2."""
from __future__ import annotations

from specc.importers.table import (ACTIVATIONS, BOOL, INT, INT_OR_NULL, NUMBER, STR, TOKEN, Family, Field_, Name,
                                   Refuse, Registered, linear, lookup, norm, read, set_key)


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

REGISTERED = Registered(OPT)
