"""specc.build() (specc/builder/pipeline.py) on tiny-gpt2: the cache, reproducible artifacts across
processes, trained weights, the memory check, external data, and the Python API.

Builds are expensive (~3-4 s each): the seed-0 build and the weights build are module-scoped and
the tests that need a rebuild start from a copy of them."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

import specc
from specc.builder.clients import CONFIG, GENAI_CONFIG, GENERATION_CONFIG
from specc.errors import BuildError, WeightsError
from specc.export import inplace
from specc.export.outdir import MANIFEST
from specc.builder.memory import estimate_memory
from specc.spec.costs import inspect_spec
from specc.builder.pipeline import STAGES, BuildResult
from specc.spec import load_spec, resolve
from specc.weights import save_module

pytestmark = pytest.mark.xdist_group("test_pipeline")  # one worker: the module's shared builds are made once

ROOT = Path(__file__).resolve().parents[1]
SPEC = "tiny-gpt2"
CLIENT_FILES = [CONFIG, GENERATION_CONFIG, GENAI_CONFIG]  # what a decoder's build writes for other clients
COMPOSED = [inplace.FILE]  # and the graph composed from its own (specc/export/inplace.py)
GIB = 1024**3


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(out: Path) -> dict:
    return json.loads((out / MANIFEST).read_text())


def stats(out: Path) -> dict[str, tuple[int, int, int]]:
    """inode, mtime and size of DIR and of every file in it."""
    paths = [out, *sorted(out.rglob("*"))]
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, p.stat().st_size) for p in paths}


def staging_leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".specc-tmp-" in p.name or ".specc-old-" in p.name]


def tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def comparable(artifacts: list[dict]) -> list[dict]:
    """The manifest's artifacts, every file's sha256 included (model.safetensors too: its bytes
    are reproducible, see test_model_safetensors_bytes_are_reproducible)."""
    return [dict(a) for a in artifacts]


def same_safetensors(a: Path, b: Path) -> bool:
    from safetensors import safe_open

    def meta(p):
        with safe_open(str(p), "pt") as f:
            return f.metadata()

    return tensors_equal(load_file(str(a)), load_file(str(b))) and meta(a) == meta(b)


# --- module-scoped builds -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """tiny-gpt2, seed 0, model.safetensors kept (its bytes are compared below), every progress
    event recorded."""
    out = tmp_path_factory.mktemp("seed0") / "out"
    events = []
    result = specc.build(SPEC, out, keep_weights=True, progress=lambda stage, state, facts: events.append((stage, state, dict(facts))))
    return result, out, events


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("weights") / "trained.safetensors"
    save_module(specc.to_torch(SPEC, seed=7), path)
    return path


@pytest.fixture(scope="module")
def weights_build(tmp_path_factory, weights_file):
    out = tmp_path_factory.mktemp("wbuild") / "out"
    return specc.build(SPEC, out, keep_weights=True, weights=weights_file), out


@pytest.fixture
def copy_of(tmp_path):
    """A copy of a build directory under this test's tmp_path (same content, same cache key)."""

    def copy(src: Path, name: str = "out") -> Path:
        dst = tmp_path / name
        shutil.copytree(src, dst)
        return dst

    return copy


# --- the first build ----------------------------------------------------------------------------


def test_python_api(built):
    result, out, _ = built
    assert isinstance(result, BuildResult)
    assert result.cached is False
    assert result.out_dir == out.absolute()
    assert [a["path"] for a in result.artifacts] == ["model.onnx", *CLIENT_FILES, *COMPOSED, "model.safetensors"]
    for a in result.artifacts:
        f = out / a["path"]
        assert a["bytes"] == f.stat().st_size and a["sha256"] == sha(f)
    model = specc.to_torch(SPEC)
    assert result.parameters == sum(p.numel() for p in model.parameters()) == 139_264
    assert result.verification["passed"] is True
    tol = result.verification["tolerance"]
    assert isinstance(result.max_abs_diff, float)
    assert 0 <= result.max_abs_diff <= tol["atol"]
    assert result.max_abs_diff == result.verification["max_abs_diff"]
    assert result.verification["cases"]
    d = result.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["out_dir"] == str(out.absolute()) and d["cached"] is False
    # the manifest on disk is what the result holds
    assert manifest(out) == result.manifest
    assert {"artifacts", "parameters", "verification", "versions", "graphs", "cache_key", "options"} <= d.keys()
    assert d["options"] == {"target": "onnx", "precision": "fp32", "opset": 18, "weights": {"source": "seed", "seed": 0},
                            "keep_weights": True}
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "model.onnx", *CLIENT_FILES, *COMPOSED, "model.safetensors"])
    assert staging_leftovers(out.parent) == []


def test_verification_session_computes_what_the_runtime_session_does(built):
    """The build verifies with weight prepacking and constant folding off (to keep a tied head's
    embedding from being copied twice); the graph's outputs are those of the session a user runs,
    with every optimization, up to float rounding."""
    import onnxruntime as ort

    from specc.export.verify import verification_session
    from specc.runtime.session import session_options

    _, out, _ = built
    lean = verification_session(out / "model.onnx", "model")
    full = ort.InferenceSession(str(out / "model.onnx"), session_options(ort), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {}
    for i in lean.get_inputs():
        if i.name == "input_ids":
            feed[i.name] = rng.integers(0, 1000, (2, 7), dtype=np.int64)
        elif i.name in ("attention_mask", "position_ids"):
            feed[i.name] = np.ones((2, 7), np.int64) if i.name == "attention_mask" else np.tile(np.arange(7), (2, 1))
        else:  # an empty cache: past_key_values.* [batch, heads, 0, head_dim]
            feed[i.name] = np.zeros([2, i.shape[1], 0, i.shape[3]], np.float32)
    names = [o.name for o in lean.get_outputs()]
    assert "logits" in names
    for name, a, b in zip(names, lean.run(names, feed), full.run(names, feed)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max()), err_msg=name)


def test_progress_reports_every_stage_in_order(built):
    _, _, events = built
    starts = [s for s, state, _ in events if state == "start"]
    dones = [s for s, state, _ in events if state == "done"]
    assert starts == list(STAGES) == dones
    facts = {s: f for s, state, f in events if state == "done"}
    assert all(f["seconds"] >= 0 for f in facts.values())
    assert facts["build module"]["parameters"] == 139_264
    assert facts["verify"]["max_abs_diff"] == built[0].max_abs_diff


def test_weights_match_the_seeded_module(built):
    _, out, _ = built
    want = {n: p.detach() for n, p in specc.to_torch(SPEC, seed=0).named_parameters()}
    assert tensors_equal(load_file(str(out / "model.safetensors")), want)


def test_artifacts_share_one_file_mode(built):
    import stat

    _, out, _ = built
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in out.iterdir()}
    assert len(set(modes.values())) == 1, modes


# --- cache ----------------------------------------------------------------------------------------


def test_cache_hit_is_fast_and_touches_nothing(built):
    first, out, _ = built
    before = stats(out)
    events = []
    t0 = time.perf_counter()
    again = specc.build(SPEC, out, keep_weights=True, progress=lambda s, st, f: events.append((s, st)))
    elapsed = time.perf_counter() - t0
    assert again.cached is True
    assert elapsed < 5, f"cache hit took {elapsed:.1f} s"
    assert stats(out) == before
    assert again.manifest == first.manifest
    assert again.to_dict()["cached"] is True
    # only loading and resolving the spec (to compute the key) ran, then the hit
    assert events == [("load", "start"), ("load", "done"), ("resolve", "start"), ("resolve", "done"), ("cache", "done")]
    # the same inputs spelled out are the same key
    assert specc.build(SPEC, out, keep_weights=True, precision="fp32", seed=0, opset=18, target="onnx").cached is True
    assert stats(out) == before


def test_same_spec_from_another_file_is_a_hit(built, copy_of, tmp_path):
    out = copy_of(built[1])
    spec = tmp_path / "elsewhere" / "my-gpt2.yaml"
    spec.parent.mkdir()
    shutil.copy(ROOT / "specs" / "tiny-gpt2.yaml", spec)
    assert specc.build(spec, out, keep_weights=True).cached is True


def test_seed_change_rebuilds(built, copy_of, weights_build, weights_file):
    out = copy_of(built[1])
    before = stats(out)
    result = specc.build(SPEC, out, keep_weights=True, seed=7)
    assert result.cached is False
    assert result.manifest["options"]["weights"] == {"source": "seed", "seed": 7}
    assert result.manifest["cache_key"] != built[0].manifest["cache_key"]
    assert stats(out)["model.onnx"] != before["model.onnx"]
    assert sha(out / "model.safetensors") != sha(built[1] / "model.safetensors")
    # seed 7 initialises what the weights file (to_torch(seed=7)) holds: the same graph, byte for byte
    assert tensors_equal(load_file(str(out / "model.safetensors")), load_file(str(weights_file)))
    assert sha(out / "model.onnx") == sha(weights_build[1] / "model.onnx")


def test_precision_change_rebuilds(built, copy_of):
    out = copy_of(built[1])
    result = specc.build(SPEC, out, keep_weights=True, precision="fp16")
    assert result.cached is False
    assert result.manifest["options"]["precision"] == "fp16"
    assert result.verification["precision"] == "fp16" and result.verification["passed"]
    fp32_bytes = built[0].artifacts[0]["bytes"]
    assert result.artifacts[0]["path"] == "model.onnx"
    assert result.artifacts[0]["bytes"] < 0.75 * fp32_bytes  # half-precision weights
    assert manifest(out)["options"]["precision"] == "fp16"


def test_spec_change_rebuilds(built, copy_of, spec_file):
    out = copy_of(built[1])
    wider = spec_file("""\
        specc: 1
        extends: tiny-gpt2
        decoder:
          ffn: {d_ff: 256}
        """, "wider.yaml")
    result = specc.build(wider, out, keep_weights=True)
    assert result.cached is False
    assert result.manifest["name"] == "tiny-gpt2"
    assert result.manifest["spec_sha256"] != built[0].manifest["spec_sha256"]
    # 2 layers x (64 x 128 more in, 128 more bias, 128 x 64 more out)
    assert result.parameters == built[0].parameters + 2 * (64 * 128 + 128 + 128 * 64)
    assert specc.build(wider, out, keep_weights=True).cached is True


def test_force_rebuilds(built, copy_of):
    out = copy_of(built[1])
    before = stats(out)
    result = specc.build(SPEC, out, keep_weights=True, force=True)
    assert result.cached is False
    after = stats(out)
    assert after["model.onnx"][:2] != before["model.onnx"][:2]
    # the same inputs build the same bytes
    assert result.manifest["cache_key"] == built[0].manifest["cache_key"]
    assert comparable(result.artifacts) == comparable(built[0].artifacts)
    assert sha(out / "model.onnx") == sha(built[1] / "model.onnx")
    assert same_safetensors(out / "model.safetensors", built[1] / "model.safetensors")


def test_a_build_with_an_unreadable_manifest_is_refused_untouched(built, copy_of):
    """Without its manifest a folder's files cannot be told apart from a user's: no data is risked."""
    out = copy_of(built[1])
    (out / MANIFEST).write_text('{"cache_key": ')
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    with pytest.raises(BuildError, match="is not a specc build") as info:
        specc.build(SPEC, out, force=True)
    assert str(out / MANIFEST) in str(info.value)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize("lost", ["model.onnx", "model.safetensors"])
def test_a_shortened_artifact_list_is_no_cache_hit(built, copy_of, lost):
    """The red-team report: delete model.onnx and its entry in the manifest, and the cache said
    'up to date'. The files the graphs name, and the weights, must be listed and intact."""
    out = copy_of(built[1])
    data = manifest(out)
    data["artifacts"] = [a for a in data["artifacts"] if a["path"] != lost]
    (out / MANIFEST).write_text(json.dumps(data))
    (out / lost).unlink()
    result = specc.build(SPEC, out, keep_weights=True)
    assert result.cached is False
    assert sha(out / "model.onnx") == built[0].artifacts[0]["sha256"]
    assert (out / "model.safetensors").is_file()


def test_damaged_build_is_rebuilt(built, copy_of):
    out = copy_of(built[1])
    data = (out / "model.onnx").read_bytes()
    (out / "model.onnx").write_bytes(data[: len(data) // 2])
    result = specc.build(SPEC, out, keep_weights=True)
    assert result.cached is False
    assert sha(out / "model.onnx") == built[0].artifacts[0]["sha256"]
    assert comparable(manifest(out)["artifacts"]) == comparable(built[0].artifacts)
    assert same_safetensors(out / "model.safetensors", built[1] / "model.safetensors")


# --- reproducible across processes ----------------------------------------------------------------


def test_byte_identical_in_another_process(built, tmp_path):
    first, out_a, _ = built
    env = {k: v for k, v in os.environ.items() if k != "SPECC_DEBUG"}
    env["PYTHONHASHSEED"] = "4242"  # another set/dict iteration order than this process
    code = "import sys, specc; r = specc.build(sys.argv[1], sys.argv[2], keep_weights=True); print(r.out_dir)"
    proc = subprocess.run([sys.executable, "-c", code, SPEC, "rel/out"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    out_b = tmp_path / "rel" / "out"
    assert proc.stdout.strip() == str(out_b)  # a relative DIR, reported absolute
    assert sha(out_a / "model.onnx") == sha(out_b / "model.onnx"), "model.onnx differs between two processes"
    assert same_safetensors(out_a / "model.safetensors", out_b / "model.safetensors")
    m_a, m_b = manifest(out_a), manifest(out_b)
    assert m_a["artifacts"][0]["path"] == "model.onnx" and m_a["artifacts"][0] == m_b["artifacts"][0]
    assert comparable(m_a["artifacts"]) == comparable(m_b["artifacts"])
    assert m_a["cache_key"] == m_b["cache_key"]
    assert m_a["spec_sha256"] == m_b["spec_sha256"]
    strip = lambda m: {k: v for k, v in m.items() if k not in ("timings_s", "artifacts")}  # noqa: E731
    assert strip(m_a) == strip(m_b)
    # no machine-specific paths: the build dirs, the repository (spec files), the home directory
    for out, text in ((out_a, (out_a / MANIFEST).read_text()), (out_b, (out_b / MANIFEST).read_text())):
        for path in {str(out.parent), str(tmp_path), str(ROOT), str(Path.home()), os.getcwd()}:
            assert path not in text, f"{path} in {out}/manifest.json"
    # and the other process's build is a cache hit here
    assert specc.build(SPEC, out_b, keep_weights=True).cached is True


def test_model_safetensors_bytes_are_reproducible(tmp_path):
    model = specc.to_torch(SPEC)
    digests = set()
    for _ in range(12):  # with the bug, all 12 agree with probability 2**-11
        save_module(model, tmp_path / "model.safetensors")
        digests.add(sha(tmp_path / "model.safetensors"))
    assert len(digests) == 1


# --- weights ---------------------------------------------------------------------------------------


def test_weights_file_is_used(built, weights_build, weights_file):
    result, out = weights_build
    assert result.cached is False and result.verification["passed"]
    assert tensors_equal(load_file(str(out / "model.safetensors")), load_file(str(weights_file)))
    assert result.manifest["options"]["weights"] == {
        "source": "file", "file": weights_file.name, "sha256": sha(weights_file)}
    # not the seed-0 build
    assert sha(out / "model.onnx") != sha(built[1] / "model.onnx")
    assert sha(out / "model.safetensors") != sha(built[1] / "model.safetensors")
    assert not any(str(weights_file.parent) in line for line in (out / MANIFEST).read_text().splitlines())


def test_weights_key_in_spec(weights_build, weights_file, tmp_path, monkeypatch, spec_file):
    (tmp_path / "specs" / "w").mkdir(parents=True)
    shutil.copy(weights_file, tmp_path / "specs" / "w" / "trained.safetensors")
    spec = spec_file("""\
        specc: 1
        extends: tiny-gpt2
        weights: w/trained.safetensors
        """, "specs/trained.yaml")
    elsewhere = tmp_path / "cwd"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # relative to the spec file, not the working directory
    result = specc.build(spec, tmp_path / "out", keep_weights=True)
    out = tmp_path / "out"
    assert result.cached is False
    assert result.manifest["options"]["weights"] == weights_build[0].manifest["options"]["weights"]
    assert tensors_equal(load_file(str(out / "model.safetensors")), load_file(str(weights_file)))
    assert sha(out / "model.onnx") == sha(weights_build[1] / "model.onnx")
    assert str(tmp_path) not in (out / MANIFEST).read_text()


def test_weights_argument_wins_over_spec_key(weights_build, weights_file, tmp_path, spec_file):
    out = tmp_path / "out"
    shutil.copytree(weights_build[1], out)
    spec = spec_file("""\
        specc: 1
        extends: tiny-gpt2
        weights: missing.safetensors
        """)
    # the spec's weights file does not exist, the explicit one does: no error, and a rebuild
    # (the spec text differs) that uses the explicit file
    result = specc.build(spec, out, keep_weights=True, weights=weights_file)
    assert result.manifest["options"]["weights"]["sha256"] == sha(weights_file)
    assert tensors_equal(load_file(str(out / "model.safetensors")), load_file(str(weights_file)))


def test_wrong_weights_fail_before_dir_exists(weights_file, tmp_path):
    tensors = load_file(str(weights_file))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    bad = tmp_path / "bad.safetensors"
    save_file(tensors, str(bad))
    out = tmp_path / "out"
    with pytest.raises(WeightsError) as info:
        specc.build(SPEC, out, weights=bad)
    assert "missing" in str(info.value) and dropped in str(info.value)
    assert not out.exists()
    assert staging_leftovers(tmp_path) == []


def test_missing_weights_file(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(BuildError, match="no such weights file"):
        specc.build(SPEC, out, weights=tmp_path / "nothere.safetensors")
    assert not out.exists()


# --- memory ----------------------------------------------------------------------------------------


def test_max_memory_refuses_before_any_directory(tmp_path):
    need = estimate_memory(resolve(load_spec(SPEC)))["bytes"]
    out = tmp_path / "sub" / "out"
    with pytest.raises(BuildError) as info:
        specc.build(SPEC, out, max_memory=1000)
    msg = str(info.value)
    assert f"{need / GIB:.1f} GiB" in msg
    assert "--max-memory" in msg
    assert not (tmp_path / "sub").exists()


def test_default_limit_is_available_memory(tmp_path, monkeypatch):
    import specc.builder.memory

    monkeypatch.setattr(specc.builder.memory, "available_memory", lambda: 64 * 1024**2)
    with pytest.raises(BuildError, match="but 64.0 MiB is available"):
        specc.build(SPEC, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
    # an explicit limit overrides what the machine reports
    with pytest.raises(BuildError, match=r"but 512\.0 MiB is available"):
        specc.build(SPEC, tmp_path / "out", max_memory=GIB // 2)


def test_estimate_memory_grows_with_the_spec():
    est = {name: estimate_memory(resolve(load_spec(name))) for name in ("tiny-gpt2", "gpt2-small", "gpt2-medium")}
    assert est["tiny-gpt2"]["bytes"] < est["gpt2-small"]["bytes"] < est["gpt2-medium"]["bytes"]
    small = resolve(load_spec("gpt2-small"))
    fp32 = 4 * inspect_spec(small)["parameters"]
    assert fp32 > 400 * 1024**2  # ~124M parameters
    assert est["gpt2-small"]["weights"] == fp32
    assert est["gpt2-small"]["bytes"] >= 4 * fp32
    assert est["gpt2-small"]["activations"] > est["tiny-gpt2"]["activations"] > 0


# --- external data ---------------------------------------------------------------------------------


def _ort_outputs(path: Path) -> list[np.ndarray]:
    import onnxruntime as ort

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    b, s, past = 2, 5, 3
    feeds = {
        "input_ids": rng.integers(0, 1000, (b, s), dtype=np.int64),
        "attention_mask": np.ones((b, past + s), dtype=np.int64),
        "position_ids": np.tile(np.arange(past, past + s, dtype=np.int64), (b, 1)),
    }
    for layer in range(2):
        for kv in ("key", "value"):
            feeds[f"past_key_values.{layer}.{kv}"] = rng.standard_normal((b, 4, past, 16)).astype(np.float32)
    assert {i.name for i in sess.get_inputs()} == feeds.keys()
    return sess.run(None, feeds)


def test_external_data(built, tmp_path, monkeypatch):
    import onnx

    import specc.export.onnx as onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 1)
    out = tmp_path / "ext"
    result = specc.build(SPEC, out)
    # without keep_weights: the graph and its data are the weights' one copy
    assert [a["path"] for a in result.artifacts] == ["model.onnx", "model.onnx.data", *CLIENT_FILES, *COMPOSED]
    assert sorted(p.name for p in out.iterdir()) == sorted([MANIFEST, "model.onnx", "model.onnx.data", *CLIENT_FILES, *COMPOSED])
    for a in result.artifacts:
        assert sha(out / a["path"]) == a["sha256"]
    assert result.verification["passed"] is True
    assert (out / "model.onnx").stat().st_size < (out / "model.onnx.data").stat().st_size
    # the graph refers to its data by a relative name, so DIR can move
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    locations = {e.value for init in proto.graph.initializer for e in init.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}
    # onnxruntime loads it from DIR (the staging directory is gone) and computes what the
    # single-file build computes
    moved = tmp_path / "moved"
    out.rename(moved)
    got, want = _ort_outputs(moved / "model.onnx"), _ort_outputs(built[1] / "model.onnx")
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    # a cache hit checks the data file too
    assert specc.build(SPEC, moved).cached is True
    (moved / "model.onnx.data").write_bytes(b"")
    assert specc.build(SPEC, moved).cached is False


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, message", [
    ({"target": "foo"}, "unknown target 'foo'"),
    ({"target": "triton", "precision": "bf16"}, "precision bf16 is not built for target triton"),
    ({"precision": "bf16"}, "precision bf16 is not built for target onnx"),
    ({"precision": "fp64"}, "unknown precision 'fp64'"),
    ({"opset": 7}, "opset 7 is not supported"),
])
def test_refused_options_create_nothing(tmp_path, options, message):
    with pytest.raises(BuildError, match=message):
        specc.build(SPEC, tmp_path / "out", **options)
    assert list(tmp_path.iterdir()) == []


# --- the write stage ------------------------------------------------------------------------------


def test_every_layout_and_extra_of_the_targets_table_has_its_writer():
    """The write stage is the targets table read (specc/builder/write.py): each target's layout and
    extras name a writer, and every writer is named by a row's type."""
    import typing

    from specc.builder import write
    from specc.spec.targets import TARGETS, Target

    hints = typing.get_type_hints(Target)
    assert set(typing.get_args(hints["write"])) == set(write.LAYOUTS)
    assert set(typing.get_args(typing.get_args(hints["extras"])[0])) == set(write.EXTRAS)
    assert all(t.write in write.LAYOUTS and set(t.extras) <= set(write.EXTRAS) for t in TARGETS.values())
    assert TARGETS["onnx"].extras == ("clients", "inplace") and TARGETS["triton"].extras == ()


def test_the_manifest_lists_the_extras_of_the_target(built):
    """An onnx build of a decoder writes both of its target's extras, in the row's order, and
    records each in the manifest."""
    m = manifest(built[1])
    assert [k for k in m if k in ("clients", "inplace")] == ["clients", "inplace"]
    assert m["inplace"]["file"] in {a["path"] for a in m["artifacts"]}
