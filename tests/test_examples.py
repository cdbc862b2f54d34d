"""Every example runs as a user would run it."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# scripts that run on a build directory get one of tiny-gpt2 (built once)
NEEDS_BUILD = {"generate_with_onnxruntime.py": ["5,6,7", "--max-new-tokens", "4"]}


@pytest.fixture(scope="module")
def gpt2_build(tmp_path_factory):
    import specc

    return specc.build("tiny-gpt2", tmp_path_factory.mktemp("examples") / "tiny-gpt2").out_dir


@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES.glob("*.py")))
def test_example_runs(script, request):
    args = [str(request.getfixturevalue("gpt2_build")), *NEEDS_BUILD[script]] if script in NEEDS_BUILD else []
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr


def test_greedy_example_decodes_with_the_cache_as_a_full_pass_would():
    sys.path.insert(0, str(EXAMPLES))
    try:
        import greedy_with_torch
    finally:
        sys.path.pop(0)
    import torch

    import specc

    model = specc.to_torch(EXAMPLES / "custom-architecture.yaml", seed=0)
    ids = greedy_with_torch.greedy(model, [5, 6, 7], 6)
    # without the cache: each step reruns the whole sequence
    slow = [5, 6, 7]
    with torch.no_grad():
        for _ in range(6):
            slow.append(int(model(input_ids=torch.tensor([slow]))["logits"][0, -1].argmax()))
    assert ids == slow


@pytest.mark.parametrize("spec", sorted(p.name for p in EXAMPLES.glob("*.yaml")))
def test_example_specs_are_valid(spec):
    import specc

    specc.load_spec(EXAMPLES / spec)
