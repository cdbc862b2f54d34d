"""Optimum's rows of the GPU suite (benchmarks/gpu.py runs this in a process of its own): the suite's
Hugging Face models (BertConfig() and GPT2Config(), random weights, seed 0) exported by Optimum's
own exporter, in fp16 on the GPU, and run by its ORTModel classes on onnxruntime's CUDA provider
with IO binding. Their times go to a JSON file for gpu.py's tables.

    PYTHONPATH=OPTIMUM_SITE:. python benchmarks/gpu_optimum.py --out FILE.json [--repeats 20] [--gen-repeats 5]

A process of its own because optimum-onnx pins transformers below 4.58 (OPTIMUM_SITE holds
optimum, optimum-onnx and the transformers they take). Debug: --device cpu --tiny exports fp32 and
runs on the CPU provider.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu import Runner, Sizes, first_line, log  # noqa: E402  (this suite's sizes and timing)


def export(model, task: str, out: Path, device: str, dtype: str) -> float:
    """model saved, then exported by Optimum in `dtype` (fp16 needs a GPU); the export's seconds."""
    from optimum.exporters.onnx import main_export

    src = out.with_name(out.name + "-hf")
    model.save_pretrained(src)
    t0 = time.perf_counter()
    main_export(str(src), output=str(out), task=task, device=device, dtype=dtype, do_validation=False)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--gen-repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    args = ap.parse_args(argv)
    import optimum.onnxruntime as ortm
    import transformers as T

    provider = "CUDAExecutionProvider" if args.device == "cuda" else "CPUExecutionProvider"
    precision = "fp16" if args.device == "cuda" else "fp32"
    name = f"Optimum ORT {'CUDA' if args.device == 'cuda' else 'CPU'} {precision} (own process)"
    sizes, runner = Sizes(args.tiny), Runner(args.device)
    result: dict = {"name": name, "versions": {"transformers": T.__version__}, "export_s": {}, "failures": []}
    try:
        from importlib.metadata import version

        result["versions"].update({d: version(d) for d in ("optimum", "optimum-onnx")})
    except Exception:
        pass
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp:
        try:
            torch.manual_seed(0)
            out = Path(tmp) / "bert"
            result["export_s"]["bert"] = export(T.BertModel(sizes.bert_config()).eval(), "feature-extraction", out,
                                                args.device, precision)
            model = ortm.ORTModelForFeatureExtraction.from_pretrained(out, provider=provider, use_io_binding=True)
            result["bert"] = {}
            for batch in sizes.batches:
                ids = torch.from_numpy(rng.integers(sizes.vocab_lo, sizes.vocab_hi, (batch, sizes.seq))).to(args.device)
                feeds = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}
                times = runner.interleaved({name: lambda feeds=feeds: model(**feeds)}, args.repeats)
                result["bert"][str(batch)] = times[name]
            del model
        except Exception as exc:
            result["failures"].append(["Optimum bert", first_line(exc)])
            log(f"optimum bert: {first_line(exc)}")
        # GPT-2: fp16 where Optimum's fp16 export loads, else its fp32 export (named so in the row)
        for gpt_precision in dict.fromkeys((precision, "fp32")):
            try:
                torch.manual_seed(0)
                out = Path(tmp) / f"gpt2-{gpt_precision}"
                result["export_s"][f"gpt2 {gpt_precision}"] = export(T.GPT2LMHeadModel(sizes.gpt2_config()).eval(),
                                                                     "text-generation-with-past", out, args.device,
                                                                     gpt_precision)
                model = ortm.ORTModelForCausalLM.from_pretrained(out, provider=provider, use_io_binding=True,
                                                                 use_cache=True)
                break
            except Exception as exc:
                result["failures"].append([f"Optimum's {gpt_precision} export of gpt2", first_line(exc)])
                log(f"optimum gpt2 {gpt_precision}: {first_line(exc)}")
                model = None
        try:
            if model is None:
                raise RuntimeError("no export of gpt2 loaded")
            gpt_name = name.replace(precision, gpt_precision)
            prompt = torch.from_numpy(np.random.default_rng(0).integers(sizes.vocab_lo, sizes.vocab_hi,
                                                                        (1, sizes.prompt))).to(args.device)

            def gen(n):
                out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n,
                                     min_new_tokens=n, do_sample=False, num_beams=1, pad_token_id=0, eos_token_id=None)
                return out[:, prompt.shape[1]:]

            full = runner.interleaved({gpt_name: lambda: gen(sizes.new)}, args.gen_repeats, warmup=1)
            first = runner.interleaved({gpt_name: lambda: gen(1)}, args.gen_repeats, warmup=1)
            result["gpt2"] = {"name": gpt_name, "full": full[gpt_name], "first": first[gpt_name],
                              "n_tokens": int(gen(sizes.new).shape[1])}
        except Exception as exc:
            result["failures"].append(["Optimum gpt2", first_line(exc)])
            log(f"optimum gpt2: {first_line(exc)}")
    Path(args.out).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
