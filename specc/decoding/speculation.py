"""Speculative decoding's rules, which Session.generate (specc/runtime/speculative.py) and the
serving engine (engine.py) share: how many tokens to draft next (DraftLength), which drafted
tokens the target keeps and the token after them (`check`), and what a generation did
(Speculation). Drafters are draft.py's.

A step checks k drafted tokens after the token chosen last in one call of k + 1 positions, whose
logits L0..Lk (after that token and after each draft) `check` reads. The in-place cache graph's
LM output holds a call's last io.LM_POSITIONS positions, so k is at most MAX_DRAFT.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..spec import io
from .sampling import Sampler, draw

FIRST_DRAFT, MAX_DRAFT = 4, io.LM_POSITIONS - 1  # draft lengths: the first tried, the longest (one call checks it)
PAUSE, MAX_PAUSE = 4, 64  # plain steps after two all-rejected drafts in a row; doubled while rejections go on


@dataclass
class Speculation:
    """What a speculative generation did: target calls after the prefill, tokens drafted, drafts
    accepted."""

    steps: int = 0
    drafted: int = 0
    accepted: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


class DraftLength:
    """k, the number of tokens to draft next, from how the last drafts fared: doubled (to MAX_DRAFT)
    when a draft is all accepted, one past the accepted count when part of it is, halved when none
    is; after two all-rejected drafts in a row, 0 (plain steps) for PAUSE steps, the pause doubling
    (to MAX_PAUSE) while drafts keep failing. `accepted`: drafts accepted per check, a running
    mean (the newest check weighs 1/4), MAX_DRAFT before the first."""

    def __init__(self):
        self.k, self.misses, self.pause, self.wait = FIRST_DRAFT, 0, PAUSE, 0
        self.accepted = float(MAX_DRAFT)

    def next(self) -> int:
        if self.wait:
            self.wait -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.accepted += (accepted - self.accepted) / 4
        if accepted == 0:
            self.k, self.misses = max(1, self.k // 2), self.misses + 1
            if self.misses >= 2:
                self.wait, self.pause, self.misses = self.pause, min(2 * self.pause, MAX_PAUSE), 0
            return
        self.misses, self.pause = 0, PAUSE
        self.k = min(2 * self.k, MAX_DRAFT) if accepted == drafted else accepted + 1


def check(choose: Sampler, logits: np.ndarray, draft: list[int]) -> tuple[int, int]:
    """(how many drafted tokens are kept, the token after them) from the target's logits after
    each of [token] + draft [1 + len(draft), vocab].

    Greedy: drafts kept while each is the target's own choice; the next token is its choice after
    them. Sampling, the rule of Leviathan et al. 2023 and Chen et al. 2023 for a drafter that
    proposes one token with certainty (q = 1 on it): draft x kept with probability
    min(1, p(x) / q(x)) = p(x), p the target's distribution there (temperature, top-k, top-p as
    the Sampler draws); at the first one rejected the next token is drawn from
    max(0, p - q) renormalized, p without x; after all kept, from p after the last. Each token
    so made has the target's distribution given the ones before it."""
    if not choose.sampling:
        chosen = choose(logits)
        accepted = 0
        while accepted < len(draft) and int(chosen[accepted]) == draft[accepted]:
            accepted += 1
        return accepted, int(chosen[accepted])
    p = choose.probabilities(logits)
    for i, x in enumerate(draft):
        if choose.rng.random() >= p[i, x]:
            residual = p[i:i + 1].copy()
            residual[0, x] = 0.0
            return i, int(draw(residual / residual.sum(), choose.rng)[0])
    return len(draft), int(draw(p[len(draft):], choose.rng)[0])
