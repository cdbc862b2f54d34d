"""The `specc` command. The only module that prints to a user.

Exit codes (docs/errors.md): 0 success, 1 a user error (bad spec, bad input,
verification failure), 2 bad usage. No Python traceback ever reaches the user: specc's own
errors print their located message; anything unexpected prints one line naming the error
(SPECC_DEBUG=1 shows the traceback for a bug report).
"""
from __future__ import annotations

import json
import os
import sys
from typing import Any

import click

from specc.decoding.draft import DRAFTERS
from specc.errors import Issue, SpeccError, SpecError
from specc.interrupts import Terminated, terminate_as_interrupt
from specc.spec.targets import DEFAULT_OPSET, PRECISIONS, TARGETS, VERIFY_PROVIDERS
from specc.version import __version__


# what torch's generator and numpy's seed sequence both take
SEED = click.IntRange(0, 2**64 - 1)


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


class _Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        try:
            with terminate_as_interrupt():  # SIGTERM cleans up as Ctrl-C does
                return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except SpeccError as exc:
            # spec errors are already FILE:LINE:COL: key: message lines
            click.echo(str(exc) if isinstance(exc, SpecError) else f"specc: error: {exc}", err=True)
            ctx.exit(exc.exit_code)
        except Terminated:
            click.echo("specc: terminated", err=True)
            ctx.exit(143)
        except KeyboardInterrupt:
            click.echo("specc: interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:
            # the reader went away (`specc inspect ... | head`): stop quietly, as a program killed
            # by SIGPIPE would; stdout goes to /dev/null so that the interpreter's last flush
            # cannot fail again
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            ctx.exit(141)
        except OSError as exc:  # the machine's refusal (disk full, read-only, permissions), not a bug
            if os.environ.get("SPECC_DEBUG"):
                raise
            where = f"{exc.filename}: " if exc.filename else ""
            click.echo(f"specc: error: {where}{exc.strerror or exc}", err=True)
            ctx.exit(1)
        except Exception as exc:  # a bug in specc: one line, never a traceback
            if os.environ.get("SPECC_DEBUG"):
                raise
            from specc.deps import missing_for_building

            missing = missing_for_building(exc) if isinstance(exc, ModuleNotFoundError) else None
            if missing is not None:  # building's dependencies, absent from a serving environment: not a bug
                click.echo(f"specc: error: {missing}", err=True)
                ctx.exit(1)
            click.echo(
                f"specc: internal error: {type(exc).__name__}: {exc}\n"
                "(this is a bug in specc; run with SPECC_DEBUG=1 for the traceback)",
                err=True,
            )
            ctx.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="specc", message="%(prog)s %(version)s")
def main() -> None:
    """specc: declarative Transformer specs compiled to verified PyTorch and ONNX artifacts.

    SPEC arguments take a YAML file or a catalog name (e.g. gpt2-small)."""
    _quick_exit()


# the commands that open a build's sessions and decode with them
_RUNS_MODELS = ("run", "generate", "serve")


def entry() -> None:
    """The `specc` program (pyproject's console script). A command that runs a model first starts
    again in the environment where glibc's malloc gives its weights huge pages
    (specc.malloc.huge_pages_environment: a tunable glibc reads only when a program starts), the
    same process id and arguments; `GLIBC_TUNABLES=glibc.malloc.hugetlb=0` keeps 4 KiB pages. Every
    other command, and main() called in-process, runs as it is."""
    if len(sys.argv) > 1 and sys.argv[1] in _RUNS_MODELS:
        from specc.malloc import huge_pages_environment

        environ = huge_pages_environment()
        if environ is not None:
            os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)
    main()


_exit_registered = False


def _quick_exit() -> None:
    """At exit, have the interpreter's last garbage collections skip the objects still alive.
    Finalization otherwise walks every object that torch, its exporter, onnxscript and onnxruntime
    created, several times (what that costs: docs/build.md). Objects are still released by
    reference count, and atexit handlers run as before. Once per process."""
    global _exit_registered
    if not _exit_registered:
        import atexit
        import gc

        atexit.register(gc.freeze)
        _exit_registered = True


# --- validate / resolve / schema ----------------------------------------------------------


@main.command()
@click.argument("specs", nargs=-1, required=True)
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def validate(specs: tuple[str, ...], as_json: bool) -> None:
    """Validate each SPEC; exit 0 only if all are valid."""
    from specc.spec import load_spec

    results = []
    for ref in specs:
        try:
            load_spec(ref)
            issues: list[Issue] = []
        except SpecError as exc:
            issues = exc.issues
        results.append({"path": ref, "valid": not issues, "errors": [i.to_dict() for i in issues]})
        if not as_json:
            if issues:
                click.echo(f"{ref}: invalid ({len(issues)} error{'s' if len(issues) > 1 else ''})")
                for issue in issues:
                    click.echo(f"  {issue}", err=True)
            else:
                click.echo(f"{ref}: valid")
    if as_json:
        _emit_json({"specs": results})
    if not all(r["valid"] for r in results):
        sys.exit(1)


@main.command()
@click.argument("spec")
@click.option("--json", "as_json", is_flag=True, help="The resolved spec as JSON.")
def resolve(spec: str, as_json: bool) -> None:
    """Print the resolved SPEC: extends merged, every default filled."""
    from specc.spec import load_spec
    from specc.spec.dump import spec_to_data, spec_to_yaml
    from specc.spec.resolve import explicit

    full = explicit(load_spec(spec))
    if as_json:
        _emit_json(spec_to_data(full))
    else:
        click.echo(spec_to_yaml(full), nl=False)


@main.command()
def schema() -> None:
    """Print the JSON Schema (Draft 2020-12) of the spec language."""
    from specc.spec.jsonschema import language_schema

    _emit_json(language_schema())


# --- inspect ------------------------------------------------------------------------------


@main.command()
@click.argument("spec")
@click.option("--length", type=click.IntRange(min=1), default=None, help="Sequence length for FLOPs (default: serving.length.opt).")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def inspect(spec: str, length: int | None, as_json: bool) -> None:
    """Parameters, FLOPs per token, KV-cache and weight bytes, and a per-layer table."""
    from specc.spec.costs import inspect_spec
    from specc.spec import load_spec, resolve

    facts = inspect_spec(resolve(load_spec(spec)), length)
    if as_json:
        _emit_json(facts)
        return
    from specc.report import inspect_report, render

    render(inspect_report(facts))


# --- graph / diff -------------------------------------------------------------------------


def _graph_format(ctx, param, value: str) -> str:
    from pathlib import Path

    from specc.show.graph import FORMATS

    if Path(value).suffix.lower().lstrip(".") not in FORMATS:
        raise click.BadParameter(f"{value}: the extension picks the format: .svg, .png or .dot")
    return value


@main.command()
@click.argument("specs", nargs=-1, required=True, metavar="SPEC | --diff A B")
@click.option("-o", "--out", "out_file", required=True, type=click.Path(dir_okay=False), callback=_graph_format,
              help="FILE.svg, FILE.png (rendered with graphviz's dot) or FILE.dot (DOT source).")
@click.option("--diff", "as_diff", is_flag=True, help="Two specs A B: B drawn with what differs from A highlighted.")
def graph(specs: tuple[str, ...], out_file: str, as_diff: bool) -> None:
    """Draw the architecture of SPEC (stacks ×N, one layer expanded, residual paths)."""
    from specc.show.graph import build_diff_graph, build_graph, write
    from specc.spec import load_spec, resolve

    if len(specs) != (2 if as_diff else 1):
        raise click.UsageError("graph takes one SPEC, or two with --diff (specc graph --diff A B -o FILE)")
    resolved = [resolve(load_spec(s)) for s in specs]
    g = build_diff_graph(*resolved) if as_diff else build_graph(resolved[0])
    click.echo(write(g, out_file))


@main.command()
@click.argument("spec_a")
@click.argument("spec_b")
@click.option("--json", "as_json", is_flag=True, help="One JSON document on stdout.")
def diff(spec_a: str, spec_b: str, as_json: bool) -> None:
    """The resolved specs A and B side by side: differing fields, parameters and FLOPs."""
    from specc.show.diff import diff_specs
    from specc.spec import load_spec, resolve

    facts = diff_specs(resolve(load_spec(spec_a)), resolve(load_spec(spec_b)))
    if as_json:
        _emit_json(facts)
        return
    from specc.report import diff_report, render

    names = facts["names"]
    labels = (spec_a, spec_b) if names["a"] == names["b"] else (names["a"], names["b"])
    render(diff_report(facts, *labels))


# --- build --------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "k": 1024, "kb": 1000, "kib": 1024, "m": 1024**2, "mb": 1000**2, "mib": 1024**2,
          "g": 1024**3, "gb": 1000**3, "gib": 1024**3, "t": 1024**4, "tb": 1000**4, "tib": 1024**4}


class _Bytes(click.ParamType):
    """A size: 8GiB, 512M, 2.5G or plain bytes."""

    name = "size"

    def convert(self, value, param, ctx):
        import re

        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _UNITS:
            self.fail(f"{value!r} is not a size (e.g. 8GiB, 512M, 1000000)", param, ctx)
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


class _StageDisplay:
    """Progress per build stage on stderr: a spinner and ticks on a terminal, plain lines when
    piped, nothing with --quiet / --json."""

    def __init__(self, enabled: bool):
        from rich.console import Console

        self.console = Console(stderr=True)
        self.enabled = enabled
        self.status = None

    def __call__(self, stage: str, state: str, facts: dict) -> None:
        if not self.enabled:
            return
        if stage == "cache":
            self._line(f"up to date: {facts['out_dir']} (cache hit; --force rebuilds)")
            return
        if state == "start":
            if self.console.is_terminal:
                self.status = self.console.status(f"{stage}...")
                self.status.start()
            return
        if state == "step":  # a streamed build making its layers, or verifying its segments, one at a time
            text = f"{stage}: " + (facts.get("what") or f"{facts['role']} layer {facts['layer'] + 1} of {facts['of']}")
            if self.status is not None:
                self.status.update(text + "...")
            elif not self.console.is_terminal:
                click.echo(f"specc: {text}", err=True)
            return
        if self.status is not None:
            self.status.stop()
            self.status = None
        detail = ""
        if "parameters" in facts:
            detail = f"  {facts['parameters']:,} parameters"
        if "max_abs_diff" in facts:
            detail = f"  max |onnxruntime - torch| {facts['max_abs_diff']:.2e}"
            if "reference_s" in facts:
                detail += (f" (the torch reference ran beside the export: {facts['reference_s']:.1f} s, "
                           f"{facts['reference_wait_s']:.1f} s of it waited for)")
        if "optimizations" in facts:
            from specc.report import optimization_text

            detail = "  " + ", ".join(optimization_text(o, fusions=True) for o in facts["optimizations"])
        self._line(f"{stage:<13} {facts['seconds']:7.2f} s{detail}", tick=True)

    def _line(self, text: str, tick: bool = False) -> None:
        if self.console.is_terminal:
            self.console.print(("[green]✓[/green] " if tick else "") + text, highlight=False)
        else:
            click.echo(f"specc: {text}", err=True)

    def close(self) -> None:
        if self.status is not None:
            self.status.stop()


@main.command()
@click.argument("spec")
@click.option("-o", "--out", "out_dir", required=True, type=click.Path(file_okay=False), help="The build directory to write.")
@click.option("--target", type=click.Choice(list(TARGETS)), default="onnx", show_default=True,
              help="onnx: DIR/*.onnx; triton: a Triton model repository in DIR; tensorrt: engines (needs TensorRT and a GPU). See docs/serving.md.")
@click.option("--precision", type=click.Choice([p for p in PRECISIONS if any(p in t.precisions for t in TARGETS.values())]),
              default=None, help="Default: the spec's serving.precision. int8, int4 and gguf: the onnx and triton targets; "
                   "gguf: the GGUF file `specc import gguf` read the weights from, its blocks kept exactly.")
@click.option("--activations", type=click.Choice(["fp32", "int8"]), default=None,
              help="An integer build's decode arithmetic: fp32, or int8 (the input rounded per block, as llama.cpp's "
                   "quantized dot products; faster). Default: the spec's serving.activations, else the precision's own.")
@click.option("--weights", type=click.Path(dir_okay=False), default=None, help="Trained weights (.safetensors, or a sharded file's .safetensors.index.json); default: the spec's weights: key, else seeded random.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random initialisation (no weights given).")
@click.option("--opset", type=int, default=None, help=f"ONNX opset (default {DEFAULT_OPSET}; see docs/export.md).")
@click.option("--max-memory", type=_Bytes(), default=None, help="Memory the build may use (e.g. 16GiB); default: what is available.")
@click.option("--stream/--no-stream", default=None,
              help="Hold one layer at a time (a model larger than memory; see docs/build.md); default: streamed when the whole model does not fit.")
@click.option("--keep-weights", is_flag=True,
              help="Also write DIR/model.safetensors, the fp32 weights in specc's names (the graphs hold the weights either way).")
@click.option("--verify-provider", type=click.Choice(list(VERIFY_PROVIDERS)), default="cpu", show_default=True,
              help="Where onnxruntime runs the graphs it verifies: cpu, or cuda (its CUDA execution provider; needs onnxruntime-gpu and a GPU).")
@click.option("--force", is_flag=True, help="Rebuild even when DIR is up to date.")
@click.option("--quiet", "-q", is_flag=True, help="No progress and no summary; errors only.")
@click.option("--json", "as_json", is_flag=True, help="The manifest's facts as one JSON document on stdout.")
def build(spec: str, out_dir: str, target: str, precision: str | None, activations: str | None, weights: str | None,
          seed: int, opset: int | None, max_memory: int | None, stream: bool | None, keep_weights: bool,
          verify_provider: str, force: bool, quiet: bool, as_json: bool) -> None:
    """Build SPEC into DIR: export to ONNX, verify against PyTorch, write DIR/manifest.json.

    A verification failure exits 1 and leaves DIR as it was."""
    from specc.malloc import one_arena

    one_arena()
    from specc.builder.pipeline import build as run_build

    display = _StageDisplay(enabled=not (quiet or as_json))
    try:
        result = run_build(spec, out_dir, target=target, precision=precision, weights=weights, seed=seed,
                           force=force, opset=DEFAULT_OPSET if opset is None else opset, max_memory=max_memory,
                           stream=stream, keep_weights=keep_weights, verify_provider=verify_provider,
                           activations=activations, progress=display)
    finally:
        display.close()
    if as_json:
        _emit_json(result.to_dict())
        return
    if quiet:
        return
    from specc.report import build_report, render

    render(build_report(result.manifest, str(result.out_dir), cached=result.cached))


# --- weights: import hf / export-weights ----------------------------------------------------


@main.group("import", cls=_Group)
def import_group() -> None:
    """Turn a checkpoint from another framework into a spec plus weights."""


@import_group.command("hf")
@click.argument("src_dir", type=click.Path(file_okay=False))
@click.option("-o", "--out", "out_spec", required=True, type=click.Path(dir_okay=False),
              help="The spec to write (SPEC.yaml); the weights go to SPEC.safetensors beside it.")
@click.option("--name", default=None, help="The spec's name (default: from SRC_DIR).")
@click.option("--max-length", type=click.IntRange(min=1), default=None,
              help="serving.length.max (default: the checkpoint's context, e.g. max_position_embeddings).")
@click.option("--no-tokenizer", is_flag=True, help="Carry no tokenizer (default: SRC_DIR's tokenizer.json and its companions, to SPEC.tokenizer/).")
@click.option("--force", is_flag=True, help="Replace SPEC.yaml / SPEC.safetensors / SPEC.tokenizer if they exist.")
@click.option("--json", "as_json", is_flag=True, help='{"spec": path, "weights": path, "tokenizer": path or null} on stdout.')
def import_hf_cmd(src_dir: str, out_spec: str, name: str | None, max_length: int | None, no_tokenizer: bool,
                  force: bool, as_json: bool) -> None:
    """Import a local Hugging Face checkpoint folder (config.json + model.safetensors or
    pytorch_model.bin): 23 families (docs/import.md), from BERT and GPT-2 to Qwen3, Gemma 3 and T5.

    Anything in the config or the weights that specc cannot compute exactly is refused, naming
    the field."""
    from specc.importers.hf import import_hf

    _report_import(*import_hf(src_dir, out_spec, name=name, force=force, max_length=max_length,
                              tokenizer=not no_tokenizer), as_json)


@import_group.command("gguf")
@click.argument("src_file", type=click.Path(dir_okay=False))
@click.option("-o", "--out", "out_spec", required=True, type=click.Path(dir_okay=False),
              help="The spec to write (SPEC.yaml); the weights go to SPEC.safetensors beside it.")
@click.option("--name", default=None,
              help="The spec's name (default: from the file's general.name, else from the file's name).")
@click.option("--max-length", type=click.IntRange(min=1), default=None,
              help="serving.length.max (default: the file's context_length).")
@click.option("--no-tokenizer", is_flag=True, help="Carry no tokenizer (default: the file's, converted by transformers to SPEC.tokenizer/).")
@click.option("--force", is_flag=True, help="Replace SPEC.yaml / SPEC.safetensors / SPEC.tokenizer if they exist.")
@click.option("--json", "as_json", is_flag=True, help='{"spec": path, "weights": path, "tokenizer": path or null} on stdout.')
def import_gguf_cmd(src_file: str, out_spec: str, name: str | None, max_length: int | None, no_tokenizer: bool,
                    force: bool, as_json: bool) -> None:
    """Import a llama.cpp GGUF file (llama, qwen2, qwen3, gemma, gemma2, gemma3, phi3, stablelm,
    gptneox, falcon, bloom, gpt2, olmo2; bert; t5), its tensors dequantized to fp32 one at a time.

    Refused as `import hf` refuses: anything specc cannot compute exactly, naming it."""
    from specc.importers.gguf import import_gguf

    _report_import(*import_gguf(src_file, out_spec, name=name, force=force, max_length=max_length,
                                tokenizer=not no_tokenizer), as_json)


def _report_import(spec_path, weights_path, as_json: bool) -> None:
    """What an import wrote: JSON, or lines and the next command."""
    from specc.importers.hf.tokenizer import tokenizer_folder
    from specc.spec import load_spec

    spec = load_spec(spec_path)
    tokenizer = tokenizer_folder(spec_path) if spec.tokenizer is not None else None
    if as_json:
        _emit_json({"spec": str(spec_path), "weights": str(weights_path),
                    "tokenizer": str(tokenizer) if tokenizer is not None else None})
        return
    from specc.report import human_bytes

    click.echo(f"wrote {spec_path} and {weights_path} ({human_bytes(weights_path.stat().st_size)})")
    if tokenizer is not None:
        click.echo(f"wrote {tokenizer}/ ({', '.join(sorted(p.name for p in tokenizer.iterdir()))})")
    else:
        click.echo("no tokenizer carried (none in the checkpoint, or --no-tokenizer): --text needs --tokenizer FILE")
    click.echo(f"serving.length.max {spec.serving.length.max} (--max-length N to change it)")
    click.echo(f"next: specc build {spec_path} -o DIR")


@main.command("export-weights")
@click.argument("spec")
@click.option("-o", "--out", "out_file", required=True, type=click.Path(dir_okay=False), help="The .safetensors file to write.")
@click.option("--seed", type=SEED, default=0, show_default=True, help="Seed of the random initialisation (a spec without weights:).")
def export_weights_cmd(spec: str, out_file: str, seed: int) -> None:
    """Write the weights SPEC builds with (its weights: file, else the seeded initialisation) in
    specc's parameter names."""
    from specc import export_weights

    if not out_file.endswith(".safetensors"):
        raise click.UsageError("the output must be a .safetensors file")
    if not os.path.isdir(os.path.dirname(os.path.abspath(out_file))):
        raise SpeccError(f"{os.path.dirname(out_file)}: no such directory")
    export_weights(spec, out_file, seed=seed)
    from specc.report import human_bytes

    click.echo(f"wrote {out_file} ({human_bytes(os.path.getsize(out_file))})")


# --- serve ---------------------------------------------------------------------------------


@main.command()
@click.argument("build_dir", type=click.Path(file_okay=False))
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind (loopback by default).")
@click.option("--http-port", type=click.IntRange(1, 65535), default=8000, show_default=True)
@click.option("--grpc-port", type=click.IntRange(1, 65535), default=8001, show_default=True)
@click.option("--metrics-port", type=click.IntRange(1, 65535), default=8002, show_default=True)
@click.option("--provider", "providers", multiple=True, help="onnxruntime execution provider: cuda, tensorrt (trt), cpu, or onnxruntime's full name; repeat, in order (default: the best available; a GPU one that cannot run here falls back to CPU with a notice).")
@click.option("--verbose", is_flag=True, help="Triton's own log on the terminal (verbose), instead of in a file.")
@click.option("--max-sequences", type=click.IntRange(min=1), default=None,
              help="Decoders: sequences decoded together (default: serving.generation.max_sequences, else serving.batch.max).")
@click.option("--max-cache-tokens", type=click.IntRange(min=1), default=None,
              help="Decoders: positions the server's KV cache holds, rows x the longest (default: serving.generation.max_cache_tokens).")
@click.option("--max-waiting", type=click.IntRange(min=0), default=None,
              help="Decoders: generate requests queued for a place; more answer 503 (default: serving.generation.max_waiting).")
@click.option("--prefix-cache-tokens", type=click.IntRange(min=0), default=None,
              help="Decoders: positions of recent prompts' KV cache kept, so that a request beginning with one prefills only the rest; 0 turns it off (default: serving.generation.prefix_cache_tokens, else --max-cache-tokens).")
@click.option("--drain-timeout", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="At Ctrl-C / SIGTERM: seconds that running generate requests get to finish (a second Ctrl-C stops at once).")
def serve(build_dir: str, host: str, http_port: int, grpc_port: int, metrics_port: int, providers: tuple[str, ...],
          verbose: bool, max_sequences: int | None, max_cache_tokens: int | None, max_waiting: int | None,
          prefix_cache_tokens: int | None, drain_timeout: float) -> None:
    """Serve a build on a real Triton Inference Server (PyTriton), with dynamic batching from the
    spec's serving: shapes, until Ctrl-C. A decoder is also served for generation (POST
    /v2/models/NAME/generate and generate_stream, and the OpenAI-compatible /v1/chat/completions,
    /v1/completions and /v1/models on the same port), its requests decoded together on the server.
    Needs the serve environment: `make install-serve`, then `.venv-serve/bin/specc serve DIR`."""
    from specc.runtime.serve import describe, serve as serve_build, summary

    def ready(info: dict) -> None:
        click.echo(describe(info), err=True)

    stats = serve_build(build_dir, host=host, http_port=http_port, grpc_port=grpc_port, metrics_port=metrics_port,
                        providers=list(providers) or None, on_ready=ready, verbose=verbose,
                        max_sequences=max_sequences, max_cache_tokens=max_cache_tokens, max_waiting=max_waiting,
                        prefix_cache_tokens=prefix_cache_tokens, drain_timeout=drain_timeout,
                        on_stop=lambda line: click.echo(line, err=True))
    click.echo("specc: server stopped" + (f"; {summary(stats)}" if stats is not None else ""), err=True)


# --- run / generate -------------------------------------------------------------------------


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise click.BadParameter(f"{text!r} is not a comma-separated list of token ids", param_hint="--ids") from None
    if not ids:
        raise click.BadParameter("no token ids given", param_hint="--ids")
    return ids


def _finite(ctx, param, value):
    """A float option that must be a number: nan and inf are refused (exit 2)."""
    import math

    if value is not None and not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number")
    return value


def _read_batch(path: str, session) -> "dict[str, Any] | list":
    """--input FILE: a JSON list of lists of ids, a JSON object of named inputs, or an NPZ, read
    within the build's limits (specc/runtime/inputs.py: an NPZ's shapes are checked before its
    arrays are unpacked)."""
    from specc.runtime.inputs import read_inputs

    if session.architecture == "encoder-decoder":
        return read_inputs(path, session.graphs["encoder"].info, session.limits, session.graphs["decoder"].info)
    return read_inputs(path, session.graphs["model"].info, session.limits)


def _rows(ids: tuple[str, ...], input_file: str | None, texts: tuple[str, ...]) -> list[list[int]] | None:
    """The prompt of --ids; None for --input FILE or --text, which are read once the build is
    open (_read_batch, _text_tokenizer). Usage errors (no prompt, two kinds of prompt) come first."""
    given = sum(bool(x) for x in (ids, input_file, texts))
    if given != 1:
        raise click.UsageError("give the prompt one way: --ids (repeat for a batch), --input FILE, or --text")
    if texts or input_file:
        return None
    return [_parse_ids(x) for x in ids]


def _text_tokenizer(session, path: str | None, texts: tuple[str, ...]):
    """The tokenizer of --text and of the printed text: --tokenizer's (a tokenizer.json, or a
    folder holding one) where given, else the build's where --text was given (a usage error where
    it carries none, as --text without --tokenizer always was); None otherwise (--ids in, ids out)."""
    from specc.runtime.text import Tokenizer

    if path is not None:
        return Tokenizer.load(path)
    if texts and not session.has_tokenizer:
        raise click.UsageError(f"--text needs a tokenizer: {session.dir} carries none (its spec has no "
                               "tokenizer:); give --tokenizer FILE")
    return session.tokenizer if texts else None


@main.command("run")
@click.argument("build_dir", type=click.Path(file_okay=False))
@click.option("--ids", multiple=True, help="Token ids, comma-separated; repeat for a batch (rows of different lengths are padded).")
@click.option("--input", "input_file", type=click.Path(dir_okay=False), default=None, help="A JSON list of lists of ids, a JSON object of named inputs, or an NPZ.")
@click.option("--text", "texts", multiple=True, help="Text, encoded with the build's tokenizer (or --tokenizer's), its padding and attention mask; repeat for a batch.")
@click.option("--tokenizer", type=click.Path(), default=None, help="A tokenizer.json (Hugging Face tokenizers), or a folder holding one; default: the build's.")
@click.option("--provider", "providers", multiple=True, help="onnxruntime execution provider: cuda, tensorrt (trt), cpu, or onnxruntime's full name; repeat, in order (default: the best available; a GPU one that cannot run here falls back to CPU with a notice).")
@click.option("--out", "out_file", type=click.Path(dir_okay=False), default=None, help="Write every output to FILE.npz.")
@click.option("--no-hash-check", is_flag=True, help="Open the graphs without checking them against the manifest's sha256 (faster for a large build known to be intact).")
@click.option("--json", "as_json", is_flag=True, help='{"outputs": {name: nested lists}} on stdout.')
def run_cmd(build_dir, ids, input_file, texts, tokenizer, providers, out_file, no_hash_check, as_json):
    """Run a built model on token ids or text and print its named outputs (classifiers: probabilities)."""
    import numpy as np

    from specc.runtime import Session
    from specc.runtime.arrays import pad_rows
    from specc.runtime.inputs import check_prompts
    from specc.spec.io import is_present

    given = _rows(ids, input_file, texts)
    session = Session(build_dir, providers=providers or None, check_hashes=not no_hash_check)
    if texts:
        given = session.encode(texts, _text_tokenizer(session, tokenizer, texts))
    elif given is None:
        given = _read_batch(input_file, session)
    if isinstance(given, dict):
        inputs = given
    else:  # rows of ids: integers within the build's limits (floats are refused, not truncated), then padded
        rows = check_prompts(given, session.limits)
        padded, mask = pad_rows(rows, session.info.pad_id, left=session.architecture == "decoder")
        inputs = {"input_ids": padded, "attention_mask": mask}
    outputs = session.run(**inputs)
    shown = {k: v for k, v in outputs.items() if not is_present(k)}
    kinds = session.info.output_kinds
    probs = {f"{k}_probabilities": _softmax(v) for k, v in shown.items() if kinds.get(k) == "classifier"}
    if out_file:
        from specc.runtime.arrays import save_npz

        save_npz(out_file, outputs)
    if as_json:
        _emit_json({"outputs": {k: v.tolist() for k, v in {**shown, **probs}.items()}})
        return
    click.echo(f"{session.manifest['name']} on {session.provider}")
    for name, arr in {**shown, **probs}.items():
        flat = np.asarray(arr).ravel()
        head = ", ".join(f"{x:.4g}" for x in flat[:6]) + (", ..." if flat.size > 6 else "")
        click.echo(f"  {name}: {arr.dtype} {list(arr.shape)}  [{head}]")


def _generation_stats(new_ids: list[list[int]], start: float, first: float | None, end: float) -> None:
    """One line on stderr: the new tokens of every row, the seconds from start to end, tokens/s
    over all of them, and, after the first step (the prompt's prefill), the decode steps' rate."""
    tokens = sum(len(r) for r in new_ids)
    took = max(end - start, 1e-9)
    line = f"specc: {tokens} new token{'' if tokens == 1 else 's'} in {took:.2f} s, {tokens / took:.1f} tokens/s"
    after = tokens - sum(1 for r in new_ids if r)  # the tokens of the steps after the first
    if first is not None and after > 0 and end > first:
        line += f" (first token after {first - start:.2f} s; then {after / (end - first):.1f} tokens/s)"
    sys.stdout.flush()  # the answer first, where both streams go to one place
    click.echo(line, err=True)


def _softmax(x):
    import numpy as np

    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


@main.command()
@click.argument("build_dir", type=click.Path(file_okay=False))
@click.option("--ids", multiple=True, help="Prompt token ids, comma-separated; repeat for a batch.")
@click.option("--input", "input_file", type=click.Path(dir_okay=False), default=None, help="A JSON list of lists of prompt ids.")
@click.option("--text", "texts", multiple=True, help="Prompt text, encoded with the build's tokenizer (or --tokenizer's); repeat for a batch.")
@click.option("--chat", is_flag=True, help="Each --text is a user's message, put in the tokenizer's chat template (with the assistant's turn opened).")
@click.option("--tokenizer", type=click.Path(), default=None, help="A tokenizer.json, or a folder holding one (with its tokenizer_config.json): text in, text out; default: the build's.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=20, show_default=True)
@click.option("--greedy", is_flag=True, help="Greedy decoding (the default).")
@click.option("--temperature", type=click.FloatRange(min=0, min_open=True), default=None, callback=_finite, help="Sample at this temperature.")
@click.option("--top-k", type=click.IntRange(min=1), default=None, help="Sample from the k most likely tokens.")
@click.option("--top-p", type=click.FloatRange(min=0, max=1, min_open=True), default=None, callback=_finite, help="Sample from the smallest set of tokens with this much probability.")
@click.option("--seed", type=click.IntRange(min=0), default=None, help="Seed for sampling.")
@click.option("--beams", type=click.IntRange(min=1), default=1, show_default=True, help="Beam search with this many beams.")
@click.option("--length-penalty", type=float, default=0.6, show_default=True, callback=_finite, help="Beam search: alpha of ((5 + len) / 6) ** alpha (Wu et al. 2016).")
@click.option("--eos-id", type=click.IntRange(-(2**63), 2**63 - 1), default=None, help="Stop a row at this token (default: the spec's tokens.eos).")
@click.option("--speculative", metavar="ngram|DRAFT_BUILD", default=None, help="Speculative decoding with this drafter (ngram: prompt lookup; or a draft build's directory, a decoder with the same vocabulary): greedy or sampled: plain decoding's tokens (a seed's), refused at int8 activations where the in-place graph has no spare position (routed experts, older builds); several tokens per step where the text repeats; one prompt; its acceptance on stderr.")
@click.option("--provider", "providers", multiple=True, help="onnxruntime execution provider: cuda, tensorrt (trt), cpu, or onnxruntime's full name; repeat, in order (default: the best available; a GPU one that cannot run here falls back to CPU with a notice).")
@click.option("--no-hash-check", is_flag=True, help="Open the graphs without checking them against the manifest's sha256 (faster for a large build known to be intact).")
@click.option("--json", "as_json", is_flag=True, help='{"ids": [[...]], "new_ids": [[...]]} on stdout.')
@click.option("--stats", is_flag=True, help="Then, on stderr: the tokens generated, the seconds taken and tokens/s (the first token's wait apart).")
def generate(build_dir, ids, input_file, texts, chat, tokenizer, max_new_tokens, greedy, temperature, top_k, top_p,
             seed, beams, length_penalty, eos_id, speculative, providers, no_hash_check, as_json, stats):
    """Generate with a built decoder or encoder-decoder: greedy by default, sampling or beam search.

    A single prompt's tokens stream to stdout as they come (as text, whole characters at a time,
    where there is a tokenizer). --text without --chat on a build whose tokenizer has a chat
    template (an instruct model) continues the text as it is, and says in one line on stderr how
    to chat."""
    import time

    from specc.runtime import Session

    sampling = temperature is not None or top_k is not None or top_p is not None
    if greedy and (sampling or beams > 1):
        raise click.UsageError("--greedy cannot be combined with sampling options or --beams")
    if chat and not texts:
        raise click.UsageError("--chat takes the messages of --text")
    rows = _rows(ids, input_file, texts)
    session = Session(build_dir, providers=providers or None, check_hashes=not no_hash_check)
    if speculative is not None and speculative not in DRAFTERS:  # a draft build
        speculative = Session(speculative, providers=providers or None, check_hashes=not no_hash_check)
    tok = _text_tokenizer(session, tokenizer, texts)
    if texts:
        if not chat and tok.chat_template is not None and not any(tok.templated(t) for t in texts):
            click.echo(f"specc: {session.manifest['name']} has a chat template; to chat, add --chat (each --text "
                       "a user's message); without it the text is continued as it is", err=True)
        rows = session.prompts(texts, chat=chat, tokenizer=tok)
    elif rows is None:
        rows = _read_batch(input_file, session)
    if isinstance(rows, dict):
        rows = rows["input_ids"]
    stream = not as_json and len(rows) == 1 and beams == 1
    pieces = tok.stream() if tok is not None else None
    first: list[float] = []  # when the first token came

    def on_token(step: int, new: list) -> None:
        if not first:
            first.append(time.perf_counter())
        if new[0] is None or not stream:
            return
        click.echo(pieces.push(new[0]) if pieces is not None else f"{new[0]} ", nl=False)

    start = time.perf_counter()
    result = session.generate(rows, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                              top_p=top_p, seed=seed, beams=beams, length_penalty=length_penalty, eos_id=eos_id,
                              on_token=on_token if stream or stats else None, speculative=speculative)
    end = time.perf_counter()
    if result.speculation is not None:
        s = result.speculation
        drafter = speculative if isinstance(speculative, str) else f"draft {speculative.dir}"
        click.echo(f"specc: speculative {drafter}: {s.steps} steps after the prompt, {s.accepted} of {s.drafted} "
                   f"drafted tokens accepted ({s.acceptance:.0%})", err=True)
    if as_json:
        doc = {"ids": result.ids, "new_ids": result.new_ids}
        if tok is not None:
            doc["text"] = [tok.decode(r) for r in result.new_ids]
        _emit_json(doc)
    elif stream:
        click.echo(pieces.flush() if pieces is not None else "")
    else:
        for row in result.new_ids:
            click.echo(tok.decode(row) if tok is not None else ",".join(map(str, row)))
    if stats:  # after the answer; beams report their tokens only once settled: no first token to time
        _generation_stats(result.new_ids, start, first[0] if first and beams == 1 else None, end)
