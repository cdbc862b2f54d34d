"""A Triton Inference Server model repository from a verified build (see docs/serving.md).

Layout, written inside the build's staging directory (so a failed build leaves nothing):

    REPO/manifest.json, REPO/model.safetensors      the build's own files (Triton loads only folders)
    REPO/MODEL/config.pbtxt                         one model per graph
    REPO/MODEL/1/model.onnx (+ model.onnx's external data, under its original file name)
    REPO/MODEL/1/model.plan                         when a TensorRT engine was built
    REPO/NAME/config.pbtxt, REPO/NAME/1/model.py,   a decoder's generation model (Python backend)
    REPO/NAME/1/generation.json

An encoder gives one model named after the spec; an encoder-decoder gives two, `NAME_encoder`
and `NAME_decoder`. A decoder with an lm output gives its graph as `NAME_model` and, under the
spec's name, the generation model: Triton's generate endpoint, its loop run in Triton's Python
backend (specc/export/triton_generate.py, copied as model.py; it imports nothing of specc) over
the graph model by BLS, the KV cache kept inside the server. Names, dims and dynamic batching
follow specc/spec/triton.py, the rule `specc serve` follows too. The graph models are
stateless: the KV cache is an explicit input (`past_key_values.*`) and output (`present.*`)
that the caller passes back each step, which works with the ONNX Runtime backend as it is.

config.pbtxt is written as text here; specc does not need tritonclient at run time (the tests
parse it with Triton's own protobuf definitions).
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from specc.errors import BuildError
from specc.export import triton_generate
from specc.spec import triton as rule
from specc.spec.io import (
    ATTENTION_MASK,
    INPUT_IDS,
    POSITION_IDS,
    TOKEN_TYPE_IDS,
    is_growing,
    is_past,
    parse_cache,
)
from specc.spec.resolve import GraphSig, ResolvedSpec, TensorSig

# IO signature dtype -> Triton's DataType enum name
TRITON_DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32",
                 "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16"}
# the generate endpoint's field dtypes (specc/spec/triton.py) -> Triton's
FIELD_DTYPES = {"bytes": "TYPE_STRING", "bool": "TYPE_BOOL", **TRITON_DTYPES}
GENERATE_MODEL_FILE = "model.py"  # the Python backend's file name


def lm_output(r: ResolvedSpec) -> str | None:
    """The main graph's output of kind lm (what generation reads), as the manifest records it."""
    main = r.graph("decoder" if r.architecture == "encoder-decoder" else "model")
    names = {t.name for t in main.outputs}
    return next((o.name for o in r.outputs if o.kind == "lm" and o.name in names), None)


def generates(r: ResolvedSpec) -> bool:
    """Whether the repository gets a generation model (specc/spec/triton.py's rule). Its model.py
    holds the cache as numpy arrays, which have no bfloat16; the triton target builds no bf16."""
    return rule.generates(r.architecture, lm_output(r))


def model_names(r: ResolvedSpec) -> dict[str, str]:
    """graph name -> Triton model name (specc/spec/triton.py's rule, which `specc serve` follows)."""
    return rule.model_names(r.name, [sig.name for sig in r.graphs], generation=generates(r))


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


def _field(f: rule.Field, optional: bool) -> list[str]:
    return ["  {", f"    name: {json.dumps(f.name)}", f"    data_type: {FIELD_DTYPES[f.dtype]}",
            f"    dims: [ {', '.join(map(str, f.shape))} ]"] + (["    optional: true"] if optional else []) + ["  }"]


def generate_config_text(name: str) -> str:
    """config.pbtxt of the generation model: the Python backend, decoupled (a response per token
    when a request streams), no batching of its own (it batches the decode steps itself), the
    generate endpoint's fields, every input optional (a request gives the ones it needs)."""
    lines = [f"name: {json.dumps(name)}", 'backend: "python"', "max_batch_size: 0",
             "model_transaction_policy {", "  decoupled: true", "}"]
    for key, fields, optional in (("input", rule.GENERATE_INPUTS, True), ("output", rule.GENERATE_OUTPUTS, False)):
        blocks = [_field(f, optional) for f in fields]
        lines.append(f"{key} [")
        for i, block in enumerate(blocks):
            lines += block[:-1] + (["  },"] if i < len(blocks) - 1 else ["  }"])
        lines.append("]")
    lines += ["instance_group [", "  {", "    count: 1", "    kind: KIND_CPU", "  }", "]"]
    return "\n".join(lines) + "\n"


def generation_facts(r: ResolvedSpec, graph_model: str) -> dict:
    """generation.json: what the generation model's model.py knows of the build (it reads nothing
    else of specc): the graph model and its tensors, the vocabulary, the context, eos, the
    limits of serving.generation, and the endpoint's fields."""
    graph = r.graph("model")
    inputs = {t.name: t for t in graph.inputs}
    outputs = {t.name for t in graph.outputs}
    cache = []
    for t in graph.inputs:
        if is_past(t.name) and is_growing(t.name):
            present = parse_cache(t.name)[1].present
            if present not in outputs:
                raise BuildError(f"{t.name}: the graph has no {present} output; it cannot generate")
            _, heads, _, head_dim = t.dims
            cache.append({"input": t.name, "output": present, "heads": heads, "head_dim": head_dim, "dtype": t.dtype})
    if ATTENTION_MASK not in inputs:
        raise BuildError(f"{r.name}: the decoder graph takes no {ATTENTION_MASK}; sequences cannot share a step")
    g = r.serving.generation
    sequences, tokens = rule.generation_limits(r.serving.batch.max, r.serving.length.max, g.max_sequences,
                                               g.max_cache_tokens)
    return {
        "format": triton_generate.FORMAT,
        "name": r.name,
        "graph_model": graph_model,
        "ids": INPUT_IDS, "mask": ATTENTION_MASK,
        "positions": POSITION_IDS if POSITION_IDS in inputs else None,
        "token_types": TOKEN_TYPE_IDS if TOKEN_TYPE_IDS in inputs else None,
        "logits": lm_output(r),
        "cache": cache,
        "vocab": r.vocab.size,
        "length_max": r.serving.length.max,
        # learned positions cover at least serving.length.max (the lengths_fit rule)
        "context": r.serving.length.max, "context_source": "serving.length.max",
        "eos": r.tokens.eos,
        "max_sequences": sequences, "max_cache_tokens": tokens, "max_waiting": g.max_waiting,
        "default_max_tokens": rule.DEFAULT_MAX_TOKENS, "max_stops": rule.MAX_STOPS,
        "max_stop_bytes": rule.MAX_STOP_BYTES, "reserved_parameters": list(rule.RESERVED_PARAMETERS),
        "fields": [{"name": f.name, "dtype": f.dtype, "shape": list(f.shape), "kind": f.kind}
                   for f in rule.GENERATE_INPUTS],
    }


def write_generation_model(root: Path, r: ResolvedSpec, graph_model: str) -> list[Path]:
    """root/NAME/config.pbtxt, root/NAME/1/model.py (specc/export/triton_generate.py, as it is)
    and root/NAME/1/generation.json. Returns the files written."""
    model_dir = root / r.name
    version = model_dir / "1"
    version.mkdir(parents=True)
    code = version / GENERATE_MODEL_FILE
    shutil.copyfile(triton_generate.__file__, code)
    facts = version / triton_generate.FACTS_FILE
    facts.write_text(json.dumps(generation_facts(r, graph_model), indent=1) + "\n")
    config = model_dir / "config.pbtxt"
    config.write_text(generate_config_text(r.name))
    return [config, code, facts]


def write_repository(root: Path, r: ResolvedSpec, files: dict[str, list[Path]],
                     plans: dict[str, Path] | None = None) -> list[Path]:
    """Move each graph's ONNX files (and engine, if any) from `root` into `root/MODEL/1/` and write
    `root/MODEL/config.pbtxt`; for a decoder, also the generation model. root is the build's
    staging directory. Returns the files written."""
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
    if generates(r):
        written += write_generation_model(root, r, names["model"])
    return written
