"""`specc serve` on a decoder: the generation model (Triton's generate extension and gRPC
streaming) on a real server. Concurrent requests of different lengths, over HTTP generate,
generate_stream and gRPC streaming, answer the tokens Session.generate gives each alone; text in
and out through the build's tokenizer.json; malformed requests are refused with a message and the
server goes on; a soak of mixed requests loses none; a client that goes away mid-stream frees its
place; SIGTERM lets running requests finish and refuses new ones (503)."""
from __future__ import annotations

import http.client
import json
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import specc
from tests.runtime.test_serve import ROOT, Server, needs_serve_env

pytest.importorskip("onnxruntime")


BUSY = (400, 503)


def generate(port: int, model: str, body, stream: bool = False, timeout: float = 60) -> tuple[int, object]:
    """(status, answer) of POST /generate (a JSON object) or /generate_stream (the list of SSE
    events' objects). `body` is a dict, or raw bytes sent as they are."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", f"/v2/models/{model}/{'generate_stream' if stream else 'generate'}", body=data)
    answer = conn.getresponse()
    raw = answer.read().decode()
    conn.close()
    if answer.status == 200 and not raw.startswith("data:"):
        got = json.loads(raw)  # Triton writes a one-element array as its element
        return answer.status, {**got, "output_ids": np.atleast_1d(got.get("output_ids", [])).tolist()}
    if raw.startswith("data:"):  # server-sent events; a refusal is the first (and only) one
        events = [json.loads(line[5:]) for line in raw.splitlines() if line.startswith("data:")]
        return answer.status, events if answer.status == 200 and "error" not in events[0] else events[0]
    return answer.status, json.loads(raw)


def joined(events: list[dict]) -> dict:
    """A stream's events as one answer: ids and text joined, the last event's reason and counts."""
    ids = [i for e in events for i in np.atleast_1d(e.get("output_ids", [])).tolist()]
    out = {"output_ids": ids, **{k: events[-1][k] for k in ("finish_reason", "prompt_tokens", "completion_tokens")}}
    if any("text_output" in e for e in events):
        out["text_output"] = "".join(e.get("text_output", "") for e in events)
    return out


def grpc_generate(port: int, model: str, fields: dict) -> dict:
    """One streamed request over gRPC (tritonclient's bidirectional stream), joined."""
    import tritonclient.grpc as grpcclient

    dtypes = {"input_ids": ("INT64", np.int64), "max_tokens": ("INT64", np.int64), "eos": ("INT64", np.int64),
              "stream": ("BOOL", np.bool_), "text_input": ("BYTES", np.object_)}
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    try:
        inputs = []
        for name, value in fields.items():
            dtype, np_dtype = dtypes[name]
            arr = np.array(value if isinstance(value, list) else [value], dtype=np_dtype)
            t = grpcclient.InferInput(name, list(arr.shape), dtype)
            t.set_data_from_numpy(arr)
            inputs.append(t)
        client.async_stream_infer(model, inputs)
        events = []
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                return {"error": error.message()}
            event = {}
            for name in ("output_ids", "text_output", "finish_reason", "prompt_tokens", "completion_tokens"):
                value = result.as_numpy(name)
                if value is not None:
                    event[name] = value.tolist() if name == "output_ids" else \
                        (value[0].decode() if value.dtype == object else int(value[0]))
            events.append(event)
            if "finish_reason" in event:
                return joined(events)
    finally:
        client.stop_stream()
        client.close()


def word_tokenizer(path):
    """A tokenizer.json whose word `tokN` is id N (a vocabulary of 1000), words joined by spaces."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab={f"tok{i}": i for i in range(1000)}, unk_token="tok0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path))
    return tok


def prompts(seed: int, n: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(0, 999, size=int(rng.integers(1, 25))).tolist(), int(rng.integers(1, 20))) for _ in range(n)]


@needs_serve_env
def test_generate_endpoint_answers_concurrent_requests_like_session_generate(tmp_path):
    """24 concurrent requests, a third each over generate, generate_stream and gRPC streaming,
    4 decoded at once: each answer is Session.generate's for that prompt alone; text in and
    out; stop strings; then the client mistakes, each refused with one line while the server
    goes on; then a soak of 300 mixed requests from 16 clients, every good one answered right."""
    from specc.runtime import Session

    (tmp_path / "tok").mkdir()
    tok = word_tokenizer(tmp_path / "tok" / "tokenizer.json")  # the build's, hash-checked as Session checks it
    spec = tmp_path / "tiny-gpt2.yaml"
    spec.write_text("specc: 1\nname: tiny-gpt2\nextends: tiny-gpt2\ntokenizer: tok\n")
    build = specc.build(spec, tmp_path / "tiny-gpt2").out_dir
    session = Session(build)
    model = "tiny-gpt2"

    def alone(ids, n):
        return session.generate(ids, max_new_tokens=n, eos_id=-1).new_ids[0]

    cases = prompts(0, 24)
    want = [alone(ids, n) for ids, n in cases]
    server = Server(build, "--max-sequences", "4")
    try:
        assert "tiny-gpt2 generates (text or ids; 4 sequences at once" in server.output()

        def ask(i: int) -> dict:
            ids, n = cases[i]
            body = {"input_ids": ids, "max_tokens": n, "eos": -1}
            if i % 3 == 0:
                status, answer = generate(server.http, model, body)
                assert status == 200, answer
                return answer
            if i % 3 == 1:
                status, events = generate(server.http, model, {**body, "stream": True}, stream=True)
                assert status == 200 and len(events) == n + 1, events  # a token each, then the end
                return joined(events)
            return grpc_generate(server.grpc, model, {**body, "stream": True})

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(len(cases))))
        for (ids, n), w, got in zip(cases, want, answers):
            assert got["output_ids"] == w, got
            assert got["finish_reason"] == "length" and got["prompt_tokens"] == len(ids) and got["completion_tokens"] == n

        # text in, text out (the build's tokenizer.json), whole and streamed
        text = "tok5 tok9 tok2 tok77"
        ids = alone(tok.encode(text).ids, 12)
        status, answer = generate(server.http, model, {"text_input": text, "max_tokens": 12, "eos": -1})
        assert status == 200 and answer["output_ids"] == ids and answer["text_output"] == tok.decode(ids), answer
        status, events = generate(server.http, model, {"text_input": text, "max_tokens": 12, "eos": -1, "stream": True},
                                  stream=True)
        assert joined(events)["text_output"] == tok.decode(ids)
        # a stop string: the text ends before it, finish_reason stop
        stop = tok.decode(ids[4:6])
        status, answer = generate(server.http, model, {"text_input": text, "max_tokens": 12, "eos": -1, "stop": [stop]})
        full = tok.decode(ids)
        assert answer["finish_reason"] == "stop" and answer["text_output"] == full[:full.index(stop)], answer
        # the spec's eos (999) ends a request early where the model makes it
        status, answer = generate(server.http, model, {"input_ids": [5, 9, 2], "max_tokens": 30})
        assert answer["output_ids"] == session.generate([5, 9, 2], max_new_tokens=30).new_ids[0]

        mistakes = [  # body, (statuses), the start of the message
            ({"input_ids": [5, 9], "max_token": 4}, (400,), "unknown field 'max_token'"),
            ({"input_ids": [5, 9], "max_tokens": 0}, (400,), "max_tokens must be at least 1, got 0"),
            ({"input_ids": [5, 9], "max_tokens": 127}, (400,), "prompt (2 tokens) + max_tokens (127) is past the 128"),
            ({"input_ids": [5, 9], "max_tokens": 2 ** 40}, (400,), "prompt (2 tokens) + max_tokens (1099511627776)"),
            ({"input_ids": [5, 5000]}, (400,), "input_ids: token id(s) [5000] outside the vocabulary (0..999)"),
            ({"input_ids": [-1]}, (400,), "input_ids: token id(s) [-1] outside the vocabulary"),
            ({"input_ids": []}, (400,), "input_ids: empty tensor"),
            ({"text_input": ""}, (400,), "text_input: empty"),
            ({"text_input": "tok1", "input_ids": [1]}, (400,), "give the prompt as text_input or as input_ids"),
            ({}, (400,), "give the prompt as text_input or as input_ids"),
            ({"input_ids": [1], "temperature": -1}, (400,), "temperature must be >= 0"),
            ({"input_ids": [1], "top_p": 1.5}, (400,), "top_p must be in (0, 1]"),
            ({"input_ids": [1], "top_k": 0}, (400,), "top_k must be at least 1"),
            ({"input_ids": [1], "seed": -3, "temperature": 1}, (400,), "seed must be an integer >= 0"),
            ({"input_ids": [1], "foo": [1, 2]}, (400,), "parameter 'foo' has invalid type"),
            # what Triton's HTTP frontend would answer 500 is refused by specc serve's front first
            ({"input_ids": [1], "max_tokens": [1, 2]}, (400,), "max_tokens: expected a 64-bit integer, got an array [1, 2]"),
            ({"input_ids": [1], "max_tokens": "four"}, (400,), 'max_tokens: expected a 64-bit integer, got a string "four"'),
            ({"input_ids": [1.5]}, (400,), "input_ids: expected an array of token ids (integers) or one, got an array [1.5]"),
            ({"input_ids": [1], "stream": "yes"}, (400,), "stream: expected true or false"),
            ({"text_input": 5}, (400,), "text_input: expected a string, got an integer 5"),
            (b'{"text_input": "\xff\xfe"}', (400,), "the request body is not UTF-8 text (byte 16"),
            (b"not json", (400,), "the request body is not JSON (Expecting value at line 1, column 1)"),
            (b"[1, 2]", (400,), "the request body is an array; the generate endpoint takes a JSON object"),
        ]
        for body, statuses, start in mistakes:
            for stream in (False, True):
                status, answer = generate(server.http, model, body, stream=stream)
                assert status in statuses and isinstance(answer, dict) and answer["error"].startswith(start), \
                    (body, stream, status, answer)
                message = answer["error"]
                assert "\n" not in message and "Traceback" not in message and str(ROOT) not in message, message
            status, answer = generate(server.http, model, {"input_ids": cases[0][0], "max_tokens": cases[0][1], "eos": -1})
            assert status == 200 and answer["output_ids"] == want[0]
        # over gRPC, text that is not UTF-8 is the model's refusal
        bad = grpc_generate(server.grpc, model, {"text_input": b"\xff\xfe tok1", "stream": True})
        assert bad["error"].startswith("text_input: not UTF-8 text"), bad

        # the soak: 300 requests from 16 clients, one in ten a mistake; every good one answered,
        # its greedy tokens those of the prompt alone
        soak = prompts(1, 300)
        soak_want = {i: alone(ids, n) for i, (ids, n) in enumerate(soak) if i % 10}

        def soak_one(i: int):
            ids, n = soak[i]
            if i % 10 == 0:
                return generate(server.http, model, {"input_ids": ids + [4000], "max_tokens": n})
            if i % 4 == 1:
                return 200, grpc_generate(server.grpc, model, {"input_ids": ids, "max_tokens": n, "eos": -1,
                                                                "stream": True})
            if i % 4 == 2:
                status, events = generate(server.http, model, {"input_ids": ids, "max_tokens": n, "eos": -1,
                                                               "stream": True}, stream=True)
                return status, joined(events) if status == 200 else events
            return generate(server.http, model, {"input_ids": ids, "max_tokens": n, "eos": -1})

        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            results = list(pool.map(soak_one, range(len(soak))))
        assert time.monotonic() - t0 < 120
        for i, (status, answer) in enumerate(results):
            if i % 10 == 0:
                assert status == 400 and "outside the vocabulary" in answer["error"], answer
            else:
                assert status == 200 and answer["output_ids"] == soak_want[i], (i, answer)
        assert server.proc.poll() is None
    finally:
        code = server.stop()
    assert code == 0, server.output()
    out = server.output()
    assert "Traceback" not in out
    assert "finished: " in out and "cancelled" not in out, out


@needs_serve_env
def test_a_client_that_goes_away_frees_its_place_and_sigterm_drains(tmp_path, spec_file):
    """One place (--max-sequences 1, nothing waits): a stream whose client disconnects is ended
    (cancelled) and its place serves the next request at once. Then SIGTERM: the running
    request finishes whole, a new one is refused 503, and the server exits 0."""
    spec = spec_file("""\
        specc: 1
        name: long-llama
        extends: tiny-llama
        position: {kind: rotary, max_length: 2048}
        serving:
          length: {min: 1, opt: 32, max: 2048}
        """, name="long-llama.yaml")
    build = specc.build(spec, tmp_path / "long-llama").out_dir
    model = "long-llama"
    server = Server(build, "--max-sequences", "1", "--max-waiting", "0")
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
        conn.request("POST", f"/v2/models/{model}/generate_stream",
                     body=json.dumps({"input_ids": [1, 2, 3], "max_tokens": 2000, "eos": -1, "stream": True}))
        answer = conn.getresponse()
        assert answer.status == 200
        seen = 0
        while seen < 3:
            seen += answer.fp.readline().startswith(b"data:")
        # the place is taken: another request is refused at once (Triton's UNAVAILABLE; the bundled
        # server's Python backend answers it 400, docs/serving.md)
        status, busy = generate(server.http, model, {"input_ids": [4], "max_tokens": 2})
        assert status in BUSY and busy["error"].startswith("server busy"), (status, busy)
        conn.sock.close()  # the client goes away mid-stream
        conn.close()
        deadline = time.monotonic() + 20
        while True:  # its place comes free long before its 2000 tokens could be made
            status, answer = generate(server.http, model, {"input_ids": [4], "max_tokens": 2, "eos": -1})
            if status == 200:
                break
            assert status in BUSY and time.monotonic() < deadline, answer
            time.sleep(0.05)

        # SIGTERM while a request runs: it finishes whole; a new one is refused
        results: dict = {}

        def running():
            results["long"] = generate(server.http, model, {"input_ids": [7, 8], "max_tokens": 1800, "eos": -1,
                                                             "stream": True}, stream=True)

        thread = threading.Thread(target=running)
        thread.start()
        time.sleep(0.5)
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        status, answer = generate(server.http, model, {"input_ids": [4], "max_tokens": 2})
        assert status in BUSY and "shutting down" in answer["error"], (status, answer)
        thread.join(120)
        status, events = results["long"]
        assert status == 200 and joined(events)["completion_tokens"] == 1800 and joined(events)["finish_reason"] == "length"
        assert server.proc.wait(timeout=90) == 0, server.output()
    finally:
        if server.proc.poll() is None:
            server.stop()
    out = server.output()
    assert "Traceback" not in out and "1 cancelled" in out, out
