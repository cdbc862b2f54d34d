"""`extends:`: deep merge (this file wins, mappings merge, lists replace, a changed `kind` replaces
its mapping), relative paths and catalog names, and the errors: cycles, missing files, unknown
catalog names, and problems in a parent file."""
from __future__ import annotations

from pathlib import Path

import pytest

from specc.errors import SpecError
from specc.spec import load_spec, loads_spec
from specc.spec.dump import spec_to_data
from specc.spec.resolve import explicit

PARENT = """\
specc: 1
name: parent
description: the parent
architecture: decoder
d_model: 64
vocab:
  size: 100
  type_size: 2
position:
  kind: sinusoidal
  max_length: 256
  base: 500.0
decoder:
  layers: 2
  attention:
    heads: 4
    kv_heads: 2
    bias: false
  ffn:
    d_ff: 128
    activation: gelu
outputs:
  - {name: logits, kind: lm}
  - {name: hidden, kind: hidden}
serving:
  length: {min: 1, opt: 16, max: 256}
"""


def test_deep_merge(spec_file):
    spec_file(PARENT, "parent.yaml")
    child = spec_file(
        """\
        specc: 1
        name: child
        extends: parent.yaml
        d_model: 128
        decoder:
          layers: 3
          attention:
            heads: 8
        outputs:
          - {name: out, kind: hidden}
        """,
        "child.yaml",
    )
    spec = load_spec(child)
    # scalars: the child wins
    assert spec.name == "child"
    assert spec.d_model == 128
    assert spec.decoder.layers == 3
    assert spec.decoder.attention.heads == 8
    # nested mappings merge: what the child does not set comes from the parent
    assert spec.description == "the parent"
    assert spec.decoder.attention.kv_heads == 2
    assert spec.decoder.attention.bias is False
    assert spec.decoder.ffn.d_ff == 128 and spec.decoder.ffn.activation == "gelu"
    assert spec.vocab.size == 100 and spec.vocab.type_size == 2
    assert spec.position.kind == "sinusoidal" and spec.position.base == 500.0 and spec.position.max_length == 256
    # lists replace
    assert [(o.name, o.kind) for o in spec.outputs] == [("out", "hidden")]
    # the merged spec does not remember where it came from
    assert explicit(spec).extends is None


def test_changing_kind_replaces_the_mapping(spec_file):
    """The parent's sinusoidal `base` (and its other position keys) must not leak into a relative
    position: a mapping whose kind the child changes is replaced whole."""
    spec_file(PARENT, "parent.yaml")
    child = spec_file(
        """\
        specc: 1
        name: child
        extends: parent.yaml
        position:
          kind: relative
          clip: 8
        """,
        "child.yaml",
    )
    spec = load_spec(child)
    assert spec.position.kind == "relative"
    assert spec.position.clip == 8
    assert not hasattr(spec.position, "base")
    assert spec.position.max_length == 512  # the default, not the parent's 256


def test_same_kind_merges(spec_file):
    spec_file(PARENT, "parent.yaml")
    child = spec_file("specc: 1\nname: child\nextends: parent.yaml\nposition: {kind: sinusoidal, base: 20.0}\n",
                      "child.yaml")
    spec = load_spec(child)
    assert spec.position.base == 20.0
    assert spec.position.max_length == 256  # from the parent


def test_changing_pattern_kind_replaces_the_pattern(spec_file):
    spec_file(PARENT.replace("    bias: false\n", "    bias: false\n    pattern: {kind: local, window: 4}\n"),
              "parent.yaml")
    child = spec_file(
        "specc: 1\nname: child\nextends: parent.yaml\ndecoder:\n  attention:\n    pattern: {kind: full}\n",
        "child.yaml",
    )
    spec = load_spec(child)
    assert spec.decoder.attention.pattern.kind == "full"  # the parent's window: 4 did not leak
    assert spec.decoder.attention.kv_heads == 2


def test_a_mapping_without_kind_has_its_fields_default_kind(spec_file):
    """tiny-llama's attention names no kind (multi_head, its field's default): a child's latent
    attention changes the kind and replaces it whole (the parent's kv_heads, a multi_head key, does
    not leak into it); a child's ffn of kind moe replaces the dense one; a child that names no kind
    under a moe parent merges into it."""
    child = spec_file("specc: 1\nname: child\nextends: tiny-llama\ndecoder:\n"
                      "  attention: {kind: latent, heads: 4, d_k: 24, rope_dims: 8, kv_rank: 16}\n"
                      "  ffn: {kind: moe, experts: 4, top_k: 2, d_ff: 32}\n", "child.yaml")
    spec = load_spec(child)
    assert spec.decoder.attention.kind == "latent" and spec.decoder.attention.bias is False  # latent's default
    assert (spec.decoder.ffn.kind, spec.decoder.ffn.activation, spec.decoder.ffn.bias) == ("moe", "swiglu", False)
    grandchild = spec_file("specc: 1\nname: grandchild\nextends: child.yaml\ndecoder:\n  ffn: {top_k: 3}\n"
                           "  attention: {heads: 2}\n", "grandchild.yaml")
    spec = load_spec(grandchild)
    assert (spec.decoder.ffn.kind, spec.decoder.ffn.experts, spec.decoder.ffn.top_k) == ("moe", 4, 3)
    assert (spec.decoder.attention.kind, spec.decoder.attention.heads, spec.decoder.attention.kv_rank) == ("latent", 2, 16)


def test_extends_path_is_relative_to_the_file_not_the_cwd(spec_file, tmp_path, monkeypatch):
    spec_file(PARENT, "base/parent.yaml")
    child = spec_file("specc: 1\nname: child\nextends: ../base/parent.yaml\n", "models/child.yaml")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    spec = load_spec(child)
    assert spec.name == "child" and spec.d_model == 64


def test_three_level_chain(spec_file):
    spec_file(PARENT, "a.yaml")
    spec_file("specc: 1\nname: b\nextends: a.yaml\nd_model: 32\n", "b.yaml")
    c = spec_file("specc: 1\nname: c\nextends: b.yaml\ndecoder:\n  layers: 5\n", "c.yaml")
    spec = load_spec(c)
    assert (spec.name, spec.d_model, spec.decoder.layers, spec.decoder.ffn.d_ff) == ("c", 32, 5, 128)


def test_extends_catalog_name(spec_file):
    child = spec_file("specc: 1\nname: my-gpt\nextends: tiny-gpt2\n")
    mine = spec_to_data(explicit(load_spec(child)))
    catalog = spec_to_data(explicit(load_spec("tiny-gpt2")))
    assert mine.pop("name") == "my-gpt"
    catalog.pop("name")
    assert mine == catalog


def test_loads_spec_extends_relative_to_base_dir(tmp_path, spec_file, monkeypatch):
    spec_file(PARENT, "lib/parent.yaml")
    monkeypatch.chdir(tmp_path)
    before = sorted(p.name for p in (tmp_path / "lib").iterdir())
    spec = loads_spec("specc: 1\nname: child\nextends: parent.yaml\n", base_dir=tmp_path / "lib")
    assert spec.d_model == 64 and spec.name == "child"
    # no temporary file is left behind
    assert sorted(p.name for p in (tmp_path / "lib").iterdir()) == before


def test_weights_path_is_relative_to_the_file_that_names_it(spec_file):
    spec_file(PARENT + "weights: w.safetensors\n", "lib/parent.yaml")
    child = spec_file("specc: 1\nname: child\nextends: lib/parent.yaml\n", "child.yaml")
    spec = load_spec(child)
    assert Path(spec.weights_path) == (child.parent / "lib" / "w.safetensors").resolve()


# --- errors ---------------------------------------------------------------------------------------


def test_cycle_is_an_error(spec_file):
    a = spec_file("specc: 1\nname: a\nextends: b.yaml\n", "a.yaml")
    spec_file("specc: 1\nname: b\nextends: ./a.yaml\n", "b.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(a)
    [issue] = info.value.issues
    assert issue.key == "extends"
    assert "cycle" in issue.message
    assert "a.yaml" in issue.message and "b.yaml" in issue.message


def test_self_extends_is_a_cycle(spec_file):
    a = spec_file("specc: 1\nname: a\nextends: a.yaml\n", "a.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(a)
    assert "cycle" in info.value.issues[0].message


def test_cycle_is_located(spec_file):
    """The issue points at the `extends:` value that closes the cycle."""
    a = spec_file("specc: 1\nname: a\nextends: b.yaml\n", "a.yaml")
    spec_file("specc: 1\nname: b\nextends: a.yaml\n", "b.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(a)
    [issue] = info.value.issues
    assert (issue.line, issue.column) == (3, 10)  # `extends:`'s value, in either file


def test_long_chain_is_refused(spec_file):
    spec_file(PARENT, "p0.yaml")
    for i in range(1, 40):
        spec_file(f"specc: 1\nname: p{i}\nextends: p{i - 1}.yaml\n", f"p{i}.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(spec_file("specc: 1\nname: top\nextends: p39.yaml\n", "top.yaml"))
    assert any(i.key == "extends" for i in info.value.issues)


def test_missing_path(spec_file):
    child = spec_file("specc: 1\nname: c\nextends: nothere.yaml\n")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert (issue.file, issue.key, issue.line, issue.column) == (str(child), "extends", 3, 10)
    assert "nothere.yaml" in issue.message


def test_unknown_catalog_name_with_suggestion(spec_file):
    child = spec_file("specc: 1\nname: c\nextends: gpt2-smal\n")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert (issue.file, issue.key, issue.line, issue.column) == (str(child), "extends", 3, 10)
    assert "gpt2-smal" in issue.message
    assert "did you mean 'gpt2-small'?" in issue.message


def test_unknown_catalog_name_without_near_miss(spec_file):
    child = spec_file("specc: 1\nname: c\nextends: qqqqqqqq\n")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert "qqqqqqqq" in issue.message and "did you mean" not in issue.message


@pytest.mark.parametrize("value", ["5", '""', "[a.yaml]"], ids=["int", "empty", "list"])
def test_extends_must_be_a_name_or_path(value, spec_file):
    child = spec_file(f"specc: 1\nname: c\nextends: {value}\n")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert (issue.key, issue.line, issue.column) == ("extends", 3, 10)


def test_parse_error_in_parent_is_located_there_and_mentions_the_child(spec_file):
    parent = spec_file("specc: 1\nname: p\nvocab: [1, 2\n", "lib/parent.yaml")
    child = spec_file("specc: 1\nname: c\nextends: lib/parent.yaml\n", "child.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert Path(issue.file).resolve() == parent.resolve()
    assert issue.line is not None
    assert str(child) in issue.message


def test_validation_error_in_parent_is_located_there(spec_file, position_of):
    parent_text = PARENT.replace("  type_size: 2\n", "  type_sise: 2\n")
    parent = spec_file(parent_text, "lib/parent.yaml")
    child = spec_file("specc: 1\nname: c\nextends: lib/parent.yaml\n", "child.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert issue.key == "vocab.type_sise"
    assert Path(issue.file).resolve() == parent.resolve()
    assert (issue.line, issue.column) == position_of(parent_text, "type_sise")


def test_validation_error_in_parent_mentions_the_child(spec_file):
    """Not only parse errors: a validation issue located in a parent names the child too."""
    spec_file(PARENT.replace("  type_size: 2\n", "  type_sise: 2\n"), "lib/parent.yaml")
    child = spec_file("specc: 1\nname: c\nextends: lib/parent.yaml\n", "child.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert "child.yaml" in issue.message


def test_rule_error_caused_by_the_child_is_located_in_the_child(spec_file, position_of):
    spec_file(PARENT, "parent.yaml")
    text = "specc: 1\nname: c\nextends: parent.yaml\ndecoder:\n  attention:\n    kv_heads: 3\n"
    child = spec_file(text, "child.yaml")
    with pytest.raises(SpecError) as info:
        load_spec(child)
    [issue] = info.value.issues
    assert issue.key == "decoder.attention.kv_heads"
    assert issue.file == str(child)
    assert (issue.line, issue.column) == position_of(text, "kv_heads: ^3")
