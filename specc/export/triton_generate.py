"""The generation model of a specc Triton repository: Triton's generate endpoint for a decoder,
run inside Triton's stock Python backend, with no specc process (docs/serving.md).

`specc build --target triton` copies this file, as it is, to REPO/NAME/1/model.py, beside
generation.json (the build's facts: the graph model's name and tensors, the vocabulary, the
context, eos, the limits, the endpoint's fields). It imports nothing of specc, since a fleet has
no specc installed: the standard library, numpy, and the `tokenizers` package where the
repository has a tokenizer.json. Each graph call is a BLS request (`pb_utils.InferenceRequest`)
to the graph model NAME_model, which the ONNX Runtime backend serves; the KV cache never leaves
the server.

    execute(requests) --> each request read and checked --> waiting (FIFO, at most max_waiting)
    the loop's thread, one iteration at a time:
        admit what fits (max_sequences rows, max_cache_tokens positions)
        prefill each admitted prompt alone (batch 1, an empty cache): its first token
        ONE decode step [B, 1] for every running sequence (continuous batching): a token each
        sequences that ended (eos, a stop string, max_tokens, a client gone) leave the block

The cache block holds each running sequence's positions right-aligned, zeros on their left, masked
by attention_mask; positions are counted from the mask, so every row's next token sits at its own
position. Requests, answers and refusals are those of `specc serve`'s generate endpoint: the same
fields, the same greedy tokens and seeded samples as specc's Session.generate gives each prompt
alone, the same one-line messages.
"""
from __future__ import annotations

import collections
import json
import math
import os
import threading
import time

import numpy as np

try:  # the module Triton's Python backend provides; absent when a test imports this file
    import triton_python_backend_utils as pb_utils
except ImportError:
    pb_utils = None

FACTS_FILE = "generation.json"
TOKENIZER_FILE = "tokenizer.json"
FORMAT = 1  # generation.json's format this file reads
# why a sequence ended: finish_reason (as llama.cpp's server and OpenAI's API name them), or a failure
STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"
CANCEL_POLL_S = 0.05  # how often a running request asks Triton whether its client went away


class Refused(Exception):
    """A request this model does not take: `busy` (its queue is full, or it is stopping: Triton's
    UNAVAILABLE) or the client's mistake (INVALID_ARG, HTTP 400); the message is one line."""

    def __init__(self, message: str, busy: bool = False):
        super().__init__(message)
        self.busy = busy


# --- reading a request ---------------------------------------------------------------------------


class Request:
    """A request read and checked: the prompt's ids, how to continue it, where it ends."""

    def __init__(self, ids, max_tokens, temperature, top_k, top_p, seed, eos, stops, stream, text):
        self.ids, self.max_tokens = ids, max_tokens
        self.temperature, self.top_k, self.top_p, self.seed = temperature, top_k, top_p, seed
        self.eos = eos  # the token that ends it, None for none
        self.stops, self.stream, self.text = stops, stream, text

    @property
    def sampling(self) -> bool:
        """Greedy unless temperature > 0, top_k or top_p is given (temperature 0 is greedy)."""
        if self.temperature == 0:
            return False
        return self.temperature is not None or self.top_k is not None or self.top_p is not None

    @property
    def need(self) -> int:
        """Positions of its final length: prompt + max_tokens."""
        return len(self.ids) + self.max_tokens


def _values(name, value) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype == object and arr.size and not all(isinstance(v, (bytes, str)) for v in arr.reshape(-1)):
        raise Refused(f"{name}: not a value of this field's type")
    return arr.reshape(-1)


def _shown(x) -> str:
    if isinstance(x, bytes):
        x = x.decode("utf-8", "replace")
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def _scalar(name: str, kind: str, value):
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


def _text(name: str, x) -> str:
    if isinstance(x, str):
        return x
    if not isinstance(x, (bytes, np.bytes_)):
        raise Refused(f"{name}: expected text, got {_shown(x)}")
    try:
        return bytes(x).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Refused(f"{name}: not UTF-8 text (byte {exc.start}: {bytes(x)[exc.start:exc.start + 1]!r})") from None


def parse(facts: dict, inputs: dict, parameters: dict, codec) -> Request:
    """A generate request's inputs (name -> array) and parameters, checked against the build's
    facts: Refused with one line naming the field for anything wrong, in the words of specc
    serve's generate endpoint."""
    kinds = {f["name"]: f["kind"] for f in facts["fields"]}
    names = ", ".join(kinds)
    given = dict(inputs)
    for key, value in parameters.items():
        if key in facts["reserved_parameters"] or key.startswith("triton_"):
            continue
        if key not in kinds:
            raise Refused(f"unknown field {key!r}; the generate endpoint takes {names}")
        if key in given:
            raise Refused(f"{key}: given twice (as an input and as a parameter)")
        given[key] = value
    unknown = sorted(set(given) - set(kinds))
    if unknown:
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
        ids = codec.encode(text)
        if not ids:
            raise Refused("text_input: encodes to no tokens")
    else:
        arr = _values("input_ids", given["input_ids"])
        if arr.dtype.kind not in "iu" or arr.dtype == object:
            raise Refused(f"input_ids: expected integers, got {arr.dtype}")
        ids = [int(x) for x in arr]
        if not ids:
            raise Refused("input_ids: empty; give at least one token")
    stops = ()
    if "stop" in given:
        stops = tuple(_text("stop", s) for s in _values("stop", given["stop"]))
        if stops and codec is None:
            raise Refused("stop: stop strings need the build's tokenizer.json; use eos for a stop token")
        most, longest = facts["max_stops"], facts["max_stop_bytes"]
        if len(stops) > most or any(not s or len(s.encode()) > longest for s in stops):
            raise Refused(f"stop: at most {most} strings of 1..{longest} bytes")
    temperature = opts.get("temperature")
    if temperature is not None and temperature < 0:
        raise Refused(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
    max_tokens = opts.get("max_tokens", facts["default_max_tokens"])
    eos = opts.get("eos", facts["eos"])
    request = Request(ids=ids, max_tokens=max_tokens, temperature=temperature, top_k=opts.get("top_k"),
                      top_p=opts.get("top_p"), seed=opts.get("seed"), eos=None if eos is None or eos < 0 else eos,
                      stops=stops, stream=bool(opts.get("stream", False)), text="text_input" in given)
    check(facts, request)
    return request


def check(facts: dict, r: Request) -> None:
    """The options' ranges, the prompt's ids and its length, as specc checks one prompt's
    generation, and against this model's cache budget."""
    if r.max_tokens < 1:
        raise Refused(f"max_tokens must be at least 1, got {r.max_tokens!r}")
    if r.top_p is not None and not 0 < r.top_p <= 1:
        raise Refused(f"top_p must be in (0, 1], got {r.top_p!r}")
    if r.top_k is not None and r.top_k < 1:
        raise Refused(f"top_k must be at least 1, got {r.top_k!r}")
    if r.seed is not None and r.seed < 0:
        raise Refused(f"seed must be an integer >= 0, got {r.seed!r}")
    length, vocab, context = facts["length_max"], facts["vocab"], facts["context"]
    if len(r.ids) > length:
        raise Refused(f"input_ids: a prompt of {len(r.ids)} tokens, more than the build's serving.length.max {length}")
    bad = sorted({x for x in r.ids if not 0 <= x < vocab})
    if bad:
        raise Refused(f"input_ids: token id(s) {bad[:5]} outside the vocabulary (0..{vocab - 1})")
    if r.need > context:
        raise Refused(f"prompt ({len(r.ids)} tokens) + max_tokens ({r.max_tokens}) is past the {context} positions "
                      f"the model takes ({facts['context_source']}): at most {max(context - len(r.ids), 0)} new tokens")
    if r.need > facts["max_cache_tokens"]:
        raise Refused(f"prompt ({len(r.ids)} tokens) + max_tokens ({r.max_tokens}) is more than the server's cache "
                      f"of {facts['max_cache_tokens']} positions (max_cache_tokens)")


# --- text ----------------------------------------------------------------------------------------


class Codec:
    """The repository's tokenizer.json (Hugging Face tokenizers), for text in and out."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @classmethod
    def find(cls, folders) -> Codec | None:
        """The first tokenizer.json in `folders`, or None where none has one."""
        path = next((os.path.join(f, TOKENIZER_FILE) for f in folders
                     if os.path.isfile(os.path.join(f, TOKENIZER_FILE))), None)
        if path is None:
            return None
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise RuntimeError(f"{path}: reading it needs the `tokenizers` package in the Python backend's "
                               "environment: pip install tokenizers") from None
        return cls(Tokenizer.from_file(path))

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text).ids)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


class TextStream:
    """The new text of a sequence, piece by piece as its tokens come: each piece is what the
    decoded text grew by, held back while it ends in an incomplete UTF-8 character (U+FFFD) or
    could be the start of a stop string. feed() returns (piece, stopped): at a stop string the
    text ends before it."""

    def __init__(self, codec: Codec, stops):
        self.codec, self.stops = codec, stops
        self.ids: list[int] = []
        self.sent = 0  # characters of the text handed out

    def feed(self, token: int):
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


# --- choosing tokens -------------------------------------------------------------------------------


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def sample(logits: np.ndarray, rng: np.random.Generator, temperature: float, top_k, top_p) -> np.ndarray:
    """One token per row from softmax(logits / temperature), restricted to the top_k most likely
    and to the smallest set whose probability reaches top_p: one uniform draw per row, so a
    seeded request draws what specc's Session.generate draws for the prompt alone."""
    x = logits.astype(np.float64) / max(temperature, 1e-6)
    if top_k:
        kth = np.sort(x, axis=-1)[:, -min(top_k, x.shape[-1])][:, None]
        x = np.where(x < kth, -np.inf, x)
    p = np.exp(log_softmax(x))
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-p, axis=-1)
        sorted_p = np.take_along_axis(p, order, axis=-1)
        keep_sorted = np.cumsum(sorted_p, axis=-1) - sorted_p < top_p  # always keeps the first
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    u = rng.random((len(p), 1))
    return np.minimum((np.cumsum(p, axis=-1) < u).sum(axis=-1), p.shape[-1] - 1)


# --- the loop ----------------------------------------------------------------------------------------


class Sequence:
    """One request on its way: `sink` gets its tokens (token() -> False ends it: a stop string)
    and its end (done(reason, error)), and says whether its client went away (cancelled())."""

    def __init__(self, request: Request, sink):
        self.request, self.sink = request, sink
        self.rng = np.random.default_rng(request.seed) if request.sampling else None
        self.length = 0  # positions in the cache
        self.last = -1  # the token the next step feeds
        self.made = 0  # tokens made
        self.present = None  # after prefill, before it joins the block: its own cache [1, H, p, Dh]
        self.ended = None


class Engine:
    """Continuous batching over the graph model. `run(feeds) -> outputs` calls the graph (name ->
    array both ways): BLS inside Triton, anything equivalent in a test. submit() from any thread;
    step() from one: the thread start() makes, or a test's own loop (`while engine.step(): pass`)."""

    def __init__(self, facts: dict, run):
        self.facts, self.run = facts, run
        self.cache = facts["cache"]  # [{"input", "output", "heads", "head_dim", "dtype"}]: a cache tensor in and out
        self.lock = threading.Condition()
        self.waiting: collections.deque = collections.deque()
        self.active: list[Sequence] = []
        self.block: dict = {}  # present name -> [B, H, T, Dh], the active rows right-aligned
        self.closed = None  # why new requests are refused
        self.stopping = False
        self.thread = None
        self.steps = 0  # batched decode steps so far

    # --- the callers' side -----------------------------------------------------------------------

    def submit(self, request: Request, sink) -> None:
        """Queue a checked request; Refused(busy) when the queue is full or the model is stopping."""
        limit = self.facts["max_waiting"]
        with self.lock:
            if self.closed:
                raise Refused(self.closed, busy=True)
            if len(self.waiting) >= limit and not (not self.waiting and self._fits(request.need, [])):
                raise Refused(f"server busy: {len(self.active)} sequences running and {len(self.waiting)} requests "
                              f"waiting (max_waiting {limit}); retry later", busy=True)
            self.waiting.append(Sequence(request, sink))
            self.lock.notify_all()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="specc-generate", daemon=True)
        self.thread.start()

    def stop(self, drain_s: float = 0.0) -> None:
        """Refuse new requests, let those running finish for up to `drain_s` seconds, then end the
        rest as cancelled and stop the thread."""
        with self.lock:
            self.closed = "server shutting down; retry on another server"
        deadline = time.monotonic() + drain_s
        while time.monotonic() < deadline:
            with self.lock:
                if not self.waiting and not self.active:
                    break
            time.sleep(0.02)
        with self.lock:
            self.stopping = True
            self.lock.notify_all()
        if self.thread is not None:
            self.thread.join()
        for seq in list(self.active) + list(self.waiting):
            self._end(seq, CANCELLED)
        self.active, self.waiting, self.block = [], collections.deque(), {}

    # --- the loop's thread ---------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            with self.lock:
                while not self.stopping and not self.waiting and not self.active:
                    self.lock.wait()
                if self.stopping:
                    return
            self.step()

    def step(self) -> bool:
        """One iteration: drop what was cancelled, admit what fits (each prefilled alone), one
        batched decode step for every running row, and let the rows that ended leave. Returns
        whether work remains."""
        with self.lock:
            gone = [s for s in self.waiting if _cancelled(s)]
            for seq in gone:
                self.waiting.remove(seq)
        for seq in gone + [s for s in self.active if _cancelled(s)]:
            self._end(seq, CANCELLED)
        with self.lock:
            admitted = []
            while self.waiting and self._fits(self.waiting[0].request.need, admitted):
                admitted.append(self.waiting.popleft())
        joining = [seq for seq in admitted if self._prefill(seq)]
        self._regroup(joining)
        if self.active:
            self._decode()
            self._regroup([])
        with self.lock:
            return bool(self.waiting or self.active)

    def _fits(self, need: int, pending: list) -> bool:
        """Whether one more row of `need` positions fits beside the running rows and `pending`:
        max_sequences rows, and rows x the longest final length within max_cache_tokens."""
        rows = [s.request.need for s in self.active if s.ended is None] + [s.request.need for s in pending]
        rows.append(need)
        return len(rows) <= self.facts["max_sequences"] and len(rows) * max(rows) <= self.facts["max_cache_tokens"]

    def _feeds(self, ids: np.ndarray, mask: np.ndarray) -> dict:
        f = self.facts
        feeds = {f["ids"]: ids, f["mask"]: mask}
        if f["positions"]:  # each token's count of attended tokens before it: padding shifts nothing
            feeds[f["positions"]] = (mask.cumsum(-1) - 1).clip(min=0)[:, -ids.shape[1]:]
        if f["token_types"]:
            feeds[f["token_types"]] = np.zeros_like(ids)
        return feeds

    def _call(self, feeds: dict, rows: list) -> dict | None:
        try:
            return self.run(feeds)
        except Exception as exc:  # the graph model failed: every row of the call fails alike
            message = " ".join(str(exc).split()) or type(exc).__name__
            for seq in rows:
                self._end(seq, ERROR, f"the graph model failed: {message}")
            return None

    def _prefill(self, seq: Sequence) -> bool:
        """The prompt alone, batch 1, an empty cache. Its first token goes to the sink; False
        if the sequence ended there."""
        ids = np.asarray([seq.request.ids], dtype=np.int64)
        feeds = self._feeds(ids, np.ones_like(ids))
        for c in self.cache:
            feeds[c["input"]] = np.zeros((1, c["heads"], 0, c["head_dim"]), dtype=c["dtype"])
        out = self._call(feeds, [seq])
        if out is None:
            return False
        seq.present = {c["output"]: out[c["output"]] for c in self.cache}
        seq.length = ids.shape[1]
        return self._emit(seq, out[self.facts["logits"]][:, -1, :])

    def _decode(self) -> None:
        """One step [B, 1] for every running row: each row's last token at its own position."""
        rows = self.active
        length = max(s.length for s in rows)
        lengths = np.array([s.length for s in rows])
        mask = (np.arange(length + 1)[None, :] >= (length - lengths)[:, None]).astype(np.int64)  # [B, T + 1]
        feeds = self._feeds(np.array([[s.last] for s in rows], dtype=np.int64), mask)
        for c in self.cache:
            feeds[c["input"]] = self.block[c["output"]]
        out = self._call(feeds, rows)
        if out is None:
            self.block = {}
            return
        self.steps += 1
        self.block = {c["output"]: out[c["output"]] for c in self.cache}
        logits = out[self.facts["logits"]][:, -1, :]
        for i, seq in enumerate(rows):
            seq.length += 1
            if seq.ended is None:
                self._emit(seq, logits[i: i + 1])

    def _emit(self, seq: Sequence, logits: np.ndarray) -> bool:
        """The row's next token from its [1, V] logits (argmax, or its own generator), to its
        sink; the row ends where it ends. True while it goes on."""
        r = seq.request
        if seq.rng is not None:
            token = int(sample(logits, seq.rng, r.temperature or 1.0, r.top_k, r.top_p)[0])
        else:
            token = int(logits[0].argmax())
        seq.last, seq.made = token, seq.made + 1
        try:
            more = seq.sink.token(token) is not False
        except Exception:  # a sink's failure ends its own row only
            more = False
        if not more or (r.eos is not None and token == r.eos):
            self._end(seq, STOP)
        elif seq.made >= r.max_tokens:
            self._end(seq, LENGTH)
        return seq.ended is None

    def _end(self, seq: Sequence, reason: str, error: str | None = None) -> None:
        if seq.ended is not None:
            return
        seq.ended = reason
        try:
            seq.sink.done(reason, error)
        except Exception:  # noqa: S110 - a sink's failure cannot stop the others
            pass

    def _regroup(self, joining: list) -> None:
        """Rows that ended leave the block and `joining` rows enter it, each right-aligned with
        zeros on its left (masked, but finite: 0 x NaN is NaN)."""
        keep = [(i, s) for i, s in enumerate(self.active) if s.ended is None]
        joining = [s for s in joining if s.ended is None]
        if len(keep) == len(self.active) and not joining:
            return
        rows = [s for _, s in keep] + joining
        length = max((s.length for s in rows), default=0)
        block = {}
        for c in self.cache:
            name = c["output"]
            new = np.zeros((len(rows), c["heads"], length, c["head_dim"]), dtype=c["dtype"])
            old = self.block.get(name)
            for j, (i, s) in enumerate(keep):
                new[j, :, length - s.length:] = old[i, :, old.shape[2] - s.length:]
            for j, s in enumerate(joining, start=len(keep)):
                new[j, :, length - s.length:] = s.present[name][0]
            block[name] = new
        for s in joining:
            s.present = None
        self.block = block if rows else {}
        with self.lock:
            self.active = rows


def _cancelled(seq: Sequence) -> bool:
    try:
        return bool(seq.sink.cancelled())
    except Exception:
        return True


# --- Triton's side ------------------------------------------------------------------------------------


def outputs(ids, text=None, reason=None, usage=None) -> dict:
    """One response's outputs: new ids (and text), and at the end the finish reason and usage."""
    out = {"output_ids": np.asarray(ids, dtype=np.int64)}
    if text is not None:
        out["text_output"] = np.array([text.encode("utf-8")], dtype=np.object_)
    if reason is not None:
        out["finish_reason"] = np.array([reason.encode()], dtype=np.object_)
    if usage is not None:
        out["prompt_tokens"] = np.array([usage[0]], dtype=np.int32)
        out["completion_tokens"] = np.array([usage[1]], dtype=np.int32)
    return out


class Answers:
    """One request's sink, collecting and streaming its answers; `send(outputs, error, final)`
    delivers one response (neither outputs nor error: only the final flag), `gone()` says whether
    the client went away."""

    def __init__(self, request: Request, codec: Codec | None, send, gone):
        self.request, self.send, self.gone = request, send, gone
        self.text = TextStream(codec, request.stops) if request.text or request.stops else None
        self.ids: list[int] = []
        self.pieces: list[str] = []
        self.checked = 0.0
        self.lost = False

    def token(self, token_id: int) -> bool:
        piece, stopped = self.text.feed(token_id) if self.text is not None else (None, False)
        self.ids.append(token_id)
        if piece is not None:
            self.pieces.append(piece)
        if self.request.stream:
            self._send(outputs([token_id], piece if self.request.text else None), None, False)
        return not stopped

    def done(self, reason: str, error: str | None = None) -> None:
        if self.lost:  # Triton holds a request until its final flag, client or not
            try:
                self.send(None, None, True)
            except Exception:  # noqa: S110 - the request is gone already
                pass
            return
        if reason == ERROR:
            self._send(None, error or "generation failed", True)
            return
        rest = self.text.rest() if self.text is not None and reason != STOP else ""
        usage = (len(self.request.ids), len(self.ids))
        if self.request.stream:
            answer = outputs([], rest if self.request.text else None, reason, usage)
        else:
            answer = outputs(self.ids, "".join(self.pieces) + rest if self.request.text else None, reason, usage)
        self._send(answer, None, True)

    def cancelled(self) -> bool:
        now = time.monotonic()
        if not self.lost and now - self.checked > CANCEL_POLL_S:
            self.checked = now
            self.lost = bool(self.gone())
        return self.lost

    def _send(self, answer, error, final) -> None:
        if self.lost:
            return
        try:
            self.send(answer, error, final)
        except Exception:  # the client went away: the loop ends the row at its next iteration
            self.lost = True


class TritonPythonModel:
    """Triton's Python backend entry points: a decoupled model, one response per token when the
    request streams, else one at the end."""

    def initialize(self, args):
        folder = os.path.join(args["model_repository"], args["model_version"])
        with open(os.path.join(folder, FACTS_FILE), encoding="utf-8") as f:
            self.facts = json.load(f)
        if self.facts.get("format") != FORMAT:
            raise RuntimeError(f"{os.path.join(folder, FACTS_FILE)}: format {self.facts.get('format')!r}, this "
                               f"model.py reads format {FORMAT}; rebuild the repository with one specc")
        # the version folder, the model's, the repository's root (where a build keeps its tokenizer)
        self.codec = Codec.find([folder, args["model_repository"], os.path.dirname(args["model_repository"])])
        self.names = [self.facts["logits"]] + [c["output"] for c in self.facts["cache"]]
        memory = getattr(pb_utils, "PreferredMemory", None)  # the graph's outputs come back in CPU memory
        self.memory = {"preferred_memory": memory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)} if memory else {}
        self.engine = Engine(self.facts, self._graph)
        self.engine.start()

    def _graph(self, feeds: dict) -> dict:
        """One call of the graph model through BLS."""
        request = pb_utils.InferenceRequest(
            model_name=self.facts["graph_model"], requested_output_names=self.names,
            inputs=[pb_utils.Tensor(n, np.ascontiguousarray(v)) for n, v in feeds.items()], **self.memory)
        response = request.exec()
        if response.has_error():
            raise RuntimeError(response.error().message())
        return {n: pb_utils.get_output_tensor_by_name(response, n).as_numpy() for n in self.names}

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {t.name(): t.as_numpy() for t in request.inputs()}
                parameters = json.loads(request.parameters() or "{}")
                parsed = parse(self.facts, inputs, parameters, self.codec)
                answers = Answers(parsed, self.codec, _sender(sender), _gone(request))
                self.engine.submit(parsed, answers)
            except Refused as exc:
                sender.send(_error(str(exc), "UNAVAILABLE" if exc.busy else "INVALID_ARG"),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # a bug of this file: one line to the client, the rest to Triton's log
                pb_utils.Logger.log_error(f"generate: {type(exc).__name__}: {exc}")
                sender.send(_error("internal error; the server's log has it", "INTERNAL"),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        self.engine.stop()


def _error(message: str, code: str):
    kind = getattr(pb_utils.TritonError, code, None)
    error = pb_utils.TritonError(message) if kind is None else pb_utils.TritonError(message, kind)
    return pb_utils.InferenceResponse(output_tensors=[], error=error)


def _sender(sender):
    def send(answer, error, final):
        flags = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0
        if answer is None and error is None:
            sender.send(None, flags)
        elif error is not None:
            sender.send(_error(error, "INTERNAL"), flags=flags)
        else:
            sender.send(pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(n, v) for n, v in answer.items()]),
                        flags=flags)
    return send


def _gone(request):
    is_cancelled = getattr(request, "is_cancelled", None)  # Triton 23.10 and later
    return is_cancelled if is_cancelled is not None else (lambda: False)
