"""`specc import gguf`: a llama.cpp GGUF file as a spec plus safetensors weights.

Contract: `import_gguf(path, out_spec)` reads the file with the `gguf` package's reader (memory
mapped), turns its metadata into the Hugging Face config of the same model and its tensors into
Hugging Face's names, each dequantized to fp32 by gguf's own routines when it is asked for (one
tensor in memory at a time, never the model), and hands both to the Hugging Face importer's
writer (specc.importers.hf.importer.write_import): the same family tables, refusals and
all-or-nothing writing as `specc import hf`. Architectures: llama (LLaMA, Mistral and the models
converted as llama), qwen2, qwen3; any other is refused naming `general.architecture`.

llama.cpp's converter stores a llama model's q and k rows permuted for its rotary layout (pairs
of adjacent dims); they are permuted back to Hugging Face's (each head's halves), as
transformers' own GGUF loading does. qwen2 and qwen3 are stored unpermuted. The tokenizer in the
file's metadata is carried as import hf carries a folder's (OUT.tokenizer/), converted to a
tokenizer.json by specc.importers.hf.tokenizer.gguf_tokenizer.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Iterator, Mapping

import numpy as np

from specc.importers.hf.checkpoint import CheckpointError
from specc.importers.hf.importer import check_outputs, write_import
from specc.importers.hf.tokenizer import gguf_tokenizer

# general.architecture -> (model_type, architectures entry, q/k rows permuted by the converter)
ARCHITECTURES = {
    "llama": ("llama", "LlamaForCausalLM", True),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", False),
    "qwen3": ("qwen3", "Qwen3ForCausalLM", False),
}
# GGUF tensor names -> Hugging Face's (blk.N. -> model.layers.N.)
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
          "attn_k_norm": "self_attn.k_norm", "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj",
          "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(name: str) -> str | None:
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _TOP:
        return f"{_TOP[m.group(1)]}.{m.group(2)}"
    return None


def _field(reader, key: str, default=None):
    """A metadata value as Python (a string, a number or a list), or DEFAULT when absent."""
    f = reader.fields.get(key)
    if f is None:
        return default
    value = f.contents()
    return value


def _config(reader, where: str) -> tuple[dict, bool]:
    """The Hugging Face config of the file's model, and whether its q/k rows are permuted."""
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise CheckpointError(f"{where}: general.architecture {arch!r} has no importer; specc import gguf reads "
                              + ", ".join(sorted(ARCHITECTURES)))
    model_type, head, permuted = ARCHITECTURES[arch]

    def need(key: str, default=None):
        value = _field(reader, f"{arch}.{key}", default)
        if value is None:
            raise CheckpointError(f"{where}: no {arch}.{key} in the file's metadata")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"{where}: {arch}.{key} is {str(value)[:40]}; specc reads one number here "
                                  "(a value per layer is not expressible)")
        return value

    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise CheckpointError(f"{where}: {arch}.rope.scaling.type {scaling!r}: specc implements plain rotary "
                              "positions only")

    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise CheckpointError(f"{where}: no token_embd.weight tensor")
    heads = int(need("attention.head_count"))
    config = {
        "model_type": model_type, "architectures": [head],
        "hidden_size": int(need("embedding_length")), "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(need("attention.head_count_kv", heads)),
        "intermediate_size": int(need("feed_forward_length")),
        "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(need("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(need("context_length", 2048)),
        "vocab_size": int(embd.shape[1]),  # ggml's shape: [d_model, vocab]
        "tie_word_embeddings": "output.weight" not in tensors,
        "hidden_act": "silu",
    }
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is not None:
        config["head_dim"] = int(head_dim)
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    d_k = config.get("head_dim") or config["hidden_size"] // heads
    if rope_dims is not None and int(rope_dims) != d_k:
        config["partial_rotary_factor"] = int(rope_dims) / d_k
    if arch == "qwen2":
        config["use_sliding_window"] = False
    for ours, key in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id")):
        value = _field(reader, key)
        if value is not None:
            config[ours] = int(value)
    return config, permuted


class GGUFTensors(Mapping):
    """A GGUF file's tensors under Hugging Face's names, each dequantized to fp32 (gguf's own
    routines) when asked for; q/k rows permuted back where the converter permuted them."""

    def __init__(self, reader, config: dict, permuted: bool, where: str):
        self._by_name: dict[str, object] = {}
        for t in reader.tensors:
            hf = _hf_name(t.name)
            if hf is None:
                raise CheckpointError(f"{where}: tensor {t.name} has no place in a {config['model_type']} model")
            self._by_name[hf] = t
        self._heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        self._permuted = permuted

    def __getitem__(self, name: str):
        import torch
        from gguf import quants

        t = self._by_name[name]
        data = quants.dequantize(t.data, t.tensor_type)  # a new array, or (F32) a view of the mapped file
        data = np.array(data, dtype=np.float32, copy=not data.flags.writeable or data.dtype != np.float32)
        data = data.reshape(tuple(int(d) for d in reversed(t.shape)))
        proj = name.split(".")[-2]
        if self._permuted and proj in self._heads and name.endswith(".weight"):
            data = _unpermute(data, self._heads[proj])
        return torch.from_numpy(np.ascontiguousarray(data))

    def meta(self, name: str):
        import torch

        t = self._by_name[name]
        return torch.empty(tuple(int(d) for d in reversed(t.shape)), dtype=torch.float32, device="meta")

    def __contains__(self, name) -> bool:  # Mapping's would dequantize the tensor to answer
        return name in self._by_name

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """Rows of q or k from llama.cpp's rotary layout (adjacent dims paired) back to Hugging
    Face's (each head's halves): per head, row j*d/2 + i of the result is row 2i + j."""
    rows, cols = w.shape
    return w.reshape(heads, rows // heads // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def import_gguf(path: str | os.PathLike, out_spec: str | os.PathLike, *, name: str | None = None,
                force: bool = False, max_length: int | None = None, tokenizer: bool = True) -> tuple[Path, Path]:
    """Write OUT.yaml and OUT.safetensors for the GGUF file PATH, and OUT.tokenizer/ from its
    tokenizer metadata (unless tokenizer=False); all or none. max_length: as import_hf's."""
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
    config, permuted = _config(reader, where)
    tensors = GGUFTensors(reader, config, permuted, where)
    stem = re.sub(r"[^a-z0-9._-]+", "-", path.stem.lower()).strip("-._") or "imported"
    label = path.name.replace("{", "{{").replace("}", "}}")  # write_import formats the description
    carry = (lambda vocab: gguf_tokenizer(path, reader, vocab, config["max_position_embeddings"])) if tokenizer else None
    return write_import(config, tensors, where, Path(out_spec), weights, name or stem,
                        f"Imported from a GGUF file ({config['model_type']}, {label}) by specc import gguf",
                        max_length=max_length, tokenizer=carry)
