"""Mutations of every catalog spec through `specc validate` and `specc resolve`: deleted keys,
wrong types, out-of-range and huge numbers, unicode, deep nesting, duplicate keys, stray text.
Whatever the file, the exit code is 0 or 1, no traceback and no "internal error" is printed, and
a failure names FILE:LINE:COL. Seeded: `make test` tries the same SPECC_FUZZ_EXAMPLES * 10
mutations per run (default 40); `make fuzz` tries more."""
from __future__ import annotations

import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from specc.cli import main
from specc.spec.load import catalog_dir
from specc.spec.yamlio import dump_yaml, parse_yaml

CATALOG = sorted(catalog_dir().glob("*.yaml"))
COUNT = 10 * int(os.environ.get("SPECC_FUZZ_EXAMPLES", "4"))
LOCATED = re.compile(r"^\s*\S+:\d+:\d+: ", re.M)

WEIRD = [10**400, -(10**400), 1e308 * 10, float("nan"), -1, 0, 2**63, 0.5, -0.0, "", "ünïcødé ✓",
         "名前", "\u202e\u0000x", "a" * 5000, True, None, [], {}, [1, [2, [3]]], {"kind": "?"}]


def paths(data, prefix=()):
    """Every key path of the data, lists included."""
    out = []
    if isinstance(data, dict):
        for k, v in data.items():
            out.append(prefix + (k,))
            out += paths(v, prefix + (k,))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            out.append(prefix + (i,))
            out += paths(v, prefix + (i,))
    return out


def parent_of(data, path):
    for part in path[:-1]:
        data = data[part]
    return data


def nested(depth: int):
    value: object = 1
    for _ in range(depth):
        value = {"a": value}
    return value


def mutate_data(data: dict, rng: random.Random) -> str:
    where = rng.choice(paths(data))
    parent, last = parent_of(data, where), where[-1]
    op = rng.choice(["delete", "weird", "weird", "nest", "rename", "string_number"])
    if op == "delete":
        del parent[last]
    elif op == "weird":
        parent[last] = rng.choice(WEIRD)
    elif op == "nest":
        parent[last] = nested(rng.choice([5, 47, 49, 200]))
    elif op == "rename" and isinstance(parent, dict):
        parent[rng.choice(["kínd", "x" * 300, "heads ", "2", "__class__"])] = parent.pop(last)
    elif op == "string_number":
        parent[last] = str(rng.randint(-5, 10**6))
    return dump_yaml(data) if not isinstance(data, str) else data


def mutate_text(text: str, rng: random.Random) -> str:
    lines = text.splitlines()
    i = rng.randrange(len(lines))
    op = rng.choice(["duplicate", "drop", "indent", "truncate", "unicode", "tab", "bigint", "flow"])
    if op == "duplicate":
        lines.insert(i, lines[i])
    elif op == "drop":
        del lines[i]
    elif op == "indent":
        lines[i] = " " * rng.choice([1, 3, 7]) + lines[i]
    elif op == "truncate":
        return text[: rng.randrange(len(text))]
    elif op == "unicode":
        lines[i] = lines[i] + rng.choice([" # ✓", "\u00a0", "ü", "\ufeff", "\x85"])
    elif op == "tab":
        lines[i] = "\t" + lines[i]
    elif op == "bigint":
        lines[i] = re.sub(r"\b\d+\b", "9" * 400, lines[i])
    elif op == "flow":
        lines[i] = lines[i] + rng.choice([" {", " [", " &a", " *a", " !!python/object:os.system", " : :"])
    return "\n".join(lines) + "\n"


def cases():
    rng = random.Random(1234)
    for n in range(COUNT):
        source = CATALOG[n % len(CATALOG)]
        text = source.read_text()
        if n % 2:
            data = parse_yaml(text, str(source)).data
            data.pop("extends", None) if rng.random() < 0.2 else None
            yield source.stem, n, mutate_data(data, rng)
        else:
            yield source.stem, n, mutate_text(text, rng)


def check(result_code: int, output: str, text: str) -> None:
    assert result_code in (0, 1), (result_code, output, text)
    assert "Traceback" not in output, (output, text)
    assert "internal error" not in output, (output, text)
    if result_code == 1:
        assert LOCATED.search(output), (output, text)


@pytest.mark.parametrize("stem,n,text", list(cases()), ids=lambda v: str(v) if isinstance(v, (str, int)) else "")
def test_mutated_catalog_spec_validate_and_resolve(stem, n, text, tmp_path):
    path = tmp_path / f"{stem}-mutant.yaml"
    path.write_text(text, encoding="utf-8")
    runner = CliRunner()
    for args in (["validate", str(path)], ["resolve", str(path)], ["validate", "--json", str(path)]):
        result = runner.invoke(main, args)
        assert result.exception is None or isinstance(result.exception, SystemExit), (repr(result.exception), text)
        if args[1] == "--json":
            assert result.exit_code in (0, 1)
            continue
        check(result.exit_code, result.output, text)


def test_every_catalog_spec_was_mutated():
    assert {stem for stem, _, _ in cases()} == {p.stem for p in CATALOG} or COUNT < len(CATALOG)


@pytest.mark.parametrize("n", [0, 1, 2])
def test_mutations_through_the_real_process(n, tmp_path):
    """A few mutants through the installed command: the real exit path."""
    stem, _, text = list(cases())[n]
    path = tmp_path / "mutant.yaml"
    path.write_text(text, encoding="utf-8")
    exe = Path(sys.executable).with_name("specc")
    for cmd in ("validate", "resolve"):
        proc = subprocess.run([str(exe), cmd, str(path)], capture_output=True, text=True, timeout=120)
        check(proc.returncode, proc.stdout + proc.stderr, text)
