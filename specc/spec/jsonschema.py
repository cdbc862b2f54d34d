"""The JSON Schema of the spec language, for editors (YAML language servers) and other tools."""
from __future__ import annotations

from typing import Any

from specc.spec.schema import ModelSpec

DRAFT = "https://json-schema.org/draft/2020-12/schema"


def language_schema() -> dict[str, Any]:
    schema = ModelSpec.model_json_schema(by_alias=True, mode="validation")
    return {
        "$schema": DRAFT,
        "$id": "https://specc.dev/schema/spec-v1.json",
        "title": "specc spec, language version 1",
        **{k: v for k, v in schema.items() if k != "title"},
    }
