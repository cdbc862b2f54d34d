"""The vocabulary a family's GGUF row is written in (specc.importers.families): how one
`general.architecture` of llama.cpp's GGUF files maps onto the Hugging Face form of that family.

A row is one `Arch` record: the config from the file's metadata (a function of `Meta`, which reads
a metadata key and refuses naming it), GGUF tensor names to Hugging Face's, and the converter's
changes to each tensor, undone. The readers most rows share (`common`: sizes, heads, norms, the
vocabulary, tying, the special ids; `head_size`, `rotary_fraction`; the encoders' `rows`,
`encoder_heads`, `token_id`) and the change three rows share (`fix_fused`: fused q/k/v regrouped)
live here; a row's own readers and fixes live in its family's module.

The reading itself (the file, its tensors dequantized, the import) is specc.importers.gguf's. Nothing
here opens a file or imports torch or gguf; arrays are numpy's.

        GGUF metadata --row.config(Meta)--> Hugging Face config.json
        blk.N.KIND.weight --row.layer / row.top--> Hugging Face tensor name
        tensor --row.fix(kind, part, array, config)--> Hugging Face's layout
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from specc.importers.errors import CheckpointError

_MISSING = object()


class Meta:
    """One file's metadata and tensor names, read for its architecture ARCH; each refusal names
    the file and the GGUF key."""

    def __init__(self, reader, arch: str, where: str):
        self.reader, self.arch, self.where = reader, arch, where
        self.tensors = {t.name: t for t in reader.tensors}

    def raw(self, key: str, default: Any = None) -> Any:
        """The value of KEY (a full GGUF key) as Python, or DEFAULT when absent."""
        f = self.reader.fields.get(key)
        return default if f is None else f.contents()

    def number(self, key: str, default: Any = _MISSING) -> int | float:
        """`ARCH.KEY` as one number; DEFAULT when absent (refused when there is none)."""
        full = f"{self.arch}.{key}"
        value = self.raw(full, _MISSING)
        if value is _MISSING:
            if default is _MISSING:
                raise CheckpointError(f"{self.where}: no {full} in the file's metadata")
            return default
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise CheckpointError(f"{self.where}: {full} is {str(value)[:40]}; specc reads one number here "
                                  "(a value per layer is not expressible)")
        return value

    def flag(self, key: str, default: bool) -> bool:
        full = f"{self.arch}.{key}"
        value = self.raw(full, default)
        if not isinstance(value, bool):
            raise CheckpointError(f"{self.where}: {full} is {str(value)[:40]}; expected true or false")
        return value

    def has(self, tensor: str) -> bool:
        return tensor in self.tensors

    def refuse(self, key: str, why: str):
        raise CheckpointError(f"{self.where}: {key}: {why}")


@dataclass(frozen=True)
class Arch:
    """How one `general.architecture` maps to a Hugging Face model: the config from the metadata,
    GGUF tensor names to Hugging Face's (`blk.N.KIND` -> LAYER[KIND] under PREFIX with {i} = N,
    TOP for the rest; `enc.blk.N.KIND` and `dec.blk.N.KIND`, T5's stacks, as LAYER["enc.KIND"],
    LAYER["dec.KIND"]; {i} may stand in LAYER's names too; `variant(meta)` gives LAYER where it
    depends on the file), the converter's changes to undo (`fix(kind, part, array, config)`,
    `transposed`: kinds whose weights the converter transposed, their last two dimensions;
    `shaped(kind, part, shape)`: the shape `fix` gives a tensor whose shape it changes otherwise,
    such as a [1, D] matrix the converter squeezed to [D]), `outputs(meta)`: spec outputs the
    file's metadata adds to the family head's, and whether the file's tokenizer is carried."""
    model_type: str
    head: str
    config: Callable[[Meta], dict]
    layer: Mapping[str, str]
    top: Mapping[str, str]
    prefix: str = "model.layers.{i}."
    fix: Callable[[str, str, np.ndarray, dict], np.ndarray] | None = None
    transposed: frozenset[str] = field(default_factory=frozenset)
    shaped: Callable[[str, str, tuple[int, ...]], tuple[int, ...]] | None = None
    variant: Callable[[Meta], Mapping[str, str]] | None = None  # LAYER for this file, where it depends on it
    outputs: Callable[[Meta], list[dict]] | None = None  # outputs after the family head's (a pooled embedding)
    # whether the file's tokenizer is carried: transformers (5.24) converts the tokenizers of the
    # architectures its GGUF loading reads, not bert's, gemma's, gptneox's or olmo2's
    tokenizer: bool = True
    # the `rope.scaling.type` values the row's config reads itself (any other is refused)
    rope_scalings: frozenset[str] = frozenset()


# --- metadata -> config: the readers most rows share ---------------------------------------------


def common(m: Meta, model_type: str, head: str, *, rms: bool = True, context: int = 2048,
           ffn: bool = True) -> dict:
    """The fields most architectures share, under LLaMA's config names: sizes, heads, the norm's
    eps (RMSNorm's or LayerNorm's key), the context length (CONTEXT when absent), the feed-forward
    width (required where FFN), the vocabulary (token_embd's rows), tying (no output.weight:
    llama.cpp computes the logits with token_embd), the special token ids."""
    heads = int(m.number("attention.head_count"))
    if heads < 1:
        m.refuse(f"{m.arch}.attention.head_count", f"{heads}: a model has at least one head")
    cfg = {
        "model_type": model_type, "architectures": [head],
        "hidden_size": int(m.number("embedding_length")), "num_hidden_layers": int(m.number("block_count")),
        "num_attention_heads": heads, "num_key_value_heads": int(m.number("attention.head_count_kv", heads)),
        "max_position_embeddings": int(m.number("context_length", context)),
        "vocab_size": int(m.tensors["token_embd.weight"].shape[1]),  # ggml's shape: [d_model, vocab]
        "tie_word_embeddings": not m.has("output.weight"),
    }
    if rms:
        cfg["rms_norm_eps"] = float(m.number("attention.layer_norm_rms_epsilon"))
    else:
        cfg["layer_norm_eps"] = float(m.number("attention.layer_norm_epsilon"))
    if ffn or m.raw(f"{m.arch}.feed_forward_length") is not None:
        cfg["intermediate_size"] = int(m.number("feed_forward_length"))
    # the file's ids, or none: a family's defaults (OLMo 2's eos 50279) describe Hugging Face's
    # checkpoints, not this file's vocabulary
    for ours, key in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = m.raw(f"tokenizer.ggml.{key}_token_id")
        cfg[ours] = None if value is None else int(value)
    cfg["pad_token_id"] = None
    return cfg


def head_size(m: Meta, cfg: dict) -> int:
    """`attention.key_length` (written where a head is not d_model / heads, and then the config's
    head_dim), else d_model / heads."""
    d = m.raw(f"{m.arch}.attention.key_length")
    if d is not None:
        cfg["head_dim"] = int(m.number("attention.key_length"))
        return cfg["head_dim"]
    return cfg["hidden_size"] // cfg["num_attention_heads"]


def rotary_fraction(m: Meta, size: int, default: float = 1.0) -> float:
    """`rope.dimension_count` (the rotated dims of a head) over the head's SIZE."""
    dims = m.raw(f"{m.arch}.rope.dimension_count")
    return default if dims is None else int(m.number("rope.dimension_count")) / size


# --- the encoders' readers (bert, t5) ------------------------------------------------------------


def same_tensor(m: Meta, a: str, b: str) -> bool:
    """Whether tensors A and B hold the same bytes in the same type and shape."""
    ta, tb = m.tensors[a], m.tensors[b]
    return (ta.tensor_type == tb.tensor_type and list(ta.shape) == list(tb.shape)
            and np.array_equal(ta.data, tb.data))


def rows(m: Meta, tensor: str) -> int:
    """The rows of a 2-D table (ggml's shape is [columns, rows])."""
    return int(m.tensors[tensor].shape[1])


def encoder_heads(m: Meta) -> int:
    """`attention.head_count`, at least 1; `attention.head_count_kv`, where present, the same
    (these encoders have a key and a value head per query head)."""
    heads = int(m.number("attention.head_count"))
    if heads < 1:
        m.refuse(f"{m.arch}.attention.head_count", f"{heads}: a model has at least one head")
    kv = int(m.number("attention.head_count_kv", heads))
    if kv != heads:
        m.refuse(f"{m.arch}.attention.head_count_kv", f"{kv}: {m.arch} has a key and a value head per query head "
                 f"({heads})")
    return heads


def token_id(m: Meta, key: str) -> int | None:
    """`tokenizer.ggml.KEY`, a token id, or None where absent."""
    full = f"tokenizer.ggml.{key}"
    value = m.raw(full)
    if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
        m.refuse(full, f"{str(value)[:40]}: expected a token id")
    return value


# --- the converter's change three rows share: fused q/k/v regrouped ------------------------------


def regroup(w: np.ndarray, heads: int, kv: int) -> np.ndarray:
    """Fused q/k/v rows (a weight or a bias) from llama.cpp's order (every query head, then every
    key head, then every value head) back to Hugging Face's: per key-value group, its heads/kv
    query heads, its key head, its value head (Falcon; with kv = heads, q, k, v per head: BLOOM,
    GPT-NeoX)."""
    d = w.shape[0] // (heads + 2 * kv)
    rest = w.shape[1:]
    q = w[:heads * d].reshape(kv, heads // kv, d, *rest)
    k = w[heads * d:(heads + kv) * d].reshape(kv, 1, d, *rest)
    v = w[(heads + kv) * d:].reshape(kv, 1, d, *rest)
    return np.concatenate([q, k, v], axis=1).reshape(w.shape)


def fix_fused(kind: str, part: str, w: np.ndarray, cfg: dict) -> np.ndarray:
    """BLOOM, GPT-NeoX, Falcon: the fused q/k/v rows grouped back (`regroup`)."""
    if kind != "attn_qkv":
        return w
    heads = cfg.get("num_attention_heads") or cfg["n_head"]
    return regroup(w, heads, cfg.get("num_kv_heads") or heads)


# BLOOM's and Falcon's (under transformer.) and GPT-NeoX's (under gpt_neox.) blocks
FUSED = {"attn_norm": "input_layernorm", "attn_qkv": "self_attention.query_key_value",
         "attn_output": "self_attention.dense", "ffn_norm": "post_attention_layernorm",
         "ffn_up": "mlp.dense_h_to_4h", "ffn_down": "mlp.dense_4h_to_h"}
