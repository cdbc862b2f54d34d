"""The real-model text path (make test-slow): the two packaged checkpoints imported with their
tokenizers, built, and given text through the command line.

- all-MiniLM-L6-v2 (`specc import hf` of its unzipped folder): `specc run --text` on a batch that
  its tokenizer pads to 128 gives each sentence's hidden states as the sentence alone gives them,
  and as transformers' BertModel gives them from transformers' own tokenization.
- SmolLM2-135M-Instruct (`specc import gguf` of its Q4_1 file): `specc generate --chat` feeds the
  ids of transformers' apply_chat_template, and the streamed reply equals the --json text."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.runtime import Session

pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="make install-real-models")

from benchmarks import realmodels as rm  # noqa: E402
from tests.helpers import realtokenizers as rt  # noqa: E402

pytestmark = pytest.mark.slow

SENTENCES = ["The cat sat on the mat.", "Onnxruntime runs the graph that specc built and verified against torch.",
             "Short.", "A rather longer sentence, with commas, numbers like 42, and words that split into pieces."]


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("real-text")


def test_minilm_text_batch_is_each_sentence_alone_and_transformers(work):
    import torch
    from transformers import AutoModel, AutoTokenizer

    rt.minilm_zip()  # skips where the package is absent
    folder = rm.minilm_folder(work)
    result = cli("import", "hf", folder, "-o", work / "minilm.yaml")
    assert result.exit_code == 0, result.output
    build = specc.build(work / "minilm.yaml", work / "minilm", progress=None).out_dir
    result = cli("run", build, *(a for t in SENTENCES for a in ("--text", t)), "--json")
    assert result.exit_code == 0, result.output
    got = np.array(json.loads(result.stdout)["outputs"]["last_hidden_state"])
    assert got.shape == (len(SENTENCES), 128, 384)  # the tokenizer's own padding, kept

    s = Session(build)
    ref_tok = AutoTokenizer.from_pretrained(str(build))  # the build folder is a tokenizer folder
    ref = AutoModel.from_pretrained(str(folder)).eval()
    for i, text in enumerate(SENTENCES):
        ids = ref_tok(text)["input_ids"]
        alone = s.run(input_ids=[ids])["last_hidden_state"][0]
        np.testing.assert_allclose(got[i, :len(ids)], alone, atol=1e-4)
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([ids])).last_hidden_state[0].numpy()
        np.testing.assert_allclose(alone, want, atol=1e-4)


def test_smollm2_chat_streams_the_json_text(work):
    from transformers import AutoTokenizer

    path = rt.smollm2_gguf()
    result = cli("import", "gguf", path, "-o", work / "smollm2.yaml", "--max-length", "1024")
    assert result.exit_code == 0, result.output
    build = specc.build(work / "smollm2.yaml", work / "smollm2", progress=None).out_dir
    ref = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    for text in ("Say good morning in Japanese, with an emoji.", "What is the capital of France?"):
        args = ["generate", build, "--chat", "--text", text, "--max-new-tokens", "48"]
        doc = json.loads(cli(*args, "--json").stdout)
        want = ref.apply_chat_template([{"role": "user", "content": text}], tokenize=True, add_generation_prompt=True)
        want = list(want["input_ids"] if hasattr(want, "keys") else want)
        assert doc["ids"][0][:len(want)] == want
        streamed = cli(*args)
        assert streamed.exit_code == 0, streamed.output
        assert streamed.stdout == doc["text"][0] + "\n"
        assert doc["text"][0].strip()  # a reply, not nothing
