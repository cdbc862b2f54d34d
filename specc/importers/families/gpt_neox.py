"""GPT-NeoX (Pythia): attention and feed-forward side by side, q, k, v fused per head, partial
rotary; its config.json inverse, and the GGUF row `gptneox` (the fused q/k/v rows grouped back per
head, as BLOOM's)."""
from __future__ import annotations

from specc.importers.gguftable import FUSED, Arch, Meta, common, fix_fused, rotary_fraction
from specc.importers.rope import SCALING_SOURCE, as_rope_scaling, read_rope, set_rope
from specc.importers.table import (ACTIVATIONS, BOOL, INT, NUMBER, STR, TOKEN, Family, Field_, Name, Registered,
                                   fused_qkv, linear, lookup, norm, read, set_key)


def _neox_extra(spec: dict, cfg: dict) -> None:
    """`position.base` and `position.fraction` from `rope_parameters` (rope_theta,
    partial_rotary_factor) or the older `rotary_emb_base` and `rotary_pct` (default 0.25), and
    `position.scaling` as LLaMA's;
    `use_parallel_residual` true (the default): `decoder.parallel: two_norms`."""
    set_rope(spec, *read_rope(cfg, spec, "rotary_emb_base", "rotary_pct", 0.25))
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


# --- config.json, backwards ---------------------------------------------------------------------


def _neox_inverse(spec: dict, config: dict) -> None:
    """GPT-NeoX: rotary_emb_base, rotary_pct, rope_scaling and use_parallel_residual (its two
    norms side by side), what _neox_extra reads."""
    position = spec["position"]
    if position.get("kind") != "rotary":
        raise ValueError("GPT-NeoX rotates its queries and keys")
    config["rotary_emb_base"] = position["base"]
    config["rotary_pct"] = position["fraction"]
    scaling = position.get("scaling") or {}
    if scaling.get("kind", "none") != "none":
        config["rope_scaling"] = as_rope_scaling(scaling)
    config["use_parallel_residual"] = spec["decoder"].get("parallel") == "two_norms"


# --- GGUF ---------------------------------------------------------------------------------------


def _gptneox_config(m: Meta) -> dict:
    """GPT-NeoX (Pythia): `use_parallel_residual` (true when absent), partial rotary, GELU (exact:
    the model's own; llama.cpp computes its tanh approximation)."""
    cfg = common(m, "gpt_neox", "GPTNeoXForCausalLM", rms=False)
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    cfg["rotary_pct"] = rotary_fraction(m, head_dim, 0.25)
    cfg["rotary_emb_base"] = float(m.number("rope.freq_base", 10000.0))
    cfg["use_parallel_residual"] = m.flag("use_parallel_residual", True)
    cfg["attention_bias"] = m.has("blk.0.attn_qkv.bias")
    cfg["hidden_act"] = "gelu"
    return cfg


REGISTERED = Registered(
    GPT_NEOX,
    inverse={"gpt_neox": _neox_inverse},
    gguf={"gptneox": Arch("gpt_neox", "GPTNeoXForCausalLM", _gptneox_config,
                          {**FUSED, "attn_qkv": "attention.query_key_value", "attn_output": "attention.dense"},
                          {"token_embd": "gpt_neox.embed_in", "output_norm": "gpt_neox.final_layer_norm",
                           "output": "embed_out"}, prefix="gpt_neox.layers.{i}.", fix=fix_fused, tokenizer=False)},
)
