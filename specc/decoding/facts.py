"""What the engine knows of a build, and generation.json, the file that carries it to the Triton
model:

    Model      the vocabulary, the longest prompt, the context, eos: what a request is checked against
    Limits     how much the engine holds at once: sequences, cache positions, requests waiting,
               prompts' K/V kept for reuse (the prefix cache)
    Endpoint   the generate endpoint's fields (specc/spec/triton.py's table) and its bounds
    GraphFacts (graphs.py) the graph model's, and the in-place cache graph's where it has one

`specc serve` makes them from the build's manifest and its flags (specc/runtime/scheduler.py);
`specc build --target triton` writes them into generation.json from the resolved spec
(specc/export/triton.py, through `to_json`), and the Triton model reads them back (`from_json`).
One set of names, written and read here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .errors import DecodingError
from .graphs import GraphFacts

FACTS_FILE = "generation.json"
FORMAT = 3  # generation.json's layout: a Triton model reads only the format it was written with


@dataclass(frozen=True)
class Model:
    """The build's facts a request is checked against: token ids below `vocab`, a prompt of at
    most `length_max` tokens, prompt + max_tokens within `context` positions (`context_source`
    says where that bound comes from), the spec's eos (None: none), and what an integer build
    decodes in (`activations`: fp32 or int8, specc/spec/targets.py; None: a float build), which
    says whether its drafts can be checked (speculation.py)."""

    vocab: int
    length_max: int
    context: int
    context_source: str
    eos: int | None
    activations: str | None = None


@dataclass(frozen=True)
class Limits:
    """What the engine holds at once: `max_sequences` rows in a step, `max_cache_tokens`
    positions of cache (rows x the longest row), `max_waiting` requests queued, and
    `prefix_cache_tokens` positions of prompts' K/V kept for the requests that begin with them
    (prefix.py; None: as many as max_cache_tokens; 0: none kept)."""

    max_sequences: int
    max_cache_tokens: int
    max_waiting: int
    prefix_cache_tokens: int | None = None

    @property
    def prefix_positions(self) -> int:
        """The prefix cache's budget in positions (0: off)."""
        return self.max_cache_tokens if self.prefix_cache_tokens is None else self.prefix_cache_tokens


@dataclass(frozen=True)
class Endpoint:
    """The generate endpoint's request side: each field's name and kind (ids | int | float |
    text | texts | bool), the parameters Triton itself may put on a request, and the bounds."""

    fields: tuple[tuple[str, str], ...]
    reserved_parameters: tuple[str, ...]
    default_max_tokens: int
    max_stops: int
    max_stop_bytes: int

    @classmethod
    def of(cls, fields: Iterable[Any], reserved_parameters: Iterable[str], default_max_tokens: int,
           max_stops: int, max_stop_bytes: int) -> Endpoint:
        """From fields given as objects with name and kind (specc/spec/triton.py's Field)."""
        return cls(tuple((f.name, f.kind) for f in fields), tuple(reserved_parameters), default_max_tokens,
                   max_stops, max_stop_bytes)

    @property
    def kinds(self) -> dict[str, str]:
        return dict(self.fields)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.fields)


@dataclass(frozen=True)
class Generation:
    """Everything a generation model is made of: generation.json read."""

    name: str
    graph_model: str
    graph: GraphFacts
    model: Model
    limits: Limits
    endpoint: Endpoint
    inplace_model: str | None = None  # the in-place cache graph's model, where the repository has one
    inplace: GraphFacts | None = None


def to_json(g: Generation) -> dict:
    """generation.json's content."""
    return {
        "format": FORMAT, "name": g.name, "graph_model": g.graph_model, **g.graph.to_dict(),
        "inplace_graph": None if g.inplace is None else {"model": g.inplace_model, **g.inplace.to_dict()},
        "vocab": g.model.vocab, "length_max": g.model.length_max, "context": g.model.context,
        "context_source": g.model.context_source, "eos": g.model.eos, "activations": g.model.activations,
        "max_sequences": g.limits.max_sequences, "max_cache_tokens": g.limits.max_cache_tokens,
        "max_waiting": g.limits.max_waiting, "prefix_cache_tokens": g.limits.prefix_cache_tokens,
        "default_max_tokens": g.endpoint.default_max_tokens, "max_stops": g.endpoint.max_stops,
        "max_stop_bytes": g.endpoint.max_stop_bytes, "reserved_parameters": list(g.endpoint.reserved_parameters),
        "fields": [{"name": n, "kind": k} for n, k in g.endpoint.fields],
    }


def from_json(d: Mapping[str, Any], where: str = FACTS_FILE) -> Generation:
    """generation.json read; DecodingError naming `where` for a file of another format."""
    if not isinstance(d, Mapping) or d.get("format") != FORMAT:
        found = d.get("format") if isinstance(d, Mapping) else None
        raise DecodingError(f"{where}: format {found!r}, this model reads format {FORMAT}; rebuild the "
                            "repository with one specc")
    inplace = d.get("inplace_graph")
    return Generation(
        name=d["name"], graph_model=d["graph_model"], graph=GraphFacts.from_dict(d),
        model=Model(vocab=d["vocab"], length_max=d["length_max"], context=d["context"],
                    context_source=d["context_source"], eos=d["eos"], activations=d.get("activations")),
        limits=Limits(max_sequences=d["max_sequences"], max_cache_tokens=d["max_cache_tokens"],
                      max_waiting=d["max_waiting"], prefix_cache_tokens=d["prefix_cache_tokens"]),
        endpoint=Endpoint(fields=tuple((f["name"], f["kind"]) for f in d["fields"]),
                          reserved_parameters=tuple(d["reserved_parameters"]),
                          default_max_tokens=d["default_max_tokens"], max_stops=d["max_stops"],
                          max_stop_bytes=d["max_stop_bytes"]),
        inplace_model=None if inplace is None else inplace["model"],
        inplace=None if inplace is None else GraphFacts.from_dict(inplace))
