"""`specc graph`: the diagram's structure (read from its DOT source), rendering with dot, the
dot-missing error and usage errors."""
from __future__ import annotations

import re
import shutil
import xml.etree.ElementTree as ET

import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.show.graph import build_diff_graph, build_graph

HAS_DOT = shutil.which("dot") is not None


def run(*args):
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert "Traceback" not in result.output
    return result


def parse(source: str):
    """(nodes: name -> attribute text, edges: (a, b) -> attribute text, clusters: name -> body)."""
    nodes, edges = {}, {}
    for m in re.finditer(r"^\s*(\w+) -> (\w+)(?: \[(.*?)\])?$", source, flags=re.M | re.S):
        edges[(m.group(1), m.group(2))] = m.group(3) or ""
    for m in re.finditer(r'^\s*(\w+) \[(label=(?:"[^"]*"|\S+).*?)\]$', source, flags=re.M | re.S):
        nodes[m.group(1)] = m.group(2)
    clusters = dict(re.findall(r"subgraph (cluster_\w+) \{(.*?)\n\t\}", source, flags=re.S))
    return nodes, edges, clusters


def label(attrs: str) -> str:
    m = re.match(r'label=(?:"([^"]*)"|(\S+))', attrs)
    return m.group(1) if m.group(1) is not None else m.group(2)


def graph_of(name: str):
    r = specc.resolve(specc.load_spec(name))
    return r, parse(build_graph(r).source)


def chain(edges, *names):
    for a, b in zip(names, names[1:]):
        assert (a, b) in edges, f"no edge {a} -> {b}"


def test_transformer_base_post_norm_encoder_decoder():
    r, (nodes, edges, clusters) = graph_of("transformer-base")
    for role in ("encoder", "decoder"):
        assert f"label=\"{role} layer ×{len(r.stack(role).layers)}\"" in clusters[f"cluster_{role}"]
        assert len(r.stack(role).layers) == 6
        # post-norm: sublayer -> Add -> Norm, the residual from the sublayer's input into the Add
        chain(edges, f"{role}_embed_add", f"{role}_attn", f"{role}_attn_add", f"{role}_attn_norm")
        assert "dashed" in edges[(f"{role}_embed_add", f"{role}_attn_add")]
        chain(edges, f"{role}_ffn", f"{role}_ffn_add", f"{role}_ffn_norm", f"{role}_out")
        assert f"{role}_final_norm" not in nodes  # post-norm: no final norm
        assert ("{}_pos".format(role), f"{role}_embed_add") in edges  # sinusoidal positions are added
        assert "sinusoidal" in label(nodes[f"{role}_pos"])
    chain(edges, "decoder_attn_norm", "decoder_cross", "decoder_cross_add", "decoder_cross_norm", "decoder_ffn")
    assert "dashed" in edges[("decoder_attn_norm", "decoder_cross_add")]
    # cross-attention: the encoder's output feeds the decoder's cross-attention
    assert "keys, values" in edges[("encoder_out", "decoder_cross")]
    att = label(nodes["decoder_cross"])
    assert "8 heads" in att and "d_k 64, d_v 64" in att and "kv heads" not in att
    assert "causal" in label(nodes["decoder_attn"]) and "causal" not in label(nodes["encoder_attn"])
    assert "ReLU, d_ff 2048" in label(nodes["encoder_ffn"])
    assert ("decoder_out", "out_logits") in edges
    assert "37000" in label(nodes["out_logits"]) and "tied" in label(nodes["out_logits"])
    assert "× √d_model" in label(nodes["encoder_embed"])
    # every sublayer node sits inside its stack's cluster
    for role in ("encoder", "decoder"):
        for n in ("attn", "ffn", "attn_add", "attn_norm"):
            assert re.search(rf"^\s*{role}_{n} \[", clusters[f"cluster_{role}"], flags=re.M)


def test_tiny_llama_pre_norm_rotary_grouped_swiglu():
    r, (nodes, edges, clusters) = graph_of("tiny-llama")
    a = r.decoder.layers[0].attention
    assert a.kv_heads < a.heads
    assert "encoder_embed" not in nodes and "decoder_cross" not in nodes
    # pre-norm: Norm -> sublayer -> Add, residual around both
    chain(edges, "decoder_embed", "decoder_attn_norm", "decoder_attn", "decoder_attn_add",
          "decoder_ffn_norm", "decoder_ffn", "decoder_ffn_add", "decoder_final_norm", "decoder_out", "out_logits")
    assert "dashed" in edges[("decoder_embed", "decoder_attn_add")]
    assert "dashed" in edges[("decoder_attn_add", "decoder_ffn_add")]
    assert label(nodes["decoder_attn_norm"]) == "RMSNorm" and "RMSNorm" in label(nodes["decoder_final_norm"])
    assert f"{a.heads} heads, {a.kv_heads} kv heads" in label(nodes["decoder_attn"])
    assert f"d_k {a.d_k}, d_v {a.d_v}" in label(nodes["decoder_attn"])
    assert "SwiGLU, d_ff 128" in label(nodes["decoder_ffn"])
    # rotary positions act inside attention, not as an added embedding
    assert "rotary" in label(nodes["decoder_pos"]) and ("decoder_pos", "decoder_attn") in edges
    assert "decoder_embed_add" not in nodes
    assert f"decoder layer ×{len(r.decoder.layers)}" in clusters["cluster_decoder"]


def test_bert_base_token_types_and_outputs():
    r, (nodes, edges, clusters) = graph_of("bert-base")
    assert "token types (2)" in label(nodes["encoder_embed"]) and "LayerNorm" in label(nodes["encoder_embed"])
    assert "encoder layer ×12" in clusters["cluster_encoder"]
    names = [o.name for o in r.outputs]
    assert names == ["last_hidden_state", "pooler_output"]
    for o in r.outputs:
        assert ("encoder_out", f"out_{o.name}") in edges
        assert o.kind in label(nodes[f"out_{o.name}"])
    assert "tanh" in label(nodes["out_pooler_output"])
    assert "learned" in label(nodes["encoder_pos"])


def test_sandwich_norm_order(spec_file):
    path = spec_file("""\
        specc: 1
        name: sandwich
        architecture: decoder
        d_model: 32
        vocab: {size: 50}
        position: {kind: alibi, max_length: 16}
        norm: {placement: sandwich}
        decoder: {layers: 3, attention: {heads: 2}, ffn: {d_ff: 64}}
    """)
    _, (nodes, edges, _) = graph_of(str(path))
    chain(edges, "decoder_embed", "decoder_attn_norm", "decoder_attn", "decoder_attn_norm2", "decoder_attn_add",
          "decoder_ffn_norm", "decoder_ffn", "decoder_ffn_norm2", "decoder_ffn_add")
    assert ("decoder_pos", "decoder_attn") in edges and "ALiBi" in label(nodes["decoder_pos"])


def test_sublayer_output_norm_order(spec_file):
    path = spec_file("""\
        specc: 1
        name: olmo-like
        architecture: decoder
        d_model: 32
        vocab: {size: 50}
        position: {kind: rotary, max_length: 16}
        norm: {kind: rmsnorm, placement: sublayer_output}
        decoder: {layers: 2, attention: {heads: 2}, ffn: {d_ff: 64}}
    """)
    _, (nodes, edges, _) = graph_of(str(path))
    chain(edges, "decoder_embed", "decoder_attn", "decoder_attn_norm", "decoder_attn_add", "decoder_ffn",
          "decoder_ffn_norm", "decoder_ffn_add", "decoder_final_norm")


def test_layers_configured_apart_are_named_in_the_stack_label():
    source = build_graph(specc.resolve(specc.load_spec("gemma-3-1b"))).source
    assert "decoder layer ×26\nlayers 5, 11, 17, 23: full attention, rotary base 1e+06" in source
    assert "layers 5" not in build_graph(specc.resolve(specc.load_spec("llama-style-1b"))).source


def test_rotary_scaling_is_named(spec_file):
    """Gemma 3 4B's form: the global layers' scaling in the stack label, the model's by the positions."""
    path = spec_file("""\
        specc: 1
        name: scaled
        architecture: decoder
        d_model: 32
        vocab: {size: 50}
        position: {kind: rotary, max_length: 64, scaling: {kind: yarn, factor: 4.0, original_max_length: 16}}
        decoder:
          layers: 4
          attention: {heads: 2, pattern: {kind: local, window: 3}}
          ffn: {d_ff: 64}
          overrides:
            - {every: 2, first: 1, pattern: {kind: full}, rotary_scaling: {kind: linear, factor: 8.0}}
    """)
    source = build_graph(specc.resolve(specc.load_spec(str(path)))).source
    assert "scaled: yarn x4" in source
    assert "layers 1, 3: full attention, scaled: linear x8" in source


def test_routed_experts_latent_attention_and_sinks_are_drawn(spec_file):
    """DeepSeek's shape: latent attention with what it caches, the first layer dense and the rest
    a mixture of experts (named in the stack label), the router and shared expert on the FFN; gpt-oss's
    sinks on its attention."""
    path = spec_file("""\
        specc: 1
        name: mla
        architecture: decoder
        d_model: 32
        vocab: {size: 50}
        position: {kind: rotary, layout: interleaved}
        norm: {kind: rmsnorm, placement: pre}
        decoder:
          layers: 3
          attention: {kind: latent, heads: 4, d_k: 12, rope_dims: 4, q_rank: 16, kv_rank: 8}
          ffn:
            kind: moe
            experts: 8
            top_k: 2
            d_ff: 16
            router: {kind: sigmoid, normalize: true, scale: 2.5, groups: 4, top_groups: 2}
            shared: {d_ff: 16}
          overrides: [{indices: [0], ffn: {d_ff: 64, activation: swiglu}}]
    """)
    _, (nodes, _, clusters) = graph_of(str(path))
    attn = label(nodes["decoder_attn"])
    assert "multi-head latent self-attention" in attn and "q rank 16, kv rank 8" in attn
    assert "caches latent 8 + rotary key 4 per token" in attn
    assert "layers 1, 2: top-2 of 8 experts, d_ff 16" in clusters["cluster_decoder"]
    assert "feed-forward" in label(nodes["decoder_ffn"])  # the expanded layer is the first, dense one
    r = specc.resolve(specc.load_spec(str(path)))  # drawn from its second layer: the experts
    last = r.decoder.model_copy(update={"layers": r.decoder.layers[1:]})
    nodes, _, _ = parse(build_graph(r.model_copy(update={"decoder": last})).source)
    ffn = label(nodes["decoder_ffn"])
    assert "mixture of experts: top-2 of 8" in ffn and "router: sigmoid scores (selection bias, 2 of 4 groups, " \
        "renormalised, x2.5)" in ffn and "+ shared expert d_ff 16" in ffn
    sinks = spec_file("""\
        specc: 1
        name: sinks
        architecture: decoder
        d_model: 32
        vocab: {size: 50}
        decoder: {layers: 1, attention: {heads: 2, sinks: true}, ffn: {d_ff: 64}}
    """)
    _, (nodes, _, _) = graph_of(str(sinks))
    assert "learned sink logit per head" in label(nodes["decoder_attn"])


@pytest.mark.parametrize("parallel", ["one_norm", "two_norms"])
def test_parallel_layers_side_by_side(spec_file, parallel):
    path = spec_file(f"""\
        specc: 1
        name: parallel
        architecture: decoder
        d_model: 32
        vocab: {{size: 50}}
        position: {{kind: rotary, max_length: 16}}
        norm: {{placement: pre}}
        decoder: {{layers: 2, attention: {{heads: 2}}, ffn: {{d_ff: 64}}, parallel: {parallel}}}
    """)
    _, (nodes, edges, _) = graph_of(str(path))
    chain(edges, "decoder_embed", "decoder_attn_norm", "decoder_attn", "decoder_parallel_add")
    ffn_in = "decoder_attn_norm" if parallel == "one_norm" else "decoder_ffn_norm"
    chain(edges, ffn_in, "decoder_ffn", "decoder_parallel_add")
    assert ("decoder_ffn_norm" in nodes) == (parallel == "two_norms")
    assert ("decoder_embed", "decoder_parallel_add") in edges  # the residual


def test_diff_graph_highlights_what_differs(spec_file):
    path = spec_file("""\
        specc: 1
        name: wide-ffn
        extends: transformer-base
        encoder: {ffn: {d_ff: 4096}}
    """)
    a, b = (specc.resolve(specc.load_spec(s)) for s in ("transformer-base", str(path)))
    source = build_diff_graph(a, b).source
    nodes, _, _ = parse(source)
    assert "#ffd27f" in nodes["encoder_ffn"]
    assert "#ffd27f" not in nodes["decoder_ffn"] and "#ffd27f" not in nodes["encoder_attn"]
    assert "encoder.ffn.d_ff: 2048 → 4096" in source


@pytest.mark.skipif(not HAS_DOT, reason="graphviz's dot program is not installed")
def test_renders_svg_and_png(tmp_path):
    svg, png = tmp_path / "m.svg", tmp_path / "m.png"
    r = run("graph", "tiny-transformer", "-o", svg)
    assert r.exit_code == 0, r.output
    root = ET.parse(svg).getroot()
    assert root.tag.endswith("svg")
    text = "".join(root.itertext())
    assert "multi-head cross-attention" in text and "decoder layer ×" in text
    r = run("graph", "tiny-llama", "-o", png)
    assert r.exit_code == 0, r.output
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")
    r = run("graph", "--diff", "tiny-transformer", "tiny-shaw-relative", "-o", tmp_path / "d.svg")
    assert r.exit_code == 0, r.output
    ET.parse(tmp_path / "d.svg")


def test_dot_missing_names_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "m.svg"
    r = run("graph", "tiny-transformer", "-o", out)
    assert r.exit_code == 1
    assert "apt-get install graphviz" in r.output and "brew install graphviz" in r.output
    assert not out.exists() and list(tmp_path.iterdir()) == []
    # DOT source needs no dot program
    r = run("graph", "tiny-transformer", "-o", tmp_path / "m.dot")
    assert r.exit_code == 0, r.output
    assert (tmp_path / "m.dot").read_text().startswith("digraph")


def test_usage_and_user_errors(tmp_path, spec_file):
    r = run("graph", "tiny-transformer", "-o", tmp_path / "m.pdf")
    assert r.exit_code == 2 and ".svg, .png or .dot" in r.output
    r = run("graph", "tiny-transformer", "tiny-llama", "-o", tmp_path / "m.dot")
    assert r.exit_code == 2
    r = run("graph", "--diff", "tiny-transformer", "-o", tmp_path / "m.dot")
    assert r.exit_code == 2
    bad = spec_file("specc: 1\nname: bad\narchitecture: decoder\nd_model: 32\nvocab: {size: 10}\ndecoder: {attention: {heads: 0}}\n")
    r = run("graph", bad, "-o", tmp_path / "m.dot")
    assert r.exit_code == 1 and "heads" in r.output and f"{bad}:6" in r.output
    assert not (tmp_path / "m.dot").exists()
