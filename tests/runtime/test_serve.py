"""`specc serve DIR` on a real Triton server (PyTriton, in the serve environment `.venv-serve`):
concurrent requests over HTTP and gRPC with tritonclient, answers checked against
specc.runtime.Session (what `specc run` prints), the server stopped cleanly with SIGINT."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.request
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


def test_ports_triton_cannot_bind_are_refused_before_anything_starts():
    from specc.runtime.serve import ServeError, check_ports

    a, b, c = free_ports(3)
    check_ports("127.0.0.1", {"http": a, "grpc": b, "metrics": c})  # free: no error
    with pytest.raises(ServeError, match=f"--http-port and --metrics-port are both {a}"):
        check_ports("127.0.0.1", {"http": a, "grpc": b, "metrics": a})
    with socket.socket() as held:
        held.bind(("127.0.0.1", b))
        held.listen()
        with pytest.raises(ServeError, match=f"port {b} on 127.0.0.1 is in use .*--grpc-port"):
            check_ports("127.0.0.1", {"http": a, "grpc": b, "metrics": c})


@needs_serve_env
def test_serve_on_a_taken_port_exits_at_once_naming_it(tmp_path):
    build = specc.build("tiny-gpt2", tmp_path / "b").out_dir
    http, grpc, metrics = free_ports(3)
    with socket.socket() as held:
        held.bind(("127.0.0.1", http))
        held.listen()
        t0 = time.monotonic()
        proc = subprocess.run([str(SERVE_SPECC), "serve", str(build), "--http-port", str(http), "--grpc-port", str(grpc),
                               "--metrics-port", str(metrics)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"port {http} on 127.0.0.1 is in use" in proc.stderr and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60


class Server:
    """`specc serve BUILD ARGS` on free ports, ready. `own_group`: in a process group of its own, as
    a terminal's foreground job is (a terminal's Ctrl-C is os.killpg(proc.pid, SIGINT)); `env`:
    variables set for it."""

    def __init__(self, build: Path, *args: str, own_group: bool = False, env: dict | None = None):
        self.http, self.grpc, self.metrics = free_ports(3)
        self.log = open(build.parent / "serve.log", "w+")
        self.proc = subprocess.Popen(
            [str(SERVE_SPECC), "serve", str(build), "--http-port", str(self.http), "--grpc-port", str(self.grpc),
             "--metrics-port", str(self.metrics), *args],
            stdout=self.log, stderr=subprocess.STDOUT, start_new_session=own_group,
            env={**{k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}, **(env or {})})
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

    def stop(self, sig=signal.SIGINT) -> int:
        self.proc.send_signal(sig)
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


def refusal(protocol: str, port: int, model: str, feeds: dict[str, np.ndarray]) -> tuple[str, str]:
    """(status, message) of a request the server refuses: "400" over HTTP, "StatusCode.INVALID_ARGUMENT"
    over gRPC; the message must be one line, without a traceback or a path of the server's."""
    from tritonclient.utils import InferenceServerException

    with pytest.raises(InferenceServerException) as info:
        infer(protocol, port, model, feeds, [])
    message = info.value.message()
    assert "\n" not in message and "Traceback" not in message and ".py" not in message, message
    assert str(ROOT) not in message and "/tmp" not in message, message
    return str(info.value.status()), message


BAD = {"http": "400", "grpc": "StatusCode.INVALID_ARGUMENT"}


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
        # a token type past the type vocabulary: 400 with one line, and the next request is answered
        bad = dict(requests[0], token_type_ids=np.full((1, 12), 2, np.int64))
        for protocol, port in (("http", server.http), ("grpc", server.grpc)):
            status, message = refusal(protocol, port, model, bad)
            assert status == BAD[protocol] and message.startswith("token_type_ids: type id(s) [2]"), message
            got = infer(protocol, port, model, requests[0], outputs)
            np.testing.assert_allclose(got[outputs[0]], expected[0][outputs[0]], rtol=1e-5, atol=1e-5)
    finally:
        code = server.stop()
    assert code == 0, server.output()
    assert "server stopped" in server.output() and "Traceback" not in server.output()
    # nothing listens on its ports any more
    for port in (server.http, server.grpc):
        with socket.socket() as s, pytest.raises(ConnectionRefusedError):
            s.connect(("127.0.0.1", port))


@pytest.fixture(scope="module")
def gpt2_server(tmp_path_factory):
    """One server of a tiny-gpt2 build for the tests of its graph model (the xdist group keeps
    them on one worker); its output at start, and a clean stop after."""
    build = specc.build("tiny-gpt2", tmp_path_factory.mktemp("served") / "tiny-gpt2").out_dir
    server = Server(build)
    started = server.output()
    yield build, server, started
    code = server.stop()
    assert code == 0, server.output()
    assert "Traceback" not in server.output()


@needs_serve_env
@pytest.mark.xdist_group("gpt2-server")
def test_serve_decoder_prefill_and_cached_step_over_http(gpt2_server):
    """A decoder served stateless: prefill with an empty cache, then one step fed the returned present.*."""
    from specc.runtime import Session

    build, server, started = gpt2_server
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

    # one line to start with, Triton's own log in the file it names
    lines = started.splitlines()
    assert len(lines) == 1 and lines[0].startswith("serving tiny-gpt2, tiny-gpt2_model ") and "Triton's log: " in lines[0], lines
    assert "tiny-gpt2 generates (ids; 4 sequences at once, 512 cache positions, 64 waiting)" in lines[0], lines
    assert "server_version" in Path(lines[0].split("Triton's log: ")[1].split(";")[0]).read_text()
    # the request docs/serving.md gives to paste answers as specc run does
    doc = (ROOT / "docs" / "serving.md").read_text()
    body = doc.split("<!-- request: tiny-gpt2 -->")[1].split("-d '")[1].split("'\n")[0]
    req = urllib.request.Request(f"http://127.0.0.1:{server.http}/v2/models/tiny-gpt2_model/infer", data=body.encode())
    with urllib.request.urlopen(req, timeout=60) as answer:
        got = json.loads(answer.read())["outputs"][0]
    assert got["name"] == "logits" and got["shape"] == [1, 3, 1000]
    np.testing.assert_allclose(np.array(got["data"]).reshape(1, 3, 1000), session.run(input_ids=[[5, 9, 2]])["logits"],
                               rtol=1e-4, atol=1e-4)
    # the prefill sends no cache: the server supplies the empty one
    model = session.spec["name"] + "_model"  # the spec's name is the generation model's
    first = infer("http", server.http, model, feeds_for(ids, {}, 0), ["logits"] + present_names)
    want = session.run(**feeds_for(ids, {}, 0))
    np.testing.assert_allclose(first["logits"], want["logits"], rtol=1e-5, atol=1e-5)
    past = {p: first[q] for p, q in zip(sorted(past_names), sorted(present_names))}
    nxt = np.array([[int(first["logits"][0, -1].argmax())]], dtype=np.int64)
    second = infer("http", server.http, model, feeds_for(nxt, past, 4), ["logits"])
    full = session.run(input_ids=np.concatenate([ids, nxt], axis=1))
    np.testing.assert_allclose(second["logits"][0, -1], full["logits"][0, -1], rtol=1e-4, atol=1e-4)


@needs_serve_env
@pytest.mark.xdist_group("gpt2-server")
def test_serve_answers_client_mistakes_with_400_and_one_line_and_goes_on(gpt2_server):
    """Each mistake `specc run` refuses is refused by the server too: HTTP 400 / gRPC INVALID_ARGUMENT
    with the same one line (no traceback, no server path), and a good request right after it is
    answered as Session answers it. Mistakes sent concurrently with good requests fail alone."""
    from specc.runtime import RunError, Session

    build, server, _ = gpt2_server
    session = Session(build)
    model = session.spec["name"] + "_model"
    past = [n for n in session.graphs["model"].inputs if n.startswith("past_key_values.")]

    def feeds(ids, mask=None, positions=None, cache=None):
        ids = np.asarray(ids, np.int64)
        b, t = ids.shape
        p = 0 if not cache else next(iter(cache.values())).shape[2]
        f = {"input_ids": ids,
             "attention_mask": np.ones((b, p + t), np.int64) if mask is None else np.asarray(mask, np.int64),
             "position_ids": np.arange(p, p + t, dtype=np.int64)[None].repeat(b, 0) if positions is None
             else np.asarray(positions, np.int64)}
        return {**f, **(cache or {})}

    def cache(heads=4, length=2, names=past):
        return {n: np.zeros((1, heads, length, 16), np.float32) for n in names}

    mistakes = {  # id -> (request, the start of the one line; None: Triton's own refusal of a shape)
        "negative-id": (feeds([[-5, 9, 2]]), "input_ids: token id(s) [-5] outside the vocabulary (0..999)"),
        "id-past-vocab": (feeds([[5000, 9, 2]]), "input_ids: token id(s) [5000]"),
        "mask-values": (feeds([[5, 9, 2]], mask=[[7, -1, 0]]), "attention_mask: values must be 0 or 1"),
        "mask-length": (feeds([[5, 9]], mask=[[1, 1, 1]]), "attention_mask: covers 3 positions"),
        "negative-position": (feeds([[5, 9, 2]], positions=[[0, -1, 2]]), "position_ids: position(s) [-1]"),
        "position-past-table": (feeds([[5, 9, 2]], positions=[[0, 1, 500]]), "position_ids: position(s) [500]"),
        "empty-sequence": (feeds(np.zeros((1, 0))), "input_ids: empty tensor (shape [1, 0])"),
        "too-long": (feeds(np.ones((1, 200))), "input_ids: sequence of 200, more than the build's serving.length.max 128"),
        "cache-past-length": (feeds([[1, 2]], cache=cache(length=127)), "attention_mask: total_sequence of 129"),
        "zero-length-cache": (feeds([[1]], cache=cache(length=0)), past[0] + ": a zero-length cache"),
        "partial-cache": (feeds([[1]], cache=cache(names=past[:1])), past[0] + ": the cache comes whole"),
        "cache-heads": (feeds([[1]], cache=cache(heads=3)), None),
        "batch-past-max": (feeds(np.ones((5, 3))), None),
    }
    good = feeds([[5, 9, 2]])
    want = session.run(**good)["logits"]
    for name, (request, line) in mistakes.items():
        in_process = None
        if name not in ("empty-sequence", "zero-length-cache", "cache-heads", "batch-past-max"):
            with pytest.raises(RunError) as info:
                session.run(**request)  # what `specc run` says
            in_process = str(info.value)
        for protocol, port in (("http", server.http), ("grpc", server.grpc)):
            status, message = refusal(protocol, port, model, request)
            assert status == BAD[protocol], (name, status, message)
            if line is not None:
                assert message.startswith(line), (name, message)
            if in_process is not None:
                assert message == in_process, (name, message)
            got = infer(protocol, port, model, good, ["logits"])["logits"]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # bad and good requests at once: Triton may batch them together; each bad one fails alone
    bad = feeds([[-5, 9, 2]])
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: infer("http", server.http, model, good, ["logits"]) if i % 2
                                else refusal("http", server.http, model, bad), range(32)))
    for i, answer in enumerate(answers):
        if i % 2:
            np.testing.assert_allclose(answer["logits"], want, rtol=1e-5, atol=1e-5)
        else:
            assert answer == ("400", mistakes["negative-id"][1]), answer
    assert server.proc.poll() is None  # still serving


# --- the build's tokenizer, checked as Session checks it ---------------------------------------------


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """A tiny-gpt2 build whose spec carries a tokenizer (hashed among its artifacts)."""
    from tests.runtime.test_serve_generate import word_tokenizer

    folder = tmp_path_factory.mktemp("tokenized")
    (folder / "tok").mkdir()
    word_tokenizer(folder / "tok" / "tokenizer.json")
    spec = folder / "tiny-gpt2.yaml"
    spec.write_text("specc: 1\nname: tiny-gpt2\nextends: tiny-gpt2\ntokenizer: tok\n")
    return specc.build(spec, folder / "tiny-gpt2").out_dir


def _copy(build: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(build, to))


def test_the_servers_tokenizer_is_hash_checked(with_tokenizer, tmp_path):
    """endpoint.text_codec: the build's tokenizer as Session.tokenizer reads it; a tokenizer.json
    changed since the build, or one the manifest does not list, is refused naming it."""
    from specc.runtime import RunError, Session
    from specc.runtime.endpoint import text_codec

    codec = text_codec(Session(with_tokenizer))
    assert codec is not None and codec.encode("tok5 tok9") == [5, 9] and codec.decode([5, 9]) == "tok5 tok9"
    tampered = _copy(with_tokenizer, tmp_path / "tampered")
    path = tampered / "tokenizer.json"
    path.write_text(path.read_text().replace('"tok5"', '"tok5x"'))
    with pytest.raises(RunError, match=r"tokenizer.json: changed since the build verified it \(its sha256 is not the "
                                       r"manifest's\)"):
        text_codec(Session(tampered))
    plain = specc.build("tiny-gpt2", tmp_path / "plain").out_dir
    assert text_codec(Session(plain)) is None  # no tokenizer: ids in and out
    (plain / "tokenizer.json").write_text(path.read_text())
    with pytest.raises(RunError, match="tokenizer.json is not among the build's artifacts; rebuild it"):
        text_codec(Session(plain))


@needs_serve_env
def test_serve_refuses_a_tampered_tokenizer_before_it_starts(with_tokenizer, tmp_path):
    tampered = _copy(with_tokenizer, tmp_path / "tampered")
    path = tampered / "tokenizer.json"
    path.write_text(path.read_text().replace('"tok5"', '"tok5x"'))
    http, grpc, metrics = free_ports(3)
    proc = subprocess.run([str(SERVE_SPECC), "serve", str(tampered), "--http-port", str(http), "--grpc-port", str(grpc),
                           "--metrics-port", str(metrics)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert f"{path}: changed since the build verified it" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


# --- what specc serve changes in PyTriton ----------------------------------------------------------------


@needs_serve_env
def test_pytriton_has_what_specc_serve_patches():
    """Every PyTriton name specc/runtime/pytriton_patch.py patches or calls is there, with the
    parameters it relies on, in the serve environment's PyTriton; and the code it appends to
    PyTriton's proxy model.py compiles there."""
    script = ("import json, pathlib, pytriton\n"
              "from specc.runtime.pytriton_patch import check_pytriton, stub_source\n"
              "from specc.spec.io import PAST_PREFIX\n"
              "proxy = pathlib.Path(pytriton.__file__).parent / 'proxy' / 'model.py'\n"
              "compile(proxy.read_text() + stub_source(PAST_PREFIX + '.'), str(proxy), 'exec')\n"
              "print(json.dumps(check_pytriton()))")
    out = subprocess.run([str(ROOT / ".venv-serve" / "bin" / "python"), "-c", script], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_pytriton_check_fails_when_pytriton_changes():
    """check_pytriton names a method gone, a parameter renamed and an attribute no longer set."""
    from specc.runtime.pytriton_patch import RELIED_ON, check_pytriton

    sources = {
        "models/model.py": "class Model:\n    SCRIPT_FILES_TO_COPY = []\n"
                           "    def generate_model(self, model_repository): ...\n    def get_proxy_model_files(self): ...\n",
        "triton.py": "from pytriton.server.triton_server import TritonServer\n",
        "server/triton_server.py": "class TritonServer:\n    def __init__(self, *, path, libs_path, config, gpus=None, "
                                   "verbose=True): ...\n",
        "proxy/model.py": "from .communication import PyTritonResponseFlags\n"
                          "def _wrap_response(response, requested_outputs_names, model_outputs_dict): ...\n"
                          "class TritonPythonModel:\n    def __init__(self):\n        self._decoupled_model = None\n"
                          "    def execute(self, triton_requests): ...\n"
                          "class TritonRequestsServer:\n    def _wrap_request(self, triton_request, inputs, span=None): ...\n"
                          "class DecoupledResponsesHandler:\n"
                          "    def __init__(self, requests_map, serializer_deserializer, model_outputs_dict):\n"
                          "        self._requests_map = requests_map\n"
                          "        self._serializer_deserializer = serializer_deserializer\n"
                          "        self._model_outputs_dict = model_outputs_dict\n"
                          "    async def handle_responses(self, scope, responses_queue, responses_future): ...\n",
        "proxy/communication.py": "class PyTritonResponseFlags:\n    EOS = 1\n    ERROR = 2\n",
        "proxy/data.py": "class BaseRequestsResponsesSerializerDeserializer:\n"
                         "    def deserialize_responses(self, responses_payload): ...\n"
                         "    def free_responses_resources(self, responses_payload): ...\n",
    }
    assert check_pytriton(sources) == [] and len(RELIED_ON) == 18  # the stand-in has all it needs
    changed = dict(sources)
    changed["proxy/model.py"] = (sources["proxy/model.py"]
                                 .replace("def _wrap_request(self, triton_request,", "def _wrap_request(self, request,")
                                 .replace("        self._requests_map = requests_map\n", "")
                                 .replace("async def handle_responses", "async def handle"))
    assert check_pytriton(changed) == [
        "pytriton/proxy/model.py: TritonRequestsServer._wrap_request(self, request, inputs, span), where specc serve "
        "calls it with (self, triton_request, ...)",
        "pytriton/proxy/model.py: no DecoupledResponsesHandler.handle_responses",
        "pytriton/proxy/model.py: no DecoupledResponsesHandler._requests_map",
    ]
