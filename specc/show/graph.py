"""`specc graph`: the architecture drawn from the resolved spec, the way papers draw it.

The diagram is built as DOT with the `graphviz` package and rendered by graphviz's `dot`
program. Each stack is a cluster labelled "×N" holding one expanded layer, its first (the label
lists the layers a stack's `overrides` configure apart, and how): its sublayers in the order the norm
placement gives (post: sublayer, Add, Norm; pre: Norm, sublayer, Add; sandwich: Norm,
sublayer, Norm, Add; sublayer_output: sublayer, Norm, Add; parallel layers: one Norm or two, attention and feed-forward side by
side into one Add), with the residual paths dashed. Node names are stable (`encoder_attn`,
`decoder_cross`, `decoder_ffn`, `encoder_out`, `out_logits`, ...) so that `--diff` can
highlight them and tests can read the structure.
"""
from __future__ import annotations

import shutil
from pathlib import Path

import graphviz

from specc.errors import SpeccError
from specc.fileio import write_atomic
from specc.show.diff import differences, highlighted_nodes
from specc.spec.resolve import ResolvedAttention, ResolvedSpec

FORMATS = ("svg", "png", "dot")
INSTALL_HINT = ("install graphviz (its `dot` program): apt-get install graphviz / brew install graphviz / "
                "conda install graphviz (or write DOT source with -o FILE.dot)")
HIGHLIGHT = "#ffd27f"

_ACT = {"relu": "ReLU", "gelu": "GELU", "gelu_tanh": "GELU (tanh)", "silu": "SiLU", "swiglu": "SwiGLU", "geglu": "GeGLU",
        "geglu_tanh": "GeGLU (tanh)", "clamped_swiglu": "clamped SwiGLU"}
_SCORE = {"scaled_dot": "scaled dot-product", "dot": "dot-product", "bilinear": "bilinear", "additive": "additive"}


class GraphError(SpeccError):
    pass


def _pattern(p) -> str:
    if p.kind == "full":
        return "full"
    if p.kind == "local":
        return f"local, window {p.window}"
    if p.kind == "linformer":
        return f"linformer, k {p.k}"
    if p.kind == "bigbird":
        return f"bigbird, block {p.block}, window {p.window}, global {p.global_}, random {p.random}"
    return p.kind


def attention_label(a: ResolvedAttention, title: str) -> str:
    if a.kind == "latent":
        return _latent_label(a, title)
    heads = f"{a.heads} heads" + (f", {a.kv_heads} kv heads" if a.kv_heads != a.heads else "")
    lines = [
        title,
        f"{_SCORE[a.score]}, {heads}",
        f"d_k {a.d_k}, d_v {a.d_v}",
        f"pattern: {_pattern(a.pattern)}" + (", causal" if a.causal else ""),
        f"merge: {a.merge}" + (", shared K=V" if a.share_kv else ""),
    ]
    if a.rotary_dims:
        lines.append(f"rotary on {a.rotary_dims} of {a.d_k} dims")
    if a.sinks:
        lines.append("learned sink logit per head")
    return "\n".join(lines)


def _latent_label(a: ResolvedAttention, title: str) -> str:
    """Multi-head latent attention: its ranks, what it caches."""
    lines = [
        title.replace("multi-head", "multi-head latent"),
        f"{a.heads} heads, d_k {a.d_k} (rotary {a.rotary_dims}), d_v {a.d_v}",
        ("q direct" if a.q_rank is None else f"q rank {a.q_rank}") + f", kv rank {a.kv_rank}",
        f"caches latent {a.kv_rank} + rotary key {a.rotary_dims} per token",
        f"pattern: {_pattern(a.pattern)}" + (", causal" if a.causal else ""),
    ]
    if a.sinks:
        lines.append("learned sink logit per head")
    return "\n".join(lines)


def ffn_label(f) -> str:
    """A dense FFN's label, or a mixture of routed experts' (router, shared expert)."""
    if f.kind == "dense":
        return f"feed-forward\n{_ACT[f.activation]}, d_ff {f.d_ff}\n{'with' if f.bias else 'no'} bias"
    r = f.router
    router = {"softmax": "softmax, then top-k", "top_k_softmax": "top-k, then softmax", "sigmoid": "sigmoid scores",
              "sparsemixer": "sparsemixer"}[r.kind]
    extras = [x for x in (
        "bias" if r.bias else "",
        "selection bias" if getattr(r, "selection_bias", False) else "",
        f"{r.top_groups} of {r.groups} groups" if getattr(r, "groups", None) else "",
        "renormalised" if getattr(r, "normalize", False) else "",
        f"x{r.scale:g}" if getattr(r, "scale", 1.0) != 1.0 else "",
    ) if x]
    lines = [f"mixture of experts: top-{f.top_k} of {f.experts}",
             f"{_ACT[f.activation]}, d_ff {f.d_ff} each, {'with' if f.bias else 'no'} bias",
             f"router: {router}" + (f" ({', '.join(extras)})" if extras else "")]
    if f.shared is not None:
        lines.append(f"+ shared expert d_ff {f.shared.d_ff}" + (", sigmoid gate" if f.shared.gate else ""))
    return "\n".join(lines)


def _norm_label(r: ResolvedSpec) -> str:
    return {"layernorm": "LayerNorm", "rmsnorm": "RMSNorm"}[r.norm.kind]


def _position_label(r: ResolvedSpec) -> str:
    p = r.position
    extra = {
        "sinusoidal": f"sinusoidal ({p.layout if hasattr(p, 'layout') else ''})",
        "learned": "learned",
        "relative": f"relative (clip {getattr(p, 'clip', '')}{', values' if getattr(p, 'values', False) else ''})",
        "rotary": f"rotary (base {getattr(p, 'base', '')}, fraction {getattr(p, 'fraction', '')}"
                  f"{_scaling(p.scaling) if p.kind == 'rotary' and p.scaling.kind != 'none' else ''})",
        "alibi": "ALiBi",
        "bucketed": f"bucketed (T5: {getattr(p, 'buckets', '')} buckets to {getattr(p, 'max_distance', '')})",
    }.get(p.kind, p.kind)
    return f"positions: {extra}\nmax length {p.max_length}"


def _scaling(sc) -> str:
    """", scaled: linear x8" (a rotary scaling's kind and factor, where it has one)."""
    factor = getattr(sc, "factor", None)
    return f", scaled: {sc.kind}" + (f" x{factor:g}" if factor is not None else "")


def _apart(st) -> str:
    """The stack's layers configured apart from its first (overrides), one line per kind:
    "layers 5, 11, 17: full attention, rotary base 1e+06"."""
    first, first_ffn = st.layers[0].attention, st.layers[0].ffn
    kinds: dict[str, list[int]] = {}
    for layer in st.layers[1:]:
        a, f = layer.attention, layer.ffn
        parts = ([f"{a.pattern.kind} attention"] if a.pattern != first.pattern else []) + (
            [f"rotary base {a.rotary_base:g}"] if a.rotary_base != first.rotary_base else []) + (
            [_scaling(a.rotary_scaling).lstrip(", ")] if a.rotary_scaling != first.rotary_scaling else []) + (
            [_ffn_short(f)] if f != first_ffn else [])
        if parts:
            kinds.setdefault(", ".join(parts), []).append(layer.index)
    return "".join(f"\nlayers {', '.join(map(str, idx))}: {what}" for what, idx in kinds.items())


def _ffn_short(f) -> str:
    """"dense FFN d_ff 18432" or "top-8 of 256 experts" (a layer's FFN where it differs from the first's)."""
    return f"dense FFN d_ff {f.d_ff}" if f.kind == "dense" else f"top-{f.top_k} of {f.experts} experts, d_ff {f.d_ff}"


def _output_label(r: ResolvedSpec, o) -> str:
    lines = [o.name, o.kind]
    if o.kind in ("lm", "mlm"):
        lines.append(f"Linear d_model → {r.target_vocab_size}" + (" (tied to embedding)" if r.tie_output else ""))
    if hasattr(o, "classes"):
        lines.append(f"{o.classes} classes")
    if hasattr(o, "pool"):
        lines.append(f"pool: {o.pool}" + (f", {o.pooler}" if getattr(o, "pooler", None) else ""))
    return "\n".join(lines)


class _Builder:
    def __init__(self, r: ResolvedSpec, highlight: set[str], title: str | None):
        self.r = r
        self.hl = highlight
        self.g = graphviz.Digraph(r.name, graph_attr={"rankdir": "BT", "fontname": "Helvetica", "label": title or r.name,
                                                      "labelloc": "t", "newrank": "true"},
                                  node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "white",
                                             "fontname": "Helvetica", "fontsize": "10"},
                                  edge_attr={"fontname": "Helvetica", "fontsize": "9"})

    def node(self, g, name: str, label: str, fill: str = "white", **attrs) -> str:
        if name in self.hl or (name.startswith("out_") and "outputs" in self.hl):
            fill, attrs["penwidth"] = HIGHLIGHT, "2"
        g.node(name, label, fillcolor=fill, **attrs)
        return name

    def sublayer(self, g, role: str, key: str, label: str, fill: str, cur: str) -> str:
        """One sublayer with its norms and residual, in the placement's order; returns its output node."""
        place, norm = self.r.norm.placement, _norm_label(self.r)
        x = cur
        if place in ("pre", "sandwich"):
            cur = self.edge_to(cur, self.node(g, f"{role}_{key}_norm", norm, "#f0f0f0"))
        cur = self.edge_to(cur, self.node(g, f"{role}_{key}", label, fill))
        if place == "sandwich":
            cur = self.edge_to(cur, self.node(g, f"{role}_{key}_norm2", norm, "#f0f0f0"))
        if place == "sublayer_output":
            cur = self.edge_to(cur, self.node(g, f"{role}_{key}_norm", norm, "#f0f0f0"))
        add = self.node(g, f"{role}_{key}_add", "Add", "#f0f0f0", shape="circle")
        self.edge_to(cur, add)
        self.g.edge(x, add, style="dashed", color="#777777", tooltip="residual")
        cur = add
        if place == "post":
            cur = self.edge_to(cur, self.node(g, f"{role}_{key}_norm", norm, "#f0f0f0"))
        return cur

    def parallel(self, g, role: str, attn: str, ffn: str, norms: str, cur: str) -> str:
        """Attention and feed-forward side by side from one norm or two, summed with the residual."""
        norm, x = _norm_label(self.r), cur
        a_in = self.edge_to(cur, self.node(g, f"{role}_attn_norm", norm, "#f0f0f0"))
        f_in = a_in if norms == "one_norm" else self.edge_to(cur, self.node(g, f"{role}_ffn_norm", norm, "#f0f0f0"))
        add = self.node(g, f"{role}_parallel_add", "Add", "#f0f0f0", shape="circle")
        self.edge_to(self.edge_to(a_in, self.node(g, f"{role}_attn", attn, "#fff1c1")), add)
        self.edge_to(self.edge_to(f_in, self.node(g, f"{role}_ffn", ffn, "#dbe9f6")), add)
        self.g.edge(x, add, style="dashed", color="#777777", tooltip="residual")
        return add

    def edge_to(self, a: str, b: str, **attrs) -> str:
        self.g.edge(a, b, **attrs)
        return b

    def embed(self, role: str, vocab: int) -> str:
        r, v = self.r, self.r.vocab
        src = {"encoder": "source tokens", "decoder": "target tokens" if r.architecture == "encoder-decoder" else "tokens"}[role]
        inp = self.node(self.g, f"{role}_input", src, "#ffffff", shape="plaintext")
        lines = ["token embedding", f"{vocab} × {r.d_model}"]
        if v.type_size:
            lines.append(f"+ token types ({v.type_size})")
        if v.scale == "sqrt_d_model":
            lines.append("× √d_model")
        if v.share and r.architecture == "encoder-decoder" and role == "decoder":
            lines.append("shared with encoder")
        if v.norm:
            lines.append(f"then {_norm_label(r)}")
        cur = self.edge_to(inp, self.node(self.g, f"{role}_embed", "\n".join(lines), "#fde2e4"))
        if r.position.kind in ("sinusoidal", "learned"):
            pos = self.node(self.g, f"{role}_pos", _position_label(r), "#e2ece9", shape="ellipse")
            add = self.node(self.g, f"{role}_embed_add", "+", "#f0f0f0", shape="circle")
            self.g.edge(cur, add)
            self.g.edge(pos, add)
            cur = add
        return cur

    def stack(self, role: str, cur: str) -> str:
        r, st = self.r, self.r.stack(role)
        layer = st.layers[0]
        n = len(st.layers)
        with self.g.subgraph(name=f"cluster_{role}") as c:
            hl = f"{role}_layers" in self.hl
            c.attr(label=f"{role} layer ×{n}" + _apart(st), labeljust="r", style="rounded,filled",
                   fillcolor=HIGHLIGHT if hl else "#f7f7fb", color="#999999", penwidth="2" if hl else "1")
            title = "masked multi-head self-attention" if layer.attention.causal else "multi-head self-attention"
            attn = attention_label(layer.attention, title)
            ffn = ffn_label(layer.ffn)
            if layer.parallel != "none":
                cur = self.parallel(c, role, attn, ffn, layer.parallel, cur)
            else:
                cur = self.sublayer(c, role, "attn", attn, "#fff1c1", cur)
                if layer.cross_attention is not None:
                    cur = self.sublayer(c, role, "cross", attention_label(layer.cross_attention, "multi-head cross-attention"),
                                        "#fff1c1", cur)
                cur = self.sublayer(c, role, "ffn", ffn, "#dbe9f6", cur)
        if r.position.kind in ("rotary", "alibi", "relative", "bucketed"):
            pos = self.node(self.g, f"{role}_pos", _position_label(r), "#e2ece9", shape="ellipse")
            self.g.edge(pos, f"{role}_attn", style="dotted", label="in scores" if r.position.kind != "rotary" else "rotates q, k")
        if st.final_norm:
            cur = self.edge_to(cur, self.node(self.g, f"{role}_final_norm", f"final {_norm_label(r)}", "#f0f0f0"))
        out = self.node(self.g, f"{role}_out", f"{role} output", "white", shape="plaintext")
        return self.edge_to(cur, out)

    def build(self) -> graphviz.Digraph:
        r = self.r
        enc_out = None
        if r.encoder is not None:
            enc_out = self.stack("encoder", self.embed("encoder", r.encoder.vocab_size))
        last = enc_out
        if r.decoder is not None:
            last = self.stack("decoder", self.embed("decoder", r.decoder.vocab_size))
            if enc_out is not None and r.decoder.layers[0].cross_attention is not None:
                self.g.edge(enc_out, "decoder_cross", label="keys, values", color="#c0392b", penwidth="1.5",
                            constraint="false")
        for o in r.outputs:
            self.g.edge(last, self.node(self.g, f"out_{o.name}", _output_label(r, o), "#e8e0f5"))
        return self.g


def build_graph(r: ResolvedSpec, highlight: set[str] | None = None, title: str | None = None) -> graphviz.Digraph:
    """The architecture diagram of `r` as a graphviz Digraph; nodes named in `highlight` are
    filled in the highlight colour (and `<role>_layers` highlights a stack's cluster)."""
    return _Builder(r, set(highlight or ()), title).build()


def build_diff_graph(a: ResolvedSpec, b: ResolvedSpec) -> graphviz.Digraph:
    """B's diagram with the parts whose fields differ from A highlighted, and the differing
    fields listed under the title."""
    diffs = differences(a, b)
    lines = [f"{b.name} against {a.name}"]
    lines += [f"{d['key']}: {d['a']} → {d['b']}" for d in diffs] or ["no differences"]
    return build_graph(b, highlighted_nodes(diffs), title="\n".join(lines))


def write(g: graphviz.Digraph, out: str) -> str:
    """Write the diagram to `out` (.svg, .png or .dot), atomically (no half-written file)."""
    path = Path(out)
    fmt = path.suffix.lower().lstrip(".")
    if fmt not in FORMATS:
        raise ValueError(f"{out}: unknown extension {path.suffix or '(none)'} (use .svg, .png or .dot)")
    if fmt == "dot":
        data = g.source.encode()
    else:
        if shutil.which("dot") is None:
            raise GraphError(f"cannot render {path.name}: graphviz's `dot` program is not on PATH; {INSTALL_HINT}")
        try:
            data = g.pipe(format=fmt)
        except graphviz.ExecutableNotFound as exc:
            raise GraphError(f"cannot render {path.name}: {INSTALL_HINT}") from exc
        except graphviz.CalledProcessError as exc:
            raise GraphError(f"dot failed rendering {path.name}: {exc.stderr.decode(errors='replace').strip()}") from exc
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise GraphError(f"{out}: directory {parent} does not exist")
    return str(write_atomic(path, data))
