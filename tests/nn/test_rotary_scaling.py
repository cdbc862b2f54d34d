"""Rotary scaling and LayerNorm without bias against independent references: the inverse
frequencies against transformers' rope init functions (bit for bit), cos and sin against its
RotaryEmbedding modules (LLaMA's for one scaling per model, Gemma 3's per layer kind), linear
scaling against Chen et al.'s position interpolation, and `norm: {bias: false}` against
torch.nn.LayerNorm(bias=False)."""
from __future__ import annotations

import math

import pytest
import torch

import specc
from specc.nn.blocks import make_norm
from specc.nn.positions import rotary_cos_sin, rotary_frequencies
from specc.spec.schema import NormSpec

from tests.helpers.speclib import KINDS, tiny

transformers = pytest.importorskip("transformers")
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

HEAD, BASE, MAXLEN = 16, 500.0, 64
LONG_SHORT = [1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 3.5, 4.0]
LONG_LONG = [1.5, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0]

# label -> (transformers' rope_parameters, the spec's scaling); original lengths small, so that
# every scaling binds on a few positions (llama3: wavelengths on both sides of 8 / 1 and 8 / 4;
# yarn: the ramp between pairs 0 and 7)
SCALINGS = {
    "linear": ({"rope_type": "linear", "factor": 4.0}, {"kind": "linear", "factor": 4.0}),
    "llama3": ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8},
               {"kind": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_length": 8}),
    "yarn": ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
             {"kind": "yarn", "factor": 4.0, "original_max_length": 16}),
    "yarn-untruncated": ({"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 16, "beta_fast": 8.0,
                          "beta_slow": 2.0, "truncate": False, "attention_factor": 1.3},
                         {"kind": "yarn", "factor": 3.0, "original_max_length": 16, "beta_fast": 8.0, "beta_slow": 2.0,
                          "truncate": False, "attention_factor": 1.3}),
    "longrope": ({"rope_type": "longrope", "short_factor": LONG_SHORT, "long_factor": LONG_LONG,
                  "original_max_position_embeddings": 8},
                 {"kind": "longrope", "short_factor": LONG_SHORT, "long_factor": LONG_LONG, "original_max_length": 8}),
}


def _config(rope: dict, fraction: float = 1.0):
    return transformers.LlamaConfig(hidden_size=4 * HEAD, num_attention_heads=4, max_position_embeddings=MAXLEN,
                                    rope_parameters={**rope, "rope_theta": BASE, "partial_rotary_factor": fraction})


def _spec(scaling: dict, fraction: float = 1.0, layout: str = "halves"):
    return tiny({"d_model": 4 * HEAD, "position": {"kind": "rotary", "base": BASE, "fraction": fraction,
                                                   "layout": layout, "max_length": MAXLEN, "scaling": scaling}})


def _frequencies(spec, layer: int = 0):
    return specc.to_torch(spec, seed=0).decoder.layers[layer].attention.frequencies


@pytest.mark.parametrize("fraction", [1.0, 0.5])
@pytest.mark.parametrize("label", list(SCALINGS))
def test_frequencies_are_transformers_own(label, fraction):
    """The model's inverse frequencies are transformers' rope init function's, to the bit, and its
    attention factor the same number (for LongRoPE: both sets, the long one past the original length)."""
    hf_params, ours = SCALINGS[label]
    if fraction != 1.0 and label == "longrope":
        ours = {**ours, "short_factor": LONG_SHORT[:4], "long_factor": LONG_LONG[:4]}
        hf_params = {**hf_params, "short_factor": LONG_SHORT[:4], "long_factor": LONG_LONG[:4]}
    cfg = _config(hf_params, fraction)
    init = ROPE_INIT_FUNCTIONS[hf_params["rope_type"]]
    want, factor = init(cfg, "cpu")
    freqs = _frequencies(_spec(ours, fraction))
    assert torch.equal(torch.tensor(freqs.short, dtype=torch.float32), want)
    assert freqs.scale == pytest.approx(factor, rel=1e-12)
    if label == "longrope":
        long, _ = init(cfg, "cpu", seq_len=9)
        assert torch.equal(torch.tensor(freqs.long, dtype=torch.float32), long)
        assert freqs.threshold == 8
        assert not torch.equal(long, want)
    plain = rotary_frequencies(int(HEAD * fraction), BASE)
    assert freqs.short != plain.short  # the scaling changed them


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("label", list(SCALINGS))
def test_cos_sin_match_transformers_rotary_embedding(label, dtype):
    """cos and sin of LlamaRotaryEmbedding (its attention factor applied, LongRoPE's set chosen by
    the largest position + 1) for a batch of positions within and past the original length."""
    hf_params, ours = SCALINGS[label]
    rope = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(_config(hf_params))
    freqs = _frequencies(_spec(ours))
    x = torch.zeros(1, dtype=dtype)
    for positions in ([[0, 1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 1, 2, 3, 4, 5]], [list(range(40, 48))] * 2, [[63]]):
        pos = torch.tensor(positions)
        want_cos, want_sin = rope(x, pos)
        cos, sin = rotary_cos_sin(pos, freqs, dtype)
        assert cos.dtype == dtype
        torch.testing.assert_close(cos[:, 0], want_cos, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=0)
        torch.testing.assert_close(sin[:, 0], want_sin, atol=1e-6 if dtype == torch.float32 else 1e-3, rtol=0)


def test_longrope_switches_sets_at_the_original_length():
    """Positions up to 7 (a sequence of 8 = original_max_length) turn by the short factors, one
    position further by the long ones, for the whole batch."""
    _, ours = SCALINGS["longrope"]
    freqs = _frequencies(_spec(ours))
    at = torch.tensor([[7]])
    short = rotary_cos_sin(at, freqs, torch.float32)[1][0, 0, 0, :8]
    want_short = torch.sin(7 * torch.tensor(freqs.short, dtype=torch.float32)) * freqs.scale
    torch.testing.assert_close(short, want_short, atol=1e-7, rtol=0)
    batch = torch.tensor([[7], [8]])  # the second row's length passes 8: both rows take the long set
    first = rotary_cos_sin(batch, freqs, torch.float32)[1][0, 0, 0, :8]
    want_long = torch.sin(7 * torch.tensor(freqs.long, dtype=torch.float32)) * freqs.scale
    torch.testing.assert_close(first, want_long, atol=1e-7, rtol=0)


def test_linear_scaling_is_position_interpolation():
    """Chen et al. 2023, eq. (4): f'(x, m) = f(x, m L / L'): position m with factor s turns as
    position m / s does unscaled."""
    scaled = _frequencies(_spec({"kind": "linear", "factor": 4.0}))
    plain = _frequencies(_spec({"kind": "none"}))
    m = torch.arange(0, 64, dtype=torch.float64)
    got = m[:, None] * torch.tensor(scaled.short, dtype=torch.float64)
    want = (m / 4.0)[:, None] * torch.tensor(plain.short, dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


def test_yarn_factor_is_the_papers():
    """Peng et al. 2023, section 3.4: sqrt(1/t) = 0.1 ln(s) + 1, applied to cos and sin; and the
    fastest pairs keep their frequency, the slowest are divided by s (section 3.2)."""
    freqs = _frequencies(_spec({"kind": "yarn", "factor": 4.0, "original_max_length": 16}))
    plain = _frequencies(_spec({"kind": "none"}))
    assert freqs.scale == pytest.approx(0.1 * math.log(4.0) + 1.0)
    assert freqs.short[0] == plain.short[0]
    assert freqs.short[-1] == pytest.approx(plain.short[-1] / 4.0, rel=1e-6)


def test_gemma3_global_layers_scaled_alone():
    """Gemma 3 (4B and larger): global layers' frequencies from base 1e6 divided by 8, the
    sliding layers' from base 10 unscaled; cos and sin against Gemma3RotaryEmbedding per layer kind."""
    cfg = transformers.Gemma3TextConfig(
        hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=HEAD,
        intermediate_size=48, sliding_window=4, max_position_embeddings=MAXLEN,
        layer_types=["sliding_attention", "full_attention"] * 2,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}})
    rope = transformers.models.gemma3.modeling_gemma3.Gemma3RotaryEmbedding(cfg)
    spec = tiny({"d_model": 32, "position": {"kind": "rotary", "base": 10.0, "max_length": MAXLEN},
                 "decoder": {"layers": 4, "attention": {"heads": 4, "kv_heads": 2, "d_k": HEAD,
                                                        "pattern": {"kind": "local", "window": 3}},
                             "overrides": [{"every": 2, "first": 1, "pattern": {"kind": "full"}, "rotary_base": 1e6,
                                            "rotary_scaling": {"kind": "linear", "factor": 8.0}}]}})
    model = specc.to_torch(spec, seed=0)
    pos = torch.arange(20)[None]
    for i in range(4):
        kind = cfg.layer_types[i]
        want_cos, want_sin = rope(torch.zeros(1), pos, kind)
        cos, sin = rotary_cos_sin(pos, model.decoder.layers[i].attention.frequencies, torch.float32)
        torch.testing.assert_close(cos[:, 0], want_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin[:, 0], want_sin, atol=1e-6, rtol=0)
    assert model.decoder.layers[1].attention.frequencies != model.decoder.layers[0].attention.frequencies


def test_layers_share_a_scheme_where_their_base_and_scaling_agree():
    """The overrides-scaling kind: its global layers (1) share one scheme, the others (0, 2)
    another; Stack.forward makes cos and sin once for each."""
    model = specc.to_torch(tiny(KINDS["overrides-scaling"]), seed=0)
    f = [layer.attention.frequencies for layer in model.decoder.layers]
    assert f[0] == f[2] != f[1]
    assert f[1] == rotary_frequencies(8, 100.0, _spec({"kind": "linear", "factor": 8.0}).position.scaling)


def _steps(model, ids, prefill: int) -> torch.Tensor:
    """Logits of `ids` run as a prefill of `prefill` tokens, then one token at a time with the cache."""
    with torch.no_grad():
        out = model(input_ids=ids[:, :prefill], use_cache=True)
        logits = [out["logits"]]
        for t in range(prefill, ids.shape[1]):
            past = {k.replace("present", "past_key_values", 1): v for k, v in out.items() if k.startswith("present.")}
            out = model(input_ids=ids[:, t:t + 1], use_cache=True, **past)
            logits.append(out["logits"])
    return torch.cat(logits, 1)


def test_longrope_with_the_cache():
    """Within the original length (8) and past it from the prefill on, decoding with the cache
    computes what one pass does; a cache filled within it and read past it keeps the keys the short
    factors turned (as transformers' generate does, where Phi-3 does not recompute its cache)."""
    model = specc.to_torch(tiny(KINDS["rotary-longrope"]), seed=1)
    ids = torch.randint(0, 61, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        short, long = model(input_ids=ids[:, :8])["logits"], model(input_ids=ids)["logits"]
    torch.testing.assert_close(_steps(model, ids[:, :8], 1), short, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_steps(model, ids, 9), long, atol=1e-5, rtol=1e-5)
    crossed = _steps(model, ids, 4)
    torch.testing.assert_close(crossed[:, :8], short, atol=1e-5, rtol=1e-5)
    assert (crossed[:, 8:] - long[:, 8:]).abs().max() > 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_layernorm_without_bias_is_torchs(dtype):
    """`norm: {kind: layernorm, bias: false}` is torch.nn.LayerNorm(bias=False): a weight, no bias
    (computed in fp32 for an fp16 input, then cast)."""
    ours = make_norm(NormSpec(kind="layernorm", bias=False, eps=1e-5), 24)
    ref = torch.nn.LayerNorm(24, eps=1e-5, bias=False)
    assert [n for n, _ in ours.named_parameters()] == ["weight"] == [n for n, _ in ref.named_parameters()]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        w = torch.randn(24, generator=g)
        ours.weight.copy_(w)
        ref.weight.copy_(w)
    x = (torch.randn(3, 5, 24, generator=g) * 3 + 1).to(dtype)
    with torch.no_grad():
        want = ref(x.float()).to(dtype)
        torch.testing.assert_close(ours(x), want, atol=1e-6, rtol=0)
    biased = make_norm(NormSpec(kind="layernorm", eps=1e-5), 24)
    assert [n for n, _ in biased.named_parameters()] == ["weight", "bias"]


def test_model_without_norm_biases_has_none():
    model = specc.to_torch(tiny(KINDS["layernorm-no-bias"]), seed=0)
    norms = [n for n, _ in model.named_parameters() if "norm" in n]
    assert norms and all(n.endswith(".weight") for n in norms)
