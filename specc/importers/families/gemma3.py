"""Gemma 3 (its text model): Gemma 2's with QK-norm, every 6th layer global with its own rotary
base, no score soft-cap; the GGUF row `gemma3` (the converter's change as Gemma's, the q and k
norms too)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.gemma import fix_gemma
from specc.importers.families.gemma2 import GEMMA2, GGUF_SANDWICH, gemma2_config, gemma2_extra, softcapped_lm
from specc.importers.families.llama import GGUF_TOP
from specc.importers.gguftable import Arch, Meta
from specc.importers.table import Registered, norm


def _gemma3_extra(spec: dict, cfg: dict) -> None:
    """As Gemma 2's, with every 6th layer global by default (their rotary base 1e6 unless the
    config says), QK-norm (`qk_norm: head`), and no soft-capping of the scores: Gemma 3's
    attention does not apply `attn_logit_softcapping` (transformers' Gemma3Attention)."""
    gemma2_extra(spec, cfg, gemma3=True)


_G2 = "layers.{i}."
GEMMA3 = replace(
    GEMMA2,
    model_types=("gemma3_text",),
    fixed={**GEMMA2.fixed, "decoder": {"attention": {"qk_norm": "head"}}},
    heads={"Gemma3ForCausalLM": lambda cfg, t: softcapped_lm(cfg, t, None)},
    names=GEMMA2.names + (
        *norm("decoder.layers.{i}.attention.q_norm", _G2 + "self_attn.q_norm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention.k_norm", _G2 + "self_attn.k_norm", "decoder", bias=False),
    ),
    extra=_gemma3_extra,
)


# --- GGUF ---------------------------------------------------------------------------------------


def _gemma3_config(m: Meta) -> dict:
    """Gemma 3: Gemma 2's (gemma2_config), a window in five layers of six (llama.cpp's pattern;
    `attention.sliding_window_pattern` where the file has one), the global layers' rotary base
    `rope.freq_base`, the sliding ones' `rope.freq_base_swa` (llama.cpp's 10000 when absent), the
    logits capped only where the file says."""
    cfg = gemma2_config(m, "gemma3_text", "Gemma3ForCausalLM", context=131072, layers_27b=62)
    cfg["sliding_window"] = int(m.number("attention.sliding_window"))
    cfg["rope_theta"] = float(m.number("rope.freq_base", 1000000.0))
    cfg["rope_local_base_freq"] = float(m.number("rope.freq_base_swa", 10000.0))
    cap = m.raw("gemma3.final_logit_softcapping")
    cfg["final_logit_softcapping"] = None if cap is None else float(m.number("final_logit_softcapping"))
    pattern = m.raw("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # one flag per layer, true where the layer slides
        if len(pattern) != cfg["num_hidden_layers"] or not all(isinstance(p, bool) for p in pattern):
            m.refuse("gemma3.attention.sliding_window_pattern", f"{str(pattern)[:60]}: expected one "
                     f"true/false per layer ({cfg['num_hidden_layers']})")
        cfg["layer_types"] = ["sliding_attention" if p else "full_attention" for p in pattern]
    elif pattern is not None:
        cfg["sliding_window_pattern"] = int(m.number("attention.sliding_window_pattern"))
    return cfg


REGISTERED = Registered(
    GEMMA3,
    gguf={"gemma3": Arch("gemma3_text", "Gemma3ForCausalLM", _gemma3_config, GGUF_SANDWICH, GGUF_TOP, fix=fix_gemma)},
)
