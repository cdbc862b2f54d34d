"""A Hugging Face LLaMA checkpoint of any shape with random weights, written the way Hugging Face
writes large models (model-0000N-of-0000M.safetensors shards and model.safetensors.index.json),
one tensor at a time, so that a 7B-shaped checkpoint is never whole in memory."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from specc.weights.io import write_safetensors


def llama_names(layers: int, d: int, kv: int, ff: int, vocab: int) -> list[tuple[str, tuple[int, ...]]]:
    """LlamaForCausalLM's tensor names and shapes, in the order the shards hold them."""
    out = [("model.embed_tokens.weight", (vocab, d))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (d,)), (p + "self_attn.q_proj.weight", (d, d)),
                (p + "self_attn.k_proj.weight", (kv, d)), (p + "self_attn.v_proj.weight", (kv, d)),
                (p + "self_attn.o_proj.weight", (d, d)), (p + "post_attention_layernorm.weight", (d,)),
                (p + "mlp.gate_proj.weight", (ff, d)), (p + "mlp.up_proj.weight", (ff, d)),
                (p + "mlp.down_proj.weight", (d, ff))]
    return out + [("model.norm.weight", (d,)), ("lm_head.weight", (vocab, d))]


def tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The same random values for the same name, whatever else is written."""
    g = torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(name)))
    if name.endswith("norm.weight"):
        return (1 + 0.1 * torch.randn(shape, generator=g)).to(dtype)
    return (0.02 * torch.randn(shape, generator=g)).to(dtype)


def write_llama(out: Path, *, layers: int, d: int, heads: int, kv_heads: int, ff: int, vocab: int,
                shard_bytes: int = 2 << 30, dtype: torch.dtype = torch.bfloat16, context: int = 4096) -> int:
    """Write the folder; returns the weights' bytes."""
    out.mkdir(parents=True, exist_ok=True)
    names = llama_names(layers, d, kv_heads * (d // heads), ff, vocab)
    shards, size, current = [], 0, []
    for name, shape in names:
        n = torch.Size(shape).numel() * torch.tensor([], dtype=dtype).element_size()
        if current and size + n > shard_bytes:
            shards.append(current)
            current, size = [], 0
        current.append((name, shape))
        size += n
    shards.append(current)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        entries = {n: torch.empty(s, dtype=dtype, device="meta") for n, s in shard}
        shapes = dict(shard)
        write_safetensors(entries, lambda n: tensor(n, shapes[n], dtype), out / file)
        for n, s in shard:
            weight_map[n] = file
            total += entries[n].numel() * entries[n].element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}, indent=2))
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": d,
              "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "intermediate_size": ff, "vocab_size": vocab, "max_position_embeddings": context,
              "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return total
