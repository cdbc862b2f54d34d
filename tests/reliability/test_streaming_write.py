"""A build writes its graph one weight at a time (specc.export.onnx.write_streaming): the file
parses to exactly the model the canonical serializer writes, and writing it never holds a second
full copy of the weights (the canonical route holds two: the protobuf message and its bytes)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from specc.export.onnx import write_streaming


def _model(sizes: list[int]) -> ir.Model:
    """out = x + sum of the weights (each a [n] float32 vector, random), so onnxruntime reads all."""
    rng = np.random.default_rng(0)
    x = ir.Value(name="x", shape=ir.Shape([sizes[0]]), type=ir.TensorType(ir.DataType.FLOAT))
    graph = ir.Graph([x], [], nodes=[], name="g", opset_imports={"": 18})
    total = x
    for i, n in enumerate(sizes):
        w = ir.Value(name=f"w{i}", const_value=ir.tensor(rng.standard_normal(n, dtype=np.float32), name=f"w{i}"))
        graph.register_initializer(w)
        s = ir.node("Slice", [w, _const(graph, f"s{i}", [0]), _const(graph, f"e{i}", [sizes[0]])])
        add = ir.node("Add", [total, s.outputs[0]])
        graph.extend([s, add])
        total = add.outputs[0]
    total.name = "out"
    total.type, total.shape = ir.TensorType(ir.DataType.FLOAT), ir.Shape([sizes[0]])
    graph.outputs.append(total)
    return ir.Model(graph, ir_version=10)


def _const(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    v = ir.Value(name=name, const_value=ir.tensor(np.array(values, dtype=np.int64), name=name))
    graph.register_initializer(v)
    return v


def test_the_streamed_file_is_the_canonical_model(tmp_path):
    model = _model([16, 1000, 3000])
    path = tmp_path / "m.onnx"
    write_streaming(model, path)
    canonical = ir.serde.serialize_model(model).SerializeToString()
    assert path.read_bytes() != canonical  # written in records, not in one message...
    assert onnx.load(str(path)).SerializeToString() == canonical  # ...that parse to the same model
    onnx.checker.check_model(str(path))
    x = np.arange(16, dtype=np.float32)
    got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    want = x + sum(model.graph.initializers[f"w{i}"].const_value.numpy()[:16] for i in range(3))
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_every_weight_layout_is_written_as_the_canonical_serializer_writes_it(tmp_path):
    # raw data is written from the tensor's own memory where it is laid out as written, else
    # from its tobytes: a transposed view, a torch tensor, half types, 4-bit packing
    import torch
    from torch.onnx._internal.exporter._core import TorchTensor

    rng = np.random.default_rng(0)
    tensors = {
        "numpy": ir.tensor(rng.standard_normal((3, 5), dtype=np.float32)),
        "numpy_transposed": ir.tensor(rng.standard_normal((5, 3), dtype=np.float32).T),
        "torch": TorchTensor(torch.randn(3, 5)),
        "torch_transposed": TorchTensor(torch.randn(5, 3).t()),
        "torch_fp16": TorchTensor(torch.randn(3, 5).half()),
        "torch_bf16": TorchTensor(torch.randn(3, 5).bfloat16()),
        "int64": ir.tensor(np.array([1, -2, 3], dtype=np.int64)),
        "int4": ir.tensor(np.array([1, -2, 3, 4, 5], dtype=np.int8), dtype=ir.DataType.INT4),
    }
    graph = ir.Graph([], [], nodes=[], name="g", opset_imports={"": 21})
    for name, tensor in tensors.items():
        graph.register_initializer(ir.Value(name=name, shape=ir.Shape(tensor.shape.numpy()), type=ir.TensorType(tensor.dtype),
                                            const_value=tensor))
    out = ir.node("Identity", [graph.initializers["numpy"]])
    graph.append(out)
    graph.outputs.append(out.outputs[0])
    out.outputs[0].name = "y"
    model = ir.Model(graph, ir_version=10)
    path = tmp_path / "m.onnx"
    write_streaming(model, path)
    loaded = {t.name: t for t in onnx.load(str(path)).graph.initializer}
    canonical = {t.name: t for t in ir.serde.serialize_model(model).graph.initializer}
    assert loaded.keys() == canonical.keys() == tensors.keys()
    for name in tensors:
        assert loaded[name].SerializeToString() == canonical[name].SerializeToString(), name
        assert loaded[name].raw_data == tensors[name].tobytes(), name


# The child's own peak: VmHWM, reset to the current RSS first (Linux's clear_refs "5"). Not
# ru_maxrss, which a child keeps from a larger parent across fork and exec: from a test worker that
# had grown past the child's whole peak, the canonical writer's copy seemed to cost 30 MiB.
_MEASURE = textwrap.dedent("""
    import sys
    from tests.reliability.test_streaming_write import _model
    from specc.export.onnx import write_streaming
    import onnx_ir as ir

    def peak_kib():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))

    mib = 1 << 20
    model = _model([16] + [16 * mib // 4] * 6)  # six 16 MiB weights: 96 MiB
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = peak_kib()
    if sys.argv[1] == "streaming":
        write_streaming(model, sys.argv[2])
    else:
        ir.save(model, sys.argv[2])
    print((peak_kib() - before) * 1024 / mib)
""")


def _peak_growth_mib(route: str, path) -> float:
    from pathlib import Path

    # run from the repository root, whose `tests` package the child imports this module's _model from
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", _MEASURE, route, str(path)], capture_output=True, text=True, check=True,
                         cwd=root)
    return float(out.stdout.strip().splitlines()[-1])


def test_writing_holds_one_weight_not_a_second_copy(tmp_path):
    streaming = _peak_growth_mib("streaming", tmp_path / "a.onnx")
    canonical = _peak_growth_mib("canonical", tmp_path / "b.onnx")
    # 96 MiB of weights: the canonical writer's peak grows by up to twice that (150-400 MiB seen,
    # depending on the peak before it), the streaming one by at most about one 16 MiB weight
    assert canonical > 100, canonical
    assert streaming < 40 and streaming < canonical / 3, (streaming, canonical)
