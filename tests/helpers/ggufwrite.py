"""A Hugging Face model written as a GGUF file the way llama.cpp's converter (convert_hf_to_gguf.py)
writes it: its metadata keys for the architecture, the tensor names of the gguf package's own
TensorNameMap (the table the converter names tensors by), and the converter's changes to the
tensors (llama's q/k rows permuted for its rotary layout, Gemma's norms + 1, GPT-2's Conv1D
weights transposed, BLOOM / GPT-NeoX / Falcon's fused q/k/v regrouped as all q, all k, all v;
each layer's routed experts stacked, gpt-oss's gate and up split and transposed, DeepSeek's kv_b
split into k_b and v_b;
RoBERTa's position rows before the padding id + 1 cut off; BERT's pooler and MLM head, and
T5's copies of its embedding table, left out), with fp32, Q8_0 or (matrices) Q4_0 blocks. Written from the converter's behaviour for these tests, independently
of specc's importer (which undoes each change); the tokenizer is a placeholder vocabulary."""
from __future__ import annotations

import re
import tempfile
from pathlib import Path

import numpy as np
import torch

import gguf

# transformers' model_type -> general.architecture
ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma": "gemma",
        "gemma2": "gemma2", "gemma3_text": "gemma3", "phi3": "phi3", "stablelm": "stablelm", "gpt_neox": "gptneox",
        "falcon": "falcon", "bloom": "bloom", "gpt2": "gpt2", "olmo2": "olmo2",
        # the BERT converter's subclasses (DistilBERT, RoBERTa) write the bert architecture
        "bert": "bert", "distilbert": "bert", "roberta": "bert", "t5": "t5",
        # mixtures of experts and latent attention (Mixtral's converter writes the llama architecture)
        "mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe", "gpt_oss": "gpt-oss",
        "deepseek_v2": "deepseek2", "deepseek_v3": "deepseek2"}
MOE_ARCHS = ("qwen2moe", "qwen3moe", "olmoe", "gpt-oss", "deepseek2")


def _metadata(w: gguf.GGUFWriter, arch: str, c: dict, pooling: gguf.PoolingType | None = None) -> None:
    """The keys each converter class writes (set_gguf_parameters), from the config C."""
    heads = _first(c, "num_attention_heads", "n_head", "n_heads", "num_heads")
    hidden = _first(c, "hidden_size", "n_embd", "dim", "d_model")
    layers = _first(c, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    rope = c.get("rope_parameters") or {}
    w.add_block_count(layers)
    w.add_embedding_length(hidden)
    w.add_head_count(heads)
    if arch in ("llama", "qwen2", "qwen3", "olmo2", "gemma3"):  # TextModel's own keys
        w.add_context_length(c["max_position_embeddings"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count_kv(c["num_key_value_heads"])
        theta = rope.get("full_attention", rope).get("rope_theta")
        if theta is not None:
            w.add_rope_freq_base(theta)
        if (swa := rope.get("sliding_attention", {}).get("rope_theta")) is not None:
            w.add_rope_freq_base_swa(swa)
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        if c.get("head_dim") is not None:
            w.add_key_length(c["head_dim"])
            w.add_value_length(c["head_dim"])
        if arch == "llama":
            w.add_vocab_size(c["vocab_size"])
            w.add_rope_dimension_count(c.get("head_dim") or hidden // heads)
            if c.get("num_local_experts"):  # Mixtral: TextModel's expert keys
                w.add_expert_count(c["num_local_experts"])
                w.add_expert_used_count(c["num_experts_per_tok"])
        if arch == "gemma3":
            w.add_sliding_window(c["sliding_window"])
            if c.get("final_logit_softcapping"):
                w.add_final_logit_softcapping(c["final_logit_softcapping"])
    elif arch in ("gemma", "gemma2"):
        w.add_context_length(c["max_position_embeddings"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
        if arch == "gemma2":
            w.add_attn_logit_softcapping(c["attn_logit_softcapping"])
            w.add_final_logit_softcapping(c["final_logit_softcapping"])
            w.add_sliding_window(c["sliding_window"])
    elif arch == "phi3":
        w.add_context_length(c["max_position_embeddings"])
        w.add_rope_scaling_orig_ctx_len(c.get("original_max_position_embeddings") or c["max_position_embeddings"])
        w.add_feed_forward_length(c["intermediate_size"])
        w.add_head_count_kv(c["num_key_value_heads"])
        w.add_layer_norm_rms_eps(c["rms_norm_eps"])
        w.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * hidden) // heads)
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_sliding_window(c.get("sliding_window") or 0)
    elif arch in ("stablelm", "gptneox"):
        w.add_context_length(c["max_position_embeddings"])
        w.add_feed_forward_length(c["intermediate_size"])
        fraction = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", c.get("rotary_pct")))
        w.add_rope_dimension_count(int(fraction * (hidden // heads)))
        if arch == "stablelm":
            w.add_head_count_kv(c["num_key_value_heads"])
        w.add_parallel_residual(c.get("use_parallel_residual", True))
        w.add_layer_norm_eps(c["layer_norm_eps"])
    elif arch == "falcon":
        w.add_context_length(2048)  # "not in config.json"
        w.add_tensor_data_layout("jploski")
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count_kv(_falcon_kv(c))
        w.add_layer_norm_eps(c["layer_norm_epsilon"])
    elif arch == "bloom":
        w.add_context_length(c.get("seq_length", hidden))
        w.add_feed_forward_length(4 * hidden)
        w.add_head_count_kv(heads)
        w.add_layer_norm_eps(c["layer_norm_epsilon"])
    elif arch == "gpt2":
        w.add_context_length(c["n_ctx"] if "n_ctx" in c else c["n_positions"])
        w.add_feed_forward_length(4 * hidden)
        w.add_layer_norm_eps(c["layer_norm_epsilon"])
    elif arch == "bert":  # TextModel's keys, then BertModel's
        w.add_context_length(c["max_position_embeddings"] - _position_offset(c))
        w.add_feed_forward_length(_first(c, "intermediate_size", "hidden_dim"))
        w.add_layer_norm_eps(c.get("layer_norm_eps", 1e-12))  # DistilBERT's converter writes 1e-12
        w.add_causal_attention(False)
        if pooling is not None:  # from a sentence-transformers Pooling module, where the folder has one
            w.add_pooling_type(pooling)
    elif arch in MOE_ARCHS:
        _moe_metadata(w, arch, c)
    elif arch == "t5":
        w.add_context_length(c.get("n_positions", 512))
        w.add_feed_forward_length(c["d_ff"])
        if c.get("num_decoder_layers") is not None:
            w.add_decoder_block_count(c["num_decoder_layers"])
        w.add_key_length(c["d_kv"])
        w.add_value_length(c["d_kv"])
        w.add_layer_norm_eps(c["layer_norm_epsilon"])
        w.add_relative_attn_buckets_count(c["relative_attention_num_buckets"])
        w.add_layer_norm_rms_eps(c["layer_norm_epsilon"])
        w.add_decoder_start_token_id(c["decoder_start_token_id"])


def _moe_metadata(w: gguf.GGUFWriter, arch: str, c: dict) -> None:
    """TextModel's keys (sizes, rope, experts, groups, YaRN) and each MoE converter's own."""
    rope = c.get("rope_parameters") or {}
    w.add_context_length(c["max_position_embeddings"])
    w.add_feed_forward_length(c["intermediate_size"])
    kv = 1 if arch == "deepseek2" else c["num_key_value_heads"]  # deepseek2: MLA written as MQA
    w.add_head_count_kv(kv)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_layer_norm_rms_eps(1e-5 if arch == "olmoe" else c["rms_norm_eps"])
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts")
    w.add_expert_count(experts)
    w.add_expert_used_count(c["num_experts_per_tok"])
    if c.get("n_group") is not None:
        w.add_expert_group_count(c["n_group"])
    if c.get("topk_group") is not None:
        w.add_expert_group_used_count(c["topk_group"])
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rope["factor"])
        w.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast), ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if rope.get(key) is not None:
                add(rope[key])
    if c.get("head_dim") is not None and arch != "deepseek2":
        w.add_key_length(c["head_dim"])
        w.add_value_length(c["head_dim"])
    if arch in ("qwen2moe", "qwen3moe"):
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        if arch == "qwen2moe":
            w.add_expert_shared_feed_forward_length(c["shared_expert_intermediate_size"])
    elif arch == "gpt-oss":
        w.add_sliding_window(c["sliding_window"])
        w.add_expert_feed_forward_length(c["intermediate_size"])
    elif arch == "deepseek2":
        kv_rank, rot = c["kv_lora_rank"], c["qk_rope_head_dim"]
        w.add_leading_dense_block_count(c["first_k_dense_replace"])
        w.add_vocab_size(c["vocab_size"])
        if c.get("q_lora_rank") is not None:
            w.add_q_lora_rank(c["q_lora_rank"])
        w.add_kv_lora_rank(kv_rank)
        w.add_key_length(kv_rank + rot)
        w.add_value_length(kv_rank)
        w.add_key_length_mla(c["qk_nope_head_dim"] + rot)
        w.add_value_length_mla(c["v_head_dim"])
        w.add_expert_feed_forward_length(c["moe_intermediate_size"])
        w.add_expert_shared_count(c["n_shared_experts"])
        w.add_expert_weights_scale(c["routed_scaling_factor"])
        if c["model_type"] == "deepseek_v3":  # a hub config's scoring_func sigmoid (transformers' config keeps none)
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            if c.get("norm_topk_prob"):
                w.add_expert_weights_norm(True)
        w.add_rope_dimension_count(rot)
        if rope.get("mscale_all_dim") is not None:
            w.add_rope_scaling_yarn_log_mul(0.1 * rope["mscale_all_dim"])


def _first(c: dict, *keys: str):
    """The first of KEYS the config has (the converter's find_hparam)."""
    return next((c[k] for k in keys if c.get(k) is not None), None)


def _position_offset(c: dict) -> int:
    """RoBERTa's converter cuts the position rows before the padding id + 1 off the table (and off
    the context length): llama.cpp counts positions from 0."""
    return c["pad_token_id"] + 1 if c["model_type"] == "roberta" and c.get("pad_token_id") is not None else 0


def _falcon_kv(c: dict) -> int:
    """Key-value heads as the falcon converter counts them: num_kv_heads where the model's layout
    groups by them (the new architecture, or one per head), 1 for multi-query."""
    if c.get("new_decoder_architecture") or not c.get("multi_query", True):
        return c.get("num_kv_heads") or c["num_attention_heads"]
    return 1


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama's converter: each head's two halves of q/k rows interleaved (a weight or a bias)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _ungroup(w: np.ndarray, heads: int, kv: int) -> np.ndarray:
    """Fused q/k/v rows grouped per key-value group (q heads, k, v) to all q, all k, all v."""
    d = w.shape[0] // (heads + 2 * kv)
    g = w.reshape(kv, heads // kv + 2, d, *w.shape[1:])
    q = g[:, :-2].reshape(heads * d, *w.shape[1:])
    k = g[:, -2].reshape(kv * d, *w.shape[1:])
    v = g[:, -1].reshape(kv * d, *w.shape[1:])
    return np.concatenate([q, k, v])


def _converted(arch: str, c: dict, name: str, t: np.ndarray) -> np.ndarray:
    """The tensor NAME as the converter's modify_tensors leaves it."""
    heads = c.get("num_attention_heads") or c.get("n_head")
    if arch == "bert" and name == "embeddings.position_embeddings.weight":
        return t[_position_offset(c):]
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _permute(t, heads)
    if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _permute(t, c["num_key_value_heads"])
    if arch in ("gemma", "gemma2", "gemma3") and name.endswith("norm.weight"):
        return t + 1
    if arch == "gpt2" and name.endswith((".c_attn.weight", ".c_proj.weight", ".c_fc.weight")):
        return t.T
    if arch in ("bloom", "gptneox") and "query_key_value" in name:
        return _ungroup(t, heads, heads)
    if arch == "falcon" and "query_key_value" in name:
        return _ungroup(t, heads, _falcon_kv(c))
    return t


def _saved(model) -> dict:
    """The checkpoint's tensors as save_pretrained writes them (each expert apart, as the hub's
    files hold them), which the converter reads."""
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        return load_file(str(Path(tmp) / "model.safetensors"))


def _merged(state: dict, arch: str, c: dict) -> dict:
    """The tensors as the MoE converters leave them before naming: each layer's experts stacked
    (expert e at index e) under the merged name; gpt-oss's gate and up split from their alternate
    columns and its experts transposed to [E, out, in]; DeepSeek's kv_b split into k_b (each
    head's key rows, transposed) and v_b; the selection bias as e_score_correction.bias; the
    sinks as a weight."""
    out: dict = {}
    for name, t in state.items():
        m = re.match(r"(model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\.(\w+)\.weight$", name)
        if m:
            out.setdefault(f"{m.group(1)}.{m.group(3)}.weight", {})[int(m.group(2))] = t
            continue
        if arch == "gpt-oss" and name.endswith("experts.gate_up_proj"):
            out[name.replace("gate_up_proj", "gate_proj.weight")] = t[:, :, ::2].transpose(1, 2)
            out[name.replace("gate_up_proj", "up_proj.weight")] = t[:, :, 1::2].transpose(1, 2)
        elif arch == "gpt-oss" and name.endswith("experts.gate_up_proj_bias"):
            out[name.replace("gate_up_proj_bias", "gate_proj.bias")] = t[:, ::2]
            out[name.replace("gate_up_proj_bias", "up_proj.bias")] = t[:, 1::2]
        elif arch == "gpt-oss" and name.endswith("experts.down_proj"):
            out[name + ".weight"] = t.transpose(1, 2)
        elif arch == "gpt-oss" and name.endswith("experts.down_proj_bias"):
            out[name.replace("down_proj_bias", "down_proj.bias")] = t
        elif name.endswith(".sinks"):
            out[name + ".weight"] = t
        elif name.endswith("e_score_correction_bias"):
            out[name.replace("e_score_correction_bias", "e_score_correction.bias")] = t
        elif arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            heads, nope, dv = c["num_attention_heads"], c["qk_nope_head_dim"], c["v_head_dim"]
            kv_b = t.reshape(heads, nope + dv, t.shape[-1])
            out[name.replace("kv_b_proj", "k_b_proj")] = kv_b[:, :nope].transpose(1, 2)
            out[name.replace("kv_b_proj", "v_b_proj")] = kv_b[:, nope:]
        else:
            out[name] = t
    return {name: (torch.stack([t[e] for e in sorted(t)]) if isinstance(t, dict) else t) for name, t in out.items()}


def _hf_tensors(model, arch: str, c: dict, head_copy: bool):
    """(name, tensor) as the converter reads them from the saved checkpoint, named as its
    filter_tensors leaves them: a tied head is not in the checkpoint (save_pretrained drops it;
    HEAD_COPY: a T5 checkpoint that holds its tied head as a tensor, as older ones do);
    BERT's prefixes, pooler, MLM heads and position ids are dropped; T5's first embedding table is
    kept (as shared.weight), its copies are not."""
    state = model.state_dict()
    if arch in MOE_ARCHS or c["model_type"] == "mixtral":
        state = _merged(_saved(model), arch, c)
    tied = c.get("tie_word_embeddings", True)
    if arch == "t5":  # transformers' T5 config always says tied; the checkpoint holds lm_head where it is not
        tied = model.lm_head.weight.data_ptr() == model.shared.weight.data_ptr() and not head_copy
    for name, t in state.items():
        if name == "lm_head.weight" and (tied or arch in ("gemma", "gemma2")):
            continue  # save_pretrained drops a tied head; Gemma's converters skip lm_head
        if name.endswith((".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "position_ids", "token_type_ids")):
            continue
        if arch == "bloom":
            name = name.removeprefix("transformer.")  # the bloom converter drops it before naming
        if arch == "bert":
            name = name.removeprefix("bert.").removeprefix("roberta.").removeprefix("distilbert.")
            if name.startswith(("pooler.", "cls.predictions", "cls.seq_relationship", "vocab_", "lm_head")):
                continue  # "we are only using BERT for embeddings"
            if c["model_type"] == "bert" and name in ("classifier.weight", "classifier.bias"):
                name = name.replace("classifier.", "classifier.out_proj.")  # BertForSequenceClassification's
        if arch == "t5" and name in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight"):
            continue  # shared.weight comes first: the one table written
        yield name, t


def write_gguf(model, path, qtype: str = "F32", pooling: gguf.PoolingType | None = None,
               head_copy: bool = False, name: str | None = None) -> None:
    """MODEL (a transformers model) as llama.cpp's converter writes it, 2-D tensors (and stacked
    experts) in QTYPE (F32, or Q8_0 or Q4_0 or Q4_1 (matrices only), where a row is whole blocks of 32; MXFP4: the stacked experts'
    weights alone, as gpt-oss's files hold them); POOLING: the pooling type the BERT converter
    writes for a sentence-transformers folder; HEAD_COPY: T5's tied head written as output.weight;
    NAME: general.name (none where None)."""
    c = model.config.to_dict()
    arch = ARCH[c["model_type"]]
    w = gguf.GGUFWriter(path, arch)
    if name is not None:
        w.add_name(name)
    _metadata(w, arch, c, pooling)
    vocab = c["vocab_size"]
    if arch == "t5":  # the sentencepiece pieces, then [PADi] up to the vocabulary (T5's 100 sentinels among them)
        pieces = max(3, vocab - 100)
        tokens = ["<pad>", "</s>", "<unk>", *(f"t{i}" for i in range(3, pieces)), *(f"[PAD{i}]" for i in range(pieces, vocab))]
        types = [3, 3, 2] + [1] * (pieces - 3) + [5] * (vocab - pieces)
        w.add_tokenizer_model("t5")
    elif arch == "bert":
        tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *(f"t{i}" for i in range(4, vocab))]
        types = [3, 2, 3, 3] + [1] * (vocab - 4)
        w.add_tokenizer_model("bert")
        w.add_token_type_count(c.get("type_vocab_size", 1))
    elif arch in ("gemma", "gemma2", "gemma3"):  # Gemma's special tokens where its vocabulary has them
        tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", *(f"t{i}" for i in range(5, vocab))]
        types = [3, 3, 3, 2, 3] + [1] * (vocab - 5)
        w.add_tokenizer_model("llama")
    else:
        tokens = ["<unk>", "<s>", "</s>", *(f"t{i}" for i in range(3, vocab))]
        types = [2, 3, 3] + [1] * (vocab - 3)
        w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("pad_token_id", w.add_pad_token_id)):
        if isinstance(c.get(key), int):
            add(c[key])
    layers = _first(c, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    names = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, arch.upper().replace("-", "_")), layers)
    for name, t in _hf_tensors(model, arch, c, head_copy):
        t = _converted(arch, c, name, t.float().numpy())
        if arch in MOE_ARCHS:
            t = t.squeeze()  # the converter's squeeze: Qwen2-MoE's shared expert gate [1, D] is written as [D]
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, f"no GGUF name for {name}"
        blocks = t.shape[-1] % 32 == 0 and gguf_name.endswith(".weight")
        quantized = {"Q8_0": blocks and t.ndim in (2, 3), "Q4_0": blocks and t.ndim == 2, "Q4_1": blocks and t.ndim == 2,
                     "MXFP4": blocks and t.ndim == 3 and "_exps" in gguf_name}
        if quantized.get(qtype):
            kind = getattr(gguf.GGMLQuantizationType, qtype)
            w.add_tensor(gguf_name, gguf.quants.quantize(np.ascontiguousarray(t), kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
