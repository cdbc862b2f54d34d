"""The GPU half of the performance suite: the suite's workloads on CUDA, and
docs/benchmarks_gpu.md rewritten with the results.

    python benchmarks/gpu.py [--repeats 20] [--gen-repeats 5] [--quick] [--out PATH]

Needs a CUDA GPU (without one it says so and exits, writing nothing), torch, transformers and
specc (importable: installed, or PYTHONPATH=.); onnxruntime with the CUDA / TensorRT execution
providers and TensorRT itself are used where installed, and the report says which were not and why.

Variants, each measured on the same inputs, random weights (seed 0) of the real shapes, nothing
downloaded:
- bert-base, batch 1 and 8, sequence 128: the Hugging Face BertModel (BertConfig() defaults) in
  fp32 and fp16 eager; specc's PyTorch module (specc.to_torch("bert-base")) in fp32 and fp16
  eager and under torch.compile (fp16, default mode);
- gpt2-small: greedy generation (prompt 32 + 64 new, batch 1) with HF GPT2LMHeadModel.generate
  and with specc's module in a cached greedy loop (below), fp32 and fp16; one decode step at 512
  context (511 cached + 1 new), eager and (specc, fp16) under torch.compile;
- onnxruntime on the GPU (where onnxruntime-gpu is installed): specc's builds of bert-base (fp32,
  fp16), gpt2-small (fp16) and llama-style-1b (fp16), each verified by `specc build
  --verify-provider cuda`, run by specc.runtime.Session(provider="cuda") in the same tables:
  bert's graph with inputs and outputs bound on the device; generation with the KV cache kept on
  the device (IO binding) against the same graph in a loop that copies the cache to the host and
  back every step; gpt2's decode step at 512 context with its cache on the device;
- llama-style-1b fp16 generation (prompt 32 + 64 new): HF LlamaForCausalLM.generate, specc's
  module in the cached greedy loop, and specc's graph on onnxruntime CUDA;
- Optimum's own export of the same HF models run by its ORTModel classes on onnxruntime CUDA
  (benchmarks/gpu_optimum.py, in a process of its own with Optimum's transformers: --optimum-path);
- a TensorRT engine built by `specc build --target tensorrt`, where TensorRT can be had.

Timing: every call is bracketed by torch.cuda.synchronize(); the variants of a table run
interleaved, one call of each per round, after warm-up rounds; medians and min-max ranges are
reported, with ratios against PyTorch eager fp32 (the Hugging Face model) of the same workload.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

import specc
from specc import errors
from specc.deps import installed_runtimes
from specc.spec.costs import inspect_spec
from specc.runtime.cache import empty_cache
from specc.runtime.graph import GPU_PROVIDERS, unusable_provider
from specc.spec.io import ATTENTION_MASK, INPUT_IDS, POSITION_IDS, TOKEN_TYPE_IDS, is_present, present_to_past

sys.path.insert(0, str(Path(__file__).resolve().parent))
from suite import _cpu  # noqa: E402  (the CPU suite's; it imports no baseline at module level)

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "bench-gpu"
DEFAULT_OUT = ROOT / "docs" / "benchmarks_gpu.md"
HF_FP32 = "HF eager fp32"


# --- measuring ----------------------------------------------------------------------------------


class Clock:
    """Wall time since start, against the run's budget (compiles are skipped once it runs short)."""

    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def left(self) -> float:
        return self.budget_s - self.elapsed()


def log(msg: str) -> None:
    print(f"[gpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def first_line(exc: BaseException) -> str:
    """The exception's type and the first line of its message, as the report names a failure."""
    return f"{type(exc).__name__}: {errors.first_line(exc)}".rstrip(": ")


class Runner:
    """Calls on one device: synchronize before and after each call when it is CUDA."""

    def __init__(self, device: str):
        self.device = device
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def timed(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0

    def interleaved(self, variants: dict, repeats: int, warmup: int = 3) -> dict[str, list[float]]:
        """Each variant called once per round, rounds repeated; seconds per call, warm-up rounds
        dropped (as benchmarks/suite.py measures, without its pause: nothing spins on a GPU)."""
        times: dict[str, list[float]] = {k: [] for k in variants}
        for i in range(warmup + repeats):
            for name, fn in variants.items():
                dt = self.timed(fn)
                if i >= warmup:
                    times[name].append(dt)
        return times


def med(ts: list[float]) -> float:
    return statistics.median(ts)


class CompileTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise CompileTimeout in the main thread after `seconds` (SIGALRM; Unix)."""
    seconds = max(1, int(seconds))

    def on_alarm(signum, frame):
        raise CompileTimeout(f"did not finish within {seconds} s")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def compile_variant(name: str, make, runner: Runner, clock: Clock, limit_s: float, failures: list,
                    reserve_s: float = 90.0):
    """make() -> a callable whose first calls compile. Runs two warm-up calls under a time limit;
    returns (callable, seconds of the first call) or (None, None), recording why in failures."""
    limit = min(limit_s, clock.left() - reserve_s)
    if limit < 20:
        failures.append((name, f"skipped: the run's time budget was spent ({clock.elapsed():.0f} s of "
                               f"{clock.budget_s:.0f} s) before this compile"))
        log(f"{name}: skipped (time budget)")
        return None, None
    log(f"{name}: compiling (limit {limit:.0f} s)")
    try:
        with time_limit(limit):
            fn = make()
            first = runner.timed(fn)
            runner.timed(fn)
    except CompileTimeout as exc:
        failures.append((name, f"torch.compile {exc} (the time guard this run allowed it)"))
        log(f"{name}: compile timed out")
        return None, None
    except Exception as exc:  # whatever dynamo / inductor raise
        failures.append((name, f"torch.compile failed: {first_line(exc)}"))
        log(f"{name}: compile failed: {first_line(exc)}")
        traceback.print_exc(limit=-3)
        return None, None
    log(f"{name}: compiled, first call {first:.1f} s")
    return fn, first


# --- machine facts and floors -------------------------------------------------------------------------


def machine_facts(device: str) -> dict:
    import transformers

    facts = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu(), "cores": os.cpu_count(),
        "versions": {"specc": specc.__version__, "python": platform.python_version(), "torch": torch.__version__,
                     "CUDA (torch)": torch.version.cuda or "none", "transformers": transformers.__version__},
    }
    try:
        import onnxruntime

        facts["versions"]["onnxruntime"] = onnxruntime.__version__
    except ImportError:
        pass
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        facts["gpu"] = p.name
        facts["gpu_memory_gib"] = p.total_memory / 2**30
        facts["sms"] = p.multi_processor_count
        facts["capability"] = f"{p.major}.{p.minor}"
        facts["driver"] = _nvidia_smi("driver_version")
        cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if cudnn:
            facts["versions"]["cuDNN"] = str(cudnn)
    else:
        facts["gpu"] = "none (debug run on the CPU)"
    return facts


def _nvidia_smi(field: str) -> str:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown (no nvidia-smi)"


def matmul_probe(runner: Runner, n: int, calls: int = 10) -> dict[str, float]:
    """TFLOP/s of an n x n x n torch.mm on random data: each dtype's mean over `calls` products
    after 3 warm-ups. fp32 with TF32 off (torch's default) and on."""
    out = {}
    dev = runner.device
    for label, dtype, tf32 in (("bf16", torch.bfloat16, False), ("fp16", torch.float16, False),
                               ("tf32", torch.float32, True), ("fp32", torch.float32, False)):
        if dev == "cpu" and dtype != torch.float32:
            continue
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            a = torch.randn(n, n, device=dev, dtype=dtype)
            b = torch.randn(n, n, device=dev, dtype=dtype)
            for _ in range(3):
                torch.mm(a, b)
            dt = runner.timed(lambda: [torch.mm(a, b) for _ in range(calls)])
            out[label] = 2 * n**3 * calls / dt / 1e12
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old
    return out


def copy_bandwidth(runner: Runner, mib: int = 1024) -> float:
    """GB/s of a device-to-device copy of `mib` MiB, counting bytes read and written; best of 5."""
    x = torch.empty(mib * 2**20, dtype=torch.uint8, device=runner.device)
    y = torch.empty_like(x)
    y.copy_(x)
    best = min(runner.timed(lambda: y.copy_(x)) for _ in range(5))
    return 2 * mib * 2**20 / best / 1e9


# --- models ------------------------------------------------------------------------------------------


class Sizes:
    """The workloads' sizes: the real ones, or tiny ones for a debug run (--tiny)."""

    def __init__(self, tiny: bool):
        self.tiny = tiny
        self.bert_spec, self.gpt_spec = ("tiny-bert", "tiny-gpt2") if tiny else ("bert-base", "gpt2-small")
        self.llama_spec = "tiny-llama" if tiny else "llama-style-1b"
        # specc's builds onnxruntime runs on the GPU, each verified there
        self.ort_builds = ((self.bert_spec, "fp32"), (self.bert_spec, "fp16"), (self.gpt_spec, "fp16"),
                           (self.llama_spec, "fp16"))
        self.seq = 32 if tiny else 128
        self.batches = (1, 8) if not tiny else (1, 2)
        self.context = 64 if tiny else 512
        self.prompt, self.new = (8, 8) if tiny else (32, 64)
        self.vocab_lo, self.vocab_hi = (10, 900) if tiny else (1000, 20000)

    def bert_config(self):
        import transformers as T

        if self.tiny:
            return T.BertConfig(vocab_size=1000, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=128, max_position_embeddings=128)
        return T.BertConfig()

    def gpt2_config(self):
        import transformers as T

        if self.tiny:
            return T.GPT2Config(vocab_size=1000, n_embd=64, n_layer=2, n_head=4, n_positions=128,
                                bos_token_id=999, eos_token_id=999)
        return T.GPT2Config()

    def llama_config(self):
        """Hugging Face's LlamaConfig of specs/llama-style-1b.yaml (TinyLlama-1.1B's shapes), or of
        tiny-llama."""
        import transformers as T

        r = specc.resolve(specc.load_spec(self.llama_spec))
        spec = r.spec
        att = spec.decoder.attention
        return T.LlamaConfig(vocab_size=spec.vocab.size, hidden_size=spec.d_model, num_hidden_layers=spec.decoder.layers,
                             num_attention_heads=att.heads, num_key_value_heads=att.kv_heads or att.heads,
                             intermediate_size=spec.decoder.ffn.d_ff, max_position_embeddings=r.serving.length.max,
                             rms_norm_eps=spec.norm.eps, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


def hf_model(cls, config, device: str, dtype):
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"  # transformers' default where torch has it; named, so the doc can say
    return cls(config).eval().to(device=device, dtype=dtype)


def specc_model(spec: str, device: str, dtype):
    return specc.to_torch(spec, seed=0).to(device=device, dtype=dtype).eval()


# --- bert-base ----------------------------------------------------------------------------------------


def bert(sizes: Sizes, runner: Runner, clock: Clock, repeats: int, compile_limit: float, failures: list,
         o: Ort) -> dict:
    import transformers as T

    dev = runner.device
    log("bert: models")
    hf32 = hf_model(T.BertModel, sizes.bert_config(), dev, torch.float32)
    hf16 = copy.deepcopy(hf32).half()
    sp32 = specc_model(sizes.bert_spec, dev, torch.float32)
    sp16 = copy.deepcopy(sp32).half()
    attn = getattr(hf32.config, "_attn_implementation", "?")
    rng = np.random.default_rng(0)
    variants: dict[int, dict] = {}
    refs = {}
    ort_outs: dict[int, dict] = {b: {} for b in sizes.batches}
    for batch in sizes.batches:
        ids = torch.from_numpy(rng.integers(sizes.vocab_lo, sizes.vocab_hi, (batch, sizes.seq))).to(dev)
        feeds = {INPUT_IDS: ids, ATTENTION_MASK: torch.ones_like(ids), TOKEN_TYPE_IDS: torch.zeros_like(ids)}

        def hf(m, feeds=feeds):
            with torch.inference_mode():
                return m(**feeds).last_hidden_state

        def sp(m, feeds=feeds):
            with torch.inference_mode():
                return m(**feeds)["last_hidden_state"]

        variants[batch] = {HF_FP32: lambda hf=hf: hf(hf32), "HF eager fp16": lambda hf=hf: hf(hf16),
                           "specc eager fp32": lambda sp=sp: sp(sp32), "specc eager fp16": lambda sp=sp: sp(sp16)}
        refs[batch] = sp
        try:
            ort_calls, ort_outs[batch] = ort_bert_variants(o, sizes, batch, ids.cpu().numpy())
            variants[batch].update(ort_calls)
        except Exception as exc:
            failures.append((f"bert batch {batch}: onnxruntime", first_line(exc)))
            log(f"bert batch {batch}: onnxruntime: {first_line(exc)}")
    # every compile before any timing, so that no table is measured while the compilers' worker
    # processes are still busy and every table sees the same machine
    compile_s: dict[int, dict] = {b: {} for b in sizes.batches}
    if compile_limit > 0:
        for mode in ("default", "reduce-overhead"):
            name = f"specc torch.compile fp16 ({mode})"
            compiled = torch.compile(sp16, mode=None if mode == "default" else mode, dynamic=False)
            for batch in sizes.batches:
                fn, secs = compile_variant(f"bert batch {batch}: {name}", lambda c=compiled, b=batch: (lambda: refs[b](c)),
                                           runner, clock, compile_limit, failures)
                if fn is not None:
                    variants[batch][name] = fn
                    compile_s[batch][name] = secs
    tables = {}
    for batch in sizes.batches:
        log(f"bert batch {batch}: timing {len(variants[batch])} variants")
        times = runner.interleaved(variants[batch], repeats)
        ref = refs[batch](sp32).float()
        diffs = {k: float((v().float() - ref).abs().max()) for k, v in variants[batch].items()
                 if k.startswith("specc") and k not in ort_outs[batch]}
        diffs.update({k: float((v().float() - ref.cpu()).abs().max()) for k, v in ort_outs[batch].items()})
        tables[batch] = {"times": times, "diffs": diffs, "compile_s": compile_s[batch]}
    return {"tables": tables, "attn": attn}


def _free(dev: str) -> None:
    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()


# --- gpt2-small -------------------------------------------------------------------------------------


def specc_greedy(model, prompt: torch.Tensor, new: int) -> torch.Tensor:
    """specc's module in a cached greedy loop: the prompt in one call, then one token per call
    with the previous call's present.* fed back as past_key_values.*. The chosen ids stay on the
    device (no host sync per token). Returns the new ids [B, new]."""
    with torch.inference_mode():
        out = model(input_ids=prompt, use_cache=True)
        token = out["logits"][:, -1].argmax(-1, keepdim=True)
        chosen = [token]
        for _ in range(new - 1):
            out = model(input_ids=token, **present_to_past(out))
            token = out["logits"][:, -1].argmax(-1, keepdim=True)
            chosen.append(token)
        return torch.cat(chosen, dim=1)


def gpt2(sizes: Sizes, runner: Runner, clock: Clock, repeats: int, gen_repeats: int, compile_limit: float,
         failures: list, o: Ort) -> dict:
    """Generation and the decode step; each part that fails is recorded, the other still runs."""
    import transformers as T

    dev = runner.device
    log("gpt2: models")
    models = {"hf32": hf_model(T.GPT2LMHeadModel, sizes.gpt2_config(), dev, torch.float32)}
    models["hf16"] = copy.deepcopy(models["hf32"]).half()
    models["sp32"] = specc_model(sizes.gpt_spec, dev, torch.float32)
    models["sp16"] = copy.deepcopy(models["sp32"]).half()
    result: dict = {}
    for part, fn in (("generation", gpt2_generation), ("decode step", gpt2_decode_step)):
        try:
            result.update(fn(models, sizes, runner, clock, repeats, gen_repeats, compile_limit, failures, o))
        except Exception as exc:
            failures.append((f"{sizes.gpt_spec} {part}", first_line(exc)))
            log(f"gpt2 {part} failed: {first_line(exc)}")
            traceback.print_exc()
    models.clear()
    _free(dev)
    return result


def same_ids_as(name: str) -> str:
    """The generation row a row's ids are compared with: specc's own fp32 (torch) loop for
    onnxruntime's rows (the same seeded weights), else the row's fp32 twin."""
    return "specc greedy loop fp32" if name.startswith("specc ORT") else name.replace("fp16", "fp32")


def gpt2_generation(models: dict, sizes: Sizes, runner: Runner, clock: Clock, repeats: int, gen_repeats: int,
                    compile_limit: float, failures: list, o: Ort) -> dict:
    dev = runner.device
    rng = np.random.default_rng(0)
    prompt = torch.from_numpy(rng.integers(sizes.vocab_lo, sizes.vocab_hi, (1, sizes.prompt))).to(dev)
    kw = dict(do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)

    def hf_gen(m, n):
        with torch.inference_mode():
            out = m.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                             min_new_tokens=n, **kw)
        return out[:, prompt.shape[1]:]

    gens = {"HF generate fp32": lambda n: hf_gen(models["hf32"], n),
            "HF generate fp16": lambda n: hf_gen(models["hf16"], n),
            "specc greedy loop fp32": lambda n: specc_greedy(models["sp32"], prompt, n),
            "specc greedy loop fp16": lambda n: specc_greedy(models["sp16"], prompt, n)}
    gens.update(ort_generation_variants(o, sizes.gpt_spec, prompt[0].tolist()))
    log("gpt2: generation")
    return generation_table(gens, sizes, runner, gen_repeats)


def generation_table(gens: dict, sizes: Sizes, runner: Runner, gen_repeats: int) -> dict:
    """gens: name -> call(n) making n new tokens (ids as a tensor or a list). Every call timed
    interleaved for sizes.new tokens and for 1 (the time to the first token); the ids compared."""
    full = runner.interleaved({k: (lambda g=g: g(sizes.new)) for k, g in gens.items()}, gen_repeats, warmup=1)
    first = runner.interleaved({k: (lambda g=g: g(1)) for k, g in gens.items()}, gen_repeats, warmup=1)
    ids = {k: torch.as_tensor(g(sizes.new)).reshape(1, -1).cpu() for k, g in gens.items()}
    same = {k: bool(torch.equal(ids[k], ids[same_ids_as(k)])) for k in gens
            if (k.endswith("fp16") or k.startswith("specc ORT")) and same_ids_as(k) in ids}
    n_tokens = {k: int(v.shape[1]) for k, v in ids.items()}
    return {"full": full, "first": first, "same": same, "n_tokens": n_tokens}


def gpt2_decode_step(models: dict, sizes: Sizes, runner: Runner, clock: Clock, repeats: int, gen_repeats: int,
                     compile_limit: float, failures: list, o: Ort) -> dict:
    """One new token after context - 1 cached positions."""
    dev = runner.device
    log("gpt2: decode step")
    rng = np.random.default_rng(1)
    past_len = sizes.context - 1
    ctx = torch.from_numpy(rng.integers(sizes.vocab_lo, sizes.vocab_hi, (1, past_len))).to(dev)
    step = torch.tensor([[42]], device=dev)
    mask = torch.ones(1, sizes.context, dtype=torch.long, device=dev)
    variants = {}
    for label in ("fp32", "fp16"):
        m = models[f"hf{label[2:]}"]
        with torch.inference_mode():
            cache = m(input_ids=ctx, use_cache=True).past_key_values

        def hf_step(m=m, cache=cache):
            with torch.inference_mode():
                m(input_ids=step, past_key_values=cache, attention_mask=mask, use_cache=True)
                cache.crop(-1)  # the step appended one position; take it back

        variants[f"HF eager {label}"] = hf_step
    pasts = {}
    for label in ("fp32", "fp16"):
        m = models[f"sp{label[2:]}"]
        with torch.inference_mode():
            out = m(input_ids=ctx, use_cache=True)
        past = present_to_past(out)
        pasts[label] = past

        def sp_step(m=m, past=past):
            with torch.inference_mode():
                return m(input_ids=step, **past)["logits"]

        variants[f"specc eager {label}"] = sp_step
    compile_s = {}
    if compile_limit > 0:
        for mode in ("default", "reduce-overhead"):
            name = f"specc torch.compile fp16 ({mode})"

            def make(mode=mode):
                c = torch.compile(models["sp16"], mode=None if mode == "default" else mode, dynamic=False)

                def fn():
                    with torch.inference_mode():
                        return c(input_ids=step, **pasts["fp16"])["logits"]

                return fn

            fn, secs = compile_variant(f"gpt2 decode step: {name}", make, runner, clock, compile_limit, failures)
            if fn is not None:
                variants[name] = fn
                compile_s[name] = secs
    ort_out = {}
    if (sizes.gpt_spec, "fp16") in o.dirs:
        try:
            name, call, ort_out[name] = ort_decode_step(o, sizes, ctx.cpu().numpy())
            variants[name] = call
        except Exception as exc:
            failures.append(("gpt2 decode step: onnxruntime", first_line(exc)))
            log(f"gpt2 decode step: onnxruntime: {first_line(exc)}")
    log(f"gpt2 decode step: timing {len(variants)} variants")
    step_times = runner.interleaved(variants, repeats)
    with torch.inference_mode():
        ref = models["sp32"](input_ids=step, **pasts["fp32"])["logits"].float()
    diffs = {k: float((v().float() - ref).abs().max()) for k, v in variants.items()
             if k.startswith("specc") and k not in ort_out}
    diffs.update({k: float((v().float() - ref.cpu()).abs().max()) for k, v in ort_out.items()})
    return {"step": step_times, "step_diffs": diffs, "compile_s": compile_s}


def ort_decode_step(o: Ort, sizes: Sizes, ctx: np.ndarray):
    """specc's fp16 gpt2 graph on onnxruntime: one token (id 42) after `ctx` [1, context - 1], the
    cache of the prefill kept on the device. Returns (name, call, call -> logits as a torch tensor)."""
    graph = o.session(sizes.gpt_spec, "fp16").graphs["model"]
    n = ctx.shape[1]
    feeds = {INPUT_IDS: ctx, ATTENTION_MASK: np.ones_like(ctx), **empty_cache(graph, 1)}
    if POSITION_IDS in graph.inputs:
        feeds[POSITION_IDS] = np.arange(n, dtype=np.int64)[None]
    past = present_to_past({k: v for k, v in graph.run(feeds).items() if is_present(k)})
    step = {INPUT_IDS: np.asarray([[42]], dtype=np.int64), ATTENTION_MASK: np.ones((1, n + 1), dtype=np.int64)}
    if POSITION_IDS in graph.inputs:
        step[POSITION_IDS] = np.asarray([[n]], dtype=np.int64)
    feeds = {**ort_feeds(graph, step), **past}
    name = ort_label(o, "fp16", "cache on the device")
    return (name, lambda: graph.run(feeds),
            lambda: torch.from_numpy(graph.run(feeds)["logits"].numpy()))


# --- llama-style-1b -------------------------------------------------------------------------------


def llama(sizes: Sizes, runner: Runner, clock: Clock, gen_repeats: int, failures: list, o: Ort) -> dict:
    """fp16 greedy generation, batch 1, prompt sizes.prompt + sizes.new: HF LlamaForCausalLM.generate,
    specc's module in the cached greedy loop, specc's graph on onnxruntime (both loops)."""
    import transformers as T

    dev = runner.device
    log("llama: models")
    with torch.device(dev):
        hf = hf_model(T.LlamaForCausalLM, sizes.llama_config(), dev, torch.float16)
    sp = specc.to_torch(sizes.llama_spec, seed=0)
    sp32 = sp.to(dev).eval()
    rng = np.random.default_rng(2)
    prompt = torch.from_numpy(rng.integers(sizes.vocab_lo, sizes.vocab_hi, (1, sizes.prompt))).to(dev)
    kw = dict(do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
    # specc's fp32 loop first, for the ids the fp16 rows are compared with, then the module in fp16
    want32 = specc_greedy(sp32, prompt, sizes.new).cpu()
    sp16 = sp32.half()
    del sp32, sp

    def hf_gen(n):
        with torch.inference_mode():
            out = hf.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                              min_new_tokens=n, **kw)
        return out[:, prompt.shape[1]:]

    gens = {"HF generate fp16": hf_gen, "specc greedy loop fp16": lambda n: specc_greedy(sp16, prompt, n)}
    gens.update(ort_generation_variants(o, sizes.llama_spec, prompt[0].tolist()))
    log(f"llama: generation, {len(gens)} variants")
    table = generation_table(gens, sizes, runner, gen_repeats)
    # the fp16 rows against specc's fp32 loop (the same seeded weights; HF's are its own)
    table["same"] = {k: bool(torch.equal(torch.as_tensor(gens[k](sizes.new)).reshape(1, -1).cpu(), want32))
                     for k in gens if k.startswith("specc")}
    return table


# --- onnxruntime and TensorRT ---------------------------------------------------------------------


class Ort:
    """onnxruntime as this run has it: its facts, the provider specc verifies and runs on ("cuda";
    "cpu" in a debug run; None where it cannot run), and specc's builds verified there:
    (spec, precision) -> build directory, with a row of figures per build."""

    def __init__(self):
        self.facts: dict = {}
        self.provider: str | None = None
        self.dirs: dict[tuple[str, str], Path] = {}
        self.build_rows: list[dict] = []

    def session(self, spec: str, precision: str, **options):
        from specc.runtime import Session

        return Session(self.dirs[(spec, precision)], provider=self.provider, **options)


def onnxruntime_setup(sizes: Sizes, runner: Runner, clock: Clock, failures: list, debug_cpu: bool) -> Ort:
    """onnxruntime's facts, what it cannot run here (and why), and specc's builds of sizes.ort_builds,
    each verified on the GPU (`specc build --verify-provider cuda`); `debug_cpu`: a debug run's
    stand-in, verified and run on the CPU provider."""
    o = Ort()
    try:
        import onnxruntime as ort
    except ImportError as exc:
        for p in GPU_PROVIDERS:
            failures.append((f"onnxruntime {p}", f"onnxruntime is not installed ({first_line(exc)})"))
        return o
    available = ort.get_available_providers()
    dists = installed_runtimes()
    o.facts.update(version=ort.__version__, available=available, device=ort.get_device(), dists=dists)
    log(f"onnxruntime {ort.__version__} ({', '.join(dists) or 'no distribution metadata'}): providers {available}")
    for p in GPU_PROVIDERS:
        if p not in available:
            cpu_build = "onnxruntime-gpu" not in dists
            why = (f"{p} not available: this onnxruntime {ort.__version__} is the CPU build "
                   f"(the `onnxruntime` wheel, get_device() = {ort.get_device()}; providers: {', '.join(available)}); "
                   "it needs `onnxruntime-gpu`" if cpu_build else
                   f"{p} not available in onnxruntime-gpu {ort.__version__} here (providers: {', '.join(available)})")
            failures.append((f"onnxruntime {p}", why))
        elif p == "TensorrtExecutionProvider":
            why = unusable_provider(ort, p)
            if why:
                failures.append((f"onnxruntime {p}", why))
    if runner.cuda:
        why = unusable_provider(ort, "CUDAExecutionProvider") if "CUDAExecutionProvider" in available else "not available"
        o.provider = None if why else "cuda"
    elif debug_cpu:
        o.provider = "cpu"
    if o.provider is None:
        return o
    for spec, precision in sizes.ort_builds:
        label = f"specc build {spec} --precision {precision} --verify-provider {o.provider}"
        if clock.left() < 150:
            failures.append((label, "skipped: too little of the run's time budget left"))
            continue
        out_dir = WORK / f"{spec}-{precision}-{o.provider}"
        log(label)
        try:
            t0 = time.perf_counter()
            result = specc.build(spec, out_dir, precision=precision, verify_provider=o.provider, progress=None)
            seconds = time.perf_counter() - t0
        except Exception as exc:
            failures.append((label, first_line(exc)))
            log(f"{label}: {first_line(exc)}")
            continue
        v = result.manifest["verification"]
        o.dirs[(spec, precision)] = out_dir
        o.build_rows.append({"spec": spec, "precision": precision, "provider": v.get("provider", "cpu"),
                             "max_abs_diff": v["max_abs_diff"], "tolerance": v.get("tolerance"),
                             "cases": len(v.get("cases", [])), "seconds": seconds, "cached": result.cached,
                             "verify_s": result.manifest.get("timings", {}).get("verify")})
        log(f"{label}: verified, max abs diff {v['max_abs_diff']:.3g} ({seconds:.0f} s)")
    return o


def ort_label(o: Ort, precision: str, what: str = "") -> str:
    name = "CUDA" if o.provider == "cuda" else (o.provider or "?").upper()
    return f"specc ORT {name} {precision}" + (f", {what}" if what else "")


def ort_feeds(graph, arrays: dict) -> dict:
    """`arrays` (numpy, inputs of the graph) as OrtValues on the graph's device."""
    return {n: graph.value(n, a) for n, a in arrays.items()}


def ort_bert_variants(o: Ort, sizes: Sizes, batch: int, ids: np.ndarray) -> tuple[dict, dict]:
    """The bert table's onnxruntime variants for one batch: name -> call (inputs and outputs bound on
    the device), name -> the call's last_hidden_state as a torch tensor (for the diff)."""
    variants, outputs = {}, {}
    for precision in ("fp32", "fp16"):
        if (sizes.bert_spec, precision) not in o.dirs:
            continue
        graph = o.session(sizes.bert_spec, precision).graphs["model"]
        arrays = {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids), TOKEN_TYPE_IDS: np.zeros_like(ids)}
        feeds = ort_feeds(graph, arrays)
        name = ort_label(o, precision)
        variants[name] = lambda graph=graph, feeds=feeds: graph.run(feeds)
        outputs[name] = lambda graph=graph, feeds=feeds: torch.from_numpy(graph.run(feeds)["last_hidden_state"].numpy())
    return variants, outputs


def host_copy_greedy(graph, prompt: list[int], new: int) -> list[int]:
    """A greedy loop over a decoder graph that takes every output to the host and feeds the cache back
    from there each step (numpy in, numpy out: the round trip IO binding saves). Batch 1, no EOS."""
    ids = np.asarray([prompt], dtype=np.int64)
    feeds = {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids)}
    feeds.update(empty_cache(graph, 1))
    length, chosen = ids.shape[1], []
    for step in range(new):
        if POSITION_IDS in graph.inputs:
            t = feeds[INPUT_IDS].shape[1]
            feeds[POSITION_IDS] = np.arange(length - t, length, dtype=np.int64)[None]
        out = {k: v.numpy() for k, v in graph.run(feeds).items()}
        token = int(out["logits"][0, -1].argmax())
        chosen.append(token)
        length += 1
        feeds = {INPUT_IDS: np.asarray([[token]], dtype=np.int64), ATTENTION_MASK: np.ones((1, length), dtype=np.int64),
                 **present_to_past({k: v for k, v in out.items() if is_present(k)})}
    return chosen


def ort_generation_variants(o: Ort, spec: str, prompt: list[int]) -> dict:
    """Greedy generation with specc's fp16 graph of `spec` on onnxruntime: Session.generate (the
    cache kept on the device, IO binding) and the host-copy loop. name -> call(n) -> new ids."""
    if (spec, "fp16") not in o.dirs:
        return {}
    sess = o.session(spec, "fp16", inplace=False)  # model.onnx; the in-place graph's routes: gpu_decode.py
    graph = sess.graphs["model"]
    return {ort_label(o, "fp16", "generate, cache on the device (IO binding)"):
            lambda n: sess.generate(prompt, max_new_tokens=n, eos_id=-1, pad_id=0).new_ids[0],
            ort_label(o, "fp16", "host-copy loop (cache to the host and back each step)"):
            lambda n: host_copy_greedy(graph, prompt, n)}


def optimum(sizes: Sizes, clock: Clock, args, failures: list) -> dict | None:
    """benchmarks/gpu_optimum.py in a process of its own, with args.optimum_path first on its path
    (Optimum and the transformers it takes); its JSON, or None (the reason in failures)."""
    if not args.optimum_path:
        failures.append(("Optimum's export on onnxruntime", "not run: no --optimum-path (optimum-onnx pins transformers "
                         "below 4.58, so it runs from a folder of its own)"))
        return None
    limit = clock.left() - 20
    if limit < 60:
        failures.append(("Optimum's export on onnxruntime", "skipped: the run's time budget was spent"))
        return None
    out = WORK / "optimum.json"
    out.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).with_name("gpu_optimum.py")), "--out", str(out),
           "--repeats", str(args.repeats), "--gen-repeats", str(args.gen_repeats), "--device", args.device]
    if args.tiny:
        cmd.append("--tiny")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (args.optimum_path, str(ROOT), env.get("PYTHONPATH")) if p)
    log(f"optimum: {' '.join(cmd[1:])} (limit {limit:.0f} s)")
    try:
        done = subprocess.run(cmd, env=env, timeout=limit, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    except subprocess.TimeoutExpired:
        failures.append(("Optimum's export on onnxruntime", f"did not finish within the {limit:.0f} s left of the run"))
        return None
    if done.returncode or not out.is_file():
        tail = done.stdout.strip().splitlines()[-1:] or ["no output"]
        failures.append(("Optimum's export on onnxruntime", f"exit {done.returncode}: {tail[0]}"))
        return None
    result = json.loads(out.read_text())
    failures.extend(tuple(f) for f in result.get("failures", []))
    return result


def merge_optimum(opt: dict | None, bert_r: dict | None, gpt_r: dict | None) -> None:
    """Optimum's times as rows of the bert and gpt2 generation tables (marked as timed apart)."""
    if not opt:
        return
    name = opt["name"]
    for batch, ts in opt.get("bert", {}).items():
        if bert_r and int(batch) in bert_r["tables"]:
            bert_r["tables"][int(batch)]["times"][name] = ts
    if gpt_r and "full" in gpt_r and "gpt2" in opt:
        name = opt["gpt2"].get("name", name)
        gpt_r["full"][name], gpt_r["first"][name] = opt["gpt2"]["full"], opt["gpt2"]["first"]
        gpt_r["n_tokens"][name] = opt["gpt2"]["n_tokens"]


def tensorrt_engine(sizes: Sizes, runner: Runner, clock: Clock, repeats: int, failures: list) -> dict:
    """`specc build --target tensorrt` (fp16) and its engine timed with bound device buffers."""
    rows: dict = {}
    try:
        import tensorrt as trt
    except ImportError as exc:
        failures.append(("TensorRT engine (specc build --target tensorrt)",
                         f"TensorRT is not installed here ({first_line(exc)}); it comes from NVIDIA's package index "
                         "(`pip install 'specc[gpu,tensorrt]'` on a CUDA machine)"))
        return rows
    if runner.device != "cuda":
        return rows
    if clock.left() < 240:
        failures.append(("TensorRT engine", "skipped: too little of the run's time budget left for an engine build"))
        return rows
    rng = np.random.default_rng(0)
    for precision in ("fp16",):
        label = f"specc TensorRT engine {precision} (TensorRT {trt.__version__})"
        try:
            out_dir = WORK / f"{sizes.bert_spec}-tensorrt-{precision}"
            log(f"TensorRT: specc build {sizes.bert_spec} --target tensorrt --precision {precision}")
            specc.build(sizes.bert_spec, out_dir, target="tensorrt", precision=precision, progress=None)
            plan = next(out_dir.glob("*.plan"))
            engine = trt.Runtime(trt.Logger(trt.Logger.ERROR)).deserialize_cuda_engine(plan.read_bytes())
            context = engine.create_execution_context()
            names = [engine.get_tensor_name(i) for i in range(engine.num_io_tensors)]
            inputs = [n for n in names if engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
            for batch in sizes.batches:
                ids = rng.integers(sizes.vocab_lo, sizes.vocab_hi, (batch, sizes.seq)).astype(np.int64)
                arrays = {INPUT_IDS: ids, ATTENTION_MASK: np.ones_like(ids), TOKEN_TYPE_IDS: np.zeros_like(ids)}
                keep = {}
                for n in inputs:
                    dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(n)))).dtype
                    keep[n] = torch.from_numpy(arrays[n]).to(device="cuda", dtype=dtype)
                    context.set_input_shape(n, tuple(keep[n].shape))
                    context.set_tensor_address(n, keep[n].data_ptr())
                for n in names:
                    if n not in inputs:
                        dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(engine.get_tensor_dtype(n)))).dtype
                        keep[n] = torch.empty(tuple(context.get_tensor_shape(n)), dtype=dtype, device="cuda")
                        context.set_tensor_address(n, keep[n].data_ptr())
                stream = torch.cuda.current_stream()

                def run():
                    if not context.execute_async_v3(stream.cuda_stream):
                        raise RuntimeError("execute_async_v3 returned False")

                t = runner.interleaved({label: run}, repeats)
                rows.setdefault(batch, {})[label] = t[label]
        except Exception as exc:
            failures.append((label, first_line(exc)))
            log(f"{label}: {first_line(exc)}")
    return rows


# --- the report ---------------------------------------------------------------------------------------


def _ms(s: float) -> str:
    return f"{s * 1e3:.3f}" if s < 0.01 else f"{s * 1e3:.2f}" if s < 0.1 else f"{s * 1e3:.1f}"


def _row(name: str, ts: list[float], base: float | None, extra: list[str]) -> str:
    m = med(ts)
    cells = [name, f"{_ms(m)} ms", f"{_ms(min(ts))}-{_ms(max(ts))}", f"{m / base:.2f}x" if base else "-"] + extra
    return "| " + " | ".join(cells) + " |"


ORT_GENERATION = (
    "specc ORT: the fp16 build on onnxruntime's CUDA provider, `Session.generate` (its present.* stay "
    "onnxruntime's OrtValues on the device and are bound as the next step's inputs; the last position's "
    "logits come to the host for the choice), and the same graph in a loop that takes every output to the host "
    "as numpy and feeds the cache back from there each step (`host_copy_greedy`).")


def generation_lines(title: str, table: dict, sizes: Sizes, base_name: str, desc: str) -> list[str]:
    """A generation table: tokens/s, range, time to first token, speed against `base_name`, and
    whether the ids equal the row's reference (same_ids_as)."""
    full, first, new = table["full"], table["first"], sizes.new
    base = med(full[base_name])
    reps = len(full[base_name])
    lines = [title, "",
             f"Medians of {reps} after 1 warm-up; EOS off, so every variant makes {new} tokens "
             f"({', '.join(f'{k}: {n}' for k, n in table['n_tokens'].items() if n != new) or 'checked'}). "
             f"Time to first token = the call with 1 new token. {desc}", "",
             f"| variant | tokens/s | range | time to first token | vs {base_name} (speed) | same ids as specc fp32 |",
             "|---|---|---|---|---|---|"]
    for k, ts in full.items():
        tps = new / med(ts)
        same = "-" if k not in table["same"] else ("yes" if table["same"][k] else "no")
        ttft = f"{_ms(med(first[k]))} ms" if k in first else "-"
        lines.append(f"| {k} | {tps:.1f} | {new / max(ts):.1f}-{new / min(ts):.1f} | {ttft} | "
                     f"{base / med(ts):.2f}x | {same} |")
    lines += ["", "(\"same ids\": specc's rows against specc's fp32 loop on the same seeded weights, HF's fp16 "
              "against HF fp32; random weights give near-tied logits, so fp16 may pick other tokens than fp32 "
              "without being wrong.)", ""]
    return lines


def report(args, facts: dict, probe: dict, bw: float, flops: dict, bert_r: dict | None, gpt_r: dict | None,
           llama_r: dict | None, o: Ort, opt: dict | None, trt_rows: dict, failures: list, sizes: Sizes,
           notes: list[str]) -> str:
    v = facts["versions"]
    lines = [
        "# GPU benchmarks",
        "",
        "Written by `python benchmarks/gpu.py` on a CUDA machine; do not edit by hand. The CPU suite is "
        "[benchmarks.md](benchmarks.md) (`make bench`).",
        "",
        f"Command: `{args.command}`",
        "",
        f"Run: {facts['date']}. Machine: {facts['gpu']}"
        + (f", {facts['gpu_memory_gib']:.0f} GiB, {facts['sms']} SMs, compute capability {facts['capability']}, "
           f"driver {facts['driver']}" if "sms" in facts else "")
        + f"; {facts['cpu']}, {facts['cores']} cores. " + ", ".join(f"{k} {val}" for k, val in v.items()) + ".",
        "",
        "Method: every call is bracketed by `torch.cuda.synchronize()`; the variants of a table run "
        "interleaved in one process (one call of each per round) after warm-up rounds; medians and "
        "min-max ranges of the timed rounds. Ratios are median / median of PyTorch eager fp32 (the "
        "Hugging Face model) on the same workload: below 1.00x is faster. Random weights of the real "
        "shapes (seed 0), nothing downloaded; HF and specc models have different random weights, so "
        "their outputs are not compared; specc's lower-precision and compiled variants are compared "
        "with specc fp32 (max abs diff). torch.compile runs dynamic=False under a time guard, every "
        "compile before the first timed table; its first-call (compile) time is reported. Mode "
        "reduce-overhead replays the compiled kernels as CUDA graphs, so the host launches one graph "
        "instead of every kernel from Python: where eager fp16 is no faster than eager fp32, the "
        "time is the host's launching, not the GPU's arithmetic.",
        "",
        "## The machine's floors",
        "",
        f"Matrix product n x n x n (n = {args.matmul_n}, random data, mean of 10 after 3 warm-ups): "
        + ", ".join(f"{k} {val:.0f} TFLOP/s" if val >= 10 else f"{k} {val:.2f} TFLOP/s" for k, val in probe.items())
        + f". Device-to-device copy: {bw:.0f} GB/s (bytes read + written, best of 5 at 1 GiB).",
        "",
    ]
    if bert_r:
        lines += [f"## {sizes.bert_spec} (encoder), sequence {sizes.seq}", "",
                  f"Hugging Face BertModel attention: `{bert_r['attn']}`; specc's module computes attention "
                  "explicitly (scores, softmax in fp32, probs @ v) and its LayerNorms in fp32.", ""]
        for batch, tab in bert_r["tables"].items():
            times, diffs, comp = tab["times"], tab["diffs"], tab["compile_s"]
            base = med(times[HF_FP32])
            fl = flops.get("bert")
            reps = len(times[HF_FP32])
            head = (f"Batch {batch}: time per batch, medians of {reps}. Floor: "
                    + (f"{batch * sizes.seq * fl / 1e9:.1f} GFLOP per batch, {_ms(batch * sizes.seq * fl / (probe['fp16'] * 1e12))} ms "
                       f"at the fp16 probe, {_ms(batch * sizes.seq * fl / (probe['fp32'] * 1e12))} ms at the fp32 probe."
                       if fl and "fp16" in probe else "not probed."))
            lines += [head, "", "| variant | median | range | vs HF eager fp32 | share of the matmul floor | "
                      "max abs diff vs specc fp32 | first call (compile) |", "|---|---|---|---|---|---|---|"]
            for k, ts in times.items():
                share = "-"
                if fl and probe:
                    peak = probe.get("fp16" if "fp16" in k else "fp32")
                    if peak:
                        x = batch * sizes.seq * fl / (peak * 1e12) / med(ts)
                        share = f"{x:.0%}" if x >= 0.1 else f"{x:.1%}"
                diff = f"{diffs[k]:.2e}" if k in diffs else "-"
                c = f"{comp[k]:.1f} s" if comp.get(k) else "-"
                lines.append(_row(k, ts, base, [share, diff, c]))
            lines.append("")
    if gpt_r:
        lines += [f"## {sizes.gpt_spec} (decoder)", ""]
    if gpt_r and "full" in gpt_r:
        lines += generation_lines(
            f"### Greedy generation, batch 1, prompt {sizes.prompt} + {sizes.new} new tokens", gpt_r, sizes,
            "HF generate fp32", "HF: `GPT2LMHeadModel.generate` (do_sample False, its own cache). specc: `specc.to_torch` "
            "in the cached greedy loop of benchmarks/gpu.py (`specc_greedy`: present.* fed back as past_key_values.*, "
            "which the module concatenates; argmax on the device, no host sync per token). " + ORT_GENERATION)
    if gpt_r and "step" in gpt_r:
        step = gpt_r["step"]
        reps = len(step["HF eager fp32"])
        lines += [
                  f"### One decode step at {sizes.context} context ({sizes.context - 1} cached + 1 new), batch 1", "",
                  f"Medians of {reps}. HF: the model with its DynamicCache, cropped back after each step. specc: "
                  "the module with past_key_values.* given. Weight-read floor: "
                  + (f"{flops['gpt_params'] * 2 / (bw * 1e9) * 1e3:.3f} ms for fp16 weights at the copy bandwidth"
                     if flops.get("gpt_params") else "-") + ".", "",
                  "| variant | median | range | vs HF eager fp32 | max abs logit diff vs specc fp32 | first call (compile) |",
                  "|---|---|---|---|---|---|"]
        base = med(step["HF eager fp32"])
        for k, ts in step.items():
            diff = f"{gpt_r['step_diffs'][k]:.2e}" if k in gpt_r["step_diffs"] else "-"
            c = f"{gpt_r['compile_s'][k]:.1f} s" if gpt_r["compile_s"].get(k) else "-"
            lines.append(_row(k, ts, base, [diff, c]))
        lines.append("")
    if llama_r:
        lines += [f"## {sizes.llama_spec} (decoder, fp16)", ""]
        lines += generation_lines(
            f"### Greedy generation, batch 1, prompt {sizes.prompt} + {sizes.new} new tokens", llama_r, sizes,
            "HF generate fp16", "HF: `LlamaForCausalLM.generate` in fp16 (the spec's shapes as a LlamaConfig, sdpa "
            "attention, its own cache). specc greedy loop fp16: `specc.to_torch` in `specc_greedy`. " + ORT_GENERATION)
    lines += ["## onnxruntime on CUDA: specc's builds, verified there", ""]
    if o.facts.get("version"):
        lines += [f"onnxruntime {o.facts['version']} ({', '.join(o.facts['dists']) or '?'}; get_device() = "
                  f"{o.facts['device']}); available providers: {', '.join(o.facts['available'])}.", ""]
    if o.build_rows:
        lines += ["Each build verified by onnxruntime on the provider named (`specc.build(..., verify_provider=...)`, "
                  "`specc build --verify-provider cuda`): every verification case against the fp32 torch module, "
                  "within the tolerance shown (docs/build.md); these graphs are the `specc ORT` rows of the tables above.",
                  "", "| build | precision | verified on | cases | max abs diff | tolerance (atol, rtol) | build time |",
                  "|---|---|---|---|---|---|---|"]
        for row in o.build_rows:
            tol = row["tolerance"] or {}
            lines.append(f"| {row['spec']} | {row['precision']} | {row['provider']} | {row['cases']} | "
                         f"{row['max_abs_diff']:.3g} | {tol.get('atol', '-')}, {tol.get('rtol', '-')} | "
                         f"{row['seconds']:.0f} s{' (cache hit)' if row['cached'] else ''} |")
        lines.append("")
    else:
        lines += ["No build ran on a GPU provider here: see below.", ""]
    if opt:
        lines += [f"{opt['name']}: Optimum's exporter (" + ", ".join(f"{k} {v}" for k, v in opt["versions"].items())
                  + ") from the HF models of the tables (random weights, seed 0), its ORTModel classes with "
                  "use_io_binding=True; timed in a process of its own after the tables' other rows, with the same "
                  "repeats (benchmarks/gpu_optimum.py). Export: "
                  + ", ".join(f"{k} {v:.0f} s" for k, v in opt["export_s"].items()) + ".", ""]
    if trt_rows:
        base_times = {b: med(t["times"][HF_FP32]) for b, t in bert_r["tables"].items()} if bert_r else {}
        lines += ["## TensorRT", "", f"`specc build {sizes.bert_spec} --target tensorrt`, sequence {sizes.seq}, "
                  "ratios against HF eager fp32 of the bert table above.", "",
                  "| batch | variant | median | range | vs HF eager fp32 |", "|---|---|---|---|---|"]
        for batch, r in trt_rows.items():
            for k, ts in r.items():
                lines.append(f"| {batch} " + _row(k, ts, base_times.get(batch), []))
        lines.append("")
    lines += ["## Could not run, and why", ""]
    if not failures and not notes:
        lines.append("Everything ran.")
    for what, why in failures:
        lines.append(f"- {what}: {why}")
    for note in notes:
        lines.append(f"- {note}")
    return "\n".join(lines) + "\n"


# --- main -----------------------------------------------------------------------------------------------


def _shown_args(argv: list[str]) -> list[str]:
    """The command line as the report shows it: without --out and --note (a path of the machine
    it ran on, and the notes the report prints anyway)."""
    shown, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--note"):
            skip = True
        elif not a.startswith(("--out=", "--note=")):
            shown.append(a)
    return shown


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="the report to write (default docs/benchmarks_gpu.md)")
    ap.add_argument("--repeats", type=int, default=20, help="timed rounds for bert and the decode step")
    ap.add_argument("--gen-repeats", type=int, default=5, help="timed rounds for generation")
    ap.add_argument("--quick", action="store_true", help="few repeats, a smaller matmul probe (a smoke run)")
    ap.add_argument("--compile-limit", type=float, default=180, help="seconds each torch.compile may take (0: none)")
    ap.add_argument("--budget", type=float, default=480, help="seconds for the whole run; compiles and engine builds "
                    "that would not fit are skipped and reported")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's 'Could not run' section "
                    "(facts of the machine the script cannot see)")
    # debug: run the logic on the CPU with the tiny specs; never writes docs/benchmarks_gpu.md by default
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--optimum-path", default=None, help="a folder holding optimum, optimum-onnx and the transformers "
                    "they take (below 4.58), for Optimum's rows (benchmarks/gpu_optimum.py runs with it on its path)")
    ap.add_argument("--only", default="ort,bert,gpt2,llama,optimum,tensorrt",
                    help="parts to run, comma-separated (default: all): ort (specc's builds verified on the GPU), "
                    "bert, gpt2, llama, optimum, tensorrt")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"benchmarks/gpu.py: no CUDA GPU here (torch {torch.__version__}, built with CUDA "
              f"{torch.version.cuda or 'none'}; torch.cuda.is_available() is False). Nothing measured; "
              f"{args.out} is left as it is.", file=sys.stderr)
        return 0
    if args.device != "cuda" and Path(args.out).resolve() == DEFAULT_OUT.resolve():
        raise SystemExit("benchmarks/gpu.py: a --device cpu debug run needs --out elsewhere than docs/benchmarks_gpu.md")
    if args.quick:
        args.repeats, args.gen_repeats = min(args.repeats, 5), min(args.gen_repeats, 2)
    args.matmul_n = 4096 if (args.quick or args.device != "cuda") else 8192
    args.command = " ".join(["python benchmarks/gpu.py"] + _shown_args(sys.argv[1:] if argv is None else argv))
    only = set(args.only.split(","))
    clock = Clock(args.budget)
    runner = Runner(args.device)
    sizes = Sizes(args.tiny)
    WORK.mkdir(parents=True, exist_ok=True)
    failures: list[tuple[str, str]] = []

    facts = machine_facts(args.device)
    log(f"{facts['gpu']}; " + ", ".join(f"{k} {v}" for k, v in facts["versions"].items()))
    log("probes")
    probe = matmul_probe(runner, args.matmul_n if args.device == "cuda" else 512)
    bw = copy_bandwidth(runner, 1024 if args.device == "cuda" else 64)
    log("probe: " + ", ".join(f"{k} {v:.1f} TFLOP/s" for k, v in probe.items()) + f"; copy {bw:.0f} GB/s")

    flops = {}
    with contextlib.suppress(Exception):
        flops["bert"] = inspect_spec(specc.resolve(specc.load_spec(sizes.bert_spec)), length=sizes.seq)["flops_per_token"]
    with contextlib.suppress(Exception):
        flops["gpt_params"] = inspect_spec(specc.resolve(specc.load_spec(sizes.gpt_spec)))["parameters"]

    compile_limit = args.compile_limit
    bert_r = gpt_r = llama_r = opt = None
    trt_rows: dict = {}

    def attempt(what: str, fn, default):
        try:
            return fn()
        except Exception as exc:
            failures.append((what, first_line(exc)))
            log(f"{what} failed: {first_line(exc)}")
            traceback.print_exc()
            _free(args.device)
            return default

    # specc's builds first: each is verified on the GPU, and the tables below run its graphs
    o = (attempt("onnxruntime", lambda: onnxruntime_setup(sizes, runner, clock, failures, args.device != "cuda"), Ort())
         if "ort" in only else Ort())
    if "bert" in only:
        bert_r = attempt(sizes.bert_spec, lambda: bert(sizes, runner, clock, args.repeats, compile_limit, failures, o),
                         None)
        _free(args.device)
    if "gpt2" in only:
        gpt_r = attempt(sizes.gpt_spec, lambda: gpt2(sizes, runner, clock, args.repeats, args.gen_repeats,
                                                      compile_limit, failures, o), None)
    if "llama" in only:
        llama_r = attempt(sizes.llama_spec, lambda: llama(sizes, runner, clock, args.gen_repeats, failures, o), None)
        _free(args.device)
    if "optimum" in only:
        opt = attempt("Optimum", lambda: optimum(sizes, clock, args, failures), None)
        merge_optimum(opt, bert_r, gpt_r)
    if "tensorrt" in only:
        trt_rows = attempt("TensorRT", lambda: tensorrt_engine(sizes, runner, clock, args.repeats, failures), {})
    text = report(args, facts, probe, bw, flops, bert_r, gpt_r, llama_r, o, opt, trt_rows, failures, sizes, args.note)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, out)
    print(text, flush=True)
    log(f"wrote {out} in {clock.elapsed():.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
