"""Streamed builds (specc/nn/streamed.py, pipeline.build(stream=True)): one layer of a deep stack
made at a time, the same artifacts as a build that holds the whole model, verification that still
fails a wrong build and names the layer, and the memory estimate that chooses between them."""
from __future__ import annotations

import hashlib
import json
import math
import threading
import weakref

import onnx
import pytest
import torch

import specc
from specc.errors import BuildError, VerificationError
from specc.export import stitch
from specc.builder.memory import estimate_memory, estimate_streamed
from specc.nn import as_resolved, blocks
from specc.nn import streamed as st
from specc.export.stitch import streamable
from specc.builder.pipeline import _resolve
from specc.spec.load import load_spec
from specc.spec.schema import FullPattern, LayerOverride, LocalPattern

pytest.importorskip("onnxruntime")

LAYERS = 5


def _deep(name: str = "tiny-llama", layers: int = LAYERS, **stack_update):
    spec = load_spec(name)
    stack = "decoder" if spec.decoder is not None else "encoder"
    return spec.model_copy(update={stack: getattr(spec, stack).model_copy(update={"layers": layers, **stack_update})})


def _patterned(layers: int = 8, **where):
    """tiny-llama with a global layer among local ones at `where` (LayerOverride's every/first or
    indices), as Gemma 2 and 3 place theirs; by default every third layer from layer 2, Gemma 3's
    pattern at a period of 3 (8 layers: two blocks traced, one copied, and a partial block of 2)."""
    return _deep(layers=layers, attention=load_spec("tiny-llama").decoder.attention.model_copy(
        update={"pattern": LocalPattern(window=3)}),
        overrides=[LayerOverride(**(where or {"every": 3, "first": 2}), pattern=FullPattern(), rotary_base=500.0)])


def _hashes(out) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(out.iterdir())
            if p.is_file() and p.name != "manifest.json"}


SLOW = pytest.mark.slow  # make test keeps one of fp32 and int4 per test (the two writers' extremes); make test-slow adds the rest


@pytest.mark.parametrize("precision", [pytest.param("fp32", marks=SLOW), pytest.param("fp16", marks=SLOW),
                                       pytest.param("int8", marks=SLOW), "int4"])
def test_streamed_and_in_memory_builds_write_the_same_bytes(tmp_path, precision):
    spec = _deep()
    if precision == "int4":  # with a tied head, packed from the table the lookup keeps (the pattern test streams an untied one)
        spec = spec.model_copy(update={"vocab": spec.vocab.model_copy(update={"tie_output": True})})
    # model.safetensors kept: its streamed writer (a tensor at a time) is compared too
    whole = specc.build(spec, tmp_path / "whole", precision=precision, stream=False, keep_weights=True)
    streamed = specc.build(spec, tmp_path / "streamed", precision=precision, stream=True, keep_weights=True)
    assert _hashes(tmp_path / "whole") == _hashes(tmp_path / "streamed")
    assert "model.safetensors" in _hashes(tmp_path / "streamed")
    if precision == "int4":
        nodes = onnx.load(str(tmp_path / "streamed" / "model.onnx"), load_external_data=False).graph.node
        assert [n.input[1] for n in nodes if n.op_type == "MatMulNBits" and ".T_q" in n.input[1]] == [
            "model.embeddings.tokens.weight.T_q8.codes"]
    assert streamed.verification["streamed"]["longest"] == 128
    assert "streamed" not in whole.verification
    # and the same verification figures, case for case (a streamed build caps only cases past 128 tokens)
    figures = lambda result: [(c["case"], json.dumps(c["outputs"], sort_keys=True)) for c in result.verification["cases"]]  # noqa: E731
    assert figures(whole) == figures(streamed)


@pytest.mark.slow  # a long build; make test-slow
def test_a_stack_with_a_pattern_is_streamed_block_by_block(tmp_path):
    """Local layers with a global one every third (Gemma 3's pattern at a shorter period): six
    layers traced, the rest copied by blocks of three, the last block partial; streamed and in
    memory, the same bytes and the same verification figures."""
    spec = _patterned()
    assert streamable(as_resolved(spec)) == {"decoder": stitch.Plan(8, 3)}
    whole = specc.build(spec, tmp_path / "whole", precision="int4", stream=False, keep_weights=True)
    streamed = specc.build(spec, tmp_path / "streamed", precision="int4", stream=True, keep_weights=True)
    assert _hashes(tmp_path / "whole") == _hashes(tmp_path / "streamed")
    entry = next(o for o in streamed.manifest["optimizations"] if o.get("pass") == "specc.stitch")
    assert entry["periods"] == {"decoder": 3} and entry["layers_traced"] == 6
    figures = lambda result: [(c["case"], json.dumps(c["outputs"], sort_keys=True)) for c in result.verification["cases"]]  # noqa: E731
    assert figures(whole) == figures(streamed)


def test_external_data_is_written_once_per_weight_and_page_aligned(tmp_path, monkeypatch):
    """Past the protobuf limit (here: always), weights go to model.onnx.data, each at a page-aligned
    offset, small ones inline; streamed and not, the same bytes, and onnxruntime runs it (the
    build verifies it)."""
    import onnx

    from specc.export import onnx as onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 0)
    spec = _deep()
    specc.build(spec, tmp_path / "whole", precision="int4", stream=False)
    specc.build(spec, tmp_path / "streamed", precision="int4", stream=True)
    assert _hashes(tmp_path / "whole") == _hashes(tmp_path / "streamed")
    proto = onnx.load(str(tmp_path / "streamed" / "model.onnx"), load_external_data=False)
    external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    assert external and all(int(dict((e.key, e.value) for e in t.external_data)["offset"]) % onnx_export.DATA_ALIGN == 0
                            for t in external)
    assert all(len(t.raw_data) < onnx_export.INLINE_BYTES for t in proto.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL)


def test_a_streamed_build_from_a_weights_file_matches_the_in_memory_one(tmp_path):
    spec = _deep()
    first = specc.build(spec, tmp_path / "seeded", seed=3, stream=False, keep_weights=True)
    weights = first.out_dir / "model.safetensors"
    specc.build(spec, tmp_path / "whole", weights=weights, stream=False, precision="int4")
    specc.build(spec, tmp_path / "streamed", weights=weights, stream=True, precision="int4")
    assert _hashes(tmp_path / "whole") == _hashes(tmp_path / "streamed")


def test_a_streamed_build_holds_one_made_layer_at_a_time(tmp_path, monkeypatch):
    """Every layer past the traced two is made by StreamedWeights, and no more than one holds its
    weights at once (a forward loop still holds the module it ran while the next is made, whose
    tensors are let go of by then; the reference run in this process: SPECC_REFERENCE_PROCESS=inline)."""
    monkeypatch.setenv("SPECC_REFERENCE_PROCESS", "inline")
    alive, most, made = weakref.WeakSet(), [0], []
    real = st.StreamedWeights.layer

    def layer(self, role, index):
        module = real(self, role, index)
        if index >= stitch.KEEP and module not in alive:
            alive.add(module)
            made.append(index)
        holding = [m for m in alive if any(p.numel() for p in m.parameters())]
        most[0] = max(most[0], len(holding))
        return module

    monkeypatch.setattr(st.StreamedWeights, "layer", layer)
    specc.build(_deep(layers=6), tmp_path / "out", precision="int4", stream=True)
    assert sorted(set(made)) == [2, 3, 4, 5]
    assert most[0] == 1
    # made when written and once for the reference run's four cases together (in_lockstep), not
    # once a case: at most twice each
    assert max(made.count(i) for i in set(made)) <= 2, made


def test_the_reference_run_makes_each_layer_once_per_case(monkeypatch):
    """A streamed model's forward reaches each cut layer once: nothing else walks its layers (a
    walk to read each layer's cache window once made all 32 of a 7B model again per case)."""
    from specc.export import verify

    r = as_resolved(_deep(layers=6))
    short, source = st.short_and_source(r, streamable(r), 0)
    made = []
    source.on_layer = lambda role, index, of: made.append(index)
    verify.reference_outputs(r, st.streamed_model(short, source).eval(), 0)
    cases = len(verify.cases(r))
    assert cases >= 3 and sorted(made) == sorted(list(range(stitch.KEEP, 6)) * cases)


@pytest.mark.parametrize("spec,layers", [("plain", ("decoder",)), ("plain", ()), ("windows", ("decoder",))])
def test_a_streamed_reference_run_makes_each_layer_once_for_all_cases(monkeypatch, spec, layers):
    """A streamed build's reference run (with each layer's output kept for the segments, or not)
    runs every case's forward in lockstep: each cut layer is made once, not once a case, and
    every output, the caches a later case reads included, is what the cases run one after
    another give."""
    from specc.export import verify

    r = as_resolved(_deep(layers=6) if spec == "plain" else _patterned(layers=8))
    short, source = st.short_and_source(r, streamable(r), 0)
    made = []
    source.on_layer = lambda role, index, of: made.append(index)
    model = st.streamed_model(short, source).eval()
    together = verify.reference_outputs(r, model, 0, layers=layers, lockstep=st.in_lockstep)
    kept = streamable(r)["decoder"].kept
    assert sorted(made) == list(range(kept, len(r.decoder.layers)))
    made.clear()
    apart = verify.reference_outputs(r, model, 0, layers=layers)  # the cases one after another
    assert len(made) == (len(r.decoder.layers) - kept) * len(verify.cases(r))
    assert together.keys() == apart.keys()
    for key, outputs in apart.items():
        assert outputs.keys() == together[key].keys()
        assert any(name.startswith("present.") for name in outputs)
        for name, want in outputs.items():
            torch.testing.assert_close(torch.from_numpy(together[key][name]), torch.from_numpy(want),
                                       rtol=0, atol=0, msg=f"{key} {name}")


def test_a_failing_case_in_lockstep_fails_the_run_without_stalling_the_others():
    from specc.export import verify

    r = as_resolved(_deep(layers=6))
    short, source = st.short_and_source(r, streamable(r), 0)
    model = st.streamed_model(short, source).eval()
    real = source.layer

    def layer(role, index):
        got = real(role, index)
        if index == 4 and threading.current_thread().name.endswith("-1"):
            raise RuntimeError("made wrong")
        return got

    source.layer = layer
    with pytest.raises(RuntimeError, match="made wrong"):
        verify.reference_outputs(r, model, 0, layers=("decoder",), lockstep=st.in_lockstep)


def _plant(monkeypatch, weight: str, factor: float, layer: int = 3) -> None:
    """A copied layer's `weight`, as the stitched graph reads it, multiplied by `factor`."""
    real = stitch._weight

    def planted(weights, lazy, template, name, root):
        value = real(weights, lazy, template, name, root)
        if name.endswith(f"layers.{layer}.{weight}"):
            inner = value.const_value
            kind = type(template.const_value)
            value.const_value = type(inner)(lambda: kind(torch.from_numpy(inner.numpy() * factor), name=name),
                                            dtype=inner.dtype, shape=inner.shape, name=name)
        return value

    monkeypatch.setattr(stitch, "_weight", planted)


# int4: a norm's gain, since at a tiny seeded model's scale a wrong FFN projection hides under
# int4's noise bar (a negated one passes; docs/build.md, "Streamed builds", says so)
@pytest.mark.parametrize("precision, weight, factor", [("fp32", "ffn.down.weight", 1.1),
                                                       pytest.param("fp16", "ffn.down.weight", 3.0, marks=SLOW),
                                                       ("int4", "ffn_norm.weight", 10.0)])
def test_a_wrong_weight_in_a_deep_layer_fails_the_build_naming_the_layer(tmp_path, monkeypatch, precision, weight, factor):
    """Layer 3's weight, as the graph reads it, is scaled: the build fails, says decoder layer 3,
    and leaves no build behind."""
    _plant(monkeypatch, weight, factor)
    with pytest.raises(VerificationError, match="the first layer off: decoder layer 3 "):
        specc.build(_deep(layers=6), tmp_path / "out", precision=precision, stream=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a long build; make test-slow
def test_a_wrong_weight_in_a_partial_last_block_fails_the_build_naming_the_layer(tmp_path, monkeypatch):
    """Layer 7 of a stack of period 3 (copied from layer 4 in the last, partial block)."""
    _plant(monkeypatch, "ffn.down.weight", 1.1, layer=7)
    with pytest.raises(VerificationError, match="the first layer off: decoder layer 7 "):
        specc.build(_patterned(), tmp_path / "out", stream=True)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("spec", [_deep, _patterned])
def test_seeded_layers_made_alone_have_the_whole_models_values(spec):
    r = as_resolved(spec())
    whole = specc.to_torch(r, seed=5)
    short = st.short_model(r, streamable(r), seed=5)
    source = st.StreamedWeights(r, short, streamable(r), seed=5)
    for name, p in whole.named_parameters():
        assert torch.equal(source.tensor(name), p), name
    assert source._held is None  # each parameter drawn alone: no layer was made for them
    ids = torch.randint(0, r.vocab.size, (2, 7))
    with torch.no_grad():
        assert torch.equal(st.streamed_model(short, source)(input_ids=ids)["logits"], whole(input_ids=ids)["logits"])
    assert blocks.param_seed(5, "a") != blocks.param_seed(5, "b") != blocks.param_seed(6, "b")


@pytest.mark.parametrize("spec", [_deep, _patterned])
def test_a_hollow_short_module_holds_no_layer_values_and_its_source_makes_them(spec):
    """An fp32 export's short module (a streamed build's) holds its traced layers' shapes and
    dtypes only; the source makes their values, the whole model's, and the model it runs is the
    whole model (the bytes a build writes from it: the tests above)."""
    r = as_resolved(spec())
    plans = streamable(r)
    whole = specc.to_torch(r, seed=5)
    short, source = st.short_and_source(r, plans, seed=5, hollow=True)
    for name, p in short.named_parameters():
        if st.layer_index(name, plans) is not None:
            assert p.untyped_storage().nbytes() == p.element_size(), name  # one value, whatever its shape
    for name, p in whole.named_parameters():
        assert torch.equal(source.tensor(name), p), name
    ids = torch.randint(0, r.vocab.size, (2, 7))
    with torch.no_grad():
        assert torch.equal(st.streamed_model(short, source)(input_ids=ids)["logits"], whole(input_ids=ids)["logits"])


def test_what_cannot_be_streamed_is_refused_with_the_reason(tmp_path):
    assert streamable(as_resolved("tiny-llama")) == f"no stack has more than {stitch.KEEP} layers"
    assert "encoder-decoder" in streamable(as_resolved(_deep("tiny-transformer")))
    assert "do not repeat in a period" in streamable(as_resolved(_patterned(layers=9, indices=[3])))
    with pytest.raises(BuildError, match="cannot be built streamed: no stack has more than 2 layers"):
        specc.build("tiny-llama", tmp_path / "out", stream=True)
    assert not (tmp_path / "out").exists()
    # too large for memory and deep, but not streamable: the refusal says why it is not streamed
    with pytest.raises(BuildError, match=r"is available \(it cannot be built streamed, one layer at a time: an "
                                         r"encoder-decoder's encoder graph .*\); free memory"):
        specc.build(_deep("tiny-transformer"), tmp_path / "out", max_memory=1024)
    # a model of two layers, where streaming would not matter, is refused without that
    with pytest.raises(BuildError) as refused:
        specc.build("tiny-llama", tmp_path / "out", max_memory=1024)
    assert "streamed" not in str(refused.value)
    assert not (tmp_path / "out").exists()


def test_the_estimates_choose_streaming_only_where_the_whole_model_does_not_fit(tmp_path):
    r = _resolve(as_resolved("llama-2-7b").spec, "int4", "onnx")
    whole, streamed = estimate_memory(r)["bytes"], estimate_streamed(r)["bytes"]
    # the measured peak of this build is 5.12 GiB (docs/benchmarks_streamed.md): the estimate is
    # above it, and far below the whole build's
    assert 5.12 * 1024**3 < streamed < 8 * 1024**3 < 100 * 1024**3 < whole
    # a limit between the two: streamed by default, refused when told not to stream
    spec = _deep()
    limit = (estimate_memory(as_resolved(spec))["bytes"] + estimate_streamed(as_resolved(spec))["bytes"]) // 2
    result = specc.build(spec, tmp_path / "auto", max_memory=limit)
    assert "streamed" in result.verification
    with pytest.raises(BuildError, match=r"needs about .* is available \(built streamed, one layer at a time, it would need about"):
        specc.build(spec, tmp_path / "no", max_memory=limit, stream=False)
    with pytest.raises(BuildError, match="streamed needs about"):
        specc.build(spec, tmp_path / "tiny", max_memory=1024, stream=True)


def test_the_estimate_counts_an_int4_builds_packed_tied_head(monkeypatch):
    """gemma-2-9b's tied head, packed in 8-bit blocks of 16 beside its fp32 table (specc/export/
    quantize.py): a code and, per block, a float scale and a code of zero point per entry, in the
    written size that the disk check and the verification estimate read."""
    import specc.builder.memory as memory

    r = _resolve(as_resolved("gemma-2-9b").spec, "int4", "onnx")
    packed = estimate_streamed(r)["stored"]
    monkeypatch.setitem(memory.TIED_HEAD, "int4", None)
    plain = estimate_streamed(r)["stored"]
    assert packed - plain == math.ceil(256000 * 3584 * (1 + (4 + 1) / 16))


def _shard(weights, folder, parts: int = 2):
    """`weights` written again as `parts` shards and an index, as Hugging Face writes a large
    checkpoint; returns the index."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(weights))
    names = sorted(tensors)
    weight_map = {}
    for i in range(parts):
        shard = f"model-{i + 1:05d}-of-{parts:05d}.safetensors"
        mine = names[i::parts]
        save_file({n: tensors[n] for n in mine}, str(folder / shard))
        weight_map.update({n: shard for n in mine})
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


@pytest.mark.slow  # a long build; make test-slow
def test_a_sharded_weights_file_builds_what_the_single_file_does(tmp_path):
    """--weights NAME.safetensors.index.json: the same graphs as the single file, streamed and
    not; each shard is hashed into the build's inputs, so a changed shard is a new build."""
    spec = _deep()
    weights = specc.build(spec, tmp_path / "seeded", seed=3, stream=False, keep_weights=True).out_dir / "model.safetensors"
    (tmp_path / "sharded").mkdir()
    index = _shard(weights, tmp_path / "sharded")
    single = specc.build(spec, tmp_path / "single", weights=weights, stream=False)
    whole = specc.build(spec, tmp_path / "whole", weights=index, stream=False)
    assert specc.build(spec, tmp_path / "streamed", weights=index, stream=True).verification["streamed"]
    assert _hashes(tmp_path / "single") == _hashes(tmp_path / "whole") == _hashes(tmp_path / "streamed")
    source = whole.manifest["options"]["weights"]
    assert source["file"] == index.name and sorted(source["shards"]) == ["model-00001-of-00002.safetensors",
                                                                         "model-00002-of-00002.safetensors"]
    assert specc.build(spec, tmp_path / "whole", weights=index, stream=False).cached
    shard = tmp_path / "sharded" / "model-00002-of-00002.safetensors"
    from safetensors.torch import load_file, save_file

    changed = load_file(str(shard))
    first = sorted(changed)[0]
    changed[first] = changed[first] + 1
    save_file(changed, str(shard))
    assert not specc.build(spec, tmp_path / "whole", weights=index, stream=False).cached
    assert single.manifest["options"]["weights"]["sha256"] != source["sha256"]  # the index's, not the file's


def test_a_sharded_weights_file_whose_shards_disagree_with_its_index_is_refused(tmp_path):
    from specc.errors import WeightsError
    from specc.weights.io import ShardedSafetensors

    spec = _deep()
    weights = specc.build(spec, tmp_path / "seeded", stream=False, keep_weights=True).out_dir / "model.safetensors"
    index = _shard(weights, tmp_path)
    data = json.loads(index.read_text())
    moved = sorted(data["weight_map"])[0]
    data["weight_map"][moved] = "model-00002-of-00002.safetensors"  # not where it is
    index.write_text(json.dumps(data))
    with pytest.raises(WeightsError, match=r"model-0000\d-of-00002.safetensors (lacks|holds) .*" + moved.replace(".", r"\.")):
        ShardedSafetensors(index)
    data["weight_map"][moved] = "../model-00001-of-00002.safetensors"
    index.write_text(json.dumps(data))
    with pytest.raises(WeightsError, match="not a file name inside"):
        specc.build(spec, tmp_path / "out", weights=index)
    assert not (tmp_path / "out").exists()


@pytest.fixture
def by_segments(monkeypatch):
    """Streamed builds verified a layer at a time, as a 7B fp16 one is (its written weights outweigh
    what building holds); a small one is otherwise run whole."""
    from specc.builder import memory

    real = memory.estimate_streamed
    monkeypatch.setattr(memory, "estimate_streamed", lambda r, stacks=None: {**real(r, stacks), "whole": False})


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=SLOW), pytest.param("int4", marks=SLOW)])
def test_a_build_verified_by_segments_checks_every_layer_on_every_case(tmp_path, by_segments, precision):
    """Each layer's segment, the first (with the embeddings) and the last (the head) run on every
    case; the graph is the one a whole build writes."""
    spec = _deep(layers=6)
    res = specc.build(spec, tmp_path / "streamed", precision=precision, stream=True)
    whole = specc.build(spec, tmp_path / "whole", precision=precision, stream=False)
    assert _hashes(tmp_path / "whole") == _hashes(tmp_path / "streamed")
    v = res.verification
    assert v["streamed"]["by_segments"] and v["cases"] == []
    cases = [c["case"] for c in whole.verification["cases"]]
    names = [f"decoder layer {i}" for i in range(6)] + ["what follows decoder layer 5"]
    assert [(s["segment"], s["case"]) for s in v["segments"]] == [(n, c) for n in names for c in cases]
    by = {(s["segment"], s["case"]): s["outputs"] for s in v["segments"]}
    assert set(by[("decoder layer 3", "longest")]) == {"decoder.layers.3", "present.3.key", "present.3.value"}
    assert set(by[("what follows decoder layer 5", "longest")]) == {"logits"}
    assert v["max_abs_diff"] <= (1e-3 if precision != "fp16" else 0.1)


def test_window_caches_verified_by_segments(tmp_path, by_segments):
    """Every layer sliding a window of 12 (as Mistral's): the stitched, streamed graph's presents
    are window caches, checked layer by layer on the cases that outgrow the window."""
    spec = _deep(layers=4)
    att = spec.decoder.attention.model_copy(update={"pattern": LocalPattern(window=12)})
    spec = spec.model_copy(update={"decoder": spec.decoder.model_copy(update={"attention": att})})
    res = specc.build(spec, tmp_path / "streamed", stream=True)
    v = res.verification
    assert v["streamed"]["by_segments"]
    by = {(s["segment"], s["case"]): s["outputs"] for s in v["segments"]}
    assert {"window-prefill", "window-step", "window-step-2"} <= {case for _, case in by}
    assert set(by[("decoder layer 3", "window-step-2")]) == {"decoder.layers.3", "present.3.key", "present.3.value"}
    sig = {t["name"]: t["dims"] for t in res.manifest["graphs"]["model"]["outputs"]}
    assert sig["present.3.key"][2] == "total_sequence_window12"


@pytest.mark.parametrize("precision, weight, factor", [("fp32", "ffn.down.weight", 1.1), ("int4", "ffn.down.weight", -1.0)])
def test_a_wrong_weight_fails_its_own_segment(tmp_path, monkeypatch, by_segments, precision, weight, factor):
    """Verified a layer at a time, a wrong weight in layer 3 fails layer 3's segment, every earlier
    one having passed; no build is left behind."""
    _plant(monkeypatch, weight, factor)
    with pytest.raises(VerificationError, match=r"case padded-prefill .*, decoder layer 3: output 'decoder\.layers\.3'"):
        specc.build(_deep(layers=6), tmp_path / "out", precision=precision, stream=True)
    assert not (tmp_path / "out").exists()


def test_segments_cover_the_graph_and_refuse_a_read_across_a_cut():
    from onnx import TensorProto, helper

    from specc.export import segments

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    nodes = [helper.make_node("Relu", ["x"], ["h0"]), helper.make_node("Neg", ["h0"], ["h1"]),
             helper.make_node("Abs", ["h1"], ["y"])]
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    cut = segments.cut(graph, [("decoder", 0, "h0"), ("decoder", 1, "h1")])
    assert [(s.name, s.nodes, s.outputs) for s in cut] == [("decoder layer 0", [0], ["h0"]), ("decoder layer 1", [1], ["h1"]),
                                                           ("what follows decoder layer 1", [2], ["y"])]
    nodes[2] = helper.make_node("Add", ["h1", "h0"], ["y"])  # the head reads layer 0's output too
    graph = helper.make_graph(nodes, "g", [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(BuildError, match="reads 'h0', another layer's output"):
        segments.cut(graph, [("decoder", 0, "h0"), ("decoder", 1, "h1")])


def test_a_build_the_disk_cannot_hold_is_refused_before_any_work(tmp_path, monkeypatch):
    import shutil

    from specc.builder import memory

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda path: usage._replace(free=1 << 20))
    with pytest.raises(BuildError, match=r"writes about .* but .* has 1\.0 MiB free; free disk space"):
        specc.build("tiny-gpt2", tmp_path / "out", progress=None)
    assert list(tmp_path.iterdir()) == []


def test_gemma_style_norms_and_gates_stream_to_the_same_bytes(tmp_path):
    """unit_offset norms (a gain of 1 + weight, folded when exported) and GeGLU (tanh): the
    stitched copies' weights are the layers' own."""
    spec = _deep()
    spec = spec.model_copy(update={
        "norm": spec.norm.model_copy(update={"unit_offset": True}),
        "decoder": spec.decoder.model_copy(update={"ffn": spec.decoder.ffn.model_copy(update={"activation": "geglu_tanh"})})})
    specc.build(spec, tmp_path / "whole", stream=False)
    specc.build(spec, tmp_path / "streamed", stream=True)
    assert _hashes(tmp_path / "whole") == _hashes(tmp_path / "streamed")


def test_an_encoder_verified_by_segments(tmp_path, by_segments):
    """A post-norm encoder (BERT): the last layer's output is the graph's last_hidden_state, so
    nothing follows it but the pooler, if anything; every layer is still checked."""
    res = specc.build(_deep("tiny-bert"), tmp_path / "out", stream=True)
    names = {s["segment"] for s in res.verification["segments"]}
    assert {f"encoder layer {i}" for i in range(LAYERS)} <= names


def test_a_build_plans_once(tmp_path, monkeypatch):
    """The stitch of each graph and the memory estimates are computed once per build, in its plan
    (specc/builder/plan.py), and the export stitches as the plan says."""
    from specc.builder import memory

    calls = {"stitch_plan": 0, "estimate_memory": 0, "estimate_streamed": 0}

    def counted(owner, name):
        real = getattr(owner, name)

        def call(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(owner, name, call)

    counted(stitch, "stitch_plan")
    counted(memory, "estimate_memory")
    counted(memory, "estimate_streamed")
    result = specc.build(_deep(), tmp_path / "out", stream=True)
    assert calls == {"stitch_plan": 1, "estimate_memory": 1, "estimate_streamed": 1}  # one graph: model
    stitched = [o for o in result.manifest["optimizations"] if o.get("pass") == "specc.stitch"]
    assert [(o["layers"], o["layers_traced"]) for o in stitched] == [({"decoder": LAYERS}, 2)]
