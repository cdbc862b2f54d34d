"""The whole import: a checkpoint folder -> OUT.yaml + OUT.safetensors (+ OUT.tokenizer/), all or
none.

Contract: `import_hf(src, out_spec)` reads the folder (specc.importers.hf.checkpoint), converts its config
and tensors (specc.importers.hf.convert), validates and resolves the spec it writes, and only then writes
the weights, the tokenizer folder (specc.importers.hf.tokenizer: the checkpoint's tokenizer files, where it
has a tokenizer.json) and, atomically, the spec, whose `weights:` key names the safetensors file beside
it and `tokenizer:` the folder. serving.length.max is the checkpoint's context unless `max_length`
says otherwise.
Any failure raises CheckpointError, one line naming the file and the config field or tensor (a
spec the config makes that specc's validation refuses is reported against the config field it came
from, not against OUT.yaml, which is never written), and leaves no file behind; existing files are
replaced only with force=True.

The spec is written sparse (only what the import set) in the order people read a spec in, not
with specc.spec.dump: that dumps a whole ModelSpec with every default filled and orders only
`kind:` first, which would make a different, much longer file.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

from specc.errors import SpecError
from specc.fileio import write_atomic
from specc.importers.hf.checkpoint import CheckpointError, read_checkpoint
from specc.importers.hf.convert import config_to_spec, convert_tensors, family_of, spec_error
from specc.importers.hf.sentence import sentence_embedding
from specc.importers.hf.tokenizer import hf_tokenizer, remove_folder, tokenizer_folder, write_folder
from specc.spec import loads_spec, resolve
from specc.spec.yamlio import dump_yaml


def spec_name(*texts: str | None) -> str:
    """The first of TEXTS that makes a spec name, as one: lower case, each run of other characters
    than a-z, 0-9, '.', '_' and '-' one '-', none at either end, at most 128 characters;
    "imported" where none does."""
    for text in texts:
        name = re.sub(r"[^a-z0-9._-]+", "-", (text or "").lower()).strip("-._")[:128].rstrip("-._")
        if name:
            return name
    return "imported"


def import_hf(src: str | os.PathLike, out_spec: str | os.PathLike, *, name: str | None = None,
              force: bool = False, max_length: int | None = None, tokenizer: bool = True) -> tuple[Path, Path]:
    """Write OUT.yaml and OUT.safetensors (beside it) for the checkpoint folder SRC, and
    OUT.tokenizer/ where the folder has a tokenizer.json (unless tokenizer=False), and, for a
    sentence-transformers folder whose pooling the language computes, the `sentence_embedding`
    output (specc.importers.hf.sentence); returns the spec's and the weights' paths. Nothing is written unless the import succeeds and the spec
    validates. max_length: serving.length.max (default: the checkpoint's context)."""
    src = Path(src)
    weights = check_outputs(out_spec, force)
    config, tensors = read_checkpoint(src)
    outputs, note = sentence_embedding(src)
    note = f"; {note}".replace("{", "{{").replace("}", "}}") if note else ""  # write_import formats it
    return write_import(config, tensors, str(src / "config.json"), Path(out_spec), weights, name or spec_name(src.resolve().name),
                        "Imported from a Hugging Face {arch} checkpoint (model_type {model_type}) by specc import hf"
                        + note, max_length=max_length,
                        tokenizer=(lambda vocab: hf_tokenizer(src, vocab)) if tokenizer else None, outputs=outputs)


def check_outputs(out_spec: str | os.PathLike, force: bool) -> Path:
    """OUT.safetensors for OUT.yaml, once both (and OUT.tokenizer/) may be written: a .yaml name,
    nothing in the way (unless force), an existing folder. CheckpointError otherwise."""
    out_spec = Path(out_spec)
    if out_spec.suffix not in (".yaml", ".yml"):
        raise CheckpointError(f"{out_spec}: the spec file must end in .yaml or .yml")
    weights = out_spec.with_suffix(".safetensors")
    if not force:
        for p in (out_spec, weights, tokenizer_folder(out_spec)):
            if os.path.lexists(p):
                raise CheckpointError(f"{p} exists; pass --force (force=True) to replace it")
    if not out_spec.parent.is_dir():
        raise CheckpointError(f"{out_spec.parent}: the folder for the spec does not exist (create it first)")
    return weights


def write_import(config: dict, tensors, where: str, out_spec: Path, weights: Path, name: str,
                 description: str, *, max_length: int | None = None,
                 tokenizer: Callable[[int], dict[str, bytes] | None] | None = None,
                 outputs: list[dict] | None = None, metadata: dict[str, str] | None = None) -> tuple[Path, Path]:
    """A Hugging Face config and its tensors (by Hugging Face's names) as OUT.yaml + weights
    (+ OUT.tokenizer/), all or none; WHERE names the config in messages; DESCRIPTION may name
    {arch} (the config's architectures entry) and {model_type}. max_length: serving.length.max
    (default: the checkpoint's context). tokenizer(vocab size): the tokenizer's files to carry,
    or None. OUTPUTS (parameter-free, such as a pooled embedding) follow the family head's.
    METADATA: strings the weights file's header carries (import gguf's record of its file).
    Shared by import hf and import gguf (which reads a GGUF file into that form, with the pooled
    output its pooling type names)."""
    from specc.weights.io import write_safetensors  # imports torch

    data = config_to_spec(config, tensors, name, where, max_length=max_length)
    data["outputs"] += outputs or []
    fam, arch = family_of(config, where)  # both checked by config_to_spec
    arch = arch if config.get("architectures") else "?"  # what the config names, not the default head
    description = description.format(arch=arch, model_type=config.get("model_type"))
    vocab = data["vocab"]
    files = tokenizer(max(vocab["size"], vocab.get("target_size") or 0)) if tokenizer is not None else None
    folder = tokenizer_folder(out_spec)
    data = {"specc": 1, "name": data.pop("name"), "description": description,
            **{k: v for k, v in data.items() if k != "specc"}, "weights": weights.name,
            **({"tokenizer": folder.name} if files is not None else {})}
    text = dump_yaml(_reading_order(data))
    try:
        spec = loads_spec(text, file=str(out_spec), base_dir=out_spec.parent)
        resolved = resolve(spec)
    except SpecError as exc:
        named = [i for i in exc.issues if i.key == "name"]
        if named:  # the --name (or folder) name, not the config
            raise CheckpointError(f"spec name {data['name']!r}: {named[0].message}") from None
        raise spec_error(exc, fam, config, where) from None
    params = convert_tensors(fam, config, tensors, resolved, where)
    write_safetensors(params.entries, params.__getitem__, weights, metadata)  # one tensor in memory at a time
    try:
        if files is not None:
            write_folder(files, folder)
        else:
            remove_folder(folder)  # an earlier import's (force), which this spec does not name
        write_atomic(out_spec, text)
    except BaseException:
        weights.unlink(missing_ok=True)
        if files is not None:
            remove_folder(folder)
        raise
    return out_spec, weights


# the order people read a spec in (the language doc's); other keys keep theirs, after these
_TOP = ("specc", "name", "description", "architecture", "d_model", "vocab", "position", "norm", "dropout",
        "encoder", "decoder", "outputs", "tokens", "weights", "tokenizer", "serving")
_NESTED = ("kind", "name", "size", "target_size", "type_size", "share", "tie_output", "scale", "norm",
           "max_length", "base", "layout", "fraction", "placement", "eps", "final", "hidden", "layers",
           "attention", "heads", "kv_heads", "d_k", "score", "bias", "ffn", "d_ff", "activation")


def _reading_order(data: Any, order: tuple[str, ...] = _TOP) -> Any:
    if isinstance(data, dict):
        keys = sorted(data, key=lambda k: order.index(k) if k in order else len(order))
        return {k: _reading_order(data[k], _NESTED) for k in keys}
    if isinstance(data, list):
        return [_reading_order(v, _NESTED) for v in data]
    return data
