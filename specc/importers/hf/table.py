"""The vocabulary the family tables (specc.importers.hf.families) are written in.

A family is one `Family` record: config fields, fixed values, refusals, output heads and parameter
names, each a row of the types below. Row builders (`linear`, `norm`, `fused_qkv`) and the helpers a family's
hooks use to write into a spec (`set_key`) or to look at a checkpoint (`has_tensor`) live here too,
so that families.py holds the tables alone and convert.py reads them without importing any table.
Nothing here reads files or imports torch.

config.json is untrusted input: every field a family reads is checked against its JSON type
(`Kind`) where it is read, by `Field_.kind` or by a hook's `read(...)`, and a wrong type is a
ValueError naming the field ("n_embd: expected an integer, got null"), never a TypeError deeper
down.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

MISSING = object()  # a config field with no Hugging Face default: the import needs it


# --- the JSON types of config fields ---------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """The JSON type a config field must have: `name` for messages, `ok(value)` decides. JSON
    gives int, float, str, bool, None, list and dict only; bool is not an integer here (Python's
    True == 1 would otherwise pass for a size), and a float is not an integer (32.0 for n_embd is
    refused, as transformers' own config classes refuse it); an integer is a number."""

    name: str
    ok: Callable[[Any], bool]


def _int(v: Any) -> bool:
    return type(v) is int


INT = Kind("an integer", _int)
INT_OR_NULL = Kind("an integer or null", lambda v: v is None or _int(v))
NUMBER = Kind("a number", lambda v: type(v) in (int, float))
NUMBER_OR_NULL = Kind("a number or null", lambda v: v is None or type(v) in (int, float))
BOOL = Kind("true or false", lambda v: type(v) is bool)
STR = Kind("a string", lambda v: type(v) is str)
STR_OR_NULL = Kind("a string or null", lambda v: v is None or type(v) is str)
OBJECT_OR_NULL = Kind("an object or null", lambda v: v is None or type(v) is dict)
LIST_OR_NULL = Kind("a list or null", lambda v: v is None or type(v) is list)
# special token ids: one id, several (LLaMA 3's EOS; refused later, naming the ids) or none
TOKEN = Kind("an integer, a list of integers or null",
             lambda v: v is None or _int(v) or (type(v) is list and all(map(_int, v))))


def shown(value: Any, limit: int = 60) -> str:
    """A config value as JSON for a message, cut to LIMIT characters (a hostile value may be
    megabytes long or nested hundreds deep)."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def check(name: str, value: Any, kind: Kind) -> Any:
    """VALUE if it is of KIND, else ValueError naming the field NAME and what it got."""
    if not kind.ok(value):
        raise ValueError(f"{name}: expected {kind.name}, got {shown(value)}")
    return value


def read(cfg: dict, name: str, kind: Kind, default: Any = MISSING, *, label: str | None = None) -> Any:
    """cfg[NAME] checked against KIND (ValueError naming the field, or LABEL, when it is not);
    DEFAULT, unchecked, when absent; KeyError(LABEL or NAME) when absent and there is no default."""
    if name not in cfg:
        if default is MISSING:
            raise KeyError(label or name)
        return default
    return check(label or name, cfg[name], kind)


def lookup(table: dict, what: str) -> Callable[[Any], Any]:
    """A converter that maps a config value through TABLE, refusing (ValueError) any other value.
    The value is a string (the field's kind is STR), so `in` cannot meet an unhashable one."""
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
    kind: Kind = field(kw_only=True)  # the JSON type the field must have when present


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
    # copy | transpose | qkv0 / qkv1 / qkv2 (GPT-2's fused Conv1D) | rows_q / rows_k / rows_v (q, k, v
    # stacked by rows, k and v of one size) | halves0 / halves1 (two stacked by rows) |
    # groups_qkv0:{heads}:{kv_heads} ... (q, k, v rows by key-value group, convert._transform; the
    # stack's heads and kv heads filled in) | offset2
    transform: str = "copy"
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
    # spec key -> the config field(s) `extra` or `heads` set it from, so that a spec the importer
    # makes and specc refuses (d_ff 0, eps NaN) is reported against the config field
    sources: dict[str, str] = field(default_factory=dict)


def linear(specc: str, hf: str, stack: str = "", transform: str = "copy", bias: bool = True) -> tuple[Name, ...]:
    """The weight row (and the bias row) of one Linear."""
    rows = (Name(specc + ".weight", (hf + ".weight",), transform, stack),)
    if bias:
        rows += (Name(specc + ".bias", (hf + ".bias",), "copy", stack),)
    return rows


def fused_qkv(specc: str, hf: str, stack: str) -> tuple[Name, ...]:
    """q, k, v weights and biases of an attention SPECC from one fused projection HF, split by
    key-value group (groups_qkv: BLOOM, GPT-NeoX, Falcon)."""
    return tuple(Name(f"{specc}.{p}.{w}", (f"{hf}.{w}",), f"groups_qkv{n}:{{heads}}:{{kv_heads}}", stack)
                 for n, p in enumerate("qkv") for w in ("weight", "bias"))


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
