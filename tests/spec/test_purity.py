"""The spec layer is pure data: loading, resolving and dumping a spec never imports torch, onnx or
onnxruntime (checked in a fresh interpreter, where nothing else has imported them)."""
from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("torch", "onnx", "onnxruntime")

SCRIPT = """
import json, sys
import specc.spec
from specc.spec import load_spec, loads_spec, resolve
from specc.spec.dump import spec_to_yaml
from specc.spec.jsonschema import language_schema
from specc.spec.resolve import explicit
for name in ("tiny-gpt2", "tiny-bert", "tiny-transformer"):
    spec = load_spec(name)
    resolve(spec)
    loads_spec(spec_to_yaml(explicit(spec)))
language_schema()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in %r)))
""" % (HEAVY,)


def test_spec_layer_imports_no_heavy_dependency():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded == []


def test_the_check_can_see_an_import():
    """The same probe does report a heavy module when one is imported (so the test above can fail)."""
    script = "import sys, json; import onnx; print(json.dumps([m for m in sys.modules if m == 'onnx']))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["onnx"]
