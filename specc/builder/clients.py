"""The files a build folder holds for the clients that open it besides specc: Hugging Face's
config.json and generation_config.json (Optimum's ORTModelFor* classes, transformers' AutoConfig and
pipelines) and onnxruntime-genai's genai_config.json, made from the resolved spec and its graphs'
IO signature alone.

Contracts:

- `client_files(r, graph_files)` says, for each client, which files it gets and their JSON, or why it gets none
  (`ClientFiles.clients`, which the manifest records as `clients`). A file is written only where
  its client runs the build's graphs as `specc run` / `specc generate` do; nothing is written for
  a spec the client would run computing something else or fail on.
- config.json is written only where a Hugging Face family computes what the spec computes
  (specc.importers.hf.as_config: the importer's family table read backwards and imported again),
  and for a decoder only where Optimum's empty cache for a prompt has the graph's shape (Optimum
  derives it from config.json by rules of its own, OPTIMUM_* below, read in optimum-onnx 0.1.0's
  optimum/onnxruntime/modeling_decoder.py and modeling_seq2seq.py). An encoder-decoder also gets
  OPTIMUM_DECODER: Optimum's ORTModelForSeq2SeqLM runs a decoder that takes
  `encoder_hidden_states` and makes the cross-attention cache itself, where specc's encoder graph
  makes it; the build composes that graph from its own two (specc/export/optimum_seq2seq.py,
  written and checked by the pipeline, not by `write` here).
- generation_config.json goes with config.json: the spec's `tokens:` as transformers names them.
- genai_config.json is written for a decoder whose graph onnxruntime-genai can feed: input_ids,
  attention_mask, position_ids where the graph takes it, and one cache shape for every layer,
  named past_key_values.N.key/.value -> present.N.key/.value (specc/spec/io.py). Its model type is
  onnxruntime-genai's generic `decoder` (its "gpt2" type expects GPT-2's old fused cache); the
  graphs' cache is never shared with the past (specc's graphs return the whole cache).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specc.export.optimum_seq2seq import MERGED as OPTIMUM_DECODER  # an encoder-decoder's decoder as Optimum runs it
from specc.fileio import write_atomic
from specc.importers.hf.as_config import hf_config
from specc.spec import io
from specc.spec.manifest import Tokens
from specc.spec.resolve import ResolvedSpec

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
GENAI_CONFIG = "genai_config.json"
FILES = (CONFIG, GENERATION_CONFIG, GENAI_CONFIG)  # every JSON file a build may write for a client

OPTIMUM, GENAI = "optimum", "onnxruntime-genai"

# Optimum's ORTModelForCausalLM feeds a prompt an empty cache of [batch, kv heads, 0, head size]:
# kv heads from config.num_key_value_heads for these model types (else num_attention_heads; Falcon
# by its own rule), head size from config.head_dim for these (else hidden_size // heads)
OPTIMUM_KV_HEADS = frozenset({"arcee", "deepseek_v3", "cohere", "gemma", "gemma3_text", "glm", "granite", "gpt_oss",
                              "helium", "mistral", "llama", "nemotron", "qwen2", "qwen3", "qwen3_moe", "smollm3",
                              "stablelm"})
OPTIMUM_HEAD_DIM = frozenset({"gemma", "gemma3_text", "gpt_oss", "nemotron"})
# the graph inputs onnxruntime-genai fills for a decoder besides the cache
GENAI_INPUTS = (io.INPUT_IDS, io.ATTENTION_MASK, io.POSITION_IDS)


@dataclass
class ClientFiles:
    """files: file name -> its JSON data; clients: client -> {"files": [names]} or {"why": reason}."""

    files: dict[str, dict] = field(default_factory=dict)
    clients: dict[str, dict] = field(default_factory=dict)


WINDOWED = ("{client} feeds every layer's cache back at the sequence's length; this graph's sliding layers keep "
            "only their window (window caches: docs/runtime.md)")


def client_files(r: ResolvedSpec, graph_files: dict[str, str]) -> ClientFiles:
    """What a build of R writes for other clients (the module's contracts); GRAPH_FILES: each
    graph's file in the build folder, as the manifest records it."""
    out = ClientFiles()
    config, why = _hf_files(r)
    if config is not None and any(r.cache_windows):
        config, why = None, WINDOWED.format(client="Optimum")
    if config is None:
        out.clients[OPTIMUM] = {"why": why}
    else:
        out.files[CONFIG] = config
        out.files[GENERATION_CONFIG] = _generation_config(r)
        out.clients[OPTIMUM] = {"files": [CONFIG, GENERATION_CONFIG]}
        if r.architecture == "encoder-decoder":
            out.clients[OPTIMUM]["files"].append(OPTIMUM_DECODER)
    genai, why = _genai_config(r, graph_files)
    if genai is None:
        out.clients[GENAI] = {"why": why}
    else:
        out.files[GENAI_CONFIG] = genai
        out.clients[GENAI] = {"files": [GENAI_CONFIG]}
    return out


def write(root: Path, made: ClientFiles) -> list[Path]:
    """The files of MADE written into ROOT; their paths, in FILES' order."""
    paths = []
    for name in FILES:
        if name in made.files:
            path = root / name
            write_atomic(path, json.dumps(made.files[name], indent=2) + "\n")
            paths.append(path)
    return paths


# --- Hugging Face -----------------------------------------------------------------------------


def _hf_files(r: ResolvedSpec) -> tuple[dict | None, str]:
    described = hf_config(r)
    if described.config is None:
        return None, described.why
    config = {**described.config, "use_cache": r.architecture != "encoder"}
    if r.architecture == "encoder-decoder":  # the token specc's generate starts from (transformers wants one)
        config["decoder_start_token_id"] = _decoder_start(r)
    if r.architecture != "encoder":
        if r.architecture == "decoder" and r.spec.decoder.attention.kind == "latent":
            return None, ("Optimum feeds a prompt empty caches of keys and values per head; this graph's latent "
                          "attention caches its latent and rotary key (past_key_values.N.latent, .rope_key)")
        # one empty cache shape for every past input (an encoder-decoder's cross K/V too)
        graph = "model" if r.architecture == "decoder" else "decoder"
        want = _cache_shapes(r, graph)
        got = _optimum_cache(config, r)
        if want != {got}:
            shapes = ", ".join(f"[batch, {h}, 0, {d}]" for h, d in sorted(want))
            return None, (f"Optimum feeds a prompt an empty cache of [batch, {got[0]}, 0, {got[1]}] for model_type "
                          f"{config['model_type']!r}; the graph's is {shapes}")
    return config, ""


def _optimum_cache(config: dict, r: ResolvedSpec) -> tuple[int, int]:
    """(kv heads, head size) of the empty cache Optimum makes from CONFIG (its rules, above)."""
    mt = config["model_type"]
    if r.architecture == "encoder-decoder":
        # num_attention_heads: the encoder's (BART's and Marian's attribute map; T5 has one count)
        heads = r.spec.encoder.attention.heads
        return heads, r.spec.d_model // heads
    attention = r.spec.decoder.attention
    heads = attention.heads
    if mt in OPTIMUM_KV_HEADS:
        kv = attention.kv_heads
    elif mt == "falcon":
        kv = attention.kv_heads if config.get("new_decoder_architecture") or not config.get("multi_query", True) else 1
    else:
        kv = heads
    size = attention.d_k if mt in OPTIMUM_HEAD_DIM else r.spec.d_model // heads
    return kv, size


def _generation_config(r: ResolvedSpec) -> dict:
    """generation_config.json: the spec's special token ids, under transformers' names."""
    tokens = _tokens(r)
    ids = {"bos_token_id": tokens.bos, "eos_token_id": tokens.eos, "pad_token_id": tokens.pad}
    if r.architecture == "encoder-decoder":
        ids["decoder_start_token_id"] = _decoder_start(r)
    return {k: v for k, v in ids.items() if v is not None}


# --- onnxruntime-genai ------------------------------------------------------------------------


def _cache_shapes(r: ResolvedSpec, graph: str = "model") -> set[tuple[int, int]]:
    """(heads, head size) of each past input of GRAPH, [batch, heads, length, head size]."""
    sig = r.graph(graph)
    return {(t.dims[1], t.dims[3]) for t in sig.inputs if io.is_past(t.name)}


def _cache_shape(r: ResolvedSpec) -> tuple[int, int] | None:
    """(heads, head size) of every layer's key and value in the main graph, where they are one
    shape [batch, heads, past_sequence, head size]; None where they are not."""
    shapes = _cache_shapes(r)
    return shapes.pop() if len(shapes) == 1 else None


def _genai_config(r: ResolvedSpec, graph_files: dict[str, str]) -> tuple[dict | None, str]:
    if r.architecture != "decoder":
        return None, f"onnxruntime-genai runs decoder-only models (this is an {r.architecture})"
    sig = next(g for g in r.graphs if g.name == "model")
    lm = r.lm_output
    if lm is None:
        return None, "onnxruntime-genai generates from an lm output; the spec has none"
    if any(r.cache_windows):
        return None, WINDOWED.format(client="onnxruntime-genai")
    others = [t.name for t in sig.inputs if t.name not in GENAI_INPUTS and not io.is_past(t.name)]
    if others:
        return None, f"onnxruntime-genai does not feed the graph's input(s) {', '.join(others)}"
    shape = _cache_shape(r)
    if shape is None:
        return None, "onnxruntime-genai takes one cache shape for every layer; the graph's layers differ"
    names = {t.name for t in sig.inputs}
    inputs = {name: name for name in GENAI_INPUTS if name in names}
    inputs.update(past_key_names=f"{io.PAST_PREFIX}.%d.{io.KEY}", past_value_names=f"{io.PAST_PREFIX}.%d.{io.VALUE}")
    outputs = {"logits": lm, "present_key_names": f"{io.PRESENT_PREFIX}.%d.{io.KEY}",
               "present_value_names": f"{io.PRESENT_PREFIX}.%d.{io.VALUE}"}
    tokens = _tokens(r)
    context = r.spec.position.max_length
    decoder = {"session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
               "filename": graph_files[sig.name], "head_size": shape[1], "hidden_size": r.spec.d_model,
               "num_attention_heads": r.spec.decoder.attention.heads, "num_hidden_layers": r.spec.decoder.layers,
               "num_key_value_heads": shape[0], "inputs": inputs, "outputs": outputs}
    model = {"type": "decoder", "vocab_size": r.spec.vocab.size, "context_length": context,
             # -1 where the spec names no id: no token ends a sequence, as in specc generate
             "eos_token_id": -1 if tokens.eos is None else tokens.eos, "pad_token_id": tokens.pad_for(tokens.eos),
             **({} if tokens.bos is None else {"bos_token_id": tokens.bos}), "decoder": decoder}
    search = {"do_sample": False, "num_beams": 1, "num_return_sequences": 1, "max_length": context, "min_length": 0,
              "past_present_share_buffer": False, "early_stopping": True, "length_penalty": 1.0,
              "repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "diversity_penalty": 0.0,
              "temperature": 1.0, "top_k": 50, "top_p": 1.0}
    return {"model": model, "search": search}, ""



def _decoder_start(r: ResolvedSpec) -> int:
    tokens = _tokens(r)
    return tokens.start_for(tokens.pad_for(tokens.eos))


def _tokens(r: ResolvedSpec) -> Tokens:
    given = r.spec.tokens
    return Tokens(bos=given.bos, eos=given.eos, pad=given.pad, decoder_start=given.decoder_start)
