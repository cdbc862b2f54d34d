"""Routed experts, attention sinks and latent attention against transformers' own modules, block by
block: each Hugging Face module is made from a small config, its tensors drawn at random (routers
wide enough that the choice of experts varies from token to token), copied into specc's module,
and both run on the same input in fp32: within 1e-5. The whole models (Mixtral, gpt-oss,
DeepSeek-V3) are in test_moe_models.py."""
from __future__ import annotations

import math

import pytest
import torch

import specc
from specc.nn.experts import MoE
from specc.nn.positions import rotary_cos_sin
from specc.spec.schema import ExpertsFFNSpec

from tests.helpers.speclib import tiny

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
D, N_TOKENS = 32, 23  # d_model; tokens per block test (batch 1 x 23, and 3 x 5 below)


ROUTERS = ("gate.weight", "router.weight")  # transformers' names of a block's router


def _randomize(module: torch.nn.Module, seed: int, scale: float = 1.0) -> None:
    """Every parameter and buffer of `module` drawn from N(0, 1 / fan-in) (a vector: N(0, 0.25)),
    a router's weight from N(0, scale^2 / fan-in): logits far enough apart that tokens choose
    different experts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted([*module.named_parameters(), *module.named_buffers()]):
            if not t.is_floating_point():
                continue
            noise = torch.randn(t.shape, generator=gen)
            wide = scale if name in ROUTERS else 1.0
            t.copy_(noise * (0.5 if t.dim() == 1 else wide / math.sqrt(t.shape[-1])))


def _x(seed: int = 1, shape=(1, N_TOKENS, D)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _ours(ffn: dict) -> MoE:
    return MoE(ExpertsFFNSpec.model_validate({"kind": "moe", **ffn}), D).eval()


def _copy(ours: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Every parameter of `ours` from `tensors` (by specc's name), none left over."""
    state = {name: t.detach().clone() for name, t in tensors.items()}
    ours.load_state_dict(state, strict=True)


def _split_gate_up(gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' stacked gate_up_proj [E, 2F, D]: gate is the first F rows, up the last."""
    f = gate_up.shape[1] // 2
    return gate_up[:, :f], gate_up[:, f:]


def _stacked(hf_experts) -> dict[str, torch.Tensor]:
    gate, up = _split_gate_up(hf_experts.gate_up_proj)
    return {"experts.gate": gate, "experts.up": up, "experts.down": hf_experts.down_proj}


def _mlp(prefix: str, hf_mlp) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{ours}.weight": getattr(hf_mlp, f"{hf}_proj").weight for ours, hf in
            (("gate", "gate"), ("up", "up"), ("down", "down"))}


def _compare(hf_block, ours: MoE, x: torch.Tensor) -> None:
    with torch.no_grad():
        want = hf_block(x)
        want = want[0] if isinstance(want, tuple) else want
        got = ours(x)
    assert got.shape == want.shape
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()


def _routes_vary(router_logits_fn, x) -> None:
    """The test means something: different tokens go to different experts."""
    with torch.no_grad():
        chosen = router_logits_fn(x.reshape(-1, D))
    assert len({tuple(sorted(row.tolist())) for row in chosen}) > 3


# --- mixtures of experts -------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(1, N_TOKENS, D), (3, 5, D)])
def test_mixtral_sparse_moe_block(shape):
    """Softmax over the experts, the top 2, renormalised (Mixtral always divides by their sum)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    cfg = transformers.MixtralConfig(hidden_size=D, intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)
    hf = MixtralSparseMoeBlock(cfg).eval()
    _randomize(hf, 0, scale=3.0)
    ours = _ours({"experts": 8, "top_k": 2, "d_ff": 48, "router": {"kind": "softmax", "normalize": True}})
    _copy(ours, {"router.weight": hf.gate.weight, **_stacked(hf.experts)})
    x = _x(shape=shape)
    _routes_vary(lambda h: ours.router(h)[1], x)
    _compare(hf, ours, x)


@pytest.mark.parametrize("normalize", [False, True])
def test_qwen2_moe_sparse_moe_block_with_its_gated_shared_expert(normalize):
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = transformers.Qwen2MoeConfig(hidden_size=D, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                      num_experts=8, num_experts_per_tok=3, norm_topk_prob=normalize)
    hf = Qwen2MoeSparseMoeBlock(cfg).eval()
    _randomize(hf, 1, scale=3.0)
    ours = _ours({"experts": 8, "top_k": 3, "d_ff": 24, "router": {"kind": "softmax", "normalize": normalize},
                  "shared": {"d_ff": 40, "gate": True}})
    _copy(ours, {"router.weight": hf.gate.weight, **_stacked(hf.experts), **_mlp("shared", hf.shared_expert),
                 "shared_gate.weight": hf.shared_expert_gate.weight})
    _compare(hf, ours, _x())


def test_qwen3_moe_sparse_moe_block():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = transformers.Qwen3MoeConfig(hidden_size=D, moe_intermediate_size=16, num_experts=16, num_experts_per_tok=4,
                                      norm_topk_prob=True)
    hf = Qwen3MoeSparseMoeBlock(cfg).eval()
    _randomize(hf, 2, scale=3.0)
    ours = _ours({"experts": 16, "top_k": 4, "d_ff": 16, "router": {"kind": "softmax", "normalize": True}})
    _copy(ours, {"router.weight": hf.gate.weight, **_stacked(hf.experts)})
    _compare(hf, ours, _x())


def test_olmoe_sparse_moe_block():
    """The chosen probabilities as they are (norm_topk_prob false)."""
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock

    cfg = transformers.OlmoeConfig(hidden_size=D, intermediate_size=20, num_experts=8, num_experts_per_tok=2,
                                   norm_topk_prob=False)
    hf = OlmoeSparseMoeBlock(cfg).eval()
    _randomize(hf, 3, scale=3.0)
    ours = _ours({"experts": 8, "top_k": 2, "d_ff": 20})
    _copy(ours, {"router.weight": hf.gate.weight, **_stacked(hf.experts)})
    _compare(hf, ours, _x())


def test_granitemoe_moe():
    """The top-k logits first, then their softmax."""
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeMoE

    cfg = transformers.GraniteMoeConfig(hidden_size=D, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2)
    hf = GraniteMoeMoE(cfg).eval()
    _randomize(hf, 4, scale=3.0)
    ours = _ours({"experts": 6, "top_k": 2, "d_ff": 24, "router": {"kind": "top_k_softmax"}})
    _copy(ours, {"router.weight": hf.router.weight, **_stacked(hf.experts)})
    _compare(hf, ours, _x())


def gpt_oss_experts(prefix: str, hf_mlp) -> dict[str, torch.Tensor]:
    """gpt-oss's experts in specc's names: gate_up_proj [E, D, 2F] (x @ W, gate and up interleaved
    column by column) and down_proj [E, F, D], each with a bias."""
    gu, gub = hf_mlp.experts.gate_up_proj, hf_mlp.experts.gate_up_proj_bias
    return {
        f"{prefix}router.weight": hf_mlp.router.weight, f"{prefix}router.bias": hf_mlp.router.bias,
        f"{prefix}experts.gate": gu[:, :, ::2].transpose(1, 2), f"{prefix}experts.up": gu[:, :, 1::2].transpose(1, 2),
        f"{prefix}experts.down": hf_mlp.experts.down_proj.transpose(1, 2),
        f"{prefix}experts.gate_bias": gub[:, ::2], f"{prefix}experts.up_bias": gub[:, 1::2],
        f"{prefix}experts.down_bias": hf_mlp.experts.down_proj_bias,
    }


GPT_OSS_FFN = {"experts": 8, "top_k": 3, "d_ff": 24, "activation": "clamped_swiglu", "swiglu_alpha": 1.702,
               "swiglu_limit": 7.0, "bias": True, "router": {"kind": "top_k_softmax", "bias": True}}


def test_gpt_oss_mlp_clamps_and_biases():
    """The router's bias, top-k then softmax, and the clamped SwiGLU with biased experts; inputs
    large enough that the clamps bind."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    cfg = transformers.GptOssConfig(hidden_size=D, intermediate_size=24, num_local_experts=8, num_experts_per_tok=3)
    hf = GptOssMLP(cfg).eval()
    _randomize(hf, 5, scale=3.0)
    ours = _ours(GPT_OSS_FFN)
    _copy(ours, gpt_oss_experts("", hf))
    x = 4 * _x()
    with torch.no_grad():  # the clamps bind: some gate and up projections pass the limit
        pre = torch.einsum("nd,edf->nef", x.reshape(-1, D), hf.experts.gate_up_proj)
    assert (pre[..., ::2] > 7).any() and (pre[..., 1::2].abs() > 7).any()
    _compare(hf, ours, x)


def test_phimoe_sparsemixer():
    from transformers.models.phimoe.modeling_phimoe import PhimoeSparseMoeBlock

    cfg = transformers.PhimoeConfig(hidden_size=D, intermediate_size=24, num_local_experts=8, num_experts_per_tok=2,
                                    router_jitter_noise=0.2)
    hf = PhimoeSparseMoeBlock(cfg).eval()
    _randomize(hf, 6, scale=3.0)
    ours = _ours({"experts": 8, "top_k": 2, "d_ff": 24, "router": {"kind": "sparsemixer", "jitter_eps": 0.2}})
    _copy(ours, {"router.weight": hf.router.weight, **_stacked(hf.experts)})
    x = _x()
    with torch.no_grad():  # the masks bind: some rows weigh their expert below 1 and above the plain softmax
        w, _ = ours.router(x.reshape(-1, D))
    assert (w < 0.999).any() and (w > 0.999).any()
    _compare(hf, ours, x)


@pytest.mark.parametrize("groups", [None, (4, 2)], ids=["greedy", "group-limited"])
def test_deepseek_v2_moe(groups):
    """Softmax scores, greedy or group-limited (each group scored by its best expert), times the
    routed scaling factor, plus the shared experts (one MLP of n_shared x moe_intermediate_size)."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe

    extra = {} if groups is None else {"topk_method": "group_limited_greedy", "n_group": groups[0], "topk_group": groups[1]}
    cfg = transformers.DeepseekV2Config(hidden_size=D, moe_intermediate_size=16, n_routed_experts=8, n_shared_experts=2,
                                        num_experts_per_tok=3, routed_scaling_factor=1.5, **extra)
    hf = DeepseekV2Moe(cfg).eval()
    _randomize(hf, 7, scale=3.0)
    router = {"kind": "softmax", "scale": 1.5}
    if groups is not None:
        router.update(groups=groups[0], top_groups=groups[1], group_score="max")
    ours = _ours({"experts": 8, "top_k": 3, "d_ff": 16, "router": router, "shared": {"d_ff": 32}})
    _copy(ours, {"router.weight": hf.gate.weight, **_stacked(hf.experts), **_mlp("shared", hf.shared_experts)})
    _compare(hf, ours, _x())


@pytest.mark.parametrize("normalize", [True, False])
def test_deepseek_v3_moe(normalize):
    """Sigmoid scores; the choice on scores + e_score_correction_bias within the best groups (each
    scored by its two best biased scores), the weights the unbiased scores, renormalised, times the
    routed scaling factor; plus the shared expert."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    cfg = transformers.DeepseekV3Config(hidden_size=D, moe_intermediate_size=16, n_routed_experts=16, n_shared_experts=1,
                                        num_experts_per_tok=4, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                        norm_topk_prob=normalize)
    hf = DeepseekV3MoE(cfg).eval()
    _randomize(hf, 8, scale=3.0)
    ours = _ours({"experts": 16, "top_k": 4, "d_ff": 16, "shared": {"d_ff": 16},
                  "router": {"kind": "sigmoid", "normalize": normalize, "scale": 2.5, "groups": 4, "top_groups": 2}})
    _copy(ours, {"router.weight": hf.gate.weight, "router.selection_bias": hf.gate.e_score_correction_bias,
                 **_stacked(hf.experts), **_mlp("shared", hf.shared_experts)})
    x = _x()
    with torch.no_grad():  # the bias changes some choices (so that leaving it out would fail)
        plain = ours.router.selection_bias.clone()
        ours.router.selection_bias.zero_()
        unbiased = ours.router(x.reshape(-1, D))[1].sort(-1).values
        ours.router.selection_bias.copy_(plain)
        assert not torch.equal(unbiased, ours.router(x.reshape(-1, D))[1].sort(-1).values)
    _compare(hf, ours, x)


def test_a_token_is_computed_by_its_chosen_experts_alone():
    """The cost per token follows top_k: an expert no token chose is never run (its weights may
    be anything), and each token's output is the weighted sum of its chosen experts' outputs."""
    ours = _ours({"experts": 8, "top_k": 2, "d_ff": 16})
    _randomize(ours, 9, scale=3.0)
    x = _x(shape=(1, 1, D)).reshape(1, D)
    with torch.no_grad():
        weights, index = ours.router(x)
        unused = sorted(set(range(8)) - set(index[0].tolist()))
        ours.experts.up[unused] = float("nan")
        out = ours(x)
        want = sum(w * ours.experts.expert(e, x) for w, e in zip(weights[0], index[0].tolist()))
    assert torch.isfinite(out).all()
    assert torch.allclose(out, want, atol=ATOL)


# --- attention: sinks and latent attention -------------------------------------------------------


def _additive(allowed: torch.Tensor) -> torch.Tensor:
    """transformers' 4-D float mask from specc's boolean one."""
    return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)


def _causal(t: int, window: int | None = None) -> torch.Tensor:
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    allowed = k <= q
    if window is not None:
        allowed &= q - k < window  # transformers' sliding window: the last `window` keys, itself included
    return allowed[None, None]


def _our_attention(spec_overrides: dict, layer: int = 0):
    """The attention module of layer `layer` of a tiny decoder (specc.to_torch), with its rotary
    cos / sin for positions 0..T-1."""
    model = specc.to_torch(tiny(spec_overrides), seed=0)
    return model.decoder.layers[layer].attention


@pytest.mark.parametrize("layer_type", ["sliding_attention", "full_attention"])
def test_gpt_oss_attention_with_sinks(layer_type):
    """gpt-oss: a learned logit per head joins each row's softmax; grouped-query heads, biased
    projections, and on sliding layers a window of 4 keys (specc's local window 3)."""
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssAttention, GptOssRotaryEmbedding

    cfg = transformers.GptOssConfig(hidden_size=D, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                    sliding_window=4, layer_types=[layer_type], num_hidden_layers=1)
    cfg._attn_implementation = "eager"
    hf = GptOssAttention(cfg, 0).eval()
    _randomize(hf, 10, scale=2.0)
    window = 3 if layer_type == "sliding_attention" else None
    pattern = {"kind": "local", "window": window} if window else {"kind": "full"}
    ours = _our_attention({"d_model": D, "position": {"kind": "rotary", "base": cfg.rope_parameters["rope_theta"],
                                                      "scaling": _gpt_oss_yarn(cfg)},
                           "decoder": {"layers": 1, "attention": {"heads": 4, "kv_heads": 2, "d_k": 16, "sinks": True,
                                                                  "pattern": pattern}}})
    _copy(ours, {f"{a}.{leaf}": getattr(hf, f"{a}_proj").__getattr__(leaf) for a in "qkvo" for leaf in ("weight", "bias")}
          | {"sinks": hf.sinks})
    t = 9
    x = _x(shape=(2, t, D))
    pos = torch.arange(t)[None].expand(2, t)
    allowed = _causal(t, 4 if window else None)
    with torch.no_grad():
        cos, sin = GptOssRotaryEmbedding(cfg)(x, pos)
        want, _ = hf(x, (cos, sin), _additive(allowed))
        got, _ = ours(x, allowed.expand(2, 1, t, t), torch.arange(t), rope=rotary_cos_sin(pos, ours.frequencies, x.dtype))
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()
    with torch.no_grad():  # the sinks take a share: without them the output differs
        ours.sinks.fill_(-1e4)
        plain, _ = ours(x, allowed.expand(2, 1, t, t), torch.arange(t), rope=rotary_cos_sin(pos, ours.frequencies, x.dtype))
    assert not torch.allclose(plain, want, atol=1e-3)


def _gpt_oss_yarn(cfg) -> dict:
    """The language's YaRN scaling from gpt-oss's rope_parameters."""
    rp = cfg.rope_parameters
    return {"kind": "yarn", "factor": rp["factor"], "original_max_length": rp["original_max_position_embeddings"],
            "beta_fast": rp["beta_fast"], "beta_slow": rp["beta_slow"], "truncate": rp.get("truncate", True)}


def latent_tensors(prefix: str, hf_att, q_lora: bool) -> dict[str, torch.Tensor]:
    """DeepSeek's attention in specc's names."""
    names = {"kv_a": "kv_a_proj_with_mqa", "kv_a_norm": "kv_a_layernorm", "kv_b": "kv_b_proj", "o": "o_proj"}
    names |= {"q_a": "q_a_proj", "q_a_norm": "q_a_layernorm", "q_b": "q_b_proj"} if q_lora else {"q": "q_proj"}
    out = {}
    for ours, theirs in names.items():
        for leaf, t in getattr(hf_att, theirs).named_parameters():
            out[f"{prefix}{ours}.{leaf}"] = t
    return out


LATENT = dict(heads=4, nope=12, rope=8, v=10, kv_rank=16)


def _deepseek_config(version: int, q_lora: int | None, **extra):
    cls = transformers.DeepseekV2Config if version == 2 else transformers.DeepseekV3Config
    cfg = cls(hidden_size=D, num_attention_heads=LATENT["heads"], num_key_value_heads=LATENT["heads"],
              qk_nope_head_dim=LATENT["nope"], qk_rope_head_dim=LATENT["rope"], v_head_dim=LATENT["v"],
              kv_lora_rank=LATENT["kv_rank"], q_lora_rank=q_lora, num_hidden_layers=1, **extra)
    cfg._attn_implementation = "eager"
    return cfg


def deepseek_yarn_scale(cfg) -> float:
    """The softmax scale transformers' DeepSeek attention uses: qk_head_dim^-1/2, times mscale^2
    under YaRN with mscale_all_dim (yarn_apply_mscale), in its order of operations."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** (-0.5)
    rp = cfg.rope_parameters
    if rp.get("rope_type", "default") != "default" and rp.get("mscale_all_dim"):
        mscale = 0.1 * rp["mscale_all_dim"] * math.log(rp["factor"]) + 1.0
        scale = scale * mscale * mscale
    return scale


@pytest.mark.parametrize("version,q_lora,interleave", [(2, None, True), (2, 24, True), (3, 24, True), (3, None, False)],
                         ids=["v2-lite", "v2", "v3", "v3-halves"])
def test_deepseek_latent_attention(version, q_lora, interleave):
    """MLA with and without the queries' low rank, the rotary part interleaved (DeepSeek's pairs)
    or in halves, and YaRN with mscale_all_dim on V3 (its softmax scale times mscale^2); then a
    cached step: the cache holds the latent and the rotary key, and the step sees the same
    attention as the whole pass."""
    module = __import__(f"transformers.models.deepseek_v{version}.modeling_deepseek_v{version}", fromlist=["x"])
    extra = {"rope_interleave": interleave} if version == 3 else {}
    if version == 3:
        extra["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                    "mscale_all_dim": 1.0, "original_max_position_embeddings": 16,
                                    "beta_fast": 32.0, "beta_slow": 1.0}
    cfg = _deepseek_config(version, q_lora, **extra)
    attention_cls = getattr(module, f"DeepseekV{version}Attention")
    hf = attention_cls(cfg, 0).eval()
    _randomize(hf, 11, scale=2.0)
    rotary = {"kind": "rotary", "base": 10000.0, "layout": "interleaved" if interleave else "halves", "max_length": 64}
    if version == 3:
        rotary["scaling"] = {"kind": "yarn", "factor": 4.0, "original_max_length": 16, "attention_factor": 1.0}
    att = {"kind": "latent", "heads": LATENT["heads"], "d_k": LATENT["nope"] + LATENT["rope"], "d_v": LATENT["v"],
           "rope_dims": LATENT["rope"], "q_rank": q_lora, "kv_rank": LATENT["kv_rank"], "scale": deepseek_yarn_scale(cfg)}
    ours = _our_attention({"d_model": D, "position": rotary, "norm": {"kind": "rmsnorm", "placement": "pre"},
                           "decoder": {"layers": 1, "attention": att}})
    _copy(ours, latent_tensors("", hf, q_lora is not None))
    t = 8
    x = 2 * _x(shape=(2, t, D))
    pos = torch.arange(t)[None].expand(2, t)
    allowed = _causal(t)
    with torch.no_grad():
        rope = getattr(module, f"DeepseekV{version}RotaryEmbedding")(cfg)(x, pos)
        want, _ = hf(hidden_states=x, position_embeddings=rope, attention_mask=_additive(allowed))
        got, (latent, k_rot) = ours(x, allowed.expand(2, 1, t, t), torch.arange(t),
                                    rope=rotary_cos_sin(pos, ours.frequencies, x.dtype, ours.interleaved))
    assert latent.shape == (2, 1, t, LATENT["kv_rank"]) and k_rot.shape == (2, 1, t, LATENT["rope"])
    assert torch.allclose(got, want, atol=ATOL, rtol=0), (got - want).abs().max()
    with torch.no_grad():  # the last 3 tokens after a cache of the first 5
        _, past = ours(x[:, :5], allowed[..., :5, :5].expand(2, 1, 5, 5), torch.arange(5),
                       rope=rotary_cos_sin(pos[:, :5], ours.frequencies, x.dtype, ours.interleaved))
        step, _ = ours(x[:, 5:], allowed[..., 5:, :].expand(2, 1, 3, t), torch.arange(5, t), past=past,
                       rope=rotary_cos_sin(pos[:, 5:], ours.frequencies, x.dtype, ours.interleaved))
    assert torch.allclose(step, want[:, 5:], atol=ATOL, rtol=0), (step - want[:, 5:]).abs().max()
