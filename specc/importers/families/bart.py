"""BART, mBART, Marian and Pegasus: encoder-decoders with learned (from row 2) or sinusoidal
positions; their config.json inverses (one per model type)."""
from __future__ import annotations

from typing import Callable

from specc.importers.table import (ACTIVATIONS, BOOL, INT, INT_OR_NULL, NUMBER, STR, TOKEN, Family, Field_, Name,
                                   Refuse, Registered, linear, lookup, norm, read, set_key)


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


# --- config.json, backwards ---------------------------------------------------------------------


def _seq2seq_inverse(model_type: str) -> Callable[[dict, dict], None]:
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


REGISTERED = Registered(SEQ2SEQ, inverse={mt: _seq2seq_inverse(mt) for mt in SEQ2SEQ.model_types})
