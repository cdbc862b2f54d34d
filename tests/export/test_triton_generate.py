"""--target triton on a decoder: the generation model (NAME: Triton's generate endpoint in the stock
Python backend, its loop calling NAME_model by BLS).

Without a server: its config.pbtxt parsed with Triton's own protobuf definitions, generation.json
against the build, model.py importing nothing of specc; its loop (specc/export/triton_generate.py's
Engine) over the graph with onnxruntime gives, for requests arriving at different times and
decoded together, the tokens Session.generate gives each alone (greedy and seeded sampling); its
refusals are specc serve's, word for word.

On a real server: the tritonserver binary PyTriton bundles, started directly on the repository
(no PyTriton, no specc process). That binary has the Python backend only, no ONNX Runtime backend,
so NAME_model is served by tests/export/triton_standin.py (the same ONNX graph run with onnxruntime
inside the Python backend); the generation model is the build's, unchanged."""
from __future__ import annotations

import ast
import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from specc.export import triton_generate
from specc.pipeline import build
from specc.spec import triton as rule

ort = pytest.importorskip("onnxruntime")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
text_format = pytest.importorskip("google.protobuf.text_format")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # the serve tests' helpers
from test_serve import ROOT, free_ports  # noqa: E402
from test_serve_generate import generate, grpc_generate, joined, word_tokenizer  # noqa: E402

SERVE_PYTHON = ROOT / ".venv-serve" / "bin" / "python"
needs_serve_env = pytest.mark.skipif(
    not SERVE_PYTHON.exists(), reason="the serve environment is missing: run `make install-serve` (.venv-serve)")
DECODERS = ["tiny-gpt2", "tiny-llama"]
# what model.py may import: the standard library, numpy, tokenizers and Triton's own module
ALLOWED = {"__future__", "collections", "json", "math", "os", "threading", "time", "numpy", "tokenizers",
           "triton_python_backend_utils"}


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """name -> a built repository; tiny-gpt2's spec carries a tokenizer (`tokenizer:`), which the
    build copies to the repository's root."""
    done: dict = {}

    def get(name: str) -> Path:
        if name not in done:
            folder = tmp_path_factory.mktemp("repo")
            spec = name
            if name == "tiny-gpt2":
                (folder / "tok").mkdir()
                word_tokenizer(folder / "tok" / "tokenizer.json")
                spec = folder / "tiny-gpt2.yaml"
                spec.write_text("specc: 1\nname: tiny-gpt2\nextends: tiny-gpt2\ntokenizer: tok\n")
            done[name] = build(spec, folder / name, target="triton").out_dir
        return done[name]

    return get


def _config(path: Path):
    cfg = model_config_pb2.ModelConfig()
    text_format.Parse(path.read_text(), cfg)
    return cfg


def _facts(repo: Path, name: str) -> dict:
    return json.loads((repo / name / "1" / triton_generate.FACTS_FILE).read_text())


def test_generation_model_is_written_for_a_decoder(repos):
    from specc.spec.load import load_spec
    from specc.spec.resolve import resolve

    repo = repos("tiny-gpt2")
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["tiny-gpt2", "tiny-gpt2_model"]
    assert sorted(p.name for p in (repo / "tiny-gpt2" / "1").iterdir()) == ["generation.json", "model.py"]
    assert (repo / "tiny-gpt2" / "1" / "model.py").read_bytes() == Path(triton_generate.__file__).read_bytes()
    manifest = json.loads((repo / "manifest.json").read_text())
    assert manifest["graphs"]["model"]["file"] == "tiny-gpt2_model/1/model.onnx"
    listed = {a["path"] for a in manifest["artifacts"]}
    assert {"tiny-gpt2/config.pbtxt", "tiny-gpt2/1/model.py", "tiny-gpt2/1/generation.json"} <= listed

    cfg = _config(repo / "tiny-gpt2" / "config.pbtxt")
    assert cfg.name == "tiny-gpt2" and cfg.backend == "python" and not cfg.platform
    assert cfg.max_batch_size == 0 and cfg.model_transaction_policy.decoupled
    names = {"bytes": "TYPE_STRING", "bool": "TYPE_BOOL", "int64": "TYPE_INT64", "int32": "TYPE_INT32",
             "float32": "TYPE_FP32"}
    for entries, fields, optional in ((cfg.input, rule.GENERATE_INPUTS, True), (cfg.output, rule.GENERATE_OUTPUTS, False)):
        assert [e.name for e in entries] == [f.name for f in fields]
        for e, f in zip(entries, fields):
            assert model_config_pb2.DataType.Name(e.data_type) == names[f.dtype], e.name
            assert tuple(e.dims) == f.shape and (not optional or e.optional), e.name

    facts = _facts(repo, "tiny-gpt2")
    r = resolve(load_spec("tiny-gpt2"))
    graph = _config(repo / "tiny-gpt2_model" / "config.pbtxt")
    assert facts["graph_model"] == graph.name == "tiny-gpt2_model"
    assert facts["eos"] == r.tokens.eos and facts["vocab"] == r.vocab.size
    assert facts["context"] == facts["length_max"] == r.serving.length.max
    assert (facts["max_sequences"], facts["max_cache_tokens"]) == (r.serving.batch.max,
                                                                   r.serving.batch.max * r.serving.length.max)
    inputs, outputs = {i.name: i for i in graph.input}, {o.name for o in graph.output}
    assert {facts["ids"], facts["mask"], facts["positions"]} <= set(inputs) and facts["logits"] in outputs
    growing = [n for n in inputs if n not in (facts["ids"], facts["mask"], facts["positions"])]
    assert [c["input"] for c in facts["cache"]] == growing and all(c["output"] in outputs for c in facts["cache"])
    for c in facts["cache"]:
        assert [c["heads"], -1, c["head_dim"]] == list(inputs[c["input"]].dims)


def test_encoder_decoder_gets_no_generation_model(tmp_path):
    repo = build("tiny-transformer", tmp_path / "t", target="triton").out_dir
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["tiny-transformer_decoder", "tiny-transformer_encoder"]


def test_model_py_imports_nothing_of_specc():
    tree = ast.parse(Path(triton_generate.__file__).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names} | \
        {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= ALLOWED, imported - ALLOWED
    assert "specc" not in imported and len(imported) > 5  # the walk sees the imports


class Sink:
    def __init__(self):
        self.tokens: list[int] = []
        self.reason = self.error = None

    def token(self, token_id):
        self.tokens.append(token_id)
        return True

    def done(self, reason, error=None):
        self.reason, self.error = reason, error

    def cancelled(self):
        return False


def _engine(repo: Path, name: str, **limits) -> tuple:
    facts = {**_facts(repo, name), **limits}
    sess = ort.InferenceSession(str(repo / facts["graph_model"] / "1" / "model.onnx"), providers=["CPUExecutionProvider"])
    outs = [o.name for o in sess.get_outputs()]
    calls = []

    def run(feeds):
        calls.append(len(feeds[facts["ids"]]))
        return dict(zip(outs, sess.run(outs, feeds)))

    return triton_generate.Engine(facts, run), facts, calls


def _request(facts, ids, n, **opts):
    return triton_generate.parse(facts, {"input_ids": np.asarray(ids, dtype=np.int64)},
                                 {"max_tokens": n, **opts}, None)


@pytest.mark.parametrize("name", DECODERS)
def test_engine_batches_requests_and_answers_as_session_generate(repos, name):
    """14 requests of different lengths arriving over several iterations, 4 decoded at once
    (greedy, and seeded sampling with temperature / top_k / top_p): each gets the tokens
    Session.generate gives its prompt alone; the decode steps ran batched."""
    from specc.runtime import Session

    repo = repos(name)
    session = Session(repo)
    engine, facts, calls = _engine(repo, name, max_sequences=4)
    rng = np.random.default_rng(1)
    cases = []
    for i in range(14):
        ids = rng.integers(0, 999, size=int(rng.integers(1, 20))).tolist()
        opts = [{}, {"temperature": 0.8, "seed": i}, {"top_k": 5, "seed": i}, {"top_p": 0.9, "temperature": 1.3, "seed": i}][i % 4]
        cases.append((ids, int(rng.integers(1, 16)), opts))
    sinks = [Sink() for _ in cases]
    for i, ((ids, n, opts), sink) in enumerate(zip(cases, sinks)):
        engine.submit(_request(facts, ids, n, eos=-1, **opts), sink)
        if i % 3 == 2:  # later arrivals join sequences already running
            engine.step()
    while engine.step():
        pass
    for (ids, n, opts), sink in zip(cases, sinks):
        want = session.generate(ids, max_new_tokens=n, eos_id=-1, **opts).new_ids[0]
        assert sink.tokens == want and sink.reason == "length", (ids, n, opts)
    assert max(calls) == 4 and engine.steps < sum(n for _, n, _ in cases) - len(cases)  # steps were shared
    # the spec's eos ends a sequence where the model makes it, as Session.generate stops there
    sink = Sink()
    engine.submit(_request(facts, [5, 9, 2], 40), sink)
    while engine.step():
        pass
    assert sink.tokens == session.generate([5, 9, 2], max_new_tokens=40).new_ids[0]
    assert sink.reason == ("stop" if facts["eos"] in sink.tokens else "length")


def test_engine_limits_and_cancel(repos):
    repo = repos("tiny-gpt2")
    engine, facts, _ = _engine(repo, "tiny-gpt2", max_sequences=2, max_waiting=1)
    a, b, c = Sink(), Sink(), Sink()
    engine.submit(_request(facts, [1, 2], 5, eos=-1), a)
    with pytest.raises(triton_generate.Refused, match=r"server busy: 0 sequences running and 1 requests waiting "
                                                      r"\(max_waiting 1\); retry later") as info:
        engine.submit(_request(facts, [1, 2], 5, eos=-1), b)
    assert info.value.busy
    engine.step()  # a is running now, the queue empty
    c.cancelled = lambda: True  # its client went away
    engine.submit(_request(facts, [3], 5, eos=-1), c)
    while engine.step():
        pass
    assert (a.reason, len(a.tokens)) == ("length", 5) and (c.reason, c.tokens) == ("cancelled", [])
    engine.stop()
    with pytest.raises(triton_generate.Refused, match="server shutting down"):
        engine.submit(_request(facts, [1], 1), Sink())


def test_a_failing_graph_model_ends_its_rows_with_one_line(repos):
    engine, facts, _ = _engine(repos("tiny-gpt2"), "tiny-gpt2")
    runs = engine.run

    def failing(feeds):
        if len(feeds[facts["ids"]]) > 1:  # the batched decode step fails; prefill runs
            raise RuntimeError("Model tiny-gpt2_model - Error when running inference:\n  Server not ready")
        return runs(feeds)

    engine.run = failing
    sinks = [Sink(), Sink()]
    for ids, sink in zip(([5, 9], [7]), sinks):
        engine.submit(_request(facts, ids, 4, eos=-1), sink)
    while engine.step():
        pass
    for sink in sinks:
        assert (sink.reason, len(sink.tokens)) == ("error", 1)  # the prefill's token, then the failed step
        assert sink.error == "the graph model failed: Model tiny-gpt2_model - Error when running inference: Server not ready"
    ok = Sink()
    engine.run = runs
    engine.submit(_request(facts, [5, 9], 3, eos=-1), ok)  # the next request runs as usual
    while engine.step():
        pass
    assert (ok.reason, len(ok.tokens)) == ("length", 3)


def test_refusals_are_specc_serves(repos):
    """Each mistake is refused with the line specc serve's generate endpoint answers."""
    from specc.runtime import RunError, Session
    from specc.runtime import endpoint
    from specc.runtime.endpoint import TextCodec
    from specc.runtime.scheduler import Scheduler

    repo = repos("tiny-gpt2")
    scheduler = Scheduler(Session(repo))
    codec = TextCodec.of_build(repo)
    facts = _facts(repo, "tiny-gpt2")
    mine = triton_generate.Codec.find([repo / "tiny-gpt2" / "1", repo / "tiny-gpt2", repo])
    assert codec is not None and mine is not None
    i64, f32 = (lambda *v: np.array(v, dtype=np.int64)), (lambda *v: np.array(v, dtype=np.float32))
    cases = [  # (inputs, parameters)
        ({"input_ids": i64(5, 9)}, {"max_token": 4}),
        ({"input_ids": i64(5, 9), "max_tokens": i64(0)}, {}),
        ({"input_ids": i64(5, 9), "max_tokens": i64(127)}, {}),
        ({"input_ids": i64(5, 9)}, {"max_tokens": 2 ** 40}),
        ({"input_ids": i64(5, 5000, -1)}, {}),
        ({"input_ids": i64(*range(129))}, {}),
        ({"input_ids": i64()}, {}),
        ({"text_input": np.array([b""], dtype=object)}, {}),
        ({"text_input": np.array([b"\xff\xfe"], dtype=object)}, {}),
        ({"text_input": np.array([b"tok1"], dtype=object), "input_ids": i64(1)}, {}),
        ({}, {}),
        ({"input_ids": i64(1), "temperature": f32(-1)}, {}),
        ({"input_ids": i64(1), "top_p": f32(1.5)}, {}),
        ({"input_ids": i64(1), "top_k": i64(0)}, {}),
        ({"input_ids": i64(1), "seed": i64(-3), "temperature": f32(1)}, {}),
        ({"input_ids": i64(1), "max_tokens": i64(1, 2)}, {}),
        ({"input_ids": i64(1)}, {"temperature": float("nan")}),
        ({"input_ids": i64(1)}, {"max_tokens": 2.5}),
        ({"input_ids": i64(1)}, {"stream": 1}),
        ({"input_ids": i64(1), "max_tokens": i64(4)}, {"max_tokens": 4}),
        ({"input_ids": i64(1), "stop": np.array([b"x" * 300], dtype=object)}, {}),
        ({"input_ids": i64(1), "stop": np.array([b""], dtype=object)}, {}),
    ]
    for inputs, params in cases:
        with pytest.raises(RunError) as theirs:
            scheduler.check(endpoint.parse(inputs, params, codec).request)
        with pytest.raises(triton_generate.Refused) as ours:
            triton_generate.parse(facts, inputs, params, mine)
        assert str(ours.value) == str(theirs.value) and not ours.value.busy, (inputs, params)
    # text_input and stop need a tokenizer.json
    for inputs in ({"text_input": np.array([b"tok1"], dtype=object)},
                   {"input_ids": i64(1), "stop": np.array([b"tok1"], dtype=object)}):
        with pytest.raises(RunError) as theirs:
            endpoint.parse(inputs, {}, None)
        with pytest.raises(triton_generate.Refused) as ours:
            triton_generate.parse(facts, inputs, {}, None)
        assert str(ours.value) == str(theirs.value)


def test_text_stream_matches_specc_serves(repos):
    """Pieces of text as tokens come, held back at a possible stop string, ended before one."""
    from specc.runtime.endpoint import TextCodec, TextStream

    repo = repos("tiny-gpt2")
    theirs_codec, ours_codec = TextCodec.of_build(repo), triton_generate.Codec.find([repo])
    ids = [5, 9, 2, 77, 9, 2, 12]
    for stops in [(), ("tok9 tok2",), ("tok2 tok7", "tok12"), ("tok77 tok",)]:
        theirs, ours = TextStream(theirs_codec, stops), triton_generate.TextStream(ours_codec, stops)
        for token in ids:
            got = ours.feed(token)
            assert got == theirs.feed(token), (stops, token)
            if got[1]:
                break
        else:
            assert ours.rest() == theirs.rest()


# --- on a real tritonserver ------------------------------------------------------------------------


class Tritonserver:
    """The tritonserver binary PyTriton bundles, run directly on a repository: its Python backend
    (the stub for the serve environment's Python, which then runs model.py with that environment's
    numpy, onnxruntime and tokenizers, and no specc), 127.0.0.1 only, free ports, stopped with
    SIGTERM."""

    def __init__(self, repo: Path, work: Path):
        where = json.loads(subprocess.run(
            [str(SERVE_PYTHON), "-c", "import json, os, sys, sysconfig, pytriton; print(json.dumps(["
             "os.path.dirname(pytriton.__file__), sysconfig.get_config_var('LIBDIR'), "
             "f'{sys.version_info[0]}.{sys.version_info[1]}', sysconfig.get_paths()['purelib']]))"],
            capture_output=True, text=True, check=True).stdout)
        package, libdir, version, packages = Path(where[0]), where[1], where[2], where[3]
        # The backend's interpreter is the first python3 on PATH, isolated (no PYTHONPATH): an
        # environment of its own that sees the serve environment's packages (numpy, onnxruntime,
        # tokenizers) through a .pth line, but not the .pth files there, so not specc's editable
        # install: specc cannot be imported by the models, as on a fleet
        fleet_python = work / "fleet-python"
        subprocess.run([str(SERVE_PYTHON), "-m", "venv", "--without-pip", str(fleet_python)], check=True)
        (fleet_python / "lib" / f"python{version}" / "site-packages" / "serve-packages.pth").write_text(packages + "\n")
        dist = package / "tritonserver"
        self.backends = work / "backends"
        python = self.backends / "python"
        python.mkdir(parents=True)
        for f in ("libtriton_python.so", "triton_python_backend_utils.py"):
            (python / f).symlink_to(dist / "backends" / "python" / f)
        shutil.copy(dist / "python_backend_stubs" / version / "triton_python_backend_stub", python)
        self.http, self.grpc, metrics = free_ports(3)
        env = {**os.environ, "PATH": f"{fleet_python / 'bin'}{os.pathsep}{os.environ['PATH']}",
               "LD_LIBRARY_PATH": os.pathsep.join([libdir, str(package.parent / "nvidia_pytriton.libs")])}
        self.log_path = work / "tritonserver.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            [str(dist / "bin" / "tritonserver"), f"--model-repository={repo}", f"--backend-directory={self.backends}",
             "--http-address=127.0.0.1", f"--http-port={self.http}", "--grpc-address=127.0.0.1",
             f"--grpc-port={self.grpc}", "--allow-metrics=false", f"--metrics-port={metrics}", "--exit-timeout-secs=30"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=work)  # not a checkout holding specc/
        deadline = time.monotonic() + 180
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"tritonserver exited {self.proc.returncode}:\n{self.output()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/health/ready", timeout=5) as answer:
                    if answer.status == 200:
                        break
            except OSError:  # not listening, or not ready yet
                pass
            assert time.monotonic() < deadline, f"tritonserver not ready in 180 s:\n{self.output()}"
            time.sleep(0.5)

    def output(self) -> str:
        if not self.log.closed:
            self.log.flush()
        return self.log_path.read_text()

    def graph_calls(self, model: str, settled: bool = False) -> int:
        """Rows the graph model has run (Triton's statistics), once no more come when `settled`."""
        def count() -> int:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/v2/models/{model}/stats", timeout=10) as answer:
                return json.loads(answer.read())["model_stats"][0]["inference_count"]

        last = count()
        deadline = time.monotonic() + 60
        while settled and time.monotonic() < deadline:
            time.sleep(0.5)
            now, last = last, count()
            if now == last:
                break
        return last

    def stubs(self) -> list[int]:
        """The Python backend's stub processes still running from this server's backend folder."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if str(self.backends).encode() in cmdline and b"stub" in cmdline:
                found.append(int(pid))
        return found

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        finally:
            self.log.close()


def fleet_repo(repo: Path, to: Path) -> Path:
    """A copy of the built repository with the graph model served by the Python-backend stand-in
    (this tritonserver has no ONNX Runtime backend); the generation model as built."""
    shutil.copytree(repo, to)
    for model in to.iterdir():
        config = model / "config.pbtxt"
        if config.is_file() and 'platform: "onnxruntime_onnx"' in config.read_text():
            config.write_text(config.read_text().replace('platform: "onnxruntime_onnx"', 'backend: "python"'))
            shutil.copy(Path(__file__).with_name("triton_standin.py"), model / "1" / "model.py")
    return to


@needs_serve_env
def test_generation_model_on_the_bundled_tritonserver(repos, tmp_path):
    """tritonserver on the repository, no specc process: 12 concurrent requests over generate,
    generate_stream and gRPC streaming, 4 decoded at once, each answered with Session.generate's tokens for its
    prompt alone; a seeded sample; text in and out through the repository's tokenizer.json, a
    stop string; mistakes answered 400 with specc serve's line while the server goes on; a client
    that goes away mid-stream; SIGTERM stops the server and its backend processes."""
    from tokenizers import Tokenizer

    from specc.runtime import Session

    built = repos("tiny-gpt2")
    session = Session(built)
    repo = fleet_repo(built, tmp_path / "repo")
    assert (repo / "tokenizer.json").is_file()  # the spec's tokenizer, at the repository's root
    tok = Tokenizer.from_file(str(repo / "tokenizer.json"))
    model = "tiny-gpt2"
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, 999, size=int(rng.integers(1, 25))).tolist(), int(rng.integers(1, 20))) for _ in range(12)]
    want = [session.generate(ids, max_new_tokens=n, eos_id=-1).new_ids[0] for ids, n in cases]
    server = Tritonserver(repo, tmp_path)
    try:

        def ask(i: int) -> dict:
            ids, n = cases[i]
            body = {"input_ids": ids, "max_tokens": n, "eos": -1}
            if i % 3 == 1:
                status, events = generate(server.http, model, {**body, "stream": True}, stream=True)
                assert status == 200 and len(events) == n + 1, events  # a token each, then the end
                return joined(events)
            if i % 3 == 2:
                return grpc_generate(server.grpc, model, {**body, "stream": True})
            status, answer = generate(server.http, model, body)
            assert status == 200, answer
            return answer

        with ThreadPoolExecutor(12) as pool:
            answers = list(pool.map(ask, range(len(cases))))
        for (ids, n), w, got in zip(cases, want, answers):
            assert got["output_ids"] == w, (ids, n, got)
            assert got["finish_reason"] == "length" and got["prompt_tokens"] == len(ids) and got["completion_tokens"] == n

        status, answer = generate(server.http, model, {"input_ids": [5, 9, 2], "max_tokens": 12, "temperature": 0.9,
                                                        "top_k": 20, "seed": 7, "eos": -1})
        sampled = session.generate([5, 9, 2], max_new_tokens=12, temperature=0.9, top_k=20, seed=7, eos_id=-1).new_ids[0]
        assert status == 200 and answer["output_ids"] == sampled

        text = "tok5 tok9 tok2 tok77"
        ids = session.generate(tok.encode(text).ids, max_new_tokens=12, eos_id=-1).new_ids[0]
        status, answer = generate(server.http, model, {"text_input": text, "max_tokens": 12, "eos": -1})
        assert status == 200 and answer["output_ids"] == ids and answer["text_output"] == tok.decode(ids), answer
        status, events = generate(server.http, model, {"text_input": text, "max_tokens": 12, "eos": -1, "stream": True},
                                  stream=True)
        assert joined(events)["text_output"] == tok.decode(ids)
        stop = tok.decode(ids[4:6])
        status, answer = generate(server.http, model, {"text_input": text, "max_tokens": 12, "eos": -1, "stop": [stop]})
        full = tok.decode(ids)
        assert answer["finish_reason"] == "stop" and answer["text_output"] == full[:full.index(stop)], answer

        for body, start in [({"input_ids": [5, 9], "max_token": 4}, "unknown field 'max_token'"),
                            ({"input_ids": [5, 9], "max_tokens": 127}, "prompt (2 tokens) + max_tokens (127) is past the 128"),
                            ({"input_ids": [5, 5000]}, "input_ids: token id(s) [5000] outside the vocabulary (0..999)"),
                            ({"input_ids": []}, "input_ids: empty; give at least one token"),
                            ({"text_input": "tok1", "input_ids": [1]}, "give the prompt as text_input or as input_ids"),
                            ({"input_ids": [1], "top_p": 1.5}, "top_p must be in (0, 1]")]:
            for stream in (False, True):
                status, answer = generate(server.http, model, body, stream=stream)
                assert status == 400 and answer["error"].startswith(start), (body, stream, status, answer)
                assert "\n" not in answer["error"] and "Traceback" not in answer["error"]
        # a client that goes away mid-stream: its sequence ends before max_tokens (the graph model
        # is called fewer times than the whole generation takes), and the server goes on answering
        before = server.graph_calls(f"{model}_model")
        conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
        conn.request("POST", f"/v2/models/{model}/generate_stream",
                     body=json.dumps({"input_ids": [1, 2], "max_tokens": 125, "eos": -1, "stream": True}))
        conn.getresponse().fp.readline()
        conn.close()
        assert server.graph_calls(f"{model}_model", settled=True) - before < 1 + 124
        status, answer = generate(server.http, model, {"input_ids": cases[0][0], "max_tokens": cases[0][1], "eos": -1})
        assert status == 200 and answer["output_ids"] == want[0]
        server.graph_calls(f"{model}_model", settled=True)  # nothing running at SIGTERM (docs/serving.md)
    finally:
        code = server.stop()
    assert code == 0, (code, server.output()[-3000:])
    deadline = time.monotonic() + 30
    while server.stubs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert server.stubs() == []
