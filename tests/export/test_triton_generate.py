"""--target triton on a decoder: the generation model (NAME: Triton's generate endpoint in the stock
Python backend, its engine specc/decoding/ copied beside it, its loop calling NAME_model by BLS).

Without a server: its config.pbtxt parsed with Triton's own protobuf definitions, generation.json
against the build, model.py importing nothing of specc but its copy of the engine; model.py run in
this process beside that copy (tests/export/pb_utils_standin.py standing in for Triton's module,
each BLS call the graph's ONNX file run with onnxruntime): for requests arriving at different
times and decoded together, the tokens Session.generate gives each alone (greedy and seeded
sampling); and the same requests, over the same fields, answered alike by `specc serve`'s
generation model and by this one (the cross-host tests), through the model graph and through the
in-place cache graph.

On a real server: the tritonserver binary PyTriton bundles, started directly on the repository
(no PyTriton, no specc process). That binary has the Python backend only, no ONNX Runtime backend,
so NAME_model is served by tests/export/triton_standin.py (the same ONNX graph run with onnxruntime
inside the Python backend); the generation model is the build's, unchanged."""
from __future__ import annotations

import ast
import asyncio
import atexit
import http.client
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from specc.export import triton as triton_export
from specc.builder.pipeline import build
from specc.spec import triton as rule

ort = pytest.importorskip("onnxruntime")
model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
text_format = pytest.importorskip("google.protobuf.text_format")

from tests.export import pb_utils_standin as standin  # noqa: E402 - the generation model's Triton, in this process
from tests.runtime.test_serve import ROOT, free_ports  # noqa: E402
from tests.runtime.test_serve_generate import generate, grpc_generate, joined, word_tokenizer  # noqa: E402

SERVE_PYTHON = ROOT / ".venv-serve" / "bin" / "python"
needs_serve_env = pytest.mark.skipif(
    not SERVE_PYTHON.exists(), reason="the serve environment is missing: run `make install-serve` (.venv-serve)")
DECODERS = ["tiny-gpt2", "tiny-llama"]
# what model.py may import: the standard library, numpy, tokenizers (and jinja2 for a chat
# template), Triton's own module and the engine copied beside it
ALLOWED = {"__future__", "collections", "json", "math", "os", "threading", "time", "numpy", "tokenizers", "jinja2",
           "triton_python_backend_utils", "specc_decoding"}
# specc/export/triton_generate.py as a repository's model.py imports it, beside a copy of the engine
_HOST = Path(tempfile.mkdtemp(prefix="specc-triton-host-"))
atexit.register(shutil.rmtree, _HOST, True)
triton_generate = standin.load_host(_HOST, Path(triton_export.__file__).with_name("triton_generate.py"),
                                    triton_export.engine_files())


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    """name -> a built repository; the spec carries a tokenizer (`tokenizer:`, a word tokenizer
    whose `tokN` is id N), which the build copies to the repository's root. NAME/onnx: the same
    spec built for onnx (its graphs, and a decoder's in-place cache graph, which `specc serve`
    decodes with; the triton target composes none)."""
    done: dict = {}

    def get(name: str) -> Path:
        if name not in done:
            base, _, target = name.partition("/")
            folder = tmp_path_factory.mktemp("repo")
            (folder / "tok").mkdir()
            word_tokenizer(folder / "tok" / "tokenizer.json")
            spec = folder / f"{base}.yaml"
            spec.write_text(f"specc: 1\nname: {base}\nextends: {base}\ntokenizer: tok\n")
            done[name] = build(spec, folder / base, target=target or "triton").out_dir
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
    # NAME_openai: the generation model as Triton's OpenAI frontend calls it (the tests below)
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["tiny-gpt2", "tiny-gpt2_model", "tiny-gpt2_openai"]
    assert sorted(p.name for p in (repo / "tiny-gpt2" / "1").iterdir()) == ["generation.json", "model.py"]
    assert (repo / "tiny-gpt2" / "1" / "model.py").read_bytes() == Path(triton_generate.__file__).read_bytes()
    manifest = json.loads((repo / "manifest.json").read_text())
    assert manifest["graphs"]["model"]["file"] == "tiny-gpt2_model/1/model.onnx"
    listed = {a["path"] for a in manifest["artifacts"]}
    assert {"tiny-gpt2/config.pbtxt", "tiny-gpt2/1/model.py", "tiny-gpt2/1/generation.json"} <= listed
    # the engine model.py imports, beside it as the package specc_decoding: specc/decoding/ and
    # specc/spec/io.py as they are, listed among the build's artifacts
    engine = repo / "tiny-gpt2" / triton_export.ENGINE_PACKAGE
    files = triton_export.engine_files()
    assert sorted(p.relative_to(engine).as_posix() for p in engine.rglob("*.py")) == sorted(files)
    assert {"decoding/engine.py", "decoding/stores.py", "spec/io.py"} <= set(files)
    for name, source in files.items():
        if source is not None:
            assert (engine / name).read_bytes() == source.read_bytes(), name
        assert f"tiny-gpt2/{triton_export.ENGINE_PACKAGE}/{name}" in listed, name

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
    assert triton_export.ENGINE_PACKAGE in imported  # the engine, from the package written beside it


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


class Graph:
    """The graph model behind a BLS stand-in: run(feeds) -> outputs, replaceable by a test."""

    def __init__(self, path: Path):
        self.session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        self.calls: list[int] = []  # the rows of each call

    def run(self, feeds: dict) -> dict:
        self.calls.append(len(feeds["input_ids"]))
        outs = [o.name for o in self.session.get_outputs()]
        return dict(zip(outs, self.session.run(outs, feeds)))

    def infer(self, name: str, feeds: dict, outputs: list, **_):
        """A BLS call as the host makes it (BlsGraph's `infer`): Triton's response, or its error."""
        try:
            got = self.run({n: np.array(v) for n, v in feeds.items()})
        except Exception as exc:
            return standin.InferenceResponse(error=standin.TritonError(str(exc)))
        return standin.InferenceResponse([standin.Tensor(n, got[n]) for n in outputs])


def _engine(repo: Path, name: str, **limits) -> tuple:
    facts = {**_facts(repo, name), **limits}
    graph = Graph(repo / facts["graph_model"] / "1" / "model.onnx")
    generation = triton_generate.decoding_facts.from_json(facts)
    return triton_generate.engine(generation, graph.infer), facts, graph


def _request(facts, ids, n, **opts):
    endpoint = triton_generate.decoding_facts.from_json(facts).endpoint
    return triton_generate.parse(endpoint, {"input_ids": np.asarray(ids, dtype=np.int64)},
                                 {"max_tokens": n, **opts}, None).request


@pytest.mark.parametrize("name", DECODERS)
def test_engine_batches_requests_and_answers_as_session_generate(repos, name):
    """14 requests of different lengths arriving over several iterations, 4 decoded at once
    (greedy, and seeded sampling with temperature / top_k / top_p): each gets the tokens
    Session.generate gives its prompt alone; the decode steps ran batched."""
    from specc.runtime import Session

    repo = repos(name)
    session = Session(repo)
    engine, facts, graph = _engine(repo, name, max_sequences=4)
    calls = graph.calls
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


@pytest.mark.parametrize("name", DECODERS)
def test_the_triton_models_prefix_cache_reuses_prompts_over_bls(repos, name):
    """generation.json's prefix_cache_tokens (null: on, as many as max_cache_tokens): requests sharing a
    40-token prefix prefill only their own tokens after it, the cached K/V sent through BLS as the
    graph model's past; each answers Session.generate's tokens; 0 turns it off."""
    from specc.runtime import Session

    repo = repos(name)
    session = Session(repo)
    assert _facts(repo, name)["prefix_cache_tokens"] is None
    rng = np.random.default_rng(4)
    shared = rng.integers(0, 999, size=40).tolist()
    cases = [(shared + rng.integers(0, 999, size=int(rng.integers(1, 9))).tolist(), int(rng.integers(2, 10)))
             for _ in range(6)]
    for budget, reused in ((None, True), (0, False)):
        engine, facts, _ = _engine(repo, name, prefix_cache_tokens=budget)
        sinks = [Sink() for _ in cases]
        for (ids, n), sink in zip(cases, sinks):
            engine.submit(_request(facts, ids, n, eos=-1), sink)
            while engine.step():
                pass
        for (ids, n), sink in zip(cases, sinks):
            assert sink.tokens == session.generate(ids, max_new_tokens=n, eos_id=-1).new_ids[0]
        assert (engine.stats.reused == 5 * 32) == reused and (engine.prefix is not None) == reused


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
    engine, facts, graph = _engine(repos("tiny-gpt2"), "tiny-gpt2")
    runs = graph.run

    def failing(feeds):
        if len(feeds[facts["ids"]]) > 1:  # the batched decode step fails; prefill runs
            raise RuntimeError("Model tiny-gpt2_model - Error when running inference:\n  Server not ready")
        return runs(feeds)

    graph.run = failing
    sinks = [Sink(), Sink()]
    for ids, sink in zip(([5, 9], [7]), sinks):
        engine.submit(_request(facts, ids, 4, eos=-1), sink)
    while engine.step():
        pass
    for sink in sinks:
        assert (sink.reason, len(sink.tokens)) == ("error", 1)  # the prefill's token, then the failed step
        assert sink.error == "the graph model failed: Model tiny-gpt2_model - Error when running inference: Server not ready"
    ok = Sink()
    graph.run = runs
    engine.submit(_request(facts, [5, 9], 3, eos=-1), ok)  # the next request runs as usual
    while engine.step():
        pass
    assert (ok.reason, len(ok.tokens)) == ("length", 3)


# --- the same requests to both hosts ----------------------------------------------------------------

# case -> (the build `specc serve` runs, the graph the Triton model decodes with)
CROSS = {
    "tiny-gpt2": ("tiny-gpt2", "model"),  # the model graph on both hosts (a triton build has no in-place graph)
    "tiny-llama": ("tiny-llama/onnx", "model"),  # specc serve's in-place store; the repository's model graph
    "tiny-llama/inplace": ("tiny-llama/onnx", "inplace"),  # the in-place store on both: Triton's through BLS copies
}
CROSS_LIMITS = (3, 120, 64)  # max_sequences, max_cache_tokens (3 rows of 40; a longer row leaves room for 2), max_waiting


class PyTritonRequest(dict):
    """One request as PyTriton hands it to an inference callable: its inputs, its parameters."""

    def __init__(self, inputs: dict, parameters: dict):
        super().__init__(inputs)
        self.parameters = parameters


def cross_requests(session, tok) -> list[tuple[dict, dict]]:
    """(inputs, parameters) of 22 requests as a client sends them: ids of 1..23 tokens with their
    own max_tokens, greedy, seeded samples (temperature, top_k, top_p), temperature 0, the spec's
    eos or none, streamed or not; text in and out, with a stop string the text reaches; an eos the
    model makes; and mistakes, each refused."""
    i64, f32 = (lambda *v: np.array(v, dtype=np.int64)), (lambda *v: np.array(v, dtype=np.float32))
    rng = np.random.default_rng(7)
    out = []
    for i in range(14):
        inputs = {"input_ids": i64(*rng.integers(0, 999, size=int(rng.integers(1, 24)))),
                  "max_tokens": i64(int(rng.integers(1, 20)))}
        inputs.update([{}, {"temperature": f32(0.8), "seed": i64(i)}, {"top_k": i64(5), "seed": i64(i)},
                       {"top_p": f32(0.9), "temperature": f32(1.3), "seed": i64(i)}, {"temperature": f32(0)}][i % 5])
        if i % 2:
            inputs["eos"] = i64(-1)
        out.append((inputs, {"stream": True} if i % 3 == 0 else {}))
    text = "tok5 tok9 tok2 tok77"
    ids = session.generate(tok.encode(text).ids, max_new_tokens=12, eos_id=-1).new_ids[0]
    stop = tok.decode(ids[4:6])
    texts = np.array([text.encode()], dtype=np.object_)
    out += [({"text_input": texts, "max_tokens": i64(12), "eos": i64(-1)}, {}),
            ({"text_input": texts, "max_tokens": i64(12), "eos": i64(-1), "stream": np.array([True])}, {}),
            ({"text_input": texts, "stop": np.array([stop.encode()], dtype=np.object_)}, {"max_tokens": 12, "eos": -1}),
            ({"input_ids": i64(*tok.encode(text).ids), "max_tokens": i64(12), "eos": i64(ids[3])}, {})]
    out += [({"input_ids": i64(5, 9)}, {"max_token": 4}),
            ({"input_ids": i64(5, 9), "max_tokens": i64(0)}, {}),
            ({"input_ids": i64(1), "top_p": f32(1.5)}, {}),
            ({"input_ids": i64(5, 5000)}, {}),
            ({"input_ids": i64(*range(30)), "max_tokens": i64(95)}, {}),
            ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, {})]
    return out


def serve_answers(session, requests: list, delays: list) -> tuple[list[dict], object]:
    """Each request through `specc serve`'s generation model (generation_model.generate_fn, its
    Scheduler running on its thread, as PyTriton calls it: one coroutine per request on one
    loop), `delays[i]` seconds after the first; the answers joined, and the scheduler's stats."""
    from specc.runtime.endpoint import text_codec
    from specc.runtime.generation_model import Cancels, generate_fn
    from specc.runtime.pytriton_patch import REFUSAL
    from specc.runtime.scheduler import GenerationLimits, Scheduler

    scheduler = Scheduler(session, GenerationLimits(*CROSS_LIMITS))
    scheduler.start()
    cancels = Cancels(scheduler)
    generate_model = generate_fn(scheduler, text_codec(session), cancels)

    async def one(i: int) -> dict:
        await asyncio.sleep(delays[i])
        got = []
        async for (response,) in generate_model([PyTritonRequest(*requests[i])]):
            got.append(response)
        if REFUSAL in got[-1]:
            return {"error": bytes(got[-1][REFUSAL][1]).decode()}
        return standin.joined(got)

    async def every() -> list[dict]:
        return await asyncio.gather(*(one(i) for i in range(len(requests))))

    try:
        return asyncio.run(every()), scheduler
    finally:
        scheduler.stop()
        cancels.close()


def triton_answers(folder: Path, requests: list, delays: list) -> tuple[list[dict], object]:
    """Each request through the repository's generation model (model.py's TritonPythonModel:
    initialize, execute, finalize, as Triton calls them; its BLS calls the stand-in's), `delays[i]`
    seconds after the first; the answers joined, and its engine."""
    model = triton_generate.TritonPythonModel()
    model.initialize({"model_repository": str(folder), "model_version": "1"})
    senders = [standin.Sender() for _ in requests]

    def one(i: int) -> dict:
        time.sleep(delays[i])
        model.execute([standin.Request(*requests[i], senders[i])])
        assert senders[i].final.wait(120), i
        return senders[i].answer()

    try:
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(one, range(len(requests)))), model.engine
    finally:
        model.finalize()


@pytest.mark.parametrize("case", list(CROSS))
def test_both_hosts_answer_the_same_requests_alike(repos, tmp_path, case):
    """The same requests, arriving over 70 ms while others decode (3 rows at most, rows joining
    and leaving mid-stream), to `specc serve`'s generation model and to the repository's: the same
    answers, token for token and word for word (greedy and seeded samples, text, a stop string,
    eos, max_tokens, the refusals), and each request's tokens those Session.generate gives it
    alone. specc serve decodes through the in-place cache graph where the build has one; the
    Triton model through the repository's model graph, or the in-place graph through BLS."""
    from tokenizers import Tokenizer

    from specc.decoding.graphs import GraphFacts
    from specc.runtime import Session

    name = case.partition("/")[0]
    served, graph = CROSS[case]
    repo = repos(name)
    session = Session(repos(served))
    assert (session.inplace is not None) == (served != name)
    tok = Tokenizer.from_file(str(repo / "tokenizer.json"))
    requests = cross_requests(session, tok)
    delays = [0.005 * (i % 15) for i in range(len(requests))]

    facts = _facts(repo, name)
    facts.update(zip(("max_sequences", "max_cache_tokens", "max_waiting"), CROSS_LIMITS))
    standin.MODELS[facts["graph_model"]] = str(repo / facts["graph_model"] / "1" / "model.onnx")
    if graph == "inplace":
        inplace = session.info.inplace
        facts["inplace_graph"] = {"model": f"{name}_inplace",
                                  **GraphFacts.of(inplace.inputs, inplace.outputs, facts["logits"]).to_dict()}
        standin.MODELS[f"{name}_inplace"] = str(session.dir / inplace.file)
    folder = tmp_path / name
    (folder / "1").mkdir(parents=True)
    (folder / "1" / triton_generate.FACTS_FILE).write_text(json.dumps(facts))
    shutil.copy(repo / "tokenizer.json", folder / "1")

    theirs, scheduler = serve_answers(session, requests, delays)
    ours, engine = triton_answers(folder, requests, delays)
    assert type(scheduler.block).__name__ == ("InplaceBlock" if served != name else "CacheBlock")
    assert type(engine.block).__name__ == ("InplaceBlock" if graph == "inplace" else "CacheBlock")
    for (inputs, params), a, b in zip(requests, theirs, ours):
        assert a == {k: v for k, v in b.items() if k != "code"}, (inputs, params, a, b)
        assert b.get("code", "INVALID_ARG") == "INVALID_ARG"
    # what the answers are: Session.generate's tokens for each prompt alone, ...
    for (inputs, params), answer in zip(requests[:14], ours[:14]):
        options = {k: v.item() for k, v in inputs.items() if k in ("temperature", "top_k", "top_p", "seed")}
        if options.get("temperature") == 0:
            options = {}
        eos = inputs["eos"].item() if "eos" in inputs else None
        want = session.generate(inputs["input_ids"].tolist(), max_new_tokens=inputs["max_tokens"].item(), eos_id=eos,
                                **options).new_ids[0]
        assert answer["output_ids"] == want, (inputs, answer)
        stop_id = session.info.tokens.eos if eos is None else eos
        assert answer["finish_reason"] == ("stop" if want and want[-1] == stop_id else "length")
        assert answer["prompt_tokens"] == len(inputs["input_ids"]) and answer["completion_tokens"] == len(want)
    # ... text in and out, a stop string, an eos the model makes, and the refusals
    whole, streamed, stopped, eos = ours[14:18]
    assert whole["text_output"] == tok.decode(whole["output_ids"]) == streamed["text_output"]
    assert stopped["finish_reason"] == "stop" and whole["text_output"].startswith(stopped["text_output"])
    assert len(stopped["text_output"]) < len(whole["text_output"])
    assert eos["finish_reason"] == "stop" and eos["output_ids"][-1] == requests[17][0]["eos"].item()
    assert [a["error"] for a in ours[18:]] == [
        "unknown field 'max_token'; the generate endpoint takes " + ", ".join(f.name for f in rule.GENERATE_INPUTS),
        "max_tokens must be at least 1, got 0",
        "top_p must be in (0, 1], got 1.5",
        "input_ids: token id(s) [5000] outside the vocabulary (0..999)",
        "prompt (30 tokens) + max_tokens (95) is more than the server's cache of 120 positions (max_cache_tokens)",
        "text_input: not UTF-8 text (byte 0: b'\\xff')"]
    # rows joined and left a running batch: fewer steps than tokens after the prefills, on both
    for stats in (scheduler.stats, engine.stats):
        assert stats.prefills == 18 and stats.steps < stats.tokens - stats.prefills


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


# --- Triton's OpenAI-compatible frontend -----------------------------------------------------------


def frontend_stream(port: int, model: str, text: str, max_tokens: int, stream: bool, usage: bool = True,
                    **options) -> dict:
    """One request as Triton's OpenAI frontend sends a Python-backend model (its TensorRT-LLM form,
    server/python/openai's engine/utils/triton.py): every tensor with a batch dim of 1, max_tokens
    INT32, seed UINT64, stop_words; over gRPC streaming (a decoupled model). The responses' text
    (as the frontend joins them: each a delta) and their usage (as it adds it up)."""
    import queue

    import tritonclient.grpc as grpcclient

    def tensor(name, dtype, array):
        t = grpcclient.InferInput(name, list(array.shape), dtype)
        t.set_data_from_numpy(array)
        return t

    inputs = [tensor("text_input", "BYTES", np.array([[text.encode()]], dtype=np.object_)),
              tensor("stream", "BOOL", np.array([[stream]])),
              tensor("max_tokens", "INT32", np.array([[max_tokens]], dtype=np.int32))]
    if "stop" in options:
        inputs.append(tensor("stop_words", "BYTES", np.array([[s.encode() for s in options["stop"]]], dtype=np.object_)))
    if "seed" in options:
        inputs.append(tensor("seed", "UINT64", np.array([[options["seed"]]], dtype=np.uint64)))
    for name in ("temperature", "top_p", "frequency_penalty"):
        if name in options:
            inputs.append(tensor(name, "FP32", np.array([[options[name]]], dtype=np.float32)))
    if usage:
        inputs += [tensor(n, "BOOL", np.array([[True]])) for n in ("return_num_input_tokens", "return_num_output_tokens")]
    got: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(f"127.0.0.1:{port}")
    client.start_stream(callback=lambda result, error: got.put((result, error)))
    out = {"pieces": [], "prompt_tokens": None, "completion_tokens": 0}
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = got.get(timeout=60)
            if error is not None:
                return {"error": error.message()}
            text = result.as_numpy("text_output")
            if text is not None:
                assert text.shape == (1, 1)
                out["pieces"].append(text.reshape(-1)[0].decode())
            n_in, n_out = result.as_numpy("num_input_tokens"), result.as_numpy("num_output_tokens")
            if n_in is not None:  # the frontend's accumulator: the prompt once, the completion summed
                out["prompt_tokens"] = out["prompt_tokens"] or int(n_in.reshape(-1)[0])
                out["completion_tokens"] += int(n_out.reshape(-1)[0])
            if result.get_response().parameters["triton_final_response"].bool_param:
                out["text"] = "".join(out["pieces"])
                return out
    finally:
        client.stop_stream()
        client.close()


def test_the_frontend_model_is_written_beside_the_generation_model(repos):
    repo = repos("tiny-gpt2")
    cfg = _config(repo / "tiny-gpt2_openai" / "config.pbtxt")
    assert cfg.backend == "python" and cfg.max_batch_size == 1 and cfg.model_transaction_policy.decoupled
    assert cfg.parameters["specc_frontend_of"].string_value == "tiny-gpt2"
    assert [(i.name, list(i.dims), i.optional) for i in cfg.input] == \
        [(f.name, list(f.shape), f.name != "text_input") for f in rule.FRONTEND_INPUTS]
    assert [o.name for o in cfg.output] == [f.name for f in rule.FRONTEND_OUTPUTS]
    types = {i.name: model_config_pb2.DataType.Name(i.data_type) for i in cfg.input}
    assert types["max_tokens"] == "TYPE_INT32" and types["seed"] == "TYPE_UINT64" and types["stop_words"] == "TYPE_STRING"
    assert (repo / "tiny-gpt2_openai" / "1" / "model.py").read_bytes() == \
        Path(triton_export.__file__).with_name("triton_generate.py").read_bytes()
    source = Path(triton_export.__file__).with_name("triton_generate.py").read_text()
    assert f'FRONTEND_OF = "{triton_export.FRONTEND_OF}"' in source  # the parameter both read


@needs_serve_env
def test_tritons_openai_frontend_requests_on_the_bundled_tritonserver(tmp_path):
    """What Triton's OpenAI frontend sends a Python-backend model, sent to NAME_openai on the bundled
    tritonserver (the frontend itself cannot run here: it needs Triton's in-process Python API,
    which no package here provides): chat prompts rendered by the template as the frontend renders
    them, streamed and not, with stop words and a seed; the text is what `specc generate --chat`
    gives, the usage adds up as the frontend adds it; refusals are one line; and NAME's own
    generate endpoint takes `chat: true`."""
    pytest.importorskip("jinja2")
    from specc.runtime import Session
    from tests.helpers.chattokenizer import chat_spec

    built = build(chat_spec(tmp_path), tmp_path / "tiny-chat", target="triton").out_dir
    repo = fleet_repo(built, tmp_path / "repo")
    session = Session(built)
    tok = session.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about rain.", "Why is the sky blue?", "Hi"]
    rendered = [tok.chat([{"role": "user", "content": q}]) for q in questions]
    server = Tritonserver(repo, tmp_path)
    try:
        for i, (q, text) in enumerate(zip(questions, rendered)):
            ids = tok.prompts([text], add_special_tokens=True)[0]  # the frontend sends text; NAME encodes it
            n = 6 + 3 * i
            new = session.generate(ids, max_new_tokens=n).new_ids[0]
            want = tok.decode(new)
            for stream in (False, True):
                got = frontend_stream(server.grpc, "tiny-chat_openai", text, n, stream)
                assert got["text"] == want and got["prompt_tokens"] == len(ids) and got["completion_tokens"] == len(new), \
                    (stream, got, want)
                assert len(got["pieces"]) == (1 if not stream else len(got["pieces"])) and \
                    (not stream or len(got["pieces"]) > 1)
            status, answer = generate(server.http, "tiny-chat", {"text_input": q, "chat": True, "max_tokens": n})
            assert status == 200 and answer["text_output"] == want, answer
        # a stop word, and a seeded sample
        ids = tok.prompts([rendered[0]])[0]
        full = tok.decode(session.generate(ids, max_new_tokens=20).new_ids[0])
        stop = full[5:7]
        got = frontend_stream(server.grpc, "tiny-chat_openai", rendered[0], 20, True, stop=[stop, "zzz"])
        assert got["text"] == full[:full.index(stop)]
        sampled = session.generate(ids, max_new_tokens=10, temperature=0.8, seed=11).new_ids[0]
        got = frontend_stream(server.grpc, "tiny-chat_openai", rendered[0], 10, False, temperature=0.8, seed=11)
        assert got["text"] == tok.decode(sampled)
        # without usage asked: none sent
        got = frontend_stream(server.grpc, "tiny-chat_openai", rendered[1], 4, True, usage=False)
        assert got["prompt_tokens"] is None and got["text"]
        # refusals, in one line; the server goes on
        for options, start in [({"frequency_penalty": 0.5}, "frequency_penalty: penalties are not supported"),
                                ({"max_tokens": 500}, "prompt (")]:
            n = options.pop("max_tokens", 4)
            got = frontend_stream(server.grpc, "tiny-chat_openai", rendered[0], n, False, **options)
            assert got["error"].startswith(start) and "\n" not in got["error"], got
        assert frontend_stream(server.grpc, "tiny-chat_openai", rendered[0], 3, False)["text"]
    finally:
        code = server.stop()
    assert code == 0, server.output()[-3000:]
