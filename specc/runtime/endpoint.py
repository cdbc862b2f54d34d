"""The generate endpoint's contract: what a request to `specc serve`'s generation model holds,
checked into a GenerationRequest, and the responses it gets. Numpy only (PyTriton and Triton
stay in serve.py), so the tests check it without a server.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from specc.fileio import NotARegularFile, read_bounded
from specc.runtime.errors import RunError
from specc.runtime.scheduler import GenerationRequest
from specc.spec.triton import (
    DEFAULT_MAX_TOKENS,
    GENERATE_INPUTS,
    GENERATE_OUTPUTS,
    MAX_STOP_BYTES,
    MAX_STOPS,
    RESERVED_PARAMETERS,
    Field,
)

TOKENIZER_FILE = "tokenizer.json"  # at a build's root: Hugging Face tokenizers' file
MAX_TOKENIZER_BYTES = 256 << 20
INPUTS, OUTPUTS = GENERATE_INPUTS, GENERATE_OUTPUTS  # the table, shared with --target triton's model
NAMES = tuple(f.name for f in INPUTS)
RESERVED = RESERVED_PARAMETERS


@dataclass(frozen=True)
class Parsed:
    """A request read: what the scheduler runs, its stop strings and whether it streams."""

    request: GenerationRequest
    stop: tuple[str, ...]
    stream: bool
    text: bool  # the prompt came as text: answer text_output too


class TextCodec:
    """A build's tokenizer.json, for text in and out (Hugging Face tokenizers)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def of_build(cls, build_dir: str | Path) -> TextCodec | None:
        """The build's tokenizer.json, or None where it has none; RunError if it cannot be read."""
        path = Path(build_dir) / TOKENIZER_FILE
        if not path.exists():
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise RunError(f"{path}: reading it needs the `tokenizers` package: pip install tokenizers") from None
        try:
            return cls(Tokenizer.from_str(read_bounded(path, MAX_TOKENIZER_BYTES).decode("utf-8")))
        except (NotARegularFile, OSError, UnicodeDecodeError) as exc:
            raise RunError(f"{path}: cannot load the tokenizer ({exc})") from None
        except Exception as exc:  # tokenizers raises its own exception type
            raise RunError(f"{path}: cannot load the tokenizer ({str(exc).splitlines()[0] or type(exc).__name__})") from None

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


_JSON_WORDS = {"text": "a string", "texts": "a string or an array of strings", "ids": "an array of token ids "
               "(integers) or one", "int": "a 64-bit integer", "float": "a finite number", "bool": "true or false"}
_JSON_NAMES = {str: "a string", list: "an array", dict: "an object", bool: "a boolean", int: "an integer",
               float: "a number", type(None): "null"}


def check_body(body: bytes) -> None:
    """A generate request's JSON body (Triton's generate extension), checked as far as Triton's HTTP
    frontend reads it before the model does: UTF-8 JSON, an object, each field's value of its JSON
    type (a scalar field's value alone or in an array of one, as Triton takes it). RunError with
    one line where not (Triton would answer those 500); unknown keys and values out of range are
    parse()'s."""
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
    fields = {f.name: f for f in INPUTS}
    for key, value in request.items():
        field = fields.get(key)
        if field is not None and not _json_fits(field.kind, value):
            raise RunError(f"{key}: expected {_JSON_WORDS[field.kind]}, got {_json_shown(value)}")


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


def _values(name: str, value: Any) -> np.ndarray:
    """A tensor's or a parameter's value as a flat array."""
    arr = np.asarray(value)
    if arr.dtype == object and arr.size and not all(isinstance(v, (bytes, str)) for v in arr.reshape(-1)):
        raise RunError(f"{name}: not a value of this field's type")
    return arr.reshape(-1)


def _scalar(field: Field, value: Any):
    arr = _values(field.name, value)
    if arr.size != 1:
        raise RunError(f"{field.name}: expected one value, got {arr.size}")
    x = arr[0]
    if field.kind == "bool":
        if not isinstance(x, (bool, np.bool_)):
            raise RunError(f"{field.name}: expected true or false, got {x!r}")
        return bool(x)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise RunError(f"{field.name}: expected a number, got {_shown(x)}")
    if field.kind == "int":
        if isinstance(x, (float, np.floating)) and not float(x).is_integer():
            raise RunError(f"{field.name}: expected an integer, got {x!r}")
        return int(x)
    if not math.isfinite(float(x)):
        raise RunError(f"{field.name}: expected a finite number, got {x!r}")
    return float(x)


def _shown(x: Any) -> str:
    if isinstance(x, bytes):
        x = x.decode("utf-8", "replace")
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _text(name: str, x: Any) -> str:
    if isinstance(x, str):
        return x
    if not isinstance(x, (bytes, np.bytes_)):
        raise RunError(f"{name}: expected text, got {_shown(x)}")
    try:
        return bytes(x).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RunError(f"{name}: not UTF-8 text (byte {exc.start}: {bytes(x)[exc.start:exc.start + 1]!r})") from None


def parse(data: Mapping[str, np.ndarray], parameters: Mapping[str, Any], codec: TextCodec | None) -> Parsed:
    """A generate request's inputs (tensors by name) and parameters, checked: RunError with one
    line naming the field for anything wrong. The options' ranges and the prompt's ids are
    checked later, with the build's limits (Scheduler.check)."""
    given = dict(data)
    for key, value in parameters.items():
        if key in RESERVED or key.startswith("triton_"):
            continue
        if key not in NAMES:
            raise RunError(f"unknown field {key!r}; the generate endpoint takes {', '.join(NAMES)}")
        if key in given:
            raise RunError(f"{key}: given twice (as an input and as a parameter)")
        given[key] = value
    fields = {f.name: f for f in INPUTS}
    unknown = sorted(set(given) - set(fields))
    if unknown:  # Triton refuses unknown inputs itself; a direct caller may not
        raise RunError(f"unknown field {unknown[0]!r}; the generate endpoint takes {', '.join(NAMES)}")
    opts = {k: _scalar(fields[k], v) for k, v in given.items() if fields[k].kind in ("int", "float", "bool")}
    if ("text_input" in given) == ("input_ids" in given):
        raise RunError("give the prompt as text_input or as input_ids (one of them)")
    if "text_input" in given:
        if codec is None:
            raise RunError("text_input: this build has no tokenizer.json; send input_ids")
        texts = _values("text_input", given["text_input"])
        if texts.size != 1:
            raise RunError(f"text_input: expected one text, got {texts.size}")
        text = _text("text_input", texts[0])
        if not text:
            raise RunError("text_input: empty; give at least one token")
        ids = codec.encode(text)
        if not ids:
            raise RunError("text_input: encodes to no tokens")
    else:
        arr = _values("input_ids", given["input_ids"])
        if arr.dtype.kind not in "iu" or arr.dtype == object:
            raise RunError(f"input_ids: expected integers, got {arr.dtype}")
        ids = [int(x) for x in arr]
        if not ids:
            raise RunError("input_ids: empty; give at least one token")
    stops: tuple[str, ...] = ()
    if "stop" in given:
        values = _values("stop", given["stop"])
        stops = tuple(_text("stop", s) for s in values)
        if stops and codec is None:
            raise RunError("stop: stop strings need the build's tokenizer.json; use eos for a stop token")
        if len(stops) > MAX_STOPS or any(not s or len(s.encode()) > MAX_STOP_BYTES for s in stops):
            raise RunError(f"stop: at most {MAX_STOPS} strings of 1..{MAX_STOP_BYTES} bytes")
    request = GenerationRequest(ids=tuple(ids), max_tokens=opts.get("max_tokens", DEFAULT_MAX_TOKENS),
                                temperature=opts.get("temperature"), top_k=opts.get("top_k"), top_p=opts.get("top_p"),
                                seed=opts.get("seed"), eos=opts.get("eos"))
    if request.temperature is not None and request.temperature < 0:
        raise RunError(f"temperature must be >= 0 (0 is greedy), got {request.temperature!r}")
    return Parsed(request=request, stop=stops, stream=bool(opts.get("stream", False)), text="text_input" in given)


class TextStream:
    """The new text of a sequence, piece by piece as its tokens come: each piece is what the
    decoded text grew by, held back while it ends in an incomplete UTF-8 character (the
    tokenizer's U+FFFD) or could be the start of a stop string. feed() returns (piece, stopped):
    at a stop string the text ends before it."""

    def __init__(self, codec: TextCodec, stops: tuple[str, ...]):
        self.codec, self.stops = codec, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed out

    def feed(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        for stop in self.stops:
            at = text.find(stop, max(self.sent - len(stop), 0))
            if at >= 0:
                piece, self.sent = text[self.sent:at], max(at, self.sent)
                return piece, True
        end = len(text)
        if text.endswith("\ufffd"):
            end -= 1
        for stop in self.stops:  # a suffix that may grow into a stop string waits
            for k in range(min(len(stop) - 1, end - self.sent), 0, -1):
                if text[end - k:end] == stop[:k]:
                    end -= k
                    break
        piece = text[self.sent:end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return piece, False

    def rest(self) -> str:
        """What is held back, once the sequence has ended without a stop string."""
        text = self.codec.decode(self.ids)
        piece, self.sent = text[self.sent:], len(text)
        return piece


def response(ids: list[int], text: str | None, reason: str | None = None,
             usage: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """One response's outputs: new ids (and text), and at the end the finish reason and usage."""
    out = {"output_ids": np.asarray(ids, dtype=np.int64)}
    if text is not None:
        out["text_output"] = np.array([text.encode("utf-8")], dtype=np.bytes_)
    if reason is not None:
        out["finish_reason"] = np.array([reason.encode()], dtype=np.bytes_)
    if usage is not None:
        out["prompt_tokens"] = np.array([usage[0]], dtype=np.int32)
        out["completion_tokens"] = np.array([usage[1]], dtype=np.int32)
    return out
