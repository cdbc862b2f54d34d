"""Execution providers: short names ("cuda", "tensorrt"/"trt", "cpu"), the per-process probe of
whether a GPU provider can really be created (specc/runtime/graph.py), and the fallback to CPU with
one line on stderr when it cannot: with a stand-in onnxruntime here, and for real where the
installed onnxruntime is onnxruntime-gpu on a machine without a usable GPU
(`make install RUNTIME=gpu`)."""
from __future__ import annotations

import ctypes
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.deps import installed_runtimes
from specc.runtime import RunError, Session, choose_providers
from specc.runtime import graph as runtime_graph
from specc.runtime import session as runtime_session

ort = pytest.importorskip("onnxruntime")

CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"
NOTICE = "specc: CUDAExecutionProvider is not usable here (no CUDA GPU or CUDA libraries); running on CPUExecutionProvider"


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    # under the session's base temp dir: the other runtime test modules may have built it already
    return specc.build("tiny-gpt2", tmp_path_factory.getbasetemp() / "specc-runtime-builds" / "tiny-gpt2").out_dir


@pytest.fixture
def fresh(monkeypatch):
    """The probe cache and the notices given, emptied for one test (both are per process)."""
    monkeypatch.setattr(runtime_graph, "_PROBED", {})
    monkeypatch.setattr(runtime_graph, "_NOTICED", set())


class StandIn:
    """onnxruntime as onnxruntime-gpu is on a machine without a GPU: CUDA and TensorRT listed
    available, but a session asked for one of them comes up on CPU (after printing, warning and
    logging, as onnxruntime does), or raises where `raises`. `usable` names the GPU providers that
    do work. Everything else is the real onnxruntime."""

    def __init__(self, usable=(), raises=False):
        self.usable, self.raises = set(usable), raises
        self.opened: list[list[str]] = []  # the providers of each session asked for
        self.severities: list[int] = []
        real = ort.InferenceSession
        stand_in = self

        class InferenceSession:
            def __init__(self, model, options=None, providers=None, **kw):
                # names, or (name, options) pairs as onnxruntime takes them
                providers = [p[0] if isinstance(p, tuple) else p for p in providers or [CPU]]
                stand_in.opened.append(providers)
                ok = [p for p in providers if p == CPU or p in stand_in.usable]
                if len(ok) < len(providers):
                    if stand_in.raises:
                        raise RuntimeError("Failed to load library libonnxruntime_providers_cuda.so\nmore lines")
                    print("*************** EP Error ***************")
                    warnings.warn("Failed to create CUDAExecutionProvider")
                self._real = real(model, options, providers=ok or [CPU], **kw)
                self._providers = ok or [CPU]

            def get_providers(self):
                return self._providers

            def __getattr__(self, name):
                return getattr(self._real, name)

        self.InferenceSession = InferenceSession

    def get_available_providers(self):
        return [TRT, CUDA, CPU]

    def set_default_logger_severity(self, level: int) -> None:
        self.severities.append(level)

    def __getattr__(self, name):
        return getattr(ort, name)


# --- names ---------------------------------------------------------------------------------------


def test_short_names_in_any_case():
    available = [TRT, CUDA, CPU]
    assert choose_providers(available, ["cuda"]) == [CUDA, CPU]
    assert choose_providers(available, ["CUDA"]) == [CUDA, CPU]
    assert choose_providers(available, ["tensorrt"]) == [TRT, CPU]
    assert choose_providers(available, ["TRT", "Cuda"]) == [TRT, CUDA, CPU]
    assert choose_providers(available, ["cpu"]) == [CPU]
    assert choose_providers([CPU], ["Cpu"]) == [CPU]


def test_full_names_still_taken_and_repeats_asked_once():
    available = [TRT, CUDA, CPU]
    assert choose_providers(available, [CUDA]) == [CUDA, CPU]
    assert choose_providers(available, ["cudaexecutionprovider"]) == [CUDA, CPU]
    assert choose_providers(available, ["cuda", CUDA, "cpu"]) == [CUDA, CPU]


def test_an_unknown_or_unavailable_provider_is_an_error_naming_the_available_ones():
    with pytest.raises(RunError) as info:
        choose_providers([CPU], ["cuda"])
    assert CUDA in str(info.value) and "not available" in str(info.value) and CPU in str(info.value)
    with pytest.raises(RunError) as info:
        choose_providers(["AzureExecutionProvider", CPU], ["NoSuchExecutionProvider"])
    message = str(info.value)
    assert "NoSuchExecutionProvider" in message and "AzureExecutionProvider" in message and CPU in message


def test_session_takes_one_provider_or_a_list_not_both(gpt2):
    assert Session(gpt2, provider="cpu").providers == [CPU]
    assert Session(gpt2, providers=["cpu"]).providers == [CPU]
    with pytest.raises(TypeError, match="not both"):
        Session(gpt2, providers=["cpu"], provider="cpu")
    with pytest.raises(RunError, match="NoSuchExecutionProvider"):
        Session(gpt2, provider="NoSuchExecutionProvider")


def test_cli_provider_short_name(gpt2):
    result = CliRunner().invoke(main, ["run", str(gpt2), "--ids", "1,2,3", "--provider", "cpu"])
    assert result.exit_code == 0, result.output
    assert "on CPUExecutionProvider" in result.stdout


# --- the fallback, with a stand-in onnxruntime -------------------------------------------------


def test_a_gpu_provider_that_cannot_be_created_is_dropped_with_one_notice(fresh, capsys):
    fake = StandIn()
    assert runtime_graph.usable_providers(fake, [CUDA, CPU]) == [CPU]
    captured = capsys.readouterr()
    assert captured.err == NOTICE + "\n"
    assert captured.out == ""  # onnxruntime's own fallback prints stayed in the probe
    assert fake.opened == [[CUDA]]  # the probe asks for the provider alone
    assert fake.severities == [4, 2]  # logging silenced for the probe, then back to the default
    # once per process: neither a second probe nor a second notice
    assert runtime_graph.usable_providers(fake, [CUDA, CPU]) == [CPU]
    assert capsys.readouterr().err == ""
    assert fake.opened == [[CUDA]]


def test_the_default_providers_fall_back_in_one_line(fresh, capsys):
    fake = StandIn(raises=True)
    chosen = choose_providers(fake.get_available_providers())
    assert chosen == [TRT, CUDA, CPU]
    assert runtime_graph.usable_providers(fake, chosen) == [CPU]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"specc: {TRT} and {CUDA} are not usable here (")
    assert err.endswith("; running on CPUExecutionProvider\n")


def test_a_usable_gpu_provider_is_kept_silently(fresh, capsys):
    fake = StandIn(usable={CUDA})
    # TensorRT falls back to CUDA without a word (the session's provider says what runs)
    assert runtime_graph.usable_providers(fake, [TRT, CUDA, CPU]) == [CUDA, CPU]
    assert runtime_graph.usable_providers(fake, [CUDA, CPU]) == [CUDA, CPU]
    assert capsys.readouterr().err == ""


def test_unusable_provider_says_why_and_entries_are_full_names(fresh, capsys):
    fake = StandIn(usable={TRT})
    assert runtime_graph.unusable_provider(fake, "cuda") == f"{CUDA} is not usable here (no CUDA GPU or CUDA libraries)"
    assert runtime_graph.unusable_provider(fake, "trt") is None
    assert runtime_graph.unusable_provider(fake, "cpu") is None
    assert "not available" in runtime_graph.unusable_provider(fake, "NoSuchExecutionProvider")
    assert capsys.readouterr().err == ""  # a question, not a fallback: no notice
    # CUDA with TF32 off, as builds are verified there
    assert runtime_graph.provider_entries(["cuda", "CPU", CPU]) == [(CUDA, {"use_tf32": "0"}), CPU]


def test_session_with_cuda_runs_on_cpu_after_one_notice(fresh, monkeypatch, gpt2, capsys):
    fake = StandIn()
    monkeypatch.setattr(runtime_session, "require_onnxruntime", lambda purpose="": fake)
    s = Session(gpt2, provider="cuda")
    assert s.provider == CPU and s.providers == [CPU]
    assert s.run(input_ids=[[1, 2, 3]])["logits"].shape[:2] == (1, 3)
    assert fake.opened[1:] == [[CPU]]  # the graph itself (opened when run) is never asked for CUDA
    assert Session(gpt2, providers=["CUDA"]).provider == CPU
    captured = capsys.readouterr()
    assert captured.err == NOTICE + "\n" and captured.out == ""


def test_cli_provider_cuda_falls_back(fresh, monkeypatch, gpt2):
    monkeypatch.setattr(runtime_session, "require_onnxruntime", lambda purpose="": StandIn())
    result = CliRunner().invoke(main, ["run", str(gpt2), "--ids", "1,2,3", "--provider", "cuda"])
    assert result.exit_code == 0, result.output
    assert result.stderr == NOTICE + "\n"
    assert "on CPUExecutionProvider" in result.stdout


# --- for real: onnxruntime-gpu without a usable GPU ---------------------------------------------


def cuda_devices() -> int:
    """CUDA devices the driver sees (0 without a driver), asked of libcuda itself."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


ORT_GPU_WITHOUT_GPU = (installed_runtimes() == ["onnxruntime-gpu"] and CUDA in ort.get_available_providers()
                       and cuda_devices() == 0)


@pytest.mark.skipif(not ORT_GPU_WITHOUT_GPU,
                    reason="needs onnxruntime-gpu installed on a machine without a usable CUDA GPU")
def test_onnxruntime_gpu_without_a_gpu_runs_on_cpu_with_one_line(gpt2):
    code = ("from specc.runtime import Session\n"
            f"s = Session({str(gpt2)!r}, provider='cuda')\n"
            "print(s.provider, s.providers)\n"
            "s.run(input_ids=[[1, 2, 3]])\n"
            f"Session({str(gpt2)!r}, provider='cuda')\n"  # a second session: no second notice
            f"Session({str(gpt2)!r})\n")  # the default providers (TensorRT, CUDA, CPU) also fall back quietly
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "CPUExecutionProvider ['CPUExecutionProvider']\n"
    assert done.stderr == NOTICE + "\n"
    # the CLI: `specc run --provider cuda`, in its own process
    specc_cli = Path(sys.executable).with_name("specc")
    done = subprocess.run([str(specc_cli), "run", str(gpt2), "--ids", "1,2,3", "--provider", "cuda"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "on CPUExecutionProvider" in done.stdout
    assert done.stderr == NOTICE + "\n"
