"""build(): the stages of `specc build` in order, each verified before the next.

    load -> resolve -> build module -> export -> optimize -> verify -> write
    (spec)   (IO sig)   (torch, weights)  (per graph)  (onnxscript)  (ORT vs torch)  (weights, manifest, rename)

Everything is written into a staging directory and moved to DIR only after verification passed
(specc/export/outdir.py). A rebuild whose inputs (resolved spec, weights, options, versions) hash
to the cache key recorded in DIR/manifest.json, with every artifact intact, is a cache hit.
"""
from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import shutil
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specc import __version__
from specc.errors import BuildError
from specc.export.outdir import Staging
from specc.fileio import write_atomic
from specc.interrupts import check as check_interrupt
from specc.interrupts import watch as watch_interrupts
from specc.spec.dump import spec_to_data
from specc.spec.manifest import MANIFEST, MANIFEST_VERSION
from specc.spec.resolve import ResolvedSpec

STAGES = ("load", "resolve", "build module", "export", "optimize", "save", "verify", "write")
TARGETS = ("onnx", "tensorrt", "triton")
PRECISIONS = ("fp32", "fp16", "bf16", "int8", "int4")
_ONNX_PRECISIONS = ("fp32", "fp16", "int8", "int4")
BUILT_PRECISIONS = {"onnx": _ONNX_PRECISIONS,  # what each target builds today
                    "triton": _ONNX_PRECISIONS,  # a repository of the onnx target's graphs
                    "tensorrt": ("fp32", "fp16")}  # bf16: onnxruntime (CPU) cannot verify the graph first
DEFAULT_OPSET = 18  # see specc/export/onnx.py for why

Progress = Callable[[str, str, dict], None]  # (stage, "start" | "done", facts)


@dataclass
class BuildResult:
    """What a build produced: DIR, its manifest (the facts `specc build --json` prints) and
    whether it was a cache hit."""

    out_dir: Path
    manifest: dict
    cached: bool = False

    @property
    def artifacts(self) -> list[dict]:
        return self.manifest["artifacts"]

    @property
    def parameters(self) -> int:
        return self.manifest["parameters"]

    @property
    def verification(self) -> dict:
        return self.manifest["verification"]

    @property
    def max_abs_diff(self) -> float:
        return self.manifest["verification"]["max_abs_diff"]

    def to_dict(self) -> dict:
        return {"out_dir": str(self.out_dir), "cached": self.cached, **self.manifest}


@dataclass
class _Clock:
    progress: Progress | None
    times: dict[str, float] = field(default_factory=dict)
    started: dict[str, float] = field(default_factory=dict)

    def so_far(self) -> dict[str, float]:
        """Finished stages' times plus the running ones' time so far."""
        now = time.perf_counter()
        running = {k: round(now - t, 3) for k, t in self.started.items() if k not in self.times}
        return {**self.times, **running}

    @contextlib.contextmanager
    def stage(self, name: str, **facts: Any):
        check_interrupt()
        if self.progress:
            self.progress(name, "start", facts)
        t0 = self.started[name] = time.perf_counter()
        done: dict[str, Any] = {}
        yield done
        self.times[name] = round(self.times.get(name, 0.0) + time.perf_counter() - t0, 3)
        if self.progress:
            self.progress(name, "done", {"seconds": self.times[name], **done})


def versions() -> dict[str, str]:
    import platform
    from importlib import metadata

    out = {"specc": __version__, "python": platform.python_version()}
    for dist in ("torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def _canonical(data: Any) -> bytes:
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def build(spec, out_dir: str | os.PathLike, *, target: str = "onnx", precision: str | None = None,
          weights: str | os.PathLike | None = None, seed: int = 0, force: bool = False,
          opset: int = DEFAULT_OPSET, max_memory: int | None = None,
          progress: Progress | None = None) -> BuildResult:
    """Build, verify and write a spec's artifacts to `out_dir` (see `specc build --help`).

    spec: a path, a catalog name, a ModelSpec or a ResolvedSpec. precision: the spec's
    serving.precision unless given. weights: a safetensors file, else the spec's `weights:`, else
    seeded random initialisation. max_memory: bytes this build may use (default: what the machine
    has available). progress: called as progress(stage, "start" | "done", facts)."""
    from specc.export.onnx import SUPPORTED_OPSETS, file_sha256

    if target not in TARGETS:
        raise BuildError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if target == "tensorrt":  # before any export work: without TensorRT there is nothing to build
        from specc.deps import require_tensorrt

        require_tensorrt("specc build --target tensorrt")
    if opset not in SUPPORTED_OPSETS:
        raise BuildError(f"opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}")
    clock = _Clock(progress)
    t_start = time.perf_counter()

    with clock.stage("load"):
        spec_obj = _load(spec)
    with clock.stage("resolve") as facts:
        r = _resolve(spec_obj, precision)
        precision = r.serving.precision
        if precision not in BUILT_PRECISIONS[target]:
            raise BuildError(f"precision {precision} is not built for target {target} yet; "
                             f"choose one of {', '.join(BUILT_PRECISIONS[target])}")
        facts["name"] = r.name
    weights_path = Path(weights) if weights is not None else (Path(r.weights_path) if r.weights_path else None)
    weights_info: dict[str, Any] = {"source": "seed", "seed": seed}
    if weights_path is not None:
        if not weights_path.is_file():
            raise BuildError(f"{weights_path}: no such weights file")
        weights_info = {"source": "file", "file": weights_path.name, "sha256": file_sha256(weights_path)}
    spec_data = spec_to_data(r.spec)
    options = {"target": target, "precision": precision, "opset": opset, "weights": weights_info}
    vers = versions()
    engines = _builds_engines(target, precision)
    ort_passes = _ort_passes(engines)
    cache_key = hashlib.sha256(_canonical({"spec": spec_data, "options": options, "versions": vers,
                                           "manifest": MANIFEST_VERSION, "passes": ort_passes})).hexdigest()
    out = Path(out_dir)
    if not force:
        hit = _cached(out, cache_key)
        if hit is not None:
            if progress:
                progress("cache", "done", {"out_dir": str(out)})
            return BuildResult(out.absolute(), hit, cached=True)
    check_memory(r, max_memory)

    with Staging(out) as stage, watch_interrupts():
        from specc.export.onnx import preload

        model, n_params = _build_module(clock, r, weights_path, seed, preload())
        from specc.export.reference import ReferenceJob

        # the module's outputs for every verification case, and its weights file: taken in a
        # forked process beside the export where that pays (specc/export/reference.py), else
        # here once the graph is saved; large outputs (a long case's logits) wait on disk, in the
        # staging directory, until compared
        spill = stage.tmp / ".references"
        spill.mkdir()
        with ReferenceJob(r, model, seed, spill, stage.tmp / "model.safetensors") as references:
            files, optimizations = _export(clock, r, model, precision, opset, n_params, stage.tmp, ort_passes)
            with clock.stage("verify") as facts:
                from specc.export.verify import verify
                from specc.malloc import trim

                waited = time.perf_counter()
                refs = references.result()
                if references.seconds is not None:  # forked: its time, and how long verify waited for it
                    facts["reference_s"] = references.seconds
                    facts["reference_wait_s"] = round(time.perf_counter() - waited, 3)
                # then the module is released: the graph is loaded and run without a second copy
                # of the weights beside it
                _release(model)
                del model
                trim()  # the module's freed memory back to the system before onnxruntime loads its own copy
                sessions = {name: _session(paths[0], name) for name, paths in files.items()}
                report = verify(r, refs, sessions, "onnx", precision, seed=seed)  # the ONNX graph, by onnxruntime
                del sessions
                facts["max_abs_diff"] = report.max_abs
        with clock.stage("write"):
            graph_files = {sig.name: f"{sig.name}.onnx" for sig in r.graphs}
            engine_report, plans = None, {}
            if engines:
                engine_report, plans = _tensorrt(r, refs, files, stage.tmp, precision, seed)
            del refs
            shutil.rmtree(spill)
            if target == "triton":  # REPO/NAME/config.pbtxt, REPO/NAME/1/model.onnx (+ model.plan); manifest at REPO
                from specc.export.triton import model_names, write_repository

                names = model_names(r)
                artifacts = write_repository(stage.tmp, r, files, plans)
                graph_files = {g: f"{names[g]}/1/model.onnx" for g in graph_files}
            else:
                artifacts = [p for paths in files.values() for p in paths] + list(plans.values())
            artifacts.append(stage.tmp / "model.safetensors")
            manifest = {
                "specc_manifest": MANIFEST_VERSION,
                "name": r.name,
                "architecture": r.architecture,
                "spec": spec_data,
                "spec_sha256": hashlib.sha256(_canonical(spec_data)).hexdigest(),
                "options": options,
                "versions": vers,
                "cache_key": cache_key,
                "graphs": {sig.name: {"file": graph_files[sig.name], "inputs": _sigs(sig.inputs),
                                      "outputs": _sigs(sig.outputs)} for sig in r.graphs},
                "artifacts": _artifacts(artifacts, stage.tmp),
                "parameters": n_params,
                "optimizations": optimizations,
                "verification": report.to_dict(),
                **({"verification_tensorrt": engine_report} if engine_report is not None else {}),
                # wall-clock seconds per stage: not content, kept apart from the hashes above
                "timings_s": {**clock.so_far(), "total": round(time.perf_counter() - t_start, 3)},
            }
            _write_json(stage.tmp / MANIFEST, manifest)
            check_interrupt()  # the last moment a Ctrl-C still leaves DIR as it was
            stage.commit()
    return BuildResult(out.absolute(), manifest)


# --- stages ------------------------------------------------------------------------------------


def _load(spec):
    from specc.spec.schema import ModelSpec

    if isinstance(spec, (ModelSpec, ResolvedSpec)):
        return spec
    from specc.spec.load import load_spec

    return load_spec(spec)


def _resolve(spec, precision: str | None) -> ResolvedSpec:
    from specc.spec.resolve import resolve

    if precision is not None and precision not in PRECISIONS:
        raise BuildError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if isinstance(spec, ResolvedSpec):
        if precision is None or precision == spec.serving.precision:
            return spec
        spec = spec.spec  # explicit; re-resolved below with the precision
    if precision is not None and precision != spec.serving.precision:
        serving = spec.serving.model_copy(update={"precision": precision})
        spec = spec.model_copy(update={"serving": serving})
    return resolve(spec)


def _build_module(clock: _Clock, r: ResolvedSpec, weights_path: Path | None, seed: int, preloading=None):
    """The module, while `preloading` (specc.export.onnx.preload) imports the exporter beside it:
    the stage ends when both are done, before the reference run is forked."""
    with clock.stage("build module") as facts:
        from specc.nn import to_torch

        model = to_torch(r, weights=weights_path, seed=seed)
        n_params = sum(p.numel() for p in model.parameters())
        facts["parameters"] = n_params
        if preloading is not None:
            preloading.join()
    return model, n_params


def _release(model) -> None:
    """Free the module's weight memory at once. `del model` alone is not enough: onnxscript's
    rewrite rules keep the last graph they matched (module-level state), and that graph's input
    bookkeeping still holds the parameter objects the exporter started from (save() detaches the
    graph's own constants). Each parameter and buffer is pointed at an empty tensor, so its memory
    goes back whoever still holds the object. The module is unusable afterwards."""
    import torch

    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = torch.empty(0, dtype=tensor.dtype)


def _builds_engines(target: str, precision: str) -> bool:
    """Whether this build makes TensorRT engines: the tensorrt target, or a triton repository
    where TensorRT and a GPU are there (_engines_possible)."""
    return target == "tensorrt" or (target == "triton" and _engines_possible(precision))


def _ort_passes(engines: bool) -> list[str]:
    """specc's graph passes for a build. They emit onnxruntime operators, so a build that makes
    TensorRT engines from its graphs gets none."""
    from specc.export.passes import PASSES

    return [] if engines else list(PASSES)


def _export(clock: _Clock, r: ResolvedSpec, model, precision: str, opset: int, n_params: int, tmp: Path,
            ort_passes: list[str] = ()):
    """Export every graph, optimize it (onnxscript's optimizer, then specc's `ort_passes`), save it
    into tmp. Returns ({graph: [files]}, optimizations)."""
    from specc.export import onnx as onnx_export

    export_model = _for_precision(model, precision)
    programs, prefolded, optimizations = {}, {}, []
    with clock.stage("export", graphs=[g.name for g in r.graphs]):
        for sig in r.graphs:
            example = onnx_export.example_inputs(r, sig)
            with _quiet():
                programs[sig.name], stitched = onnx_export.export_stitched(export_model, r, sig, example, opset)
            if stitched is not None:
                prefolded[sig.name] = stitched.get("prefolded", False)
                optimizations.append(stitched)
    with clock.stage("optimize") as facts:
        for sig in r.graphs:
            with _quiet():
                optimizations.append({"graph": sig.name, **onnx_export.optimize(programs[sig.name],
                                                                                prefolded.get(sig.name, False))})
            if ort_passes:
                from specc.export import passes

                before = len(programs[sig.name].model.graph)
                fired = passes.apply(programs[sig.name].model, ort_passes)
                optimizations.append({"graph": sig.name, "pass": "specc.passes", "nodes_before": before,
                                      "nodes_after": len(programs[sig.name].model.graph), "fusions": fired})
        facts["optimizations"] = optimizations
    weight_bytes = n_params * (2 if precision in ("fp16", "bf16") else 4)
    files = {}
    with clock.stage("save"):
        for sig in r.graphs:
            with _quiet():
                files[sig.name] = onnx_export.save(programs.pop(sig.name), sig, tmp / f"{sig.name}.onnx", weight_bytes, opset)
    if precision in ("int8", "int4"):
        from specc.export.quantize import quantize

        with clock.stage("quantize") as facts:
            for sig in r.graphs:
                if len(files[sig.name]) > 1:
                    raise BuildError(f"{precision} builds of graphs past 2 GB (external data) are not supported yet")
                with _quiet():
                    optimizations.append(quantize(files[sig.name][0], precision, sig))
            facts["quantized"] = [o for o in optimizations if "precision" in o]
    return files, optimizations


def _engines_possible(precision: str) -> bool:
    """Whether a Triton build also builds TensorRT engines: tensorrt importable, a CUDA GPU, and a
    precision the tensorrt target builds."""
    import importlib.util

    if precision not in BUILT_PRECISIONS["tensorrt"] or importlib.util.find_spec("tensorrt") is None:
        return False
    import torch

    return torch.cuda.is_available()


def _tensorrt(r: ResolvedSpec, refs: dict, files: dict, tmp: Path, precision: str, seed: int) -> tuple[dict, dict]:
    """Check each graph against TensorRT's parser support, build one engine per graph
    (`<graph>.plan`) and verify the engines like the ONNX graphs (same cases, the tensorrt
    tolerance) against the module's reference_outputs(). Needs TensorRT and a CUDA GPU. Returns (the engines' verification, graph -> plan)."""
    import onnx

    from specc.export.tensorrt import EngineSession, build_engine, check_compatible
    from specc.export.verify import verify

    sessions, plans = {}, {}
    for sig in r.graphs:
        onnx_path = files[sig.name][0]
        check_compatible(onnx.load(str(onnx_path), load_external_data=False), graph=sig.name)
        plans[sig.name] = build_engine(onnx_path, tmp / f"{sig.name}.plan", r, sig, precision)
        sessions[sig.name] = EngineSession(plans[sig.name])
    return verify(r, refs, sessions, "tensorrt", precision, seed=seed).to_dict(), plans


def _for_precision(model, precision: str):
    """The module the exporter traces: the model itself in fp32, a half-precision copy in fp16
    (norms and softmax still accumulate in fp32 inside the modules)."""
    if precision in ("fp32", "int8", "int4"):  # integer precisions quantize the fp32 graph
        return model
    import copy

    import torch

    return copy.deepcopy(model).to({"fp16": torch.float16, "bf16": torch.bfloat16}[precision])


VERIFY_DISABLED_OPTIMIZERS = ["ConstantFolding"]


def _session(path: Path, graph: str):
    """The onnxruntime session a build verifies `graph` with: CPU, every graph optimization but
    constant folding, no weight prepacking."""
    from specc.deps import require_onnxruntime

    from specc.runtime.session import session_options

    ort = require_onnxruntime("verifying a build")
    opts = session_options(ort)
    # Neither of these changes what the graph computes (beyond float rounding: 2.4e-6 on
    # gpt2-small's logits), only where its weights lie: prepacking
    # keeps a packed copy of a weight beside the one a Gather still reads (a tied embedding), and
    # constant folding turns a tied LM head's Transpose into a transposed copy of the embedding.
    # Without them gpt2-small's session holds 0.52 GiB instead of 0.69 (its weights are 0.46);
    # tests/test_pipeline.py checks that a graph gives the same outputs with them and without.
    opts.add_session_config_entry("session.disable_prepacking", "1")
    try:
        return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"],
                                    disabled_optimizers=VERIFY_DISABLED_OPTIMIZERS)
    except Exception as exc:  # onnxruntime raises its own exception types
        raise BuildError(f"onnxruntime cannot load the exported {graph} graph: {str(exc).strip().splitlines()[0]}") from None


@contextlib.contextmanager
def _quiet():
    """The exporter prints progress to stdout and logs warnings, onnxruntime's quantizers log a
    line per node through the root logger; `specc build --json` owns stdout and a build reports
    through its own progress. Log records up to WARNING are dropped while inside."""
    sink = io.StringIO()
    disabled = logging.root.manager.disable
    logging.disable(max(disabled, logging.WARNING))
    try:
        with contextlib.redirect_stdout(sink), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)


# --- cache, manifest, memory -------------------------------------------------------------------


def _cached(out: Path, cache_key: str) -> dict | None:
    """DIR's manifest when it records this cache key and every artifact is intact."""
    try:
        manifest = json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("cache_key") != cache_key:
        return None
    try:
        artifacts = [(out / a["path"], a["bytes"], a["sha256"]) for a in manifest.get("artifacts", [])]
    except (KeyError, TypeError):
        return None
    if not all(p.is_file() and p.stat().st_size == size for p, size, _ in artifacts):
        return None
    if _sha256s([p for p, _, _ in artifacts]) != [digest for _, _, digest in artifacts]:
        return None
    return manifest


def _sha256s(paths: list[Path]) -> list[str]:
    """The files' sha256 digests, hashed side by side (hashlib leaves the GIL while hashing: a
    gpt2-small build's two 0.47 GiB artifacts take 0.4 s instead of 0.8 on two cores)."""
    from concurrent.futures import ThreadPoolExecutor

    from specc.export.onnx import file_sha256

    with ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return list(pool.map(file_sha256, paths))


def _sigs(sigs) -> list[dict]:
    return [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in sigs]


def _artifacts(paths: list[Path], root: Path) -> list[dict]:
    return [{"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size, "sha256": digest}
            for p, digest in zip(paths, _sha256s(paths))]


def _write_json(path: Path, data: dict) -> None:
    write_atomic(path, json.dumps(data, indent=2) + "\n")


def estimate_memory(r: ResolvedSpec) -> dict:
    """Bytes a build needs at its peak, from the spec alone: the fp32 weights held about four
    times (module, exported graph, onnxruntime session, weights file buffer) plus the
    verification activations at the longest case, plus a fixed 1 GiB for the libraries."""
    from specc.spec.costs import inspect_spec

    facts = inspect_spec(r)
    weights = facts["weight_bytes"]["fp32"]
    length = r.serving.length.max
    widest = max((l.ffn.d_ff for s in (r.encoder, r.decoder) if s for l in s.layers), default=r.d_model)
    heads = max((l.attention.heads for s in (r.encoder, r.decoder) if s for l in s.layers), default=1)
    vocab = max(r.vocab.size, r.target_vocab_size)
    # per layer kept by ORT's arena at once: scores [H,T,T] and the widest activations, in fp32
    activations = 4 * 4 * (heads * length * length + length * (4 * r.d_model + 2 * widest + vocab))
    total = 4 * weights + activations + 1024**3
    return {"bytes": total, "weights": weights, "activations": activations}


def available_memory() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_memory(r: ResolvedSpec, max_memory: int | None = None) -> None:
    """Refuse up front a build that cannot fit, with the estimate."""
    need = estimate_memory(r)
    have = max_memory if max_memory is not None else available_memory()
    if have is not None and need["bytes"] > have:
        from specc.report import human_bytes

        raise BuildError(
            f"building {r.name} needs about {human_bytes(need['bytes'])} "
            f"({human_bytes(need['weights'])} of fp32 weights held ~4 times during export and verification, "
            f"{human_bytes(need['activations'])} of activations), but {human_bytes(have)} is available; "
            "free memory, build on a larger machine, or raise the limit with --max-memory"
        )
