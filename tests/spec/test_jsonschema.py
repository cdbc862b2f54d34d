"""The JSON Schema of the language (`specc schema`): a valid Draft 2020-12 schema that accepts
every catalog spec and rejects keys that are not in the language."""
from __future__ import annotations

import json

import jsonschema
import pytest
from click.testing import CliRunner

from specc.cli import main
from specc.spec import catalog_dir, catalog_names, load_spec
from specc.spec.dump import spec_to_data
from specc.spec.resolve import explicit
from specc.spec.yamlio import parse_yaml


@pytest.fixture(scope="module")
def schema() -> dict:
    result = CliRunner().invoke(main, ["schema"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


@pytest.fixture(scope="module")
def validator(schema) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(schema)


def test_schema_is_draft_2020_12(schema):
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    jsonschema.Draft202012Validator.check_schema(schema)
    assert schema["type"] == "object"
    for key in ("specc", "name", "architecture", "d_model", "vocab"):
        assert key in schema["required"]


def test_schema_command_matches_the_api(schema):
    from specc.spec.jsonschema import language_schema

    assert schema == language_schema()


@pytest.mark.parametrize("name", catalog_names())
def test_resolved_catalog_spec_validates(name, validator):
    data = spec_to_data(explicit(load_spec(name)))
    errors = [e.message for e in validator.iter_errors(data)]
    assert not errors


def _as_written(name: str) -> dict:
    path = catalog_dir() / f"{name}.yaml"
    return parse_yaml(path.read_text(encoding="utf-8"), str(path)).data


SELF_CONTAINED = [n for n in catalog_names() if _as_written(n).get("extends") is None]


def test_some_catalog_specs_are_self_contained():
    assert {"gpt2-small", "transformer-base", "bert-base"} <= set(SELF_CONTAINED)


@pytest.mark.parametrize("name", SELF_CONTAINED)
def test_catalog_file_without_extends_validates_as_written(name, validator):
    """What an editor with the schema sees: the file as written (specs that extend another are
    partial on their own, so only the self-contained ones)."""
    assert not [e.message for e in validator.iter_errors(_as_written(name))]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d["vocab"].__setitem__("sizee", 3),
        lambda d: d.__setitem__("d_modle", 3),
        lambda d: d["decoder"]["attention"].__setitem__("head", 3),
        lambda d: d.__setitem__("architecture", "encoder-only"),
        lambda d: d.pop("d_model"),
        lambda d: d["decoder"].__setitem__("layers", "two"),
    ],
    ids=["unknown-nested-key", "unknown-top-key", "unknown-attention-key", "bad-choice", "missing-required",
         "wrong-type"],
)
def test_schema_rejects(mutate, validator):
    data = spec_to_data(explicit(load_spec("tiny-gpt2")))
    assert validator.is_valid(data)
    mutate(data)
    assert not validator.is_valid(data)
