"""Prompt lookup with and without its guesses on the plain steps of a pause (DraftLength.guessed,
docs/runtime.md), against plain decoding, in one process: the tasks of benchmarks/speculative.py
on a build it made, each variant in turn per round, greedy, EOS off. Prints a Markdown table.

    .venv/bin/python benchmarks/speculative_guesses.py BUILD_DIR [--text FILE] [--tasks repeat rewrite ...]
        [--new 128] [--rounds 3]

"Without" is DraftLength with `guessed` doing nothing (what drafting did before the guesses):
the same tokens, only when drafting resumes after a pause differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402
from speculative import THREADS, paragraph, tasks, timed  # noqa: E402

from specc.decoding.speculation import DraftLength  # noqa: E402
from specc.runtime import Session  # noqa: E402
from specc.runtime import speculative as loop  # noqa: E402 - (not this folder's speculative.py)


class _Unguessed(DraftLength):
    def guessed(self, right: bool) -> None:
        pass


class _Without:
    """A session's generate with DraftLength's guesses switched off (the speculative loop's
    DraftLength swapped for the call)."""

    def __init__(self, session: Session):
        self.session = session

    def generate(self, *args, **kwargs):
        was, loop.DraftLength = loop.DraftLength, _Unguessed
        try:
            return self.session.generate(*args, **kwargs)
        finally:
            loop.DraftLength = was


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", type=Path)
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--tasks", nargs="+", default=["repeat", "rewrite", "extract", "quote", "free"])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    prompts_text = tasks(paragraph(args.text.read_text() if args.text else rm.reference_text()))
    session = Session(args.build, threads=THREADS)
    chat = session.tokenizer.chat_template is not None

    print(f"{args.build.name}: speed-up over plain decoding (calls after the prompt, drafts kept/drafted)\n")
    print("| task | with the guesses | without | same tokens |")
    print("|---|---|---|---|")
    for task in args.tasks:
        prompt = session.prompts([prompts_text[task]], chat=chat)[0]
        runs = timed({"plain": (session, {}), "with": (session, {"speculative": "ngram"}),
                      "without": (_Without(session), {"speculative": "ngram"})}, prompt, args.new, args.rounds)
        (t0, plain), (t1, on), (t2, off) = runs["plain"], runs["with"], runs["without"]
        cell = [f"{t0 / t:.2f}x ({r.speculation.steps}, {r.speculation.accepted}/{r.speculation.drafted})"
                for t, r in ((t1, on), (t2, off))]
        same = "yes" if plain.new_ids == on.new_ids == off.new_ids else "NO"
        print(f"| {task} | {cell[0]} | {cell[1]} | {same} |", flush=True)


if __name__ == "__main__":
    main()
