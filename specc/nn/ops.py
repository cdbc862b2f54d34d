"""Small pieces shared by the modules, so that what torch.export records holds only what computes.

torch.export records a dropout in eval mode and a cast to the dtype a tensor already has as ops of
their own (9 of a bert-base layer's 34 recorded ops before these helpers; 25 after). The ONNX
optimizer drops them afterwards anyway, and the export took as long with them (15.6 s for
bert-base either way): its time goes to torch's decomposition and type-promotion passes.
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
