"""A mixture of routed experts (the `moe` FFN kind): a router chooses top_k of E expert FFNs for
each token and weighs their outputs; a shared expert, where there is one, sees every token.

Shapes: N tokens (batch x sequence, flattened), D d_model, E experts, k top_k, F each expert's d_ff.

    x [N,D] --router (fp32)--> logits [N,E] --scores, choice, weights--> index [N,k], weight [N,k]
      |                                                                            |
      '--> for each expert e: the tokens that chose it (index_select), their rows only:
           y_e = down_e(act(gate_e(x)) * up_e(x))  ->  out[tokens] += weight * y_e  (index_add)
    out (+ shared(x), times sigmoid(x w_g) with a gate)  [N,D]

A token is computed by its k experts alone: the cost per token follows top_k, not E. The experts'
weights are stacked, one tensor per projection and layer ([E, F, D] as llama.cpp's ffn_*_exps
and onnxruntime's MoE operators hold them). The router's arithmetic is fp32 whatever the model's
dtype, so that the choice of experts does not change with the number format a build computes in.

Routers (specc.spec.schema: SoftmaxRouter, TopKSoftmaxRouter, SigmoidRouter, SparseMixerRouter),
each as transformers computes its families' (MixtralTopKRouter, Qwen2MoeTopKRouter, OlmoeTopKRouter,
GptOssTopKRouter, GraniteMoeTopKRouter, DeepseekV2TopkRouter, DeepseekV3TopkRouter, phimoe's
sparsemixer): tests/nn/test_moe_reference.py holds them to it.
"""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from specc.nn.ops import ACTIVATIONS, GATED, cast, gated
from specc.spec.schema import ExpertsFFNSpec


def _group_limited(choice: torch.Tensor, groups: int, top_groups: int, score: str) -> torch.Tensor:
    """The choice scores [N,E] with every expert outside the `top_groups` best of `groups` equal
    groups set to -inf; a group's score is its best expert's (`max`) or its two best's sum
    (`top2_sum`): DeepSeek-V2's group_limited_greedy and V3's noaux_tc."""
    n, e = choice.shape
    grouped = choice.view(n, groups, e // groups)
    group_scores = grouped.max(dim=-1).values if score == "max" else grouped.topk(2, dim=-1).values.sum(dim=-1)
    best = group_scores.topk(top_groups, dim=-1).indices
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter(1, best, True)
    keep = keep[:, :, None].expand(n, groups, e // groups).reshape(n, e)
    return choice.masked_fill(~keep, float("-inf"))


def _sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PhiMoE's sparsemixer at inference for two experts (transformers' phimoe.sparsemixer, its
    eval path): each expert the highest logit left, weighted by the softmax of the logits within
    2 eps of it (relative to max(|logit|, that highest)), the first expert's logit masked out for
    the second."""
    weights, index = [], []
    masked = logits
    for _ in range(2):
        top, top_index = masked.max(dim=-1, keepdim=True)
        far = (top - logits) / logits.abs().clamp(min=top) > 2 * eps
        probs = torch.softmax(masked.masked_fill(far, float("-inf")), dim=-1)
        weights.append(probs.gather(-1, top_index))
        index.append(top_index)
        masked = masked.scatter(-1, top_index, float("-inf"))
    return torch.cat(weights, dim=-1), torch.cat(index, dim=-1)


class Router(nn.Module):
    """weight [E, D]; bias [E] (`bias`: gpt-oss); selection_bias [E] (the sigmoid router's
    `selection_bias`: DeepSeek-V3's e_score_correction_bias, added to the scores for the choice
    only)."""

    def __init__(self, spec: ExpertsFFNSpec, d_model: int):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.experts, d_model))
        self.bias = nn.Parameter(torch.empty(spec.experts)) if spec.router.bias else None
        with_selection = spec.router.kind == "sigmoid" and spec.router.selection_bias
        self.selection_bias = nn.Parameter(torch.empty(spec.experts)) if with_selection else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N,D] -> (weights [N,k] fp32, expert index [N,k])."""
        r, k = self.spec.router, self.spec.top_k
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(cast(x, torch.float32), self.weight.float(), bias)
        if r.kind == "top_k_softmax":
            top, index = logits.topk(k, dim=-1)
            return torch.softmax(top, dim=-1), index
        if r.kind == "sparsemixer":
            return _sparsemixer(logits, r.jitter_eps)
        scores = torch.softmax(logits, dim=-1) if r.kind == "softmax" else torch.sigmoid(logits)
        choice = scores if self.selection_bias is None else scores + self.selection_bias.float()
        if r.groups is not None:
            choice = _group_limited(choice, r.groups, r.top_groups, r.group_score)
        index = choice.topk(k, dim=-1).indices
        weights = scores.gather(-1, index)
        if r.normalize:  # the sigmoid router's sum may be tiny: DeepSeek-V3's 1e-20 keeps it finite
            weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if r.kind == "sigmoid" else 0.0))
        return (weights * r.scale if r.scale != 1.0 else weights), index


class Experts(nn.Module):
    """The routed experts, stacked: gate [E, F, D] (gated activations), up [E, F, D], down [E, D, F];
    with `bias`, gate_bias [E, F], up_bias [E, F], down_bias [E, D]."""

    def __init__(self, spec: ExpertsFFNSpec, d_model: int):
        super().__init__()
        self.spec = spec
        e, f, d = spec.experts, spec.d_ff, d_model
        self.gate = nn.Parameter(torch.empty(e, f, d)) if spec.activation in GATED else None
        self.up = nn.Parameter(torch.empty(e, f, d))
        self.down = nn.Parameter(torch.empty(e, d, f))
        self.gate_bias = nn.Parameter(torch.empty(e, f)) if spec.bias and self.gate is not None else None
        self.up_bias = nn.Parameter(torch.empty(e, f)) if spec.bias else None
        self.down_bias = nn.Parameter(torch.empty(e, d)) if spec.bias else None

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e of the rows x [n, D]: [n, D]."""
        s = self.spec

        def bias(b):
            return None if b is None else b[e]

        up = F.linear(x, self.up[e], bias(self.up_bias))
        if self.gate is None:
            h = ACTIVATIONS[s.activation](up)
        else:
            h = gated(s.activation, F.linear(x, self.gate[e], bias(self.gate_bias)), up, s.swiglu_alpha, s.swiglu_limit)
        return F.linear(h, self.down[e], bias(self.down_bias))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [N,D]; weights, index [N,k]: sum over each token's chosen experts of weight x expert(x).
        Expert by expert in ascending order, the rows that chose it only (transformers' order of
        summation, so that the two agree to the rounding)."""
        out = torch.zeros_like(x)
        for e in range(self.spec.experts):
            token, slot = torch.where(index == e)
            y = self.expert(e, x[token])
            out.index_add_(0, token, y * cast(weights[token, slot, None], y.dtype))
        return out


class SharedExpert(nn.Module):
    """gate [F_s, D] (gated activations), up [F_s, D], down [D, F_s], biases with `bias`: an FFN of
    the routed experts' activation that sees every token."""

    def __init__(self, spec: ExpertsFFNSpec, d_model: int):
        super().__init__()
        self.spec = spec
        f, bias = spec.shared.d_ff, spec.bias
        self.gate = nn.Linear(d_model, f, bias=bias) if spec.activation in GATED else None
        self.up = nn.Linear(d_model, f, bias=bias)
        self.down = nn.Linear(f, d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.spec
        if self.gate is None:
            return self.down(ACTIVATIONS[s.activation](self.up(x)))
        return self.down(gated(s.activation, self.gate(x), self.up(x), s.swiglu_alpha, s.swiglu_limit))


class MoE(nn.Module):
    """router (Router), experts (Experts), shared (SharedExpert, with `shared`) and shared_gate
    [1, D] (with shared.gate: the shared expert's output times sigmoid(x w_g), Qwen2-MoE's
    shared_expert_gate)."""

    def __init__(self, spec: ExpertsFFNSpec, d_model: int):
        super().__init__()
        self.spec = spec
        self.router = Router(spec, d_model)
        self.experts = Experts(spec, d_model)
        self.shared = SharedExpert(spec, d_model) if spec.shared is not None else None
        self.shared_gate = nn.Linear(d_model, 1, bias=False) if spec.shared is not None and spec.shared.gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> [..., D]."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, index = self.router(flat)
        out = self.experts(flat, weights, index)
        if self.shared is not None:
            shared = self.shared(flat)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(flat)) * shared
            out = out + shared
        return out.reshape(shape)
