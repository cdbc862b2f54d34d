"""build(): the stages of `specc build` in order.

    load -> resolve -> [cache hit?] -> plan -> build module -> export -> optimize -> save -> verify -> write
    (spec)  (IO sig,    (manifest.py)  (plan.py:  (torch,      (per graph, (onnxscript, (files;   (ORT vs  (write.py:
            precision)                 stitches,  weights)     stitched    passes;      int8/int4  torch)   engines, layout,
                                       memory)                 as planned) quantized)   packed)             extras; manifest)

Everything is written into a staging directory and moved to DIR only after the written graphs
passed verification (specc/export/outdir.py). What each target builds, verifies within and
writes is the table in specc/spec/targets.py; the stages read the precision from the resolved
spec (serving.precision, `--precision` resolved into it); the cache key, the cache hit and the
manifest are specc/builder/manifest.py's; the plan made before any work (stitches, memory and
disk checks, streamed or not) is specc/builder/plan.py's; the files of the write stage are
specc/builder/write.py's.
"""
from __future__ import annotations

import contextlib
import copy
import math
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from specc.builder import manifest as build_manifest
from specc.builder import plan as build_plan
from specc.builder import memory as build_memory
from specc.builder.memory import STREAMED_LONGEST
from specc.builder.plan import BuildPlan
from specc.builder.write import write as write_artifacts
from specc.deps import require_onnxruntime, require_tensorrt
from specc.errors import BuildError, VerificationError
from specc.export.diagnose import first_wrong_layer
from specc.export.ggufgraph import GGUFSource, quantize_gguf
from specc.export.outdir import Staging, clean_leftovers
from specc.export.passes import PASSES, QUANTIZED_PASSES
from specc.export.passes import apply as apply_passes
from specc.export.quantize import dequantize_linears, quantize
from specc.export.reference import ReferenceJob
from specc.export.segments import verify_segments
from specc.export.stitch import LAYER_OUTPUTS
from specc.export.tensorrt import build_engines, engines_possible
from specc.export.verify import new_report, prepacks, verification_session, verify
from specc.importers.gguf import gguf_source, row_order
from specc.interrupts import check as check_interrupt
from specc.interrupts import watch as watch_interrupts
from specc.malloc import trim
from specc.runtime.graph import unusable_provider
from specc.spec.costs import parameter_shapes
from specc.spec.load import load_spec
from specc.spec.manifest import WEIGHTS_FILE
from specc.spec.rules import activations_are_an_integer_builds
from specc.spec.resolve import ResolvedSpec, resolve
from specc.spec.schema import ModelSpec
from specc.spec.targets import ACTIVATION_LEVELS, DEFAULT_OPSET, PRECISIONS, SUPPORTED_OPSETS, TARGETS, VERIFY_PROVIDERS

STAGES = ("load", "resolve", "build module", "export", "optimize", "save", "verify", "write")

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
    t0: float = field(default_factory=time.perf_counter)
    current: str | None = None

    def so_far(self) -> dict[str, float]:
        """Finished stages' times plus the running ones' time so far."""
        now = time.perf_counter()
        running = {k: round(now - t, 3) for k, t in self.started.items() if k not in self.times}
        return {**self.times, **running}

    def timings(self) -> dict[str, float]:
        """so_far() and the total since the build began: the manifest's timings_s."""
        return {**self.so_far(), "total": round(time.perf_counter() - self.t0, 3)}

    def step(self, **facts: Any) -> None:
        """Progress inside the running stage (a streamed build's layers: role, layer, of)."""
        if self.progress and self.current is not None:
            self.progress(self.current, "step", facts)

    @contextlib.contextmanager
    def stage(self, name: str, **facts: Any):
        check_interrupt()
        if self.progress:
            self.progress(name, "start", facts)
        self.current = name
        t0 = self.started[name] = time.perf_counter()
        done: dict[str, Any] = {}
        yield done
        self.times[name] = round(self.times.get(name, 0.0) + time.perf_counter() - t0, 3)
        if self.progress:
            self.progress(name, "done", {"seconds": self.times[name], **done})


def build(spec, out_dir: str | os.PathLike, *, target: str = "onnx", precision: str | None = None,
          weights: str | os.PathLike | None = None, seed: int = 0, force: bool = False,
          opset: int = DEFAULT_OPSET, max_memory: int | None = None, stream: bool | None = None,
          keep_weights: bool = False, verify_provider: str = "cpu", activations: str | None = None,
          progress: Progress | None = None) -> BuildResult:
    """Build, verify and write a spec's artifacts to `out_dir` (see `specc build --help`).

    spec: a path, a catalog name, a ModelSpec or a ResolvedSpec. precision: the spec's
    serving.precision unless given. weights: a safetensors file, else the spec's `weights:`, else
    seeded random initialisation. max_memory: bytes this build may use (default: what the machine
    has available). stream: build streamed (one layer of the deep stacks in memory at a time,
    specc/builder/memory.py and docs/build.md), or not; by default streamed where the whole model does not
    fit and the streamed build does. keep_weights: also write model.safetensors, the fp32 weights the
    build used in specc's names (the graphs hold the weights either way; docs/build.md).
    verify_provider: where onnxruntime runs the graphs it verifies, "cpu" or "cuda" (its CUDA
    execution provider, which must be usable here; docs/build.md). activations: the spec's
    serving.activations unless given (an integer build's decode arithmetic, fp32 or int8).
    progress: called as progress(stage, "start" | "done", facts)."""
    _check_options(target, opset, verify_provider)
    clock = _Clock(progress)
    with clock.stage("load"):
        spec = _load(spec)
    with clock.stage("resolve") as facts:
        r = _resolve(spec, precision, target, activations)
        facts["name"] = r.name
    weights_file = _weights_file(weights, r)
    gguf = _gguf_file(r, weights_file)
    tokenizer = build_manifest.tokenizer_files(r)  # copied into DIR's root, hashed in the manifest
    engines = _builds_engines(target, r.serving.precision)
    made = build_manifest.inputs(r, target=target, opset=opset, weights=weights_file,
                                 seed=seed, passes=_ort_passes(engines) if TARGETS[target].ort_passes else [],
                                 tokenizer=tokenizer, keep_weights=keep_weights, verify_provider=verify_provider)
    out = Path(out_dir)
    hit = None if force else build_manifest.cached(out, made.cache_key)
    if hit is not None:
        clean_leftovers(out)
        if progress:
            progress("cache", "done", {"out_dir": str(out)})
        return BuildResult(out.absolute(), hit, cached=True)
    plan = build_plan.make(r, stream=stream, max_memory=max_memory, out_dir=out, keep_weights=keep_weights)

    with Staging(out) as stage, watch_interrupts():
        from specc.export.onnx import preload

        built = _build_module(clock, r, plan, weights_file, seed, preload())
        model, n_params = built.model, built.parameters
        # the module's outputs for every verification case, and its weights file: taken in a
        # forked process beside the export where that pays (specc/export/reference.py), else
        # here once the graph is saved; large outputs (a long case's logits) wait on disk, in the
        # staging directory, until compared
        spill = stage.tmp / ".references"
        spill.mkdir()
        # a streamed build's reference run waits for the save (run by result(), not forked): its
        # layers made beside the save's were such a build's peak (docs/build.md)
        with ReferenceJob(r, built.reference, seed, spill, stage.tmp / WEIGHTS_FILE, longest=plan.longest,
                          fork=False if plan.streamed else None, n_params=n_params,
                          write_weights=built.write_weights if keep_weights else _no_weights_file,
                          prepare=_reference_weights(r, weights_file),
                          layers=tuple(plan.streamed_stacks) if plan.segmented else (),
                          lockstep=_lockstep(plan)) as references:
            exported, optimizations = _export(clock, r, plan, model, opset, built.source)
            _optimize(clock, r, exported, made.passes, optimizations)
            _quantize(clock, r, exported, optimizations, gguf, made.passes)
            layer_outputs: dict = {}
            files = _save(clock, r, exported, n_params, opset, stage.tmp, layer_outputs)
            refs, report = _verify(clock, r, plan, references, built, files, seed, layer_outputs, weights_file,
                                   verify_provider)
        del model, built
        with clock.stage("write"):
            engine_report, engine_files = (build_engines(r, refs, files, stage.tmp, r.serving.precision, seed)
                                           if engines else (None, {}))
            del refs
            shutil.rmtree(spill)
            written = write_artifacts(r, TARGETS[target], files, engine_files, stage.tmp, tokenizer, keep_weights)
            listed = build_manifest.artifacts(written.artifacts, stage.tmp)
            verification = {**report.to_dict(), **_protocol(plan),
                            "length": {"verified": plan.longest, "serving": r.serving.length.max}}
            manifest = build_manifest.write(
                stage.tmp, r, made, graph_files=written.graph_files, artifacts=listed, parameters=n_params,
                extras=written.entries, optimizations=optimizations, verification=verification,
                verification_tensorrt=engine_report, timings=clock.timings())
            check_interrupt()  # the last moment a Ctrl-C still leaves DIR as it was
            stage.commit()
    return BuildResult(out.absolute(), manifest)


# --- options -----------------------------------------------------------------------------------


def _check_options(target: str, opset: int, verify_provider: str = "cpu") -> None:
    """What can be refused before any work: an unknown target or opset, a target whose engines
    need TensorRT where it is missing, verification on a provider that is not usable here."""
    if target not in TARGETS:
        raise BuildError(f"unknown target {target!r}; choose one of {', '.join(TARGETS)}")
    if verify_provider not in VERIFY_PROVIDERS:
        raise BuildError(f"unknown verify provider {verify_provider!r}; choose one of {', '.join(VERIFY_PROVIDERS)}")
    if verify_provider != "cpu":
        provider = VERIFY_PROVIDERS[verify_provider]
        why = unusable_provider(require_onnxruntime("verifying a build"), provider)
        if why:
            raise BuildError(f"--verify-provider {verify_provider}: {why}")
    if TARGETS[target].engines == "always":  # without TensorRT there is nothing to build
        require_tensorrt(f"specc build --target {target}")
    if opset not in SUPPORTED_OPSETS:
        raise BuildError(f"opset {opset} is not supported; choose {SUPPORTED_OPSETS.start}..{SUPPORTED_OPSETS.stop - 1}")


def _weights_file(weights: str | os.PathLike | None, r: ResolvedSpec) -> Path | None:
    """`weights`, else the spec's `weights:`; None: seeded random initialisation."""
    path = Path(weights) if weights is not None else (Path(r.weights_path) if r.weights_path else None)
    if path is not None and not path.is_file():
        raise BuildError(f"{path}: no such weights file")
    return path


def _gguf_file(r: ResolvedSpec, weights_file: Path | None) -> Path | None:
    """The GGUF file a gguf build writes the blocks of: the one its weights were imported from
    (specc.importers.gguf records it in the weights file); None for any other precision."""
    if r.serving.precision != "gguf":
        return None
    found = gguf_source(weights_file) if weights_file is not None else None
    if found is None:
        raise BuildError(f"precision gguf keeps a GGUF file's blocks: build it from the weights `specc import gguf` "
                         f"wrote{f' ({weights_file} records no GGUF file)' if weights_file else ' (this build has none)'}")
    if not found.is_file():
        raise BuildError(f"{weights_file} was imported from {found}, which is not there any more")
    return found


def _builds_engines(target: str, precision: str) -> bool:
    """Whether this build makes TensorRT engines: its target's `engines` in the targets table,
    "where possible" meaning TensorRT and a CUDA GPU are there (engines_possible)."""
    engines = TARGETS[target].engines
    return engines == "always" or (engines == "where possible" and engines_possible(precision))


def _ort_passes(engines: bool) -> list[str]:
    """specc's graph passes for a build. They emit onnxruntime operators, so a build that makes
    TensorRT engines from its graphs gets none."""
    return [] if engines else [*PASSES, *QUANTIZED_PASSES]


def _no_weights_file(path: Path) -> None:
    """The weights file's writer of a build that does not keep it: nothing is written."""


def _reference_weights(r: ResolvedSpec, weights_file: Path | None):
    """What the reference run computes with: the model's own weights, or for an integer build of
    seeded weights the weights the graph holds (each Linear weight packed and unpacked as quantize
    packs it, specc/export/quantize.py): a deep random model amplifies its quantization noise past
    any bar that means something for a trained one, so there verification compares the graph with
    the model it is (docs/build.md, "Verifying integer builds"). A build of trained weights is
    compared with its fp32 model, quantization noise included (QUALITY_BARS)."""
    precision = r.serving.precision
    if not PRECISIONS[precision].quantized or weights_file is not None:
        return None

    def prepare(model) -> None:
        from specc.nn.streamed import transform_layers

        dequantize_linears(model, precision)
        transform_layers(model, lambda layer: dequantize_linears(layer, precision))

    return prepare


def _lockstep(plan: BuildPlan):
    """How a streamed build's reference run takes its cases at once, making each layer once
    (specc/nn/streamed.py's in_lockstep): where one stack is streamed; None otherwise."""
    if not plan.streamed or len(plan.streamed_stacks) != 1:
        return None
    from specc.nn.streamed import in_lockstep

    return in_lockstep


def _protocol(plan: BuildPlan) -> dict:
    """The manifest's word on how a streamed build was verified (docs/build.md)."""
    if not plan.streamed:
        return {}
    graph = ("the written graph cut at each layer's output, each segment run alone by onnxruntime from the "
             "graph's external data on torch's own input to it" if plan.segmented else
             "the written graph, run whole by onnxruntime from its external data")
    return {"streamed": {"longest": STREAMED_LONGEST,
                         "reference": "torch, the whole model's forward with its layers made one at a time",
                         "graph": graph, "by_segments": plan.segmented}}


# --- stages ------------------------------------------------------------------------------------


def _load(spec):
    if isinstance(spec, (ModelSpec, ResolvedSpec)):
        return spec
    return load_spec(spec)


def _resolve(spec, precision: str | None, target: str, activations: str | None = None) -> ResolvedSpec:
    """The resolved spec, `precision` and `activations` overriding serving.precision and
    serving.activations; refused if the target does not build that precision."""
    if precision is not None and precision not in PRECISIONS:
        raise BuildError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    if activations is not None and activations not in ACTIVATION_LEVELS:
        raise BuildError(f"unknown activations {activations!r}; choose one of {', '.join(ACTIVATION_LEVELS)}")
    override = {k: v for k, v in (("precision", precision), ("activations", activations)) if v is not None}
    if isinstance(spec, ResolvedSpec) and any(getattr(spec.serving, k) != v for k, v in override.items()):
        spec = spec.spec  # explicit; re-resolved below with the overrides
    if not isinstance(spec, ResolvedSpec):
        if any(getattr(spec.serving, k) != v for k, v in override.items()):
            spec = spec.model_copy(update={"serving": spec.serving.model_copy(update=override)})
            for where, problem in activations_are_an_integer_builds(spec):  # the flags' own pair, said as the spec's
                raise BuildError(f"{'.'.join(where)}: {problem}")
        spec = resolve(spec)
    built = TARGETS[target].precisions
    if spec.serving.precision not in built:
        raise BuildError(f"precision {spec.serving.precision} is not built for target {target} yet; "
                         f"choose one of {', '.join(built)}")
    return spec


@dataclass
class _Module:
    """What the build module stage makes. model: what is traced (a streamed build's short module);
    reference: what the reference run runs (the whole model's forward); source: where the
    stitched copies' weights come from when written (None: `model` holds them all);
    write_weights(path): model.safetensors' writer (None: save_module of `model`)."""

    model: Any
    parameters: int
    reference: Any
    source: Any = None
    write_weights: Callable[[Path], None] | None = None
    remake: Callable[[], Any] | None = None  # a streamed build's reference again, once released

    def release(self) -> None:
        _release(self.model)
        if self.source is not None:
            self.source.release()


def _build_module(clock: _Clock, r: ResolvedSpec, plan: BuildPlan, weights_file: Path | None, seed: int,
                  preloading=None) -> _Module:
    """The module, while `preloading` (specc.export.onnx.preload) imports the exporter beside it:
    the stage ends when both are done, before the reference run is forked. Streamed: the short
    module and the source of the other layers (specc/nn/streamed.py)."""
    with clock.stage("build module") as facts:
        from specc.nn import to_torch

        if plan.streamed:
            from specc.nn import streamed as st

            plans = plan.streamed_stacks

            hollow = build_memory.hollow(r)  # every layer's weights made when written, one layer at a time

            def make():
                return st.short_and_source(r, plans, seed, weights_file, hollow=hollow)

            short, source = make()
            # progress from this process only: a forked reference run makes its own layers, and its
            # display (a terminal's spinner thread) was not forked with it
            pid = os.getpid()
            source.on_layer = lambda role, index, of: os.getpid() == pid and clock.step(role=role, layer=index, of=of)
            n_params = sum(math.prod(shape) for shape in parameter_shapes(r).values())
            built = _Module(short, n_params, st.streamed_model(short, source), source,
                            lambda path: st.write_weights(source, path),
                            remake=lambda: st.streamed_model(*make()))
        else:
            model = to_torch(r, weights=weights_file, seed=seed)
            built = _Module(model, sum(p.numel() for p in model.parameters()), model)
        facts["parameters"] = built.parameters
        if plan.streamed:
            facts["streamed"] = True
        if preloading is not None:
            preloading.join()
    return built


def _export(clock: _Clock, r: ResolvedSpec, plan: BuildPlan, model, opset: int, source=None) -> tuple[dict, list[dict]]:
    """Every graph of the IO signature exported, each stitched as the plan says. Returns ({graph:
    (program, prefolded)}, optimizations: the stitching facts of the graphs that were stitched).
    `source`: a streamed build's StreamedWeights (the copies' weights made when written)."""
    from specc.export import onnx as onnx_export

    export_model = _for_precision(model, r)
    exported, optimizations = {}, []
    with clock.stage("export", graphs=[g.name for g in r.graphs]):
        for sig in r.graphs:
            example = onnx_export.example_inputs(r, sig)
            with onnx_export.quiet():
                program, stitched = onnx_export.export_stitched(export_model, r, sig, example, opset, source=source,
                                                                plan=plan.stitches[sig.name])
            exported[sig.name] = (program, stitched is not None and stitched.get("prefolded", False))
            if stitched is not None:
                optimizations.append(stitched)
    return exported, optimizations


def _optimize(clock: _Clock, r: ResolvedSpec, exported: dict, ort_passes: list[str], optimizations: list[dict]) -> None:
    """onnxscript's optimizer on each graph, then specc's `ort_passes`; their facts appended to
    `optimizations`."""
    from specc.export import onnx as onnx_export

    with clock.stage("optimize") as facts:
        for sig in r.graphs:
            program, prefolded = exported[sig.name]
            with onnx_export.quiet():
                optimizations.append({"graph": sig.name, **onnx_export.optimize(program, prefolded)})
            _run_passes(program.model, sig.name, ort_passes, optimizations)
        facts["optimizations"] = optimizations


def _save(clock: _Clock, r: ResolvedSpec, exported: dict, n_params: int, opset: int, tmp: Path,
          layer_outputs: dict) -> dict[str, list[Path]]:
    """Each graph written into tmp, and let go of once written. Returns {graph: [files]};
    `layer_outputs` gets {graph: {role: [each layer's output name]}} where the stitch recorded them."""
    from specc.export import onnx as onnx_export

    weight_bytes = n_params * PRECISIONS[r.serving.precision].dtype_bytes
    files = {}
    with clock.stage("save"):
        for sig in r.graphs:
            program, _ = exported.pop(sig.name)
            graph = program.model.graph
            layers = graph.meta.get(LAYER_OUTPUTS, {})
            # each layer's output, where it is still in the graph as it is written (for diagnose)
            layer_outputs[sig.name] = {role: [v.name for v in values] for role, values in layers.items()
                                       if all(v.producer() is not None and v.producer().graph is graph for v in values)}
            with onnx_export.quiet():
                files[sig.name] = onnx_export.save(program, sig, tmp / f"{sig.name}.onnx", weight_bytes, opset)
            del program
    return files


def _run_passes(model, graph: str, names: list[str], optimizations: list[dict], quantized: bool = False) -> None:
    """Those of specc's passes `names` that run on the fp32 graph (PASSES), or after the quantizer
    (QUANTIZED_PASSES, where `quantized`), on `model` in place; their facts appended to
    `optimizations` (none where no such pass is named)."""
    if not any(name in (QUANTIZED_PASSES if quantized else PASSES) for name in names):
        return
    before = len(model.graph)
    fired = apply_passes(model, names, quantized=quantized)
    optimizations.append({"graph": graph, "pass": "specc.passes", "nodes_before": before,
                          "nodes_after": len(model.graph), "fusions": fired})


def _quantize(clock: _Clock, r: ResolvedSpec, exported: dict, optimizations: list[dict],
              gguf: Path | None = None, ort_passes: list[str] = ()) -> None:
    """An integer precision's quantizer on each optimized fp32 graph, before it is written
    (specc/export/quantize.py; gguf: the GGUF file's own blocks, specc/export/ggufgraph.py), then
    those of `ort_passes` that read its products (QUANTIZED_PASSES)."""
    precision = r.serving.precision
    if not PRECISIONS[precision].quantized:
        return
    with clock.stage("quantize") as facts:
        source = GGUFSource(gguf, row_order) if gguf is not None else None
        for sig in r.graphs:
            program, _ = exported[sig.name]
            optimizations.append(quantize(program.model, precision, sig, r.serving.activations) if source is None
                                 else quantize_gguf(program.model, sig, source, r.serving.activations))
            _run_passes(program.model, sig.name, ort_passes, optimizations, quantized=True)
        facts["quantized"] = [o for o in optimizations if "precision" in o]


def _verify(clock: _Clock, r: ResolvedSpec, plan: BuildPlan, references: ReferenceJob, built: _Module,
            files: dict[str, list[Path]], seed: int, layer_outputs: dict, weights_file: Path | None,
            provider: str = "cpu"):
    """The torch outputs (waited for where the reference run was forked), the module released,
    then each written graph run by onnxruntime and compared (the plan's `segmented`: a layer at a time,
    specc/export/segments.py). Returns (the torch outputs, the report). A streamed build that
    fails says which layer is wrong first, where it can (specc/export/diagnose.py)."""
    with clock.stage("verify") as facts:
        waited = time.perf_counter()
        refs = references.result()
        if references.seconds is not None:  # forked: its time, and how long verify waited for it
            facts["reference_s"] = references.seconds
            facts["reference_wait_s"] = round(time.perf_counter() - waited, 3)
        # then the module is released: the graph is loaded and run without a second copy of the
        # weights beside it
        built.release()
        trim()  # the module's freed memory back to the system before onnxruntime loads its own copy
        dequantized = _reference_weights(r, weights_file) is not None
        precision, longest = r.serving.precision, plan.longest
        if plan.segmented:
            report = _verify_segments(clock, r, refs, files, layer_outputs, seed, longest, dequantized, provider)
            facts["max_abs_diff"] = report.max_abs
            return refs, report
        sessions = {name: verification_session(paths[0], name, provider, prepacks(precision)) for name, paths in files.items()}
        try:
            report = verify(r, refs, sessions, "onnx", precision, seed=seed, longest=longest,  # the ONNX graph, by onnxruntime
                            dequantized=dequantized, provider=provider)
        except VerificationError as failed:
            del sessions
            where = _first_wrong_layer(r, built, files, layer_outputs, seed, longest, weights_file, provider)
            if where is None:
                raise
            raise VerificationError(f"{failed}; the first layer off: {where}") from None
        del sessions
        facts["max_abs_diff"] = report.max_abs
    return refs, report


def _verify_segments(clock: _Clock, r: ResolvedSpec, refs: dict, files: dict[str, list[Path]], layer_outputs: dict,
                     seed: int, longest: int | None, dequantized: bool, provider: str = "cpu"):
    """segments.verify_segments on a streamed build's single graph, with progress per segment."""
    names = layer_outputs.get("model") or {}
    if set(files) != {"model"} or not names:
        raise BuildError(f"{r.name}: the streamed graph cannot be verified a layer at a time (its layer outputs "
                         "were not recorded)")
    layers = [(role, i, name) for role, values in names.items() for i, name in enumerate(values)]

    def on_segment(name: str, index: int, of: int) -> None:
        clock.step(what=f"segment {index + 1} of {of} ({name})")

    prepack = prepacks(r.serving.precision)
    return verify_segments(r, refs, files["model"][0], layers, lambda path: verification_session(path, "model", provider, prepack),
                           new_report(r, "onnx", r.serving.precision, dequantized, provider), seed, longest, on_segment)


def _first_wrong_layer(r: ResolvedSpec, built: _Module, files: dict[str, list[Path]], layer_outputs: dict,
                      seed: int, longest: int | None, weights_file: Path | None, provider: str = "cpu") -> str | None:
    """diagnose.first_wrong_layer for a streamed build's single graph; None for any other build."""
    names = layer_outputs.get("model")
    if built.remake is None or not names or set(files) != {"model"}:
        return None
    reference = built.remake()
    prepare = _reference_weights(r, weights_file)
    if prepare is not None:
        prepare(reference)
    try:
        return first_wrong_layer(r, files["model"][0], names, reference,
                                 lambda path: verification_session(path, "model", provider, prepacks(r.serving.precision)),
                                 r.serving.precision, seed, longest)
    finally:
        _release(reference)


# --- helpers -----------------------------------------------------------------------------------


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


def _for_precision(model, r: ResolvedSpec):
    """The module the exporter traces: the model itself where r's precision exports fp32 (fp32,
    and the integer precisions, which quantize the fp32 graph), else a copy in the precision's
    dtype (norms and softmax still accumulate in fp32 inside the modules)."""
    dtype = PRECISIONS[r.serving.precision].dtype
    if dtype == "float32":
        return model
    import torch

    return copy.deepcopy(model).to(getattr(torch, dtype))
