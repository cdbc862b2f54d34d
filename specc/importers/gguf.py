"""`specc import gguf`: a llama.cpp GGUF file as a spec plus safetensors weights.

Contract: `import_gguf(path, out_spec)` reads the file with the `gguf` package's reader (memory
mapped), turns its metadata into the Hugging Face config of the same model and its tensors into
Hugging Face's names and layouts, each dequantized to fp32 by gguf's own routines when it is
asked for (one tensor in memory at a time, never the model), and hands both to the Hugging Face
importer's writer (specc.importers.hf.importer.write_import): the same family tables, refusals and
all-or-nothing writing as `specc import hf`.

        GGUF file --general.architecture--> its family's row (ARCHITECTURES)
            metadata --row.config--> config.json;  tensors --row's names, row.fix--> Hugging Face's
            --> write_import (the Hugging Face importer's writer)

Architectures (`general.architecture`): the rows the family modules register
(specc.importers.families.ARCHITECTURES; docs/import.md lists them with what each one undoes): the
decoders llama (LLaMA, Mistral, Mixtral and the models converted as llama), qwen2, qwen3, gemma,
gemma2, gemma3 (its text model), phi3, stablelm, gptneox, falcon, bloom, gpt2, olmo2; the mixtures of
experts qwen2moe, qwen3moe, olmoe, gpt-oss (its MXFP4 experts dequantized by gguf's routines) and
deepseek2 (DeepSeek-V2 and V3, latent attention); the encoder bert
(BERT, and the DistilBERT, RoBERTa and XLM-RoBERTa checkpoints the converter writes as bert: each
is computed as the BERT it is stored as); the encoder-decoder t5. Any other is refused naming
`general.architecture` (with the family's reason where one names it: GGUF_REFUSED). Every change
llama.cpp's converter (convert_hf_to_gguf.py) makes to a tensor is undone by the row's `fix`,
exactly, or needs no undoing; what the file does not say is what llama.cpp assumes, stated at each
row's config (Gemma 2 and 3's query scale, Gemma 3's layer pattern and local rotary base).

Refused here, for every architecture, naming the GGUF key or tensor: rope scaling
(`ARCH.rope.scaling.type`, but YaRN where the row reads it: gpt-oss, deepseek2; and the tensors
some converters write for it: llama 3's `rope_freqs`, Phi-3's long-context factors). The rows refuse the rest (per-layer values, OLMo 3's sliding
windows, StableLM's per-head q/k norms, UMT5's relative-position table per layer, BERT's
classifier without its pooler), and the family's table what it refuses of the config. The
tokenizer in the file's metadata is carried as import hf carries a folder's (OUT.tokenizer/),
converted to a tokenizer.json by specc.importers.hf.tokenizer.gguf_tokenizer where transformers
converts it (the row's `tokenizer`: not bert's, gemma's, gptneox's or olmo2's).

The weights file records the GGUF file it was read from (its header's metadata, SOURCE_KEY: the
file's absolute path): `specc build --precision gguf` finds it there (`gguf_source`) and writes
the file's own quantized blocks into the graphs instead of the fp32 values (specc/export/ggufgraph.py,
with `row_order`: the order this import's fix gives each matrix's rows).
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from specc.importers.errors import CheckpointError
from specc.importers.families import ARCHITECTURES, GGUF_REFUSED
from specc.importers.gguftable import Arch, Meta
from specc.importers.hf.importer import check_outputs, spec_name, write_import
from specc.importers.hf.tokenizer import gguf_tokenizer

# tensors some converters write for rope scaling: refused by name rather than as "no place"
SOURCE_KEY = "specc.gguf_file"  # the weights file's metadata key naming the GGUF file it was read from

_ROPE_FACTORS = {"rope_freqs.weight": "llama 3's rope scaling (per-frequency factors)",
                 "rope_factors_long.weight": "Phi-3's long-context rope scaling (longrope)",
                 "rope_factors_short.weight": "Phi-3's long-context rope scaling (longrope)"}


def _refuse_rope_scaling(m: Meta, read: frozenset[str]) -> None:
    """A rope scaling other than those the row reads itself (READ: gpt-oss's and DeepSeek's YaRN)."""
    scaling = m.raw(f"{m.arch}.rope.scaling.type")
    if scaling not in (None, "none", *read):
        also = f" (and {', '.join(sorted(read))} for {m.arch})" if read else ""
        m.refuse(f"{m.arch}.rope.scaling.type", f"{scaling!r}: specc implements plain rotary positions only{also}")


def _config(reader, where: str) -> tuple[dict, Arch, Mapping[str, str], list[dict]]:
    """The Hugging Face config of the file's model, its architecture's table, the layer names for
    this file, and the outputs its metadata adds."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        why = GGUF_REFUSED.get(arch, "no specc family computes it")
        raise CheckpointError(f"{where}: general.architecture {arch!r} has no importer ({why}); specc import gguf "
                              "reads " + ", ".join(sorted(ARCHITECTURES)))
    m = Meta(reader, arch, where)
    table = ARCHITECTURES[arch]
    _refuse_rope_scaling(m, table.rope_scalings)
    for name, what in _ROPE_FACTORS.items():
        if m.has(name):
            m.refuse(name, f"{what}: specc implements plain rotary positions only")
    if not m.has("token_embd.weight") or len(m.tensors["token_embd.weight"].shape) != 2:
        raise CheckpointError(f"{where}: no token_embd.weight tensor (a table of [d_model, vocab])")
    return (table.config(m), table, table.variant(m) if table.variant else table.layer,
            table.outputs(m) if table.outputs else [])


# the config fields the families keep the context length in (GPT-2's and T5's n_positions,
# BLOOM's seq_length): the carried tokenizer's model_max_length
_CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "seq_length")


def _field(reader, key: str, default=None):
    """A metadata value as Python (a string, a number or a list), or DEFAULT when absent."""
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _text(value) -> str | None:
    """A metadata value that should be a string (general.name), or None where it is not one."""
    return value if isinstance(value, str) else None


class GGUFTensors(Mapping):
    """A GGUF file's tensors under Hugging Face's names, each dequantized to fp32 (gguf's own
    routines) and the converter's change undone (its architecture's `fix`) when asked for."""

    def __init__(self, reader, config: dict, arch: Arch, layer: Mapping[str, str], where: str):
        self._by_name: dict[str, tuple[object, str, str]] = {}  # HF name -> (tensor, kind, part)
        self._config, self._arch = config, arch
        for t in reader.tensors:
            hf, kind, part = _hf_name(arch, layer, t.name)
            if hf is None:
                raise CheckpointError(f"{where}: tensor {t.name} has no place in a {config['model_type']} model")
            self._by_name[hf] = (t, kind, part)

    def __getitem__(self, name: str):
        import torch
        from gguf import quants

        t, kind, part = self._by_name[name]
        data = quants.dequantize(t.data, t.tensor_type)  # a new array, or (F32) a view of the mapped file
        data = np.array(data, dtype=np.float32, copy=not data.flags.writeable or data.dtype != np.float32)
        data = data.reshape(tuple(int(d) for d in reversed(t.shape)))
        if self._arch.fix is not None:
            data = self._arch.fix(kind, part, data, self._config)
        return torch.from_numpy(np.ascontiguousarray(data))

    def meta(self, name: str):
        import torch

        t, kind, part = self._by_name[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        if kind in self._arch.transposed and part == "weight" and len(shape) >= 2:
            shape = (*shape[:-2], shape[-1], shape[-2])
        if self._arch.shaped is not None:
            shape = self._arch.shaped(kind, part, shape)
        return torch.empty(shape, dtype=torch.float32, device="meta")

    def __contains__(self, name) -> bool:  # Mapping's would dequantize the tensor to answer
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


def _hf_name(arch: Arch, layer: Mapping[str, str], name: str) -> tuple[str | None, str, str]:
    """(Hugging Face name, GGUF kind, weight/bias) of a GGUF tensor name; None where it has no place."""
    m = re.fullmatch(r"((?:enc|dec)\.)?blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    kind = m and (m.group(1) or "") + m.group(3)
    if m and kind in layer:
        return f"{(arch.prefix + layer[kind]).format(i=m.group(2))}.{m.group(4)}", kind, m.group(4)
    m = re.fullmatch(r"(\w+(?:\.\w+)?)\.(weight|bias)", name)
    if m and m.group(1) in arch.top:
        return f"{arch.top[m.group(1)]}.{m.group(2)}", m.group(1), m.group(2)
    return None, "", ""


def import_gguf(path: str | os.PathLike, out_spec: str | os.PathLike, *, name: str | None = None,
                force: bool = False, max_length: int | None = None, tokenizer: bool = True) -> tuple[Path, Path]:
    """Write OUT.yaml and OUT.safetensors for the GGUF file PATH, and OUT.tokenizer/ from its
    tokenizer metadata (unless tokenizer=False); all or none. The spec is named NAME, else after
    the file's `general.name` (the model's name the converter writes), else after the file's
    name. max_length: as import_hf's."""
    try:
        from gguf import GGUFReader
    except ImportError:
        raise CheckpointError("reading GGUF needs the gguf package: pip install gguf (or specc[gguf])") from None
    path = Path(path)
    weights = check_outputs(out_spec, force)
    if not path.is_file():
        raise CheckpointError(f"{path}: no such file")
    try:
        reader = GGUFReader(path)
    except (ValueError, OSError, IndexError) as exc:
        raise CheckpointError(f"{path}: not a GGUF file gguf can read ({exc})") from None
    where = str(path)
    config, arch, layer, outputs = _config(reader, where)
    tensors = GGUFTensors(reader, config, arch, layer, where)
    label = path.name.replace("{", "{{").replace("}", "}}")  # write_import formats the description
    context = next((config[k] for k in _CONTEXT_FIELDS if config.get(k) is not None), None)
    carry = (lambda vocab: gguf_tokenizer(path, reader, vocab, context)) if tokenizer and arch.tokenizer else None
    return write_import(config, tensors, where, Path(out_spec), weights,
                        name or spec_name(_text(_field(reader, "general.name")), path.stem),
                        f"Imported from a GGUF file ({config['model_type']}, {label}) by specc import gguf",
                        max_length=max_length, tokenizer=carry, outputs=outputs,
                        metadata={SOURCE_KEY: str(path.resolve())})


def gguf_source(weights: str | os.PathLike) -> Path | None:
    """The GGUF file a weights file was imported from (as import_gguf records it), or None."""
    from specc.weights.io import open_weights  # imports torch

    recorded = getattr(open_weights(weights), "metadata", {}).get(SOURCE_KEY)
    return Path(recorded) if recorded else None


def row_order(reader, where: str):
    """For a file's matrices: `orders(name, n)` gives the order the import puts the N rows of the
    GGUF matrix NAME in (its architecture's `fix`, where that only reorders rows, as it does to
    llama's query and key projections), None where it keeps them, or the string "other" where
    the fix does more than reorder rows (the matrix is then no GGUF matrix's rows as imported)."""
    config, arch, layer, _ = _config(reader, where)
    tensors = {t.name: t for t in reader.tensors}

    def orders(name: str, n: int):
        t = tensors[name]
        _, kind, part = _hf_name(arch, layer, name)
        if arch.fix is None:
            return None
        k = int(np.prod(t.shape)) // n
        index = np.ascontiguousarray(np.broadcast_to(np.arange(n, dtype=np.float32)[:, None], (n, k)))
        fixed = np.asarray(arch.fix(kind, part, index.copy(), config))
        if fixed.shape == index.shape and np.array_equal(fixed, index):
            return None
        rows = fixed[:, 0] if fixed.shape == index.shape else None
        if rows is None or not (fixed == rows[:, None]).all() or not np.array_equal(np.sort(rows), index[:, 0]):
            return "other"
        return rows.astype(np.int64)

    return orders
