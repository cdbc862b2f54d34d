"""How specc's graphs become Triton models: their names, their dims and their dynamic batching,
and the generate endpoint's fields.

One rule for both Triton routes: `specc build --target triton` (specc/export/triton.py writes it
into config.pbtxt) and `specc serve` (specc/runtime/serve.py hands it to PyTriton), so a client
sees the same models either way. Torch-free: the runtime reads it too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from specc.spec.io import BATCH

# How long the dynamic batcher may hold a request for others to join its batch. It is the most the
# batcher adds to any request's latency, paid in full by a request that arrives alone. A client
# that decodes sends its next step only after the previous answer, so a longer wait cannot gather
# that client's next request; the delay only lets requests already in flight together (concurrent
# clients, or the rows of one batch split over requests) meet. `serving:` states no latency budget,
# so the bound stays small; change it in config.pbtxt for a fleet that wants fuller batches.
MAX_QUEUE_DELAY_US = 100


@dataclass(frozen=True)
class DynamicBatching:
    """Triton's dynamic batcher for one model: max_batch_size and the dynamic_batching block."""

    max_batch_size: int
    preferred_batch_sizes: tuple[int, ...]
    max_queue_delay_us: int = MAX_QUEUE_DELAY_US


def dynamic_batching(batch_opt: int, batch_max: int) -> DynamicBatching:
    """The batching of a build with `serving.batch` {opt, max}: batches of up to max; preferred
    sizes opt, the batch the build's shapes are chosen for (the TensorRT profile's opt), and max,
    the largest batch the graphs are built to take. Triton sends the largest preferred batch it can
    form at once, so a full batch, or one of opt, never waits out the queue delay."""
    return DynamicBatching(max_batch_size=batch_max,
                           preferred_batch_sizes=tuple(sorted({min(batch_opt, batch_max), batch_max})))


def model_names(spec_name: str, graphs: Iterable[str], generation: bool = False) -> dict[str, str]:
    """graph name -> Triton model name: the spec's name for a build of one graph (encoder-only and
    decoder-only specs), NAME_encoder and NAME_decoder for an encoder-decoder's two. Where the
    spec's name goes to a generation model (`generation`: `specc serve` on a decoder), each
    graph is NAME_GRAPH (a decoder's one graph: NAME_model)."""
    graphs = list(graphs)
    if len(graphs) == 1 and not generation:
        return {graphs[0]: spec_name}
    return {g: f"{spec_name}_{g}" for g in graphs}


def model_dims(dims: Iterable[int | str]) -> tuple[int, ...] | None:
    """A tensor's dims as a Triton model declares them: without the leading batch dim (Triton's
    batching adds it), -1 for every symbolic dim. None for a tensor without a leading batch dim,
    which a batching model cannot take."""
    dims = tuple(dims)
    if not dims or dims[0] != BATCH:
        return None
    return tuple(d if isinstance(d, int) else -1 for d in dims[1:])


def generates(architecture: str, lm_output: str | None) -> bool:
    """Whether a build gets a generation model (named after the spec; its graph then NAME_model):
    a decoder with an lm output. An encoder-decoder's decoder graph takes no mask for its own
    cache, so sequences that started at different times cannot share its step."""
    return architecture == "decoder" and lm_output is not None


def generation_limits(batch_max: int, length_max: int, max_sequences: int | None,
                      max_cache_tokens: int | None) -> tuple[int, int]:
    """serving.generation's (max_sequences, max_cache_tokens) with their defaults filled in:
    max_sequences serving.batch.max, max_cache_tokens max_sequences x serving.length.max."""
    sequences = max_sequences if max_sequences is not None else batch_max
    return sequences, max_cache_tokens if max_cache_tokens is not None else sequences * length_max


# --- the generate endpoint's fields --------------------------------------------------------------
# One table for `specc serve`'s generation model and the generation model of `--target triton` (its
# config.pbtxt, and generation.json): both read requests with it through specc/decoding/request.py.

DEFAULT_MAX_TOKENS = 16  # OpenAI's completions API and vLLM's default
MAX_STOPS = 16  # stop strings in one request
MAX_STOP_BYTES = 256  # the longest stop string, in UTF-8 bytes
# parameters Triton itself may put on a request (its parameters extension reserves them)
RESERVED_PARAMETERS = ("sequence_id", "priority", "timeout", "sequence_start", "sequence_end", "headers")


@dataclass(frozen=True)
class Field:
    """One input or output of the generate endpoint."""

    name: str
    dtype: str  # numpy dtype name; "bytes" for Triton's BYTES
    shape: tuple[int, ...]  # without a batch dim; -1 any length
    kind: str  # how a value is read: ids | int | float | text | texts | bool


GENERATE_INPUTS = (
    Field("text_input", "bytes", (1,), "text"),
    Field("input_ids", "int64", (-1,), "ids"),
    Field("max_tokens", "int64", (1,), "int"),
    Field("temperature", "float32", (1,), "float"),
    Field("top_k", "int64", (1,), "int"),
    Field("top_p", "float32", (1,), "float"),
    Field("seed", "int64", (1,), "int"),
    Field("stop", "bytes", (-1,), "texts"),
    Field("eos", "int64", (1,), "int"),
    Field("stream", "bool", (1,), "bool"),
    Field("chat", "bool", (1,), "bool"),
    Field("speculative", "bytes", (1,), "text"),
)
GENERATE_OUTPUTS = (
    Field("text_output", "bytes", (1,), "text"),
    Field("output_ids", "int64", (-1,), "ids"),
    Field("finish_reason", "bytes", (1,), "text"),
    Field("prompt_tokens", "int32", (1,), "int"),
    Field("completion_tokens", "int32", (1,), "int"),
)

# --- the model Triton's OpenAI-compatible frontend calls ------------------------------------------
# `--target triton` on a decoder also writes NAME_openai: the generation model as Triton's own
# OpenAI frontend (server/python/openai) sends a Python-backend model its requests, in their
# TensorRT-LLM form: these names and dtypes, each with a batch dim of 1 (max_batch_size 1), the
# chat template applied by the frontend. It relays them to NAME (specc/export/triton_generate.py's
# Frontend), whose own fields stay as above.


def frontend_model_name(spec_name: str) -> str:
    """The model a Triton OpenAI frontend serves a build's generation as."""
    return f"{spec_name}_openai"


FRONTEND_INPUTS = (
    Field("text_input", "bytes", (1,), "text"),
    Field("stream", "bool", (1,), "bool"),
    Field("max_tokens", "int32", (1,), "int"),
    Field("stop_words", "bytes", (-1,), "texts"),
    Field("temperature", "float32", (1,), "float"),
    Field("top_p", "float32", (1,), "float"),
    Field("seed", "uint64", (1,), "int"),
    Field("frequency_penalty", "float32", (1,), "float"),  # 0 only
    Field("presence_penalty", "float32", (1,), "float"),  # 0 only
    Field("return_num_input_tokens", "bool", (1,), "bool"),
    Field("return_num_output_tokens", "bool", (1,), "bool"),
)
FRONTEND_OUTPUTS = (
    Field("text_output", "bytes", (1,), "text"),
    Field("num_input_tokens", "int32", (1,), "int"),
    Field("num_output_tokens", "int32", (1,), "int"),
)
