"""The in-place cache graph of a decoder build: inplace.onnx, the build's verified model.onnx with
each layer's attention over its KV cache replaced by onnxruntime's GroupQueryAttention
(com.microsoft), whose past and present are one buffer the runtime allocates once.

model.onnx's decode step copies the whole cache every step (a Concat of past and new into the
present) and reads it again in the attention. inplace.onnx takes each layer's cache as a buffer
[batch, kv_heads, max_sequence, head_dim] and writes only the new positions into it:

    inputs   input_ids, position_ids (where model.onnx takes them), past_key_values.N.key/value
             (the buffers), seqlens_k int32 [batch] (positions in the cache after this call,
             minus one), total_sequence_length int32 scalar (positions after this call)
    outputs  model.onnx's, present.N.key/value bound by the runtime to the past's own buffers; the
             LM output holds each row's last min(sequence, io.LM_POSITIONS) positions, [batch,
             lm_positions, vocab]: a decode step reads its one, a speculative step its check of
             the drafted tokens (specc/runtime/speculative.py), and a prompt's LM head is a few
             positions' product, not the whole prompt's

What it computes is model.onnx's on rows that are not padded, for a prompt and for any number of
tokens after the cache (each sees the cache and the new ones before it): GroupQueryAttention masks the
future, not padding, so it runs a batch whose rows all have the same length (a single prompt,
or equal ones). The attention nodes are found from the cache's names and checked piece by piece
(`rewrite`); what cannot be matched, and every spec whose attention GroupQueryAttention does not
compute (windows, ALiBi, relative or bucketed positions, bilinear or additive scores, soft caps,
heads of unequal key and value widths), gets no in-place graph and the reason in the manifest.
`check` runs it against model.onnx on a prompt, a step of several tokens and decode steps
(docs/build.md).

Where a layer's queries and keys are turned by rotary positions in the half-split form over the
whole head, GroupQueryAttention turns them (do_rotary) from tables that model.onnx's own rotary
nodes compute for positions 0..serving.length.max-1 (`_rotary_tables`); other forms keep their nodes.
Beside the attention, two rewrites for speed, both of the same values: x * Reciprocal(Sqrt(y)) (an
RMSNorm as torch.export writes it) becomes x / Sqrt(y), the form onnxruntime fuses into
SimplifiedLayerNormalization; and a per-head QK-norm is computed before the heads are transposed
(`_heads_last`), over the last axis of the tensor onnxruntime reads, where it fuses it too.
model.onnx keeps torch's form, which its verification against torch holds to fp32's tolerance.
Nothing is traced again and no weight is written twice (specc/export/external.py).
"""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from specc.deps import require_onnxruntime
from specc.errors import BuildError, first_line
from specc.export.external import referenced
from specc.spec import io
from specc.spec.resolve import ResolvedSpec
from specc.spec.targets import decode_activations

FILE = "inplace.onnx"
GRAPH = "model"  # the graph it is made from
OP = "GroupQueryAttention"
DOMAIN = "com.microsoft"
SEQLENS_K, TOTAL_SEQUENCE_LENGTH, MAX_SEQUENCE = io.SEQLENS_K, io.TOTAL_SEQUENCE_LENGTH, io.MAX_SEQUENCE
ROTARY = "inplace/rotary"  # GroupQueryAttention's rotary tables: ROTARY/K/cos_cache, ROTARY/K/sin_cache
_ROTARY_HEAD = 16  # GroupQueryAttention turns heads whose width is a multiple of this (onnxruntime's check)
# ops allowed between the scores' MatMul and the probabilities' MatMul (scale, mask, softmax, reshapes)
_SCORE_OPS = {"Div", "Mul", "Reshape", "Where", "Add", "Softmax", "Cast"}


class Unfit(Exception):
    """This build gets no in-place graph; the message says why."""


def unfit(r: ResolvedSpec) -> str | None:
    """Why the spec's attention is not what GroupQueryAttention computes, or None where it is."""
    if r.architecture != "decoder":
        return "only decoder-only builds have one"
    if r.position.kind not in ("rotary", "learned", "sinusoidal", "none"):
        return f"{r.position.kind} positions add to the scores"
    for layer in r.stack("decoder").layers:
        a = layer.attention
        why = (a.pattern.kind != "full" and f"a {a.pattern.kind} attention pattern"
               or a.score not in ("scaled_dot", "dot") and f"{a.score} scores"
               or a.softcap is not None and "a soft cap on the scores"
               or a.d_k != a.d_v and "keys and values of different widths"
               or a.merge != "project" and f"heads merged by {a.merge}")
        if why:
            return f"layer {layer.index} has {why}"
    return None


def write(root: Path, r: ResolvedSpec, graph_files: dict[str, str]) -> tuple[Path, dict]:
    """ROOT/inplace.onnx from ROOT's model graph (the module's doc), and its IO signature as the
    manifest writes a graph's ({"inputs": [...], "outputs": [...]}); Unfit where it cannot be made."""
    import onnx

    why = unfit(r)
    if why:
        raise Unfit(why)
    source = graph_files[GRAPH]
    model = onnx.load(str(root / source), load_external_data=False)
    rewrite(model, r)
    inits = [t if t.name.startswith(ROTARY + "/") else referenced(t, root, source, t.name)
             for t in model.graph.initializer]
    del model.graph.initializer[:]
    model.graph.initializer.extend(inits)
    path = root / FILE
    path.write_bytes(model.SerializeToString())
    return path, {"inputs": _signature(model.graph.input), "outputs": _signature(model.graph.output)}


_DTYPES = {1: "float32", 10: "float16", 16: "bfloat16", 6: "int32", 7: "int64"}


def _signature(values) -> list[dict]:
    return [{"name": v.name, "dtype": _DTYPES[v.type.tensor_type.elem_type],
             "dims": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in values]


def spare(r: ResolvedSpec) -> bool:
    """Whether the in-place graph runs a spare position after the positions of a call of one row:
    where the build decodes with int8 activations and has no routed experts. There a single step
    must compute what a speculative check's call of several positions does
    (specc/decoding/speculation.py): the products' 8-bit inputs turn any other rounding into a
    quantization step. GroupQueryAttention computes one position by a path of its own (its
    weights meet the values in a matrix-vector product), while calls of two positions and more
    give a position the same floats whatever the others. So a row's every call has two or more:
    its last position once more (a copy of its query, key and value) after the call's own, its
    output dropped, its cache entry one past the call's positions (the buffers hold one more,
    io.SPARE_SEQUENCE), written over by the next call. A call of several rows (a batched decode
    step) has none: GroupQueryAttention takes several positions after a cache for one row only.
    MatMulNBits at level 4 computes a row alone as among others at 8 bits; at 4 bits some CPUs
    (AVX2 without AVX-512) multiply a lone row (a call of one position for one row) in a kernel
    of their own, about 1e-6 apart, so each 4-bit product gets its input's lone row twice
    (`_single_row_spares`). Routed experts (QMoE) are not known to compute a row alone as among
    others, so they keep the refusal."""
    return decode_activations(r.serving.precision, r.serving.activations) == "int8" and not r.routed_layers


_SPARE = "inplace/spare"
# the shared values the layers' spare positions read: where a call's positions start and end
# ([1] each: the call's sequence less the spare count, and the sequence), the axis, and
# seqlens_k and total_sequence_length counting the spare
_SPARE_LAST = (f"{_SPARE}/from", f"{_SPARE}/sequence", f"{_SPARE}/axis")
_SPARE_OWN = (f"{_SPARE}/zero", f"{_SPARE}/sequence", f"{_SPARE}/axis")
_SPARE_LENGTHS = (f"{_SPARE}/{SEQLENS_K}", f"{_SPARE}/{TOTAL_SEQUENCE_LENGTH}")


def _spare_lengths(g) -> list:
    """The values _SPARE_LAST, _SPARE_OWN and _SPARE_LENGTHS name. A call of one row has a spare
    position, a call of several none: GroupQueryAttention takes several new positions after a
    cache for one row only, and a batched step's rows run its one-position path anyway."""
    from onnx import TensorProto, helper

    g.initializer.extend([helper.make_tensor(f"{_SPARE}/zero", TensorProto.INT64, [1], [0]),
                          helper.make_tensor(f"{_SPARE}/axis", TensorProto.INT64, [1], [1]),
                          helper.make_tensor(f"{_SPARE}/one", TensorProto.INT64, [1], [1]),
                          helper.make_tensor(f"{_SPARE}/scalar", TensorProto.INT64, [0], [])])
    made = [
        helper.make_node("Shape", [io.INPUT_IDS], [f"{_SPARE}/rows"], start=0, end=1),
        helper.make_node("Shape", [io.INPUT_IDS], [f"{_SPARE}/sequence"], start=1, end=2),
        helper.make_node("Equal", [f"{_SPARE}/rows", f"{_SPARE}/one"], [f"{_SPARE}/alone"]),
        helper.make_node("Cast", [f"{_SPARE}/alone"], [f"{_SPARE}/count"], to=TensorProto.INT64),
        helper.make_node("Sub", [f"{_SPARE}/sequence", f"{_SPARE}/count"], [f"{_SPARE}/from"]),
        helper.make_node("Reshape", [f"{_SPARE}/count", f"{_SPARE}/scalar"], [f"{_SPARE}/count/scalar"]),
        helper.make_node("Cast", [f"{_SPARE}/count/scalar"], [f"{_SPARE}/count/int32"], to=TensorProto.INT32),
    ]
    made += [helper.make_node("Add", [name, f"{_SPARE}/count/int32"], [spared], name=spared)
             for name, spared in zip((SEQLENS_K, TOTAL_SEQUENCE_LENGTH), _SPARE_LENGTHS)]
    for n in made:
        n.name = n.name or n.output[0]
    return made


_SINGLE = f"{_SPARE}/single"
_SINGLE_ROWS = f"{_SINGLE}/rows"  # [2, 1] in a call of one position for one row, else [1, 1]: what Expand broadcasts a product's input to
_SINGLE_OWN = (f"{_SPARE}/zero", f"{_SINGLE}/own_end", f"{_SINGLE}/axis")  # the Slice that drops a product's spare row
_END = np.iinfo(np.int64).max


def _lone_row_kernel(node) -> bool:
    """Whether a product may multiply a lone row in a kernel of its own: MatMulNBits of 4-bit
    weights at accuracy level 4 (int8 activations), whatever its block (`spare`)."""
    return node.op_type == "MatMulNBits" and node.domain == DOMAIN and \
        _attr(node, "bits") == 4 and _attr(node, "accuracy_level") == 4


def _single_row_spares(g, nodes: list) -> list:
    """Every product in NODES that multiplies a lone row in a kernel of its own
    (`_lone_row_kernel`), given in a call of one row and one position its input's row once more
    (an Expand of its one row to two) and its output's second row dropped, so that it runs the
    kernel of several rows in every call; the nodes this adds (the shared values first). A call of
    more positions or rows passes its rows as they are (copies of a few rows). Called after
    _spare_lengths, whose constants (_SPARE/one, _SPARE/zero) it reads."""
    from onnx import TensorProto, helper

    products = [n for n in nodes if _lone_row_kernel(n)]
    if not products:
        return []
    g.initializer.extend([helper.make_tensor(f"{_SINGLE}/last", TensorProto.INT64, [1], [-1]),
                          helper.make_tensor(f"{_SINGLE}/axis", TensorProto.INT64, [1], [-2]),
                          helper.make_tensor(f"{_SINGLE}/end", TensorProto.INT64, [1], [_END]),
                          helper.make_tensor(f"{_SINGLE}/one_one", TensorProto.INT64, [2], [1, 1]),
                          helper.make_tensor(f"{_SINGLE}/two_one", TensorProto.INT64, [2], [2, 1])])
    made = [
        helper.make_node("Size", [io.INPUT_IDS], [f"{_SINGLE}/positions"]),
        helper.make_node("Equal", [f"{_SINGLE}/positions", f"{_SPARE}/one"], [f"{_SINGLE}/alone"]),
        helper.make_node("Where", [f"{_SINGLE}/alone", f"{_SINGLE}/two_one", f"{_SINGLE}/one_one"], [_SINGLE_ROWS]),
        helper.make_node("Where", [f"{_SINGLE}/alone", f"{_SINGLE}/last", f"{_SINGLE}/end"], [f"{_SINGLE}/own_end"]),
    ]
    padded: dict[str, str] = {}
    for n in products:
        x = n.input[0]
        if x not in padded:  # (/in and /out: a product that reads another's output names both apart)
            padded[x] = f"{x}/single/in"
            made.append(helper.make_node("Expand", [x, _SINGLE_ROWS], [padded[x]]))
        y = n.output[0]
        n.input[0], n.output[0] = padded[x], f"{y}/single/out"
        made.append(helper.make_node("Slice", [f"{y}/single/out", *_SINGLE_OWN], [y]))
    for m in made:
        m.name = m.name or m.output[0]
    return made


def rewrite(model, r: ResolvedSpec) -> None:
    """MODEL (model.onnx's proto, edited in place) with every layer's cached attention one
    GroupQueryAttention node (with a spare position where `spare`); Unfit naming the layer where
    the nodes are not the expected ones."""
    from onnx import TensorProto, helper

    with_spare = spare(r)
    g = model.graph
    layers = r.stack("decoder").layers
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list] = defaultdict(list)
    for n in g.node:
        for i in n.input:
            consumers[i].append(n)
    constants = _constants(g)
    dims = {t.name: list(t.dims) for t in g.initializer} | {k: list(v.shape) for k, v in constants.items()}
    dropped, added, renamed, found = _roots_as_divisions(g.node, consumers, producer), [], {}, []
    for layer in layers:
        i, att = layer.index, layer.attention
        key, value = (io.CacheSlot(i, io.SELF, w) for w in (io.KEY, io.VALUE))
        k_cat, v_cat = producer.get(key.present), producer.get(value.present)
        for cat, slot in ((k_cat, key), (v_cat, value)):
            if cat is None or cat.op_type != "Concat" or cat.input[0] != slot.past or _attr(cat, "axis") not in (2, -2):
                raise Unfit(f"layer {i}: {slot.present} is not a Concat of {slot.past} and the new positions")
        scores = _chain_to(consumers, key.present, ("MatMul",), through=("Unsqueeze", "Transpose"), layer=i)
        probs_v = _chain_to(consumers, value.present, ("MatMul",), through=("Unsqueeze",), layer=i)
        query, factor = _query(producer, constants, scores.input[0])
        scale = factor * _score_scale(producer, consumers, constants, scores, probs_v, i)
        rq, rk = (_rotary(producer, constants, x, att.d_k) for x in (query, k_cat.input[1]))
        rotary = (rq[0], rk[0], rq[1:]) if rq and rk and rq[1:] == rk[1:] and att.d_k % _ROTARY_HEAD == 0 \
            else None  # unturned q, k; (cos, sin)
        found.append((i, att, key, value, query, k_cat, v_cat, scale, _merged(consumers, probs_v, i), rotary))
    tables: dict[tuple, tuple | None] = {}  # (cos, sin) -> GroupQueryAttention's tables, where they can be made
    for rotary in (f[-1] for f in found if f[-1] and f[-1][2] not in tables):
        tables[rotary[2]] = _rotary_tables(model, producer, rotary[2], r, f"{ROTARY}/{len(tables)}")
    for i, att, key, value, query, k_cat, v_cat, scale, merged, rotary in found:
        k_new = k_cat.input[1]
        turned = tables[rotary[2]] if rotary else None
        if turned:  # GroupQueryAttention turns the queries and keys itself, from the tables
            query, k_new = rotary[0], rotary[1]
        q3, k3, v3, out = (f"inplace/{i}/{n}" for n in ("query", "key", "value", "output"))
        for src, dst in ((query, q3), (k_new, k3), (v_cat.input[1], v3)):
            heads_last = _heads_last(src, producer, constants, dims, dst)
            if heads_last is None:
                added.append(helper.make_node("Transpose", [src], [dst + "/bshd"], perm=[0, 2, 1, 3],
                                              name=dst + "/transpose"))
                bshd = dst + "/bshd"
            else:
                bshd, nodes = heads_last
                added += nodes
            added.append(helper.make_node("Reshape", [bshd, "inplace/flat"], [dst], name=dst + "/reshape"))
        natural = 1.0 / np.sqrt(att.d_k)
        attrs = {} if abs(scale - natural) <= 1e-6 * natural else {"scale": float(scale)}
        inputs = [q3, k3, v3, key.past, value.past, SEQLENS_K, TOTAL_SEQUENCE_LENGTH]
        attended = out
        if with_spare:  # the call's last position once more after its own, its output dropped
            for j, x in enumerate((q3, k3, v3)):
                added += [helper.make_node("Slice", [x, *_SPARE_LAST], [x + "/last"], name=x + "/last"),
                          helper.make_node("Concat", [x, x + "/last"], [x + "/spare"], axis=1, name=x + "/spare")]
                inputs[j] = x + "/spare"
            inputs[5:7] = _SPARE_LENGTHS
            attended = out + "/spare"
            added.append(helper.make_node("Slice", [attended, *_SPARE_OWN], [out], name=out + "/own"))
        if turned:
            inputs += [t.name for t in turned]
            attrs.update(do_rotary=1, rotary_interleaved=0)
        added.append(helper.make_node(OP, inputs, [attended, key.present, value.present], domain=DOMAIN,
                                      name=f"inplace/{i}/attention", num_heads=att.heads, kv_num_heads=att.kv_heads,
                                      **attrs))
        dropped |= {id(k_cat), id(v_cat)}
        renamed[merged] = out
    g.initializer.extend(t for pair in tables.values() if pair for t in pair)
    for n in g.node:
        for j, name in enumerate(n.input):
            if name in renamed:
                n.input[j] = renamed[name]
    for o in g.output:
        if o.name in renamed:
            raise Unfit(f"the attention's output {o.name} is a graph output")
    flat = helper.make_tensor("inplace/flat", TensorProto.INT64, [3], [0, 0, -1])
    added += _last_positions_logits(g, producer, constants, r.lm_output) if r.lm_output else []
    if with_spare:
        added += _spare_lengths(g)
    kept = [n for n in g.node if id(n) not in dropped] + added
    if with_spare:
        kept += _single_row_spares(g, kept)
    g.initializer.append(flat)
    _set_nodes(g, _live(_sorted(kept, g), g))
    _set_inputs(g, r, io.SPARE_SEQUENCE if with_spare else MAX_SEQUENCE)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


_ALONG_LAST_AXIS = {"Pow", "ReduceMean", "Add", "Sub", "Sqrt", "Div", "Mul", "Reciprocal", "Cast", "LayerNormalization"}


def _heads_last(src: str, producer, constants: dict, dims: dict, dst: str) -> tuple[str, list] | None:
    """SRC [batch, heads, sequence, head] in [batch, sequence, heads, head] without a Transpose,
    where it is computed from a Transpose (0, 2, 1, 3) of such a tensor by nodes that act along the
    last axis alone (a per-head norm, QK-norm's; or nothing): those nodes again on the untransposed
    tensor (their old copies left for `_live` to drop). Returns (the name, the nodes to add), or
    None where SRC is made otherwise. So onnxruntime sees the norm over the last axis of the
    tensor it reads, which it fuses into SimplifiedLayerNormalization, as it does the layers'
    norms (the transposes pushed through the norm leave it over axis 3, which it does not fuse)."""
    from onnx import helper

    region, stack, source = {}, [src], None
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if node is None or name in region:
            continue
        if node.op_type == "Transpose":
            if _attr(node, "perm") != [0, 2, 1, 3] or source not in (None, node.input[0]):
                return None
            source = node.input[0]
            region[name] = None
            continue
        if node.op_type not in _ALONG_LAST_AXIS or any(node.output[1:]):
            return None
        if node.op_type == "LayerNormalization":
            if _attr(node, "axis") not in (None, -1, 3):
                return None
            inputs = node.input
        elif node.op_type == "ReduceMean":
            axes = _attr(node, "axes") if len(node.input) < 2 else constants.get(node.input[1])
            if _attr(node, "keepdims") == 0 or axes is None or np.atleast_1d(axes).tolist() not in ([-1], [3]):
                return None
            inputs = node.input[:1]
        else:
            inputs = node.input
        for i in inputs:
            if i in dims:  # a constant: it must vary along the last axis alone
                if any(d != 1 for d in dims[i][:-1]):
                    return None
            elif i in producer:
                stack.append(i)
            else:
                return None
        region[name] = node
    if source is None:
        return None
    if region[src] is None:  # SRC is the Transpose itself
        return source, []
    renamed = {n: (source if node is None else f"{dst}/heads_last/{k}") for k, (n, node) in enumerate(region.items())}
    made = []
    for name, node in region.items():
        if node is None:
            continue
        copy = helper.make_node(node.op_type, [renamed.get(i, i) for i in node.input], [renamed[name]],
                                name=renamed[name], domain=node.domain or None)
        copy.attribute.extend(node.attribute)
        made.append(copy)
    return renamed[src], made


_PER_POSITION = {"MatMul", "MatMulNBits", "Add", "Mul", "Div", "Sub", "Tanh", "Cast"}


def _last_positions_logits(g, producer, constants, lm: str) -> list:
    """The LM head made to read each row's last min(sequence, io.LM_POSITIONS) positions: a Slice
    of them at the head's input x, and the LM output's sequence dim io.LM_POSITIONS_DIM. Between x
    and the output lie only the head's products of x by constants and what acts on each position
    alone (a constant bias, scale or soft cap; a gguf head's second product, of its codes' low
    nibbles or of x's block sums by its offsets, and the Add of the two), and nothing else reads
    their values; anything else leaves the graph as it is. Returns the nodes to add (none where it
    is left)."""
    from onnx import TensorProto, helper

    name = lm
    for _ in range(8):  # x: the first operands back to the head's product
        node = producer.get(name)
        if node is None or node.op_type not in _PER_POSITION:
            return []
        if node.op_type in ("MatMul", "MatMulNBits"):
            break
        name = node.input[0]
    else:
        return []
    x = node.input[0]
    constant = _constant_values(g, constants)
    region, stack = {}, [lm]
    while stack:
        name = stack.pop()
        node = producer.get(name)
        if name == x or name in constant or id(node) in region:
            continue
        if node is None or node.op_type not in _PER_POSITION or \
                (node.op_type in ("MatMul", "MatMulNBits") and not all(i in constant for i in node.input[1:] if i)):
            return []
        region[id(node)] = node
        stack += [i for i in node.input if i]
    made = {o for n in region.values() for o in n.output}
    if any(i in made and id(n) not in region for n in g.node for i in n.input) or \
            any(o.name in made and o.name != lm for o in g.output):
        return []  # a value of the head is read elsewhere, at every position
    last = f"inplace/{lm}/last_positions"
    g.initializer.extend([helper.make_tensor(f"{last}/{k}", TensorProto.INT64, [1], [v])
                          for k, v in (("starts", -io.LM_POSITIONS), ("ends", 2**63 - 1), ("axes", 1))])
    slice_node = helper.make_node("Slice", [x, f"{last}/starts", f"{last}/ends", f"{last}/axes"], [last], name=last)
    for n in region.values():
        for j, i in enumerate(n.input):
            if i == x:
                n.input[j] = last
    out = next(o for o in g.output if o.name == lm)
    out.type.tensor_type.shape.dim[1].dim_param = io.LM_POSITIONS_DIM
    return [slice_node]


def _constant_values(g, constants) -> set[str]:
    """The names of the values that are constants: initializers, Constant nodes' and what nodes
    compute from those alone (a gguf head's scales x 16, its offsets transposed)."""
    out = {t.name for t in g.initializer} | set(constants)
    changed = True
    while changed:
        changed = False
        for n in g.node:
            if n.output[0] not in out and n.input and all(i in out for i in n.input if i):
                out.update(n.output)
                changed = True
    return out


def _roots_as_divisions(nodes, consumers, producer) -> set[int]:
    """x * Reciprocal(Sqrt(y)) rewritten as x / Sqrt(y) (the same value): onnxruntime fuses an RMSNorm
    written so into one SimplifiedLayerNormalization kernel, the exported form not. Edits the Mul
    nodes in place; returns the ids of the Reciprocal nodes left unread."""
    gone = set()
    for n in nodes:
        root = producer.get(n.input[0]) if n.op_type == "Reciprocal" else None
        users = consumers.get(n.output[0], []) if root is not None else []
        if root is None or root.op_type != "Sqrt" or len(users) != 1 or users[0].op_type != "Mul":
            continue
        mul = users[0]
        x = mul.input[0] if mul.input[1] == n.output[0] else mul.input[1]
        mul.op_type = "Div"
        del mul.input[:]
        mul.input.extend([x, root.output[0]])
        gone.add(id(n))
    return gone


def _rotary(producer, constants, name: str, d: int) -> tuple[str, str, str] | None:
    """(X, COS, SIN) where NAME is X * COS + rotate_half(X) * SIN, rotate_half(X) being
    Concat(-X[..., d/2:], X[..., :d/2]) on the last axis (rotary positions in the half-split form,
    over the whole head of width D); None where it is anything else."""
    add = producer.get(name)
    if add is None or add.op_type != "Add" or len(add.input) != 2:
        return None
    muls = [producer.get(n) for n in add.input]
    if any(m is None or m.op_type != "Mul" for m in muls):
        return None
    for plain, turned in (muls, muls[::-1]):
        cats = [n for n in turned.input if n in producer and producer[n].op_type == "Concat"]
        x = _half_turn(producer, constants, producer[cats[0]], d) if len(cats) == 1 else None
        if x is None or x not in plain.input:
            continue
        sin = turned.input[1] if turned.input[0] == cats[0] else turned.input[0]
        cos = plain.input[1] if plain.input[0] == x else plain.input[0]
        return x, cos, sin
    return None


def _half_turn(producer, constants, cat, d: int) -> str | None:
    """X where CAT is Concat(-X[..., d/2:], X[..., :d/2]) on the last axis; None elsewhere."""
    if _attr(cat, "axis") not in (-1, 3) or len(cat.input) != 2:
        return None
    neg, low = (producer.get(n) for n in cat.input)
    if neg is None or neg.op_type != "Neg" or low is None or low.op_type != "Slice":
        return None
    high = producer.get(neg.input[0])
    if high is None or high.op_type != "Slice" or high.input[0] != low.input[0]:
        return None
    if _last_axis_slice(constants, high, d) != (d // 2, d) or _last_axis_slice(constants, low, d) != (0, d // 2):
        return None
    return low.input[0]


def _last_axis_slice(constants, node, d: int) -> tuple[int, int] | None:
    """(start, end) of a Slice with constant bounds, step 1, on the last axis of a tensor whose last
    dim is D (an end past it read as D); None for any other Slice."""
    bounds = [constants.get(n) for n in node.input[1:]]
    if len(bounds) < 3 or any(b is None or b.size != 1 for b in bounds):
        return None
    start, end, axis, *step = (int(b.reshape(-1)[0]) for b in bounds)
    if axis not in (-1, 3) or step not in ([], [1]):
        return None
    return start, min(end, d)


def _rotary_tables(model, producer, pair: tuple[str, str], r: ResolvedSpec, prefix: str) -> tuple | None:
    """GroupQueryAttention's cos_cache and sin_cache (PREFIX/cos_cache, PREFIX/sin_cache),
    [serving.length.max, head_dim / 2] in the cache's type, for the (COS, SIN) PAIR the graph's own
    rotary nodes multiply by, where the graph computes them from position_ids alone and a position's
    angles do not depend on how many positions are asked: those nodes of model.onnx run on positions
    0.., so the tables hold the graph's own values. None where not (the layers keep their rotary
    nodes)."""
    import onnx
    from onnx import helper

    cos, sin = pair
    g = model.graph
    inputs = {v.name: v for v in g.input}
    inits = {t.name: t for t in g.initializer}
    seen, read, stack = set(), set(), [cos, sin]
    while stack:
        name = stack.pop()
        if name in seen or name == "":
            continue
        seen.add(name)
        if name in inputs:
            read.add(name)
        elif name not in inits:
            if name not in producer:
                return None
            stack.extend(producer[name].input)
    used = [inits[n] for n in seen if n in inits]
    if read != {io.POSITION_IDS} or any(t.data_location == onnx.TensorProto.EXTERNAL for t in used):
        return None
    nodes = [n for n in g.node if any(o in seen for o in n.output)]
    sub = helper.make_model(helper.make_graph(nodes, "rotary", [inputs[io.POSITION_IDS]],
                                              [helper.ValueInfoProto(name=cos), helper.ValueInfoProto(name=sin)],
                                              initializer=used), opset_imports=model.opset_import,
                          ir_version=model.ir_version)  # not onnx's newest: the runtime may read older ones only
    ort = require_onnxruntime("making the in-place graph's rotary tables")
    session = ort.InferenceSession(sub.SerializeToString(), providers=["CPUExecutionProvider"])
    positions = r.serving.length.max
    tables = []
    for n in sorted({min(8, positions), positions}):
        c, s = session.run(None, {io.POSITION_IDS: np.arange(n, dtype=np.int64)[None]})
        d = c.shape[-1]
        if c.size != n * d or s.shape != c.shape or d % 2:
            return None
        tables.append((c.reshape(n, d), s.reshape(n, d)))
    (c0, s0), (c, s) = tables[0], tables[-1]
    if not (np.array_equal(c[: len(c0)], c0) and np.array_equal(s[: len(s0)], s0)):
        return None  # angles that depend on the sequence's length (LongRoPE, dynamic scaling): not one table
    half = d // 2
    if not (np.array_equal(c[:, :half], c[:, half:]) and np.array_equal(s[:, :half], s[:, half:])):
        return None  # not one angle per pair of halves
    if spare(r):  # a row for the spare position after the last one: its angle turns a key nothing reads
        c, s = np.concatenate([c, c[-1:]]), np.concatenate([s, s[-1:]])
    past = next(v for v in g.input if io.is_past(v.name))
    dtype = helper.tensor_dtype_to_np_dtype(past.type.tensor_type.elem_type)
    return tuple(onnx.numpy_helper.from_array(np.ascontiguousarray(t[:, :half].astype(dtype)), f"{prefix}/{name}")
                 for t, name in ((c, "cos_cache"), (s, "sin_cache")))


def _chain_to(consumers, start: str, ops: tuple, through: tuple, layer: int):
    """The one node of `ops` that reads START through nodes of `through` (each read by one node),
    START's graph-output use apart."""
    name = start
    for _ in range(8):
        users = consumers.get(name, [])
        if len(users) != 1:
            break
        node = users[0]
        if node.op_type in ops:
            return node
        if node.op_type not in through:
            break
        name = node.output[0]
    raise Unfit(f"layer {layer}: the attention that reads {start} is not a {'/'.join(ops)} after {'/'.join(through)}")


def _query(producer, constants, name: str) -> tuple[str, float]:
    """The queries the scores' MatMul reads, [batch, heads, sequence, head_dim], back through
    reshapes and products with a constant scalar; and that constant (1.0 where there is none)."""
    factor = 1.0
    while name in producer:
        node = producer[name]
        c = _scalar(constants, node.input[1]) if node.op_type in ("Mul", "Div") and len(node.input) == 2 else None
        if node.op_type not in ("Reshape", "Unsqueeze") and c is None:
            break
        if c is not None:
            factor = factor * c if node.op_type == "Mul" else factor / c
        name = node.input[0]
    return name, factor


def _scalar(constants, name: str) -> float | None:
    c = constants.get(name)
    return float(c.reshape(-1)[0]) if c is not None and c.size == 1 else None


def _score_scale(producer, consumers, constants, scores, probs_v, layer: int) -> float:
    """The factor the nodes between the scores' MatMul and the probabilities' MatMul multiply the
    scores by; Unfit where they do anything but scale, mask, reshape and one Softmax."""
    scale, softmax = 1.0, 0
    name = probs_v.input[0]
    seen = 0
    while name != scores.output[0]:
        node = producer.get(name)
        seen += 1
        if node is None or node.op_type not in _SCORE_OPS or seen > 16:
            raise Unfit(f"layer {layer}: the scores reach the softmax through {node.op_type if node else name!r}")
        if node.op_type == "Softmax":
            softmax += 1
            name = node.input[0]
        elif node.op_type in ("Div", "Mul"):
            c = _scalar(constants, node.input[1])
            if c is None:
                raise Unfit(f"layer {layer}: the scores are scaled by a value that is not a constant")
            scale = scale / c if node.op_type == "Div" else scale * c
            name = node.input[0]
        elif node.op_type == "Where":
            name = node.input[1]  # Where(mask, scores, -inf): the mask is GroupQueryAttention's own
        elif node.op_type == "Add":
            raise Unfit(f"layer {layer}: something is added to the scores")
        else:
            name = node.input[0]
    if softmax != 1:
        raise Unfit(f"layer {layer}: {softmax} softmaxes between the scores and the values")
    return scale


def _merged(consumers, probs_v, layer: int) -> str:
    """The attention's output as the output projection reads it, [batch, sequence, heads x
    head_dim]: the probabilities' MatMul through reshapes and one Transpose (0, 2, 1, 3), ending
    in a Reshape."""
    name, transposed, last = probs_v.output[0], 0, probs_v
    for _ in range(6):
        users = consumers.get(name, [])
        if len(users) != 1 or users[0].op_type not in ("Reshape", "Transpose"):
            break
        last = users[0]
        if last.op_type == "Transpose":
            if list(_attr(last, "perm") or []) != [0, 2, 1, 3]:
                break
            transposed += 1
        name = last.output[0]
    if transposed != 1 or last.op_type != "Reshape":
        raise Unfit(f"layer {layer}: the heads are not merged by a Transpose (0, 2, 1, 3) and a Reshape")
    return name


def _attr(node, name: str):
    from onnx import helper

    return next((helper.get_attribute_value(a) for a in node.attribute if a.name == name), None)


def _constants(g) -> dict[str, np.ndarray]:
    """Small initializers and Constant nodes' values by name."""
    from onnx import numpy_helper

    out = {t.name: numpy_helper.to_array(t) for t in g.initializer
           if t.data_location != 1 and len(t.dims) <= 1 and int(np.prod(t.dims or [1])) <= 8}
    for n in g.node:
        if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
            out[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    return out


def _sorted(nodes: list, g) -> list:
    """NODES in an order where each reads only graph inputs, initializers or earlier outputs."""
    ready = {i.name for i in g.input} | {t.name for t in g.initializer} | {"", SEQLENS_K, TOTAL_SEQUENCE_LENGTH}
    waiting = list(nodes)
    out = []
    while waiting:
        rest = []
        for n in waiting:
            if all(i in ready for i in n.input):
                out.append(n)
                ready.update(n.output)
            else:
                rest.append(n)
        if len(rest) == len(waiting):
            raise Unfit(f"the rewritten graph has a cycle or a missing value at {rest[0].name or rest[0].op_type}")
        waiting = rest
    return out


def _live(nodes: list, g) -> list:
    """NODES that the graph's outputs need."""
    needed = {o.name for o in g.output}
    keep = []
    for n in reversed(nodes):
        if any(o in needed for o in n.output):
            keep.append(n)
            needed.update(n.input)
    return keep[::-1]


def _set_nodes(g, nodes: list) -> None:
    used = {i for n in nodes for i in n.input}
    kept_inits = [t for t in g.initializer if t.name in used]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(kept_inits)
    del g.value_info[:]


def _set_inputs(g, r: ResolvedSpec, length: str) -> None:
    """The graph's inputs: model.onnx's that the nodes still read, the caches as buffers of
    LENGTH positions (MAX_SEQUENCE, or io.SPARE_SEQUENCE), then seqlens_k and total_sequence_length;
    its present outputs alike."""
    from onnx import TensorProto, helper

    used = {i for n in g.node for i in n.input}
    kept = [v for v in g.input if v.name in used]
    for v in list(kept) + [o for o in g.output if io.is_present(o.name)]:
        if io.parse_cache(v.name):
            v.type.tensor_type.shape.dim[2].dim_param = length
    del g.input[:]
    g.input.extend(kept)
    g.input.extend([helper.make_tensor_value_info(SEQLENS_K, TensorProto.INT32, [io.BATCH]),
                    helper.make_tensor_value_info(TOTAL_SEQUENCE_LENGTH, TensorProto.INT32, [])])


# --- the check -----------------------------------------------------------------------------------


def check(root: Path, r: ResolvedSpec, graph_files: dict[str, str], open_session, compare, feeds,
          prompt: int = 7, steps: int = 3, seed: int = 0, several: int = 3) -> dict:
    """inplace.onnx against model.onnx on one prompt of PROMPT seeded tokens and STEPS greedy decode
    steps from it, the first of them SEVERAL tokens (the greedy one and seeded ones: a speculative
    step's check), the LM output's last min(sequence, io.LM_POSITIONS) positions compared; each graph opened in turn (never both at once: a 7B graph is held once).
    COMPARE(name, got, want) -> its figures, raising BuildError where they differ past the build's
    tolerance. OPEN_SESSION(path, graph name) makes a session; FEEDS(input names, ids, start,
    caches) the in-place graph's inputs, as the runtime makes them (specc/runtime/cache.py's
    inplace_feeds). Returns the worst figures."""
    longest = r.serving.length.max  # the case fits what the build serves (learned positions too)
    steps = min(steps, longest - 1)
    several = max(1, min(several, longest - steps))
    prompt = min(prompt, longest - steps - several + 1)
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, r.input_vocab_size("decoder"), (1, prompt), dtype=np.int64)
    seeded = rng.integers(0, r.input_vocab_size("decoder"), (1, several - 1), dtype=np.int64)
    lm = r.lm_output or next(o.name for o in r.graph(GRAPH).outputs if not io.is_present(o.name))  # what is compared

    session = open_session(root / graph_files[GRAPH], GRAPH)
    names = {t.name: t for t in session.get_inputs()}
    past = {n: np.zeros((1, t.shape[1], 0, t.shape[3]), dtype=_np_type(t.type)) for n, t in names.items() if io.is_past(n)}
    want, tokens, chosen = [], ids, []
    for step in range(steps + 1):
        start = past[next(iter(past))].shape[2]
        f = {io.INPUT_IDS: tokens, **past}
        if io.ATTENTION_MASK in names:
            f[io.ATTENTION_MASK] = np.ones((1, start + tokens.shape[1]), dtype=np.int64)
        if io.POSITION_IDS in names:
            f[io.POSITION_IDS] = np.arange(start, start + tokens.shape[1], dtype=np.int64)[None]
        if io.TOKEN_TYPE_IDS in names:
            f[io.TOKEN_TYPE_IDS] = np.zeros_like(tokens)
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, f)))
        want.append(out[lm][:, -io.LM_POSITIONS:])  # the in-place graph's LM output's positions
        past = io.present_to_past({k: v for k, v in out.items() if io.is_present(k)})
        tokens = out[lm][:, -1:].argmax(-1).astype(np.int64)
        if step == 0:
            tokens = np.concatenate([tokens, seeded], axis=1)
        chosen.append(tokens)
    del session, past

    session = open_session(root / FILE, FILE)
    names = {t.name: t for t in session.get_inputs()}
    capacity = prompt + steps + several - 1
    caches = {n: np.zeros(io.concrete_dims(t.shape, {io.BATCH: 1, MAX_SEQUENCE: capacity}), dtype=_np_type(t.type))
              for n, t in names.items() if io.is_past(n)}
    binding_names = [o.name for o in session.get_outputs()]
    worst: dict = {}
    tokens, start = ids, 0
    for step in range(steps + 1):
        try:
            got = _run_inplace(session, binding_names, feeds(names, tokens, start, caches))
        except Exception as exc:  # onnxruntime's own exception types
            raise BuildError(f"{FILE} (the in-place cache graph): onnxruntime cannot run it: "
                             f"{first_line(exc)[:300]}") from None
        what = "prompt" if step == 0 else f"decode step {step}" + (f" of {tokens.shape[1]} tokens" if tokens.shape[1] > 1 else "")
        figures = compare(f"{lm} ({what})", got[lm], want[step])
        for k, v in figures.items():
            if not isinstance(v, (int, float)):
                continue
            worst[k] = v if k not in worst else (max(worst[k], v) if k.startswith("max") else min(worst[k], v))
        start += tokens.shape[1]
        tokens = chosen[step]  # model.onnx's choice, so both graphs read the same tokens
    return worst


def _run_inplace(session, names: list[str], feeds: dict) -> dict[str, np.ndarray]:
    """Run with the present.* bound to the past's own buffers (the arrays in FEEDS)."""
    ort = require_onnxruntime("checking the in-place cache graph")
    binding = session.io_binding()
    wanted = {t.name for t in session.get_inputs()}
    for k, v in feeds.items():
        if k in wanted:
            binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(v)))
    buffer = {present: past for past, present in io.present_to_past({n: n for n in names if io.is_present(n)}).items()}
    for n in names:  # in the outputs' order, which get_outputs() keeps
        if n in buffer:
            binding.bind_ortvalue_output(n, ort.OrtValue.ortvalue_from_numpy(feeds[buffer[n]]))
        else:
            binding.bind_output(n, "cpu")
    session.run_with_iobinding(binding)
    return {n: v.numpy() for n, v in zip(names, binding.get_outputs()) if not io.is_present(n)}


def _np_type(ort_type: str):
    return {"tensor(float16)": np.float16}.get(ort_type, np.float32)
