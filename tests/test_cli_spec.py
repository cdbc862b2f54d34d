"""`specc validate / resolve / schema / --version` (design/cli.md): exit codes 0 / 1 / 2, one line
per spec, the JSON shapes, catalog names as SPEC, and never a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.spec import load_spec, loads_spec
from specc.spec.dump import spec_to_data
from specc.spec.resolve import explicit

from tests.helpers.spectext import DEC

VALID = DEC

# two mistakes: an unknown key (line 6) and heads out of range (line 10)
INVALID = VALID.replace("  size: 100\n", "  size: 100\n  sise: 100\n").replace("heads: 4", "heads: 0")
INVALID_ONE = VALID.replace("heads: 4", "heads: 5")

ERROR_KEYS = {"file", "line", "column", "key", "message"}


def run(*args: str):
    result = CliRunner().invoke(main, list(args))
    # a SystemExit is how click reports an exit code; any other exception is a bug
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


@pytest.fixture
def specs(spec_file):
    return {
        "valid": spec_file(VALID, "valid.yaml"),
        "invalid": spec_file(VALID.replace("  size: 100\n", "  size: 100\n  sise: 100\n"), "invalid.yaml"),
        "invalid_one": spec_file(INVALID_ONE, "invalid_one.yaml"),
    }


# --- validate ---------------------------------------------------------------------------------


def test_validate_valid(specs):
    result = run("validate", str(specs["valid"]))
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [f"{specs['valid']}: valid"]


def test_validate_invalid_prints_located_issue(specs):
    path = specs["invalid_one"]
    result = run("validate", str(path))
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [f"{path}: invalid (1 error)"]
    assert f"{path}:10:12: decoder.attention.heads: d_model 64 is not divisible by heads 5" in result.stderr


def test_validate_reports_every_issue(spec_file):
    path = spec_file(INVALID, "two.yaml")
    result = run("validate", str(path))
    assert result.exit_code == 1
    assert result.stdout.splitlines() == [f"{path}: invalid (2 errors)"]
    err = result.stderr
    assert f"{path}:7:3: vocab.sise: unknown key 'sise'" in err
    assert f"{path}:11:12: decoder.attention.heads:" in err
    assert err.index("vocab.sise") < err.index("decoder.attention.heads")


def test_validate_mixed(specs, tmp_path):
    missing = tmp_path / "missing.yaml"
    result = run("validate", str(specs["valid"]), str(specs["invalid_one"]), "tiny-gpt2", str(missing))
    assert result.exit_code == 1
    lines = result.stdout.splitlines()
    assert len(lines) == 4
    assert lines[0] == f"{specs['valid']}: valid"
    assert lines[1].startswith(f"{specs['invalid_one']}: invalid")
    assert lines[2] == "tiny-gpt2: valid"
    assert lines[3].startswith(f"{missing}: invalid")


def test_validate_json_shape(specs):
    result = run("validate", "--json", str(specs["valid"]), str(specs["invalid_one"]))
    assert result.exit_code == 1
    doc = json.loads(result.stdout)  # one JSON document and nothing else on stdout
    assert list(doc) == ["specs"]
    assert [set(s) for s in doc["specs"]] == [{"path", "valid", "errors"}] * 2
    ok, bad = doc["specs"]
    assert ok == {"path": str(specs["valid"]), "valid": True, "errors": []}
    assert bad["path"] == str(specs["invalid_one"]) and bad["valid"] is False
    [err] = bad["errors"]
    assert set(err) == ERROR_KEYS
    assert err == {
        "file": str(specs["invalid_one"]),
        "line": 10,
        "column": 12,
        "key": "decoder.attention.heads",
        "message": err["message"],
    }
    assert "divisible" in err["message"]


def test_validate_json_all_valid_exits_0(specs):
    result = run("validate", "--json", str(specs["valid"]), "tiny-bert")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert [s["valid"] for s in doc["specs"]] == [True, True]


def test_validate_json_missing_file(tmp_path):
    missing = tmp_path / "nope.yaml"
    result = run("validate", "--json", str(missing))
    assert result.exit_code == 1
    [entry] = json.loads(result.stdout)["specs"]
    assert entry["valid"] is False
    [err] = entry["errors"]
    assert set(err) == ERROR_KEYS and err["file"] == str(missing)


@pytest.mark.parametrize("name", ["tiny-gpt2", "gpt2-small", "transformer-base"])
def test_validate_catalog_name(name):
    result = run("validate", name)
    assert result.exit_code == 0
    assert result.stdout.splitlines() == [f"{name}: valid"]


def test_validate_near_miss_catalog_name_suggests():
    result = run("validate", "gpt2-smal")
    assert result.exit_code == 1
    assert "did you mean 'gpt2-small'?" in result.stderr


def test_validate_hostile_file(spec_file, tmp_path):
    marker = tmp_path / "pwned_specc"
    path = spec_file(VALID + f'description: !!python/object/apply:os.system ["touch {marker}"]\n')
    result = run("validate", str(path))
    assert result.exit_code == 1
    assert f"{path}:11:14: description:" in result.stderr
    assert not marker.exists()


# --- resolve ----------------------------------------------------------------------------------


def test_resolve_prints_yaml_that_loads_back_equal(specs):
    result = run("resolve", str(specs["valid"]))
    assert result.exit_code == 0
    again = loads_spec(result.stdout)
    assert again == explicit(load_spec(specs["valid"]))
    assert again.decoder.attention.d_k == 16  # defaults and derived values are written out


def test_resolve_catalog_name_merges_extends():
    result = run("resolve", "tiny-gpt2")
    assert result.exit_code == 0
    assert "extends: tiny" not in result.stdout and "extends: gpt2" not in result.stdout
    assert loads_spec(result.stdout) == explicit(load_spec("tiny-gpt2"))


def test_resolve_json():
    result = run("resolve", "--json", "tiny-transformer")
    assert result.exit_code == 0
    data = json.loads(result.stdout)
    assert data == spec_to_data(explicit(load_spec("tiny-transformer")))
    assert data["decoder"]["cross_attention"]["heads"] == 4


def test_resolve_invalid_spec(specs):
    path = specs["invalid_one"]
    result = run("resolve", str(path))
    assert result.exit_code == 1
    assert result.stdout == ""
    assert f"{path}:10:12: decoder.attention.heads:" in result.stderr


# --- schema, version --------------------------------------------------------------------------


def test_schema_prints_json():
    result = run("schema")
    assert result.exit_code == 0
    assert json.loads(result.stdout)["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_version():
    result = run("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"specc {specc.__version__}"


# --- bad usage: exit 2 ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args",
    [
        ["validate"],
        ["resolve"],
        ["resolve", "tiny-gpt2", "tiny-bert"],
        ["validate", "--bogus", "tiny-gpt2"],
        ["no-such-command"],
        ["schema", "extra"],
    ],
    ids=["validate-no-spec", "resolve-no-spec", "resolve-two-specs", "unknown-option", "unknown-command",
         "schema-extra-arg"],
)
def test_bad_usage_exits_2(args):
    result = run(*args)
    assert result.exit_code == 2
    assert "Usage" in result.output or "Error" in result.output


# --- the installed command, in a real process ---------------------------------------------------

SPECC = Path(sys.executable).with_name("specc")


def specc_cmd(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    if not SPECC.exists():
        pytest.skip("the specc console script is not installed next to this Python")
    env = {k: v for k, v in os.environ.items() if k != "SPECC_DEBUG"}
    return subprocess.run([str(SPECC), *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env)


def test_process_missing_file(tmp_path):
    out = specc_cmd("validate", "nothere.yaml", cwd=tmp_path)
    assert out.returncode == 1
    assert "nothere.yaml" in out.stdout + out.stderr
    assert "no such spec file" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_process_resolve_missing_file(tmp_path):
    out = specc_cmd("resolve", "nothere.yaml", cwd=tmp_path)
    assert out.returncode == 1
    assert out.stdout == ""
    assert "nothere.yaml" in out.stderr
    assert "Traceback" not in out.stdout + out.stderr


def test_process_validate_json_and_catalog(tmp_path):
    out = specc_cmd("validate", "--json", "tiny-gpt2", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"specs": [{"path": "tiny-gpt2", "valid": True, "errors": []}]}


def test_process_bad_usage(tmp_path):
    out = specc_cmd("validate", cwd=tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stdout + out.stderr


def test_process_hostile_yaml(tmp_path):
    (tmp_path / "bomb.yaml").write_text(
        "a: &a [x, x, x, x, x, x, x, x, x]\n"
        + "".join(f"{n}: &{n} [" + ", ".join([f"*{p}"] * 9) + "]\n" for p, n in zip("abcdefgh", "bcdefghi"))
    )
    (tmp_path / "deep.yaml").write_text("a: " + "[" * 600 + "]" * 600 + "\n")
    (tmp_path / "bytes.yaml").write_bytes(b"specc: 1\nname: \xff\xfe\n")
    out = specc_cmd("validate", "bomb.yaml", "deep.yaml", "bytes.yaml", cwd=tmp_path)
    assert out.returncode == 1
    assert len(out.stdout.splitlines()) == 3
    assert "Traceback" not in out.stdout + out.stderr
    assert "internal error" not in out.stderr
