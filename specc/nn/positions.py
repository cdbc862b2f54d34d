"""Position schemes. Shape letters: B batch, T new tokens, S total keys, H heads, Dh head dim, D d_model.

  sinusoidal  Vaswani et al. 2017, 3.5: PE(p, 2i) = sin(p / base^(2i/D)), PE(p, 2i+1) = cos(same),
              computed from the position ids (no table; any length).
  learned     a table [max_length, D] (a parameter of the stack: `<stack>.positions.weight`).
  relative    Shaw et al. 2018: a^K_ij, a^V_ij = w_{clip(j - i, -k, k)}; tables [2k+1, Dh] per layer
              (in attention.py, which adds them to keys and values).
  rotary      Su et al. 2021 (RoFormer): rotate pairs of q/k dims by p * base^(-2i/R); R = the rotated
              dims (leading `rotary_dims` of each head). Pairs are (x_i, x_{i+R/2}) (layout halves: the
              GPT-NeoX / LLaMA layout of Hugging Face checkpoints) or (x_2i, x_2i+1) (interleaved:
              RoFormer's own, GPT-J's, llama.cpp's).
  bucketed    Raffel et al. 2020 (T5): a learned per-head scalar added to each score, looked up by
              bucket(j - i): exact below half the buckets, log-spaced up to max_distance; both signs
              in an encoder (half the buckets each), the past only in a decoder.
  alibi       Press et al. 2022: add -m_h * |i - j| to the scores; slopes m_h = 2^(-8h/H) for H a power
              of two, else those of the nearest lower power of two followed by every other slope of
              twice that (the paper's recipe, section 3).
"""
from __future__ import annotations

import math

import torch


def sinusoidal(position_ids: torch.Tensor, d_model: int, base: float, layout: str = "interleaved") -> torch.Tensor:
    """[B, T] int positions -> [B, T, D] float encodings: sin on even dims, cos on odd
    (interleaved), or the sines of every frequency first, then the cosines (halves)."""
    half = (d_model + 1) // 2
    # inverse frequencies base^(-2i/D), i = 0..half-1
    inv = torch.exp(torch.arange(half, dtype=torch.float32, device=position_ids.device) * (-2.0 * math.log(base) / d_model))
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv  # [B, T, half]
    if layout == "halves":
        return torch.cat((torch.sin(angles), torch.cos(angles[..., : d_model - half])), dim=-1)
    pe = torch.stack((torch.sin(angles), torch.cos(angles)), dim=-1).flatten(-2)  # interleave: [B, T, 2*half]
    return pe[..., :d_model]


def rotary_cos_sin(position_ids: torch.Tensor, rot: int, base: float, dtype: torch.dtype,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] positions -> cos, sin of shape [B, 1, T, rot]: each frequency repeated for both
    halves, or (interleaved) for both dims of its pair."""
    inv = 1.0 / (base ** (torch.arange(0, rot, 2, dtype=torch.float32, device=position_ids.device) / rot))
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv  # [B, T, rot/2]
    if interleaved:
        angles = torch.stack((angles, angles), dim=-1).flatten(-2)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    angles = angles.unsqueeze(1)  # [B, 1, T, rot]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False) -> torch.Tensor:
    """Rotate the leading `rot` dims of x [B, H, T, Dh] (dim i with i + rot/2, or interleaved:
    dim 2i with 2i + 1); the rest pass through."""
    rot = cos.shape[-1]
    xr, rest = x[..., :rot], x[..., rot:]
    if interleaved:
        turned = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
    else:
        turned = torch.cat((-xr[..., rot // 2:], xr[..., : rot // 2]), dim=-1)
    rotated = xr * cos + turned * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def alibi_slopes(heads: int) -> list[float]:
    """Press et al. 2022's head slopes (a geometric sequence starting at 2^(-8/n))."""

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    if math.log2(heads).is_integer():
        return power_of_two(heads)
    lower = 2 ** math.floor(math.log2(heads))
    return power_of_two(lower) + power_of_two(2 * lower)[0::2][: heads - lower]


def distance_buckets(buckets: int, max_distance: int, bidirectional: bool) -> tuple[int, tuple[int, ...]]:
    """T5's buckets of distances, as (exact, thresholds): distance n < exact is bucket n; from
    there, bucket exact + the number of thresholds <= n (every distance past max_distance shares
    the last). Worked out once, in torch's fp32 arithmetic as Hugging Face's T5 computes each
    bucket at every call, so that the log-spaced boundaries fall where they fall there; the graph
    then compares integers only (an exported log would round some distances into the neighbouring
    bucket)."""
    if bidirectional:
        buckets //= 2
    exact = buckets // 2
    n = torch.arange(max_distance + 1)
    far = exact + (torch.log(n.float().clamp(min=1.0) / exact) / math.log(max_distance / exact)
                   * (buckets - exact)).to(torch.int64)
    table = torch.where(n < exact, n, far.clamp(max=buckets - 1)).tolist()
    # the first distance in each bucket past the exact ones (a bucket the log spacing skips gets
    # the same threshold as the next, so the count still lands on the right bucket)
    return exact, tuple(next(n for n, v in enumerate(table) if v >= b) for b in range(exact + 1, table[-1] + 1))


def relative_bucket(q_pos: torch.Tensor, k_pos: torch.Tensor, exact: int, thresholds: tuple[int, ...],
                    upper: int) -> torch.Tensor:
    """The bucket of each distance j - i, shape [T, S] (distance_buckets' exact and thresholds),
    keys after the query offset by `upper` (half the buckets) where both directions count; with
    `upper` 0 (a decoder) only the past counts, a later key reading distance 0."""
    rel = k_pos.unsqueeze(0) - q_pos.unsqueeze(1)
    dist = rel.abs() if upper else (-rel).clamp(min=0)
    out = dist.clamp(max=exact)
    for t in thresholds:
        out = out + (dist >= t).to(out.dtype)
    return out + (rel > 0).to(out.dtype) * upper if upper else out


def relative_index(q_pos: torch.Tensor, k_pos: torch.Tensor, clip: int) -> torch.Tensor:
    """Shaw et al.'s clipped distance as a table index: clip(j - i, -k, k) + k, shape [T, S]."""
    return (k_pos.unsqueeze(0) - q_pos.unsqueeze(1)).clamp(-clip, clip) + clip
