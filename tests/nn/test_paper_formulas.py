"""specc's attention variants against direct NumPy transcriptions of each paper's formula.

Every reference below is written from the formula (Vaswani et al. 2017; the lecture notes' score
functions and head merges; Shaw et al. 2018; Press et al. 2022; Su et al. 2021; Wang et al. 2020;
Zaheer et al. 2020), in float64, from the module's raw weights only: no specc helper is called
inside a reference. Attention parameters are re-drawn at a larger scale than the default
initialisation (and biases made non-zero) so that softmaxes are far from uniform and every weight
matters.
"""
from __future__ import annotations

import math
import textwrap

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import specc  # noqa: E402
from specc.nn.positions import (alibi_slopes, distance_buckets, relative_bucket, rotary_cos_sin,  # noqa: E402
                                 rotary_frequencies)

ATOL, RTOL = 1e-5, 1e-4


# --- building ---------------------------------------------------------------------------------


def spec_text(
    *,
    arch: str = "encoder",
    d_model: int = 16,
    attention: str = "{heads: 4}",
    position: str = "{kind: none}",
    layers: int = 1,
    max_length: int = 16,
) -> str:
    stack = f"""
      layers: {layers}
      attention: {attention}
      ffn: {{d_ff: 32}}
    """
    stacks = "".join(
        f"{name}:{textwrap.indent(textwrap.dedent(stack), '  ')}"
        for name in (("encoder",) if arch == "encoder" else ("decoder",) if arch == "decoder" else ("encoder", "decoder"))
    )
    pos = position.strip()
    assert pos.startswith("{") and pos.endswith("}")
    pos = pos[:-1] + (", " if pos[1:-1].strip() else "") + f"max_length: {max_length}}}"
    return (
        textwrap.dedent(
            f"""\
            specc: 1
            name: paper-formulas
            architecture: {arch}
            d_model: {d_model}
            vocab: {{size: 50}}
            position: {pos}
            dropout: 0.0
            serving:
              batch: {{min: 1, opt: 2, max: 4}}
              length: {{min: 1, opt: 8, max: {max_length}}}
            """
        )
        + stacks
    )


def randomize(module: torch.nn.Module, seed: int = 1, scale: float = 0.3) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters(), key=lambda kv: kv[0]):
            p.copy_(scale * torch.randn(p.shape, generator=gen))


def build(seed: int = 1, **kw):
    model = specc.to_torch(specc.loads_spec(spec_text(**kw)), seed=0)
    randomize(model, seed)
    return model


def attention_of(model, stack: str = "encoder", layer: int = 0):
    return getattr(model, stack).layers[layer].attention


def inputs(b: int, t: int, d: int, seed: int = 2) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, t, d, generator=gen)


def full_mask(b: int, t: int, s: int | None = None) -> torch.Tensor:
    return torch.ones(b, 1, t, t if s is None else s, dtype=torch.bool)


def padded_mask(b: int, t: int) -> torch.Tensor:
    """Row b > 0 has its last b+1 keys as padding."""
    m = full_mask(b, t)
    for i in range(1, b):
        m[i, :, :, t - (i + 1):] = False
    return m


def causal_mask(b: int, t: int) -> torch.Tensor:
    return torch.tril(torch.ones(t, t, dtype=torch.bool)).expand(b, 1, t, t).clone()


def run(att, x, allowed, q_idx=None, **kw) -> np.ndarray:
    t = x.shape[1]
    q_idx = torch.arange(t) if q_idx is None else q_idx
    with torch.no_grad():
        out, _ = att(x, allowed, q_idx, **kw)
    return out.double().numpy()


def close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert actual.shape == expected.shape
    np.testing.assert_allclose(actual, expected, atol=ATOL, rtol=RTOL)


# --- NumPy reference pieces -------------------------------------------------------------------


def W(p) -> np.ndarray:
    return p.detach().double().numpy()


def linear(x: np.ndarray, lin) -> np.ndarray:
    """y = x W^T + b (torch's nn.Linear convention: weight [out, in])."""
    y = x @ W(lin.weight).T
    if lin.bias is not None:
        y = y + W(lin.bias)
    return y


def split(y: np.ndarray, heads: int) -> np.ndarray:
    """[B, T, H*d] -> [B, H, T, d]."""
    b, t, hd = y.shape
    return y.reshape(b, t, heads, hd // heads).transpose(0, 2, 1, 3)


def softmax(scores: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
    if allowed is not None:
        scores = np.where(allowed, scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    e = np.exp(scores)
    return e / e.sum(axis=-1, keepdims=True)


def qkv(att, x: np.ndarray, heads: int, kv_heads: int | None = None, share_kv: bool = False):
    kv_heads = heads if kv_heads is None else kv_heads
    q = split(linear(x, att.q), heads)
    k = split(linear(x, att.k), kv_heads)
    v = k if share_kv else split(linear(x, att.v), kv_heads)
    return q, k, v


def merge_project(att, z: np.ndarray) -> np.ndarray:
    """Concatenate heads [B,H,T,Dv] -> [B,T,H*Dv], then W_o."""
    b, h, t, dv = z.shape
    return linear(z.transpose(0, 2, 1, 3).reshape(b, t, h * dv), att.o)


def mha_reference(att, x, allowed, *, heads, score="scaled_dot", merge="project", extra_bias=None, pattern=None):
    """Scores by the lecture notes' functions, masked softmax, weighted values, merge."""
    q, k, v = qkv(att, x, heads)
    dk = q.shape[-1]
    if score == "scaled_dot":
        s = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(dk)
    elif score == "dot":
        s = np.einsum("bhid,bhjd->bhij", q, k)
    elif score == "bilinear":
        w = W(att.score_w)  # [H, Dk, Dk]
        s = np.einsum("bhid,hde,bhje->bhij", q, w, k)
    elif score == "additive":
        w = W(att.score_w)  # [H, Dk]
        s = np.einsum("bhijd,hd->bhij", np.tanh(q[:, :, :, None, :] + k[:, :, None, :, :]), w)
    else:
        raise AssertionError(score)
    if extra_bias is not None:
        s = s + extra_bias
    mask = allowed if pattern is None else allowed & pattern
    alpha = softmax(s, mask)
    z = np.einsum("bhij,bhjd->bhid", alpha, v)
    if merge == "project":
        return merge_project(att, z)
    if merge == "concat":
        b, h, t, dv = z.shape
        return z.transpose(0, 2, 1, 3).reshape(b, t, h * dv)
    if merge == "mean":
        return z.mean(axis=1)
    raise AssertionError(merge)


# --- 1. score functions -----------------------------------------------------------------------


@pytest.mark.parametrize("score", ["scaled_dot", "dot", "bilinear", "additive"])
def test_score_functions(score):
    model = build(d_model=16, attention=f"{{heads: 4, score: {score}}}")
    att = attention_of(model)
    x = inputs(3, 7, 16)
    allowed = padded_mask(3, 7)
    expected = mha_reference(att, x.double().numpy(), allowed.numpy(), heads=4, score=score)
    close(run(att, x, allowed), expected)


def test_score_parameter_shapes():
    model = build(d_model=16, attention="{heads: 4, score: bilinear}")
    assert tuple(attention_of(model).score_w.shape) == (4, 4, 4)
    model = build(d_model=16, attention="{heads: 4, score: additive}")
    assert tuple(attention_of(model).score_w.shape) == (4, 4)


def test_scaled_dot_is_dot_over_sqrt_dk():
    """The same weights with score: dot and a query projection scaled by 1/sqrt(d_k) give the
    scaled-dot output: the scaling is exactly 1/sqrt(d_k), with d_k = 8 here."""
    a = attention_of(build(d_model=16, attention="{heads: 2, score: scaled_dot}"))
    b = attention_of(build(d_model=16, attention="{heads: 2, score: dot}"))
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        b.q.weight /= math.sqrt(8)
        b.q.bias /= math.sqrt(8)
    x = inputs(2, 6, 16)
    close(run(b, x, full_mask(2, 6)), run(a, x, full_mask(2, 6)))


# --- 2. head merges ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "attention, heads, merge",
    [
        ("{heads: 4, merge: project}", 4, "project"),
        ("{heads: 2, d_k: 6, d_v: 5, merge: project}", 2, "project"),
        ("{heads: 4, merge: concat}", 4, "concat"),
        ("{heads: 2, d_k: 16, merge: mean}", 2, "mean"),
    ],
)
def test_head_merges(attention, heads, merge):
    model = build(d_model=16, attention=attention)
    att = attention_of(model)
    if merge != "project":
        assert att.o is None
    x = inputs(2, 6, 16)
    allowed = padded_mask(2, 6)
    expected = mha_reference(att, x.double().numpy(), allowed.numpy(), heads=heads, merge=merge)
    close(run(att, x, allowed), expected)


# --- 3. W_k = W_v -----------------------------------------------------------------------------


def test_share_kv_values_use_key_weights():
    model = build(d_model=16, attention="{heads: 4, share_kv: true}")
    att = attention_of(model)
    assert att.v is None
    x = inputs(2, 6, 16)
    xn = x.double().numpy()
    q, k, v = qkv(att, xn, 4, share_kv=True)
    alpha = softmax(np.einsum("bhid,bhjd->bhij", q, k) / 2.0, None)
    expected = merge_project(att, np.einsum("bhij,bhjd->bhid", alpha, k))
    close(run(att, x, full_mask(2, 6)), expected)
    with torch.no_grad():
        _, (k_present, v_present) = att(x, full_mask(2, 6), torch.arange(6))
    close(v_present.double().numpy(), k)


# --- 4. Shaw et al. 2018 ----------------------------------------------------------------------


def shaw_reference(att, x, allowed, *, heads, clip, values, q_pos=None, k_pos=None):
    """e_ij = q_i (k_j + a^K_ij)^T / sqrt(d_k); z_i = sum_j alpha_ij (v_j + a^V_ij);
    a_ij = w_{clip(j - i, -k, k)} (table rows 0..2k for offsets -k..k)."""
    q, k, v = qkv(att, x, heads)
    t, s = q.shape[2], k.shape[2]
    q_pos = np.arange(t) if q_pos is None else q_pos
    k_pos = np.arange(s) if k_pos is None else k_pos
    wk = W(att.rel_k.weight)
    aK = np.empty((t, s, wk.shape[1]))
    for i in range(t):
        for j in range(s):
            aK[i, j] = wk[min(max(k_pos[j] - q_pos[i], -clip), clip) + clip]
    e = np.einsum("bhid,bhijd->bhij", q, k[:, :, None, :, :] + aK[None, None]) / math.sqrt(q.shape[-1])
    alpha = softmax(e, allowed)
    z = np.einsum("bhij,bhjd->bhid", alpha, v)
    if values:
        wv = W(att.rel_v.weight)
        aV = np.empty((t, s, wv.shape[1]))
        for i in range(t):
            for j in range(s):
                aV[i, j] = wv[min(max(k_pos[j] - q_pos[i], -clip), clip) + clip]
        z = z + np.einsum("bhij,ijd->bhid", alpha, aV)
    return merge_project(att, z)


@pytest.mark.parametrize("values", [True, False])
def test_shaw_relative_positions(values):
    clip, t = 2, 9  # clip < T - 1: far pairs share the clipped embeddings
    model = build(d_model=16, attention="{heads: 4}", position=f"{{kind: relative, clip: {clip}, values: {str(values).lower()}}}")
    att = attention_of(model)
    assert tuple(att.rel_k.weight.shape) == (2 * clip + 1, 4)
    assert (att.rel_v is not None) == values
    x = inputs(2, t, 16)
    allowed = padded_mask(2, t)
    expected = shaw_reference(att, x.double().numpy(), allowed.numpy(), heads=4, clip=clip, values=values)
    close(run(att, x, allowed), expected)


def test_shaw_clipping_is_by_signed_offset():
    """Changing the table row for offset +k (all keys at j - i >= k) changes the output; the row for
    an offset no pair uses (with T = 2 only -1, 0, +1 occur) does not."""
    clip = 3
    model = build(d_model=16, attention="{heads: 2}", position=f"{{kind: relative, clip: {clip}}}")
    att = attention_of(model)
    x = inputs(1, 2, 16)
    base = run(att, x, full_mask(1, 2))
    with torch.no_grad():
        att.rel_k.weight[0] += 5.0  # offset -3: unused with T = 2
        att.rel_v.weight[2 * clip] += 5.0  # offset +3: unused
    close(run(att, x, full_mask(1, 2)), base)
    with torch.no_grad():
        att.rel_v.weight[clip + 1] += 1.0  # offset +1: used by query 0 -> key 1
    assert not np.allclose(run(att, x, full_mask(1, 2))[0, 0], base[0, 0], atol=1e-4)


def test_shaw_decoder_with_past_uses_absolute_offsets():
    """Incremental decoding: queries at positions P..P+T-1 against all P+T keys."""
    clip, p, t = 2, 5, 3
    model = build(arch="decoder", d_model=16, attention="{heads: 2}", position=f"{{kind: relative, clip: {clip}}}")
    att = attention_of(model, "decoder")
    x = inputs(2, p + t, 16)
    with torch.no_grad():
        _, past = att(x[:, :p], causal_mask(2, p), torch.arange(p))
    allowed = causal_mask(2, p + t)[:, :, p:]
    got = run(att, x[:, p:], allowed, q_idx=torch.arange(p, p + t), past=past)
    full = shaw_reference(att, x.double().numpy(), causal_mask(2, p + t).numpy(), heads=2, clip=clip, values=True)
    close(got, full[:, p:])


# --- 5. ALiBi, Press et al. 2022 --------------------------------------------------------------


def paper_slopes(n: int) -> list[float]:
    """Section 3: for n a power of two, the geometric sequence starting at 2^(-8/n) with ratio
    2^(-8/n); otherwise the slopes of the largest power of two below n, followed by every other
    slope of twice that many heads."""

    def geometric(m: int) -> list[float]:
        return [2.0 ** (-8.0 * (h + 1) / m) for h in range(m)]

    if n & (n - 1) == 0:
        return geometric(n)
    lower = 1 << (n.bit_length() - 1)
    return geometric(lower) + geometric(2 * lower)[0::2][: n - lower]


def test_alibi_slopes_match_the_paper():
    assert paper_slopes(8) == [2.0 ** -(h + 1) for h in range(8)]  # the paper's example: 1/2 ... 1/256
    assert paper_slopes(6) == [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    for h in (1, 2, 3, 4, 5, 6, 7, 8, 12, 16):
        np.testing.assert_allclose(alibi_slopes(h), paper_slopes(h), rtol=1e-12, atol=0)


def alibi_reference(att, x, allowed, *, heads, q_pos=None, k_pos=None):
    q, k, v = qkv(att, x, heads)
    t, s = q.shape[2], k.shape[2]
    q_pos = np.arange(t) if q_pos is None else q_pos
    k_pos = np.arange(s) if k_pos is None else k_pos
    m = np.array(paper_slopes(heads))
    bias = -m[:, None, None] * np.abs(q_pos[:, None] - k_pos[None, :])[None]  # [H, T, S]
    e = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1]) + bias[None]
    alpha = softmax(e, allowed)
    return merge_project(att, np.einsum("bhij,bhjd->bhid", alpha, v))


@pytest.mark.parametrize("heads, d_model", [(4, 16), (6, 24)])
def test_alibi_decoder_causal(heads, d_model):
    model = build(arch="decoder", d_model=d_model, attention=f"{{heads: {heads}}}", position="{kind: alibi}")
    att = attention_of(model, "decoder")
    np.testing.assert_allclose(att.slopes.double().numpy().reshape(-1), paper_slopes(heads), rtol=1e-6)
    t = 10
    x = inputs(2, t, d_model)
    allowed = causal_mask(2, t)
    close(run(att, x, allowed), alibi_reference(att, x.double().numpy(), allowed.numpy(), heads=heads))


def test_alibi_encoder_symmetric_distance():
    model = build(d_model=16, attention="{heads: 2}", position="{kind: alibi}")
    att = attention_of(model)
    x = inputs(2, 8, 16)
    allowed = padded_mask(2, 8)
    close(run(att, x, allowed), alibi_reference(att, x.double().numpy(), allowed.numpy(), heads=2))


def test_alibi_decoder_with_past():
    p, t = 6, 2
    model = build(arch="decoder", d_model=24, attention="{heads: 6}", position="{kind: alibi}")
    att = attention_of(model, "decoder")
    x = inputs(1, p + t, 24)
    with torch.no_grad():
        _, past = att(x[:, :p], causal_mask(1, p), torch.arange(p))
    got = run(att, x[:, p:], causal_mask(1, p + t)[:, :, p:], q_idx=torch.arange(p, p + t), past=past)
    full = alibi_reference(att, x.double().numpy(), causal_mask(1, p + t).numpy(), heads=6)
    close(got, full[:, p:])


# --- 6. Rotary, Su et al. 2021 ----------------------------------------------------------------


def rotate_half_np(x: np.ndarray, pos: np.ndarray, r: int, base: float) -> np.ndarray:
    """x [B,H,T,Dh], pos [B,T]: for i < R/2 rotate (x_i, x_{i+R/2}) by pos * base^(-2i/R);
    dims >= R unchanged."""
    out = x.copy()
    half = r // 2
    for i in range(half):
        theta = pos[:, None, :] * base ** (-2.0 * i / r)  # [B,1,T]
        a, b = x[..., i], x[..., i + half]
        out[..., i] = a * np.cos(theta) - b * np.sin(theta)
        out[..., i + half] = a * np.sin(theta) + b * np.cos(theta)
    return out


def rotary_reference(att, x, allowed, pos, *, heads, r, base):
    q, k, v = qkv(att, x, heads)
    q, k = rotate_half_np(q, pos, r, base), rotate_half_np(k, pos, r, base)
    e = np.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
    alpha = softmax(e, allowed)
    return merge_project(att, np.einsum("bhij,bhjd->bhid", alpha, v))


def rope_for(pos: torch.Tensor, r: int, base: float):
    return rotary_cos_sin(pos, rotary_frequencies(r, base), torch.float32)


@pytest.mark.parametrize("fraction, r", [(1.0, 8), (0.5, 4)])
def test_rotary_rotate_half(fraction, r):
    base = 100.0  # a small base: every frequency turns visibly over a few positions
    model = build(
        arch="decoder", d_model=32, attention="{heads: 4}",
        position=f"{{kind: rotary, base: {base}, fraction: {fraction}}}", max_length=64,
    )
    att = attention_of(model, "decoder")
    assert att.spec.rotary_dims == r
    t = 7
    pos = torch.stack([torch.arange(t), torch.arange(t) + 11])  # row 1: a left-shifted window
    x = inputs(2, t, 32)
    allowed = causal_mask(2, t)
    got = run(att, x, allowed, rope=rope_for(pos, r, base))
    expected = rotary_reference(att, x.double().numpy(), allowed.numpy(), pos.double().numpy(), heads=4, r=r, base=base)
    close(got, expected)


def test_rotary_rotation_matches_the_complex_form():
    """RoFormer's complex form: (x_i + i x_{i+R/2}) * e^{i pos theta_i}, checked against the
    real rotate-half reference so the reference itself is right."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 1, 5, 8))
    pos = np.arange(5, dtype=float)[None]
    got = rotate_half_np(x, pos, 8, 10000.0)
    z = (x[..., :4] + 1j * x[..., 4:]) * np.exp(1j * pos[:, None, :, None] * 10000.0 ** (-np.arange(4) / 4))
    np.testing.assert_allclose(got, np.concatenate([z.real, z.imag], axis=-1), atol=1e-12)


@pytest.mark.parametrize("fraction, r", [(1.0, 8), (0.5, 4)])
def test_rotary_depends_only_on_position_difference(fraction, r):
    base = 100.0
    model = build(d_model=32, attention="{heads: 4}", position=f"{{kind: rotary, base: {base}, fraction: {fraction}}}", max_length=64)
    att = attention_of(model)
    t = 8
    x = inputs(1, t, 32)
    pos = torch.arange(t)[None]
    allowed = full_mask(1, t)
    a = run(att, x, allowed, rope=rope_for(pos, r, base))
    b = run(att, x, allowed, rope=rope_for(pos + 5, r, base))
    close(b, a)
    # and the scores themselves: q_m . k_n after rotation depends on n - m only
    xn = x.double().numpy()
    q, k, _ = qkv(att, xn, 4)
    p = pos.double().numpy()
    s0 = np.einsum("bhid,bhjd->bhij", rotate_half_np(q, p, r, base), rotate_half_np(k, p, r, base))
    s5 = np.einsum("bhid,bhjd->bhij", rotate_half_np(q, p + 5, r, base), rotate_half_np(k, p + 5, r, base))
    np.testing.assert_allclose(s5, s0, atol=1e-9)
    # a non-uniform change of positions does change the output (the rotation is applied)
    c = run(att, x, allowed, rope=rope_for(pos * 2, r, base))
    assert not np.allclose(c, a, atol=1e-4)


# --- 7. Linformer, Wang et al. 2020 -----------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
def test_linformer_projected_keys_and_values(padded):
    kproj, t, heads = 4, 10, 2
    model = build(d_model=16, attention=f"{{heads: {heads}, pattern: {{kind: linformer, k: {kproj}}}}}")
    att = attention_of(model)
    assert tuple(att.proj_k.shape) == (kproj, 16) and tuple(att.proj_v.shape) == (kproj, 16)
    b = 2
    x = inputs(b, t, 16)
    keep = torch.ones(b, t, dtype=torch.bool)
    if padded:
        keep[1, t - 3:] = False
    xn = x.double().numpy()
    q, k, v = qkv(att, xn, heads)
    kn = keep.numpy()[:, None, :, None].astype(float)
    k, v = k * kn, v * kn  # padded keys zeroed before the projection
    E, F = W(att.proj_k)[:, :t], W(att.proj_v)[:, :t]
    k2 = np.einsum("ks,bhsd->bhkd", E, k)  # K' = E K, shared by the heads
    v2 = np.einsum("ks,bhsd->bhkd", F, v)
    alpha = softmax(np.einsum("bhid,bhkd->bhik", q, k2) / math.sqrt(q.shape[-1]), None)
    expected = merge_project(att, np.einsum("bhik,bhkd->bhid", alpha, v2))
    got = run(att, x, full_mask(b, t), key_keep=keep if padded else None)
    close(got, expected)
    if padded:
        # the padded keys' content is irrelevant
        x2 = x.clone()
        x2[1, t - 3:] += 3.0
        # (only keys/values: the queries at padded positions change, so compare the real rows)
        got2 = run(att, x2, full_mask(b, t), key_keep=keep)
        close(got2[1, : t - 3], got[1, : t - 3])


# --- 8. BigBird, Zaheer et al. 2020 -----------------------------------------------------------


BIGBIRD = "{heads: 2, pattern: {kind: bigbird, block: 2, window: 1, global: 1, random: 2}}"


def bigbird_mask_np(t: int, block: int, window: int, glob: int, random_blocks) -> np.ndarray:
    m = np.zeros((t, t), dtype=bool)
    for i in range(t):
        for j in range(t):
            bi, bj = i // block, j // block
            m[i, j] = abs(i - j) <= window or bi < glob or bj < glob or bj in random_blocks[bi]
    return m


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_bigbird_pattern(arch):
    t = 12
    model = build(arch=arch, d_model=16, attention=BIGBIRD, layers=2, max_length=16)
    stack = arch
    rb = model.resolved.stack(stack).layers[0].attention.random_blocks
    assert len(rb) == 8  # max_length / block
    for i, row in enumerate(rb):
        assert len(set(row)) == len(row)
        assert all(j >= 1 and j != i for j in row)  # global blocks are never drawn
        if arch == "decoder":
            assert all(j < i for j in row)  # no future blocks
        else:
            assert len(row) == 2
    pattern = bigbird_mask_np(t, 2, 1, 1, rb)
    # the random blocks matter within these T tokens
    assert (pattern & ~bigbird_mask_np(t, 2, 1, 1, [()] * 8)).any()
    att = attention_of(model, stack)
    x = inputs(2, t, 16)
    allowed = causal_mask(2, t) if arch == "decoder" else padded_mask(2, t)
    expected = mha_reference(att, x.double().numpy(), allowed.numpy(), heads=2, pattern=pattern[None, None])
    close(run(att, x, allowed), expected)


def test_bigbird_random_blocks_are_deterministic_and_per_layer():
    text = spec_text(d_model=16, attention=BIGBIRD, layers=3, max_length=32)
    r1 = specc.resolve(specc.loads_spec(text))
    r2 = specc.resolve(specc.loads_spec(text))
    blocks1 = [layer.attention.random_blocks for layer in r1.encoder.layers]
    blocks2 = [layer.attention.random_blocks for layer in r2.encoder.layers]
    assert blocks1 == blocks2
    assert len(blocks1[0]) == 16
    assert len({b for b in blocks1}) == 3  # every layer draws its own
    # the built module sees the resolved blocks
    model = specc.to_torch(r1, seed=0)
    for i, layer in enumerate(model.encoder.layers):
        table = layer.attention.random_table.numpy()
        expect = np.zeros((16, 16), dtype=bool)
        for qb, row in enumerate(blocks1[i]):
            expect[qb, list(row)] = True
        np.testing.assert_array_equal(table, expect)


# --- 9. Local (restricted) attention ----------------------------------------------------------


@pytest.mark.parametrize("arch", ["encoder", "decoder"])
def test_local_window(arch):
    t, window = 9, 2
    model = build(arch=arch, d_model=16, attention=f"{{heads: 4, pattern: {{kind: local, window: {window}}}}}")
    att = attention_of(model, arch)
    i = np.arange(t)
    pattern = np.abs(i[:, None] - i[None, :]) <= window
    x = inputs(2, t, 16)
    allowed = causal_mask(2, t) if arch == "decoder" else padded_mask(2, t)
    expected = mha_reference(att, x.double().numpy(), allowed.numpy(), heads=4, pattern=pattern[None, None])
    close(run(att, x, allowed), expected)


# --- 10. Grouped-query / multi-query ----------------------------------------------------------


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_grouped_query(kv_heads):
    heads, d_model, t = 4, 16, 6
    model = build(d_model=d_model, attention=f"{{heads: {heads}, kv_heads: {kv_heads}}}")
    att = attention_of(model)
    dk = d_model // heads
    assert tuple(att.k.weight.shape) == (kv_heads * dk, d_model)
    assert tuple(att.v.weight.shape) == (kv_heads * dk, d_model)
    x = inputs(2, t, d_model)
    allowed = padded_mask(2, t)
    q, k, v = qkv(att, x.double().numpy(), heads, kv_heads)
    group = heads // kv_heads
    z = np.empty((2, heads, t, dk))
    for h in range(heads):
        g = h // group  # query head h reads kv head h // (H / H_kv)
        alpha = softmax(q[:, h] @ k[:, g].transpose(0, 2, 1) / math.sqrt(dk), allowed.numpy()[:, 0])
        z[:, h] = alpha @ v[:, g]
    expected = merge_project(att, z)
    with torch.no_grad():
        out, (k_present, v_present) = att(x, allowed, torch.arange(t))
    close(out.double().numpy(), expected)
    assert tuple(k_present.shape) == (2, kv_heads, t, dk)
    close(k_present.double().numpy(), k)
    close(v_present.double().numpy(), v)


# --- 11. QK-norm (Qwen3 per head, OLMo 2 over all heads) -----------------------------------------


@pytest.mark.parametrize("qk_norm, kv_heads", [("head", 2), ("full", 2), ("head", 4)])
def test_qk_norm(qk_norm, kv_heads):
    """q and k through the model's RMSNorm (x / sqrt(mean(x^2) + eps) * g) before the scores: over
    each head's d_k (Qwen3, Yang et al. 2025) or over all heads' concatenation (OLMo 2, OLMo et
    al. 2024); the values are not normalised, and the cache holds the normalised keys."""
    heads, d_model, t = 4, 16, 6
    text = spec_text(d_model=d_model, attention=f"{{heads: {heads}, kv_heads: {kv_heads}, qk_norm: {qk_norm}}}")
    model = specc.to_torch(specc.loads_spec(text.replace("dropout: 0.0", "dropout: 0.0\nnorm: {kind: rmsnorm, eps: 1.0e-6}")), seed=0)
    randomize(model, 1)
    att = attention_of(model)
    dk = d_model // heads
    x = inputs(2, t, d_model).double().numpy()

    def rms(a: np.ndarray, g) -> np.ndarray:
        return a / np.sqrt((a ** 2).mean(-1, keepdims=True) + 1e-6) * g.detach().double().numpy()

    if qk_norm == "head":
        q = rms(split(linear(x, att.q), heads), att.q_norm.weight)
        k = rms(split(linear(x, att.k), kv_heads), att.k_norm.weight)
    else:
        q = split(rms(linear(x, att.q), att.q_norm.weight), heads)
        k = split(rms(linear(x, att.k), att.k_norm.weight), kv_heads)
    v = split(linear(x, att.v), kv_heads)
    allowed = padded_mask(2, t)
    z = np.empty((2, heads, t, dk))
    for h in range(heads):
        g = h // (heads // kv_heads)
        z[:, h] = softmax(q[:, h] @ k[:, g].transpose(0, 2, 1) / math.sqrt(dk), allowed.numpy()[:, 0]) @ v[:, g]
    with torch.no_grad():
        out, (k_present, v_present) = att(torch.from_numpy(x).float(), allowed, torch.arange(t))
    close(out.double().numpy(), merge_project(att, z))
    close(k_present.double().numpy(), k)
    close(v_present.double().numpy(), v)


@pytest.mark.parametrize("buckets,max_distance", [(32, 128), (8, 8), (4, 8), (32, 64), (32, 17), (64, 40)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_bucketed_positions_match_t5s_buckets(buckets, max_distance, bidirectional):
    # Raffel et al.'s buckets as Hugging Face's T5 computes them at every call, over every distance
    # of a 300-token sequence (the far ones all in the last bucket of their half)
    t5 = pytest.importorskip("transformers.models.t5.modeling_t5")
    pos = torch.arange(300)
    want = t5.T5Attention._relative_position_bucket(pos[None, :] - pos[:, None], bidirectional=bidirectional,
                                                    num_buckets=buckets, max_distance=max_distance)
    exact, thresholds = distance_buckets(buckets, max_distance, bidirectional)
    got = relative_bucket(pos, pos, exact, thresholds, buckets // 2 if bidirectional else 0)
    assert torch.equal(got, want)
