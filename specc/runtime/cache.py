"""The KV cache between a decoder graph's calls: empty caches for a prompt, the CPU cache buffers
of one generation, and running a graph so that its present.* become the next call's
past_key_values.* (names, dims and the present -> past rule: specc/spec/io.py). An in-place cache
graph's feeds are specc/decoding/stores.py's inplace_feeds (Session.generate's and the serving
engine's), named here too for the build's check of that graph.

On CPU a generation allocates its cache once (CacheBuffers: two buffers per cache output, used in
turn, sized for prompt + max_new_tokens, or for its window where a layer keeps a window cache)
and onnxruntime writes each step's present.* straight into them (never into the buffer the
step's past is read from, so a window's shift reads nothing the write has overwritten). On a GPU the present.* stay onnxruntime's own OrtValues on the device and are bound as
the next step's inputs. Neither copies the cache through numpy.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from specc.decoding.stores import inplace_feeds  # noqa: F401 - the in-place graph's feeds, for this module's users
from specc.runtime.errors import RunError
from specc.runtime.graph import Graph, shape_of
from specc.spec.io import (
    ATTENTION_MASK,
    cache_length,
    cache_window,
    empty_cache_dims,
    is_growing,
    is_past,
    is_present,
    numpy_dtype,
    past_from_caches,
    present_to_past,
)


def empty_cache(graph: Graph, batch: int) -> dict[str, np.ndarray]:
    """Zero-length caches [batch, heads, 0, head_dim] for each growing past_key_values.* the graph
    takes (not an encoder-decoder's cross-attention K/V, which the encoder computes)."""
    return {name: np.zeros(empty_cache_dims(t.dims, batch), dtype=numpy_dtype(t.dtype))
            for name, t in graph.inputs.items() if is_past(name) and is_growing(name)}


def past_length(graph: Graph, feeds: dict[str, Any]) -> int:
    """Positions already in the growing cache that `feeds` gives the graph, when no attention_mask
    says it (0 if the graph takes no cache): a whole-sequence cache's length, or a window cache's
    while it is shorter than its window (at its window, it does not say; RunError)."""
    growing = [n for n in graph.inputs if is_past(n) and is_growing(n)]
    p = past_from_caches((shape_of(feeds[n])[2], cache_window(graph.inputs[n].dims)) for n in growing)
    if p is None:
        first = growing[0]
        raise RunError(f"{ATTENTION_MASK}: needed with a cache: every layer keeps a window of at most "
                       f"{cache_window(graph.inputs[first].dims)} positions, so {first} of "
                       f"{shape_of(feeds[first])[2]} does not say how long the sequence is")
    return p


class CacheBuffers:
    """The growing KV cache of one generation on CPU, allocated once: two flat buffers per
    present.* output, each big enough for [batch, heads, capacity, head_dim] (a window cache's:
    [batch, heads, min(window, capacity), head_dim]), used in turn. A step
    reads its past from views of one and onnxruntime writes the present into views of the other,
    so no step allocates a cache (the graph's Concat still copies past + new into the present)."""

    def __init__(self, graph: Graph, batch: int, capacity: int):
        self.graph = graph
        self.batch, self.capacity = batch, capacity
        self.buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.heads: dict[str, tuple[int, int]] = {}
        self.dims: dict[str, tuple] = {}
        for name, t in graph.output_sig.items():
            if is_present(name) and is_growing(name):
                _, h, _, d = t.dims
                dtype = numpy_dtype(t.dtype)
                self.heads[name], self.dims[name] = (h, d), tuple(t.dims)
                size = batch * h * cache_length(t.dims, capacity) * d
                self.buffers[name] = (np.empty(size, dtype), np.empty(size, dtype))
        self.turn = 0
        self.current: dict[str, np.ndarray] = {}  # the views that hold the cache now

    def next(self, total: int) -> dict[str, np.ndarray]:
        """Views [batch, heads, length, head_dim] of the buffers not holding the current cache: the
        length a present holds after `total` positions in all (spec/io.py's cache_length)."""
        if total > self.capacity:
            raise RunError(f"cache of {total} positions past its capacity of {self.capacity}")
        out = {}
        for name, pair in self.buffers.items():
            h, d = self.heads[name]
            n = cache_length(self.dims[name], total)
            out[name] = pair[self.turn][: self.batch * h * n * d].reshape(self.batch, h, n, d)
        return out

    def hold(self, views: dict[str, np.ndarray]) -> dict[str, Any]:
        """Make `views` (from next()) the current cache; returns them as past_key_values.* inputs."""
        self.current, self.turn = views, 1 - self.turn
        return present_to_past({k: self.graph.ort.OrtValue.ortvalue_from_numpy(v) for k, v in views.items()})

    def reorder(self, rows: np.ndarray) -> dict[str, Any]:
        """The current cache with its batch rows taken in the order `rows` (beam search)."""
        views = {}
        for name, current in self.current.items():
            views[name] = self.buffers[name][self.turn][: current.size].reshape(current.shape)
        for name, view in views.items():
            np.take(self.current[name], rows, axis=0, out=view)
        return self.hold(views)

    def truncate(self, total: int) -> dict[str, Any]:
        """The current cache cut back to its first `total` positions (a whole-sequence cache only:
        a window's older positions are gone), copied into the other buffers; returns them as
        past_key_values.* inputs."""
        views = self.next(total)
        for name, view in views.items():
            view[...] = self.current[name][:, :, : view.shape[2]]
        return self.hold(views)


def run_cached(graph: Graph, kv: CacheBuffers | None, feeds: dict[str, Any], total: int) -> tuple[dict, dict]:
    """Run one prefill or step of `total` positions in all; returns (the next step's
    past_key_values.*, the graph's outputs as OrtValues). With CacheBuffers the present.* land in
    preallocated memory; without (a GPU) they stay on the device as onnxruntime's own OrtValues."""
    into = kv.next(total) if kv else None
    out = graph.run(feeds, into=into)
    return (kv.hold(into) if kv else present_to_past(out)), out


def reorder_cache(graph: Graph, kv: CacheBuffers | None, cache: dict[str, Any], rows: np.ndarray) -> dict[str, Any]:
    """`cache` (past_key_values.*) with its batch rows taken in the order `rows`."""
    if kv:
        return kv.reorder(rows)
    return {k: graph.value(k, v.numpy()[rows]) for k, v in cache.items()}


def truncate_cache(graph: Graph, kv: CacheBuffers | None, cache: dict[str, Any], total: int) -> dict[str, Any]:
    """`cache` (past_key_values.*, whole-sequence caches) cut back to its first `total` positions:
    a speculative step's rejected tokens taken out again."""
    if kv:
        return kv.truncate(total)
    return {k: graph.value(k, v.numpy()[:, :, :total]) for k, v in cache.items()}
