"""A Session opens only the graphs its build verified (specc/runtime/session.py check_graph_files):
each graph file is listed in the manifest with the sha256 it has now; check_hashes=False and
`--no-hash-check` skip the check."""
from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.runtime import RunError, Session

pytestmark = pytest.mark.xdist_group("test_hash_check")  # one worker: the module's shared builds are made once


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = tmp_path_factory.mktemp("hash") / "good"
    specc.build("tiny-gpt2", out)
    return out


@pytest.fixture
def copy(good, tmp_path):
    dst = tmp_path / "build"
    shutil.copytree(good, dst)
    return dst


def flip(path, at: int = -64) -> None:
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def test_an_intact_build_opens_and_runs(good):
    out = Session(good).run(input_ids=[[1, 2, 3]])
    assert out["logits"].shape == (1, 3, 1000)


def test_a_changed_graph_is_refused_naming_it(copy):
    flip(copy / "model.onnx")
    with pytest.raises(RunError, match=r"model\.onnx: changed since the build verified it"):
        Session(copy)
    result = CliRunner().invoke(main, ["run", str(copy), "--ids", "1,2"])
    assert result.exit_code == 1 and "changed since the build verified it" in result.output
    assert "Traceback" not in result.output


def test_the_check_can_be_skipped(copy, good):
    manifest = json.loads((copy / "manifest.json").read_text())
    for a in manifest["artifacts"]:
        if a["path"] == "model.onnx":
            a["sha256"] = "0" * 64  # the file is intact; only the record disagrees
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RunError, match="changed since"):
        Session(copy)
    assert Session(copy, check_hashes=False).run(input_ids=[[1, 2]])["logits"].shape == (1, 2, 1000)
    result = CliRunner().invoke(main, ["run", str(copy), "--ids", "1,2", "--no-hash-check"])
    assert result.exit_code == 0, result.output


def test_a_graph_missing_from_the_artifacts_is_refused(copy):
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["path"] != "model.onnx"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(RunError, match="model.onnx is not among the build's artifacts"):
        Session(copy)
