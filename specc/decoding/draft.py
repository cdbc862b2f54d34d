"""Drafters for speculative decoding: guesses of the next tokens that the target model then checks
in one multi-token step (specc/runtime/speculative.py), so a guess changes how fast tokens come,
never which tokens come.

PromptLookup needs no second model: where the last n tokens of the text so far (prompt and
generated tokens, n from MAX_NGRAM down to MIN_NGRAM, the longest first) occurred before, it
proposes the tokens that followed their latest earlier occurrence. Text that copies from its
prompt (a quotation, a rewrite, code edited in place) is drafted well; free text rarely is, and
then nothing is proposed. A single token seen before (a quotation mark, a comma) is too common
to say where the text goes, so a suffix of one token proposes nothing (MIN_NGRAM; what it
saves: docs/benchmarks_speculative.md).

Each n-gram's two latest end positions are kept in a dict updated per token, so a proposal costs
O(MAX_NGRAM) whatever the length of the text.
"""
from __future__ import annotations

from typing import Iterable

MAX_NGRAM = 3  # the longest suffix matched
MIN_NGRAM = 2  # the shortest


class PromptLookup:
    """The n-gram index of one sequence: `extend` it with tokens as they come (the prompt first),
    `propose` up to k next tokens."""

    free = True  # a proposal costs nothing next to a model call: plain steps may ask for a guess too (DraftLength.guessed)

    def __init__(self, tokens: Iterable[int] = ()):
        self.tokens: list[int] = []
        self.lengths = tuple(range(MAX_NGRAM, MIN_NGRAM - 1, -1))  # the suffixes matched, longest first
        # n -> n-gram -> (its latest end position, the one before or -1)
        self.ends: dict[int, dict[tuple[int, ...], tuple[int, int]]] = {n: {} for n in self.lengths}
        self.extend(tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        for token in tokens:
            self.tokens.append(int(token))
            end = len(self.tokens) - 1
            for n, index in self.ends.items():
                if end + 1 >= n:
                    gram = tuple(self.tokens[end + 1 - n:])
                    latest = index.get(gram)
                    index[gram] = (end, latest[0] if latest else -1)

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix (of
        MIN_NGRAM to MAX_NGRAM tokens) seen before; [] where no such suffix occurred before or k < 1."""
        if k < 1 or not self.tokens:
            return []
        for n in self.lengths:
            if n > len(self.tokens):
                continue
            found = self.ends[n].get(tuple(self.tokens[-n:]))
            if found is not None and found[1] >= 0:
                start = found[1] + 1  # the suffix itself is the latest occurrence; the one before
                return self.tokens[start:start + k]
        return []


def free_guess(drafter) -> list[int] | None:
    """The drafter's guess of the next token ([] for none) where guessing costs nothing
    (`free`: prompt lookup), for a plain step to weigh (DraftLength.guessed); else None."""
    return drafter.propose(1) if getattr(drafter, "free", False) else None


DRAFTERS = {"ngram": PromptLookup}  # speculative decoding's drafters by the name a caller gives
