"""`specc build` (specc/cli.py): the summary on stdout, progress on stderr, --json / --quiet, the
cache hit, and the user errors (exit 1, a clear message, nothing written) and bad usage (exit 2).

In-process runs use click's CliRunner; --json and --quiet are also checked in a real process,
where anything a library prints to the file descriptors would show."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specc.cli import main
from specc.export.outdir import MANIFEST
from specc.builder.memory import estimate_memory
from specc.builder.pipeline import STAGES
from specc.report import human_bytes
from specc.spec import load_spec, resolve

from tests.helpers.spectext import DEC

pytestmark = pytest.mark.xdist_group("test_cli_build")  # one worker: the module's shared builds are made once

SPEC = "tiny-gpt2"
SPECC = Path(sys.executable).with_name("specc")
MANIFEST_KEYS = {"artifacts", "parameters", "verification", "versions", "graphs", "cached"}


def run(*args: str):
    result = CliRunner().invoke(main, list(args))
    # a SystemExit is how click reports an exit code; any other exception is a bug
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def specc_cmd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if not SPECC.exists():
        pytest.skip("the specc console script is not installed next to this Python")
    env = {k: v for k, v in os.environ.items() if k != "SPECC_DEBUG"}
    return subprocess.run([str(SPECC), *args], capture_output=True, text=True, timeout=180, cwd=cwd, env=env)


def listing(root: Path) -> dict[str, bytes | None]:
    return {p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def first(tmp_path_factory):
    """One plain `specc build tiny-gpt2 -o DIR`."""
    out = tmp_path_factory.mktemp("cli") / "out"
    return run("build", SPEC, "-o", str(out)), out


# --- a build --------------------------------------------------------------------------------------


def test_summary_lists_the_artifacts(first):
    result, out = first
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / MANIFEST).read_text())
    lines = result.stdout.splitlines()
    assert lines[0] == f"tiny-gpt2 -> {out}"
    for a in manifest["artifacts"]:
        row = next((l for l in lines if l.startswith(a["path"] + " ")), None)
        assert row is not None, f"{a['path']} not in the summary:\n{result.stdout}"
        assert a["sha256"][:12] in row and re.search(r" \d+(\.\d+)? (B|KiB|MiB) ", row), row
    assert "parameters: 139,264" in lines
    verified = [l for l in lines if l.startswith("verified:")]
    assert len(verified) == 1 and f"{len(manifest['verification']['cases'])} cases" in verified[0]
    assert "onnx fp32" in verified[0]
    assert "specc:" not in result.stdout  # progress is not on stdout


def test_progress_on_stderr_names_every_stage(first):
    result, _ = first
    lines = result.stderr.splitlines()
    got = [next((i for i, l in enumerate(lines) if l.startswith(f"specc: {stage} ")), None) for stage in STAGES]
    assert None not in got, f"stages missing from stderr:\n{result.stderr}"
    assert got == sorted(got)  # in pipeline order
    assert "139,264 parameters" in result.stderr
    assert "max |onnxruntime - torch|" in result.stderr
    assert "nodes" in result.stderr  # optimize: node counts
    assert "cache hit" not in result.stderr


def test_cache_hit_says_so(first):
    _, out = first
    before = listing(out)
    result = run("build", SPEC, "-o", str(out))
    assert result.exit_code == 0
    assert "cache hit" in result.stderr and "--force" in result.stderr
    assert result.stdout.splitlines()[0] == f"tiny-gpt2 -> {out} (cached)"
    assert "model.onnx" in result.stdout
    assert not any(l.startswith("specc: export") for l in result.stderr.splitlines())
    assert listing(out) == before


def test_json_on_a_cache_hit(first):
    _, out = first
    result = run("build", SPEC, "-o", str(out), "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert MANIFEST_KEYS <= doc.keys()
    assert doc["cached"] is True
    assert doc["out_dir"] == str(out)
    assert result.stderr == ""


def test_quiet_on_a_cache_hit(first):
    _, out = first
    result = run("build", SPEC, "-o", str(out), "-q")
    assert result.exit_code == 0
    assert result.stdout == "" and result.stderr == ""


# --- --json and --quiet in a real process ---------------------------------------------------------


@pytest.fixture(scope="module")
def process_json(tmp_path_factory):
    cwd = tmp_path_factory.mktemp("proc")
    return specc_cmd("build", SPEC, "-o", "out", "--json", cwd=cwd), cwd / "out"


def test_json_prints_one_document(process_json):
    proc, out = process_json
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)  # the whole of stdout: one JSON document, nothing else
    assert isinstance(doc, dict)
    assert MANIFEST_KEYS <= doc.keys()
    assert doc["cached"] is False
    assert doc["out_dir"] == str(out)
    assert [a["path"] for a in doc["artifacts"]] == ["model.onnx", "config.json", "generation_config.json",
                                                     "genai_config.json", "inplace.onnx"]
    assert doc["parameters"] == 139_264
    assert doc["verification"]["passed"] is True
    assert set(doc["graphs"]) == {"model"}
    assert {"specc", "torch", "onnx"} <= doc["versions"].keys()
    on_disk = json.loads((out / MANIFEST).read_text())
    assert {k: v for k, v in doc.items() if k not in ("out_dir", "cached")} == on_disk
    assert proc.stderr == ""  # no progress with --json, and no library noise


def test_quiet_prints_nothing(process_json):
    _, out = process_json
    proc = specc_cmd("build", SPEC, "-o", str(out), "--quiet", "--force")
    assert proc.returncode == 0
    assert proc.stdout == ""
    assert proc.stderr == ""
    assert (out / MANIFEST).is_file() and (out / "model.onnx").is_file()


# --- user errors: exit 1, a clear message, nothing written ------------------------------------------

# one line of the shared minimal decoder changed at a time
BAD_SPECS = {
    "unknown key": (DEC.replace("  size: 100\n", "  size: 100\n  sise: 3\n"), "^sise: 3", "unknown key 'sise'"),
    "bad value": (DEC.replace("heads: 4", "heads: 5"), "heads: ^5", "not divisible by heads 5"),
}


@pytest.mark.parametrize("case", BAD_SPECS)
def test_bad_spec_is_located(case, spec_file, position_of, tmp_path):
    text, needle, message = BAD_SPECS[case]
    path = spec_file(text, "bad.yaml")
    line, col = position_of(text, needle)
    out = tmp_path / "out"
    result = run("build", str(path), "-o", str(out))
    assert result.exit_code == 1
    assert f"{path}:{line}:{col}:" in result.stderr
    assert message in result.stderr
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    assert result.stdout == ""
    assert not out.exists()


def test_missing_weights_file(tmp_path):
    out = tmp_path / "out"
    weights = tmp_path / "nothere.safetensors"
    result = run("build", SPEC, "-o", str(out), "--weights", str(weights))
    assert result.exit_code == 1
    assert f"specc: error: {weights}: no such weights file" in result.stderr
    assert not out.exists()


def test_verifying_on_a_gpu_that_is_not_here_is_refused_before_work(tmp_path):
    """--verify-provider cuda where onnxruntime cannot create its CUDA provider (the CPU wheel, or
    onnxruntime-gpu without a GPU): exit 1 naming the option and why, nothing written."""
    import onnxruntime as ort

    from specc.runtime.graph import unusable_provider

    why = unusable_provider(ort, "cuda")
    if why is None:
        pytest.skip("onnxruntime's CUDA provider is usable here (tests/runtime/test_cuda.py covers it)")
    out = tmp_path / "out"
    result = run("build", SPEC, "-o", str(out), "--verify-provider", "cuda")
    assert result.exit_code == 1
    assert f"specc: error: --verify-provider cuda: {why}" in result.stderr
    assert not out.exists()


def test_verify_provider_is_recorded_and_cuda_is_another_build(first):
    """The manifest says where the graphs were verified; a CUDA verification has its own cache key
    (a CPU build's key is what it was before the option existed)."""
    from specc.builder import manifest as build_manifest

    _, out = first
    assert json.loads((out / MANIFEST).read_text())["verification"]["provider"] == "cpu"
    r = resolve(load_spec(SPEC))
    args = dict(target="onnx", opset=18, weights=None, seed=0, passes=[])  # the precision: the spec's, fp32
    plain = build_manifest.inputs(r, **args)
    assert build_manifest.inputs(r, **args, verify_provider="cpu").cache_key == plain.cache_key
    assert "verify_provider" not in plain.options
    assert build_manifest.inputs(r, **args, verify_provider="cuda").cache_key != plain.cache_key


def test_max_memory_too_small(tmp_path):
    need = estimate_memory(resolve(load_spec(SPEC)))["bytes"]
    out = tmp_path / "out"
    result = run("build", SPEC, "-o", str(out), "--max-memory", "1KiB")
    assert result.exit_code == 1
    assert f"needs about {human_bytes(need)}" in result.stderr
    assert "--max-memory" in result.stderr
    assert "but 1.0 KiB is available" in result.stderr
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("size, shown", [("512M", "512.0 MiB"), ("768MiB", "768.0 MiB"), ("900MB", "858.3 MiB"),
                                         ("1000000", "976.6 KiB"), (" 0.5GiB ", "512.0 MiB")])
def test_max_memory_units(tmp_path, size, shown):
    result = run("build", SPEC, "-o", str(tmp_path / "out"), "--max-memory", size)
    assert result.exit_code == 1
    assert f"but {shown} is available" in result.stderr


@pytest.mark.parametrize("size", ["nonsense", "12XB", "-1G", "", "1.2.3G"])
def test_max_memory_not_a_size(tmp_path, size):
    result = run("build", SPEC, "-o", str(tmp_path / "out"), "--max-memory", size)
    assert result.exit_code == 2
    assert "is not a size" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_out_dir_that_is_not_a_build(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    (out / "sub").mkdir()
    (out / "sub" / "data.bin").write_bytes(b"\x00\x01")
    before = listing(out)
    result = run("build", SPEC, "-o", str(out))
    assert result.exit_code == 1
    assert "not a specc build" in result.stderr and str(out) in result.stderr
    assert listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]


def test_a_folder_with_another_manifest_is_refused_before_work(tmp_path):
    """The data-loss report: a web app's folder, which has a manifest.json, was replaced whole."""
    out = tmp_path / "webapp"
    (out / "src").mkdir(parents=True)
    (out / MANIFEST).write_text('{"manifest_version": 3}\n')
    (out / "src" / "app.js").write_text("x")
    before = listing(out)
    result = run("build", SPEC, "-o", str(out), "-q")
    assert result.exit_code == 1
    assert f"{out / MANIFEST}: not a specc manifest" in result.stderr
    assert "build module" not in result.stderr  # refused before any work
    assert listing(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["webapp"]


def test_a_rebuild_keeps_the_users_files_and_builds_through_a_link(first, tmp_path):
    _, built = first
    real = tmp_path / "real"
    shutil.copytree(built, real)
    (real / "NOTES.md").write_text("my notes")
    (real / "results").mkdir()
    (real / "results" / "eval.csv").write_text("1,2\n")
    link = tmp_path / "link"
    link.symlink_to("real")
    old = json.loads((real / MANIFEST).read_text())
    result = run("build", SPEC, "-o", str(link), "--seed", "1", "-q")  # another seed: a real rebuild
    assert result.exit_code == 0, result.output
    new = json.loads((real / MANIFEST).read_text())
    assert new["options"]["weights"]["seed"] == 1 and new["artifacts"] != old["artifacts"]
    assert (real / "NOTES.md").read_text() == "my notes"
    assert (real / "results" / "eval.csv").read_text() == "1,2\n"
    assert link.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]  # no staging entry, no lock


def test_unknown_target_is_bad_usage(tmp_path):
    result = run("build", SPEC, "-o", str(tmp_path / "out"), "--target", "foo")
    assert result.exit_code == 2
    assert "foo" in result.stderr and "Usage" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_help_offers_only_precisions_a_target_builds(tmp_path):
    """bf16 is in the language but no target builds it yet: --help does not offer it, and asking
    for it is bad usage (exit 2) naming the choices, before any work."""
    help_text = run("build", "--help").stdout
    assert "fp32|fp16|int8|int4" in help_text and "bf16" not in help_text
    result = run("build", SPEC, "-o", str(tmp_path / "out"), "--precision", "bf16")
    assert result.exit_code == 2 and "'bf16' is not one of" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_spec_asking_for_an_unbuilt_precision_fails_clearly(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text("specc: 1\nextends: tiny-gpt2\nserving:\n  precision: bf16\n")
    result = run("build", str(spec), "-o", str(tmp_path / "out"))
    assert result.exit_code == 1
    assert "specc: error: precision bf16 is not built for target onnx yet; choose one of fp32, fp16, int8, int4" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("args, message", [
    (["--opset", "12"], "opset 12 is not supported"),
])
def test_unbuilt_options_fail_clearly(tmp_path, args, message):
    result = run("build", SPEC, "-o", str(tmp_path / "out"), *args)
    assert result.exit_code == 1
    assert f"specc: error: {message}" in result.stderr
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_missing_out_is_bad_usage():
    result = run("build", SPEC)
    assert result.exit_code == 2
    assert "--out" in result.stderr


def test_opset_zero_is_refused(tmp_path):
    # --max-memory 1KiB stops the build right after the option checks, should --opset 0 pass them
    result = run("build", SPEC, "-o", str(tmp_path / "out"), "--opset", "0", "--max-memory", "1KiB")
    assert result.exit_code == 1
    assert "opset 0 is not supported" in result.stderr


_ARENAS = """
import ctypes, sys, threading
from specc.malloc import one_arena
applied = one_arena() if sys.argv[1] == "1" else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
def grab():
    for _ in range(100):
        libc.malloc(4096)
threads = [threading.Thread(target=grab) for _ in range(4)]
for t in threads: t.start()
for t in threads: t.join()
print(applied, flush=True)
libc.malloc_stats()  # one "Arena N:" block per heap, on stderr
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc arenas")
@pytest.mark.parametrize("apply,env,arenas", [("0", {}, "many"), ("1", {}, "one"), ("1", {"MALLOC_ARENA_MAX": "4"}, "many")])
def test_build_keeps_one_malloc_arena_unless_the_user_chose(apply, env, arenas):
    """specc build asks glibc for one heap for all threads (a steadier peak); a user's
    MALLOC_ARENA_MAX wins."""
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env
    proc = subprocess.run([sys.executable, "-c", _ARENAS, apply], capture_output=True, text=True, env=environ, timeout=60)
    assert proc.returncode == 0, proc.stderr
    n = proc.stderr.count("Arena ")
    assert proc.stdout.strip() == {"0": "None", "1": str(not env)}[apply]
    assert (n == 1) if arenas == "one" else (n > 1), proc.stderr


# --- errors of the machine, numbers out of range, a closed pipe (issue 30's red-team findings) ----


@pytest.mark.parametrize("args", [
    ["build", SPEC, "-o", "OUT", "--seed", "-1"],
    ["build", SPEC, "-o", "OUT", "--seed", str(2**64)],
    ["export-weights", SPEC, "-o", "OUT/w.safetensors", "--seed", "-1"],
    ["generate", "OUT", "--ids", "1", "--eos-id", "9" * 30],
])
def test_numbers_out_of_range_are_refused_by_the_option_parser(tmp_path, args):
    result = run(*[a.replace("OUT", str(tmp_path / "out")) for a in args])
    assert result.exit_code == 2, result.output
    assert "is not in the range" in result.output and "internal error" not in result.output
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, where, meaning", [
    (["build", SPEC, "-o", "/proc/specc-test/out"], "/proc/specc-test", "No such file or directory"),
    (["build", SPEC, "-o", "LONG"], ".specc-lock", "File name too long"),
    (["export-weights", SPEC, "-o", "/proc/specc-test.safetensors"], "/proc/specc-test.safetensors", "No such file or directory"),
])
def test_errors_of_the_machine_are_one_plain_line(tmp_path, args, where, meaning):
    args = [str(tmp_path / ("a" * 300)) if a == "LONG" else a for a in args]
    result = specc_cmd(*args, "-q") if args[0] == "build" else specc_cmd(*args)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specc: error: "), result.stderr
    assert where in lines[0] and meaning in lines[0]
    assert "internal error" not in result.stderr and "bug" not in result.stderr


def test_a_closed_pipe_ends_the_command_quietly():
    """`specc inspect gpt2-small | head -1`: the reader leaves; no 'internal error', no traceback."""
    if not SPECC.exists():
        pytest.skip("the specc console script is not installed next to this Python")
    env = {k: v for k, v in os.environ.items() if k != "SPECC_DEBUG"}
    proc = subprocess.Popen([str(SPECC), "inspect", "gpt2-small"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    proc.stdout.close()  # the reader is gone before the first line (start-up takes longer)
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err  # 128 + SIGPIPE, as a program the signal ended
    assert err == ""
