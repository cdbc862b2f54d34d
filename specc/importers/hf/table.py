"""The vocabulary the family tables (specc.importers.hf.families) are written in.

A family is one `Family` record: config fields, fixed values, refusals, output heads and parameter
names, each a row of the types below. Row builders (`linear`, `norm`) and the helpers a family's
hooks use to write into a spec (`set_key`) or to look at a checkpoint (`has_tensor`) live here too,
so that families.py holds the tables alone and convert.py reads them without importing any table.
Nothing here reads files or imports torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

MISSING = object()  # a config field with no Hugging Face default: the import needs it


def lookup(table: dict, what: str) -> Callable[[Any], Any]:
    """A converter that maps a config value through TABLE, refusing (ValueError) any other value."""
    def convert(value):
        if value not in table:
            raise ValueError(f"{what} {value!r} is not one specc computes exactly; it supports "
                             + ", ".join(map(repr, sorted(table))))
        return table[value]
    return convert


def _same(v):
    return v


@dataclass(frozen=True)
class Field_:
    key: str                   # dotted spec key
    name: str                  # config field
    default: Any = MISSING     # Hugging Face's default when the field is absent
    convert: Callable[[Any], Any] = _same


@dataclass(frozen=True)
class Refuse:
    name: str                  # config field
    allowed: tuple             # the values specc can express
    default: Any = None        # Hugging Face's default when absent
    why: str = ""


@dataclass(frozen=True)
class Name:
    specc: str                 # template: {i} = layer; {s} = stack; {head} = output name
    hf: tuple[str, ...]        # candidates, the first present wins
    transform: str = "copy"    # copy | transpose | qkv0 / qkv1 / qkv2 (GPT-2's fused Conv1D) | offset2
    stack: str = ""            # "encoder" / "decoder": {i} runs over that stack's layers


@dataclass(frozen=True)
class Family:
    """One importable family. `extra` (spec, config) adjusts the spec where the config does not map
    1:1 and raises ValueError (or KeyError for a missing field) to refuse; its docstring is printed
    in docs/import.md. `heads[architecture](config, tensors)` gives the spec's outputs."""

    model_types: tuple[str, ...]
    architecture: str
    fields: tuple[Field_, ...]
    fixed: dict
    refuse: tuple[Refuse, ...]
    heads: dict[str, Callable[[dict, dict], list]]
    names: tuple[Name, ...]
    prefixes: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    # tensors that must be zero (specc has no place for them), and tables that must equal a formula
    zero: tuple[str, ...] = ()
    extra: Callable[[dict, dict], None] | None = None  # spec <- config adjustments that are not 1:1


def linear(specc: str, hf: str, stack: str = "", transform: str = "copy", bias: bool = True) -> tuple[Name, ...]:
    """The weight row (and the bias row) of one Linear."""
    rows = (Name(specc + ".weight", (hf + ".weight",), transform, stack),)
    if bias:
        rows += (Name(specc + ".bias", (hf + ".bias",), "copy", stack),)
    return rows


def norm(specc: str, hf: str, stack: str = "", bias: bool = True) -> tuple[Name, ...]:
    """The weight row (and the bias row) of one LayerNorm / RMSNorm."""
    return linear(specc, hf, stack, bias=bias)


def set_key(spec: dict, key: str, value: Any) -> None:
    """spec[a][b][c] = value for the dotted key "a.b.c", making the mappings on the way."""
    *path, last = key.split(".")
    node = spec
    for part in path:
        node = node.setdefault(part, {})
    node[last] = value


def has_tensor(tensors: dict, name: str, prefixes: tuple[str, ...]) -> bool:
    """Whether the checkpoint holds NAME under one of the family's prefixes."""
    return any(p + name in tensors for p in prefixes)
