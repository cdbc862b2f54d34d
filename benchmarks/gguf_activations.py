"""What int8 activations cost a gguf build, beside what llama.cpp's own arithmetic costs on the same
file: next-token argmax agreement and KL divergence against the file's values computed in fp32;
docs/benchmarks_quality.md's "int8 activations" section rewritten.

    .venv/bin/python benchmarks/gguf_activations.py --text FILE [--chunks 4] [--models smollm2 gemma3]

For each model (benchmarks/speculative.py's builds of the packaged files: SmolLM2-135M-Instruct's
Q4_1, Gemma 3 270M's Q4_K_M), llama.cpp (build/llama-server/bin's llama-perplexity: `make
llama-server` then `cmake --build build/llama-server --target llama-perplexity`; 2 threads) reads TEXT, cuts
its tokens into chunks of 512 and saves, for the second half of each chunk, its log-probabilities
of the next token (`--kl-divergence-base`: 16-bit codes of each, a step of at most 16/65535 nats
over the 16 nats below the top). specc's builds of the same file run those token ids, each chunk
in one call of model.onnx, with the BOS llama.cpp puts first: gguf at fp32 activations (the
default) and at int8 activations (`--activations int8`). The reference is the fp32 build, the
file's values in fp32 (verified against torch within 1e-4).

The bar a gguf build at int8 activations is verified against (specc/spec/targets.py's
GGUF_INT8_BAR) cites the figures this writes.
"""
from __future__ import annotations

import argparse
import datetime
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402
import speculative  # noqa: E402

from specc.runtime import Session  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PERPLEXITY = ROOT / "build" / "llama-server" / "bin" / "llama-perplexity"
DOC = ROOT / "docs" / "benchmarks_quality.md"
OWNER = "gguf_activations"  # the section this script owns in DOC (realmodels.write_section)
THREADS = 2


def llama_cpp_log_probs(gguf: Path, text: Path, chunks: int, context: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(tokens [chunks, context] as llama.cpp read TEXT, its log-probabilities [chunks, positions,
    vocab] at positions context/2 .. context-2, the first position of each chunk's tokens it
    replaced by BOS (-1: none))."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "base.kld"
        run = subprocess.run([str(PERPLEXITY), "-m", str(gguf), "-f", str(text), "-c", str(context),
                              "--chunks", str(chunks), "-t", str(THREADS), "--kl-divergence-base", str(out)],
                             capture_output=True, text=True)
        if run.returncode != 0:
            raise SystemExit(f"llama-perplexity failed:\n{run.stderr[-2000:]}")
        raw = out.read_bytes()
    if raw[:8] != b"_logits_":
        raise SystemExit("llama-perplexity wrote no logits file")
    n_ctx, n_vocab, n_chunk = np.frombuffer(raw, np.int32, 3, 8)
    assert n_ctx == context, (n_ctx, context)
    at = 20
    tokens = np.frombuffer(raw, np.int32, n_chunk * n_ctx, at).reshape(n_chunk, n_ctx).astype(np.int64)
    at += 4 * int(n_chunk) * int(n_ctx)
    nv = 2 * ((n_vocab + 1) // 2) + 4
    positions = n_ctx - 1 - n_ctx // 2
    codes = np.frombuffer(raw, np.uint16, n_chunk * positions * nv, at).reshape(n_chunk, positions, nv)
    head = codes[..., :4].copy().view(np.float32)  # scale, the least log-probability
    scale, least = head[..., 0:1], head[..., 1:2]
    log_probs = least + scale * codes[..., 4:4 + n_vocab].astype(np.float32)
    return tokens, log_probs, first_token(gguf)


def first_token(gguf: Path) -> int:
    """The BOS id llama.cpp puts first in each chunk (tokenizer.ggml.add_bos_token), else -1."""
    from gguf import GGUFReader

    fields = GGUFReader(gguf).fields

    def value(key: str):
        f = fields.get(key)
        return None if f is None else f.parts[f.data[0]][0]

    add = value("tokenizer.ggml.add_bos_token")
    bos = value("tokenizer.ggml.bos_token_id")
    return int(bos) if bos is not None and (add is None or bool(add)) else -1


def specc_log_probs(build: Path, tokens: np.ndarray, bos: int, first: int) -> np.ndarray:
    session = Session(build, threads=THREADS)
    out = []
    for row in tokens:
        ids = row.copy()
        if bos >= 0:
            ids[0] = bos
        logits = session.run(input_ids=ids[None])["logits"][0][first:len(ids) - 1]
        out.append(rm.log_softmax(logits).astype(np.float32))
    return np.stack(out)


def compare(ref: np.ndarray, got: np.ndarray) -> tuple[float, float]:
    """(argmax agreement, mean KL(ref || got)) over every position."""
    r, g = ref.reshape(-1, ref.shape[-1]), got.reshape(-1, got.shape[-1])
    agree = float((r.argmax(1) == g.argmax(1)).mean())
    kl = float((np.exp(r) * (r - g)).sum(1).mean())
    return agree, kl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--chunks", type=int, default=4)
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"], choices=["smollm2", "gemma3"])
    args = ap.parse_args()
    context = 512  # within Gemma 3's build (GEMMA_LENGTH positions)
    first = context // 2
    lines = ["## int8 activations on the GGUF files, beside llama.cpp", "",
             f"Generated by `benchmarks/gguf_activations.py` (`.venv/bin/python benchmarks/gguf_activations.py "
             f"--text {args.text.name} --chunks {args.chunks} --models {' '.join(args.models)}`; {args.text.name}: "
             "every text of the lecture notes the spec language is drawn from, concatenated in name order; this "
             "section only, "
             "benchmarks/quality.py keeps it).", "",
             f"Run: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; llama.cpp's llama-perplexity "
             "(the vendored source), specc's builds on onnxruntime.", "",
             f"Next tokens at positions {first}..{context - 2} of {args.chunks} chunks of {context} tokens (llama.cpp's "
             "tokens, its BOS first where the file asks for one), against the file's values in fp32 (specc's fp32 "
             "build): llama.cpp running the file (its own arithmetic: each product's input rounded to 8 bits per "
             "block), and specc's gguf builds of it at fp32 activations (the default) and at int8 activations.", "",
             "| model | variant | argmax agreement | KL (nats) |", "|---|---|---|---|"]
    for model in args.models:
        reference, gguf = speculative.build(model, "fp32")
        builds = {"specc gguf, fp32 activations": speculative.build(model, "gguf")[0],
                  "specc gguf, int8 activations": speculative.build(model, "gguf", "int8")[0]}
        tokens, theirs, bos = llama_cpp_log_probs(gguf, args.text, args.chunks, context)
        ref = specc_log_probs(reference, tokens, bos, first)
        for name, got in [(f"llama.cpp, {gguf.name}", theirs)] + \
                [(name, specc_log_probs(d, tokens, bos, first)) for name, d in builds.items()]:
            agree, kl = compare(ref, got)
            lines.append(f"| {model} | {name} | {agree:.2%} | {max(kl, 0.0):.4f} |")  # not -0.0000
            print(lines[-1], flush=True)
            del got
    rm.write_section(DOC, OWNER, lines)
    print(f"wrote {DOC}")


if __name__ == "__main__":
    main()
