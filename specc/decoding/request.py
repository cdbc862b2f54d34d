"""A generate request: read from its fields (`parse`, the endpoint's inputs and parameters as
either host receives them), checked against the build and the engine's budget (`check`), and
answered (`Answer`: the responses a host sends back). Every refusal is a Refused with one line
naming the field, in the words both hosts answer.

Triton's generate extension turns each top-level key of a JSON body that names a model input into
that input's tensor and every other key into a request parameter; gRPC clients send the inputs
as tensors. So every field is an optional input, read from a tensor or, as well, from a parameter
of its name; any other parameter is refused, naming it (a misspelt `max_token` would otherwise
be ignored).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from .draft import DRAFTERS
from .errors import Refused
from .facts import Endpoint, Limits, Model
from .sampling import samples
from .text import Codec, TemplateError, TextStream

# why a sequence ended (the endpoint's finish_reason, as llama.cpp's server and OpenAI's API name
# them): its eos token or a stop string; max_tokens; the client went away; a failure of the server's
STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"


@dataclass(frozen=True)
class Request:
    """One prompt and how to continue it. Greedy unless the options sample (sampling.samples:
    temperature 0 is greedy); `eos` replaces the spec's tokens.eos (-1: none, so only max_tokens
    ends it); `speculative` names a drafter (draft.DRAFTERS) whose guesses the engine checks
    (speculation.py): the same tokens, sooner where the text copies."""

    ids: tuple[int, ...]
    max_tokens: int
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    eos: int | None = None
    speculative: str | None = None

    @property
    def sampling(self) -> bool:
        return samples(self.temperature, self.top_k, self.top_p)


@dataclass(frozen=True)
class Parsed:
    """A request read: what the engine runs, its stop strings, whether it streams, and whether
    its prompt came as text (then its answer holds text too)."""

    request: Request
    stop: tuple[str, ...]
    stream: bool
    text: bool


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def check(model: Model, limits: Limits, r: Request) -> tuple[int, int | None]:
    """A request's options, its prompt and its length, against the build and the engine's cache
    budget; returns (positions it needs: prompt + max_tokens, the eos that ends it or None)."""
    if not r.ids:
        raise Refused("input_ids: an empty prompt; give at least one token")
    if not _is_int(r.max_tokens) or r.max_tokens < 1:
        raise Refused(f"max_tokens must be at least 1, got {r.max_tokens!r}")
    if r.temperature is not None and not (math.isfinite(r.temperature) and r.temperature >= 0):
        raise Refused(f"temperature must be >= 0 (0 is greedy), got {r.temperature!r}")
    if r.top_p is not None and not 0 < r.top_p <= 1:
        raise Refused(f"top_p must be in (0, 1], got {r.top_p!r}")
    if r.top_k is not None and (not _is_int(r.top_k) or r.top_k < 1):
        raise Refused(f"top_k must be at least 1, got {r.top_k!r}")
    if r.seed is not None and (not _is_int(r.seed) or r.seed < 0):
        raise Refused(f"seed must be an integer >= 0, got {r.seed!r}")
    if r.eos is not None and not _is_int(r.eos):  # outside the vocabulary (e.g. -1): no token ends it
        raise Refused(f"eos must be an integer, got {r.eos!r}")
    if r.speculative is not None and r.speculative not in DRAFTERS:
        raise Refused(f"speculative: unknown drafter {r.speculative!r}; the server drafts with {', '.join(DRAFTERS)}")
    if len(r.ids) > model.length_max:
        raise Refused(f"input_ids: a prompt of {len(r.ids)} tokens, more than the build's serving.length.max "
                      f"{model.length_max}")
    bad = sorted({x for x in r.ids if not 0 <= x < model.vocab})
    if bad:
        raise Refused(f"input_ids: token id(s) {bad[:5]} outside the vocabulary (0..{model.vocab - 1})")
    need = len(r.ids) + r.max_tokens
    if need > model.context:
        raise Refused(f"prompt ({len(r.ids)} tokens) + max_tokens ({r.max_tokens}) is past the {model.context} "
                      f"positions the model takes ({model.context_source}): at most "
                      f"{max(model.context - len(r.ids), 0)} new tokens")
    if need > limits.max_cache_tokens:
        raise Refused(f"prompt ({len(r.ids)} tokens) + max_tokens ({r.max_tokens}) is more than the server's cache "
                      f"of {limits.max_cache_tokens} positions (max_cache_tokens)")
    eos = r.eos if r.eos is not None else model.eos
    return need, (None if eos is not None and eos < 0 else eos)


# --- reading a request's fields -----------------------------------------------------------------


def _values(name: str, value: Any) -> np.ndarray:
    """A tensor's or a parameter's value as a flat array."""
    arr = np.asarray(value)
    if arr.dtype == object and arr.size and not all(isinstance(v, (bytes, str)) for v in arr.reshape(-1)):
        raise Refused(f"{name}: not a value of this field's type")
    return arr.reshape(-1)


def _shown(x: Any) -> str:
    if isinstance(x, bytes):
        x = x.decode("utf-8", "replace")
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _scalar(name: str, kind: str, value: Any):
    arr = _values(name, value)
    if arr.size != 1:
        raise Refused(f"{name}: expected one value, got {arr.size}")
    x = arr[0]
    if kind == "bool":
        if not isinstance(x, (bool, np.bool_)):
            raise Refused(f"{name}: expected true or false, got {x!r}")
        return bool(x)
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise Refused(f"{name}: expected a number, got {_shown(x)}")
    if kind == "int":
        if isinstance(x, (float, np.floating)) and not float(x).is_integer():
            raise Refused(f"{name}: expected an integer, got {x!r}")
        return int(x)
    if not math.isfinite(float(x)):
        raise Refused(f"{name}: expected a finite number, got {x!r}")
    return float(x)


def _text(name: str, x: Any) -> str:
    if isinstance(x, str):
        return x
    if not isinstance(x, (bytes, np.bytes_)):
        raise Refused(f"{name}: expected text, got {_shown(x)}")
    try:
        return bytes(x).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(f"{name}: not UTF-8 text (byte {exc.start}: {bytes(x)[exc.start:exc.start + 1]!r})") from None


def parse(endpoint: Endpoint, data: Mapping[str, Any], parameters: Mapping[str, Any], codec: Codec | None) -> Parsed:
    """A generate request's inputs (tensors by name) and parameters, read: Refused with one line
    naming the field for anything wrong. The options' ranges and the prompt's ids are check()'s,
    when the engine takes the request."""
    kinds = endpoint.kinds
    names = ", ".join(endpoint.names)
    given = dict(data)
    for key, value in parameters.items():
        if key in endpoint.reserved_parameters or key.startswith("triton_"):
            continue
        if key not in kinds:
            raise Refused(f"unknown field {key!r}; the generate endpoint takes {names}")
        if key in given:
            raise Refused(f"{key}: given twice (as an input and as a parameter)")
        given[key] = value
    unknown = sorted(set(given) - set(kinds))
    if unknown:  # Triton refuses unknown inputs itself; a direct caller may not
        raise Refused(f"unknown field {unknown[0]!r}; the generate endpoint takes {names}")
    opts = {k: _scalar(k, kinds[k], v) for k, v in given.items() if kinds[k] in ("int", "float", "bool")}
    if ("text_input" in given) == ("input_ids" in given):
        raise Refused("give the prompt as text_input or as input_ids (one of them)")
    if "text_input" in given:
        if codec is None:
            raise Refused("text_input: this build has no tokenizer.json; send input_ids")
        texts = _values("text_input", given["text_input"])
        if texts.size != 1:
            raise Refused(f"text_input: expected one text, got {texts.size}")
        text = _text("text_input", texts[0])
        if not text:
            raise Refused("text_input: empty; give at least one token")
        if opts.get("chat"):  # a user's message in the build's chat template, as `specc generate --chat`
            try:
                ids = codec.chat([{"role": "user", "content": text}])
            except TemplateError as exc:
                raise Refused(f"chat: {exc}") from None
        else:
            ids = codec.encode(text)
        if not ids:
            raise Refused("text_input: encodes to no tokens")
    else:
        if opts.get("chat"):
            raise Refused("chat: true puts text_input in the build's chat template; give the message as text_input")
        arr = _values("input_ids", given["input_ids"])
        if arr.dtype.kind not in "iu" or arr.dtype == object:
            raise Refused(f"input_ids: expected integers, got {arr.dtype}")
        ids = [int(x) for x in arr]
        if not ids:
            raise Refused("input_ids: empty; give at least one token")
    stops: tuple[str, ...] = ()
    if "stop" in given:
        stops = tuple(_text("stop", s) for s in _values("stop", given["stop"]))
        if stops and codec is None:
            raise Refused("stop: stop strings need the build's tokenizer.json; use eos for a stop token")
        most, longest = endpoint.max_stops, endpoint.max_stop_bytes
        if len(stops) > most or any(not s or len(s.encode()) > longest for s in stops):
            raise Refused(f"stop: at most {most} strings of 1..{longest} bytes")
    speculative = None
    if "speculative" in given:
        drafters = _values("speculative", given["speculative"])
        if drafters.size != 1:
            raise Refused(f"speculative: expected one drafter's name, got {drafters.size}")
        speculative = _text("speculative", drafters[0])
    request = Request(ids=tuple(ids), max_tokens=opts.get("max_tokens", endpoint.default_max_tokens),
                      temperature=opts.get("temperature"), top_k=opts.get("top_k"), top_p=opts.get("top_p"),
                      seed=opts.get("seed"), eos=opts.get("eos"), speculative=speculative)
    if request.temperature is not None and request.temperature < 0:
        raise Refused(f"temperature must be >= 0 (0 is greedy), got {request.temperature!r}")
    return Parsed(request=request, stop=stops, stream=bool(opts.get("stream", False)), text="text_input" in given)


# --- answering it ----------------------------------------------------------------------------------


def response(ids: list[int], text: str | None, reason: str | None = None, usage: tuple[int, int] | None = None,
             text_dtype=np.bytes_) -> dict[str, np.ndarray]:
    """One response's outputs: new ids (and text), and at the end the finish reason and usage
    (prompt_tokens, completion_tokens). `text_dtype`: the host's array type for BYTES (PyTriton
    takes np.bytes_, Triton's Python backend np.object_)."""
    out = {"output_ids": np.asarray(ids, dtype=np.int64)}
    if text is not None:
        out["text_output"] = np.array([text.encode("utf-8")], dtype=text_dtype)
    if reason is not None:
        out["finish_reason"] = np.array([reason.encode()], dtype=text_dtype)
    if usage is not None:
        out["prompt_tokens"] = np.array([usage[0]], dtype=np.int32)
        out["completion_tokens"] = np.array([usage[1]], dtype=np.int32)
    return out


class Answer:
    """One request's answer as its tokens come: token() gives the response to send now (one per
    token when the request streams, else None) and whether a stop string ended the text;
    final(reason) the last response (a stream's: the text held back, the finish reason and the
    usage; else everything at once). The text is there when the prompt came as text."""

    def __init__(self, parsed: Parsed, codec: Codec | None, text_dtype=np.bytes_):
        self.parsed, self.text_dtype = parsed, text_dtype
        self.text = TextStream(codec, parsed.stop) if codec is not None and (parsed.text or parsed.stop) else None
        self.ids: list[int] = []
        self.pieces: list[str] = []

    def token(self, token_id: int) -> tuple[dict[str, np.ndarray] | None, bool]:
        piece, stopped = self.text.feed(token_id) if self.text is not None else (None, False)
        self.ids.append(token_id)
        if piece is not None:
            self.pieces.append(piece)
        if not self.parsed.stream:
            return None, stopped
        return response([token_id], piece if self.parsed.text else None, text_dtype=self.text_dtype), stopped

    def final(self, reason: str) -> dict[str, np.ndarray]:
        rest = self.text.rest() if self.text is not None and reason != STOP else ""
        usage = (len(self.parsed.request.ids), len(self.ids))
        if self.parsed.stream:
            return response([], rest if self.parsed.text else None, reason, usage, self.text_dtype)
        text = "".join(self.pieces) + rest if self.parsed.text else None
        return response(self.ids, text, reason, usage, self.text_dtype)
