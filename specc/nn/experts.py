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

The routed experts of a float32 model whose activation onnxruntime's com.microsoft MoE operator
computes (FUSED_ACTIVATIONS) run as one operator, `torch.ops.specc.moe` (routed_experts: its
semantics are that operator's, its kernel here the loop above), which the export writes as that
MoE node (specc/export/moe.py), so that a graph reads only the chosen experts' weights. The router
hands it logits: a softmax router's own (the operator takes the top_k and their softmax over
every expert, or over the top_k alone where the weights are renormalised), or for any other
router the log of its weights at its choice and -inf elsewhere, the output then multiplied by the
weights' sum (Router.as_logits). Other activations and dtypes keep the loop (Experts.forward),
and so does a forward pass that records gradients (training: the operator has no backward); the
export and verification run without them.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Optional

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


_OBSERVED = threading.local()  # .sink: where this thread's router calls are recorded (observing_routing)


@contextlib.contextmanager
def observing_routing() -> Iterator[list]:
    """While inside, every Router call on this thread appends, in call order (a forward pass: the
    routed layers in order), (top_k, the values its top_k chose among: [N, E] fp32, Router.selection
    of its logits). What verification reads to tell a near tie's flipped choice from an error."""
    previous = getattr(_OBSERVED, "sink", None)
    _OBSERVED.sink = sink = []
    try:
        yield sink
    finally:
        _OBSERVED.sink = previous


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

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """x [N,D] -> the router's logits [N,E], fp32."""
        bias = None if self.bias is None else self.bias.float()
        logits = F.linear(cast(x, torch.float32), self.weight.float(), bias)
        sink = getattr(_OBSERVED, "sink", None)
        if sink is not None:
            sink.append((self.spec.top_k, self.selection(logits).detach().float().numpy().copy()))
        return logits

    def selection(self, logits: torch.Tensor) -> torch.Tensor:
        """The values [N,E] whose top_k is the choice (before a group limit): the logits (softmax
        routers, whose softmax keeps their order, and sparsemixer), or the sigmoid's scores plus
        the selection bias."""
        return logits if self.spec.router.kind != "sigmoid" else self._biased(torch.sigmoid(logits))

    def _biased(self, scores: torch.Tensor) -> torch.Tensor:
        """The scores the choice is made on: plus the selection bias, where there is one."""
        return scores if self.selection_bias is None else scores + self.selection_bias.float()

    def as_logits(self, x: torch.Tensor) -> tuple[torch.Tensor, bool, torch.Tensor | None]:
        """The router as routed_experts reads it: (logits [N,E] fp32, whether the weights are the
        softmax of the top_k logits alone (else of every logit), a factor [N,1] the output is
        multiplied by, or None). A softmax router without groups or scale, and the top_k_softmax
        router, are their own logits; any other router is the log of its weights at its choice,
        -inf elsewhere, renormalised, times the weights' sum."""
        r = self.spec.router
        if r.kind == "top_k_softmax" or (r.kind == "softmax" and r.groups is None and r.scale == 1.0):
            return self.logits(x), r.kind == "top_k_softmax" or r.normalize, None
        weights, index = self(x)
        chosen = torch.full((x.shape[0], self.spec.experts), float("-inf"), dtype=torch.float32, device=x.device)
        return chosen.scatter(-1, index, torch.log(weights)), True, weights.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N,D] -> (weights [N,k] fp32, expert index [N,k])."""
        r, k = self.spec.router, self.spec.top_k
        logits = self.logits(x)
        if r.kind == "top_k_softmax":
            top, index = logits.topk(k, dim=-1)
            return torch.softmax(top, dim=-1), index
        if r.kind == "sparsemixer":
            return _sparsemixer(logits, r.jitter_eps)
        scores = torch.softmax(logits, dim=-1) if r.kind == "softmax" else torch.sigmoid(logits)
        choice = self._biased(scores)
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

    @property
    def routed_weights(self) -> tuple[str, ...]:
        """The stacked weights a graph holds in one MoE node (which an integer build packs,
        specc/export/quantize.py), where the experts run as routed_experts; else none."""
        if self.spec.activation not in FUSED_ACTIVATIONS:
            return ()
        return ("up", "down") if self.gate is None else ("gate", "up", "down")

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e of the rows x [n, D]: [n, D]."""
        s = self.spec
        return _expert(e, x, self.up, self.down, self.gate, self.up_bias, self.down_bias, self.gate_bias,
                       s.activation, s.swiglu_alpha, s.swiglu_limit)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """x [N,D]; weights, index [N,k]: sum over each token's chosen experts of weight x expert(x)."""
        return _mix(x, weights, index, self.spec.experts, self.expert)

    def routed(self, x: torch.Tensor, logits: torch.Tensor, normalize: bool) -> torch.Tensor:
        """x [N,D] fp32, router logits [N,E]: routed_experts over these experts."""
        s = self.spec
        return torch.ops.specc.moe(x, logits, self.up, self.down, self.gate, self.up_bias, self.down_bias,
                                   self.gate_bias, s.top_k, normalize, s.activation, s.swiglu_alpha, s.swiglu_limit)


def _expert(e: int, x: torch.Tensor, up: torch.Tensor, down: torch.Tensor, gate: torch.Tensor | None,
            up_bias: torch.Tensor | None, down_bias: torch.Tensor | None, gate_bias: torch.Tensor | None,
            activation: str, alpha: float | None, limit: float | None) -> torch.Tensor:
    """Expert e of stacked experts (Experts' tensors) on the rows x [n, D]: [n, D]."""

    def bias(b):
        return None if b is None else b[e]

    h = F.linear(x, up[e], bias(up_bias))
    if gate is None:
        h = ACTIVATIONS[activation](h)
    else:
        h = gated(activation, F.linear(x, gate[e], bias(gate_bias)), h, alpha, limit)
    return F.linear(h, down[e], bias(down_bias))


def _mix(x: torch.Tensor, weights: torch.Tensor, index: torch.Tensor, experts: int, expert) -> torch.Tensor:
    """Sum over each token's chosen experts (index [N,k]) of weight x expert(e, rows). Expert by
    expert in ascending order, the rows that chose it only (transformers' order of summation, so
    that the two agree to the rounding)."""
    out = torch.zeros_like(x)
    for e in range(experts):
        token, slot = torch.where(index == e)
        y = expert(e, x[token])
        out.index_add_(0, token, y * cast(weights[token, slot, None], y.dtype))
    return out


# the activations onnxruntime's MoE operator computes on CPU (its activation_type relu, gelu: the
# tanh approximation, silu, and swiglu with alpha, beta and limit; not GELU with erf, nor GEGLU)
FUSED_ACTIVATIONS = ("relu", "gelu_tanh", "silu", "swiglu", "clamped_swiglu")


@torch.library.custom_op("specc::moe", mutates_args=())
def routed_experts(x: torch.Tensor, logits: torch.Tensor, up: torch.Tensor, down: torch.Tensor,
                   gate: Optional[torch.Tensor], up_bias: Optional[torch.Tensor], down_bias: Optional[torch.Tensor],
                   gate_bias: Optional[torch.Tensor], k: int, normalize: bool, activation: str,
                   alpha: Optional[float], limit: Optional[float]) -> torch.Tensor:
    """onnxruntime's com.microsoft MoE for the rows x [N,D] and router logits [N,E]: each row's
    top k logits choose its experts, weighted by the softmax of every logit at those k, or, with
    `normalize`, the softmax of the k alone; experts as Experts holds them."""
    top, index = logits.topk(k, dim=-1)
    weights = torch.softmax(top, dim=-1) if normalize else torch.softmax(logits, dim=-1).gather(-1, index)
    return _mix(x, weights, index, up.shape[0],
                lambda e, rows: _expert(e, rows, up, down, gate, up_bias, down_bias, gate_bias, activation, alpha, limit))


@routed_experts.register_fake
def _(x, logits, up, down, gate, up_bias, down_bias, gate_bias, k, normalize, activation, alpha, limit):
    return torch.empty_like(x)


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
        if self.spec.activation in FUSED_ACTIVATIONS and flat.dtype == torch.float32 and not torch.is_grad_enabled():
            logits, normalize, factor = self.router.as_logits(flat)
            out = self.experts.routed(flat, logits, normalize)
            if factor is not None:
                out = out * factor
        else:
            weights, index = self.router(flat)
            out = self.experts(flat, weights, index)
        out = out.reshape(shape)
        if self.shared is not None:  # on x as it came: its products are MatMuls, which an integer build packs
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = torch.sigmoid(self.shared_gate(x)) * shared
            out = out + shared
        return out
