"""The generation model of a specc Triton repository: Triton's generate endpoint for a decoder,
run inside Triton's stock Python backend, with no specc process (docs/serving.md).

`specc build --target triton` copies this file, as it is, to REPO/NAME/1/model.py, beside
generation.json (the build's facts, specc/decoding/facts.py), and the engine it runs to
REPO/NAME/specc_decoding/ (specc/decoding/ and the IO contract specc/spec/io.py, as they are).
Triton's Python backend puts the model's folder on sys.path, so `specc_decoding` imports from
there; a fleet has no specc installed, and this file imports nothing of specc: the standard
library, numpy, `tokenizers` where the repository has a tokenizer.json, Triton's own module, and
that copy of the engine. So the Triton model and `specc serve` decode with one code: the same
request reading and refusals, sampler, step loop and cache store.

    execute(requests) --> each request read (decoding's parse) --> Engine.submit (checked,
        | a refusal answered at once: INVALID_ARG, or UNAVAILABLE when busy)   queued)
        v
    the engine's thread: admit, prefill alone, ONE decode step [B, 1] for every running sequence
        | each graph call a BLS request (BlsGraph) to the graph model NAME_model, which the ONNX
        | Runtime backend serves; the KV cache never leaves the server
        v
    each token to the request's sink (Answers: decoding's Answer, sent as Triton's responses)

The same file is also NAME_openai/1/model.py, the generation model as Triton's own
OpenAI-compatible frontend (server/python/openai) calls a Python-backend model: its TensorRT-LLM
form of a request (text_input already in the chat template, max_tokens INT32, stream,
stop_words, temperature, top_p, seed UINT64, return_num_input_tokens / return_num_output_tokens,
each with a batch dim of 1), answered text_output and the usage (num_input_tokens,
num_output_tokens). Its config says which model it fronts (the parameter FRONTEND_OF); it holds
no engine of its own but passes each request to NAME through BLS, streamed, so both serve from
one engine and one cache, and NAME's own fields and dtypes stay as they are for its clients:

    frontend request --> NAME_openai (Frontend: read, a refusal answered at once)
        --> BLS, decoupled: NAME's generate request (stream: true) --> its responses, relayed:
            a delta of text each (stream), or the text whole at the end; the usage at the end

This host is the engine's GraphCall through BLS, which passes every tensor by copy through
Triton's shared memory: the store the engine keeps is numpy arrays in this process, sent to the
graph model and back each step. The in-place cache graph's store (written in place by `specc
serve`'s onnxruntime) would cross the same way, copied in and out; the repository serves the
model graph (generation.json's "inplace_graph" is null; docs/serving.md says why), and where it
names one, this file decodes with it through the engine's one choice (stores.choose_store).
"""
from __future__ import annotations

import json
import os
import threading
import time

import numpy as np

from specc_decoding.decoding import facts as decoding_facts
from specc_decoding.decoding.engine import ERROR, Engine
from specc_decoding.decoding.errors import Busy, DecodingError, Refused
from specc_decoding.decoding.graphs import GraphFacts
from specc_decoding.decoding.request import Answer, parse
from specc_decoding.decoding.text import ChatTemplate, Codec

try:  # the module Triton's Python backend provides; absent when a test imports this file
    import triton_python_backend_utils as pb_utils
except ImportError:
    pb_utils = None

FACTS_FILE = decoding_facts.FACTS_FILE
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG, CHAT_TEMPLATE = "tokenizer_config.json", "chat_template.jinja"  # beside tokenizer.json
CANCEL_POLL_S = 0.05  # how often a running request asks Triton whether its client went away
INTERNAL_ERROR = "internal error; the server's log has it"
FRONTEND_OF = "specc_frontend_of"  # NAME_openai's config parameter: the generation model it fronts

__all__ = ["Busy", "Engine", "Frontend", "Refused", "TritonPythonModel", "parse"]


class BlsGraph:
    """A graph model as the engine calls it (decoding.graphs.GraphCall): one BLS request to the
    model `name`, its tensors copied both ways (so it writes into nothing the engine gives).
    `infer(name, feeds, outputs)` sends it and returns Triton's response (pb_utils' by default);
    a failed call raises with "the graph model failed:" and Triton's message on one line."""

    writes_into = False

    def __init__(self, name: str, facts: GraphFacts, infer=None):
        self.name, self.facts = name, facts
        self.infer = infer or _bls
        self.memory = {}
        memory = getattr(pb_utils, "PreferredMemory", None)  # the graph's outputs come back in CPU memory
        if memory is not None:
            self.memory = {"preferred_memory": memory(pb_utils.TRITONSERVER_MEMORY_CPU, 0)}

    def __call__(self, feeds: dict, into=None) -> dict:
        names = list(self.facts.outputs)
        response = self.infer(self.name, feeds, names, **self.memory)
        if response.has_error():  # Triton's message may run over lines: its cause is on the next one
            raise RuntimeError("the graph model failed: " + " ".join(response.error().message().split()))
        return {n: pb_utils.get_output_tensor_by_name(response, n).as_numpy() for n in names}


def _bls(name: str, feeds: dict, outputs: list, **memory):
    request = pb_utils.InferenceRequest(
        model_name=name, requested_output_names=outputs,
        inputs=[pb_utils.Tensor(n, np.ascontiguousarray(v)) for n, v in feeds.items()], **memory)
    return request.exec()


def engine(generation: decoding_facts.Generation, infer=None) -> Engine:
    """The engine of generation.json's facts over BLS calls (`infer`: as BlsGraph takes it)."""
    inplace = None
    if generation.inplace is not None:
        inplace = BlsGraph(generation.inplace_model, generation.inplace, infer)
    return Engine(lambda: BlsGraph(generation.graph_model, generation.graph, infer), inplace,
                  generation.model, generation.limits)


class Answers:
    """One request's sink (decoding.engine.Sink): decoding's Answer sent as Triton's responses.
    `send(outputs, error, final)` delivers one (neither outputs nor error: only the final flag),
    `gone()` says whether the client went away (asked at most every CANCEL_POLL_S)."""

    def __init__(self, answer: Answer, send, gone):
        self.answer, self.send, self.gone = answer, send, gone
        self.checked = 0.0
        self.lost = False

    def token(self, token_id: int) -> bool:
        response, stopped = self.answer.token(token_id)
        if response is not None:
            self._send(response, None, False)
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
        self._send(self.answer.final(reason), None, True)

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
        except Exception:  # the client went away: the engine ends the row at its next iteration
            self.lost = True


class TritonPythonModel:
    """Triton's Python backend entry points: a decoupled model, one response per token when the
    request streams, else one at the end."""

    def initialize(self, args):
        parameters = json.loads(args.get("model_config") or "{}").get("parameters") or {}
        fronted = (parameters.get(FRONTEND_OF) or {}).get("string_value")
        self.frontend = Frontend(fronted) if fronted else None  # NAME_openai: no engine of its own
        if self.frontend is not None:
            return
        folder = os.path.join(args["model_repository"], args["model_version"])
        path = os.path.join(folder, FACTS_FILE)
        with open(path, encoding="utf-8") as f:
            try:
                self.generation = decoding_facts.from_json(json.load(f), path)
            except DecodingError as exc:
                raise RuntimeError(str(exc)) from None
        # the version folder, the model's, the repository's root (where a build keeps its tokenizer)
        self.codec = find_codec([folder, args["model_repository"], os.path.dirname(args["model_repository"])])
        self.engine = engine(self.generation)
        self.engine.start()

    def execute(self, requests):
        if self.frontend is not None:
            return self.frontend.execute(requests)
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs = {t.name(): t.as_numpy() for t in request.inputs()}
                parameters = json.loads(request.parameters() or "{}")
                parsed = parse(self.generation.endpoint, inputs, parameters, self.codec)
                answers = Answers(Answer(parsed, self.codec, np.object_), _sender(sender), _gone(request))
                self.engine.submit(parsed.request, answers)
            except Refused as exc:
                sender.send(_error(str(exc), "UNAVAILABLE" if exc.busy else "INVALID_ARG"),
                            flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            except Exception as exc:  # a bug of this file: one line to the client, the rest to Triton's log
                pb_utils.Logger.log_error(f"generate: {type(exc).__name__}: {exc}")
                sender.send(_error(INTERNAL_ERROR, "INTERNAL"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        return None

    def finalize(self):
        if self.frontend is None:
            self.engine.stop()


def find_codec(folders) -> Codec | None:
    """The first tokenizer.json in `folders`, with the chat template beside it (tokenizer_config.json's,
    or chat_template.jinja's: decoding's ChatTemplate reads them as `specc serve` does), or None
    where none has one. The template needs jinja2 in the Python backend's environment only when
    a request asks for it (`chat`)."""
    path = next((os.path.join(f, TOKENIZER_FILE) for f in folders
                 if os.path.isfile(os.path.join(f, TOKENIZER_FILE))), None)
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise RuntimeError(f"{path}: reading it needs the `tokenizers` package in the Python backend's "
                           "environment: pip install tokenizers") from None
    folder = os.path.dirname(path)
    config, text = {}, None
    if os.path.isfile(os.path.join(folder, TOKENIZER_CONFIG)):
        with open(os.path.join(folder, TOKENIZER_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    if os.path.isfile(os.path.join(folder, CHAT_TEMPLATE)):
        with open(os.path.join(folder, CHAT_TEMPLATE), encoding="utf-8") as f:
            text = f.read()
    return Codec(Tokenizer.from_file(path), ChatTemplate.of(config if isinstance(config, dict) else {}, text, _jinja))


def _jinja():
    """jinja2, for chat templates (ImportError where the backend's environment lacks it)."""
    import jinja2.sandbox

    return jinja2


class Frontend:
    """NAME_openai (the module's doc): the requests of Triton's OpenAI-compatible frontend, relayed to
    the generation model `generation` through BLS (`infer(name, inputs, outputs)` sends one,
    decoupled, and returns its responses; pb_utils' by default)."""

    # the frontend's fields (specc/spec/triton.py's FRONTEND_INPUTS) -> the generation model's
    OPTIONS = {"max_tokens": ("max_tokens", np.int64), "temperature": ("temperature", np.float32),
               "top_p": ("top_p", np.float32), "seed": ("seed", np.int64)}
    ASKED = ("text_output", "output_ids", "finish_reason", "prompt_tokens", "completion_tokens")

    def __init__(self, generation: str, infer=None):
        self.generation = generation
        self.infer = infer or _bls_stream

    def read(self, inputs: dict) -> tuple[dict, bool, bool]:
        """A frontend request's tensors ([1, ...] each) as the generation model's inputs, whether it
        streams, whether it asks for the usage; Refused with one line for what it does not take."""
        values = {name: np.asarray(v).reshape(-1) for name, v in inputs.items()}
        if "text_input" not in values or values["text_input"].size != 1:
            raise Refused("text_input: expected one text (the frontend's prompt)")
        for name in ("frequency_penalty", "presence_penalty"):
            if name in values and float(values[name][0]) != 0:
                raise Refused(f"{name}: penalties are not supported; leave it out or 0")
        out = {"text_input": np.array([values["text_input"][0]], dtype=np.object_),
               "stream": np.array([True])}
        for name, (to, dtype) in self.OPTIONS.items():
            if name in values:
                value = values[name][0]
                if name == "seed" and int(value) >= 2**63:
                    raise Refused(f"seed must be below 2**63, got {int(value)}")
                out[to] = np.array([value], dtype=dtype)
        if "stop_words" in values and values["stop_words"].size:
            out["stop"] = np.array(list(values["stop_words"]), dtype=np.object_)
        stream = bool(values["stream"][0]) if "stream" in values else False
        usage = any(bool(values[n][0]) for n in ("return_num_input_tokens", "return_num_output_tokens") if n in values)
        return out, stream, usage

    def execute(self, requests):
        for request in requests:
            sender = request.get_response_sender()
            try:
                inputs, stream, usage = self.read({t.name(): t.as_numpy() for t in request.inputs()})
            except Refused as exc:
                sender.send(_error(str(exc), "INVALID_ARG"), flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                continue
            threading.Thread(target=self.relay, args=(request, sender, inputs, stream, usage), daemon=True).start()
        return None

    def relay(self, request, sender, inputs: dict, stream: bool, usage: bool) -> None:
        """The generation model's responses to one request, relayed: each one's text as a response
        of its own (stream), or all of it in one; the usage with the last. A client that went away
        ends the relay, and the generation model's request with it where BLS can cancel it."""
        final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        gone = _gone(request)
        pieces, counts = [], None
        try:
            responses = self.infer(self.generation, inputs, list(self.ASKED))
            for response in responses:
                if gone():
                    getattr(responses, "cancel", lambda: None)()
                    sender.send(None, final)
                    return
                if response.has_error():
                    error = response.error()
                    code = {getattr(pb_utils.TritonError, "UNAVAILABLE", None): "UNAVAILABLE",
                            getattr(pb_utils.TritonError, "INVALID_ARG", None): "INVALID_ARG"}.get(
                        getattr(error, "code", lambda: None)(), "INVALID_ARG")
                    sender.send(_error(error.message(), code), flags=final)
                    return
                got = {t: pb_utils.get_output_tensor_by_name(response, t) for t in self.ASKED}
                piece = _text(got["text_output"])
                if got["finish_reason"] is not None:
                    counts = (int(got["prompt_tokens"].as_numpy().reshape(-1)[0]),
                              int(got["completion_tokens"].as_numpy().reshape(-1)[0]))
                if stream and counts is None:
                    if piece:
                        sender.send(_frontend_response(piece), 0)
                elif not stream:
                    pieces.append(piece)
                if counts is not None:
                    text = piece if stream else "".join(pieces)
                    sender.send(_frontend_response(text, counts if usage else None), final)
                    return
            sender.send(_error("the generation model ended without a final response", "INTERNAL"), flags=final)
        except Exception as exc:  # a bug of this file, or BLS failing: one line to the client
            pb_utils.Logger.log_error(f"openai frontend relay: {type(exc).__name__}: {exc}")
            try:
                sender.send(_error(INTERNAL_ERROR, "INTERNAL"), flags=final)
            except Exception:  # noqa: S110 - the request is gone already
                pass


def _text(tensor) -> str:
    if tensor is None:
        return ""
    value = np.asarray(tensor.as_numpy()).reshape(-1)
    return bytes(value[0]).decode("utf-8") if value.size else ""


def _frontend_response(text: str, counts=None):
    """One response to the frontend: text_output [1, 1] (its batch dim), and the usage as it reads
    it (num_input_tokens, num_output_tokens, INT32) where given."""
    tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))]
    if counts is not None:
        tensors += [pb_utils.Tensor("num_input_tokens", np.array([[counts[0]]], dtype=np.int32)),
                    pb_utils.Tensor("num_output_tokens", np.array([[counts[1]]], dtype=np.int32))]
    return pb_utils.InferenceResponse(output_tensors=tensors)


def _bls_stream(name: str, inputs: dict, outputs: list):
    """One decoupled BLS request to the model `name`: its responses, as they come."""
    request = pb_utils.InferenceRequest(model_name=name, requested_output_names=outputs,
                                        inputs=[pb_utils.Tensor(n, v) for n, v in inputs.items()])
    return request.exec(decoupled=True)


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
