"""The runtime's view of a build: BuildInfo (specc/spec/manifest.py) read from a build's manifest,
the Triton naming and batching rule that `specc serve` and `--target triton` share
(specc/spec/triton.py), and the runtime's modules importing each other without a cycle."""
from __future__ import annotations

import ast
import graphlib
import json
import shutil
from pathlib import Path

import pytest

import specc
from specc.runtime import RunError, Session
from specc.spec import triton as rule
from specc.spec.manifest import BuildInfo, NotAManifest, Range, Tokens, read_manifest

pytest.importorskip("onnxruntime")

RUNTIME = Path(__file__).resolve().parents[2] / "specc" / "runtime"


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    done: dict = {}

    def get(name: str) -> Path:
        if name not in done:
            done[name] = specc.build(name, tmp_path_factory.getbasetemp() / "specc-runtime-builds" / name).out_dir
        return done[name]

    return get


def test_build_info_of_a_decoder(builds):
    manifest = read_manifest(builds("tiny-gpt2") / "manifest.json")
    info = BuildInfo.from_manifest(manifest)
    assert (info.name, info.architecture) == ("tiny-gpt2", "decoder")
    assert list(info.graphs) == ["model"] and info.main_graph is info.graphs["model"]
    graph = manifest["graphs"]["model"]
    assert info.main_graph.file == graph["file"]
    assert [(t.name, t.dtype, list(t.dims)) for t in info.main_graph.inputs] == \
        [(t["name"], t["dtype"], t["dims"]) for t in graph["inputs"]]
    assert [t.name for t in info.main_graph.outputs] == [t["name"] for t in graph["outputs"]]
    assert info.vocab_size == 1000 and info.lm_output == "logits" and info.output_kinds == {"logits": "lm"}
    assert info.target_vocab_size == 1000 and info.type_vocab_size == 0
    assert info.learned_positions == 128
    assert info.tokens == Tokens(bos=999, eos=999, pad=None, decoder_start=None)
    assert info.pad_id == 999 and info.pad_for(None) == 0 and info.pad_for(7) == 7
    assert info.batch == Range(1, 2, 4) and info.length == Range(1, 32, 128)
    assert Session(builds("tiny-gpt2")).info == info


def test_build_info_of_an_encoder_decoder(builds):
    info = BuildInfo.from_manifest(read_manifest(builds("tiny-transformer") / "manifest.json"))
    assert info.architecture == "encoder-decoder" and list(info.graphs) == ["encoder", "decoder"]
    assert info.main_graph.name == "decoder" and info.lm_output == "logits"
    spec = read_manifest(builds("tiny-transformer") / "manifest.json")["spec"]
    assert info.learned_positions == (spec["position"]["max_length"] if spec["position"]["kind"] == "learned" else None)
    assert info.target_vocab_size == (spec["vocab"].get("target_size") or spec["vocab"]["size"])
    assert info.start_for(5) == next(t for t in (info.tokens.decoder_start, info.tokens.bos, 5) if t is not None)


def test_build_info_of_an_encoder_has_no_lm_output(builds):
    info = BuildInfo.from_manifest(read_manifest(builds("tiny-bert") / "manifest.json"))
    assert info.architecture == "encoder" and info.lm_output is None
    spec = read_manifest(builds("tiny-bert") / "manifest.json")["spec"]
    assert info.type_vocab_size == spec["vocab"]["type_size"] > 0


def test_a_malformed_manifest_is_named(tmp_path, builds):
    manifest = read_manifest(builds("tiny-gpt2") / "manifest.json")
    with pytest.raises(NotAManifest, match="'graphs' or 'spec'"):
        BuildInfo.from_manifest({k: v for k, v in manifest.items() if k != "spec"})
    broken = json.loads(json.dumps(manifest))
    del broken["spec"]["vocab"]
    with pytest.raises(NotAManifest, match="'spec'"):
        BuildInfo.from_manifest(broken)
    broken = json.loads(json.dumps(manifest))
    broken["graphs"]["model"]["inputs"][0]["dims"] = None
    with pytest.raises(NotAManifest, match="'graphs'"):
        BuildInfo.from_manifest(broken)
    copy = tmp_path / "broken"
    shutil.copytree(builds("tiny-gpt2"), copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["spec"]["serving"] = "fast"
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(RunError, match="manifest.json: malformed 'spec'"):
        Session(copy)


def test_one_triton_rule_for_names_dims_and_batching():
    assert rule.model_names("m", ["model"]) == {"model": "m"}
    assert rule.model_names("t", ["encoder", "decoder"]) == {"encoder": "t_encoder", "decoder": "t_decoder"}
    assert rule.dynamic_batching(2, 4) == rule.DynamicBatching(4, (2, 4), rule.MAX_QUEUE_DELAY_US)
    assert rule.dynamic_batching(4, 4).preferred_batch_sizes == (4,)
    assert rule.dynamic_batching(8, 4).preferred_batch_sizes == (4,)  # never past max_batch_size
    assert rule.model_dims(("batch", 4, "past_sequence", 16)) == (4, -1, 16)
    assert rule.model_dims((4, "sequence")) is None


def test_the_runtime_modules_import_each_other_without_a_cycle():
    graph = {}
    for path in RUNTIME.glob("*.py"):
        name = "specc.runtime" if path.stem == "__init__" else f"specc.runtime.{path.stem}"
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):  # lazy imports count too
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specc.runtime."):
                deps.add(node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("specc.runtime.")}
        graph[name] = deps
    order = list(graphlib.TopologicalSorter(graph).static_order())  # raises CycleError on a cycle
    assert order.index("specc.runtime.generate") < order.index("specc.runtime.session")
    assert "specc.runtime.session" not in graph["specc.runtime.generate"]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-transformer", "tiny-bert"])
def test_the_lm_output_a_build_records_is_the_resolved_specs(builds, name):
    """One rule names the output generation reads (spec/io.py's lm_output): the manifest's
    reader and the resolved spec the build wrote it from give the same name (None for an encoder)."""
    info = BuildInfo.from_manifest(read_manifest(builds(name) / "manifest.json"))
    assert info.lm_output == specc.resolve(specc.load_spec(name)).lm_output
    assert (info.lm_output is None) == (name == "tiny-bert")
