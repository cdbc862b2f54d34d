"""Fuse multi-head attention, as the exporter writes it out op by op, into onnxruntime's
com.microsoft `MultiHeadAttention`:

    q3, k3, v3 [B,T|S,H*D] --Reshape [B,*,H,D]--> Transpose: q (0,2,1,3), k (0,2,3,1), v (0,2,1,3)
    scores = MatMul(q, k^T), then Div(c) or Mul(c) or neither, then Where(keep, scores, fill) with
             keep [B,S] unsqueezed to [B,1,1,S] or no mask, then Softmax(-1) (in an fp16 graph
             as specc's modules write it: Cast to fp32, Softmax, Cast back)
    out = MatMul(probs, v) --Transpose (0,2,1,3)--> Reshape [B,T,H*Dv]

becomes `MultiHeadAttention(q3, k3, v3, bias?, key_padding_mask?)` with num_heads H, the score
scale, and mask_filter_value = fill (fp32's minimum for fp16's: _filter_value). onnxruntime's CPU kernel adds the mask to the scaled scores
(0 where a key is kept, `fill` where not) before the softmax. specc's modules mask with the
dtype's minimum, so a masked score rounds to that minimum as the Where gives it, and a row with
nothing to attend to averages the values in both. The [B,H,T,S] scores never leave the kernel:
one node instead of thirteen, sixteen with the bias Adds (what it gains: docs/build.md).

Where q3, k3 and v3 are each `Add(x, b)` with a constant 1-D bias that nothing else reads, the
three biases become the node's `bias` input, added inside the kernel as it lays out the heads.

Left written out: a causal or pattern mask ([B,1,T,S], not a key-padding mask), relative
positions or ALiBi added to the scores, cached keys (a decoder's Concat with the past), and
anything but fp32 and fp16 (what onnxruntime's CPU and CUDA kernels take; its kernels compute the
softmax in fp32, as the Casts did). onnxruntime-only: the tensorrt target does not run it.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from specc.export.passes.match import ints, producer, remove_unread, scalar, sole_reader

DOMAIN = "com.microsoft"


def _dims(value: ir.Value | None) -> list | None:
    return list(value.shape) if value is not None and value.shape is not None else None


def _perm(node: ir.Node) -> list[int]:
    return list(node.attributes.get_ints("perm", []))


def _heads(split: ir.Value, perm: list[int]):
    """(x3, H, D, [Reshape, Transpose]) where `split` = Transpose(perm)(Reshape(x3 [B,N,H*D] to
    [B,N,H,D])), else None."""
    tr = producer(split, "Transpose")
    if tr is None or _perm(tr) != perm:
        return None
    rs = producer(tr.inputs[0], "Reshape")
    if rs is None or rs.inputs[0] is None:
        return None
    x3 = rs.inputs[0]
    whole, parts = _dims(x3), _dims(rs.outputs[0])
    if whole is None or parts is None or len(whole) != 3 or len(parts) != 4:
        return None
    h, d = parts[2], parts[3]
    # the leading dims carried through: the same ints or the same named dims (unknown dims compare
    # equal in onnx_ir, so they prove nothing)
    if not (isinstance(h, int) and isinstance(d, int) and whole[2] == h * d and whole[:2] == parts[:2]
            and all(isinstance(x, int) or x.value is not None for x in whole[:2])):
        return None
    return x3, h, d, [rs, tr]


def _key_mask(cond: ir.Value | None) -> ir.Value | None:
    """The [B,S] bool keep mask that `cond` [B,1,1,S] is unsqueezed from, else None."""
    un = producer(cond, "Unsqueeze")
    if un is None or len(un.inputs) != 2 or ints(un.inputs[1]) != [1, 2]:
        return None
    keep = un.inputs[0]
    dims = _dims(keep)
    if keep is None or keep.dtype != ir.DataType.BOOL or dims is None or len(dims) != 2:
        return None
    return keep


def _match(softmax: ir.Node) -> dict | None:
    """The parts of the fused node for one Softmax, or None where the pattern does not hold."""
    if softmax.attributes.get_int("axis", -1) not in (-1, 3):
        return None
    probs, x, reader, pattern = softmax.outputs[0], softmax.inputs[0], softmax, [softmax]
    to32, back = producer(x, "Cast"), sole_reader(probs)
    if to32 is not None and back is not None and back.op_type == "Cast" and back.domain == "":
        # an fp16 graph's softmax in fp32: Cast(fp16 -> fp32), Softmax, Cast(fp32 -> fp16)
        if (to32.attributes.get_int("to") != ir.DataType.FLOAT or to32.inputs[0] is None
                or back.attributes.get_int("to") != to32.inputs[0].dtype or sole_reader(x) is not softmax):
            return None
        probs, x, reader = back.outputs[0], to32.inputs[0], to32
        pattern += [back, to32]
    pv = sole_reader(probs)
    if pv is None or pv.op_type != "MatMul" or pv.domain != "" or pv.inputs[0] is not probs:
        return None
    pattern.append(pv)
    keep, fill = None, None
    where = producer(x, "Where")
    if where is not None:
        keep, fill = _key_mask(where.inputs[0]), scalar(where.inputs[2])
        if keep is None or fill is None or sole_reader(x) is not reader:
            return None
        pattern += [where, where.inputs[0].producer()]  # the Unsqueeze goes with the last layer's
        x, reader = where.inputs[1], where
    scale = 1.0
    scaler = producer(x, "Div") or producer(x, "Mul")
    if scaler is not None:
        c = scalar(scaler.inputs[1])
        if not c or sole_reader(x) is not reader:
            return None
        scale = 1.0 / c if scaler.op_type == "Div" else c
        pattern.append(scaler)
        x, reader = scaler.inputs[0], scaler
    qk = producer(x, "MatMul")
    if qk is None or sole_reader(x) is not reader:
        return None
    pattern.append(qk)
    q, k, v = (_heads(qk.inputs[0], [0, 2, 1, 3]), _heads(qk.inputs[1], [0, 2, 3, 1]),
               _heads(pv.inputs[1], [0, 2, 1, 3]))
    if q is None or k is None or v is None or not q[1] == k[1] == v[1] or q[2] != k[2]:
        return None
    if keep is not None and _dims(keep) != [_dims(q[0])[0], _dims(k[0])[1]]:
        return None  # the kernel takes a [B,S] mask, not one broadcast over the batch
    back = sole_reader(pv.outputs[0])
    if back is None or back.op_type != "Transpose" or back.domain != "" or _perm(back) != [0, 2, 1, 3]:
        return None
    merge = sole_reader(back.outputs[0])
    if merge is None or merge.op_type != "Reshape" or merge.domain != "":
        return None
    merged = _dims(merge.outputs[0])
    if merged is None or len(merged) != 3 or merged[2] != v[1] * v[2]:
        return None
    dtypes = {t[0].dtype for t in (q, k, v)}
    if len(dtypes) != 1 or dtypes.pop() not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):  # what the kernels take
        return None
    return {"q": q, "k": k, "v": v, "scale": scale, "keep": keep, "fill": fill,
            "pattern": pattern + [back, merge] + q[3] + k[3] + v[3], "out": merge.outputs[0]}


def _bias(x3: ir.Value, reshape: ir.Node) -> tuple[ir.Value, ir.Value] | None:
    """(x, b) where x3 = Add(x, b), b a 1-D constant over x3's last axis, and only `reshape`
    reads x3; else None."""
    add = producer(x3, "Add")
    if add is None or sole_reader(x3) is not reshape:
        return None
    for i, b in enumerate(add.inputs):
        other = add.inputs[1 - i]
        if (b is not None and other is not None and b.is_initializer() and b.const_value is not None
                and list(b.const_value.shape) == _dims(x3)[2:] and _dims(other) == _dims(x3)):
            return other, b
    return None


def _filter_value(fill: float, dtype: ir.DataType) -> float:
    """The score a masked key gets inside the kernel: the Where's fill, except that fp16's minimum
    becomes fp32's. The kernels add it in fp32, where fp16's minimum does not swamp the scores: a
    row with nothing to attend to would take a softmax over its masked scores, where the written-out
    graph (and torch) average its values."""
    if dtype == ir.DataType.FLOAT16 and fill <= float(np.finfo(np.float16).min):
        return float(np.finfo(np.float32).min)
    return float(fill)


def _int32_mask(graph: ir.Graph, keep: ir.Value, made: dict[int, ir.Value]) -> ir.Value:
    """The int32 key_padding_mask of a bool keep mask: one Cast per mask, shared by the layers,
    placed right after the mask is made (first in the graph for a graph input)."""
    if id(keep) not in made:
        cast = ir.node("Cast", [keep], {"to": ir.DataType.INT32}, name=f"{keep.name}/int32")
        if keep.producer() is not None:
            graph.insert_after(keep.producer(), cast)
        else:
            graph.insert_before(graph.node(0), cast)
        cast.outputs[0].name = f"{keep.name}.int32"
        made[id(keep)] = cast.outputs[0]
    return made[id(keep)]


def run(graph: ir.Graph) -> int:
    fired = 0
    masks: dict[int, ir.Value] = {}
    for node in list(graph):
        if node.op_type != "Softmax" or node.domain != "":
            continue
        m = _match(node)
        if m is None:
            continue
        (q3, heads, _, (q_rs, _)), (k3, _, _, (k_rs, _)), (v3, _, _, (v_rs, _)) = m["q"], m["k"], m["v"]
        out, pattern = m["out"], m["pattern"]
        inputs: list[ir.Value | None] = [q3, k3, v3, None]
        biased = [_bias(x3, rs) for x3, rs in ((q3, q_rs), (k3, k_rs), (v3, v_rs))]
        if len({id(q3), id(k3), id(v3)}) == 3 and all(biased):
            name = f"{out.name}.qkv_bias"
            bias = np.concatenate([b.const_value.numpy() for _, b in biased]).astype(q3.dtype.numpy())
            value = ir.Value(name=name, const_value=ir.tensor(bias, name=name), shape=ir.Shape(bias.shape),
                             type=ir.TensorType(q3.dtype))
            graph.register_initializer(value)
            inputs = [x for x, _ in biased] + [value]
            pattern += [x3.producer() for x3 in (q3, k3, v3)]
        attributes = {"num_heads": heads, "scale": float(m["scale"])}
        if m["keep"] is not None:
            inputs.append(_int32_mask(graph, m["keep"], masks))
            attributes["mask_filter_value"] = _filter_value(m["fill"], q3.dtype)
        while inputs[-1] is None:
            inputs.pop()
        fused = ir.node("MultiHeadAttention", inputs, attributes, domain=DOMAIN, name=f"{out.name}/MultiHeadAttention")
        graph.insert_before(out.producer(), fused)  # after every input: the merge reads them all, through the pattern
        out.replace_all_uses_with(fused.outputs[0], replace_graph_outputs=True)
        fused.outputs[0].name, out.name = out.name, f"{out.name}.unfused"
        remove_unread(graph, pattern)
        fired += 1
    if fired:
        graph.opset_imports.setdefault(DOMAIN, 1)
    return fired
