"""specc/runtime/front.py and endpoint.check_body without Triton: a generate body that Triton's HTTP
frontend would answer 500 is refused 400 with one line; everything else passes through to the
server behind, byte for byte, streamed answers chunk by chunk, on one kept-alive connection.
(With a real Triton behind it: tests/runtime/test_serve_generate.py.)"""
from __future__ import annotations

import http.client
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from specc.runtime.endpoint import check_body
from specc.runtime.errors import RunError
from specc.runtime.front import Front


@pytest.mark.parametrize("body,message", [
    (b"not json", "the request body is not JSON (Expecting value at line 1, column 1)"),
    (b'{"text_input": "\xff"}', "the request body is not UTF-8 text (byte 16: b'\\xff')"),
    (b'"text"', "the request body is a string; the generate endpoint takes a JSON object"),
    (b'{"max_tokens": "four"}', 'max_tokens: expected a 64-bit integer, got a string "four"'),
    (b'{"max_tokens": 3.0}', "max_tokens: expected a 64-bit integer, got a number 3.0"),
    (b'{"max_tokens": [1, 2]}', "max_tokens: expected a 64-bit integer, got an array [1, 2]"),
    (b'{"max_tokens": true}', "max_tokens: expected a 64-bit integer, got a boolean true"),
    (b'{"input_ids": [1.5]}', "input_ids: expected an array of token ids (integers) or one, got an array [1.5]"),
    (b'{"temperature": "1"}', 'temperature: expected a finite number, got a string "1"'),
    (b'{"stream": 1}', "stream: expected true or false, got an integer 1"),
    (b'{"stop": 5}', "stop: expected a string or an array of strings, got an integer 5"),
    (b'{"eos": null}', "eos: expected a 64-bit integer, got null null"),
    (b'{"seed": 99999999999999999999}', "seed: expected a 64-bit integer, got an integer 99999999999999999999"),
    (b'{"temperature": NaN}', "the request body holds NaN, which JSON does not have"),
    (b'{"top_p": 1e999}', "top_p: expected a finite number, got a number Infinity"),
    (b"[" * 100000, "the request body nests arrays or objects too deep"),
])
def test_bodies_triton_would_answer_500_are_refused(body, message):
    with pytest.raises(RunError) as err:
        check_body(body)
    assert str(err.value).startswith(message)


@pytest.mark.parametrize("body", [
    b'{"input_ids": [1, 2], "max_tokens": 3, "temperature": 0.5, "top_p": 1, "stream": true, "stop": "x"}',
    b'{"input_ids": 5, "max_tokens": [3], "stop": ["a", "b"], "seed": 7, "eos": -1}',  # as Triton takes them
    b'{"text_input": "hello", "unknown": [1, {}]}',  # unknown keys: the model's own refusal names them
])
def test_bodies_triton_takes_pass(body):
    check_body(body)


class _Behind(BaseHTTPRequestHandler):
    """A stand-in for Triton's HTTP frontend: echoes a POST, streams three events on /stream."""

    protocol_version = "HTTP/1.1"
    seen: list = []

    hung_up = threading.Event()

    def do_POST(self):  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.seen.append((self.path, body, self.headers.get("X-Custom")))
        if self.path.endswith("/slow"):  # no answer until the front hangs up
            if self.rfile.read(1) == b"":
                _Behind.hung_up.set()
            return
        if self.path.endswith("/generate_stream"):
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(3):
                data = f"data: {json.dumps({'i': i})}\n\n".encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
                time.sleep(0.05)
            self.wfile.write(b"0\r\n\r\n")
            return
        self.send_response(201)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def front():
    class Behind(ThreadingHTTPServer):
        request_queue_size = 1024  # the burst test's 128 clients reach it too

    behind = Behind(("127.0.0.1", 0), _Behind)
    threading.Thread(target=behind.serve_forever, daemon=True).start()
    f = Front("127.0.0.1", 0, behind.server_address[1], "m")
    f.start()
    _Behind.seen = []
    yield f.server.server_address[1]
    f.stop()
    behind.shutdown()
    behind.server_close()


def test_the_front_checks_generate_bodies_and_passes_the_rest(front):
    conn = http.client.HTTPConnection("127.0.0.1", front, timeout=10)
    conn.request("POST", "/v2/models/m/generate", body=b"not json")
    answer = conn.getresponse()
    assert answer.status == 400 and json.loads(answer.read())["error"].startswith("the request body is not JSON")
    assert _Behind.seen == []  # never reached the server behind
    # the same connection, kept alive: a good body passes, byte for byte, with its headers
    good = b'{"input_ids": [1, 2]}'
    conn.request("POST", "/v2/models/m/versions/1/generate", body=good, headers={"X-Custom": "yes"})
    answer = conn.getresponse()
    assert (answer.status, answer.read()) == (201, good)
    assert _Behind.seen == [("/v2/models/m/versions/1/generate", good, "yes")]
    # other models and endpoints are not checked: Triton's own answers pass
    conn.request("POST", "/v2/models/other/generate", body=b"not json")
    assert conn.getresponse().read() == b"not json"
    # a stream comes through as it is made
    conn.request("POST", "/v2/models/m/generate_stream", body=good)
    answer = conn.getresponse()
    assert answer.status == 200 and answer.getheader("Content-Type") == "text/event-stream"
    events = [json.loads(line[5:]) for line in answer.read().decode().splitlines() if line.startswith("data:")]
    assert events == [{"i": 0}, {"i": 1}, {"i": 2}]
    conn.close()


def test_a_burst_of_clients_is_accepted(front):
    """128 clients connecting at once: none reset (the accept queue holds them)."""
    barrier, answers = threading.Barrier(128), []

    def client():
        conn = http.client.HTTPConnection("127.0.0.1", front, timeout=30)
        barrier.wait()
        conn.request("POST", "/v2/models/other/infer", body=b"x")
        answers.append(conn.getresponse().status)
        conn.close()

    threads = [threading.Thread(target=client) for _ in range(128)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert answers == [201] * 128


def test_a_client_that_hangs_up_closes_the_upstream_connection(front):
    """Waiting on an answer that is slow to come, the client goes away: the server behind sees its
    connection closed (Triton then cancels the request)."""
    conn = http.client.HTTPConnection("127.0.0.1", front, timeout=10)
    conn.request("POST", "/v2/models/m/slow", body=b"{}")
    time.sleep(0.3)
    conn.sock.close()
    assert _Behind.hung_up.wait(5)


@pytest.mark.parametrize("head,why", [
    (b"Content-Length: -5\r\n", "Content-Length '-5' is not a size"),
    (b"Content-Length: 70000000\r\n", "a generate request of 70000000 bytes is past"),
    (b"Transfer-Encoding: chunked\r\n", "a chunked request body whose chunk sizes do not parse"),
])
def test_a_body_refused_before_it_is_read_ends_the_connection(front, head, why):
    import socket

    with socket.create_connection(("127.0.0.1", front), timeout=10) as s:
        s.sendall(b"POST /v2/models/m/generate HTTP/1.1\r\nHost: x\r\n" + head + b"\r\nzz\r\n")
        data = b""
        while chunk := s.recv(65536):  # the front closes the connection after its answer
            data += chunk
    assert data.startswith(b"HTTP/1.1 4") and why.encode() in data


def test_the_hangup_watcher_survives_an_upstream_connection_already_closed(monkeypatch):
    """The client hangs up just as the handler closes its upstream connection (a client that
    leaves once it has its answer, under load): the watcher's shutdown meets a closed socket and
    must say nothing (a traceback on the server's output before)."""
    import socket

    from specc.runtime.front import _watch_for_hangup

    errors = []
    monkeypatch.setattr(threading, "excepthook", lambda args: errors.append(args.exc_value))
    client, peer = socket.socketpair()
    upstream = http.client.HTTPConnection("127.0.0.1", 9)
    upstream.sock, other = socket.socketpair()
    upstream.sock.close()  # closed, but not yet let go of (the handler's close() in between)
    done = _watch_for_hangup(client, upstream)
    peer.close()  # the client hangs up
    assert done.wait(5)
    time.sleep(0.3)
    client.close()
    other.close()
    assert errors == []


def test_a_handler_failure_is_one_line_and_a_client_gone_is_none(capsys):
    """socketserver prints a traceback for any exception of a handler: the front's server says
    nothing for a client gone mid-answer (reset, broken pipe) and one line for anything else."""
    from specc.runtime.front import _Server

    server = _Server.__new__(_Server)  # handle_error reads nothing of the instance
    for exc in (ConnectionResetError(104, "Connection reset by peer"), BrokenPipeError(32, "Broken pipe"),
                TimeoutError("timed out")):
        try:
            raise exc
        except OSError:
            server.handle_error(None, ("127.0.0.1", 5555))
    assert capsys.readouterr().err == ""
    for exc, line in ((ValueError("a bug\non two lines"), "ValueError: a bug"), (KeyError(), "KeyError")):
        try:
            raise exc
        except Exception:
            server.handle_error(None, ("127.0.0.1", 5555))
        assert capsys.readouterr().err == f"specc serve: the HTTP front dropped a request from 127.0.0.1: {line}\n"
