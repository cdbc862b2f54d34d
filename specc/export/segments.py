"""Verifying a streamed build's graph a layer at a time: memory of one layer, not of the model.

A streamed build's graph is cut at its deep stack's layer outputs (the residual stream the stitch
recorded, stitch.LAYER_OUTPUTS) into segments: the first runs from the graph's inputs to layer 0's
output (the embeddings and layer 0), each next one from the previous layer's output to its own
(with the graph inputs its attention reads: the masks, the positions, its own past), and the last
from the last layer's output to the graph's remaining outputs (the final norm and the heads). Each
segment is written beside the graph, its weights left in the graph's external data, and run by
onnxruntime alone on every verification case, fed torch's own hidden state for its input and
torch's own caches for a decode step; its outputs (the layer's output and its present.*, or the
heads') are compared with torch's by the build's tolerance or quality bar.

What that proves: every node of the written graph that its outputs need (each lies in a segment:
checked; a node nothing reads computes nothing) computes with
its written weights what torch's matching layer computes from the same input, within the bar; the
segments chain into the whole graph by construction (each cut value is one segment's output and
the next one's input, and no segment reads any other). What it does not: that the per-layer
differences, compounded through the stack, stay within the bar at the graph's outputs; that is
proved only where the graph is also run whole (docs/build.md, "Streamed builds").
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from specc.errors import BuildError, first_line
from specc.export import verify
from specc.spec.io import is_present, numpy_dtype
from specc.spec.targets import PRECISIONS

SEGMENT_FILE = ".segment.onnx"  # beside the graph (its external data is found relative to it); removed once loaded


@dataclass
class Segment:
    """Part of a graph between two cut values. `reads` / `writes`: the cut value it reads (None
    for the first) and the one it writes (None for the last), each with the reference's key for
    it ("decoder.layers.3"). `outputs`: every value it outputs (its cut value first, then the
    graph outputs it makes). `nodes`: indices of the graph's nodes, in graph order."""

    name: str
    reads: tuple[str, str] | None
    writes: tuple[str, str] | None
    outputs: list[str] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)


def cut(graph, layers: list[tuple[str, int, str]]) -> list[Segment]:
    """The segments of an onnx GraphProto (topologically sorted, as written) cut at `layers`:
    (role, index, value name) of each layer output, in the order the graph computes them.
    Raises BuildError where the graph does not come apart there (a node reading across a cut, or
    one the outputs need in no segment)."""
    nodes = list(graph.node)
    if any(a.g.node or a.graphs for n in nodes for a in n.attribute):
        raise BuildError("a graph with subgraphs (If, Loop, Scan) is not cut into segments")
    at = {name: j for j, (_, _, name) in enumerate(layers)}
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    # each value's segment as its readers see it: a cut value belongs to the segment after it;
    # graph inputs and initializers to none (every segment may read them)
    after: dict[str, int] = {}
    place = []
    for n in nodes:
        s = max((after[v] for v in n.input if v in after), default=0)
        place.append(s)
        for out in n.output:
            after[out] = at[out] + 1 if out in at else s
    for j, (role, index, name) in enumerate(layers):
        if name not in producer or place[producer[name]] != j:
            raise BuildError(f"the graph does not cut at {role} layer {index}'s output {name!r}")
    count = len(layers) + 1
    segments = []
    for s in range(count):
        role, index, name = layers[min(s, len(layers) - 1)]
        title = (f"{role} layer {index}" if s < len(layers) else f"what follows {role} layer {index}")
        reads = (layers[s - 1][2], _key(layers[s - 1])) if s > 0 else None
        writes = (name, _key(layers[s])) if s < len(layers) else None
        seg = Segment(title, reads, writes)
        if writes:
            seg.outputs.append(writes[0])
        seg.outputs += [o.name for o in graph.output if o.name in producer and place[producer[o.name]] == s
                        and o.name not in seg.outputs]
        if seg.outputs:  # the last is empty where the last layer's output is the graph's (a post-norm encoder)
            segments.append(seg)
    covered: set[int] = set()
    for seg in segments:
        seg.nodes = _cone(nodes, producer, seg, at)
        covered.update(seg.nodes)
    live = _live(nodes, producer, [o.name for o in graph.output])  # a node nothing reads computes nothing
    if not live <= covered:
        missing = nodes[min(live - covered)]
        raise BuildError(f"node {missing.name or missing.op_type!r} lies in no segment of the graph")
    return segments


def _live(nodes, producer: dict[str, int], outputs: list[str]) -> set[int]:
    """The nodes the graph's outputs need."""
    todo, found = list(outputs), set()
    while todo:
        v = todo.pop()
        i = producer.get(v)
        if i is not None and i not in found:
            found.add(i)
            todo.extend(x for x in nodes[i].input if x)
    return found


def _key(layer: tuple[str, int, str]) -> str:
    return f"{layer[0]}.layers.{layer[1]}"


def _cone(nodes, producer: dict[str, int], seg: Segment, at: dict[str, int]) -> list[int]:
    """The nodes seg's outputs need, back to its cut input, the graph inputs and initializers."""
    stop = seg.reads[0] if seg.reads else None
    todo, seen = list(seg.outputs), set()
    found: set[int] = set()
    while todo:
        v = todo.pop()
        if v in seen or v == stop or v not in producer:
            continue
        seen.add(v)
        if v in at and v not in seg.outputs:
            raise BuildError(f"{seg.name} reads {v!r}, another layer's output, beside its own input")
        i = producer[v]
        if i not in found:
            found.add(i)
            todo.extend(x for x in nodes[i].input if x)
    return sorted(found)


def segment_model(proto, seg: Segment, elem: int):
    """The ModelProto of one segment of `proto` (loaded without its external data: the
    initializers keep their references into it)."""
    from onnx import helper

    g = proto.graph
    nodes = [g.node[i] for i in seg.nodes]
    needed = {v for n in nodes for v in n.input if v}
    outputs = {o.name: o for o in g.output}
    inputs = ([helper.make_tensor_value_info(seg.reads[0], elem, None)] if seg.reads else [])
    inputs += [i for i in g.input if i.name in needed]
    graph = helper.make_graph(
        nodes, f"{g.name}.{seg.name.replace(' ', '_')}", inputs,
        [outputs[o] if o in outputs else helper.make_tensor_value_info(o, elem, None) for o in seg.outputs],
        [t for t in g.initializer if t.name in needed])
    model = helper.make_model(graph, opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    model.functions.extend(proto.functions)
    return model


def verify_segments(r, refs: dict, graph: Path, layers: list[tuple[str, int, str]], session_for,
                    report: verify.Report, seed: int, longest: int | None, on_segment=None) -> verify.Report:
    """Every segment of the graph at `graph` (a single-graph streamed build's) run on every case,
    its outputs compared with `refs` (verify.reference_outputs with the stacks' layers recorded)
    into `report.segments`. session_for(path): an onnxruntime session. on_segment(name, i, of):
    progress. Raises VerificationError naming the segment, the case and the output."""
    import onnx

    proto = onnx.load(str(graph), load_external_data=False)
    segments = cut(proto.graph, layers)
    elem = onnx.TensorProto.FLOAT16 if PRECISIONS[report.precision].half else onnx.TensorProto.FLOAT
    hidden = numpy_dtype("float16" if PRECISIONS[report.precision].half else "float32")
    steps = verify._steps(r, seed, longest)
    # each case's whole feed, its caches torch's own from the case it continues: read once, not
    # once a segment (a session takes the inputs its segment reads)
    feeds = {step.key: verify.case_feed(step, _arrays(refs[step.prev]) if step.prev else None, None) for step in steps}
    scores = verify.scored(r)
    path = graph.with_name(SEGMENT_FILE)
    for number, seg in enumerate(segments):
        if on_segment is not None:
            on_segment(seg.name, number, len(segments))
        try:
            onnx.save(segment_model(proto, seg, elem), str(path))
            session = session_for(path)
        finally:
            path.unlink(missing_ok=True)
        wanted = {i.name for i in session.get_inputs()}
        for step in steps:
            want = refs[step.key]
            feed = {k: v for k, v in feeds[step.key].items() if k in wanted}
            if seg.reads:
                feed[seg.reads[0]] = _array(want[seg.reads[1]]).astype(hidden)
            where = f"{step.where}, {seg.name}"
            try:
                got = dict(zip(seg.outputs, session.run(seg.outputs, feed)))
            except Exception as exc:  # onnxruntime's own exception types
                msg = first_line(exc) or type(exc).__name__
                raise verify.VerificationError(f"{where}: onnxruntime failed to run the segment: {msg}") from None
            figures = {}
            for name in seg.outputs:
                key = seg.writes[1] if seg.writes and name == seg.writes[0] else name
                gaps = (verify.layer_gaps(r, key, want.get(verify.ROUTING_GAPS))
                        if seg.writes and name == seg.writes[0] else None)  # its own routing's
                figures[key] = report.compare(key, key in scores, got[name], want[key], where, gaps)
            report.segments.append({"segment": seg.name, "graph": step.case.graph, "case": step.case.name,
                                    "outputs": figures})
            del got, feed
        del session
    return report


def _array(x) -> np.ndarray:
    return x.read() if isinstance(x, verify.Spilled) else x


def _arrays(outputs: dict) -> dict[str, np.ndarray]:
    """A case's cache outputs (present.*) in memory, what the case after it is fed."""
    return {k: _array(v) for k, v in outputs.items() if is_present(k)}
