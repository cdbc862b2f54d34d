"""Text through a build (specc/runtime/text.py, Session.encode / prompts, `specc run` and
`specc generate` with --text and --chat), with the real tokenizers of the two packaged checkpoints
(tests/helpers/realtokenizers.py) carried by small builds of their vocabularies:

- all-MiniLM-L6-v2's tokenizer pads every text to 128: a padded batch's outputs equal each text run
  alone without padding (the attention mask passed; without it they differ);
- SmolLM2's byte-level tokenizer splits Japanese and emoji characters over several tokens: the
  streamed text never holds half a character and equals the --json text;
- --chat renders the chat template as transformers' apply_chat_template does, to the same ids."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.runtime import RunError, Session
from specc.runtime.text import REPLACEMENT, Tokenizer

from tests.helpers import realtokenizers as rt

pytestmark = pytest.mark.xdist_group("test_text")  # one worker: the module's shared builds are made once

pytest.importorskip("onnxruntime")
pytest.importorskip("tokenizers")

# a reply a chat model might give: characters of 3 and 4 UTF-8 bytes, which a byte-level BPE
# splits over tokens, beside ASCII
MIXED = "日本語のテキストです。絵文字も🙂👍🏽 and English, 🎉 ok"


def cli(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


@pytest.fixture(scope="module")
def smollm2_tok(tmp_path_factory) -> Path:
    return rt.smollm2_tokenizer(tmp_path_factory.mktemp("smollm2") / "tok")


@pytest.fixture(scope="module")
def minilm_tok(tmp_path_factory) -> Path:
    return rt.minilm_tokenizer(tmp_path_factory.mktemp("minilm") / "tok")


def _build(root: Path, base: str, vocab: int, tokenizer: Path, extra: str = "") -> Path:
    """A small build of catalog spec `base` with the real tokenizer's vocabulary, carrying it."""
    spec = root / "spec.yaml"
    spec.write_text(f"specc: 1\nname: text-{base}\nextends: {base}\nvocab: {{size: {vocab}}}\n"
                    f"tokenizer: {tokenizer.name}\n{extra}")
    return specc.build(spec, root / "build", progress=None).out_dir


@pytest.fixture(scope="module")
def bert_build(minilm_tok) -> Path:
    return _build(minilm_tok.parent, "tiny-bert", rt.MINILM_VOCAB, minilm_tok)


@pytest.fixture(scope="module")
def llama_build(smollm2_tok) -> Path:
    return _build(smollm2_tok.parent, "tiny-llama", rt.SMOLLM2_VOCAB, smollm2_tok, "tokens: {eos: 2}\n")


# --- the build carries the tokenizer ------------------------------------------------------------------


def test_the_build_copies_the_tokenizer_into_its_root_and_hashes_it(bert_build, minilm_tok):
    manifest = json.loads((bert_build / "manifest.json").read_text())
    listed = {a["path"]: a["sha256"] for a in manifest["artifacts"]}
    names = sorted(p.name for p in minilm_tok.iterdir())
    assert names == ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    for name in names:
        assert (bert_build / name).read_bytes() == (minilm_tok / name).read_bytes()
        assert name in listed
    assert set(manifest["options"]["tokenizer"]) == set(names)


def test_a_changed_tokenizer_file_is_refused_when_the_build_reads_it(bert_build, tmp_path):
    import shutil

    copy = tmp_path / "b"
    shutil.copytree(bert_build, copy)
    (copy / "tokenizer.json").write_text((copy / "tokenizer.json").read_text().replace('"[PAD]"', '"[XAD]"'))
    with pytest.raises(RunError, match="tokenizer.json: changed since the build"):
        Session(copy).tokenizer
    # a template added after the build would be read with it: refused as well
    shutil.copy(bert_build / "tokenizer.json", copy / "tokenizer.json")
    (copy / "chat_template.jinja").write_text("{{ messages }}")
    with pytest.raises(RunError, match="chat_template.jinja is not among the build's artifacts"):
        Session(copy).tokenizer
    assert Session(copy, check_hashes=False).tokenizer.template == "{{ messages }}"


# --- MiniLM: padding honoured, the mask passed ------------------------------------------------------------


def test_minilm_padded_batch_equals_each_text_alone(bert_build):
    s = Session(bert_build)
    texts = ["A short one.", "This sentence is quite a bit longer than the first, with more words.", "Hi"]
    feeds = s.encode(texts)
    # the tokenizer's own padding (to 128, its tokenizer.json) and its mask, token types with them
    assert feeds["input_ids"].shape == (3, 128) and feeds["attention_mask"].shape == (3, 128)
    assert set(feeds) == {"input_ids", "attention_mask", "token_type_ids"}
    padded = s.run(**feeds)["last_hidden_state"]
    tok = s.tokenizer.backend
    tok.no_padding()
    for i, text in enumerate(texts):
        ids = tok.encode(text).ids
        assert ids == feeds["input_ids"][i, :len(ids)].tolist() and feeds["attention_mask"][i].sum() == len(ids)
        alone = s.run(input_ids=[ids])["last_hidden_state"][0]
        np.testing.assert_allclose(padded[i, :len(ids)], alone, atol=1e-5)
    # its truncation too: a long text is cut at 128, ending with [SEP] as transformers cuts it
    transformers = pytest.importorskip("transformers")
    long = " ".join(["word"] * 300)
    cut = Session(bert_build).encode([long])
    ref = transformers.AutoTokenizer.from_pretrained(str(bert_build))(long, truncation=True, max_length=128)
    assert cut["input_ids"][0].tolist() == ref["input_ids"] and cut["attention_mask"].sum() == 128
    # the test can fail: the same batch with its padding attended is another answer
    unmasked = s.run(input_ids=feeds["input_ids"])["last_hidden_state"]
    assert np.abs(unmasked[0, :5] - padded[0, :5]).max() > 1e-2


def test_run_text_uses_the_builds_tokenizer_and_its_mask(bert_build):
    s = Session(bert_build)
    texts = ["The cat sat on the mat.", "Tokenizers pad; models must not attend to it."]
    result = cli("run", bert_build, *(a for t in texts for a in ("--text", t)), "--json")
    assert result.exit_code == 0, result.output
    got = np.array(json.loads(result.stdout)["outputs"]["last_hidden_state"])
    np.testing.assert_allclose(got, s.run(**s.encode(texts))["last_hidden_state"], atol=1e-5)


def test_unequal_rows_of_a_tokenizer_without_padding_are_padded_as_ids_rows(llama_build):
    """SmolLM2's tokenizer does not pad: a decoder's rows are left-padded with the build's pad id
    and masked, as --ids rows are; each row's logits are its own."""
    s = Session(llama_build)
    texts = ["Hello there, how are you today?", "日本"]
    feeds = s.encode(texts)
    ids = [s.tokenizer.backend.encode(t).ids for t in texts]
    width = max(map(len, ids))
    assert feeds["attention_mask"].tolist() == [[0] * (width - len(r)) + [1] * len(r) for r in ids]
    logits = s.run(**feeds)["logits"]
    for i, row in enumerate(ids):
        np.testing.assert_allclose(logits[i, width - len(row):], s.run(input_ids=[row])["logits"][0], atol=1e-4)


# --- SmolLM2: whole characters streamed ------------------------------------------------------------------


def test_stream_decoder_holds_back_split_characters(smollm2_tok):
    tok = Tokenizer.load(smollm2_tok)
    ids = tok.backend.encode(MIXED, add_special_tokens=False).ids
    assert tok.decode(ids) == MIXED
    # the real tokenizer does split characters: one token alone decodes to a replacement character
    assert any(REPLACEMENT in tok.decode([i]) for i in ids)
    stream = tok.stream()
    pieces = [stream.push(i) for i in ids] + [stream.flush()]
    assert "".join(pieces) == MIXED
    assert not any(REPLACEMENT in p for p in pieces)
    assert "" in pieces[:-1]  # something was held back


def test_stream_decoder_flushes_an_unfinished_character_as_decode_does(smollm2_tok):
    tok = Tokenizer.load(smollm2_tok)
    ids = tok.backend.encode("ok 🙂", add_special_tokens=False).ids[:-1]  # the emoji's last byte cut off
    stream = tok.stream()
    text = "".join(stream.push(i) for i in ids)
    assert REPLACEMENT not in text
    assert text + stream.flush() == tok.decode(ids)


def test_streamed_generate_equals_the_json_text(llama_build):
    """Whatever the seeded model generates (its tokens are the real vocabulary's, byte pieces
    among them), the streamed text is the --json text."""
    args = ["generate", llama_build, "--text", MIXED, "--max-new-tokens", "40", "--temperature", "1.0", "--seed"]
    for seed in ("1", "2", "3"):
        doc = json.loads(cli(*args, seed, "--json").stdout)
        streamed = cli(*args, seed)
        assert streamed.exit_code == 0, streamed.output
        assert streamed.stdout == doc["text"][0] + "\n"


# --- chat ------------------------------------------------------------------------------------------------


def test_chat_renders_as_transformers_apply_chat_template(smollm2_tok):
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_tok))
    ours = Tokenizer.load(smollm2_tok)
    for messages in ([{"role": "user", "content": "What is the capital of France?"}],
                     [{"role": "system", "content": "Be brief."}, {"role": "user", "content": MIXED},
                      {"role": "assistant", "content": "はい 🙂"}, {"role": "user", "content": "Again?"}]):
        for gen in (True, False):
            want = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.chat(messages, add_generation_prompt=gen) == want
    messages = [{"role": "user", "content": MIXED}]
    want_ids = ref.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    want_ids = want_ids["input_ids"] if isinstance(want_ids, dict) or hasattr(want_ids, "keys") else want_ids
    assert ours.prompts([ours.chat(messages)], add_special_tokens=False) == [list(want_ids)]


def test_a_template_with_tojson_loop_controls_and_special_tokens(tmp_path, smollm2_tok):
    """Features the templates of other checkpoints use, against transformers' rendering."""
    transformers = pytest.importorskip("transformers")
    import shutil

    folder = tmp_path / "tok"
    shutil.copytree(smollm2_tok, folder)
    (folder / "chat_template.jinja").write_text(
        "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
        "{% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
        "{{ m['role'] }}: {{ m['content'] | tojson }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}{{ eos_token }}")
    ref = transformers.AutoTokenizer.from_pretrained(str(folder))
    ours = Tokenizer.load(folder)
    messages = [{"role": "user", "content": "日本 \"quoted\""}, {"role": "skip", "content": "x"},
                {"role": "assistant", "content": "ok"}]
    assert ours.chat(messages) == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(RunError, match="the chat template fails: bad role"):
        ours.chat([{"role": "robot", "content": "x"}])


def test_generate_chat_feeds_the_rendered_template(llama_build):
    s = Session(llama_build)
    text = "What is the capital of France?"
    doc = json.loads(cli("generate", llama_build, "--chat", "--text", text, "--max-new-tokens", "5", "--json").stdout)
    prompt = s.tokenizer.prompts([s.tokenizer.chat([{"role": "user", "content": text}])], add_special_tokens=False)[0]
    assert doc["ids"][0][:len(prompt)] == prompt
    assert s.tokenizer.decode(prompt).startswith("system\nYou are a helpful AI assistant named SmolLM")
    assert doc["new_ids"] == s.generate([prompt], max_new_tokens=5).new_ids


def test_text_without_chat_on_an_instruct_build_says_how_to_chat(llama_build, bert_build, minilm_tok):
    """An instruct build (its tokenizer has a chat template) given plain text without --chat
    continues it as it is and says in one line how to chat; not with --chat, not for a text put in
    the template by hand, not for a build whose tokenizer has no template."""
    plain = cli("generate", llama_build, "--text", "What is the capital of France?", "--max-new-tokens", "3")
    assert plain.exit_code == 0
    hint = [line for line in plain.stderr.splitlines() if "--chat" in line]
    assert len(hint) == 1 and hint[0].startswith("specc: text-tiny-llama has a chat template; to chat, add --chat")
    s = Session(llama_build)
    templated = s.tokenizer.chat([{"role": "user", "content": "Hi"}])
    for args in (["--chat", "--text", "Hi"], ["--text", templated]):
        result = cli("generate", llama_build, *args, "--max-new-tokens", "3")
        assert result.exit_code == 0 and "--chat" not in result.stderr, result.stderr
    assert s.tokenizer.templated(templated) and not s.tokenizer.templated("What is <b>bold</b>?")
    result = cli("generate", bert_build, "--text", "hi", "--tokenizer", minilm_tok)  # an encoder: refused as before
    assert "--chat" not in result.stderr


def test_generate_stats_says_how_many_tokens_and_how_fast(llama_build):
    result = cli("generate", llama_build, "--chat", "--text", "Hi", "--max-new-tokens", "6", "--eos-id", "-1",
                 "--stats", "--json")
    assert result.exit_code == 0, result.stderr
    doc = json.loads(result.stdout)  # stdout keeps the answer alone
    assert len(doc["new_ids"][0]) == 6
    line = result.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"specc: 6 new tokens in ([\d.]+) s, ([\d.]+) tokens/s "
                     r"\(first token after ([\d.]+) s; then ([\d.]+) tokens/s\)", line)
    assert m, line
    took, rate, first, then = map(float, m.groups())
    # the seconds are printed to 0.01 s: the rate is 6 over a duration within half of that of them
    assert 6 / (took + 0.005) - 0.05 <= rate <= 6 / max(took - 0.005, 1e-9) + 0.05
    assert first <= took and then > 0
    beams = cli("generate", llama_build, "--ids", "5,6,7", "--beams", "2", "--max-new-tokens", "4", "--eos-id", "-1",
                "--stats")
    assert re.fullmatch(r"specc: 4 new tokens in [\d.]+ s, [\d.]+ tokens/s", beams.stderr.strip().splitlines()[-1])


# --- refusals ------------------------------------------------------------------------------------------------


def test_text_without_a_tokenizer_names_the_build(tmp_path_factory):
    gpt2 = specc.build("tiny-gpt2", tmp_path_factory.getbasetemp() / "specc-runtime-builds" / "tiny-gpt2").out_dir
    result = cli("generate", gpt2, "--text", "hello")
    assert result.exit_code == 2
    assert "carries none" in result.stderr and "--tokenizer FILE" in result.stderr
    with pytest.raises(RunError, match="carries no tokenizer"):
        Session(gpt2).tokenizer
    assert cli("generate", gpt2, "--chat", "--ids", "1,2").exit_code == 2  # --chat takes --text


def test_chat_without_a_template_exits_1(bert_build, minilm_tok):
    result = cli("generate", bert_build, "--chat", "--text", "hi", "--tokenizer", minilm_tok)
    assert result.exit_code == 1
    assert "has no chat template" in result.stderr and "internal error" not in result.stderr
