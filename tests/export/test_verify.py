"""specc.export.verify: the tolerance table, the verification cases, the comparison rule, and
that verification fails (and a build with it) when the artifact does not compute what torch does."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

import specc
import specc.builder.pipeline
from specc.errors import VerificationError
from specc.export import verify as verify_mod
from specc.spec.targets import DEQUANTIZED_BAR
from specc.export.verify import CUDA_TOLERANCES, QUALITY_BARS, TOLERANCES, _compare, cases, new_report, tolerance, verify
from specc.builder.pipeline import build
from specc.spec import resolve
from specc.spec.load import load_spec
from specc.spec.targets import BUILT_PRECISIONS, PRECISIONS, TARGETS

from tests.helpers import speclib

ort = pytest.importorskip("onnxruntime")

pytestmark = pytest.mark.xdist_group("test_verify")  # one worker: the module's shared builds are made once

# output 'NAME' [d0, d1, ...] differs from torch by X
DIFFERS = re.compile(r"output '(?P<name>[^']+)' \[(?P<shape>\d+(?:, \d+)*)\] differs from torch by (?P<diff>[-+0-9.e]+)")


# --- the tolerance table ---------------------------------------------------------------------


def test_tolerance_table_is_keyed_by_target_and_precision():
    assert TOLERANCES
    for key, value in TOLERANCES.items():
        assert isinstance(key, tuple) and len(key) == 2
        target, precision = key
        assert target in TARGETS and precision in PRECISIONS, key
        atol, rtol = value
        assert 0 < atol < 1 and 0 < rtol < 1, key
        assert tolerance(target, precision) == (atol, rtol)
    # every precision a target builds has a tolerance, or for the integer ones a quality bar (a
    # Triton repository holds the ONNX graphs, verified as the onnx target's); fp16 is looser than fp32
    for target, precisions in BUILT_PRECISIONS.items():
        for precision in precisions:
            if PRECISIONS[precision].quantized:
                assert target != "tensorrt" and precision in QUALITY_BARS
            else:
                assert ("onnx" if target == "triton" else target, precision) in TOLERANCES
    for bar in QUALITY_BARS.values():
        assert 0 < bar.cosine_min <= bar.cosine_mean < 1 and 0 < bar.kl_mean < 1
    assert QUALITY_BARS["int8"].cosine_mean > QUALITY_BARS["int4"].cosine_mean
    # seeded builds: compared with the graph's own dequantized weights, a bar tighter than either
    assert all(DEQUANTIZED_BAR.cosine_mean >= bar.cosine_mean and DEQUANTIZED_BAR.cosine_min >= bar.cosine_min
               for bar in QUALITY_BARS.values())
    assert all(a >= b for a, b in zip(TOLERANCES[("onnx", "fp16")], TOLERANCES[("onnx", "fp32")]))


def test_cuda_rows_cover_the_onnx_float_precisions():
    """`--verify-provider cuda` verifies the onnx target's float graphs (the integer ones by their
    bars): each has a CUDA row, no looser than fp16's; the provider is named when one is missing."""
    for precision in BUILT_PRECISIONS["onnx"]:
        if not PRECISIONS[precision].quantized:
            assert tolerance("onnx", precision, "cuda") == CUDA_TOLERANCES[("onnx", precision)]
    assert all(0 < t <= f for t, f in zip(CUDA_TOLERANCES[("onnx", "fp32")], CUDA_TOLERANCES[("onnx", "fp16")]))
    with pytest.raises(VerificationError, match="on CUDA"):
        tolerance("tensorrt", "fp32", "cuda")
    report = new_report(resolve(load_spec("tiny-gpt2")), "onnx", "fp16", provider="cuda")
    assert (report.atol, report.rtol) == CUDA_TOLERANCES[("onnx", "fp16")] and report.to_dict()["provider"] == "cuda"


@pytest.mark.parametrize("target,precision", [("tensorrt", "int8"), ("onnx", "int2"), ("triton", "fp32"), ("nope", "fp16")])
def test_unknown_tolerance_key_raises(target, precision):
    assert (target, precision) not in TOLERANCES
    with pytest.raises(VerificationError, match=re.escape(repr(target)) + ".*" + re.escape(repr(precision))):
        tolerance(target, precision)


# --- cases ----------------------------------------------------------------------------------


def _resolved(kind: str | None = None, catalog: str | None = None, serving_max: int | None = None):
    if catalog:
        return resolve(load_spec(catalog))
    overrides = dict(speclib.KINDS[kind])
    if serving_max is not None:
        overrides["serving"] = {"length": {"min": 1, "opt": serving_max, "max": serving_max}}
    return resolve(speclib.tiny(overrides))


SPECS = {
    "encoder": dict(kind="encoder-default"),
    "decoder": dict(kind="decoder-default"),
    "encoder-decoder": dict(kind="encdec-default"),
    "tiny-bert": dict(catalog="tiny-bert"),
    "tiny-gpt2": dict(catalog="tiny-gpt2"),
    "tiny-transformer": dict(catalog="tiny-transformer"),
    "decoder-max3": dict(kind="decoder-default", serving_max=3),
    "encoder-max3": dict(kind="encoder-default", serving_max=3),
    "encdec-max3": dict(kind="encdec-default", serving_max=3),
    "decoder-max9": dict(kind="decoder-default", serving_max=9),
}


def _total(cs, case) -> int:
    """Tokens seen by a case: its own plus those of the cases it continues."""
    by = {(c.graph, c.name): c for c in cs}
    n = case.sequence
    while case.after:
        case = by[(case.graph, case.after)]
        n += case.sequence
    return n


@pytest.mark.parametrize("which", list(SPECS))
def test_cases_cover_the_required_shapes(which):
    r = _resolved(**SPECS[which])
    cs = cases(r)
    longest = r.serving.length.max
    graphs = [g.name for g in r.graphs]
    assert len(cs) >= 3
    assert len({(c.graph, c.name) for c in cs}) == len(cs)  # unique names per graph
    assert {c.graph for c in cs} == set(graphs)
    seen = set()
    for c in cs:  # a case continues or reads only cases that ran before it
        if c.after:
            assert (c.graph, c.after) in seen
        if c.source:
            assert ("encoder", c.source) in seen
        seen.add((c.graph, c.name))
        assert c.batch >= 1 and c.sequence >= 1 and 0 <= c.pad < c.sequence
    for graph in graphs:
        mine = [c for c in cs if c.graph == graph]
        assert any(c.sequence == 1 and not c.after for c in mine), graph
        assert any(c.sequence == longest for c in mine), graph
        if r.architecture == "encoder-decoder" and graph == "decoder":
            # the decoder's padding is the source's: a batch>1 case reads a padded encoder case
            src = {c.name: c for c in cs if c.graph == "encoder"}
            assert any(c.batch > 1 and src[c.source].pad > 0 and src[c.source].batch == c.batch for c in mine)
            assert all(c.source and src[c.source].batch == c.batch for c in mine)
        else:
            assert any(c.batch > 1 and c.pad > 0 for c in mine), graph
    cached = r.architecture in ("decoder", "encoder-decoder")
    steps = [c for c in cs if c.after]
    if cached:
        graph = "model" if r.architecture == "decoder" else "decoder"
        assert steps, "no decode step for a graph with a KV cache"
        for step in steps:
            assert step.graph == graph and step.sequence == 1
            prefill = next(c for c in cs if c.graph == graph and c.name == step.after)
            assert prefill.sequence > 1 and prefill.batch == step.batch > 1  # a real prefill, batched
            assert prefill.pad > 0 or r.architecture == "encoder-decoder"
    else:
        assert not steps


@pytest.mark.parametrize("which", list(SPECS))
def test_cases_stay_within_serving_length(which):
    r = _resolved(**SPECS[which])
    cs = cases(r)
    assert max(_total(cs, c) for c in cs) == r.serving.length.max


@pytest.mark.parametrize("kind,serving_max", [("decoder-default", 2), ("decoder-default", 1), ("encoder-default", 1)])
def test_cases_stay_within_a_short_serving_length(kind, serving_max):
    r = _resolved(kind=kind, serving_max=serving_max)
    cs = cases(r)
    assert max(_total(cs, c) for c in cs) <= serving_max


@pytest.mark.parametrize("window, serving_max, cut", [(20, 64, True), (3, 64, False), (29, 32, True), (30, 32, False)])
def test_window_caches_get_cases_that_outgrow_the_window(window, serving_max, cut):
    """A window cache as long as the padded prefill or longer gets a padded prompt of W + 1 (the
    present cut to W) and two steps from it; a shorter one is cut by the padded prefill already;
    none runs past serving.length.max."""
    r = resolve(speclib.tiny({"decoder": {"attention": {"heads": 4, "pattern": {"kind": "local", "window": window}}},
                              "serving": {"length": {"min": 1, "opt": serving_max, "max": serving_max}}}))
    cs = cases(r)
    by = {c.name: c for c in cs}
    assert max(_total(cs, c) for c in cs) <= serving_max
    assert ("window-prefill" in by) is cut
    if cut or window < 8:  # a padded prompt past the window, and a step from its cut cache
        assert any(c.sequence > window and c.pad > 0 and any(d.after == c.name for d in cs) for c in cs)
    if cut:
        assert (by["window-prefill"].sequence, by["window-prefill"].batch) == (window + 1, 2)
        assert by["window-step"].after == "window-prefill" and by["window-step-2"].after == "window-step"


# --- _compare -------------------------------------------------------------------------------


def test_compare_passes_equal_arrays():
    a = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    fig = _compare("x", a, a.copy(), 0.0, 0.0, "here")
    assert fig == {"shape": [2, 3, 4], "max_abs": 0.0, "max_rel": 0.0}


def test_compare_passes_within_atol_plus_rtol_scale_and_fails_beyond():
    want = np.zeros((3, 5), dtype=np.float64)
    want[0, 0], want[2, 4] = 10.0, -4.0  # scale = max|want| = 10
    atol, rtol = 1e-3, 1e-2  # bound = 1e-3 + 1e-2 * 10 = 0.101
    inside = want.copy()
    inside[1, 2] += 0.1009
    fig = _compare("y", inside, want, atol, rtol, "here")
    assert fig["shape"] == [3, 5]
    assert fig["max_abs"] == pytest.approx(0.1009)
    assert fig["max_rel"] == pytest.approx(0.1009 / 10)
    # rtol matters: the same difference fails without it, and fails just beyond the bound
    with pytest.raises(VerificationError):
        _compare("y", inside, want, atol, 0.0, "here")
    beyond = want.copy()
    beyond[1, 2] -= 0.1012
    with pytest.raises(VerificationError) as err:
        _compare("y", beyond, want, atol, rtol, "somewhere")
    msg = str(err.value)
    assert msg.startswith("somewhere: ")
    m = DIFFERS.search(msg)
    assert m and m["name"] == "y" and m["shape"] == "3, 5" and float(m["diff"]) == pytest.approx(0.1012, rel=1e-2)


def test_compare_fails_on_shape_mismatch():
    with pytest.raises(VerificationError, match=r"'z'.*\[2, 3\].*\[2, 4\]"):
        _compare("z", np.zeros((2, 3)), np.zeros((2, 4)), 1.0, 1.0, "here")


def test_compare_non_finite_values_fail():
    want = np.ones((2, 2), dtype=np.float32)
    got = want.copy()
    got[1, 1] = np.nan
    with pytest.raises(VerificationError, match=r"'w' \[2, 2\] has NaN in onnxruntime"):
        _compare("w", got, want, 1.0, 1.0, "here")
    got[1, 1] = np.inf
    with pytest.raises(VerificationError, match="infinities"):
        _compare("w", got, want, 1.0, 1.0, "here")
    # a NaN in torch fails too: the reference itself is broken
    with pytest.raises(VerificationError, match="has NaN in torch"):
        _compare("w", want, np.where(np.eye(2) > 0, np.nan, want).astype(np.float32), 1.0, 1.0, "here")
    # NaN on both sides is never "equal"
    both = want.copy()
    both[0, 1] = np.nan
    with pytest.raises(VerificationError, match="NaN"):
        _compare("w", both, both.copy(), 0.0, 0.0, "here")


# --- verify() on real artifacts -------------------------------------------------------------


class Perturbed:
    """An onnxruntime session whose `output` is changed by `fn` on the `call`-th run (1-based)."""

    def __init__(self, session, output: str, call: int, fn):
        self.session, self.output, self.call, self.fn = session, output, call, fn
        self.calls = 0

    def run(self, names, feed):
        res = self.session.run(names, feed)
        self.calls += 1
        if self.calls == self.call:
            i = list(names).index(self.output)
            res[i] = self.fn(res[i].copy())
        return res

    def __getattr__(self, name):
        return getattr(self.session, name)


def _sessions(result) -> dict:
    return {g: ort.InferenceSession(str(result.out_dir / info["file"]), providers=["CPUExecutionProvider"])
            for g, info in result.manifest["graphs"].items()}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """kind -> (ResolvedSpec, BuildResult) for a tiny decoder and a tiny encoder, built once."""
    out = {}
    for kind in ("decoder-default", "encoder-default"):
        r = resolve(speclib.tiny(speclib.KINDS[kind]))
        out[kind] = (r, build(r, tmp_path_factory.mktemp(kind) / "out"))
    return out


def _add(delta, where=(0,)):
    def fn(a):
        a[where] += np.asarray(delta, dtype=a.dtype)
        return a
    return fn


@pytest.mark.parametrize("kind", ["decoder-default", "encoder-default"])
def test_verify_passes_the_unchanged_artifact(built, kind):
    r, result = built[kind]
    report = verify(r, specc.to_torch(r, seed=0), _sessions(result))
    assert [c["case"] for c in report.cases] == [c.name for c in cases(r)]
    assert report.to_dict()["passed"] is True
    assert report.max_abs < TOLERANCES[("onnx", "fp32")][0]


# (kind, output, which run, its name, its shape)
PERTURB = [
    ("decoder-default", "logits", 2, "decode-step", [2, 1, 61]),
    ("decoder-default", "present.1.value", 1, "padded-prefill", [2, 4, 8, 8]),
    ("encoder-default", "last_hidden_state", 1, "padded", [2, 9, 32]),
    ("encoder-default", "last_hidden_state", 3, "longest", [1, 64, 32]),
]


@pytest.mark.parametrize("kind,output,call,case,shape", PERTURB)
def test_verify_fails_when_one_output_of_one_case_differs(built, kind, output, call, case, shape):
    r, result = built[kind]
    sessions = _sessions(result)
    sessions["model"] = Perturbed(sessions["model"], output, call, _add(1e-2, (0, 0, 0)))
    with pytest.raises(VerificationError) as err:
        verify(r, specc.to_torch(r, seed=0), sessions)
    msg = str(err.value)
    m = DIFFERS.search(msg)
    assert m, msg
    assert m["name"] == output
    assert [int(d) for d in m["shape"].split(", ")] == shape
    assert float(m["diff"]) == pytest.approx(1e-2, rel=0.05)
    assert f"case {case}" in msg and "model graph" in msg
    if case == "decode-step":
        assert "past_sequence 8" in msg


@pytest.mark.parametrize("kind", ["decoder-default", "encoder-default"])
def test_spilled_references_give_the_same_report(built, kind, tmp_path, monkeypatch):
    """Large reference outputs wait on disk (chunked reads): the figures are those of the in-memory
    comparison, cases that a later case continues from stay in memory, and a difference is still
    found in a spilled output."""
    r, result = built[kind]
    model = specc.to_torch(r, seed=0)
    plain = verify(r, verify_mod.reference_outputs(r, model), _sessions(result))
    monkeypatch.setattr(verify_mod, "SPILL_BYTES", 64)
    monkeypatch.setattr(verify_mod, "_CHUNK", 100)  # several chunks per output
    refs = verify_mod.reference_outputs(r, model, spill=tmp_path)
    spilled = {key for key, outs in refs.items() if any(isinstance(v, verify_mod.Spilled) for v in outs.values())}
    continued = {(c.graph, c.after) for c in cases(r) if c.after}
    assert spilled and not spilled & continued
    assert all(isinstance(v, verify_mod.Spilled) for key in spilled for v in refs[key].values())  # a case spills whole
    assert len(list(tmp_path.iterdir())) == sum(isinstance(v, verify_mod.Spilled) for o in refs.values() for v in o.values())
    assert verify(r, refs, _sessions(result)).to_dict() == plain.to_dict()
    sessions = _sessions(result)
    name = r.graphs[0].outputs[0].name
    sessions["model"] = Perturbed(sessions["model"], name, len(cases(r)), _add(1e-2, (0, -1, -1)))
    with pytest.raises(VerificationError, match=rf"output '{re.escape(name)}' .* differs from torch by 0.01"):
        verify(r, refs, sessions)


def test_a_cut_short_spilled_reference_fails_clearly(tmp_path):
    want = np.arange(1000, dtype=np.float32).reshape(10, 100)
    spilled = verify_mod.Spilled(tmp_path / "x.bin", want)
    _compare("x", want.copy(), spilled, 0.0, 0.0, "here")
    with open(spilled.path, "r+b") as f:
        f.truncate(3000)
    with pytest.raises(VerificationError, match="cut short"):
        _compare("x", want.copy(), spilled, 0.0, 0.0, "here")


def test_verify_gives_freed_memory_back_before_each_run(built, monkeypatch):
    """The heap is trimmed before every onnxruntime run, so that a case's freed outputs are not
    counted beside the next case's (the build's peak memory, docs/reliability.md)."""
    r, result = built["decoder-default"]
    sessions = _sessions(result)
    events = []
    monkeypatch.setattr(verify_mod, "trim", lambda: events.append("trim"))
    sessions["model"] = Perturbed(sessions["model"], r.graphs[0].outputs[0].name, 0, None)
    run = sessions["model"].run
    sessions["model"].run = lambda names, feed: (events.append("run"), run(names, feed))[1]
    verify(r, specc.to_torch(r, seed=0), sessions)
    assert events == ["trim", "run"] * len(cases(r)) and len(cases(r)) > 1


@pytest.mark.parametrize("kind", ["decoder-default", "encoder-default"])
def test_verify_fails_on_a_nan_output(built, kind):
    r, result = built[kind]
    output = r.graphs[0].outputs[0].name
    sessions = _sessions(result)
    sessions["model"] = Perturbed(sessions["model"], output, 1, lambda a: np.where(np.arange(a.size).reshape(a.shape) == 5, np.nan, a).astype(a.dtype))
    with pytest.raises(VerificationError, match=rf"output '{re.escape(output)}' \[2, \d+, \d+\] has NaN in onnxruntime"):
        verify(r, specc.to_torch(r, seed=0), sessions)


@pytest.mark.parametrize("kind,param", [("decoder-default", "decoder.layers.1.ffn.down.weight"),
                                        ("encoder-default", "encoder.layers.0.ffn.up.weight")])
def test_verify_fails_when_the_reference_changed_after_export(built, kind, param):
    r, result = built[kind]
    model = specc.to_torch(r, seed=0)
    with torch.no_grad():
        dict(model.named_parameters())[param][0, 0] += 0.5
    with pytest.raises(VerificationError) as err:
        verify(r, model, _sessions(result))
    msg = str(err.value)
    m = DIFFERS.search(msg)
    assert m, msg
    assert m["name"] in [o.name for o in r.graphs[0].outputs]
    assert int(m["shape"].split(", ")[0]) == 2  # the first case (padded, batch 2) already differs
    assert float(m["diff"]) > 1e-4


def test_verify_tolerance_lookup_decides(built, monkeypatch):
    """A small perturbation passes the fp32 tolerance and fails a tighter one put in TOLERANCES."""
    r, result = built["decoder-default"]
    model = specc.to_torch(r, seed=0)

    def small():
        sessions = _sessions(result)
        sessions["model"] = Perturbed(sessions["model"], "logits", 1, lambda a: a + np.float32(1e-5))
        return sessions

    report = verify(r, model, small())
    assert 5e-6 < report.max_abs < 1e-4
    monkeypatch.setitem(verify_mod.TOLERANCES, ("onnx", "fp32"), (1e-6, 0.0))
    with pytest.raises(VerificationError, match=r"'logits' \[2, 8, 61\] differs from torch by .*tolerance 1e-06 \+ 0"):
        verify(r, model, small())


def test_verify_rejects_an_unknown_tolerance_key(built):
    r, result = built["encoder-default"]
    with pytest.raises(VerificationError, match="no verification tolerance"):
        verify(r, specc.to_torch(r, seed=0), _sessions(result), target="tensorrt", precision="int8")


# --- a failing verification fails the whole build ---------------------------------------------


def _perturbing_session(monkeypatch, delta: float):
    real = verify_mod.verification_session

    def session(path, graph, provider="cpu", prepack=False):
        return Perturbed(real(path, graph, provider, prepack), "logits", 1, lambda a: a + np.asarray(delta, a.dtype))

    monkeypatch.setattr(specc.builder.pipeline, "verification_session", session)


def _snapshot(d: Path) -> dict[str, bytes]:
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("how", ["perturbed-artifact", "tightened-tolerance"])
def test_failed_verification_fails_the_build_and_writes_nothing(tmp_path, monkeypatch, how):
    if how == "perturbed-artifact":
        _perturbing_session(monkeypatch, 1e-2)
    else:  # a perturbation within the fp32 tolerance, with the tolerance tightened below it
        _perturbing_session(monkeypatch, 1e-5)
        monkeypatch.setitem(verify_mod.TOLERANCES, ("onnx", "fp32"), (1e-6, 0.0))
    out = tmp_path / "out"
    with pytest.raises(VerificationError, match=r"output 'logits' \[2, 8, 61\] differs from torch"):
        build(speclib.tiny(), out)
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == []  # no staging directory, no lock file


def test_failed_rebuild_keeps_the_previous_build_intact(built, tmp_path, monkeypatch):
    r, good = built["decoder-default"]
    out = tmp_path / "out"
    shutil.copytree(good.out_dir, out)
    before = _snapshot(out)
    assert "manifest.json" in before and "model.onnx" in before
    _perturbing_session(monkeypatch, 1e-2)
    with pytest.raises(VerificationError):
        build(r, out, force=True)
    assert _snapshot(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["out"]
    monkeypatch.undo()
    again = build(r, out)  # still a complete build: the cache recognises it
    assert again.cached and again.manifest == good.manifest


def test_compare_fails_on_infinities_of_the_other_sign():
    want = np.zeros((2, 3), dtype=np.float32)
    want[0, 0] = -np.inf
    got = want.copy()
    _compare("x", got, want, 1e-4, 1e-4, "here")  # the same infinity on both sides passes
    got[0, 0] = np.inf
    with pytest.raises(VerificationError, match="infinities"):
        _compare("x", got, want, 1e-4, 1e-4, "here")
    with pytest.raises(VerificationError, match="infinities"):  # an infinity in torch alone
        _compare("x", np.zeros_like(want), want, 1e-4, 1e-4, "here")


def test_compare_measures_the_finite_values_beside_infinities(monkeypatch):
    """Chunks with an infinity (the same on both sides) and chunks without give the largest
    difference and scale of the finite values: a mask value's infinities do not hide a difference."""
    monkeypatch.setattr(verify_mod, "_CHUNK", 4)
    want = np.arange(12, dtype=np.float32).reshape(3, 4)
    want[0, 1] = -np.inf
    got = want.copy()
    got[0, 2] += 0.25  # in the chunk with the infinity
    got[2, 3] -= 0.5  # in a chunk without
    fig = _compare("x", got, want, 0.0, 0.1, "here")
    assert fig["max_abs"] == pytest.approx(0.5) and fig["max_rel"] == pytest.approx(0.5 / 11)
    got[2, 3] = want[2, 3]
    assert _compare("x", got, want, 0.0, 0.1, "here")["max_abs"] == pytest.approx(0.25)


@pytest.mark.parametrize("kind,serving_max", [("decoder-default", 2), ("decoder-default", 1),
                                              ("encoder-default", 1), ("encdec-default", 2)])
def test_short_serving_length_builds(tmp_path, kind, serving_max):
    """A spec that serves only 1 or 2 tokens builds: its cases stay inside the learned positions."""
    overrides = dict(speclib.KINDS[kind])
    overrides["position"] = {"kind": "learned", "max_length": serving_max}
    overrides["serving"] = {"length": {"min": 1, "opt": serving_max, "max": serving_max}}
    result = specc.builder.pipeline.build(speclib.tiny(overrides), tmp_path / "out")
    assert result.verification["passed"] is True
    assert max(c["shapes"]["sequence"] + c["shapes"].get("past_sequence", 0)
               for c in result.verification["cases"]) <= serving_max
