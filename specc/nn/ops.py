"""Small pieces shared by the modules, so that what torch.export records holds only what computes.

torch.export records a dropout in eval mode and a cast to the dtype a tensor already has as ops of
their own. The ONNX optimizer drops them afterwards anyway; these helpers keep the recorded graph
to what computes, so that it reads as the model does.
"""
from __future__ import annotations

import torch
from torch import nn


class Dropout(nn.Dropout):
    """nn.Dropout that is not traced at all outside training."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) if self.training and self.p > 0 else x


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; x itself (no op) where it has it already."""
    return x if x.dtype == dtype else x.to(dtype)
