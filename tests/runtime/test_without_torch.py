"""Running and serving a build needs onnxruntime, numpy and tokenizers, not the compiler: `specc
run`, `specc generate` (text, chat) and `specc serve` (the generate endpoint and the OpenAI API) on
a build, in processes where importing torch, onnx, onnxscript, onnx_ir, safetensors or
transformers fails as it fails where they are not installed; their answers are the ones of the
environment that has them. `specc build` there says what it needs, exit 1, no traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import specc
from tests.helpers.chattokenizer import chat_spec
from tests.runtime.test_serve import ROOT, Server, needs_serve_env

pytest.importorskip("onnxruntime")
pytest.importorskip("jinja2")

ABSENT = ("torch", "onnx", "onnxscript", "onnx_ir", "safetensors", "transformers")


@pytest.fixture(scope="module")
def without_torch(tmp_path_factory):
    """(the build, the environment variables of a process in which the compiler's packages are not
    there): modules of their names, first on the path, that fail to import as a missing one does."""
    root = tmp_path_factory.mktemp("without-torch")
    shadows = root / "absent"
    shadows.mkdir()
    for name in ABSENT:
        (shadows / f"{name}.py").write_text(f"raise ModuleNotFoundError(\"No module named '{name}'\", name={name!r})\n")
    build = specc.build(chat_spec(root), root / "tiny-chat").out_dir
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(shadows), str(ROOT)])}
    return build, env


def specc_cli(env: dict, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from specc.cli import main; main()", *map(str, args)], env=env,
                          capture_output=True, text=True, timeout=300)


def test_run_and_generate_need_no_torch(without_torch):
    from specc.runtime import Session

    build, env = without_torch
    for name in ABSENT:
        assert subprocess.run([sys.executable, "-c", f"import {name}"], env=env, capture_output=True).returncode == 1
    session = Session(build)
    got = specc_cli(env, "run", build, "--text", "hello there", "--json")
    assert got.returncode == 0, got.stderr
    want = session.run(**{k: v for k, v in vars(session.tokenizer.feeds(["hello there"], pad_id=0, left=True)).items()
                          if k in ("input_ids", "attention_mask")})
    assert json.loads(got.stdout)["outputs"]["logits"] == want["logits"].tolist()
    got = specc_cli(env, "generate", build, "--chat", "--text", "What is the capital of France?",
                    "--max-new-tokens", "8", "--json")
    assert got.returncode == 0, got.stderr
    tok = session.tokenizer
    ids = tok.prompts([tok.chat([{"role": "user", "content": "What is the capital of France?"}])], add_special_tokens=False)
    assert json.loads(got.stdout)["new_ids"] == session.generate(ids, max_new_tokens=8).new_ids
    built = specc_cli(env, "build", "tiny-gpt2", "-o", build.parent / "again")
    assert built.returncode == 1 and "Traceback" not in built.stderr
    assert "this command needs torch, which is not installed here" in built.stderr, built.stderr


@needs_serve_env
def test_serve_needs_no_torch(without_torch):
    import http.client

    from specc.runtime import Session

    build, env = without_torch
    session = Session(build)
    tok = session.tokenizer
    ids = tok.prompts([tok.chat([{"role": "user", "content": "Hi"}])], add_special_tokens=False)[0]
    want = tok.decode(session.generate(ids, max_new_tokens=6).new_ids[0])
    server = Server(build, env={"PYTHONPATH": env["PYTHONPATH"]})
    try:
        conn = http.client.HTTPConnection("127.0.0.1", server.http, timeout=60)
        conn.request("POST", "/v1/chat/completions", body=json.dumps(
            {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6}))
        answer = json.loads(conn.getresponse().read())
        assert answer["choices"][0]["message"]["content"] == want
        conn.request("POST", "/v2/models/tiny-chat/generate", body=json.dumps(
            {"text_input": "Hi", "chat": True, "max_tokens": 6}))
        assert json.loads(conn.getresponse().read())["text_output"] == want
        conn.close()
    finally:
        code = server.stop()
    assert code == 0 and "Traceback" not in server.output()
