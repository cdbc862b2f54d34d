"""torch -> ONNX for one graph of the IO signature, with torch.onnx.export's dynamo exporter.

Why this exporter and opset (measured by benchmarks/opset_probe.py, recorded in docs/export.md):
the TorchScript exporter is deprecated; the dynamo exporter targets opset 18 natively (older
opsets go through the version converter), and opset 18 loads in every onnxruntime and TensorRT
release we support. DEFAULT_OPSET (specc/spec/targets.py) is that choice; `--opset` picks another.

The exported file is made reproducible: the exporter's per-node metadata (stack traces with file
paths, FX node text) and doc strings are dropped, the symbolic dims of inputs and outputs are
renamed after the IO signature (batch, sequence, past_sequence, ...), and the exporter's
intermediate shape annotations (value_info, named after its internal symbols) are removed;
onnxruntime infers them again on load.
"""
from __future__ import annotations

import contextlib
import importlib
import io
import logging
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from specc.errors import BuildError, first_line
from specc.export import moe
from specc.export import stitch as st
from specc.export.external import INLINE_BYTES
from specc.spec.io import BATCH, ENC_SEQ, INPUT_IDS, PAST, POSITION_IDS, SEQ, TOKEN_TYPE_IDS, TOTAL, concrete_dims
from specc.spec.resolve import GraphSig
from specc.spec.targets import DEFAULT_OPSET

# protobuf cannot serialize one message over 2 GiB: beyond this, weights go to external data
EXTERNAL_DATA_BYTES = 2 * 1024**3 - 64 * 1024**2


class GraphModule(nn.Module):
    """One graph of a SpeccModel with positional tensors in IO-signature order (what the exporter
    traces) and outputs returned as a tuple in signature order. Calls the model's own graph
    method: no second implementation."""

    def __init__(self, model: nn.Module, sig: GraphSig):
        super().__init__()
        self.model = model
        self.sig = sig
        self.input_names = [t.name for t in sig.inputs]
        self.output_names = [t.name for t in sig.outputs]

    def forward(self, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(self.input_names, args))
        if self.sig.name == "encoder":
            out = self.model.encode(**inputs)
        elif self.sig.name == "decoder":
            out = self.model.decode(**inputs)
        else:
            out = self.model(**inputs)  # a decoder gets past_key_values.*, so it returns present.*
        return tuple(out[name] for name in self.output_names)


# What torch.onnx.export(dynamo=True), its optimizer and the passes import on first use: seconds
# of module code before any tracing (docs/build.md)
EXPORTER_MODULES = ("torch.export", "torch._dynamo", "torch.onnx._internal.exporter._core",
                    "onnxscript", "onnxscript.function_libs.torch_lib.ops", "onnxscript.optimizer",
                    "onnxscript.rewriter", "onnx_ir", "onnx")


def preload() -> threading.Thread:
    """Import EXPORTER_MODULES in a thread, started while the module is built: building it is
    mostly torch's own kernels (the seeded draws), which leave the interpreter free, so the
    imports cost the build little there instead of their whole time at the start of the export.
    A module that cannot be imported is left for the export to report.
    Join the thread before forking (specc/export/reference.py): a child forked while another
    thread holds an import lock could wait on it for ever."""

    def run() -> None:
        for name in EXPORTER_MODULES:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - the export imports it again and says what is wrong
                pass

    thread = threading.Thread(target=run, name="specc-preload", daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def quiet():
    """The exporter prints progress to stdout and logs warnings, onnxruntime's quantizers log a
    line per node through the root logger; `specc build --json` owns stdout and a build reports
    through its own progress. Inside, stdout goes nowhere, warnings are ignored and log records up
    to WARNING are dropped."""
    sink = io.StringIO()
    disabled = logging.root.manager.disable
    logging.disable(max(disabled, logging.WARNING))
    try:
        with contextlib.redirect_stdout(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)


def export_stitched(model: nn.Module, r, sig: GraphSig, example: dict[str, torch.Tensor],
                    opset: int = DEFAULT_OPSET, prefolded: bool = True, source=None,
                    plan: dict[str, st.Plan] | None = None):
    """The graph as export_graph gives it, traced with the first layers of each deep stack whose
    layers repeat and the rest written in as copies (specc/export/stitch.py), or traced whole where
    that cannot be done. Returns (program, facts): facts is the manifest's optimization entry
    ({"pass": "specc.stitch", ...}: the layers traced and the nodes before and after, or why the
    graph was traced whole), or None when no stack was deep enough to try. A stitched graph's
    traced layers are prefolded before they are copied (facts["prefolded"]; see prefold), unless
    `prefolded` is False. `source`: where the copies' weights come from, read when written (a
    streamed build's StreamedWeights, specc/nn/streamed.py; `model` is then its short module and
    the graph must stitch); by default `model` itself, read now. `plan`: the graph's
    stitch.stitch_plan, where the build has it (its plan, specc/builder/plan.py)."""

    plan = st.stitch_plan(r, sig) if plan is None else plan
    if not plan:
        return export_graph(model, sig, example, opset), None
    short_sig = st.truncated_sig(sig, plan)
    short_example = {t.name: example[t.name] for t in short_sig.inputs}
    program = export_graph(st.truncated(model, plan), short_sig, short_example, opset)
    graph = program.model.graph
    if prefolded:
        with st.layer_weights_hidden(graph, plan):
            prefold(program.model)
    before = len(graph)
    facts = {"graph": sig.name, "pass": "specc.stitch", "layers": {role: p.layers for role, p in plan.items()},
             "layers_traced": max(p.kept for p in plan.values())}
    if any(p.period > 1 for p in plan.values()):
        facts["periods"] = {role: p.period for role, p in plan.items()}
    try:
        st.stitch(graph, source or st.ModuleWeights(model), plan, lazy=source is not None)
        st.order_io(graph, sig)
    except st.NotStitchable as why:  # the graph may be half-changed: trace the whole model
        if source is not None:  # a streamed build has no whole model to trace
            raise BuildError(f"the {sig.name} graph cannot be built streamed: {why}") from None
        del program, graph
        program = export_graph(model, sig, example, opset)
        n = len(program.model.graph)
        return program, {**facts, "layers_traced": None, "skipped": str(why), "nodes_before": n, "nodes_after": n}
    return program, {**facts, "nodes_before": before, "nodes_after": len(graph), "prefolded": prefolded}


def export_graph(model: nn.Module, sig: GraphSig, example: dict[str, torch.Tensor], opset: int = DEFAULT_OPSET):
    """The graph as an onnx_ir-backed ONNXProgram (not yet optimized or saved).

    `example` holds one input per signature name; its dims must be >= 2 wherever the signature is
    symbolic, or torch.export specializes them to the example's size."""
    wrapper = GraphModule(model, sig).eval()
    args = tuple(example[name] for name in wrapper.input_names)
    dynamic = tuple(
        {i: torch.export.Dim.DYNAMIC for i, d in enumerate(t.dims) if isinstance(d, str)} for t in sig.inputs
    )
    try:
        with torch.no_grad():
            return torch.onnx.export(
                wrapper, args, dynamo=True, optimize=False, opset_version=opset,
                input_names=wrapper.input_names, output_names=wrapper.output_names,
                dynamic_shapes=(dynamic,), verbose=False, custom_translation_table=moe.translations(),
            )
    except Exception as exc:  # the exporter raises many types; report it as a build failure
        interrupt = _interrupt(exc)  # Ctrl-C or SIGTERM inside torch.export comes back wrapped in its own error
        if interrupt is not None:
            raise interrupt from None
        first = first_line(exc) or type(exc).__name__
        raise BuildError(f"export of the {sig.name} graph failed: {type(exc).__name__}: {first}") from exc


def _interrupt(exc: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt (or Terminated) in exc's chain of causes, if any."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


def optimize(program, prefolded: bool = False) -> dict:
    """The exporter's own graph optimizer (onnxscript: constant folding, rewrite rules, dead-code
    removal, redundant-op elimination). A stitched graph whose traced layers were prefolded gets
    only what prefold left out. Returns the node counts before and after."""
    before = len(program.model.graph)
    moe.fold_expert_weights(program.model.graph)
    if prefolded:
        fold_weight_transposes(program.model.graph)
        _finish(program.model)
    else:
        program.optimize()
    return {"pass": "onnxscript.optimizer", "nodes_before": before, "nodes_after": len(program.model.graph)}


# A stitched graph is optimized in two parts. onnxscript's optimizer spends most of its time in
# its rewrite rules, node by node, doing the same work in each layer. prefold() runs the
# layer-by-layer part (inlining, constant folding, the rewrite rules,
# up to twice) on the two traced layers before layer 1 is copied, with the layers' weights
# hidden (stitch.layer_weights_hidden); _finish() runs on the whole graph what needs the
# weights or every layer (folding what reads a weight, unused-node removal, constants lifted to
# initializers, duplicate initializers and common subexpressions merged, output and name fixes,
# onnxscript's fusions). The result has the same nodes in the same order as the whole optimizer
# gives (tests/export/test_stitch.py checks it for every kind; what it saves: docs/export.md).
def prefold(model) -> None:
    import onnx_ir as ir
    from onnxscript import optimizer, rewriter

    ir.passes.common.InlinePass()(model)
    for _ in range(2):  # the optimizer's iterations (it stops early only where a second changes nothing)
        optimizer.fold_constants_ir(model, onnx_shape_inference=True)
        rewriter.rewrite(model)


def fold_weight_transposes(graph) -> int:
    """Every Transpose of an initializer that nothing else reads (a Linear's weight: the exporter
    writes x @ W^T) becomes an initializer named after its output whose value is transposed when
    it is read (written), in graph order. The optimizer's constant folding would make the same
    values at once, one transposed copy of every weight held beside the weights (and a streamed
    build's weights made all together). Returns how many."""
    import onnx_ir as ir

    folded = 0
    for node in list(graph):
        if node.op_type != "Transpose" or node.domain != "" or len(node.inputs) != 1:
            continue
        (source,), (out,) = node.inputs, node.outputs
        if (source is None or source.name not in graph.initializers or source.const_value is None
                or len(source.uses()) != 1 or out.is_graph_output()):
            continue
        tensor = source.const_value
        perm = node.attributes.get_ints("perm") or list(range(len(tensor.shape)))[::-1]
        name = out.name
        shape = ir.Shape([tensor.shape[i] for i in perm])
        lazy = ir.LazyTensor(lambda t=tensor, p=tuple(perm), n=name: ir.tensor(np.ascontiguousarray(np.transpose(t.numpy(), p)), name=n),
                             dtype=tensor.dtype, shape=shape, name=name)
        value = ir.Value(name=None, shape=shape, type=ir.TensorType(tensor.dtype), const_value=lazy)
        out.replace_all_uses_with(value)
        graph.remove(node, safe=True)
        graph.initializers.pop(source.name)
        value.name = name
        graph.register_initializer(value)
        folded += 1
    return folded


def _finish(model) -> None:
    import onnx_ir as ir
    from onnx_ir.passes import common
    from onnxscript import optimizer
    from onnxscript.rewriter import onnx_fusions

    optimizer.fold_constants_ir(model, onnx_shape_inference=True)
    ir.passes.Sequential(
        common.RemoveUnusedNodesPass(), common.RemoveUnusedFunctionsPass(), common.RemoveUnusedOpsetsPass(),
        common.LiftConstantsToInitializersPass(lift_all_constants=True, size_limit=0),
        common.LiftSubgraphInitializersToMainGraphPass(), common.DeduplicateInitializersPass(),
        common.CommonSubexpressionEliminationPass(), common.OutputFixPass(), common.NameFixPass(),
    )(model)
    onnx_fusions.fuse(model)


def save(program, sig: GraphSig, path: Path, weight_bytes: int, opset: int | None = None) -> list[Path]:
    """Write the graph reproducibly; weights past the protobuf limit go to `<name>.onnx.data`.
    Returns the files written. With `opset`, the file must declare exactly that opset (the
    exporter's down-conversion can fail and silently keep its own). The program is spent
    afterwards: its constants are detached (see _drop_weights)."""
    def prepare(proto) -> None:
        _check_opset(proto, sig, opset)
        _normalize(proto, sig)

    if weight_bytes >= EXTERNAL_DATA_BYTES:
        files = write_external(program.model, path, prepare)
    else:
        write_streaming(program.model, path, prepare)
        files = [path]
    _drop_weights(program.model.graph)
    return files


def _drop_weights(graph) -> None:
    """Detach every constant from a graph that has been written. onnxscript's rewrite rules keep
    the last graph they matched (module-level state), so without this its initializers, and the
    numpy views of the module's parameters that constant folding made, would keep the weights
    reachable until the process ends, beside onnxruntime's copy during verification."""
    for value in (*graph.inputs, *graph.initializers.values()):
        value.const_value = None
    for node in graph.all_nodes():
        for value in node.outputs:
            value.const_value = None


def write_streaming(model, path: Path, prepare=None) -> None:
    """Write an onnx_ir Model to one .onnx file holding one weight in memory at a time (see the
    note on _MODEL_GRAPH below). `prepare(proto)` may edit the weightless ModelProto first."""
    import onnx_ir as ir

    weights = dict(model.graph.initializers)
    model.graph.initializers.clear()
    try:
        proto = ir.serde.serialize_model(model)  # the graph without its weights: small
    finally:
        model.graph.initializers.update(weights)
    if prepare is not None:
        prepare(proto)
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
        del proto
        for value in weights.values():
            for piece in _initializer_record(value):
                f.write(piece)


DATA_ALIGN = 4096  # each weight's offset in NAME.onnx.data: a page, so onnxruntime can map it where it lies


def write_external(model, path: Path, prepare=None) -> list[Path]:
    """Write an onnx_ir Model as `path` and its weights as `path`.data (ONNX external data, named
    relative to the model file), one weight at a time, each made (a lazy tensor) and written once,
    at a page-aligned offset; those under INLINE_BYTES stay in the model file. `prepare(proto)` may edit the weightless ModelProto first. Returns
    the two files."""
    import onnx
    import onnx_ir as ir

    data = path.with_name(path.name + ".data")
    weights = dict(model.graph.initializers)
    model.graph.initializers.clear()
    try:
        proto = ir.serde.serialize_model(model)
    finally:
        model.graph.initializers.update(weights)
    if prepare is not None:
        prepare(proto)
    offset = 0
    with open(data, "wb") as f:
        for value in weights.values():
            tensor = value.const_value
            if tensor is None:
                raise BuildError(f"initializer {value.name!r} has no value")
            if tensor.nbytes < INLINE_BYTES:  # a shape or a scalar: inline, where shape inference reads it
                proto.graph.initializer.append(ir.serde.serialize_tensor(tensor))
                proto.graph.initializer[-1].name = value.name
                del proto.graph.initializer[-1].metadata_props[:]
                continue
            f.write(b"\0" * (-offset % DATA_ALIGN))
            offset += -offset % DATA_ALIGN
            raw = _raw_data(tensor)
            f.write(raw)
            entry = onnx.TensorProto(name=value.name, dims=list(tensor.shape.numpy()), data_type=int(tensor.dtype),
                                     data_location=onnx.TensorProto.EXTERNAL)
            for key, val in (("location", data.name), ("offset", str(offset)), ("length", str(len(raw)))):
                item = entry.external_data.add()
                item.key, item.value = key, val
            proto.graph.initializer.append(entry)
            offset += len(raw)
            del raw
    with open(path, "wb") as f:
        f.write(proto.SerializeToString())
    return [path, data]


def _check_opset(proto, sig: GraphSig, opset: int | None) -> None:
    written = {o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")}
    if opset is not None and written != {opset}:
        raise BuildError(f"the {sig.name} graph was asked for opset {opset} but declares {sorted(written)}")


# Streaming the weights. A protobuf parser merges repeated occurrences of an embedded message
# field (proto3 and proto2 alike), so a ModelProto written as its weightless skeleton followed by
# one `graph { initializer: T }` record per weight parses as the complete model (onnx.load,
# onnxruntime and TensorRT's parser all read it so) while the writer holds one tensor at a time
# instead of the whole serialized model twice (protobuf message + bytes).
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, payload_len: int) -> bytes:
    """The key and length of a length-delimited field (wire type 2)."""
    return _varint(number << 3 | 2) + _varint(payload_len)


def _initializer_record(value) -> list:
    """One weight as a `graph { initializer: T }` ModelProto record, in pieces (bytes, and the
    raw data as a view of the tensor's memory where it is laid out as written)."""
    import onnx
    import onnx_ir as ir

    tensor = value.const_value
    if tensor is None:
        raise BuildError(f"initializer {value.name!r} has no value")
    if tensor.dtype == ir.DataType.STRING:  # no raw form: the serializer's own encoding
        proto = ir.serde.serialize_tensor(tensor)
        proto.name = value.name
        del proto.metadata_props[:]
        body = [proto.SerializeToString()]
    else:
        head = onnx.TensorProto(name=value.name, dims=list(tensor.shape.numpy()), data_type=int(tensor.dtype))
        raw = _raw_data(tensor)
        body = [head.SerializeToString(), _field(_TENSOR_RAW_DATA, len(raw)), raw]
    size = sum(map(len, body))
    inner = _field(_GRAPH_INITIALIZER, size)
    return [_field(_MODEL_GRAPH, len(inner) + size), inner, *body]


def _raw_data(tensor):
    """A tensor's raw_data bytes (little-endian, C order): a view of its own memory where it is
    laid out so (a parameter's tensor: no copy of the weights), else the tensor's tobytes (a
    transposed view, 4-bit types packed two to a byte, a big-endian machine)."""
    if sys.byteorder == "little" and tensor.dtype.itemsize >= 1:
        array = tensor.numpy()
        if array.dtype.itemsize == tensor.dtype.itemsize and not array.flags.c_contiguous:
            array = _contiguous(array)
        if array is not None and array.flags.c_contiguous and array.dtype.itemsize == tensor.dtype.itemsize:
            return memoryview(array.reshape(-1).view(np.uint8))
    return tensor.tobytes()


def _contiguous(array):
    """A C-ordered copy of a strided array (a transposed weight) made by torch, whose blocked copy
    is about twice as fast as numpy's on a transpose (docs/build.md); None where torch does not
    take the array (a dtype it lacks, negative strides)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # a read-only array: torch only reads it here
            return torch.from_numpy(array).contiguous().numpy()
    except (TypeError, ValueError, RuntimeError):
        return None


def _normalize(proto, sig: GraphSig) -> None:
    """Drop what makes two exports of one model differ (metadata, doc strings, internal symbol
    names) and give the IO dims the signature's names."""
    proto.doc_string = ""
    proto.producer_name = "specc"
    proto.producer_version = ""
    del proto.metadata_props[:]
    graph = proto.graph
    graph.doc_string = ""
    del graph.metadata_props[:]
    del graph.value_info[:]
    for node in graph.node:
        _strip_node(node)
    for fn in proto.functions:
        for node in fn.node:
            _strip_node(node)
    for init in graph.initializer:
        del init.metadata_props[:]
    by_name = {t.name: t for t in (*sig.inputs, *sig.outputs)}
    for value in (*graph.input, *graph.output):
        del value.metadata_props[:]
        value.doc_string = ""
        t = by_name.get(value.name)
        if t is None:
            raise BuildError(f"the exported graph has {value.name!r}, which is not in the IO signature")
        dims = value.type.tensor_type.shape.dim
        if len(dims) != len(t.dims):
            raise BuildError(f"{value.name}: exported rank {len(dims)}, IO signature {len(t.dims)}")
        for dim, want in zip(dims, t.dims):
            if isinstance(want, str):
                dim.Clear()
                dim.dim_param = want
            elif dim.HasField("dim_value") and dim.dim_value != want:
                raise BuildError(f"{value.name}: exported dim {dim.dim_value}, IO signature {want}")
            else:
                dim.Clear()
                dim.dim_value = want


def _strip_node(node) -> None:
    del node.metadata_props[:]
    node.doc_string = ""
    for attr in node.attribute:
        if attr.HasField("g"):
            for sub in attr.g.node:
                _strip_node(sub)


# Example sizes for tracing: >= 2 (torch.export specializes 0 and 1) and all different, so no
# two symbolic dims are mistaken for one.
_TRACE_SIZES = {BATCH: 2, SEQ: 3, PAST: 5, ENC_SEQ: 7}


def example_inputs(r, sig: GraphSig) -> dict[str, torch.Tensor]:
    """One tensor per input of the graph, at _TRACE_SIZES, for tracing."""
    size = {**_TRACE_SIZES, TOTAL: _TRACE_SIZES[SEQ] + _TRACE_SIZES[PAST]}
    gen = torch.Generator().manual_seed(0)
    vocab = r.input_vocab_size(sig.name)
    dtypes = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
    out = {}
    for t in sig.inputs:
        shape = concrete_dims(t.dims, size)
        if t.name == INPUT_IDS:
            out[t.name] = torch.randint(0, vocab, shape, generator=gen)
        elif t.name == TOKEN_TYPE_IDS:
            out[t.name] = torch.randint(0, max(1, r.vocab.type_size), shape, generator=gen)
        elif t.name == POSITION_IDS:
            out[t.name] = (torch.arange(shape[1]) + size[PAST]).expand(*shape).contiguous()
        elif t.dtype in ("int64", "int32"):  # masks
            out[t.name] = torch.ones(shape, dtype=torch.int64)
        else:
            out[t.name] = torch.randn(shape, generator=gen).to(dtypes[t.dtype]) * 0.1
    return out
