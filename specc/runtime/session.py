"""Run what `specc build` wrote, with onnxruntime. Never imports specc.nn or specc.export: the
build directory (its manifest and graphs) is all a Session needs.

    s = Session("build/tiny-gpt2")
    s.provider                       # the execution provider that really runs the graphs
    s.run(input_ids=[[1, 2, 3]])     # {"logits": array, "present.0.key": array, ...}
    s.generate([1, 2, 3], max_new_tokens=8).ids

Decoder graphs carry their KV cache as OrtValues from one step to the next through IO binding,
on the device that runs the graph (no copy through numpy). On CPU a generation allocates its cache
once (CacheBuffers: two buffers per layer, used in turn, sized for prompt + max_new_tokens) and
onnxruntime writes each step's present.* straight into them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import numpy as np

from specc.deps import require_onnxruntime
from specc.errors import SpeccError
from specc.fileio import write_atomic
from specc.spec import manifest as spec_manifest
from specc.spec.manifest import MANIFEST

# most capable first; onnxruntime would otherwise fall back silently
PREFERRED_PROVIDERS = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
_NP = {"int64": np.int64, "int32": np.int32, "float32": np.float32, "float16": np.float16}


class RunError(SpeccError):
    """Bad inputs to a built model, or a build directory that cannot be run."""


def choose_providers(available: Sequence[str], requested: Sequence[str] | None = None) -> list[str]:
    """The providers to ask for, in order: `requested` (each must be available), else the
    preferred ones that are available. CPU always ends the list."""
    if requested:
        missing = [p for p in requested if p not in available]
        if missing:
            raise RunError(f"execution provider(s) {', '.join(missing)} not available here; "
                           f"available: {', '.join(available)}")
        chosen = list(requested)
    else:
        chosen = [p for p in PREFERRED_PROVIDERS if p in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


def session_options(ort, threads: int | None = None):
    """onnxruntime options specc runs with: every graph optimization, quiet logs, intra-op
    threads = `threads`, else onnxruntime's default (on this project's 2-vCPU machines it runs
    two threads: bert-base at seq 128 in 67 ms, against 119 ms on one)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.log_severity_level = 3
    if threads:
        options.intra_op_num_threads = threads
    return options


def read_manifest(build_dir: str | Path) -> dict:
    path = Path(build_dir) / MANIFEST
    if not path.is_file():
        raise RunError(f"{build_dir}: not a specc build (no {MANIFEST}); run `specc build SPEC -o {build_dir}` first")
    try:
        manifest = spec_manifest.read_manifest(path)
    except OSError as exc:
        raise RunError(f"{path}: cannot read the manifest ({exc.strerror})") from None
    except spec_manifest.NotAManifest as exc:
        raise RunError(f"{path}: {exc}") from None
    if "graphs" not in manifest or "spec" not in manifest:
        raise RunError(f"{path}: not a specc manifest (no 'graphs' or 'spec')")
    return manifest


class Graph:
    """One onnxruntime session with its IO signature from the manifest."""

    def __init__(self, ort, path: Path, sig: dict, providers: list[str], options):
        try:
            self.session = ort.InferenceSession(str(path), options, providers=providers)
        except Exception as exc:  # onnxruntime's own exception types
            raise RunError(f"{path}: onnxruntime cannot load it: {str(exc).strip().splitlines()[0]}") from None
        self.ort = ort
        self.inputs = {t["name"]: t for t in sig["inputs"]}
        self.outputs = [t["name"] for t in sig["outputs"]]
        self.output_sig = {t["name"]: t for t in sig["outputs"]}
        self.provider = self.session.get_providers()[0]
        self.device = "cuda" if self.provider in ("CUDAExecutionProvider", "TensorrtExecutionProvider") else "cpu"

    def value(self, name: str, array: np.ndarray):
        """An OrtValue for an input, in the graph's dtype, on the graph's device."""
        dtype = _NP.get(self.inputs[name]["dtype"], np.float32)
        array = np.ascontiguousarray(array, dtype=dtype)
        return self.ort.OrtValue.ortvalue_from_numpy(array, self.device, 0)

    def run(self, feeds: dict[str, Any], into: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
        """Run with IO binding. Feeds are numpy arrays or OrtValues; the result holds OrtValues
        (on the graph's device), keyed by output name. `into` (CPU only): preallocated contiguous
        arrays of the exact output shapes, which onnxruntime writes those outputs into."""
        missing = sorted(set(self.inputs) - set(feeds))
        if missing:
            raise RunError(f"missing input(s): {', '.join(missing)}")
        binding = self.session.io_binding()
        for name in self.inputs:
            val = feeds[name]
            if not isinstance(val, self.ort.OrtValue):
                val = self.value(name, val)
            binding.bind_ortvalue_input(name, val)
        for name in self.outputs:
            if into and name in into:
                binding.bind_ortvalue_output(name, self.ort.OrtValue.ortvalue_from_numpy(into[name]))
            else:
                binding.bind_output(name, self.device)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # onnxruntime's own exception types
            raise RunError(f"onnxruntime failed: {str(exc).strip().splitlines()[0]}") from None
        return dict(zip(self.outputs, binding.get_outputs()))


class CacheBuffers:
    """The self-attention KV cache of one generation on CPU, allocated once: two flat buffers per
    present.* output, each big enough for [batch, heads, capacity, head_dim], used in turn. A step
    reads its past from views of one and onnxruntime writes the present into views of the other,
    so no step allocates a cache (the graph's Concat still copies past + new into the present)."""

    def __init__(self, graph: Graph, batch: int, capacity: int):
        self.graph = graph
        self.batch, self.capacity = batch, capacity
        self.buffers: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        self.heads: dict[str, tuple[int, int]] = {}
        for name, t in graph.output_sig.items():
            if name.startswith("present.") and ".encoder." not in name:
                _, h, _, d = t["dims"]
                dtype = _NP.get(t["dtype"], np.float32)
                self.heads[name] = (h, d)
                self.buffers[name] = (np.empty(batch * h * capacity * d, dtype), np.empty(batch * h * capacity * d, dtype))
        self.turn = 0
        self.current: dict[str, np.ndarray] = {}  # the views that hold the cache now

    def next(self, total: int) -> dict[str, np.ndarray]:
        """Views [batch, heads, total, head_dim] of the buffers not holding the current cache."""
        if total > self.capacity:
            raise RunError(f"cache of {total} positions past its capacity of {self.capacity}")
        out = {}
        for name, pair in self.buffers.items():
            h, d = self.heads[name]
            out[name] = pair[self.turn][: self.batch * h * total * d].reshape(self.batch, h, total, d)
        return out

    def hold(self, views: dict[str, np.ndarray]) -> dict[str, Any]:
        """Make `views` (from next()) the current cache; returns them as past_key_values.* inputs."""
        self.current, self.turn = views, 1 - self.turn
        return {"past_key_values." + k[len("present."):]: self.graph.ort.OrtValue.ortvalue_from_numpy(v)
                for k, v in views.items()}

    def reorder(self, rows: np.ndarray) -> dict[str, Any]:
        """The current cache with its batch rows taken in the order `rows` (beam search)."""
        total = next(iter(self.current.values())).shape[2]
        views = self.next(total)
        for name, view in views.items():
            np.take(self.current[name], rows, axis=0, out=view)
        return self.hold(views)


class Session:
    """A built model, ready to run. providers: onnxruntime execution providers to use, in order
    (default: TensorRT, CUDA, CPU, those available). threads: intra-op threads (default: onnxruntime's)."""

    def __init__(self, build_dir: str | Path, providers: Sequence[str] | None = None, *, threads: int | None = None):
        ort = require_onnxruntime("running a build")
        self.dir = Path(build_dir)
        self.manifest = read_manifest(self.dir)
        self.spec = self.manifest["spec"]
        self.architecture = self.manifest["architecture"]
        options = session_options(ort, threads)
        asked = choose_providers(ort.get_available_providers(), providers)
        self.graphs = {name: Graph(ort, self.dir / info["file"], info, asked, options)
                       for name, info in self.manifest["graphs"].items()}
        first = next(iter(self.graphs.values()))
        self.provider = first.provider  # what really runs (onnxruntime falls back silently)
        self.providers = first.session.get_providers()

    # --- facts -----------------------------------------------------------------------------

    @property
    def tokens(self) -> dict:
        return self.spec.get("tokens", {})

    @property
    def output_names(self) -> list[str]:
        main = self.graphs.get("decoder") or self.graphs["model"]
        return [n for n in main.outputs if not n.startswith("present.")]

    # --- run -------------------------------------------------------------------------------

    def run(self, **inputs: Any) -> dict[str, np.ndarray]:
        """Named outputs for named inputs (arrays or nested lists). Inputs the graph needs but the
        caller left out get their natural defaults: attention_mask all ones, position_ids counted
        from the mask, token_type_ids zeros, an empty KV cache. An encoder-decoder runs its
        encoder on input_ids and, given decoder_input_ids, its decoder too."""
        try:
            feeds = {k: np.asarray(v) for k, v in inputs.items()}
        except ValueError:
            raise RunError("inputs must be rectangular arrays; pad rows of different lengths "
                           "(or use generate(), which pads)") from None
        if "input_ids" not in feeds:
            raise RunError("run() needs input_ids")
        ids = feeds["input_ids"] = _ids(feeds["input_ids"])
        vocab = self.spec["vocab"]["size"]
        if ids.min() < 0 or ids.max() >= vocab:
            raise RunError(f"token ids must be in 0..{vocab - 1}; got {int(ids.min())}..{int(ids.max())}")
        if self.architecture == "encoder-decoder":
            return self._run_encoder_decoder(feeds)
        graph = self.graphs["model"]
        unknown = sorted(set(feeds) - set(graph.inputs))
        if unknown:
            raise RunError(f"unknown input(s) {', '.join(unknown)}; the model takes {', '.join(graph.inputs)}")
        out = graph.run(self._defaults(graph, feeds))
        return {k: v.numpy() for k, v in out.items()}

    def _run_encoder_decoder(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        enc, dec = self.graphs["encoder"], self.graphs["decoder"]
        dec_ids = feeds.pop("decoder_input_ids", None)
        unknown = sorted(set(feeds) - set(enc.inputs))
        if unknown:
            raise RunError(f"unknown input(s) {', '.join(unknown)}; the encoder takes {', '.join(enc.inputs)} "
                           "(and decoder_input_ids for the decoder)")
        enc_feeds = self._defaults(enc, feeds)
        enc_out = enc.run(enc_feeds)
        result = {"encoder_last_hidden_state": enc_out["last_hidden_state"].numpy()}
        if dec_ids is None:
            return result
        dec_feeds = {"input_ids": _ids(dec_ids), "encoder_attention_mask": enc_feeds["attention_mask"]}
        dec_feeds.update(as_past(enc_out))
        out = dec.run(self._defaults(dec, dec_feeds))
        result.update({k: v.numpy() for k, v in out.items()})
        return result

    def _defaults(self, graph: Graph, feeds: dict[str, np.ndarray]) -> dict[str, Any]:
        ids = feeds["input_ids"]  # validated by run()
        b, t = ids.shape
        out = dict(feeds)
        past = empty_cache(graph, b)
        p = 0
        if past:
            for name, val in past.items():
                out.setdefault(name, val)
            first = next(n for n in graph.inputs if n.startswith("past_key_values.") and ".encoder." not in n)
            p = shape_of(out[first])[2]
        if "attention_mask" in graph.inputs and "attention_mask" not in out:
            out["attention_mask"] = np.ones((b, p + t), dtype=np.int64)
        if "position_ids" in graph.inputs and "position_ids" not in out:
            mask = np.asarray(out["attention_mask"])
            out["position_ids"] = np.clip(np.cumsum(mask, axis=1) - 1, 0, None)[:, -t:]
        if "token_type_ids" in graph.inputs and "token_type_ids" not in out:
            out["token_type_ids"] = np.zeros((b, t), dtype=np.int64)
        return out

    # --- generate --------------------------------------------------------------------------

    def generate(self, input_ids, max_new_tokens: int = 20, **options):
        """Generate from one prompt (a list of ids), a batch (a list of lists, any lengths) or an
        int64 array [batch, seq]. Options as `specc generate`: greedy (default), sampling
        (temperature, top_k, top_p, seed), beam search (beams, length_penalty), eos_id, on_token
        (a callback getting each step's new ids). Returns a Generated with .ids and .new_ids."""
        from specc.runtime.generate import generate

        return generate(self, input_ids, max_new_tokens=max_new_tokens, **options)


# --- helpers shared with the generation loop ------------------------------------------------------


def _ids(x) -> np.ndarray:
    ids = np.asarray(x)
    if ids.ndim == 1:
        ids = ids[None, :]
    if ids.ndim != 2 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise RunError(f"input_ids must be a non-empty [batch, sequence] array of integers, got shape {list(ids.shape)}")
    return ids.astype(np.int64)


def save_npz(path: str | Path, arrays: dict[str, np.ndarray]) -> None:
    """Write arrays as NPZ atomically (temp file, then rename)."""
    import io

    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_atomic(path, buf.getvalue())


def shape_of(value) -> tuple[int, ...]:
    """The shape of a numpy array or an OrtValue (whose shape is a method)."""
    shape = getattr(value, "shape", None)
    return tuple(shape()) if callable(shape) else tuple(np.shape(value))


def empty_cache(graph: Graph, batch: int) -> dict[str, np.ndarray]:
    """Zero-length self-attention caches [B, H, 0, D] for a prompt."""
    out = {}
    for name, t in graph.inputs.items():
        if name.startswith("past_key_values.") and ".encoder." not in name:
            shape = [batch if d == "batch" else 0 if d == "past_sequence" else d for d in t["dims"]]
            out[name] = np.zeros(shape, dtype=_NP.get(t["dtype"], np.float32))
    return out


def as_past(outputs: dict) -> dict:
    """A graph's present.* outputs as the next call's past_key_values.* inputs: a decoder's own
    cache, or an encoder's cross-attention K/V (present.N.encoder.*) for the decoder."""
    return {"past_key_values." + k[len("present."):]: v for k, v in outputs.items() if k.startswith("present.")}
