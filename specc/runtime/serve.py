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

PyTriton needs numpy < 2, so it lives in its own environment (`make install-serve`, the `serve`
extra). The server's Python backend stub links against libpython: on interpreters built outside
the system's (pyenv, conda) the server is started with the interpreter's lib folder on
LD_LIBRARY_PATH.
"""
from __future__ import annotations

import os
import signal
import sysconfig
import threading
from pathlib import Path
from typing import Any, Callable

import numpy as np

from specc.errors import SpeccError
from specc.runtime.cache import empty_cache
from specc.runtime.graph import Graph
from specc.runtime.session import Session
from specc.spec import triton as rule
from specc.spec.io import is_growing, is_past, numpy_dtype
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


def _infer_fn(graph: Graph) -> Callable:
    from pytriton.decorators import batch

    lock = threading.Lock()  # one onnxruntime run at a time per graph: the session's threads do the rest

    @batch
    def infer(**inputs: np.ndarray) -> dict[str, np.ndarray]:
        batch_size = len(next(iter(inputs.values())))
        for name, value in empty_cache(graph, batch_size).items():
            inputs.setdefault(name, value)
        with lock:
            out = graph.run(inputs)
        return {k: v.numpy() for k, v in out.items()}

    return infer


def serve(build_dir: str | Path, *, host: str = "127.0.0.1", http_port: int = DEFAULT_HTTP_PORT,
          grpc_port: int = DEFAULT_GRPC_PORT, metrics_port: int = DEFAULT_METRICS_PORT,
          providers=None, on_ready: Callable[[dict], None] | None = None,
          stop: threading.Event | None = None) -> None:
    """Serve DIR on Triton until SIGINT / SIGTERM (or `stop` is set). `on_ready` gets
    {"models": [...], "http": url, "grpc": address} once the server answers."""
    require_pytriton()
    from pytriton.model_config import DynamicBatcher, ModelConfig
    from pytriton.triton import Triton, TritonConfig

    session = Session(build_dir, providers=providers)
    info = session.info
    names = rule.model_names(info.name, info.graphs)
    batching = rule.dynamic_batching(info.batch.opt, info.batch.max)
    os.environ["LD_LIBRARY_PATH"] = _library_path()
    config = TritonConfig(http_address=host, http_port=http_port, grpc_address=host, grpc_port=grpc_port,
                          metrics_port=metrics_port, allow_metrics=True, log_verbose=0)
    stop = stop or threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    models = []
    try:
        with Triton(config=config) as triton:
            for graph_name, graph in session.graphs.items():
                models.append(names[graph_name])
                triton.bind(
                    model_name=models[-1],
                    infer_func=_infer_fn(graph),
                    inputs=_tensors(graph.info.inputs),
                    outputs=_tensors(graph.info.outputs),
                    config=ModelConfig(
                        max_batch_size=batching.max_batch_size,
                        batcher=DynamicBatcher(max_queue_delay_microseconds=batching.max_queue_delay_us,
                                               preferred_batch_size=list(batching.preferred_batch_sizes)),
                    ),
                    strict=True,
                )
            triton.run()
            if on_ready is not None:
                on_ready({"models": models, "http": f"http://{host}:{http_port}", "grpc": f"{host}:{grpc_port}",
                          "provider": session.provider})
            while not stop.wait(0.2):  # a short wait, so that signal handlers run promptly
                pass
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def describe(info: dict[str, Any]) -> str:
    return (f"serving {', '.join(info['models'])} ({info['provider']}) on {info['http']} (HTTP) and "
            f"{info['grpc']} (gRPC); Ctrl-C stops")
