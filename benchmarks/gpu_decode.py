"""Decoding on the GPU against its memory floor: specc's decoder builds on onnxruntime's CUDA
provider, each way generation can run them there, beside PyTorch in the same process; writes
docs/benchmarks_gpu_decode.md (and a JSON of every figure).

    python benchmarks/gpu_decode.py [--new 128] [--repeats 5] [--budget 420] [--out DIR]

Needs a CUDA GPU, onnxruntime-gpu, torch and transformers (without a CUDA provider it says so and
exits, writing nothing). Random weights of the real shapes (seed 0), nothing downloaded.

Per build (specc build SPEC --precision P --verify-provider cuda), greedy generation of one
prompt of 32 ids (seeded) and `--new` new tokens, EOS off:
- model.onnx, its cache kept on the device (IO binding; Session(inplace=False)): the route of
  docs/benchmarks_gpu.md before the in-place graph ran on CUDA;
- the in-place cache graph on device buffers bound once, each step run as usual
  (Session(cuda_graph=False));
- the same, each step one replayed CUDA graph (Session(provider="cuda"), specc/runtime/captured.py);
- PyTorch: Hugging Face's model of the same shapes (its own random weights) in fp16, eager
  (`generate`, dynamic cache) and with a static cache under torch.compile (reduce-overhead: CUDA
  graphs), the compile timed apart.
A step's time is (time for `new` tokens - time to the first token) / (new - 1); its floor is the
bytes a step reads (every weight but a token table that only a Gather reads, one row a step)
at the device-to-device copy bandwidth measured in the same run. Tokens are compared between
specc's routes (the same graph weights): the replayed steps must give model.onnx's tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

import specc
from gpu import Clock, Runner, Sizes, copy_bandwidth, first_line, hf_model, log, machine_facts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "bench-gpu-decode"
DOC = ROOT / "docs" / "benchmarks_gpu_decode.md"
JSON_NAME = "benchmarks_gpu_decode.json"  # every figure of the run, beside the report
BUILDS = (("llama-style-1b", "fp16"), ("gpt2-small", "fp16"), ("llama-style-1b", "int4"))
COMPILED = ("llama-style-1b",)  # the specs whose PyTorch peer is also timed under torch.compile
PROMPT = 32
ROUTES = {"model.onnx, cache on the device (IO binding)": dict(inplace=False),
          "in-place graph, device buffers, no capture": dict(cuda_graph=False),
          "in-place graph, each step a replayed CUDA graph": {}}


def step_bytes(build: Path) -> int:
    """Bytes a decode step reads: every initializer of model.onnx but the tables only Gathers read."""
    import onnx
    from onnx import helper

    g = onnx.load(str(build / "model.onnx"), load_external_data=False).graph
    readers: dict[str, set[str]] = {}
    for n in g.node:
        for i in n.input:
            readers.setdefault(i, set()).add(n.op_type)
    total = 0
    for t in g.initializer:
        if readers.get(t.name) == {"Gather"} and len(t.dims) == 2:
            continue
        size = int(np.prod(t.dims)) if t.dims else 1
        total += size * np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).itemsize
    return total


def timed_generation(runner: Runner, calls: dict, new: int, repeats: int) -> dict:
    """name -> call(n); each timed for `new` tokens and for 1, interleaved, after one warm-up round."""
    full = runner.interleaved({k: (lambda c=c: c(new)) for k, c in calls.items()}, repeats, warmup=1)
    first = runner.interleaved({k: (lambda c=c: c(1)) for k, c in calls.items()}, repeats, warmup=1)
    out = {}
    for k in calls:
        f, t1 = statistics.median(full[k]), statistics.median(first[k])
        out[k] = {"tokens_per_s": new / f, "first_token_ms": t1 * 1e3, "step_ms": (f - t1) / (new - 1) * 1e3,
                  "full_s": full[k], "first_s": first[k]}
    return out


def specc_routes(build: Path, prompt: list[int]) -> tuple[dict, dict]:
    """specc's routes of ROUTES that this build has: name -> call(n) -> new ids (each tried once);
    and route -> why it did not run."""
    from specc.runtime import Session

    calls, absent = {}, {}
    for name, kw in ROUTES.items():
        try:
            s = Session(build, provider="cuda", **kw)
            if kw.get("inplace", True) and s.captured(1) is None:
                absent[name] = "no in-place graph on CUDA for this build (its cache is not fp16/bf16, or it has none)"
                continue
            def call(n, s=s):
                return s.generate(prompt, max_new_tokens=n, eos_id=-1, pad_id=0).new_ids[0]

            call(4)
            calls[name] = call
        except Exception as exc:  # a route that fails here is reported, and the others still run
            absent[name] = first_line(exc)
            log(f"{name}: {first_line(exc)}")
    return calls, absent


def rows_throughput(build: Path, prompt: list[int], new: int, runner: Runner, rows: int = 16) -> dict | None:
    """Tokens/s of `rows` equal-length prompts decoded together through replayed steps (one capture
    for that row count), against one row: what a batched step on the device does, before a server."""
    from specc.runtime import Session

    s = Session(build, provider="cuda")
    if s.captured(rows) is None:
        return None
    batch = [prompt[i:] + prompt[:i] for i in range(rows)]  # rows of one length, different tokens

    def many():
        s.generate(batch, max_new_tokens=new, eos_id=-1, pad_id=0)

    def one():
        s.generate([prompt], max_new_tokens=new, eos_id=-1, pad_id=0)

    times = runner.interleaved({"many": many, "one": one}, 3, warmup=1)
    many_s, one_s = statistics.median(times["many"]), statistics.median(times["one"])
    return {"rows": rows, "tokens_per_s": rows * new / many_s, "one_row_tokens_per_s": new / one_s,
            "ratio": (rows * new / many_s) / (new / one_s)}


def torch_routes(spec: str, prompt: list[int], clock: Clock, runner: Runner) -> tuple[dict, dict, dict]:
    """Hugging Face's model of the spec's shapes in fp16: eager generate, and static cache under
    torch.compile (reduce-overhead); name -> call(n), failures, compile seconds."""
    import transformers as T

    sizes = Sizes(tiny=False)
    config = sizes.gpt2_config() if spec.startswith("gpt2") else sizes.llama_config()
    cls = T.GPT2LMHeadModel if spec.startswith("gpt2") else T.LlamaForCausalLM
    with torch.device("cuda"):
        model = hf_model(cls, config, "cuda", torch.float16)
    ids = torch.tensor([prompt], device="cuda")
    kw = dict(do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))

    def gen(n, **extra):
        with torch.inference_mode():
            return model.generate(input_ids=ids, max_new_tokens=n, min_new_tokens=n, **kw, **extra)[0, ids.shape[1]:].tolist()

    calls, failed, compiled = {"PyTorch eager fp16 (HF generate)": gen}, {}, {}
    name = "PyTorch torch.compile fp16, static cache (reduce-overhead)"
    if spec not in COMPILED:
        return calls, failed, compiled
    if clock.left() < 150:
        failed[name] = "skipped: too little of the run's time budget left"
        return calls, failed, compiled
    try:
        static = dict(cache_implementation="static", compile_config=T.CompileConfig(mode="reduce-overhead", fullgraph=True))
        t0 = time.perf_counter()
        runner.timed(lambda: gen(8, **static))
        compiled[name] = time.perf_counter() - t0
        calls[name] = lambda n: gen(n, **static)
    except Exception as exc:  # a compile that fails is reported, not fatal
        failed[name] = first_line(exc)
    return calls, failed, compiled


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--budget", type=float, default=420.0, help="seconds; later work is skipped past it")
    ap.add_argument("--out", type=Path, default=None, help="a folder for the report and JSON (default: docs/)")
    ap.add_argument("--from-json", type=Path, default=None,
                    help="write the report again from a run's JSON (no GPU needed), into --out")
    args = ap.parse_args(argv)
    out = args.out or DOC.parent
    if args.from_json:
        data = json.loads(args.from_json.read_text())
        (out / DOC.name).write_text(report(data))
        if args.from_json.resolve() != (out / JSON_NAME).resolve():
            (out / JSON_NAME).write_text(json.dumps(data, indent=1))
        return 0
    import onnxruntime as ort

    from specc.runtime.graph import unusable_provider

    if not torch.cuda.is_available() or unusable_provider(ort, "cuda"):
        print(f"needs a CUDA GPU and onnxruntime's CUDA provider: {unusable_provider(ort, 'cuda')}", file=sys.stderr)
        return 1
    clock, runner = Clock(args.budget), Runner("cuda")
    facts = machine_facts("cuda")
    facts["versions"]["onnxruntime"] = ort.__version__
    bw = copy_bandwidth(runner)
    log(f"copy bandwidth {bw:.0f} GB/s")
    rng = np.random.default_rng(2)
    prompt = rng.integers(1000, 20000, PROMPT).tolist()
    results, failures = [], []
    for spec, precision in BUILDS:
        label = f"specc build {spec} --precision {precision} --verify-provider cuda"
        if clock.left() < 120:
            failures.append((label, "skipped: too little of the run's time budget left"))
            continue
        d = WORK / f"{spec}-{precision}"
        log(label)
        try:
            t0 = time.perf_counter()
            built = specc.build(spec, d, precision=precision, verify_provider="cuda", progress=None)
            build_s = time.perf_counter() - t0
            calls, absent = specc_routes(d, prompt)
        except Exception as exc:
            failures.append((label, first_line(exc)))
            log(f"{label}: {first_line(exc)}")
            continue
        failed, compiled = dict(absent), {}
        if precision == "fp16":
            try:
                more, more_failed, compiled = torch_routes(spec, prompt, clock, runner)
                calls.update(more)
                failed.update(more_failed)
            except Exception as exc:
                failed["PyTorch"] = first_line(exc)
        log(f"{spec} {precision}: timing {len(calls)} routes")
        table = timed_generation(runner, calls, args.new, args.repeats)
        ids = {k: c(args.new) for k, c in calls.items() if not k.startswith("PyTorch")}
        base = ids.get(next(iter(ROUTES)))
        floor_ms = step_bytes(d) / (bw * 1e9) * 1e3
        for k, row in table.items():
            row["floor_share"] = floor_ms / row["step_ms"]
            row["same_tokens_as_model_onnx"] = None if k not in ids or base is None else ids[k] == base
        batched = rows_throughput(d, prompt, args.new, runner) if precision == "fp16" else None
        results.append({"spec": spec, "precision": precision, "build_s": build_s, "batched": batched,
                        "max_abs_diff": built.manifest["verification"]["max_abs_diff"],
                        "step_bytes": step_bytes(d), "floor_ms": floor_ms, "routes": table,
                        "not_run": failed, "compile_s": compiled})
        torch.cuda.empty_cache()
    out.mkdir(parents=True, exist_ok=True)
    data = {"facts": facts, "bandwidth_gb_s": bw, "prompt": PROMPT, "new": args.new, "repeats": args.repeats,
            "results": results, "failures": failures, "argv": sys.argv[1:]}
    (out / JSON_NAME).write_text(json.dumps(data, indent=1, default=float))
    (out / DOC.name).write_text(report(data))
    log(f"wrote {out / DOC.name}")
    return 0


def _shown(argv: list[str]) -> list[str]:
    """The run's arguments as the report shows them: without --out and its folder (the machine's)."""
    shown, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--out":
            skip = True
        elif not a.startswith("--out="):
            shown.append(a)
    return shown


def report(data: dict) -> str:
    f = data["facts"]
    v = ", ".join(f"{k} {x}" for k, x in f["versions"].items())
    lines = ["# Decoding on the GPU against its memory floor", "",
             "Written by `python benchmarks/gpu_decode.py` on a CUDA machine; do not edit by hand. "
             "The GPU suite is [benchmarks_gpu.md](benchmarks_gpu.md).", "",
             "Command: `python benchmarks/gpu_decode.py" + "".join(" " + a for a in _shown(data["argv"])) + "`", "",
             f"Run: {f['date']}. Machine: {f['gpu']}, {f['gpu_memory_gib']:.0f} GiB, {f['sms']} SMs, driver "
             f"{f['driver']}; {f['cpu']}, {f['cores']} cores. {v}.", "",
             f"Greedy generation, batch 1, a prompt of {data['prompt']} ids + {data['new']} new tokens, EOS off; "
             f"medians of {data['repeats']} after a warm-up round, routes interleaved. A step's time is (time for "
             f"{data['new']} tokens - time to the first token) / {data['new'] - 1}. Floor: the bytes a step reads "
             "(every weight but a token table only a Gather reads) at the device-to-device copy bandwidth measured "
             f"in this run, {data['bandwidth_gb_s']:.0f} GB/s (bytes read + written). PyTorch rows: Hugging Face's "
             "model of the same shapes with its own random weights, so their tokens are not compared.", ""]
    for r in data["results"]:
        lines += [f"## {r['spec']} {r['precision']}", "",
                  f"Build {r['build_s']:.0f} s, verified on CUDA (max abs diff {r['max_abs_diff']:.3g}). "
                  f"A step reads {r['step_bytes'] / 1e9:.3f} GB: floor {r['floor_ms']:.3f} ms "
                  f"({1e3 / r['floor_ms']:.0f} steps/s).", "",
                  "| route | tokens/s | step | share of the floor | time to first token | same tokens as model.onnx |",
                  "|---|---|---|---|---|---|"]
        for k, row in r["routes"].items():
            same = {None: "-", True: "yes", False: "**no**"}[row["same_tokens_as_model_onnx"]]
            lines.append(f"| {k} | {row['tokens_per_s']:.1f} | {row['step_ms']:.3f} ms | {row['floor_share']:.0%} | "
                         f"{row['first_token_ms']:.2f} ms | {same} |")
        if r.get("batched"):
            b = r["batched"]
            lines.append(f"\n{b['rows']} rows of one length decoded together through replayed steps: "
                         f"{b['tokens_per_s']:.0f} tokens/s, {b['ratio']:.1f}x one row's {b['one_row_tokens_per_s']:.0f} "
                         "(Session.generate on a batch; not yet `specc serve`).")
        for k, s in r["compile_s"].items():
            lines.append(f"\n{k}: first call (compile) {s:.1f} s.")
        for k, why in r["not_run"].items():
            lines.append(f"\nNot run: {k}: {why}")
        lines.append("")
    if data["failures"]:
        lines += ["## Could not run", ""] + [f"- {k}: {why}" for k, why in data["failures"]] + [""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
