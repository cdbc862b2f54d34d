"""DeepSeek-V3: DeepSeek-V2's latent attention (the rotary pairs interleaved unless
`rope_interleave` is false) and dense first layers, its routed experts chosen by sigmoid scores
plus a per-expert selection bias no weight sees, within the best `topk_group` of `n_group` groups
(each scored by its two best biased scores), the chosen scores renormalised (`norm_topk_prob`) and
times `routed_scaling_factor` (DeepSeek-AI 2024, arXiv:2412.19437, section 2.1.2; transformers'
DeepseekV3MoE)."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.deepseek_v2 import DEEPSEEK_V2, deepseek_extra, deepseek_inverse
from specc.importers.table import BOOL, INT, NUMBER, TOKEN, Field_, Registered, overridden


def _v3_extra(spec: dict, cfg: dict) -> None:
    deepseek_extra(spec, cfg, 3)


_v3_extra.__doc__ = deepseek_extra.__doc__

DEEPSEEK_V3 = replace(
    DEEPSEEK_V2,
    model_types=("deepseek_v3",),
    fields=overridden(DEEPSEEK_V2.fields, (
        Field_("position.max_length", "max_position_embeddings", 4096, kind=INT),
        Field_("decoder.ffn.d_ff", "moe_intermediate_size", 2048, kind=INT),
        Field_("decoder.ffn.experts", "n_routed_experts", 256, kind=INT, aliases=("num_local_experts",)),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", 8, kind=INT),
        Field_("decoder.ffn.router.scale", "routed_scaling_factor", 2.5, kind=NUMBER),
        Field_("tokens.bos", "bos_token_id", 0, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 1, kind=TOKEN))) + (
        Field_("decoder.ffn.router.normalize", "norm_topk_prob", True, kind=BOOL),
    ),
    fixed={**DEEPSEEK_V2.fixed, "decoder": {**DEEPSEEK_V2.fixed["decoder"], "ffn": {
        "kind": "moe", "bias": False, "router": {"kind": "sigmoid", "selection_bias": True, "group_score": "top2_sum"}}}},
    refuse=(),
    heads={"DeepseekV3ForCausalLM": DEEPSEEK_V2.heads["DeepseekV2ForCausalLM"]},
    extra=_v3_extra,
)

REGISTERED = Registered(DEEPSEEK_V3, inverse={"deepseek_v3": lambda spec, config: deepseek_inverse(spec, config, 3)})
