"""specc's compiled PyTorch modules against PyTorch's own modules as independent references.

Every test builds a small model from a spec, gives it random weights (biases and norm gains
included, so that a wrongly wired bias or norm cannot hide behind the zero / one initialisation),
copies those weights into torch's reference modules (F.scaled_dot_product_attention,
nn.MultiheadAttention, nn.TransformerEncoderLayer / DecoderLayer, nn.RMSNorm, ...) or into a
formula written out by hand, and compares the outputs in float32.
"""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

import specc
from specc.nn.blocks import RMSNorm
from specc.nn.positions import sinusoidal

ATOL = 1e-5
RTOL = 1e-5

B, T, S = 3, 7, 9  # batch, target length, source length
VOCAB = 50


# --- helpers -------------------------------------------------------------------------------------


def spec_dict(architecture: str = "encoder", d_model: int = 32, **over) -> dict:
    """A small spec as a dict; `over` replaces top-level keys (whole values)."""
    stack = {"layers": 2, "attention": {"heads": 4}, "ffn": {"d_ff": 64, "activation": "relu"}}
    d = {
        "specc": 1,
        "name": "ref-test",
        "architecture": architecture,
        "d_model": d_model,
        "vocab": {"size": VOCAB},
        "position": {"kind": "none", "max_length": 64},
        "norm": {"kind": "layernorm", "placement": "post", "eps": 1e-5},
        "dropout": 0.0,
        "serving": {"batch": {"min": 1, "opt": 2, "max": 4}, "length": {"min": 1, "opt": 16, "max": 64}},
    }
    if architecture in ("encoder", "encoder-decoder"):
        d["encoder"] = json.loads(json.dumps(stack))
    if architecture in ("decoder", "encoder-decoder"):
        d["decoder"] = json.loads(json.dumps(stack))
    d.update(over)
    return d


def build(d: dict, seed: int = 0):
    """Compile the spec (JSON is YAML) and randomise every parameter."""
    model = specc.to_torch(specc.loads_spec(json.dumps(d)), seed=seed)
    randomize(model, seed + 1)
    return model


def randomize(module: nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            owner = module.get_submodule(name.rsplit(".", 1)[0]) if "." in name else module
            leaf = name.rsplit(".", 1)[-1]
            noise = torch.randn(p.shape, generator=gen)
            if isinstance(owner, (nn.LayerNorm, RMSNorm)) and leaf == "weight":
                p.copy_(1.0 + 0.2 * noise)
            elif leaf == "bias" or p.dim() == 1:
                p.copy_(0.2 * noise)
            elif isinstance(owner, nn.Embedding):
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[-1]))


def rand(*shape: int, seed: int = 123) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def padding_keep(b: int, n: int) -> torch.Tensor:
    """[b, n] bool, True = a real token: row 0 full, the others right-padded by 2, 3, ..."""
    keep = torch.ones(b, n, dtype=torch.bool)
    for i in range(1, b):
        keep[i, n - (i + 1):] = False
    return keep


def causal_allowed(t: int) -> torch.Tensor:
    """specc's convention: [1,1,T,T] bool, True = may attend."""
    return torch.ones(t, t, dtype=torch.bool).tril()[None, None]


def causal_blocked(t: int) -> torch.Tensor:
    """torch's nn.Transformer* convention: [T,T] bool, True = may NOT attend."""
    return torch.ones(t, t, dtype=torch.bool).triu(1)


def close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> None:
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)


def copy_mha(mha: nn.MultiheadAttention, att) -> None:
    """specc Attention (q, k, v, o Linear) -> nn.MultiheadAttention (packed in_proj, out_proj)."""
    with torch.no_grad():
        mha.in_proj_weight.copy_(torch.cat([att.q.weight, att.k.weight, att.v.weight]))
        if att.q.bias is not None:
            mha.in_proj_bias.copy_(torch.cat([att.q.bias, att.k.bias, att.v.bias]))
            mha.out_proj.bias.copy_(att.o.bias)
        else:
            assert mha.in_proj_bias is None and mha.out_proj.bias is None
        mha.out_proj.weight.copy_(att.o.weight)


def copy_norm(dst: nn.Module, src: nn.Module) -> None:
    with torch.no_grad():
        dst.weight.copy_(src.weight)
        if getattr(dst, "bias", None) is not None:
            dst.bias.copy_(src.bias)
    assert dst.eps == src.eps


TORCH_ACT = {"relu": "relu", "gelu": "gelu", "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}


def torch_encoder_layer(layer, d_model: int, heads: int, d_ff: int, activation: str, norm_first: bool, eps: float):
    ref = nn.TransformerEncoderLayer(d_model, heads, d_ff, dropout=0.0, activation=TORCH_ACT[activation],
                                     layer_norm_eps=eps, batch_first=True, norm_first=norm_first)
    copy_mha(ref.self_attn, layer.attention)
    with torch.no_grad():
        ref.linear1.load_state_dict(layer.ffn.up.state_dict())
        ref.linear2.load_state_dict(layer.ffn.down.state_dict())
    copy_norm(ref.norm1, layer.attention_norm)
    copy_norm(ref.norm2, layer.ffn_norm)
    return ref.eval()


def torch_decoder_layer(layer, d_model: int, heads: int, d_ff: int, activation: str, norm_first: bool, eps: float):
    ref = nn.TransformerDecoderLayer(d_model, heads, d_ff, dropout=0.0, activation=TORCH_ACT[activation],
                                     layer_norm_eps=eps, batch_first=True, norm_first=norm_first)
    copy_mha(ref.self_attn, layer.attention)
    copy_mha(ref.multihead_attn, layer.cross_attention)
    with torch.no_grad():
        ref.linear1.load_state_dict(layer.ffn.up.state_dict())
        ref.linear2.load_state_dict(layer.ffn.down.state_dict())
    copy_norm(ref.norm1, layer.attention_norm)
    copy_norm(ref.norm2, layer.cross_attention_norm)
    copy_norm(ref.norm3, layer.ffn_norm)
    return ref.eval()


def sinusoidal_numpy(n: int, d: int, base: float = 10000.0) -> np.ndarray:
    """Vaswani et al. 2017, 3.5: PE(pos, 2i) = sin(pos / base^(2i/d)), PE(pos, 2i+1) = cos(same)."""
    pe = np.zeros((n, d), dtype=np.float64)
    for pos in range(n):
        for j in range(d):
            i = j // 2
            angle = pos / base ** (2 * i / d)
            pe[pos, j] = math.sin(angle) if j % 2 == 0 else math.cos(angle)
    return pe


@pytest.fixture(autouse=True)
def _no_grad():
    with torch.no_grad():
        yield


# --- 1. attention vs F.scaled_dot_product_attention ---------------------------------------------

ATTENTION_CONFIGS = {
    "mha": dict(heads=4),
    "gqa": dict(heads=4, kv_heads=2),
    "mqa": dict(heads=4, kv_heads=1),
    "dk_dv": dict(heads=4, d_k=12, d_v=10),
    "gqa_dk_dv_nobias": dict(heads=4, kv_heads=2, d_k=12, d_v=10, bias=False),
    "dot": dict(heads=4, score="dot"),
}


def sdpa_reference(att, x: torch.Tensor, attn_mask=None, is_causal=False, scale=None) -> torch.Tensor:
    s = att.spec
    b, t, _ = x.shape
    q = att.q(x).view(b, t, s.heads, s.d_k).transpose(1, 2)
    k = att.k(x).view(b, t, s.kv_heads, s.d_k).transpose(1, 2)
    v = att.v(x).view(b, t, s.kv_heads, s.d_v).transpose(1, 2)
    g = s.heads // s.kv_heads  # each kv head serves g consecutive query heads
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return F.linear(out.transpose(1, 2).reshape(b, t, s.heads * s.d_v), att.o.weight, att.o.bias)


@pytest.mark.parametrize("config", list(ATTENTION_CONFIGS))
@pytest.mark.parametrize("mask", ["none", "padding", "causal", "causal+padding"])
def test_attention_matches_sdpa(config, mask):
    model = build(spec_dict(encoder={"layers": 1, "attention": ATTENTION_CONFIGS[config], "ffn": {"d_ff": 64}}))
    att = model.encoder.layers[0].attention
    x = rand(B, T, 32)
    keep = padding_keep(B, T)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    attn_mask, is_causal = None, False
    if "padding" in mask:
        allowed = allowed & keep[:, None, None, :]
        attn_mask = keep[:, None, None, :].expand(B, 1, T, T)
    if "causal" in mask:
        allowed = allowed & causal_allowed(T)
        if attn_mask is None:
            is_causal = True
        else:
            attn_mask = attn_mask & causal_allowed(T)
    scale = 1.0 if att.spec.score == "dot" else None
    expected = sdpa_reference(att, x, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    out, (k, v) = att(x, allowed, torch.arange(T))
    close(out, expected)
    s = att.spec
    assert k.shape == (B, s.kv_heads, T, s.d_k) and v.shape == (B, s.kv_heads, T, s.d_v)


def test_attention_gqa_matches_sdpa_enable_gqa():
    """The same grouping as torch's own enable_gqa=True (no hand-written repeat)."""
    model = build(spec_dict(encoder={"layers": 1, "attention": {"heads": 4, "kv_heads": 2}, "ffn": {"d_ff": 64}}))
    att = model.encoder.layers[0].attention
    x = rand(B, T, 32)
    q = att.q(x).view(B, T, 4, 8).transpose(1, 2)
    k = att.k(x).view(B, T, 2, 8).transpose(1, 2)
    v = att.v(x).view(B, T, 2, 8).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected = att.o(out.transpose(1, 2).reshape(B, T, 32))
    close(att(x, causal_allowed(T), torch.arange(T))[0], expected)


def test_cross_attention_matches_sdpa():
    """Cross-attention: queries from x [B,T,D], keys / values from the memory [B,S,D], padded source."""
    model = build(spec_dict("encoder-decoder"))
    att = model.decoder.layers[0].cross_attention
    x, mem = rand(B, T, 32, seed=1), rand(B, S, 32, seed=2)
    keep = padding_keep(B, S)
    h, dk = 4, 8
    q = att.q(x).view(B, T, h, dk).transpose(1, 2)
    k = att.k(mem).view(B, S, h, dk).transpose(1, 2)
    v = att.v(mem).view(B, S, h, dk).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep[:, None, None, :])
    expected = att.o(out.transpose(1, 2).reshape(B, T, 32))
    got, _ = att(x, keep[:, None, None, :], torch.arange(T), memory=mem, key_keep=keep)
    close(got, expected)


# --- 2. attention vs nn.MultiheadAttention ------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("mask", ["none", "key_padding", "causal"])
def test_attention_matches_multihead_attention(bias, mask):
    model = build(spec_dict(encoder={"layers": 1, "attention": {"heads": 4, "bias": bias}, "ffn": {"d_ff": 64}}))
    att = model.encoder.layers[0].attention
    mha = nn.MultiheadAttention(32, 4, dropout=0.0, bias=bias, batch_first=True).eval()
    copy_mha(mha, att)
    x = rand(B, T, 32)
    allowed = torch.ones(B, 1, T, T, dtype=torch.bool)
    kwargs = {}
    if mask == "key_padding":
        keep = padding_keep(B, T)
        allowed = allowed & keep[:, None, None, :]
        kwargs["key_padding_mask"] = ~keep
    elif mask == "causal":
        allowed = allowed & causal_allowed(T)
        kwargs["attn_mask"] = causal_blocked(T)
    expected, _ = mha(x, x, x, need_weights=False, **kwargs)
    close(att(x, allowed, torch.arange(T))[0], expected)


# --- 3. encoder layers vs nn.TransformerEncoderLayer --------------------------------------------


@pytest.mark.parametrize("activation", ["relu", "gelu"])
@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("padded", [False, True])
def test_encoder_layer_matches_transformer_encoder_layer(activation, placement, padded):
    eps = 1e-5 if placement == "post" else 1e-6
    d = spec_dict(norm={"kind": "layernorm", "placement": placement, "eps": eps, "final": False},
                  encoder={"layers": 2, "attention": {"heads": 4}, "ffn": {"d_ff": 64, "activation": activation}})
    model = build(d)
    x = rand(B, T, 32)
    keep = padding_keep(B, T) if padded else torch.ones(B, T, dtype=torch.bool)
    allowed = keep[:, None, None, :]
    for layer in model.encoder.layers:
        ref = torch_encoder_layer(layer, 32, 4, 64, activation, placement == "pre", eps)
        expected = ref(x, src_key_padding_mask=~keep if padded else None)
        got, _, _ = layer(x, allowed, torch.arange(T))
        # the torch fast path may zero padded rows; the real tokens must agree exactly
        close(got[keep], expected[keep])
        x = got


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_encoder_stack_matches_transformer_encoder(placement):
    """The whole encoder model (no positions, final norm by `final: auto`) vs nn.TransformerEncoder."""
    d = spec_dict(norm={"kind": "layernorm", "placement": placement, "eps": 1e-5},
                  encoder={"layers": 2, "attention": {"heads": 4}, "ffn": {"d_ff": 64, "activation": "gelu"}})
    model = build(d)
    final = model.encoder.final_norm
    assert (final is not None) == (placement == "pre")
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, activation="gelu", layer_norm_eps=1e-5,
                                       batch_first=True, norm_first=placement == "pre")
    ref = nn.TransformerEncoder(layer, 2, norm=nn.LayerNorm(32, eps=1e-5) if final is not None else None,
                                enable_nested_tensor=False).eval()
    for i, lay in enumerate(model.encoder.layers):
        ref.layers[i] = torch_encoder_layer(lay, 32, 4, 64, "gelu", placement == "pre", 1e-5)
    if final is not None:
        copy_norm(ref.norm, final)
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(5))
    keep = padding_keep(B, T)
    got = model(input_ids=ids, attention_mask=keep.long())["last_hidden_state"]
    expected = ref(model.embeddings.tokens.weight[ids], src_key_padding_mask=~keep)
    close(got[keep], expected[keep])


# --- 4. decoder layers vs nn.TransformerDecoderLayer --------------------------------------------


@pytest.mark.parametrize("placement", ["post", "pre"])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_decoder_layer_matches_transformer_decoder_layer(placement, activation):
    stack = {"layers": 2, "attention": {"heads": 4}, "ffn": {"d_ff": 64, "activation": activation}}
    d = spec_dict("encoder-decoder", norm={"kind": "layernorm", "placement": placement, "eps": 1e-5, "final": False},
                  encoder=stack, decoder=stack)
    model = build(d)
    x, mem = rand(B, T, 32, seed=1), rand(B, S, 32, seed=2)
    keep = padding_keep(B, S)
    for layer in model.decoder.layers:
        ref = torch_decoder_layer(layer, 32, 4, 64, activation, placement == "pre", 1e-5)
        expected = ref(x, mem, tgt_mask=nn.Transformer.generate_square_subsequent_mask(T), tgt_is_causal=True,
                       memory_key_padding_mask=~keep)
        got, _, _ = layer(x, causal_allowed(T), torch.arange(T), memory=mem,
                          memory_allowed=keep[:, None, None, :], memory_keep=keep)
        close(got, expected)
        x = got


@pytest.mark.parametrize("placement", ["post", "pre"])
def test_encoder_decoder_model_matches_torch_transformer(placement):
    """Vaswani et al.'s Transformer end to end: shared tied vocabulary, embeddings * sqrt(d_model),
    sinusoidal positions (the numpy formula), nn.TransformerEncoder / nn.TransformerDecoder, tied
    output projection; `final: auto` adds final norms for pre only."""
    d = spec_dict("encoder-decoder", norm={"kind": "layernorm", "placement": placement, "eps": 1e-5},
                  vocab={"size": VOCAB, "share": True, "tie_output": True, "scale": "sqrt_d_model"},
                  position={"kind": "sinusoidal", "max_length": 64})
    model = build(d)
    pre = placement == "pre"
    enc_layer = nn.TransformerEncoderLayer(32, 4, 64, 0.0, "relu", 1e-5, batch_first=True, norm_first=pre)
    dec_layer = nn.TransformerDecoderLayer(32, 4, 64, 0.0, "relu", 1e-5, batch_first=True, norm_first=pre)
    encoder = nn.TransformerEncoder(enc_layer, 2, norm=nn.LayerNorm(32, eps=1e-5) if pre else None,
                                    enable_nested_tensor=False).eval()
    decoder = nn.TransformerDecoder(dec_layer, 2, norm=nn.LayerNorm(32, eps=1e-5) if pre else None).eval()
    for i in range(2):
        encoder.layers[i] = torch_encoder_layer(model.encoder.layers[i], 32, 4, 64, "relu", pre, 1e-5)
        decoder.layers[i] = torch_decoder_layer(model.decoder.layers[i], 32, 4, 64, "relu", pre, 1e-5)
    if pre:
        copy_norm(encoder.norm, model.encoder.final_norm)
        copy_norm(decoder.norm, model.decoder.final_norm)
    else:
        assert model.encoder.final_norm is None and model.decoder.final_norm is None

    gen = torch.Generator().manual_seed(7)
    src, tgt = torch.randint(0, VOCAB, (B, S), generator=gen), torch.randint(0, VOCAB, (B, T), generator=gen)
    keep = padding_keep(B, S)
    emb = model.embeddings.tokens.weight
    pe = torch.tensor(sinusoidal_numpy(max(S, T), 32), dtype=torch.float32)
    memory = encoder(emb[src] * math.sqrt(32) + pe[:S], src_key_padding_mask=~keep)
    h = decoder(emb[tgt] * math.sqrt(32) + pe[:T], memory, tgt_mask=causal_blocked(T), tgt_is_causal=True,
                memory_key_padding_mask=~keep)
    expected = h @ emb.t()
    got = model(input_ids=src, attention_mask=keep.long(), decoder_input_ids=tgt)["logits"]
    close(got, expected, atol=5e-5, rtol=5e-5)


# --- 5. GPT-style decoder model vs torch modules ------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
def test_gpt_style_decoder_matches_torch_reference(padded):
    d_model, heads, d_ff = 48, 4, 96
    stack = {"layers": 2, "attention": {"heads": heads}, "ffn": {"d_ff": d_ff, "activation": "gelu_tanh"}}
    d = spec_dict("decoder", d_model=d_model, decoder=stack,
                  vocab={"size": VOCAB, "tie_output": True},
                  position={"kind": "learned", "max_length": 64},
                  norm={"kind": "layernorm", "placement": "pre", "eps": 1e-5})
    model = build(d)
    assert model.heads["logits"].proj is None  # tied

    tok = nn.Embedding(VOCAB, d_model)
    pos = nn.Embedding(64, d_model)
    tok.load_state_dict(model.embeddings.tokens.state_dict())
    pos.load_state_dict(model.decoder.positions.state_dict())
    layers = [torch_encoder_layer(l, d_model, heads, d_ff, "gelu_tanh", True, 1e-5) for l in model.decoder.layers]
    ln_f = nn.LayerNorm(d_model, eps=1e-5)
    copy_norm(ln_f, model.decoder.final_norm)

    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(3))
    keep = padding_keep(B, T) if padded else torch.ones(B, T, dtype=torch.bool)
    h = tok(ids) + pos(torch.arange(T))[None]
    for layer in layers:
        h = layer(h, src_mask=causal_blocked(T), is_causal=True, src_key_padding_mask=~keep if padded else None)
    expected = ln_f(h) @ tok.weight.t()

    got = model(input_ids=ids, attention_mask=keep.long())["logits"]
    assert got.shape == (B, T, VOCAB)
    close(got[keep], expected[keep], atol=5e-5, rtol=5e-5)


# --- 6. sinusoidal positions --------------------------------------------------------------------


@pytest.mark.parametrize("d", [32, 64, 33])
def test_sinusoidal_matches_vaswani_formula(d):
    n = 100
    got = sinusoidal(torch.arange(n)[None].expand(2, n), d, 10000.0)
    assert got.shape == (2, n, d)
    expected = torch.tensor(sinusoidal_numpy(n, d), dtype=torch.float32)
    # float32 angles of up to ~100 radians: a few ulp of 1e-5 each
    close(got[0], expected, atol=1e-4, rtol=0)
    close(got[1], expected, atol=1e-4, rtol=0)
    close(got[0, :10], expected[:10], atol=2e-6, rtol=0)


def test_sinusoidal_base_and_position_ids():
    ids = torch.tensor([[5, 0, 17, 3]])
    got = sinusoidal(ids, 16, 500.0)
    expected = torch.tensor(sinusoidal_numpy(18, 16, 500.0), dtype=torch.float32)[ids[0]]
    close(got[0], expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("d", [16, 33])
def test_sinusoidal_halves_layout_puts_every_sine_before_the_cosines(d):
    """layout: halves (tensor2tensor / Marian): angle[p, j] = p / base^(2*(j//2)/d); the sines of
    the even j fill the first ceil(d/2) dims, the cosines of the odd j the rest."""
    n, base = 40, 10000.0
    angle = np.array([[p / base ** (2 * (j // 2) / d) for j in range(d)] for p in range(n)])
    first = (d + 1) // 2
    expected = np.zeros((n, d))
    expected[:, :first] = np.sin(angle[:, 0::2])
    expected[:, first:] = np.cos(angle[:, 1::2])
    got = sinusoidal(torch.arange(n)[None], d, base, "halves")
    close(got[0], torch.tensor(expected, dtype=torch.float32), atol=2e-5, rtol=0)
    # the same numbers as the interleaved layout, in another order
    inter = sinusoidal(torch.arange(n)[None], d, base)[0]
    close(got[0, :, :first], inter[:, 0::2], atol=0, rtol=0)


# --- 7. norms -----------------------------------------------------------------------------------


@pytest.mark.parametrize("eps", [1e-6, 1e-5, 0.1])
def test_rmsnorm_matches_torch_rmsnorm(eps):
    ours, ref = RMSNorm(32, eps), nn.RMSNorm(32, eps=eps)
    w = 1.0 + 0.3 * rand(32, seed=9)
    ours.weight.copy_(w)
    ref.weight.copy_(w)
    x = rand(B, T, 32) * 3.0
    close(ours(x), ref(x))


def test_spec_rmsnorm_layers_use_rmsnorm():
    d = spec_dict(norm={"kind": "rmsnorm", "placement": "pre", "eps": 1e-6})
    model = build(d)
    layer = model.encoder.layers[0]
    ref = nn.RMSNorm(32, eps=1e-6)
    copy_norm(ref, layer.attention_norm)
    x = rand(B, T, 32)
    close(layer.attention_norm(x), ref(x))
    # pre placement with RMSNorm, by hand
    h = x + layer.attention(ref(x), torch.ones(B, 1, T, T, dtype=torch.bool), torch.arange(T))[0]
    copy_norm(ref, layer.ffn_norm)
    h = h + layer.ffn(ref(h))
    close(layer(x, torch.ones(B, 1, T, T, dtype=torch.bool), torch.arange(T))[0], h)


def _ln(norm: nn.Module):
    return lambda x: F.layer_norm(x, (x.shape[-1],), norm.weight, norm.bias, norm.eps)


def test_sandwich_encoder_layer_wiring():
    """sandwich: x + PostNorm(f(Norm(x))) for attention and FFN."""
    model = build(spec_dict(norm={"kind": "layernorm", "placement": "sandwich", "eps": 1e-5}))
    layer = model.encoder.layers[0]
    x = rand(B, T, 32)
    keep = padding_keep(B, T)
    allowed = keep[:, None, None, :]
    h = x + _ln(layer.attention_post_norm)(sdpa_reference(layer.attention, _ln(layer.attention_norm)(x), attn_mask=allowed))
    ffn = layer.ffn
    hn = _ln(layer.ffn_norm)(h)
    h = h + _ln(layer.ffn_post_norm)(F.linear(F.relu(F.linear(hn, ffn.up.weight, ffn.up.bias)), ffn.down.weight, ffn.down.bias))
    close(layer(x, allowed, torch.arange(T))[0], h)


def test_sandwich_decoder_layer_wiring():
    """sandwich with cross-attention: each of the three sublayers gets its own pre and post norm."""
    model = build(spec_dict("encoder-decoder", norm={"kind": "layernorm", "placement": "sandwich", "eps": 1e-5}))
    layer = model.decoder.layers[0]
    x, mem = rand(B, T, 32, seed=1), rand(B, S, 32, seed=2)
    keep = padding_keep(B, S)
    mem_allowed = keep[:, None, None, :]
    q_idx = torch.arange(T)
    h = x + _ln(layer.attention_post_norm)(sdpa_reference(layer.attention, _ln(layer.attention_norm)(x), is_causal=True))
    ca = layer.cross_attention(_ln(layer.cross_attention_norm)(h), mem_allowed, q_idx, memory=mem)[0]
    h = h + _ln(layer.cross_attention_post_norm)(ca)
    h = h + _ln(layer.ffn_post_norm)(layer.ffn(_ln(layer.ffn_norm)(h)))
    got = layer(x, causal_allowed(T), q_idx, memory=mem, memory_allowed=mem_allowed, memory_keep=keep)[0]
    close(got, h)


# --- 8. FFN activations -------------------------------------------------------------------------


def _gelu_erf(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def _gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def _silu(x):
    return x * torch.sigmoid(x)


HAND_ACT = {
    "relu": lambda x: torch.clamp(x, min=0.0),
    "gelu": _gelu_erf,
    "gelu_tanh": _gelu_tanh,
    "silu": _silu,
    "swiglu": _silu,
    "geglu": _gelu_erf,
}
TORCH_F = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "swiglu": F.silu,
    "geglu": F.gelu,
}


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("activation", ["relu", "gelu", "gelu_tanh", "silu", "swiglu", "geglu"])
def test_ffn_activation(activation, bias):
    d = spec_dict(encoder={"layers": 1, "attention": {"heads": 4}, "ffn": {"d_ff": 48, "activation": activation, "bias": bias}})
    ffn = build(d).encoder.layers[0].ffn
    gated = activation in ("swiglu", "geglu")
    assert (ffn.gate is not None) == gated
    assert (ffn.up.bias is not None) == bias
    x = rand(B, T, 32) * 2.0

    def lin(m, h):
        return F.linear(h, m.weight, m.bias)

    for act in (HAND_ACT[activation], TORCH_F[activation]):
        inner = act(lin(ffn.gate, x)) * lin(ffn.up, x) if gated else act(lin(ffn.up, x))
        close(ffn(x), lin(ffn.down, inner))


def test_gated_ffn_is_not_ungated():
    """A gated FFN really uses its gate (guards against a test that passes by symmetry)."""
    ffn = build(spec_dict(encoder={"layers": 1, "attention": {"heads": 4},
                                   "ffn": {"d_ff": 48, "activation": "swiglu"}})).encoder.layers[0].ffn
    x = rand(B, T, 32)
    swapped = ffn.down(F.silu(ffn.up(x)) * ffn.gate(x))
    assert not torch.allclose(ffn(x), swapped, atol=1e-3)


# --- 9. dropout ---------------------------------------------------------------------------------


@pytest.mark.parametrize("dropout", [0.5, {"hidden": 0.0, "attention": 0.5}, {"hidden": 0.5, "attention": 0.0}])
def test_dropout_only_in_train_mode(dropout):
    model = build(spec_dict("decoder", dropout=dropout))
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(4))
    assert not model.training  # to_torch returns eval mode
    a, b = model(input_ids=ids)["logits"], model(input_ids=ids)["logits"]
    assert torch.equal(a, b)
    model.train()
    torch.manual_seed(0)
    c, e = model(input_ids=ids)["logits"], model(input_ids=ids)["logits"]
    assert not torch.allclose(c, e)
    assert not torch.allclose(c, a)
    model.eval()
    assert torch.equal(model(input_ids=ids)["logits"], a)


def test_no_dropout_train_equals_eval():
    model = build(spec_dict("decoder", dropout=0.0))
    ids = torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(4))
    a = model(input_ids=ids)["logits"]
    model.train()
    close(model(input_ids=ids)["logits"], a, atol=0, rtol=0)
