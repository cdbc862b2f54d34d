"""A build's manifest.json: its name, its version, what makes a file one, and BuildInfo, the typed
view of a build the runtime reads.

Torch-free and standard library only: the build directory's guard (specc/export/outdir.py) and the
runtime both read it. A specc manifest is a JSON object with an integer `specc_manifest` and an
`artifacts` list of {path, bytes, sha256} whose paths are relative and stay inside the build
folder. Anything else named manifest.json (a web app's, another tool's) is not a build.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import MappingProxyType
from typing import Any, Mapping

from specc.spec import io
from specc.spec.targets import decode_activations

MANIFEST = "manifest.json"
WEIGHTS_FILE = "model.safetensors"  # every build folder holds its weights under this name
# A Hugging Face tokenizer's files, under the names a spec's `tokenizer:` folder holds them and a build
# folder's root has them (copied by the build, hashed among its artifacts): the tokenizer itself
# (tokenizers' serialization, required), its settings (special tokens, padding side, model_max_length,
# an inline chat template), the older special-tokens file, and a chat template in a file of its own.
TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
CHAT_TEMPLATE = "chat_template.jinja"
TOKENIZER_FILES = (TOKENIZER_JSON, TOKENIZER_CONFIG, "special_tokens_map.json", CHAT_TEMPLATE)
MAX_TOKENIZER_BYTES = 256 << 20  # one such file; a tokenizer.json of the largest vocabularies is tens of MB
MANIFEST_VERSION = 1
MAX_MANIFEST_BYTES = 64 << 20  # a manifest lists graphs and hashes; a larger file is not one


class NotAManifest(ValueError):
    """The file is not a specc manifest; the message says why (without the path)."""


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The parsed manifest at `path`. Raises NotAManifest if it is not a regular file of specc's
    manifest shape, OSError if it cannot be read."""
    path = Path(path)
    if not path.is_file():
        raise NotAManifest("not a regular file")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise NotAManifest(f"larger than {MAX_MANIFEST_BYTES >> 20} MiB")
    try:
        data = json.loads(path.read_bytes())
    except ValueError as exc:
        raise NotAManifest(f"not JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("specc_manifest"), int):
        raise NotAManifest("not a specc manifest (no integer 'specc_manifest')")
    artifact_paths(data)
    return data


def artifact_paths(manifest: dict[str, Any]) -> list[str]:
    """The relative paths of the files a build wrote, as its manifest lists them (itself apart).
    Raises NotAManifest for a list that is malformed or names a path outside the folder."""
    artifacts = manifest.get("artifacts")
    if not isinstance(artifacts, list):
        raise NotAManifest("'artifacts' is not a list")
    paths = []
    for entry in artifacts:
        path = entry.get("path") if isinstance(entry, dict) else None
        if not isinstance(path, str) or not _inside(path):
            raise NotAManifest(f"artifact entry {entry!r} does not name a path inside the build")
        paths.append(path)
    return paths


def _inside(path: str) -> bool:
    p = PurePosixPath(path)
    return bool(path) and "\\" not in path and "\0" not in path and not p.is_absolute() \
        and ".." not in p.parts and p.as_posix() not in (".", MANIFEST)


# --- a typed view of a build, for the runtime -------------------------------------------------

Dim = int | str  # a fixed size, or a symbolic dim named in specc/spec/io.py


@dataclass(frozen=True)
class TensorInfo:
    """One input or output of a graph: its name, dtype name and dims, as the manifest records."""

    name: str
    dtype: str
    dims: tuple[Dim, ...]


@dataclass(frozen=True)
class GraphInfo:
    """One graph of a build: its ONNX file (relative to the build folder) and IO signature."""

    name: str
    file: str
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class Range:
    """A serving range (serving.batch, serving.length): min, opt, max."""

    min: int
    opt: int
    max: int


@dataclass(frozen=True)
class Generation:
    """serving.generation: what `specc serve` decodes at once (None: its default from the batch
    and length ranges). A build made before the key existed reads as every default."""

    max_sequences: int | None = None
    max_cache_tokens: int | None = None
    max_waiting: int = 64
    prefix_cache_tokens: int | None = None


@dataclass(frozen=True)
class Tokens:
    """The spec's special token ids (tokens:), None where it names none."""

    bos: int | None = None
    eos: int | None = None
    pad: int | None = None
    decoder_start: int | None = None

    def pad_for(self, eos: int | None) -> int:
        """The padding id when `eos` ends a row: pad, else `eos`, else 0."""
        return next(t for t in (self.pad, eos, 0) if t is not None)

    def start_for(self, pad: int) -> int:
        """An encoder-decoder's first decoder token: decoder_start, else bos, else `pad`."""
        return next(t for t in (self.decoder_start, self.bos, pad) if t is not None)


@dataclass(frozen=True)
class Output:
    """One of the spec's outputs: its name and kind (lm, classifier, hidden, ...)."""

    name: str
    kind: str


@dataclass(frozen=True)
class BuildInfo:
    """What the runtime needs to know about a build, read once from its manifest: the graphs with
    their IO signatures, and the facts the resolver decided, taken from the manifest's recorded
    (explicit, every default filled) spec rather than re-derived by each reader."""

    name: str
    architecture: str  # encoder | decoder | encoder-decoder
    graphs: Mapping[str, GraphInfo]  # graph name (model | encoder | decoder) -> graph, in build order
    vocab_size: int  # of input_ids: the source vocabulary for an encoder-decoder
    target_vocab_size: int  # of an encoder-decoder's decoder ids (vocab_size elsewhere)
    type_vocab_size: int  # of token_type_ids (0: none)
    outputs: tuple[Output, ...]  # the spec's outputs, in its order
    lm_output: str | None  # the main graph's output of kind lm (what generation reads), if any
    learned_positions: int | None  # max_length of learned positions (a hard limit), else None
    tokens: Tokens
    batch: Range  # serving.batch
    length: Range  # serving.length
    generation: Generation = Generation()  # serving.generation
    # a decoder's in-place cache graph (specc/export/inplace.py), which generation runs on CPU where
    # it can; None where the build has none
    inplace: GraphInfo | None = None
    # what an integer build's graphs decode in (specc/spec/targets.py's decode_activations): fp32
    # or int8; None: a float build
    activations: str | None = None

    @property
    def main_graph(self) -> GraphInfo:
        """The graph whose outputs are the model's: the decoder of an encoder-decoder, else the model."""
        return self.graphs[io.main_graph(self.graphs)]

    @property
    def output_kinds(self) -> dict[str, str]:
        return {o.name: o.kind for o in self.outputs}

    def pad_for(self, eos: int | None) -> int:
        """The padding id when `eos` ends a row: tokens.pad, else `eos`, else 0."""
        return self.tokens.pad_for(eos)

    @property
    def pad_id(self) -> int:
        """The padding id with the spec's own EOS: tokens.pad, else tokens.eos, else 0."""
        return self.pad_for(self.tokens.eos)

    def start_for(self, pad: int) -> int:
        """An encoder-decoder's first decoder token: tokens.decoder_start, else tokens.bos, else `pad`."""
        return self.tokens.start_for(pad)

    @classmethod
    def from_manifest(cls, manifest: Mapping[str, Any]) -> BuildInfo:
        """The typed view of a parsed manifest (read_manifest's result). Raises NotAManifest,
        naming the field, where the manifest lacks what a build's manifest has."""
        if "graphs" not in manifest or "spec" not in manifest:
            raise NotAManifest("not a specc manifest (no 'graphs' or 'spec')")
        field = "graphs"
        try:
            graphs = {name: GraphInfo(name=name, file=_str(g["file"]), inputs=_tensors(g["inputs"]),
                                      outputs=_tensors(g["outputs"]))
                      for name, g in manifest["graphs"].items()}
            if not graphs or not ({"model"} <= set(graphs) or {"encoder", "decoder"} <= set(graphs)):
                raise ValueError("no 'model' graph, nor 'encoder' and 'decoder'")
            field = "spec"
            spec = manifest["spec"]
            outputs = tuple(Output(name=_str(o["name"]), kind=_str(o["kind"])) for o in spec.get("outputs") or ())
            lm = io.lm_output(((o.name, o.kind) for o in outputs), (t.name for t in graphs[io.main_graph(graphs)].outputs))
            position = spec.get("position") or {}
            learned = _int(position["max_length"]) if position.get("kind") == "learned" else None
            given = spec.get("tokens") or {}
            tokens = Tokens(**{k: _opt_int(given.get(k)) for k in ("bos", "eos", "pad", "decoder_start")})
            serving = spec["serving"]
            vocab = spec["vocab"]
            info = cls(name=_str(manifest.get("name", spec.get("name"))),
                       architecture=_str(manifest.get("architecture", spec.get("architecture"))),
                       graphs=MappingProxyType(graphs), vocab_size=_int(vocab["size"]),
                       target_vocab_size=_int(vocab.get("target_size") or vocab["size"]),
                       type_vocab_size=_int(vocab.get("type_size") or 0), outputs=outputs,
                       lm_output=lm, learned_positions=learned, tokens=tokens,
                       batch=_range(serving["batch"]), length=_range(serving["length"]),
                       generation=_generation(serving.get("generation") or {}),
                       inplace=_inplace(manifest.get("inplace") or {}),
                       activations=decode_activations(_str(serving.get("precision", "fp32")), serving.get("activations")))
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise NotAManifest(f"malformed '{field}' ({type(exc).__name__}: {exc})") from None
        return info


def _tensors(entries: Any) -> tuple[TensorInfo, ...]:
    return tuple(TensorInfo(name=_str(t["name"]), dtype=_str(t["dtype"]),
                            dims=tuple(d if isinstance(d, str) else _int(d) for d in t["dims"]))
                 for t in entries)


def _inplace(entry: Any) -> GraphInfo | None:
    if "file" not in entry:
        return None
    return GraphInfo(name="inplace", file=_str(entry["file"]), inputs=_tensors(entry["inputs"]),
                     outputs=_tensors(entry["outputs"]))


def _generation(entry: Any) -> Generation:
    default = Generation()
    return Generation(max_sequences=_opt_int(entry.get("max_sequences")),
                      max_cache_tokens=_opt_int(entry.get("max_cache_tokens")),
                      max_waiting=_int(entry.get("max_waiting", default.max_waiting)),
                      prefix_cache_tokens=_opt_int(entry.get("prefix_cache_tokens")))


def _range(entry: Any) -> Range:
    return Range(min=_int(entry["min"]), opt=_int(entry["opt"]), max=_int(entry["max"]))


def _str(value: Any) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{value!r} is not a string")
    return value


def _int(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{value!r} is not an integer")
    return value


def _opt_int(value: Any) -> int | None:
    return None if value is None else _int(value)
