"""Server-side generation for `specc serve`: specc/decoding's engine (one batched decode step for
every sequence, continuous batching; the cache store; the sampler) over a Session's graphs, run
by onnxruntime through IO binding. `specc serve` drives it from its request threads
(specc/runtime/generation_model.py), the tests and benchmarks drive it directly.

    Session --graphs--> OrtGraph (decoding.graphs.GraphCall over runtime/graph.py's Graph)
       |                   the in-place cache graph where the build has one (the store written
       |                   in place: outputs bound to its buffers), else model.onnx
       v
    Scheduler = decoding.engine.Engine + the build's facts (BuildInfo) and limits
                (serving.generation, `specc serve`'s flags), its refusals as RunError / Busy

Everything about requests, the step loop and the store is specc/decoding/'s (its docstrings
draw it); this module only binds it to onnxruntime and to the build, so `specc serve` and the
generation model of a `--target triton` repository decode with the same code.

Encoder-decoder builds are not scheduled here: their decoder graph takes no attention_mask for
its own cache, so rows that started at different times cannot share one step.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from specc.decoding.engine import CANCELLED, ERROR, LENGTH, STOP, Engine, Sink, Stats
from specc.decoding.errors import Busy as EngineBusy
from specc.decoding.errors import DecodingError
from specc.decoding.facts import Limits, Model
from specc.decoding.graphs import GraphFacts
from specc.decoding.request import Request
from specc.decoding.stores import CacheBlock, InplaceBlock
from specc.runtime.errors import RunError
from specc.runtime.generate import Model as Built
from specc.runtime.generate import lm_output
from specc.runtime.graph import Graph
from specc.runtime.inputs import Limits as Inputs
from specc.spec import triton as rule
from specc.spec.manifest import BuildInfo

__all__ = ["CANCELLED", "ERROR", "LENGTH", "STOP", "Busy", "CacheBlock", "GenerationLimits", "GenerationRequest",
           "InplaceBlock", "OrtGraph", "Scheduler", "Sink", "Stats"]

GenerationRequest = Request  # a request as the scheduler takes it (decoding.request.Request)


class Busy(RunError):
    """The server cannot take the request now (its queue is full, or it is shutting down): HTTP 503."""


@dataclass(frozen=True)
class GenerationLimits(Limits):
    """What the scheduler holds at once (decoding.facts.Limits): `max_sequences` rows in a step,
    `max_cache_tokens` positions of cache, `max_waiting` requests queued, `prefix_cache_tokens`
    positions of the prefix cache (None: max_cache_tokens; 0: off)."""

    @classmethod
    def of(cls, info: BuildInfo, max_sequences: int | None = None, max_cache_tokens: int | None = None,
           max_waiting: int | None = None, prefix_cache_tokens: int | None = None) -> GenerationLimits:
        """The build's serving.generation, each value replaced by the argument given (`specc serve`'s
        flags); RunError naming the flag for a value the build cannot take."""
        g = info.generation
        sequences, tokens = rule.generation_limits(
            info.batch.max, info.length.max, max_sequences if max_sequences is not None else g.max_sequences,
            max_cache_tokens if max_cache_tokens is not None else g.max_cache_tokens)
        if not 1 <= sequences <= info.batch.max:
            raise RunError(f"--max-sequences {sequences}: the graphs take 1..serving.batch.max "
                           f"{info.batch.max} rows")
        if tokens < 1:
            raise RunError(f"--max-cache-tokens {tokens}: must be at least 1")
        waiting = next(v for v in (max_waiting, g.max_waiting) if v is not None)
        if waiting < 0:
            raise RunError(f"--max-waiting {waiting}: must be at least 0")
        prefix = prefix_cache_tokens if prefix_cache_tokens is not None else g.prefix_cache_tokens
        if prefix is not None and prefix < 0:
            raise RunError(f"--prefix-cache-tokens {prefix}: must be at least 0 (0: no prefix cache)")
        return cls(max_sequences=sequences, max_cache_tokens=tokens, max_waiting=waiting, prefix_cache_tokens=prefix)


class OrtGraph:
    """A Session's graph as the engine calls it (decoding.graphs.GraphCall): onnxruntime through
    IO binding, the cache outputs written into the arrays the engine gives (`into`), so the
    in-place store is written in place and the block's next buffer directly."""

    writes_into = True

    def __init__(self, graph: Graph, logits: str):
        self.graph = graph
        try:
            self.facts = GraphFacts.of(graph.info.inputs, graph.info.outputs, logits)
        except DecodingError as exc:
            raise RunError(f"{graph.info.file}: {exc}") from None

    def __call__(self, feeds: dict[str, np.ndarray], into: Mapping[str, np.ndarray] | None = None) -> dict:
        out = self.graph.run(feeds, into=dict(into) if into else None)
        got = {self.facts.logits: out[self.facts.logits].numpy()}
        for c in self.facts.cache:
            got[c.present] = into[c.present] if into and c.present in into else out[c.present].numpy()
        return got


def model_facts(info: BuildInfo, limits: Inputs) -> Model:
    """What a request is checked against (decoding.facts.Model): the build's input limits (its
    context: serving.length.max, or fewer learned positions), eos and activations."""
    return Model(vocab=limits.vocab, length_max=limits.length, context=limits.context,
                 context_source=limits.context_source(), eos=info.tokens.eos, activations=info.activations)


class Scheduler(Engine):
    """Continuous batching over a decoder build (a Session, or anything with `graphs`, `inplace`,
    `info` and `limits`): decoding.engine.Engine, its refusals RunError (HTTP 400) and Busy
    (503). submit() from any thread; the work happens in step(), called by one thread: the one
    start() makes, or a test's own loop (`while scheduler.step(): pass`)."""

    def __init__(self, model: Built, limits: GenerationLimits | None = None):
        info = model.info
        if info.architecture != "decoder" or "model" not in model.graphs:
            raise RunError("server-side generation needs a decoder build (an encoder-decoder's decoder "
                           "graph takes no mask for its own cache, so its rows cannot share a step)")
        self.model = model
        self.info = info
        self.logits_name = lm_output(info)
        inplace = getattr(model, "inplace", None)
        try:
            super().__init__(lambda: OrtGraph(model.graphs["model"], self.logits_name),
                             None if inplace is None else OrtGraph(inplace, self.logits_name),
                             model_facts(info, model.limits), limits or GenerationLimits.of(info))
        except DecodingError as exc:
            raise RunError(f"server-side generation: {exc}") from None

    def check(self, request: Request) -> tuple[int, int | None]:
        """A request checked against the build and this server's budget; returns (positions it
        needs, its eos). RunError (HTTP 400) with the engine's line."""
        try:
            return super().check(request)
        except DecodingError as exc:
            raise RunError(str(exc)) from None

    def submit(self, request: Request, sink: Sink) -> int:
        """Queue a request; returns its ticket (for cancel). RunError for a bad request, Busy when
        the queue is full or the server is shutting down; nothing is queued then."""
        try:
            return super().submit(request, sink)
        except EngineBusy as exc:
            raise Busy(str(exc)) from None
        except DecodingError as exc:
            raise RunError(str(exc)) from None
