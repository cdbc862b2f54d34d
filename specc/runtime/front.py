"""The HTTP front of `specc serve`: it owns the HTTP port, answers the OpenAI-compatible API
(/v1/*, specc/runtime/openai_api.py, on the generate endpoint's engine) itself, and hands every
other request to Triton's own HTTP frontend, listening on a loopback port of its own, unchanged
but for what it checks first and the status of a busy refusal.

    client --> front (HOST:PORT) --+-- /v1/*            --> openai_api.OpenAIApi (answered here)
                                   +-- POST .../generate --> check_body (400 here), then Triton
                                   +-- the rest          --> Triton's HTTP frontend (127.0.0.1:UPSTREAM)

Triton's HTTP frontend converts a generate request's JSON body into tensors before the model sees
it, and answers 500 where the body is not JSON or a field's value is not of its input's JSON type
("max_tokens": "four", "input_ids": [1.5]): a client's mistake reported as the server's. So a POST
to the generation model's generate / generate_stream has its body read here and checked
(endpoint.check_body); a body that fails gets 400 and `{"error": "..."}`, one line, and never
reaches Triton; so does `"stream": true` on /generate (which answers once: the stream is
generate_stream's), and `messages` (a conversation is /v1/chat/completions'). Everything else
(the other endpoints, the graph models, health, metadata, the binary tensor extension) passes
through as it came (method, path, body, headers but those of one hop), and so do the answers,
streamed as they come (server-sent events, chunk by chunk), but one: a generate request the
engine refuses as busy (a full queue, a draining server: decoding's Busy, Triton's UNAVAILABLE)
is answered 503 with Retry-After, where the Python backend of the Triton that PyTriton bundles
answers it 400 (clients retry on 503). A client that hangs up while its answer is awaited or
streamed shuts the front's connection to Triton, so Triton cancels the request as it would its
own client's; on /v1 the engine cancels it. A body refused before it is read whole ends its
connection (what is left of it is never read).
"""
from __future__ import annotations

import http.client
import json
import re
import select
import socket
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable, Iterable

from specc.decoding.errors import is_busy
from specc.errors import first_line
from specc.runtime.endpoint import check_body
from specc.runtime.errors import RunError
from specc.runtime.openai_api import RETRY_AFTER_S, OpenAIApi, Refusal, Reply, refusal_line

# headers of one hop (RFC 9110 7.6.1): each side of the front has its own
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
        "expect"}
MAX_BODY = 64 << 20  # a generate body past this is refused (413) before it is read
_TIMEOUT_S = 3600.0  # a stream may run for long; Triton's own limits apply


class Front:
    """Serve HOST:PORT, forwarding to Triton's HTTP frontend on 127.0.0.1:UPSTREAM; generate bodies
    for the model GENERATION (None: no generation model) are checked first; /v1/* is OPENAI's
    (None: answered 404 in OpenAI's error form)."""

    def __init__(self, host: str, port: int, upstream: int, generation: str | None, openai: OpenAIApi | None = None):
        pattern = re.compile(rf"^/v2/models/{re.escape(generation)}(/versions/\d+)?/generate(_stream)?/?$") \
            if generation else None

        self.stopping = threading.Event()  # set while the server stops: Triton gone is then 503, not 502

        class Handler(_Forward):
            upstream_port = upstream
            generate_path = pattern
            openai_api = openai
            stopping = self.stopping

        class Server(_Server):
            address_family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]

        self.server = Server((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, name="specc-http-front", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    daemon_threads = True
    request_queue_size = 1024  # connections waiting to be accepted (socketserver's 5 resets a burst of clients)

    def handle_error(self, request, client_address) -> None:
        """A client gone mid-answer (its connection reset or closed) ends its handler quietly; any
        other failure of a handler is one line on stderr, never a traceback (socketserver prints one)."""
        exc = sys.exc_info()[1]
        if isinstance(exc, (ConnectionError, TimeoutError)):
            return
        print(f"specc serve: the HTTP front dropped a request from {client_address[0]}: "
              f"{type(exc).__name__}: {first_line(exc)}".rstrip(": "), file=sys.stderr)


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Triton's own frontend
    upstream_port: int
    generate_path: re.Pattern | None
    openai_api: OpenAIApi | None
    stopping: threading.Event

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._forward()

    do_POST = do_PUT = do_DELETE = do_HEAD = do_OPTIONS = do_GET  # noqa: N815

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - Triton logs requests, not the front
        pass

    def _forward(self) -> None:
        body, why = self._body()
        if why is not None:
            self.close_connection = True  # what is left of the body is not read: the connection ends
            if self._is_openai():
                return self._reply(Reply.refusal(Refusal(why[0], why[1])))
            return self._refuse(*why)
        if self._is_openai():
            return self._openai(body)
        if self._is_generate():
            try:
                fields = check_body(body)
                if fields.get("stream") is True and not self._path().rstrip("/").endswith("_stream"):
                    raise RunError("stream: true answers one response per token, which /generate cannot hold: "
                                   "POST .../generate_stream (server-sent events) or gRPC streaming")
            except RunError as exc:
                return self._refuse(400, str(exc))
        self._relay(body)

    def _kind(self) -> str:
        return "generate request" if self._is_generate() else "request"

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def _is_openai(self) -> bool:
        path = self._path()
        return path == "/v1" or path.startswith("/v1/")

    def _openai(self, body: bytes) -> None:
        """A /v1 request, answered by the OpenAI API; a client that hangs up cancels its request."""
        if self.openai_api is None:
            return self._reply(Reply.refusal(Refusal(404, "this server has no OpenAI-compatible endpoints",
                                                     code="not_found")))
        gone = threading.Event()
        watching = _watch_for_hangup(self.connection, gone.set)
        try:
            try:
                reply = self.openai_api.handle(self.command, self.path, body, gone)
            except Exception as exc:  # a bug of the API: one line to the client, never a traceback
                reply = Reply.refusal(Refusal(500, refusal_line(exc)))
            self._reply(reply)
        finally:
            watching.set()

    def _reply(self, reply: Reply) -> None:
        """An OpenAI API answer to the client: one body, or events written as they come (chunked;
        HTTP/1.0 clients: as they come, then the connection ends). A client gone mid-stream ends
        its request (reply.close)."""
        self.send_response(reply.status)
        for k, v in reply.headers.items():
            self.send_header(k, v)
        if reply.chunks is None:
            data = reply.data or b""
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            return
        try:
            self._stream(reply.chunks)
        except OSError:  # the client went away mid-stream: its request ends, its place comes free
            self.close_connection = True
            reply.close()

    def _body(self) -> tuple[bytes, tuple[int, str] | None]:
        """The request's body, or why it is refused (status, message) before it is all read."""
        limit = MAX_BODY if self._is_generate() or self._is_openai() else None
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            return self._read_chunked(limit)
        length = self.headers.get("Content-Length")
        if length is None:
            return b"", None
        try:
            n = int(length)
        except ValueError:
            n = -1
        if n < 0:
            return b"", (400, f"Content-Length {length!r} is not a size")
        if limit is not None and n > limit:
            return b"", (413, f"a {self._kind()} of {n} bytes is past the {limit} bytes this server reads")
        body = self.rfile.read(n)
        return body, (None if len(body) == n else (400, f"the body ended after {len(body)} of {n} bytes"))

    def _read_chunked(self, limit: int | None) -> tuple[bytes, tuple[int, str] | None]:
        parts, size = [], 0
        while True:
            line = self.rfile.readline(1024)
            try:
                n = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                return b"", (400, "a chunked request body whose chunk sizes do not parse")
            if n == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts), None
            size += n
            if limit is not None and size > limit:
                return b"", (413, f"a {self._kind()} past the {limit} bytes this server reads")
            parts.append(self.rfile.read(n))
            self.rfile.readline(1024)

    def _is_generate(self) -> bool:
        return self.command == "POST" and self.generate_path is not None \
            and self.generate_path.match(self._path()) is not None

    def _refuse(self, status: int, message: str, headers: dict | None = None) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _relay(self, body: bytes) -> None:
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=_TIMEOUT_S)
        gone = _watch_for_hangup(self.connection, upstream)
        started = False
        try:
            upstream.putrequest(self.command, self.path, skip_host=True, skip_accept_encoding=True)
            for k, v in self.headers.items():  # in order, repeated ones repeated
                if k.lower() not in _HOP:
                    upstream.putheader(k, v)
            if body or self.command in ("POST", "PUT"):
                upstream.putheader("Content-Length", str(len(body)))
            upstream.endheaders(body or None)
            answer = upstream.getresponse()
            started = True
            self._answer(answer)
        except (OSError, http.client.HTTPException) as exc:
            if gone.is_set() or started:  # the client went away, or the answer broke off: nothing to say
                self.close_connection = True
            elif self.stopping.is_set():
                self._refuse(503, "server shutting down; retry on another server", {"Retry-After": str(RETRY_AFTER_S)})
            else:
                self._refuse(502, f"the Triton server behind this port does not answer ({exc})")
        finally:
            gone.set()
            upstream.close()

    def _answer(self, answer: http.client.HTTPResponse) -> None:
        """Triton's answer to the client: status and headers, then the body, whole where its size is
        known and chunk by chunk as it comes where not (HTTP/1.0 clients: as it comes, then the
        connection ends)."""
        if answer.status == 400 and self._is_generate():  # a busy refusal is 503 (the module's doc)
            data = answer.read()
            busy = _is_busy_answer(data)
            self.send_response_only(503 if busy else 400)
            for k, v in answer.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            if busy:
                self.send_header("Retry-After", str(RETRY_AFTER_S))
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self.send_response_only(answer.status, answer.reason)
        for k, v in answer.getheaders():
            if k.lower() not in _HOP:
                self.send_header(k, v)
        sized = answer.getheader("Content-Length")
        if self.command == "HEAD" or answer.status in (204, 304) or 100 <= answer.status < 200:
            if sized is not None:
                self.send_header("Content-Length", sized)
            self.end_headers()
            return
        if sized is not None:
            data = answer.read()
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            return
        self._stream(iter(lambda: answer.read1(1 << 16), b""))  # each piece on as it comes

    def _stream(self, pieces: Iterable[bytes]) -> None:
        """End the headers and write a body of unknown length piece by piece as it comes: chunked,
        or for an HTTP/1.0 client raw, then the connection ends. OSError: the client went away."""
        chunked = self.request_version != "HTTP/1.0"
        if chunked:
            self.send_header("Transfer-Encoding", "chunked")
        else:
            self.close_connection = True
        self.end_headers()
        for data in pieces:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data) if chunked else data)
            self.wfile.flush()
        if chunked:
            self.wfile.write(b"0\r\n\r\n")


def _shut(upstream: http.client.HTTPConnection) -> None:
    """Wake the relay's read and tell Triton the client went away."""
    sock = upstream.sock  # the handler may close it meanwhile (its answer complete)
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _is_busy_answer(data: bytes) -> bool:
    """Whether Triton's answer to a generate request (JSON, or a server-sent event) is a busy refusal."""
    text = data.decode("utf-8", "replace").strip()
    if text.startswith("data:"):
        text = text.splitlines()[0][5:]
    try:
        error = json.loads(text).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, str) and is_busy(error)


def _watch_for_hangup(client: socket.socket, then: http.client.HTTPConnection | Callable[[], None]) -> threading.Event:
    """As soon as CLIENT hangs up while its answer is awaited: shut THEN, the relay's connection to
    Triton (Triton then cancels the request, as it would for its own client), or call it (the
    OpenAI API cancels the request in the engine). Set the returned event to stop watching."""
    done = threading.Event()
    on_hangup = then if callable(then) else lambda: _shut(then)

    def watch() -> None:
        poller = select.poll()  # not select(): a server with many connections has descriptors past 1024
        try:
            poller.register(client, select.POLLIN)
        except (OSError, ValueError):  # the handler closed the connection: it is done with it
            return
        while not done.is_set():
            try:
                ready = poller.poll(200)
            except OSError:
                return
            if not ready:
                continue
            try:
                if client.recv(1, socket.MSG_PEEK) != b"":
                    return  # the client's next request, already sent: it is still there
            except OSError:
                pass
            if not done.is_set():
                done.set()
                on_hangup()
            return

    threading.Thread(target=watch, name="specc-http-front-watch", daemon=True).start()
    return done
