"""What `specc build` can make, as one table: the targets, and the precisions they build in.

For each target: the precisions it builds, the tolerances its verification passes within, whether
specc's onnxruntime graph passes (specc/export/passes/) run on its graphs, whether it makes
TensorRT engines, its layout (where its graphs go) and its extras (what it writes besides them).
For each precision: the dtype the module is exported in, the bytes a weight takes, and whether
the exported graph is quantized afterwards.

Pure data (no torch, no onnx), so that the spec schema's `serving.precision` reads it. The CLI's
choices, the verification tolerances (specc/export/verify.py), the weight bytes of
`specc inspect` (specc/spec/costs.py) and the build's write stage (specc/builder/write.py, which
maps each layout and extra to its code), read it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# the ONNX opset graphs are exported at unless `--opset` says otherwise (why 18: specc/export/onnx.py)
DEFAULT_OPSET = 18
SUPPORTED_OPSETS = range(18, 24)  # what `--opset` accepts

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class Precision:
    name: str
    dtype: str  # the dtype the module is exported in (an integer precision quantizes an fp32 graph)
    # bytes one weight takes at this precision, what `specc inspect` and the build's memory and
    # disk estimates count: an integer precision's packed layout (a code and, per block, a float
    # scale and a code of zero point where it has them; specc/export/quantize.py's Scheme packs
    # exactly this, tests/export/test_quantize.py holds it to it)
    weight_bytes: float
    quantized: bool  # the saved fp32 graph's weights are quantized afterwards (specc/export/quantize.py)
    # an integer precision's serving.activations where the spec gives none: what its weight-only
    # kernels compute in when a graph decodes a token at a time (ACTIVATION_LEVELS); None: a float one
    activations: str | None = None

    @property
    def dtype_bytes(self) -> int:
        """Bytes of one element of the exported graph's floats (weights, KV cache)."""
        return DTYPE_BYTES[self.dtype]

    @property
    def half(self) -> bool:
        """A 16-bit float precision (norms and softmax still accumulate in fp32)."""
        return self.dtype_bytes == 2


PRECISIONS: dict[str, Precision] = {p.name: p for p in (
    Precision("fp32", "float32", 4, quantized=False),
    Precision("fp16", "float16", 2, quantized=False),
    Precision("bf16", "bfloat16", 2, quantized=False),
    # weight-only 8-bit blocks of 16 with zero points (MatMulNBits): 1 + (4 + 1) / 16
    Precision("int8", "float32", 1.3125, quantized=True, activations="int8"),
    # weight-only 4-bit blocks of 32, no zero points: 0.5 + 4 / 32
    Precision("int4", "float32", 0.625, quantized=True, activations="fp32"),
    # weights imported from a GGUF file, kept in the file's own blocks (specc/export/ggufgraph.py);
    # the bytes counted are those of Q4_1, the commonest such file, as the graph holds it: a 4-bit
    # code and, per block of 32, a float scale and a float offset, 0.5 + 8 / 32
    Precision("gguf", "float32", 0.75, quantized=True, activations="fp32"),
)}

PrecisionName = Literal[tuple(PRECISIONS)]  # serving.precision's accepted values
# serving.activations -> onnxruntime's accuracy level for MatMulNBits and QMoE in a graph that
# decodes a token at a time: fp32 compute, or the input rounded to int8 per block (the kernel then
# computes a call of one position and one of several by different paths, which differ by more than
# float rounding: docs/runtime.md's speculative decoding)
ACTIVATION_LEVELS = {"fp32": 1, "int8": 4}


def decode_activations(precision: str, activations: str | None) -> str | None:
    """What a build of `precision` decodes in, given serving.activations: ACTIVATION_LEVELS' key,
    or None for a float build."""
    return activations or PRECISIONS[precision].activations if PRECISIONS[precision].quantized else None


@dataclass(frozen=True)
class Target:
    name: str
    precisions: tuple[str, ...]  # the precisions it builds
    # precision -> (atol, rtol) of what this target adds to the build and verifies: the onnx
    # target's graphs (run by onnxruntime; every target's graphs are verified as these), the
    # tensorrt target's engines. A difference passes when max|out - torch| <= atol + rtol * max|torch|.
    tolerances: dict[str, tuple[float, float]]
    # the same on onnxruntime's CUDA execution provider (`specc build --verify-provider cuda`), where
    # the target's graphs can be verified there; TF32 is off, so fp32 is computed in fp32
    cuda_tolerances: dict[str, tuple[float, float]]
    ort_passes: bool  # specc's onnxruntime graph passes run on its graphs (never on graphs made into engines)
    engines: Literal["never", "always", "where possible"]  # TensorRT engines; possible: tensorrt and a CUDA GPU
    write: Literal["files", "triton"]  # files: the graphs (and engines) in DIR; triton: a Triton model repository
    # what it writes besides its graphs (and engines) and the tokenizer's files, in this order:
    # clients: config.json, generation_config.json, genai_config.json where their clients run the
    # graphs (specc/builder/clients.py), and Optimum's decoder of an encoder-decoder
    # (specc/export/optimum_seq2seq.py); inplace: a decoder's in-place cache graph (specc/export/inplace.py)
    extras: tuple[Literal["clients", "inplace"], ...] = ()


# bf16 has tolerances but no target builds it yet: onnxruntime (CPU) cannot verify the graph first
_ONNX_PRECISIONS = ("fp32", "fp16", "int8", "int4", "gguf")

TARGETS: dict[str, Target] = {t.name: t for t in (
    Target("onnx", _ONNX_PRECISIONS,
           # the integer precisions are judged by QUALITY_BARS instead
           tolerances={"fp32": (1e-4, 1e-4), "fp16": (2e-2, 2e-2), "bf16": (1e-1, 5e-2)},
           cuda_tolerances={"fp32": (1e-4, 1e-4), "fp16": (2e-2, 2e-2)},
           ort_passes=True, engines="never", write="files", extras=("clients", "inplace")),
    Target("tensorrt", ("fp32", "fp16"),
           tolerances={"fp32": (5e-4, 5e-4), "fp16": (2e-2, 2e-2), "bf16": (1e-1, 5e-2)}, cuda_tolerances={},
           ort_passes=False, engines="always", write="files", extras=("clients",)),
    # a repository of the onnx target's graphs (verified as those), with engines where possible
    Target("triton", _ONNX_PRECISIONS, tolerances={}, cuda_tolerances={}, ort_passes=True, engines="where possible", write="triton"),
)}



@dataclass(frozen=True)
class QualityBar:
    """What an integer build's graph must keep of torch's outputs, case by case (specc/export/verify.py).
    Rows are the vectors along an output's last axis: a token's hidden state, its logits, a
    cache entry. Scores (the logits of lm, mlm and classifier outputs) are compared centered,
    since softmax ignores a shift."""

    cosine_mean: float  # mean cosine similarity of onnxruntime's rows with torch's, at least
    cosine_min: float  # the worst row's cosine, at least
    kl_mean: float  # scores: mean KL(softmax(torch) || softmax(onnxruntime)) per row, in nats, at most


# An integer build with trained weights (a weights file) is compared with its fp32 model: set by
# measurement on the verification cases (random token ids; docs/build.md, "Verifying integer
# builds"), the ordinary noise of each precision on two trained checkpoints passes with a margin
# (measured worst, int8: mean cosine 0.9986, worst row 0.9963, KL 0.0038 on SmolLM2-135M; int4:
# mean 0.956, worst row 0.894 on all-MiniLM-L6-v2's hidden states, KL 0.0003).
QUALITY_BARS: dict[str, QualityBar] = {
    "int8": QualityBar(cosine_mean=0.995, cosine_min=0.98, kl_mean=0.02),
    "int4": QualityBar(cosine_mean=0.94, cosine_min=0.85, kl_mean=0.1),
    # the graph's weights are the model's own (the file's values): what is left is the kernel's
    # arithmetic, held to int8's bar (at int8 activations: GGUF_INT8_BAR, below)
    "gguf": QualityBar(cosine_mean=0.995, cosine_min=0.98, kl_mean=0.02),
}
# With seeded weights, whose quantization noise a deep random model amplifies (a correct
# llama-2-7b int4 graph: 0.71 logits cosine from fp32), it is compared with torch computing with
# the graph's own dequantized weights (specc/builder/pipeline.py, _reference_weights): what is left is
# the kernel's arithmetic. Measured worst: 1.0000 to five places (tiny-llama, tiny-gpt2,
# tiny-bert, tiny-transformer, 32-layer seeded decoders of d_model 256 and 512, int8 and int4).
DEQUANTIZED_BAR = QualityBar(cosine_mean=0.999, cosine_min=0.99, kl_mean=0.005)
# A gguf build at int8 activations (serving.activations int8) computes as llama.cpp computes the
# same file, each product's input rounded to 8 bits per block. On text it is as far from the
# file's values in fp32 as llama.cpp's own run of the file (benchmarks/gguf_activations.py,
# docs/benchmarks_quality.md); on the verification's seeded tokens that rounding moves single
# rows and sharp distributions further than QUALITY_BARS["gguf"] allows (SmolLM2's Q4_1: a cache
# row's cosine 0.969; Gemma 3's Q4_K_M: a one-token case's KL 0.52 at cosine 0.984). Judged by
# int4's cosines, and a KL that a wrong graph exceeds and this noise does not.
GGUF_INT8_BAR = QualityBar(cosine_mean=QUALITY_BARS["int4"].cosine_mean, cosine_min=QUALITY_BARS["int4"].cosine_min,
                           kl_mean=1.0)


def quality_bar(precision: str, activations: str | None) -> QualityBar | None:
    """The bar an integer build of `precision` decoding in `activations` (decode_activations) is
    judged by against its fp32 model: QUALITY_BARS', GGUF_INT8_BAR for gguf at int8."""
    return GGUF_INT8_BAR if (precision, activations) == ("gguf", "int8") else QUALITY_BARS.get(precision)

# views of the table
BUILT_PRECISIONS: dict[str, tuple[str, ...]] = {name: t.precisions for name, t in TARGETS.items()}
TOLERANCES: dict[tuple[str, str], tuple[float, float]] = {
    (name, precision): tol for name, t in TARGETS.items() for precision, tol in t.tolerances.items()}
# (target, precision) -> (atol, rtol) on onnxruntime's CUDA execution provider
CUDA_TOLERANCES: dict[tuple[str, str], tuple[float, float]] = {
    (name, precision): tol for name, t in TARGETS.items() for precision, tol in t.cuda_tolerances.items()}
# where a build's graphs are verified: onnxruntime's execution provider, by its short name
VERIFY_PROVIDERS = {"cpu": "CPUExecutionProvider", "cuda": "CUDAExecutionProvider"}

__all__ = ["BUILT_PRECISIONS", "CUDA_TOLERANCES", "DEFAULT_OPSET", "DEQUANTIZED_BAR", "GGUF_INT8_BAR", "PRECISIONS", "QUALITY_BARS", "SUPPORTED_OPSETS", "TARGETS",
           "TOLERANCES", "VERIFY_PROVIDERS", "Precision", "PrecisionName", "QualityBar", "Target", "quality_bar"]
