"""Speculative decoding of one prompt: a drafter (prompt lookup, specc/decoding/draft.py, or a
draft build's greedy guesses, ModelDraft) guesses the next tokens, the target checks them all in one call of its cached graph, and the tokens kept are the
target's own: greedy, plain greedy decoding's, token for token; sampling, by the speculative
sampling rule (`check`), draws from the distribution plain sampling draws from (not the same
draws: the generator is used differently).

    logits --choose--> token --drafter--> d1..dk (k: DraftLength)
      ^                                        |
      |  runner.extend([token, d1..dk]): the logits after each, L0..Lk, in one call
      |  check: a drafts kept (greedy: while each is the target's choice) and the token after them
      '-- runner.truncate(): the cache cut back past the first rejected draft

A draft that is all rejected costs one call of k + 1 positions where plain decoding makes one of
1; DraftLength halves k after a rejection and stops drafting for a while after rejections in a
row, so text with nothing to copy runs (nearly) plain steps.

The runner is generate.py's DecoderRunner over model.onnx, the graph whose LM output holds every
position (the in-place graph's holds the last alone, so it cannot check a draft). Its caches must
hold the whole sequence: a window cache has lost the positions a roll-back would need. A
drafter has two methods: extend(tokens), the tokens kept, and propose(k), up to k guesses.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specc.decoding.sampling import Sampler, draw, greedy
from specc.runtime.errors import RunError
from specc.spec.io import cache_window, is_past

FIRST_DRAFT, MAX_DRAFT = 4, 8  # draft lengths: the first tried, the longest
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
    (to MAX_PAUSE) while drafts keep failing."""

    def __init__(self):
        self.k, self.misses, self.pause, self.wait = FIRST_DRAFT, 0, PAUSE, 0

    def next(self) -> int:
        if self.wait:
            self.wait -= 1
            return 0
        return self.k

    def update(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        if accepted == 0:
            self.k, self.misses = max(1, self.k // 2), self.misses + 1
            if self.misses >= 2:
                self.wait, self.pause, self.misses = self.pause, min(2 * self.pause, MAX_PAUSE), 0
            return
        self.misses, self.pause = 0, PAUSE
        self.k = min(2 * self.k, MAX_DRAFT) if accepted == drafted else accepted + 1


def check_runner(graph, what: str) -> None:
    """RunError where `graph` (model.onnx) keeps a window cache, which cannot be cut back."""
    for name, t in graph.inputs.items():
        if is_past(name) and cache_window(t.dims) is not None:
            raise RunError(f"{what}: {name} keeps a window of {cache_window(t.dims)} positions; "
                           "speculative decoding needs caches of the whole sequence")


def check_draft(draft, target, positions: int) -> None:
    """RunError where `draft` (a Session) cannot draft for `target`: not a decoder, another
    vocabulary, a window cache, or fewer than `positions` positions (prompt + max_new_tokens)."""
    what = f"speculative: the draft build {getattr(draft, 'dir', draft)}"
    if draft.info.architecture != "decoder":
        raise RunError(f"{what} is an {draft.info.architecture}; a draft build is a decoder")
    if draft.limits.vocab != target.limits.vocab:
        raise RunError(f"{what} has a vocabulary of {draft.limits.vocab}, the model {target.limits.vocab}; "
                       "they must share one")
    if positions > draft.limits.context:
        raise RunError(f"{what} takes {draft.limits.context} positions, fewer than the prompt + max_new_tokens "
                       f"({positions})")
    check_runner(draft.graphs["model"], what)


class ModelDraft:
    """A draft model's greedy guesses: `runner` is a DecoderRunner over the draft build for the
    prompt (not yet prefilled), sized for the prompt, max_new_tokens and MAX_DRAFT more. Its cache
    holds the K/V of `cached` tokens; before guessing, it is cut back to what they share with the
    text so far, and the rest of the text is run in one call."""

    def __init__(self, runner, prompt: list[int], context: int):
        self.runner, self.context = runner, context
        self.tokens = list(prompt)
        self.cached: list[int] | None = None  # None: not prefilled yet

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def propose(self, k: int) -> list[int]:
        k = min(k, self.context - len(self.tokens))
        if k < 1:
            return []
        logits = self._catch_up()
        guesses: list[int] = []
        for i in range(k):
            guesses.append(int(greedy(logits)[0]))
            if i < k - 1:
                logits = self.runner.step(np.asarray(guesses[-1:], dtype=np.int64))
                self.cached.append(guesses[-1])
        return guesses

    def _catch_up(self) -> np.ndarray:
        """The draft's logits after the text so far, its cache holding the text's K/V but the last's."""
        if self.cached is None:  # the prompt (the runner's rows) first; the tokens after it below
            self.runner.prefill()
            self.cached = self.tokens[: len(self.runner.mask[0])]
        shared = 0
        for a, b in zip(self.cached, self.tokens):
            if a != b:
                break
            shared += 1
        shared = min(shared, len(self.tokens) - 1)  # at least the last token runs: its logits are wanted
        if shared < len(self.cached):
            self.runner.truncate(shared)  # one prompt, nothing padded: positions are tokens
        rest = self.tokens[shared:]
        self.cached = list(self.tokens)
        return self.runner.extend(np.asarray([rest], dtype=np.int64))[:, -1, :]


def speculative_loop(runner, prompt: list[int], max_new: int, choose: Sampler, eos: int | None, on_token,
                     drafter, stats: Speculation) -> list[int]:
    """The new tokens of one prompt (batch 1), stopped at EOS (kept) or max_new; on_token(step,
    [token]) for each as it is kept. Greedy: generate.py's _step_loop's tokens; sampling: tokens
    drawn from the distribution _step_loop draws from (`check`)."""
    length = DraftLength()
    new: list[int] = []

    def keep(token: int) -> bool:
        """Keep `token`; whether generation ends with it."""
        new.append(token)
        drafter.extend([token])
        if on_token:
            on_token(len(new) - 1, [token])
        return token == eos or len(new) == max_new

    token = int(choose(runner.prefill())[0])
    while not keep(token):
        draft = drafter.propose(min(length.next(), max_new - len(new)))
        out = runner.extend(np.asarray([[token] + draft], dtype=np.int64))[0]  # [1 + len(draft), vocab]
        accepted, token = check(choose, out, draft)
        stats.steps, stats.drafted, stats.accepted = stats.steps + 1, stats.drafted + len(draft), stats.accepted + accepted
        length.update(len(draft), accepted)
        for d in draft[:accepted]:
            if keep(d):
                return new
        if accepted < len(draft):
            runner.truncate(len(prompt) + len(new))
    return new


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
