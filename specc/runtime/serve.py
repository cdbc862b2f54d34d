"""`specc serve DIR`: a real Triton Inference Server on a build, through NVIDIA's PyTriton: the
server's lifecycle (its ports, its start, its models bound, its stop).

    Session(DIR) (graphs hash-checked) --+--> graph_models.py: one stateless Triton model per graph
                                         +--> generation_model.py: the generate endpoint, over a
                                         |    Scheduler (specc/decoding's engine) and the build's
                                         |    tokenizer (hash-checked as Session checks it)
    pytriton_patch.patched(): PyTriton's model.py with one-line refusals and cancellations
    front.py: the HTTP port (generate bodies checked; /v1/*: openai_api.py, the OpenAI-compatible
    API, on the same Scheduler), Triton's frontend behind it; gRPC and metrics are Triton's own ports

Stopping: the first SIGINT / SIGTERM refuses new generate requests (503) and lets those running
finish, for up to --drain-timeout seconds, saying how many it waits for; a second one cancels
them and the server is gone within 2 s (its tritonserver, in a process group of its own, killed
where it has not stopped by then).

PyTriton bundles the `tritonserver` binary and runs our Python callables in Triton's Python
backend. Model names, dims and dynamic batching follow specc/spec/triton.py, the rule `specc
build --target triton` writes into config.pbtxt: the spec's name for a single graph, NAME_encoder
/ NAME_decoder for an encoder-decoder; max_batch_size = serving.batch.max, preferred batch sizes
serving.batch.opt and .max. On a decoder with an lm output the spec's name goes to the generation
model and each graph is NAME_GRAPH. A refused request answers HTTP 400 (gRPC INVALID_ARGUMENT)
with one line, never a traceback (pytriton_patch.py).

PyTriton needs numpy < 2, so it lives in its own environment (`make install-serve`, the `serve`
extra). The server's Python backend stub links against libpython: on interpreters built outside
the system's (pyenv, conda) the server is started with the interpreter's lib folder on
LD_LIBRARY_PATH.
"""
from __future__ import annotations

import errno
import os
import signal
import socket
import sysconfig
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from specc.runtime import endpoint
from specc.runtime.endpoint import text_codec
from specc.runtime.errors import ServeError
from specc.runtime.front import Front
from specc.runtime.generation_model import Cancels, fields, generate_fn
from specc.runtime.graph_models import infer_fn, tensors
from specc.runtime.embedding import Embedder
from specc.runtime.openai_api import OpenAIApi
from specc.runtime.pytriton_patch import CANCEL_ENV, REFUSAL, check_pytriton, patched
from specc.runtime.scheduler import GenerationLimits, Scheduler, Stats
from specc.runtime.session import Session
from specc.spec import triton as rule
from specc.spec.io import PAST_PREFIX

__all__ = ["DEFAULT_GRPC_PORT", "DEFAULT_HTTP_PORT", "DEFAULT_METRICS_PORT", "REFUSAL", "ServeError", "check_ports",
           "describe", "require_pytriton", "serve", "serves_generation", "summary"]

_infer_fn = infer_fn  # the graph models' callable, under the name the fuzz tests drive it by

DEFAULT_HTTP_PORT = 8000
DEFAULT_GRPC_PORT = 8001
DEFAULT_METRICS_PORT = 8002


def require_pytriton():
    """PyTriton, or ServeError naming the serve environment; ServeError too where the installed
    PyTriton lacks what specc serve relies on (pytriton_patch.RELIED_ON)."""
    try:
        import pytriton.triton  # noqa: F401
    except ImportError as exc:
        raise ServeError(
            "specc serve needs NVIDIA's PyTriton, which needs numpy < 2 and so lives in its own "
            "environment: run `make install-serve`, then `.venv-serve/bin/specc serve DIR` "
            f"(or pip install 'specc[cpu,serve]' into a fresh environment) [{exc}]"
        ) from None
    problems = check_pytriton()
    if problems:
        raise ServeError(f"this PyTriton is not the one specc serve works with ({problems[0]}); install the serve "
                         "extra's PyTriton: `make install-serve`")


def _library_path() -> str:
    """LD_LIBRARY_PATH with this interpreter's lib folder first (for the backend stub's libpython)."""
    libdir = sysconfig.get_config_var("LIBDIR") or ""
    current = os.environ.get("LD_LIBRARY_PATH", "")
    parts = [p for p in current.split(os.pathsep) if p]
    if libdir and libdir not in parts:
        parts.insert(0, libdir)
    return os.pathsep.join(parts)


def serves_generation(info) -> bool:
    """Whether `specc serve` adds the generation model: a decoder build with an lm output."""
    return rule.generates(info.architecture, info.lm_output)


def serve(build_dir: str | Path, *, host: str = "127.0.0.1", http_port: int = DEFAULT_HTTP_PORT,
          grpc_port: int = DEFAULT_GRPC_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
          providers=None, on_ready: Callable[[dict], None] | None = None,
          stop: threading.Event | None = None, verbose: bool = False, max_sequences: int | None = None,
          max_cache_tokens: int | None = None, max_waiting: int | None = None, prefix_cache_tokens: int | None = None,
          drain_timeout: float = 60.0, on_stop: Callable[[str], None] | None = None) -> Stats | None:
    """Serve DIR on Triton until SIGINT / SIGTERM (or `stop` is set). `on_ready` gets
    {"models": [...], "http": url, "grpc": address, "provider": ..., "log": Triton's log file or
    None, "generation": None or {"model", "max_sequences", "max_cache_tokens", "max_waiting",
    "prefix_cache_tokens", "text", "chat"}, "embeddings": whether /v1/embeddings answers} once the
    server answers. Triton's own log goes to a file (its path in "log"), or with `verbose` to the
    terminal at verbose level 1. A decoder build is also served as a generation model (the
    spec's name; the graphs then NAME_GRAPH), its sequences decoded together by a Scheduler
    with serving.generation's limits, each replaced by the argument given. At a stop, new
    generate requests are refused (503) and those running finish, for up to `drain_timeout`
    seconds, before the server stops; a second signal cancels them and stops it at once. The
    OpenAI-compatible API (/v1/*, openai_api.py) answers on the HTTP port, on the same
    scheduler, and /v1/embeddings for a build with a sentence_embedding output. `on_stop` gets
    a line for the user at each stage of stopping. Returns the scheduler's Stats (None without
    generation)."""
    require_pytriton()
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    check_ports(host, {"http": http_port, "grpc": grpc_port, "metrics": metrics_port})
    session = Session(build_dir, providers=providers)
    info = session.info
    scheduler = codec = None
    if serves_generation(info):
        scheduler = Scheduler(session, GenerationLimits.of(info, max_sequences, max_cache_tokens, max_waiting,
                                                           prefix_cache_tokens))
        codec = text_codec(session)
    embedder = Embedder.of(session)
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
    now = threading.Event()  # a second signal: stop without waiting for anything
    say = on_stop or (lambda line: None)
    signals = _Signals(stop, now) if threading.current_thread() is threading.main_thread() else None
    models = []
    cancels = front = triton = None
    try:
        if scheduler is not None:  # before Triton starts: its backend stubs inherit the variable
            cancels = Cancels(scheduler)
            os.environ[CANCEL_ENV] = cancels.path
        with patched(verbose, f"{PAST_PREFIX}."), Triton(config=config) as triton:
            for graph_name, graph in session.graphs.items():
                models.append(names[graph_name])
                triton.bind(
                    model_name=models[-1],
                    infer_func=infer_fn(graph, session.limits),
                    inputs=tensors(graph.info.inputs),
                    outputs=tensors(graph.info.outputs),
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
                triton.bind(model_name=info.name, infer_func=generate_fn(scheduler, codec, cancels),
                            inputs=fields(endpoint.INPUTS, optional=True), outputs=fields(endpoint.OUTPUTS),
                            config=ModelConfig(batching=False, decoupled=True), strict=False)
                models.insert(0, info.name)
                limits = scheduler.limits
                generation = {"model": info.name, "max_sequences": limits.max_sequences,
                              "max_cache_tokens": limits.max_cache_tokens, "max_waiting": limits.max_waiting,
                              "prefix_cache_tokens": scheduler.prefix.max_positions if scheduler.prefix else 0,
                              "text": codec is not None, "chat": codec is not None and codec.template is not None}
            triton.run()
            front = Front(host, http_port, behind, info.name if scheduler is not None else None,
                          OpenAIApi(info.name, scheduler, codec, embedder))
            front.start()
            if on_ready is not None:
                on_ready({"models": models, "http": f"http://{host}:{http_port}", "grpc": f"{host}:{grpc_port}",
                          "provider": session.provider, "log": str(log) if log else None, "generation": generation,
                          "embeddings": embedder is not None})
            while not stop.wait(0.2):  # a short wait, so that signal handlers run promptly
                pass
            threading.Thread(target=_stop_now, args=(now, scheduler, triton, say), name="specc-stop-now",
                             daemon=True).start()
            if scheduler is not None:  # new generate requests answer 503; those running finish
                _drain(scheduler, drain_timeout, now, say)
            front.stopping.set()
            say("specc serve: stopping Triton" + ("" if now.is_set() else "; Ctrl-C again stops now"))
            if scheduler is not None and not scheduler.idle():  # past the drain: what is left ends before Triton stops
                scheduler.cancel_all()
                deadline = time.monotonic() + 1.0
                while not scheduler.idle() and time.monotonic() < deadline:
                    time.sleep(0.02)
    finally:
        if signals is not None:
            signals.restore()
        if front is not None:
            front.stop()
        if scheduler is not None:
            scheduler.stop()
        if cancels is not None:
            cancels.close()
    return scheduler.stats if scheduler is not None else None


class _Signals:
    """SIGINT and SIGTERM while serving: the first sets `stop`, any later one `now`. Told by a thread
    of its own through Python's signal wakeup fd, so a signal is acted on at once even while the
    main thread waits inside a call that defers Python's signal handlers (PyTriton's stop waits on
    Triton's process)."""

    def __init__(self, stop: threading.Event, now: threading.Event):
        self.reader, writer = socket.socketpair()
        self.writer = writer
        writer.setblocking(False)
        self.handlers = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGINT, signal.SIGTERM)}
        self.wakeup = signal.set_wakeup_fd(writer.fileno(), warn_on_full_buffer=False)

        def read() -> None:
            while True:
                try:
                    got = self.reader.recv(64)
                except OSError:
                    return
                if not got:
                    return
                for number in got:
                    if number in (signal.SIGINT, signal.SIGTERM):
                        (now if stop.is_set() else stop).set()

        threading.Thread(target=read, name="specc-signals", daemon=True).start()

    def restore(self) -> None:
        signal.set_wakeup_fd(self.wakeup)
        for s, handler in self.handlers.items():
            signal.signal(s, handler)
        self.writer.close()
        self.reader.close()


def _drain(scheduler: Scheduler, timeout: float, now: threading.Event, say: Callable[[str], None]) -> None:
    """Refuse new generate requests (503) and wait up to `timeout` seconds for those queued and
    running to end, saying how many there are; `now` set (a second signal) ends the wait."""
    scheduler.close()
    stats = scheduler.stats
    if scheduler.idle():
        return
    say(f"specc serve: stopping: new requests are refused; waiting up to {timeout:g} s (--drain-timeout) for "
        f"{stats.active} running and {stats.waiting} queued generate requests to finish; Ctrl-C again stops now")
    deadline = time.monotonic() + timeout
    while not scheduler.idle() and not now.is_set():
        if time.monotonic() > deadline:
            say(f"specc serve: --drain-timeout {timeout:g} s is over; cancelling what still runs")
            return

        now.wait(0.05)


def _stop_now(now: threading.Event, scheduler: Scheduler | None, triton, say: Callable[[str], None]) -> None:
    """Once the server is stopping, on a thread of its own: at a second signal (`now`), every
    generate request ends (cancelled) and the process is gone within STOP_NOW_S: where the
    orderly stop has not ended by then, Triton's server process group (its own: pytriton_patch)
    is killed and this process exits (130, as an interrupted command)."""
    now.wait()
    started = time.monotonic()
    running = 0 if scheduler is None else scheduler.stats.active + scheduler.stats.waiting
    say(f"specc serve: stopping now{f'; cancelling {running} generate requests' if running else ''}")
    if scheduler is not None:
        scheduler.cancel_all()
    time.sleep(max(0.0, STOP_NOW_S - 0.4 - (time.monotonic() - started)))
    pid = getattr(getattr(getattr(triton, "_triton_server", None), "_tritonserver_running_cmd", None), "pid", None)
    if pid:
        try:
            os.killpg(pid, signal.SIGKILL)  # tritonserver and its backend stubs
        except OSError:
            pass
    os._exit(130)


STOP_NOW_S = 2.0  # how long a second signal gives the server to be gone


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
    reused = f"; {stats.reused} of {stats.reused + stats.prefilled} prompt positions from the prefix cache" \
        if stats.reused else ""
    return (f"generated {stats.tokens} tokens for {stats.prefills} requests in {stats.steps} batched steps "
            f"(finished: {ends}){reused}")


def describe(info: dict[str, Any]) -> str:
    log = f"Triton's log: {info['log']}; " if info.get("log") else ""
    g = info.get("generation")
    prefix = f"a prefix cache of {g['prefix_cache_tokens']} positions" if g and g["prefix_cache_tokens"] else \
        "no prefix cache"
    gen = (f"; {g['model']} generates ({'text or ' if g['text'] else ''}ids; {g['max_sequences']} sequences at once, "
           f"{g['max_cache_tokens']} cache positions, {g['max_waiting']} waiting); {prefix}; the OpenAI-compatible "
           f"API at {info['http']}/v1"
           f"{'' if g['chat'] else ' (completions only: no chat template)' if g['text'] else ' (none: no tokenizer)'}") \
        if g else ""
    embeddings = f"; sentence embeddings at {info['http']}/v1/embeddings" if info.get("embeddings") else ""
    return (f"serving {', '.join(info['models'])} ({info['provider']}) on {info['http']} (HTTP) and "
            f"{info['grpc']} (gRPC){gen}{embeddings}; {log}Ctrl-C stops")
