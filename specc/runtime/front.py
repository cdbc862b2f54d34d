"""The HTTP front of `specc serve`: it owns the HTTP port and hands every request to Triton's own
HTTP frontend, listening on a loopback port of its own, unchanged; it checks one thing first.

Triton's HTTP frontend converts a generate request's JSON body into tensors before the model sees
it, and answers 500 where the body is not JSON or a field's value is not of its input's JSON type
("max_tokens": "four", "input_ids": [1.5]): a client's mistake reported as the server's. So a POST
to the generation model's generate / generate_stream has its body read here and checked
(endpoint.check_body); a body that fails gets 400 and `{"error": "..."}`, one line, and never
reaches Triton. Everything else (the other endpoints, the graph models, health, metadata, the
binary tensor extension) passes through byte for byte, and so do the answers, streamed as they
come (server-sent events, chunk by chunk). A client that goes away mid-stream closes the front's
connection to Triton, so Triton cancels the request as it would its own client's.
"""
from __future__ import annotations

import http.client
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from specc.runtime.endpoint import check_body
from specc.runtime.errors import RunError

# headers of one hop (RFC 9110 7.6.1): each side of the front has its own
_HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer", "upgrade", "content-length",
        "expect"}
MAX_BODY = 64 << 20  # a generate body past this is refused (413) before it is read
_TIMEOUT_S = 3600.0  # a stream may run for long; Triton's own limits apply


class Front:
    """Serve HOST:PORT, forwarding to Triton's HTTP frontend on 127.0.0.1:UPSTREAM; generate bodies
    for the model GENERATION (None: no generation model) are checked first."""

    def __init__(self, host: str, port: int, upstream: int, generation: str | None):
        pattern = re.compile(rf"^/v2/models/{re.escape(generation)}(/versions/\d+)?/generate(_stream)?/?$") \
            if generation else None

        class Handler(_Forward):
            upstream_port = upstream
            generate_path = pattern

        self.server = _Server((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, name="specc-http-front", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    allow_reuse_address = True
    request_queue_size = 1024  # connections waiting to be accepted (socketserver's 5 resets a burst of clients)


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as Triton's own frontend
    upstream_port: int
    generate_path: re.Pattern | None

    def do_GET(self) -> None:  # noqa: N802 (http.server's names)
        self._forward()

    do_POST = do_PUT = do_DELETE = do_HEAD = do_GET  # noqa: N815

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - Triton logs requests, not the front
        pass

    def _forward(self) -> None:
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
            body = self._read_chunked()
        elif length is not None:
            try:
                n = int(length)
            except ValueError:
                return self._refuse(400, f"Content-Length {length!r} is not a number")
            if n > MAX_BODY and self._is_generate():
                return self._refuse(413, f"a generate request of {n} bytes is past the {MAX_BODY} bytes this server reads")
            body = self.rfile.read(n)
        else:
            body = b""
        if body is None:
            return self._refuse(400, "a chunked request body that does not parse")
        if self._is_generate():
            try:
                check_body(body)
            except RunError as exc:
                return self._refuse(400, str(exc))
        self._relay(body)

    def _is_generate(self) -> bool:
        return self.command == "POST" and self.generate_path is not None \
            and self.generate_path.match(self.path.split("?", 1)[0]) is not None

    def _read_chunked(self) -> bytes | None:
        parts, size = [], 0
        while True:
            line = self.rfile.readline(1024)
            try:
                n = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                return None
            if n == 0:
                while self.rfile.readline(1024) not in (b"\r\n", b"\n", b""):
                    pass  # trailers
                return b"".join(parts)
            size += n
            if size > MAX_BODY:
                return None
            parts.append(self.rfile.read(n))
            self.rfile.readline(1024)

    def _refuse(self, status: int, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _relay(self, body: bytes) -> None:
        upstream = http.client.HTTPConnection("127.0.0.1", self.upstream_port, timeout=_TIMEOUT_S)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            if body or self.command in ("POST", "PUT"):
                headers["Content-Length"] = str(len(body))
            try:
                upstream.request(self.command, self.path, body=body or None, headers=headers)
                answer = upstream.getresponse()
            except OSError as exc:
                return self._refuse(502, f"the Triton server behind this port does not answer ({exc.strerror or exc})")
            self.send_response_only(answer.status, answer.reason)
            for k, v in answer.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            sized = answer.getheader("Content-Length")
            if sized is not None or self.command == "HEAD":
                data = answer.read()
                self.send_header("Content-Length", sized or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                return
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            while True:  # a stream: each piece on as it comes
                data = answer.read1(1 << 16)
                if not data:
                    break
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
        except OSError:  # the client went away: closing the upstream connection tells Triton
            self.close_connection = True
        finally:
            upstream.close()
