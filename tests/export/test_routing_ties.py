"""Routing near ties in verification (specc/export/verify.py): the reference records each routed
layer's choice values (specc/nn/experts.py, observing_routing), verification turns them into each
token's gap between its k-th and (k+1)-th choice, and a layer verified from torch's own input (a
segment) may leave a near-tie token's row below the row bar, counted; any other row is judged as
ever. A spec with routed experts that decodes with int8 activations is built streamed and verified
a layer at a time where it can be."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specc.builder import plan
from specc.builder.pipeline import _resolve, build
from specc.errors import VerificationError
from specc.export import verify
from specc.nn.experts import MoE, observing_routing
from specc.spec.schema import ExpertsFFNSpec
from specc.spec.targets import DEQUANTIZED_BAR

from tests.export.test_moe_export import SPECS
from tests.helpers import speclib


def test_a_gap_is_the_kth_and_next_choice_apart_in_standard_deviations_of_the_row():
    values = np.array([[5.0, 1.0, 3.0, 2.0], [1.0, 1.0, 1.0, 1.0], [0.0, 4.0, 4.0, -4.0]], np.float32)
    got = verify._gaps(2, values)
    np.testing.assert_allclose(got[0], (3.0 - 2.0) / np.std(values[0]), rtol=1e-6)
    assert got[1] == 0.0  # a flat row: every choice a tie
    np.testing.assert_allclose(got[2], (4.0 - 0.0) / np.std(values[2]), rtol=1e-6)
    assert np.isinf(verify._gaps(4, values)).all()  # every expert chosen: no choice to flip


def test_routers_record_their_choice_values_in_call_order():
    """A sigmoid router chooses on its scores plus the selection bias: that is what is recorded
    (the top_k of it are the experts the module computes), one entry per call, on this thread only."""
    spec = ExpertsFFNSpec.model_validate({"kind": "moe", "experts": 8, "top_k": 2, "d_ff": 16,
                                         "router": {"kind": "sigmoid", "selection_bias": True}})
    moe = MoE(spec, 32).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(5, 32, generator=gen)
    with torch.no_grad(), observing_routing() as sink:
        moe(x)
        moe(x[:3])
    assert [(k, v.shape) for k, v in sink] == [(2, (5, 8)), (2, (3, 8))]
    with torch.no_grad():
        want = torch.sigmoid(moe.router.logits(x)) + moe.router.selection_bias
        _, index = moe.router(x)
    np.testing.assert_allclose(sink[0][1], want.numpy(), rtol=1e-6)
    top = np.argsort(-sink[0][1], axis=1)[:, :2]
    assert [set(t) for t in top.tolist()] == [set(i) for i in index.numpy().tolist()]
    with torch.no_grad():
        moe(x)  # outside: nothing recorded
    assert len(sink) == 2


def _rows(seed: int = 0, n: int = 6, width: int = 32):
    rng = np.random.default_rng(seed)
    want = rng.standard_normal((1, n, width)).astype(np.float32)
    got = want + 1e-4 * rng.standard_normal(want.shape).astype(np.float32)
    got[0, 2] = rng.standard_normal(width)  # another expert's output: cosine near 0
    return got, want


def test_a_near_tie_row_below_the_bar_is_counted_and_any_other_fails():
    got, want = _rows()
    bar = DEQUANTIZED_BAR
    with pytest.raises(VerificationError, match="worst row's cosine"):
        verify._compare_quality("decoder.layers.0", False, got, want, bar, "here")
    gaps = np.full(6, 1.0, np.float32)
    gaps[[2, 4]] = [0.01, 0.03]  # row 4 passes the row bar: counted as a near tie, left out of the mean
    figures = verify._compare_quality("decoder.layers.0", False, got, want, bar, "here", gaps)
    assert figures["rows_flipped"] == 1 and figures["rows_near_tie"] == 2
    assert figures["flipped_gap_max"] == pytest.approx(0.01)
    assert figures["cosine_min"] > 0.999  # the flipped row is out; row 4 is still held to the row bar
    gaps = np.full(6, 1.0, np.float32)
    gaps[2], gaps[3] = verify.NEAR_TIE, 0.0  # the far row's gap is not a near tie's: judged
    with pytest.raises(VerificationError, match="worst row's cosine"):
        verify._compare_quality("decoder.layers.0", False, got, want, bar, "here", gaps)


def test_a_layers_gaps_are_its_own_routers():
    spec = speclib.tiny(SPECS["sigmoid-selection-groups-dense-first"][0])  # layer 0 dense, 1 and 2 routed
    r = _resolve(spec, "int4", "onnx")
    assert r.routed_layers == (("decoder", 1), ("decoder", 2))
    gaps = np.array([[0.5, 0.01, 0.9], [0.02, 0.7, 0.8]], np.float32)  # [routed layers, tokens]
    assert verify.layer_gaps(r, "decoder.layers.0", gaps) is None  # dense: routes nothing
    np.testing.assert_array_equal(verify.layer_gaps(r, "decoder.layers.1", gaps), gaps[0])
    np.testing.assert_array_equal(verify.layer_gaps(r, "decoder.layers.2", gaps), gaps[1])


def test_which_builds_are_verified_a_layer_at_a_time():
    routed = speclib.tiny(SPECS["softmax-normalize"][0])  # 3 routed layers, one config
    for precision, activations, by_layers in (("int4", "int8", True), ("int4", None, False), ("int8", None, True),
                                              ("fp32", None, False)):
        r = _resolve(routed, precision, "onnx", activations)
        assert verify.by_layers(r) == by_layers
        made = plan.make(r)
        assert (made.streamed, made.segmented) == (by_layers, by_layers), (precision, activations)
    # a dense first layer: not the layer a period after it, so the graph cannot be streamed (the
    # build would refuse it at export): verified whole
    dense_first = _resolve(speclib.tiny(SPECS["sigmoid-selection-groups-dense-first"][0]), "int4", "onnx", "int8")
    assert verify.by_layers(dense_first) and not plan.make(dense_first).streamed


def test_a_routed_build_at_int8_activations_is_verified_a_layer_at_a_time(tmp_path):
    spec = speclib.tiny(SPECS["softmax-normalize"][0])
    result = build(spec, tmp_path / "out", precision="int4", activations="int8")
    report = result.manifest["verification"]
    assert report["passed"] is True and report["segments"] and not report["cases"]
    layers = [s for s in report["segments"] if any(k.startswith("decoder.layers.") for k in s["outputs"])]
    assert len(layers) == 3 * len({s["case"] for s in report["segments"]})
    for s in layers:  # each routed layer's output judged with its own routing's ties
        (figures,) = [o for k, o in s["outputs"].items() if k.startswith("decoder.layers.")]
        assert "rows_near_tie" in figures and figures["rows_flipped"] <= figures["rows_near_tie"]
