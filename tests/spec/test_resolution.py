"""Resolution: the defaults and derived values the resolver fills in, once."""
from __future__ import annotations

import pytest

from specc.spec import loads_spec, resolve
from specc.spec.io import cache_length, concrete_dims, empty_cache_dims, parse_window, windowed
from specc.spec.dump import spec_to_data, spec_to_yaml
from specc.spec.resolve import explicit
from specc.spec.schema import EVERY_KEY

from tests.helpers.spectext import DEC

ENC = DEC.replace("architecture: decoder", "architecture: encoder").replace("decoder:", "encoder:")

ED = """\
specc: 1
name: t
architecture: encoder-decoder
d_model: 64
vocab:
  size: 100
encoder:
  layers: 2
  attention:
    heads: 4
decoder:
  layers: 2
  attention:
    heads: 8
    kv_heads: 2
    bias: false
    pattern: {kind: local, window: 3}
"""


def test_head_dimensions_filled():
    r = resolve(loads_spec(DEC))
    att = r.spec.decoder.attention
    assert (att.d_k, att.d_v, att.kv_heads) == (16, 16, 4)
    layer = r.decoder.layers[1]
    assert layer.index == 1
    assert (layer.attention.d_k, layer.attention.d_v, layer.attention.kv_heads) == (16, 16, 4)
    assert layer.attention.causal and not layer.attention.cross


def test_explicit_head_dimensions_kept():
    r = resolve(loads_spec(DEC + "    d_k: 24\n    d_v: 12\n    kv_heads: 2\n"))
    att = r.decoder.layers[0].attention
    assert (att.d_k, att.d_v, att.kv_heads) == (24, 12, 2)


@pytest.mark.parametrize(
    "placement,final",
    [("pre", True), ("sandwich", True), ("post", False)],
)
def test_final_norm_auto(placement, final):
    r = resolve(loads_spec(DEC + f"norm: {{placement: {placement}}}\n"))
    assert r.spec.norm.final is final
    assert r.decoder.final_norm is final


@pytest.mark.parametrize("placement,final", [("pre", False), ("post", True)])
def test_final_norm_explicit_wins(placement, final):
    r = resolve(loads_spec(DEC + f"norm: {{placement: {placement}, final: {str(final).lower()}}}\n"))
    assert r.spec.norm.final is final


def test_default_output_decoder():
    r = resolve(loads_spec(DEC))
    assert [(o.name, o.kind) for o in r.outputs] == [("logits", "lm")]
    assert r.tie_output is True


def test_default_output_encoder_and_tie_off():
    r = resolve(loads_spec(ENC))
    assert [(o.name, o.kind) for o in r.outputs] == [("last_hidden_state", "hidden")]
    # tie_output's default (true) acts only where an lm / mlm output exists
    assert r.tie_output is False
    assert r.spec.vocab.tie_output is False


def test_default_output_encoder_decoder():
    r = resolve(loads_spec(ED))
    assert [(o.name, o.kind) for o in r.outputs] == [("logits", "lm")]


def test_tie_default_false_without_lm_output():
    r = resolve(loads_spec(DEC + "outputs:\n  - {name: h, kind: hidden}\n"))
    assert r.tie_output is False


def test_tie_with_mlm_output():
    r = resolve(loads_spec(ENC + "outputs:\n  - {name: logits, kind: mlm}\n"))
    assert r.tie_output is True


def test_cross_attention_null_copies_attention_with_full_pattern():
    r = resolve(loads_spec(ED))
    cross = r.spec.decoder.cross_attention
    assert cross is not None
    assert cross.pattern.kind == "full"
    assert (cross.heads, cross.kv_heads, cross.d_k, cross.d_v, cross.bias) == (8, 2, 8, 8, False)
    self_att = r.spec.decoder.attention
    assert self_att.pattern.kind == "local"  # the self-attention keeps its own pattern
    layer = r.decoder.layers[0]
    assert layer.cross_attention.cross and not layer.cross_attention.causal
    assert layer.cross_attention.pattern.kind == "full"
    # the encoder has none
    assert r.spec.encoder.cross_attention is None
    assert r.encoder.layers[0].cross_attention is None


def test_cross_attention_given_is_kept():
    r = resolve(loads_spec(ED + "  cross_attention:\n    heads: 2\n    pattern: {kind: linformer, k: 64}\n"))
    cross = r.spec.decoder.cross_attention
    assert (cross.heads, cross.d_k, cross.pattern.kind) == (2, 32, "linformer")


BIGBIRD = ENC.replace("  layers: 2\n", "  layers: 3\n") + (
    "    pattern: {kind: bigbird, block: 16, window: 1, global: 1, random: 2}\n"
)


def test_bigbird_random_blocks_are_stable_and_differ_between_layers():
    a = resolve(loads_spec(BIGBIRD))
    b = resolve(loads_spec(BIGBIRD))
    blocks_a = [layer.attention.random_blocks for layer in a.encoder.layers]
    blocks_b = [layer.attention.random_blocks for layer in b.encoder.layers]
    assert blocks_a == blocks_b
    assert len(blocks_a[0]) == 512 // 16  # one row per query block
    assert blocks_a[0] != blocks_a[1] != blocks_a[2]
    assert blocks_a[0] != blocks_a[2]
    for i, row in enumerate(blocks_a[0]):
        assert len(row) == 2
        assert i not in row and 0 not in row  # not itself, not a global block


def test_bigbird_in_a_decoder_draws_no_future_blocks():
    text = DEC + "    pattern: {kind: bigbird, block: 16, window: 1, global: 1, random: 2}\n"
    r = resolve(loads_spec(text))
    for i, row in enumerate(r.decoder.layers[0].attention.random_blocks):
        assert all(j < i for j in row)


def test_no_random_blocks_without_bigbird():
    r = resolve(loads_spec(DEC))
    assert r.decoder.layers[0].attention.random_blocks == ()


def test_dropout_number_becomes_both():
    spec = loads_spec(DEC + "dropout: 0.2\n")
    r = resolve(spec)
    assert (r.dropout.hidden, r.dropout.attention) == (0.2, 0.2)
    assert (explicit(spec).dropout.hidden, explicit(spec).dropout.attention) == (0.2, 0.2)


def test_dropout_mapping_default_fills_other():
    r = resolve(loads_spec(DEC + "dropout: {attention: 0.0}\n"))
    assert (r.dropout.hidden, r.dropout.attention) == (0.1, 0.0)


def test_rotary_fraction_dims():
    r = resolve(loads_spec(DEC + "position: {kind: rotary, fraction: 0.5}\n"))
    assert r.decoder.layers[0].attention.rotary_dims == 8


def test_position_ids_only_for_absolute_positions():
    for kind, present in [("learned", True), ("rotary", True), ("sinusoidal", True), ("alibi", False),
                          ("relative", False), ("none", False)]:
        r = resolve(loads_spec(DEC + f"position: {{kind: {kind}}}\n"))
        names = [t.name for t in r.graph("model").inputs]
        assert ("position_ids" in names) is present, kind


def test_precision_sets_float_dtypes():
    r = resolve(loads_spec(DEC + "serving: {precision: fp16}\n"))
    g = r.graph("model")
    assert g.outputs[0].dtype == "float16"
    assert g.input("past_key_values.0.key").dtype == "float16"
    assert g.input("input_ids").dtype == "int64"


def test_target_vocabulary_sizes_the_decoder():
    r = resolve(loads_spec(ED.replace("  size: 100\n", "  size: 100\n  target_size: 300\n  share: false\n")))
    assert r.encoder.vocab_size == 100
    assert r.decoder.vocab_size == 300
    assert r.graph("decoder").outputs[0].dims == ("batch", "sequence", 300)


def test_resolve_is_idempotent():
    r = resolve(loads_spec(ED))
    assert resolve(r) is r
    assert resolve(r.spec) == r


def test_sliding_layers_of_a_decoder_keep_window_caches():
    """A decoder-only model's local layers get windowed cache dims (their own length, min(W, the
    sequence)); its global layers (overrides) and an encoder-decoder's decoder keep the whole."""
    text = DEC.replace("    heads: 4\n", "    heads: 4\n    pattern: {kind: local, window: 5}\n  overrides: [{indices: [1], pattern: {kind: full}}]\n")
    r = resolve(loads_spec(text))
    g = r.graph("model")
    assert [layer.attention.cache_window for layer in r.decoder.layers] == [5, None]
    assert g.input("past_key_values.0.key").dims == ("batch", 4, "past_sequence_window5", 16)
    assert g.input("past_key_values.1.value").dims == ("batch", 4, "past_sequence", 16)
    outs = {t.name: t.dims for t in g.outputs}
    assert outs["present.0.value"][2] == "total_sequence_window5" and outs["present.1.key"][2] == "total_sequence"
    ed = resolve(loads_spec(ED))
    assert ed.decoder.layers[0].attention.cache_window is None
    assert all("window" not in str(t.dims) for t in ed.graph("decoder").inputs)


def test_window_dims_follow_from_the_dims_they_window():
    assert windowed("past_sequence", 4) == "past_sequence_window4"
    assert parse_window("total_sequence_window4") == ("total_sequence", 4)
    for other in ("past_sequence", "sequence_window4", "past_sequence_window0", "past_sequence_windowx", 4):
        assert parse_window(other) is None
    dims = ("batch", 2, "past_sequence_window4", 8)
    assert concrete_dims(dims, {"batch": 3, "past_sequence": 2}) == [3, 2, 2, 8]
    assert concrete_dims(dims, {"batch": 3, "past_sequence": 9}) == [3, 2, 4, 8]
    assert empty_cache_dims(dims, 1) == [1, 2, 0, 8]
    assert [cache_length(dims, t) for t in (1, 4, 9)] == [1, 4, 4]
    assert cache_length(("batch", 2, "past_sequence", 8), 9) == 9
    with pytest.raises(KeyError):
        concrete_dims(dims, {"batch": 3})


# --- routed experts, latent attention, sinks --------------------------------------------------

MOE = DEC.replace("  layers: 2\n", "  layers: 5\n") + """\
  ffn:
    kind: moe
    experts: 8
    top_k: 2
    d_ff: 32
    router: {kind: sigmoid, normalize: true, scale: 2.5, groups: 4, top_groups: 2}
    shared: {d_ff: 64, gate: true}
  overrides:
    - {indices: [0, 1], ffn: {d_ff: 128, activation: swiglu, bias: false}}
    - {indices: [1], pattern: {kind: local, window: 3}}
"""

LATENT = DEC.replace("    heads: 4\n", "    kind: latent\n    heads: 4\n    d_k: 24\n    d_v: 16\n    rope_dims: 8\n"
                                     "    q_rank: 32\n    kv_rank: 12\n    sinks: true\n") + (
    "  overrides: [{indices: [1], pattern: {kind: local, window: 3}}]\nposition: {kind: rotary, layout: interleaved}\n")


def test_an_override_gives_its_layers_their_own_ffn_and_attention_apart():
    """DeepSeek's first dense layers: an override's `ffn` replaces the stack's whole for the layers
    it chooses; another override may choose one of them for its attention."""
    r = resolve(loads_spec(MOE))
    kinds = [layer.ffn.kind for layer in r.decoder.layers]
    assert kinds == ["dense", "dense", "moe", "moe", "moe"]
    assert r.decoder.layers[0].ffn.d_ff == 128 and r.decoder.layers[2].ffn.d_ff == 32
    assert [layer.attention.pattern.kind for layer in r.decoder.layers] == ["full", "local", "full", "full", "full"]
    moe = r.decoder.layers[4].ffn
    assert (moe.experts, moe.top_k, moe.router.kind, moe.router.group_score, moe.shared.gate) == (8, 2, "sigmoid", "top2_sum", True)


def test_latent_attention_caches_its_latent_and_rotary_key():
    """[batch, 1, length, kv_rank] and [batch, 1, length, rope_dims] in place of each head's keys
    and values, windowed as any cache on a local layer."""
    r = resolve(loads_spec(LATENT))
    a = r.decoder.layers[0].attention
    assert (a.kind, a.heads, a.kv_heads, a.d_k, a.d_v, a.rotary_dims, a.q_rank, a.kv_rank, a.sinks) == (
        "latent", 4, 4, 24, 16, 8, 32, 12, True)
    g = r.graph("model")
    names = [t.name for t in g.inputs if t.name.startswith("past_key_values")]
    assert names == ["past_key_values.0.latent", "past_key_values.0.rope_key",
                     "past_key_values.1.latent", "past_key_values.1.rope_key"]
    assert g.input("past_key_values.0.latent").dims == ("batch", 1, "past_sequence", 12)
    assert g.input("past_key_values.1.rope_key").dims == ("batch", 1, "past_sequence_window3", 8)
    outs = {t.name: t.dims for t in g.outputs}
    assert outs["present.1.latent"] == ("batch", 1, "total_sequence_window3", 12)
    assert r.cache_pair == ("latent", "rope_key")
    assert resolve(loads_spec(DEC)).cache_pair == ("key", "value")


def test_latent_cache_names_parse_and_pair():
    from specc.spec.io import cache_slots, layer_pasts, layer_presents, parse_cache, present_to_past

    assert parse_cache("past_key_values.3.latent")[1].which == "latent"
    assert parse_cache("present.0.rope_key")[0] == "present"
    assert parse_cache("present.0.rope") is None
    pair = ("latent", "rope_key")
    assert [s.past for s in cache_slots(1, pair=pair)] == ["past_key_values.0.latent", "past_key_values.0.rope_key"]
    presents = layer_presents([("l0", "r0"), ("l1", "r1")], pair=pair)
    assert list(presents) == ["present.0.latent", "present.0.rope_key", "present.1.latent", "present.1.rope_key"]
    assert layer_pasts(present_to_past(presents), 2, pair=pair) == [("l0", "r0"), ("l1", "r1")]
    assert layer_pasts(present_to_past(presents), 2) is None  # no key / value there


def test_new_kinds_resolve_to_an_explicit_form_that_loads_back():
    for text in (MOE, LATENT):
        full = explicit(loads_spec(text))
        assert loads_spec(spec_to_yaml(full)) == full
        assert explicit(full) == full


def test_keys_new_to_the_language_are_written_only_where_they_are_used():
    """`specc resolve` of a spec that uses none of them prints what it printed before they
    existed (and a build's cache key is what it was); one that uses them shows them."""
    plain = spec_to_data(explicit(loads_spec(DEC + "  overrides: [{indices: [1], pattern: {kind: full}}]\n")))
    assert "kind" not in plain["decoder"]["attention"] and "sinks" not in plain["decoder"]["attention"]
    assert "kind" not in plain["decoder"]["ffn"] and "ffn" not in plain["decoder"]["overrides"][0]
    every = explicit(loads_spec(DEC)).model_dump(context=EVERY_KEY)
    assert every["decoder"]["ffn"]["kind"] == "dense" and every["decoder"]["attention"]["sinks"] is False
    used = spec_to_data(explicit(loads_spec(MOE.replace("    heads: 4\n", "    heads: 4\n    sinks: true\n"))))
    assert used["decoder"]["ffn"]["kind"] == "moe" and used["decoder"]["attention"]["sinks"] is True
    assert used["decoder"]["overrides"][0]["ffn"]["d_ff"] == 128
