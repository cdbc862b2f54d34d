"""specc/runtime/openai_api.py without a server: the OpenAI-compatible API over a Scheduler of a
tiny chat build (a real byte-level BPE tokenizer with a ChatML template, tests/helpers/
chattokenizer.py). A chat answers the greedy tokens `specc generate --chat` gives the same
message; streamed, it is OpenAI's chunks (role first, the text, finish_reason, the usage chunk,
[DONE]); stop strings cut the text as OpenAI cuts it; every malformed body is refused 400 with
OpenAI's error object naming the field; an unknown model 404; a full server 503 with Retry-After;
a client gone frees its place. (With a real server and the `openai` package:
tests/runtime/test_openai_serve.py.)"""
from __future__ import annotations

import json
import threading
import time

import pytest

import specc
from specc.decoding.request import Request
from specc.runtime import Session
from specc.runtime.endpoint import text_codec
from specc.runtime.openai_api import OpenAIApi, read_chat, read_completion
from specc.runtime.scheduler import GenerationLimits, Scheduler
from tests.helpers.chattokenizer import DEFAULT_SYSTEM, chat_spec

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

MODEL = "tiny-chat"


@pytest.fixture(scope="module")
def chat_build(tmp_path_factory):
    root = tmp_path_factory.mktemp("openai")
    return specc.build(chat_spec(root), root / MODEL).out_dir


@pytest.fixture(scope="module")
def session(chat_build):
    return Session(chat_build)


def api_of(session, **limits) -> OpenAIApi:
    scheduler = Scheduler(session, GenerationLimits(**{"max_sequences": 4, "max_cache_tokens": 512,
                                                      "max_waiting": 64, **limits}))
    scheduler.start()
    return OpenAIApi(MODEL, scheduler, text_codec(session))


@pytest.fixture()
def api(session):
    api = api_of(session)
    yield api
    api.scheduler.stop()


def post(api: OpenAIApi, path: str, body, gone: threading.Event | None = None):
    """(status, headers, the JSON answer or the list of SSE events' payloads)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = api.handle("POST", path, data, gone or threading.Event())
    if reply.chunks is None:
        return reply.status, reply.headers, json.loads(reply.data)
    events = [c.decode() for c in reply.chunks]
    assert all(e.startswith("data: ") and e.endswith("\n\n") for e in events), events
    return reply.status, reply.headers, [e[6:-2] if e[6:-2] == "[DONE]" else json.loads(e[6:-2]) for e in events]


def chat_alone(session, messages, n):
    """What `specc generate --chat` does for one message: the template's ids, greedy, the spec's eos."""
    tok = session.tokenizer
    ids = tok.prompts([tok.chat(messages)], add_special_tokens=False)[0]
    new = session.generate(ids, max_new_tokens=n).new_ids[0]
    return ids, new


def test_chat_answers_what_generate_chat_gives_the_message(api, session):
    for text, n in [("What is the capital of France?", 12), ("Write a haiku about rain.", 20), ("Hi", 5)]:
        messages = [{"role": "user", "content": text}]
        ids, new = chat_alone(session, messages, n)
        status, _, got = post(api, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": n})
        assert status == 200, got
        choice = got["choices"][0]
        assert choice["message"] == {"role": "assistant", "content": session.tokenizer.decode(new)}
        assert choice["finish_reason"] == ("stop" if new[-1] == session.info.tokens.eos else "length")
        assert got["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(new),
                                "total_tokens": len(ids) + len(new)}
        assert got["object"] == "chat.completion" and got["model"] == MODEL and got["id"].startswith("chatcmpl-")
    # the conversation as the template renders it: system, user and assistant turns
    turns = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Colour of sky?"},
             {"role": "assistant", "content": "Blue."}, {"role": "developer", "content": "Be terse."},
             {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "grass?"}]}]
    read = [dict(t, role="system" if t["role"] == "developer" else t["role"]) for t in turns]
    read[-1]["content"] = "And grass?"
    ids, new = chat_alone(session, read, 8)
    assert DEFAULT_SYSTEM not in session.tokenizer.chat(read)
    _, _, got = post(api, "/v1/chat/completions", {"model": MODEL, "messages": turns, "max_completion_tokens": 8})
    assert got["choices"][0]["message"]["content"] == session.tokenizer.decode(new)
    assert got["usage"]["prompt_tokens"] == len(ids)


def test_a_speculative_chat_answers_what_a_plain_one_does(api, session):
    """`speculative` in the body (the openai package's extra_body) drafts by prompt lookup: the
    same greedy answer, streamed or not."""
    messages = [{"role": "user", "content": "Repeat after me: the cat sat on the mat, the cat sat on the mat."}]
    ids, new = chat_alone(session, messages, 24)
    for stream in (False, True):
        body = {"model": MODEL, "messages": messages, "max_tokens": 24, "speculative": "ngram", "stream": stream}
        status, _, got = post(api, "/v1/chat/completions", body)
        assert status == 200, got
        text = got["choices"][0]["message"]["content"] if not stream else \
            "".join(c["choices"][0]["delta"].get("content", "") for c in got[:-1] if c["choices"])
        assert text == session.tokenizer.decode(new)


def test_a_streamed_chat_is_openai_chunks_ending_in_done(api, session):
    messages = [{"role": "user", "content": "Tell me a story."}]
    ids, new = chat_alone(session, messages, 15)
    status, headers, events = post(api, "/v1/chat/completions", {
        "model": MODEL, "messages": messages, "max_tokens": 15, "stream": True, "stream_options": {"include_usage": True}})
    assert status == 200 and headers["Content-Type"] == "text/event-stream"
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}
    assert all(c["usage"] is None for c in chunks[:-1])  # include_usage: null on every other chunk
    last = chunks[-2]["choices"][0]
    assert last["delta"] == {} and last["finish_reason"] == "length"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-2])
    assert text == session.tokenizer.decode(new)
    # without include_usage: no usage at all
    _, _, events = post(api, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 3,
                                                      "stream": True})
    assert events[-1] == "[DONE]" and all("usage" not in c for c in events[:-1])


def test_stop_strings_cut_the_text_before_them(api, session):
    messages = [{"role": "user", "content": "Count to ten."}]
    _, new = chat_alone(session, messages, 20)
    full = session.tokenizer.decode(new)
    stop = full[7:9]
    want = full[:full.index(stop)]
    for stream in (False, True):
        _, _, got = post(api, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 20,
                                                       "stop": [stop, "never in it \u2603"], "stream": stream})
        if stream:
            text = "".join(c["choices"][0]["delta"].get("content", "") for c in got[1:-1] if c["choices"])
            reason = got[-2]["choices"][0]["finish_reason"]
        else:
            text, reason = got["choices"][0]["message"]["content"], got["choices"][0]["finish_reason"]
        assert text == want and reason == "stop", (stream, got)


def test_completions_take_text_or_ids(api, session):
    tok = session.tokenizer
    prompt = "The quick brown fox"
    ids = tok.prompts([prompt])[0]
    new = session.generate(ids, max_new_tokens=16).new_ids[0]  # OpenAI's default max_tokens: 16
    for given in (prompt, [prompt], ids, [ids]):
        status, _, got = post(api, "/v1/completions", {"model": MODEL, "prompt": given})
        assert status == 200, got
        assert got["object"] == "text_completion" and got["choices"][0]["text"] == tok.decode(new)
        assert got["usage"]["completion_tokens"] == len(new) == 16 and got["choices"][0]["finish_reason"] == "length"
    _, _, events = post(api, "/v1/completions", {"model": MODEL, "prompt": prompt, "stream": True, "max_tokens": 16})
    assert events[-1] == "[DONE]" and "".join(e["choices"][0]["text"] for e in events[:-1]) == tok.decode(new)


def test_models_and_routes(api):
    reply = api.handle("GET", "/v1/models", b"", threading.Event())
    assert reply.status == 200 and json.loads(reply.data)["data"][0]["id"] == MODEL
    assert api.handle("GET", f"/v1/models/{MODEL}", b"", threading.Event()).status == 200
    embed = json.dumps({"model": MODEL, "input": "hi"}).encode()  # a chat build has no sentence embedding
    for method, path, status, code, body in [("GET", "/v1/models/gpt-4", 404, "model_not_found", b"{}"),
                                             ("GET", "/v1/nothing", 404, "not_found", b"{}"),
                                             ("GET", "/v1/chat/completions", 405, "method_not_allowed", b"{}"),
                                             ("POST", "/v1/embeddings", 400, "model_not_supported", embed)]:
        reply = api.handle(method, path, body, threading.Event())
        error = json.loads(reply.data)["error"]
        assert reply.status == status and error["code"] == code and error["message"], (path, error)


GOOD = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize("body,status,param,start", [
    (b"not json", 400, None, "the request body is not JSON"),
    (b'{"model": "tiny-chat", "messages": "\xff"}', 400, None, "the request body is not UTF-8 text"),
    (b"[1]", 400, None, "the request body is an array [1]; expected a JSON object"),
    ({**GOOD, "model": "gpt-4"}, 404, "model", "the model 'gpt-4' does not exist"),
    ({"messages": GOOD["messages"]}, 400, "model", "model: required"),
    ({**GOOD, "messages": []}, 400, "messages", "messages: expected a non-empty array"),
    ({**GOOD, "messages": [{"role": "user"}]}, 400, "messages[0].content", "messages[0].content: expected a string"),
    ({**GOOD, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role", "messages[0].role: expected one of"),
    ({**GOOD, "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0]", "messages[0].content[0]: only text parts"),
    ({**GOOD, "messages": [{"role": "user", "content": "x", "mood": "happy"}]}, 400, "messages[0].mood", "messages[0].mood: unknown field"),
    ({**GOOD, "max_token": 5}, 400, "max_token", "max_token: unknown field"),
    ({**GOOD, "max_tokens": "5"}, 400, "max_tokens", 'max_tokens: expected an integer, got a string "5"'),
    ({**GOOD, "max_tokens": 0}, 400, "max_tokens", "max_tokens: must be at least 1"),
    ({**GOOD, "max_tokens": 500}, 400, "max_tokens", "prompt (36 tokens) + max_tokens (500) is past the 128 positions"),
    ({**GOOD, "temperature": 3}, 400, "temperature", "temperature: must be in [0, 2]"),
    ({**GOOD, "temperature": True}, 400, "temperature", "temperature: expected a number, got a boolean"),
    ({**GOOD, "top_p": 0}, 400, "top_p", "top_p: must be in (0, 1]"),
    ({**GOOD, "seed": 1.5}, 400, "seed", "seed: expected an integer"),
    ({**GOOD, "stop": 5}, 400, "stop", "stop: expected a string or an array of strings"),
    ({**GOOD, "stop": [""]}, 400, "stop", "stop: at most 16 strings"),
    ({**GOOD, "n": 2}, 400, "n", "n: only one choice per request"),
    ({**GOOD, "logprobs": True}, 400, "logprobs", "logprobs: log probabilities are not supported"),
    ({**GOOD, "tools": [{"type": "function"}]}, 400, "tools", "tools: tools are not supported"),
    ({**GOOD, "stream": "yes"}, 400, "stream", "stream: expected true or false"),
    ({**GOOD, "stream_options": {"include_usage": True}}, 400, "stream_options", "stream_options: only with stream: true"),
    ({**GOOD, "messages": [{"role": "user", "content": "word " * 200}]}, 400, "messages", "messages: "),
    ({**GOOD, "speculative": 3}, 400, "speculative", "speculative: expected a drafter's name"),
    ({**GOOD, "speculative": "lookahead"}, 400, "speculative", "speculative: unknown drafter 'lookahead'"),
])
def test_malformed_chat_bodies_are_refused_naming_the_field(api, body, status, param, start):
    got_status, _, got = post(api, "/v1/chat/completions", body)
    error = got["error"]
    assert got_status == status and error["message"].startswith(start), error
    assert error["param"] == param, error
    assert error["type"] == ("invalid_request_error" if status in (400, 404) else error["type"])
    assert "\n" not in error["message"] and "Traceback" not in error["message"]
    # the API goes on
    assert post(api, "/v1/chat/completions", {**GOOD, "max_tokens": 2})[0] == 200


@pytest.mark.parametrize("body,start", [
    ({"model": MODEL}, "prompt: expected a string or an array of token ids"),
    ({"model": MODEL, "prompt": ""}, "prompt: empty"),
    ({"model": MODEL, "prompt": ["a", "b"]}, "prompt: one prompt per request"),
    ({"model": MODEL, "prompt": [1, 5000]}, "prompt: token id(s) [5000] outside the vocabulary"),
    ({"model": MODEL, "prompt": "x", "echo": True}, "echo: echo is not supported"),
    ({"model": MODEL, "prompt": "x", "messages": []}, "messages: unknown field"),
])
def test_malformed_completion_bodies_are_refused(api, body, start):
    status, _, got = post(api, "/v1/completions", body)
    assert status == 400 and got["error"]["message"].startswith(start), got


def test_the_defaults_openai_clients_send_are_taken():
    """What the openai package, LangChain and LlamaIndex put in a body at their defaults."""
    _, ask = read_chat(json.dumps({**GOOD, "n": 1, "temperature": 0.7, "top_p": 1, "frequency_penalty": 0,
                                   "presence_penalty": 0.0, "logprobs": False, "user": "u1", "stream": False,
                                   "response_format": {"type": "text"}, "tool_choice": "none", "seed": 3,
                                   "stop": "\n", "max_tokens": None}).encode())
    assert ask.temperature == 0.7 and ask.top_p == 1 and ask.seed == 3 and ask.stop == ("\n",) and ask.max_tokens is None
    _, ask = read_completion(json.dumps({"model": MODEL, "prompt": "x", "best_of": 1, "echo": False,
                                         "suffix": None, "logprobs": None}).encode())
    assert ask.prompt == "x"


class _Held:
    """A sink that takes every token and is told the end."""

    def __init__(self):
        self.tokens, self.ended = [], threading.Event()

    def token(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return True

    def done(self, reason: str, error: str | None = None) -> None:
        self.ended.set()


def test_a_full_server_answers_503_with_retry_after(session, monkeypatch):
    for graph in (session.inplace, session.graphs["model"]):  # a step takes 50 ms at least, so the
        if graph is not None:                                  # request holding the place outlasts the test
            run = graph.run
            monkeypatch.setattr(graph, "run", lambda feeds, into=None, run=run: (time.sleep(0.05), run(feeds, into))[1])
    api = api_of(session, max_sequences=1, max_waiting=0)
    try:
        held = _Held()  # the one place, taken by a request no eos ends (a chat's own may end it at once)
        ticket = api.scheduler.submit(Request(ids=(5, 6, 7), max_tokens=120, eos=-1), held)
        deadline = time.monotonic() + 10
        while not held.tokens:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        status, headers, got = post(api, "/v1/chat/completions", {**GOOD, "max_tokens": 2})
        assert status == 503 and headers["Retry-After"] == "1" and got["error"]["type"] == "unavailable_error"
        assert got["error"]["message"].startswith("server busy")
        api.scheduler.cancel(ticket)  # it goes away: its place comes free
        assert held.ended.wait(10)
        assert post(api, "/v1/chat/completions", {**GOOD, "max_tokens": 2})[0] == 200
        assert api.scheduler.stats.finished["cancelled"] == 1
        api.scheduler.close()
        status, headers, got = post(api, "/v1/completions", {"model": MODEL, "prompt": "x"})
        assert status == 503 and got["error"]["message"].startswith("server shutting down")
    finally:
        api.scheduler.stop()


def test_a_build_that_does_not_generate_says_so(session):
    api = OpenAIApi("minilm", None, None)
    reply = api.handle("GET", "/v1/models", b"", threading.Event())
    assert json.loads(reply.data)["data"] == []
    reply = api.handle("POST", "/v1/chat/completions", json.dumps({**GOOD, "model": "minilm"}).encode(), threading.Event())
    assert reply.status == 404 and "not a text generation model" in json.loads(reply.data)["error"]["message"]
    reply = api.handle("POST", "/v1/embeddings", json.dumps({"model": "minilm", "input": "x"}).encode(),
                       threading.Event())
    assert reply.status == 400 and "no sentence_embedding output" in json.loads(reply.data)["error"]["message"]


def test_the_chat_template_renders_as_transformers_renders_it(session, chat_build):
    """The build's template through decoding's ChatTemplate (what every host renders with), against
    transformers' apply_chat_template on the same tokenizer files: the same text and ids."""
    transformers = pytest.importorskip("transformers")
    ref = transformers.PreTrainedTokenizerFast.from_pretrained(str(chat_build))
    codec = text_codec(session)
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "h\u00e9llo \u65e5\u672c"},
                      {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "Again?"}]):
        want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert session.tokenizer.chat(messages) == want
        ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        assert codec.chat(messages) == list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_a_conversations_next_turn_reuses_its_prefix(api, session):
    """A chat client re-sends the conversation each turn: the second turn's prompt begins with the
    first's, whose K/V the engine's prefix cache kept; the answer is the one without it."""
    system = {"role": "system", "content": "You are a patient tutor who explains the Python language reference "
                                           "in plain words, with one short example for every answer you give."}
    first = [system, {"role": "user", "content": "What does a for statement do?"}]
    _, _, got = post(api, "/v1/chat/completions", {"model": MODEL, "messages": first, "max_tokens": 10})
    second = first + [{"role": "assistant", "content": got["choices"][0]["message"]["content"]},
                      {"role": "user", "content": "And a while statement?"}]
    before = api.scheduler.stats.reused
    _, _, again = post(api, "/v1/chat/completions", {"model": MODEL, "messages": second, "max_tokens": 10})
    ids, new = chat_alone(session, second, 10)
    assert again["choices"][0]["message"]["content"] == session.tokenizer.decode(new)
    assert api.scheduler.stats.reused - before >= (got["usage"]["prompt_tokens"] // 16) * 16 - 16


def test_the_load_benchmarks_chat_reader_reads_this_stream(api, session):
    """benchmarks/serve_load.py's ChatStream, fed this API's streamed chunks as the client reads
    them: the reply's text, one arrival per content chunk, the usage chunk's counts, [DONE]."""
    from benchmarks.serve_load import ChatStream

    messages = [{"role": "user", "content": "Tell me a story."}]
    ids, new = chat_alone(session, messages, 12)
    for include_usage in (True, False):
        body = {"model": MODEL, "messages": messages, "max_tokens": 12, "stream": True}
        if include_usage:
            body["stream_options"] = {"include_usage": True}
        reply = api.handle("POST", "/v1/chat/completions", json.dumps(body).encode(), threading.Event())
        chunks = list(reply.chunks)
        stream = ChatStream()
        ends = [stream.feed(line, float(k)) for k, c in enumerate(chunks) for line in c.splitlines(keepends=True)]
        assert ends.count(True) == 1 and stream.done and stream.text == session.tokenizer.decode(new)
        contents = [k for k, c in enumerate(chunks) if b'"content":"' in c and b'"content":""' not in c]
        assert stream.times == [float(k) for k in contents]  # the role chunk's empty content is no token
        if include_usage:
            assert stream.usage["prompt_tokens"] == len(ids) and stream.tokens == len(new)
        else:
            assert stream.usage is None and stream.tokens == len(contents)
    with pytest.raises(RuntimeError, match="generation failed"):
        ChatStream().feed(b'data: {"error": {"message": "generation failed: x", "code": null}}\n', 0.0)
