"""Speculative decoding of one prompt: a drafter (prompt lookup, specc/decoding/draft.py, or a
draft build's greedy guesses, ModelDraft) guesses the next tokens, the target checks them all in one call of its cached graph, and the tokens kept are the
target's own: greedy or sampled, plain decoding's tokens, token for token (`check`: a seed's
draws are plain sampling's, one per token kept).

    logits --choose--> token --drafter--> d1..dk (k: DraftLength)
      ^                                        |
      |  runner.extend([token, d1..dk]): the logits after each, L0..Lk, in one call
      |  check: a drafts kept (greedy: while each is the target's choice) and the token after them
      '-- runner.truncate(): the cache cut back past the first rejected draft

A draft that is all rejected costs one call of k + 1 positions (and the drafter's time) where
plain decoding makes one of 1; the loop times both and DraftLength weighs each check against the
plain steps its time would have made, halving k after a rejection and pausing drafting after
checks that lost, long enough that text with nothing to copy runs (nearly) plain steps; prompt
lookup's guesses, free, are still weighed on those plain steps, and a streak of right ones (text
that has started to copy) ends the pause.

The runner is generate.py's InplaceRunner over the build's in-place graph, whose LM output holds
a call's last io.LM_POSITIONS positions (MAX_DRAFT drafts and the token before them), where the
build has one that runs here; else its DecoderRunner over model.onnx, whose LM output holds every
position and whose caches must then hold the whole sequence (a window cache has lost the positions
a roll-back would need). A drafter has two methods: extend(tokens), the tokens kept, and
propose(k), up to k guesses; and may have a third, prefill(), its own work on the prompt, which the
loop runs right after the target's, before the first token (as llama.cpp's speculative example
evaluates the prompt with both models before it decodes).
"""
from __future__ import annotations

import time

import numpy as np

from specc.decoding.draft import free_guess
from specc.decoding.sampling import Sampler, greedy
from specc.decoding.speculation import MAX_DRAFT, DraftLength, Speculation, check  # noqa: F401 - MAX_DRAFT: this module's API too
from specc.runtime.errors import RunError
from specc.spec.io import cache_window, is_past


def check_runner(graph, what: str) -> None:
    """RunError where `graph` (model.onnx) keeps a window cache, which cannot be cut back."""
    for name, t in graph.inputs.items():
        if is_past(name) and cache_window(t.dims) is not None:
            raise RunError(f"{what}: {name} keeps a window of {cache_window(t.dims)} positions; "
                           "speculative decoding needs caches of the whole sequence")


def check_draft(draft, target, positions: int) -> None:
    """RunError where `draft` (a Session) cannot draft for `target`: not a decoder, another
    vocabulary, or fewer than `positions` positions (prompt + max_new_tokens); its runner's
    graph is checked where it is made (generate.speculative_runner)."""
    what = f"speculative: the draft build {getattr(draft, 'dir', draft)}"
    if draft.info.architecture != "decoder":
        raise RunError(f"{what} is an {draft.info.architecture}; a draft build is a decoder")
    if draft.limits.vocab != target.limits.vocab:
        raise RunError(f"{what} has a vocabulary of {draft.limits.vocab}, the model {target.limits.vocab}; "
                       "they must share one")
    if positions > draft.limits.context:
        raise RunError(f"{what} takes {draft.limits.context} positions, fewer than the prompt + max_new_tokens "
                       f"({positions})")


class ModelDraft:
    """A draft model's greedy guesses: `runner` is generate.speculative_runner's over the draft
    build for the prompt (not yet prefilled), sized for the prompt, max_new_tokens and MAX_DRAFT more. Its cache
    holds the K/V of `cached` tokens; before guessing, it is cut back to what they share with the
    text so far, and the rest of the text is run in one call."""

    def __init__(self, runner, prompt: list[int], context: int):
        self.runner, self.context = runner, context
        self.tokens = list(prompt)
        self.cached: list[int] | None = None  # None: not prefilled yet

    def extend(self, tokens) -> None:
        self.tokens.extend(int(t) for t in tokens)

    def prefill(self) -> None:
        """The prompt (the runner's rows) through the draft build, once: what its first guess
        would wait for otherwise."""
        if self.cached is None:
            self.runner.prefill()
            self.cached = self.tokens[: self.runner.ids.shape[1]]

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
        self.prefill()  # the prompt first, where the loop has not run it; the tokens after it below
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
    [token]) for each as it is kept: generate.py's _step_loop's tokens, greedy or sampled with
    the same seed (`check`)."""
    length = DraftLength(capped=getattr(drafter, "free", False))  # (a draft build's pauses: the budget's alone)
    new: list[int] = []

    def keep(token: int) -> bool:
        """Keep `token`; whether generation ends with it."""
        new.append(token)
        drafter.extend([token])
        if on_token:
            on_token(len(new) - 1, [token])
        return token == eos or len(new) == max_new

    token = int(choose(runner.prefill())[0])
    if max_new > 1 and (prefill := getattr(drafter, "prefill", None)):
        prefill()
    while not keep(token):
        start = time.perf_counter()
        draft = drafter.propose(min(length.next(), max_new - len(new)))
        out = runner.extend(np.asarray([[token] + draft], dtype=np.int64))[0]  # [1 + len(draft), vocab]
        seconds = time.perf_counter() - start
        accepted, token = check(choose, out, draft)
        stats.steps, stats.drafted, stats.accepted = stats.steps + 1, stats.drafted + len(draft), stats.accepted + accepted
        if draft:
            length.update(len(draft), accepted, seconds)
        else:
            length.plain(seconds)
            if (guess := free_guess(drafter)) is not None:  # (the drafter's text ends before `token`)
                length.guessed(guess == [token])
        for d in draft[:accepted]:
            if keep(d):
                return new
        if accepted < len(draft):
            runner.truncate(len(prompt) + len(new))
    return new


