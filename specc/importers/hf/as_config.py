"""A resolved spec as a Hugging Face config.json: a family's table (specc.importers.families) read
backwards, kept only where importing it again gives back the spec.

Contract: `hf_config(r)` is a Described: `config`, the config.json of the first family (in the
tables' order) whose config imports (convert.config_to_spec, the importer's own reading, itself
checked against transformers) as a spec that resolves to r's computation; else None, with `why`
naming what no family can say. So a config.json specc writes never describes another model than
the one built. Compared: every resolved key but the ones that do not change what the graph
computes (name, description, extends, weights, tokenizer, serving, dropout, tokens: the special
ids go to the config where the family has fields for them, and to generation_config.json).

How a config is made: each field of the table is the spec's value at its key, or the config value
the field's converter maps onto it (an activation name through the field's lookup table, a bool
for a spec string); the family's own rules (its `extra`, which no table states backwards) are
inverted by the inverse its module registers for the model type (INVERSE), and every other model
type is tried with its table alone. Pure data: no file is read, no torch imported.

        ResolvedSpec --each family in order (FAMILIES), each model type and head-->
            fields backwards + INVERSE[model_type] --> config --config_to_spec, resolve--> same spec? --> config
"""
from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Iterator

from specc.errors import SpecError
from specc.importers.errors import CheckpointError
from specc.importers.families import FAMILIES, INVERSE
from specc.importers.hf.convert import config_to_spec
from specc.importers.table import MISSING, Family, Lookup
from specc.spec.dump import spec_to_data
from specc.spec.load import loads_spec
from specc.spec.resolve import ResolvedSpec, resolve
from specc.spec.yamlio import dump_yaml

# resolved keys that do not change what a graph computes (see the module's contract)
IGNORED = ("specc", "name", "description", "extends", "weights", "tokenizer", "serving", "dropout", "tokens")

# config values a converter may map onto a spec value besides the spec's own value, the field's
# default and the names of the field's lookup table (Lookup.table): the two bools
_CANDIDATES = (True, False)


@dataclass(frozen=True)
class Described:
    """hf_config's answer: the config (None where no family describes the spec) and, then, why."""

    config: dict | None
    why: str = ""


def _get(data: dict, key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return MISSING
        node = node[part]
    return node


def _config_value(field, value: Any) -> Any:
    """The config value the field reads as VALUE: the value itself, the field's default or a
    candidate (a bool, a name of the field's lookup table), the first the field's type admits and
    its converter maps onto VALUE; MISSING when none does."""
    names = tuple(field.convert.table) if isinstance(field.convert, Lookup) else ()
    for candidate in (value, field.default, *_CANDIDATES, *names):
        if candidate is MISSING or not field.kind.ok(candidate):
            continue
        try:
            if field.convert(candidate) == value and type(field.convert(candidate)) is type(value):
                return candidate
        except (ValueError, TypeError, KeyError):
            continue
    return MISSING


class _Tensors(Mapping):
    """What the round trip passes for a checkpoint's tensors: a head that asks whether a tensor is
    there (BERT's pooler) is told `present`; the count is large enough for any layer count."""

    def __init__(self, present: bool):
        self.present = present

    def __contains__(self, name: object) -> bool:
        return self.present

    def __getitem__(self, name: str):
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return sys.maxsize


def _computed(data: dict) -> dict:
    return {k: v for k, v in data.items() if k not in IGNORED}


def _attempts(fam: Family, spec: dict) -> Iterator[dict]:
    """Each config of FAM for SPEC: one per model type and head the family has."""
    for model_type in fam.model_types:
        config: dict = {}
        missing = False
        for f in fam.fields:
            value = _config_value(f, _get(spec, f.key))
            if value is MISSING:
                missing = True
                break
            config[f.name] = value
        if missing:
            return
        inverse = INVERSE.get(model_type)
        if inverse is not None:
            try:
                inverse(spec, config)
            except (ValueError, KeyError, TypeError):
                continue
        for arch in _heads(fam, model_type):
            yield {"model_type": model_type, "architectures": [arch], **config}


def _heads(fam: Family, model_type: str) -> list[str]:
    """The family's heads that a config of MODEL_TYPE names (LlamaForCausalLM for llama,
    MistralForCausalLM for mistral), else all of them (one head for several types)."""
    prefix = model_type.replace("_", "").lower()
    own = [arch for arch in fam.heads if arch.lower().startswith(prefix)]
    return own or list(fam.heads)


def _imports_as(config: dict, name: str, want: dict) -> bool:
    """Whether CONFIG imports as a spec that computes WANT."""
    for present in (True, False):
        try:
            data = config_to_spec(config, _Tensors(present), name)
            spec = loads_spec(dump_yaml(data))
            got = spec_to_data(resolve(spec).spec)
        except (CheckpointError, SpecError, ValueError, KeyError, TypeError):
            continue
        if _computed(got) == want:
            return True
    return False


def hf_config(r: ResolvedSpec) -> Described:
    """The config.json of the first family that describes R (the module's contract)."""
    spec = spec_to_data(r.spec)
    want = _computed(spec)
    tried = []
    for fam in FAMILIES:
        if fam.architecture != r.architecture:
            continue
        tried.append("/".join(fam.model_types))
        for config in _attempts(fam, spec):
            if _imports_as(config, r.name, want):
                return Described(config)
    families = ", ".join(tried) if tried else "none"
    return Described(None, f"no Hugging Face family computes this {r.architecture} as specc does "
                           f"(tried: {families})")
