"""Specs back to YAML / JSON-ready data (what `specc resolve` prints)."""
from __future__ import annotations

from typing import Any

from specc.spec.schema import ModelSpec
from specc.spec.yamlio import dump_yaml, kind_first


def spec_to_data(spec: ModelSpec) -> dict[str, Any]:
    return kind_first(spec.model_dump(by_alias=True, mode="json"))


def spec_to_yaml(spec: ModelSpec) -> str:
    return dump_yaml(spec_to_data(spec))
