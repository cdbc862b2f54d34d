"""A tied output projection in an integer build: left fp32, packed at 4 bits, or packed in int8's
8-bit blocks, on SmolLM2-135M-Instruct (49152 x 576 tied table; benchmarks/realmodels.py).

    .venv/bin/python benchmarks/tied_head.py quality [VARIANT ...]
    .venv/bin/python benchmarks/tied_head.py ROUNDS [VARIANT ...]     # decode speed, rounds interleaved

quality: perplexity, next-token argmax agreement and KL against the fp32 build on 4 windows of 512
tokens of the Python language reference, and greedy agreement on the chat prompts (benchmarks/
quality.py's metrics). ROUNDS: decode tokens/s (median over the prompts, 2 threads) and the peak
RSS of each variant, each round in its own process, the variants in turn. A variant whose build
fails verification is reported as refused. The variants other than the current defaults are made
by replacing specc/export/quantize.py's choice of the head's scheme for the build; results:
docs/build.md ("quantize").
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality as Q  # noqa: E402
import realmodels as rm  # noqa: E402

import specc  # noqa: E402
from specc.errors import VerificationError  # noqa: E402
from specc.export import quantize as q  # noqa: E402

WORK = Q.WORK
# name -> (precision, the tied head's scheme: a precision's, or None for fp32)
VARIANTS = {
    "fp32": ("fp32", None),
    "int4-head-fp32": ("int4", None),
    "int4-head-4bit": ("int4", "int4"),
    "int4-head-8bit": ("int4", "int8"),
    "int8-head-fp32": ("int8", None),
    "int8-head-8bit": ("int8", "int8"),
}


def build(spec: Path, name: str) -> Path:
    """The variant's build under WORK (made once)."""
    precision, head = VARIANTS[name]
    out = WORK / f"tied-head-{name}"
    if (out / "manifest.json").is_file():
        return out
    saved = dict(q.TIED_HEAD)
    if precision in q.TIED_HEAD:
        q.TIED_HEAD[precision] = head
    try:
        specc.build(spec, out, precision=precision, progress=None, force=True)
    finally:
        q.TIED_HEAD.update(saved)
    return out


def main() -> None:
    from transformers import AutoTokenizer

    mode, names = sys.argv[1], sys.argv[2:] or list(VARIANTS)
    WORK.mkdir(parents=True, exist_ok=True)
    folder = rm.smollm2_folder(WORK)
    spec = Q.imported(folder, "smollm2")
    tok = AutoTokenizer.from_pretrained(folder)
    windows = rm.token_windows(tok(rm.reference_text())["input_ids"], 4, 512)
    prompts = [rm.chat_ids(tok, p) for p in rm.CHAT_PROMPTS]
    if mode == "quality":
        ref = None
        for name in names:
            try:
                out = build(spec, name)
            except VerificationError as refused:
                print(json.dumps({"variant": name, "refused": str(refused)}), flush=True)
                continue
            logits = Q.specc_logits(out, windows)
            greedy, _ = Q.specc_greedy(out, prompts)
            if ref is None:  # the first variant named is the reference (fp32)
                ref = (logits, greedy)
            share, identical = rm.greedy_agreement(ref[1], greedy)
            print(json.dumps({"variant": name, "ppl": rm.perplexity(logits, windows),
                              "agreement": rm.argmax_agreement(logits, ref[0]), "kl": rm.kl_mean(ref[0], logits),
                              "greedy": share, "identical": identical,
                              "mib": sum(p.stat().st_size for p in out.glob("*.onnx")) / 2**20}), flush=True)
    elif mode == "one":
        import resource

        _, rate = Q.specc_greedy(build(spec, names[0]), prompts)
        print(json.dumps({"rate": rate, "peak_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}))
    else:
        for name in list(names):  # built here, not in the timed processes; a refused one is left out
            try:
                build(spec, name)
            except VerificationError as refused:
                print(f"{name}: refused ({refused})", flush=True)
                names.remove(name)
        rates: dict[str, list[float]] = {n: [] for n in names}
        peaks: dict[str, float] = {}
        for _ in range(int(mode)):
            for name in names:
                done = subprocess.run([sys.executable, __file__, "one", name], capture_output=True, text=True, check=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rates[name].append(row["rate"])
                peaks[name] = max(peaks.get(name, 0.0), row["peak_gib"])
        for name, values in rates.items():
            print(f"{name}: median {statistics.median(values):.1f} tok/s {[round(v, 1) for v in values]}, "
                  f"peak {peaks[name]:.3f} GiB", flush=True)


if __name__ == "__main__":
    main()
