"""specc's int4 build of a LLaMA-shaped spec against llama.cpp running the same weights as Q4_0:
decode tokens/s, prompt tokens/s, time to first token and peak resident memory, each side in its
own process with the same threads, and each one's share of the memory-bandwidth floor (the
weights read once per decode step at the machine's read bandwidth, suite.read_bandwidth).

    .venv-bench/bin/python benchmarks/llama_cpp_peer.py [SPEC] [--prompt 128] [--new 64] [--rounds 5]

The sides run in turn, --rounds times (a shared machine's speed drifts between runs): each
figure is the median over the rounds, and the ratios' range over rounds is given beside it. A
third side, "specc, model graph", is the same build generating through model.onnx
(Session(..., inplace=False)) instead of its in-place cache graph (docs/build.md). specc's sides
run in the environment `specc generate` starts in (their weights in huge pages:
specc.malloc.huge_pages_environment), but "specc, 4 KiB pages" (the in-place graph with
glibc.malloc.hugetlb=0); "llama.cpp" runs as it is started, and "llama.cpp, huge pages" in specc's
environment: what huge pages give either side is in the table.

SPEC (default llama-2-7b) is built with `specc build --precision int4 --keep-weights` into
build/bench (a cache hit after the first time; a 7B build streams, docs/build.md). Its own weights
file (model.safetensors, the seeded fp32 weights, which the build keeps only when asked) is written as an F16 GGUF tensor by tensor
(`write_gguf`: never the whole model in memory), then quantized to Q4_0 by llama.cpp's own
quantizer; the F16 file is deleted after. Appends its table to docs/benchmarks_streamed.md.

A mixture of experts of Qwen3-MoE's shape (qwen3-30b-a3b: llama.cpp's `qwen3moe`) is too large for
its fp32 weights file or an F16 GGUF on this disk: give its build with --build (a streamed build of
seeded weights, e.g. `benchmarks/streamed_build.py --keep`), and the same seeded weights are made
again tensor by tensor (specc/nn/streamed.py) and written straight to Q4_0 by gguf's own Q4_0
routine (llama.cpp's reference quantizer), every matrix Q4_0 (as `llama-quantize --pure`), the
router and the norms fp32 (as llama-quantize keeps them). The bandwidth floor then counts the
weights a token reads: the active parameters (top-k experts, not the embedding table) at each
side's bytes per parameter.

The model has random weights: the prompt is random token ids and greedy decoding runs for
exactly --new tokens (no end token), on both sides. The vocabulary written to the GGUF is a
placeholder (ids only; llama.cpp needs one to load).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import WORK, _cpu, read_bandwidth  # noqa: E402

from specc.malloc import HUGE_PAGES_TUNABLE, huge_pages_environment, with_tunable  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
THREADS = 2
GIB = 1024**3
# llama.cpp's token kinds (llama_token_type) for the placeholder vocabulary
NORMAL, UNKNOWN, CONTROL, BYTE = 1, 2, 3, 6


# --- the same weights as a GGUF ------------------------------------------------------------------


def is_moe(spec: dict) -> bool:
    return spec["decoder"]["ffn"]["kind"] == "moe"


def is_gpt_oss(spec: dict) -> bool:
    """gpt-oss-shaped (llama.cpp's `gpt-oss`): attention sinks."""
    return bool(spec["decoder"]["attention"].get("sinks"))


def architecture(spec: dict) -> str:
    """llama.cpp's architecture for the spec: llama, qwen3moe or gpt-oss."""
    return "gpt-oss" if is_gpt_oss(spec) else "qwen3moe" if is_moe(spec) else "llama"


def gguf_names(spec: dict) -> dict[str, str]:
    """specc's weight names of a LLaMA-shaped decoder → llama.cpp's (its `llama` architecture), or
    of a Qwen3-MoE-shaped one (`qwen3moe`: QK-norm, routed experts stacked as llama.cpp stacks them)."""
    out = {"embeddings.tokens.weight": "token_embd.weight", "decoder.final_norm.weight": "output_norm.weight"}
    if not spec["vocab"]["tie_output"]:
        out["heads.logits.proj.weight"] = "output.weight"
    per_layer = {"attention_norm.weight": "attn_norm.weight", "attention.q.weight": "attn_q.weight",
                 "attention.k.weight": "attn_k.weight", "attention.v.weight": "attn_v.weight",
                 "attention.o.weight": "attn_output.weight", "ffn_norm.weight": "ffn_norm.weight"}
    if is_moe(spec):
        per_layer.update({"ffn.router.weight": "ffn_gate_inp.weight", "ffn.experts.gate": "ffn_gate_exps.weight",
                          "ffn.experts.up": "ffn_up_exps.weight", "ffn.experts.down": "ffn_down_exps.weight"})
    if is_gpt_oss(spec):  # biased attention, experts and router, a sink logit per head; ffn_norm as post_attention_norm
        per_layer.update({f"attention.{p}.bias": f"attn_{q}.bias" for p, q in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))})
        per_layer.update({"attention.sinks": "attn_sinks.weight", "ffn.router.bias": "ffn_gate_inp.bias",
                          "ffn_norm.weight": "post_attention_norm.weight",
                          **{f"ffn.experts.{p}_bias": f"ffn_{p}_exps.bias" for p in ("gate", "up", "down")}})
    elif is_moe(spec):
        per_layer.update({"attention.q_norm.weight": "attn_q_norm.weight", "attention.k_norm.weight": "attn_k_norm.weight"})
    else:
        per_layer.update({"ffn.gate.weight": "ffn_gate.weight", "ffn.up.weight": "ffn_up.weight",
                          "ffn.down.weight": "ffn_down.weight"})
    for i in range(spec["decoder"]["layers"]):
        out.update({f"decoder.layers.{i}.{k}": f"blk.{i}.{v}" for k, v in per_layer.items()})
    return out


def check_llama_shaped(spec: dict) -> None:
    """What llama.cpp's `llama` architecture computes: refuse a spec that differs from it."""
    dec, pos, norm = spec["decoder"], spec["position"], spec["norm"]
    att = dec["attention"]
    heads = spec.get("outputs") or [{"kind": "lm"}]
    wrong = {"architecture": spec["architecture"] != "decoder", "rotary positions": pos["kind"] != "rotary",
             "whole rotary": pos.get("fraction", 1.0) != 1.0, "rotary halves": pos.get("layout", "halves") != "halves",
             "rmsnorm": norm["kind"] != "rmsnorm", "pre-norm": norm["placement"] != "pre",
             "plain norm gains": norm.get("unit_offset", False),
             "no biases": att["bias"] or bool(att.get("output_bias")) or dec["ffn"]["bias"],
             "swiglu": dec["ffn"]["activation"] != "swiglu", "full attention": att["pattern"]["kind"] != "full",
             "scaled dot scores": att["score"] != "scaled_dot" or att.get("scale") is not None,
             "uncapped scores": att.get("softcap") is not None,
             "qk norm as the architecture has it": att.get("qk_norm", "none") != ("head" if is_moe(spec) else "none"),
             "sequential layers": dec.get("parallel", "none") != "none", "alike layers": bool(dec.get("overrides")),
             "unscaled embeddings": spec.get("vocab", {}).get("scale", "none") != "none",
             "a plain lm head": any(h.get("bias") or h.get("softcap") or h.get("scale") for h in heads)}
    if is_gpt_oss(spec):  # llama.cpp's gpt-oss: what it fixes, and the windows of every other layer
        ffn, pattern = dec["ffn"], att["pattern"]
        over = dec.get("overrides") or []
        wrong.update({"no biases": False, "swiglu": False, "full attention": False, "alike layers": False,
                      "qk norm as the architecture has it": att.get("qk_norm", "none") != "none",
                      "biased attention and experts": not (att["bias"] and ffn["bias"]),
                      "the clamped swiglu at 1.702 and 7": (ffn["activation"], ffn.get("swiglu_alpha"), ffn.get("swiglu_limit"))
                      != ("clamped_swiglu", 1.702, 7.0),
                      "a biased top-k softmax router": ffn["router"]["kind"] != "top_k_softmax" or not ffn["router"].get("bias"),
                      "windows in the even layers, dense odd ones": pattern["kind"] != "local" or len(over) != 1
                      or (over[0].get("every"), over[0].get("first"), over[0].get("pattern", {}).get("kind")) != (2, 1, "full"),
                      "rotary YaRN": (spec["position"].get("scaling") or {}).get("kind") != "yarn"})
    elif is_moe(spec):  # llama.cpp's qwen3moe: softmax over all experts, the chosen weights renormalised
        ffn = dec["ffn"]
        wrong.update({"a softmax router, renormalised": ffn["router"]["kind"] != "softmax" or not ffn["router"].get("normalize"),
                      "no shared experts": bool(ffn.get("shared")), "every layer routed": bool(ffn.get("dense"))})
    if any(wrong.values()):
        raise SystemExit(f"{spec['name']} is not LLaMA-shaped: needs {', '.join(k for k, v in wrong.items() if v)}")


def to_interleaved(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q or k from specc's rotary layout (each head's first half of dims rotated with its
    second half, as Hugging Face's LLaMA) to llama.cpp's (adjacent pairs rotated): per head, row
    2i+j of the result is row j*d_k/2 + i of the input."""
    rows, cols = w.shape
    return w.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


def write_gguf(shapes: dict[str, tuple[int, ...]], tensor, spec: dict, out: Path, matrices: str = "F16") -> None:
    """A specc model's weights as a GGUF file written a tensor at a time (`tensor(name)`: its fp32
    array by specc's name; `shapes`: every name's shape), matrices in `matrices` (F16, or Q4_0 by
    gguf's own routine), norms and a router in fp32, with the `llama` (or `qwen3moe`)
    architecture's metadata and a placeholder vocabulary of the spec's size."""
    import gguf

    check_llama_shaped(spec)
    dec, att = spec["decoder"], spec["decoder"]["attention"]
    names = gguf_names(spec)
    missing = sorted(set(names) - set(shapes))
    if missing:
        raise SystemExit(f"no {missing[0]} in the weights (of {len(missing)} missing)")
    moe = is_moe(spec)
    # llama.cpp's llama rotates adjacent pairs; qwen3moe rotates halves (NEOX), as specc does
    heads = {} if moe else {"attn_q.weight": att["heads"], "attn_k.weight": att["kv_heads"]}
    w = gguf.GGUFWriter(out, architecture(spec))
    w.add_name(spec["name"])
    w.add_context_length(spec["position"]["max_length"])
    w.add_embedding_length(spec["d_model"])
    w.add_block_count(dec["layers"])
    w.add_feed_forward_length(dec["ffn"]["d_ff"])
    w.add_head_count(att["heads"])
    w.add_head_count_kv(att["kv_heads"])
    w.add_key_length(att["d_k"])
    w.add_value_length(att["d_v"])
    w.add_rope_dimension_count(att["d_k"])
    w.add_rope_freq_base(spec["position"]["base"])
    w.add_layer_norm_rms_eps(spec["norm"]["eps"])
    if moe:
        w.add_expert_count(dec["ffn"]["experts"])
        w.add_expert_used_count(dec["ffn"]["top_k"])
        w.add_expert_feed_forward_length(dec["ffn"]["d_ff"])
    if is_gpt_oss(spec):  # the window (the token and the ones before it) and YaRN's rope scaling
        scaling = spec["position"]["scaling"]
        w.add_sliding_window(att["pattern"]["window"] + 1)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(scaling["factor"])
        w.add_rope_scaling_orig_ctx_len(scaling["original_max_length"])
        w.add_rope_scaling_yarn_beta_fast(scaling.get("beta_fast", 32.0))
        w.add_rope_scaling_yarn_beta_slow(scaling.get("beta_slow", 1.0))
    w.add_file_type({"F16": gguf.LlamaFileType.MOSTLY_F16, "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0}[matrices])
    size = spec["vocab"]["size"]
    tokens = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256))]
    kinds = [UNKNOWN, CONTROL, CONTROL, *([BYTE] * 256)]
    tokens += [f"\u2581t{i}" for i in range(len(tokens), size)]
    kinds += [NORMAL] * (size - len(kinds))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:size])
    w.add_token_scores([0.0] * size)
    w.add_token_types(kinds[:size])
    w.add_bos_token_id(spec["tokens"]["bos"] if spec["tokens"]["bos"] is not None else 1)
    w.add_eos_token_id(spec["tokens"]["eos"] if spec["tokens"]["eos"] is not None else 2)
    q4 = gguf.GGMLQuantizationType.Q4_0

    def kind(name: str):  # the tensor's GGML type
        if name.endswith(("norm.weight", "ffn_gate_inp.weight", ".bias", "attn_sinks.weight")):
            return gguf.GGMLQuantizationType.F32
        return q4 if matrices == "Q4_0" else gguf.GGMLQuantizationType.F16

    for ours, theirs in names.items():
        shape = tuple(shapes[ours])
        t = kind(theirs)
        if t == q4:
            stored = gguf.quant_shape_to_byte_shape(shape, q4)
            w.add_tensor_info(theirs, stored, np.dtype(np.uint8), int(np.prod(stored)), raw_dtype=q4)
        else:
            dtype = np.dtype(np.float32 if t == gguf.GGMLQuantizationType.F32 else np.float16)
            w.add_tensor_info(theirs, shape, dtype, int(np.prod(shape)) * dtype.itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for ours, theirs in names.items():
        t = np.asarray(tensor(ours), dtype=np.float32)
        if theirs.split(".", 2)[-1] in heads:
            t = to_interleaved(t, heads[theirs.split(".", 2)[-1]])
        w.write_tensor_data(gguf.quants.quantize(np.ascontiguousarray(t), kind(theirs)))
    w.close()


def file_tensors(weights: Path) -> tuple[dict, object]:
    """(shapes, tensor) of a safetensors weights file, for write_gguf."""
    from safetensors import safe_open

    f = safe_open(weights, "np")
    return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, f.get_tensor


def seeded_tensors(spec_name: str, seed: int = 0) -> tuple[dict, object]:
    """(shapes, tensor) of a spec's seeded weights, each made alone as a streamed build makes it
    (specc/nn/streamed.py: the values the build's graph was made from), for write_gguf."""
    from specc.export.stitch import streamable
    from specc.nn import as_resolved
    from specc.nn import streamed as st
    from specc.spec.costs import parameter_shapes

    r = as_resolved(spec_name)
    short, source = st.short_and_source(r, streamable(r), seed, hollow=True)  # every layer's tensors made alone
    return ({k: tuple(v) for k, v in parameter_shapes(r).items()},
            lambda name: source.tensor(name).float().numpy())


def quantize(src: Path, out: Path, kind: str = "Q4_0") -> None:
    """`src` quantized by llama.cpp's own quantizer (llama_ftype: Q4_0 = 2, Q8_0 = 7)."""
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"Q4_0": 2, "Q8_0": 7}[kind]
    params.nthread = THREADS
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(out).encode(), params)
    if rc != 0:
        raise SystemExit(f"llama.cpp's quantizer returned {rc} for {src}")


# --- one side, in its own process ----------------------------------------------------------------


def prompt_ids(vocab: int, n: int) -> list[int]:
    return np.random.default_rng(0).integers(3, vocab, size=n).tolist()


SPECC, SPECC_MODEL, SPECC_SMALL = "specc", "specc, model graph", "specc, 4 KiB pages"
LLAMA, LLAMA_HUGE = "llama.cpp", "llama.cpp, huge pages"
LLAMA_SIDES = (LLAMA, LLAMA_HUGE)  # the sides that run the GGUF
SIDES = (SPECC, SPECC_MODEL, SPECC_SMALL, *LLAMA_SIDES)


def run_specc(build: Path, prompt: list[int], new: int, inplace: bool = True) -> dict:
    from specc.runtime import Session

    t0 = time.perf_counter()
    s = Session(build, threads=THREADS, check_hashes=False, inplace=inplace)
    if s.inplace is None:  # the graph generation runs, opened here (a Session opens it when first used)
        s.graphs["model"]
    loaded = time.perf_counter()
    stamps: list[float] = []
    g = s.generate(prompt, max_new_tokens=new, eos_id=-1, on_token=lambda step, ids: stamps.append(time.perf_counter()))
    return {"load_s": loaded - t0, "ttft_s": stamps[0] - loaded, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "ids": g.new_ids[0]}


def run_llama_cpp(gguf_path: Path, prompt: list[int], new: int) -> dict:
    from llama_cpp import Llama

    t0 = time.perf_counter()
    llm = Llama(model_path=str(gguf_path), n_ctx=len(prompt) + new + 8, n_batch=512, n_threads=THREADS,
                n_threads_batch=THREADS, verbose=False)
    loaded = time.perf_counter()
    llm.eval(prompt)
    ids, stamps = [], []
    for _ in range(new):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        ids.append(nxt)
        stamps.append(time.perf_counter())
        if len(ids) < new:
            llm.eval([nxt])
    return {"load_s": loaded - t0, "ttft_s": stamps[0] - loaded, "decode_tok_s": (len(stamps) - 1) / (stamps[-1] - stamps[0]),
            "ids": ids}


LLAMA_BENCH = ROOT / "build" / "llama-server" / "bin" / "llama-bench"


def run_llama_bench(gguf_path: Path, prompt: int, new: int) -> dict:
    """llama.cpp's side where llama-cpp-python is not installed: llama-bench (`make llama-server`,
    then its llama-bench target) on the same file and threads, its prompt of `prompt` tokens and
    its decode of `new` at that depth, one repetition each. Time to first token is the prompt's
    time plus one step (llama-bench reports no load time); peak memory is llama-bench's own."""
    import resource

    def bench(*flags: str) -> float:
        out = subprocess.run([str(LLAMA_BENCH), "-m", str(gguf_path), "-t", str(THREADS), "-r", "1", "-o", "json", *flags],
                             check=True, capture_output=True, text=True).stdout
        return float(json.loads(out)[0]["avg_ts"])

    t0 = time.perf_counter()
    prompt_rate = bench("-p", str(prompt), "-n", "0")
    decode_rate = bench("-p", "0", "-n", str(new), "-d", str(prompt))
    return {"load_s": float("nan"), "ttft_s": prompt / prompt_rate + 1 / decode_rate, "decode_tok_s": decode_rate,
            "ids": [], "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
            "wall_s": time.perf_counter() - t0}


def side(args) -> None:
    """The child: one side's run, its figures as JSON on stdout."""
    prompt = prompt_ids(args.vocab, args.prompt)
    if args.side in LLAMA_SIDES:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            print(json.dumps(run_llama_bench(Path(args.path), args.prompt, args.new)))
            return
        fig = run_llama_cpp(Path(args.path), prompt, args.new)
    else:
        fig = run_specc(Path(args.path), prompt, args.new, inplace=args.side != SPECC_MODEL)
    fig["peak"] = peak_resident()
    print(json.dumps(fig))


def peak_resident() -> int:
    """This process's peak resident bytes (VmHWM: its own pages, from its exec on; ru_maxrss
    would carry the parent's peak across fork and exec)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def measure(which: str, path: Path, vocab: int, args) -> dict:
    """One side in a fresh process (both run in-process: no children to count). specc's sides,
    and llama.cpp's second, run in the environment `specc generate` runs in (its weights in huge
    pages: specc.malloc.huge_pages_environment); llama.cpp's first in this one, as it is run."""
    cmd = [sys.executable, __file__, "--side", which, "--path", str(path), "--vocab", str(vocab),
           "--prompt", str(args.prompt), "--new", str(args.new)]
    if which == LLAMA:
        env = None
    elif which == SPECC_SMALL:
        env = with_tunable(os.environ, f"{HUGE_PAGES_TUNABLE}=0")
    else:
        env = huge_pages_environment()
    done = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


# --- the parent: build, convert, measure, write --------------------------------------------------


def graph_bytes(build: Path) -> int:
    """Bytes of the build's decoder graph and its external data: the weights a decode step reads."""
    manifest = json.loads((build / "manifest.json").read_text())
    files = {a["path"]: a["bytes"] for a in manifest["artifacts"]}
    return sum(b for p, b in files.items() if p != "model.safetensors")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec", nargs="?", default="llama-2-7b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--build", help="an int4 build of SPEC's seeded weights to measure (else built with --keep-weights "
                                    "into build/bench); the GGUF is then made from the seeds")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmarks_streamed.md",
                    help="the document whose section for SPEC the table replaces (or is appended to)")
    ap.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--vocab", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.side:
        return side(args)

    WORK.mkdir(parents=True, exist_ok=True)
    build = Path(args.build) if args.build else WORK / f"peer-{args.spec}-int4"
    if not args.build and not (build / "model.safetensors").is_file():
        t0 = time.perf_counter()
        subprocess.run([str(Path(sys.executable).parent / "specc"), "build", args.spec, "-o", str(build),
                        "--precision", "int4", "--keep-weights", "--force"], check=True)
        print(f"[peer] specc build: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    manifest = json.loads((build / "manifest.json").read_text())
    spec = manifest["spec"]
    q4 = WORK / f"peer-{spec['name']}.Q4_0.gguf"
    if not q4.is_file():
        t0 = time.perf_counter()
        if (build / "model.safetensors").is_file():
            f16 = WORK / f"peer-{spec['name']}.F16.gguf"
            write_gguf(*file_tensors(build / "model.safetensors"), spec, f16)
            quantize(f16, q4)
            f16.unlink()
            print(f"[peer] GGUF F16 written and quantized to Q4_0: {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        else:
            partial = q4.with_suffix(".partial")
            write_gguf(*seeded_tensors(args.spec, manifest["options"]["weights"]["seed"]), spec, partial,
                       matrices="Q4_0")
            partial.rename(q4)
            print(f"[peer] GGUF Q4_0 written from the seeds: {time.perf_counter() - t0:.0f} s", file=sys.stderr)

    sizes = {which: q4.stat().st_size if which in LLAMA_SIDES else graph_bytes(build) for which in SIDES}
    runs: dict[str, list[dict]] = {which: [] for which in args.sides}
    for r in range(args.rounds):
        for which in args.sides:
            runs[which].append(measure(which, q4 if which in LLAMA_SIDES else build, spec["vocab"]["size"], args))
            print(f"[peer] round {r + 1}, {which}: {runs[which][-1]['decode_tok_s']:.2f} tok/s decode", file=sys.stderr)
    bandwidth = read_bandwidth()
    write(args, spec, runs, sizes, bandwidth, manifest["parameters"])


def huge_pages_note() -> str:
    """How this run's environment stood on huge pages, for the doc."""
    if huge_pages_environment() is not None:
        return "GLIBC_TUNABLES=glibc.malloc.hugetlb=1, the kernel's transparent huge pages in madvise mode"
    return ("none set by specc here: GLIBC_TUNABLES was " + repr(os.environ.get("GLIBC_TUNABLES", "unset"))
            + ", the kernel's transparent huge pages not in madvise mode, or not glibc 2.35+")


def median_run(runs: list[dict]) -> dict:
    """Each figure's median over the rounds (the ids of the first round)."""
    return {k: (runs[0][k] if k == "ids" else float(np.median([r[k] for r in runs]))) for k in runs[0]}


def read_per_token(spec: dict, ref: str, parameters: int, size: int) -> float:
    """Bytes of weights a decode step reads from a file of `size` bytes holding `parameters`: all
    of it for a dense model (the graph files; the GGUF), the active parameters at the file's bytes
    per parameter for a mixture of experts (its top-k experts, not the embedding table; `ref`: the
    spec as the command line named it)."""
    if not is_moe(spec):
        return size
    from specc.nn import as_resolved
    from specc.spec.costs import inspect_spec

    active = inspect_spec(as_resolved(ref))["active_parameters"] - spec["vocab"]["size"] * spec["d_model"]
    return size * active / parameters


def write(args, spec: dict, runs: dict, sizes: dict, bandwidth: float, parameters: int) -> None:
    import onnxruntime

    try:
        import llama_cpp

        peer = f"llama-cpp-python {llama_cpp.__version__}"
    except ImportError:
        peer = ("llama.cpp's llama-bench (built from llama-cpp-python's vendored source, `make llama-server`; "
                "its prompt, then its decode at the prompt's depth)")

    rows = {which: median_run(r) for which, r in runs.items()}
    ratios = {which: [a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(r, runs["llama.cpp"])] for which, r in runs.items()}
    same = sum(1 for _ in itertools.takewhile(lambda ab: ab[0] == ab[1], zip(rows[SPECC]["ids"], rows["llama.cpp"]["ids"])))
    # the sides measured (a run may leave out the model graph)
    rows = {which: rows[which] for which in SIDES if which in rows}
    options = (f" --build {args.build}" if args.build else "") + (
        f" --sides {' '.join(map(shlex.quote, args.sides))}" if args.sides != list(SIDES) else "")
    gguf_from = ("its weights file written as an F16 GGUF and quantized to Q4_0 by llama.cpp's quantizer"
                 if not args.build else "the same seeded weights made again tensor by tensor and written as Q4_0 by "
                 "gguf's Q4_0 routine (every matrix Q4_0, as llama-quantize --pure; router and norms fp32)")
    floor = ("the bytes of weights a decode step reads (the graph files; the GGUF)" if not is_moe(spec) else
             "the bytes of weights a decode step reads: the active parameters (top-k experts, no embedding table) "
             "at each file's bytes per parameter")
    lines = [
        f"## {spec['name']}: specc int4 against llama.cpp Q4_0 (benchmarks/llama_cpp_peer.py)",
        "",
        f"`{Path(sys.executable).relative_to(ROOT) if ROOT in Path(sys.executable).parents else sys.executable} "
        f"benchmarks/llama_cpp_peer.py {args.spec} --prompt {args.prompt} --new {args.new} --rounds {args.rounds}"
        f"{options}`, "
        f"{datetime.date.today()}, {_cpu()}, {THREADS} threads each, onnxruntime {onnxruntime.__version__}, "
        f"{peer}, Python {platform.python_version()}. The same seeded weights: "
        f"specc's build, and {gguf_from}. Prompt: {args.prompt} random token ids; then {args.new} greedy tokens. Each side in its "
        f"own process, the sides in turn, {args.rounds} rounds: each figure is the median over the rounds; "
        "\"vs llama.cpp\" is the ratio of the medians, and in brackets the range of the ratio within a round. "
        "specc generates through its in-place cache graph; \"specc, model graph\" is the same build through "
        "model.onnx. specc's sides run in the environment `specc generate` starts in, their weights in huge pages "
        f"({huge_pages_note()}), but \"{SPECC_SMALL}\" (its in-place graph with glibc.malloc.hugetlb=0); "
        f"\"{LLAMA}\" runs as it is started, and \"{LLAMA_HUGE}\" in specc's environment. "
        "Memory is a side's peak resident set. Read bandwidth "
        f"{bandwidth:.1f} GB/s (suite.read_bandwidth): "
        f"the floor is that bandwidth over {floor}.",
        "",
        "| | decode tok/s | vs llama.cpp | share of the bandwidth floor | prompt tok/s | time to first token | "
        "load | peak memory | weights |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    base = rows["llama.cpp"]["decode_tok_s"]
    for which, r in rows.items():
        floor = bandwidth * 1e9 / read_per_token(spec, args.spec, parameters, sizes[which])
        within = f" ({min(ratios[which]):.2f}-{max(ratios[which]):.2f})" if which != LLAMA else ""
        load = "-" if math.isnan(r["load_s"]) else f"{r['load_s']:.1f} s"
        lines.append(f"| {which} | {r['decode_tok_s']:.2f} | {r['decode_tok_s'] / base:.2f}x{within} | "
                     f"{r['decode_tok_s'] / floor:.0%} | {args.prompt / r['ttft_s']:.1f} | {r['ttft_s']:.2f} s | "
                     f"{load} | {r['peak'] / GIB:.2f} GiB | {sizes[which] / GIB:.2f} GiB |")
    if rows["llama.cpp"]["ids"]:
        lines += ["", f"Greedy tokens the two sides share from the start: {same} of {args.new} (random weights "
                  "give near-flat logits, so quantization noise flips early choices; agreement on a trained model is "
                  "in docs/benchmarks_quality.md).", ""]
    doc = args.out
    text = doc.read_text() if doc.is_file() else ""
    head = lines[0]
    if head in text:  # replace this spec's earlier table
        start = text.index(head)
        end = text.find("\n## ", start + 1)
        text = text[:start] + "\n".join(lines) + ("\n" + text[end + 1:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + "\n".join(lines)
    doc.write_text(text)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
