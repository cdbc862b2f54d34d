"""`specc serve`'s generation model: Triton's generate endpoint (generate, generate_stream, gRPC
streaming) bound to the scheduler, through PyTriton.

    PyTriton's request --> endpoint.parse (specc/decoding's parse) --> Scheduler.submit
        |                     a refusal: its one line, HTTP 400 (busy: 503)
        v
    the scheduler's thread: each token to the request's sink (_Stream), which makes its
        response (decoding's Answer) and hands it to the request's coroutine on PyTriton's loop
        v
    the coroutine yields it: one response per token when the request streams, else one at the end

A stream whose client goes away is cancelled in the scheduler: Triton cancels the request, the
Python backend stub (pytriton_patch.install) sends the request's key as a datagram to Cancels'
socket, and Cancels hands the scheduler that request's ticket.
"""
from __future__ import annotations

import asyncio
import os
import socket
import tempfile
import threading
from typing import Callable

import numpy as np

from specc.decoding.request import Answer
from specc.decoding.text import Codec
from specc.runtime import endpoint
from specc.runtime.errors import RunError
from specc.runtime.pytriton_patch import CANCEL_KEY, refusal
from specc.runtime.scheduler import ERROR, Busy, Scheduler


class Cancels:
    """Clients that went away, back to the scheduler: the server's side of the stub's datagrams
    (pytriton_patch.install). Each generate request registers its key with its ticket; a key that
    arrives is cancelled (a key that arrives before its request registered is kept and cancels it
    then)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.dir = tempfile.mkdtemp(prefix="specc-serve-")
        self.path = os.path.join(self.dir, "cancel.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(self.path)
        self.tickets: dict[str, int] = {}
        self.early: set[str] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, name="specc-cancels", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        while True:
            try:
                key = self.sock.recv(256).decode("utf-8", "replace")
            except OSError:  # closed
                return
            with self.lock:
                ticket = self.tickets.pop(key, None)
                if ticket is None:
                    self.early.add(key)
            if ticket is not None:
                self.scheduler.cancel(ticket)

    def register(self, key: str | None, ticket: int) -> None:
        if not key:
            return
        with self.lock:
            early = key in self.early
            self.early.discard(key)
            if not early:
                self.tickets[key] = ticket
        if early:
            self.scheduler.cancel(ticket)

    def forget(self, key: str | None) -> None:
        with self.lock:
            self.tickets.pop(key or "", None)

    def close(self) -> None:
        self.sock.close()
        for path in (self.path, self.dir):
            try:
                os.unlink(path) if path == self.path else os.rmdir(path)
            except OSError:
                pass


class _Stream:
    """One generate request's sink: the scheduler's thread makes each response (its Answer) and
    hands it to the request's coroutine through an asyncio queue on PyTriton's loop."""

    def __init__(self, loop, answer: Answer):
        self.loop, self.answer = loop, answer
        self.queue: asyncio.Queue = asyncio.Queue()

    def token(self, token_id: int) -> bool:
        response, stopped = self.answer.token(token_id)
        if response is not None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (response, False))
        return not stopped

    def done(self, reason: str, error: str | None = None) -> None:
        last = refusal(error or "generation failed", "server") if reason == ERROR else self.answer.final(reason)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (last, True))


def generate_fn(scheduler: Scheduler, codec: Codec | None, cancels: Cancels) -> Callable:
    """The generation model's inference callable: an async generator, so that PyTriton's loop
    runs every request at once (each waits on its own queue) while the scheduler decodes them
    together. Yields one response per token when the request streams, else one at the end."""

    async def generate(requests: list):
        if len(requests) != 1:  # Triton hands a model without batching one request at a time
            yield [refusal("one request at a time", "server") for _ in requests]
            return
        request = requests[0]
        params = dict(request.parameters or {})
        key = params.pop(CANCEL_KEY, None)
        try:
            parsed = endpoint.parse(dict(request.items()), params, codec)
            sink = _Stream(asyncio.get_running_loop(), Answer(parsed, codec))
            ticket = scheduler.submit(parsed.request, sink)
        except Busy as exc:
            yield [refusal(str(exc), "busy")]
            return
        except RunError as exc:
            yield [refusal(str(exc))]
            return
        cancels.register(key, ticket)
        try:
            while True:
                response, last = await sink.queue.get()
                yield [response]
                if last:
                    return
        finally:  # also when PyTriton cancels the coroutine (shutdown)
            cancels.forget(key)
            scheduler.cancel(ticket)

    return generate


def fields(table, optional: bool = False) -> list:
    """PyTriton tensors of the generate endpoint's fields (specc/spec/triton.py's table)."""
    from pytriton.model_config import Tensor

    dtypes = {"bytes": np.bytes_, "bool": np.bool_}
    return [Tensor(name=f.name, dtype=dtypes.get(f.dtype) or np.dtype(f.dtype), shape=f.shape, optional=optional)
            for f in table]
