"""specc build --target triton: the model repository's layout, and config.pbtxt parsed with
Triton's own protobuf definitions (tritonclient) checked against the ONNX graphs it serves."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from click.testing import CliRunner

from specc.cli import main
from specc.export import triton
from specc.builder.pipeline import build
from specc.spec.load import load_spec
from specc.spec.resolve import resolve

pytest.importorskip("onnxruntime")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
text_format = pytest.importorskip("google.protobuf.text_format")

pytestmark = pytest.mark.xdist_group("test_triton")  # one worker: the module's shared builds are made once

# ONNX element type -> Triton DataType name (Triton's ONNX Runtime backend's correspondence)
ONNX_TO_TRITON = {onnx.TensorProto.INT64: "TYPE_INT64", onnx.TensorProto.INT32: "TYPE_INT32",
                  onnx.TensorProto.FLOAT: "TYPE_FP32", onnx.TensorProto.FLOAT16: "TYPE_FP16",
                  onnx.TensorProto.BFLOAT16: "TYPE_BF16"}


def _config(path):
    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), cfg)
    return cfg


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    out = {}
    for name in ("tiny-gpt2", "tiny-transformer"):
        repo = tmp_path_factory.mktemp("repo") / name
        build(name, repo, target="triton")
        out[name] = repo
    return out


def _check_tensors(entries, values, dtype_name):
    assert [e.name for e in entries] == [v.name for v in values]
    for e, v in zip(entries, values):
        assert model_config_pb2.DataType.Name(e.data_type) == ONNX_TO_TRITON[v.type.tensor_type.elem_type], e.name
        dims = [d.dim_value if d.HasField("dim_value") else -1 for d in v.type.tensor_type.shape.dim]
        assert dims[0] == -1, f"{e.name}: the batch dim is dynamic in the graph"
        assert list(e.dims) == dims[1:], e.name


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-transformer"])
def test_config_matches_onnx_graph(repos, name):
    repo = repos[name]
    r = resolve(load_spec(name))
    names = triton.model_names(r)
    # a decoder's generation model, and it as Triton's OpenAI frontend calls it (test_triton_generate.py)
    generation = [name, f"{name}_openai"] if triton.generates(r) else []
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == sorted([*names.values(), *generation])
    assert names == ({"model": f"{name}_model"} if name == "tiny-gpt2" else {"encoder": f"{name}_encoder",
                                                                             "decoder": f"{name}_decoder"})
    manifest = json.loads((repo / "manifest.json").read_text())
    for sig in r.graphs:
        model_dir = repo / names[sig.name]
        assert sorted(p.name for p in (model_dir / "1").iterdir()) == ["model.onnx"]
        assert manifest["graphs"][sig.name]["file"] == f"{names[sig.name]}/1/model.onnx"
        cfg = _config(model_dir / "config.pbtxt")
        graph = onnx.load(str(model_dir / "1" / "model.onnx")).graph
        assert cfg.name == names[sig.name] == model_dir.name  # Triton requires name == folder
        assert cfg.platform == "onnxruntime_onnx"
        assert cfg.max_batch_size == r.serving.batch.max
        _check_tensors(cfg.input, graph.input, "input")
        _check_tensors(cfg.output, graph.output, "output")
        db = cfg.dynamic_batching
        assert cfg.HasField("dynamic_batching")
        assert r.serving.batch.opt in db.preferred_batch_size
        assert all(1 <= b <= cfg.max_batch_size for b in db.preferred_batch_size)
        assert 0 < db.max_queue_delay_microseconds <= 10_000
        assert [(g.count, model_config_pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in cfg.instance_group] == \
            [(1, "KIND_CPU")]
    # every artifact the manifest lists exists with its recorded size
    for a in manifest["artifacts"]:
        assert (repo / a["path"]).stat().st_size == a["bytes"]


def test_decoder_repo_decodes_with_explicit_cache(repos):
    """The stateless decoder form: prefill with empty past_key_values.* ([B, H, 0, D]), then one
    step fed the returned present.*; the step's logits equal a full recompute of the sequence."""
    import onnxruntime as ort

    repo = repos["tiny-gpt2"]
    cfg = _config(repo / "tiny-gpt2_model" / "config.pbtxt")
    sess = ort.InferenceSession(str(repo / "tiny-gpt2_model" / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 100, size=(2, 6), dtype=np.int64)
    pasts = [i for i in cfg.input if i.name.startswith("past_key_values.")]
    assert pasts and all(list(i.dims)[1] == -1 for i in pasts)  # [heads, past, width]

    def run(tokens, past, offset):
        feed = {"input_ids": tokens, "attention_mask": np.ones((2, offset + tokens.shape[1]), np.int64)}
        names = {i.name for i in cfg.input}
        if "position_ids" in names:
            feed["position_ids"] = np.arange(offset, offset + tokens.shape[1], dtype=np.int64)[None].repeat(2, 0)
        for i in pasts:
            feed[i.name] = past[i.name] if past else np.zeros((2, i.dims[0], 0, i.dims[2]), np.float32)
        outs = [o.name for o in cfg.output]
        return dict(zip(outs, sess.run(outs, feed)))

    first = run(ids[:, :5], None, 0)
    past = {i.name: first["present." + i.name[len("past_key_values."):]] for i in pasts}
    step = run(ids[:, 5:], past, 5)
    full = run(ids, None, 0)
    logits = cfg.output[0].name
    np.testing.assert_allclose(step[logits][:, -1], full[logits][:, -1], atol=1e-4, rtol=1e-4)


def test_plan_config_is_tensorrt_on_gpu():
    r = resolve(load_spec("tiny-gpt2"))
    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(triton.config_text(r, r.graphs[0], "m", plan=True), cfg)
    assert cfg.platform == "tensorrt_plan"
    assert model_config_pb2.ModelInstanceGroup.Kind.Name(cfg.instance_group[0].kind) == "KIND_GPU"


def test_failed_layout_leaves_nothing(tmp_path, monkeypatch):
    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(triton, "write_repository", boom)
    repo = tmp_path / "repo"
    result = CliRunner().invoke(main, ["build", "tiny-gpt2", "--target", "triton", "-o", str(repo)])
    assert result.exit_code != 0
    assert "Traceback" not in result.output
    left = [p.name for p in tmp_path.iterdir()]
    assert left == [], "a failed build leaves no repository or staging directory"
