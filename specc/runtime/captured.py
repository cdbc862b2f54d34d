"""Decoding on a GPU with each step one launch: a decoder's in-place cache graph on onnxruntime's
CUDA provider with CUDA graph capture (the provider's `enable_cuda_graph`), its inputs and outputs
bound once to buffers that stay on the device.

    prefill (run normally: gpu_graph_id -1)      input_ids [rows, prompt] from the host
         |  writes positions 0..prompt-1 into the device store, its last positions' logits -> host
         v
    step (replayed: gpu_graph_id = rows)          ids, positions, seqlens_k copied into their
         |  device buffers; one cudaGraphLaunch;  bound buffers (a few bytes each); the launch
         |  the next position written in place    reads them where the capture bound them
         v
    logits [rows, 1, vocab] -> host, the token chosen there

A CUDA graph replays the kernels it captured with the arguments they had, so every step must bind
the same device addresses and shapes: the store is [rows, kv_heads, capacity, head_dim] per layer
(capacity: the build's serving.length.max, which the graph's rotary tables cover), a step's LM
output holds its one position (a prefill's, the prompt's last few: its own buffer), and total_sequence_length (GroupQueryAttention's host-side scalar) is the
store's capacity on every step, so that nothing captured depends on the length. The length a row
has is seqlens_k, read on the device: GroupQueryAttention attends to positions 0..seqlens_k of each
row, so what an earlier generation left beyond them is never read. One capture per row count is
kept for the session's life (onnxruntime keeps a captured graph per gpu_graph_id), with its store.

onnxruntime captures only a graph with every compute node on the CUDA provider (shape arithmetic
on the CPU is allowed, copies between the two are not) and computes GroupQueryAttention on CUDA
in fp16 and bf16 alone; `unfit` says when a build's graph is not such a graph, and generation
then runs the graph without capture (specc/runtime/generate.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from specc.errors import first_line
from specc.runtime.errors import RunError
from specc.runtime.graph import Graph
from specc.spec.io import (
    BATCH,
    INPUT_IDS,
    MAX_SEQUENCE,
    POSITION_IDS,
    SEQLENS_K,
    TOKEN_TYPE_IDS,
    TOTAL_SEQUENCE_LENGTH,
    concrete_dims,
    is_past,
    numpy_dtype,
    parse_cache,
)

RUN_OPTION = "gpu_graph_id"  # onnxruntime's run option naming the captured graph a run replays
NOT_CAPTURED = "-1"  # its value for a run that is neither captured nor replayed
CAPTURE_OPTIONS = {"enable_cuda_graph": "1"}  # the CUDA provider's options for such a session
# the float dtypes onnxruntime's CUDA GroupQueryAttention computes
CUDA_ATTENTION_DTYPES = ("float16", "bfloat16")


def unfit(graph: Graph) -> str | None:
    """Why `graph` (an in-place cache graph) cannot be replayed on the GPU, or None where it can."""
    if graph.device != "cuda":
        return f"it runs on {graph.provider}, not on CUDA"
    dtype = next(t.dtype for n, t in graph.inputs.items() if is_past(n))
    if dtype not in CUDA_ATTENTION_DTYPES:
        return f"its cache is {dtype}; onnxruntime's CUDA GroupQueryAttention computes float16 and bfloat16"
    return None


class CapturedDecoder:
    """The device state of one row count: the store, the bound inputs and outputs of a step, and
    the run options naming its captured graph (one per row count). Made once per (session, rows)
    and kept. capture=False: the same bound buffers, every step run by onnxruntime as usual (the
    graph's session then has no CUDA graph capture), to measure what the capture itself does."""

    def __init__(self, graph: Graph, rows: int, capacity: int, logits: str, capture: bool = True):
        why = unfit(graph) if capture else None
        if why:
            raise RunError(f"the in-place graph cannot be replayed on the GPU: {why}")
        ort = graph.ort
        self.graph, self.rows, self.capacity, self.logits_name = graph, rows, capacity, logits
        self.length = 0  # positions each row has in the store
        dims = {BATCH: rows, MAX_SEQUENCE: capacity}

        def device(shape, dtype) -> Any:
            return ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.dtype(dtype), graph.device, 0)

        self.store = {name: device(concrete_dims(t.dims, dims), numpy_dtype(t.dtype))
                      for name, t in graph.inputs.items() if is_past(name)}
        self.into = {parse_cache(name)[1].present: value for name, value in self.store.items()}
        out = graph.output_sig[logits]
        self.logits = device((rows, 1, out.dims[-1]), numpy_dtype(out.dtype))
        # a step's inputs: written on the host, copied into these bound buffers before each launch
        self.step_inputs = {INPUT_IDS: device((rows, 1), np.int64), SEQLENS_K: device((rows,), np.int32)}
        if POSITION_IDS in graph.inputs:
            self.step_inputs[POSITION_IDS] = device((rows, 1), np.int64)
        if TOKEN_TYPE_IDS in graph.inputs:
            self.step_inputs[TOKEN_TYPE_IDS] = device((rows, 1), np.int64)
            self.step_inputs[TOKEN_TYPE_IDS].update_inplace(np.zeros((rows, 1), np.int64))
        self.total = np.array(capacity, dtype=np.int32)  # the host-side scalar: the same on every step
        self.step_binding = self._binding(self.step_inputs, self.total, self.logits)
        self.plain = ort.RunOptions()
        self.plain.add_run_config_entry(RUN_OPTION, NOT_CAPTURED)
        self.replay = ort.RunOptions()  # capture=False: every step runs as the prefill does
        self.replay.add_run_config_entry(RUN_OPTION, str(rows) if capture else NOT_CAPTURED)

    def _binding(self, inputs: dict[str, Any], total: np.ndarray, logits: Any = None):
        """The IO binding of a call: the store, `inputs`, and the LM output into `logits` (a
        step's bound buffer) or, where None, wherever onnxruntime puts it (a prefill's)."""
        binding = self.graph.session.io_binding()
        for name, value in inputs.items():
            binding.bind_ortvalue_input(name, value)
        binding.bind_cpu_input(TOTAL_SEQUENCE_LENGTH, total)
        for name, value in self.store.items():
            binding.bind_ortvalue_input(name, value)
        for name, value in self.into.items():
            binding.bind_ortvalue_output(name, value)
        if logits is not None:
            binding.bind_ortvalue_output(self.logits_name, logits)
        for name in self.graph.outputs:  # any other output: where onnxruntime puts it
            if (name != self.logits_name or logits is None) and name not in self.into:
                binding.bind_output(name, self.graph.device)
        return binding

    def prefill(self, ids: np.ndarray) -> np.ndarray:
        """Write the prompts `ids` [rows, prompt] (equal lengths) into the store from position 0; the
        last position's logits [rows, vocab] on the host. Run without capture (its shape is the
        prompt's)."""
        rows, t = ids.shape
        if rows != self.rows:
            raise RunError(f"{rows} prompts for a decoder of {self.rows} rows")
        if t > self.capacity:
            raise RunError(f"a prompt of {t} positions past the store's {self.capacity}")
        inputs = {INPUT_IDS: self.graph.value(INPUT_IDS, ids),
                  SEQLENS_K: self.graph.value(SEQLENS_K, np.full(rows, t - 1))}
        if POSITION_IDS in self.graph.inputs:
            inputs[POSITION_IDS] = self.graph.value(POSITION_IDS, np.broadcast_to(np.arange(t), (rows, t)))
        if TOKEN_TYPE_IDS in self.graph.inputs:
            inputs[TOKEN_TYPE_IDS] = self.graph.value(TOKEN_TYPE_IDS, np.zeros((rows, t)))
        binding = self._binding(inputs, np.array(t, dtype=np.int32))
        self._run(binding, self.plain)
        self.length = t
        bound = list(self.into) + [n for n in self.graph.outputs if n not in self.into]  # the binding's order
        outputs = dict(zip(bound, binding.get_outputs()))
        return outputs[self.logits_name].numpy()[:, -1, :]

    def step(self, tokens: np.ndarray) -> np.ndarray:
        """One new token per row at position `length`, written in place; the logits [rows, vocab]."""
        if self.length >= self.capacity:
            raise RunError(f"the store of {self.capacity} positions is full")
        p = self.length
        self.step_inputs[INPUT_IDS].update_inplace(np.ascontiguousarray(tokens, dtype=np.int64).reshape(self.rows, 1))
        self.step_inputs[SEQLENS_K].update_inplace(np.full(self.rows, p, dtype=np.int32))
        if POSITION_IDS in self.step_inputs:
            self.step_inputs[POSITION_IDS].update_inplace(np.full((self.rows, 1), p, dtype=np.int64))
        self._run(self.step_binding, self.replay)
        self.length = p + 1
        return self._logits()

    def _run(self, binding, options) -> None:
        try:
            self.graph.session.run_with_iobinding(binding, options)
        except Exception as exc:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime failed: {first_line(exc)}") from None

    def _logits(self) -> np.ndarray:
        return self.logits.numpy()[:, -1, :]


class CapturedRunner:
    """generate()'s runner over a session's CapturedDecoder for this many rows (equal-length
    prompts, nothing padded): prefill, then one replayed step per token."""

    def __init__(self, decoder: CapturedDecoder, rows: list[list[int]], new: int):
        if len(rows[0]) + new > decoder.capacity:
            raise RunError(f"prompt {len(rows[0])} + {new} new tokens past the build's {decoder.capacity} positions")
        self.decoder = decoder
        self.ids = np.asarray(rows, dtype=np.int64)

    def prefill(self) -> np.ndarray:
        return self.decoder.prefill(self.ids)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        return self.decoder.step(tokens)
