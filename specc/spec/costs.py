"""What a model costs, from the resolved spec alone (no torch, no allocation): parameters in total
and by component, FLOPs per token, KV-cache bytes per token, weight bytes per precision, and a
per-layer table.

`parameter_shapes()` is the parameter-name contract of docs/weights.md written as data; a test
checks it against the compiled module's own parameters for every kind, so the counts here are the
module's counts exactly. Tied and shared tables exist once, so they are counted once.

FLOPs convention (a multiply-add is 2 FLOPs; what a dense implementation computes per token of a
forward pass over N tokens): 2 x every weight matrix a token passes through, plus attention's
2 x H x (Dk + Dv) per key seen (N for full attention, at most 2w+1 for local, the window plus the
global and random blocks for BigBird, k for Linformer, the source length N for cross-attention).
Embedding lookups, norms, activations and softmax are not counted (Kaplan et al. 2020's convention).
A token passes through the top_k routed experts its router chooses, not the others: their FLOPs
are top_k / experts of the experts' weights, twice.

Active parameters: what one token reads, every parameter but the routed experts its router does
not choose (top_k of each layer's experts are; the embedding tables count whole, as Mixtral's and
Qwen's model cards count them). A model without routed experts has them all active.
"""
from __future__ import annotations

from collections import OrderedDict

from specc.spec.resolve import ResolvedAttention, ResolvedSpec
from specc.spec.schema import GATED_ACTIVATIONS, NormSpec
from specc.spec.targets import PRECISIONS

BYTES = {name: p.weight_bytes for name, p in PRECISIONS.items()}  # bytes per weight, per precision (packed, for int8 and int4)


def _linear(prefix: str, n_in: int, n_out: int, bias: bool) -> dict:
    out = {f"{prefix}.weight": (n_out, n_in)}
    if bias:
        out[f"{prefix}.bias"] = (n_out,)
    return out


def _norm(prefix: str, norm: NormSpec, d: int) -> dict:
    out = {f"{prefix}.weight": (d,)}
    if norm.kind == "layernorm" and norm.bias:
        out[f"{prefix}.bias"] = (d,)
    return out


def _latent_attention(prefix: str, a: ResolvedAttention, r: ResolvedSpec) -> dict:
    d, h, dr = r.d_model, a.heads, a.rotary_dims
    out = {}
    if a.q_rank is None:
        out.update(_linear(f"{prefix}.q", d, h * a.d_k, False))
    else:
        out.update(_linear(f"{prefix}.q_a", d, a.q_rank, a.bias))
        out[f"{prefix}.q_a_norm.weight"] = (a.q_rank,)
        out.update(_linear(f"{prefix}.q_b", a.q_rank, h * a.d_k, False))
    out.update(_linear(f"{prefix}.kv_a", d, a.kv_rank + dr, a.bias))
    out[f"{prefix}.kv_a_norm.weight"] = (a.kv_rank,)
    out.update(_linear(f"{prefix}.kv_b", a.kv_rank, h * (a.d_k - dr + a.d_v), False))
    out.update(_linear(f"{prefix}.o", h * a.d_v, d, a.output_bias))
    return out


def _attention(prefix: str, a: ResolvedAttention, r: ResolvedSpec) -> dict:
    d = r.d_model
    out = {}
    if a.sinks:
        out[f"{prefix}.sinks"] = (a.heads,)
    if a.kind == "latent":
        out.update(_latent_attention(prefix, a, r))
        return out
    out.update(_linear(f"{prefix}.q", d, a.heads * a.d_k, a.bias))
    out.update(_linear(f"{prefix}.k", d, a.kv_heads * a.d_k, a.bias))
    if not a.share_kv:
        out.update(_linear(f"{prefix}.v", d, a.kv_heads * a.d_v, a.bias))
    if a.merge == "project":
        out.update(_linear(f"{prefix}.o", a.heads * a.d_v, d, a.output_bias))
    if a.qk_norm != "none":  # over each head's d_k, or over all heads' at once
        out.update(_norm(f"{prefix}.q_norm", r.norm, a.d_k if a.qk_norm == "head" else a.heads * a.d_k))
        out.update(_norm(f"{prefix}.k_norm", r.norm, a.d_k if a.qk_norm == "head" else a.kv_heads * a.d_k))
    if a.score == "bilinear":
        out[f"{prefix}.score_w"] = (a.heads, a.d_k, a.d_k)
    elif a.score == "additive":
        out[f"{prefix}.score_w"] = (a.heads, a.d_k)
    if r.position.kind == "relative" and not a.cross:
        rows = 2 * r.position.clip + 1
        out[f"{prefix}.rel_k.weight"] = (rows, a.d_k)
        if r.position.values:
            out[f"{prefix}.rel_v.weight"] = (rows, a.d_v)
    if a.pattern.kind == "linformer":
        out[f"{prefix}.proj_k"] = (a.pattern.k, r.position.max_length)
        out[f"{prefix}.proj_v"] = (a.pattern.k, r.position.max_length)
    return out


def parameter_shapes(r: ResolvedSpec) -> "OrderedDict[str, tuple[int, ...]]":
    """Every parameter's name and shape, as the compiled module has them."""
    d, v, norm = r.d_model, r.vocab, r.norm
    out: OrderedDict = OrderedDict()
    out["embeddings.tokens.weight"] = (v.size, d)
    if r.architecture == "encoder-decoder" and not v.share:
        out["embeddings.target_tokens.weight"] = (r.target_vocab_size, d)
    if v.type_size:
        out["embeddings.types.weight"] = (v.type_size, d)
    for stack in (r.encoder, r.decoder):
        if stack is None:
            continue
        s = stack.role
        if r.position.kind == "learned":
            out[f"{s}.positions.weight"] = (r.position.max_length, d)
        if r.position.kind == "bucketed":
            out[f"{s}.relative_bias.weight"] = (r.position.buckets, stack.layers[0].attention.heads)
        if v.norm:
            out.update(_norm(f"{s}.embed_norm", norm, d))
        for layer in stack.layers:
            p = f"{s}.layers.{layer.index}"
            subs = [("attention", layer.attention)]
            if layer.cross_attention is not None:
                subs.append(("cross_attention", layer.cross_attention))
            for name, att in subs:
                out.update(_attention(f"{p}.{name}", att, r))
                out.update(_norm(f"{p}.{name}_norm", norm, d))
                if norm.placement == "sandwich":
                    out.update(_norm(f"{p}.{name}_post_norm", norm, d))
            out.update(_ffn(f"{p}.ffn", layer.ffn, d))
            if layer.parallel != "one_norm":
                out.update(_norm(f"{p}.ffn_norm", norm, d))
            if norm.placement == "sandwich":
                out.update(_norm(f"{p}.ffn_post_norm", norm, d))
        if stack.final_norm:
            out.update(_norm(f"{s}.final_norm", norm, d))
    vocab = r.output_vocab_size
    for o in r.outputs:
        h = f"heads.{o.name}"
        if o.kind in ("lm", "mlm") and not r.tie_output:
            out[f"{h}.proj.weight"] = (vocab, d)
        if o.kind == "lm" and o.bias:
            out[f"{h}.bias" if r.tie_output else f"{h}.proj.bias"] = (vocab,)
        if o.kind == "mlm":
            out.update(_linear(f"{h}.transform", d, d, True))
            out.update(_norm(f"{h}.norm", norm, d))
            out[f"{h}.bias"] = (vocab,)
        if o.kind in ("classifier", "pooled") and o.pooler == "tanh":
            out.update(_linear(f"{h}.pooler", d, d, True))
        if o.kind in ("classifier", "token_classifier"):
            out.update(_linear(f"{h}.proj", d, o.classes, True))
    return out


def _ffn(prefix: str, f, d: int) -> dict:
    """A dense FFN's parameters, or a mixture of experts' (specc/nn/experts.py)."""
    if f.kind == "dense":
        out = _linear(f"{prefix}.gate", d, f.d_ff, f.bias) if f.activation in GATED_ACTIVATIONS else {}
        out.update(_linear(f"{prefix}.up", d, f.d_ff, f.bias))
        out.update(_linear(f"{prefix}.down", f.d_ff, d, f.bias))
        return out
    e, gated = f.experts, f.activation in GATED_ACTIVATIONS
    out = {f"{prefix}.router.weight": (e, d)}
    if f.router.bias:
        out[f"{prefix}.router.bias"] = (e,)
    if f.router.kind == "sigmoid" and f.router.selection_bias:
        out[f"{prefix}.router.selection_bias"] = (e,)
    x = f"{prefix}.experts"
    if gated:
        out[f"{x}.gate"] = (e, f.d_ff, d)
    out[f"{x}.up"] = (e, f.d_ff, d)
    out[f"{x}.down"] = (e, d, f.d_ff)
    if f.bias:
        if gated:
            out[f"{x}.gate_bias"] = (e, f.d_ff)
        out[f"{x}.up_bias"] = (e, f.d_ff)
        out[f"{x}.down_bias"] = (e, d)
    if f.shared is not None:
        if gated:
            out.update(_linear(f"{prefix}.shared.gate", d, f.shared.d_ff, f.bias))
        out.update(_linear(f"{prefix}.shared.up", d, f.shared.d_ff, f.bias))
        out.update(_linear(f"{prefix}.shared.down", f.shared.d_ff, d, f.bias))
        if f.shared.gate:
            out[f"{prefix}.shared_gate.weight"] = (1, d)
    return out


def _numel(shape: tuple) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def component(name: str) -> str:
    """The component a parameter belongs to: embeddings, encoder.attention, decoder.ffn, ..."""
    parts = name.split(".")
    if parts[0] in ("embeddings",):
        return "embeddings"
    if parts[0] == "heads":
        return f"heads.{parts[1]}"
    stack = parts[0]
    if parts[1] in ("positions", "embed_norm"):
        return f"{stack}.embeddings"
    if parts[1] == "relative_bias":  # bucketed positions' table, read by every layer's self-attention
        return f"{stack}.attention"
    if parts[1] == "final_norm":
        return f"{stack}.norms"
    sub = parts[3]
    if sub.endswith("_norm"):
        return f"{stack}.norms"
    if sub == "ffn" and parts[4] == "experts":  # the routed experts, apart from router and shared expert
        return f"{stack}.experts"
    return f"{stack}.{sub}"


def _keys_seen(a: ResolvedAttention, n: int) -> int:
    p = a.pattern
    if p.kind == "local":
        return min(n, 2 * p.window + 1)
    if p.kind == "bigbird":
        return min(n, 2 * p.window + 1 + (p.global_ + p.random) * p.block)
    if p.kind == "linformer":
        return min(n, p.k)
    return n


def _attention_flops(a: ResolvedAttention, r: ResolvedSpec, n: int) -> int:
    """Per token: the quadratic part (scores and weighted values) plus score extras."""
    keys = _keys_seen(a, n)
    flops = 2 * a.heads * (a.d_k + a.d_v) * keys
    if a.score == "bilinear":
        flops += 2 * a.heads * a.d_k * a.d_k
    if r.position.kind == "relative" and not a.cross:
        flops += 2 * a.heads * (a.d_k + (a.d_v if r.position.values else 0)) * keys
    if a.pattern.kind == "linformer":  # projecting N keys and values to k, spread over N tokens
        flops += 2 * a.kv_heads * (a.d_k + a.d_v) * a.pattern.k
    return flops


def inspect_spec(r: ResolvedSpec, length: int | None = None) -> dict:
    """The facts `specc inspect` prints (JSON keys in docs/cli.md)."""
    n = length or r.serving.length.opt
    shapes = parameter_shapes(r)
    by_component: dict[str, int] = {}
    for name, shape in shapes.items():
        c = component(name)
        by_component[c] = by_component.get(c, 0) + _numel(shape)
    total = sum(by_component.values())
    matmul = {name: _numel(s) for name, s in shapes.items() if _is_matmul(name)}

    # each layer's parameter names, found in one pass (linear in the number of layers)
    in_layer: dict[str, list[str]] = {}
    for name in shapes:
        role, sep, index, _ = (name.split(".", 3) + ["", "", ""])[:4]
        if sep == "layers":
            in_layer.setdefault(f"{role}.layers.{index}.", []).append(name)

    layers = []
    flops = 0
    idle = 0  # routed experts' parameters a token does not read
    for stack in (r.encoder, r.decoder):
        if stack is None:
            continue
        for layer in stack.layers:
            p = f"{stack.role}.layers.{layer.index}."
            names = in_layer.get(p, [])
            params = sum(_numel(shapes[k]) for k in names)
            lf = 2 * sum(matmul[k] for k in names if k in matmul and ".cross_attention." not in k)
            lf += _attention_flops(layer.attention, r, n)
            f = layer.ffn
            layer_idle = 0
            if f.kind == "moe":
                experts = sum(_numel(shapes[k]) for k in names if k.startswith(p + "ffn.experts."))
                weights = sum(_numel(shapes[k]) for k in names if k.startswith(p + "ffn.experts.") and not k.endswith("_bias"))
                lf += 2 * weights // f.experts * f.top_k  # the chosen experts' matrices
                layer_idle = experts // f.experts * (f.experts - f.top_k)
            idle += layer_idle
            if layer.cross_attention is not None:
                a = layer.cross_attention
                # the cross K/V projections run once per source token; the queries once per target token
                lf += 2 * sum(matmul[k] for k in names if k in matmul and k.startswith(p + "cross_attention."))
                lf += _attention_flops(a, r, n)
            flops += lf
            layers.append({
                "stack": stack.role, "index": layer.index, "parameters": params,
                "active_parameters": params - layer_idle, "flops_per_token": lf,
                "attention": layer.attention.kind, "heads": layer.attention.heads, "kv_heads": layer.attention.kv_heads,
                "d_k": layer.attention.d_k, "d_v": layer.attention.d_v,
                "pattern": layer.attention.pattern.kind, "d_ff": f.d_ff, "activation": f.activation,
                "experts": f.experts if f.kind == "moe" else None, "top_k": f.top_k if f.kind == "moe" else None,
            })
    vocab = r.output_vocab_size
    for o in r.outputs:
        flops += 2 * sum(v for k, v in matmul.items() if k.startswith(f"heads.{o.name}."))
        if o.kind in ("lm", "mlm") and r.tie_output:
            flops += 2 * r.d_model * vocab
    cache_bytes = PRECISIONS[r.serving.precision].dtype_bytes  # the cache is in the exported float dtype
    kv = 0
    kv_at_length = 0  # one sequence of n positions: a window cache holds min(W, n) of them (spec/io.py)
    cross_kv = 0
    if r.decoder is not None:
        for layer in r.decoder.layers:
            a = layer.attention
            # latent attention caches one latent and one rotary key per position (spec/io.py)
            widths = a.kv_rank + a.rotary_dims if a.kind == "latent" else a.kv_heads * (a.d_k + a.d_v)
            position = widths * cache_bytes
            kv += position
            window = layer.attention.cache_window
            kv_at_length += position * (n if window is None else min(window, n))
            if layer.cross_attention is not None:
                c = layer.cross_attention
                cross_kv += c.kv_heads * (c.d_k + c.d_v) * cache_bytes
    shared = []
    if r.tie_output:
        table = "embeddings.target_tokens" if "embeddings.target_tokens.weight" in shapes else "embeddings.tokens"
        shared += [f"heads.{o.name} reuses {table}.weight (counted once)" for o in r.outputs if o.kind in ("lm", "mlm")]
    if r.architecture == "encoder-decoder" and r.vocab.share:
        shared.append("encoder and decoder share embeddings.tokens.weight (counted once)")
    return {
        "name": r.name,
        "length": n,
        "parameters": total,
        "active_parameters": total - idle,
        "parameters_by_component": by_component,
        "shared": shared,
        "flops_per_token": int(flops),
        "kv_cache_bytes_per_token": kv,
        "kv_cache_bytes_at_length": kv_at_length,
        "cross_kv_cache_bytes_per_source_token": cross_kv,
        "weight_bytes": {p: int(total * b) for p, b in BYTES.items()},
        "layers": layers,
    }


def _is_matmul(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    return name.endswith(".weight") and leaf[-2] in ("q", "k", "v", "o", "gate", "up", "down", "transform", "pooler", "proj",
                                                     "q_a", "q_b", "kv_a", "kv_b", "router", "shared_gate")
