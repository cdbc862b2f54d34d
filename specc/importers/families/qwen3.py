"""Qwen3: Qwen2's windows, LLaMA's unbiased projections, RMSNorm on each head's q and k; LLaMA's
inverse and GGUF names (the row `qwen3`: nothing changed by the converter)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_inverse, rotary_config
from specc.importers.families.qwen2 import QWEN2
from specc.importers.gguftable import Arch, Meta
from specc.importers.table import Registered, norm

QWEN3 = replace(
    QWEN2,
    model_types=("qwen3",),
    fields=LLAMA.fields,
    fixed={**LLAMA.fixed, "decoder": {"attention": {"qk_norm": "head"}}},
    heads={"Qwen3ForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=LLAMA.names + (
        *norm("decoder.layers.{i}.attention.q_norm", "layers.{i}.self_attn.q_norm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention.k_norm", "layers.{i}.self_attn.k_norm", "decoder", bias=False),
    ),
)


def _qwen3_config(m: Meta) -> dict:
    """Qwen3: LLaMA's (rotary_config)."""
    return rotary_config(m, "qwen3", "Qwen3ForCausalLM")


REGISTERED = Registered(
    QWEN3,
    inverse={"qwen3": llama_inverse},
    gguf={"qwen3": Arch("qwen3", "Qwen3ForCausalLM", _qwen3_config, GGUF_LAYER, GGUF_TOP)},
)
