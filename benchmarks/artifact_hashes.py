"""The sha256 of every file a matrix of catalog builds writes, to hold a change of the code to
"the same artifacts before and after": run it on both checkouts, then compare the two files.

    python benchmarks/artifact_hashes.py --out before.json        # on the old checkout
    python benchmarks/artifact_hashes.py --out after.json         # on the new one
    python benchmarks/artifact_hashes.py --compare before.json after.json

Each case is `specc build SPEC --target T --precision P` into a fresh folder; every file but
manifest.json (which holds timings) is hashed, and the manifest's own artifact list is kept.
--compare prints, per case, the files whose bytes differ and the files only one side has; it
exits 1 where a graph or weights file (.onnx, .onnx.data, .safetensors) differs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
from pathlib import Path

CASES = (
    ("tiny-gpt2", "onnx", "fp32"), ("tiny-gpt2", "onnx", "int4"), ("tiny-gpt2", "triton", "fp32"),
    ("tiny-llama", "onnx", "fp32"), ("tiny-llama", "onnx", "int4"), ("tiny-llama", "onnx", "int8"),
    ("tiny-llama", "onnx", "fp16"), ("tiny-llama", "triton", "fp32"),
    ("tiny-bert", "onnx", "fp32"), ("tiny-bert", "onnx", "int8"), ("tiny-bert", "triton", "fp16"),
    ("tiny-transformer", "onnx", "fp32"), ("tiny-transformer", "triton", "fp32"),
    ("tiny-shaw-relative", "onnx", "fp32"),
    ("gpt2-small", "onnx", "fp32"), ("gpt2-small", "onnx", "int4"),
)
MANIFEST = "manifest.json"
GRAPH_SUFFIXES = (".onnx", ".onnx.data", ".safetensors")


def hashes() -> dict:
    import specc

    out = {}
    root = Path(tempfile.mkdtemp(prefix="artifact-hashes-"))
    for spec, target, precision in CASES:
        d = root / f"{spec}-{target}-{precision}"
        specc.build(spec, d, target=target, precision=precision, progress=None)
        files = {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
                 for p in sorted(d.rglob("*")) if p.is_file() and p.name != MANIFEST}
        listed = json.loads((d / MANIFEST).read_text())["artifacts"]
        out[f"{spec}/{target}/{precision}"] = {"files": files, "manifest": {a["path"]: a["sha256"] for a in listed}}
        print(spec, target, precision, len(files), "files", file=sys.stderr, flush=True)
    return out


def compare(before: dict, after: dict) -> int:
    graphs_differ = False
    for case in sorted(set(before) | set(after)):
        if case not in before or case not in after:
            print(f"{case}: only {'after' if case in after else 'before'}")
            continue
        b, a = before[case]["files"], after[case]["files"]
        changed = sorted(k for k in b.keys() & a.keys() if b[k] != a[k])
        only_b, only_a = sorted(b.keys() - a.keys()), sorted(a.keys() - b.keys())
        graphs_differ |= any(k.endswith(GRAPH_SUFFIXES) for k in changed + only_b + only_a)
        same = len(b.keys() & a.keys()) - len(changed)
        print(f"{case}: {same} files the same" + (f"; differ: {', '.join(changed)}" if changed else "")
              + (f"; before only: {', '.join(only_b)}" if only_b else "")
              + (f"; after only: {len(only_a)} ({', '.join(only_a[:4])}{', ...' if len(only_a) > 4 else ''})" if only_a else ""))
    print("graphs and weights: " + ("DIFFER" if graphs_differ else "byte-identical in every case"))
    return 1 if graphs_differ else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="write the hashes of this checkout's builds here")
    ap.add_argument("--compare", nargs=2, type=Path, metavar=("BEFORE", "AFTER"))
    args = ap.parse_args(argv)
    if args.compare:
        return compare(*(json.loads(p.read_text()) for p in args.compare))
    if not args.out:
        ap.error("give --out FILE or --compare BEFORE AFTER")
    args.out.write_text(json.dumps(hashes(), indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
