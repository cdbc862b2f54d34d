"""Every example runs as a user would run it."""
from __future__ import annotations

import runpy
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


# scripts that run on a build directory get one of tiny-gpt2 (built once)
NEEDS_BUILD = {"generate_with_onnxruntime.py": ["5,6,7", "--max-new-tokens", "4"]}


def _check_bert_classification(stdout: str) -> None:
    # one row per sequence: three PyTorch probabilities that sum to 1, then onnxruntime's three
    rows = [l for l in stdout.splitlines() if l[:1].isdigit()]
    assert len(rows) == 2, stdout
    for row in rows:
        torch_part, ort_part = row.split(";")
        p_torch = [float(x) for x in torch_part.split()[1:]]
        p_ort = [float(x) for x in ort_part.split()]
        assert len(p_torch) == 3 and sum(p_torch) == pytest.approx(1.0, abs=2e-4)
        assert p_ort == pytest.approx(p_torch, abs=1e-4)
    assert float(stdout.split("max |probability difference|")[1].split()[0]) < 1e-4


def _check_table3_sweep(stdout: str) -> None:
    lines = stdout.splitlines()
    assert lines[1].split()[0] == "row" and [l.split()[0] for l in lines[2:]][:2] == ["base", "a1"]


# output checks for scripts whose output says whether they worked
CHECKS = {"bert_classification.py": _check_bert_classification, "table3_sweep.py": _check_table3_sweep}


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
    if script in CHECKS:
        CHECKS[script](out.stdout)


def test_greedy_example_decodes_with_the_cache_as_a_full_pass_would():
    # the example's functions, read from the script a user runs (its main block not run)
    greedy = runpy.run_path(str(EXAMPLES / "greedy_with_torch.py"))["greedy"]
    import torch

    import specc

    model = specc.to_torch(EXAMPLES / "custom-architecture.yaml", seed=0)
    ids = greedy(model, [5, 6, 7], 6)
    # without the cache: each step reruns the whole sequence
    slow = [5, 6, 7]
    with torch.no_grad():
        for _ in range(6):
            slow.append(int(model(input_ids=torch.tensor([slow]))["logits"][0, -1].argmax()))
    assert ids == slow


@pytest.mark.parametrize("spec", sorted(str(p.relative_to(EXAMPLES)) for p in EXAMPLES.rglob("*.yaml")))
def test_example_specs_are_valid(spec):
    import specc

    specc.load_spec(EXAMPLES / spec)


def test_table3_sweep_counts_what_inspect_counts_and_the_paper_reports():
    import json

    import yaml

    out = subprocess.run([sys.executable, str(EXAMPLES / "table3_sweep.py"), "--json"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    rows = {r["row"]: r for r in json.loads(out.stdout)["rows"]}
    inspect = subprocess.run([str(Path(sys.executable).with_name("specc")), "inspect", "transformer-base", "--json"],
                             capture_output=True, text=True, timeout=120)
    assert inspect.returncode == 0, inspect.stderr
    assert rows["base"]["parameters"] == json.loads(inspect.stdout)["parameters"]
    # Vaswani et al. 2017, Table 3: base 65 x 10^6 parameters
    assert rows["base"]["parameters"] == pytest.approx(65e6, rel=0.04)
    for key, row in rows.items():
        if row["paper_millions"] is not None:  # every row the paper counts, within 7%
            assert row["parameters"] == pytest.approx(row["paper_millions"] * 1e6, rel=0.07), key
    # each row is a spec that extends the base model and sets only a few fields
    for key in rows:
        data = yaml.safe_load((EXAMPLES / "table3" / f"{key}.yaml").read_text())
        assert data["extends"] == "transformer-base"
        assert set(data) - {"specc", "name", "description", "extends"} <= {
            "encoder", "decoder", "d_model", "dropout", "position"}, key
    # the paper's ordering: more layers, wider layers, bigger d_ff all add parameters
    assert rows["c1"]["parameters"] < rows["c2"]["parameters"] < rows["base"]["parameters"] < rows["c3"]["parameters"]
    assert rows["c4"]["parameters"] < rows["base"]["parameters"] < rows["c5"]["parameters"] < rows["big"]["parameters"]


def test_custom_architecture_mixes_relative_positions_local_attention_and_pre_norm():
    import specc

    r = specc.resolve(specc.load_spec(EXAMPLES / "custom-architecture.yaml"))
    assert r.position.kind == "relative"
    assert r.norm.placement == "pre"
    assert {layer.attention.pattern.kind for layer in r.decoder.layers} == {"local"}
