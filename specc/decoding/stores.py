"""The cache of every sequence the engine decodes, and the one place its form is chosen
(`choose_store`): the in-place store where the build has an in-place cache graph that takes no
attention_mask, else the block over the model graph.

InplaceBlock, over the in-place cache graph (specc/export/inplace.py; a decoder whose attention
onnxruntime's GroupQueryAttention computes): one store per layer's cache [R, H, T, Dh] whose
first B rows are the active rows, row i's l_i positions left-aligned and T at least the longest
final length of its rows. A step binds those rows as both past and present, and row i's new
position is written at its own column l_i (seqlens_k): each row attends to its own positions
alone, so nothing is masked. A row that leaves has another moved into its place, a row that
joins is copied into the next free row: only the rows that move are copied, and a new store is
made only for a row longer than T or more rows than R. A host that binds outputs
(GraphCall.writes_into) has the step write in place and copy nothing; one that cannot has the
graph's present (the store's rows with the new positions written) copied back into the store.

CacheBlock, over the model graph (model.onnx), one per growing present.* output, [B, H, T, Dh]
with T the longest row: row i holds its own l_i positions right-aligned (columns T - l_i .. T - 1),
zeros before them, and the step's attention_mask is 0 on that left padding. Positions are counted
from the mask (specc/spec/io.py's positions_from_mask), so row i's next token sits at position
l_i whatever the padding. A step reads the block as past_key_values.* and the graph writes
present.* into the other of two buffers (or, on a host that cannot bind outputs, returns it as
its own arrays, which become the block), and a row that joins or leaves makes one copy of the
block into new buffers. A layer that keeps a window cache of W positions has views of min(W, T)
columns, the last ones of the block's.

Both say how many positions they hold as admission counts them (`held`), and never grow past
max_cache_tokens: admission reserves every row's final length before it joins. Both prefill a
prompt either whole or after a past of its first positions that the prefix cache kept
(prefix.py), where every cache holds the whole sequence (`reuses_prefixes`).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np

from ..spec import io
from .errors import DecodingError
from .facts import Limits
from .graphs import GraphCall, GraphFacts


def inplace_feeds(inputs: Iterable[str], ids: np.ndarray, start, caches: Mapping[str, Any]) -> dict[str, Any]:
    """An in-place cache graph's feeds for `ids` [batch, sequence] (numpy int64) at positions
    start.. (an int, or one per row [batch]: rows of different lengths, each left-aligned in its
    cache), nothing padded, with its cache buffers `caches` (past_key_values.* -> [batch,
    kv_heads, max_sequence, head_dim]); `inputs`: the graph's input names (position_ids,
    attention_mask and token_type_ids (zeros) where it takes them; attention_mask only for rows of
    one length)."""
    b, t = ids.shape
    starts = np.broadcast_to(np.asarray(start, dtype=np.int64), (b,))
    out = {io.INPUT_IDS: ids, io.SEQLENS_K: (starts + t - 1).astype(np.int32),
           io.TOTAL_SEQUENCE_LENGTH: np.array(starts.max() + t, dtype=np.int32), **caches}
    if io.POSITION_IDS in inputs:
        out[io.POSITION_IDS] = starts[:, None] + np.arange(t, dtype=np.int64)[None, :]
    if io.ATTENTION_MASK in inputs:
        if (starts != starts[0]).any():
            raise ValueError("an in-place graph that takes attention_mask runs rows of one length only")
        out[io.ATTENTION_MASK] = np.ones((b, int(starts[0]) + t), dtype=np.int64)
    if io.TOKEN_TYPE_IDS in inputs:
        out[io.TOKEN_TYPE_IDS] = np.zeros((b, t), dtype=np.int64)
    return out


def store_kind(inplace: GraphFacts | None, model: Callable[[], GraphFacts]) -> str:
    """Which store decodes a build: "inplace" where it has an in-place cache graph that takes no
    attention_mask (one that does runs rows of one length only), else "block" over the model
    graph (`model` gives its facts, asked only then), which must take attention_mask: rows that
    started at different times share a step through it. DecodingError where neither can."""
    if inplace is not None and inplace.mask is None:
        return "inplace"
    if model().mask is None:
        raise DecodingError(f"the decoder graph takes no {io.ATTENTION_MASK}; sequences that started at "
                            "different times cannot share its step")
    return "block"


def choose_store(limits: Limits, inplace: GraphCall | None, model: Callable[[], GraphCall]) -> CacheBlock | InplaceBlock:
    """The store the engine decodes with, by store_kind's rule. `model` makes the model graph's
    GraphCall where it is needed, so a host with an in-place graph never opens the model graph
    for generation."""
    opened: list[GraphCall] = []

    def model_facts() -> GraphFacts:
        opened.append(model())
        return opened[0].facts

    if store_kind(None if inplace is None else inplace.facts, model_facts) == "inplace":
        return InplaceBlock(inplace, limits)
    return CacheBlock(opened[0], limits.max_cache_tokens)


def _whole(facts: GraphFacts) -> bool:
    """Whether every cache of a graph holds the whole sequence (none keeps a window)."""
    return all(io.cache_window(c.dims) is None for c in facts.cache)


def _last(logits: np.ndarray) -> np.ndarray:
    """The last position's logits [rows, vocab] of a graph's [rows, positions, vocab]."""
    return np.asarray(logits)[:, -1, :]


class CacheBlock:
    """The growing cache of every active row over the model graph (the module's doc): two flat
    buffers per growing present.* output, used in turn. T is the longest row's positions
    (`length`). Buffers grow on demand, never past `max_positions` x H x Dh."""

    def __init__(self, graph: GraphCall, max_positions: int):
        self.graph = graph
        self.facts = graph.facts
        self.max_positions = max_positions
        self.logits = self.facts.logits
        # present name -> (H, Dh, numpy dtype), and its dims (a window cache's length dim)
        self.shapes: dict[str, tuple[int, int, str]] = {c.present: (c.heads, c.head_dim, c.numpy_dtype)
                                                        for c in self.facts.cache}
        self.dims: dict[str, tuple] = {c.present: c.dims for c in self.facts.cache}
        self.pasts = {c.present: c.past for c in self.facts.cache}
        self.buffers: list[dict[str, np.ndarray]] = [{}, {}]
        self.turn = 0  # the buffer the next views come from
        self.current: dict[str, np.ndarray] = {}  # views (or a host's arrays) holding the block now
        self.rows, self.length = 0, 0

    def bytes_per_position(self) -> int:
        return sum(h * d * np.dtype(dt).itemsize for h, d, dt in self.shapes.values())

    @property
    def held(self) -> int:
        """Positions the block holds: rows x the longest row."""
        return self.rows * self.length

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a prefill can start after a past of cached positions (prefix.py): every cache
        holds the whole sequence (no window cache)."""
        return _whole(self.facts)

    def prefill(self, ids: np.ndarray, past: dict | None = None) -> tuple[dict, np.ndarray]:
        """One prompt [1, p] alone, an empty cache (Session.generate's prefill of one prompt), or
        its positions after `past` (present name -> [1, H, k, Dh]: its first k positions, from the
        prefix cache): its present.* [1, H, k + p, Dh] and its last position's logits [1, V]."""
        k = 0 if past is None else next(iter(past.values())).shape[2]
        feeds = self._feeds(ids, np.ones((1, k + ids.shape[1]), dtype=np.int64))
        for c in self.facts.cache:
            feeds[c.past] = past[c.present] if past is not None else \
                np.zeros(io.empty_cache_dims(c.dims, 1), dtype=c.numpy_dtype)
        out = self.graph(feeds)
        return {name: np.asarray(out[name]) for name in self.shapes}, _last(out[self.logits])

    def step(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One decode step [B, 1], row i's token at position lengths[i] (the mask's): the rows'
        logits [B, V]; the block grows by a column. A failed call leaves the block as it was."""
        mask = (np.arange(self.length + 1)[None, :] >= (self.length - lengths)[:, None]).astype(np.int64)
        feeds = self._feeds(ids, mask)
        feeds.update({self.pasts[name]: view for name, view in self.current.items()})
        into = self.next(self.rows, self.length + 1) if self.graph.writes_into else None
        out = self.graph(feeds, into)
        self.hold({name: np.asarray(out[name]) for name in self.shapes}, self.length + 1)
        return _last(out[self.logits])

    def regroup(self, keep: list[tuple[int, int, int]], joining: list[tuple[dict, int, int]]) -> list[int]:
        """The rows `keep` ((row index, positions, final length)) and then `joining` ((its prefill's
        present.*, positions, final length)), in one copy, in that order (returned as
        InplaceBlock.regroup returns its own)."""
        length = max([n for _, n, _ in keep] + [n for _, n, _ in joining], default=0)
        self.relayout([(i, n) for i, n, _ in keep], [(p, n) for p, n, _ in joining], length)
        return list(range(len(keep) + len(joining)))

    def _feeds(self, ids: np.ndarray, mask: np.ndarray) -> dict:
        f = self.facts
        feeds = {f.ids: ids, f.mask: mask}
        if f.positions:
            feeds[f.positions] = io.positions_from_mask(mask, ids.shape[1])
        if f.token_types:
            feeds[f.token_types] = np.zeros_like(ids)
        return feeds

    def next(self, rows: int, length: int) -> dict[str, np.ndarray]:
        """Views [rows, H, length, Dh] (a window cache's: min(W, length) columns) of the buffer
        not holding the block, grown if it must be."""
        if rows * length > self.max_positions:  # admission reserves every row's final length: a bug if reached
            raise DecodingError(f"cache of {rows} x {length} positions past its budget of {self.max_positions}")
        out = {}
        for name, (h, d, dtype) in self.shapes.items():
            n = io.cache_length(self.dims[name], length)
            cells = rows * n
            buf = self.buffers[self.turn].get(name)
            if buf is None or buf.size < cells * h * d:
                grown = min(self.max_positions, max(cells, 2 * (buf.size // (h * d) if buf is not None else 0)))
                buf = self.buffers[self.turn][name] = np.empty(grown * h * d, dtype)
            out[name] = buf[: cells * h * d].reshape(rows, h, n, d)
        return out

    def hold(self, views: Mapping[str, np.ndarray], length: int) -> None:
        """Make `views` (from next(rows, length), or a host's arrays of those shapes) the block."""
        self.current, self.turn = dict(views), 1 - self.turn
        first = next(iter(views.values()), None)
        self.rows, self.length = (first.shape[0], length) if first is not None else (0, 0)

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
                m = io.cache_length(dims, n)
                view[j, :, : width - m] = 0
                view[j, :, width - m:] = self.current[name][i, :, self.current[name].shape[2] - m:]
            for j, (present, n) in enumerate(joining, start=len(keep)):
                m = io.cache_length(dims, n)
                view[j, :, : width - m] = 0
                view[j, :, width - m:] = present[name][0]
        if rows:
            self.hold(views, length)
        else:
            self.current, self.rows, self.length = {}, 0, 0


class InplaceBlock:
    """The store of an in-place cache graph (the module's doc): one store per past_key_values.*
    [R, H, T, Dh], of which a step binds the first B rows (a view: the active rows) as both past
    and present. Row i's l_i positions are left-aligned and the graph writes its new position at
    column l_i, reading only its own l_i + 1. T is at least the longest final length (prompt +
    max_tokens) of the rows, and R x T stays within max_cache_tokens; a graph with a spare
    position (specc/export/inplace.py's `spare`) has one column more, past T, which a call of one
    row writes and the next call writes over.

    Rows come and go without a new store: a row that leaves has a row from past the new end
    moved into its place (that row's positions only), a row that joins has its prefill's
    positions copied into the next free row, so the rows change order (regroup says how). Only a
    row whose final length is past T, or more rows than R, makes a new store (every row copied
    once; `_restore` sizes it). The store is kept while the engine runs, empty or not: a page
    no row has written takes no memory, and one a row wrote stays in memory until a new store."""

    def __init__(self, graph: GraphCall, limits: Limits):
        self.graph = graph
        self.facts = graph.facts
        self.inputs = self.facts.inputs
        self.logits = self.facts.logits
        self.max_rows, self.max_positions = limits.max_sequences, limits.max_cache_tokens
        # past name -> (H, Dh, numpy dtype)
        self.shapes: dict[str, tuple[int, int, str]] = {c.past: (c.heads, c.head_dim, c.numpy_dtype)
                                                        for c in self.facts.cache}
        self.presents = {c.past: c.present for c in self.facts.cache}
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
        """Buffers for `columns` positions a row (and the graph's spare one past them)."""
        columns += self.facts.spare
        caches = {name: np.zeros((rows, h, columns, d), dtype) for name, (h, d, dtype) in self.shapes.items()}
        return caches, {self.presents[name]: buf for name, buf in caches.items()}

    def _run(self, ids: np.ndarray, start, caches: dict, into: dict) -> np.ndarray:
        """One call writing into `caches` (past name -> buffer; `into`: the same by present name):
        in place where the host binds outputs, else the graph's presents copied back. The LM
        output: the call's last min(t, io.LM_POSITIONS) positions [B, ., V]."""
        out = self.graph(inplace_feeds(self.inputs, ids, start, caches), into)
        for present, view in into.items():
            got = out[present]
            if got is not view:
                view[...] = got
        return np.asarray(out[self.logits])

    @property
    def reuses_prefixes(self) -> bool:
        """Whether a prefill can start after a past of cached positions (CacheBlock's rule)."""
        return _whole(self.facts)

    def prefill(self, ids: np.ndarray, past: dict | None = None) -> tuple[dict, np.ndarray]:
        """One prompt [1, p] alone into buffers of its own [1, H, p, Dh], or its positions after
        `past` (past name -> [1, H, k, Dh], from the prefix cache) into buffers of k + p: those,
        and its last position's logits [1, V]."""
        k = 0 if past is None else next(iter(past.values())).shape[2]
        caches, into = self._buffers(1, k + ids.shape[1])
        if past is not None:
            for name, buf in caches.items():
                buf[:, :, :k] = past[name]
        return caches, _last(self._run(ids, k, caches, into))

    def step(self, ids: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """One decode step [B, 1], row i's token at position lengths[i], written in place: the
        rows' logits [B, V]."""
        return _last(self._run(ids, lengths, self.current, self.into))

    def extend(self, row: int, ids: np.ndarray, length: int) -> np.ndarray:
        """Row `row` alone: its tokens `ids` [1, t] at positions length.., written in place into its
        own rows of the store (GroupQueryAttention takes several new positions after a cache for
        one row at a time): their logits [1, t, V] (t at most io.LM_POSITIONS: a speculative
        check). Positions past length + t that the row wrote before are written over later,
        never read."""
        caches = {name: view[row:row + 1] for name, view in self.current.items()}
        return self._run(ids, length, caches, {self.presents[name]: v for name, v in caches.items()})

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
        self.into = {self.presents[name]: view for name, view in self.current.items()}
