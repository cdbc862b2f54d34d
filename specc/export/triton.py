"""A Triton Inference Server model repository from a verified build (see docs/serving.md).

Layout, written inside the build's staging directory (so a failed build leaves nothing):

    REPO/manifest.json, REPO/model.safetensors      the build's own files (Triton loads only folders)
    REPO/MODEL/config.pbtxt                         one model per graph
    REPO/MODEL/1/model.onnx (+ model.onnx's external data, under its original file name)
    REPO/MODEL/1/model.plan                         when a TensorRT engine was built
    REPO/NAME/config.pbtxt, REPO/NAME/1/model.py,   a decoder's generation model (Python backend)
    REPO/NAME/1/generation.json, REPO/NAME/specc_decoding/   and the engine it runs
    REPO/NAME_openai/config.pbtxt, REPO/NAME_openai/1/model.py   the same model.py, as Triton's
                                                    OpenAI-compatible frontend calls it: relayed to NAME

An encoder gives one model named after the spec; an encoder-decoder gives two, `NAME_encoder`
and `NAME_decoder`. A decoder with an lm output gives its graph as `NAME_model` and, under the
spec's name, the generation model: Triton's generate endpoint, its loop run in Triton's Python
backend (specc/export/triton_generate.py, copied as model.py; it imports nothing of specc but
the copy of specc/decoding/ beside it, the engine `specc serve` runs too) over the graph model
by BLS, the KV cache kept inside the server. Names, dims and dynamic batching
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

from specc import decoding
from specc.decoding.errors import DecodingError
from specc.decoding.facts import FACTS_FILE, Endpoint, Generation, Limits, Model, to_json
from specc.decoding.graphs import GraphFacts
from specc.decoding.stores import store_kind
from specc.errors import BuildError
from specc.spec import io
from specc.spec import triton as rule
from specc.spec.resolve import GraphSig, ResolvedSpec, TensorSig
from specc.spec.targets import decode_activations

# IO signature dtype -> Triton's DataType enum name
TRITON_DTYPES = {"int64": "TYPE_INT64", "int32": "TYPE_INT32", "float32": "TYPE_FP32",
                 "float16": "TYPE_FP16", "bfloat16": "TYPE_BF16", "uint64": "TYPE_UINT64"}
# the generate endpoint's field dtypes (specc/spec/triton.py) -> Triton's
FIELD_DTYPES = {"bytes": "TYPE_STRING", "bool": "TYPE_BOOL", **TRITON_DTYPES}
GENERATE_MODEL_FILE = "model.py"  # the Python backend's file name
FRONTEND_OF = "specc_frontend_of"  # NAME_openai's config parameter (triton_generate.py reads it)
ENGINE_PACKAGE = "specc_decoding"  # the engine's package beside the generation model (triton_generate.py imports it)
ENGINE_INIT = ('"""specc\'s generation engine (specc/decoding/ and the IO contract specc/spec/io.py), copied by\n'
               '`specc build --target triton` for the generation model beside it (1/model.py)."""\n')


def generates(r: ResolvedSpec) -> bool:
    """Whether the repository gets a generation model (specc/spec/triton.py's rule). Its model.py
    holds the cache as numpy arrays, which have no bfloat16; the triton target builds no bf16."""
    return rule.generates(r.architecture, r.lm_output)


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


def generate_config_text(name: str, fronted: str | None = None) -> str:
    """config.pbtxt of the generation model: the Python backend, decoupled (a response per token
    when a request streams), no batching of its own (it batches the decode steps itself), the
    generate endpoint's fields, every input optional (a request gives the ones it needs). With
    `fronted`: NAME_openai's, which relays Triton's OpenAI frontend to that generation model: the
    frontend's fields, a batch dim of 1 on each (max_batch_size 1, no batcher), text_input required."""
    lines = [f"name: {json.dumps(name)}", 'backend: "python"', f"max_batch_size: {1 if fronted else 0}",
             "model_transaction_policy {", "  decoupled: true", "}"]
    tables = (("input", rule.GENERATE_INPUTS, True), ("output", rule.GENERATE_OUTPUTS, False))
    if fronted:
        lines += ["parameters {", f"  key: {json.dumps(FRONTEND_OF)}", f"  value: {{ string_value: {json.dumps(fronted)} }}",
                  "}"]
        tables = (("input", rule.FRONTEND_INPUTS, True), ("output", rule.FRONTEND_OUTPUTS, False))
    for key, fields, optional in tables:
        blocks = [_field(f, optional and not (fronted and f.name == "text_input")) for f in fields]
        lines.append(f"{key} [")
        for i, block in enumerate(blocks):
            lines += block[:-1] + (["  },"] if i < len(blocks) - 1 else ["  }"])
        lines.append("]")
    lines += ["instance_group [", "  {", "    count: 1", "    kind: KIND_CPU", "  }", "]"]
    return "\n".join(lines) + "\n"


def generation_facts(r: ResolvedSpec, graph_model: str) -> dict:
    """generation.json: what the generation model knows of the build (it reads nothing else of
    specc; specc/decoding/facts.py writes and reads it): the graph model and what the engine reads
    of its signature, the vocabulary, the context, eos, the limits of serving.generation, and the
    endpoint's fields. The model graph decodes (no in-place graph: docs/serving.md)."""
    graph = r.graph("model")
    try:
        facts = GraphFacts.of(graph.inputs, graph.outputs, r.lm_output)
        store_kind(None, lambda: facts)
    except DecodingError as exc:
        raise BuildError(f"{r.name}: {exc}") from None
    g = r.serving.generation
    sequences, tokens = rule.generation_limits(r.serving.batch.max, r.serving.length.max, g.max_sequences,
                                               g.max_cache_tokens)
    return to_json(Generation(
        name=r.name, graph_model=graph_model, graph=facts,
        # learned positions cover at least serving.length.max (the lengths_fit rule)
        model=Model(vocab=r.vocab.size, length_max=r.serving.length.max, context=r.serving.length.max,
                    context_source="serving.length.max", eos=r.tokens.eos,
                    activations=decode_activations(r.serving.precision, r.serving.activations)),
        limits=Limits(max_sequences=sequences, max_cache_tokens=tokens, max_waiting=g.max_waiting,
                      prefix_cache_tokens=g.prefix_cache_tokens),
        endpoint=Endpoint.of(rule.GENERATE_INPUTS, rule.RESERVED_PARAMETERS, rule.DEFAULT_MAX_TOKENS, rule.MAX_STOPS,
                             rule.MAX_STOP_BYTES)))


def engine_files() -> dict[str, Path]:
    """The engine the generation model imports, as the files of its package `specc_decoding`
    (path inside it -> the specc file it copies): specc/decoding/*.py and the IO contract
    specc/spec/io.py, with __init__ files of their own between (None: written empty)."""
    files: dict[str, Path | None] = {"__init__.py": None, "spec/__init__.py": None, "spec/io.py": Path(io.__file__)}
    for path in sorted(Path(decoding.__file__).parent.glob("*.py")):
        files[f"decoding/{path.name}"] = path
    return files


def write_generation_model(root: Path, r: ResolvedSpec, graph_model: str) -> list[Path]:
    """root/NAME/config.pbtxt, root/NAME/1/model.py (specc/export/triton_generate.py, as it is),
    root/NAME/1/generation.json, and the engine model.py imports, root/NAME/specc_decoding/
    (engine_files; Triton's Python backend puts the model's folder on sys.path, and a folder
    whose name is not a number is no version of the model). Returns the files written."""
    model_dir = root / r.name
    version = model_dir / "1"
    version.mkdir(parents=True)
    facts = version / FACTS_FILE
    facts.write_text(json.dumps(generation_facts(r, graph_model), indent=1) + "\n")
    code = version / GENERATE_MODEL_FILE
    shutil.copyfile(Path(__file__).with_name("triton_generate.py"), code)
    written = [code, facts]
    for name, source in engine_files().items():
        path = model_dir / ENGINE_PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if source is None:
            path.write_text(ENGINE_INIT)
        else:
            shutil.copyfile(source, path)
        written.append(path)
    config = model_dir / "config.pbtxt"
    config.write_text(generate_config_text(r.name))
    # NAME_openai: the same model.py, relaying Triton's OpenAI frontend to NAME
    front_dir = root / rule.frontend_model_name(r.name)
    (front_dir / "1").mkdir(parents=True)
    shutil.copyfile(code, front_dir / "1" / GENERATE_MODEL_FILE)
    shutil.copytree(model_dir / ENGINE_PACKAGE, front_dir / ENGINE_PACKAGE)  # what model.py imports at its top
    (front_dir / "config.pbtxt").write_text(generate_config_text(rule.frontend_model_name(r.name), fronted=r.name))
    written += [front_dir / "1" / GENERATE_MODEL_FILE, front_dir / "config.pbtxt"]
    written += sorted(p for p in (front_dir / ENGINE_PACKAGE).rglob("*") if p.is_file())
    return [config] + written


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
