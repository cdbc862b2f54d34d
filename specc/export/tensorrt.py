"""The TensorRT target: compatibility check, optimization profiles, precision flags, engine build,
an engine "session" for verification, and a build's engines verified (see docs/serving.md).

The pure parts (profiles from the spec's `serving:` ranges, precision flags, the check of a graph
against specc/export/tensorrt_ops.py, the parser-error report) need neither TensorRT nor a GPU.
build_engine(), EngineSession and build_engines() import `tensorrt` (and torch's CUDA) only
when called.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np

from specc.deps import require_tensorrt
from specc.errors import BuildError
from specc.export import tensorrt_ops as ops
from specc.export.verify import verify
from specc.fileio import write_atomic
from specc.spec.io import BATCH, ENC_SEQ, PAST, SEQ, TOTAL, parse_window
from specc.spec.resolve import GraphSig, ResolvedSpec
from specc.spec.targets import PRECISIONS, TARGETS

Shape = tuple[int, ...]

# precision -> TensorRT BuilderFlag names (fp32 needs none; TF32 is left at TensorRT's default)
PRECISION_FLAGS = {"fp32": (), "fp16": ("FP16",), "bf16": ("BF16",), "int8": ("INT8",)}
# layers kept in fp32 under fp16/bf16: normalizations (mean/variance in half precision overflow
# or lose the variance of large activations)
FP32_LAYER_TYPES = ("NORMALIZATION", "REDUCE")


def _ranges(r: ResolvedSpec) -> dict[str, tuple[int, int, int]]:
    b, n = r.serving.batch, r.serving.length
    past_max = max(n.max - 1, 0)
    return {
        BATCH: (b.min, b.opt, b.max),
        SEQ: (n.min, n.opt, n.max),
        # the cache grows from empty (prefill: past 0, which TensorRT accepts as an empty tensor)
        # to length.max - 1 tokens before the last step; opt: a decode step midway
        PAST: (0, min(n.opt, past_max), past_max),
        TOTAL: (n.min, n.opt, n.max),
        ENC_SEQ: (n.min, n.opt, n.max),
    }


def profile_shapes(r: ResolvedSpec, sig: GraphSig) -> dict[str, tuple[Shape, Shape, Shape]]:
    """input name -> (min, opt, max) shapes for the graph's one optimization profile."""
    ranges = _ranges(r)
    out = {}
    for t in sig.inputs:
        lo, mid, hi = [], [], []
        for d in t.dims:
            if isinstance(d, int):
                a = b = c = d
            else:
                window = parse_window(d)  # a window cache: min(W, the dim it windows)
                try:
                    a, b, c = ranges[d] if window is None else (min(window[1], x) for x in ranges[window[0]])
                except KeyError:
                    raise BuildError(f"input {t.name}: no serving range for dimension {d!r}") from None
            lo.append(a), mid.append(b), hi.append(c)
        out[t.name] = (tuple(lo), tuple(mid), tuple(hi))
    return out


def is_quantized(model) -> bool:
    """Whether the graph carries explicit QuantizeLinear/DequantizeLinear pairs (what TensorRT
    builds int8 from)."""
    kinds = {n.op_type for n in model.graph.node}
    return {"QuantizeLinear", "DequantizeLinear"} <= kinds


def precision_flags(precision: str, model=None) -> tuple[str, ...]:
    """TensorRT BuilderFlag names for a precision. int8 only from a graph with Q/DQ nodes."""
    if precision not in PRECISION_FLAGS:
        raise BuildError(f"precision {precision} is not built for target tensorrt; "
                         f"choose one of {', '.join(PRECISION_FLAGS)}")
    if precision == "int8" and (model is None or not is_quantized(model)):
        raise BuildError("int8 TensorRT engines are built only from a graph with QuantizeLinear/DequantizeLinear "
                         "nodes; specc's int8 ONNX graphs use onnxruntime's weight-only MatMulNBits, which "
                         "TensorRT does not take: build fp16 or bf16")
    return PRECISION_FLAGS[precision]


def findings(model) -> list[str]:
    """What in an onnx.ModelProto TensorRT's ONNX parser (per tensorrt_ops) would refuse, one
    line per node (by name), or [] when nothing is."""
    out = []
    for imp in model.opset_import:
        if imp.domain in ("", "ai.onnx") and imp.version not in ops.OPSETS:
            out.append(f"opset {imp.version}: TensorRT {ops.TENSORRT_VERSION} parses opsets "
                       f"{ops.OPSETS.start}-{ops.OPSETS.stop - 1}")
    for i, node in enumerate(model.graph.node):
        name = node.name or f"#{i}"
        where = f"node {name} ({node.op_type})"
        if node.domain not in ("", "ai.onnx"):
            out.append(f"{where}: operator domain {node.domain!r} is not supported by TensorRT's ONNX parser")
            continue
        if node.op_type in ops.CONTROL_FLOW:
            out.append(f"{where}: data-dependent control flow; the TensorRT export must be one static graph")
            continue
        if node.op_type not in ops.SUPPORTED:
            reason = ops.REFUSED.get(node.op_type, "not supported by TensorRT's ONNX parser")
            out.append(f"{where}: {reason}")
            continue
        for attr_name, bad, need in ops.ATTRIBUTE_RULES.get(node.op_type, ()):
            for a in node.attribute:
                if a.name == attr_name:
                    value = _attr_value(a)
                    if bad(value):
                        out.append(f"{where}: attribute {attr_name}={value!r}; TensorRT needs {need}")
    return out


def _attr_value(a):
    import onnx

    return onnx.helper.get_attribute_value(a)


def check_compatible(model, graph: str = "model") -> None:
    """BuildError naming every node TensorRT would refuse."""
    found = findings(model)
    if found:
        shown = "\n  ".join(found[:20]) + (f"\n  ... and {len(found) - 20} more" if len(found) > 20 else "")
        raise BuildError(f"the {graph} graph is not buildable with TensorRT {ops.TENSORRT_VERSION}:\n  {shown}")


def parser_errors(parser) -> str:
    """TensorRT OnnxParser errors as lines naming the node (parser: anything with num_errors and
    get_error(i) returning objects with desc(), node_name(), node_operator())."""
    lines = []
    for i in range(parser.num_errors):
        e = parser.get_error(i)
        node = e.node_name() or f"#{e.node()}"
        op = e.node_operator()
        lines.append(f"node {node}{f' ({op})' if op else ''}: {e.desc()}")
    return "\n  ".join(lines)


def timing_cache_path() -> Path:
    """Where the timing cache is kept between builds: $SPECC_CACHE_DIR, else the user's cache."""
    base = os.environ.get("SPECC_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "specc")
    return Path(base) / "tensorrt" / "timing.cache"


def _logger(trt):
    return trt.Logger(trt.Logger.WARNING)


def build_engine(onnx_path: Path, plan_path: Path, r: ResolvedSpec, sig: GraphSig, precision: str,
                 *, cache_path: Path | None = None, workspace: int | None = None) -> Path:
    """Parse the ONNX graph with TensorRT's parser, build a serialized engine with one
    optimization profile covering the spec's serving ranges, write it to plan_path."""
    import onnx

    trt = require_tensorrt("building a TensorRT engine")
    flags = precision_flags(precision, onnx.load(str(onnx_path), load_external_data=False))
    logger = _logger(trt)
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # explicit batch is the only mode in TensorRT 10
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        raise BuildError(f"TensorRT's ONNX parser refused the {sig.name} graph:\n  {parser_errors(parser)}")
    config = builder.create_builder_config()
    if workspace:
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace)
    for flag in flags:
        config.set_flag(getattr(trt.BuilderFlag, flag))
    if PRECISIONS[precision].half:  # keep normalizations in fp32
        config.set_flag(trt.BuilderFlag.OBEY_PRECISION_CONSTRAINTS)
        for i in range(network.num_layers):
            layer = network.get_layer(i)
            if layer.type in [getattr(trt.LayerType, t) for t in FP32_LAYER_TYPES]:
                layer.precision = trt.float32
    profile = builder.create_optimization_profile()
    for name, (lo, mid, hi) in profile_shapes(r, sig).items():
        profile.set_shape(name, lo, mid, hi)
    config.add_optimization_profile(profile)
    cache_file = cache_path or timing_cache_path()
    blob = cache_file.read_bytes() if cache_file.is_file() else b""
    cache = config.create_timing_cache(blob)
    config.set_timing_cache(cache, ignore_mismatch=True)
    engine = builder.build_serialized_network(network, config)
    if engine is None:
        raise BuildError(f"TensorRT could not build an engine for the {sig.name} graph (see its log above)")
    plan_path.write_bytes(bytes(engine))
    cache_file.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(cache_file, bytes(config.get_timing_cache().serialize()))
    return plan_path


class EngineSession:
    """A TensorRT engine with onnxruntime's `run(output_names, feed)`, so that
    specc.export.verify.verify() checks it like an onnxruntime session. Buffers are torch CUDA
    tensors."""

    def __init__(self, plan_path: Path):
        import torch

        trt = require_tensorrt("verifying a TensorRT engine")
        if not torch.cuda.is_available():
            raise BuildError("verifying a TensorRT engine needs a CUDA GPU, and torch sees none")
        self._trt, self._torch = trt, torch
        runtime = trt.Runtime(_logger(trt))
        self.engine = runtime.deserialize_cuda_engine(Path(plan_path).read_bytes())
        if self.engine is None:
            raise BuildError(f"{plan_path}: TensorRT cannot load the engine")
        self.context = self.engine.create_execution_context()

    def run(self, names, feed):
        trt, torch = self._trt, self._torch
        keep = []
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
                t = torch.from_numpy(np.ascontiguousarray(feed[name])).cuda()
                self.context.set_input_shape(name, tuple(t.shape))
                self.context.set_tensor_address(name, t.data_ptr())
                keep.append(t)
        outs = {}
        for i in range(self.engine.num_io_tensors):
            name = self.engine.get_tensor_name(i)
            if self.engine.get_tensor_mode(name) == trt.TensorIOMode.OUTPUT:
                shape = tuple(self.context.get_tensor_shape(name))
                dtype = torch.from_numpy(np.empty(0, dtype=trt.nptype(self.engine.get_tensor_dtype(name)))).dtype
                outs[name] = torch.empty(shape, dtype=dtype, device="cuda")
                self.context.set_tensor_address(name, outs[name].data_ptr())
        stream = torch.cuda.current_stream()
        if not self.context.execute_async_v3(stream.cuda_stream):
            raise BuildError("TensorRT failed to run the engine")
        stream.synchronize()
        return [outs[n].cpu().numpy() for n in names]


# --- a build's engines --------------------------------------------------------------------------


def engines_possible(precision: str) -> bool:
    """Whether TensorRT engines can be built here: tensorrt importable, a CUDA GPU, and a
    precision the tensorrt target builds."""
    if precision not in TARGETS["tensorrt"].precisions or importlib.util.find_spec("tensorrt") is None:
        return False
    import torch

    return torch.cuda.is_available()


def build_engines(r: ResolvedSpec, refs: dict, files: dict[str, list[Path]], tmp: Path, precision: str,
                  seed: int) -> tuple[dict, dict[str, Path]]:
    """Check each graph against TensorRT's parser support, build one engine per graph
    (`<graph>.plan` in tmp) and verify the engines like the ONNX graphs (same cases, the tensorrt
    tolerance) against the module's reference outputs `refs`. Needs TensorRT and a CUDA GPU.
    Returns (the engines' verification, graph -> plan)."""
    import onnx

    sessions, plans = {}, {}
    for sig in r.graphs:
        onnx_path = files[sig.name][0]
        check_compatible(onnx.load(str(onnx_path), load_external_data=False), graph=sig.name)
        plans[sig.name] = build_engine(onnx_path, tmp / f"{sig.name}.plan", r, sig, precision)
        sessions[sig.name] = EngineSession(plans[sig.name])
    return verify(r, refs, sessions, "tensorrt", precision, seed=seed).to_dict(), plans
