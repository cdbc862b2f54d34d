"""Malformed and hostile YAML: every one is a SpecError naming the file (and, where the problem
has one, the line and column), never another exception; nothing in a file is ever executed."""
from __future__ import annotations

import time

import pytest

from specc.errors import SpecError
from specc.spec import load_spec, loads_spec
from specc.spec.yamlio import MAX_SPEC_BYTES

from tests.helpers.spectext import DEC

VALID = DEC


def _rejected(path) -> SpecError:
    """Load ``path``; it must fail with a SpecError (anything else fails the test)."""
    try:
        load_spec(path)
    except SpecError as exc:
        assert exc.issues, "a SpecError with no issue"
        for issue in exc.issues:
            assert issue.file == str(path)
            assert issue.message
        return exc
    pytest.fail("the spec was accepted")


def _one(exc: SpecError):
    assert len(exc.issues) == 1, "\n".join(map(str, exc.issues))
    return exc.issues[0]


# (id, text, needle marking the expected line:column with "^", message fragment)
LOCATED = [
    ("tab-indent", "specc: 1\nvocab:\n\tsize: 3\n", "^\tsize", "invalid YAML"),
    ("bad-indent", "specc: 1\nvocab:\n  size: 3\n   type_size: 4\n", "type_size^:", "invalid YAML"),
    ("unclosed-bracket", "specc: 1\nvocab: [1, 2\nname: t\n", "name^:", "invalid YAML"),
    ("unclosed-quote", 'specc: 1\nname: "t\n', None, "invalid YAML"),
    ("custom-tag", VALID + "description: !foo bar\n", "description: ^!foo", "'!foo' is not allowed"),
    ("custom-tag-on-mapping", VALID + "position: !pos {kind: learned}\n", "position: ^!pos", "not allowed"),
    ("python-name-tag", VALID + "description: !!python/name:os.system\n", "description: ^!!python", "not allowed"),
    ("binary-tag", VALID + "description: !!binary aGVsbG8=\n", "description: ^!!binary", "not allowed"),
    ("duplicate-key", VALID + "d_model: 32\n", "^d_model: 32", "duplicate key 'd_model' (first at line 4)"),
    ("duplicate-nested-key", VALID + "    heads: 8\n", "^heads: 8", "duplicate key 'heads'"),
    (
        "merge-key",
        "base: &b {size: 100}\n" + VALID.replace("vocab:\n  size: 100\n", "vocab:\n  <<: *b\n"),
        "^<<",
        "merge keys (<<) are not supported",
    ),
    ("non-string-key", VALID + "1: one\n", "^1: one", "keys must be plain strings"),
    ("list-at-top-level", "- specc: 1\n- name: t\n", "^- specc", "a spec is a YAML mapping"),
    ("scalar-at-top-level", "just some words\n", "^just", "a spec is a YAML mapping"),
    ("empty-file", "", None, "empty"),
    ("only-comments", "# nothing here\n", None, "empty"),
    ("two-documents", VALID + "---\nspecc: 1\n", "^---", "invalid YAML"),
    ("deep-nesting", "a: " + "[" * 200 + "]" * 200 + "\n", None, "nesting deeper than"),
    ("deep-mapping-nesting", "".join("  " * i + f"k{i}:\n" for i in range(200)) + "  " * 200 + "x: 1\n", None,
     "nesting deeper than"),
]


@pytest.mark.parametrize("text,at,fragment", [c[1:] for c in LOCATED], ids=[c[0] for c in LOCATED])
def test_malformed_yaml_is_a_located_spec_error(text, at, fragment, spec_file, position_of):
    path = spec_file(text)
    issue = _one(_rejected(path))
    assert fragment in issue.message
    assert issue.line is not None and issue.column is not None and issue.line >= 1 and issue.column >= 1
    if at is not None:
        assert (issue.line, issue.column) == position_of(text, at), str(issue)


@pytest.mark.parametrize(
    "tag_value",
    [
        '!!python/object/apply:os.system ["touch {marker}"]',
        "!!python/object/apply:os.system\n  - touch {marker}",
        '!!python/object/new:subprocess.check_call [["touch", "{marker}"]]',
    ],
    ids=["apply-flow", "apply-block", "new"],
)
def test_python_tags_are_refused_and_never_run(tag_value, spec_file, tmp_path, position_of):
    marker = tmp_path / "pwned_specc"
    text = VALID + "description: " + tag_value.format(marker=marker) + "\n"
    path = spec_file(text)
    issue = _one(_rejected(path))
    assert "is not allowed" in issue.message
    assert issue.key == "description"
    assert (issue.line, issue.column) == position_of(text, "description: ^!!python")
    assert not marker.exists()
    # the same through loads_spec (text, no file)
    with pytest.raises(SpecError):
        loads_spec(text)
    assert not marker.exists()


def test_billion_laughs_is_refused_quickly(spec_file):
    rows = ['a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        rows.append(f"{name}: &{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    path = spec_file("\n".join(rows) + "\n")  # 9**9 strings if expanded
    start = time.perf_counter()
    issue = _one(_rejected(path))
    assert time.perf_counter() - start < 2.0
    assert "refused" in issue.message
    assert issue.line is not None


def test_very_deep_flow_nesting_is_refused(spec_file):
    path = spec_file("a: " + "[" * 600 + "]" * 600 + "\n")
    issue = _one(_rejected(path))
    assert "nesting" in issue.message


def test_file_over_one_mebibyte_is_refused(spec_file):
    filler = "# " + "x" * 100 + "\n"
    text = VALID + filler * (MAX_SPEC_BYTES // len(filler) + 1)
    path = spec_file(text)
    assert path.stat().st_size > MAX_SPEC_BYTES
    issue = _one(_rejected(path))
    assert "limit" in issue.message or "larger" in issue.message
    with pytest.raises(SpecError):
        loads_spec(text)


def test_file_just_under_the_limit_is_read(spec_file):
    filler = "# " + "x" * 100 + "\n"
    text = VALID + filler * ((MAX_SPEC_BYTES - len(VALID)) // len(filler) - 1)
    path = spec_file(text)
    assert path.stat().st_size <= MAX_SPEC_BYTES
    assert load_spec(path).name == "t"


def test_non_utf8_bytes_are_refused(spec_file):
    path = spec_file(VALID.encode() + b"description: caf\xe9\n")
    issue = _one(_rejected(path))
    assert "UTF-8" in issue.message


def test_non_utf8_bytes_are_located(spec_file):
    """Line and column of the first byte that is not UTF-8 (the \\xe9)."""
    path = spec_file(VALID.encode() + b"description: caf\xe9\n")
    issue = _one(_rejected(path))
    assert (issue.line, issue.column) == (11, 17)


def test_nul_byte_is_a_spec_error(spec_file):
    issue = _one(_rejected(spec_file(VALID + "description: a\x00b\n")))
    assert "invalid YAML" in issue.message


def test_a_directory_is_not_a_spec(tmp_path):
    d = tmp_path / "dir.yaml"
    d.mkdir()
    with pytest.raises(SpecError) as info:
        load_spec(d)
    assert info.value.issues[0].file == str(d)


def test_missing_file_is_a_spec_error(tmp_path):
    path = tmp_path / "nothere.yaml"
    with pytest.raises(SpecError) as info:
        load_spec(path)
    [issue] = info.value.issues
    assert issue.file == str(path)
    assert "no such spec file" in issue.message


def test_yaml_1_2_scalars(spec_file):
    """Plain values keep their YAML 1.2 core-schema types: `0x40` is an int, `1.0e-5` a float."""
    spec = load_spec(spec_file(VALID.replace("d_model: 64", "d_model: 0x40") + "norm: {eps: 1.0e-5}\n"))
    assert spec.d_model == 64
    assert spec.norm.eps == 1.0e-5


# --- absurd sizes are refused at once (issue 30's red-team findings) ------------------------------


@pytest.mark.parametrize("key, value, message", [
    ("d_model", "9" * 5000, "an integer of 5000 digits"),  # past Python's int-from-text limit
    ("d_model", "9" * 21, "an integer of 21 digits"),
    ("decoder", "{layers: 100000000}", "less than or equal to 4096"),
])
def test_absurd_sizes_are_refused_located_within_a_second(tmp_path, key, value, message):
    path = tmp_path / "absurd.yaml"
    path.write_text(f"specc: 1\nname: absurd\nextends: tiny-gpt2\n{key}: {value}\n")
    t0 = time.perf_counter()
    issue = _one(_rejected(path))
    assert time.perf_counter() - t0 < 1.0
    assert message in issue.message and issue.line == 4
