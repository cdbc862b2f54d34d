"""Integer precisions, applied to an exported fp32 graph with onnxruntime's quantizers.

- int8: dynamic quantization. MatMul weights become int8 (per output column), activations are
  quantized at run time (DynamicQuantizeLinear + MatMulInteger, fused by onnxruntime into
  DynamicQuantizeMatMul). Only MatMul is quantized: Gather (the embedding tables) stays fp32, and
  so does any attention op. Weights use the reduced 7-bit range: on x86 CPUs without VNNI (AVX2
  only) onnxruntime's u8 x s8 kernels add pairs of products in int16 (vpmaddubsw), which
  saturates with full-range weights (measured on an AVX2-only EPYC: tiny-gpt2's present.0.key off
  by 13.6% of its range, against 1-2% with the reduced range); the graph must be right on every
  machine that runs it, so the range does not depend on the build machine.
- int4: weight-only 4-bit blocks (com.microsoft MatMulNBits, block 32, symmetric), activations
  fp32 with int8 compute inside the kernel (accuracy_level 4). For decoders, whose speed is the
  weight bytes read per token.

Both read the saved .onnx and write it back in place, normalized again so identical inputs give
identical bytes.
"""
from __future__ import annotations

import os
from pathlib import Path

from specc.errors import BuildError
from specc.spec.targets import PRECISIONS

INT_PRECISIONS = tuple(name for name, p in PRECISIONS.items() if p.quantized)  # int8, int4
INT4_BLOCK = 32


def quantize(path: Path, precision: str, sig) -> dict:
    """Quantize the graph at `path` in place; returns facts for the manifest."""
    import onnx

    from specc.export.onnx import _normalize

    tmp = path.with_name(f".{path.name}.q.onnx")
    try:
        if precision == "int8":
            proto = _dynamic_int8(path, tmp)
        elif precision == "int4":
            proto = _weight_only(path, bits=4)
        else:
            raise BuildError(f"no quantizer for precision {precision!r}")
        _normalize(proto, sig)
        onnx.save(proto, str(path))
    except BuildError:
        raise
    except Exception as exc:  # onnxruntime's quantizer raises many types
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise BuildError(f"quantizing the {sig.name} graph to {precision} failed: {first}") from None
    finally:
        for leftover in (tmp, tmp.with_name(tmp.name + ".data")):
            if leftover.exists():
                os.unlink(leftover)
    ops: dict[str, int] = {}
    for n in proto.graph.node:
        ops[n.op_type] = ops.get(n.op_type, 0) + 1
    quantized = {k: v for k, v in ops.items() if k in ("MatMulInteger", "DynamicQuantizeMatMul", "MatMulNBits",
                                                      "DynamicQuantizeLinear")}
    return {"graph": sig.name, "precision": precision, "float_matmuls_left": ops.get("MatMul", 0),
            "quantized_ops": quantized}


def _dynamic_int8(src: Path, tmp: Path):
    """The quantizer writes a file (at `tmp`); returns it loaded."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(src, tmp, op_types_to_quantize=["MatMul"], per_channel=True, reduce_range=True,
                     weight_type=QuantType.QInt8,
                     # the graph passes emit com.microsoft operators, which onnx shape inference cannot type
                     extra_options={"MatMulConstBOnly": True, "DefaultTensorType": onnx.TensorProto.FLOAT})
    return onnx.load(str(tmp))


def _weight_only(src: Path, bits: int):
    import onnx
    from onnxruntime.quantization.matmul_nbits_quantizer import DefaultWeightOnlyQuantConfig, MatMulNBitsQuantizer

    config = DefaultWeightOnlyQuantConfig(block_size=INT4_BLOCK, is_symmetric=True, accuracy_level=4, bits=bits)
    q = MatMulNBitsQuantizer(onnx.load(str(src)), bits=bits, block_size=INT4_BLOCK, is_symmetric=True,
                             accuracy_level=4, algo_config=config)
    q.process()
    return q.model.model
