"""int4 of a trained checkpoint against its fp32 build, one quantizer knob at a time: whether the
greedy chat answers stay fp32's, and what each knob costs in decode speed and graph bytes.

    .venv/bin/python benchmarks/int4_chat.py --texts DIR [--rounds 3] [VARIANT ...]

SmolLM2-135M-Instruct imported from its HF folder (benchmarks/realmodels.py), built in fp32 and in
each int4 variant (VARIANTS: specc/export/quantize.py's int4 scheme, its accuracy level or its tied
head's scheme replaced, then the fp32 build's graph quantized as the int4 build's quantize stage
quantizes it; see build). For each:
- chat: the eight questions of realmodels.CHAT_QUESTIONS as `specc generate --chat` puts them
  (Session.prompts(chat=True)), greedy, the spec's end token; a question agrees when its first
  CHAT_TOKENS new tokens are fp32's;
- argmax: next-token argmax agreement with fp32 on windows of a folder of plain texts (--texts DIR,
  its *.txt files in name order; benchmarks/quality.py's metrics), with the KL;
- decode: tokens/s after the first (benchmarks/quality.py's specc_greedy: 32 new tokens a question,
  2 threads, median over the questions), each round in its own process, the variants in turn; the
  median over rounds;
- bytes: the graph files.
Prints a Markdown table and,
with rounds, writes it into docs/benchmarks_quality.md (its section Q.INT4_CHAT).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality as Q  # noqa: E402
import realmodels as rm  # noqa: E402

import specc  # noqa: E402
from specc import load_spec, resolve  # noqa: E402
from specc.export import inplace  # noqa: E402
from specc.export import quantize as q  # noqa: E402
from specc.runtime import Session  # noqa: E402

WORK = Q.WORK
CHAT_TOKENS = 16
# what --texts held when the page's figures were measured
TEXTS = "five lecture notes on self-attention and the Transformer in plain text, 72 KB"
ROW = "int4_chat.json"  # a variant's measured row, kept in its build beside what it was measured on
# name -> the int4 build's settings that the variant sets (None: the fp32 build), the others as
# the int4 build has them: fields of the int4 Scheme (block, accuracy_level, zero_points),
# "head": the tied head's precision (a key of quantize.SCHEMES, or None for fp32) and
# "head_level": the tied head's accuracy level. Before the variants were measured, int4 was
# level-4 (blocks of 32, no zero points, its tied head in int8's blocks at level 4); it is level-1.
VARIANTS: dict[str, dict | None] = {
    "fp32": None,
    "level-4": {"accuracy_level": 4},
    "level-4-zero-points": {"accuracy_level": 4, "zero_points": True},
    "level-4-head-fp32": {"accuracy_level": 4, "head": None},
    "level-4-head-level-1": {"accuracy_level": 4, "head_level": 1},
    "level-4-block-64": {"accuracy_level": 4, "block": 64},
    "level-4-block-128": {"accuracy_level": 4, "block": 128},
    "level-1": {"accuracy_level": 1},
    "level-1-head-level-1": {"accuracy_level": 1, "head_level": 1},
    "level-0-head-level-0": {"accuracy_level": 0, "head_level": 0},
    "level-1-head-fp32": {"accuracy_level": 1, "head": None},
}


def build(spec: Path, name: str) -> Path:
    """The variant's build under WORK (made once): fp32 by `specc build`, an int4 variant from
    the fp32 build's graph by the build's own quantize stage (quantize.quantize_file, on the same
    optimized fp32 graph the int4 build quantizes; with the settings as they are, the graphs are
    the int4 build's byte for byte), with its settings replaced; not verified."""
    change = VARIANTS[name]
    out = built(name)
    if (out / "manifest.json").is_file():
        return out
    if change is None:
        specc.build(spec, out, precision="fp32", progress=None, force=True)
        return out
    fp32 = build(spec, "fp32")
    saved_schemes, saved_head = dict(q.SCHEMES), dict(q.TIED_HEAD)
    fields = {k: v for k, v in change.items() if k not in ("head", "head_level")}
    q.SCHEMES["int4"] = dataclasses.replace(q.SCHEMES["int4"], **fields)
    if "head" in change:
        q.TIED_HEAD["int4"] = change["head"]
    if "head_level" in change:
        head = q.TIED_HEAD["int4"]
        q.SCHEMES[head] = dataclasses.replace(q.SCHEMES[head], accuracy_level=change["head_level"])
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(fp32, tmp)
    r = resolve(load_spec(spec))
    try:
        for sig in r.graphs:
            q.quantize_file(tmp / f"{sig.name}.onnx", "int4", sig)
    finally:
        q.SCHEMES.update(saved_schemes)
        q.TIED_HEAD.update(saved_head)
    if (tmp / inplace.FILE).is_file():  # it reads model.onnx's weights where they lay: made again, as a build makes it
        inplace.write(tmp, r, {sig.name: f"{sig.name}.onnx" for sig in r.graphs})
    tmp.rename(out)
    return out


def built(name: str) -> Path:
    """Where the variant is built (fp32: where benchmarks/quality.py builds it)."""
    return WORK / ("smollm2-fp32" if VARIANTS[name] is None else f"int4-chat-{name}")


def chat_answers(out: Path) -> list[list[int]]:
    s = Session(out, threads=Q.THREADS, check_hashes=False)
    prompts = s.prompts(rm.CHAT_QUESTIONS, chat=True)
    return [s.generate([p], max_new_tokens=CHAT_TOKENS).new_ids[0] for p in prompts]


def seed_windows(folder: Path, tok, count: int, length: int) -> np.ndarray:
    files = sorted(folder.glob("*.txt"))
    if not files:
        raise SystemExit(f"int4_chat: no texts (*.txt) in {folder}")
    text = "\n\n".join(f.read_text() for f in files)
    return rm.token_windows(tok(text)["input_ids"], count, length)


def graph_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.iterdir() if p.name.endswith((".onnx", ".onnx.data")))


def main() -> None:
    from transformers import AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", choices=[[]] + list(VARIANTS), default=[])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--texts", type=Path, required=True, help="a folder of .txt files: the text of the argmax agreement")
    ap.add_argument("--untimed", nargs="*", default=[], choices=list(VARIANTS), help="variants whose speed is not timed")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # a timed round of one variant, in its own process
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    folder = rm.smollm2_folder(WORK)
    spec = Q.imported(folder, "smollm2")
    if args.one:
        tok = AutoTokenizer.from_pretrained(folder)
        _, rate = Q.specc_greedy(built(args.one), [rm.chat_ids(tok, t) for t in rm.CHAT_QUESTIONS])
        print(json.dumps({"rate": rate}))
        return
    names = ["fp32"] + [n for n in (args.variants or VARIANTS) if n != "fp32"]
    tok = AutoTokenizer.from_pretrained(folder)
    windows = seed_windows(args.texts, tok, args.windows, args.length)
    rows, ref = {}, None
    measured = {"windows": args.windows, "length": args.length, "texts": str(args.texts.resolve())}
    for name in names:
        out = build(spec, name)
        saved = out / ROW
        if saved.is_file() and json.loads(saved.read_text())["measured"] == measured:
            rows[name] = json.loads(saved.read_text())["row"]
        else:
            if ref is None:  # fp32's, the first name
                ref = (Q.specc_logits(built("fp32"), windows), chat_answers(built("fp32")))
            logits = Q.specc_logits(out, windows)
            same = [a[:CHAT_TOKENS] == r[:CHAT_TOKENS] for a, r in zip(chat_answers(out), ref[1])]
            rows[name] = {"chat": sum(same), "differ": [i + 1 for i, s in enumerate(same) if not s],
                          "argmax": rm.argmax_agreement(logits, ref[0]), "kl": rm.kl_mean(ref[0], logits),
                          "mib": graph_bytes(out) / 2**20}
            saved.write_text(json.dumps({"measured": measured, "row": rows[name]}))
            del logits
        print(json.dumps({"variant": name, **rows[name]}), flush=True)
    timed = [n for n in names if n not in args.untimed]
    rates: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.rounds):
        for name in timed:
            done = subprocess.run([sys.executable, __file__, "--one", name], capture_output=True, text=True, check=True)
            rates[name].append(json.loads(done.stdout.strip().splitlines()[-1])["rate"])
    table = [f"| variant | chat answers as fp32's (first {CHAT_TOKENS} tokens) | differ | argmax agreement | KL (nats) | "
             "decode tok/s (median; rounds) | graph |", "|---|---|---|---|---|---|---|"]
    for name in names:
        r = rows[name]
        table.append(f"| {name} | {r['chat']}/{len(rm.CHAT_QUESTIONS)} | {', '.join(map(str, r['differ'])) or '-'} | "
                     f"{100 * r['argmax']:.1f}% | {r['kl']:.4f} | {_rate(rates[name])} | {r['mib']:.0f} MiB |")
    print("\n".join(table))
    if args.rounds:
        write(table, args)


def write(table: list[str], args) -> None:
    """The section Q.INT4_CHAT of docs/benchmarks_quality.md, the table under its command and
    what it measured (benchmarks/quality.py keeps the section when it writes the page)."""
    import onnxruntime

    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        Q.INT4_CHAT,
        "",
        "Generated by `benchmarks/int4_chat.py` (do not edit by hand): SmolLM2-135M-Instruct imported from its HF "
        "folder, built in fp32 and in int4 variants, one quantizer setting at a time (accuracy level: "
        "MatMulNBits' compute, 4 int8 and 1 or 0 fp32; zero points; the tied head in fp32, or in int8's "
        "blocks at level 4 or 1; block size). Each int4 variant is the fp32 build's graph quantized by the "
        "build's own quantize stage with that setting (with int4's settings, byte for byte the int4 build's).",
        "",
        f"Command: `.venv/bin/python benchmarks/int4_chat.py --texts DIR --rounds {args.rounds}"
        f"{' --untimed ' + ' '.join(args.untimed) if args.untimed else ''}` (DIR: {TEXTS})",
        "",
        f"Run: {now}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, shared with other "
        f"work (speeds are comparable within a run, variants timed in turn); onnxruntime {onnxruntime.__version__}.",
        "",
        f"Chat: {len(rm.CHAT_QUESTIONS)} questions (`realmodels.CHAT_QUESTIONS`) put as `specc generate --chat` puts "
        f"them, greedy, the spec's end token; agreeing when the first {CHAT_TOKENS} new tokens are fp32's; "
        "differ: which questions do not. Argmax and KL: next tokens against fp32 on "
        f"{args.windows} windows of {args.length} tokens of DIR's text. Decode: tokens/s after the first, "
        f"{Q.THREADS} threads, the median over the questions (32 new tokens each), each round in its own process. "
        "Graph: the graph files. int4 is now `level-1`; it was `level-4` (the `specc int4` row of the table above "
        "was measured then).",
        "",
        *table,
    ]
    kept = Q.DOC.read_text().split(Q.INT4_CHAT)[0].rstrip("\n") if Q.DOC.is_file() else ""
    Q.DOC.write_text((kept + "\n\n" if kept else "") + "\n".join(lines) + "\n")
    print(f"[int4_chat] wrote {Q.DOC}")


def _rate(values: list[float]) -> str:
    """The median over rounds, and the rounds."""
    if not values:
        return "-"
    return f"{statistics.median(values):.1f} ({', '.join(f'{v:.0f}' for v in values)})"


if __name__ == "__main__":
    main()
