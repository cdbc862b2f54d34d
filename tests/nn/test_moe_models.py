"""Whole models of routed experts against transformers: Mixtral, gpt-oss and DeepSeek-V3 (with
DeepSeek-V2-Lite's direct queries and group-limited softmax routing), each from a small random
config, saved as a checkpoint and imported (specc import hf: the family tables of
specc.importers.families). The import gives the spec written by hand below from the config, layer
by layer; the logits agree within 1e-4 in fp32, with the cache as without, and greedy decoding
picks the same tokens."""
from __future__ import annotations

import math

import pytest
import torch

import specc
from specc.importers.hf import import_hf
from specc.spec import loads_spec
from specc.spec.yamlio import dump_yaml

from tests.nn.test_moe_reference import deepseek_yarn_scale

transformers = pytest.importorskip("transformers")

D, V, LAYERS = 32, 97, 3


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """transformers' own draws at a wider range (routers that send tokens to different experts,
    logits with margins), then every bias, norm gain, sink and selection bias moved off its
    initial value, so that a wrongly wired one shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in sorted([*model.named_parameters(), *model.named_buffers()]):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(t.shape, generator=gen)
            if t.dim() == 1 or name.endswith("_bias"):
                t.copy_((1.0 if "norm" in name else 0.0) + 0.3 * noise)
            else:
                wide = 4.0 if name.endswith(("mlp.gate.weight", "mlp.router.weight")) else 1.0
                t.copy_(noise * wide / math.sqrt(t.shape[-1]))


def _imported(hf, hand: specc.spec.ModelSpec, tmp_path) -> torch.nn.Module:
    """transformers' model saved and imported: specc's module of the imported spec and weights,
    after checking that the import computes the spec written by hand (layer by layer, positions
    and norm)."""
    hf.save_pretrained(tmp_path / "ckpt")
    spec, _ = import_hf(tmp_path / "ckpt", tmp_path / "imported.yaml")
    got, want = specc.resolve(specc.load_spec(spec)), specc.resolve(hand)
    assert [(layer.attention, layer.ffn) for layer in got.decoder.layers] == \
        [(layer.attention, layer.ffn) for layer in want.decoder.layers]
    assert (got.position, got.norm) == (want.position, want.norm)
    return specc.to_torch(spec)


def _spec(decoder: dict, position: dict, eps: float) -> specc.spec.ModelSpec:
    return loads_spec(dump_yaml({
        "specc": 1, "name": "moe-test", "architecture": "decoder", "d_model": D,
        "vocab": {"size": V, "tie_output": False}, "position": {"max_length": 64, **position},
        "norm": {"kind": "rmsnorm", "placement": "pre", "eps": eps}, "dropout": 0.0, "decoder": decoder,
        "serving": {"length": {"min": 1, "opt": 16, "max": 64}},
    }))


def _agree(hf, ours, steps: int = 6) -> None:
    """Logits of a 2 x 9 batch within 1e-4; then the prompt's cache and `steps` greedy tokens, one
    at a time from the cache: the same tokens as transformers' generate, each step's logits
    within 1e-4 of a whole pass."""
    ids = torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = ours(input_ids=ids)["logits"]
        assert torch.allclose(got, want, atol=1e-4, rtol=0), (got - want).abs().max()
        generated = hf.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps,
                                pad_token_id=0, eos_token_id=None)
        out = ours(input_ids=ids, use_cache=True)
        tokens = ids
        for _ in range(steps):
            nxt = out["logits"][:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
            past = {k.replace("present", "past_key_values", 1): v for k, v in out.items() if k.startswith("present.")}
            out = ours(input_ids=nxt, **past)
        whole = ours(input_ids=tokens)["logits"][:, -1]
    assert torch.equal(tokens, generated), (tokens, generated)
    assert torch.allclose(out["logits"][:, -1], whole, atol=1e-4, rtol=0)


def _hf(config_cls: str, model_cls: str, seed: int, **kwargs):
    cfg = getattr(transformers, config_cls)(vocab_size=V, hidden_size=D, num_hidden_layers=LAYERS,
                                            max_position_embeddings=64, tie_word_embeddings=False, **kwargs)
    cfg._attn_implementation = "eager"
    hf = getattr(transformers, model_cls)(cfg).eval()
    _randomize(hf, seed)
    return cfg, hf


def test_mixtral_matches_transformers(tmp_path):
    cfg, hf = _hf("MixtralConfig", "MixtralForCausalLM", 0, intermediate_size=40, num_attention_heads=4,
                  num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, rms_norm_eps=1e-5)
    ours = _imported(hf, _spec({
        "layers": LAYERS, "attention": {"heads": 4, "kv_heads": 2, "bias": False},
        "ffn": {"kind": "moe", "experts": 4, "top_k": 2, "d_ff": 40, "router": {"kind": "softmax", "normalize": True}},
    }, {"kind": "rotary", "base": cfg.rope_parameters["rope_theta"]}, 1e-5), tmp_path)
    _agree(hf, ours)


def test_gpt_oss_matches_transformers(tmp_path):
    """Sliding (window 4) and full layers in turn, sinks, biased attention, YaRN (no truncation),
    the biased router's top-k then softmax, the clamped SwiGLU experts with their biases."""
    cfg, hf = _hf("GptOssConfig", "GptOssForCausalLM", 1, intermediate_size=24, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
                  rms_norm_eps=1e-5)
    rp = cfg.rope_parameters
    assert cfg.layer_types[:2] == ["sliding_attention", "full_attention"]
    ours = _imported(hf, _spec({
        "layers": LAYERS,
        "attention": {"heads": 4, "kv_heads": 2, "d_k": 16, "bias": True, "sinks": True,
                      "pattern": {"kind": "local", "window": cfg.sliding_window - 1}},
        "overrides": [{"every": 2, "first": 1, "pattern": {"kind": "full"}}],
        "ffn": {"kind": "moe", "experts": 4, "top_k": 2, "d_ff": 24, "activation": "clamped_swiglu",
                "swiglu_alpha": cfg.swiglu_alpha, "swiglu_limit": cfg.swiglu_limit, "bias": True,
                "router": {"kind": "top_k_softmax", "bias": True}},
    }, {"kind": "rotary", "base": rp["rope_theta"], "scaling": {
        "kind": "yarn", "factor": rp["factor"], "original_max_length": rp["original_max_position_embeddings"],
        "beta_fast": rp["beta_fast"], "beta_slow": rp["beta_slow"], "truncate": rp["truncate"]}}, 1e-5), tmp_path)
    _agree(hf, ours)


@pytest.mark.parametrize("version", [3, 2])
def test_deepseek_matches_transformers(version, tmp_path):
    """V3: latent attention with the queries' low rank, the rotary part interleaved, the first
    layer dense and the others sigmoid-routed (the selection bias, 4 groups of which 2, renormalised,
    x 2.5) with a shared expert. V2-Lite's shape: queries projected directly, group-limited softmax
    routing x 1.5, YaRN with mscale_all_dim (its softmax scale times mscale^2)."""
    common = dict(intermediate_size=48, moe_intermediate_size=16, num_attention_heads=4, num_key_value_heads=4,
                  qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, kv_lora_rank=16, first_k_dense_replace=1,
                  n_shared_experts=2, num_experts_per_tok=2, n_group=4, topk_group=2, rms_norm_eps=1e-6)
    if version == 3:
        cfg, hf = _hf("DeepseekV3Config", "DeepseekV3ForCausalLM", 2, q_lora_rank=24, n_routed_experts=8,
                      routed_scaling_factor=2.5, norm_topk_prob=True, **common)
        router = {"kind": "sigmoid", "normalize": True, "scale": 2.5, "groups": 4, "top_groups": 2}
        position = {"kind": "rotary", "base": cfg.rope_parameters["rope_theta"], "layout": "interleaved"}
    else:
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707, "mscale_all_dim": 0.707,
                "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0}
        cfg, hf = _hf("DeepseekV2Config", "DeepseekV2ForCausalLM", 3, q_lora_rank=None, n_routed_experts=8,
                      routed_scaling_factor=1.5, topk_method="group_limited_greedy", rope_parameters=rope, **common)
        router = {"kind": "softmax", "scale": 1.5, "groups": 4, "top_groups": 2, "group_score": "max"}
        position = {"kind": "rotary", "base": 10000.0, "layout": "interleaved", "scaling": {
            "kind": "yarn", "factor": 4.0, "original_max_length": 16, "attention_factor": 1.0}}
    q_lora = cfg.q_lora_rank
    ours = _imported(hf, _spec({
        "layers": LAYERS,
        "attention": {"kind": "latent", "heads": 4, "d_k": 20, "d_v": 10, "rope_dims": 8, "q_rank": q_lora,
                      "kv_rank": 16, "scale": deepseek_yarn_scale(cfg)},
        "ffn": {"kind": "moe", "experts": 8, "top_k": 2, "d_ff": 16, "router": router, "shared": {"d_ff": 32}},
        "overrides": [{"indices": [0], "ffn": {"d_ff": 48, "activation": "swiglu", "bias": False}}],
    }, position, 1e-6), tmp_path)
    _agree(hf, ours)
