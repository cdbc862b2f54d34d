"""Export a deep stack by tracing its first layers and repeating them in the ONNX graph.

torch.export and the ONNX exporter's decomposition retrace cost grows with every layer traced
(docs/export.md has the figures), almost all of it symbolic shape reasoning that is the same in
every layer. When the layers of a stack repeat with a period P (P = 1: every layer configured
alike; P = 2: Gemma 2's alternating local and global layers; P = 6: Gemma 3's five local to one
global), specc traces the model with the first 2P layers of
that stack (the same parameter objects, no copy) and writes layers 2P..N-1 into the graph as
copies of layers P..2P-1, block by block (the last block may be partial), each copied layer
reading its own weights, its own cache inputs and the previous layer's output.

It is done only where it is provably what the whole trace would give:
- every resolved layer i is layer P + i mod P but for its index (no pattern other than the
  period, no BigBird random blocks that differ; with P = 1, layer 0 may differ), so the torch
  code of a copied layer is its twin's with other weights;
- in the traced graph, block 0 (layers 0..P-1) and block 1 (layers P..2P-1) are the same nodes
  in the same order (op, domain, attributes) wired the same way: what block 1 takes from block
  0, block 0 takes from before the stack; what block 1 takes from its own nodes, block 0 takes
  from its own; weights and cache inputs differ only by the layer's index (by P); everything
  else is the same value. Every node of a layer is found by the module path the exporter
  records on it (the `namespace` metadata).
Anything else (a node of a layer without that metadata, a value of block 0 read after the
stack; where the last block is partial, a traced layer that hands the next more than one value
or a value of block 1 other than its output read after the stack) leaves the stitch undone,
and the model is traced whole. The build's numerical verification then checks the graph as it
checks any other.
"""
from __future__ import annotations

import contextlib
import copy
import re
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from specc.spec.io import parse_cache

KEEP = 2  # the fewest layers traced per stitched stack: a stack of period 1 (layer 0, and layer 1 as the rest's pattern)
# graph.meta key (not written): {role: [each layer's output value]} where one value goes from
# layer to layer, for saying which layer of a failed streamed build is wrong (specc/export/diagnose.py)
LAYER_OUTPUTS = "specc.layer_outputs"


class NotStitchable(Exception):
    """Why a traced graph cannot be stitched; the model is traced whole instead."""


class Plan(NamedTuple):
    """How one deep stack is stitched: its depth, and the period its layers repeat in. Its first
    `kept` layers are traced; layer i past them copies layer twin(i)."""

    layers: int
    period: int

    @property
    def kept(self) -> int:
        return 2 * self.period

    def twin(self, index: int) -> int:
        """The traced layer that layer `index` is configured as (itself, where it is traced)."""
        return index if index < self.kept else self.period + index % self.period


def period(stack) -> int | None:
    """The smallest P, with more than 2P layers in the stack, such that every layer i is configured
    as layer P + i mod P but for its index (for P = 1, every layer but layer 0: a layer 0
    configured apart is left to the graph's check, which takes it where its nodes are layer 1's,
    e.g. a rotary base held in its own buffer); None where there is none."""
    configs = [_config(layer) for layer in stack.layers]
    n = len(configs)
    for p in range(1, (n - 1) // 2 + 1):
        if all(configs[i] == configs[p + i % p] for i in range(1 if p == 1 else 0, n)):
            return p
    return None


def _config(layer):
    """A layer's configuration but for its index: what two layers of a period share."""
    return layer.model_copy(update={"index": 0})


def repeats_from_first(r, stacks: dict[str, Plan]) -> bool:
    """Whether each planned stack's layer 0 is configured as the layer a period after it (period()
    lets a period of 1 leave layer 0 apart, for the graph's check to judge at export)."""
    return all(_config(r.stack(role).layers[0]) == _config(r.stack(role).layers[p.period]) for role, p in stacks.items())


def stitch_plan(r, sig) -> dict[str, Plan]:
    """{stack role: Plan} for the stacks of this graph that can be traced in part: more than
    KEEP layers, configured in a repeating period (period())."""
    plan = {}
    for stack in (r.encoder, r.decoder):
        # an encoder-decoder's encoder graph also makes each decoder layer's cross-attention K/V,
        # outside that layer's forward (no module path on the nodes): that part is traced whole
        if stack is None or len(stack.layers) <= KEEP or sig.name not in ("model", stack.role):
            continue
        p = period(stack)
        if p is not None:
            plan[stack.role] = Plan(len(stack.layers), p)
    return plan


def deep_stacks(r) -> list[str]:
    """The roles of the stacks deeper than KEEP layers: those a stitch or a streamed build concerns."""
    return [s.role for s in (r.encoder, r.decoder) if s is not None and len(s.layers) > KEEP]


def stitch_plans(r) -> dict[str, dict[str, Plan]]:
    """stitch_plan of each of the spec's graphs: {graph: {stack role: Plan}}."""
    return {sig.name: stitch_plan(r, sig) for sig in r.graphs}


def streamable(r, plans: dict[str, dict[str, Plan]] | None = None) -> dict[str, Plan] | str:
    """{role: Plan} of the stacks a streamed build makes one layer at a time, or why the spec
    cannot be built streamed: every stack deeper than KEEP layers must be stitched in every graph
    that runs it (stitch_plan), which an encoder-decoder's encoder graph is not. `plans`: the
    graphs' stitch_plans, where the caller has them."""
    if r.architecture == "encoder-decoder":
        return "an encoder-decoder's encoder graph makes the decoder layers' cross-attention keys and values"
    deep = deep_stacks(r)
    if not deep:
        return f"no stack has more than {KEEP} layers"
    graphs = stitch_plans(r) if plans is None else plans
    stacks = {}
    for sig in r.graphs:
        plan = graphs[sig.name]
        missing = [role for role in deep if role not in plan]
        if missing:
            return (f"the layers of the {missing[0]} stack do not repeat in a period of less than half its "
                    f"depth (a per-layer pattern)")
        stacks.update(plan)
    return stacks


def truncated(model, plan: dict[str, Plan]):
    """A shallow copy of a SpeccModel whose planned stacks hold their first `kept` layers (the
    same module objects: no parameter is copied)."""
    from torch import nn

    short = copy.copy(model)
    short._modules = dict(model._modules)
    for role, p in plan.items():
        stack = copy.copy(model._modules[role])
        stack._modules = dict(stack._modules)
        stack._modules["layers"] = nn.ModuleList(list(stack.layers)[:p.kept])
        short._modules[role] = stack
    return short


def truncated_sig(sig, plan: dict[str, Plan]):
    """The IO signature of truncated(model, plan): per-layer inputs and outputs (past_key_values.N.*,
    present.N.*, which belong to the decoder stack) of the layers not traced left out when the
    decoder is truncated, else the signature unchanged."""
    if "decoder" not in plan:
        return sig

    def kept(t) -> bool:
        parsed = parse_cache(t.name)
        return parsed is None or parsed[1].layer < plan["decoder"].kept

    return sig.model_copy(update={"inputs": tuple(t for t in sig.inputs if kept(t)),
                                  "outputs": tuple(t for t in sig.outputs if kept(t))})


@contextlib.contextmanager
def layer_weights_hidden(graph, plan: dict[str, Plan], root: str = "model."):
    """Inside, the weights and buffers of the planned stacks' layers are graph inputs with no
    value: what optimizes the traced layers before they are copied (onnx.prefold) can then make
    no choice that depends on the traced layers' values, which the copies do not share. The graph's
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


def _layer_pattern(stack: str):
    """Matches a module path of a layer of `stack` (model.decoder.layers), its index as group 1."""
    return re.compile(re.escape(stack) + r"\.(\d+)(?=\.|$)")


def _node_layer(node, pattern) -> int | None:
    """The layer of the stack `pattern` matches whose module path the node's `namespace` metadata
    names, or None."""
    ns = node.metadata_props.get("namespace") or ""
    for part in ns.split("/"):
        found = pattern.match(part.split(":", 1)[0].strip())
        if found is not None:
            return int(found.group(1))
    return None


def _shifted(name: str, stack: str, block: range, shift: int) -> str | None:
    """A weight's name of a layer in `block` of `stack` moved `shift` layers
    (model.decoder.layers.1.q.weight -> model.decoder.layers.3.q.weight), or None when it is not
    the weight of a layer in `block`."""
    if not name.startswith(stack + "."):
        return None
    index, dot, rest = name[len(stack) + 1:].partition(".")
    if not dot or not index.isdigit() or int(index) not in block:
        return None
    return f"{stack}.{int(index) + shift}.{rest}"


def _io_shifted(name: str, block: range, shift: int) -> str | None:
    """A cache input or output of a layer in `block` under the name of the layer `shift` on
    (past_key_values.1.key -> past_key_values.3.key); None for a name of no layer in `block`."""
    parsed = parse_cache(name)
    if parsed is None or parsed[1].layer not in block:
        return None
    prefix, slot = parsed
    return replace(slot, layer=slot.layer + shift).name(prefix)


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


class _Block:
    """The nodes of the layers `layers` (a range) of a stack in graph order, its Constant nodes
    aside (the exporter makes a constant once and lets later layers read it, so constants are
    matched by value); layer_of: each node's layer."""

    def __init__(self, graph, role: str, layers: range, root: str):
        self.stack = f"{root}{role}.layers"
        self.layers = layers
        pattern = _layer_pattern(self.stack)
        self.layer_of = {}
        self.nodes = []
        for n in graph:
            if _constant_node(n) is None:
                index = _node_layer(n, pattern)
                if index is not None and index in layers:
                    self.layer_of[id(n)] = index
                    self.nodes.append(n)
        self.ids = set(self.layer_of)

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


class _Checked(NamedTuple):
    """What _check finds in the traced graph: block 1 (layers P..2P-1); pair: block 0 value ->
    block 1 value; chain: block 1 inputs that block 0 produced; extra: nodes outside the layers
    that each copy makes again (see _expression); outs: each traced layer's output, the one value
    the next layer reads of it (None where a layer hands on several)."""

    b1: _Block
    pair: dict
    chain: set
    extra: list
    outs: list | None


def stitch(graph, source, plan: dict[str, Plan], root: str = "model.", lazy: bool = False) -> dict[str, int]:
    """Repeat layers P..2P-1 of each planned stack in `graph` (an onnx_ir Graph traced from
    truncated(model, plan)) until the stack has its full depth. `source` gives the whole model's
    tensors by module path (specc/nn/streamed.py: the module itself, or a streamed build's layers
    made one at a time); `root` is the prefix of its parameter names in the graph. `lazy`: every
    layer's weights, the traced layers' too, are asked of the source only when they are read
    (written), not now: a streamed build's short module may then hold none of its own
    (specc/nn/streamed.py's hollow layers).
    Returns {role: nodes added}. Raises NotStitchable when the traced layers do not match (see
    the module's doc); the graph may then be partly changed, so the caller traces again."""
    checked = {role: _check(graph, role, root, plan[role]) for role in plan}  # every stack first: all or nothing
    added = {role: _repeat(graph, source, lazy, role, plan[role], root, checked[role]) for role in plan}
    names = [v.name for v in graph.inputs] + list(graph.initializers) + [o.name for n in graph for o in n.outputs]
    if len(names) != len(set(names)):
        raise NotStitchable("a copied value's name is taken")
    if lazy:
        for role, p in plan.items():
            traced = range(p.kept)
            for name, value in list(graph.initializers.items()):
                if _shifted(name, f"{root}{role}.layers", traced, 0) is not None and value.const_value is not None:
                    value.const_value = _weight(source, True, value, name, root).const_value
    return added


def _check(graph, role: str, root: str, plan: Plan) -> _Checked:
    """Match block 0's nodes (layers 0..P-1) with block 1's (layers P..2P-1); where the last block
    copied is partial, see that the stack's output can be taken from the middle of block 1."""
    period = plan.period
    order = {id(n): i for i, n in enumerate(graph)}
    l0 = _Block(graph, role, range(0, period), root)
    l1 = _Block(graph, role, range(period, 2 * period), root)
    if not l0.nodes or len(l0.nodes) != len(l1.nodes):
        raise NotStitchable(f"{role} layers {_span(l0)} and {_span(l1)} have {len(l0.nodes)} and {len(l1.nodes)} nodes")
    end = order[id(l1.nodes[-1])]
    initializers = graph.initializers
    stack, back = l1.stack, -period
    pair, chain, extra = {}, set(), {}
    for n0, n1 in zip(l0.nodes, l1.nodes):
        if _node_key(n0) != _node_key(n1) or l1.layer_of[id(n1)] != l0.layer_of[id(n0)] + period:
            raise NotStitchable(f"{role} layers {_span(l0)} and {_span(l1)} differ at {n0.op_type} / {n1.op_type}")
        for a, b in zip(n0.inputs, n1.inputs):
            if a is None or b is None:
                if a is not b:
                    raise NotStitchable(f"{role}: an optional input of a {n1.op_type} is given in one layer only")
            elif _constant(b) is not None:  # read where it is, by every copy
                if _constant(a) is None or _node_key(_constant(a)) != _node_key(_constant(b)):
                    raise NotStitchable(f"{role}: layers read different constants ({a.name}, {b.name})")
            elif l1.owns(b):
                if pair.get(a) is not b:
                    raise NotStitchable(f"{role}: {_span(l1)} reads {b.name} where {_span(l0)} reads {a.name}")
            elif l0.owns(b):  # what block 1 takes from block 0, block 0 takes from before the stack
                if l0.owns(a):
                    raise NotStitchable(f"{role}: {b.name} goes from block {_span(l0)} to {_span(l1)}, "
                                        f"{a.name} is block {_span(l0)}'s own")
                chain.add(b)
            elif b.name in initializers:
                moved = _shifted(b.name, stack, l1.layers, back)
                if moved is not None:
                    if a.name != moved:
                        raise NotStitchable(f"{role}: a layer reads {b.name} where its twin reads {a.name}")
                elif a is not b and not (a.name in initializers and _same_constant(a, b)):
                    raise NotStitchable(f"{role}: layers read the constants {a.name} and {b.name}")
            elif b.is_graph_input():
                moved = _io_shifted(b.name, l1.layers, back)
                if (a.name != moved) if moved is not None else (a is not b):
                    raise NotStitchable(f"{role}: a layer reads the input {b.name} where its twin reads {a.name}")
            else:  # made outside both blocks
                found = None if l0.owns(a) else _expression(a, b, l0, l1)
                if found is None:
                    raise NotStitchable(f"{role}: a layer reads {b.name} where its twin reads {a.name}")
                for node in found[1]:
                    extra[id(node)] = node
        for a, b in zip(n0.outputs, n1.outputs):
            pair[a] = b
    for value in pair:  # block 0's values go to block 1 or out as its own cache, nowhere else
        for user, _ in value.uses():
            if id(user) not in l0.ids and id(user) not in l1.ids:
                raise NotStitchable(f"{role}: {value.name} of layers {_span(l0)} is read after the stack")
    for value in pair.values():
        for user, _ in value.uses():
            if id(user) not in l1.ids and order[id(user)] <= end:
                raise NotStitchable(f"{role}: {value.name} of layers {_span(l1)} is read inside the stack")
    outs = _layer_outputs(l0, l1, pair, period)
    if plan.layers % period:
        if outs is None:
            raise NotStitchable(f"{role}: a partial last block needs each layer's output, and a layer hands on several")
        outputs = {id(v) for v in graph.outputs}
        for value in pair.values():  # the stack's output, or a layer's own cache, and nothing else leaves block 1
            leaves = any(id(user) not in l1.ids for user, _ in value.uses()) or (
                id(value) in outputs and _io_shifted(value.name, l1.layers, 0) is None)
            if leaves and value is not outs[-1]:
                raise NotStitchable(f"{role}: {value.name} is read after the stack, and the last block is partial")
    return _Checked(l1, pair, chain, sorted(extra.values(), key=lambda n: order[id(n)]), outs)


def _span(block: _Block) -> str:
    return str(block.layers.start) if len(block.layers) == 1 else f"{block.layers.start}-{block.layers.stop - 1}"


def _layer_outputs(l0: _Block, l1: _Block, pair: dict, period: int) -> list | None:
    """Each of the 2P traced layers' output: the one value of it the next layer reads (the last
    one's: block 1's counterpart of block 0's last), or None where any layer hands on several."""
    layer_of = {**l0.layer_of, **l1.layer_of}
    outs = []
    for layer in range(2 * period - 1):
        handed = {id(v): v for n in (*l0.nodes, *l1.nodes) if layer_of[id(n)] == layer for v in n.outputs
                  if any(layer_of.get(id(user)) == layer + 1 for user, _ in v.uses())}
        if len(handed) != 1:
            return None
        outs.extend(handed.values())
    return [*outs, pair[outs[period - 1]]]


def _expression(a, b, l0, l1, depth: int = 8):
    """How block 1 reads b where block 0 reads a, both made outside the layers (the exporter
    computes sizes such as past + new tokens outside any module, once per layer): None when they
    are not the same expression; else (per_layer, nodes): per_layer when it reads a layer's own
    cache input (past_key_values.o.* in a, .P+o.* in b), and then `nodes`, b's expression, is
    copied for every block; otherwise every copy reads b."""
    if a is b:
        return False, []
    if a.is_graph_input() and b.is_graph_input():
        shift = l0.layers.start - l1.layers.start
        return (True, []) if _io_shifted(b.name, l1.layers, shift) == a.name else None
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


def _needed(nodes, extra) -> list:
    """The nodes of `extra` that `nodes` read, directly or through one another, in extra's order."""
    made = {o: n for n in extra for o in n.outputs}
    need, todo = set(), [v for n in nodes for v in n.inputs if v is not None]
    while todo:
        node = made.get(todo.pop())
        if node is not None and id(node) not in need:
            need.add(id(node))
            todo.extend(v for v in node.inputs if v is not None)
    return [n for n in extra if id(n) in need]


def _repeat(graph, weights, lazy: bool, role: str, plan: Plan, root: str, checked: _Checked) -> int:
    import onnx_ir as ir

    l1, pair, chain, extra, outs = checked
    period, stack = plan.period, l1.stack
    # (first layer, layers) of each block copied: whole blocks, then what is left of the stack
    blocks = [(k * period, period) for k in range(2, plan.layers // period)]
    if plan.layers % period:  # _check saw that it can be done
        blocks.append((plan.layers - plan.layers % period, plan.layers % period))
    prev: dict = {}  # the last block's copy of each block 1 value (block 1: the values themselves)
    copies: list[dict] = []
    new_nodes, new_inputs, new_outputs = [], {}, {}
    outputs = {id(v): i for i, v in enumerate(graph.outputs)}
    last = l1.nodes[-1]
    for first, count in blocks:
        shift = first - period
        layers = range(period, period + count)
        copy: dict = {}

        def source(b):
            if b is None:
                return None
            if b in copy:
                return copy[b]
            if b in chain:  # block 0's value in block 1 -> block 1's value in block 2 -> ...
                counterpart = pair[b]
                return prev.get(counterpart, counterpart)
            if l1.owns(b):  # of a layer of block 1 that this (partial) block does not copy
                raise NotStitchable(f"{role}: a copy of {_span(l1)} reads {b.name} of a layer it does not copy")
            if b.name in graph.initializers:
                name = _shifted(b.name, stack, layers, shift)
                if name is None:
                    return b
                if name not in graph.initializers:
                    graph.register_initializer(_weight(weights, lazy, b, name, root))
                return graph.initializers[name]
            name = _io_shifted(b.name, layers, shift) if b.is_graph_input() else None
            if name is not None:
                if name not in new_inputs:
                    new_inputs[name] = ir.Value(name=name, shape=b.shape.copy(), type=b.type)
                return new_inputs[name]
            return b

        nodes = [n for n in l1.nodes if l1.layer_of[id(n)] in layers]
        for n1 in (*(_needed(nodes, extra) if count < period else extra), *nodes):
            index = l1.layer_of.get(id(n1))
            if index is None:  # outside the layers: named after the block
                meta, suffix = dict(n1.metadata_props), first
            else:
                moved = re.compile(re.escape(f"{stack}.{index}") + r"(?!\d)")
                meta = {key: moved.sub(f"{stack}.{index + shift}", val) for key, val in n1.metadata_props.items()}
                suffix = index + shift
            attrs = [ir.Attr(a.name, a.type, a.value) for a in n1.attributes.values()]
            node = ir.Node(n1.domain, n1.op_type, [source(b) for b in n1.inputs], attrs,
                           overload=n1.overload, num_outputs=len(n1.outputs), version=n1.version,
                           name=f"{n1.name}__{suffix}", metadata_props=meta)
            for old, new in zip(n1.outputs, node.outputs):
                io = _io_shifted(old.name, layers, shift) if id(old) in outputs else None
                new.name = io if io is not None else f"{old.name}__{suffix}"
                new.shape = old.shape.copy() if old.shape is not None else None
                new.type = old.type
                copy[old] = new
                if io is not None:
                    new_outputs[io] = new
            new_nodes.append(node)
        prev = copy
        copies.append(copy)
    graph.insert_after(last, new_nodes)
    if outs is not None:  # one value goes from layer to layer (the residual stream): each layer's output
        graph.meta.setdefault(LAYER_OUTPUTS, {})[role] = [
            *outs, *[c[outs[period + o]] for (_, count), c in zip(blocks, copies) for o in range(count)]]
    # what read block 1's output after the stack now reads the last copy's (of a partial block:
    # the output of the last layer it has)
    count = blocks[-1][1]
    moves = prev if count == period else {outs[-1]: prev[outs[period + count - 1]]}
    added = {id(n) for n in new_nodes}
    for old in pair.values():
        if old not in moves:  # no reader after the stack (_check)
            continue
        for user, index in list(old.uses()):
            if id(user) not in l1.ids and id(user) not in added:
                user.replace_input_with(index, moves[old])
        if id(old) in outputs and _io_shifted(old.name, l1.layers, 0) is None:  # a whole-graph output: moves
            new = moves[old]
            name = old.name
            old.name = f"{name}__{period}"
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
            raise NotStitchable(f"{name} is {tuple(t.shape)}, its twin's is {shape}")
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
