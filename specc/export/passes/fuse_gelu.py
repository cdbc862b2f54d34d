"""Fuse the exact (erf) GELU, x * 0.5 * (1 + erf(x / sqrt 2)), as the exporter spells it (five
elementwise nodes), into onnxruntime's com.microsoft `BiasGelu(y, b)` when x = y + b with a
constant bias b read by nothing else, else `Gelu(x)`: one pass over the [tokens, d_ff] tensor
instead of six. onnxruntime's own GeluFusion does not recognise the exporter's node order.

onnxruntime-only: the tensorrt target does not run it.
"""
from __future__ import annotations

import math

import onnx_ir as ir

from specc.export.passes.match import other_input, remove_unread, scalar, sole_reader

DOMAIN = "com.microsoft"


def _is(value: float | None, want: float) -> bool:
    """`value` is `want` as a constant of the graph's dtype holds it (fp16 rounds sqrt 2 by 1.1e-4)."""
    return value is not None and math.isclose(value, want, rel_tol=1e-3)


def _match(erf: ir.Node):
    """(x, the nodes to remove, the node whose output is the GELU) or None."""
    scale = erf.inputs[0].producer() if erf.inputs[0] is not None else None
    if scale is None or scale.domain != "" or sole_reader(erf.inputs[0]) is not erf:
        return None
    if scale.op_type == "Div" and _is(scalar(scale.inputs[1]), math.sqrt(2.0)):
        x = scale.inputs[0]
    elif scale.op_type == "Mul":
        x = next((i for i in scale.inputs if i is not None and not _is(scalar(i), 1 / math.sqrt(2.0))), None)
        if x is None or not _is(scalar(other_input(scale, x)), 1 / math.sqrt(2.0)):
            return None
    else:
        return None
    one = sole_reader(erf.outputs[0])
    if one is None or one.op_type != "Add" or not _is(scalar(other_input(one, erf.outputs[0])), 1.0):
        return None
    first = sole_reader(one.outputs[0])
    if first is None or first.op_type != "Mul":
        return None
    second = sole_reader(first.outputs[0])
    if second is None or second.op_type != "Mul":
        return None
    a, b = other_input(first, one.outputs[0]), other_input(second, first.outputs[0])
    # (0.5 * (1 + erf)) * x  or  (x * (1 + erf)) * 0.5
    if not ((_is(scalar(a), 0.5) and b is x) or (a is x and _is(scalar(b), 0.5))):
        return None
    return x, [scale, erf, one, first, second], second


def run(graph: ir.Graph) -> int:
    fired = 0
    for node in list(graph):
        if node.op_type != "Erf" or node.domain != "":
            continue
        found = _match(node)
        if found is None:
            continue
        x, removed, last = found
        if x.dtype not in (ir.DataType.FLOAT, ir.DataType.FLOAT16):  # what onnxruntime's kernels take
            continue
        inputs, name = [x], "Gelu"
        producer = x.producer()
        if (producer is not None and producer.op_type == "Add" and producer.domain == ""
                and len(list(x.uses())) == 2 and not x.is_graph_output()):
            consts = [i for i in producer.inputs if i is not None and i.const_value is not None and i.is_initializer()]
            if len(consts) == 1 and consts[0].const_value.numpy().ndim == 1:
                other = other_input(producer, consts[0])
                if other is not None:
                    inputs, name = [other, consts[0]], "BiasGelu"
                    removed.insert(0, producer)
        fused = ir.node(name, inputs, domain=DOMAIN, name=f"{last.name or 'gelu'}/{name}")
        graph.insert_before(removed[0], fused)
        last.outputs[0].replace_all_uses_with(fused.outputs[0], replace_graph_outputs=True)
        fused.outputs[0].name, last.outputs[0].name = last.outputs[0].name, f"{last.outputs[0].name}.unfused"
        remove_unread(graph, removed)
        graph.opset_imports.setdefault(DOMAIN, 1)
        fired += 1
    return fired
