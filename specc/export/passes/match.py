"""What the graph passes share: reading constants, following a value to the node that makes it
or the one node that reads it, and removing what a fusion left unread."""
from __future__ import annotations

import onnx_ir as ir


def scalar(value: ir.Value | None) -> float | None:
    """The value of a one-element float constant, else None."""
    if value is None or value.const_value is None:
        return None
    array = value.const_value.numpy()
    return float(array.reshape(())) if array.size == 1 and array.dtype.kind == "f" else None


def ints(value: ir.Value | None) -> list[int] | None:
    """The elements of an integer constant, else None."""
    if value is None or value.const_value is None:
        return None
    array = value.const_value.numpy()
    return [int(v) for v in array.reshape(-1)] if array.dtype.kind in "iu" else None


def producer(value: ir.Value | None, op: str) -> ir.Node | None:
    """The node of the default domain with type `op` that makes `value`, else None."""
    node = value.producer() if value is not None else None
    return node if node is not None and node.op_type == op and node.domain == "" else None


def sole_reader(value: ir.Value) -> ir.Node | None:
    """The one node that reads `value` once, where nothing else reads it and it is no graph
    output; else None."""
    uses = list(value.uses())
    return uses[0].node if len(uses) == 1 and not value.is_graph_output() else None


def other_input(node: ir.Node, value: ir.Value) -> ir.Value | None:
    """The other input of a two-input node that reads `value`, else None."""
    ins = list(node.inputs)
    if len(ins) != 2 or value not in ins:
        return None
    return ins[1] if ins[0] is value else ins[0]


def remove_unread(graph: ir.Graph, candidates: list[ir.Node]) -> None:
    """Remove those of `candidates` whose outputs nothing reads, until no more can go (a node that
    something outside the fusion still reads stays), and then the initializers only they read."""
    pending = list(dict.fromkeys(candidates))
    read: list[ir.Value] = []
    removed = True
    while removed:
        removed = False
        for node in list(pending):
            if all(not out.uses() and not out.is_graph_output() for out in node.outputs):
                read += [v for v in node.inputs if v is not None]
                graph.remove(node, safe=True)
                pending.remove(node)
                removed = True
    for value in dict.fromkeys(read):
        if value.is_initializer() and not value.uses() and not value.is_graph_input() and not value.is_graph_output():
            graph.initializers.pop(value.name, None)
