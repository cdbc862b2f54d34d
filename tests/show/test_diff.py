"""`specc diff A B`: the differing resolved fields only, and parameters/FLOPs of each side, on
Table 3 style variants of transformer-base (Vaswani et al. 2017)."""
from __future__ import annotations

import json

from click.testing import CliRunner

from specc.cli import main

# Table 3 row (A): more heads at constant heads × d_k, everywhere attention is used
ROW_A = """\
    specc: 1
    name: base-16-heads
    extends: transformer-base
    encoder:
      attention: {heads: 16, d_k: 32, d_v: 32}
    decoder:
      attention: {heads: 16, d_k: 32, d_v: 32}
      cross_attention: {heads: 16, d_k: 32, d_v: 32}
"""
# Table 3 row (C): a wider feed-forward, here in the encoder only
ROW_C = """\
    specc: 1
    name: base-wide-ffn
    extends: transformer-base
    encoder:
      ffn: {d_ff: 4096}
"""


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def as_json(*args):
    r = run(*args, "--json")
    assert r.exit_code == 0, r.output
    return json.loads(r.output)


def test_row_a_heads_and_head_dims(spec_file):
    b = spec_file(ROW_A)
    facts = as_json("diff", "transformer-base", b)
    expected = {f"{s}.{k}": (a_val, b_val)
                for s in ("encoder.attention", "decoder.attention", "decoder.cross_attention")
                for k, a_val, b_val in (("heads", 8, 16), ("kv_heads", 8, 16), ("d_k", 64, 32), ("d_v", 64, 32))}
    assert {d["key"]: (d["a"], d["b"]) for d in facts["differences"]} == expected
    assert len(facts["differences"]) == len(expected)
    for side, spec in (("a", "transformer-base"), ("b", b)):
        inspected = as_json("inspect", spec)
        assert facts["parameters"][side] == inspected["parameters"]
        assert facts["flops_per_token"][side] == inspected["flops_per_token"]
    # heads × d_k held at 512: the projections keep their sizes (Table 3 lists 65M for both)
    assert facts["parameters"]["a"] == facts["parameters"]["b"]


def test_row_c_wider_ffn_parameter_change(spec_file):
    b = spec_file(ROW_C)
    facts = as_json("diff", "transformer-base", b)
    assert facts["differences"] == [{"key": "encoder.ffn.d_ff", "a": 2048, "b": 4096}]
    for side, spec in (("a", "transformer-base"), ("b", b)):
        assert facts["parameters"][side] == as_json("inspect", spec)["parameters"]
    # per encoder layer the first linear gains d_model × Δ weights and Δ biases, the second Δ × d_model
    d_model, delta, layers = 512, 4096 - 2048, 6
    assert facts["parameters"]["b"] - facts["parameters"]["a"] == layers * (2 * d_model * delta + delta)
    assert facts["flops_per_token"]["b"] > facts["flops_per_token"]["a"]
    assert set(facts) >= {"differences", "parameters"}
    assert set(facts["parameters"]) == {"a", "b"}


def test_terminal_table(spec_file):
    b = spec_file(ROW_C)
    r = run("diff", "transformer-base", b)
    assert r.exit_code == 0, r.output
    row = next(line for line in r.output.splitlines() if line.startswith("encoder.ffn.d_ff"))
    assert row.split()[1:] == ["2048", "4096"]
    a_n, b_n = (as_json("inspect", s)["parameters"] for s in ("transformer-base", b))
    assert f"parameters: {a_n:,} -> {b_n:,} ({100 * (b_n - a_n) / a_n:+.1f}%)" in r.output
    assert "FLOPs per token:" in r.output
    assert "decoder" not in r.output.split("parameters:")[0]  # fields that agree are not listed


def test_identical_specs_have_no_differences(spec_file):
    same = spec_file("specc: 1\nname: same-as-base\nextends: transformer-base\n")
    facts = as_json("diff", "transformer-base", same)
    assert facts["differences"] == []
    assert facts["parameters"]["a"] == facts["parameters"]["b"]
    r = run("diff", "transformer-base", same)
    assert r.exit_code == 0 and "no differences" in r.output


def test_different_architectures_and_outputs():
    facts = as_json("diff", "tiny-gpt2", "tiny-llama")
    keys = {d["key"] for d in facts["differences"]}
    assert {"position.kind", "norm.kind", "decoder.ffn.activation", "decoder.attention.kv_heads"} <= keys
    # a key one side lacks is reported against null
    missing = [d for d in facts["differences"] if d["a"] is None or d["b"] is None]
    assert any(d["key"].startswith("position.") for d in missing)
    facts = as_json("diff", "bert-base", "tiny-bert")
    assert all(not d["key"].startswith(("name", "description")) for d in facts["differences"])


def test_bad_spec_is_a_user_error(spec_file):
    bad = spec_file("specc: 1\nname: bad\nextends: transformer-base\nencoder: {ffn: {d_ff: -1}}\n")
    r = run("diff", "transformer-base", bad)
    assert r.exit_code == 1 and "d_ff" in r.output
    assert run("diff", "transformer-base").exit_code == 2
