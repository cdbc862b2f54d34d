"""BLOOM: ALiBi, a LayerNorm on the embeddings, q, k, v fused per head; its config.json inverse, and
the GGUF row `bloom` (the converter stores the fused q/k/v rows as all q, all k, all v: they are
grouped back per head)."""
from __future__ import annotations

from specc.importers.gguftable import FUSED, Arch, Meta, common, fix_fused
from specc.importers.table import (BOOL, INT, NUMBER, TOKEN, Family, Field_, Name, Refuse, Registered, fused_qkv,
                                   linear, norm, read, set_key)


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


# --- config.json, backwards ---------------------------------------------------------------------


def _bloom_inverse(spec: dict, config: dict) -> None:
    """BLOOM: hidden_size and seq_length, the longest input (what _bloom_extra reads)."""
    config["hidden_size"] = spec["d_model"]
    config["seq_length"] = spec["position"]["max_length"]


# --- GGUF ---------------------------------------------------------------------------------------


def _bloom_config(m: Meta) -> dict:
    """BLOOM: ALiBi, LayerNorm on the embeddings, every head its own keys and values."""
    cfg = common(m, "bloom", "BloomForCausalLM", rms=False, ffn=False)
    if cfg["num_key_value_heads"] != cfg["num_attention_heads"]:
        m.refuse("bloom.attention.head_count_kv", f"{cfg['num_key_value_heads']}: BLOOM has a key and a value "
                 f"head per query head ({cfg['num_attention_heads']})")
    return {"model_type": "bloom", "architectures": ["BloomForCausalLM"], "hidden_size": cfg["hidden_size"],
            "n_layer": cfg["num_hidden_layers"], "n_head": cfg["num_attention_heads"],
            "layer_norm_epsilon": cfg["layer_norm_eps"], "seq_length": cfg["max_position_embeddings"],
            **{k: cfg[k] for k in ("vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                                   "pad_token_id")}}


REGISTERED = Registered(
    BLOOM,
    inverse={"bloom": _bloom_inverse},
    gguf={"bloom": Arch("bloom", "BloomForCausalLM", _bloom_config, FUSED,
                        {"token_embd": "transformer.word_embeddings",
                         "token_embd_norm": "transformer.word_embeddings_layernorm",
                         "output_norm": "transformer.ln_f", "output": "lm_head"},
                        prefix="transformer.h.{i}.", fix=fix_fused)},
)
