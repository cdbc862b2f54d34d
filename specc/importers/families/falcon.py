"""Falcon: one fused q, k, v by key-value group, attention and feed-forward side by side (or one
after the other); its config.json inverse, and the GGUF row `falcon` (the fused q/k/v rows grouped
back per key-value group; the 40B form's norms named by what they feed)."""
from __future__ import annotations

from collections.abc import Mapping

from specc.importers.gguftable import FUSED, Arch, Meta, common, fix_fused
from specc.importers.rope import SCALING_SOURCE, as_rope_scaling, read_rope, set_rope
from specc.importers.table import (ACTIVATIONS, BOOL, INT, INT_OR_NULL, NUMBER, STR, TOKEN, Family, Field_, Name,
                                   Registered, fused_qkv, linear, lookup, norm, read, set_key)


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
    base, _, scaled = read_rope(cfg, spec, "rope_theta", "partial_rotary_factor", 1.0)
    set_rope(spec, base, None, scaled)


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


# --- config.json, backwards ---------------------------------------------------------------------


def _falcon_inverse(spec: dict, config: dict) -> None:
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
        config["rope_scaling"] = as_rope_scaling(scaling)
    parallel, heads, kv = decoder.get("parallel", "none"), attention["heads"], attention["kv_heads"]
    if parallel == "two_norms" or (parallel == "one_norm" and kv not in (1, heads)):
        config.update(new_decoder_architecture=True, num_kv_heads=kv, parallel_attn=True,
                      num_ln_in_parallel_attn=2 if parallel == "two_norms" else 1)
    elif kv in (1, heads):
        config.update(new_decoder_architecture=False, multi_query=kv == 1, parallel_attn=parallel == "one_norm")
    else:
        raise ValueError("Falcon's older layers have one key-value head or one per head")


# --- GGUF ---------------------------------------------------------------------------------------


def _falcon_config(m: Meta) -> dict:
    """Falcon: attention and feed-forward side by side (llama.cpp's only form), from two norms
    where the file has attn_norm_2 (the new decoder architecture: 40B, 180B), else from one;
    `attention.head_count_kv` key-value groups (1: 7B's multi-query); biases where the file has
    them; GELU (exact: the model's own; llama.cpp computes its tanh approximation)."""
    cfg = common(m, "falcon", "FalconForCausalLM", rms=False, ffn=False)
    heads, kv = cfg["num_attention_heads"], cfg.pop("num_key_value_heads")
    if kv < 1 or heads % kv:
        m.refuse("falcon.attention.head_count_kv", f"{kv} does not divide the {heads} heads into groups")
    two = m.has("blk.0.attn_norm_2.weight")
    if two or kv not in (1, heads):
        cfg.update(new_decoder_architecture=True, num_kv_heads=kv, num_ln_in_parallel_attn=2 if two else 1)
    else:  # the older layout: multi-query, or one key-value head per query head
        cfg.update(new_decoder_architecture=False, multi_query=kv == 1, num_kv_heads=kv)
    cfg["layer_norm_epsilon"] = cfg.pop("layer_norm_eps")
    cfg["ffn_hidden_size"] = cfg.pop("intermediate_size", 4 * cfg["hidden_size"])
    cfg.update(parallel_attn=True, alibi=False, bias=m.has("blk.0.attn_qkv.bias"), activation="gelu",
               rope_theta=float(m.number("rope.freq_base", 10000.0)))
    return cfg


def _falcon_layer(m: Meta) -> Mapping[str, str]:
    """llama.cpp names the new architecture's norms by what they feed in its graph: attn_norm is
    Hugging Face's ln_mlp (it normalises the feed-forward's input), attn_norm_2 is ln_attn."""
    if m.has("blk.0.attn_norm_2.weight"):
        return {**FUSED, "attn_norm": "ln_mlp", "attn_norm_2": "ln_attn"}
    return FUSED


REGISTERED = Registered(
    FALCON,
    inverse={"falcon": _falcon_inverse},
    gguf={"falcon": Arch("falcon", "FalconForCausalLM", _falcon_config, FUSED,
                         {"token_embd": "transformer.word_embeddings", "output_norm": "transformer.ln_f",
                          "output": "lm_head"}, prefix="transformer.h.{i}.", fix=fix_fused, variant=_falcon_layer)},
)
