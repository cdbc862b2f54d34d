"""Generation loops over a built decoder or encoder-decoder: greedy, sampling (temperature,
top-k, top-p) and beam search.

    prompts --pad--> prefill (whole prompt, empty cache) --> logits[:, -1]
                        ^                                        | choose (argmax | sample | beams)
                        '--- step (1 token, cache = present) <---'

A runner owns the graph calls and the cache (specc/runtime/cache.py: OrtValues kept on the
graph's device); the loops only see [rows, vocab] logits and hand back the chosen token per row.
Beam search reorders the cache rows after each step. Speculative decoding (one prompt)
runs specc/runtime/speculative.py's loop over an InplaceRunner (where the build's in-place graph
holds the positions a check reads) or a DecoderRunner, which check drafts with `extend` and cut
their cache back with `truncate`.

The loops read a model through three attributes, `graphs`, `info` and `limits` (a Session has
them), and never import the Session: session.py imports this module, not the other way.

Greedy and sampled tokens are chosen by specc/decoding/sampling.py's Sampler, the one the serving
engine chooses each request's with, so a request's seeded draws are Session.generate's.

Beam scores use the length penalty of Wu et al. 2016, which the Transformer paper used for
translation (beam 4, alpha 0.6): score = sum(log p) / lp(n), lp(n) = ((5 + n) / 6) ** alpha.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol

import numpy as np

from specc.decoding.draft import DRAFTERS
from specc.decoding.sampling import Sampler, log_softmax, sample, samples  # noqa: F401 - sample: this module's API too
from specc.decoding.speculation import refusal
from specc.decoding.stores import inplace_feeds
from specc.runtime.arrays import pad_rows
from specc.runtime.cache import CacheBuffers, empty_cache, reorder_cache, run_cached, truncate_cache
from specc.runtime.captured import CapturedDecoder, CapturedRunner
from specc.runtime.errors import RunError
from specc.runtime.graph import Graph
from specc.runtime.inputs import Limits, check_generation
from specc.runtime.speculative import MAX_DRAFT, ModelDraft, Speculation, check_draft, check_runner, speculative_loop
from specc.spec.io import (
    ATTENTION_MASK,
    BATCH,
    LM_POSITIONS_DIM,
    MAX_SEQUENCE,
    concrete_dims,
    is_past,
    numpy_dtype,
    parse_cache,
    ENCODER_ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    TOKEN_TYPE_IDS,
    positions_from_mask,
    present_to_past,
)
from specc.spec.io import spare as io_spare
from specc.spec.manifest import BuildInfo

OnToken = Callable[[int, list], None]  # (step, [new id or None per row])


class Model(Protocol):
    """What generation reads of a built model (a Session): its graphs by name, its build's facts and
    what it takes as input."""

    graphs: Mapping[str, Graph]
    inplace: Graph | None  # a decoder's in-place cache graph, where generation runs it on the CPU
    info: BuildInfo
    limits: Limits

    def captured(self, rows: int) -> CapturedDecoder | None:
        """The in-place graph's device state for `rows` rows on a GPU (specc/runtime/captured.py),
        or None where generation does not run it."""


@dataclass
class Generated:
    """ids: each row's prompt (for an encoder-decoder: the decoder start token) followed by its new
    tokens; new_ids: the new tokens alone. Rows stop at EOS (kept) or max_new_tokens."""

    ids: list[list[int]]
    new_ids: list[list[int]]
    speculation: Speculation | None = None  # what speculative decoding did, where it ran


# --- runners: the graph calls and the cache -------------------------------------------------------


class DecoderRunner:
    """A decoder-only build: prompts left-padded; positions counted from the mask. `new`: the most
    tokens the generation adds, which sizes the CPU cache buffers."""

    def __init__(self, model: Model, rows: list[list[int]], pad: int, new: int):
        self.graph = model.graphs["model"]
        self.logits_name = lm_output(model.info)
        self.ids, self.mask = pad_rows(rows, pad, left=True)
        # positions count real tokens, so a left-padded row starts at 0
        self.positions = positions_from_mask(self.mask, self.mask.shape[1])
        self.kv = CacheBuffers(self.graph, len(rows), self.ids.shape[1] + new) if self.graph.device == "cpu" else None
        self.cache: dict = {}

    def prefill(self) -> np.ndarray:
        feeds = {INPUT_IDS: self.ids, ATTENTION_MASK: self.mask}
        feeds.update(empty_cache(self.graph, len(self.ids)))
        return self._run(feeds, self.ids.shape[1])[:, -1, :]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self.extend(tokens[:, None])[:, -1, :]

    def extend(self, tokens: np.ndarray) -> np.ndarray:
        """Run `tokens` [rows, t] after the cache in one call: the logits of each of them [rows, t,
        vocab] (a speculative step's check of t - 1 drafted tokens)."""
        rows, t = tokens.shape
        self.mask = np.concatenate([self.mask, np.ones((rows, t), dtype=np.int64)], axis=1)
        self.positions = self.positions[:, -1:] + 1 + np.arange(t, dtype=np.int64)[None, :]
        return self._run({INPUT_IDS: tokens.astype(np.int64), ATTENTION_MASK: self.mask, **self.cache}, t)[:, -t:, :]

    def truncate(self, total: int) -> None:
        """Keep the first `total` positions of every row (mask, positions and cache): the tokens
        after them, a speculative step's rejected drafts, are gone. Whole-sequence caches only."""
        self.mask = self.mask[:, :total]
        self.positions = positions_from_mask(self.mask, 1)
        self.cache = truncate_cache(self.graph, self.kv, self.cache, total)

    def _run(self, feeds: dict, t: int) -> np.ndarray:
        if POSITION_IDS in self.graph.inputs:
            feeds[POSITION_IDS] = self.positions
        if TOKEN_TYPE_IDS in self.graph.inputs:
            feeds[TOKEN_TYPE_IDS] = np.zeros((len(self.mask), t), dtype=np.int64)
        self.cache, out = run_cached(self.graph, self.kv, feeds, self.mask.shape[1])
        return out[self.logits_name].numpy()

    def reorder(self, rows: np.ndarray) -> None:
        self.mask, self.positions = self.mask[rows], self.positions[rows]
        self.cache = reorder_cache(self.graph, self.kv, self.cache, rows)


class InplaceRunner:
    """A decoder-only build's in-place cache graph (specc/export/inplace.py), on the CPU: rows of one
    length (nothing is padded). Each layer's cache is one buffer [rows, kv_heads, prompt + new,
    head_dim], allocated once; every call writes its new positions into it and copies nothing.
    GroupQueryAttention reads a row's positions up to the call's length alone, so cutting the
    cache back (`truncate`) is setting the length."""

    def __init__(self, model: Model, rows: list[list[int]], new: int):
        self.graph = model.inplace
        self.logits_name = lm_output(model.info)
        self.ids = np.asarray(rows, dtype=np.int64)
        capacity = self.ids.shape[1] + new
        self.caches = {name: np.zeros(concrete_dims(t.dims, {BATCH: len(rows), MAX_SEQUENCE: capacity}),
                                      dtype=numpy_dtype(t.dtype))
                       for name, t in self.graph.inputs.items() if is_past(name)}
        self.into = {s.present: self.caches[s.past] for s in (parse_cache(n)[1] for n in self.caches)}
        self.length = 0  # positions in the cache

    def prefill(self) -> np.ndarray:
        return self._run(self.ids)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self._run(tokens[:, None].astype(np.int64))

    def extend(self, tokens: np.ndarray) -> np.ndarray:
        """Run `tokens` [rows, t] after the cache in one call: the logits of the last min(t,
        io.LM_POSITIONS) of them [rows, ., vocab] (a speculative step's check of t - 1 drafted
        tokens, where checks_drafts)."""
        return self._call(np.asarray(tokens, dtype=np.int64))

    def truncate(self, total: int) -> None:
        """Keep the first `total` positions; the next call writes over the ones after them."""
        self.length = total

    def _run(self, ids: np.ndarray) -> np.ndarray:
        return self._call(ids)[:, -1, :]

    def _call(self, ids: np.ndarray) -> np.ndarray:
        out = self.graph.run(inplace_feeds(self.graph.inputs, ids, self.length, self.caches), into=self.into)
        self.length += ids.shape[1]
        return out[self.logits_name].numpy()


def checks_drafts(model: Model) -> bool:
    """Whether the build's in-place graph runs on the CPU here and its LM output holds the positions
    a speculative step checks (one built before it did holds the last alone)."""
    graph = model.inplace
    return graph is not None and graph.output_sig[lm_output(model.info)].dims[1] == LM_POSITIONS_DIM


def speculative_runner(model: Model, rows: list[list[int]], pad: int, new: int, what: str):
    """The runner a speculative generation checks drafts on (and a draft build guesses with): the
    in-place graph's where checks_drafts, else model.onnx's, whose caches must hold the whole sequence."""
    if checks_drafts(model):
        return InplaceRunner(model, rows, new)
    check_runner(model.graphs["model"], what)
    return DecoderRunner(model, rows, pad, new)


class EncoderDecoderRunner:
    """An encoder-decoder build: the encoder runs once on the right-padded sources; its
    cross-attention K/V are the decoder's past_key_values.N.encoder.* at every step."""

    def __init__(self, model: Model, rows: list[list[int]], pad: int, start: int, new: int):
        self.encoder, self.graph = model.graphs["encoder"], model.graphs["decoder"]
        self.logits_name = lm_output(model.info)
        self.src, self.src_mask = pad_rows(rows, pad, left=False)
        self.start = start
        self.kv = CacheBuffers(self.graph, len(rows), 1 + new) if self.graph.device == "cpu" else None
        self.length = 0  # decoder tokens so far
        self.cache: dict = {}
        self.cross: dict = {}

    def prefill(self) -> np.ndarray:
        feeds = {INPUT_IDS: self.src, ATTENTION_MASK: self.src_mask}
        if TOKEN_TYPE_IDS in self.encoder.inputs:
            feeds[TOKEN_TYPE_IDS] = np.zeros_like(self.src)
        self.cross = present_to_past(self.encoder.run(feeds))
        starts = np.full((len(self.src), 1), self.start, dtype=np.int64)
        return self._run({INPUT_IDS: starts, **empty_cache(self.graph, len(self.src))})

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self._run({INPUT_IDS: tokens[:, None].astype(np.int64), **self.cache})

    def _run(self, feeds: dict) -> np.ndarray:
        self.length += 1
        feeds = {**feeds, **self.cross, ENCODER_ATTENTION_MASK: self.src_mask}
        self.cache, out = run_cached(self.graph, self.kv, feeds, self.length)
        return last_logits(out, self.logits_name)

    def reorder(self, rows: np.ndarray) -> None:
        # beams of one source share its cross-attention K/V, so only the self-attention cache moves
        self.cache = reorder_cache(self.graph, self.kv, self.cache, rows)


def lm_output(info: BuildInfo) -> str:
    """The output generation reads: the build's `lm` output."""
    if info.lm_output is None:
        raise RunError("generation needs an `lm` output; this build has " + ", ".join(o.name for o in info.outputs))
    return info.lm_output


def last_logits(outputs: dict, name: str) -> np.ndarray:
    """The last position's logits [rows, vocab] of a graph's outputs (OrtValues)."""
    return outputs[name].numpy()[:, -1, :]


# --- choosing tokens: specc/decoding/sampling.py's Sampler (log_softmax and sample re-exported) ---


def _lp(n: int, alpha: float) -> float:
    """Wu et al. 2016's length penalty."""
    return ((5.0 + n) / 6.0) ** alpha


# --- the loops ----------------------------------------------------------------------------------


def generate(model: Model, input_ids, max_new_tokens: int = 20, *, temperature: float | None = None,
             top_k: int | None = None, top_p: float | None = None, seed: int | None = None, do_sample: bool = False,
             beams: int = 1, length_penalty: float = 0.6, eos_id: int | None = None, pad_id: int | None = None,
             on_token: OnToken | None = None, speculative: str | Model | None = None) -> Generated:
    """Generate from one prompt, a batch of prompts (any lengths) or an int64 array [batch, seq]
    (as Session.generate, which calls this). speculative: a drafter's name, or a draft build's Session
    (same vocabulary), for one prompt, greedy or sampling (specc/runtime/speculative.py)."""
    info = model.info
    if info.architecture not in ("decoder", "encoder-decoder"):
        raise RunError("generation needs a decoder or an encoder-decoder build; use `specc run` for encoders")
    # options, prompts, lengths and beams, all before anything is allocated
    rows = check_generation(model.limits, info.architecture, input_ids, max_new_tokens, beams=beams,
                            temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, do_sample=do_sample,
                            length_penalty=length_penalty, eos_id=eos_id, pad_id=pad_id, speculative=speculative)
    sampling = do_sample or samples(temperature, top_k, top_p)
    eos = eos_id if eos_id is not None else info.tokens.eos
    pad = pad_id if pad_id is not None else info.pad_for(eos)
    if speculative is not None:
        spared = checks_drafts(model) and io_spare(t.dims for n, t in model.inplace.inputs.items() if is_past(n))
        if why := refusal(info.activations, spared):
            raise RunError(why)
        runner = speculative_runner(model, rows, pad, max_new_tokens, f"speculative={speculative!r}")
        if isinstance(speculative, str):
            drafter = DRAFTERS[speculative](rows[0])
        else:
            what = f"speculative: the draft build {getattr(speculative, 'dir', speculative)}"
            check_draft(speculative, model, len(rows[0]) + max_new_tokens)
            drafter = ModelDraft(speculative_runner(speculative, rows, pad, max_new_tokens + MAX_DRAFT, what),
                                 rows[0], speculative.limits.context)
        stats = Speculation()
        new = speculative_loop(runner, rows[0], max_new_tokens,
                               Sampler(temperature, top_k, top_p, seed, sampling=sampling), eos, on_token, drafter,
                               stats)
        return Generated(ids=[rows[0] + new], new_ids=[new], speculation=stats)
    if info.architecture == "encoder-decoder":
        start = info.start_for(pad)
        make = lambda rs: EncoderDecoderRunner(model, rs, pad, start, max_new_tokens)  # noqa: E731
        prefixes = [[start] for _ in rows]
    elif beams == 1 and len({len(r) for r in rows}) == 1 and (captured := model.captured(len(rows))) is not None:
        make = lambda rs: CapturedRunner(captured, rs, max_new_tokens)  # noqa: E731
        prefixes = rows
    elif model.inplace is not None and beams == 1 and len({len(r) for r in rows}) == 1:
        make = lambda rs: InplaceRunner(model, rs, max_new_tokens)  # noqa: E731
        prefixes = rows
    else:
        make = lambda rs: DecoderRunner(model, rs, pad, max_new_tokens)  # noqa: E731
        prefixes = rows
    if beams > 1:
        new = _beam_search(make, rows, max_new_tokens, beams, length_penalty, eos)
        if on_token:  # beams settle only at the end: report the winners then
            for step in range(max(map(len, new), default=0)):
                on_token(step, [r[step] if step < len(r) else None for r in new])
    else:
        choose = Sampler(temperature, top_k, top_p, seed, sampling=sampling)
        new = _step_loop(make(rows), len(rows), max_new_tokens, choose, eos, pad, on_token)
    return Generated(ids=[p + n for p, n in zip(prefixes, new)], new_ids=new)


def _step_loop(runner, batch: int, max_new: int, choose, eos: int | None, pad: int, on_token) -> list[list[int]]:
    """Greedy or sampling: one token per row per step; a row that produced EOS is done."""
    new: list[list[int]] = [[] for _ in range(batch)]
    done = np.zeros(batch, dtype=bool)
    logits = runner.prefill()
    for step in range(max_new):
        chosen = np.asarray(choose(logits), dtype=np.int64)
        chosen = np.where(done, pad, chosen)
        for i in range(batch):
            if not done[i]:
                new[i].append(int(chosen[i]))
        if on_token:
            on_token(step, [None if done[i] else int(chosen[i]) for i in range(batch)])
        if eos is not None:
            done |= chosen == eos
        if done.all() or step == max_new - 1:
            break
        logits = runner.step(chosen)
    return new


def _beam_search(make, rows: list[list[int]], max_new: int, k: int, alpha: float, eos: int | None) -> list[list[int]]:
    """Beam search with k beams per prompt; hypotheses scored by sum(log p) / lp(length)."""
    b = len(rows)
    runner = make([r for r in rows for _ in range(k)])  # row b*k + j: beam j of prompt b
    logp = log_softmax(runner.prefill())
    vocab = logp.shape[-1]
    scores = np.full((b, k), -np.inf)
    scores[:, 0] = 0.0  # the beams start identical: expand only the first
    seqs: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(b)]
    finished: list[list[tuple[float, list[int]]]] = [[] for _ in range(b)]
    closed = np.zeros(b, dtype=bool)
    for step in range(max_new):
        cand = (scores[:, :, None] + logp.reshape(b, k, vocab)).reshape(b, k * vocab)
        top = np.argsort(-cand, axis=-1, kind="stable")[:, : 2 * k]
        rows_next, tokens_next = np.zeros(b * k, dtype=np.int64), np.zeros(b * k, dtype=np.int64)
        new_scores = np.full((b, k), -np.inf)
        new_seqs: list[list[list[int]]] = [[[] for _ in range(k)] for _ in range(b)]
        for i in range(b):
            j = 0
            for c in top[i]:
                beam, token, score = int(c // vocab), int(c % vocab), float(cand[i, c])
                if not np.isfinite(score) or closed[i]:
                    break
                seq = seqs[i][beam] + [token]
                if eos is not None and token == eos:
                    finished[i].append((score / _lp(len(seq), alpha), seq))
                    continue
                new_scores[i, j], new_seqs[i][j] = score, seq
                rows_next[i * k + j], tokens_next[i * k + j] = i * k + beam, token
                j += 1
                if j == k:
                    break
            if len(finished[i]) >= k:
                best_running = new_scores[i].max() / _lp(max_new, alpha) if alpha >= 0 else new_scores[i].max()
                if min(s for s, _ in sorted(finished[i], reverse=True)[:k]) >= best_running:
                    closed[i] = True
        scores, seqs = new_scores, new_seqs
        if closed.all() or step == max_new - 1:
            break
        runner.reorder(rows_next)
        logp = log_softmax(runner.step(tokens_next))
    out = []
    for i in range(b):
        hyps = list(finished[i]) + [(scores[i, j] / _lp(len(seqs[i][j]), alpha), seqs[i][j])
                                    for j in range(k) if np.isfinite(scores[i, j])]
        out.append(max(hyps, key=lambda h: h[0])[1] if hyps else [])
    return out
