"""Position schemes. Shape letters: B batch, T new tokens, S total keys, H heads, Dh head dim, D d_model.

  sinusoidal  Vaswani et al. 2017, 3.5: PE(p, 2i) = sin(p / base^(2i/D)), PE(p, 2i+1) = cos(same),
              computed from the position ids (no table; any length).
  learned     a table [max_length, D] (a parameter of the stack: `<stack>.positions.weight`).
  relative    Shaw et al. 2018: a^K_ij, a^V_ij = w_{clip(j - i, -k, k)}; tables [2k+1, Dh] per layer
              (in attention.py, which adds them to keys and values).
  rotary      Su et al. 2021 (RoFormer): rotate pairs of q/k dims by p * base^(-2i/R); R = the rotated
              dims (leading `rotary_dims` of each head). Pairs are (x_i, x_{i+R/2}) (layout halves: the
              GPT-NeoX / LLaMA layout of Hugging Face checkpoints) or (x_2i, x_2i+1) (interleaved:
              RoFormer's own, GPT-J's, llama.cpp's). The frequencies may be scaled to reach past the
              trained length: linear (Chen et al. 2023), Llama 3.1's, YaRN (Peng et al. 2023),
              LongRoPE (Ding et al. 2024); rotary_frequencies.
  bucketed    Raffel et al. 2020 (T5): a learned per-head scalar added to each score, looked up by
              bucket(j - i): exact below half the buckets, log-spaced up to max_distance; both signs
              in an encoder (half the buckets each), the past only in a decoder.
  alibi       Press et al. 2022: add -m_h * |i - j| to the scores; slopes m_h = 2^(-8h/H) for H a power
              of two, else those of the nearest lower power of two followed by every other slope of
              twice that (the paper's recipe, section 3).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass(frozen=True)
class RotaryFrequencies:
    """The inverse frequencies of one rotary scheme, R / 2 of them, as Python floats holding their
    fp32 values exactly (a graph makes them constants: no arithmetic of the exporter's or the
    runtime's touches them). `long` and `threshold`: LongRoPE's second set, used where the largest
    position id + 1 exceeds `threshold`. `scale`: the factor on cos and sin (YaRN's and LongRoPE's
    attention factor). Hashable: a stack makes one cos / sin per distinct scheme."""

    short: tuple[float, ...]
    long: tuple[float, ...] | None = None
    threshold: int = 0
    scale: float = 1.0


def _exponents(rot: int) -> torch.Tensor:
    """2i / R for the R / 2 pairs, fp32."""
    return torch.arange(0, rot, 2, dtype=torch.int64).to(torch.float32) / rot


def rotary_frequencies(rot: int, base: float, scaling=None, max_length: int = 0) -> RotaryFrequencies:
    """The inverse frequencies f_i = base^(-2i/R) of R rotated dims, changed by `scaling` (a kind of
    the language's rotary scaling, specc.spec.schema; None: none) and computed once, in fp32 and in
    the order of operations transformers' rope init functions use, so that they are the
    checkpoints' own to the bit. `max_length`: position.max_length (LongRoPE's default factor)."""
    kind = "none" if scaling is None else scaling.kind
    powers = base ** _exponents(rot)  # base^(2i/R)
    plain = 1.0 / powers
    if kind == "none":
        return RotaryFrequencies(tuple(plain.tolist()))
    if kind == "linear":  # Chen et al. 2023: positions interpolated, p / factor
        return RotaryFrequencies(tuple((plain / scaling.factor).tolist()))
    if kind == "llama3":
        return RotaryFrequencies(tuple(_llama3(plain, scaling).tolist()))
    if kind == "yarn":
        return _yarn(rot, base, powers, plain, scaling)
    if kind == "longrope":
        return _longrope(rot, powers, scaling, max_length)
    raise ValueError(f"rotary scaling kind {kind!r}")


def _llama3(plain: torch.Tensor, s) -> torch.Tensor:
    """Meta's Llama 3.1 scaling: by wavelength, kept (short), divided by factor (long), blended."""
    wavelength = 2 * math.pi / plain
    long_edge, short_edge = s.original_max_length / s.low_freq_factor, s.original_max_length / s.high_freq_factor
    divided = torch.where(wavelength > long_edge, plain / s.factor, plain)
    blend = (s.original_max_length / wavelength - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - blend) * divided / s.factor + blend * divided
    between = ~(wavelength < short_edge) * ~(wavelength > long_edge)
    return torch.where(between, blended, divided)


def _yarn(rot: int, base: float, powers: torch.Tensor, plain: torch.Tensor, s) -> RotaryFrequencies:
    """Peng et al. 2023: NTK-by-parts, pair i's frequency ramped from kept (the pairs that turn
    more than beta_fast times in the original length) to interpolated (fewer than beta_slow)."""

    def pair_turning(turns: float) -> float:  # the pair index that turns `turns` times in L
        return rot * math.log(s.original_max_length / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_turning(s.beta_fast), pair_turning(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001  # a ramp of one point: a step
    ramp = torch.clamp((torch.arange(rot // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    kept = 1 - ramp  # the share of pair i's frequency that is extrapolated (kept as it is)
    interpolated = 1.0 / (s.factor * powers)
    freqs = interpolated * (1 - kept) + plain * kept
    scale = s.attention_factor
    if scale is None:
        scale = 0.1 * math.log(s.factor) + 1.0 if s.factor > 1 else 1.0
    return RotaryFrequencies(tuple(freqs.tolist()), scale=float(scale))


def _longrope(rot: int, powers: torch.Tensor, s, max_length: int) -> RotaryFrequencies:
    """Ding et al. 2024 (Phi-3): a rescale factor per pair, one list within the original length
    and one beyond it."""

    def divided(factors: list[float]) -> tuple[float, ...]:
        return tuple((1.0 / (torch.tensor(factors, dtype=torch.float32) * powers)).tolist())

    scale = s.attention_factor
    if scale is None:
        factor = s.factor if s.factor is not None else max_length / s.original_max_length
        scale = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(s.original_max_length))
    return RotaryFrequencies(divided(s.short_factor), divided(s.long_factor), s.original_max_length, float(scale))


def rotary_cos_sin(position_ids: torch.Tensor, freqs: RotaryFrequencies, dtype: torch.dtype,
                   interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] positions -> cos, sin of shape [B, 1, T, R]: each frequency repeated for both
    halves, or (interleaved) for both dims of its pair; times freqs.scale, in fp32, then cast."""
    inv = torch.tensor(freqs.short, dtype=torch.float32, device=position_ids.device)
    if freqs.long is not None:  # LongRoPE: the long set where the sequence passes the threshold
        long = torch.tensor(freqs.long, dtype=torch.float32, device=position_ids.device)
        inv = torch.where(position_ids.max() + 1 > freqs.threshold, long, inv)
    angles = position_ids.to(torch.float32).unsqueeze(-1) * inv  # [B, T, R/2]
    if interleaved:
        angles = torch.stack((angles, angles), dim=-1).flatten(-2)
    else:
        angles = torch.cat((angles, angles), dim=-1)
    angles = angles.unsqueeze(1)  # [B, 1, T, R]
    cos, sin = angles.cos(), angles.sin()
    if freqs.scale != 1.0:
        cos, sin = cos * freqs.scale, sin * freqs.scale
    return cos.to(dtype), sin.to(dtype)


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
