"""Hostile files that reach `specc build` / `specc validate`: output names that would leave DIR,
and weights files with wrong names, shapes or dtypes, truncated, not safetensors, or a pickle
carrying code. Each is a user error (exit 1, one clear message naming the file and the key or
tensor, no traceback), nothing is written, and no code from a file ever runs.

(YAML tags, alias bombs and oversized spec files: tests/spec/test_yaml_hostile.py.)"""
from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path

import onnx
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

import specc
from specc.cli import main

from tests.helpers.spectext import DEC

SPEC = "tiny-gpt2"


def cli(*args: str):
    result = CliRunner().invoke(main, list(args))
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def everything_under(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*")}


# --- output names that would leave DIR -----------------------------------------------------------

ESCAPES = ["../evil", "a/b", "a\\b", "/tmp/evil", "..", ".", "x/../../y", "C:\\evil", "", "a b", "a\x00b"]


@pytest.mark.parametrize("name", ESCAPES, ids=repr)
def test_output_name_that_could_leave_dir_is_refused_at_validation(name, spec_file, tmp_path):
    text = DEC + f"outputs:\n  - kind: lm\n    name: {json.dumps(name)}\n"
    path = spec_file(text)
    line = len(text.splitlines())  # the name is the last line
    result = cli("validate", str(path))
    assert result.exit_code == 1
    assert f"{path}:{line}:" in result.output, result.output  # file and line of the name
    assert "outputs" in result.output and "name" in result.output
    before = everything_under(tmp_path)
    built = cli("build", str(path), "-o", str(tmp_path / "out"))
    assert built.exit_code == 1
    assert everything_under(tmp_path) == before  # nothing written, inside DIR or outside


@pytest.mark.parametrize("name", ["../up", "a/b", "/abs", "a\\b", ".."], ids=repr)
def test_model_name_that_could_leave_dir_is_refused(name, spec_file):
    path = spec_file(DEC.replace("name: t", f"name: {json.dumps(name)}"))
    result = cli("validate", str(path))
    assert result.exit_code == 1
    assert f"{path}:2:" in result.output and "name" in result.output, result.output


def test_valid_output_name_is_only_a_graph_output(spec_file, tmp_path):
    # the control: an ordinary name builds, names a graph output, and no file
    path = spec_file(DEC + "outputs:\n  - kind: lm\n    name: scores\n")
    assert cli("validate", str(path)).exit_code == 0
    out = tmp_path / "out"
    r = specc.build(path, out)
    graph = onnx.load(str(out / "model.onnx"), load_external_data=False)
    assert [o.name for o in graph.graph.output][0] == "scores"
    assert everything_under(out) == {a["path"] for a in r.artifacts} | {"manifest.json"}
    assert not any("scores" in p for p in everything_under(tmp_path))


# --- weights files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("w") / "good.safetensors"
    specc.save_weights(specc.to_torch(SPEC, seed=3), path)
    return path, load_file(str(path))


def build_with(weights: Path, tmp_path: Path):
    out = tmp_path / "out"
    result = cli("build", SPEC, "-o", str(out), "--weights", str(weights))
    assert result.exit_code == 1, result.output
    assert str(weights) in result.output or weights.name in result.output
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.")] == []
    return result.output


def test_missing_tensor_is_named(good, tmp_path):
    tensors = dict(good[1])
    gone = sorted(tensors)[-1]
    del tensors[gone]
    save_file(tensors, str(tmp_path / "w.safetensors"))
    msg = build_with(tmp_path / "w.safetensors", tmp_path)
    assert "missing" in msg and gone in msg


def test_renamed_tensor_is_named_both_ways(good, tmp_path):
    tensors = dict(good[1])
    old = sorted(tensors)[0]
    tensors["renamed." + old] = tensors.pop(old)
    save_file(tensors, str(tmp_path / "w.safetensors"))
    msg = build_with(tmp_path / "w.safetensors", tmp_path)
    assert "missing" in msg and old in msg
    assert "unexpected" in msg and "renamed." + old in msg


def test_wrong_shape_is_named_with_both_shapes(good, tmp_path):
    tensors = dict(good[1])
    name = next(n for n, t in sorted(tensors.items()) if t.dim() == 2)
    t = tensors[name]
    tensors[name] = torch.zeros(t.shape[0] + 1, t.shape[1])
    save_file(tensors, str(tmp_path / "w.safetensors"))
    msg = build_with(tmp_path / "w.safetensors", tmp_path)
    assert "wrong shape" in msg and name in msg
    assert str((t.shape[0] + 1, t.shape[1])) in msg and str(tuple(t.shape)) in msg


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64, torch.bool, torch.uint8])
def test_non_float_dtype_is_named(good, tmp_path, dtype):
    tensors = dict(good[1])
    name = sorted(tensors)[1]
    tensors[name] = torch.ones_like(tensors[name], dtype=dtype)
    save_file(tensors, str(tmp_path / "w.safetensors"))
    msg = build_with(tmp_path / "w.safetensors", tmp_path)
    assert "not a float dtype" in msg and name in msg and str(dtype) in msg


@pytest.mark.parametrize("keep", [0.0, 0.001, 0.5, 0.999])
def test_truncated_safetensors(good, tmp_path, keep):
    data = good[0].read_bytes()
    cut = max(1, int(len(data) * keep)) if keep else 0
    (tmp_path / "w.safetensors").write_bytes(data[:cut] if keep < 1 else data[:-1])
    msg = build_with(tmp_path / "w.safetensors", tmp_path)
    assert "cannot read safetensors" in msg and "truncated" in msg


def test_header_claiming_a_huge_length(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    msg = build_with(tmp_path / "w.safetensors", tmp_path)
    assert "cannot read safetensors" in msg


def test_header_that_is_not_json(tmp_path):
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", 8) + b"not json" + b"\0" * 16)
    assert "cannot read safetensors" in build_with(tmp_path / "w.safetensors", tmp_path)


def test_offsets_past_the_end(good, tmp_path):
    header = b'{"x":{"dtype":"F32","shape":[1000000],"data_offsets":[0,4000000]}}'
    (tmp_path / "w.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 64)
    assert "cannot read safetensors" in build_with(tmp_path / "w.safetensors", tmp_path)


class _Payload:
    """Unpickling this would create the marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize("suffix", [".bin", ".pt", ".safetensors", ".pkl"])
def test_pickle_with_code_is_refused_and_never_run(tmp_path, suffix):
    marker = tmp_path / "PWNED"
    # the control: loading this file the unsafe way does run the code
    evil = tmp_path / f"evil{suffix}"
    evil.write_bytes(pickle.dumps({"w": _Payload(marker)}))
    pickle.loads(evil.read_bytes())
    assert marker.exists()
    marker.unlink()
    msg = build_with(evil, tmp_path)
    assert not marker.exists(), "the pickle's code ran"
    assert "safetensors" in msg
    torch.save({"w": _Payload(marker)}, evil)  # the same payload in torch's zip format
    assert not marker.exists()
    build_with(evil, tmp_path)
    assert not marker.exists(), "the torch.save'd pickle's code ran"


def test_a_directory_as_weights(tmp_path):
    (tmp_path / "d.safetensors").mkdir()
    result = cli("build", SPEC, "-o", str(tmp_path / "out"), "--weights", str(tmp_path / "d.safetensors"))
    assert result.exit_code in (1, 2) and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_the_good_file_builds(good, tmp_path):
    # the control for all of the above
    out = tmp_path / "out"
    result = cli("build", SPEC, "-o", str(out), "--weights", str(good[0]), "--keep-weights")
    assert result.exit_code == 0, result.output
    assert torch.equal(load_file(str(out / "model.safetensors"))[sorted(good[1])[0]], good[1][sorted(good[1])[0]])
