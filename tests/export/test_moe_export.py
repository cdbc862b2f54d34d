"""Routed experts built to ONNX as onnxruntime's MoE operator (specc/export/moe.py), one small
spec per router kind and activation it takes: the build's verification passes (onnxruntime
against the torch module, the tolerance table of every kind), each routed layer is one MoE node
(QMoE in integer builds) and no per-expert subgraph is left, and greedy tokens from the build's
onnxruntime session equal those of the torch module recomputing the whole sequence."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
import torch

import specc
from specc.builder.memory import estimate_streamed
from specc.builder.pipeline import _resolve, build
from specc.runtime import Session

from tests.helpers import speclib

pytest.importorskip("onnxruntime")

MOE = {"kind": "moe", "experts": 8, "top_k": 2, "d_ff": 64}
# widths the integer blocks divide (QMoE's blocks must), and a model large enough that int4's
# noise stays within the quality bar of seeded weights (at d_model 32 a dense FFN's misses it too)
NORM = {"d_model": 64, "vocab": {"size": 256}, "norm": {"kind": "rmsnorm", "placement": "pre"},
        "position": {"kind": "rotary"}}
# name -> (spec overrides, routed layers)
SPECS = {
    "softmax": ({**NORM, "decoder": {**speclib.stack(), "ffn": {**MOE, "router": {"kind": "softmax"}}}}, 2),
    "softmax-normalize": ({**NORM, "decoder": {**speclib.stack(layers=3), "ffn": {
        **MOE, "top_k": 3, "router": {"kind": "softmax", "normalize": True}}}}, 3),
    "softmax-groups-scale-shared": ({**NORM, "decoder": {**speclib.stack(), "ffn": {
        **MOE, "shared": {"d_ff": 16, "gate": True},
        "router": {"kind": "softmax", "normalize": True, "scale": 2.5, "groups": 4, "top_groups": 2}}}}, 2),
    "top-k-softmax-clamped-swiglu-bias": ({**NORM, "decoder": {**speclib.stack(), "ffn": {
        **MOE, "activation": "clamped_swiglu", "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "bias": True,
        "router": {"kind": "top_k_softmax", "bias": True}}}}, 2),
    "sigmoid-selection-groups-dense-first": ({**NORM, "decoder": {**speclib.stack(layers=3), "ffn": {
        **MOE, "shared": {"d_ff": 16}, "router": {"kind": "sigmoid", "normalize": True, "scale": 2.5,
                                                  "groups": 4, "top_groups": 2, "group_score": "top2_sum"}},
        "overrides": [{"indices": [0], "ffn": {"d_ff": 40, "activation": "swiglu"}}]}}, 2),
    "sparsemixer-silu": ({**NORM, "decoder": {**speclib.stack(), "ffn": {
        **MOE, "activation": "silu", "router": {"kind": "sparsemixer"}}}}, 2),
}
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    done: dict = {}

    def get(name: str, precision: str = "fp32"):
        if (name, precision) not in done:
            spec = speclib.tiny(SPECS[name][0])
            done[(name, precision)] = (spec, build(spec, tmp_path_factory.mktemp(f"{name}-{precision}") / "out",
                                                   precision=precision))
        return done[(name, precision)]

    return get


def _ops(path) -> dict[str, int]:
    ops: dict[str, int] = {}
    for node in onnx.load(str(path), load_external_data=False).graph.node:
        ops[node.op_type] = ops.get(node.op_type, 0) + 1
    return ops


def _torch_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            nxt = model(input_ids=ids)["logits"][:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(SPECS))
def test_routed_layers_are_moe_nodes_and_decode_as_torch(built, name):
    spec, result = built(name)
    assert result.manifest["verification"]["passed"] is True
    assert result.manifest["options"]["routed_experts"] == "MoE"  # a build with the loop over experts is not up to date
    layers = SPECS[name][1]
    for graph in ("model.onnx", "inplace.onnx"):
        ops = _ops(result.out_dir / graph)
        assert ops.get("MoE", 0) == layers, (graph, ops)
        assert "ScatterND" not in ops and ops.get("Gather", 0) < 2 + layers, (graph, ops)  # no per-expert rows
    model = specc.to_torch(spec, seed=0).eval()
    prompt = np.random.default_rng(1).integers(3, spec.vocab.size, 7).tolist()
    got = Session(result.out_dir, threads=1).generate([prompt], max_new_tokens=NEW_TOKENS).new_ids[0]
    assert list(got) == _torch_greedy(model, prompt)


@pytest.mark.parametrize("precision", ["int8", "int4"])
@pytest.mark.parametrize("name", ["softmax", "top-k-softmax-clamped-swiglu-bias", "sigmoid-selection-groups-dense-first"])
def test_integer_builds_pack_the_experts_as_qmoe(built, name, precision):
    """Verified against the torch module with the weights the graph holds (each expert's rows
    packed and unpacked as the quantizer packs them), as every integer build of seeded weights is."""
    _, result = built(name, precision)
    assert result.manifest["verification"]["passed"] is True
    facts = [o for o in result.manifest["optimizations"] if o.get("precision") == precision]
    assert facts and all(o["quantized_ops"].get("QMoE") == SPECS[name][1] and "moe_left_fp32" not in o for o in facts)
    for graph in ("model.onnx", "inplace.onnx"):
        ops = _ops(result.out_dir / graph)
        assert ops.get("QMoE", 0) == SPECS[name][1] and "MoE" not in ops, (graph, ops)


def test_a_streamed_build_folds_and_packs_each_layers_experts_as_it_writes_them(tmp_path):
    """The interleaved expert weight and its integer codes are lazy: a streamed build, whose
    layers' weights are read when written, makes them then (and verifies the graph as any other)."""
    spec = speclib.tiny(SPECS["softmax-normalize"][0])
    result = build(spec, tmp_path / "out", precision="int4", stream=True)
    assert "streamed" in result.manifest["verification"] and result.manifest["verification"]["passed"] is True
    assert _ops(result.out_dir / "model.onnx").get("QMoE") == SPECS["softmax-normalize"][1]
    # the memory and disk estimates count the experts as packed, as written (fp32 would be 3.6x)
    written = sum(numpy_helper.to_array(t).nbytes for t in onnx.load(str(result.out_dir / "model.onnx")).graph.initializer)
    stored = estimate_streamed(_resolve(spec, "int4", "onnx"))["stored"]
    assert abs(stored - written) < 0.05 * written, (stored, written)


def test_int8_activations_set_every_decode_kernels_level_and_the_cache_key(tmp_path):
    """serving.activations: int8 (the `--activations` flag) makes an int4 build's MatMulNBits and
    QMoE compute with the input rounded to int8 (accuracy level 4) in every graph that decodes, the
    in-place one included; the manifest says so, the cache key differs from the default build's
    (level 1), and the build verifies as any other, its kernels computing as served (weights
    prepacked: without, both builds' figures were the same, bit for bit). A tied head keeps int8's
    own level (4)."""
    spec = speclib.tiny(SPECS["softmax-normalize"][0])
    default = build(spec, tmp_path / "default", precision="int4")
    # whole, as the default build is (a routed build at int8 activations is otherwise streamed and
    # verified a layer at a time: tests/export/test_routing_ties.py)
    fast = build(spec, tmp_path / "fast", precision="int4", activations="int8", stream=False)
    assert fast.manifest["verification"]["passed"] is True
    assert fast.manifest["cache_key"] != default.manifest["cache_key"]
    figures = [[c["outputs"] for c in result.manifest["verification"]["cases"]] for result in (default, fast)]
    assert figures[0] and figures[0] != figures[1]  # the graph (it takes a cache: level 4) computed apart
    for result, level in ((default, 1), (fast, 4)):
        assert result.manifest["options"]["quantization"]["accuracy_level"] == level
        for graph in ("model.onnx", "inplace.onnx"):
            levels = {(n.op_type, a.i) for n in onnx.load(str(result.out_dir / graph), load_external_data=False).graph.node
                      if n.op_type in ("MatMulNBits", "QMoE") and not n.input[1].endswith(".T_q8.codes")
                      for a in n.attribute if a.name == "accuracy_level"}
            assert levels == {("MatMulNBits", level), ("QMoE", level)}, (graph, levels)
    assert build(spec, tmp_path / "fast", precision="int4", activations="int8", stream=False).cached


def test_activations_are_refused_on_a_float_build_naming_the_key(tmp_path):
    from specc.errors import BuildError

    spec = speclib.tiny(SPECS["softmax"][0])
    with pytest.raises(BuildError, match=r"serving\.activations: int8 activations are an integer build's"):
        build(spec, tmp_path / "out", precision="fp32", activations="int8")
    assert not (tmp_path / "out").exists()
