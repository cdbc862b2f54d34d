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
