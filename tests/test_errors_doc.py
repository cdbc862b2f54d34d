"""docs/errors.md quotes what the CLI prints: every example there is a case here, run now.

Each case is a set of small files, a command, and its exit code. In the page, the case's block
follows a ``<!-- case: ID -->`` marker. After a deliberate change to a message, print the new
blocks with ``.venv/bin/python tests/test_errors_doc.py [ID ...]`` and paste them in.
"""
from __future__ import annotations

import os
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from specc.spec.load import catalog_dir

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "errors.md"
SPECC = str(Path(sys.executable).parent / "specc")

GPT = "specc: 1\nname: bad\nextends: tiny-gpt2\n"
BERT = "specc: 1\nname: bad\nextends: tiny-bert\n"
LAUGHS = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 10)}]\n" for p, c in zip("abcde", "bcdef")
)



def gguf_text(arch: str, *strings: tuple[str, str]) -> str:
    """A GGUF file (version 3) of string metadata and no tensors; its bytes are all ASCII."""
    kv = [("general.architecture", arch), *strings]
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, value in kv:
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<IQ", 8, len(value)) + value.encode()
    return out.decode("ascii")


# id: (files, command, exit code)
CASES: dict[str, tuple[dict[str, str], str, int]] = {
    "yaml-syntax": ({"bad.yaml": GPT + "decoder:\n  layers: [2\n"}, "validate bad.yaml", 1),
    "unknown-key": ({"bad.yaml": GPT + "decoder:\n  layrs: 2\n"}, "validate bad.yaml", 1),
    "unknown-kind": ({"bad.yaml": GPT + "position: {kind: rotery}\n"}, "validate bad.yaml", 1),
    "wrong-type": ({"bad.yaml": GPT + 'd_model: "64"\n'}, "validate bad.yaml", 1),
    "out-of-range": ({"bad.yaml": GPT + "decoder:\n  attention: {heads: 0}\n  ffn: {d_ff: -1}\n"},
                     "validate bad.yaml", 1),
    "missing-field": ({"bad.yaml": "specc: 1\nname: bad\narchitecture: decoder\nvocab: {size: 100}\n"},
                      "validate bad.yaml", 1),
    "rule-heads": ({"bad.yaml": GPT + "decoder:\n  attention: {heads: 5}\n"}, "validate bad.yaml", 1),
    "rule-several": ({"bad.yaml": GPT + "architecture: encoder\nserving:\n  length: {min: 1, opt: 64, max: 32}\n"},
                     "validate bad.yaml", 1),
    "rule-linformer-decoder": ({"bad.yaml": GPT + "decoder:\n  attention:\n    pattern: {kind: linformer, k: 32}\n"},
                               "validate bad.yaml", 1),
    "rule-experts": ({"bad.yaml": "specc: 1\nname: bad\nextends: tiny-llama\n"
                                  "decoder:\n  ffn: {kind: moe, experts: 4, top_k: 8, d_ff: 32}\n"}, "validate bad.yaml", 1),
    "rule-learned-length": ({"bad.yaml": GPT + "serving:\n  length: {min: 1, opt: 32, max: 512}\n"},
                            "validate bad.yaml", 1),
    "rule-outputs": ({"bad.yaml": BERT + "outputs:\n  - {kind: hidden}\n  - {kind: classifier, classes: 2, name: last_hidden_state}\n"},
                     "validate bad.yaml", 1),
    "rule-rotary-scaling": ({"bad.yaml": "specc: 1\nname: bad\nextends: tiny-llama\nposition:\n  kind: rotary\n"
                                         "  scaling: {kind: longrope, original_max_length: 8, short_factor: [1.0, 2.0], "
                                         "long_factor: [1.0, 2.0]}\n"}, "validate bad.yaml", 1),
    "extends-missing": ({"bad.yaml": "specc: 1\nname: bad\nextends: tiny-gtp2\n"}, "validate bad.yaml", 1),
    "extends-cycle": ({"a.yaml": "specc: 1\nname: a\nextends: b.yaml\n", "b.yaml": "specc: 1\nname: b\nextends: a.yaml\n"},
                      "validate a.yaml", 1),
    "extends-parent-error": ({"base.yaml": GPT + "d_model: 0\n", "child.yaml": "specc: 1\nname: child\nextends: base.yaml\n"},
                             "validate child.yaml", 1),
    "hostile-tag": ({"bad.yaml": GPT + "description: !!python/object/apply:os.system [echo hi]\n"},
                    "validate bad.yaml", 1),
    "hostile-aliases": ({"bad.yaml": GPT + LAUGHS}, "validate bad.yaml", 1),
    "hostile-size": ({"bad.yaml": GPT + "# " + "x" * (1 << 20) + "\n"}, "validate bad.yaml", 1),
    "weights-missing": ({"bad.yaml": GPT + "weights: trained.safetensors\n"}, "build -q bad.yaml -o build/bad", 1),
    "weights-not-safetensors": ({"bad.yaml": GPT, "w.safetensors": "not a safetensors file"},
                                "build -q bad.yaml -o build/bad --weights w.safetensors", 1),
    "weights-shard-missing": ({"bad.yaml": GPT, "w.safetensors.index.json":
                               '{"weight_map": {"decoder.final_norm.weight": "w-00002-of-00002.safetensors"}}'},
                              "build -q bad.yaml -o build/bad --weights w.safetensors.index.json", 1),
    "gguf-architecture": ({"model.gguf": gguf_text("mamba")}, "import gguf model.gguf -o model.yaml", 1),
    "gguf-metadata": ({"model.gguf": gguf_text("llama", ("llama.rope.scaling.type", "yarn"))},
                      "import gguf model.gguf -o model.yaml", 1),
    "gguf-t5encoder": ({"model.gguf": gguf_text("t5encoder")}, "import gguf model.gguf -o model.yaml", 1),
    "memory": ({}, "build -q tiny-gpt2 -o build/tiny --max-memory 1MiB", 1),
    "memory-streamed": ({"deep.yaml": GPT.replace("bad", "deep") + "decoder: {layers: 4}\n"},
                        "build -q deep.yaml -o build/deep --max-memory 1MiB", 1),
    "not-streamable": ({}, "build -q tiny-gpt2 -o build/tiny --stream", 1),
    "run-no-build": ({}, "generate build/none --ids 1,2,3", 1),
    "run-bad-ids": ({"one.yaml": GPT.replace("bad", "one") + "decoder: {layers: 1}\n"},
                    "generate build/one --ids 1,2,1000", 1),
    "usage": ({}, "build tiny-gpt2", 2),
    "tokenizer-missing": ({"bad.yaml": GPT + "tokenizer: bad.tokenizer\n"}, "build -q bad.yaml -o build/bad", 1),
    "text-no-tokenizer": ({"one.yaml": GPT.replace("bad", "one") + "decoder: {layers: 1}\n"},
                          "generate build/one --text Hello", 2),
    "import-gguf-folder": ({"model.Q4_0.gguf": "GGUF"}, "import hf . -o model.yaml", 1),
    "import-out-folder": ({}, "import hf . -o newdir/model.yaml", 1),
}
# commands run before a case's own (not shown in the page)
SETUP = {"run-bad-ids": "build -q one.yaml -o build/one", "text-no-tokenizer": "build -q one.yaml -o build/one"}


def run_case(case_id: str, cwd: Path) -> str:
    files, command, _ = CASES[case_id]
    for name, text in files.items():
        (cwd / name).write_text(text, encoding="utf-8")
    env = dict(os.environ, NO_COLOR="1", COLUMNS="100", TERM="dumb")
    if case_id in SETUP:
        subprocess.run([SPECC, *shlex.split(SETUP[case_id])], cwd=cwd, env=env, check=True, capture_output=True, timeout=300)
    proc = subprocess.run([SPECC, *shlex.split(command)], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    out = (proc.stdout + proc.stderr).rstrip("\n")
    # the page shows paths as a user sees them: the temporary folder is the current one
    out = out.replace(str(cwd.resolve()) + "/", "").replace(str(cwd) + "/", "")
    out = out.replace(str(catalog_dir().resolve()), "<catalog>").replace(str(catalog_dir()), "<catalog>")
    return f"$ specc {command}\n{out}\n(exit {proc.returncode})"


def quoted(case_id: str) -> str:
    m = re.search(rf"<!-- case: {re.escape(case_id)} -->\n```text\n(.*?)\n```", DOC.read_text(encoding="utf-8"), re.S)
    assert m, f"docs/errors.md has no block for case {case_id}"
    return m.group(1)


@pytest.mark.parametrize("case_id", list(CASES))
def test_the_page_quotes_what_the_cli_prints(case_id, tmp_path):
    got = run_case(case_id, tmp_path)
    assert got.endswith(f"(exit {CASES[case_id][2]})"), got
    assert "Traceback" not in got
    assert quoted(case_id) == got, f"regenerate: .venv/bin/python tests/test_errors_doc.py {case_id}"


def test_every_block_in_the_page_is_a_case():
    ids = re.findall(r"<!-- case: ([\w-]+) -->", DOC.read_text(encoding="utf-8"))
    assert sorted(ids) == sorted(CASES)


def test_every_cross_field_rule_is_listed():
    from specc.spec.rules import RULES

    text = DOC.read_text(encoding="utf-8")
    missing = [rule.__name__ for rule in RULES if f"`{rule.__name__}`" not in text]
    assert not missing, f"docs/errors.md does not list the rules {missing}"


if __name__ == "__main__":
    import tempfile

    for cid in sys.argv[1:] or CASES:
        with tempfile.TemporaryDirectory() as d:
            print(f"<!-- case: {cid} -->\n```text\n{run_case(cid, Path(d))}\n```\n")
