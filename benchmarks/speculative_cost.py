"""Speculative decoding's cost per step at the 7B shape, seeded weights: what one check of k
drafted tokens costs the target against a plain decode step, what a draft build's step costs, and
so the acceptance a draft must reach before it pays. Seeded weights accept almost nothing (two
random models agree by chance), so the speed-up is computed from the measured costs for each
acceptance rate, beside the one measured run. Writes a section of docs/benchmarks_speculative.md.

    .venv/bin/python benchmarks/speculative_cost.py [--target llama-2-7b] [--draft-layers 2] [--prompt 128]

The target is `specc build TARGET --precision int4` (streamed at 7B: about 15 minutes here) and
the draft its twin: the same spec with --draft-layers layers (`decoder.layers` changed, nothing
else; its seeded tables and first layers are drawn as the target's are), built int4 too, both
under build/bench. Each runs on 2 threads through the in-place cache graph (InplaceRunner, as
Session.generate's speculative steps do) after a --prompt token prompt of random ids: a plain
step (1 token), a check of k drafts (k + 1 tokens in one call, the cache cut back after each
call so every call sees the same past), the draft's step; each the median of --repeats calls.
For a per-draft acceptance a (each draft accepted with chance a, independently), a check of k
drafts yields (1 - a^(k+1)) / (1 - a) tokens for k draft steps plus one check, so the speed-up
over plain decoding is that yield times a plain step over (k draft steps + check(k)).
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import WORK, _cpu  # noqa: E402

from specc.runtime import RunError, Session  # noqa: E402
from specc.runtime.generate import InplaceRunner  # noqa: E402
from specc.spec.load import find_spec  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "benchmarks_speculative.md"
THREADS = 2
KS = (1, 2, 4, 8)
RATES = (0.0, 0.3, 0.5, 0.7, 0.8, 0.9)


def build(spec: str | Path, out: Path, activations: str | None = None) -> Path:
    """An int4 build of `spec` into `out` (a cache hit where it is there and up to date), decoding
    in `activations` (specc build --activations) where given."""
    t0 = time.perf_counter()
    subprocess.run([str(Path(sys.executable).parent / "specc"), "build", str(spec), "-o", str(out),
                    "--precision", "int4", "--quiet", *(["--activations", activations] if activations else [])],
                   check=True)
    print(f"[cost] {out.name}: {time.perf_counter() - t0:.0f} s (built, or kept where up to date)", file=sys.stderr)
    return out


def twin(target: str, layers: int) -> Path:
    """The target's spec with `layers` decoder layers, written under build/bench."""
    data = yaml.safe_load(find_spec(target).read_text())
    data["name"] = f"{data['name']}-twin{layers}"
    data["description"] = f"{target} with {layers} layers: a draft of the same seeds"
    data["decoder"]["layers"] = layers
    path = WORK / f"{data['name']}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def timed_calls(runner: InplaceRunner, tokens: int, repeats: int, vocab: int) -> float:
    """Median seconds of one call of `tokens` new positions after the prompt (cut back after each)."""
    rng = np.random.default_rng(1)
    past = runner.length
    times = []
    for _ in range(repeats + 1):  # the first call warms up
        ids = rng.integers(3, vocab, size=(1, tokens))
        t0 = time.perf_counter()
        runner.extend(ids)
        times.append(time.perf_counter() - t0)
        runner.truncate(past)
    return statistics.median(times[1:])


def costs(path: Path, prompt: list[int], repeats: int, vocab: int, ks=()) -> dict:
    session = Session(path, threads=THREADS, check_hashes=False)
    runner = InplaceRunner(session, [prompt], max(ks, default=0) + 2)
    runner.prefill()
    out = {"step": timed_calls(runner, 1, repeats, vocab)}
    for k in ks:
        out[k] = timed_calls(runner, k + 1, repeats, vocab)
    return out


def speedup(a: float, k: int, step: float, check: float, draft: float) -> float:
    tokens = k + 1 if a == 1 else (1 - a ** (k + 1)) / (1 - a)
    return tokens * step / (k * draft + check)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="llama-2-7b")
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=32, help="tokens of the measured speculative run")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--runs", type=int, default=3, help="measured speculative runs, each beside a plain one")
    ap.add_argument("--activations", choices=["fp32", "int8"], help="specc build --activations for both builds")
    ap.add_argument("--out", type=Path, default=DOC)
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    tail = f"-{args.activations}" if args.activations else ""
    target = build(args.target, WORK / f"spec-{args.target}-int4{tail}", args.activations)
    draft_spec = twin(args.target, args.draft_layers)
    draft = build(draft_spec, WORK / f"spec-{draft_spec.stem}-int4{tail}", args.activations)
    vocab = json.loads((target / "manifest.json").read_text())["spec"]["vocab"]["size"]
    prompt = np.random.default_rng(0).integers(3, vocab, size=args.prompt).tolist()

    t = costs(target, prompt, args.repeats, vocab, KS)
    d = costs(draft, prompt, args.repeats, vocab)
    print(f"[cost] target {t}, draft {d}", file=sys.stderr)

    # measured runs, plain and drafted in turn, greedy, EOS off: what seeded weights accept; each
    # session's graphs opened first (a Session opens its in-place graph at its first generation).
    # A build at int8 activations whose in-place graph has no spare position (routed experts, or
    # made before the spare) refuses speculative decoding (docs/runtime.md).
    session = Session(target, threads=THREADS, check_hashes=False)
    drafter = Session(draft, threads=THREADS, check_hashes=False)
    try:
        session.generate(prompt[:8], max_new_tokens=2, eos_id=-1, speculative=drafter)
        refused = None
    except RunError as exc:
        refused = str(exc)
    runs: dict[str, list] = {"plain": [], "draft": []}
    for _ in range(args.runs if refused is None else 0):
        for name, option in (("plain", None), ("draft", drafter)):
            t0 = time.perf_counter()
            g = session.generate(prompt, max_new_tokens=args.new, eos_id=-1, speculative=option)
            runs[name].append((time.perf_counter() - t0, g))
    same = all(p[1].new_ids == d[1].new_ids for p, d in zip(runs["plain"], runs["draft"]))

    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    level = json.loads((target / "manifest.json").read_text())["options"]["quantization"]["accuracy_level"]
    arithmetic = {1: "fp32 activations (accuracy level 1, int4's default)", 4: "int8 activations (--activations int8, level 4)"}[level]
    head = (f"## The {args.target} shape: cost per step with a {args.draft_layers}-layer twin draft"
            f"{', int8 activations' if level == 4 else ''}")
    lines = [
        head, "",
        f"`{Path(sys.executable).relative_to(ROOT) if ROOT in Path(sys.executable).parents else sys.executable} "
        f"benchmarks/speculative_cost.py --target {args.target} --draft-layers {args.draft_layers} --prompt {args.prompt} "
        f"--new {args.new} --repeats {args.repeats} --runs {args.runs}{' --activations ' + args.activations if args.activations else ''}`, {date}, {platform.machine()}, {_cpu()}, {THREADS} threads. "
        f"Seeded weights, int4 both, {arithmetic}: the target `{args.target}`, the draft the same spec with "
        f"{args.draft_layers} layers. Calls of the in-place cache graph after a {args.prompt}-token prompt, each "
        f"the median of {args.repeats}.", "",
        "| call | ms | against a plain target step |", "|---|---|---|",
        f"| target, plain step (1 token) | {t['step'] * 1e3:.1f} | 1.00x |",
    ]
    lines += [f"| target, check of {k} drafts ({k + 1} tokens) | {t[k] * 1e3:.1f} | {t[k] / t['step']:.2f}x |" for k in KS]
    lines += [f"| draft, step (1 token) | {d['step'] * 1e3:.1f} | {d['step'] / t['step']:.2f}x |", ""]
    lines += ["Speed-up over plain decoding from these costs, for a per-draft acceptance a (each draft "
              "accepted with chance a, independently; k drafts, then one check):", "",
              "| k | " + " | ".join(f"a = {a}" for a in RATES) + " | a to break even |",
              "|---|" + "---|" * (len(RATES) + 1)]
    for k in KS:
        cells = [f"{speedup(a, k, t['step'], t[k], d['step']):.2f}x" for a in RATES]
        even = next((a / 100 for a in range(0, 100) if speedup(a / 100, k, t["step"], t[k], d["step"]) >= 1), None)
        lines.append(f"| {k} | " + " | ".join(cells) + f" | {even if even is not None else '> 0.99'} |")
    if refused is not None:
        lines += ["", f"Measured: not run; speculative decoding is refused on this build: \"{refused}\"", ""]
    else:
        ratios = [p[0] / d[0] for p, d in zip(runs["plain"], runs["draft"])]
        plain_rate = args.new / statistics.median(p[0] for p in runs["plain"])
        spec = runs["draft"][-1][1].speculation
        lines += ["", f"Measured, the prompt and {args.new} greedy tokens after it, the sessions warm, {args.runs} runs of "
                  f"each in turn: plain {plain_rate:.2f} tokens/s, with the draft {statistics.median(ratios):.2f}x plain "
                  f"(by run: {', '.join(f'{r:.2f}' for r in ratios)}); the last run: {spec.accepted} of {spec.drafted} "
                  f"drafts accepted ({spec.acceptance:.0%}) in {spec.steps} target calls; the same tokens: "
                  f"{'yes' if same else 'NO'}. Seeded weights of two depths agree little but by chance; a trained draft of "
                  "the family is what the table prices.", ""]
    text = args.out.read_text() if args.out.is_file() else ""
    if head in text:
        start = text.index(head)
        end = text.find("\n## ", start + 1)
        text = text[:start] + "\n".join(lines) + ("\n" + text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    args.out.write_text(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
