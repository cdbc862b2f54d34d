"""`specc serve DIR` on a real Triton server (PyTriton, in the serve environment `.venv-serve`):
concurrent requests over HTTP and gRPC with tritonclient, answers checked against
specc.runtime.Session (what `specc run` prints), the server stopped cleanly with SIGINT."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specc
from specc.cli import main

pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[2]
SERVE_SPECC = ROOT / ".venv-serve" / "bin" / "specc"
needs_serve_env = pytest.mark.skipif(
    not SERVE_SPECC.exists(), reason="the serve environment is missing: run `make install-serve` (.venv-serve)")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def test_serve_without_pytriton_names_the_environment(tmp_path):
    try:
        import pytriton  # noqa: F401
        pytest.skip("PyTriton is installed in this environment")
    except ImportError:
        pass
    build = specc.build("tiny-gpt2", tmp_path / "b").out_dir
    result = CliRunner().invoke(main, ["serve", str(build)])
    assert result.exit_code == 1, result.output
    assert "make install-serve" in result.stderr and "Traceback" not in result.output


def test_serve_refuses_a_directory_that_is_not_a_build(tmp_path):
    if not SERVE_SPECC.exists():
        pytest.skip("the serve environment is missing: run `make install-serve`")
    proc = subprocess.run([str(SERVE_SPECC), "serve", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "not a specc build" in proc.stderr and "Traceback" not in proc.stderr


class Server:
    def __init__(self, build: Path):
        self.http, self.grpc, self.metrics = free_ports(3)
        self.log = open(build.parent / "serve.log", "w+")
        self.proc = subprocess.Popen(
            [str(SERVE_SPECC), "serve", str(build), "--http-port", str(self.http), "--grpc-port", str(self.grpc),
             "--metrics-port", str(self.metrics)],
            stdout=self.log, stderr=subprocess.STDOUT, env={k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"})
        import tritonclient.http as http

        self.client = http.InferenceServerClient(f"127.0.0.1:{self.http}")
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"specc serve exited {self.proc.returncode}:\n{self.output()}")
            try:
                if self.client.is_server_ready() and "serving" in self.output():
                    break
            except Exception:  # not listening yet
                pass
            assert time.monotonic() < deadline, f"specc serve not ready in 180 s:\n{self.output()}"
            time.sleep(0.5)

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise


def infer(protocol: str, port: int, model: str, feeds: dict[str, np.ndarray], outputs: list[str]) -> dict:
    """One request with tritonclient over `protocol` ("http" or "grpc")."""
    import importlib

    from tritonclient.utils import np_to_triton_dtype

    api = importlib.import_module(f"tritonclient.{protocol}")
    client = api.InferenceServerClient(f"127.0.0.1:{port}")
    inputs = []
    for name, arr in feeds.items():
        t = api.InferInput(name, list(arr.shape), np_to_triton_dtype(arr.dtype))
        t.set_data_from_numpy(arr)
        inputs.append(t)
    res = client.infer(model, inputs, outputs=[api.InferRequestedOutput(o) for o in outputs])
    return {o: res.as_numpy(o) for o in outputs}


@needs_serve_env
def test_serve_answers_concurrent_http_and_grpc_requests_like_specc_run(tmp_path):
    from specc.runtime import Session

    build = specc.build("tiny-bert", tmp_path / "tiny-bert").out_dir
    session = Session(build)
    graph = session.graphs["model"]
    rng = np.random.default_rng(0)
    vocab = session.spec["vocab"]["size"]
    requests = []
    for i in range(16):
        ids = rng.integers(0, vocab, size=(1, 12)).astype(np.int64)
        feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
        if "token_type_ids" in graph.inputs:
            feeds["token_type_ids"] = (np.arange(12) >= 6).astype(np.int64)[None]
        requests.append(feeds)
    outputs = session.output_names
    expected = [session.run(**feeds) for feeds in requests]  # what `specc run` computes

    server = Server(build)
    try:
        model = session.spec["name"]
        with ThreadPoolExecutor(16) as pool:
            futures = [pool.submit(infer, "http" if i % 2 == 0 else "grpc",
                                   server.http if i % 2 == 0 else server.grpc, model, feeds, outputs)
                       for i, feeds in enumerate(requests)]
            answers = [f.result(timeout=120) for f in futures]
        for want, got in zip(expected, answers):
            for name in outputs:
                np.testing.assert_allclose(got[name], want[name], rtol=1e-5, atol=1e-5)
        # the model's config as the server reports it: dynamic batching from serving:
        config = server.client.get_model_config(model)
        assert config["max_batch_size"] == session.spec["serving"]["batch"]["max"]
        assert "dynamic_batching" in config
        assert server.client.get_model_metadata(model)["inputs"][0]["name"] in graph.inputs
    finally:
        code = server.stop()
    assert code == 0, server.output()
    assert "server stopped" in server.output() and "Traceback" not in server.output()
    # nothing listens on its ports any more
    for port in (server.http, server.grpc):
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", port))


@needs_serve_env
def test_serve_decoder_prefill_and_cached_step_over_http(tmp_path):
    """A decoder served stateless: prefill with an empty cache, then one step fed the returned present.*."""
    from specc.runtime import Session

    build = specc.build("tiny-gpt2", tmp_path / "tiny-gpt2").out_dir
    session = Session(build)
    graph = session.graphs["model"]
    ids = np.array([[5, 9, 2, 7]], dtype=np.int64)
    past_names = [n for n in graph.inputs if n.startswith("past_key_values.")]
    present_names = [n for n in graph.outputs if n.startswith("present.")]

    def feeds_for(step_ids, past, start):
        total = start + step_ids.shape[1]
        f = {"input_ids": step_ids, "attention_mask": np.ones((1, total), np.int64)}
        if "position_ids" in graph.inputs:
            f["position_ids"] = np.arange(start, total, dtype=np.int64)[None]
        f.update(past)
        return f

    server = Server(build)
    try:
        # the prefill sends no cache: the server supplies the empty one
        first = infer("http", server.http, session.spec["name"], feeds_for(ids, {}, 0), ["logits"] + present_names)
        want = session.run(**feeds_for(ids, {}, 0))
        np.testing.assert_allclose(first["logits"], want["logits"], rtol=1e-5, atol=1e-5)
        past = {p: first[q] for p, q in zip(sorted(past_names), sorted(present_names))}
        nxt = np.array([[int(first["logits"][0, -1].argmax())]], dtype=np.int64)
        second = infer("http", server.http, session.spec["name"], feeds_for(nxt, past, 4), ["logits"])
        full = session.run(input_ids=np.concatenate([ids, nxt], axis=1))
        np.testing.assert_allclose(second["logits"][0, -1], full["logits"][0, -1], rtol=1e-4, atol=1e-4)
    finally:
        assert server.stop() == 0, server.output()
