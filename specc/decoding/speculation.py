"""Speculative decoding's rules, which Session.generate (specc/runtime/speculative.py) and the
serving engine (engine.py) share: how many tokens to draft next (DraftLength), which drafted
tokens the target keeps and the token after them (`check`), and what a generation did
(Speculation). Drafters are draft.py's.

A step checks k drafted tokens after the token chosen last in one call of k + 1 positions, whose
logits L0..Lk (after that token and after each draft) `check` reads. The in-place cache graph's
LM output holds a call's last io.LM_POSITIONS positions, so k is at most MAX_DRAFT.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..spec import io
from .sampling import Sampler

MAX_DRAFT = io.LM_POSITIONS - 1  # the longest draft (one call checks it)
PAUSE, MAX_PAUSE = 4, 64  # plain steps after two all-rejected drafts in a row; doubled while rejections go on
BUDGET = 0.03  # the share of a paused stretch's time that the losing checks before it may cost
SLACK = 0.5  # steps a check that kept drafts may lose and still count as paying (timings jitter)


def refusal(activations: str | None) -> str | None:
    """Why a build that decodes in `activations` (facts.Model's) cannot decode speculatively, or
    None where it can. At int8 activations a call of several positions does not compute what single
    steps do: GroupQueryAttention's several-position path rounds otherwise (about 1e-6), and the
    next MatMulNBits' 8-bit input codes turn that into a quantization step (llama-2-7b's seeded
    int4 build: a logit 0.20 of 5.4 apart), so drafts checked in one call would not give plain
    decoding's tokens."""
    if activations != "int8":
        return None
    return ("speculative: this build decodes with int8 activations (an int8 build, or serving.activations int8), "
            "which onnxruntime computes differently for several positions in one call than for one, so checked drafts "
            "would not give plain decoding's tokens; build it with --activations fp32 to decode it speculatively")


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
    """k, the number of tokens to draft next: 0 at first (a plain step, whose time checks are
    weighed against), then 1 (the cheapest probe), then from how the last drafts fared: doubled
    (to MAX_DRAFT) when a draft is all accepted, one past the accepted count when part of it is,
    halved when none is. `accepted`: drafts accepted per check, a running mean (the newest check weighs 1/4),
    MAX_DRAFT before the first.

    When drafting stops for a while (0: plain steps): without timings (`plain` never called),
    after two all-rejected drafts in a row, for PAUSE steps, the pause doubling (to MAX_PAUSE)
    while drafts keep failing. With them, a check is weighed against the plain steps its time
    would have made: a check (drafting and checking, `seconds`) that made fewer tokens than
    seconds / step is a loss of the difference, in steps (one that kept drafts and lost less than
    SLACK counts as paying); drafting pauses after two losses in a row or losses in a row of a
    step or more, for long enough that the losing checks in a row, probed as often, cost
    at most BUDGET of the steps around them (their summed loss / BUDGET steps, at least the
    doubling pause, at most MAX_PAUSE). So where a check costs several steps (a big model's int4 graph at
    fp32 activations: a check of 1 draft took 2.3 steps at 7B) text with nothing to copy runs
    plain steps but for rare probes, and where it costs about one, drafting goes on."""

    def __init__(self):
        self.k, self.misses, self.pause, self.wait = 1, 0, PAUSE, 1
        self.accepted = float(MAX_DRAFT)
        self.step: float | None = None  # a plain step's seconds, a running mean (`plain`)
        self.loss = 0.0  # steps lost by the losing checks in a row

    def next(self) -> int:
        if self.wait:
            self.wait -= 1
            return 0
        return self.k

    def plain(self, seconds: float) -> None:
        """A plain step (no drafts) took `seconds`."""
        self.step = seconds if self.step is None else self.step + (seconds - self.step) / 4

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A check of `drafted` drafts kept `accepted`; `seconds`: what drafting and checking took."""
        if drafted == 0:
            return
        self.accepted += (accepted - self.accepted) / 4
        lost = 0.0 if seconds is None or not self.step else max(0.0, seconds / self.step - (accepted + 1))
        if accepted == 0:
            self.k = max(1, self.k // 2)
        else:
            self.k = min(2 * self.k, MAX_DRAFT) if accepted == drafted else accepted + 1
        if accepted > 0 and lost < SLACK:
            self.misses, self.pause, self.loss = 0, PAUSE, 0.0
            return
        self.misses, self.loss = self.misses + 1, self.loss + lost
        if self.misses >= 2 or self.loss >= 1.0:
            self.wait = min(max(self.pause, math.ceil(self.loss / BUDGET)), MAX_PAUSE)
            self.pause, self.misses, self.loss = min(2 * self.pause, MAX_PAUSE), 0, 0.0


def check(choose: Sampler, logits: np.ndarray, draft: list[int]) -> tuple[int, int]:
    """(how many drafted tokens are kept, the token after them) from the target's logits after
    each of [token] + draft [1 + len(draft), vocab]: the target's own token at each position is
    chosen as plain decoding chooses it, and drafts are kept while each is that token.

    Greedy: the target's most likely token. Sampling: one uniform draw per position, in order,
    from the Sampler's generator, which is then left where plain sampling leaves it after the
    tokens kept (the draws of the positions after the first rejected draft are taken back). So
    a seed's tokens are plain sampling's with that seed, token for token, whatever was drafted;
    each token has the target's distribution given the ones before it, and a draft x is kept
    with probability p(x), as the speculative sampling rule of Leviathan et al. 2023 and Chen et
    al. 2023 keeps a drafter's certain guess (q = 1 on x: min(1, p(x) / q(x)))."""
    before = choose.rng.bit_generator.state if choose.sampling else None
    chosen = choose(logits)  # sampling: one uniform per row, in order, as plain sampling draws row by row
    accepted = 0
    while accepted < len(draft) and int(chosen[accepted]) == draft[accepted]:
        accepted += 1
    if before is not None:
        choose.rng.bit_generator.state = before
        choose.rng.random((accepted + 1, 1))  # the draws of the tokens kept
    return accepted, int(chosen[accepted])
