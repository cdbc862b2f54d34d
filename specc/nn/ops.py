"""Small pieces shared by the modules, so that what torch.export records holds only what computes.

torch.export records a dropout in eval mode and a cast to the dtype a tensor already has as ops of
their own. The ONNX optimizer drops them afterwards anyway; these helpers keep the recorded graph
to what computes, so that it reads as the model does.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from specc.spec.schema import GATED_ACTIVATIONS


class Dropout(nn.Dropout):
    """nn.Dropout that is not traced at all outside training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.training and self.p > 0 else x


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; x itself (no op) where it has it already."""
    return x if x.dtype == dtype else x.to(dtype)


ACTIVATIONS = {
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}
# gated: act(gate(x)) * up(x) (Shazeer 2020), act the one each gates with
ACTIVATIONS.update({gated: ACTIVATIONS[act] for gated, act in GATED_ACTIVATIONS.items()})
GATED = tuple(GATED_ACTIVATIONS)


def gated(activation: str, gate: torch.Tensor, up: torch.Tensor, alpha: float | None = None,
          limit: float | None = None) -> torch.Tensor:
    """A gated activation of the gate and up projections: act(gate) * up, or gpt-oss's
    clamped_swiglu (transformers' GptOssExperts._apply_gate): gate clamped above at `limit`, up
    to [-limit, limit], (up + 1) * gate * sigmoid(alpha * gate)."""
    if activation == "clamped_swiglu":
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
        return (up + 1) * (gate * torch.sigmoid(gate * alpha))
    return ACTIVATIONS[activation](gate) * up
