"""Export a deep stack by tracing two of its layers and repeating the second in the ONNX graph.

torch.export and the ONNX exporter's decomposition retrace cost grows with every layer traced
(docs/export.md has the figures), almost all of it symbolic shape reasoning that is the same in
every layer. When every
layer of a stack after the first is configured alike, specc traces the model with the first two
layers of that stack (the same parameter objects, no copy) and writes layers 2..N-1 into the
graph as copies of layer 1's nodes, each reading its own layer's weights, its own cache inputs
and the previous copy's output.

It is done only where it is provably what the whole trace would give:
- the resolved layers 1..N-1 are equal but for their index (no per-layer pattern, no BigBird
  random blocks that differ), so the torch code of layers 2..N-1 is layer 1's with other weights;
- in the traced graph, layer 0 and layer 1 are the same nodes in the same order (op, domain,
  attributes) wired the same way: what layer 1 takes from layer 0, layer 0 takes from before the
  stack; what layer 1 takes from its own nodes, layer 0 takes from its own; weights and cache
  inputs differ only by the layer's index; everything else is the same value. Every node of a
  layer is found by the module path the exporter records on it (the `namespace` metadata).
Anything else (a node of a layer without that metadata, a value of layer 0 read after the stack)
leaves the stitch undone, and the model is traced whole. The build's numerical verification then
checks the graph as it checks any other.
"""
from __future__ import annotations

import contextlib
import copy
from dataclasses import replace

import numpy as np

from specc.spec.io import parse_cache

KEEP = 2  # layers traced per stitched stack: layer 0, and layer 1 as the pattern of the rest
# graph.meta key (not written): {role: [each layer's output value]} where one value goes from
# layer to layer, for saying which layer of a failed streamed build is wrong (specc/export/diagnose.py)
LAYER_OUTPUTS = "specc.layer_outputs"


class NotStitchable(Exception):
    """Why a traced graph cannot be stitched; the model is traced whole instead."""


def stitch_plan(r, sig) -> dict[str, int]:
    """{stack role: layers} for the stacks of this graph that can be traced with KEEP layers:
    more than KEEP layers, and layers 1..N-1 configured alike."""
    plan = {}
    for stack in (r.encoder, r.decoder):
        # an encoder-decoder's encoder graph also makes each decoder layer's cross-attention K/V,
        # outside that layer's forward (no module path on the nodes): that part is traced whole
        if stack is None or len(stack.layers) <= KEEP or sig.name not in ("model", stack.role):
            continue
        first = stack.layers[1].model_copy(update={"index": 0})
        if all(layer.model_copy(update={"index": 0}) == first for layer in stack.layers[2:]):
            plan[stack.role] = len(stack.layers)
    return plan


def deep_stacks(r) -> list[str]:
    """The roles of the stacks deeper than KEEP layers: those a stitch or a streamed build concerns."""
    return [s.role for s in (r.encoder, r.decoder) if s is not None and len(s.layers) > KEEP]


def streamable(r) -> tuple[str, ...] | str:
    """The stacks a streamed build makes one layer at a time, or why the spec cannot be built
    streamed: every stack deeper than KEEP layers must be stitched in every graph that runs it
    (stitch_plan), which an encoder-decoder's encoder graph is not."""
    if r.architecture == "encoder-decoder":
        return "an encoder-decoder's encoder graph makes the decoder layers' cross-attention keys and values"
    deep = deep_stacks(r)
    if not deep:
        return f"no stack has more than {KEEP} layers"
    for sig in r.graphs:
        missing = [role for role in deep if role not in stitch_plan(r, sig)]
        if missing:
            return f"the layers of the {missing[0]} stack are not all alike (a per-layer pattern)"
    return tuple(deep)


def truncated(model, roles):
    """A shallow copy of a SpeccModel whose `roles` stacks hold their first KEEP layers (the same
    module objects: no parameter is copied)."""
    from torch import nn

    short = copy.copy(model)
    short._modules = dict(model._modules)
    for role in roles:
        stack = copy.copy(model._modules[role])
        stack._modules = dict(stack._modules)
        stack._modules["layers"] = nn.ModuleList(list(stack.layers)[:KEEP])
        short._modules[role] = stack
    return short


def truncated_sig(sig, plan: dict[str, int]):
    """The IO signature of truncated(model, plan): per-layer inputs and outputs (past_key_values.N.*,
    present.N.*, which belong to the decoder stack) of layers >= KEEP left out when the decoder
    is truncated, else the signature unchanged."""
    if "decoder" not in plan:
        return sig

    def kept(t) -> bool:
        parsed = parse_cache(t.name)
        return parsed is None or parsed[1].layer < KEEP

    return sig.model_copy(update={"inputs": tuple(t for t in sig.inputs if kept(t)),
                                  "outputs": tuple(t for t in sig.outputs if kept(t))})


@contextlib.contextmanager
def layer_weights_hidden(graph, plan: dict[str, int], root: str = "model."):
    """Inside, the weights and buffers of the planned stacks' layers are graph inputs with no
    value: what optimizes the traced layers before they are copied (onnx.prefold) can then make
    no choice that depends on layer 1's values, which the copies do not share. The graph's
    initializers are back, in their order, afterwards."""
    prefixes = tuple(f"{root}{role}.layers." for role in plan)
    order = list(graph.initializers)
    hidden = {name: graph.initializers[name] for name in order if name.startswith(prefixes)}
    saved = {}
    for name, value in hidden.items():
        saved[name] = value.const_value
        graph.initializers.pop(name)
        value.const_value = None
        graph.inputs.append(value)
    try:
        yield
    finally:
        for value in hidden.values():
            graph.inputs.remove(value)
        rest = dict(graph.initializers)
        graph.initializers.clear()
        for name, value in hidden.items():
            value.const_value = saved[name]
        for name in order:  # the traced order first, then what was added inside
            if name in hidden:
                graph.initializers[name] = hidden[name]
            elif name in rest:
                graph.initializers[name] = rest.pop(name)
        graph.initializers.update(rest)


def _in_layer(node, prefix: str) -> bool:
    ns = node.metadata_props.get("namespace") or ""
    for part in ns.split("/"):
        path = part.split(":", 1)[0].strip()
        if path == prefix or path.startswith(prefix + "."):
            return True
    return False


def _layer_name(name: str, prefix_from: str, prefix_to: str) -> str | None:
    """A weight's name with its layer swapped, or None when it is not that layer's weight."""
    return prefix_to + name[len(prefix_from):] if name.startswith(prefix_from + ".") else None


def _io_name(name: str, layer: int) -> str | None:
    """Layer 1's cache input or output under `layer`'s name (past_key_values.1.key ->
    past_key_values.<layer>.key); None for a name of no layer, or of another layer."""
    parsed = parse_cache(name)
    if parsed is None or parsed[1].layer != 1:
        return None
    prefix, slot = parsed
    return replace(slot, layer=layer).name(prefix)


def _tensor_key(tensor):
    arr = tensor.numpy()
    return str(arr.dtype), arr.shape, np.ascontiguousarray(arr).tobytes()


def _attr_key(attr):
    import onnx_ir as ir

    if attr.is_ref():
        raise NotStitchable(f"reference attribute {attr.name}")
    if attr.type in (ir.AttributeType.GRAPH, ir.AttributeType.GRAPHS):
        raise NotStitchable(f"a node with a subgraph ({attr.name})")
    value = attr.value
    if attr.type == ir.AttributeType.TENSOR:
        return attr.name, _tensor_key(value)
    if attr.type == ir.AttributeType.TENSORS:
        return attr.name, tuple(map(_tensor_key, value))
    return attr.name, int(attr.type), tuple(value) if isinstance(value, list) else value


def _node_key(node):
    """What two nodes must share to compute alike from alike inputs."""
    return (node.op_type, node.domain, node.overload, node.version, len(node.inputs), len(node.outputs),
            sorted(map(_attr_key, node.attributes.values())))


def _same_constant(a, b) -> bool:
    return a.const_value is not None and b.const_value is not None and \
        _tensor_key(a.const_value) == _tensor_key(b.const_value)


def _constant_node(node):
    return node if node is not None and node.op_type == "Constant" and node.domain == "" else None


def _constant(value):
    """The Constant node that makes `value`, or None."""
    return _constant_node(value.producer())


class _Layer:
    """The nodes of one layer of a stack in graph order, its Constant nodes aside: the exporter
    makes a constant once and lets later layers read it, so constants are matched by value."""

    def __init__(self, graph, role: str, index: int, root: str):
        self.prefix = f"{root}{role}.layers.{index}"
        self.nodes = [n for n in graph if _in_layer(n, self.prefix) and _constant_node(n) is None]
        self.ids = {id(n) for n in self.nodes}

    def owns(self, value) -> bool:
        producer = value.producer()
        return producer is not None and id(producer) in self.ids


class ModuleWeights:
    """A module's own tensors by module path: the source of an in-memory build's copies."""

    def __init__(self, model):
        self.model = model

    def tensor(self, name: str):
        try:
            return self.model.get_parameter(name).detach()
        except AttributeError:
            return self.model.get_buffer(name)


def stitch(graph, source, plan: dict[str, int], root: str = "model.", lazy: bool = False) -> dict[str, int]:
    """Repeat layer 1 of each planned stack in `graph` (an onnx_ir Graph traced from
    truncated(model, plan)) until the stack has its full depth. `source` gives the whole model's
    tensors by module path (specc/nn/streamed.py: the module itself, or a streamed build's layers
    made one at a time); `root` is the prefix of its parameter names in the graph. `lazy`: the
    copies' weights are asked of the source only when they are read (written), not now.
    Returns {role: nodes added}. Raises NotStitchable when the traced layers do not match (see
    the module's doc); the graph may then be partly changed, so the caller traces again."""
    checked = {role: _check(graph, role, root) for role in plan}  # every stack first: all or nothing
    added = {role: _repeat(graph, source, lazy, role, plan[role], root, *checked[role]) for role in plan}
    names = [v.name for v in graph.inputs] + list(graph.initializers) + [o.name for n in graph for o in n.outputs]
    if len(names) != len(set(names)):
        raise NotStitchable("a copied value's name is taken")
    return added


def _check(graph, role: str, root: str):
    """Match layer 0's nodes with layer 1's. Returns (layer 1, pair: layer 0 value ->
    layer 1 value, chain: layer 1 input values that layer 0 produced, extra: nodes outside the
    layers that each copy makes again, see _expression)."""
    order = {id(n): i for i, n in enumerate(graph)}
    l0, l1 = _Layer(graph, role, 0, root), _Layer(graph, role, 1, root)
    if not l0.nodes or len(l0.nodes) != len(l1.nodes):
        raise NotStitchable(f"{role} layers 0 and 1 have {len(l0.nodes)} and {len(l1.nodes)} nodes")
    end = order[id(l1.nodes[-1])]
    initializers = graph.initializers
    pair, chain, extra = {}, set(), {}
    for n0, n1 in zip(l0.nodes, l1.nodes):
        if _node_key(n0) != _node_key(n1):
            raise NotStitchable(f"{role} layers 0 and 1 differ at {n0.op_type} / {n1.op_type}")
        for a, b in zip(n0.inputs, n1.inputs):
            if a is None or b is None:
                if a is not b:
                    raise NotStitchable(f"{role}: an optional input of a {n1.op_type} is given in one layer only")
            elif _constant(b) is not None:  # read where it is, by every copy
                if _constant(a) is None or _node_key(_constant(a)) != _node_key(_constant(b)):
                    raise NotStitchable(f"{role}: layers 0 and 1 read different constants ({a.name}, {b.name})")
            elif l1.owns(b):
                if pair.get(a) is not b:
                    raise NotStitchable(f"{role}: layer 1 reads {b.name} where layer 0 reads {a.name}")
            elif l0.owns(b):  # what layer 1 takes from layer 0, layer 0 takes from before the stack
                if l0.owns(a):
                    raise NotStitchable(f"{role}: {b.name} goes from layer 0 to layer 1, {a.name} is layer 0's own")
                chain.add(b)
            elif b.name in initializers:
                moved = _layer_name(b.name, l1.prefix, l0.prefix)
                if moved is not None:
                    if a.name != moved:
                        raise NotStitchable(f"{role}: layer 1 reads {b.name} where layer 0 reads {a.name}")
                elif a is not b and not (a.name in initializers and _same_constant(a, b)):
                    raise NotStitchable(f"{role}: layers 0 and 1 read the constants {a.name} and {b.name}")
            elif b.is_graph_input():
                moved = _io_name(b.name, 0)
                if (a.name != moved) if moved is not None else (a is not b):
                    raise NotStitchable(f"{role}: layer 1 reads the input {b.name} where layer 0 reads {a.name}")
            else:  # made outside both layers
                found = None if l0.owns(a) else _expression(a, b, l0, l1)
                if found is None:
                    raise NotStitchable(f"{role}: layer 1 reads {b.name} where layer 0 reads {a.name}")
                for node in found[1]:
                    extra[id(node)] = node
        for a, b in zip(n0.outputs, n1.outputs):
            pair[a] = b
    for value in pair:  # layer 0's values go to layer 1 or out as its own cache, nowhere else
        for user, _ in value.uses():
            if id(user) not in l0.ids and id(user) not in l1.ids:
                raise NotStitchable(f"{role}: {value.name} of layer 0 is read after the stack")
    for value in pair.values():
        for user, _ in value.uses():
            if id(user) not in l1.ids and order[id(user)] <= end:
                raise NotStitchable(f"{role}: {value.name} of layer 1 is read inside the stack")
    return l1, pair, chain, sorted(extra.values(), key=lambda n: order[id(n)])


def _expression(a, b, l0, l1, depth: int = 8):
    """How layer 1 reads b where layer 0 reads a, both made outside the layers (the exporter
    computes sizes such as past + new tokens outside any module, once per layer): None when they
    are not the same expression; else (per_layer, nodes): per_layer when it reads a layer's own
    cache input (past_key_values.0.* in a, .1.* in b), and then `nodes`, b's expression, is
    copied for every layer; otherwise every copy reads b."""
    if a is b:
        return False, []
    if a.is_graph_input() and b.is_graph_input():
        return (True, []) if _io_name(b.name, 0) == a.name else None
    if depth == 0 or l0.owns(a) or l1.owns(a) or l0.owns(b) or l1.owns(b):
        return None
    na, nb = a.producer(), b.producer()
    if na is None or nb is None or len(na.outputs) != 1 or len(nb.outputs) != 1:
        return None
    if _node_key(na) != _node_key(nb):
        return None
    orders = [list(nb.inputs)]
    if na.op_type in _COMMUTATIVE and na.domain == "" and len(nb.inputs) == 2:
        orders.append(orders[0][::-1])  # a + b where the other layer has b + a
    for inputs in orders:
        found = _inputs_expression(na.inputs, inputs, l0, l1, depth)
        if found is not None:
            per_layer, nodes = found
            return (True, [*nodes, nb]) if per_layer else (False, [])
    return None


_COMMUTATIVE = {"Add", "Mul", "Max", "Min"}


def _inputs_expression(xs, ys, l0, l1, depth: int):
    per_layer, nodes = False, []
    for x, y in zip(xs, ys):
        if x is None or y is None:
            if x is not y:
                return None
            continue
        sub = _expression(x, y, l0, l1, depth - 1)
        if sub is None:
            return None
        per_layer = per_layer or sub[0]
        nodes += sub[1]
    return per_layer, nodes


def _repeat(graph, weights, lazy: bool, role: str, layers: int, root: str, l1, pair, chain, extra) -> int:
    import onnx_ir as ir

    prev: dict = {}  # layer k-1's copy of each layer 1 value (layer 1: the values themselves)
    copies: list[dict] = []
    new_nodes, new_inputs, new_outputs = [], {}, {}
    outputs = {id(v): i for i, v in enumerate(graph.outputs)}
    last = l1.nodes[-1]
    for k in range(2, layers):
        prefix = f"{root}{role}.layers.{k}"
        copy: dict = {}

        def source(b):
            if b is None:
                return None
            if b in copy:
                return copy[b]
            if b in chain:  # layer 0's value in layer 1 -> layer 1's value in layer 2 -> ...
                counterpart = pair[b]
                return prev.get(counterpart, counterpart)
            if b.name in graph.initializers:
                name = _layer_name(b.name, l1.prefix, prefix)
                if name is None:
                    return b
                if name not in graph.initializers:
                    graph.register_initializer(_weight(weights, lazy, b, name, root))
                return graph.initializers[name]
            if b.is_graph_input() and _io_name(b.name, k) is not None:
                name = _io_name(b.name, k)
                if name not in new_inputs:
                    new_inputs[name] = ir.Value(name=name, shape=b.shape.copy(), type=b.type)
                return new_inputs[name]
            return b

        for n1 in (*extra, *l1.nodes):
            attrs = [ir.Attr(a.name, a.type, a.value) for a in n1.attributes.values()]
            meta = {key: val.replace(l1.prefix, prefix) for key, val in n1.metadata_props.items()}
            node = ir.Node(n1.domain, n1.op_type, [source(b) for b in n1.inputs], attrs,
                           overload=n1.overload, num_outputs=len(n1.outputs), version=n1.version,
                           name=f"{n1.name}__{k}", metadata_props=meta)
            for old, new in zip(n1.outputs, node.outputs):
                io = _io_name(old.name, k) if id(old) in outputs else None
                new.name = io if io is not None else f"{old.name}__{k}"
                new.shape = old.shape.copy() if old.shape is not None else None
                new.type = old.type
                copy[old] = new
                if io is not None:
                    new_outputs[io] = new
            new_nodes.append(node)
        prev = copy
        copies.append(copy)
    graph.insert_after(last, new_nodes)
    if len(chain) == 1:  # one value goes from layer to layer (the residual stream): each layer's output
        (b,) = chain
        graph.meta.setdefault(LAYER_OUTPUTS, {})[role] = [b, pair[b], *[c[pair[b]] for c in copies]]
    # what read layer 1's output after the stack now reads the last copy's
    added = {id(n) for n in new_nodes}
    for old, new in prev.items():
        if not l1.owns(old):
            continue
        for user, index in list(old.uses()):
            if id(user) not in l1.ids and id(user) not in added:
                user.replace_input_with(index, new)
        if id(old) in outputs and _io_name(old.name, 1) is None:  # a whole-graph output: moves
            name = old.name
            old.name = f"{name}__1"
            new.name = name
            graph.outputs[outputs[id(old)]] = new
    graph.inputs.extend(new_inputs.values())
    graph.outputs.extend(new_outputs.values())
    return len(new_nodes)


def _weight(source, lazy: bool, template, name: str, root: str):
    """An initializer for `name` (a parameter or buffer of the model, by its path after `root`),
    shaped and typed as `template`: the source's own tensor (no copy) in template's dtype, or with
    `lazy`, a tensor that asks the source for it each time it is read."""
    import onnx_ir as ir

    path = name[len(root):]
    kind = type(template.const_value)  # the exporter's own tensor kind, over a torch tensor
    dtype = template.const_value.raw.dtype
    shape = tuple(template.shape.numpy())

    def tensor():
        try:
            t = source.tensor(path)
        except AttributeError:
            raise NotStitchable(f"{name} is not a parameter or buffer of the model") from None
        if tuple(t.shape) != shape:
            raise NotStitchable(f"{name} is {tuple(t.shape)}, layer 1's is {shape}")
        return kind(t.detach().to(dtype), name=name)

    value = ir.LazyTensor(tensor, dtype=template.const_value.dtype, shape=template.shape.copy(), name=name) if lazy else tensor()
    return ir.Value(name=name, shape=template.shape.copy(), type=template.type, const_value=value)


def order_io(graph, sig) -> None:
    """Put the graph's inputs and outputs in the IO signature's order (copies were appended)."""
    for values, wanted in ((graph.inputs, sig.inputs), (graph.outputs, sig.outputs)):
        by_name = {v.name: v for v in values}
        missing = [t.name for t in wanted if t.name not in by_name]
        if missing or len(by_name) != len(wanted):
            raise NotStitchable(f"stitched graph's IO {sorted(by_name)} is not the signature's (missing {missing})")
        values.clear()
        values.extend(by_name[t.name] for t in wanted)
