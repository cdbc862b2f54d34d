"""GPT-J: attention and feed-forward side by side from one norm, partial rotary in interleaved pairs,
a biased lm head."""
from __future__ import annotations

from specc.importers.table import (ACTIVATIONS, BOOL, INT, INT_OR_NULL, NUMBER, STR, TOKEN, Family, Field_, Name,
                                   Registered, linear, lookup, norm, read, set_key)


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

REGISTERED = Registered(GPTJ)
