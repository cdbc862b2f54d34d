"""Gemma: LLaMA's layers with GeGLU (tanh), a scaled embedding and 1 + weight norms; LLaMA's
inverse, and the GGUF row `gemma` (the converter adds 1 to every RMSNorm weight, as Hugging Face's
norms compute with 1 + weight: it is taken off again; Gemma 2 and 3 read the same)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_inverse
from specc.importers.gguftable import Arch, Meta, common, head_size
from specc.importers.table import BOOL, INT, STR, Field_, Refuse, Registered, lookup, overridden

# Gemma's configs say "gelu" for the tanh approximation (transformers rewrites it so)
GEMMA_GATED = {"gelu": "geglu_tanh", "gelu_pytorch_tanh": "geglu_tanh"}
GEMMA = replace(
    LLAMA,
    model_types=("gemma",),
    fields=overridden(LLAMA.fields, (
        Field_("decoder.ffn.activation", "hidden_act", "gelu_pytorch_tanh", lookup(GEMMA_GATED, "hidden_act"), kind=STR),
        Field_("vocab.tie_output", "tie_word_embeddings", True, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 8192, kind=INT))),
    fixed={**LLAMA.fixed, "vocab": {"scale": "sqrt_d_model"},
           "norm": {**LLAMA.fixed["norm"], "unit_offset": True}},
    refuse=(Refuse("use_bidirectional_attention", (None, False), None, "Gemma attending both ways (an encoder)"),),
    heads={"GemmaForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    sources={k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
)


# --- GGUF ---------------------------------------------------------------------------------------


def _gemma_config(m: Meta) -> dict:
    """Gemma: GeGLU (tanh), head size `attention.key_length`; the converter writes no rotary
    base, and llama.cpp's is 10000 (Gemma's)."""
    cfg = common(m, "gemma", "GemmaForCausalLM", context=8192)
    head_size(m, cfg)
    cfg["rope_theta"] = float(m.number("rope.freq_base", 10000.0))
    cfg["hidden_act"] = "gelu_pytorch_tanh"
    return cfg


def fix_gemma(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """Gemma, Gemma 2 and 3: the 1 the converter adds to every RMSNorm weight, taken off."""
    return w - np.float32(1.0) if kind.endswith("norm") and part == "weight" else w


REGISTERED = Registered(
    GEMMA,
    inverse={"gemma": llama_inverse},
    gguf={"gemma": Arch("gemma", "GemmaForCausalLM", _gemma_config, GGUF_LAYER, GGUF_TOP, fix=fix_gemma,
                        tokenizer=False)},
)
