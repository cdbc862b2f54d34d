"""The OpenAI-compatible API of `specc serve` (docs/serving.md): what the `openai` package,
LangChain, LlamaIndex and editors' assistants speak, on the HTTP port beside Triton's own API,
run on the same engine as the generate endpoint.

    GET  /v1/models, /v1/models/NAME       the build, under the spec's name
    POST /v1/chat/completions              messages -> the build's chat template (decoding's
                                           ChatTemplate, as `specc generate --chat`) -> ids
    POST /v1/completions                   prompt (text, or token ids) -> ids
    POST /v1/embeddings                    input (text, texts, or token ids) -> the build's
                                           sentence_embedding output (embedding.py), each
                                           vector as floats or base64 (little-endian float32)

    front.py (a /v1/* request) --> OpenAIApi.handle(method, path, body, gone) --> Reply
        | the body read (read_chat / read_completion: one line naming the field for anything wrong, 400)
        v
    Scheduler.submit (specc/decoding's engine: the generate endpoint's scheduler, its cache and
        | limits; a full queue or a draining server: 503 with Retry-After)
        v
    the engine's thread: each token to the request's _Feed (decoding's TextStream: whole
        | characters, stop strings cut as OpenAI cuts them: the text ends before one)
        v
    the front's thread for that connection: one JSON answer, or server-sent events (chat:
        `chat.completion.chunk`s, the role first, then the text, then finish_reason; the usage
        with stream_options.include_usage; `data: [DONE]` last)

The answers follow OpenAI's API reference where it speaks and llama.cpp's server where it is
silent: finish_reason `stop` (eos or a stop string) or `length` (max_tokens); usage counted as
the generate endpoint counts it; greedy unless temperature, top_p or top_k say otherwise
(temperature 0 is greedy); max_tokens (or max_completion_tokens) defaults to the room left in
the context on chat, 16 on completions. Every refusal is OpenAI's error object
({"error": {"message", "type", "param", "code"}}): 400 a bad request, 404 an unknown model or
path, 405 a wrong method, 501 what this server does not do, 503 busy (with Retry-After), 500 a
generation that failed. A client that goes away (front.py watches its connection) is cancelled
in the engine at its next step, its place free.

An embedding build (a `sentence_embedding` output) answers /v1/embeddings and lists itself in
/v1/models; a build without one answers it 400, naming what it lacks. Numpy and the standard library only; no HTTP here (front.py owns the port), so the tests drive
it without a server.
"""
from __future__ import annotations

import base64
import json
import math
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from specc.errors import first_line
from specc.decoding.request import CANCELLED, ERROR, LENGTH, STOP, Request
from specc.decoding.text import Codec, TemplateError, TextStream
from specc.runtime.embedding import SENTENCE_EMBEDDING, Embedder
from specc.runtime.errors import RunError
from specc.runtime.scheduler import Busy, Scheduler

__all__ = ["COMPLETION_MAX_TOKENS", "MAX_EMBEDDING_INPUTS", "OpenAIApi", "Refusal", "Reply", "read_chat",
           "read_completion", "read_embeddings"]

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
RETRY_AFTER_S = 1  # what a busy answer tells a client to wait
ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's newer name for system
MAX_STOPS = 16
MAX_STOP_BYTES = 256
MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on the inputs of one /v1/embeddings request
ENCODING_FORMATS = ("float", "base64")
OWNER = "specc"
_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
          413: "invalid_request_error", 500: "server_error", 501: "not_supported_error", 503: "unavailable_error"}


class Refusal(Exception):
    """A request this API does not take: its HTTP status, one line, the field it names (OpenAI's
    `param`) and a code (OpenAI's `code`, e.g. model_not_found)."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "invalid_request_error"),
                          "param": self.param, "code": self.code}}


@dataclass
class Reply:
    """An answer for front.py to write: its status, headers and either `data` (one JSON body) or
    `chunks` (server-sent events, each written and flushed as it comes). `close()` ends what the
    request still runs (the client went away mid-stream)."""

    status: int
    headers: dict = field(default_factory=dict)
    data: bytes | None = None
    chunks: Iterator[bytes] | None = None
    close: Callable[[], None] = lambda: None

    @classmethod
    def json(cls, status: int, body: Any, headers: dict | None = None) -> Reply:
        return cls(status, {"Content-Type": "application/json", **(headers or {})}, data=_dumps(body))

    @classmethod
    def refusal(cls, refusal: Refusal) -> Reply:
        headers = {"Retry-After": str(RETRY_AFTER_S)} if refusal.status == 503 else None
        return cls.json(refusal.status, refusal.body(), headers)


# --- reading a request ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """A chat or completion request read: the prompt (messages or a prompt), the options the
    engine takes, and how to answer."""

    chat: bool
    messages: tuple = ()  # chat: ({"role", "content"}, ...)
    prompt: str | None = None  # completions: text ...
    prompt_ids: tuple[int, ...] | None = None  # ... or token ids
    max_tokens: int | None = None  # None: the default (the room left on chat, 16 on completions)
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    speculative: str | None = None  # a drafter's name (the generate API's `speculative`)


@dataclass(frozen=True)
class EmbeddingAsk:
    """An embeddings request read: texts or rows of token ids (one of the two), how to write each
    vector, and the width asked for (None: the model's)."""

    texts: tuple[str, ...] | None
    ids: tuple[tuple[int, ...], ...] | None
    encoding_format: str = "float"
    dimensions: int | None = None


def _words(x: Any) -> str:
    names = {str: "a string", list: "an array", dict: "an object", bool: "a boolean", int: "an integer",
             float: "a number", type(None): "null"}
    text = json.dumps(x)
    return f"{names.get(type(x), 'a value')} {text if len(text) <= 40 else text[:37] + '...'}"


def _bad(param: str, message: str) -> Refusal:
    return Refusal(400, f"{param}: {message}", param)


def _int(body: Mapping, key: str, lowest: int) -> int | None:
    x = body.get(key)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, int) or not -(2**63) <= x < 2**63:
        raise _bad(key, f"expected an integer, got {_words(x)}")
    if x < lowest:
        raise _bad(key, f"must be at least {lowest}, got {x}")
    return x


def _number(body: Mapping, key: str, low: float, high: float, low_open: bool = False) -> float | None:
    x = body.get(key)
    if x is None:
        return None
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise _bad(key, f"expected a number, got {_words(x)}")
    if x > high or x < low or (low_open and x == low):
        raise _bad(key, f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {x}")
    return float(x)


def _bool(body: Mapping, key: str) -> bool:
    x = body.get(key)
    if x is None:
        return False
    if not isinstance(x, bool):
        raise _bad(key, f"expected true or false, got {_words(x)}")
    return x


def _stops(body: Mapping) -> tuple[str, ...]:
    x = body.get("stop")
    if x is None:
        return ()
    stops = [x] if isinstance(x, str) else x
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise _bad("stop", f"expected a string or an array of strings, got {_words(x)}")
    if len(stops) > MAX_STOPS or any(not s or len(s.encode()) > MAX_STOP_BYTES for s in stops):
        raise _bad("stop", f"at most {MAX_STOPS} strings of 1..{MAX_STOP_BYTES} bytes")
    return tuple(stops)


# the fields OpenAI's API defines that this server takes only at their default (any other value is
# refused plainly, never ignored): field -> (the values taken, what to say)
_DEFAULT_ONLY = {
    "n": ((None, 1), "only one choice per request (n = 1)"),
    "frequency_penalty": ((None, 0, 0.0), "penalties are not supported; leave it out or 0"),
    "presence_penalty": ((None, 0, 0.0), "penalties are not supported; leave it out or 0"),
    "logprobs": ((None, False), "log probabilities are not supported"),
    "top_logprobs": ((None,), "log probabilities are not supported"),
    "logit_bias": ((None, {}), "logit_bias is not supported"),
    "tools": ((None, []), "tools are not supported"),
    "tool_choice": ((None, "none"), "tools are not supported"),
    "functions": ((None, []), "functions are not supported"),
    "function_call": ((None, "none"), "functions are not supported"),
    "response_format": ((None, {"type": "text"}), "only {\"type\": \"text\"} is supported"),
    "echo": ((None, False), "echo is not supported"),
    "suffix": ((None, ""), "suffix is not supported"),
    "best_of": ((None, 1), "only best_of = 1 is supported"),
    "audio": ((None,), "audio is not supported"),
    "modalities": ((None, ["text"]), "only text is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
}
# fields taken and not used (they change nothing here): bookkeeping of OpenAI's platform
_IGNORED = ("user", "store", "metadata", "service_tier", "parallel_tool_calls", "reasoning_effort")
_COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options",
           "speculative")
CHAT_FIELDS = frozenset(_COMMON + ("messages", "max_completion_tokens") + _IGNORED + tuple(_DEFAULT_ONLY))
COMPLETION_FIELDS = frozenset(_COMMON + ("prompt",) + _IGNORED + tuple(_DEFAULT_ONLY))
EMBEDDING_FIELDS = frozenset(("model", "input", "encoding_format", "dimensions", "user"))


def _object(body: bytes) -> dict:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refusal(400, f"the request body is not UTF-8 text (byte {exc.start}: "
                           f"{body[exc.start:exc.start + 1]!r})") from None
    try:
        got = json.loads(text, parse_constant=_no_constant)
    except json.JSONDecodeError as exc:
        raise Refusal(400, f"the request body is not JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise Refusal(400, "the request body nests arrays or objects too deep") from None
    if not isinstance(got, dict):
        raise Refusal(400, f"the request body is {_words(got)}; expected a JSON object")
    return got


def _same(x: Any, y: Any) -> bool:
    """JSON values equal as JSON has them: 1 and 1.0 alike, true never 1."""
    numbers = (int, float)
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    if isinstance(x, numbers) and isinstance(y, numbers):
        return x == y
    return type(x) is type(y) and x == y


def _no_constant(name: str):
    raise Refusal(400, f"the request body holds {name}, which JSON does not have")


def _common(body: dict, allowed: frozenset, endpoint: str) -> dict:
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise _bad(unknown[0], f"unknown field; {endpoint} takes {', '.join(sorted(allowed))}")
    for key, (taken, why) in _DEFAULT_ONLY.items():
        if body.get(key) is not None and not any(_same(body[key], v) for v in taken):
            raise _bad(key, f"{why} (got {_words(body[key])})")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"required: the model's name (GET /v1/models), got {_words(model)}")
    stream = _bool(body, "stream")
    options = body.get("stream_options")
    if options is not None:
        if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
            raise _bad("stream_options", f"expected {{\"include_usage\": true or false}}, got {_words(options)}")
        if not stream:
            raise _bad("stream_options", "only with stream: true")
    include = bool(options and options.get("include_usage"))
    if options and not isinstance(options.get("include_usage", False), bool):
        raise _bad("stream_options.include_usage", f"expected true or false, got {_words(options['include_usage'])}")
    speculative = body.get("speculative")
    if speculative is not None and not isinstance(speculative, str):
        raise _bad("speculative", f"expected a drafter's name (\"ngram\"), got {_words(speculative)}")
    return dict(max_tokens=_int(body, "max_tokens", 1), temperature=_number(body, "temperature", 0, 2),
                top_p=_number(body, "top_p", 0, 1, low_open=True), top_k=_int(body, "top_k", 1),
                seed=_int(body, "seed", 0), stop=_stops(body), stream=stream, include_usage=include,
                speculative=speculative)


def _content(where: str, content: Any) -> str:
    """A message's content: a string, or text parts ({"type": "text", "text": ...}) joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise _bad(f"{where}.content[{i}]", f"only text parts ({{\"type\": \"text\", \"text\": \"...\"}}) "
                                                     f"are supported, got {_words(part)}")
            texts.append(part["text"])
        return "".join(texts)
    raise _bad(f"{where}.content", f"expected a string or an array of text parts, got {_words(content)}")


def read_chat(body: bytes) -> tuple[str, Ask]:
    """A /v1/chat/completions body read: (the model asked for, the request); Refusal (400) with
    one line naming the field for anything wrong."""
    got = _object(body)
    options = _common(got, CHAT_FIELDS, "/v1/chat/completions")
    if got.get("max_completion_tokens") is not None:
        options["max_tokens"] = _int(got, "max_completion_tokens", 1)
    messages = got.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _bad("messages", f"expected a non-empty array of messages, got {_words(messages)}")
    read = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise _bad(where, f"expected an object {{\"role\", \"content\"}}, got {_words(m)}")
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id", "refusal"})
        if extra:
            raise _bad(f"{where}.{extra[0]}", "unknown field; a message takes role, content and name")
        if m.get("tool_calls") or m.get("tool_call_id"):
            raise _bad(f"{where}.tool_calls", "tools are not supported")
        role = m.get("role")
        if role not in ROLES:
            raise _bad(f"{where}.role", f"expected one of {', '.join(ROLES)}, got {_words(role)}")
        message = {"role": "system" if role == "developer" else role, "content": _content(where, m.get("content"))}
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise _bad(f"{where}.name", f"expected a string, got {_words(m['name'])}")
            message["name"] = m["name"]
        read.append(message)
    return got["model"], Ask(chat=True, messages=tuple(read), **options)


def read_completion(body: bytes) -> tuple[str, Ask]:
    """A /v1/completions body read, as read_chat reads a chat's: the prompt is a string, an array
    of one string, or token ids (an array of integers, or an array of one such array)."""
    got = _object(body)
    options = _common(got, COMPLETION_FIELDS, "/v1/completions")
    prompt = got.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise _bad("prompt", "empty; give at least one token")
        return got["model"], Ask(chat=False, prompt=prompt, **options)
    if isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool) for x in prompt):
        return got["model"], Ask(chat=False, prompt_ids=tuple(prompt), **options)
    if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(x, (str, list)) for x in prompt):
        raise _bad("prompt", "one prompt per request (an array of several is a batch, not supported)")
    raise _bad("prompt", f"expected a string or an array of token ids, got {_words(prompt)}")


def _ids(x: Any) -> bool:
    return isinstance(x, list) and bool(x) and all(isinstance(i, int) and not isinstance(i, bool) for i in x)


def read_embeddings(body: bytes) -> tuple[str, EmbeddingAsk]:
    """A /v1/embeddings body read, as read_chat reads a chat's: `input` is a string, an array of
    strings, an array of token ids, or an array of such arrays (OpenAI's four forms), none of
    them empty, at most MAX_EMBEDDING_INPUTS inputs."""
    got = _object(body)
    unknown = sorted(set(got) - EMBEDDING_FIELDS)
    if unknown:
        raise _bad(unknown[0], f"unknown field; /v1/embeddings takes {', '.join(sorted(EMBEDDING_FIELDS))}")
    model = got.get("model")
    if not isinstance(model, str) or not model:
        raise _bad("model", f"required: the model's name (GET /v1/models), got {_words(model)}")
    fmt = got.get("encoding_format")
    if fmt is not None and fmt not in ENCODING_FORMATS:
        raise _bad("encoding_format", f"expected one of {', '.join(ENCODING_FORMATS)}, got {_words(fmt)}")
    dimensions = _int(got, "dimensions", 1)
    x = got.get("input")
    texts = ids = None
    if isinstance(x, str):
        texts = [x]
    elif _ids(x):
        ids = [x]
    elif isinstance(x, list) and x and all(isinstance(t, str) for t in x):
        texts = x
    elif isinstance(x, list) and x and all(_ids(r) for r in x):
        ids = x
    else:
        raise _bad("input", f"expected a string, an array of strings, an array of token ids or an array of "
                            f"such arrays, none empty, got {_words(x)}")
    inputs = texts if texts is not None else ids
    if len(inputs) > MAX_EMBEDDING_INPUTS:
        raise _bad("input", f"{len(inputs)} inputs; at most {MAX_EMBEDDING_INPUTS} in one request")
    if texts is not None and not all(texts):
        raise _bad(f"input[{texts.index('')}]", "an empty string; give at least one character")
    return model, EmbeddingAsk(texts=None if texts is None else tuple(texts),
                               ids=None if ids is None else tuple(tuple(r) for r in ids),
                               encoding_format=fmt or "float", dimensions=dimensions)


# --- answering -------------------------------------------------------------------------------------


class _Feed:
    """One request's sink (decoding.engine.Sink), called from the engine's thread: each token's text
    (decoding's TextStream: whole characters, stop strings cut) onto a queue the front's thread
    reads; `gone` set (the client hung up) cancels the request at the engine's next step."""

    def __init__(self, codec: Codec, stops: tuple[str, ...], gone: threading.Event):
        self.text = TextStream(codec, stops)
        self.gone = gone
        self.queue: queue.Queue = queue.Queue()
        self.tokens = 0
        self.stopped = False  # a stop string ended it

    def token(self, token_id: int) -> bool:
        piece, self.stopped = self.text.feed(token_id)
        self.tokens += 1
        if piece:
            self.queue.put(("text", piece))
        return not self.stopped

    def done(self, reason: str, error: str | None = None) -> None:
        rest = self.text.rest() if reason in (STOP, LENGTH) and not self.stopped else ""
        if rest:
            self.queue.put(("text", rest))
        self.queue.put(("end", reason, error))

    def cancelled(self) -> bool:
        return self.gone.is_set()

    def events(self) -> Iterator[tuple]:
        """("text", piece) ... then ("end", reason, error), as they come."""
        while True:
            event = self.queue.get()
            yield event
            if event[0] == "end":
                return


class OpenAIApi:
    """The OpenAI-compatible endpoints of one build (the module's doc): `name` the model's id,
    `scheduler` the engine the generate endpoint runs (None: the build does not generate), `codec`
    its tokenizer with its chat template (None: it carries none), `embedder` its sentence
    embedding (None: it has none)."""

    def __init__(self, name: str, scheduler: Scheduler | None, codec: Codec | None,
                 embedder: Embedder | None = None):
        self.name, self.scheduler, self.codec, self.embedder = name, scheduler, codec, embedder
        self.created = int(time.time())

    # --- routing ---------------------------------------------------------------------------------

    def handle(self, method: str, path: str, body: bytes, gone: threading.Event) -> Reply:
        """The answer to one /v1 request (never raises for a client's mistake: it answers it)."""
        route = path.split("?", 1)[0].rstrip("/")
        try:
            if route == "/v1/models":
                self._method(method, "GET")
                served = self.scheduler is not None or self.embedder is not None
                return Reply.json(200, {"object": "list", "data": [self._model()] if served else []})
            if route.startswith("/v1/models/"):
                self._method(method, "GET")
                self._known(route[len("/v1/models/"):])
                return Reply.json(200, self._model())
            if route in ("/v1/chat/completions", "/v1/completions"):
                self._method(method, "POST")
                chat = route == "/v1/chat/completions"
                model, ask = read_chat(body) if chat else read_completion(body)
                self._known(model)
                return self._generate(model, ask, gone)
            if route == "/v1/embeddings":
                self._method(method, "POST")
                model, ask = read_embeddings(body)
                self._named(model)
                return self._embed(model, ask)
            raise Refusal(404, f"no endpoint {route} here; this server answers GET /v1/models, POST "
                               "/v1/chat/completions, /v1/completions and /v1/embeddings", code="not_found")
        except Refusal as refusal:
            return Reply.refusal(refusal)

    def _method(self, method: str, want: str) -> None:
        if method != want:
            raise Refusal(405, f"{method} is not allowed here; use {want}", code="method_not_allowed")

    def _known(self, model: str) -> None:
        if self.scheduler is None:
            raise Refusal(404, f"{self.name} is not a text generation model (a decoder with an lm output); the "
                               "chat and completion endpoints need one", param="model", code="model_not_found")
        self._named(model)

    def _named(self, model: str) -> None:
        if model != self.name:
            raise Refusal(404, f"the model {model!r} does not exist; this server serves {self.name!r}",
                          param="model", code="model_not_found")

    def _model(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": OWNER}

    # --- embeddings -----------------------------------------------------------------------------------

    def _embed(self, model: str, ask: EmbeddingAsk) -> Reply:
        if self.embedder is None:
            raise Refusal(400, f"{self.name} has no {SENTENCE_EMBEDDING} output; /v1/embeddings needs a build "
                               "with one (an import of a sentence-transformers folder, or an output "
                               f"{{kind: pooled, name: {SENTENCE_EMBEDDING}}})", param="model",
                          code="model_not_supported")
        if ask.texts is not None and not self.embedder.has_tokenizer:
            raise _bad("input", f"{self.name} carries no tokenizer (its spec has no tokenizer:); give token ids")
        try:
            got = self.embedder.embed(texts=ask.texts, ids=ask.ids)
        except RunError as exc:  # the graph's checks, in this API's names
            message = str(exc)
            if message.startswith("input_ids"):
                message = "input" + message[len("input_ids"):]
            raise Refusal(400, message, param="input") from None
        width = got.vectors.shape[1]
        if ask.dimensions is not None and ask.dimensions != width:
            raise _bad("dimensions", f"{self.name}'s embeddings have {width} dimensions; shortened ones are not "
                                     "supported (leave it out)")
        data = [{"object": "embedding", "index": i, "embedding": _vector(v, ask.encoding_format)}
                for i, v in enumerate(got.vectors)]
        return Reply.json(200, {"object": "list", "data": data, "model": model,
                                "usage": {"prompt_tokens": got.tokens, "total_tokens": got.tokens}})

    # --- generation ---------------------------------------------------------------------------------

    def prompt_ids(self, ask: Ask) -> list[int]:
        """The ids the engine runs for a request: messages in the chat template (what `specc
        generate --chat` feeds for one user message), a text prompt encoded as the generate
        endpoint encodes text_input, or the ids given."""
        if ask.prompt_ids is not None:
            return list(ask.prompt_ids)
        if not ask.chat:
            ids = self.codec.encode(ask.prompt)
            if not ids:
                raise _bad("prompt", "encodes to no tokens")
            return ids
        if self.codec.template is None:
            raise Refusal(501, f"{self.name}'s tokenizer has no chat template (no chat_template.jinja, no "
                               "chat_template in tokenizer_config.json); use /v1/completions",
                          code="not_supported")
        try:
            ids = self.codec.chat(ask.messages)
        except TemplateError as exc:
            raise _bad("messages", f"the chat template refuses them: {exc}") from None
        if not ids:
            raise _bad("messages", "render to no tokens")
        return ids

    def request(self, ask: Ask) -> Request:
        """The engine's request for `ask`; max_tokens left out is the room the context leaves on
        chat (OpenAI's and llama.cpp's server's default), 16 on completions."""
        ids = self.prompt_ids(ask)
        facts, limits = self.scheduler.facts, self.scheduler.limits
        what = "messages" if ask.chat else "prompt"
        room = min(facts.context, limits.max_cache_tokens) - len(ids)
        if len(ids) > facts.length_max or room < 1:
            raise _bad(what, f"{len(ids)} tokens, and the model takes at most "
                             f"{min(facts.length_max, min(facts.context, limits.max_cache_tokens) - 1)} "
                             f"with a token to answer ({facts.context_source}; the server's cache: "
                             f"{limits.max_cache_tokens} positions)")
        max_tokens = ask.max_tokens if ask.max_tokens is not None else room if ask.chat else COMPLETION_MAX_TOKENS
        return Request(ids=tuple(ids), max_tokens=max_tokens, temperature=ask.temperature, top_k=ask.top_k,
                       top_p=ask.top_p, seed=ask.seed, speculative=ask.speculative)

    def _generate(self, model: str, ask: Ask, gone: threading.Event) -> Reply:
        if self.codec is None:  # token ids in would do, but the answer is text
            raise Refusal(501, f"{self.name} carries no tokenizer (its spec has no tokenizer:); the OpenAI "
                               "endpoints speak text", code="not_supported")
        request = self.request(ask)
        feed = _Feed(self.codec, ask.stop, gone)
        try:
            ticket = self.scheduler.submit(request, feed)
        except Busy as exc:
            raise Refusal(503, str(exc), code="server_busy") from None
        except RunError as exc:  # the engine's words, with this API's names for its fields
            message = str(exc)
            prompt = "messages" if ask.chat else "prompt"
            if message.startswith("input_ids"):
                message = prompt + message[len("input_ids"):]
            param = "max_tokens" if "max_tokens" in message else message.split(":", 1)[0]
            raise Refusal(400, message, param=param if param.isidentifier() else prompt) from None
        answer = _Answer(self, model, ask, request, feed)
        if ask.stream:
            return Reply(200, {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
                         chunks=answer.stream(), close=lambda: self.scheduler.cancel(ticket))
        try:
            return answer.whole()
        finally:
            self.scheduler.cancel(ticket)  # ended already, or its client went away


class _Answer:
    """One request's answer in OpenAI's form, whole or as server-sent events."""

    def __init__(self, api: OpenAIApi, model: str, ask: Ask, request: Request, feed: _Feed):
        self.api, self.model, self.ask, self.request, self.feed = api, model, ask, request, feed
        self.id = f"{'chatcmpl' if ask.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def usage(self) -> dict:
        prompt, made = len(self.request.ids), self.feed.tokens
        return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def whole(self) -> Reply:
        pieces = []
        for event in self.feed.events():
            if event[0] == "text":
                pieces.append(event[1])
                continue
            _, reason, error = event
            if reason == ERROR:
                return Reply.refusal(Refusal(500, f"generation failed: {error or 'no reason given'}"))
            if reason == CANCELLED:  # the client went away (or the server stopped): nothing to say
                return Reply.refusal(Refusal(503, "the request was cancelled (the server is stopping)"))
            text = "".join(pieces)
            if self.ask.chat:
                choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                          "finish_reason": reason}
                body = {**self._head("chat.completion"), "choices": [choice], "usage": self.usage()}
            else:
                choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": reason}
                body = {**self._head("text_completion"), "choices": [choice], "usage": self.usage()}
            return Reply.json(200, body)
        raise AssertionError("unreachable: events end with an end event")

    def _chunk(self, content: str | None, reason: str | None, first: bool = False) -> bytes:
        if self.ask.chat:
            delta = {"role": "assistant", "content": ""} if first else {} if content is None else {"content": content}
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}
            body = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": content or "", "logprobs": None, "finish_reason": reason}
            body = {**self._head("text_completion"), "choices": [choice]}
        if self.ask.include_usage:
            body["usage"] = None
        return _event(body)

    def stream(self) -> Iterator[bytes]:
        if self.ask.chat:
            yield self._chunk(None, None, first=True)
        for event in self.feed.events():
            if event[0] == "text":
                yield self._chunk(event[1], None)
                continue
            _, reason, error = event
            if reason == CANCELLED:
                return
            if reason == ERROR:
                yield _event(Refusal(500, f"generation failed: {error or 'no reason given'}").body())
                return
            yield self._chunk(None, reason)
            if self.ask.include_usage:
                kind = "chat.completion.chunk" if self.ask.chat else "text_completion"
                yield _event({**self._head(kind), "choices": [], "usage": self.usage()})
            yield b"data: [DONE]\n\n"
            return


def _vector(v: np.ndarray, encoding_format: str) -> list[float] | str:
    """One embedding as OpenAI writes it: floats, or base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


def _event(body: Any) -> bytes:
    return b"data: " + _dumps(body) + b"\n\n"


def _dumps(body: Any) -> bytes:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def refusal_line(exc: BaseException) -> str:
    """One line for an unexpected failure of this API (front.py answers it 500)."""
    return f"internal error: {type(exc).__name__}: {first_line(exc)}".rstrip(": ")
