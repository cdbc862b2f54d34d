"""Routed experts as onnxruntime's com.microsoft MoE operator.

The torch module runs a float32 model's routed experts as one operator, `torch.ops.specc.moe`
(specc/nn/experts.py, routed_experts), whose semantics are this node's: the router's logits in,
each row's top k chosen, weighted by the softmax of every logit at those k or (normalize) of the k
alone, each chosen expert's FFN computed for that row only. translate() writes it as one MoE node:

    MoE(x [N,D], logits [N,E], fc1 [E, 2F, D], fc1_bias [E, 2F], fc2 [E, D, F], fc2_bias [E, D])
        k, normalize_routing_weights, activation_type, swiglu_fusion=1, activation_alpha/beta, swiglu_limit

A gated expert's gate and up rows are interleaved in fc1 (g0, u0, g1, u1, ...: swiglu_fusion 1,
the only layout onnxruntime's CPU kernel takes); the translation writes that as Unsqueeze, Concat
and Reshape over the two weights, and fold_expert_weights() makes it one initializer after the
export (stitch.py copies a layer's nodes reading its own weights first; a constant folding of
the whole stack would hold every layer's copy at once). onnxruntime's SwiGLU is
G * sigmoid(alpha * G) * (L + beta) with G and L clamped at `swiglu_limit`: SwiGLU is alpha 1,
beta 0 and no limit, gpt-oss's clamped SwiGLU its alpha, beta 1 and its limit. Measured against
the torch reference in tests/export/test_moe_export.py; what it buys: docs/benchmarks_moe.md.
"""
from __future__ import annotations

import numpy as np

DOMAIN = "com.microsoft"
# spec activation -> (MoE's activation_type, alpha, beta) (beta None: not gated; limit: the spec's)
ACTIVATION = {"relu": ("relu", None, None), "gelu_tanh": ("gelu", None, None), "silu": ("silu", None, None),
              "swiglu": ("swiglu", 1.0, 0.0), "clamped_swiglu": ("swiglu", None, 1.0)}


def translations() -> dict:
    """The exporter's custom_translation_table entry for torch.ops.specc.moe, where it exists (the
    torch module registers it: specc/nn/experts.py)."""
    import torch

    try:
        op = torch.ops.specc.moe.default
    except AttributeError:  # no model with routed experts was built in this process
        return {}
    return {op: translate}


def _schema():
    """The MoE operator's schema, as far as translate() writes it (onnx has none of com.microsoft's)."""
    from onnx.defs import OpSchema

    def param(name: str, optional: bool = False):
        option = OpSchema.FormalParameterOption.Optional if optional else OpSchema.FormalParameterOption.Single
        return OpSchema.FormalParameter(name, "T", param_option=option)

    attrs = [("k", OpSchema.AttrType.INT), ("normalize_routing_weights", OpSchema.AttrType.INT),
             ("activation_type", OpSchema.AttrType.STRING), ("swiglu_fusion", OpSchema.AttrType.INT),
             ("activation_alpha", OpSchema.AttrType.FLOAT), ("activation_beta", OpSchema.AttrType.FLOAT),
             ("swiglu_limit", OpSchema.AttrType.FLOAT)]
    return OpSchema("MoE", DOMAIN, 1,
                    inputs=[param("input"), param("router_probs"), param("fc1_experts_weights"),
                            param("fc1_experts_bias", True), param("fc2_experts_weights"), param("fc2_experts_bias", True)],
                    outputs=[param("output")], type_constraints=[("T", ["tensor(float)"], "")],
                    attributes=[OpSchema.Attribute(name, kind, "", required=False) for name, kind in attrs])


def translate(x, logits, up, down, gate, up_bias, down_bias, gate_bias, k: int, normalize: bool,
              activation: str, alpha: float | None, limit: float | None):
    """torch.ops.specc.moe as an onnxscript (traced) function: one MoE node."""
    from onnxscript import opset18 as op
    from onnxscript._internal.values import Op, Opset

    moe = Op(Opset(DOMAIN, 1), "MoE", _schema())
    if gate is None:
        fc1, fc1_bias = up, up_bias
    else:
        e, f, d = (int(n) for n in up.shape)
        fc1 = op.Reshape(op.Concat(op.Unsqueeze(gate, [2]), op.Unsqueeze(up, [2]), axis=2),
                         op.Constant(value_ints=[e, 2 * f, d]))
        fc1_bias = None if up_bias is None else op.Reshape(
            op.Concat(op.Unsqueeze(gate_bias, [2]), op.Unsqueeze(up_bias, [2]), axis=2), op.Constant(value_ints=[e, 2 * f]))
    kind, default_alpha, beta = ACTIVATION[activation]
    attrs = {"k": k, "normalize_routing_weights": int(normalize), "activation_type": kind}
    if gate is not None:
        attrs.update(swiglu_fusion=1, activation_alpha=float(alpha if default_alpha is None else default_alpha),
                     activation_beta=float(beta))
        if limit is not None:
            attrs["swiglu_limit"] = float(limit)
    return moe(x, logits, fc1, fc1_bias, down, down_bias, **attrs)


_FOLDABLE = ("Reshape", "Concat", "Unsqueeze")


def fold_expert_weights(graph) -> int:
    """Every MoE node's fc1 weight and bias computed from initializers by translate()'s
    interleaving (Unsqueeze, Concat, Reshape) becomes one initializer, made when
    it is written (lazily, so that a streamed build reads the layer's weights then, and no copy
    of the stack's experts exists before), named after the node and the input. Returns how many."""
    import onnx_ir as ir

    folded = 0
    for node in list(graph):
        if node.op_type != "MoE" or node.domain != DOMAIN:
            continue
        for i in (2, 3):
            value = node.inputs[i] if len(node.inputs) > i else None
            if value is None or value.producer() is None:
                continue
            compute = _constant(value, graph)
            if compute is None:
                continue
            fn, dtype, shape = compute
            name = f"{node.name}.{('fc1_experts_weights', 'fc1_experts_bias')[i - 2]}"
            lazy = ir.LazyTensor(lambda fn=fn, name=name: ir.tensor(np.ascontiguousarray(fn()), name=name),
                                 dtype=dtype, shape=ir.Shape(shape), name=name)
            folded_value = ir.Value(name=None, shape=ir.Shape(shape), type=ir.TensorType(dtype), const_value=lazy)
            node.replace_input_with(i, folded_value)
            folded_value.name = name
            graph.register_initializer(folded_value)
            folded += 1
    return folded  # the nodes and weights no longer read are removed by the optimizer, which runs next


def _constant(value, graph):
    """(a function computing value, its dtype, its shape) where value is an initializer or
    _FOLDABLE's nodes over initializers and constants, else None."""
    import onnx_ir as ir

    if value.name in graph.initializers and value.const_value is not None:
        tensor = value.const_value
        return (lambda t=tensor: t.numpy()), tensor.dtype, tuple(tensor.shape)
    producer = value.producer()
    if producer is None or producer.domain != "":
        return None
    if producer.op_type == "Constant":
        attr = producer.attributes
        if "value" in attr:
            tensor = attr["value"].as_tensor()
            return (lambda t=tensor: t.numpy()), tensor.dtype, tuple(tensor.shape)
        if "value_ints" not in attr:
            return None
        ints = np.asarray(attr.get_ints("value_ints"), dtype=np.int64)
        return (lambda a=ints: a), ir.DataType.INT64, ints.shape
    if producer.op_type not in _FOLDABLE:
        return None
    parts = [_constant(v, graph) for v in producer.inputs]
    if any(p is None for p in parts):
        return None
    fns = [p[0] for p in parts]
    if producer.op_type == "Unsqueeze":
        axes = [int(a) for a in _static(parts[1])]
        shape = list(parts[0][2])
        for a in sorted(a % (len(shape) + len(axes)) for a in axes):
            shape.insert(a, 1)
        return (lambda f=fns[0], s=tuple(shape): f().reshape(s)), parts[0][1], tuple(shape)
    if producer.op_type == "Reshape":
        target = [int(n) for n in _static(parts[1])]
        size = int(np.prod(parts[0][2]))
        shape = [parts[0][2][i] if n == 0 else n for i, n in enumerate(target)]
        if -1 in shape:
            shape[shape.index(-1)] = size // -int(np.prod(shape))
        return (lambda f=fns[0], s=tuple(shape): f().reshape(s)), parts[0][1], tuple(shape)
    axis = producer.attributes.get_int("axis")
    rank = len(parts[0][2])
    axis %= rank
    shape = list(parts[0][2])
    shape[axis] = sum(p[2][axis] for p in parts)
    return (lambda fs=tuple(fns), a=axis: np.concatenate([f() for f in fs], axis=a)), parts[0][1], tuple(shape)


def _static(part) -> np.ndarray:
    """A small constant's value (a shape or axes), now."""
    return np.asarray(part[0]()).reshape(-1)
