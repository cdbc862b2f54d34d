"""A sentence-transformers folder imported with its pooling (specc/importers/hf/sentence.py): the
`sentence_embedding` output of the build is what SentenceTransformer.encode gives for the same
folder, a batch of texts of many lengths padded together (sentence-transformers is the
reference; skipped where it is not installed). Each pooling mode the language computes (cls,
mean, lasttoken, max), with and without Normalize, on a small random BERT with all-MiniLM-L6-v2's
real tokenizer; the packaged all-MiniLM-L6-v2 itself (mean, Normalize) at cosine 0.99999 (make
test-slow). What the language does not compute (pooling by the mean over the square root of the
length, several modes at once, a Dense module) is not imported, and the spec's description says
why; a malformed modules.json is refused naming it."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specc
from specc.cli import main as cli
from specc.importers.hf import CheckpointError, import_hf
from specc.runtime import Session
from tests.helpers import realtokenizers as rt

st = pytest.importorskip("sentence_transformers", reason="sentence-transformers (the reference) is not installed")
try:  # sentence-transformers 6 moved its modules (the old path still works, with a warning)
    from sentence_transformers.sentence_transformer import modules as st_modules
except ImportError:
    from sentence_transformers import models as st_modules
transformers = pytest.importorskip("transformers")

TEXTS = ["A cat sat on the mat.", "Hi", "The quick brown fox jumps over the lazy dog, twice, before breakfast.",
         "Embeddings map sentences to vectors that can be compared.", "x", "Paris is the capital of France.",
         "Sentence transformers pool the token states of a transformer into one vector per text.", "ok then"]


def st_folder(root: Path, mode: str, normalize: bool = False) -> Path:
    """A sentence-transformers folder (Transformer + Pooling of MODE, + Normalize) around a small
    random BERT with all-MiniLM-L6-v2's tokenizer, saved by sentence-transformers itself."""
    bert = root / "bert"
    if not bert.is_dir():
        tok = rt.minilm_tokenizer(root / "tok")
        config = transformers.BertConfig(vocab_size=rt.MINILM_VOCAB, hidden_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, intermediate_size=37, max_position_embeddings=128,
                                         initializer_range=0.2)
        transformers.set_seed(0)
        transformers.BertModel(config).save_pretrained(bert)
        for f in tok.iterdir():
            shutil.copy(f, bert / f.name)
    word = st_modules.Transformer(str(bert), max_seq_length=64)
    width = getattr(word, "get_embedding_dimension", None) or word.get_word_embedding_dimension  # 6's name, 5's
    pool = st_modules.Pooling(width(), pooling_mode=mode)
    out = root / f"st-{mode}{'-normalized' if normalize else ''}"
    st.SentenceTransformer(modules=[word, pool, *([st_modules.Normalize()] if normalize else [])],
                           device="cpu").save(str(out))
    return out


def embed(build: Path, texts=TEXTS) -> np.ndarray:
    s = Session(build)
    return s.run(**s.encode(texts))["sentence_embedding"]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


@pytest.mark.parametrize("mode,pool,normalize", [("mean", "mean", False), ("cls", "first", False),
                                                 ("lasttoken", "last", False), ("max", "max", False),
                                                 ("mean", "mean", True), ("max", "max", True)])
def test_a_pooling_the_language_computes_is_imported_as_sentence_embedding(tmp_path_factory, mode, pool, normalize):
    root = tmp_path_factory.getbasetemp() / "st-small"
    root.mkdir(exist_ok=True)
    folder = st_folder(root, mode, normalize)
    spec, _ = import_hf(folder, root / f"{folder.name}.yaml", force=True)
    outputs = specc.load_spec(spec).outputs
    assert [(o.kind, o.name) for o in outputs][-1] == ("pooled", "sentence_embedding")
    assert (outputs[-1].pool, outputs[-1].normalize) == (pool, normalize)
    build = specc.build(spec, root / f"build-{folder.name}", progress=None).out_dir
    want = st.SentenceTransformer(str(folder), device="cpu").encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    got = embed(build)
    assert np.abs(got - want).max() <= 1e-5 * max(1.0, float(np.abs(want).max()))
    assert cosine(got, want).min() >= 0.99999


@pytest.fixture
def mean_build(tmp_path_factory) -> Path:
    """The mean-pooling build the pooling test above makes, made here where that test ran in
    another process (or not at all)."""
    root = tmp_path_factory.getbasetemp() / "st-small"
    build = root / "build-st-mean"
    if not build.is_dir():
        root.mkdir(exist_ok=True)
        folder = st_folder(root, "mean")
        spec, _ = import_hf(folder, root / f"{folder.name}.yaml", force=True)
        specc.build(spec, build, progress=None)
    return build


def test_specc_run_text_prints_the_sentence_embedding(mean_build):
    build = mean_build
    result = CliRunner().invoke(cli, ["run", str(build), "--text", TEXTS[0], "--text", TEXTS[2], "--json"])
    assert result.exit_code == 0, result.output
    got = np.array(json.loads(result.stdout)["outputs"]["sentence_embedding"])
    assert got.shape == (2, 32) and np.abs(got - embed(build, [TEXTS[0], TEXTS[2]])).max() <= 1e-6
    result = CliRunner().invoke(cli, ["run", str(build), "--text", TEXTS[0]])
    assert "sentence_embedding: float32 [1, 32]" in result.stdout


@pytest.mark.parametrize("change,why", [
    ("sqrt", "the output's pool has no mean_sqrt_len pooling"),
    ("dense", "no spec key computes modules.json's Dense after the pooling"),
    ("two", "the Pooling's modes (cls + mean) are not one mode"),
])
def test_a_pipeline_the_language_does_not_compute_imports_without_the_output(tmp_path_factory, change, why):
    root = tmp_path_factory.getbasetemp() / "st-small"
    root.mkdir(exist_ok=True)
    folder = st_folder(root, "mean")
    work = root / f"st-{change}"
    shutil.copytree(folder, work, dirs_exist_ok=True)
    modules = json.loads((work / "modules.json").read_text())
    pooling = work / modules[1]["path"] / "config.json"
    config = json.loads(pooling.read_text())
    if change == "sqrt":  # as sentence-transformers before 6 writes it
        config = {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": False,
                  "pooling_mode_mean_sqrt_len_tokens": True}
    elif change == "two":  # as 6 writes it
        config["pooling_mode"] = ["cls", "mean"]
    else:
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
    pooling.write_text(json.dumps(config))
    (work / "modules.json").write_text(json.dumps(modules))
    spec, _ = import_hf(work, root / f"{change}.yaml", force=True)
    loaded = specc.load_spec(spec)
    assert "sentence_embedding" not in [o.name for o in loaded.outputs]
    assert loaded.description.endswith(f"sentence_embedding not imported: {why}")


@pytest.mark.parametrize("modules,words", [
    ("{}", "expected a non-empty list of modules"),
    ('[{"type": 3}]', "[0]: expected"),
    ('[{"type": "sentence_transformers.models.Transformer", "path": "../x"}]', "leads outside the folder"),
    ("[", "cannot read it"),
])
def test_a_malformed_modules_json_is_refused_naming_it(tmp_path_factory, modules, words):
    root = tmp_path_factory.getbasetemp() / "st-small"
    root.mkdir(exist_ok=True)
    work = root / "st-bad"
    shutil.copytree(st_folder(root, "mean"), work, dirs_exist_ok=True)
    (work / "modules.json").write_text(modules)
    with pytest.raises(CheckpointError, match="modules.json") as err:
        import_hf(work, root / "bad.yaml", force=True)
    assert words in str(err.value)
    assert not (root / "bad.yaml").exists()


@pytest.mark.slow
def test_the_packaged_minilm_is_sentence_transformers_encode(tmp_path):
    """all-MiniLM-L6-v2 as packaged (Transformer, mean Pooling, Normalize): its sentence_embedding
    is SentenceTransformer.encode's, unit vectors, 64 sentences in batches of 16 padded to 128."""
    from benchmarks import realmodels as rm

    try:
        folder = rm.minilm_folder(tmp_path)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    spec, _ = import_hf(folder, tmp_path / "minilm.yaml", max_length=128)
    assert specc.load_spec(spec).outputs[-1].normalize
    build = specc.build(spec, tmp_path / "build", progress=None).out_dir
    texts = rm.sentences(64)
    want = st.SentenceTransformer(str(folder), device="cpu").encode(texts, batch_size=16, convert_to_numpy=True)
    s = Session(build)
    got = np.concatenate([s.run(**s.encode(texts[i:i + 16]))["sentence_embedding"] for i in range(0, 64, 16)])
    assert cosine(got, want).min() >= 0.99999
    assert np.abs(np.linalg.norm(got, axis=1) - 1).max() <= 1e-5 and np.abs(got - want).max() <= 1e-5
