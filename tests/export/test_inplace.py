"""The in-place cache graph (specc/export/inplace.py): a decoder's model.onnx with each layer's
attention over its cache one GroupQueryAttention node, whose past and present share one buffer.
It is checked against the verified model.onnx by the build; here, against onnxruntime running
model.onnx step by step and against Hugging Face's own modules through the build's verification,
and a planted defect fails the build."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

import specc
from specc.errors import VerificationError
from specc.export import inplace
from specc.spec import io, resolve
from specc.spec.load import loads_spec

ort = pytest.importorskip("onnxruntime")
from specc.runtime import RunError, Session  # noqa: E402  (needs onnxruntime)


def _build(tmp_path, text: str, precision: str | None = None):
    spec = loads_spec(f"specc: 1\nname: d\n{text}\n")
    return specc.build(spec, tmp_path / "b", precision=precision)


@pytest.mark.parametrize("text,precision", [
    ("extends: tiny-llama", None),  # 4 query heads over 2 kv heads, rotary
    ("extends: tiny-llama", "int4"),
    ("extends: tiny-gpt2", None),  # learned positions, biases, one kv head per head
    ("extends: tiny-gpt2", "fp16"),
    ("extends: tiny-gpt2", "int8"),
    ("extends: tiny-llama\ndecoder: {attention: {scale: 0.5}}", None),  # a scale of its own
])
def test_generation_through_the_inplace_graph_gives_the_model_graphs_tokens(tmp_path, text, precision):
    result = _build(tmp_path, text, precision)
    entry = result.manifest["inplace"]
    assert entry["file"] == inplace.FILE and inplace.FILE in {a["path"] for a in result.manifest["artifacts"]}
    graph = onnx.load(str(result.out_dir / inplace.FILE), load_external_data=False).graph
    layers = sum(1 for o in graph.output if o.name.endswith(".value"))
    assert sum(n.op_type == inplace.OP for n in graph.node) == layers == 2
    # no cache is copied: nothing reads a past but its GroupQueryAttention
    for i in graph.input:
        if i.name.startswith("past_key_values."):
            assert [n.op_type for n in graph.node if i.name in n.input] == [inplace.OP]
    assert {i.name for i in graph.input} >= {inplace.SEQLENS_K, inplace.TOTAL_SEQUENCE_LENGTH}
    # the LM output holds a call's last few positions: the head reads a few positions of a prompt
    assert [o["dims"] for o in entry["outputs"] if o["name"] == "logits"] == [["batch", io.LM_POSITIONS_DIM, 1000]]
    assert entry["check"]["against"] == inplace.GRAPH

    fast, plain = Session(result.out_dir), Session(result.out_dir, inplace=False)  # plain: the model graph's loop
    assert fast.inplace is not None
    prompts = [[5, 9, 2, 7, 1, 3]]
    a = fast.generate(prompts, max_new_tokens=10)
    assert list(fast.graphs._opened) == []  # generation never opened the model graph
    assert a.new_ids == plain.generate(prompts, max_new_tokens=10).new_ids
    rows = [[5, 9, 2], [8, 8, 4]]  # rows of one length run in place too
    assert fast.generate(rows, max_new_tokens=6).new_ids == plain.generate(rows, max_new_tokens=6).new_ids


def test_the_inplace_runner_logits_match_the_model_graph_and_its_cache_is_written_in_place(tmp_path):
    result = _build(tmp_path, "extends: tiny-llama")
    s = Session(result.out_dir)
    seen = []
    from specc.runtime import generate as g

    runner = g.InplaceRunner(s, [[3, 1, 4, 1, 5]], new=4)
    buffers = {k: v for k, v in runner.caches.items()}
    seen.append(runner.prefill())
    for t in (9, 2, 6):
        seen.append(runner.step(np.array([t])))
    assert all(runner.caches[k] is v for k, v in buffers.items())  # never reallocated
    assert np.abs(runner.caches["past_key_values.0.key"][:, :, :8]).sum() > 0
    assert not runner.caches["past_key_values.0.key"][:, :, 8:].any()  # the free position untouched
    full = s.run(input_ids=[[3, 1, 4, 1, 5, 9, 2, 6]])["logits"][0]
    for step, logits in enumerate(seen):
        np.testing.assert_allclose(logits[0], full[4 + step], atol=1e-5, rtol=1e-5)
    assert list(s.graphs._opened) == ["model"]  # run() opened it when asked
    assert Session(result.out_dir).graphs._opened == {}  # nothing is opened before it is used


@pytest.mark.parametrize("text,turned", [
    ("extends: tiny-llama", 2),  # the graph's rotary nodes become GroupQueryAttention's do_rotary
    ("extends: tiny-llama\nposition: {scaling: {kind: llama3, factor: 8.0, low_freq_factor: 1.0, "
     "high_freq_factor: 4.0, original_max_length: 16}}", 2),  # the tables hold the graph's scaled angles
    ("extends: tiny-llama\ndecoder: {overrides: [{every: 2, first: 1, rotary_base: 500.0}]}", 2),  # a table each
    ("extends: tiny-llama\nposition: {fraction: 0.5}", 0),  # half of each head turns: the graph's own nodes
    ("extends: tiny-llama\nposition: {layout: interleaved}", 0),
    ("extends: tiny-llama\ndecoder: {attention: {heads: 8, kv_heads: 2}}", 0),  # heads of 8: onnxruntime turns 16s
    ("extends: tiny-llama\nposition: {scaling: {kind: longrope, original_max_length: 16, "  # angles that depend
     "short_factor: [1, 1, 1, 2, 2, 2, 3, 3], long_factor: [2, 2, 4, 4, 8, 8, 16, 16]}}", 0),  # on the length
])
def test_rotary_positions_turned_by_groupqueryattention_match_the_model_graph_far_along(tmp_path, text, turned):
    result = _build(tmp_path, text)
    graph = onnx.load(str(result.out_dir / inplace.FILE), load_external_data=False).graph
    nodes = [n for n in graph.node if n.op_type == inplace.OP]
    assert sum(any(a.name == "do_rotary" and a.i == 1 for a in n.attribute) for n in nodes) == turned
    assert any(n.op_type == "Neg" for n in graph.node) == (turned == 0)  # no rotate_half left where turned
    tables = {t.name for t in graph.initializer if t.name.startswith(inplace.ROTARY)}
    assert len(tables) == (4 if "rotary_base" in text else 2 if turned else 0)
    s = Session(result.out_dir)
    from specc.runtime import generate as g

    ids = list(np.random.default_rng(1).integers(0, 1000, 60))
    runner = g.InplaceRunner(s, [ids[:20]], new=40)
    seen = [runner.prefill()[0]] + [runner.step(np.array([t]))[0] for t in ids[20:59]]
    full = s.run(input_ids=[ids[:59]])["logits"][0]
    np.testing.assert_allclose(np.stack(seen), full[19:59], atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("text,norm", [
    ("extends: tiny-llama\ndecoder: {attention: {qk_norm: head}}", "SimplifiedLayerNormalization"),
    ("extends: tiny-gpt2\ndecoder: {attention: {qk_norm: head}}", "LayerNormalization"),
])
def test_qk_norms_are_computed_heads_last_where_onnxruntime_fuses_them(tmp_path, text, norm):
    """A per-head QK-norm is applied before the heads are transposed, so no Transpose reaches the
    attention's inputs and onnxruntime fuses every norm of the graph (over axis 3 of the
    transposed heads it fused none of them); the tokens stay the model graph's."""
    result = _build(tmp_path, text)
    path = result.out_dir / inplace.FILE
    graph = onnx.load(str(path), load_external_data=False).graph
    producer = {o: n for n in graph.node for o in n.output}
    for n in graph.node:
        if n.op_type == inplace.OP:
            for x in n.input[:3]:
                assert producer[producer[x].input[0]].op_type != "Transpose"
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ops = [n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx"), load_external_data=False).graph.node]
    assert ops.count(norm) == 2 * 2 + 1 + 2 * 2  # two per layer, the final one, and q's and k's in each layer
    assert "ReduceMean" not in ops and "Transpose" not in ops
    prompts = [[5, 9, 2, 7, 1, 3]]
    assert Session(result.out_dir).generate(prompts, max_new_tokens=10).new_ids == \
        Session(result.out_dir, inplace=False).generate(prompts, max_new_tokens=10).new_ids


def test_the_rotary_tables_are_computed_at_the_graphs_own_ir_version(tmp_path, monkeypatch):
    """The model run to compute GroupQueryAttention's rotary tables carries model.onnx's IR version,
    not the newest the installed onnx knows (onnxruntime older than that onnx refuses such a model)."""
    from specc.deps import require_onnxruntime

    ort = require_onnxruntime()
    seen, real = [], ort.InferenceSession

    def session(model, *args, **kwargs):
        if isinstance(model, bytes):
            seen.append(onnx.load_from_string(model).ir_version)
        return real(model, *args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", session)
    result = _build(tmp_path, "extends: tiny-llama")
    graph = onnx.load(str(result.out_dir / "model.onnx"), load_external_data=False)
    assert seen and set(seen) == {graph.ir_version} and graph.ir_version < onnx.IR_VERSION


def test_a_padded_batch_and_beams_use_the_model_graph(tmp_path):
    result = _build(tmp_path, "extends: tiny-llama")
    fast, plain = Session(result.out_dir), Session(result.out_dir, inplace=False)
    rows = [[5, 9, 2, 7], [3, 4]]
    assert fast.generate(rows, max_new_tokens=5).new_ids == plain.generate(rows, max_new_tokens=5).new_ids
    assert list(fast.graphs._opened) == ["model"]
    assert fast.generate([[5, 9]], max_new_tokens=4, beams=2).new_ids == plain.generate([[5, 9]], max_new_tokens=4, beams=2).new_ids


UNFIT = [
    ("extends: tiny-llama\ndecoder: {attention: {pattern: {kind: local, window: 8}}}", "local attention pattern"),
    ("extends: tiny-llama\nposition: {kind: alibi}", "alibi positions"),
    ("extends: tiny-llama\ndecoder: {attention: {softcap: 30.0}}", "soft cap"),
    ("extends: tiny-llama\ndecoder: {attention: {score: bilinear}}", "bilinear scores"),
]


@pytest.mark.parametrize("text,reason", UNFIT)
def test_attention_groupqueryattention_does_not_compute_is_unfit(text, reason):
    assert reason in inplace.unfit(resolve(loads_spec(f"specc: 1\nname: d\n{text}\n")))
    assert inplace.unfit(resolve(loads_spec("specc: 1\nname: d\nextends: tiny-llama\n"))) is None


@pytest.mark.parametrize("text,reason", [UNFIT[0], *(pytest.param(*u, marks=pytest.mark.slow) for u in UNFIT[1:])])
def test_attention_groupqueryattention_does_not_compute_gets_no_inplace_graph(tmp_path, text, reason):
    """The build of an unfit spec (one in make test, each in make test-slow) says why in its manifest,
    writes no in-place graph, and its Session generates through model.onnx."""
    result = _build(tmp_path, text)
    assert reason in result.manifest["inplace"]["reason"]
    assert not (result.out_dir / inplace.FILE).exists()
    s = Session(result.out_dir)
    assert s.inplace is None and s.generate([[1, 2, 3]], max_new_tokens=3).new_ids


def test_encoders_and_encoder_decoders_have_none(tmp_path):
    result = specc.build("tiny-bert", tmp_path / "b")
    assert "inplace" not in result.manifest
    assert json.loads((result.out_dir / "manifest.json").read_text()).get("inplace") is None


def _rotary_one_position_late(real):
    def tables(*a):
        out = real(*a)
        for t in out:  # each position given the angles of the one before
            v = onnx.numpy_helper.to_array(t)
            t.CopyFrom(onnx.numpy_helper.from_array(np.roll(v, 1, axis=0), t.name))
        return out
    return tables


@pytest.mark.parametrize("defect", ["scores scaled twice", "rotary tables one position late"])
def test_a_wrong_inplace_graph_fails_the_build_and_leaves_nothing(tmp_path, monkeypatch, defect):
    """Planted defects in the rewritten graph."""
    if defect == "scores scaled twice":
        real = inplace._score_scale
        monkeypatch.setattr(inplace, "_score_scale", lambda *a: 2.0 * real(*a))
    else:
        monkeypatch.setattr(inplace, "_rotary_tables", _rotary_one_position_late(inplace._rotary_tables))
    with pytest.raises(VerificationError, match="inplace.onnx"):
        _build(tmp_path, "extends: tiny-llama")
    assert not (tmp_path / "b").exists()


def test_a_changed_inplace_graph_is_refused(tmp_path):
    result = _build(tmp_path, "extends: tiny-llama")
    with open(result.out_dir / inplace.FILE, "ab") as f:
        f.write(b"\0")
    with pytest.raises(RunError, match="inplace.onnx: changed since"):
        Session(result.out_dir)
