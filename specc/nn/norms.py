"""Norms: RMSNorm (Zhang & Sennrich 2019) and LayerNorm, computed in fp32 whatever the input dtype."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from specc.nn.ops import cast
from specc.spec.schema import NormSpec


class RMSNorm(nn.Module):
    """Zhang & Sennrich 2019: x / sqrt(mean(x^2) + eps) * g, computed in fp32. With `unit_offset`
    the gain g is 1 + weight (Gemma's form: its checkpoints store the gain less one)."""

    def __init__(self, d: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps, self.unit_offset = eps, unit_offset
        self.weight = nn.Parameter(torch.zeros(d) if unit_offset else torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = cast(x, torch.float32)
        gain = self.weight + 1.0 if self.unit_offset else self.weight
        return cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps), x.dtype) * gain


class LayerNorm(nn.LayerNorm):
    """torch's LayerNorm (weight, and bias unless made with bias=False), computed in fp32 whatever
    the input dtype."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super().forward(x)
        bias = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, self.weight.float(), bias, self.eps).to(x.dtype)


def make_norm(spec: NormSpec, d: int) -> nn.Module:
    if spec.kind == "rmsnorm":
        return RMSNorm(d, spec.eps, spec.unit_offset)
    return LayerNorm(d, eps=spec.eps, bias=spec.bias)
