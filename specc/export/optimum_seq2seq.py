"""Optimum's decoder for an encoder-decoder build: decoder_model_merged.onnx, composed from the
build's encoder and decoder graphs (verified before it is made), so that Optimum's
ORTModelForSeq2SeqLM opens the build folder as it is.

Optimum runs a seq2seq decoder as one graph with an If on `use_cache_branch`:
- first step (false): it makes the cross-attention K/V itself from the encoder's last hidden
  state (`encoder_hidden_states`), then runs the decoder on the (empty) self-attention cache it
  is given, returning logits, present.N.decoder.* and present.N.encoder.*;
- later steps (true): the decoder on past_key_values.N.decoder.* and .N.encoder.*; its
  present.N.encoder.* are the past's.
Optimum pairs the cache inputs with its cache by position: they are declared layer by layer
(N.decoder.key, N.decoder.value, N.encoder.key, N.encoder.value), and the outputs likewise.

specc's encoder graph makes the cross K/V from last_hidden_state: the nodes between the two are
lifted out of it into the first-step branch; the decoder graph's nodes go into both branches. No
node is made anew and nothing is traced again. The weights are not written twice: every
initializer of external.INLINE_BYTES or more is ONNX external data pointing at the bytes where the
encoder's or the decoder's own file already holds it (an .onnx file's raw_data, or its
.onnx.data). `check` runs the merged graph with onnxruntime against the two graphs, both branches.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specc.errors import BuildError, first_line
from specc.export.external import referenced
from specc.spec import io
from specc.spec.resolve import ResolvedSpec

MERGED = "decoder_model_merged.onnx"  # the name Optimum looks for first
USE_CACHE_BRANCH = "use_cache_branch"
ENCODER_HIDDEN_STATES = "encoder_hidden_states"
# the cross cache's length in the merged graph's inputs: Optimum's first step gives it 0 beside an
# encoder_hidden_states of the source's length
PAST_ENCODER_SEQUENCE = "past_encoder_sequence"
FIRST, CACHED = "first/", "cached/"  # the branches' own value names
SOURCE_INPUTS = (io.INPUT_IDS, io.ATTENTION_MASK)  # the encoder graph's [batch, encoder_sequence] inputs


def optimum_cache_order(layers: int) -> list[io.CacheSlot]:
    """The cache slots in the order Optimum pairs them: per layer, its own K, V, then the cross K, V."""
    return [io.CacheSlot(i, part, which) for i in range(layers) for part in (io.OWN, io.CROSS)
            for which in (io.KEY, io.VALUE)]


def write(root: Path, r: ResolvedSpec, graph_files: dict[str, str]) -> Path:
    """ROOT/decoder_model_merged.onnx from ROOT's encoder and decoder graphs (the module's doc)."""
    import onnx
    from onnx import helper

    enc_file, dec_file = graph_files["encoder"], graph_files["decoder"]
    enc = onnx.load(str(root / enc_file), load_external_data=False)
    dec = onnx.load(str(root / dec_file), load_external_data=False)
    for graph in (enc.graph, dec.graph):
        if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for n in graph.node for a in n.attribute):
            raise BuildError("Optimum's merged decoder: a graph with subgraphs of its own is not composed")
    layers = r.spec.decoder.layers
    cross = [s.present for s in io.cache_slots(layers, io.CROSS)]
    lifted, lifted_inits = _cross_nodes(enc.graph, cross)

    dec_inputs = {v.name: v for v in dec.graph.input}
    dec_inits = {t.name for t in dec.graph.initializer}
    dec_outputs = [v.name for v in dec.graph.output]
    heads = [n for n in dec_outputs if not io.is_present(n)]
    enc_name = {name: "encoder/" + name for name in lifted_inits}  # the lifted weights' names, apart from the decoder's
    taken = dec_inits | set(dec_inputs) | {ENCODER_HIDDEN_STATES, USE_CACHE_BRANCH}
    if taken & set(enc_name.values()):
        raise BuildError(f"Optimum's merged decoder: the decoder graph already has a value named "
                         f"{sorted(taken & set(enc_name.values()))[0]!r}")

    # first step: cross K/V from encoder_hidden_states, then the decoder reading them
    def first_enc(v: str) -> str:
        if v == io.LAST_HIDDEN_STATE:
            return ENCODER_HIDDEN_STATES
        return enc_name.get(v) or (FIRST + "encoder/" + v if v else v)

    def first_dec(v: str) -> str:
        parsed = io.parse_cache(v)
        if parsed is not None and parsed[0] == io.PAST_PREFIX and parsed[1].cross:
            return first_enc(parsed[1].present)
        return v if v in dec_inputs or v in dec_inits or not v else FIRST + v

    def cached_dec(v: str) -> str:
        return v if v in dec_inputs or v in dec_inits or not v else CACHED + v

    first_nodes = [_renamed(n, first_enc, FIRST + "encoder/", lifted=True) for n in lifted]
    first_nodes += [_renamed(n, first_dec, FIRST) for n in dec.graph.node]
    cached_nodes = [_renamed(n, cached_dec, CACHED) for n in dec.graph.node]
    cached_nodes += [helper.make_node("Identity", [s.past], [CACHED + s.present], name=CACHED + s.present)
                     for s in io.cache_slots(layers, io.CROSS)]

    order = [*heads, *(s.present for s in optimum_cache_order(layers))]
    first_out = [first_enc(n) if io.parse_cache(n) and io.parse_cache(n)[1].cross else FIRST + n for n in order]
    types = {v.name: v for v in dec.graph.output}
    types.update({v.name: v for v in enc.graph.output})
    outputs = [_value(onnx, types[n], n) for n in order]
    first = helper.make_graph(first_nodes, "first_step", [], [_value(onnx, types[n], o) for n, o in zip(order, first_out)])
    cached = helper.make_graph(cached_nodes, "with_past", [], [_value(onnx, types[n], CACHED + n) for n in order])
    branch = helper.make_node("If", [USE_CACHE_BRANCH], order, name="optimum_use_cache_branch",
                              then_branch=cached, else_branch=first)

    hidden = next(v for v in enc.graph.output if v.name == io.LAST_HIDDEN_STATE)
    inputs = [dec_inputs[io.INPUT_IDS], dec_inputs[io.ENCODER_ATTENTION_MASK], _value(onnx, hidden, ENCODER_HIDDEN_STATES)]
    for slot in optimum_cache_order(layers):
        value = _value(onnx, dec_inputs[slot.past], slot.past)
        if slot.cross:
            value.type.tensor_type.shape.dim[2].dim_param = PAST_ENCODER_SEQUENCE
        inputs.append(value)
    inputs.append(helper.make_tensor_value_info(USE_CACHE_BRANCH, onnx.TensorProto.BOOL, [1]))

    inits = [referenced(t, root, dec_file, t.name) for t in dec.graph.initializer]
    inits += [referenced(t, root, enc_file, enc_name[t.name]) for t in enc.graph.initializer if t.name in lifted_inits]
    graph = helper.make_graph([branch], f"{r.name}-optimum-decoder", inputs, outputs, inits)
    opsets = {o.domain: o.version for o in (*enc.opset_import, *dec.opset_import)}
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                              ir_version=dec.ir_version, producer_name="specc")
    path = root / MERGED
    path.write_bytes(model.SerializeToString())
    return path


def _cross_nodes(graph, outputs: list[str]) -> tuple[list, set[str]]:
    """The encoder graph's nodes that compute OUTPUTS from last_hidden_state (in the graph's order)
    and the initializers they read."""
    produced = {out: node for node in graph.node for out in node.output}
    inits = {t.name for t in graph.initializer}
    taken, used, seen = set(), set(), set()
    stack = list(outputs)
    while stack:
        v = stack.pop()
        if not v or v == io.LAST_HIDDEN_STATE or v in seen:
            continue
        seen.add(v)
        if v in inits:
            used.add(v)
            continue
        node = produced.get(v)
        if node is None:
            raise BuildError(f"Optimum's merged decoder: the encoder graph's {outputs[0]} reads {v!r}, "
                             f"not only {io.LAST_HIDDEN_STATE}")
        if id(node) in taken:
            continue
        taken.add(id(node))
        if node.op_type == "Shape" and node.input[0] in SOURCE_INPUTS:
            continue  # its batch and length dims: read off encoder_hidden_states instead (_renamed)
        stack.extend(node.input)
    return [n for n in graph.node if id(n) in taken], used


def _renamed(node, rename, prefix: str, lifted: bool = False):
    """A copy of NODE reading and writing renamed values (RENAME), its name under PREFIX. In a node
    LIFTED from the encoder graph, the Shape of a source input [batch, encoder_sequence] becomes
    the same dims' Shape of encoder_hidden_states [batch, encoder_sequence, d_model]."""
    copy = type(node)()
    copy.CopyFrom(node)
    if lifted and node.op_type == "Shape" and node.input[0] in SOURCE_INPUTS:
        attrs = {a.name: a.i for a in node.attribute}
        start, end = attrs.get("start", 0), min(attrs.get("end", 2), 2)
        if start < 0 or end < 0:
            raise BuildError(f"Optimum's merged decoder: a Shape of {node.input[0]} from its end is not composed")
        del copy.attribute[:]
        copy.attribute.extend([_int_attribute("start", start), _int_attribute("end", end)])
        copy.input[:] = [ENCODER_HIDDEN_STATES]
        copy.output[:] = [rename(v) for v in node.output]
        copy.name = prefix + node.name
        return copy
    copy.input[:] = [rename(v) for v in node.input]
    copy.output[:] = [rename(v) for v in node.output]
    copy.name = prefix + node.name
    return copy


def _int_attribute(name: str, value: int):
    from onnx import helper

    return helper.make_attribute(name, value)


def _value(onnx, value, name: str):
    copy = onnx.ValueInfoProto()
    copy.CopyFrom(value)
    copy.name = name
    return copy


# --- the check -----------------------------------------------------------------------------------


def check(root: Path, r: ResolvedSpec, graph_files: dict[str, str], open_session, atol: float, rtol: float,
          seed: int = 0) -> float:
    """The merged graph against the build's own encoder and decoder graphs on two sources, fed as
    Optimum feeds it: the first step (use_cache_branch false, every cache empty) and the next
    (true). Returns the largest absolute difference of any output; BuildError where an element
    differs by more than atol + rtol x |expected|. OPEN_SESSION(path, graph name) makes a session."""
    enc = open_session(root / graph_files["encoder"], "encoder")
    dec = open_session(root / graph_files["decoder"], "decoder")
    merged = open_session(root / MERGED, MERGED)
    rng = np.random.default_rng(seed)
    layers = r.spec.decoder.layers
    src = rng.integers(0, r.input_vocab_size("encoder"), (2, 5), dtype=np.int64)
    mask = np.ones_like(src)
    made = _run(enc, {io.INPUT_IDS: src, io.ATTENTION_MASK: mask})
    hidden = made[io.LAST_HIDDEN_STATE]
    shapes = {t.name: t.shape for t in dec.get_inputs()}
    crosses = {s.past: made[s.present] for s in io.cache_slots(layers, io.CROSS)}
    past = {s.past: np.zeros((2, shapes[s.past][1], 0, shapes[s.past][3]), hidden.dtype)
            for s in io.cache_slots(layers, io.OWN)}
    start = r.tokens.decoder_start if r.tokens.decoder_start is not None else 0
    ids = np.full((2, 1), start, dtype=np.int64)
    worst, bad = 0.0, []
    for use_cache in (False, True):
        want = _run(dec, {io.INPUT_IDS: ids, io.ENCODER_ATTENTION_MASK: mask, **past, **crosses})
        feeds = {io.INPUT_IDS: ids, io.ENCODER_ATTENTION_MASK: mask, ENCODER_HIDDEN_STATES: hidden,
                 USE_CACHE_BRANCH: np.array([use_cache])}
        for slot in optimum_cache_order(layers):
            if use_cache:
                feeds[slot.past] = past[slot.past] if not slot.cross else crosses[slot.past]
            else:  # Optimum's first step: every cache empty, the cross K/V too
                feeds[slot.past] = np.zeros((2, shapes[slot.past][1], 0, shapes[slot.past][3]), hidden.dtype)
        try:
            got = _run(merged, feeds)
        except Exception as exc:  # onnxruntime raises its own exception types
            raise BuildError(f"{MERGED} (Optimum's decoder) differs from the build's decoder graph: onnxruntime cannot "
                             f"run its {'with-past' if use_cache else 'first'} step: "
                             f"{first_line(exc)[:300]}") from None
        expected = {**want, **({} if use_cache else {s.present: crosses[s.past] for s in io.cache_slots(layers, io.CROSS)})}
        for name, value in expected.items():
            a, b = got[name].astype(np.float64), value.astype(np.float64)
            if a.shape != b.shape:
                bad.append(f"{name} (shape {list(a.shape)}, not {list(b.shape)})")
            elif not np.all(np.abs(a - b) <= atol + rtol * np.abs(b)):
                bad.append(name)
            if a.shape == b.shape and a.size:
                worst = max(worst, float(np.abs(a - b).max()))
        past = io.present_to_past({k: v for k, v in want.items() if io.is_present(k)})
        lm = next(n for n in want if not io.is_present(n))
        ids = want[lm][:, -1:].argmax(-1).astype(np.int64)
    if bad:
        raise BuildError(f"{MERGED} (Optimum's decoder) differs from the build's decoder graph in {', '.join(bad[:3])} "
                         f"(largest difference {worst:.3g}; tolerance {atol:g} + {rtol:g} x |expected|)")
    return worst


def _run(session, feeds: dict) -> dict[str, np.ndarray]:
    names = [o.name for o in session.get_outputs()]
    wanted = {t.name for t in session.get_inputs()}
    return dict(zip(names, session.run(None, {k: v for k, v in feeds.items() if k in wanted})))
