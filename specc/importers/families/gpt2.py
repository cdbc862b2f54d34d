"""GPT-2: its Hugging Face table, its config.json inverse (n_inner, scale_attn_weights) and the GGUF
row `gpt2` (the converter stores the Conv1D weights [in, out] transposed: they are transposed
back)."""
from __future__ import annotations

import numpy as np

from specc.importers.gguftable import Arch, Meta, common
from specc.importers.table import (ACTIVATIONS, BOOL, INT, INT_OR_NULL, NUMBER, STR, TOKEN, Family, Field_, Name,
                                   Refuse, Registered, linear, lookup, norm, read, set_key)


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


# --- config.json, backwards ---------------------------------------------------------------------


def _gpt2_inverse(spec: dict, config: dict) -> None:
    """GPT-2: n_inner and scale_attn_weights (what _gpt2_extra reads)."""
    config["n_inner"] = spec["decoder"]["ffn"]["d_ff"]
    config["scale_attn_weights"] = spec["decoder"]["attention"]["score"] == "scaled_dot"


# --- GGUF ---------------------------------------------------------------------------------------


def _gpt2_config(m: Meta) -> dict:
    """GPT-2: learned positions (`context_length` rows), GELU (tanh), `feed_forward_length`."""
    cfg = common(m, "gpt2", "GPT2LMHeadModel", rms=False, context=1024, ffn=False)
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": cfg["hidden_size"],
            "n_layer": cfg["num_hidden_layers"], "n_head": cfg["num_attention_heads"],
            "n_positions": cfg["max_position_embeddings"], "n_ctx": cfg["max_position_embeddings"],
            "n_inner": cfg.get("intermediate_size"), "layer_norm_epsilon": cfg["layer_norm_eps"],
            "activation_function": "gelu_new",
            **{k: cfg[k] for k in ("vocab_size", "tie_word_embeddings", "bos_token_id", "eos_token_id",
                                   "pad_token_id")}}


_GPT2_CONV1D = frozenset({"attn_qkv", "attn_output", "ffn_up", "ffn_down"})


def _fix_gpt2(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    return np.ascontiguousarray(w.T) if kind in _GPT2_CONV1D and part == "weight" else w


REGISTERED = Registered(
    GPT2,
    inverse={"gpt2": _gpt2_inverse},
    gguf={"gpt2": Arch("gpt2", "GPT2LMHeadModel", _gpt2_config,
                       {"attn_norm": "ln_1", "attn_qkv": "attn.c_attn", "attn_output": "attn.c_proj",
                        "ffn_norm": "ln_2", "ffn_up": "mlp.c_fc", "ffn_down": "mlp.c_proj"},
                       {"token_embd": "transformer.wte", "position_embd": "transformer.wpe",
                        "output_norm": "transformer.ln_f", "output": "lm_head"},
                       prefix="transformer.h.{i}.", fix=_fix_gpt2, transposed=_GPT2_CONV1D)},
)
