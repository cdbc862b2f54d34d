"""`specc serve`'s OpenAI-compatible API on a real server, with the clients people use: the official
`openai` package (sync, streaming, async, 16 concurrent streams; run in the serve environment,
where the `serve` extra installs it: tests/runtime/openai_clients.py) and curl. Every answer is
the text `specc generate --chat` gives the same message; malformed bodies get a 4xx with a message
and the server goes on; a client that disconnects mid-stream frees its place; a full server
answers 503 with Retry-After on /v1 and on Triton's generate; /generate refuses stream: true; a
terminal's Ctrl-C drains (saying what it waits for) and a second one ends the server within 2 s.
Skipped where the serve environment (or the package in it) is missing."""
from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from tests.helpers.chattokenizer import chat_spec, embedding_spec
from tests.runtime.test_serve import ROOT, Server, needs_serve_env

pytest.importorskip("onnxruntime")
pytest.importorskip("jinja2")

SERVE_PYTHON = ROOT / ".venv-serve" / "bin" / "python"
CLIENTS = Path(__file__).with_name("openai_clients.py")
MODEL = "tiny-chat"
WORDS = ("the", "capital", "of", "France", "river", "write", "a", "poem", "about", "rain", "why", "is", "sky", "blue",
         "list", "three", "colours", "python", "function", "reverse", "string", "tell", "me", "joke", "\u00e9t\u00e9",
         "\u65e5\u672c")


def needs_openai_package():
    got = subprocess.run([str(SERVE_PYTHON), "-c", "import openai"], capture_output=True)
    if got.returncode != 0:
        pytest.skip("the openai package is missing from the serve environment: make install-serve")


def request(port: int, method: str, path: str, body=None, timeout: float = 60) -> tuple[int, dict, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    data = body if isinstance(body, (bytes, type(None))) else json.dumps(body).encode()
    conn.request(method, path, body=data)
    answer = conn.getresponse()
    raw = answer.read()
    conn.close()
    return answer.status, dict(answer.getheaders()), raw


def chats(n: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        words = " ".join(rng.choice(WORDS, size=int(rng.integers(2, 12))))
        messages = [{"role": "user", "content": words.capitalize() + "?"}]
        if i % 3 == 1:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        if i % 4 == 2:
            messages[-1:-1] = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": "Hi there."}]
        out.append({"messages": messages, "max_tokens": int(rng.integers(4, 24))})
    return out


@needs_serve_env
def test_the_openai_package_and_curl_against_a_real_server(tmp_path):
    """20 chats through the openai package four ways (sync, streamed, async, all 20 as concurrent
    async streams: more than the 4 rows decoded at once), their completions, its errors; curl
    on chat and a stream; malformed bodies, each refused with a message while the server goes on."""
    needs_openai_package()
    from specc.runtime import Session

    build = specc.build(chat_spec(tmp_path), tmp_path / MODEL).out_dir
    session = Session(build)
    tok = session.tokenizer
    cases = chats(20)

    def alone(messages, n):
        ids = tok.prompts([tok.chat(messages)], add_special_tokens=False)[0]
        new = session.generate(ids, max_new_tokens=n).new_ids[0]
        return ids, new

    want = [alone(c["messages"], c["max_tokens"]) for c in cases]
    (tmp_path / "cases.json").write_text(json.dumps({"chats": cases}))
    # `specc generate --chat` itself, for the first: the same tokens
    doc = json.loads(CliRunner().invoke(main, ["generate", str(build), "--chat", "--text", cases[0]["messages"][0]["content"],
                                               "--max-new-tokens", str(cases[0]["max_tokens"]), "--json"]).stdout)
    assert doc["new_ids"][0] == want[0][1]

    server = Server(build, "--max-sequences", "4")
    try:
        base = f"http://127.0.0.1:{server.http}/v1"
        run = subprocess.run([str(SERVE_PYTHON), str(CLIENTS), base, MODEL, str(tmp_path / "cases.json")],
                             capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
        assert run.returncode == 0, run.stderr
        seen = json.loads(run.stdout)
        assert seen["models"] == [MODEL]
        for i, (ids, new) in enumerate(want):
            text = tok.decode(new)
            reason = "stop" if new[-1] == session.info.tokens.eos else "length"
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(new), "total_tokens": len(ids) + len(new)}
            for way in ("sync", "streamed", "async_streams"):
                got = seen[way][i]
                assert got["text"] == text and got["finish_reason"] == reason, (way, i, got, text)
                assert {k: got["usage"][k] for k in usage} == usage, (way, i, got)
            assert seen["sync"][i]["role"] == "assistant" and seen["streamed"][i]["role"] == "assistant"
            assert seen["streamed"][i]["chunks"] >= 3  # the role, text, the end (and the usage)
            prompt = tok.prompts([cases[i]["messages"][-1]["content"]])[0]
            completion = session.generate(prompt, max_new_tokens=cases[i]["max_tokens"]).new_ids[0]
            assert seen["completions"][i]["text"] == tok.decode(completion)
        assert seen["async_one"] == tok.decode(want[0][1])
        errors = seen["errors"]
        assert errors["unknown_model"][0] == 404 and "no-such-model" in errors["unknown_model"][1]["message"]
        assert errors["empty_messages"][0] == 400 and errors["empty_messages"][1]["param"] == "messages"
        assert errors["n"][0] == 400 and errors["n"][1]["message"].startswith("n: only one choice")

        # curl, as the documentation shows it
        url = f"http://127.0.0.1:{server.http}/v1/chat/completions"
        body = json.dumps({"model": MODEL, "messages": cases[0]["messages"], "max_tokens": cases[0]["max_tokens"]})
        if shutil.which("curl"):
            got = json.loads(subprocess.run(["curl", "-s", url, "-H", "Content-Type: application/json", "-d", body],
                                            capture_output=True, text=True, timeout=60).stdout)
            assert got["choices"][0]["message"]["content"] == tok.decode(want[0][1])
            raw = subprocess.run(["curl", "-sN", url, "-d", body[:-1] + ', "stream": true}'], capture_output=True,
                                 text=True, timeout=60).stdout
            events = [line[6:] for line in raw.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            assert "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]) == \
                tok.decode(want[0][1])

        good = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        mistakes = [
            ({**good, "max_tokens": "two"}, 400, "max_tokens: expected an integer"),
            ({**good, "temperature": [1]}, 400, "temperature: expected a number"),
            ({**good, "frobnicate": True}, 400, "frobnicate: unknown field"),
            ({**good, "messages": []}, 400, "messages: expected a non-empty array"),
            ({**good, "messages": [{"role": "user", "content": "rain " * 300}]}, 400, "messages: "),
            ({**good, "max_tokens": 120}, 400, "prompt ("),
            (b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\xff\xfe"}]}', 400,
             "the request body is not UTF-8 text"),
            (b"{not json", 400, "the request body is not JSON"),
            ({**good, "model": "gpt-4o"}, 404, "the model 'gpt-4o' does not exist"),
        ]
        for body, status, start in mistakes:
            for path in ("/v1/chat/completions",):
                got_status, headers, raw = request(server.http, "POST", path, body)
                error = json.loads(raw)["error"]
                assert got_status == status and error["message"].startswith(start), (body, got_status, error)
                assert "Traceback" not in error["message"] and str(ROOT) not in error["message"]
            assert request(server.http, "POST", "/v1/chat/completions", good)[0] == 200
        status, _, raw = request(server.http, "POST", "/v1/embeddings", {"model": MODEL, "input": "x"})
        assert status == 400 and "no sentence_embedding output" in json.loads(raw)["error"]["message"]
        assert server.proc.poll() is None
    finally:
        code = server.stop()
    assert code == 0, server.output()
    assert "Traceback" not in server.output()


def read_events(answer, n: int) -> None:
    seen = 0
    while seen < n:
        line = answer.fp.readline()
        assert line, "the stream ended"
        seen += line.startswith(b"data:")


@needs_serve_env
def test_the_openai_package_embeds_on_a_real_server(tmp_path):
    """An embedding build served: the package's embeddings (its default, base64 decoded by it, and
    floats) are the build's sentence_embedding for each text, usage its tokens; its errors."""
    needs_openai_package()
    from specc.runtime import Session

    build = specc.build(embedding_spec(tmp_path, "tiny-embedder"), tmp_path / "tiny-embedder").out_dir
    session = Session(build)
    texts = ["What is the capital of France?", "Hi", "Embeddings map text to vectors.", "x", "The end, at last."]
    want = np.concatenate([session.run(**session.encode([t]))["sentence_embedding"] for t in texts])  # each alone
    tokens = sum(len(r) for r in session.tokenizer.prompts(texts))
    (tmp_path / "cases.json").write_text(json.dumps({"embeddings": texts}))
    server = Server(build)
    try:
        assert "sentence embeddings at" in server.output()
        run = subprocess.run([str(SERVE_PYTHON), str(CLIENTS), f"http://127.0.0.1:{server.http}/v1", "tiny-embedder",
                              str(tmp_path / "cases.json")], capture_output=True, text=True, timeout=300,
                             env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
        assert run.returncode == 0, run.stderr
        seen = json.loads(run.stdout)
        assert seen["models"] == ["tiny-embedder"] and seen["object"] == "list" and seen["model"] == "tiny-embedder"
        for way in ("default", "float"):
            assert np.abs(np.array(seen[way]) - want).max() <= 1e-5, way
        assert np.abs(np.array(seen["one"]) - want[0]).max() <= 1e-5
        assert seen["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
        assert seen["errors"]["unknown_model"][0] == 404 and seen["errors"]["no_input"][0] == 400
        status, _, raw = request(server.http, "POST", "/v1/chat/completions",
                                 {"model": "tiny-embedder", "messages": [{"role": "user", "content": "hi"}]})
        assert status == 404 and "not a text generation model" in json.loads(raw)["error"]["message"]
    finally:
        code = server.stop()
    assert code == 0, server.output()


@needs_serve_env
def test_disconnects_busy_503_generate_gaps_and_two_ctrl_c(tmp_path):
    """One place and no queue: a /v1 stream takes it; /v1 and Triton's generate answer 503 with
    Retry-After; the stream's client hangs up and its place serves the next request. /generate
    with stream: true and a generate body with messages are refused 400; `chat: true` renders the
    template. Then a terminal's Ctrl-C (the server's process group) while a stream runs: the
    server says it waits for 1 running request, refuses new ones 503; a second Ctrl-C ends it
    within 2 s, Triton's processes with it."""
    spec = chat_spec(tmp_path, "long-chat", "d_model: 256\ndecoder: {layers: 4, attention: {heads: 4, kv_heads: 2}, "
                                            "ffn: {d_ff: 512}}\nposition: {kind: rotary, max_length: 4096}\n"
                                            "serving: {length: {min: 1, opt: 32, max: 4096}}\n")
    build = specc.build(spec, tmp_path / "long-chat").out_dir
    from specc.runtime import Session

    session = Session(build)
    model = "long-chat"
    server = Server(build, "--max-sequences", "1", "--max-waiting", "0", own_group=True)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({
            "model": model, "messages": [{"role": "user", "content": "Go on forever."}], "max_tokens": 3900,
            "stream": True}))
        answer = conn.getresponse()
        assert answer.status == 200 and answer.getheader("Content-Type") == "text/event-stream"
        read_events(answer, 3)
        status, headers, raw = request(server.http, "POST", "/v1/completions", {"model": model, "prompt": "x"})
        assert status == 503 and headers.get("Retry-After") == "1", (status, raw)
        assert json.loads(raw)["error"]["message"].startswith("server busy")
        status, headers, raw = request(server.http, "POST", f"/v2/models/{model}/generate", {"input_ids": [4], "max_tokens": 2})
        assert status == 503 and headers.get("Retry-After") == "1" and json.loads(raw)["error"].startswith("server busy")
        conn.sock.close()  # the client goes away mid-stream
        conn.close()
        deadline = time.monotonic() + 20
        while True:  # its place comes free long before its 3900 tokens could be made
            status, _, raw = request(server.http, "POST", "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2})
            if status == 200:
                break
            assert status == 503 and time.monotonic() < deadline, raw
            time.sleep(0.05)

        # the generate API's gaps
        status, _, raw = request(server.http, "POST", f"/v2/models/{model}/generate",
                                 {"text_input": "hi", "max_tokens": 2, "stream": True})
        assert status == 400 and "generate_stream" in json.loads(raw)["error"], raw
        status, _, raw = request(server.http, "POST", f"/v2/models/{model}/generate",
                                 {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "/v1/chat/completions" in json.loads(raw)["error"], raw
        tok = session.tokenizer
        ids = tok.prompts([tok.chat([{"role": "user", "content": "Why is the sky blue?"}])], add_special_tokens=False)[0]
        new = session.generate(ids, max_new_tokens=6).new_ids[0]
        status, _, raw = request(server.http, "POST", f"/v2/models/{model}/generate",
                                 {"text_input": "Why is the sky blue?", "chat": True, "max_tokens": 6})
        got = json.loads(raw)
        assert status == 200 and np.atleast_1d(got["output_ids"]).tolist() == new and got["prompt_tokens"] == len(ids)

        # Ctrl-C at a terminal, twice
        conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps({
            "model": model, "messages": [{"role": "user", "content": "Go on."}], "max_tokens": 3900, "stream": True}))
        answer = conn.getresponse()
        read_events(answer, 3)
        os.killpg(server.proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 30  # (a loaded machine: make test's other worker)
        while "waiting up to 60 s" not in server.output():
            assert time.monotonic() < deadline, server.output()
            time.sleep(0.05)
        assert "for 1 running and 0 queued generate requests to finish; Ctrl-C again stops now" in server.output()
        status, headers, raw = request(server.http, "POST", "/v1/completions", {"model": model, "prompt": "x"})
        assert status == 503 and "shutting down" in json.loads(raw)["error"]["message"]
        read_events(answer, 3)  # the running stream goes on
        t0 = time.monotonic()
        os.killpg(server.proc.pid, signal.SIGINT)
        code = server.proc.wait(timeout=10)
        took = time.monotonic() - t0
        assert took < 5.0, (took, server.output())  # now, not after the drain's 60 s
        assert code == 130 and "stopping now; cancelling 1 generate requests" in server.output()
        try:
            rest = answer.read()
        except (http.client.IncompleteRead, OSError) as exc:
            rest = getattr(exc, "partial", b"")
        assert b"[DONE]" not in rest  # cut off, not finished
        time.sleep(0.5)
        left = subprocess.run(["pgrep", "-f", f"--grpc-port {server.grpc} "], capture_output=True, text=True).stdout
        assert left.strip() == "", left  # tritonserver is gone too
    finally:
        if server.proc.poll() is None:
            server.stop()
    assert "Traceback" not in server.output()
