"""The write stage's files: what a build puts into its staging directory once its graphs have
passed verification, as its target's row in specc/spec/targets.py says.

    verified graphs (+ TensorRT engines, where the target makes them)
      --layout (Target.write)--> files:  DIR/NAME.onnx (+ .data, engines) as saved
                                 triton: REPO/NAME/config.pbtxt, REPO/NAME/1/model.onnx (specc/export/triton.py)
      --the spec's tokenizer files, copied into the root
      --extras (Target.extras, in order)--> clients: config.json, generation_config.json,
                                                     genai_config.json (specc/builder/clients.py), and
                                                     an encoder-decoder's decoder as Optimum runs it
                                            inplace: a decoder's in-place cache graph (specc/export/inplace.py)
      --model.safetensors, where the build keeps it
      --> Written: the artifacts in the manifest's order, each graph's file, the extras' manifest entries

A composed graph (Optimum's decoder, the in-place graph) is checked against the verified graphs
it is made from before it is listed.
"""
from __future__ import annotations

import shutil
from dataclasses import dataclass, field
from pathlib import Path

from specc.builder.clients import OPTIMUM, OPTIMUM_DECODER, client_files
from specc.builder.clients import write as write_client_files
from specc.export import inplace, optimum_seq2seq, triton
from specc.export.verify import new_report, tolerance, verification_session
from specc.runtime.cache import inplace_feeds
from specc.spec.manifest import WEIGHTS_FILE
from specc.spec.resolve import ResolvedSpec
from specc.spec.targets import PRECISIONS, Target


@dataclass
class Written:
    """What the write stage wrote into `tmp`: artifacts, every file in the manifest's order;
    graph_files, each graph's file as the manifest records it; entries, the manifest entries the
    extras add ({"clients": ..., "inplace": ...})."""

    r: ResolvedSpec
    tmp: Path
    artifacts: list[Path]
    graph_files: dict[str, str]
    entries: dict[str, dict] = field(default_factory=dict)


def write(r: ResolvedSpec, target: Target, files: dict[str, list[Path]], engines: dict[str, Path], tmp: Path,
          tokenizer: list[Path], keep_weights: bool) -> Written:
    """The target's layout of the verified graph `files` ({graph: [files]}) and `engines` ({graph:
    engine file}), the `tokenizer` files, the target's extras and, with `keep_weights`, the weights
    file already in `tmp` (the reference run wrote it), as the module's doc draws."""
    artifacts, graph_files = LAYOUTS[target.write](r, files, engines, tmp)
    out = Written(r, tmp, artifacts, graph_files)
    out.artifacts += [Path(shutil.copyfile(f, tmp / f.name)) for f in tokenizer]
    for extra in target.extras:
        EXTRAS[extra](out)
    if keep_weights:
        out.artifacts.append(tmp / WEIGHTS_FILE)
    return out


# --- layouts: Target.write -> where the graphs go ------------------------------------------------


def _files(r: ResolvedSpec, files: dict[str, list[Path]], engines: dict[str, Path], tmp: Path):
    """`files`: the graphs (and engines) stay in DIR as saved. Returns (artifacts, graph -> file)."""
    written = [p for paths in files.values() for p in paths] + list(engines.values())
    return written, {sig.name: f"{sig.name}.onnx" for sig in r.graphs}


def _triton_repository(r: ResolvedSpec, files: dict[str, list[Path]], engines: dict[str, Path], tmp: Path):
    """`triton`: REPO/NAME/config.pbtxt and REPO/NAME/1/model.onnx (+ model.plan), the manifest at
    REPO (specc/export/triton.py). Returns (artifacts, graph -> file)."""
    names = triton.model_names(r)
    written = triton.write_repository(tmp, r, files, engines)
    return written, {sig.name: f"{names[sig.name]}/1/model.onnx" for sig in r.graphs}


LAYOUTS = {"files": _files, "triton": _triton_repository}


# --- extras: Target.extras -> what is written besides the graphs ---------------------------------


def _clients(out: Written) -> None:
    """The clients' files (specc/builder/clients.py) and, where Optimum gets files for an
    encoder-decoder, its decoder; the manifest's `clients` entry."""
    clients = client_files(out.r, out.graph_files)
    out.artifacts += write_client_files(out.tmp, clients)
    out.artifacts += _optimum_decoder(out, clients.clients[OPTIMUM])
    out.entries["clients"] = clients.clients


def _optimum_decoder(out: Written, entry: dict) -> list[Path]:
    """An encoder-decoder's decoder as Optimum runs it, where Optimum gets files (`entry`, its
    clients entry): composed from the verified graphs and checked against them
    (specc/export/optimum_seq2seq.py); the check's figure goes to `entry`."""
    if OPTIMUM_DECODER not in entry.get("files", ()):
        return []
    r = out.r
    path = optimum_seq2seq.write(out.tmp, r, out.graph_files)
    # the same nodes on the same inputs: an integer graph is held to fp32's tolerance, not to the
    # metrics that judge its quantization
    precision = r.serving.precision
    atol, rtol = tolerance("onnx", "fp32" if PRECISIONS[precision].quantized else precision)
    entry["max_abs_diff"] = optimum_seq2seq.check(out.tmp, r, out.graph_files, verification_session, atol, rtol)
    return [path]


def _inplace_graph(out: Written) -> None:
    """A decoder's in-place cache graph (specc/export/inplace.py), made from the verified model
    graph and run against it, where GroupQueryAttention computes the spec's attention: its
    manifest entry `inplace` (file, IO signature, the check's figures), or why there is none
    (none for encoders and encoder-decoders). The same weights on both sides: a quantized graph
    is judged by the bar of its kernels' arithmetic (DEQUANTIZED_BAR), any other by its
    precision's tolerance."""
    r = out.r
    if r.architecture != "decoder":
        return
    try:
        path, signature = inplace.write(out.tmp, r, out.graph_files)
    except inplace.Unfit as exc:
        out.entries["inplace"] = {"reason": str(exc)}
        return
    report = new_report(r, "onnx", r.serving.precision, dequantized=True)
    figures = inplace.check(out.tmp, r, out.graph_files, verification_session,
                            lambda name, got, want: report.compare(name, True, got, want, f"{inplace.FILE}, {name}"),
                            inplace_feeds)
    out.artifacts.append(path)
    out.entries["inplace"] = {"file": inplace.FILE, "graph": inplace.GRAPH, "op": f"{inplace.DOMAIN}.{inplace.OP}",
                              **signature, "check": {"against": inplace.GRAPH, **figures}}


EXTRAS = {"clients": _clients, "inplace": _inplace_graph}
