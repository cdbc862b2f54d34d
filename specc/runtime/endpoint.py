"""The generate endpoint's contract as `specc serve` keeps it: the fields a request holds and the
responses it gets (the table below; specc/spec/triton.py's, shared with `--target triton`), read
and answered by specc/decoding/request.py (parse, Answer: the same code the Triton model runs),
the build's tokenizer for text (hash-checked as Session checks it), and the JSON checks of
specc serve's HTTP front (check_body). Numpy only (PyTriton stays in the serve modules), so the
tests check it without a server.

Triton's generate extension (POST /v2/models/NAME/generate and /generate_stream) turns each
top-level key of the JSON body that names a model input into that input's tensor, and every
other key into a request parameter; gRPC clients send the same inputs as tensors. So every field
below is an optional input, read from a tensor or, as well, from a parameter of its name; any
other parameter is refused, naming it (a misspelt `max_token` would otherwise be ignored).

    input            dtype   shape  meaning
    text_input       BYTES   [1]    the prompt as UTF-8 text (a build with tokenizer.json at its root)
    input_ids        INT64   [-1]   the prompt as token ids (one of the two, not both)
    max_tokens       INT64   [1]    new tokens at most (default 16)
    temperature      FP32    [1]    > 0 samples; 0 or absent with no top_k/top_p is greedy
    top_k            INT64   [1]    sample from the k most likely
    top_p            FP32    [1]    sample from the nucleus of this mass
    seed             INT64   [1]    the sampler's seed (a request's draws equal Session.generate's)
    stop             BYTES   [-1]   strings that end the text (not included); needs the tokenizer
    eos              INT64   [1]    the token id that ends it (default: the spec's tokens.eos; -1: none)
    stream           BOOL    [1]    one response per token (generate_stream, gRPC streaming)
    chat             BOOL    [1]    text_input is a user's message, put in the build's chat template
                                    with the assistant's turn opened (as `specc generate --chat`)

    output              dtype  shape  meaning
    text_output         BYTES  [1]    the new text (builds with a tokenizer)
    output_ids          INT64  [-1]   the new token ids
    finish_reason       BYTES  [1]    stop | length | cancelled
    prompt_tokens       INT32  [1]    usage, as llama.cpp's server and OpenAI's API count it
    completion_tokens   INT32  [1]

Streaming, each token's response holds that token's ids and text, and the last one also
finish_reason and the counts; without `stream`, one response holds it all.
"""
from __future__ import annotations

import json
import math
from typing import Any, Mapping

from specc.decoding import request as decoding
from specc.decoding.errors import DecodingError
from specc.decoding.facts import Endpoint
from specc.decoding.request import Parsed, response
from specc.decoding.text import Codec, TextStream
from specc.runtime.errors import RunError
from specc.runtime.session import Session, check_files
from specc.spec.manifest import TOKENIZER_JSON
from specc.spec.triton import (
    DEFAULT_MAX_TOKENS,
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    MAX_STOP_BYTES,
    MAX_STOPS,
    RESERVED_PARAMETERS,
)

__all__ = ["ENDPOINT", "INPUTS", "NAMES", "OUTPUTS", "Codec", "Parsed", "TextStream", "check_body", "parse",
           "response", "text_codec"]

INPUTS, OUTPUTS = GENERATE_INPUTS, GENERATE_OUTPUTS  # the table, shared with --target triton's model
NAMES = tuple(f.name for f in INPUTS)
ENDPOINT = Endpoint.of(INPUTS, RESERVED_PARAMETERS, DEFAULT_MAX_TOKENS, MAX_STOPS, MAX_STOP_BYTES)


def text_codec(session: Session) -> Codec | None:
    """The build's tokenizer for text in and out, with its chat template where it has one
    (Session.tokenizer's: its files checked against the manifest's sha256 first, unless the
    session skips the check), or None where the build carries none. A tokenizer.json the
    manifest does not list is refused, as any file of a build that is not the one it verified:
    RunError naming it."""
    if session.has_tokenizer:
        return Codec(session.tokenizer.backend, session.tokenizer.chat_template)
    if (session.dir / TOKENIZER_JSON).exists():
        check_files(session.dir, session.manifest, [TOKENIZER_JSON])
    return None


def parse(data: Mapping[str, Any], parameters: Mapping[str, Any], codec: Codec | None) -> Parsed:
    """A generate request's inputs (tensors by name) and parameters, read by decoding's parse:
    RunError with its one line naming the field for anything wrong. The options' ranges and the
    prompt's ids are checked when the scheduler takes the request."""
    try:
        return decoding.parse(ENDPOINT, data, parameters, codec)
    except DecodingError as exc:
        raise RunError(str(exc)) from None


_JSON_WORDS = {"text": "a string", "texts": "a string or an array of strings", "ids": "an array of token ids "
               "(integers) or one", "int": "a 64-bit integer", "float": "a finite number", "bool": "true or false"}
_JSON_NAMES = {str: "a string", list: "an array", dict: "an object", bool: "a boolean", int: "an integer",
               float: "a number", type(None): "null"}


def check_body(body: bytes) -> dict:
    """A generate request's JSON body (Triton's generate extension), checked as far as Triton's HTTP
    frontend reads it before the model does: UTF-8 JSON, an object, each field's value of its JSON
    type (a scalar field's value alone or in an array of one, as Triton takes it); returns it.
    RunError with one line where not (Triton would answer those 500), and for `messages`, which
    the generate endpoint does not take (Triton's words: "parameter 'messages' has invalid
    type"); other unknown keys and values out of range are parse()'s."""
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RunError(f"the request body is not UTF-8 text (byte {exc.start}: {body[exc.start:exc.start + 1]!r})") from None
    try:
        request = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise RunError(f"the request body is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise RunError("the request body nests arrays or objects too deep") from None
    if not isinstance(request, dict):
        raise RunError(f"the request body is {_JSON_NAMES.get(type(request), 'a value')}; the generate endpoint takes a "
                       "JSON object of its fields")
    if "messages" in request:
        raise RunError("messages: the generate endpoint takes one text_input (\"chat\": true puts it in the "
                       "build's chat template as a user's message); a conversation goes to POST /v1/chat/completions")
    fields = {f.name: f for f in INPUTS}
    for key, value in request.items():
        field = fields.get(key)
        if field is not None and not _json_fits(field.kind, value):
            raise RunError(f"{key}: expected {_JSON_WORDS[field.kind]}, got {_json_shown(value)}")
    return request


def _no_constant(name: str) -> None:
    raise RunError(f"the request body holds {name}, which JSON does not have")


def _json_fits(kind: str, value: Any) -> bool:
    def one(v: Any) -> bool:
        if kind in ("int", "ids"):
            return isinstance(v, int) and not isinstance(v, bool) and -(2**63) <= v < 2**63
        if kind == "float":
            return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        return isinstance(v, bool) if kind == "bool" else isinstance(v, str)

    if kind in ("ids", "texts"):  # arrays, or one value alone
        return (isinstance(value, list) and all(one(v) for v in value)) or one(value)
    return one(value) or (isinstance(value, list) and len(value) == 1 and one(value[0]))


def _json_shown(value: Any) -> str:
    text = json.dumps(value)
    return f"{_JSON_NAMES.get(type(value), 'a value')} {text if len(text) <= 40 else text[:37] + '...'}"
