"""Merge the integer products that read one input: MatMulNBits nodes with the same input, the same
attributes (but N) and constant weights (a layer's q, k and v projections; an FFN's gate and up)
become one MatMulNBits over their weights stacked along N, whose output a Split cuts back into
theirs. A decode step then makes one call where it made two or three, each reading the same bytes.

Exact on the CPU: MatMulNBits computes each output column from its own row of codes and scales
and the input's blocks (at accuracy level 4, the input rounded to 8 bits once per block, the same
for every column), so a merged product's columns are the members' bit for bit
(tests/export/test_merge_products.py compares the logits), where every member's N is a multiple
of 16 (`_alone`). A GPU's kernels may choose another algorithm for another N: there the merged
graph is verified like any other.

Where each member is in the offset form (quantize.py's and ggufgraph.py's: y = codes product +
(block sums of x) @ offsets, an Add of the two), the members' offsets products, which read the
same block sums, merge too, and one Add before the Split takes the place of theirs.

This pass runs after quantization (it reads the products the quantizers write), on the graphs
the onnxruntime passes run on. The merged constants are lazy: made when the graph is written,
member by member (so a quantizer's one-weight cache packs each member once), and let go as each
is written.
"""
from __future__ import annotations

import numpy as np
import onnx_ir as ir

from specc.export.passes.match import other_input, remove_unread, sole_reader

DOMAIN = "com.microsoft"


def run(graph: ir.Graph) -> int:
    """Merge each group of sibling products (two or more); returns how many groups."""
    order = {id(node): i for i, node in enumerate(graph)}
    groups: dict[tuple, list[tuple[ir.Node, _Offsets | None]]] = {}
    for node in graph:
        key = _key(node)
        if key is not None:
            offsets = _offsets(node)
            if _alone(node, offsets):
                continue
            groups.setdefault((*key, id(offsets.sums) if offsets else None), []).append((node, offsets))
    merged = 0
    for members in groups.values():
        if len(members) > 1:
            _merge(graph, [m for m, _ in members], [o for _, o in members], order)
            merged += 1
    return merged


class _Offsets:
    """A product's offset form: its Add of the codes product and `matmul` = sums @ offsets, where
    `offsets` is a constant [blocks, N], or the Transpose of a constant [N, blocks]."""

    def __init__(self, add: ir.Node, matmul: ir.Node, constant: ir.Value, transposed: bool):
        self.add, self.matmul, self.constant, self.transposed = add, matmul, constant, transposed
        self.sums = matmul.inputs[0]


def _constant(value: ir.Value | None) -> bool:
    return value is not None and value.is_initializer() and value.const_value is not None


def _key(node: ir.Node) -> tuple | None:
    """What a product must share with its siblings to merge with them (its input, attributes but
    N, and which constant inputs it has), or None where it cannot merge: not a MatMulNBits, an
    input other than codes, scales and zero points (a g_idx, a bias), or one not constant."""
    if node.op_type != "MatMulNBits" or node.domain != DOMAIN:
        return None
    inputs = list(node.inputs)
    if len(inputs) not in (3, 4) or inputs[0] is None or not all(_constant(v) for v in inputs[1:]):
        return None
    attributes = tuple(sorted((name, attr.value) for name, attr in node.attributes.items() if name != "N"))
    return (id(inputs[0]), attributes, tuple((v.const_value.dtype, tuple(v.const_value.shape)[1:]) for v in inputs[1:]))


def _alone(node: ir.Node, offsets: _Offsets | None) -> bool:
    """Whether the product stays as it is: its result is a graph output (a head, whose in-place
    graph reads a call's last positions alone: specc/export/inplace.py), its constants are read by
    other nodes too (a merge would hold them twice: a GGUF file's 8-bit codes split in two planes
    share their scales with a Mul), or its N is no multiple of 16 (onnxruntime's CPU kernel sums a
    row's tail columns in another order than the rest, so a column moved past such a member would
    round differently)."""
    result = offsets.add.outputs[0] if offsets is not None else node.outputs[0]
    readers = {node} | ({offsets.matmul} if offsets is not None else set())
    constants = list(node.inputs[1:]) + ([offsets.matmul.inputs[1]] if offsets is not None else [])
    return result.is_graph_output() or int(node.attributes["N"].value) % 16 != 0 or \
        any(use.node not in readers for value in constants for use in value.uses())


def _offsets(node: ir.Node) -> _Offsets | None:
    """The product's offset form, where its output goes to one Add alone, whose other operand is a
    MatMul of block sums by constant offsets that nothing else reads; else None."""
    add = sole_reader(node.outputs[0])
    if add is None or add.op_type != "Add" or add.domain != "":
        return None
    other = other_input(add, node.outputs[0])
    matmul = other.producer() if other is not None else None
    if matmul is None or matmul.op_type != "MatMul" or matmul.domain != "" or sole_reader(other) is not add:
        return None
    constant, transposed = matmul.inputs[1], False
    producer = constant.producer() if constant is not None else None
    if producer is not None and producer.op_type == "Transpose" and producer.domain == "" and \
            list(producer.attributes.get_ints("perm", [1, 0])) == [1, 0]:
        constant, transposed = producer.inputs[0], True
    shape = constant.const_value.shape if _constant(constant) else None
    if shape is None or len(shape) != 2 or shape[0 if transposed else 1] != node.attributes["N"].value:
        return None
    return _Offsets(add, matmul, constant, transposed)


class _Stacked:
    """The members' constants stacked along N, made together when the first is written (member by
    member, each member's read one after another) and each let go once written. It holds the
    constant values themselves: the members' nodes leave the graph."""

    FIELDS = ("codes", "scales", "zero_points")

    def __init__(self, members: list[ir.Node], offsets: list[_Offsets | None]):
        count = len(members[0].inputs) - 1
        self.inputs = [list(node.inputs[1:1 + count]) for node in members]  # per member: codes, scales[, zero points]
        self.offsets = [(o.constant, o.transposed) for o in offsets] if offsets[0] is not None else []
        self.made: dict[str, np.ndarray] = {}

    def fields(self) -> list[str]:
        return list(self.FIELDS[:len(self.inputs[0])]) + (["offsets"] if self.offsets else [])

    def _offsets(self, i: int) -> np.ndarray:
        constant, transposed = self.offsets[i]
        array = constant.const_value.numpy()
        return array.T if transposed else array  # [blocks, N]

    def take(self, field: str) -> np.ndarray:
        if field not in self.made:
            # the first read makes every field (a member's fields read together); a second read
            # of one, while others wait to be written, makes that one alone
            fields = [field] if self.made else self.fields()
            parts: dict[str, list[np.ndarray]] = {f: [] for f in fields}
            for i, values in enumerate(self.inputs):
                for f, value in zip(self.FIELDS, values):
                    if f in parts:
                        parts[f].append(value.const_value.numpy())
                if "offsets" in parts:
                    parts["offsets"].append(self._offsets(i))
            self.made.update({f: np.ascontiguousarray(np.concatenate(p, axis=1 if f == "offsets" else 0))
                              for f, p in parts.items()})
        return self.made.pop(field)

    def value(self, field: str, name: str) -> ir.Value:
        """The lazy initializer of one stacked field."""
        if field == "offsets":
            shapes = [(c.const_value.shape[::-1] if t else c.const_value.shape) for c, t in self.offsets]
            shape, dtype = [int(shapes[0][0]), sum(int(s[1]) for s in shapes)], self.offsets[0][0].const_value.dtype
        else:
            values = [member[self.FIELDS.index(field)] for member in self.inputs]
            dims = [list(v.const_value.shape) for v in values]
            shape, dtype = [sum(d[0] for d in dims)] + dims[0][1:], values[0].const_value.dtype
        tensor = ir.LazyTensor(lambda: ir.tensor(self.take(field), name=name), dtype=dtype,
                               shape=ir.Shape(shape), name=name)
        return ir.Value(name=name, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=tensor)


def _merge(graph: ir.Graph, members: list[ir.Node], offsets: list[_Offsets | None], order: dict) -> None:
    first = members[0]
    stacked = _Stacked(members, offsets)
    base = f"{first.name}.merged"
    values = {f: stacked.value(f, f"{base}.{f}") for f in stacked.fields()}
    for v in values.values():
        graph.register_initializer(v)
    ns = [int(node.attributes["N"].value) for node in members]
    attributes = {name: attr.value for name, attr in first.attributes.items()}
    attributes["N"] = sum(ns)
    inputs = [first.inputs[0]] + [values[f] for f in _Stacked.FIELDS if f in values]
    product = ir.node("MatMulNBits", inputs, attributes=attributes, domain=DOMAIN, name=base)
    product.outputs[0].name = f"{base}.out"
    new = [product]
    out = product.outputs[0]
    if offsets[0] is not None:
        matmul = ir.node("MatMul", [offsets[0].sums, values["offsets"]], name=f"{base}.offsets_product")
        matmul.outputs[0].name = f"{base}.offsets_product"
        add = ir.node("Add", [out, matmul.outputs[0]], name=f"{base}.add")
        add.outputs[0].name = f"{base}.sum"
        new += [matmul, add]
        out = add.outputs[0]
        old = [o.add.outputs[0] for o in offsets]
        # after the block sums (made after the first member): before the first Add, which reads them
        at = min((o.add for o in offsets), key=lambda n: order[id(n)])
    else:
        old = [node.outputs[0] for node in members]
        at = first
    sizes = ir.Value(name=f"{base}.sizes", const_value=ir.tensor(np.array(ns, dtype=np.int64)))
    sizes.shape, sizes.type = sizes.const_value.shape, ir.TensorType(ir.DataType.INT64)
    graph.register_initializer(sizes)
    split = ir.node("Split", [out, sizes], attributes={"axis": -1}, num_outputs=len(members), name=f"{base}.split")
    new.append(split)
    graph.insert_before(at, new)
    for before, after in zip(old, split.outputs):
        name = before.name
        after.type, after.shape = before.type, before.shape
        before.replace_all_uses_with(after, replace_graph_outputs=True)
        before.name, after.name = f"{name}.unmerged", name
    removed = list(members) + [n for o in offsets if o is not None for n in (o.add, o.matmul)]
    removed += [o.matmul.inputs[1].producer() for o in offsets if o is not None and o.transposed]
    remove_unread(graph, removed)
