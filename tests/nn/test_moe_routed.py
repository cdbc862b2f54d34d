"""The routed experts as one operator (torch.ops.specc.moe, onnxruntime's MoE semantics, which the
export writes as that node) against the router and the loop over experts that
test_moe_reference.py holds to transformers' modules: every router kind handed to the operator as
logits (Router.as_logits) gives the same output, for every activation the operator takes; the
others keep the loop."""
from __future__ import annotations

import math

import pytest
import torch

from specc.nn import experts as ex
from specc.nn.experts import MoE
from specc.spec.schema import ExpertsFFNSpec

D, E = 32, 8
ROUTERS = {
    "softmax": {"kind": "softmax"},
    "softmax-normalize-bias": {"kind": "softmax", "normalize": True, "bias": True},
    "softmax-groups-scale": {"kind": "softmax", "normalize": True, "scale": 2.5, "groups": 4, "top_groups": 2},
    "top-k-softmax-bias": {"kind": "top_k_softmax", "bias": True},
    "sigmoid-selection-groups": {"kind": "sigmoid", "normalize": True, "scale": 2.5, "groups": 4, "top_groups": 2,
                                 "group_score": "top2_sum"},
    "sigmoid-plain": {"kind": "sigmoid", "selection_bias": False},
    "sparsemixer": {"kind": "sparsemixer"},
}
ACTIVATIONS = {
    "swiglu": {}, "silu": {}, "relu": {}, "gelu_tanh": {},
    "clamped_swiglu": {"swiglu_alpha": 1.702, "swiglu_limit": 7.0, "bias": True},
}


def _module(router: dict, activation: str, seed: int) -> MoE:
    top_k = 2 if router["kind"] == "sparsemixer" else 3
    spec = ExpertsFFNSpec.model_validate({"kind": "moe", "experts": E, "top_k": top_k, "d_ff": 24,
                                          "activation": activation, **ACTIVATIONS[activation], "router": router,
                                          "shared": {"d_ff": 16, "gate": True}})
    moe = MoE(spec, D).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, t in sorted(moe.named_parameters()):
            t.copy_(torch.randn(t.shape, generator=gen) * (0.5 if t.dim() == 1 else 3.0 / math.sqrt(t.shape[-1])))
    return moe


def _loop(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The block with its experts run as the loop (Router, Experts.forward)."""
    fused, ex.FUSED_ACTIVATIONS = ex.FUSED_ACTIVATIONS, ()
    try:
        return moe(x)
    finally:
        ex.FUSED_ACTIVATIONS = fused


@pytest.mark.parametrize("activation", list(ACTIVATIONS))
@pytest.mark.parametrize("router", list(ROUTERS))
def test_the_operator_computes_the_router_and_the_loop(router, activation, monkeypatch):
    moe = _module(ROUTERS[router], activation, seed=len(router) + len(activation))
    x = torch.randn(3, 7, D, generator=torch.Generator().manual_seed(1))
    seen = []
    real = ex.Experts.routed
    monkeypatch.setattr(ex.Experts, "routed", lambda self, *a: seen.append(1) or real(self, *a))
    with torch.no_grad():
        got = moe(x)
        assert seen == [1]  # the operator ran
        want = _loop(moe, x)
    assert seen == [1]
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # the choice varied: more than top_k experts were used over these tokens
    _, index = moe.router(x.reshape(-1, D))
    assert len(index.unique()) > moe.spec.top_k


def test_the_loop_is_kept_where_the_operator_has_no_such_activation(monkeypatch):
    """GELU with erf and GEGLU: onnxruntime's MoE has neither (its gelu is the tanh form)."""
    seen = []
    real = ex.Experts.routed
    monkeypatch.setattr(ex.Experts, "routed", lambda self, *a: seen.append(1) or real(self, *a))
    for activation in ("gelu", "geglu", "geglu_tanh"):
        spec = ExpertsFFNSpec.model_validate({"kind": "moe", "experts": E, "top_k": 2, "d_ff": 24,
                                              "activation": activation})
        moe = MoE(spec, D).eval()
        for t in moe.parameters():
            torch.nn.init.normal_(t, std=0.1)
        assert moe.experts.routed_weights == ()
        with torch.no_grad():
            moe(torch.randn(2, 3, D))
    assert seen == []
    swiglu = _module(ROUTERS["softmax"], "swiglu", seed=0)
    with torch.no_grad():
        swiglu(torch.randn(2, 3, D))
    assert seen == [1] and swiglu.experts.routed_weights == ("gate", "up", "down")
    swiglu(torch.randn(2, 3, D)).sum().backward()  # gradients recorded: the loop, which has a backward
    assert seen == [1] and swiglu.experts.up.grad is not None
