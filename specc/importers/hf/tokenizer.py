"""The tokenizer an import carries beside the spec and its weights: OUT.tokenizer/, a folder of a
Hugging Face tokenizer's files under their own names (specc/spec/manifest.py's TOKENIZER_FILES),
which the spec names with `tokenizer:` and the build copies into the build folder's root.

Contracts:

- `hf_tokenizer(src, vocab)`: the files a checkpoint folder has, byte for byte (tokenizer.json
  required: without it, None), each a regular file inside the folder of at most
  MAX_TOKENIZER_BYTES; tokenizer.json must be a tokenizers serialization whose ids fit the
  model's vocabulary, tokenizer_config.json a JSON object, chat_template.jinja UTF-8 text.
  CheckpointError names the file otherwise.
- `gguf_tokenizer(path, vocab, context)`: the tokenizer stored in a GGUF file's metadata
  (tokenizer.ggml.*), converted to those files by transformers' own GGUF tokenizer converter
  (AutoTokenizer with gguf_file, imported lazily: the one heavy dependency here), its chat
  template (tokenizer.chat_template) in chat_template.jinja, and tokenizer_config.json made
  portable: `tokenizer_class` PreTrainedTokenizerFast (a class every transformers release knows),
  the loader's own bookkeeping dropped, `model_max_length` the file's context length. None when
  the file holds no tokenizer.
- `write_folder(files, folder)`: written beside, then renamed into place (replacing an earlier
  import's folder), so a reader never sees half a folder.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

from specc.errors import first_line
from specc.fileio import umask
from specc.importers.hf.checkpoint import CheckpointError, read_optional
from specc.spec.manifest import (
    CHAT_TEMPLATE,
    MAX_TOKENIZER_BYTES,
    TOKENIZER_CONFIG,
    TOKENIZER_FILES,
    TOKENIZER_JSON,
)

TOKENIZER_SUFFIX = ".tokenizer"  # OUT.yaml's tokenizer folder: OUT.tokenizer
# what transformers' save_pretrained writes into tokenizer_config.json about how it was loaded,
# not about the tokenizer
_LOADER_KEYS = ("is_local", "local_files_only", "backend", "name_or_path", "_commit_hash")


def tokenizer_folder(out_spec: str | os.PathLike) -> Path:
    """Where an import writes the tokenizer of OUT.yaml: OUT.tokenizer beside it."""
    return Path(out_spec).with_suffix(TOKENIZER_SUFFIX)


def hf_tokenizer(src: Path, vocab: int) -> dict[str, bytes] | None:
    """The tokenizer files of the checkpoint folder SRC (see the module's doc); None without a
    tokenizer.json."""
    files = {}
    for name in TOKENIZER_FILES:
        data = read_optional(src, name, MAX_TOKENIZER_BYTES)
        if data is not None:
            files[name] = data
    if TOKENIZER_JSON not in files:
        return None
    check_files(files, src, vocab)
    return files


def check_files(files: dict[str, bytes], where: Path, vocab: int) -> None:
    """tokenizer.json a tokenizers serialization whose token ids lie below `vocab`, the JSON files
    JSON objects, the template UTF-8: CheckpointError naming the file (under `where`) otherwise."""
    parsed = {}
    for name, data in files.items():
        if not name.endswith(".json"):
            continue
        try:
            parsed[name] = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as exc:
            raise CheckpointError(f"{where / name}: not JSON ({str(exc)[:200]})") from None
        if not isinstance(parsed[name], dict):
            raise CheckpointError(f"{where / name}: not a JSON object")
    if CHAT_TEMPLATE in files:
        try:
            files[CHAT_TEMPLATE].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise CheckpointError(f"{where / CHAT_TEMPLATE}: not UTF-8 text ({exc})") from None
    top = _largest_id(parsed[TOKENIZER_JSON], where / TOKENIZER_JSON)
    if top >= vocab:
        raise CheckpointError(f"{where / TOKENIZER_JSON}: token id {top} is outside the model's vocabulary "
                              f"(0..{vocab - 1}); the tokenizer is not this model's")


def _largest_id(data: dict, where: Path) -> int:
    """The largest token id a tokenizer.json gives: its model's vocabulary (a token -> id map, or
    Unigram's list of [token, score], whose ids are the positions) and its added tokens."""
    model = data.get("model")
    if not isinstance(model, dict) or "vocab" not in model:
        raise CheckpointError(f"{where}: not a tokenizers serialization (no model.vocab)")
    table = model["vocab"]
    if isinstance(table, dict):
        ids = [i for i in table.values() if isinstance(i, int)]
        if len(ids) != len(table):
            raise CheckpointError(f"{where}: model.vocab maps a token to something other than an id")
    elif isinstance(table, list):
        ids = [len(table) - 1] if table else []
    else:
        raise CheckpointError(f"{where}: model.vocab is neither a map nor a list")
    added = data.get("added_tokens") or []
    if not isinstance(added, list) or not all(isinstance(t, dict) and isinstance(t.get("id"), int) for t in added):
        raise CheckpointError(f"{where}: added_tokens is not a list of tokens with ids")
    ids += [t["id"] for t in added]
    return max(ids, default=-1)


def gguf_tokenizer(path: Path, reader, vocab: int, context: int | None) -> dict[str, bytes] | None:
    """The tokenizer in the GGUF file PATH (its `reader` already open), as a Hugging Face
    tokenizer's files (see the module's doc); None when the file has no tokenizer.ggml.model."""
    if reader.fields.get("tokenizer.ggml.model") is None:
        return None
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise CheckpointError(f"{path}: converting the file's tokenizer needs transformers (pip install "
                              "transformers); or import without it (--no-tokenizer)") from None
    with tempfile.TemporaryDirectory(prefix="specc-gguf-tokenizer-") as tmp:
        # a folder of its own, so that no other file beside the GGUF (a tokenizer_config.json of
        # something else) is read with it
        os.symlink(path.resolve(), Path(tmp) / path.name)
        out = Path(tmp) / "out"
        try:
            with _quiet():
                tok = AutoTokenizer.from_pretrained(tmp, gguf_file=path.name, local_files_only=True)
                tok.save_pretrained(out)
        except Exception as exc:  # transformers raises many types; its first line names the problem
            first = first_line(exc) or type(exc).__name__
            raise CheckpointError(f"{path}: transformers cannot convert the file's tokenizer ({first[:200]})") from None
        files = {name: (out / name).read_bytes() for name in TOKENIZER_FILES if (out / name).is_file()}
    if TOKENIZER_JSON not in files:
        raise CheckpointError(f"{path}: transformers converted the file's tokenizer but wrote no {TOKENIZER_JSON}")
    if TOKENIZER_CONFIG in files:
        config = json.loads(files[TOKENIZER_CONFIG])
        for key in _LOADER_KEYS:
            config.pop(key, None)
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        if context is not None:
            config["model_max_length"] = context
        files[TOKENIZER_CONFIG] = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode("utf-8")
    check_files(files, path.parent, vocab)
    return files


@contextlib.contextmanager
def _quiet():
    """transformers warns and logs while converting; an import reports through its own lines."""
    disabled = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(disabled)


def write_folder(files: dict[str, bytes], folder: Path) -> None:
    """FILES written into FOLDER: first into a new folder beside it, then renamed into place (an
    earlier folder of that name, which the caller may replace, renamed away first and removed)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        os.chmod(tmp, 0o777 & ~umask())  # mkdtemp makes 0700
        remove_folder(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_folder(folder: Path) -> None:
    """An earlier import's tokenizer folder gone (renamed away, then removed); a file of that name
    too. Nothing where there is none."""
    if folder.is_symlink() or folder.is_file():
        folder.unlink()
    elif folder.is_dir():
        away = Path(tempfile.mkdtemp(prefix=f".{folder.name}.old.", dir=folder.parent))
        os.replace(folder, away / folder.name)
        shutil.rmtree(away, ignore_errors=True)
