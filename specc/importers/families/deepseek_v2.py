"""DeepSeek-V2: multi-head latent attention (DeepSeek-AI 2024, arXiv:2405.04434, section 2.1: the
queries projected directly or through a low rank `q_lora_rank`, keys and values from one latent
of `kv_lora_rank` and a rotary key shared by the heads, the rotary part's pairs interleaved) and,
after the first `first_k_dense_replace` dense layers, routed SwiGLU experts under a softmax router,
greedy or limited to the best `topk_group` of `n_group` groups (each scored by its best expert),
the weights times `routed_scaling_factor`, beside `n_shared_experts` shared experts computed as
one of n_shared_experts x moe_intermediate_size (transformers' DeepseekV2Moe; its router ignores
`norm_topk_prob`, and so does the import). YaRN as LLaMA's, the softmax scale times mscale^2 where
`mscale_all_dim` is given (transformers' yarn_apply_mscale). DeepSeek-V3 is built on this module.
The GGUF row `deepseek2` reads both (by its gating function): the converter stacks the experts and
splits kv_b into k_b (each head's key rows, transposed) and v_b, put together again here."""
from __future__ import annotations

import math

import numpy as np

from specc.importers.families.llama import GATED, GGUF_LAYER, GGUF_TOP, LLAMA, rotary_inverse
from specc.importers.families.qwen2_moe import GGUF_MOE
from specc.importers.gguftable import Arch, Meta, common
from specc.importers.layers import dense_layers, set_dense
from specc.importers.rope import SCALING_SOURCE, read_rope, rope_kind, set_rope
from specc.importers.table import (BOOL, INT, INT_OR_NULL, NUMBER, NUMBER_OR_NULL, OBJECT_OR_NULL, STR, STR_OR_NULL,
                                   TOKEN, Family, Field_, Name, Refuse, Registered, expert_rows, linear, lookup, norm,
                                   read, set_key)


def _rope_params(cfg: dict) -> dict:
    """The rope mapping transformers reads (rope_scaling over rope_parameters), theta included."""
    params = read(cfg, "rope_scaling", OBJECT_OR_NULL, None) or read(cfg, "rope_parameters", OBJECT_OR_NULL, None) or {}
    return params


def deepseek_scale(cfg: dict, d_k: int, max_length: int) -> float:
    """transformers' softmax scale for DeepSeek's attention (yarn_apply_mscale): d_k^-1/2, times
    mscale^2 = (0.1 mscale_all_dim ln(factor) + 1)^2 where the rope type is not default and
    `mscale_all_dim` is given (factor: the mapping's, else max_position_embeddings over the
    original), in transformers' order of operations."""
    scale = d_k ** (-0.5)
    params = _rope_params(cfg)
    label = "rope_scaling" if read(cfg, "rope_scaling", OBJECT_OR_NULL, None) else "rope_parameters"
    if rope_kind(params, label) == "default":
        return scale
    mscale_all = read(params, "mscale_all_dim", NUMBER_OR_NULL, None, label=f"{label}.mscale_all_dim")
    if not mscale_all:
        return scale
    factor = read(params, "factor", NUMBER_OR_NULL, None, label=f"{label}.factor")
    if factor is None:
        factor = max_length / read(params, "original_max_position_embeddings", INT,
                                   label=f"{label}.original_max_position_embeddings")
    mscale = 0.1 * mscale_all * math.log(factor) + 1.0 if factor > 1 else 1.0
    return scale * mscale * mscale


def deepseek_extra(spec: dict, cfg: dict, version: int) -> None:
    """`decoder.attention.d_k` = `qk_nope_head_dim` + `qk_rope_head_dim`, `scale` as transformers'
    (d_k^-1/2, times mscale^2 under YaRN with `mscale_all_dim`); `num_key_value_heads` must be
    the heads (transformers' latent attention expands the latent to every head). Positions as
    LLaMA's (`rope_theta`, YaRN with `mscale` / `mscale_all_dim` as its attention factor), each
    head's rotary pairs interleaved (V3: unless `rope_interleave` is false: halves). Shared
    experts: `n_shared_experts` (0: none) as one of `n_shared_experts` x `moe_intermediate_size`.
    The first `first_k_dense_replace` layers: `overrides` with a dense SwiGLU of
    `intermediate_size`. The router: V2's softmax, `topk_method` greedy or group_limited_greedy
    (`n_group` groups scored by their best expert, the best `topk_group` kept), times
    `routed_scaling_factor`; V3's sigmoid with the selection bias (e_score_correction_bias),
    `n_group` groups scored by the sum of their two best biased scores, the best `topk_group`
    kept, renormalised where `norm_topk_prob`, times `routed_scaling_factor`."""
    heads = read(cfg, "num_attention_heads", INT)
    kv = read(cfg, "num_key_value_heads", INT_OR_NULL, None)
    if kv is not None and kv != heads:
        raise ValueError(f"num_key_value_heads {kv}: latent attention gives every head ({heads}) its keys and "
                         "values from one latent")
    d_k = read(cfg, "qk_nope_head_dim", INT, 128) + read(cfg, "qk_rope_head_dim", INT, 64)
    set_key(spec, "decoder.attention.d_k", d_k)
    max_length = spec["position"]["max_length"]
    set_key(spec, "decoder.attention.scale", deepseek_scale(cfg, d_k, max_length))
    set_rope(spec, *read_rope(cfg, spec, "rope_theta", "partial_rotary_factor", 1.0))
    interleaved = version == 2 or read(cfg, "rope_interleave", BOOL, True)
    set_key(spec, "position.layout", "interleaved" if interleaved else "halves")
    d_ff = spec["decoder"]["ffn"]["d_ff"]
    shared = read(cfg, "n_shared_experts", INT_OR_NULL, 2 if version == 2 else 1) or 0
    if shared > 0:
        set_key(spec, "decoder.ffn.shared", {"d_ff": shared * d_ff})
    experts = spec["decoder"]["ffn"]["experts"]
    if version == 2:
        method = read(cfg, "topk_method", STR_OR_NULL, "greedy")
        if method == "group_limited_greedy":
            set_key(spec, "decoder.ffn.router.groups", read(cfg, "n_group", INT))
            set_key(spec, "decoder.ffn.router.top_groups", read(cfg, "topk_group", INT))
            set_key(spec, "decoder.ffn.router.group_score", "max")
        elif method != "greedy":
            raise ValueError(f"topk_method {method!r}: DeepSeek-V2's routers are greedy and group_limited_greedy")
    else:
        groups = read(cfg, "n_group", INT_OR_NULL, 8)
        top = read(cfg, "topk_group", INT_OR_NULL, 4)
        if groups is None or top is None:
            raise ValueError(f"{'n_group' if groups is None else 'topk_group'}: null; transformers' DeepSeek-V3 router "
                             "chooses among groups of experts")
        set_key(spec, "decoder.ffn.router.groups", groups)
        set_key(spec, "decoder.ffn.router.top_groups", top)
    layers = read(cfg, "num_hidden_layers", INT)
    first = read(cfg, "first_k_dense_replace", INT_OR_NULL, 0 if version == 2 else 3) or 0
    if experts and first:
        set_dense(spec, list(range(min(first, layers))), layers,
                  {"kind": "dense", "d_ff": read(cfg, "intermediate_size", INT),
                   "activation": spec["decoder"]["ffn"]["activation"], "bias": False})


def _lm(cfg: dict, t: dict) -> list:
    return [{"kind": "lm", "name": "logits"}]


def _v2_extra(spec: dict, cfg: dict) -> None:
    deepseek_extra(spec, cfg, 2)


_v2_extra.__doc__ = deepseek_extra.__doc__


_A = "layers.{i}.self_attn."
_M = "layers.{i}.mlp."
LATENT_NAMES = (
    *linear("decoder.layers.{i}.attention.q", _A + "q_proj", "decoder", bias=False),
    *linear("decoder.layers.{i}.attention.q_a", _A + "q_a_proj", "decoder"),
    *norm("decoder.layers.{i}.attention.q_a_norm", _A + "q_a_layernorm", "decoder", bias=False),
    *linear("decoder.layers.{i}.attention.q_b", _A + "q_b_proj", "decoder", bias=False),
    *linear("decoder.layers.{i}.attention.kv_a", _A + "kv_a_proj_with_mqa", "decoder"),
    *norm("decoder.layers.{i}.attention.kv_a_norm", _A + "kv_a_layernorm", "decoder", bias=False),
    # a GGUF file splits kv_b into k_b (each head's key rows, transposed) and v_b
    Name("decoder.layers.{i}.attention.kv_b.weight", (_A + "kv_b_proj.weight",), "copy", "decoder",
         alt=((_A + "k_b_proj.weight+" + _A + "v_b_proj.weight", "heads_cat"),)),
    *linear("decoder.layers.{i}.attention.o", _A + "o_proj", "decoder"),
)

DEEPSEEK_V2 = Family(
    model_types=("deepseek_v2",),
    architecture="decoder",
    fields=(
        Field_("d_model", "hidden_size", kind=INT),
        Field_("vocab.size", "vocab_size", kind=INT),
        Field_("vocab.tie_output", "tie_word_embeddings", False, kind=BOOL),
        Field_("position.max_length", "max_position_embeddings", 2048, kind=INT),
        Field_("norm.eps", "rms_norm_eps", 1e-6, kind=NUMBER),
        Field_("dropout.attention", "attention_dropout", 0.0, kind=NUMBER),
        Field_("decoder.layers", "num_hidden_layers", kind=INT),
        Field_("decoder.attention.heads", "num_attention_heads", kind=INT),
        Field_("decoder.attention.rope_dims", "qk_rope_head_dim", 64, kind=INT),
        Field_("decoder.attention.d_v", "v_head_dim", 128, kind=INT),
        Field_("decoder.attention.q_rank", "q_lora_rank", 1536, kind=INT_OR_NULL),
        Field_("decoder.attention.kv_rank", "kv_lora_rank", 512, kind=INT),
        Field_("decoder.attention.bias", "attention_bias", False, kind=BOOL),
        Field_("decoder.ffn.d_ff", "moe_intermediate_size", 1407, kind=INT),
        Field_("decoder.ffn.experts", "n_routed_experts", 64, kind=INT, aliases=("num_experts",)),
        Field_("decoder.ffn.top_k", "num_experts_per_tok", kind=INT),
        Field_("decoder.ffn.activation", "hidden_act", "silu", lookup(GATED, "hidden_act"), kind=STR),
        Field_("decoder.ffn.router.scale", "routed_scaling_factor", 1.0, kind=NUMBER),
        Field_("tokens.bos", "bos_token_id", 1, kind=TOKEN),
        Field_("tokens.eos", "eos_token_id", 2, kind=TOKEN),
        Field_("tokens.pad", "pad_token_id", None, kind=TOKEN),
    ),
    fixed={**LLAMA.fixed, "decoder": {"attention": {"kind": "latent"}, "ffn": {
        "kind": "moe", "bias": False, "router": {"kind": "softmax"}}}},
    refuse=(Refuse("mlp_bias", (False,), False, "biased dense and shared experts beside unbiased routed ones"),),
    heads={"DeepseekV2ForCausalLM": _lm},
    names=(
        Name("embeddings.tokens.weight", ("embed_tokens.weight",)),
        *LATENT_NAMES,
        *norm("decoder.layers.{i}.attention_norm", "layers.{i}.input_layernorm", "decoder", bias=False),
        *norm("decoder.layers.{i}.ffn_norm", "layers.{i}.post_attention_layernorm", "decoder", bias=False),
        *(n for p in ("gate", "up", "down") for n in linear(f"decoder.layers.{{i}}.ffn.{p}", _M + f"{p}_proj",
                                                             "decoder", bias=False)),
        *linear("decoder.layers.{i}.ffn.router", _M + "gate", "decoder", bias=False),
        Name("decoder.layers.{i}.ffn.router.selection_bias",
             (_M + "gate.e_score_correction_bias", _M + "gate.e_score_correction.bias"), "copy", "decoder"),
        *expert_rows("decoder.layers.{i}.ffn.experts",
                     {p: _M + f"experts.{{e}}.{p}_proj.weight" for p in ("gate", "up", "down")},
                     {p: _M + f"experts.{p}_proj.weight" for p in ("gate", "up", "down")}),
        *(n for p in ("gate", "up", "down") for n in linear(f"decoder.layers.{{i}}.ffn.shared.{p}",
                                                             _M + f"shared_experts.{p}_proj", "decoder", bias=False)),
        *norm("decoder.final_norm", "norm", bias=False),
        Name("heads.{head}.proj.weight", ("lm_head.weight",)),
    ),
    prefixes=("model.", ""),
    ignore=(r"rotary_emb\.inv_freq$",),
    extra=_v2_extra,
    sources={"decoder.attention.d_k": "qk_nope_head_dim (+ qk_rope_head_dim)", "position.scaling": SCALING_SOURCE,
             "position.base": "rope_theta (or rope_parameters.rope_theta)", "decoder.ffn.shared": "n_shared_experts",
             "decoder.ffn.router.groups": "n_group", "decoder.ffn.router.top_groups": "topk_group",
             "decoder.overrides": "first_k_dense_replace", "decoder.attention.scale": "rope_parameters.mscale_all_dim"},
)


# --- config.json, backwards ---------------------------------------------------------------------


def _scale_inverse(attention: dict, config: dict) -> None:
    """The softmax scale as the YaRN mapping's mscale_all_dim (deepseek_scale backwards): none
    where it is d_k^-1/2; else the value whose scale is the spec's to the last bit (a few
    neighbouring floats tried), ValueError where there is none or no YaRN to carry it."""
    plain = attention["d_k"] ** (-0.5)
    scale = attention.get("scale") or plain
    if scale == plain:
        return
    rope = config.get("rope_scaling") or {}
    factor = rope.get("factor")
    if rope.get("rope_type") != "yarn" or not factor or factor <= 1:
        raise ValueError("a softmax scale other than d_k^-1/2 is DeepSeek's YaRN mscale_all_dim")
    guess = (math.sqrt(scale / plain) - 1.0) / (0.1 * math.log(factor))
    for candidate in _neighbours(guess):
        cfg = {"rope_scaling": {**rope, "mscale_all_dim": candidate}}
        if candidate > 0 and deepseek_scale(cfg, attention["d_k"], 0) == scale:
            rope["mscale_all_dim"] = candidate
            return
    raise ValueError(f"softmax scale {scale}: no mscale_all_dim gives it exactly")


def _neighbours(x: float, steps: int = 8):
    """X, then the floats on either side of it, nearest first."""
    yield x
    up = down = x
    for _ in range(steps):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        yield up
        yield down


def deepseek_inverse(spec: dict, config: dict, version: int) -> None:
    """DeepSeek: the rotary rules (LLaMA's), qk_nope_head_dim, the shared experts, the dense
    first layers, the router's groups; a scale other than transformers' for these fields is not
    one a DeepSeek config says."""
    attention, ffn = spec["decoder"]["attention"], spec["decoder"]["ffn"]
    config["qk_nope_head_dim"] = attention["d_k"] - attention["rope_dims"]
    config["num_key_value_heads"] = attention["heads"]
    rotary_inverse(spec, config)
    config.pop("head_dim", None)
    config.pop("partial_rotary_factor", None)
    _scale_inverse(attention, config)
    if version == 3:
        config["rope_interleave"] = spec["position"].get("layout") == "interleaved"
    elif spec["position"].get("layout") != "interleaved":
        raise ValueError("DeepSeek-V2 interleaves its rotary pairs")
    shared = ffn.get("shared")
    if shared is not None and (shared["gate"] or shared["d_ff"] % ffn["d_ff"]):
        raise ValueError("shared experts are whole experts, ungated")
    config["n_shared_experts"] = shared["d_ff"] // ffn["d_ff"] if shared else 0
    dense, dense_ffn = dense_layers(spec)
    if dense != list(range(len(dense))):
        raise ValueError("dense layers first")
    config["first_k_dense_replace"] = len(dense)
    if dense_ffn is not None:
        if dense_ffn["bias"] or dense_ffn["activation"] != ffn["activation"]:
            raise ValueError("a dense layer of the experts' activation, unbiased")
        config["intermediate_size"] = dense_ffn["d_ff"]
    router = ffn["router"]
    if version == 2:
        grouped = router.get("groups") is not None
        config["topk_method"] = "group_limited_greedy" if grouped else "greedy"
        config["n_group"], config["topk_group"] = router.get("groups"), router.get("top_groups")
    else:
        config["n_group"], config["topk_group"] = router["groups"], router["top_groups"]
        config["norm_topk_prob"] = router["normalize"]


# --- GGUF ---------------------------------------------------------------------------------------

SIGMOID = 2  # llama.cpp's LLAMA_EXPERT_GATING_FUNC_TYPE_SIGMOID (1: softmax)


def _deepseek2_config(m: Meta) -> dict:
    """DeepSeek-V2 and V3 (`expert_gating_func` sigmoid: V3's router with the selection bias
    exp_probs_b; softmax or absent: V2's, as llama.cpp reads older files): the latent's sizes
    (`attention.q_lora_rank`, absent where the queries are projected directly;
    `attention.kv_lora_rank`; `rope.dimension_count`, the rotary part), each head's key and value
    size (`attention.key_length_mla` / `value_length_mla`, or in files without them
    `attention.key_length` / `value_length`), the experts (`expert_count`, `expert_used_count`,
    `expert_feed_forward_length`, `expert_shared_count`, `expert_weights_scale`,
    `expert_weights_norm`, `expert_group_count` / `expert_group_used_count`: groups scored by their
    two best experts, as llama.cpp and V3 score them), the first `leading_dense_block_count` layers
    dense and `feed_forward_length` wide; YaRN from `rope.scaling.*`, `yarn_log_multiplier` being
    0.1 x mscale_all_dim (the softmax scale's), the cos and sin unscaled (llama.cpp takes mscale
    and mscale_all_dim as equal). A softmax router with groups (llama.cpp scores them by their
    two best experts, transformers' V2 by its best) or renormalised weights (which V2 never
    renormalises) is refused, naming the key."""
    cfg = common(m, "deepseek_v2", "DeepseekV2ForCausalLM", context=4096)
    cfg["num_key_value_heads"] = cfg["num_attention_heads"]  # the converter writes 1: its MQA form of the latent
    v3 = m.raw(f"{m.arch}.expert_gating_func") == SIGMOID
    if v3:
        cfg.update(model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"], rope_interleave=True)
    rope = int(m.number("rope.dimension_count"))
    mla = m.raw(f"{m.arch}.attention.key_length_mla") is not None
    d_k = int(m.number("attention.key_length_mla" if mla else "attention.key_length"))
    d_v = int(m.number("attention.value_length_mla" if mla else "attention.value_length"))
    q_rank = m.raw(f"{m.arch}.attention.q_lora_rank")
    cfg.update(qk_rope_head_dim=rope, qk_nope_head_dim=d_k - rope, v_head_dim=d_v,
               kv_lora_rank=int(m.number("attention.kv_lora_rank")),
               q_lora_rank=int(m.number("attention.q_lora_rank")) if q_rank else None,
               n_routed_experts=int(m.number("expert_count")), num_experts_per_tok=int(m.number("expert_used_count")),
               moe_intermediate_size=int(m.number("expert_feed_forward_length")),
               n_shared_experts=int(m.number("expert_shared_count", 0)),
               routed_scaling_factor=float(m.number("expert_weights_scale", 1.0)),
               first_k_dense_replace=int(m.number("leading_dense_block_count", 0)), hidden_act="silu")
    norm = m.flag("expert_weights_norm", False)
    groups, used = int(m.number("expert_group_count", 1)), int(m.number("expert_group_used_count", 1))
    if v3:
        cfg.update(norm_topk_prob=norm, n_group=groups, topk_group=used)
    else:
        if groups > 1:
            m.refuse(f"{m.arch}.expert_group_count", f"{groups} with softmax scores: llama.cpp scores each group by "
                     "its two best experts, transformers' DeepSeek-V2 by its best one")
        if norm:
            m.refuse(f"{m.arch}.expert_weights_norm", "true with softmax scores: transformers' DeepSeek-V2 never "
                     "renormalises the chosen weights")
        cfg["topk_method"] = "greedy"
    params: dict = {"rope_type": "default", "rope_theta": float(m.number("rope.freq_base", 10000.0))}
    if m.raw(f"{m.arch}.rope.scaling.type") == "yarn":
        params.update(rope_type="yarn", factor=float(m.number("rope.scaling.factor")), attention_factor=1.0,
                      original_max_position_embeddings=int(m.number("rope.scaling.original_context_length")),
                      beta_fast=float(m.number("rope.scaling.yarn_beta_fast", 32.0)),
                      beta_slow=float(m.number("rope.scaling.yarn_beta_slow", 1.0)))
        log_mul = float(m.number("rope.scaling.yarn_log_multiplier", 0.0))
        if log_mul:
            params.update(mscale=log_mul / 0.1, mscale_all_dim=log_mul / 0.1)
    cfg["rope_parameters"] = params
    return cfg


def _fix_deepseek2(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """k_b: each head's key rows, transposed by the converter ([H, R, Dn]): back to [H, Dn, R]."""
    return w.swapaxes(-1, -2) if kind == "attn_k_b" else w


_GGUF_DEEPSEEK2 = {
    **{k: v for k, v in GGUF_LAYER.items() if not k.startswith("attn_") or k in ("attn_norm", "attn_output")},
    **GGUF_MOE, "attn_q": "self_attn.q_proj", "attn_q_a": "self_attn.q_a_proj", "attn_q_a_norm": "self_attn.q_a_layernorm",
    "attn_q_b": "self_attn.q_b_proj", "attn_kv_a_mqa": "self_attn.kv_a_proj_with_mqa",
    "attn_kv_a_norm": "self_attn.kv_a_layernorm", "attn_kv_b": "self_attn.kv_b_proj", "attn_k_b": "self_attn.k_b_proj",
    "attn_v_b": "self_attn.v_b_proj", "exp_probs_b": "mlp.gate.e_score_correction",
    **{f"ffn_{p}_shexp": f"mlp.shared_experts.{p}_proj" for p in ("gate", "up", "down")}}

REGISTERED = Registered(
    DEEPSEEK_V2,
    inverse={"deepseek_v2": lambda spec, config: deepseek_inverse(spec, config, 2)},
    gguf={"deepseek2": Arch("deepseek_v2", "DeepseekV2ForCausalLM", _deepseek2_config, _GGUF_DEEPSEEK2, GGUF_TOP,
                            fix=_fix_deepseek2, transposed=frozenset({"attn_k_b"}), tokenizer=False,
                            rope_scalings=frozenset({"yarn"}))},
)
