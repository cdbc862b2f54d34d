"""Which layer of a failed streamed build goes wrong first.

A streamed build's graph is verified whole (specc/export/verify.py); when that fails, its first
case is run again with each layer's output (the residual stream the stitch recorded,
stitch.LAYER_OUTPUTS) added to the graph's outputs, beside torch's layers, made one at a time,
and a layer is named: at a float precision the first whose output is beyond the precision's
tolerance (a planted wrong weight in layer k leaves layers 0..k-1 within it); where none is (the
hidden state, the residual stream, hides a wrong sublayer better than the outputs verify
compares), and at an integer precision, the layer where the relative difference from torch
grows most.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from specc.export import verify
from specc.spec.targets import PRECISIONS

DIAGNOSE_FILE = ".diagnose.onnx"  # beside the graph (its external data is found relative to it); removed after


def first_wrong_layer(r, graph: Path, names: dict[str, list[str]], reference, session_for, precision: str,
                      seed: int, longest: int | None) -> str | None:
    """'decoder layer 7 (max |diff| ..., ...)' for the first layer of the graph at `graph` whose
    output is off from `reference`'s (a streamed model, specc/nn/streamed.py), or None where
    every recorded layer is within (the fault is after the stack, or there is nothing to say).
    `names`: {role: [each layer's output value name]}; session_for(path): an onnxruntime session."""
    import onnx

    step = verify._steps(r, seed, longest)[0]
    feed = verify.case_feed(step, None, None)
    proto = onnx.load(str(graph), load_external_data=False)
    elem = onnx.TensorProto.FLOAT16 if PRECISIONS[precision].half else onnx.TensorProto.FLOAT
    wanted = [(role, i, n) for role, layer_names in names.items() for i, n in enumerate(layer_names)]
    for _, _, name in wanted:
        proto.graph.output.append(onnx.helper.make_tensor_value_info(name, elem, None))
    path = graph.with_name(DIAGNOSE_FILE)
    try:
        onnx.save(proto, str(path))
        del proto
        session = session_for(path)
        got = dict(zip([n for _, _, n in wanted], session.run([n for _, _, n in wanted], feed)))
        del session
    finally:
        path.unlink(missing_ok=True)
    outputs = _torch_layer_outputs(reference, feed, names)
    quantized = PRECISIONS[precision].quantized
    atol, rtol = (0.0, 0.0) if quantized else verify.tolerance("onnx", precision)
    grown: list[tuple[float, str]] = []  # (how much the relative difference grew, the layer's description)
    for role in names:
        before = 0.0
        for i, name in enumerate(names[role]):
            want, have = outputs[role][i], got[name].astype(np.float32)
            diff, scale = float(np.abs(have - want).max()), float(np.abs(want).max())
            rel = float(np.linalg.norm(have - want) / max(float(np.linalg.norm(want)), 1e-30))
            if not quantized and diff > atol + rtol * scale:
                return f"{role} layer {i} (max |diff| {diff:.3g}, {diff / max(scale, 1e-30):.2g} of its largest value)"
            grown.append((rel - before, f"{role} layer {i} (its output's relative difference from torch grows from "
                                        f"{before:.3g} to {rel:.3g}, the most of any layer)"))
            before = rel
    return max(grown, key=lambda g: g[0])[1] if grown else None


def _torch_layer_outputs(reference, feed: dict, names: dict[str, list[str]]) -> dict[str, list[np.ndarray]]:
    """Each recorded stack's layer outputs for `feed`, from torch's layers (forward hooks)."""
    import torch

    with verify.recording(reference, names) as outputs, torch.no_grad():
        reference(**{k: torch.from_numpy(np.ascontiguousarray(v, dtype=np.float32 if v.dtype.kind == "f" else v.dtype))
                     for k, v in feed.items()})
    return outputs


