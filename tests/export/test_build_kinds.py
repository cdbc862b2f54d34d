"""specc.builder.pipeline.build() on every tiny catalog spec and every kind of the language: the ONNX
files carry the manifest's IO signature, the artifacts are the ones the manifest lists, the
verification ran the required cases within tolerance, fp16 builds are fp16 on the wire, and the
decoder artifacts really decode incrementally with their KV cache (checked here with plain
onnxruntime against a full-recompute greedy loop in torch)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import specc
from specc.export.verify import TOLERANCES, cases
from specc.builder.memory import available_memory, estimate_memory
from specc.builder.pipeline import STAGES, build
from specc.spec import resolve
from specc.spec.load import catalog_names, load_spec

from tests.helpers import speclib

ort = pytest.importorskip("onnxruntime")

TINY_CATALOG = [n for n in catalog_names() if n.startswith("tiny-")]
FULL_CATALOG = [n for n in catalog_names() if not n.startswith("tiny-")]
TARGETS = [("catalog", n) for n in TINY_CATALOG] + [("kind", k) for k in speclib.KINDS]

_ONNX_FLOAT = {"float32": onnx.TensorProto.FLOAT, "float16": onnx.TensorProto.FLOAT16,
               "bfloat16": onnx.TensorProto.BFLOAT16, "int64": onnx.TensorProto.INT64,
               "int32": onnx.TensorProto.INT32}


def _spec(source: str, name: str):
    return load_spec(name) if source == "catalog" else speclib.tiny(speclib.KINDS[name])


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """builds(source, name, **options) -> (spec, BuildResult), each distinct build done once per module."""
    done: dict = {}

    def get(source: str, name: str, **options):
        key = (source, name, tuple(sorted(options.items())))
        if key not in done:
            spec = _spec(source, name)
            out = tmp_path_factory.mktemp(f"{name}-{options.get('precision', 'default')}") / "out"
            done[key] = (spec, build(spec, out, **options))
        return done[key]

    return get


# --- helpers -------------------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _dims(value) -> list:
    return [d.dim_param if d.HasField("dim_param") else d.dim_value if d.HasField("dim_value") else None
            for d in value.type.tensor_type.shape.dim]


def _check_graph_files(result) -> None:
    graphs = result.manifest["graphs"]
    for gname, g in graphs.items():
        path = result.out_dir / g["file"]
        assert path.is_file(), path
        proto = onnx.load(str(path), load_external_data=False)
        for kind, values, sigs in (("inputs", proto.graph.input, g["inputs"]), ("outputs", proto.graph.output, g["outputs"])):
            assert [v.name for v in values] == [s["name"] for s in sigs], (gname, kind)
            for v, s in zip(values, sigs):
                assert _dims(v) == s["dims"], (gname, v.name, _dims(v), s["dims"])
                assert v.type.tensor_type.elem_type == _ONNX_FLOAT[s["dtype"]], (gname, v.name)


def _check_artifacts(result) -> None:
    listed = {a["path"] for a in result.artifacts}
    for a in result.artifacts:
        p = result.out_dir / a["path"]
        assert p.is_file(), a
        assert p.stat().st_size == a["bytes"], a
        assert _sha256(p) == a["sha256"], a
    # every graph file and every client's file are listed (no second copy of the weights by
    # default), and nothing unlisted was written besides the manifest
    assert {g["file"] for g in result.manifest["graphs"].values()} <= listed
    clients = {f for c in result.manifest.get("clients", {}).values() for f in c.get("files", [])}
    assert clients <= listed and ("model.safetensors" in listed) == result.manifest["options"]["keep_weights"]
    on_disk = {p.relative_to(result.out_dir).as_posix() for p in result.out_dir.rglob("*") if p.is_file()}
    assert on_disk == listed | {"manifest.json"}


def _within_tolerance(verification: dict) -> None:
    atol, rtol = verification["tolerance"]["atol"], verification["tolerance"]["rtol"]
    assert verification["passed"] is True
    worst = 0.0
    for case in verification["cases"]:
        assert case["outputs"], case
        for name, fig in case["outputs"].items():
            scale = fig["max_abs"] / fig["max_rel"] if fig["max_rel"] > 0 and fig["max_abs"] > 0 else 0.0
            assert np.isfinite(fig["max_abs"]), (case["case"], name)
            assert fig["max_abs"] <= atol + rtol * scale, (case["case"], name, fig)
            worst = max(worst, fig["max_abs"])
    assert verification["max_abs_diff"] == pytest.approx(worst)


def _check_cases(r, verification: dict) -> None:
    planned = {(c.graph, c.name): c for c in cases(r)}
    run = verification["cases"]
    assert len(run) >= 3
    assert [(c["graph"], c["case"]) for c in run] == list(planned)  # every planned case ran, in order
    graph_names = {g.name for g in r.graphs}
    for c in run:
        p = planned[(c["graph"], c["case"])]
        assert c["shapes"]["batch"] == p.batch and c["shapes"]["sequence"] == p.sequence
        for fig in c["outputs"].values():
            assert fig["shape"][0] == p.batch
    outputs = {g.name: [s.name for s in g.outputs] for g in r.graphs}
    for c in run:  # every output of the graph was compared
        assert sorted(c["outputs"]) == sorted(outputs[c["graph"]])
    longest = r.serving.length.max
    for graph in graph_names:
        mine = [planned[(c["graph"], c["case"])] for c in run if c["graph"] == graph]
        if not (graph == "decoder" and r.architecture == "encoder-decoder"):  # its padding is the source's (below)
            assert any(p.batch > 1 and p.pad > 0 for p in mine), graph
        assert any(p.sequence == 1 for p in mine), graph
        assert any(p.sequence == longest for p in mine), graph
    if r.architecture in ("decoder", "encoder-decoder"):
        steps = [c for c in run if c["case"] == "decode-step"]
        assert steps and all(c["shapes"].get("past_sequence", 0) > 0 and c["shapes"]["sequence"] == 1 for c in steps)
        # the step continues a padded batch (its prefill is the batch>1 case with padding)
        prefill = planned[(steps[0]["graph"], planned[(steps[0]["graph"], "decode-step")].after)]
        assert prefill.batch > 1 and steps[0]["shapes"]["past_sequence"] == prefill.sequence
    if r.architecture == "encoder-decoder":
        # the decoder reads a padded encoder batch
        padded_src = [p for p in planned.values() if p.graph == "decoder" and p.source
                      and planned[("encoder", p.source)].pad > 0 and p.batch > 1]
        assert padded_src


# --- every tiny spec and every kind --------------------------------------------------------------


# the catalog's builds, which the tests after the first read again: on one worker, built once
CATALOG_BUILDS = pytest.mark.xdist_group("build_kinds-catalog")


@pytest.mark.parametrize("source,name", [pytest.param(s, n, marks=CATALOG_BUILDS if s == "catalog" else ()) for s, n in TARGETS],
                         ids=[f"{s}:{n}" for s, n in TARGETS])
def test_build_every_tiny_spec_and_kind(built, source, name):
    spec, result = built(source, name)
    r = resolve(spec)
    m = result.manifest
    assert not result.cached
    assert result.out_dir.is_dir() and (result.out_dir / "manifest.json").is_file()
    # the manifest's IO signature is the resolved one
    assert list(m["graphs"]) == [g.name for g in r.graphs]
    for g in r.graphs:
        assert m["graphs"][g.name]["inputs"] == [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in g.inputs]
        assert m["graphs"][g.name]["outputs"] == [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in g.outputs]
    _check_graph_files(result)
    _check_artifacts(result)
    _check_cases(r, result.verification)
    _within_tolerance(result.verification)
    assert result.verification["tolerance"] == dict(zip(("atol", "rtol"), TOLERANCES[("onnx", "fp32")]))
    assert result.max_abs_diff < TOLERANCES[("onnx", "fp32")][0] * 10
    # provenance
    assert m["name"] == r.name and m["architecture"] == r.architecture
    assert isinstance(m["spec"], dict) and m["spec"]["name"] == r.name
    # spec_sha256 is the sha256 of the recorded spec (canonical JSON)
    canonical = json.dumps(m["spec"], sort_keys=True, separators=(",", ":")).encode()
    assert m["spec_sha256"] == hashlib.sha256(canonical).hexdigest()
    on_disk = json.loads((result.out_dir / "manifest.json").read_text())
    assert on_disk == json.loads(json.dumps(m))
    for dist in ("specc", "torch", "onnx", "onnxruntime"):
        assert m["versions"].get(dist), dist
    assert m["versions"]["specc"] == specc.__version__
    assert m["versions"]["torch"] == torch.__version__
    assert m["versions"]["onnx"] == onnx.__version__
    assert m["versions"]["onnxruntime"] == ort.__version__
    assert m["options"]["precision"] == "fp32" and m["options"]["target"] == "onnx"
    assert m["parameters"] == result.parameters == sum(p.numel() for p in specc.to_torch(spec, seed=0).parameters())
    timings = m["timings_s"]
    for stage in STAGES:
        if stage == "write":  # see test_manifest_times_the_write_stage
            continue
        assert isinstance(timings.get(stage), (int, float)) and timings[stage] >= 0, stage
    assert timings["total"] >= max(v for k, v in timings.items() if k != "total")


@CATALOG_BUILDS
def test_spec_hash_and_cache_key_tell_specs_apart(built):
    _, a = built("catalog", "tiny-gpt2")
    _, b = built("catalog", "tiny-llama")
    assert a.manifest["spec_sha256"] != b.manifest["spec_sha256"]
    assert a.manifest["cache_key"] != b.manifest["cache_key"]


@CATALOG_BUILDS
def test_manifest_times_the_write_stage(built):
    _, result = built("catalog", "tiny-gpt2")
    assert set(STAGES) <= set(result.manifest["timings_s"])


# --- fp16 --------------------------------------------------------------------------------------

FP16 = {
    "decoder-rotary-rmsnorm": {"position": {"kind": "rotary"}, "norm": {"kind": "rmsnorm", "placement": "pre"},
                               "decoder": speclib.stack({"kv_heads": 2}, {"activation": "swiglu"})},
    "encoder-default": speclib.KINDS["encoder-default"],
    "encdec-default": speclib.KINDS["encdec-default"],
}


@pytest.mark.parametrize("name", list(FP16))
def test_fp16_build(tmp_path, name):
    spec = speclib.tiny(FP16[name])
    result = build(spec, tmp_path / "out", precision="fp16")
    assert result.manifest["options"]["precision"] == "fp16"
    assert result.verification["precision"] == "fp16"
    assert result.verification["tolerance"] == dict(zip(("atol", "rtol"), TOLERANCES[("onnx", "fp16")]))
    _within_tolerance(result.verification)
    _check_artifacts(result)
    n_float = 0
    for g in result.manifest["graphs"].values():
        proto = onnx.load(str(result.out_dir / g["file"]))
        for v in (*proto.graph.input, *proto.graph.output):
            if v.name in ("input_ids", "attention_mask", "position_ids", "token_type_ids", "encoder_attention_mask"):
                assert v.type.tensor_type.elem_type == onnx.TensorProto.INT64, v.name
            else:
                assert v.type.tensor_type.elem_type == onnx.TensorProto.FLOAT16, v.name
                n_float += 1
        # the weights are stored in half precision too
        floats = [i for i in proto.graph.initializer if i.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)]
        assert sum(i.data_type == onnx.TensorProto.FLOAT16 for i in floats) > len(floats) // 2
    assert n_float >= 1
    _check_graph_files(result)
    # the fp16 file runs in onnxruntime and returns fp16
    r = resolve(spec)
    sig = r.graphs[0]
    sess = ort.InferenceSession(str(result.out_dir / f"{sig.name}.onnx"), providers=["CPUExecutionProvider"])
    feed = {"input_ids": np.array([[1, 2, 3]], dtype=np.int64), "attention_mask": np.ones((1, 3), dtype=np.int64)}
    for s in sig.inputs:
        if s.name == "position_ids":
            feed[s.name] = np.arange(3, dtype=np.int64)[None]
        elif s.name.startswith("past_key_values."):
            feed[s.name] = np.zeros([1 if d == "batch" else 0 if d == "past_sequence" else d for d in s.dims], np.float16)
    first = sess.run(None, feed)[0]
    assert first.dtype == np.float16 and np.isfinite(first).all()


# --- incremental decoding with the artifact vs full recompute in torch ---------------------------

NEW_TOKENS = 6


def _assert_close_logits(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    atol, rtol = TOLERANCES[("onnx", "fp32")]
    for step, (g, w) in enumerate(zip(got, want)):
        diff = float(np.abs(g - w).max())
        assert diff <= 10 * (atol + rtol * float(np.abs(w).max())), (step, diff)


def _torch_greedy_decoder(model, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """New token ids [B, NEW_TOKENS] and the last-position logits of each step [NEW_TOKENS, B, V]."""
    ids, mask = torch.from_numpy(ids), torch.from_numpy(mask)
    out, last = [], []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=ids, attention_mask=mask)["logits"]  # full recompute, no cache
            last.append(logits[:, -1].numpy())
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            ids = torch.cat([ids, nxt], 1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
    return torch.cat(out, 1).numpy(), np.stack(last)


def _ort_greedy_decoder(path: Path, ids: np.ndarray, mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    in_names = [i.name for i in sess.get_inputs()]
    out_names = [o.name for o in sess.get_outputs()]
    assert "logits" in out_names and any(n.startswith("present.") for n in out_names)
    b = ids.shape[0]
    past = {}
    for i in sess.get_inputs():
        if i.name.startswith("past_key_values."):
            shape = [b if d == "batch" else 0 if d == "past_sequence" else d for d in i.shape]
            assert all(isinstance(d, int) for d in shape), (i.name, i.shape)
            past[i.name] = np.zeros(shape, dtype=np.float32)
    assert past, "the decoder graph takes no KV cache"
    step_ids, out, last = ids, [], []
    for step in range(NEW_TOKENS):
        feed = {"input_ids": step_ids, "attention_mask": mask, **past}
        if "position_ids" in in_names:
            feed["position_ids"] = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, -step_ids.shape[1]:]
        res = dict(zip(out_names, sess.run(out_names, feed)))
        seen = mask.shape[1]
        for name in past:
            present = "present." + name[len("past_key_values."):]
            assert res[present].shape[2] == seen, (step, present, res[present].shape)  # past + new
            past[name] = res[present]
        last.append(res["logits"][:, -1])
        nxt = res["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        out.append(nxt)
        step_ids = nxt  # only the new token from now on
        mask = np.concatenate([mask, np.ones((b, 1), np.int64)], axis=1)
    return np.concatenate(out, 1), np.stack(last)


@CATALOG_BUILDS
@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_onnx_incremental_decoding_matches_torch_full_recompute(built, name):
    spec, result = built("catalog", name)
    model = specc.to_torch(spec, seed=0)
    rng = np.random.default_rng(1)
    vocab = resolve(spec).vocab.size
    ids = rng.integers(0, vocab, size=(2, 7), dtype=np.int64)
    mask = np.ones_like(ids)
    mask[1, :2] = 0  # second row left-padded
    want, want_logits = _torch_greedy_decoder(model, ids, mask)
    got, got_logits = _ort_greedy_decoder(result.out_dir / "model.onnx", ids, mask)
    assert got.shape == (2, NEW_TOKENS)
    np.testing.assert_array_equal(got, want)
    # random tiny models often repeat a token, so the logits of every step are compared too
    _assert_close_logits(got_logits, want_logits)


@CATALOG_BUILDS
def test_onnx_encoder_decoder_incremental_decoding_matches_torch(built):
    spec, result = built("catalog", "tiny-transformer")
    r = resolve(spec)
    model = specc.to_torch(spec, seed=0)
    enc = ort.InferenceSession(str(result.out_dir / "encoder.onnx"), providers=["CPUExecutionProvider"])
    dec = ort.InferenceSession(str(result.out_dir / "decoder.onnx"), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(2)
    src = rng.integers(0, r.vocab.size, size=(2, 9), dtype=np.int64)
    src_mask = np.ones_like(src)
    src_mask[1, 6:] = 0  # second source right-padded
    first = next((t for t in (r.tokens.decoder_start, r.tokens.bos) if t is not None), 0)
    start = np.full((2, 1), first, np.int64)

    # torch: full recompute every step through forward(input_ids, attention_mask, decoder_input_ids)
    dec_ids, want_logits = torch.from_numpy(start), []
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(src_mask),
                           decoder_input_ids=dec_ids)["logits"]
            want_logits.append(logits[:, -1].numpy())
            dec_ids = torch.cat([dec_ids, logits[:, -1].argmax(-1, keepdim=True)], 1)
    want = dec_ids[:, 1:].numpy()

    # onnxruntime: encoder once, then the decoder one token at a time with its self-attention cache
    enc_names = [o.name for o in enc.get_outputs()]
    enc_out = dict(zip(enc_names, enc.run(enc_names, {"input_ids": src, "attention_mask": src_mask})))
    dec_in = {i.name: i for i in dec.get_inputs()}
    dec_names = [o.name for o in dec.get_outputs()]
    feed_static = {"encoder_attention_mask": src_mask}
    past = {}
    for name, i in dec_in.items():
        if name.startswith("past_key_values.") and ".encoder." in name:
            feed_static[name] = enc_out["present." + name[len("past_key_values."):]]
        elif name.startswith("past_key_values."):
            assert ".decoder." in name
            past[name] = np.zeros([2 if d == "batch" else 0 if d == "past_sequence" else d for d in i.shape], np.float32)
    assert past and len(feed_static) > 1
    step_ids, got, got_logits = start, [], []
    for step in range(NEW_TOKENS):
        res = dict(zip(dec_names, dec.run(dec_names, {"input_ids": step_ids, **feed_static, **past})))
        for name in past:
            present = res["present." + name[len("past_key_values."):]]
            assert present.shape[2] == step + 1
            past[name] = present
        got_logits.append(res["logits"][:, -1])
        step_ids = res["logits"][:, -1].argmax(-1)[:, None].astype(np.int64)
        got.append(step_ids)
    got = np.concatenate(got, 1)
    np.testing.assert_array_equal(got, want)
    _assert_close_logits(np.stack(got_logits), np.stack(want_logits))


# --- full-size catalog specs --------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("name", FULL_CATALOG)
def test_build_full_size_catalog_spec(tmp_path, name):
    need = estimate_memory(resolve(load_spec(name)))["bytes"]
    have = available_memory()
    if have is not None and need > have:
        pytest.skip(f"{name} needs about {need / 1024**3:.1f} GiB, {have / 1024**3:.1f} GiB available")
    result = build(name, tmp_path / "out")
    assert result.verification["passed"] is True
    _within_tolerance(result.verification)
    _check_artifacts(result)
    _check_graph_files(result)
