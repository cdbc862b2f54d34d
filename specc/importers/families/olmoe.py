"""OLMoE: LLaMA's layers with RMSNorm over all heads' queries and keys (OLMo 2's QK-norm, pre-norm
placement), each feed-forward block 64 routed SwiGLU experts under a softmax router, the chosen
probabilities kept as they are unless `norm_topk_prob` (Muennighoff et al. 2024, arXiv:2409.02060;
transformers' OlmoeSparseMoeBlock). The GGUF row `olmoe` (OLMo 2's names, the experts stacked;
every layer routed, the chosen probabilities as they are, as llama.cpp computes them)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import GGUF_LAYER, GGUF_TOP, LLAMA, llama_inverse
from specc.importers.families.qwen2_moe import GGUF_MOE, MOE_NAMES, gguf_experts
from specc.importers.gguftable import Arch, Meta, common, head_size
from specc.importers.table import BOOL, INT, NUMBER, TOKEN, Field_, Refuse, Registered, norm, overridden

OLMOE = replace(
    LLAMA,
    model_types=("olmoe",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name != "mlp_bias"), (
        Field_("position.max_length", "max_position_embeddings", 4096, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-5, kind=NUMBER),
        Field_("tokens.pad", "pad_token_id", 1, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 50279, kind=TOKEN))) + (
        Field_("decoder.ffn.experts", "num_experts", 64, kind=INT, aliases=("num_local_experts",)),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", 8, kind=INT),
        Field_("decoder.ffn.router.normalize", "norm_topk_prob", False, kind=BOOL),
    ),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"qk_norm": "full"}, "ffn": {
        "kind": "moe", "bias": False, "router": {"kind": "softmax"}}}},
    refuse=(Refuse("clip_qkv", (None,), None, "q, k and v clamped to a bound: no spec key says so"),),
    heads={"OlmoeForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=tuple(r for r in LLAMA.names if ".ffn." not in r.specc) + MOE_NAMES + (
        *norm("decoder.layers.{i}.attention.q_norm", "layers.{i}.self_attn.q_norm", "decoder", bias=False),
        *norm("decoder.layers.{i}.attention.k_norm", "layers.{i}.self_attn.k_norm", "decoder", bias=False),
    ),
    sources={k: v for k, v in LLAMA.sources.items() if k != "decoder.attention.pattern.window"},
)

def _olmoe_config(m: Meta) -> dict:
    """OLMoE: LLaMA's sizes and rotary base (`rope.freq_base`, 10000 when absent), SiLU-gated
    experts `feed_forward_length` wide (its converter writes no expert width of their own), the
    chosen probabilities as they are (llama.cpp does not renormalise them)."""
    cfg = common(m, "olmoe", "OlmoeForCausalLM", context=4096)
    head_size(m, cfg)
    cfg.update(rope_theta=float(m.number("rope.freq_base", 10000.0)), hidden_act="silu", norm_topk_prob=False)
    gguf_experts(m, cfg, "num_experts", "intermediate_size")
    return cfg


REGISTERED = Registered(
    OLMOE,
    inverse={"olmoe": llama_inverse},
    gguf={"olmoe": Arch("olmoe", "OlmoeForCausalLM", _olmoe_config, {**GGUF_LAYER, **GGUF_MOE}, GGUF_TOP,
                        tokenizer=False)},
)
