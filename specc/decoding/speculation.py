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
PAUSE, MAX_PAUSE = 4, 64  # untimed: plain steps after two all-rejected drafts in a row; doubled while rejections go on
BUDGET = 0.03  # timed: the share of a generation's steps that its checks may lose, net of what they gained
HORIZON = 32  # timed: steps the budget counts ahead of the tokens made, so that the first probes can be afforded
STREAK, GUESSED = 3, 3  # timed: right guesses in a row that end a pause early, and the budget (x BUDGET) they may spend
RESUME = 4  # timed: the least k after such a streak


def refusal(activations: str | None, spare: int) -> str | None:
    """Why a build that decodes in `activations` (facts.Model's) cannot decode speculatively, or
    None where it can. `spare`: whether the graph that checks drafts runs a spare position in its
    attention (io.spare). At int8 activations a call of several positions computes what single
    steps do only with it: GroupQueryAttention's one-position path rounds otherwise (about 1e-6),
    and the next MatMulNBits' 8-bit input codes turn that into a quantization step (llama-2-7b's
    seeded int4 build: a logit 0.20 of 5.4 apart), so drafts checked in one call would not give
    plain decoding's tokens; with the spare every call has two positions or more
    (specc/export/inplace.py's `spare`)."""
    if activations != "int8" or spare:
        return None
    return ("speculative: this build decodes with int8 activations (an int8 build, or serving.activations int8) and its "
            "in-place graph runs no spare position (a model with routed experts, or a build made before specc gave it one), "
            "so onnxruntime computes several positions in one call differently than one and checked drafts would not "
            "give plain decoding's tokens; build it with --activations fp32 (or build it again, where it has no routed "
            "experts) to decode it speculatively")


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

    When to draft at all (0: a plain step). With timings (`plain`: a plain step's seconds), a
    ledger: each check (drafting and checking, `seconds`) gains its tokens less its time in plain
    steps (a check of one guess that is rejected and takes 1.9 steps loses 0.9), and `balance`
    sums the gains. After a check that lost L (but one that kept every draft while k could grow:
    its draft was too short for a check that costs several steps), drafting waits until another loss of L would
    leave the generation within BUDGET of its steps and HORIZON more: balance - L + BUDGET x
    (tokens + HORIZON) >= 0 (at most MAX_PAUSE steps, or uncapped: `capped`). So text with nothing to copy loses about
    BUDGET to probes (of its tokens and HORIZON), and text that copies, whose checks have gained,
    goes on drafting through the rejections in it.
    Where guessing costs nothing (prompt lookup), the plain steps of a pause still ask the drafter
    for one guess and say whether it was the step's token (`guessed`): text that starts to copy
    after a pause shows as right guesses in a row, and STREAK of them end the pause (k at least
    RESUME) where another loss of L stays within GUESSED x BUDGET. Text whose guesses are wrong
    pauses as before; guesses that come right in streaks and whose checks still lose spend at most
    GUESSED x BUDGET.
    Without timings (the engine's batched steps): after two all-rejected drafts in a row, PAUSE
    steps, the pause doubling (to MAX_PAUSE) while drafts keep failing.

    `capped` False (a drafter whose guesses cost: a draft build): timed pauses are the budget's
    alone, not cut at MAX_PAUSE. Such a drafter runs the text made during a pause at its next
    guess, so a longer pause makes the next probe dearer, not cheaper, and probes every MAX_PAUSE
    steps would each lose that catch-up (SmolLM2's 8-layer draft: about 4 plain steps after 64
    tokens, docs/benchmarks_speculative.md)."""

    def __init__(self, capped: bool = True):
        self.capped = capped
        self.k, self.misses, self.pause, self.wait = 1, 0, PAUSE, 1
        self.accepted = float(MAX_DRAFT)
        self.step: float | None = None  # a plain step's seconds, a running mean (`plain`)
        self.balance = 0.0  # steps gained by the timed checks, less the steps they lost
        self.tokens = 0  # tokens made: each step's one and the drafts kept
        self.lost = 0.0  # what the check that started the pause lost
        self.streak = 0  # right guesses in a row (`guessed`)

    def next(self) -> int:
        self.tokens += 1
        if self.wait:
            self.wait -= 1
            return 0
        return self.k

    def plain(self, seconds: float) -> None:
        """A plain step (no drafts) took `seconds`: the estimate follows plain steps up slowly
        (a running mean) and down at once (a slow step is the machine's, not the model's)."""
        self.step = seconds if self.step is None else min(seconds, self.step + (seconds - self.step) / 4)

    def guessed(self, right: bool) -> None:
        """A plain step whose drafter's guess of its token (asked where guessing is free) was
        `right`, or wrong (or no guess)."""
        self.streak = self.streak + 1 if right else 0
        if self.wait and self.streak >= STREAK and \
                self.balance - self.lost + GUESSED * BUDGET * (self.tokens + HORIZON) >= 0:
            self.wait, self.k = 0, max(self.k, RESUME)

    def update(self, drafted: int, accepted: int, seconds: float | None = None) -> None:
        """A check of `drafted` drafts kept `accepted`; `seconds`: what drafting and checking took."""
        if drafted == 0:
            return
        self.tokens += accepted
        self.accepted += (accepted - self.accepted) / 4
        self.streak = 0  # (a streak counts the plain steps after a check)
        if accepted == 0:
            self.k = max(1, self.k // 2)
        else:
            self.k = min(2 * self.k, MAX_DRAFT) if accepted == drafted else accepted + 1
        if seconds is not None and self.step:
            if seconds < self.step:  # a check does a plain step's work and more: the estimate (a slow
                self.step = seconds  # first step) is wrong, so it is bounded and a plain step measures again
                self.wait = max(self.wait, 1)
            gain = accepted + 1 - seconds / self.step
            self.balance += gain
            if gain < 0 and not accepted == drafted < MAX_DRAFT:  # (all kept while k can grow: the draft was too short to pay)
                self.lost = -gain
                wait = max(0, math.ceil((-gain - self.balance) / BUDGET - self.tokens - HORIZON))
                self.wait = min(wait, MAX_PAUSE) if self.capped else wait
            return
        if accepted > 0:
            self.misses, self.pause = 0, PAUSE
            return
        self.misses += 1
        if self.misses >= 2:
            self.wait, self.pause, self.misses = self.pause, min(2 * self.pause, MAX_PAUSE), 0


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
