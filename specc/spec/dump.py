"""Specs back to YAML / JSON-ready data (what `specc resolve` prints)."""
from __future__ import annotations

from typing import Any

from specc.spec.schema import EVERY_KEY, ModelSpec
from specc.spec.yamlio import dump_yaml, kind_first


def spec_to_data(spec: ModelSpec, every_key: bool = False) -> dict[str, Any]:
    """The spec as data. Keys new to the language are left out where they hold their default
    (schema.Node.quiet), unless `every_key`."""
    return kind_first(spec.model_dump(by_alias=True, mode="json", context=EVERY_KEY if every_key else None))


def spec_to_yaml(spec: ModelSpec) -> str:
    return dump_yaml(spec_to_data(spec))
