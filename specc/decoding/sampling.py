"""Choosing tokens from logits: greedy, or drawn with temperature, top-k and top-p. One sampler
for every generation specc runs: Session.generate (specc/runtime/generate.py) and each request
of the engine, in either host. So a request with a seed draws what Session.generate draws for
its prompt alone, by construction: the same generator, seeded the same way, one uniform draw
per row per token, in the same order.

The rule for which options sample is here too (`samples`): temperature 0 is greedy.
"""
from __future__ import annotations

import numpy as np


def samples(temperature: float | None, top_k: int | None, top_p: float | None) -> bool:
    """Whether these options sample rather than take the most likely token: any of them given,
    except temperature 0, which is greedy whatever else is given (as llama.cpp's server and
    OpenAI's API read it)."""
    if temperature == 0:
        return False
    return temperature is not None or top_k is not None or top_p is not None


def greedy(logits: np.ndarray) -> np.ndarray:
    """The most likely token of each row of `logits` [rows, vocab]: numpy's argmax (the first of
    equal maxima), with float16 rows compared as integers ordered as the floats are (numpy has no
    fast float16 comparison: its float16 argmax runs an order of magnitude slower than an int16
    one over an LM's vocabulary). +0 orders above -0 there; NaN above everything, as argmax has it."""
    if logits.dtype != np.float16:
        return logits.argmax(-1)
    bits = np.ascontiguousarray(logits).view(np.int16)
    return (bits ^ ((bits >> 15) & 0x7FFF)).argmax(-1)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k: int | None,
           top_p: float | None) -> np.ndarray:
    """One token per row from softmax(logits / temperature), restricted to the top_k most likely
    and to the smallest set whose probability reaches top_p: one uniform draw per row."""
    return draw(distribution(logits, temperature, top_k, top_p), rng)


def draw(p: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One token per row of the probabilities p [rows, vocab]: one uniform draw per row."""
    u = rng.random((len(p), 1))
    return np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[-1] - 1)


def distribution(logits: np.ndarray, temperature: float, top_k: int | None, top_p: float | None) -> np.ndarray:
    """The probabilities [rows, vocab] that `sample` draws from: softmax(logits / temperature),
    restricted to the top_k most likely and to the smallest set reaching top_p, renormalized."""
    x = logits.astype(np.float64) / max(temperature, 1e-6)
    if top_k:
        kth = np.sort(x, axis=-1)[:, -min(top_k, x.shape[-1])][:, None]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(log_softmax(x))
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < top_p  # always keeps the first
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


class Sampler:
    """Tokens from logits [rows, vocab], one per row: the most likely, or, where the options
    sample (`samples`, or `sampling` given: do_sample with no option), drawn at `temperature`
    (1 where not given) from the top_k / top_p set, with a generator seeded with `seed` (fresh
    entropy without one)."""

    def __init__(self, temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
                 seed: int | None = None, sampling: bool | None = None):
        self.sampling = samples(temperature, top_k, top_p) if sampling is None else sampling
        self.temperature = temperature or 1.0
        self.top_k, self.top_p = top_k, top_p
        self.rng = np.random.default_rng(seed) if self.sampling else None

    def __call__(self, logits: np.ndarray) -> np.ndarray:
        if self.rng is None:
            return greedy(logits)
        return sample(logits, self.rng, self.temperature, self.top_k, self.top_p)
