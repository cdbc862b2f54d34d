"""An installed wheel carries the catalog: `extends: NAME` works outside a source checkout."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_ships_the_catalog_and_extends_finds_it(tmp_path):
    wheels, target = tmp_path / "wheels", tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(wheels), str(ROOT)],
        check=True, capture_output=True,
    )
    wheel = next(wheels.glob("specc-*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    spec = tmp_path / "child.yaml"
    spec.write_text("specc: 1\nname: child\nextends: tiny-gpt2\nd_model: 32\n")
    code = (
        "import specc, sys; from specc.spec.load import catalog_dir; "
        f"assert str(catalog_dir()).startswith({str(target)!r}), catalog_dir(); "
        f"s = specc.load_spec({str(spec)!r}); print(s.name, s.d_model, s.vocab.size)"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["child", "32", "1000"]


def test_a_serving_environment_installs_no_compiler():
    """`make install-serve`'s requirements: specc's own less what only building needs
    ([tool.specc] build-only in pyproject.toml), with onnxruntime and the serve extra."""
    import re
    import shutil

    import pytest

    if shutil.which("make") is None:
        pytest.skip("no make")
    got = subprocess.run(["make", "-s", "serve-requirements", f"PYTHON={sys.executable}"], cwd=ROOT, capture_output=True,
                         text=True, check=True).stdout.split()
    names = {re.split(r"[^A-Za-z0-9._-]", r)[0] for r in got}
    assert not names & {"torch", "onnx", "onnxscript", "safetensors", "graphviz"}, got
    assert {"onnxruntime", "numpy", "tokenizers", "nvidia-pytriton", "jinja2", "click", "pydantic"} <= names, got
