"""/v1/embeddings of the OpenAI-compatible API (specc/runtime/openai_api.py, specc/runtime/embedding.py)
without a server, on a tiny BERT build with a `sentence_embedding` output (mean pooling) and a
real tokenizer (tests/helpers/chattokenizer.py's byte-level BPE). Each vector is the mean of the
build's own last_hidden_state over the text's real tokens, computed here with numpy, whether the
text comes alone or padded in a batch larger than serving.batch.max; OpenAI's four input forms,
its float and base64 encodings and usage.prompt_tokens; every malformed body refused 400 with
OpenAI's error object naming the field; a build without the output refused 400. (With a real
server and the `openai` package: tests/runtime/test_openai_serve.py; an imported
sentence-transformers folder against sentence-transformers: tests/importers/test_sentence_transformers.py.)"""
from __future__ import annotations

import base64
import json
import threading

import numpy as np
import pytest

import specc
from specc.runtime import Session
from specc.runtime.embedding import Embedder
from specc.runtime.openai_api import MAX_EMBEDDING_INPUTS, OpenAIApi
from tests.helpers.chattokenizer import embedding_spec

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")

MODEL = "tiny-embedder"
TEXTS = ["What is the capital of France?", "Hi", "A longer sentence, with commas, about the weather in spring.",
         "x", "Embeddings map text to vectors.", "Paris", "one two three four five six", "z z", "The end."]


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    root = tmp_path_factory.mktemp("embeddings")
    return Session(specc.build(embedding_spec(root, MODEL), root / MODEL, progress=None).out_dir)


@pytest.fixture(scope="module")
def api(session):
    return OpenAIApi(MODEL, None, None, Embedder.of(session))


def post(api: OpenAIApi, body) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    reply = api.handle("POST", "/v1/embeddings", data, threading.Event())
    return reply.status, json.loads(reply.data)


def mean_pooled(session, text: str) -> tuple[np.ndarray, int]:
    """The text alone: its real tokens' last hidden states averaged (numpy), and their count."""
    ids = session.tokenizer.prompts([text])[0]
    hidden = session.run(input_ids=[ids])["last_hidden_state"][0]
    return hidden.mean(0), len(ids)


def test_each_vector_is_its_texts_mean_pooled_state_alone_or_batched(api, session):
    assert len(TEXTS) > session.info.batch.max  # run in more than one batch
    status, got = post(api, {"model": MODEL, "input": TEXTS})
    assert status == 200, got
    assert got["object"] == "list" and got["model"] == MODEL
    assert [d["index"] for d in got["data"]] == list(range(len(TEXTS)))
    assert all(d["object"] == "embedding" for d in got["data"])
    tokens = 0
    for text, d in zip(TEXTS, got["data"]):
        want, n = mean_pooled(session, text)
        assert np.abs(np.array(d["embedding"]) - want).max() <= 1e-5, text
        tokens += n
    assert got["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # one string: the same vector as in the batch
    status, one = post(api, {"model": MODEL, "input": TEXTS[2]})
    assert status == 200 and len(one["data"]) == 1
    assert np.abs(np.array(one["data"][0]["embedding"]) - np.array(got["data"][2]["embedding"])).max() <= 1e-5


def test_base64_is_the_little_endian_float32_bytes_and_ids_are_taken_as_they_are(api, session):
    _, floats = post(api, {"model": MODEL, "input": TEXTS[:3]})
    status, b64 = post(api, {"model": MODEL, "input": TEXTS[:3], "encoding_format": "base64"})
    assert status == 200
    for f, b in zip(floats["data"], b64["data"]):
        assert isinstance(b["embedding"], str)
        assert np.array_equal(np.frombuffer(base64.b64decode(b["embedding"]), dtype="<f4"),
                              np.array(f["embedding"], dtype=np.float32))
    rows = session.tokenizer.prompts(TEXTS[:3])
    status, by_ids = post(api, {"model": MODEL, "input": rows})
    assert status == 200 and by_ids["usage"]["prompt_tokens"] == sum(map(len, rows))
    for f, d in zip(floats["data"], by_ids["data"]):
        assert np.abs(np.array(f["embedding"]) - np.array(d["embedding"])).max() <= 1e-5
    status, one = post(api, {"model": MODEL, "input": rows[1], "dimensions": 64})
    assert status == 200 and np.allclose(one["data"][0]["embedding"], by_ids["data"][1]["embedding"], atol=1e-5)


@pytest.mark.parametrize("body,param,words", [
    ({"input": "x"}, "model", "required"),
    ({"model": MODEL}, "input", "expected a string"),
    ({"model": MODEL, "input": []}, "input", "expected a string"),
    ({"model": MODEL, "input": [[]]}, "input", "expected a string"),
    ({"model": MODEL, "input": ["a", 3]}, "input", "expected a string"),
    ({"model": MODEL, "input": ["a", ""]}, "input[1]", "an empty string"),
    ({"model": MODEL, "input": ["a"] * (MAX_EMBEDDING_INPUTS + 1)}, "input", f"at most {MAX_EMBEDDING_INPUTS}"),
    ({"model": MODEL, "input": [1, 2, 5000]}, "input", "5000"),
    ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format", "float, base64"),
    ({"model": MODEL, "input": "x", "dimensions": 32}, "dimensions", "64 dimensions"),
    ({"model": MODEL, "input": "x", "dimensions": 0}, "dimensions", "at least 1"),
    ({"model": MODEL, "input": "x", "temperature": 1}, "temperature", "unknown field"),
    ({"model": MODEL, "input": "word " * 300}, "input", "128"),
])
def test_a_bad_request_is_refused_naming_the_field(api, body, param, words):
    status, got = post(api, body)
    assert status == 400, got
    error = got["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_another_model_is_404_and_a_build_without_the_output_400(api, session):
    status, got = post(api, {"model": "gpt-4", "input": "x"})
    assert status == 404 and got["error"]["code"] == "model_not_found"
    models = json.loads(api.handle("GET", "/v1/models", b"", threading.Event()).data)
    assert [m["id"] for m in models["data"]] == [MODEL]
    plain = OpenAIApi("plain", None, None, None)
    status, got = post(plain, {"model": "plain", "input": "x"})
    assert status == 400 and "no sentence_embedding output" in got["error"]["message"]
    assert Embedder.of(Session(specc.build("tiny-bert", session.dir.parent / "plain", progress=None).out_dir)) is None
