"""A Triton Inference Server model repository from a verified build (see docs/serving.md).

Layout, written inside the build's staging directory (so a failed build leaves nothing):

    REPO/manifest.json, REPO/model.safetensors      the build's own files (Triton loads only folders)
    REPO/NAME/config.pbtxt                          one model per graph
    REPO/NAME/1/model.onnx (+ model.onnx's external data, under its original file name)
    REPO/NAME/1/model.plan                          when a TensorRT engine was built

A single-graph spec (encoder, decoder) gives one model named after the spec; an
encoder-decoder gives two, `NAME_encoder` and `NAME_decoder`. Names, dims and dynamic batching
follow specc/spec/triton.py, the rule `specc serve` follows too. Decoders are served stateless:
the KV cache is an explicit input (`past_key_values.*`) and output (`present.*`) that the
client passes back each step, which works with the ONNX Runtime backend as it is.

config.pbtxt is written as text here; specc does not need tritonclient at run time (the tests
parse it with Triton's own protobuf definitions).
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from specc.errors import BuildError
from specc.spec import triton as rule
from specc.spec.resolve import GraphSig, ResolvedSpec, TensorSig

# IO signature dtype -> Triton's DataType enum name
TRITON_DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32",
                 "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}


def model_names(r: ResolvedSpec) -> dict[str, str]:
    """graph name -> Triton model name (specc/spec/triton.py's rule, which `specc serve` follows)."""
    return rule.model_names(r.name, [sig.name for sig in r.graphs])


def _tensor(sig: TensorSig) -> list[str]:
    model_dims = rule.model_dims(sig.dims)
    if model_dims is None:
        raise BuildError(f"tensor {sig.name} has no leading batch dimension; Triton's batching needs one")
    try:
        dtype = TRITON_DTYPES[sig.dtype]
    except KeyError:
        raise BuildError(f"tensor {sig.name}: dtype {sig.dtype} has no Triton data type") from None
    dims = ", ".join(map(str, model_dims))
    return ["  {", f"    name: {json.dumps(sig.name)}", f"    data_type: {dtype}", f"    dims: [ {dims} ]", "  }"]


def config_text(r: ResolvedSpec, sig: GraphSig, name: str, *, plan: bool = False) -> str:
    """config.pbtxt (protobuf text format of inference.ModelConfig) for one graph."""
    batching = rule.dynamic_batching(r.serving.batch.opt, r.serving.batch.max)
    lines = [f"name: {json.dumps(name)}",
             f"platform: {json.dumps('tensorrt_plan' if plan else 'onnxruntime_onnx')}",
             f"max_batch_size: {batching.max_batch_size}"]
    for field, tensors in (("input", sig.inputs), ("output", sig.outputs)):
        blocks = [_tensor(t) for t in tensors]
        lines.append(f"{field} [")
        for i, block in enumerate(blocks):
            if i < len(blocks) - 1:
                block = block[:-1] + ["  },"]
            lines += block
        lines.append("]")
    lines += ["dynamic_batching {",
              f"  preferred_batch_size: [ {', '.join(map(str, batching.preferred_batch_sizes))} ]",
              f"  max_queue_delay_microseconds: {batching.max_queue_delay_us}",
              "}",
              "instance_group [",
              "  {",
              "    count: 1",
              f"    kind: {'KIND_GPU' if plan else 'KIND_CPU'}",
              "  }",
              "]"]
    return "\n".join(lines) + "\n"


def write_repository(root: Path, r: ResolvedSpec, files: dict[str, list[Path]],
                     plans: dict[str, Path] | None = None) -> list[Path]:
    """Move each graph's ONNX files (and engine, if any) from `root` into `root/NAME/1/` and write
    `root/NAME/config.pbtxt`. root is the build's staging directory. Returns the files written."""
    plans = plans or {}
    written: list[Path] = []
    names = model_names(r)
    for sig in r.graphs:
        model_dir = root / names[sig.name]
        version = model_dir / "1"
        version.mkdir(parents=True)
        paths = files[sig.name]
        onnx_path = version / "model.onnx"
        os.replace(paths[0], onnx_path)
        written.append(onnx_path)
        for extra in paths[1:]:  # external data keeps the file name the graph refers to
            os.replace(extra, version / extra.name)
            written.append(version / extra.name)
        plan = plans.get(sig.name)
        if plan is not None:
            os.replace(plan, version / "model.plan")
            written.append(version / "model.plan")
        config = model_dir / "config.pbtxt"
        config.write_text(config_text(r, sig, names[sig.name], plan=plan is not None))
        written.append(config)
    return written
