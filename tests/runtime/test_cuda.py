"""The GPU path for real: builds verified on onnxruntime's CUDA execution provider, and Session,
run, generate and the CLI on it, against the same builds on the CPU provider. Skipped unless
onnxruntime-gpu can create its CUDA provider here (a CUDA GPU and CUDA 13's libraries); run on a
GPU machine with `pytest -m gpu tests/runtime/test_cuda.py`."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

import specc
from specc.runtime import Session
from specc.runtime.graph import unusable_provider
from specc.spec.io import is_past, present_to_past
from specc.spec.targets import CUDA_TOLERANCES

ort = pytest.importorskip("onnxruntime")
WHY = unusable_provider(ort, "CUDAExecutionProvider")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(WHY is not None, reason=f"needs onnxruntime's CUDA provider: {WHY}")]

CUDA = "CUDAExecutionProvider"
PROMPTS = [[5, 6, 7], [400, 12, 999, 81, 3, 77]]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """(spec, precision, verified on) -> build directory: builds verified on CUDA, and one on the
    CPU to compare the graphs with (the CLI test builds tiny-llama)."""
    root = tmp_path_factory.mktemp("cuda")
    out = {}
    for spec, precision, provider in (("tiny-gpt2", "fp32", "cuda"), ("tiny-gpt2", "fp16", "cuda"),
                                      ("tiny-gpt2", "fp16", "cpu"), ("tiny-transformer", "fp32", "cuda"),
                                      ("tiny-bert", "fp16", "cuda")):
        d = root / f"{spec}-{precision}-{provider}"
        specc.build(spec, d, precision=precision, verify_provider=provider, progress=None)
        out[(spec, precision, provider)] = d
    return out


def manifest(d):
    return json.loads((d / "manifest.json").read_text())


@pytest.mark.parametrize("spec,precision", [("tiny-gpt2", "fp32"), ("tiny-gpt2", "fp16"), ("tiny-transformer", "fp32"),
                                            ("tiny-bert", "fp16")])
def test_build_verifies_on_cuda(builds, spec, precision):
    """Verification ran on CUDA, every case within the CUDA tolerance (the build would have failed
    otherwise; the manifest records it)."""
    v = manifest(builds[(spec, precision, "cuda")])["verification"]
    assert v["provider"] == "cuda"
    atol, rtol = CUDA_TOLERANCES[("onnx", precision)]
    assert v["tolerance"] == {"atol": atol, "rtol": rtol}
    assert v["cases"] and v["max_abs_diff"] > 0


def test_cuda_verified_graphs_are_the_cpu_builds(builds):
    """Where a build is verified changes no byte of its graphs, only its manifest (and cache key)."""
    cpu, cuda = manifest(builds[("tiny-gpt2", "fp16", "cpu")]), manifest(builds[("tiny-gpt2", "fp16", "cuda")])
    assert cpu["verification"]["provider"] == "cpu"
    graphs = {a["path"]: a["sha256"] for a in cpu["artifacts"] if a["path"].endswith((".onnx", ".onnx.data"))}
    assert graphs and graphs == {a["path"]: a["sha256"] for a in cuda["artifacts"] if a["path"] in graphs}
    assert cpu["cache_key"] != cuda["cache_key"]


@pytest.mark.parametrize("spec,precision", [("tiny-gpt2", "fp32"), ("tiny-gpt2", "fp16"), ("tiny-bert", "fp16")])
def test_session_on_cuda_runs_as_on_cpu(builds, spec, precision):
    d = builds[(spec, precision, "cuda")]
    on_gpu, on_cpu = Session(d, provider="cuda"), Session(d, provider="cpu")
    assert on_gpu.provider == CUDA and on_cpu.provider == "CPUExecutionProvider"
    ids = np.asarray([[5, 6, 7, 8, 9]], dtype=np.int64)
    got, want = on_gpu.run(input_ids=ids), on_cpu.run(input_ids=ids)
    atol, rtol = CUDA_TOLERANCES[("onnx", precision)]
    for name, w in want.items():
        assert got[name].shape == w.shape
        assert np.abs(got[name].astype(np.float32) - w.astype(np.float32)).max() <= atol + rtol * np.abs(w).max(), name


@pytest.mark.parametrize("spec", ["tiny-gpt2", "tiny-transformer"])
def test_greedy_generation_on_cuda_equals_cpu(builds, spec):
    d = builds[(spec, "fp32", "cuda")]
    got = Session(d, provider="cuda").generate(PROMPTS, max_new_tokens=8).ids
    want = Session(d, provider="cpu").generate(PROMPTS, max_new_tokens=8).ids
    assert got == want


@pytest.mark.parametrize("spec,precision", [("tiny-gpt2", "fp32"), ("tiny-gpt2", "fp16"), ("tiny-transformer", "fp32")])
def test_generation_keeps_the_cache_on_the_device(builds, spec, precision):
    """Every step after the first is fed its cache as onnxruntime values on the GPU (never numpy
    from the host), and the presents it makes stay there."""
    s = Session(builds[(spec, precision, "cuda")], provider="cuda")
    graph = s.graphs["decoder" if spec == "tiny-transformer" else "model"]
    seen = []
    run = graph.run

    def spy(feeds, into=None):
        out = run(feeds, into)
        seen.append(({n: v for n, v in feeds.items() if is_past(n)}, present_to_past(out)))
        return out

    graph.run = spy
    s.generate(PROMPTS, max_new_tokens=6)
    assert len(seen) == 6
    for i, (pasts, presents) in enumerate(seen):
        assert all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cuda" for v in presents.values())
        if i:  # the first call's growing caches are empty arrays made on the host
            assert pasts and all(isinstance(v, ort.OrtValue) and v.device_name().lower() == "cuda"
                                 for v in pasts.values()), i


def test_cli_build_run_generate_on_cuda(tmp_path):
    d = tmp_path / "llama"
    # the CLI in a process of its own, as installed or from the checkout (PYTHONPATH=.)
    cli = [sys.executable, "-c", "from specc.cli import main; main()"]
    done = subprocess.run(cli + ["build", "tiny-llama", "-o", str(d), "--precision", "fp16", "--verify-provider", "cuda",
                                 "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["verification"]["provider"] == "cuda"
    done = subprocess.run(cli + ["run", str(d), "--provider", "cuda", "--ids", "5,6,7"], capture_output=True, text=True)
    assert done.returncode == 0 and CUDA in done.stdout, done.stderr
    done = subprocess.run(cli + ["generate", str(d), "--provider", "cuda", "--ids", "5,6,7", "--max-new-tokens", "4",
                                 "--json"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert len(json.loads(done.stdout)["new_ids"][0]) == 4


@pytest.fixture(scope="module")
def llama_fp16(tmp_path_factory):
    """tiny-llama fp16, verified on CUDA: a build whose in-place graph the GPU decoder replays."""
    d = tmp_path_factory.mktemp("cuda") / "tiny-llama-fp16"
    specc.build("tiny-llama", d, precision="fp16", verify_provider="cuda", progress=None)
    return d


def test_captured_decoding_gives_the_uncaptured_tokens(llama_fp16):
    """Each decode step one replayed CUDA graph (specc/runtime/captured.py): the same greedy tokens
    as the same bound buffers run step by step without capture (the same kernels), and as
    model.onnx on CUDA (its cache on the device, no in-place graph) over the first steps, where
    fp16 near-ties of random weights have not yet parted the two graphs; a second generation
    replays the same capture."""
    prompts = [[5, 17, 33, 2, 9, 81], [7, 7, 1, 400, 3, 12]]
    captured = Session(llama_fp16, provider="cuda")
    assert captured.captured(2) is not None and captured.captured(2).replay.get_run_config_entry("gpu_graph_id") == "2"
    plain = Session(llama_fp16, provider="cuda", cuda_graph=False)
    model = Session(llama_fp16, provider="cuda", inplace=False)
    assert model.captured(2) is None
    want = plain.generate(prompts, max_new_tokens=24).new_ids
    assert [r[:8] for r in model.generate(prompts, max_new_tokens=8).new_ids] == [r[:8] for r in want]
    for _ in range(3):  # capture (after onnxruntime's warm-up runs), then replays
        assert captured.generate(prompts, max_new_tokens=24).new_ids == want
    one = captured.generate([prompts[0]], max_new_tokens=24).new_ids  # another row count: its own capture
    assert one == plain.generate([prompts[0]], max_new_tokens=24).new_ids


def test_captured_decoding_samples_as_the_uncaptured_steps(llama_fp16):
    """Seeded sampling draws the same tokens through the replayed steps as through the same steps
    run without capture."""
    prompts = [[5, 17, 33, 2]]
    options = dict(max_new_tokens=16, temperature=0.8, top_p=0.9, seed=3)
    got = Session(llama_fp16, provider="cuda").generate(prompts, **options)
    want = Session(llama_fp16, provider="cuda", cuda_graph=False).generate(prompts, **options)
    assert got.new_ids == want.new_ids


def test_an_fp32_build_has_no_captured_decoder(builds):
    """onnxruntime's CUDA GroupQueryAttention computes fp16 and bf16 alone: an fp32 build decodes
    through model.onnx on the GPU."""
    assert Session(builds[("tiny-gpt2", "fp32", "cuda")], provider="cuda").captured(1) is None
