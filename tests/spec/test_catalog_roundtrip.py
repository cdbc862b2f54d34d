"""The catalog (specs/*.yaml): every spec validates and resolves, the explicit form survives a YAML
round trip, and each resolved graph has the inputs and outputs named in the design."""
from __future__ import annotations

import pytest

from specc.spec import catalog_dir, catalog_names, load_spec, loads_spec, resolve
from specc.spec.dump import spec_to_data, spec_to_yaml
from specc.spec.resolve import explicit

NAMES = catalog_names()


def _no_provenance(resolved):
    return resolved.model_copy(update={"source": None, "weights_path": None})


def test_catalog_is_found():
    assert catalog_dir().is_dir()
    for name in ("tiny-gpt2", "tiny-bert", "tiny-transformer", "tiny-llama", "gpt2-small", "transformer-base"):
        assert name in NAMES


@pytest.mark.parametrize("name", NAMES)
def test_catalog_spec_round_trips(name):
    spec = load_spec(name)
    full = explicit(spec)
    text = spec_to_yaml(full)
    again = loads_spec(text)
    assert again == full
    assert spec_to_data(again) == spec_to_data(full)
    # explicit is a fixed point, and resolution sees no difference
    assert explicit(again) == full
    assert _no_provenance(resolve(again)) == _no_provenance(resolve(full))
    assert _no_provenance(resolve(spec)) == _no_provenance(resolve(again))


@pytest.mark.parametrize("name", NAMES)
def test_catalog_spec_is_fully_explicit(name):
    """Every optional field the resolver fills is filled."""
    full = resolve(load_spec(name)).spec
    assert full.extends is None
    assert full.outputs
    assert full.norm.final in (True, False)
    for stack in (full.encoder, full.decoder):
        if stack is None:
            continue
        for att in (stack.attention, stack.cross_attention):
            if att is not None:
                assert None not in (att.d_k, att.d_v, att.kv_heads)


@pytest.mark.parametrize("name", NAMES)
def test_catalog_spec_loads_by_path_and_by_name_alike(name):
    assert load_spec(name) == load_spec(catalog_dir() / f"{name}.yaml")


def _names(tensors):
    return [t.name for t in tensors]


def test_tiny_gpt2_graph():
    r = resolve(load_spec("tiny-gpt2"))
    [g] = r.graphs
    assert g.name == "model"
    assert _names(g.inputs) == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "past_key_values.0.key",
        "past_key_values.0.value",
        "past_key_values.1.key",
        "past_key_values.1.value",
    ]
    assert _names(g.outputs) == ["logits", "present.0.key", "present.0.value", "present.1.key", "present.1.value"]
    assert g.input("past_key_values.0.key").dims == ("batch", 4, "past_sequence", 16)
    assert g.input("attention_mask").dims == ("batch", "total_sequence")
    assert g.outputs[0].dims == ("batch", "sequence", 1000)
    assert g.input("input_ids").dtype == "int64"


def test_tiny_llama_graph_caches_kv_heads():
    r = resolve(load_spec("tiny-llama"))
    [g] = r.graphs
    assert "position_ids" in _names(g.inputs)
    assert g.input("past_key_values.0.key").dims == ("batch", 2, "past_sequence", 16)
    assert r.decoder.layers[0].attention.rotary_dims == 16


def test_tiny_bert_graph():
    r = resolve(load_spec("tiny-bert"))
    [g] = r.graphs
    assert _names(g.inputs) == ["input_ids", "attention_mask", "token_type_ids"]
    assert _names(g.outputs) == ["last_hidden_state", "pooler_output"]
    assert g.outputs[0].dims == ("batch", "sequence", 64)
    assert g.outputs[1].dims == ("batch", 64)
    assert not any(n.startswith("past_key_values") for n in _names(g.inputs))


@pytest.mark.parametrize("name", ["tiny-transformer", "tiny-shaw-relative"])
def test_encoder_decoder_graphs(name):
    r = resolve(load_spec(name))
    assert [g.name for g in r.graphs] == ["encoder", "decoder"]
    enc, dec = r.graph("encoder"), r.graph("decoder")
    assert _names(enc.inputs) == ["input_ids", "attention_mask"]
    assert _names(enc.outputs) == [
        "last_hidden_state",
        "present.0.encoder.key",
        "present.0.encoder.value",
        "present.1.encoder.key",
        "present.1.encoder.value",
    ]
    names = _names(dec.inputs)
    assert names[:2] == ["input_ids", "encoder_attention_mask"]
    for i in (0, 1):
        for part in ("decoder", "encoder"):
            for which in ("key", "value"):
                assert f"past_key_values.{i}.{part}.{which}" in names
    assert _names(dec.outputs)[0] == "logits"
    assert "present.1.decoder.value" in _names(dec.outputs)
    assert r.encoder is not None and r.decoder is not None
    assert len(r.encoder.layers) == 2 and len(r.decoder.layers) == 2
    assert all(layer.cross_attention is not None for layer in r.decoder.layers)
