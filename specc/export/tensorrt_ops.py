"""What TensorRT's ONNX parser accepts, as data (specc's own summary; see docs/serving.md).

Describes TensorRT 10.x (the ONNX parser of the 10.0-10.x releases, opsets 9-20, default ONNX
domain only). `SUPPORTED` lists the operator types the parser converts; anything else (another
domain, a Sequence/Optional op, integer-arithmetic quantized ops such as MatMulInteger) is
refused. `ATTRIBUTE_RULES` lists restrictions on supported operators that specc can see in the
graph itself; each is (attribute, predicate on its value, what TensorRT requires).
"""
from __future__ import annotations

TENSORRT_VERSION = "10"
OPSETS = range(9, 21)  # default-domain opsets the parser accepts

SUPPORTED = frozenset("""
Abs Acos Acosh Add AffineGrid And ArgMax ArgMin Asin Asinh Atan Atanh AveragePool
BatchNormalization BlackmanWindow Cast CastLike Ceil Celu Clip Col2Im Concat Constant
ConstantOfShape Conv ConvTranspose Cos Cosh CumSum DepthToSpace DequantizeLinear Div Dropout
Einsum Elu Equal Erf Exp Expand EyeLike Flatten Floor Gather GatherElements GatherND Gelu Gemm
GlobalAveragePool GlobalLpPool GlobalMaxPool Greater GreaterOrEqual GridSample GroupNormalization
GRU HammingWindow HannWindow Hardmax HardSigmoid HardSwish Identity If ImageScaler
InstanceNormalization IsInf IsNaN LayerNormalization LeakyRelu Less LessOrEqual Log LogSoftmax
Loop LpNormalization LpPool LRN LSTM MatMul Max MaxPool Mean MeanVarianceNormalization Min Mish
Mod Mul Multinomial Neg NonMaxSuppression NonZero Not OneHot Or Pad ParametricSoftplus Pow PRelu
QuantizeLinear RandomNormal RandomNormalLike RandomUniform RandomUniformLike Range Reciprocal
ReduceL1 ReduceL2 ReduceLogSum ReduceLogSumExp ReduceMax ReduceMean ReduceMin ReduceProd ReduceSum
ReduceSumSquare Relu Reshape Resize ReverseSequence RNN RoiAlign Round ScaledTanh Scan Scatter
ScatterElements ScatterND Selu Shape Shrink Sigmoid Sign Sin Sinh Size Slice Softmax Softplus
Softsign SpaceToDepth Split Sqrt Squeeze Sub Sum Tan Tanh ThresholdedRelu Tile TopK Transpose Trilu
Unsqueeze Upsample Where Xor
""".split())

# Known refusals, with the reason given in the error (the rest of the unsupported ops are simply
# "not supported by TensorRT's ONNX parser").
REFUSED = {
    "MatMulInteger": "integer matmul (dynamic quantization); TensorRT takes int8 only as QuantizeLinear/DequantizeLinear pairs",
    "ConvInteger": "integer convolution; TensorRT takes int8 only as QuantizeLinear/DequantizeLinear pairs",
    "DynamicQuantizeLinear": "dynamic quantization; TensorRT takes int8 only as QuantizeLinear/DequantizeLinear pairs",
    "QLinearMatMul": "QLinear ops; TensorRT takes QuantizeLinear/DequantizeLinear pairs",
    "QLinearConv": "QLinear ops; TensorRT takes QuantizeLinear/DequantizeLinear pairs",
    "MatMulNBits": "onnxruntime contrib op (specc's int8 and int4 weights)",
    "Unique": "data-dependent output shape",
    "Compress": "data-dependent output shape",
    "StringNormalizer": "string tensors",
    "TfIdfVectorizer": "string/ngram op",
}

# Control flow whose trip count or branch depends on data: the parser converts Loop/If/Scan,
# but specc's exports for TensorRT must not contain them (one static graph per profile).
CONTROL_FLOW = frozenset({"Loop", "If", "Scan"})


def _has_ellipsis(v) -> bool:
    return b"..." in v if isinstance(v, bytes) else "..." in str(v)


def _in(*allowed):
    return lambda v: (v.decode() if isinstance(v, bytes) else v) not in allowed


ATTRIBUTE_RULES = {
    "Einsum": [("equation", _has_ellipsis, "no ellipsis ('...') in the equation")],
    "Resize": [("mode", _in("nearest", "linear", "cubic"), "mode nearest, linear or cubic")],
    "MaxPool": [("storage_order", lambda v: v != 0, "row-major storage_order (0)")],
}
