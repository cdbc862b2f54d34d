"""OLMo 2: LLaMA's layers with each sublayer's output normalised, QK-norm over all heads; the GGUF
row `olmo2` (nothing changed by the converter; OLMo 3, the same architecture with sliding windows,
refused)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA
from specc.importers.gguftable import Arch, Meta, common, head_size
from specc.importers.table import NUMBER, TOKEN, Field_, Registered, norm, overridden

OLMO2 = replace(
    LLAMA,
    model_types=("olmo2",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name != "mlp_bias"), (
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


# --- GGUF ---------------------------------------------------------------------------------------


def _olmo2_config(m: Meta) -> dict:
    """OLMo 2: LLaMA's with each sublayer's output normalised and RMSNorm over all heads' q and k.
    OLMo 3 (the same architecture with sliding windows) is refused."""
    if m.raw("olmo2.attention.sliding_window") is not None:
        m.refuse("olmo2.attention.sliding_window", "sliding windows in some layers (OLMo 3) are not imported")
    cfg = common(m, "olmo2", "Olmo2ForCausalLM")
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "silu"
    head_size(m, cfg)
    return cfg


# OLMo 2 names its norms after where they sit (as Gemma 2 and 3 do), and has no input norms
_GGUF_LAYER = {**{k: v for k, v in GGUF_LAYER.items() if k not in ("attn_norm", "ffn_norm")},
               "post_attention_norm": "post_attention_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

REGISTERED = Registered(
    OLMO2,
    gguf={"olmo2": Arch("olmo2", "Olmo2ForCausalLM", _olmo2_config, _GGUF_LAYER, GGUF_TOP, tokenizer=False)},
)
