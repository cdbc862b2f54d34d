"""The vocabulary a family module (specc.importers.families) is written in: its Hugging Face table
and the record that registers it.

A family is one `Family` record: config fields, fixed values, refusals, output heads and parameter
names, each a row of the types below. Row builders (`linear`, `norm`, `fused_qkv`, `overridden`),
the activation names specc computes exactly (`ACTIVATIONS`, read through `lookup`) and the helpers
a family's hooks use to write into a spec (`set_key`) or to look at a checkpoint (`has_tensor`)
live here too, so that a family module holds its tables alone and the readers
(specc.importers.hf.convert, specc.importers.hf.as_config, specc.importers.gguf) read them without
importing any table. A family module registers one `Registered`: its table, its config.json
inverse and its GGUF rows (specc.importers.gguftable).
Nothing here reads files or imports torch.

config.json is untrusted input: every field a family reads is checked against its JSON type
(`Kind`) where it is read, by `Field_.kind` or by a hook's `read(...)`, and a wrong type is a
ValueError naming the field ("n_embd: expected an integer, got null"), never a TypeError deeper
down.
"""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

from specc.importers.gguftable import Arch

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


@dataclass(frozen=True, eq=False)
class Lookup:
    """A converter that maps a config value through TABLE (config value -> spec value), refusing
    (ValueError, naming WHAT) any other value. The value is a string (the field's kind is STR), so
    `in` cannot meet an unhashable one. specc.importers.hf.as_config reads TABLE backwards."""

    table: Mapping[str, Any]
    what: str

    def __call__(self, value: Any) -> Any:
        if value not in self.table:
            raise ValueError(f"{self.what} {value!r} is not one specc computes exactly; it supports "
                             + ", ".join(map(repr, sorted(self.table))))
        return self.table[value]


def lookup(table: Mapping[str, Any], what: str) -> Lookup:
    """The converter of a field whose config value maps through TABLE (see Lookup)."""
    return Lookup(table, what)


# Hugging Face activation names (transformers' ACT2FN) that specc computes exactly.
ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_python": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "silu": "silu", "swish": "silu"}


def _same(v):
    return v


@dataclass(frozen=True)
class Field_:
    key: str                   # dotted spec key
    name: str                  # config field
    default: Any = MISSING     # Hugging Face's default when the field is absent
    convert: Callable[[Any], Any] = _same
    kind: Kind = field(kw_only=True)  # the JSON type the field must have when present
    # other names of the field (its transformers config class's attribute_map): the first present
    # is read where `name` is absent
    aliases: tuple[str, ...] = field(default=(), kw_only=True)


@dataclass(frozen=True)
class Refuse:
    name: str                  # config field
    allowed: tuple             # the values specc can express
    default: Any = None        # Hugging Face's default when absent
    why: str = ""


@dataclass(frozen=True)
class Name:
    """One specc parameter and the checkpoint tensors it may come from. A candidate naming `{e}`
    is one tensor per routed expert of the layer (e = 0 .. experts - 1), stacked on a new first
    dimension (expert e at index e) before the transform; a candidate `A+B` is several tensors
    handed to the transform together (heads_cat)."""

    specc: str                 # template: {i} = layer; {s} = stack; {head} = output name
    hf: tuple[str, ...]        # candidates, the first present wins
    # copy | transpose | qkv0 / qkv1 / qkv2 (GPT-2's fused Conv1D) | rows_q / rows_k / rows_v (q, k, v
    # stacked by rows, k and v of one size) | halves0 / halves1 (two stacked by rows) |
    # groups_qkv0:{heads}:{kv_heads} ... (q, k, v rows by key-value group, convert._transform; the
    # stack's heads and kv heads filled in) | offset2 | experts_halves0 / 1 (stacked experts' gate
    # and up, [E, 2F, D], split on their rows) | alternate0 / 1 (every other entry of the last
    # dimension, from the first / second: gpt-oss's interleaved gate and up) | alternate0_t /
    # alternate1_t (the same, then the last two dimensions swapped) | transpose_last (the last two
    # dimensions swapped) | heads_cat (A+B: per head, A's rows then B's, [H, ., R] each)
    transform: str = "copy"
    stack: str = ""            # "encoder" / "decoder": {i} runs over that stack's layers
    # further candidates, tried after `hf`, each with its own transform (the stacked form a GGUF
    # file holds beside a checkpoint's per-expert tensors)
    alt: tuple[tuple[str, str], ...] = ()


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


def expert_rows(specc: str, hf: Mapping[str, str], stacked: Mapping[str, str] | None = None,
                stack: str = "decoder") -> tuple[Name, ...]:
    """The rows of the stacked experts SPECC.gate, .up and .down (the parts HF names), each from
    HF[part], a template naming {e} (one tensor per expert, stacked), or after it from
    STACKED[part] (one tensor of every expert, [E, ., .]: what a GGUF file holds)."""
    return tuple(Name(f"{specc}.{part}", (hf[part],), "copy", stack, alt=((stacked[part], "copy"),) if stacked else ())
                 for part in ("gate", "up", "down") if part in hf)


def overridden(fields: tuple[Field_, ...], changed: tuple[Field_, ...]) -> tuple[Field_, ...]:
    """`fields` with the rows for the same spec keys as `changed` replaced by them (a family built
    on another's table)."""
    by_key = {f.key: f for f in changed}
    return tuple(by_key.get(f.key, f) for f in fields)


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


# --- what a family module registers ------------------------------------------------------------


@dataclass(frozen=True)
class Registered:
    """One family as its module registers it (specc.importers.families reads each module's
    REGISTERED): `table`, its Hugging Face table; `inverse[model_type](spec, config)`, the rules of
    the table's `extra` written backwards, setting the config fields `extra` reads from a spec
    (specc.importers.hf.as_config; a model type without one is tried with its table alone), raising
    ValueError where the spec is not one this model type can say; `gguf[general.architecture]`, how
    a llama.cpp GGUF file of that architecture maps onto this family (specc.importers.gguf);
    `gguf_refused[general.architecture]`, why a file of an architecture near this family's is not
    read (named in the refusal)."""

    table: Family
    inverse: Mapping[str, Callable[[dict, dict], None]] = field(default_factory=dict)
    gguf: Mapping[str, Arch] = field(default_factory=dict)
    gguf_refused: Mapping[str, str] = field(default_factory=dict)
