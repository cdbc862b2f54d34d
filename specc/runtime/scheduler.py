"""Server-side generation: one KV cache for every sequence a server decodes, and a scheduler that
runs one batched decode step for all of them (iteration-level, "continuous" batching, as Orca,
Yu et al. 2022, OSDI, introduced it). Pure onnxruntime and numpy: `specc serve` drives it from its
request threads, the tests drive it directly.

    submit(request, sink) --> waiting (FIFO, at most max_waiting; one more: Busy, HTTP 503)
       | admitted when a place and the cache budget allow, in order of arrival
       v
    prefill alone (batch 1, an empty cache: what Session.generate runs for one prompt)
       | its first token to the sink; its cache joins the block
       v
    each iteration: ONE decode step [B, 1] for all B active sequences -> one token each
       | a sequence leaves when it ends (eos, the sink says stop, max_tokens, cancel)
       v
    the block is compacted (rows that left dropped; over model.onnx, columns no row needs any more too)

The cache block, where the build has an in-place cache graph (specc/export/inplace.py; a
decoder whose attention onnxruntime's GroupQueryAttention computes): InplaceBlock, one store per
layer's cache [R, H, T, Dh] whose first B rows are the active rows, row i's l_i positions
left-aligned and T at least the longest final length of its rows. A step binds those rows as both
past and present, and row i's new position is written at its own column l_i (seqlens_k), in
place: a step copies nothing, and each row attends to its own positions alone, so nothing is
masked. A row that leaves has another moved into its place, a row that joins is copied into the
next free row: only the rows that move are copied, and a new store is made only for a row longer
than T or more rows than R.

Otherwise CacheBlock over model.onnx, one per growing present.* output, [B, H, T, Dh] with T the
longest row: row i holds its own l_i positions right-aligned (columns T - l_i .. T - 1), zeros
before them, and the step's attention_mask is 0 on that left padding. Positions are counted from
the mask (specc/spec/io.py's positions_from_mask), so row i's next token sits at position l_i
whatever the padding: the left padding of Session.generate's ragged batches, on a batch whose rows
start at different times. A step reads the block as past_key_values.* and onnxruntime writes
present.* into the other of two buffers (as specc/runtime/cache.py's CacheBuffers), a copy of the
block every step, and a row that joins or leaves makes one copy of the block into new buffers.

Limits (GenerationLimits, from serving.generation and `specc serve`'s flags): max_sequences rows
at once; max_cache_tokens positions of the block, counted as it is held (rows x the longest
row, padding included; an InplaceBlock: rows x the longest final length, its store R x T),
reserved at admission for every row's final length (prompt + max_tokens), so a running block
never outgrows its budget; max_waiting requests queued. A request that could never fit (its own
prompt + max_tokens past the budget or the context) is refused at once (RunError, HTTP 400); one
that cannot fit now waits.

Encoder-decoder builds are not scheduled here: their decoder graph takes no attention_mask for
its own cache, so rows that started at different times cannot share one step.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Mapping, Protocol

import numpy as np

from specc.runtime.cache import empty_cache, inplace_feeds
from specc.runtime.errors import RunError
from specc.runtime.generate import Model, lm_output, sample
from specc.runtime.graph import Graph
from specc.runtime.inputs import check_generation
from specc.spec import triton as rule
from specc.spec.io import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    TOKEN_TYPE_IDS,
    cache_length,
    is_growing,
    is_past,
    is_present,
    numpy_dtype,
    parse_cache,
    positions_from_mask,
    present_to_past,
)
from specc.spec.manifest import BuildInfo

# why a sequence ended (the generate endpoint's finish_reason, as llama.cpp's server and OpenAI's
# API name them): its eos token or a stop its sink found; max_tokens; the client went away; a
# failure of the server's (onnxruntime)
STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"


class Busy(RunError):
    """The server cannot take the request now (its queue is full, or it is shutting down): HTTP 503."""


@dataclass(frozen=True)
class GenerationLimits:
    """What the scheduler holds at once: `max_sequences` rows in a step, `max_cache_tokens`
    positions of cache (rows x the longest row), `max_waiting` requests queued."""

    max_sequences: int
    max_cache_tokens: int
    max_waiting: int

    @classmethod
    def of(cls, info: BuildInfo, max_sequences: int | None = None, max_cache_tokens: int | None = None,
           max_waiting: int | None = None) -> GenerationLimits:
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
        return cls(max_sequences=sequences, max_cache_tokens=tokens, max_waiting=waiting)


@dataclass(frozen=True)
class GenerationRequest:
    """One prompt and how to continue it. Greedy unless temperature > 0, top_k or top_p is given
    (temperature 0 is greedy, as llama.cpp's server and OpenAI's API read it); `eos` replaces the
    spec's tokens.eos (-1: none, so only max_tokens ends it)."""

    ids: tuple[int, ...]
    max_tokens: int
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos: int | None = None

    @property
    def sampling(self) -> bool:
        if self.temperature == 0:
            return False
        return self.temperature is not None or self.top_k is not None or self.top_p is not None


class Sink(Protocol):
    """Where a sequence's tokens go, called from the scheduler's thread, in order. token() returns
    False to end the sequence there (a stop string found; finish reason "stop"); done() is
    called once, last, with the finish reason and, for ERROR, a one-line message."""

    def token(self, token_id: int) -> bool: ...

    def done(self, reason: str, error: str | None = None) -> None: ...


@dataclass(eq=False)
class _Sequence:
    ticket: int
    request: GenerationRequest
    sink: Sink
    eos: int | None
    need: int  # positions of its final length: prompt + max_tokens
    rng: np.random.Generator | None
    length: int = 0  # positions in the cache
    last: int = -1  # the token the next step feeds
    made: int = 0  # tokens made so far
    present: dict | None = None  # after prefill, before it joins the block: its own [1, H, p, Dh]
    ended: str | None = None


@dataclass
class Stats:
    """What the scheduler holds now, and what it has done since it started."""

    active: int = 0
    waiting: int = 0
    cache_positions: int = 0  # the block's rows x its longest row
    steps: int = 0  # batched decode steps
    prefills: int = 0
    tokens: int = 0  # tokens made
    finished: dict = field(default_factory=lambda: collections.Counter())


class CacheBlock:
    """The growing cache of every active row, two flat buffers per growing present.* output, used
    in turn: views [B, H, T, Dh] of one are a step's past, onnxruntime writes the present into
    views of the other. T is the longest row's positions (`length`); a layer that keeps a window
    cache of W positions (spec/io.py) has views of min(W, T) columns, the last ones of the
    block's. Buffers grow on demand, never past `max_positions` x H x Dh."""

    def __init__(self, graph: Graph, max_positions: int, logits: str):
        self.graph = graph
        self.max_positions = max_positions
        self.logits = logits
        self.shapes: dict[str, tuple[int, int, str]] = {}  # present name -> (H, Dh, dtype)
        self.dims: dict[str, tuple] = {}  # present name -> its signature dims
        for name, t in graph.output_sig.items():
            if is_present(name) and is_growing(name):
                _, h, _, d = t.dims
                self.shapes[name], self.dims[name] = (h, d, numpy_dtype(t.dtype)), tuple(t.dims)
        self.buffers: list[dict[str, np.ndarray]] = [{}, {}]
        self.turn = 0  # the buffer the next views come from
        self.current: dict[str, np.ndarray] = {}  # views holding the block now
        self.rows, self.length = 0, 0

    def bytes_per_position(self) -> int:
        return sum(h * d * np.dtype(dt).itemsize for h, d, dt in self.shapes.values())

    @property
    def held(self) -> int:
        """Positions the block holds: rows x the longest row."""
        return self.rows * self.length

    def prefill(self, ids: np.ndarray) -> tuple[dict, np.ndarray]:
        """One prompt [1, p] alone, an empty cache (Session.generate's prefill of one prompt): its
        present.* [1, H, p, Dh] and its last position's logits [1, V]."""
        feeds = self._feeds(ids, np.ones_like(ids))
        feeds.update(empty_cache(self.graph, 1))
        out = self.graph.run(feeds)
        return {name: out[name].numpy() for name in self.shapes}, out[self.logits].numpy()[:, -1, :]

    def step(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One decode step [B, 1], row i's token at position lengths[i] (the mask's): the rows'
        logits [B, V]; the block grows by a column. RunError leaves the block as it was."""
        mask = (np.arange(self.length + 1)[None, :] >= (self.length - lengths)[:, None]).astype(np.int64)
        feeds = self._feeds(ids, mask)
        feeds.update(self.past())
        into = self.next(self.rows, self.length + 1)
        out = self.graph.run(feeds, into=into)
        self.hold(into, self.length + 1)
        return out[self.logits].numpy()[:, -1, :]

    def regroup(self, keep: list[tuple[int, int, int]], joining: list[tuple[dict, int, int]]) -> list[int]:
        """The rows `keep` ((row index, positions, final length)) and then `joining` ((its prefill's
        present.*, positions, final length)), in one copy, in that order (returned as
        InplaceBlock.regroup returns its own)."""
        length = max([n for _, n, _ in keep] + [n for _, n, _ in joining], default=0)
        self.relayout([(i, n) for i, n, _ in keep], [(p, n) for p, n, _ in joining], length)
        return list(range(len(keep) + len(joining)))

    def _feeds(self, ids: np.ndarray, mask: np.ndarray) -> dict:
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: mask}
        if POSITION_IDS in self.graph.inputs:
            feeds[POSITION_IDS] = positions_from_mask(mask, ids.shape[1])
        if TOKEN_TYPE_IDS in self.graph.inputs:
            feeds[TOKEN_TYPE_IDS] = np.zeros_like(ids)
        return feeds

    def next(self, rows: int, length: int) -> dict[str, np.ndarray]:
        """Views [rows, H, length, Dh] (a window cache's: min(W, length) columns) of the buffer
        not holding the block, grown if it must be."""
        if rows * length > self.max_positions:  # admission reserves every row's final length: a bug if reached
            raise RunError(f"cache of {rows} x {length} positions past its budget of {self.max_positions}")
        out = {}
        for name, (h, d, dtype) in self.shapes.items():
            n = cache_length(self.dims[name], length)
            cells = rows * n
            buf = self.buffers[self.turn].get(name)
            if buf is None or buf.size < cells * h * d:
                grown = min(self.max_positions, max(cells, 2 * (buf.size // (h * d) if buf is not None else 0)))
                buf = self.buffers[self.turn][name] = np.empty(grown * h * d, dtype)
            out[name] = buf[: cells * h * d].reshape(rows, h, n, d)
        return out

    def hold(self, views: Mapping[str, np.ndarray], length: int) -> None:
        """Make `views` (from next(rows, length)) the block."""
        self.current, self.turn = dict(views), 1 - self.turn
        first = next(iter(views.values()), None)
        self.rows, self.length = (first.shape[0], length) if first is not None else (0, 0)

    def past(self) -> dict:
        """The block as past_key_values.* inputs (OrtValues over the views, no copy)."""
        ort = self.graph.ort
        return present_to_past({k: ort.OrtValue.ortvalue_from_numpy(v) for k, v in self.current.items()})

    def relayout(self, keep: list[tuple[int, int]], joining: list[tuple[dict, int]], length: int) -> None:
        """A new block of `length` columns: the current rows `keep` (row index, its positions) and
        then `joining`'s rows (each its own present.* [1, H, p, Dh], p positions; a window cache's
        holds the last min(W, p)), each right-aligned and zero on its left (masked, but it must be
        finite: 0 x NaN is NaN)."""
        rows = len(keep) + len(joining)
        views = self.next(rows, length) if rows else {}
        for name, view in views.items():
            dims, width = self.dims[name], view.shape[2]
            for j, (i, n) in enumerate(keep):
                m = cache_length(dims, n)
                view[j, :, : width - m] = 0
                view[j, :, width - m:] = self.current[name][i, :, self.current[name].shape[2] - m:]
            for j, (present, n) in enumerate(joining, start=len(keep)):
                m = cache_length(dims, n)
                view[j, :, : width - m] = 0
                view[j, :, width - m:] = present[name][0]
        if rows:
            self.hold(views, length)
        else:
            self.current, self.rows, self.length = {}, 0, 0


class InplaceBlock:
    """The block of a build's in-place cache graph (specc/export/inplace.py): one store per
    past_key_values.* [R, H, T, Dh], of which a step binds the first B rows (a view: the active
    rows) as both past and present. Row i's l_i positions are left-aligned (columns 0 .. l_i - 1)
    and GroupQueryAttention writes its new position at column l_i (its seqlens_k), reading only
    its own l_i + 1: nothing is masked. T is at least the longest final length (prompt +
    max_tokens) of the rows, and R x T stays within max_cache_tokens.

    Rows come and go without a new store: a row that leaves has a row from past the new end
    moved into its place (that row's positions only), a row that joins has its prefill's
    positions copied into the next free row, so the rows change order (regroup says how). Only a
    row whose final length is past T, or more rows than R, makes a new store (every row copied
    once; `_restore` sizes it). The store is kept while the scheduler runs, empty or not: a page
    no row has written takes no memory, and one a row wrote stays in memory until a new store."""

    def __init__(self, graph: Graph, logits: str, limits: GenerationLimits):
        self.graph = graph
        self.logits = logits
        self.max_rows, self.max_positions = limits.max_sequences, limits.max_cache_tokens
        self.shapes: dict[str, tuple[int, int, str]] = {}  # past name -> (H, Dh, dtype)
        for name, t in graph.inputs.items():
            if is_past(name):
                _, h, _, d = t.dims
                self.shapes[name] = (h, d, numpy_dtype(t.dtype))
        self.store: dict[str, np.ndarray] = {}  # past name -> [R, H, T, Dh]
        self.current: dict[str, np.ndarray] = {}  # past name -> the active rows' view [B, H, T, Dh]
        self.into: dict[str, np.ndarray] = {}  # present name -> the same view
        self.rows, self.capacity = 0, 0  # B, T
        self.longest = 0  # the longest final length of the active rows

    @property
    def held(self) -> int:
        """Positions the active rows hold as admission counts them: rows x the longest final
        length (the store itself is R x T, within max_cache_tokens)."""
        return self.rows * self.longest

    @property
    def slots(self) -> int:
        """R, the rows the store has room for (0 before the first)."""
        return len(next(iter(self.store.values()), ()))

    def _buffers(self, rows: int, columns: int) -> tuple[dict, dict]:
        caches = {name: np.zeros((rows, h, columns, d), dtype) for name, (h, d, dtype) in self.shapes.items()}
        return caches, {parse_cache(name)[1].present: buf for name, buf in caches.items()}

    def prefill(self, ids: np.ndarray) -> tuple[dict, np.ndarray]:
        """One prompt [1, p] alone into buffers of its own [1, H, p, Dh]: those, and its last
        position's logits [1, V]."""
        caches, into = self._buffers(1, ids.shape[1])
        out = self.graph.run(inplace_feeds(self.graph.inputs, ids, 0, caches), into=into)
        return caches, out[self.logits].numpy()[:, -1, :]

    def step(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One decode step [B, 1], row i's token at position lengths[i], written in place: the
        rows' logits [B, V]."""
        out = self.graph.run(inplace_feeds(self.graph.inputs, ids, lengths, self.current), into=self.into)
        return out[self.logits].numpy()[:, -1, :]

    def regroup(self, keep: list[tuple[int, int, int]], joining: list[tuple[dict, int, int]]) -> list[int]:
        """The rows `keep` ((row index, positions, final length)) and then `joining` ((its prefill's
        buffers, positions, final length)); returns the new rows' order as indices into keep +
        joining (row r holds entry order[r])."""
        rows = len(keep) + len(joining)
        need = self.longest = max((final for *_, final in keep + joining), default=0)
        if rows > self.slots or need > self.capacity:
            return self._restore(keep, joining, need)
        order: list[int | None] = [None] * len(keep)
        movers = []
        for k, (i, _, _) in enumerate(keep):
            if i < len(keep):
                order[i] = k
            else:
                movers.append(k)
        for r, k in zip([r for r, k in enumerate(order) if k is None], movers):
            i, n, _ = keep[k]
            for buf in self.store.values():
                buf[r, :, :n] = buf[i, :, :n]
            order[r] = k
        for j, (source, n, _) in enumerate(joining):
            for name, buf in self.store.items():
                buf[len(keep) + j, :, :n] = source[name][0, :, :n]
            order.append(len(keep) + j)
        self._view(rows)
        return order

    def _restore(self, keep: list[tuple[int, int, int]], joining: list[tuple[dict, int, int]], need: int) -> list[int]:
        """A new store, the rows copied into it in order: T the longest final length `need` up to
        a power of two (so that a few longer rows make no new store) and R twice the old store's
        rows (so that rows arriving one by one make a few), each as far as max_cache_tokens allows
        beside the rows (rows x need is within it: admission holds it so)."""
        sources = [(self.store, i, n) for i, n, _ in keep] + [(b, 0, n) for b, n, _ in joining]
        rows = len(sources)
        columns = max(need, min(1 << (need - 1).bit_length(), self.max_positions // rows))
        grown = min(self.max_rows, self.max_positions // columns, 2 * self.slots)
        store, _ = self._buffers(max(rows, grown), columns)
        for name, buf in store.items():
            for r, (source, i, n) in enumerate(sources):
                buf[r, :, :n] = source[name][i, :, :n]
        self.store, self.capacity = store, columns
        self._view(rows)
        return list(range(rows))

    def _view(self, rows: int) -> None:
        self.rows = rows
        self.current = {name: buf[:rows] for name, buf in self.store.items()}
        self.into = {parse_cache(name)[1].present: view for name, view in self.current.items()}


class Scheduler:
    """Continuous batching over a decoder build (a Session, or anything with `graphs`, `info`
    and `limits`). submit() from any thread; the work happens in step(), called by one thread:
    the one start() makes, or a test's own loop (`while scheduler.step(): pass`)."""

    def __init__(self, model: Model, limits: GenerationLimits | None = None):
        info = model.info
        if info.architecture != "decoder" or "model" not in model.graphs:
            raise RunError("server-side generation needs a decoder build (an encoder-decoder's decoder "
                           "graph takes no mask for its own cache, so its rows cannot share a step)")
        self.model = model
        self.info = info
        self.logits_name = lm_output(info)
        self.limits = limits or GenerationLimits.of(info)
        inplace = getattr(model, "inplace", None)
        if inplace is not None and ATTENTION_MASK not in inplace.inputs:
            self.block: CacheBlock | InplaceBlock = InplaceBlock(inplace, self.logits_name, self.limits)
        else:
            graph = model.graphs["model"]
            if ATTENTION_MASK not in graph.inputs:
                raise RunError("server-side generation needs a decoder graph that takes attention_mask")
            self.block = CacheBlock(graph, self.limits.max_cache_tokens, self.logits_name)
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []
        self._cancelled: set[int] = set()
        self._tickets = itertools.count(1)
        self._closed: str | None = None  # why new requests are refused (shutting down)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.stats = Stats()

    # --- the callers' side (any thread) ---------------------------------------------------------

    def check(self, request: GenerationRequest) -> tuple[int, int | None]:
        """A request checked as Session.generate checks one prompt, and against this server's
        budget; returns (positions it needs, its eos). RunError (HTTP 400) with one line."""
        if not request.ids:
            raise RunError("input_ids: an empty prompt; give at least one token")
        try:
            check_generation(self.model.limits, "decoder", list(request.ids), request.max_tokens,
                             temperature=request.temperature or None, top_k=request.top_k, top_p=request.top_p,
                             seed=request.seed, eos_id=request.eos)
        except RunError as exc:  # Session.generate's rules, in the words of a request's fields
            raise RunError(str(exc).replace("max_new_tokens", "max_tokens").replace("eos_id", "eos")) from None
        need = len(request.ids) + request.max_tokens
        if need > self.limits.max_cache_tokens:
            raise RunError(f"prompt ({len(request.ids)} tokens) + max_tokens ({request.max_tokens}) is more than "
                           f"the server's cache of {self.limits.max_cache_tokens} positions (max_cache_tokens)")
        eos = request.eos if request.eos is not None else self.info.tokens.eos
        return need, (None if eos is not None and eos < 0 else eos)

    def submit(self, request: GenerationRequest, sink: Sink) -> int:
        """Queue a request; returns its ticket (for cancel). RunError for a bad request, Busy when
        the queue is full or the server is shutting down; nothing is queued then."""
        need, eos = self.check(request)
        rng = np.random.default_rng(request.seed) if request.sampling else None
        with self._lock:
            if self._closed:
                raise Busy(self._closed)
            if len(self._waiting) >= self.limits.max_waiting and not self._fits_now(need):
                raise Busy(f"server busy: {len(self._active)} sequences running and {len(self._waiting)} requests "
                           f"waiting (max_waiting {self.limits.max_waiting}); retry later")
            seq = _Sequence(next(self._tickets), request, sink, eos, need, rng)
            self._waiting.append(seq)
            self.stats.waiting = len(self._waiting)
            self._lock.notify_all()
        return seq.ticket

    def cancel(self, ticket: int) -> None:
        """End a request (its client went away): it leaves at the next iteration, its sink told
        CANCELLED. Unknown or finished tickets are ignored."""
        with self._lock:
            self._cancelled.add(ticket)
            self._lock.notify_all()

    def close(self, why: str = "server shutting down; retry on another server") -> None:
        """Refuse new requests (Busy with `why`); those queued and running go on to their end."""
        with self._lock:
            self._closed = why

    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._active

    def drain(self, timeout: float) -> bool:
        """close(), then wait up to `timeout` seconds for every queued and running request to
        end; True if they did."""
        self.close()
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    # --- the scheduler's thread -------------------------------------------------------------------

    def start(self) -> None:
        """Run step() on a thread of its own until stop()."""
        self._thread = threading.Thread(target=self._loop, name="specc-scheduler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread; sequences still running end CANCELLED."""
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        for seq in list(self._active) + list(self._waiting):
            self._end(seq, CANCELLED)
        self._active, self._waiting = [], collections.deque()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._active:
                    self._lock.wait()
                if self._stop:
                    return
            self.step()

    def step(self) -> bool:
        """One iteration: drop what was cancelled, admit what fits (each prefilled alone), one
        batched decode step for every active row, and let the rows that ended leave. Returns
        whether work remains."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [s for s in self._waiting if s.ticket in cancelled]
            for seq in dropped:
                self._waiting.remove(seq)
        for seq in dropped + [s for s in self._active if s.ticket in cancelled]:
            self._end(seq, CANCELLED)  # before admission: their places are free for it
        with self._lock:
            admitted = []
            while self._waiting and self._fits(self._waiting[0].need, admitted):
                admitted.append(self._waiting.popleft())
            self.stats.waiting = len(self._waiting)
        joining = []
        for seq in admitted:
            if seq.ticket in cancelled:
                self._end(seq, CANCELLED)
            elif self._prefill(seq):
                joining.append(seq)
        self._regroup(joining)
        if self._active:
            self._decode()
            self._regroup([])
        with self._lock:
            self.stats.active = len(self._active)
            self.stats.cache_positions = self.block.held
            return bool(self._waiting or self._active)

    # --- admission ---------------------------------------------------------------------------------

    def _fits(self, need: int, pending: list[_Sequence]) -> bool:
        """Whether one more row of `need` positions fits beside the active rows and `pending`
        (admitted this iteration): max_sequences rows, and rows x the longest final length
        within max_cache_tokens (the block never grows past what its rows end at)."""
        rows = [s.need for s in self._active if s.ended is None] + [s.need for s in pending]
        rows.append(need)
        return len(rows) <= self.limits.max_sequences and len(rows) * max(rows) <= self.limits.max_cache_tokens

    def _fits_now(self, need: int) -> bool:
        return not self._waiting and self._fits(need, [])

    # --- the graph calls ------------------------------------------------------------------------------

    def _prefill(self, seq: _Sequence) -> bool:
        """The prompt alone, batch 1, an empty cache: Session.generate's prefill of one prompt.
        Its first token goes to the sink; False if the sequence ended there."""
        ids = np.asarray([seq.request.ids], dtype=np.int64)
        try:
            seq.present, logits = self.block.prefill(ids)
        except RunError as exc:
            self._end(seq, ERROR, str(exc))
            return False
        self.stats.prefills += 1
        seq.length = ids.shape[1]
        return self._emit(seq, logits)

    def _decode(self) -> None:
        """One step [B, 1] for every active row: each row's last token at its own position."""
        ids = np.array([[s.last] for s in self._active], dtype=np.int64)
        try:
            logits = self.block.step(ids, np.array([s.length for s in self._active], dtype=np.int64))
        except RunError as exc:  # every row of the step fails alike
            for seq in self._active:
                self._end(seq, ERROR, str(exc))
            self.block.regroup([], [])
            return
        self.stats.steps += 1
        for i, seq in enumerate(self._active):
            seq.length += 1
            if seq.ended is None:
                self._emit(seq, logits[i: i + 1])

    def _emit(self, seq: _Sequence, logits: np.ndarray) -> bool:
        """Choose the row's next token from its [1, V] logits (argmax, or its own generator as
        Session.generate samples one prompt), hand it to the sink, and end the row where it
        ends. True while it goes on."""
        r = seq.request
        if seq.rng is not None:
            token = int(sample(logits, seq.rng, r.temperature or 1.0, r.top_k, r.top_p)[0])
        else:
            token = int(logits[0].argmax())
        seq.last, seq.made = token, seq.made + 1
        self.stats.tokens += 1
        try:
            more = seq.sink.token(token) is not False
        except Exception:  # a sink's failure ends its own row only
            more = False
        if not more or (seq.eos is not None and token == seq.eos):
            self._end(seq, STOP)
        elif seq.made >= r.max_tokens:
            self._end(seq, LENGTH)
        return seq.ended is None

    def _end(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        if seq.ended is not None:
            return
        seq.ended = reason
        self.stats.finished[reason] += 1
        try:
            seq.sink.done(reason, error)
        except Exception:  # noqa: S110 - a sink's failure cannot stop the others
            pass

    def _regroup(self, joining: list[_Sequence]) -> None:
        """Rows that ended leave the block and `joining` rows enter it (the block says in which
        order the rows then are); nothing is copied when no row leaves or joins."""
        keep = [(i, s) for i, s in enumerate(self._active) if s.ended is None]
        joining = [s for s in joining if s.ended is None]
        if len(keep) == len(self._active) and not joining:
            return
        entries = [s for _, s in keep] + joining
        order = self.block.regroup([(i, s.length, s.need) for i, s in keep],
                                   [(s.present, s.length, s.need) for s in joining])
        rows = [entries[k] for k in order]
        for s in joining:
            s.present = None
        with self._lock:
            self._active = rows
