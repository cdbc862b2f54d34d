"""docs/language.md is generated from the pydantic models; its examples load and resolve."""
from __future__ import annotations

import typing
from pathlib import Path

import pytest

from specc.spec import schema
from specc.spec.load import loads_spec
from specc.spec.language_doc import EXAMPLES, REGENERATE, example_text, render
from specc.spec.resolve import resolve

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "language.md"


def test_language_doc_is_generated_from_the_models():
    assert DOC.read_text(encoding="utf-8") == render(), f"docs/language.md is stale; regenerate: {REGENERATE}"


@pytest.mark.parametrize(
    "base,snippet", [(b, y) for exs in EXAMPLES.values() for _, b, y in exs],
    ids=[f"{g}-{t}" for g, exs in EXAMPLES.items() for t, _, _ in exs],
)
def test_every_example_loads_and_resolves(base, snippet):
    spec = loads_spec(example_text(base, snippet), base_dir=ROOT / "specs")
    resolve(spec)


def _kinds(union) -> set[str]:
    members = typing.get_args(typing.get_args(union)[0])
    return {typing.get_args(m.model_fields["kind"].annotation)[0] for m in members}


def _literal(model, field) -> set[str]:
    return set(typing.get_args(model.model_fields[field].annotation))


@pytest.mark.parametrize("group,expected", [
    ("position", lambda: _kinds(schema.PositionSpec)),
    ("pattern", lambda: _kinds(schema.PatternSpec)),
    ("outputs", lambda: _kinds(schema.OutputSpec)),
    ("scaling", lambda: _kinds(schema.RotaryScaling)),
    ("attention", lambda: _kinds(schema.AttentionKind)),
    ("ffn", lambda: _kinds(schema.FFNKind)),
    ("router", lambda: _kinds(schema.RouterSpec)),
    ("score", lambda: _literal(schema.AttentionSpec, "score")),
    ("merge", lambda: _literal(schema.AttentionSpec, "merge")),
    ("activation", lambda: _literal(schema.FFNSpec, "activation")),
    ("stack", lambda: {f"parallel: {p}" for p in _literal(schema.StackSpec, "parallel")}
     | {"overrides", "overrides with rotary scaling"}),
    ("norm", lambda: {f"{k}, {p}" for k in _literal(schema.NormSpec, "kind") for p in _literal(schema.NormSpec, "placement")}
     | {"rmsnorm, unit offset", "layernorm without bias"}),
])
def test_an_example_for_every_kind(group, expected):
    # a kind added to the schema without an example fails here
    assert {t for t, _, _ in EXAMPLES[group]} == expected()


def test_the_examples_change_what_they_claim():
    # an example that silently failed to apply would still resolve; check one per group
    spec = loads_spec(example_text(*EXAMPLES["position"][2][1:]), base_dir=ROOT / "specs")
    assert spec.position.kind == "relative" and spec.position.clip == 8
    spec = loads_spec(example_text(*EXAMPLES["pattern"][3][1:]), base_dir=ROOT / "specs")
    assert spec.encoder.attention.pattern.kind == "bigbird"
    spec = loads_spec(example_text(*EXAMPLES["scaling"][4][1:]), base_dir=ROOT / "specs")
    assert spec.position.scaling.kind == "longrope" and len(spec.position.scaling.long_factor) == 8
    spec = loads_spec(example_text(*EXAMPLES["outputs"][3][1:]), base_dir=ROOT / "specs")
    assert [o.kind for o in spec.outputs] == ["classifier"]
    spec = loads_spec(example_text(*EXAMPLES["ffn"][1][1:]), base_dir=ROOT / "specs")
    assert spec.decoder.ffn.kind == "moe" and spec.decoder.overrides[0].ffn.kind == "dense"
    spec = loads_spec(example_text(*EXAMPLES["attention"][1][1:]), base_dir=ROOT / "specs")
    assert spec.decoder.attention.kind == "latent" and spec.decoder.attention.kv_rank == 16
    spec = loads_spec(example_text(*EXAMPLES["router"][2][1:]), base_dir=ROOT / "specs")
    assert spec.decoder.ffn.router.kind == "sigmoid" and spec.decoder.ffn.shared.d_ff == 32
