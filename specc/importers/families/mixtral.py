"""Mixtral: Mistral's layers (LLaMA's table, a sliding window where `sliding_window` is set) with
each feed-forward block a mixture of routed SwiGLU experts, chosen by a softmax over every expert's
logit whose top `num_experts_per_tok` probabilities are divided by their sum (Jiang et al. 2024,
arXiv:2401.04088; transformers' MixtralSparseMoeBlock). A checkpoint holds each expert's w1 (gate),
w3 (up) and w2 (down) apart; they are stacked at import. Its config.json inverse is Mistral's."""
from __future__ import annotations

from dataclasses import replace

from specc.importers.families.llama import LLAMA, llama_extra, mistral_inverse
from specc.importers.table import INT, NUMBER, TOKEN, Field_, Registered, expert_rows, linear, overridden

THETA = 1000000.0  # MixtralConfig's default_theta


def _mixtral_extra(spec: dict, cfg: dict) -> None:
    """As LLaMA's (head_dim, rope_theta, default 1000000, and its scalings; a `sliding_window` W
    shorter than the context is a local pattern of W - 1, every layer)."""
    llama_extra(spec, cfg, THETA)


_M = "layers.{i}.block_sparse_moe."
MIXTRAL = replace(
    LLAMA,
    model_types=("mixtral",),
    fields=overridden(tuple(f for f in LLAMA.fields if f.name not in ("attention_bias", "mlp_bias")), (
        Field_("position.max_length", "max_position_embeddings", 131072, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-5, kind=NUMBER),
        Field_("tokens.bos", "bos_token_id", 1, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 2, kind=TOKEN))) + (
        Field_("decoder.ffn.experts", "num_local_experts", 8, kind=INT, aliases=("num_experts",)),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", 2, kind=INT),
    ),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"bias": False}, "ffn": {
        "kind": "moe", "bias": False, "router": {"kind": "softmax", "normalize": True}}}},
    heads={"MixtralForCausalLM": lambda cfg, t: [{"kind": "lm", "name": "logits"}]},
    names=tuple(r for r in LLAMA.names if ".ffn." not in r.specc) + (
        *linear("decoder.layers.{i}.ffn.router", _M + "gate", "decoder", bias=False),
        *expert_rows("decoder.layers.{i}.ffn.experts",
                     {"gate": _M + "experts.{e}.w1.weight", "up": _M + "experts.{e}.w3.weight",
                      "down": _M + "experts.{e}.w2.weight"},
                     {"gate": _M + "experts.w1.weight", "up": _M + "experts.w3.weight", "down": _M + "experts.w2.weight"}),
    ),
    extra=_mixtral_extra,
)

REGISTERED = Registered(MIXTRAL, inverse={"mixtral": mistral_inverse})
