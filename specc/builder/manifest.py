"""What a build records about itself: the inputs it is made from and their cache key, the
manifest.json it writes, and the cache hit that reads that manifest back.

specc/spec/manifest.py owns the file (its name, version and shape, read_manifest); this module
fills it. The same inputs (resolved spec, options, weights, versions, graph passes) give the same
cache key and byte-identical artifacts: a rebuild whose key matches DIR/manifest.json, with every
artifact intact (sizes and sha256 checked), is a cache hit.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from specc.errors import BuildError
from specc.export.ggufgraph import describe as gguf_quantization
from specc.export.quantize import describe as quantization
from specc.importers.gguf import gguf_source
from specc.fileio import INDEX_SUFFIX, NotARegularFile, file_sha256, regular_size, sha256s, write_atomic
from specc.spec import io
from specc.spec.dump import spec_to_data
from specc.spec.manifest import (
    MANIFEST,
    MANIFEST_VERSION,
    MAX_TOKENIZER_BYTES,
    TOKENIZER_FILES,
    TOKENIZER_JSON,
    WEIGHTS_FILE,
    NotAManifest,
    read_manifest,
)
from specc.spec.resolve import ResolvedSpec
from specc.spec.targets import PRECISIONS
from specc.version import __version__

DISTRIBUTIONS = ("torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu")


def versions() -> dict[str, str]:
    """specc's, Python's and the installed libraries' versions, as the manifest records them."""
    out = {"specc": __version__, "python": platform.python_version()}
    for dist in DISTRIBUTIONS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def canonical(data: Any) -> bytes:
    """The JSON that is hashed: sorted keys, no spaces."""
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


@dataclass(frozen=True)
class Inputs:
    """What a build is made from, as the manifest records it, and the sha256 of it all."""

    spec: dict  # the resolved spec as data (every default filled)
    options: dict  # target, precision, opset, weights
    versions: dict[str, str]
    passes: list[str]  # specc's onnxruntime graph passes the build runs
    cache_key: str


# the graphs a build composes from its verified ones beside the clients' files (specc/export/inplace.py),
# each with what its form depends on: part of the cache key, so that a build made before one was
# added or changed is built again, not reused
COMPOSED_GRAPHS = {"inplace": {"lm_positions": io.LM_POSITIONS, "spare": io.SPARE_SEQUENCE,
                              "spare_rows": "4-bit MatMulNBits at level 4"}}
# how a spec's routed experts are exported (specc/export/moe.py: one MoE / QMoE node a layer): part of
# the key of a build with a `moe` FFN, so that one made with the loop over experts is built again
ROUTED_EXPERTS_FORM = "MoE"


def _routed_experts(r: ResolvedSpec) -> bool:
    return any(layer.ffn.kind == "moe" for stack in (r.encoder, r.decoder) if stack is not None for layer in stack.layers)


def tokenizer_files(r: ResolvedSpec) -> list[Path]:
    """The files of the spec's `tokenizer:` folder a build copies into its root (TOKENIZER_FILES
    that are there; tokenizer.json required), each a regular file of at most MAX_TOKENIZER_BYTES;
    none without the key. BuildError naming the spec's key and the file otherwise."""
    if r.tokenizer_path is None:
        return []
    folder = Path(r.tokenizer_path)
    where = f"{r.source or r.name}: tokenizer: {r.spec.tokenizer}"
    if not folder.is_dir():
        raise BuildError(f"{where}: no such folder ({folder})")
    if not (folder / TOKENIZER_JSON).exists():
        raise BuildError(f"{where}: no {TOKENIZER_JSON} in {folder}")
    files = [folder / name for name in TOKENIZER_FILES if os.path.lexists(folder / name)]
    for f in files:
        try:
            regular_size(f, MAX_TOKENIZER_BYTES)
        except NotARegularFile as exc:
            raise BuildError(f"{where}: {exc}") from None
        except OSError as exc:
            raise BuildError(f"{where}: {f}: {exc.strerror or exc}") from None
    return files


def inputs(r: ResolvedSpec, *, target: str, opset: int, weights: Path | None, seed: int,
           passes: list[str], tokenizer: list[Path] = (), keep_weights: bool = False,
           verify_provider: str = "cpu") -> Inputs:
    """The build's inputs: the precision r's serving.precision; `weights` a safetensors file or a sharded one's index (hashed, and each
    shard), else the seeded initialisation; `tokenizer` the files copied beside the graphs (hashed,
    under options.tokenizer, only where there are any); keep_weights: whether DIR keeps
    model.safetensors; verify_provider: where the graphs are verified (recorded where not cpu, so
    a CPU build's key is what it was)."""
    source: dict[str, Any] = {"source": "seed", "seed": seed}
    if weights is not None:
        source = {"source": "file", "file": weights.name, "sha256": file_sha256(weights)}
        if weights.name.endswith(INDEX_SUFFIX):
            from specc.weights.io import ShardedSafetensors  # imports torch

            shards = ShardedSafetensors(weights).files[1:]
            source["shards"] = dict(zip((p.name for p in shards), sha256s(shards)))
    spec = spec_to_data(r.spec)
    precision = r.serving.precision
    options = {"target": target, "precision": precision, "opset": opset, "weights": source,
               "keep_weights": keep_weights}
    if PRECISIONS[precision].quantized:
        activations = r.serving.activations
        options["quantization"] = (gguf_quantization(activations) if precision == "gguf"
                                   else quantization(precision, activations))
    if precision == "gguf" and weights is not None and (found := gguf_source(weights)) is not None and found.is_file():
        # the blocks come from the file the weights record, not from the weights: a build made
        # from another file of the same values is not up to date
        options["quantization"]["file"] = {"name": found.name, "sha256": file_sha256(found)}
    if verify_provider != "cpu":
        options["verify_provider"] = verify_provider
    if _routed_experts(r):
        options["routed_experts"] = ROUTED_EXPERTS_FORM
    if tokenizer:
        options["tokenizer"] = dict(zip((p.name for p in tokenizer), sha256s(list(tokenizer))))
    vers = versions()
    key = hashlib.sha256(canonical({"spec": spec, "options": options, "versions": vers,
                                    "manifest": MANIFEST_VERSION, "passes": passes,
                                    "composed": COMPOSED_GRAPHS})).hexdigest()
    return Inputs(spec, options, vers, passes, key)


def cached(out: Path, cache_key: str) -> dict | None:
    """DIR's manifest when it records this cache key and every artifact is intact: the manifest's
    list must name every file a build needs (each graph's file, its external data where that is on
    disk, the weights file where the build keeps it, the clients' and the tokenizer's files), and each listed file must
    have its recorded size and sha256. A list someone shortened is no cache hit."""
    try:
        manifest = read_manifest(out / MANIFEST)
    except (OSError, NotAManifest):
        return None
    if manifest.get("cache_key") != cache_key:
        return None
    try:
        artifacts = [(out / a["path"], a["bytes"], a["sha256"]) for a in manifest["artifacts"]]
        needed = {g["file"] for g in manifest["graphs"].values()}
        needed |= {WEIGHTS_FILE} if manifest["options"]["keep_weights"] else set()
        needed |= {f for c in manifest.get("clients", {}).values() for f in c.get("files", [])}
        needed |= set(manifest["options"].get("tokenizer", {}))
        needed |= {manifest["inplace"]["file"]} if "file" in manifest.get("inplace", {}) else set()
    except (KeyError, TypeError, AttributeError):
        return None
    needed |= {f"{f}.data" for f in needed if (out / f"{f}.data").exists()}
    if not needed <= {a["path"] for a in manifest["artifacts"]}:
        return None
    if not all(p.is_file() and p.stat().st_size == size for p, size, _ in artifacts):
        return None
    if sha256s([p for p, _, _ in artifacts]) != [digest for _, _, digest in artifacts]:
        return None
    return manifest


def artifacts(paths: list[Path], root: Path) -> list[dict]:
    """The manifest's `artifacts`: each file's path under root, size and sha256."""
    return [{"path": p.relative_to(root).as_posix(), "bytes": p.stat().st_size, "sha256": digest}
            for p, digest in zip(paths, sha256s(paths))]


def _sigs(sigs) -> list[dict]:
    return [{"name": t.name, "dtype": t.dtype, "dims": list(t.dims)} for t in sigs]


def write(root: Path, r: ResolvedSpec, made: Inputs, *, graph_files: dict[str, str], artifacts: list[dict],
          parameters: int, optimizations: list[dict], verification: dict, verification_tensorrt: dict | None,
          timings: dict[str, float], extras: dict[str, dict] | None = None) -> dict:
    """Write root/manifest.json (docs/build.md lists its keys) and return it. `extras`: the entries
    of what the target writes besides the graphs (specc/builder/write.py): `clients`, per client
    (specc/builder/clients.py), the files written for it or why none are; `inplace`, a decoder's
    in-place cache graph (specc/export/inplace.py), its file and IO signature or why there is
    none. `timings` is the only entry that differs between identical builds."""
    manifest = {
        "specc_manifest": MANIFEST_VERSION,
        "name": r.name,
        "architecture": r.architecture,
        "spec": made.spec,
        "spec_sha256": hashlib.sha256(canonical(made.spec)).hexdigest(),
        "options": made.options,
        "versions": made.versions,
        "cache_key": made.cache_key,
        "graphs": {sig.name: {"file": graph_files[sig.name], "inputs": _sigs(sig.inputs),
                              "outputs": _sigs(sig.outputs)} for sig in r.graphs},
        "artifacts": artifacts,
        **(extras or {}),
        "parameters": parameters,
        "optimizations": optimizations,
        "verification": verification,
        **({"verification_tensorrt": verification_tensorrt} if verification_tensorrt is not None else {}),
        # wall-clock seconds per stage: not content, kept apart from the hashes above
        "timings_s": timings,
    }
    write_atomic(root / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest
