"""The tokenizer an import carries (specc/importers/hf/tokenizer.py) and the import's other new
facts: OUT.tokenizer/ beside OUT.yaml with the checkpoint's files byte for byte, named by the
spec's `tokenizer:`, copied and hashed by the build; all or none; serving.length.max from the
checkpoint's context (or --max-length); the errors that name what is wrong (a GGUF file where a
folder was expected, a missing output folder, a tokenizer that is not the model's). And a GGUF
file's tokenizer, converted, encodes as transformers' own GGUF loading does."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.importers.hf import CheckpointError, import_hf
from specc.spec import load_spec

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

from tests.helpers import realtokenizers as rt  # noqa: E402

VOCAB, CONTEXT = 99, 64
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def _tokenizer_json(size: int = VOCAB) -> str:
    """A word-level tokenizer of `size` ids: <unk>=0, <s>=1, </s>=2, w3.."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, size)}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    return tok.to_str()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A small LLaMA checkpoint folder with a tokenizer (tokenizer.json, tokenizer_config.json with
    special tokens, chat_template.jinja)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=48, max_position_embeddings=CONTEXT, bos_token_id=1,
                                      eos_token_id=2, initializer_range=0.5)
    folder = tmp_path_factory.mktemp("ckpt") / "llama-with-tokenizer"
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    (folder / "tokenizer.json").write_text(_tokenizer_json())
    (folder / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>",
                                                              "tokenizer_class": "PreTrainedTokenizerFast"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def _copy(src: Path, dst: Path, drop: tuple[str, ...] = ()) -> Path:
    dst.mkdir()
    for p in src.iterdir():
        if p.name not in drop:
            (dst / p.name).write_bytes(p.read_bytes())
    return dst


# --- carried, built, hashed ------------------------------------------------------------------------------


def test_import_carries_the_tokenizer_and_the_build_copies_it(checkpoint, tmp_path):
    result = cli("import", "hf", checkpoint, "-o", tmp_path / "m.yaml", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["tokenizer"] == str(tmp_path / "m.tokenizer")
    carried = sorted(p.name for p in (tmp_path / "m.tokenizer").iterdir())
    assert carried == ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    for name in carried:
        assert (tmp_path / "m.tokenizer" / name).read_bytes() == (checkpoint / name).read_bytes()
    spec = load_spec(tmp_path / "m.yaml")
    assert spec.tokenizer == "m.tokenizer" and spec.tokenizer_path == str(tmp_path / "m.tokenizer")
    assert "tokenizer: m.tokenizer\n" in (tmp_path / "m.yaml").read_text()

    first = specc.build(tmp_path / "m.yaml", tmp_path / "build", progress=None)
    for name in carried:
        assert (tmp_path / "build" / name).read_bytes() == (checkpoint / name).read_bytes()
    listed = {a["path"] for a in first.artifacts}
    assert set(carried) <= listed
    assert specc.build(tmp_path / "m.yaml", tmp_path / "build", progress=None).cached
    # a changed tokenizer is a changed build: no cache hit, the new file copied
    (tmp_path / "m.tokenizer" / "chat_template.jinja").write_text(TEMPLATE + "!")
    again = specc.build(tmp_path / "m.yaml", tmp_path / "build", progress=None)
    assert not again.cached and again.manifest["cache_key"] != first.manifest["cache_key"]
    assert (tmp_path / "build" / "chat_template.jinja").read_text().endswith("!")


def test_a_spec_naming_a_missing_tokenizer_folder_is_refused_by_the_build(spec_file):
    spec = spec_file("specc: 1\nname: t\nextends: tiny-gpt2\ntokenizer: nowhere\n")
    with pytest.raises(specc.errors.BuildError, match=r"tokenizer: nowhere: no such folder"):
        specc.build(spec, spec.parent / "out", progress=None)
    (spec.parent / "empty").mkdir()
    spec.write_text("specc: 1\nname: t\nextends: tiny-gpt2\ntokenizer: empty\n")
    with pytest.raises(specc.errors.BuildError, match=r"tokenizer: empty: no tokenizer.json"):
        specc.build(spec, spec.parent / "out", progress=None)
    assert not (spec.parent / "out").exists()


def test_without_a_tokenizer_json_nothing_is_carried(checkpoint, tmp_path):
    bare = _copy(checkpoint, tmp_path / "bare", drop=("tokenizer.json",))
    result = cli("import", "hf", bare, "-o", tmp_path / "m.yaml")
    assert result.exit_code == 0, result.output
    assert "no tokenizer carried" in result.stdout
    assert not (tmp_path / "m.tokenizer").exists() and load_spec(tmp_path / "m.yaml").tokenizer is None
    result = cli("import", "hf", checkpoint, "-o", tmp_path / "n.yaml", "--no-tokenizer")
    assert result.exit_code == 0 and not (tmp_path / "n.tokenizer").exists()


def test_an_existing_tokenizer_folder_needs_force(checkpoint, tmp_path):
    (tmp_path / "m.tokenizer").mkdir()
    with pytest.raises(CheckpointError, match=r"m.tokenizer exists; pass --force"):
        import_hf(checkpoint, tmp_path / "m.yaml")
    (tmp_path / "m.tokenizer" / "stale.txt").write_text("x")
    import_hf(checkpoint, tmp_path / "m.yaml", force=True)
    assert sorted(p.name for p in (tmp_path / "m.tokenizer").iterdir()) == [
        "chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]
    # a forced import that carries none takes away the folder its spec no longer names
    import_hf(checkpoint, tmp_path / "m.yaml", force=True, tokenizer=False)
    assert not (tmp_path / "m.tokenizer").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.safetensors", "m.yaml"]


@pytest.mark.parametrize("label, change, message", [
    ("not-this-models", lambda d: (d / "tokenizer.json").write_text(_tokenizer_json(VOCAB + 5)),
     r"tokenizer.json: token id 103 is outside the model's vocabulary \(0..98\)"),
    ("not-json", lambda d: (d / "tokenizer_config.json").write_text("{nope"), r"tokenizer_config.json: not JSON"),
    ("not-a-serialization", lambda d: (d / "tokenizer.json").write_text("{}"), r"tokenizer.json: not a tokenizers"),
    ("template-not-utf8", lambda d: (d / "chat_template.jinja").write_bytes(b"\xff\xfe"), r"chat_template.jinja: not UTF-8"),
    ("fifo", lambda d: ((d / "tokenizer.json").unlink(), os.mkfifo(d / "tokenizer.json")), r"a FIFO, not a regular file"),
    ("link-outside", lambda d: ((d / "tokenizer.json").unlink(), (d / "tokenizer.json").symlink_to("/etc/hostname")),
     r"outside the checkpoint folder"),
])
def test_a_tokenizer_that_cannot_be_carried_is_refused_leaving_nothing(checkpoint, tmp_path, label, change, message):
    bad = _copy(checkpoint, tmp_path / "bad")
    change(bad)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(CheckpointError, match=message):
        import_hf(bad, out / "m.yaml")
    assert list(out.iterdir()) == []


# --- serving.length.max -------------------------------------------------------------------------------------


def test_serving_length_follows_the_checkpoints_context(checkpoint, tmp_path):
    import_hf(checkpoint, tmp_path / "a.yaml", tokenizer=False)
    assert load_spec(tmp_path / "a.yaml").serving.length.max == CONTEXT
    result = cli("import", "hf", checkpoint, "-o", tmp_path / "b.yaml", "--max-length", "32")
    assert result.exit_code == 0, result.output
    assert "serving.length.max 32" in result.stdout
    assert load_spec(tmp_path / "b.yaml").serving.length.max == 32
    result = cli("import", "hf", checkpoint, "-o", tmp_path / "c.yaml", "--max-length", "100")
    assert result.exit_code == 1
    assert "--max-length 100 is past the checkpoint's context (max_position_embeddings = 64)" in result.stderr
    assert not (tmp_path / "c.yaml").exists()


def test_the_build_says_how_far_it_verified(tmp_path, spec_file):
    spec = spec_file("specc: 1\nname: t\nextends: tiny-llama\nposition: {kind: rotary, max_length: 4096}\n"
                     "decoder: {layers: 1}\nserving: {length: {min: 1, opt: 32, max: 4096}}\n")
    res = specc.build(spec, tmp_path / "out", progress=None)
    assert res.verification["length"] == {"verified": 2048, "serving": 4096}
    from specc.report import build_report

    lines = [b for b in build_report(res.manifest, "out") if isinstance(b, str)]
    assert "verified up to 2048 positions of serving.length.max 4096" in " ".join(lines)


# --- errors that name what is wrong ---------------------------------------------------------------------------


def test_a_gguf_where_a_folder_was_expected_points_to_import_gguf(tmp_path):
    folder = tmp_path / "dl"
    folder.mkdir()
    (folder / "model.Q4_0.gguf").write_bytes(b"GGUF")
    result = cli("import", "hf", folder, "-o", tmp_path / "m.yaml")
    assert result.exit_code == 1
    assert "no config.json, but a GGUF file (model.Q4_0.gguf)" in result.stderr
    assert f"specc import gguf {folder / 'model.Q4_0.gguf'}" in result.stderr
    with pytest.raises(CheckpointError, match=r"a GGUF file, not a checkpoint folder; import it with `specc import gguf"):
        import_hf(folder / "model.Q4_0.gguf", tmp_path / "m.yaml")


def test_a_missing_output_folder_is_named_as_such(checkpoint, tmp_path):
    result = cli("import", "hf", checkpoint, "-o", tmp_path / "newdir" / "x.yaml")
    assert result.exit_code == 1
    assert f"{tmp_path / 'newdir'}: the folder for the spec does not exist" in result.stderr


# --- a GGUF file's tokenizer ------------------------------------------------------------------------------------


def test_a_gguf_tokenizer_encodes_as_transformers_gguf_loading(tmp_path):
    path = rt.smollm2_gguf()
    folder = rt.smollm2_tokenizer(tmp_path / "tok")
    ref = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ours = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in ("Hello, world!", "日本語のテキスト 🙂👍🏽", "  leading spaces\tand\ttabs\n", "<|im_start|>user\nhi<|im_end|>"):
        assert ours.encode(text).ids == ref(text)["input_ids"], text
    config = json.loads((folder / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert config["model_max_length"] == rt.SMOLLM2_CONTEXT
    assert config["eos_token"] == "<|im_end|>" and "is_local" not in config
    assert (folder / "chat_template.jinja").read_text().startswith("{% for message in messages %}")
