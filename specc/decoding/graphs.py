"""What the engine reads of a graph, and how a host calls one.

    GraphFacts.of(inputs, outputs, logits)     a graph's IO signature (name, dtype, dims each,
        |                                      as a manifest or a resolved spec records it),
        |                                      read once: the inputs it takes, its logits, its
        v                                      growing caches (past -> present, heads, head_dim)
    GraphCall: facts + __call__(feeds, into)   one call of the graph by a host

A host implements GraphCall its own way: `specc serve` runs onnxruntime with IO binding
(specc/runtime/scheduler.py), the Triton model sends a BLS request to the graph model
(specc/export/triton_generate.py). The engine hands numpy arrays in and reads numpy arrays back,
and never asks which host it runs in. `into` (present name -> an array of that output's exact
shape) is where the engine wants a cache output: a host that binds outputs writes it there
(writes_into True: the in-place cache graph's store is then written in place, and a step copies
no cache); one that cannot (BLS passes tensors by copy) returns arrays of its own, which the
engine copies where it needs them. Both give the same tokens: the arithmetic is the graph's.

GraphFacts is also what generation.json holds of a graph (to_dict / from_dict), so the Triton
model reads the facts the build wrote with the code that reads them in `specc serve`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol

import numpy as np

from ..spec import io
from .errors import DecodingError


@dataclass(frozen=True)
class Cache:
    """One growing cache tensor: its past_key_values.* input, its present.* output, its heads,
    head_dim and dtype (the signature's name), and the input's dims (a window cache's length dim
    says its window: specc/spec/io.py)."""

    past: str
    present: str
    heads: int
    head_dim: int
    dtype: str
    dims: tuple

    @property
    def numpy_dtype(self) -> str:
        return io.numpy_dtype(self.dtype)


@dataclass(frozen=True)
class GraphFacts:
    """A decoder graph as the engine reads it: the inputs it takes beside input_ids (mask,
    positions and token types, each its name or None), its logits output, its growing caches
    in signature order, and whether it is an in-place cache graph (specc/export/inplace.py: its
    caches are buffers of max_sequence positions, written at seqlens_k)."""

    ids: str
    mask: str | None
    positions: str | None
    token_types: str | None
    logits: str
    cache: tuple[Cache, ...]
    inplace: bool = False

    @classmethod
    def of(cls, inputs: Iterable[Any], outputs: Iterable[Any], logits: str) -> GraphFacts:
        """The facts of a graph whose inputs and outputs are given as objects with name, dtype
        and dims (TensorInfo, TensorSig); DecodingError where it cannot generate."""
        inputs = {t.name: t for t in inputs}
        outputs = {t.name for t in outputs}
        if io.INPUT_IDS not in inputs:
            raise DecodingError(f"the graph takes no {io.INPUT_IDS}; it cannot generate")
        if logits not in outputs:
            raise DecodingError(f"the graph has no {logits} output; it cannot generate")
        cache = []
        for name, t in inputs.items():
            if io.is_past(name) and io.is_growing(name):
                present = io.parse_cache(name)[1].present
                if present not in outputs:
                    raise DecodingError(f"{name}: the graph has no {present} output; it cannot generate")
                _, heads, _, head_dim = t.dims
                cache.append(Cache(name, present, heads, head_dim, t.dtype, tuple(t.dims)))
        return cls(ids=io.INPUT_IDS, mask=io.ATTENTION_MASK if io.ATTENTION_MASK in inputs else None,
                   positions=io.POSITION_IDS if io.POSITION_IDS in inputs else None,
                   token_types=io.TOKEN_TYPE_IDS if io.TOKEN_TYPE_IDS in inputs else None,
                   logits=logits, cache=tuple(cache), inplace=io.SEQLENS_K in inputs)

    @property
    def inputs(self) -> tuple[str, ...]:
        """The names of the inputs the engine feeds."""
        names = [self.ids] + [n for n in (self.mask, self.positions, self.token_types) if n]
        names += [c.past for c in self.cache]
        if self.inplace:
            names += [io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH]
        return tuple(names)

    @property
    def spare(self) -> int:
        """Positions an in-place graph's cache buffers hold past the sequence's: 1 where its
        attention runs a spare position after each call's own (io.SPARE_SEQUENCE), else 0."""
        return io.spare(c.dims for c in self.cache)

    @property
    def outputs(self) -> tuple[str, ...]:
        """The names of the outputs the engine reads: the logits, then the caches' presents."""
        return (self.logits,) + tuple(c.present for c in self.cache)

    def to_dict(self) -> dict:
        """The JSON form generation.json holds."""
        return {"ids": self.ids, "mask": self.mask, "positions": self.positions, "token_types": self.token_types,
                "logits": self.logits, "inplace": self.inplace,
                "cache": [{"input": c.past, "output": c.present, "heads": c.heads, "head_dim": c.head_dim,
                           "dtype": c.dtype, "dims": list(c.dims)} for c in self.cache]}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GraphFacts:
        return cls(ids=d["ids"], mask=d["mask"], positions=d["positions"], token_types=d["token_types"],
                   logits=d["logits"], inplace=bool(d.get("inplace", False)),
                   cache=tuple(Cache(c["input"], c["output"], c["heads"], c["head_dim"], c["dtype"], tuple(c["dims"]))
                               for c in d["cache"]))


class GraphCall(Protocol):
    """One graph as a host calls it (the module's doc)."""

    facts: GraphFacts
    writes_into: bool  # whether a call writes its cache outputs into the arrays `into` gives

    def __call__(self, feeds: dict[str, np.ndarray],
                 into: Mapping[str, np.ndarray] | None = None) -> Mapping[str, np.ndarray]:
        """Run the graph on `feeds` (input name -> numpy array); returns facts.outputs (name ->
        numpy array). Any exception fails the call; its first line is what the rows it ran are
        told (errors.first_line)."""
        ...
