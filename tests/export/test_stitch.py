"""Deep stacks traced with two layers and the rest copied in the ONNX graph (specc/export/stitch.py):
the stitched graph has the whole trace's inputs, outputs, weights and operators, and onnxruntime
gives the same outputs for both at sizes other than the traced ones; where stitching cannot be
proven right the model is traced whole, and the build says which it did."""
from __future__ import annotations

import collections

import numpy as np
import onnx_ir as ir
import pytest

from specc.export import onnx as onnx_export
from specc.export import stitch
from specc.nn import to_torch
from specc.spec.io import concrete_dims
from specc.spec.resolve import resolve

from tests.helpers import speclib

ort = pytest.importorskip("onnxruntime")

# kinds whose layers differ in what the exporter makes of them: a KV cache, GQA (sizes computed
# outside any module, once per layer), rotary, relative positions, a local pattern, an encoder
# with post-norm and no final norm, both graphs of an encoder-decoder, and every head
# (an encoder-only model's stitching is encdec-default's encoder graph and outputs-encoder's; share-kv
# runs in make test-slow with the other kinds)
FAST = ["decoder-default", "encdec-default", "gqa", "rotary", "relative", "local", "linformer-encoder", "outputs-encoder"]
SIZES = {"batch": 3, "sequence": 4, "past_sequence": 6, "total_sequence": 10, "encoder_sequence": 5}


def _deep(kind: str, layers: int = 3):
    data = speclib.merge(speclib.BASE, speclib.KINDS[kind])
    for role in ("encoder", "decoder"):
        if role in data and (role != "decoder" or data["architecture"] != "encoder"):
            data[role] = {**data[role], "layers": layers}
    return resolve(speclib.tiny({k: v for k, v in data.items() if k in ("encoder", "decoder")}
                                | {k: v for k, v in speclib.KINDS[kind].items() if k not in ("encoder", "decoder")}))


def _feed(r, sig) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    vocab = r.target_vocab_size if sig.name == "decoder" else r.vocab.size
    feed = {}
    for t in sig.inputs:
        shape = concrete_dims(t.dims, SIZES)  # a window cache's length follows from past_sequence
        if t.name in ("input_ids",):
            feed[t.name] = rng.integers(0, vocab, size=shape)
        elif t.name == "token_type_ids":
            feed[t.name] = rng.integers(0, max(1, r.vocab.type_size), size=shape)
        elif t.name == "position_ids":
            feed[t.name] = np.tile(np.arange(shape[1]) + SIZES["past_sequence"], (shape[0], 1))
        elif t.dtype.startswith("int"):
            feed[t.name] = np.ones(shape, np.int64)
            feed[t.name][-1, 0] = 0  # one padded position
        else:
            feed[t.name] = (rng.standard_normal(shape) * 0.1).astype(np.float32)
    return feed


def _run(program, feed) -> list[np.ndarray]:
    proto = ir.serde.serialize_model(program.model)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feed)


def _ops(program) -> collections.Counter:
    return collections.Counter(n.op_type for n in program.model.graph if n.op_type != "Constant")


def _nodes(program) -> list[bytes]:
    """Each node as computed: its op, attributes and the values it reads and writes, not its own
    name (a copy is named after layer 1's node) or the exporter's metadata."""
    def written(node):
        proto = ir.serde.serialize_node(node)
        del proto.metadata_props[:]
        proto.name = ""
        return proto.SerializeToString()

    return [written(n) for n in program.model.graph]


def _weights(program) -> dict[str, bytes]:
    return {k: v.const_value.tobytes() for k, v in program.model.graph.initializers.items()}


@pytest.mark.parametrize("kind", [k if k in FAST else pytest.param(k, marks=pytest.mark.slow) for k in speclib.KINDS])
def test_a_stitched_graph_is_the_whole_trace(kind):
    _stitched_is_whole(_deep(kind), kind)


@pytest.mark.parametrize("layers", [7, pytest.param(6, marks=pytest.mark.slow)])
def test_a_stack_with_a_period_is_stitched_block_by_block(layers):
    """Every second layer global (Gemma 2's pattern, `overrides`): layers 0-3 traced, the rest
    copied two at a time, the last block partial where the depth is odd."""
    r = _deep("overrides", layers)
    assert stitch.stitch_plan(r, r.graphs[0]) == {"decoder": stitch.Plan(layers, 2)}
    facts = _stitched_is_whole(r, "overrides")
    assert facts["layers_traced"] == 4 and facts["periods"] == {"decoder": 2}


def _stitched_is_whole(r, kind):
    """The stitched graphs of r against its whole traces; returns the last stitched one's facts."""
    model = to_torch(r, seed=0).eval()
    for sig in r.graphs:
        example = onnx_export.example_inputs(r, sig)
        stitched, facts = onnx_export.export_stitched(model, r, sig, example)
        whole = onnx_export.export_graph(model, sig, example)
        plan = stitch.stitch_plan(r, sig)
        if not plan:
            assert facts is None
        else:
            assert facts["pass"] == "specc.stitch" and facts["layers"] == {role: p.layers for role, p in plan.items()}
            assert facts["layers_traced"] == max(p.kept for p in plan.values()), facts  # every kind with a plan stitches
            assert facts["nodes_after"] > facts["nodes_before"]
        if plan:
            # the layers were optimized before they were copied: the graph the whole optimizer
            # makes of the stitched trace, node for node
            plain, _ = onnx_export.export_stitched(model, r, sig, example, prefolded=False)
            onnx_export.optimize(plain)
            onnx_export.optimize(stitched, prefolded=True)
            assert _nodes(stitched) == _nodes(plain)
            assert _weights(stitched) == _weights(plain)
        else:
            onnx_export.optimize(stitched)
        onnx_export.optimize(whole)
        g1, g2 = stitched.model.graph, whole.model.graph
        assert [v.name for v in g1.inputs] == [v.name for v in g2.inputs] == [t.name for t in sig.inputs]
        assert [v.name for v in g1.outputs] == [v.name for v in g2.outputs] == [t.name for t in sig.outputs]
        assert {k: tuple(v.shape) for k, v in g1.initializers.items() if k.startswith("model.")} == \
            {k: tuple(v.shape) for k, v in g2.initializers.items() if k.startswith("model.")}
        assert _ops(stitched) == _ops(whole)
        feed = _feed(r, sig)
        for name, a, b in zip([t.name for t in sig.outputs], _run(stitched, feed), _run(whole, feed)):
            np.testing.assert_allclose(a, b, atol=1e-6, rtol=1e-6, err_msg=f"{kind} {sig.name} {name}")
    return facts


def test_the_plan_takes_deep_stacks_whose_layers_are_alike():
    r = _deep("encdec-default", layers=4)
    enc, dec = r.graphs
    # an encoder-decoder's encoder graph also makes the decoder's cross K/V outside its layers
    assert stitch.stitch_plan(r, enc) == {"encoder": stitch.Plan(4, 1)}
    assert stitch.stitch_plan(r, dec) == {"decoder": stitch.Plan(4, 1)}
    shallow = _deep("decoder-default", layers=2)
    assert stitch.stitch_plan(shallow, shallow.graphs[0]) == {}
    # layers configured apart (here: BigBird's random key blocks drawn per layer) are traced whole
    bigbird = _deep("bigbird", layers=3)
    blocks = [layer.attention.random_blocks for layer in bigbird.decoder.layers]
    assert stitch.stitch_plan(bigbird, bigbird.graphs[0]) == ({} if blocks[1] != blocks[2] else {"decoder": stitch.Plan(3, 1)})


@pytest.mark.parametrize("overrides, layers, period", [
    ([{"every": 2, "first": 1}], 5, 2),  # Gemma 2: local and global in turn
    ([{"every": 2, "first": 1}], 4, None),  # no more than two blocks: nothing to copy
    ([{"every": 6, "first": 5}], 26, 6),  # Gemma 3 1B: five local to one global, a partial last block
    ([{"every": 3, "first": 0}], 8, 3),  # the first layer of each block global
    ([{"indices": [0]}], 5, 1),  # layer 0 apart: left to the graph's check, as it always was
    ([{"indices": [0, 2]}], 7, None),
    ([{"indices": [3]}], 9, None),  # one layer apart in the middle repeats nothing
    ([{"indices": [1, 2]}], 8, None),
])
def test_the_period_is_the_shortest_repeat_of_the_layers_configurations(overrides, layers, period):
    data = speclib.merge(speclib.BASE, speclib.KINDS["overrides"])
    data["decoder"] = {**data["decoder"], "layers": layers,
                       "overrides": [{**o, "pattern": {"kind": "full"}, "rotary_base": 100.0} for o in overrides]}
    r = resolve(speclib.tiny({"decoder": data["decoder"]} | {k: v for k, v in speclib.KINDS["overrides"].items() if k != "decoder"}))
    assert stitch.period(r.decoder) == period
    assert stitch.stitch_plan(r, r.graphs[0]) == ({} if period is None else {"decoder": stitch.Plan(layers, period)})
    plan = stitch.Plan(layers, period or 1)
    # a copied layer's twin is traced and configured as it is
    for i in range(layers if period else 0):
        assert plan.twin(i) < plan.kept
        assert r.decoder.layers[plan.twin(i)].model_copy(update={"index": i}) == r.decoder.layers[i]


def test_truncation_keeps_the_parameters_and_the_signature_of_two_layers():
    r = _deep("decoder-default", layers=4)
    model = to_torch(r, seed=0)
    short = stitch.truncated(model, {"decoder": stitch.Plan(4, 1)})
    assert len(short.decoder.layers) == 2 and len(model.decoder.layers) == 4
    assert short.decoder.layers[1].attention.q.weight is model.decoder.layers[1].attention.q.weight
    sig = stitch.truncated_sig(r.graphs[0], {"decoder": stitch.Plan(4, 1)})
    names = [t.name for t in sig.inputs + sig.outputs]
    assert "past_key_values.1.value" in names and "present.1.key" in names
    assert not any(".2." in n or ".3." in n for n in names)


def test_a_graph_that_cannot_be_stitched_is_traced_whole(monkeypatch):
    r = _deep("decoder-default")
    model = to_torch(r, seed=0).eval()
    sig = r.graphs[0]

    def refuse(*_args, **_kwargs):
        raise stitch.NotStitchable("decoder layers 0 and 1 differ")

    monkeypatch.setattr(stitch, "stitch", refuse)
    program, facts = onnx_export.export_stitched(model, r, sig, onnx_export.example_inputs(r, sig))
    assert facts["layers_traced"] is None and facts["skipped"] == "decoder layers 0 and 1 differ"
    assert [v.name for v in program.model.graph.outputs] == [t.name for t in sig.outputs]  # all 3 layers' caches


def _traced_two_of_three():
    """A 3-layer decoder and the graph of its first two layers, traced and not yet stitched."""
    r = _deep("decoder-default")
    model = to_torch(r, seed=0).eval()
    sig = r.graphs[0]
    short_sig = stitch.truncated_sig(sig, {"decoder": stitch.Plan(3, 1)})
    example = onnx_export.example_inputs(r, sig)
    program = onnx_export.export_graph(stitch.truncated(model, {"decoder": stitch.Plan(3, 1)}), short_sig,
                                       {t.name: example[t.name] for t in short_sig.inputs})
    return model, program.model.graph


def test_layer_nodes_are_found_by_module_path_and_a_mismatch_is_refused():
    model, graph = _traced_two_of_three()
    first = stitch._Block(graph, "decoder", range(0, 1), "model.").nodes
    second = stitch._Block(graph, "decoder", range(1, 2), "model.").nodes
    assert first and [n.op_type for n in first] == [n.op_type for n in second]
    # a layer 1 that reads another weight than layer 0 does is not layer 0's pattern
    reader = next(n for n in second if any(v is not None and v.name == "model.decoder.layers.1.attention.q.weight"
                                           for v in n.inputs))
    index = [v.name if v is not None else None for v in reader.inputs].index("model.decoder.layers.1.attention.q.weight")
    reader.replace_input_with(index, graph.initializers["model.decoder.layers.0.attention.k.weight"])
    with pytest.raises(stitch.NotStitchable, match="attention.k.weight"):
        stitch.stitch(graph, model, {"decoder": stitch.Plan(3, 1)})


def test_an_fp16_build_of_a_deep_stack_is_stitched_and_verified(tmp_path):
    from specc.builder.pipeline import build

    r = _deep("rotary", layers=3)
    result = build(r, tmp_path / "out", precision="fp16")
    entry = next(o for o in result.manifest["optimizations"] if o.get("pass") == "specc.stitch")
    assert entry["layers_traced"] == stitch.KEEP and entry["layers"] == {"decoder": 3}
    assert result.manifest["verification"]["precision"] == "fp16"
    assert len(result.manifest["verification"]["cases"]) >= 3


def test_the_traced_layers_weights_are_hidden_while_they_are_prefolded():
    # nothing prefold decides may depend on layer 1's values: the copies have their own
    model, graph = _traced_two_of_three()
    before = [(k, v, v.const_value) for k, v in graph.initializers.items()]
    inputs = list(graph.inputs)
    layer = [k for k, _, _ in before if k.startswith("model.decoder.layers.")]
    assert layer and len(layer) < len(before)
    with stitch.layer_weights_hidden(graph, {"decoder": stitch.Plan(3, 1)}):
        assert not any(k in graph.initializers for k in layer)
        assert all(v.const_value is None and v in graph.inputs for k, v, _ in before if k in layer)
        assert all(graph.initializers[k].const_value is c for k, _, c in before if k not in layer)
    assert [(k, v, v.const_value) for k, v in graph.initializers.items()] == before
    assert list(graph.inputs) == inputs
