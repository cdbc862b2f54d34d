"""Prompt lookup against a variant of it, and both against plain decoding, in one process: the
tasks of benchmarks/speculative.py on a build it made, each variant in turn per round, greedy,
EOS off; each speed-up is of decode times (speculative.py's `timed`: the prefill left out). Prints a
Markdown table.

    .venv/bin/python benchmarks/speculative_guesses.py BUILD_DIR [--text FILE] [--tasks repeat rewrite ...]
        [--new 128] [--rounds 3] [--against unguessed|single-token]

The variant (--against): `unguessed`, DraftLength with `guessed` doing nothing (what drafting did
before the guesses on the plain steps of a pause, docs/runtime.md); `single-token`, prompt lookup
drafting after a suffix of one token too (draft.MIN_NGRAM 1, what it did before the least suffix
of two). The same tokens either way; only how often and how much is drafted differs.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402
from speculative import THREADS, paragraph, tasks, timed  # noqa: E402

from specc.decoding import draft  # noqa: E402
from specc.decoding.speculation import DraftLength  # noqa: E402
from specc.runtime import Session  # noqa: E402
from specc.runtime import speculative as loop  # noqa: E402 - (not this folder's speculative.py)


class _Unguessed(DraftLength):
    def guessed(self, right: bool) -> None:
        pass


class _Without:
    """A session's generate with one thing swapped for the call: the speculative loop's
    DraftLength for one without guesses (`unguessed`), or the drafter's least suffix for one
    token (`single-token`)."""

    # variant -> (module, name, the value swapped in, the table's two columns: as it is, swapped)
    SWAPS = {"unguessed": (loop, "DraftLength", _Unguessed, ("with the guesses", "without")),
             "single-token": (draft, "MIN_NGRAM", 1, (f"a suffix of {draft.MIN_NGRAM} tokens or more", "of one token too"))}

    def __init__(self, session: Session, against: str):
        self.session, (self.module, self.name, self.value, _) = session, self.SWAPS[against]

    def generate(self, *args, **kwargs):
        was = getattr(self.module, self.name)
        setattr(self.module, self.name, self.value)
        try:
            return self.session.generate(*args, **kwargs)
        finally:
            setattr(self.module, self.name, was)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("build", type=Path)
    ap.add_argument("--text", type=Path, default=None)
    ap.add_argument("--tasks", nargs="+", default=["repeat", "rewrite", "extract", "quote", "free"])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--against", default="unguessed", choices=sorted(_Without.SWAPS))
    args = ap.parse_args()
    prompts_text = tasks(paragraph(args.text.read_text() if args.text else rm.reference_text()))
    session = Session(args.build, threads=THREADS)
    chat = session.tokenizer.chat_template is not None

    print(f"{args.build.name}: speed-up over plain decoding, by decode time (calls after the prompt, "
          "drafts kept/drafted)\n")
    print("| task | {} | {} | same tokens |".format(*_Without.SWAPS[args.against][3]))
    print("|---|---|---|---|")
    for task in args.tasks:
        prompt = session.prompts([prompts_text[task]], chat=chat)[0]
        runs = timed({"plain": (session, {}), "with": (session, {"speculative": "ngram"}),
                      "without": (_Without(session, args.against), {"speculative": "ngram"})}, prompt, args.new, args.rounds)
        plain, on, off = runs["plain"], runs["with"], runs["without"]
        cell = [f"{plain.decode / r.decode:.2f}x ({r.result.speculation.steps}, "
                f"{r.result.speculation.accepted}/{r.result.speculation.drafted})" for r in (on, off)]
        same = "yes" if plain.result.new_ids == on.result.new_ids == off.result.new_ids else "NO"
        print(f"| {task} | {cell[0]} | {cell[1]} | {same} |", flush=True)


if __name__ == "__main__":
    main()
