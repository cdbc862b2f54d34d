"""T5: an RMSNorm encoder-decoder with bucketed relative positions and unscaled scores; its
config.json inverse, and the GGUF row `t5` (nothing changed by the converter; of the embedding
tables, shared and the encoder's and decoder's copies, one is written; a T5 encoder alone,
`t5encoder`, refused)."""
from __future__ import annotations

import re
from collections.abc import Mapping

from specc.importers.gguftable import Arch, Meta, encoder_heads, rows, same_tensor, token_id
from specc.importers.table import (BOOL, INT, INT_OR_NULL, NUMBER, STR, TOKEN, Family, Field_, Name, Registered, linear,
                                   lookup, norm, read, set_key)

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


# --- config.json, backwards ---------------------------------------------------------------------


def _t5_inverse(spec: dict, config: dict) -> None:
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


# --- GGUF ---------------------------------------------------------------------------------------


# llama.cpp's T5 bucket distance (llama_relative_position_bucket's max_distance): no key in the file
_T5_MAX_DISTANCE = 128


def _t5_config(m: Meta) -> dict:
    """T5 (T5ForConditionalGeneration): `block_count` encoder and `decoder_block_count` (else as
    many) decoder layers of `attention.head_count` heads of `attention.key_length` dims,
    `attention.relative_buckets_count` buckets (to a distance of 128: llama.cpp's, no key), RMSNorm
    at `attention.layer_norm_rms_epsilon`, decoding from `decoder_start_token_id`. The feed-forward
    is what llama.cpp computes: gated GELU (tanh) where the file has ffn_gate (T5 v1.1, FLAN-T5),
    else ReLU (the original T5). The head: output.weight where the file has one that is not the
    embedding table's bytes; else the table, tied, its input scaled by d_model^-1/2 as Hugging
    Face's tied T5 does (llama.cpp does not scale: its logits are sqrt(d_model) times these, the
    same tokens). A relative-position table in every layer (UMT5) is refused."""
    for name in m.tensors:
        hit = re.fullmatch(r"(enc|dec)\.blk\.(\d+)\.(attn_rel_b|cross_attn_rel_b)\.weight", name)
        if hit and (hit.group(2) != "0" or hit.group(3) == "cross_attn_rel_b"):
            m.refuse(name, "a relative-position table in more than the first layer's self-attention (UMT5) is not "
                     "expressible: specc's t5 has one table per stack")
    heads, d_model = encoder_heads(m), int(m.number("embedding_length"))
    layers = int(m.number("block_count"))
    tied = not m.has("output.weight") or same_tensor(m, "output.weight", "token_embd.weight")
    return {
        "model_type": "t5", "architectures": ["T5ForConditionalGeneration"], "d_model": d_model,
        "num_layers": layers, "num_decoder_layers": int(m.number("decoder_block_count", layers)), "num_heads": heads,
        "d_kv": int(m.number("attention.key_length", d_model // heads)), "d_ff": int(m.number("feed_forward_length")),
        "layer_norm_epsilon": float(m.number("attention.layer_norm_rms_epsilon")),
        "relative_attention_num_buckets": int(m.number("attention.relative_buckets_count")),
        "relative_attention_max_distance": _T5_MAX_DISTANCE,
        "feed_forward_proj": "gated-gelu" if m.has("enc.blk.0.ffn_gate.weight") else "relu",
        "n_positions": int(m.number("context_length", 512)), "vocab_size": rows(m, "token_embd.weight"),
        "tie_word_embeddings": tied, "scale_decoder_outputs": tied,
        "decoder_start_token_id": int(m.number("decoder_start_token_id")),
        "pad_token_id": token_id(m, "padding_token_id"), "eos_token_id": token_id(m, "eos_token_id"),
    }


def _gguf_layer(m: Meta) -> Mapping[str, str]:
    """A T5 block's sublayers (block.{i}.layer.N): self-attention, the decoder's cross-attention,
    the feed-forward, whose up projection is wi_1 beside a gate wi_0, else wi."""
    up = "wi_1" if m.has("enc.blk.0.ffn_gate.weight") else "wi"
    table = {}
    for stack, hf, ffn in (("enc", "encoder", 1), ("dec", "decoder", 2)):
        block = f"{hf}.block.{{i}}.layer."
        table.update({f"{stack}.attn_norm": block + "0.layer_norm", f"{stack}.attn_rel_b":
                      block + "0.SelfAttention.relative_attention_bias",
                      **{f"{stack}.attn_{p}": f"{block}0.SelfAttention.{p}" for p in "qkvo"},
                      f"{stack}.ffn_norm": f"{block}{ffn}.layer_norm", f"{stack}.ffn_gate": f"{block}{ffn}.DenseReluDense.wi_0",
                      f"{stack}.ffn_up": f"{block}{ffn}.DenseReluDense.{up}",
                      f"{stack}.ffn_down": f"{block}{ffn}.DenseReluDense.wo"})
    table.update({"dec.cross_attn_norm": "decoder.block.{i}.layer.1.layer_norm",
                  **{f"dec.cross_attn_{p}": f"decoder.block.{{i}}.layer.1.EncDecAttention.{p}" for p in "qkvo"}})
    return table


REGISTERED = Registered(
    T5,
    inverse={"t5": _t5_inverse},
    gguf={"t5": Arch("t5", "T5ForConditionalGeneration", _t5_config, {}, {
        "token_embd": "shared", "output": "lm_head", "enc.output_norm": "encoder.final_layer_norm",
        "dec.output_norm": "decoder.final_layer_norm"}, prefix="", variant=_gguf_layer)},
    gguf_refused={"t5encoder": "a T5 encoder alone (T5EncoderModel); specc's t5 family imports "
                               "T5ForConditionalGeneration"},
)
