"""`specc serve DIR`: a real Triton Inference Server on a build, through NVIDIA's PyTriton.

PyTriton bundles the `tritonserver` binary and runs our Python callables in Triton's Python
backend; each graph of the build becomes one Triton model that runs the graph with onnxruntime
(the same `Graph` that `specc run` uses). Model names, dims and dynamic batching follow
specc/spec/triton.py, the rule `specc build --target triton` writes into config.pbtxt: the spec's
name for a single graph, NAME_encoder / NAME_decoder for an encoder-decoder; max_batch_size =
serving.batch.max, preferred batch sizes serving.batch.opt and .max. Decoders are served
stateless, as in the Triton repository (docs/serving.md): the client sends the previous step's
present.* back as past_key_values.*. Requests are batched along the first (batch) dimension; the
other dimensions of the requests batched together must agree (Triton's own rule).

Each request is checked alone, as `specc run` checks its inputs (specc/runtime/inputs.py's
check_feeds: ids in the vocabulary, masks 0/1, positions and token types in range, the cache's
shape, the serving limits). A refused request answers HTTP 400 (gRPC INVALID_ARGUMENT) with that
one line, never a traceback, and the other requests of its dynamic batch run as usual; PyTriton
alone would answer 500 with the tracebacks of two processes, so the model file PyTriton hands
Triton gets a short addition (STUB_ADDITION) that turns a refusal into the request's error.

The HTTP port is specc/runtime/front.py's: it checks a generate request's body (JSON, and each
field's JSON type: Triton's HTTP frontend would answer those mistakes 500) and hands every request
to Triton's own HTTP frontend on a loopback port as it came, its answers streamed back as they
come. gRPC and metrics are Triton's own ports.

PyTriton needs numpy < 2, so it lives in its own environment (`make install-serve`, the `serve`
extra). The server's Python backend stub links against libpython: on interpreters built outside
the system's (pyenv, conda) the server is started with the interpreter's lib folder on
LD_LIBRARY_PATH.
"""
from __future__ import annotations

import asyncio
import errno
import functools
import os
import signal
import socket
import sys
import sysconfig
import tempfile
import threading
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from specc.errors import SpeccError
from specc.runtime import endpoint
from specc.runtime.cache import empty_cache
from specc.runtime.endpoint import TextCodec, TextStream
from specc.runtime.errors import RunError
from specc.runtime.front import Front
from specc.runtime.graph import Graph
from specc.runtime.inputs import Limits, check_feeds
from specc.runtime.scheduler import ERROR, STOP, Busy, GenerationLimits, Scheduler, Stats
from specc.runtime.session import Session
from specc.spec import triton as rule
from specc.spec.io import INPUT_IDS, is_growing, is_past, numpy_dtype
from specc.spec.manifest import TensorInfo

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002


class ServeError(SpeccError):
    """`specc serve` cannot start: the serve environment is missing, or the build cannot be served."""


def require_pytriton():
    try:
        import pytriton.triton  # noqa: F401
    except ImportError as exc:
        raise ServeError(
            "specc serve needs NVIDIA's PyTriton, which needs numpy < 2 and so lives in its own "
            "environment: run `make install-serve`, then `.venv-serve/bin/specc serve DIR` "
            f"(or pip install 'specc[cpu,serve]' into a fresh environment) [{exc}]"
        ) from None


def _library_path() -> str:
    """LD_LIBRARY_PATH with this interpreter's lib folder first (for the backend stub's libpython)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    current = os.environ.get("LD_LIBRARY_PATH", "")
    parts = [p for p in current.split(os.pathsep) if p]
    if libdir and libdir not in parts:
        parts.insert(0, libdir)
    return os.pathsep.join(parts)


def _tensors(sigs: tuple[TensorInfo, ...]) -> list:
    """PyTriton tensors from the IO signature: the batch dim left to Triton, the rest dynamic.
    The growing KV-cache inputs are optional: a prefill sends none (Triton cannot carry the
    zero-length past a graph takes then), and the server supplies the empty cache."""
    from pytriton.model_config import Tensor

    out = []
    for sig in sigs:
        shape = rule.model_dims(sig.dims)
        if shape is None:
            raise ServeError(f"{sig.name}: only tensors with a leading batch dimension can be served (dims {list(sig.dims)})")
        out.append(Tensor(name=sig.name, dtype=np.dtype(numpy_dtype(sig.dtype)), shape=shape,
                          optional=is_past(sig.name) and is_growing(sig.name)))
    return out


# The refusal of one request, as its response: [kind ("client" | "server"), one line], carried as an
# output of this name to the code below, which answers it as Triton's error for that request.
REFUSAL = "specc_error"
# The parameter that carries a generate request's key, and the environment variable naming the
# socket its cancellation is sent to (STUB_ADDITION; Cancels below).
CANCEL_KEY = "specc_cancel_key"
CANCEL_ENV = "SPECC_SERVE_CANCEL_SOCKET"

# Appended to the model.py that PyTriton writes for each model (the code Triton's Python backend
# runs, in its own process). PyTriton answers any exception of an inference callable with HTTP 500
# and the tracebacks of both processes (server paths included), and fails every request of a
# dynamic batch together; a PyTritonUnrecoverableError would stop the server. This makes a request
# refused by the callable (a REFUSAL output) an error response of its own, with its one line and
# Triton's INVALID_ARG (HTTP 400, gRPC INVALID_ARGUMENT), the other requests of its batch answered
# as usual; and it refuses zero-size inputs, which PyTriton's shared memory cannot carry, before
# they reach PyTriton. Any other failure answers one line and INTERNAL (HTTP 500), with the
# traceback left to the server's log.
STUB_ADDITION = f'''

# --- appended by specc serve (specc/runtime/serve.py): one-line refusals, HTTP 400 ---------------
def _specc_refusals():
    # pb_utils gets TritonError and the rest from the backend stub after this module loads
    import itertools
    import socket
    import time

    codes = {{"client": "INVALID_ARG", "busy": "UNAVAILABLE"}}

    def refusal(kind, message):
        code = getattr(pb_utils.TritonError, codes.get(kind, "INTERNAL"), None)
        error = pb_utils.TritonError(message) if code is None else pb_utils.TritonError(message, code)
        return pb_utils.InferenceResponse(output_tensors=[], error=error)

    def empty_input(request):
        for tensor in request.inputs():
            shape = list(tensor.as_numpy().shape)
            if 0 in shape:
                name = tensor.name()
                if name.startswith("past_key_values."):
                    return (f"{{name}}: a zero-length cache (shape {{shape}}) cannot be sent; leave the "
                            "past_key_values.* inputs out at prefill (the server supplies the empty cache)")
                return f"{{name}}: empty tensor (shape {{shape}}); give at least one token"
        return None

    pytriton_wrap_response = _wrap_response
    pytriton_execute = TritonPythonModel.execute

    def wrap_response(response, requested_outputs_names, model_outputs_dict):
        data = getattr(response, "data", None)
        if data and {REFUSAL!r} in data:
            kind, message = (bytes(x).decode("utf-8", "replace") for x in data[{REFUSAL!r}].reshape(-1)[:2])
            return refusal(kind, message)
        return pytriton_wrap_response(response, requested_outputs_names, model_outputs_dict)

    def execute(self, requests):
        answers = [None] * len(requests)
        passed = []
        for i, request in enumerate(requests):
            message = empty_input(request)
            if message is None:
                passed.append(i)
            elif self._decoupled_model:
                request.get_response_sender().send(refusal("client", message),
                                                   flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
            else:
                answers[i] = refusal("client", message)
        if self._decoupled_model:  # answered through the requests' response senders
            if passed:
                pytriton_execute(self, [requests[i] for i in passed])
            return None
        if passed:
            try:
                done = pytriton_execute(self, [requests[i] for i in passed])
            except Exception:
                done = [refusal("server", "specc serve: internal error; the server's log has the traceback")
                        for _ in passed]
            for i, answer in zip(passed, done):
                answers[i] = answer
        return answers

    # A streamed request whose client went away (Triton cancels it) is told to specc serve's
    # scheduler, which frees its place: each request carries a key (parameter {CANCEL_KEY!r}),
    # sent as a datagram to the socket named below when the request is found cancelled.
    keys = {{}}
    counter = itertools.count()
    pytriton_wrap_request = TritonRequestsServer._wrap_request

    def wrap_request(self, triton_request, *args, **kwargs):
        request = pytriton_wrap_request(self, triton_request, *args, **kwargs)
        key = f"{{os.getpid()}}-{{next(counter)}}"
        request.parameters = dict(request.parameters or {{}}, **{{{CANCEL_KEY!r}: key}})
        keys[id(triton_request)] = key
        return request

    def tell_cancelled(key):
        path = os.environ.get({CANCEL_ENV!r})
        if not path:
            return
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
                s.sendto(key.encode(), path)
        except OSError:
            pass

    async def handle_decoupled(self, scope, responses_queue, responses_future):
        requests_id = scope["requests_id"]
        loop = asyncio.get_running_loop()
        triton_requests = self._requests_map[requests_id]
        senders = [r.get_response_sender() for r in triton_requests]
        gone = [False] * len(senders)
        checked = [0.0] * len(senders)

        def send(i, response, flags):
            if gone[i]:
                return
            now = time.monotonic()
            try:
                if now - checked[i] > 0.05:
                    checked[i] = now
                    if triton_requests[i].is_cancelled():
                        raise ConnectionAbortedError
                senders[i].send(response, flags)
            except Exception:
                gone[i] = True
                tell_cancelled(keys.get(id(triton_requests[i]), ""))
                try:
                    senders[i].send(None, pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                except Exception:
                    pass

        eos = False
        while not eos:
            flags, payload = await responses_queue.get()
            error = flags & PyTritonResponseFlags.ERROR
            try:
                eos = flags & PyTritonResponseFlags.EOS
                if error:
                    answers = [refusal("server", "specc serve: internal error; the server's log has the traceback")
                               for _ in senders]
                else:
                    answers = [wrap_response(r, q.requested_output_names(), self._model_outputs_dict)
                               for q, r in zip(triton_requests, self._serializer_deserializer.deserialize_responses(payload))]
                final = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if eos else 0
                if eos and not any(a is not None for a in answers):
                    answers = [None] * len(senders)
                await asyncio.gather(*(loop.run_in_executor(None, send, i, a, final) for i, a in enumerate(answers)))
            finally:
                if not error:
                    self._serializer_deserializer.free_responses_resources(payload)
                responses_queue.task_done()
        for r in triton_requests:
            keys.pop(id(r), None)
        self._requests_map.pop(requests_id)
        responses_future.set_result(None)

    globals()["_wrap_response"] = wrap_response
    TritonPythonModel.execute = execute
    TritonRequestsServer._wrap_request = wrap_request
    DecoupledResponsesHandler.handle_responses = handle_decoupled


if "TritonPythonModel" in globals() and "_wrap_response" in globals():
    _specc_refusals()
'''


@contextmanager
def _triton_output(verbose: bool):
    """What the tritonserver process prints outside its log file (its log with --verbose; else
    lines such as "Error: Failed to initialize NVML" on a machine without a GPU) reaches the
    terminal only with `verbose`: PyTriton echoes it unless its TritonServer is made quiet."""
    import pytriton.triton as triton_module

    made = triton_module.TritonServer
    triton_module.TritonServer = functools.partial(made, verbose=verbose)
    try:
        yield
    finally:
        triton_module.TritonServer = made


@contextmanager
def _one_line_refusals():
    """While serving, each model's model.py that PyTriton hands Triton ends with STUB_ADDITION:
    whether PyTriton writes it into a local model store (Model.generate_model) or sends its text
    with the load request (Model.get_proxy_model_files, the usual path)."""
    from pytriton.models.model import Model

    generate_model, proxy_files = Model.generate_model, Model.get_proxy_model_files

    def generate_with_refusals(self, model_repository):
        generate_model(self, model_repository)
        path = Path(model_repository) / self.model_name / str(self.model_version) / "model.py"
        if path.is_file():
            path.write_text(path.read_text(encoding="utf-8") + STUB_ADDITION, encoding="utf-8")

    def files_with_refusals(self):
        files = proxy_files(self)
        key = f"file:{self.model_version}/model.py"
        if key in files:
            files[key] = files[key] + STUB_ADDITION.encode("utf-8")
        return files

    Model.generate_model, Model.get_proxy_model_files = generate_with_refusals, files_with_refusals
    try:
        yield
    finally:
        Model.generate_model, Model.get_proxy_model_files = generate_model, proxy_files


def _refusal(message: str, kind: str = "client") -> dict[str, np.ndarray]:
    return {REFUSAL: np.array([kind.encode(), message.encode("utf-8")], dtype=np.bytes_)}


def request_feeds(graph: Graph, request: Mapping[str, np.ndarray], limits: Limits) -> dict[str, np.ndarray]:
    """One request's inputs, checked (specc/runtime/inputs.py's check_feeds, as `specc run` checks
    them), with the empty cache a prefill leaves out; in the graph's input order."""
    feeds = check_feeds(graph.info, dict(request), limits)
    if INPUT_IDS in feeds:
        for name, value in empty_cache(graph, len(feeds[INPUT_IDS])).items():
            feeds.setdefault(name, value)
    missing = [n for n in graph.inputs if n not in feeds]  # Triton refuses these first; a direct caller may not
    if missing:
        raise RunError(f"missing input(s): {', '.join(missing)}")
    return {n: feeds[n] for n in graph.inputs if n in feeds}


def _infer_fn(graph: Graph, limits: Limits) -> Callable:
    lock = threading.Lock()  # one onnxruntime run at a time per graph: the session's threads do the rest

    def infer(requests: list) -> list[dict[str, np.ndarray]]:
        """PyTriton's requests (a dynamic batch) in, one response per request out. Each request is
        checked alone, so a refused one answers its own error and the others run, batched
        together where their shapes agree (as Triton batched them)."""
        answers: list = [None] * len(requests)
        groups: dict[tuple, list[tuple[int, dict]]] = {}
        for i, request in enumerate(requests):
            try:
                feeds = request_feeds(graph, request, limits)
            except RunError as exc:
                answers[i] = _refusal(str(exc))
                continue
            groups.setdefault(tuple((n, v.shape[1:]) for n, v in feeds.items()), []).append((i, feeds))
        for members in groups.values():
            try:
                batch = {n: np.concatenate([f[n] for _, f in members]) for n in members[0][1]}
                with lock:
                    out = {k: v.numpy() for k, v in graph.run(batch).items()}
            except RunError as exc:  # onnxruntime refused what passed the checks
                for i, _ in members:
                    answers[i] = _refusal(str(exc), "server")
                continue
            except Exception:  # a bug: its traceback to the server's log, one line to the client
                traceback.print_exc(file=sys.stderr)
                for i, _ in members:
                    answers[i] = _refusal("specc serve: internal error; the server's log has the traceback", "server")
                continue
            start = 0
            for i, feeds in members:
                rows = len(next(iter(feeds.values())))
                answers[i] = {k: v[start:start + rows] for k, v in out.items()}
                start += rows
        return answers

    return infer


class Cancels:
    """Clients that went away, back to the scheduler: the server's side of STUB_ADDITION's
    datagrams. Each generate request registers its key with its ticket; a key that arrives is
    cancelled (a key that arrives before its request registered is kept and cancels it then)."""

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
    """One generate request's sink: the scheduler's thread hands tokens here; the request's
    coroutine reads them from an asyncio queue on PyTriton's loop."""

    def __init__(self, loop, text: TextStream | None):
        self.loop, self.text = loop, text
        self.queue: asyncio.Queue = asyncio.Queue()

    def token(self, token_id: int) -> bool:
        piece, stopped = self.text.feed(token_id) if self.text is not None else (None, False)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("token", token_id, piece))
        return not stopped

    def done(self, reason: str, error: str | None = None) -> None:
        rest = self.text.rest() if self.text is not None and reason != STOP else ""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, ("done", reason, error, rest))


def _generate_fn(scheduler: Scheduler, codec: TextCodec | None, cancels: Cancels) -> Callable:
    """The generation model's inference callable: an async generator, so that PyTriton's loop
    runs every request at once (each waits on its own queue) while the scheduler decodes them
    together. Yields one response per token when the request streams, else one at the end."""

    async def generate(requests: list):
        if len(requests) != 1:  # Triton hands a model without batching one request at a time
            yield [_refusal("one request at a time", "server") for _ in requests]
            return
        request = requests[0]
        params = dict(request.parameters or {})
        key = params.pop(CANCEL_KEY, None)
        try:
            parsed = endpoint.parse(dict(request.items()), params, codec)
            text = TextStream(codec, parsed.stop) if parsed.text or parsed.stop else None
            sink = _Stream(asyncio.get_running_loop(), text)
            ticket = scheduler.submit(parsed.request, sink)
        except Busy as exc:
            yield [_refusal(str(exc), "busy")]
            return
        except RunError as exc:
            yield [_refusal(str(exc))]
            return
        cancels.register(key, ticket)
        ids: list[int] = []
        pieces: list[str] = []
        try:
            while True:
                item = await sink.queue.get()
                if item[0] == "token":
                    ids.append(item[1])
                    if item[2] is not None:
                        pieces.append(item[2])
                    if parsed.stream:
                        yield [endpoint.response([item[1]], item[2] if parsed.text else None)]
                    continue
                _, reason, error, rest = item
                if reason == ERROR:
                    yield [_refusal(error or "generation failed", "server")]
                    return
                usage = (len(parsed.request.ids), len(ids))
                if parsed.stream:
                    yield [endpoint.response([], rest if parsed.text else None, reason, usage)]
                else:
                    yield [endpoint.response(ids, "".join(pieces) + rest if parsed.text else None, reason, usage)]
                return
        finally:  # also when PyTriton cancels the coroutine (shutdown)
            cancels.forget(key)
            scheduler.cancel(ticket)

    return generate


def serves_generation(info) -> bool:
    """Whether `specc serve` adds the generation model: a decoder build with an lm output."""
    return rule.generates(info.architecture, info.lm_output)


def serve(build_dir: str | Path, *, host: str = "127.0.0.1", http_port: int = DEFAULT_HTTP_PORT,
          grpc_port: int = DEFAULT_GRPC_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
          providers=None, on_ready: Callable[[dict], None] | None = None,
          stop: threading.Event | None = None, verbose: bool = False, max_sequences: int | None = None,
          max_cache_tokens: int | None = None, max_waiting: int | None = None,
          drain_timeout: float = 60.0) -> Stats | None:
    """Serve DIR on Triton until SIGINT / SIGTERM (or `stop` is set). `on_ready` gets
    {"models": [...], "http": url, "grpc": address, "provider": ..., "log": Triton's log file or
    None, "generation": None or {"model", "max_sequences", "max_cache_tokens", "max_waiting"}} once the
    server answers. Triton's own log goes to a file (its path in "log"), or with `verbose` to the
    terminal at verbose level 1. A decoder build is also served as a generation model (the
    spec's name; the graphs then NAME_GRAPH), its sequences decoded together by a Scheduler
    with serving.generation's limits, each replaced by the argument given. At a stop, new
    generate requests are refused (503) and those running finish, for up to `drain_timeout`
    seconds, before the server stops. Returns the scheduler's Stats (None without generation)."""
    require_pytriton()
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    check_ports(host, {"http": http_port, "grpc": grpc_port, "metrics": metrics_port})
    session = Session(build_dir, providers=providers)
    info = session.info
    scheduler = codec = None
    if serves_generation(info):
        scheduler = Scheduler(session, GenerationLimits.of(info, max_sequences, max_cache_tokens, max_waiting))
        codec = TextCodec.of_build(build_dir)
    names = rule.model_names(info.name, info.graphs, generation=scheduler is not None)
    batching = rule.dynamic_batching(info.batch.opt, info.batch.max)
    os.environ["LD_LIBRARY_PATH"] = _library_path()
    log = None if verbose else Path(tempfile.gettempdir()) / f"specc-serve-{os.getpid()}.log"
    # Triton's HTTP frontend listens on a loopback port of its own, behind the front on http_port
    # (specc/runtime/front.py: a generate body Triton would answer 500 gets 400 there)
    behind = _free_loopback_port(avoid={http_port, grpc_port, metrics_port})
    config = TritonConfig(http_address="127.0.0.1", http_port=behind, grpc_address=host, grpc_port=grpc_port,
                          metrics_port=metrics_port, allow_metrics=True, log_verbose=1 if verbose else 0, log_file=log)
    stop = stop or threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    models = []
    cancels = front = None
    try:
        if scheduler is not None:  # before Triton starts: its backend stubs inherit the variable
            cancels = Cancels(scheduler)
            os.environ[CANCEL_ENV] = cancels.path
        with _one_line_refusals(), _triton_output(verbose), Triton(config=config) as triton:
            for graph_name, graph in session.graphs.items():
                models.append(names[graph_name])
                triton.bind(
                    model_name=models[-1],
                    infer_func=_infer_fn(graph, session.limits),
                    inputs=_tensors(graph.info.inputs),
                    outputs=_tensors(graph.info.outputs),
                    config=ModelConfig(
                        max_batch_size=batching.max_batch_size,
                        batcher=DynamicBatcher(max_queue_delay_microseconds=batching.max_queue_delay_us,
                                               preferred_batch_size=list(batching.preferred_batch_sizes)),
                    ),
                    strict=False,  # a refusal is a response with the REFUSAL output, not in the config
                )
            generation = None
            if scheduler is not None:
                scheduler.start()
                triton.bind(model_name=info.name, infer_func=_generate_fn(scheduler, codec, cancels),
                            inputs=_fields(endpoint.INPUTS, optional=True), outputs=_fields(endpoint.OUTPUTS),
                            config=ModelConfig(batching=False, decoupled=True), strict=False)
                models.insert(0, info.name)
                limits = scheduler.limits
                generation = {"model": info.name, "max_sequences": limits.max_sequences,
                              "max_cache_tokens": limits.max_cache_tokens, "max_waiting": limits.max_waiting,
                              "text": codec is not None}
            triton.run()
            front = Front(host, http_port, behind, info.name if scheduler is not None else None)
            front.start()
            if on_ready is not None:
                on_ready({"models": models, "http": f"http://{host}:{http_port}", "grpc": f"{host}:{grpc_port}",
                          "provider": session.provider, "log": str(log) if log else None, "generation": generation})
            while not stop.wait(0.2):  # a short wait, so that signal handlers run promptly
                pass
            if scheduler is not None:  # new generate requests answer 503; those running finish
                scheduler.drain(drain_timeout)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if front is not None:
            front.stop()
        if scheduler is not None:
            scheduler.stop()
        if cancels is not None:
            cancels.close()
    return scheduler.stats if scheduler is not None else None


def _fields(fields, optional: bool = False) -> list:
    """PyTriton tensors of the generate endpoint's fields (specc/runtime/endpoint.py)."""
    from pytriton.model_config import Tensor

    dtypes = {"bytes": np.bytes_, "bool": np.bool_}
    return [Tensor(name=f.name, dtype=dtypes.get(f.dtype) or np.dtype(f.dtype), shape=f.shape, optional=optional)
            for f in fields]


def _free_loopback_port(avoid: set[int]) -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, none of AVOID (ports the server is about
    to bind itself)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def check_ports(host: str, ports: dict[str, int]) -> None:
    """Refuse, before anything starts, ports that Triton could not bind: one given twice, or one in
    use (Triton would otherwise retry and wait, and the server never come up). `ports`: the
    --NAME-port flag's NAME -> its port."""
    seen: dict[int, str] = {}
    for name, port in ports.items():
        if port in seen:
            raise ServeError(f"--{seen[port]}-port and --{name}-port are both {port}; give each its own port")
        seen[port] = name
        try:
            family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        except socket.gaierror as exc:
            raise ServeError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: a closing connection is no obstacle
            try:
                s.bind((host, port))
            except OSError as exc:
                why = "is in use (another server?)" if exc.errno == errno.EADDRINUSE else f"cannot be bound ({exc.strerror})"
                raise ServeError(f"port {port} on {host} {why}; choose another with --{name}-port") from None


def summary(stats: Stats) -> str:
    """One line on what the generation model did, for the server's last words."""
    ends = ", ".join(f"{n} {reason}" for reason, n in sorted(stats.finished.items())) or "none"
    return (f"generated {stats.tokens} tokens for {stats.prefills} requests in {stats.steps} batched steps "
            f"(finished: {ends})")


def describe(info: dict[str, Any]) -> str:
    log = f"Triton's log: {info['log']}; " if info.get("log") else ""
    g = info.get("generation")
    gen = (f"; {g['model']} generates ({'text or ' if g['text'] else ''}ids; {g['max_sequences']} sequences at once, "
           f"{g['max_cache_tokens']} cache positions, {g['max_waiting']} waiting)") if g else ""
    return (f"serving {', '.join(info['models'])} ({info['provider']}) on {info['http']} (HTTP) and "
            f"{info['grpc']} (gRPC){gen}; {log}Ctrl-C stops")
