"""`specc run` and `specc generate` (specc/cli.py) on built models, checked against
specc.runtime.Session, and examples/generate_with_onnxruntime.py against Session.generate.

In-process runs use click's CliRunner; one `specc generate --json` also runs in a real process."""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from click.testing import CliRunner

import specc
from specc.cli import main
from specc.runtime import Session

from tests.helpers.hostile import npz_bomb
from tests.helpers import speclib

pytestmark = pytest.mark.xdist_group("test_cli_run")  # one worker: the module's shared builds are made once

pytest.importorskip("onnxruntime")

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "generate_with_onnxruntime.py"
SPECC = Path(sys.executable).with_name("specc")
CLASSIFIER = speclib.tiny(speclib.KINDS["outputs-encoder"])


def cli(*args: str):
    result = CliRunner().invoke(main, [str(a) for a in args])
    # a SystemExit is how click reports an exit code; any other exception is a bug
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def ok_json(*args: str):
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # one JSON document and nothing else on stdout


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> Path:
    # under the session's base temp dir: the runtime test modules may have built it already
    return specc.build("tiny-gpt2", tmp_path_factory.getbasetemp() / "specc-runtime-builds" / "tiny-gpt2").out_dir


@pytest.fixture(scope="module")
def classifier(tmp_path_factory) -> Path:
    return specc.build(CLASSIFIER, tmp_path_factory.mktemp("classifier") / "out").out_dir


@pytest.fixture(scope="module")
def session(gpt2) -> Session:
    return Session(gpt2)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory) -> Path:
    """A word-level tokenizer over tiny-gpt2's 1000 ids: [UNK]=0, hello=1, world=2, w3..w999."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, "hello": 1, "world": 2, **{f"w{i}": i for i in range(3, 1000)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


# --- specc run ------------------------------------------------------------------------------------------


def test_run_prints_the_named_outputs(gpt2):
    result = cli("run", gpt2, "--ids", "1,2,3")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "tiny-gpt2 on CPUExecutionProvider"
    assert len(lines) == 2 and lines[1].strip().startswith("logits: float32 [1, 3, 1000]")
    assert "present." not in result.stdout


def test_run_json_is_one_document_with_the_outputs(gpt2, session):
    doc = ok_json("run", gpt2, "--ids", "1,2,3")
    assert list(doc) == ["outputs"] and list(doc["outputs"]) == ["logits"]
    logits = np.array(doc["outputs"]["logits"])
    assert logits.shape == (1, 3, 1000)
    assert isinstance(doc["outputs"]["logits"][0][0], list)  # nested lists
    np.testing.assert_allclose(logits, session.run(input_ids=[[1, 2, 3]])["logits"], atol=1e-6)


def test_run_out_writes_every_output(gpt2, session, tmp_path):
    out = tmp_path / "outputs.npz"
    result = cli("run", gpt2, "--ids", "4, 5,6", "--out", out)  # spaces inside --ids are fine
    assert result.exit_code == 0, result.output
    want = session.run(input_ids=[[4, 5, 6]])
    with np.load(out) as data:
        assert sorted(data.files) == sorted(want)
        assert {"present.0.key", "present.1.value"} <= set(data.files)
        for name in want:
            np.testing.assert_allclose(data[name], want[name], atol=1e-6)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["outputs.npz"]


def test_run_repeated_ids_pad_a_ragged_batch(gpt2, session):
    doc = ok_json("run", gpt2, "--ids", "1,2,3,4", "--ids", "5,6")
    logits = np.array(doc["outputs"]["logits"])
    assert logits.shape == (2, 4, 1000)
    # decoder rows are left-padded: the short row's last positions are the row alone
    np.testing.assert_allclose(logits[1, 2:], session.run(input_ids=[[5, 6]])["logits"][0], atol=1e-4)
    np.testing.assert_allclose(logits[0], session.run(input_ids=[[1, 2, 3, 4]])["logits"][0], atol=1e-4)


def test_run_input_file_with_a_ragged_batch(gpt2, session, tmp_path):
    path = tmp_path / "batch.json"
    path.write_text(json.dumps([[1, 2, 3, 4], [5, 6]]))
    result = cli("run", gpt2, "--input", path, "--json")
    assert result.exit_code == 0, result.output
    logits = np.array(json.loads(result.stdout)["outputs"]["logits"])
    assert logits.shape == (2, 4, 1000)
    np.testing.assert_allclose(logits[1, 2:], session.run(input_ids=[[5, 6]])["logits"][0], atol=1e-4)


def test_run_input_file_with_named_inputs_and_npz(gpt2, session, tmp_path):
    ids = [[999, 7, 8], [1, 2, 3]]
    mask = [[0, 1, 1], [1, 1, 1]]
    want = session.run(input_ids=ids, attention_mask=mask)["logits"]
    as_json = tmp_path / "named.json"
    as_json.write_text(json.dumps({"input_ids": ids, "attention_mask": mask}))
    got = np.array(ok_json("run", gpt2, "--input", as_json)["outputs"]["logits"])
    np.testing.assert_allclose(got, want, atol=1e-6)
    as_npz = tmp_path / "named.npz"
    np.savez(as_npz, input_ids=np.array(ids), attention_mask=np.array(mask))
    got = np.array(ok_json("run", gpt2, "--input", as_npz)["outputs"]["logits"])
    np.testing.assert_allclose(got, want, atol=1e-6)
    # equal-length rows as a plain JSON list
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps([[1, 2, 3], [4, 5, 6]]))
    got = np.array(ok_json("run", gpt2, "--input", rows)["outputs"]["logits"])
    np.testing.assert_allclose(got, session.run(input_ids=[[1, 2, 3], [4, 5, 6]])["logits"], atol=1e-6)


def test_run_input_file_errors_exit_1(gpt2, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"ids": [[1]]}')
    result = cli("run", gpt2, "--input", bad)
    assert result.exit_code == 1 and "input_ids" in result.stderr
    notjson = tmp_path / "notjson.json"
    notjson.write_text("[[1, 2")
    result = cli("run", gpt2, "--input", notjson)
    assert result.exit_code == 1 and "notjson.json" in result.stderr


def test_run_classifier_prints_probabilities(classifier):
    doc = ok_json("run", classifier, "--ids", "1,2,3,4", "--ids", "5,6")
    outs = {k: np.array(v) for k, v in doc["outputs"].items()}
    probs = {k for k in outs if k.endswith("_probabilities")}
    assert probs == {"cls_probabilities", "cls_mean_probabilities", "cls_last_probabilities"}  # classifiers only
    assert outs["cls_probabilities"].shape == (2, 3)
    for name in probs:
        p = outs[name]
        np.testing.assert_allclose(p.sum(-1), 1.0, atol=1e-5)
        assert (p > 0).all()
        logits = outs[name[: -len("_probabilities")]]
        e = np.exp(logits - logits.max(-1, keepdims=True))
        np.testing.assert_allclose(p, e / e.sum(-1, keepdims=True), atol=1e-6)
    # encoders are right-padded with a mask: the short row's pooled outputs are the row alone
    alone = Session(classifier).run(input_ids=[[5, 6]])
    for name in ("cls", "cls_mean", "cls_last", "pooler_output"):
        np.testing.assert_allclose(outs[name][1], alone[name][0], atol=1e-4)
    text = cli("run", classifier, "--ids", "1,2,3")
    assert text.exit_code == 0, text.output
    assert "cls_probabilities: float32 [1, 3]" in text.stdout


# --- specc generate ---------------------------------------------------------------------------------------


def test_generate_streams_the_new_ids(gpt2, session):
    result = cli("generate", gpt2, "--ids", "5,6,7", "--max-new-tokens", "5")
    assert result.exit_code == 0, result.output
    assert result.stdout.endswith("\n")
    assert [int(x) for x in result.stdout.split()] == session.generate([5, 6, 7], max_new_tokens=5).new_ids[0]


def test_generate_json_equals_session_generate(gpt2, session):
    prompt = [400, 12, 999, 81, 3, 77]
    doc = ok_json("generate", gpt2, "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "6")
    want = session.generate(prompt, max_new_tokens=6)
    assert doc == {"ids": want.ids, "new_ids": want.new_ids}
    assert doc["ids"][0][: len(prompt)] == prompt
    # the default is greedy, and --greedy says so
    assert ok_json("generate", gpt2, "--ids", ",".join(map(str, prompt)), "--max-new-tokens", "6", "--greedy") == doc


def test_generate_repeated_ids_is_a_batch(gpt2, session):
    rows = [[5, 6, 7], [1, 2]]
    want = session.generate(rows, max_new_tokens=4)
    doc = ok_json("generate", gpt2, "--ids", "5,6,7", "--ids", "1,2", "--max-new-tokens", "4")
    assert doc == {"ids": want.ids, "new_ids": want.new_ids}
    plain = cli("generate", gpt2, "--ids", "5,6,7", "--ids", "1,2", "--max-new-tokens", "4")
    assert plain.exit_code == 0, plain.output
    assert plain.stdout.splitlines() == [",".join(map(str, r)) for r in want.new_ids]


def test_generate_with_beams(gpt2, session):
    want = session.generate([5, 6, 7], max_new_tokens=4, beams=3)
    doc = ok_json("generate", gpt2, "--ids", "5,6,7", "--max-new-tokens", "4", "--beams", "3")
    assert doc == {"ids": want.ids, "new_ids": want.new_ids}
    alpha = session.generate([5, 6, 7], max_new_tokens=4, beams=3, length_penalty=1.5)
    doc = ok_json("generate", gpt2, "--ids", "5,6,7", "--max-new-tokens", "4", "--beams", "3", "--length-penalty", "1.5")
    assert doc["new_ids"] == alpha.new_ids
    plain = cli("generate", gpt2, "--ids", "5,6,7", "--max-new-tokens", "4", "--beams", "3")
    assert plain.exit_code == 0 and plain.stdout.splitlines() == [",".join(map(str, want.new_ids[0]))]


def test_generate_sampling_is_reproducible_with_a_seed(gpt2, session):
    flags = ["--ids", "5,6,7", "--max-new-tokens", "8", "--temperature", "1.5", "--top-k", "50", "--top-p", "0.95"]
    a = ok_json("generate", gpt2, *flags, "--seed", "7")
    b = ok_json("generate", gpt2, *flags, "--seed", "7")
    c = ok_json("generate", gpt2, *flags, "--seed", "8")
    assert a == b
    assert a["new_ids"] != c["new_ids"]
    want = session.generate([5, 6, 7], max_new_tokens=8, temperature=1.5, top_k=50, top_p=0.95, seed=7)
    assert a["new_ids"] == want.new_ids
    assert a["new_ids"] != session.generate([5, 6, 7], max_new_tokens=8).new_ids


def test_generate_eos_id(gpt2, session):
    first = session.generate([5, 6, 7], max_new_tokens=1).new_ids[0][0]
    doc = ok_json("generate", gpt2, "--ids", "5,6,7", "--max-new-tokens", "6", "--eos-id", str(first))
    assert doc["new_ids"] == [[first]]


@pytest.mark.parametrize("args", [
    ["--greedy", "--temperature", "1"], ["--greedy", "--beams", "2"], ["--greedy", "--top-k", "3"],
    ["--temperature", "0"], ["--top-p", "0"], ["--top-p", "1.5"], ["--beams", "0"], ["--max-new-tokens", "0"],
    ["--temperature", "nan"], ["--temperature", "inf"], ["--temperature", "-1"], ["--top-p", "nan"],
    ["--top-k", "-1"], ["--length-penalty", "nan"], ["--seed", "-1"],
])
def test_generate_bad_option_combinations_exit_2(gpt2, args):
    result = cli("generate", gpt2, "--ids", "5,6,7", *args)
    assert result.exit_code == 2, result.output
    assert "Usage" in result.output or "Error" in result.output
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["run", "generate"])
@pytest.mark.parametrize("args", [["--ids", "a,b"], ["--ids", ""], ["--ids", ","], [], ["--ids", "1", "--input", "x.json"],
                                  ["--text", "hello"]])
def test_bad_prompts_exit_2(gpt2, command, args):
    result = cli(command, gpt2, *args)
    assert result.exit_code == 2, result.output
    assert result.stdout == ""


@pytest.mark.parametrize("command", ["run", "generate"])
def test_a_missing_build_dir_exits_1_with_a_message(tmp_path, command):
    missing = tmp_path / "no-such-build"
    result = cli(command, missing, "--ids", "1,2,3")
    assert result.exit_code == 1
    assert str(missing) in result.stderr and "manifest.json" in result.stderr
    assert result.stdout == ""
    assert "internal error" not in result.stderr


@pytest.mark.parametrize("command", ["run", "generate"])
def test_an_unavailable_provider_exits_1(gpt2, command):
    result = cli(command, gpt2, "--ids", "1,2,3", "--provider", "NoSuchExecutionProvider")
    assert result.exit_code == 1
    assert "NoSuchExecutionProvider" in result.stderr and "internal error" not in result.stderr


def test_generate_on_an_encoder_build_exits_1(classifier):
    result = cli("generate", classifier, "--ids", "1,2,3")
    assert result.exit_code == 1
    assert "decoder" in result.stderr and "internal error" not in result.stderr


def test_generate_out_of_vocabulary_exits_1(gpt2):
    result = cli("generate", gpt2, "--ids", "5,1000")
    assert result.exit_code == 1
    assert "1000" in result.stderr and "internal error" not in result.stderr


@pytest.fixture(scope="module")
def bad_inputs(tmp_path_factory) -> Path:
    """--input files a client gets wrong."""
    folder = tmp_path_factory.mktemp("bad-inputs")
    (folder / "floats.json").write_text("[[1.5, 2.0]]")
    (folder / "floats-named.json").write_text(json.dumps({"input_ids": [[1.5, 2.0]]}))
    (folder / "negative-positions.json").write_text(json.dumps({"input_ids": [[5, 6, 7]], "position_ids": [[0, -1, 2]]}))
    (folder / "mask.json").write_text(json.dumps({"input_ids": [[5, 6, 7]], "attention_mask": [[7, -1, 0]]}))
    (folder / "too-many-rows.json").write_text(json.dumps([[1, 2]] * 5))
    np.savez(folder / "floats.npz", input_ids=np.array([[1.5, 2.0]]))
    npz_bomb(tmp_path_factory.getbasetemp() / "bomb.npz")
    return folder


# (id, command and arguments, words of the one line); {inputs} is the bad_inputs folder, {bomb} the NPZ bomb
REFUSALS = [
    ("run-negative-id", ["run", "--ids", "-5,9,2"], ["input_ids", "[-5]"]),
    ("run-float-rows", ["run", "--input", "{inputs}/floats.json"], ["input_ids", "integers", "1.5"]),
    ("run-float-named", ["run", "--input", "{inputs}/floats-named.json"], ["input_ids", "integers", "float64"]),
    ("run-float-npz", ["run", "--input", "{inputs}/floats.npz"], ["input_ids", "integers", "float64"]),
    ("run-negative-positions", ["run", "--input", "{inputs}/negative-positions.json"], ["position_ids", "[-1]"]),
    ("run-mask", ["run", "--input", "{inputs}/mask.json"], ["attention_mask", "0 or 1"]),
    ("run-too-many-rows", ["run", "--input", "{inputs}/too-many-rows.json"], ["5 prompts", "serving.batch.max 4"]),
    ("run-too-long", ["run", "--ids", ",".join(["1"] * 129)], ["129 tokens", "serving.length.max 128"]),
    ("run-npz-bomb", ["run", "--input", "{bomb}"], ["bomb.npz", "134217728", "serving.length.max 128"]),
    ("generate-npz-bomb", ["generate", "--input", "{bomb}"], ["bomb.npz", "134217728"]),
    ("generate-negative-id", ["generate", "--ids", "5,-1"], ["input_ids", "[-1]"]),
    ("generate-float-rows", ["generate", "--input", "{inputs}/floats.json"], ["input_ids", "integers"]),
    ("generate-max-new-tokens", ["generate", "--ids", "5,6", "--max-new-tokens", "100000000"],
     ["max_new_tokens (100000000)", "at most 126 new tokens"]),
    ("generate-beams", ["generate", "--ids", "5,6", "--beams", "100000"], ["beams (100000)", "use fewer beams"]),
    ("generate-too-many-prompts", ["generate"] + ["--ids", "5,6"] * 5, ["5 prompts", "serving.batch.max 4"]),
    # files that are no regular files were read without end (23 GB before the kernel ended it)
    ("run-input-device", ["run", "--input", "/dev/zero"], ["/dev/zero", "a character device, not a regular file"]),
    ("generate-input-device", ["generate", "--input", "/dev/zero"], ["/dev/zero", "a character device"]),
    ("generate-tokenizer-device", ["generate", "--text", "hi", "--tokenizer", "/dev/zero"], ["/dev/zero", "a character device"]),
]


@pytest.mark.parametrize("args, words", [c[1:] for c in REFUSALS], ids=[c[0] for c in REFUSALS])
def test_client_mistakes_exit_1_with_one_line(gpt2, bad_inputs, tmp_path_factory, args, words):
    bomb = tmp_path_factory.getbasetemp() / "bomb.npz"
    args = [a.format(inputs=bad_inputs, bomb=bomb) for a in args]
    result = cli(args[0], gpt2, *args[1:])
    assert result.exit_code == 1, result.output
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("specc: error: "), result.stderr
    assert "internal error" not in result.stderr
    for word in words:
        assert word in lines[0], (word, lines[0])


# --- tokenizer ------------------------------------------------------------------------------------------


def test_generate_text_with_a_tokenizer(gpt2, session, tokenizer_file):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_file))
    text = "hello world w17 w400"
    ids = tok.encode(text).ids
    assert ids == [1, 2, 17, 400]
    doc = ok_json("generate", gpt2, "--text", text, "--tokenizer", tokenizer_file, "--max-new-tokens", "5")
    want = session.generate(ids, max_new_tokens=5)
    assert doc["ids"] == want.ids and doc["new_ids"] == want.new_ids
    assert doc["text"] == [tok.decode(want.new_ids[0])]
    words = {i: w for w, i in tok.get_vocab().items()}
    assert doc["text"][0].split() == [words[i] for i in want.new_ids[0]]
    # without --json the text streams out
    plain = cli("generate", gpt2, "--text", text, "--tokenizer", tokenizer_file, "--max-new-tokens", "5")
    assert plain.exit_code == 0, plain.output
    assert plain.stdout.replace(" ", "").strip() == tok.decode(want.new_ids[0]).replace(" ", "")
    # a batch of texts: one decoded line per row
    batch = cli("generate", gpt2, "--text", text, "--text", "world", "--tokenizer", tokenizer_file, "--max-new-tokens", "3")
    want = session.generate([ids, [2]], max_new_tokens=3)
    assert batch.stdout.splitlines() == [tok.decode(r) for r in want.new_ids]


def test_run_text_with_a_tokenizer(gpt2, session, tokenizer_file):
    doc = ok_json("run", gpt2, "--text", "hello world w9", "--tokenizer", tokenizer_file)
    np.testing.assert_allclose(np.array(doc["outputs"]["logits"]), session.run(input_ids=[[1, 2, 9]])["logits"], atol=1e-6)


def test_a_bad_tokenizer_file_exits_1(gpt2, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{}")
    result = cli("generate", gpt2, "--text", "hello", "--tokenizer", bad)
    assert result.exit_code == 1
    assert str(bad) in result.stderr and "internal error" not in result.stderr


# --- a real process -----------------------------------------------------------------------------------------


def test_generate_json_in_a_real_process(gpt2, session):
    if not SPECC.exists():
        pytest.skip("the specc console script is not installed next to this Python")
    env = {k: v for k, v in os.environ.items() if k != "SPECC_DEBUG"}
    out = subprocess.run([str(SPECC), "generate", str(gpt2), "--ids", "5,6,7", "--ids", "8", "--max-new-tokens", "3",
                          "--json"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    want = session.generate([[5, 6, 7], [8]], max_new_tokens=3)
    assert json.loads(out.stdout) == {"ids": want.ids, "new_ids": want.new_ids}
    assert "Traceback" not in out.stderr


_STARTS = """
import os
with open(os.environ["SPECC_TEST_STARTS"], "a") as f:
    f.write(f"{os.getpid()} {os.environ.get('GLIBC_TUNABLES', '-')}\\n")
"""


@pytest.mark.parametrize("users", [None, "glibc.malloc.hugetlb=0"])
def test_generate_starts_again_in_huge_pages_as_the_same_process(gpt2, session, tmp_path, users):
    """`specc generate` runs in the environment specc.malloc.huge_pages_environment gives (one exec,
    the same process id, the same answer), unless there is none here or the user set the tunable."""
    from specc.malloc import huge_pages_environment

    if not SPECC.exists():
        pytest.skip("the specc console script is not installed next to this Python")
    (tmp_path / "sitecustomize.py").write_text(_STARTS)  # runs at every interpreter start
    env = {k: v for k, v in os.environ.items() if k not in ("SPECC_DEBUG", "GLIBC_TUNABLES")}
    env.update(PYTHONPATH=str(tmp_path), SPECC_TEST_STARTS=str(tmp_path / "starts"), **({"GLIBC_TUNABLES": users} if users else {}))
    out = subprocess.run([str(SPECC), "generate", str(gpt2), "--ids", "5,6,7", "--max-new-tokens", "3", "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["new_ids"] == session.generate([5, 6, 7], max_new_tokens=3).new_ids
    starts = [line.split() for line in (tmp_path / "starts").read_text().splitlines()]
    if users is None and huge_pages_environment(env) is not None:
        assert [t for _, t in starts] == ["-", "glibc.malloc.hugetlb=1"]
        assert starts[0][0] == starts[1][0]  # exec, not a child
    else:
        assert [t for _, t in starts] == [users or "-"]


# --- examples/generate_with_onnxruntime.py ------------------------------------------------------------------


def test_example_script_imports_nothing_from_specc():
    tree = ast.parse(EXAMPLE.read_text())
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0
            modules.add(node.module.split(".")[0])
    assert "specc" not in modules
    assert {"onnxruntime", "numpy"} <= modules
    assert "specc" not in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    assert "__import__" not in EXAMPLE.read_text() and "importlib" not in modules


def test_example_script_gives_the_ids_of_session_generate(gpt2, session):
    prompt = [400, 12, 999, 81, 3, 77]
    out = subprocess.run([sys.executable, str(EXAMPLE), str(gpt2), ",".join(map(str, prompt)), "--max-new-tokens", "9"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = [int(x) for x in out.stdout.strip().split(",")]
    assert len(got) == 9
    want = session.generate(prompt, max_new_tokens=9).new_ids[0]
    # the example does not stop at EOS (999); Session.generate does
    if 999 in got:
        got = got[: got.index(999) + 1]
    assert got == want
