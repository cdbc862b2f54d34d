"""`specc serve`'s graph models: each graph of a build served as one stateless Triton model, run
with onnxruntime (the same Graph that `specc run` uses), behind Triton's dynamic batcher.

    PyTriton's requests (a dynamic batch) --> each checked alone (request_feeds: check_feeds,
        as `specc run` checks its inputs; the empty cache a prefill leaves out supplied)
        | a refused one answers its own error (pytriton_patch.refusal: HTTP 400, one line)
        v
    the others grouped by shape, each group one onnxruntime run, split back into answers

Decoders are served stateless, as in the Triton repository (docs/serving.md): the client sends
the previous step's present.* back as past_key_values.*. Model names, dims and dynamic batching
follow specc/spec/triton.py, the rule `specc build --target triton` writes into config.pbtxt.
"""
from __future__ import annotations

import sys
import threading
import traceback
from typing import Callable, Mapping

import numpy as np

from specc.runtime.cache import empty_cache
from specc.runtime.errors import RunError, ServeError
from specc.runtime.graph import Graph
from specc.runtime.inputs import Limits, check_feeds
from specc.runtime.pytriton_patch import INTERNAL_ERROR, refusal
from specc.spec import triton as rule
from specc.spec.io import INPUT_IDS, is_growing, is_past, numpy_dtype
from specc.spec.manifest import TensorInfo


def tensors(sigs: tuple[TensorInfo, ...]) -> list:
    """PyTriton tensors from the IO signature: the batch dim left to Triton, the rest dynamic.
    The growing KV-cache inputs are optional: a prefill sends none (Triton cannot carry the
    zero-length past a graph takes then), and the server supplies the empty cache."""
    from pytriton.model_config import Tensor

    out = []
    for sig in sigs:
        shape = rule.model_dims(sig.dims)
        if shape is None:
            raise ServeError(f"{sig.name}: only tensors with a leading batch dimension can be served (dims {list(sig.dims)})")
        out.append(Tensor(name=sig.name, dtype=np.dtype(numpy_dtype(sig.dtype)), shape=shape,
                          optional=is_past(sig.name) and is_growing(sig.name)))
    return out


def request_feeds(graph: Graph, request: Mapping[str, np.ndarray], limits: Limits) -> dict[str, np.ndarray]:
    """One request's inputs, checked (specc/runtime/inputs.py's check_feeds, as `specc run` checks
    them), with the empty cache a prefill leaves out; in the graph's input order."""
    feeds = check_feeds(graph.info, dict(request), limits)
    if INPUT_IDS in feeds:
        for name, value in empty_cache(graph, len(feeds[INPUT_IDS])).items():
            feeds.setdefault(name, value)
    missing = [n for n in graph.inputs if n not in feeds]  # Triton refuses these first; a direct caller may not
    if missing:
        raise RunError(f"missing input(s): {', '.join(missing)}")
    return {n: feeds[n] for n in graph.inputs if n in feeds}


def infer_fn(graph: Graph, limits: Limits) -> Callable:
    """The inference callable of one graph's model."""
    lock = threading.Lock()  # one onnxruntime run at a time per graph: the session's threads do the rest

    def infer(requests: list) -> list[dict[str, np.ndarray]]:
        """PyTriton's requests (a dynamic batch) in, one response per request out. Each request is
        checked alone, so a refused one answers its own error and the others run, batched
        together where their shapes agree (as Triton batched them)."""
        answers: list = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, dict]]] = {}
        for i, request in enumerate(requests):
            try:
                feeds = request_feeds(graph, request, limits)
            except RunError as exc:
                answers[i] = refusal(str(exc))
                continue
            groups.setdefault(tuple((n, v.shape[1:]) for n, v in feeds.items()), []).append((i, feeds))
        for members in groups.values():
            try:
                batch = {n: np.concatenate([f[n] for _, f in members]) for n in members[0][1]}
                with lock:
                    out = {k: v.numpy() for k, v in graph.run(batch).items()}
            except RunError as exc:  # onnxruntime refused what passed the checks
                for i, _ in members:
                    answers[i] = refusal(str(exc), "server")
                continue
            except Exception:  # a bug: its traceback to the server's log, one line to the client
                traceback.print_exc(file=sys.stderr)
                for i, _ in members:
                    answers[i] = refusal(INTERNAL_ERROR, "server")
                continue
            start = 0
            for i, feeds in members:
                rows = len(next(iter(feeds.values())))
                answers[i] = {k: v[start:start + rows] for k, v in out.items()}
                start += rows
        return answers

    return infer
