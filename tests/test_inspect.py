"""`specc inspect`: counts agree exactly with reference implementations (Hugging Face's models,
built on the meta device: no weights allocated, nothing downloaded)."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from specc.cli import main
from specc.spec.costs import inspect_spec
from specc.spec import load_spec, resolve

transformers = pytest.importorskip("transformers")


def _hf_count(model_cls, config) -> int:
    import torch

    with torch.device("meta"):
        model = model_cls(config)
    return sum(p.numel() for p in model.parameters())  # tied parameters appear once


def test_gpt2_small_matches_hugging_face():
    ours = inspect_spec(resolve(load_spec("gpt2-small")))["parameters"]
    assert ours == 124_439_808
    assert ours == _hf_count(transformers.GPT2LMHeadModel, transformers.GPT2Config())


def test_gpt2_medium_matches_hugging_face():
    cfg = transformers.GPT2Config(n_embd=1024, n_layer=24, n_head=16)
    assert inspect_spec(resolve(load_spec("gpt2-medium")))["parameters"] == _hf_count(transformers.GPT2LMHeadModel, cfg)


def test_bert_base_with_pooler_matches_hugging_face():
    ours = inspect_spec(resolve(load_spec("bert-base")))["parameters"]
    assert ours == 109_482_240
    assert ours == _hf_count(transformers.BertModel, transformers.BertConfig())


# the published sizes of the models whose shapes the catalog copies
@pytest.mark.parametrize("name,published", [("llama-style-1b", None), ("open-llama-3b", None), ("llama-2-7b", 6_738_415_616),
                                            ("llama-3-8b", 8_030_261_248)])
def test_llama_family_matches_hugging_face(name, published):
    r = resolve(load_spec(name))
    att = r.decoder.layers[0].attention
    cfg = transformers.LlamaConfig(
        vocab_size=r.vocab.size, hidden_size=r.d_model, intermediate_size=r.decoder.layers[0].ffn.d_ff,
        num_hidden_layers=len(r.decoder.layers), num_attention_heads=att.heads, num_key_value_heads=att.kv_heads,
        tie_word_embeddings=r.tie_output,
    )
    ours = inspect_spec(r)["parameters"]
    assert ours == _hf_count(transformers.LlamaForCausalLM, cfg)
    assert published is None or ours == published


# today's shapes in the catalog, each against its family's Hugging Face model at the config its
# spec cites (published sizes where the model card gives one exactly)
TODAY = {
    "qwen3-0.6b": ("Qwen3ForCausalLM", "Qwen3Config", dict(
        hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
        intermediate_size=3072, vocab_size=151936, tie_word_embeddings=True), None),
    "mistral-7b": ("MistralForCausalLM", "MistralConfig", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=32000), 7_241_732_096),
    "phi-3-mini": ("Phi3ForCausalLM", "Phi3Config", dict(
        hidden_size=3072, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192,
        vocab_size=32064), 3_821_079_552),
    "gemma-3-1b": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        hidden_size=1152, num_hidden_layers=26, num_attention_heads=4, num_key_value_heads=1, head_dim=256,
        intermediate_size=6912, vocab_size=262144), None),
    "gemma-2-9b": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        hidden_size=3584, num_hidden_layers=42, num_attention_heads=16, num_key_value_heads=8, head_dim=256,
        intermediate_size=14336, vocab_size=256000, max_position_embeddings=8192, sliding_window=4096,
        query_pre_attn_scalar=256, attn_logit_softcapping=50.0, final_logit_softcapping=30.0, rope_theta=10000.0,
        rms_norm_eps=1e-6, hidden_activation="gelu_pytorch_tanh", bos_token_id=2, eos_token_id=1, pad_token_id=0), None),
    "llama-3.1-8b": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        vocab_size=128256, max_position_embeddings=131072, tie_word_embeddings=False,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_theta": 500000.0}), 8_030_261_248),
    "gpt-j-6b": ("GPTJForCausalLM", "GPTJConfig", dict(
        n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, vocab_size=50400, n_positions=2048), None),
}


@pytest.mark.parametrize("name", list(TODAY))
def test_todays_shapes_match_hugging_face(name):
    model_cls, cfg_cls, kwargs, published = TODAY[name]
    ours = inspect_spec(resolve(load_spec(name)))["parameters"]
    assert ours == _hf_count(getattr(transformers, model_cls), getattr(transformers, cfg_cls)(**kwargs))
    assert published is None or ours == published


def test_the_catalogs_gemma_2_9b_is_what_the_importer_makes_of_the_config_it_cites():
    """Every layer (local and global in turn, soft-capping, scale), the head, the vocabulary, the
    norms and the positions, against `specc import hf`'s reading of transformers' own config."""
    from specc.importers.hf.convert import config_to_spec
    from specc.spec.schema import ModelSpec

    model_cls, cfg_cls, kwargs, _ = TODAY["gemma-2-9b"]
    config = {**getattr(transformers, cfg_cls)(**kwargs).to_dict(), "architectures": [model_cls]}
    imported = resolve(ModelSpec.model_validate(config_to_spec(config, dict.fromkeys(map(str, range(64))), "gemma-2-9b")))
    ours = resolve(load_spec("gemma-2-9b"))
    assert imported.decoder.layers == ours.decoder.layers
    assert (imported.outputs, imported.vocab, imported.norm, imported.position) == (ours.outputs, ours.vocab, ours.norm, ours.position)
    assert [layer.attention.pattern.kind for layer in ours.decoder.layers[:3]] == ["local", "full", "local"]


def test_breakdown_sums_to_total_and_names_sharing():
    facts = inspect_spec(resolve(load_spec("transformer-base")))
    assert sum(facts["parameters_by_component"].values()) == facts["parameters"]
    assert any("counted once" in s for s in facts["shared"])
    # Vaswani et al. Table 3 reports 65M for the base model
    assert 60e6 < facts["parameters"] < 66e6


def test_flops_and_cache_follow_the_formulas():
    r = resolve(load_spec("gpt2-small"))
    short, long = inspect_spec(r, 128), inspect_spec(r, 1024)
    d, layers, heads = 768, 12, 12
    # the quadratic term: 2 * H * (Dk + Dv) per key per layer
    assert long["flops_per_token"] - short["flops_per_token"] == layers * 2 * heads * (64 + 64) * (1024 - 128)
    # 2 * weights that each token passes through (no embeddings) + the tied head
    non_embedding = short["parameters"] - 50257 * d - 1024 * d
    matmul = layers * (4 * d * d + 2 * d * 3072)
    assert short["flops_per_token"] == 2 * matmul + 2 * d * 50257 + layers * 2 * heads * 128 * 128
    assert non_embedding > matmul
    assert short["kv_cache_bytes_per_token"] == layers * 2 * d * 4
    assert long["kv_cache_bytes_at_length"] == 1024 * long["kv_cache_bytes_per_token"]  # no window: all of it
    assert short["weight_bytes"]["fp16"] == 2 * short["parameters"]


def test_window_caches_cap_the_cache_of_a_long_sequence():
    """Mistral 7B (int4: an fp32 cache) keeps the last 4095 positions in each of its 32 layers;
    Gemma 3 1B's 22 sliding layers keep 511 and its 4 global layers everything."""
    mistral = inspect_spec(resolve(load_spec("mistral-7b")), 4096)
    per_layer = 8 * (128 + 128) * 4
    assert mistral["kv_cache_bytes_per_token"] == 32 * per_layer
    assert mistral["kv_cache_bytes_at_length"] == 32 * per_layer * 4095
    gemma = inspect_spec(resolve(load_spec("gemma-3-1b")), 4096)
    per_layer = gemma["kv_cache_bytes_per_token"] // 26
    assert gemma["kv_cache_bytes_at_length"] == per_layer * (22 * 511 + 4 * 4096)


def test_cli_inspect_json_and_table():
    runner = CliRunner()
    res = runner.invoke(main, ["inspect", "tiny-llama", "--json", "--length", "64"])
    assert res.exit_code == 0, res.output
    facts = json.loads(res.output)
    for key in ("parameters", "parameters_by_component", "flops_per_token", "kv_cache_bytes_per_token", "weight_bytes", "layers"):
        assert key in facts
    assert facts["length"] == 64 and len(facts["layers"]) == 2
    res = runner.invoke(main, ["inspect", "tiny-llama"])
    assert res.exit_code == 0 and "parameters" in res.output and "decoder.0" in res.output


def test_inspect_is_linear_in_the_number_of_layers(tmp_path):
    """A deep stack's facts: the per-layer parameters and FLOPs are those of one layer times the
    depth, and 8x the layers takes far less than the 64x a quadratic count would (the red-team
    report: 1000 layers took 4.3 s, 2000 about 15). A ratio of two runs side by side, not a
    duration: a loaded machine slows both. Each the best of three, with the collector held off
    (a suite's worker once took 3.1 s over one run of 2000 layers that takes 0.1 alone, 216x
    the 250-layer run beside it)."""
    import gc
    import time

    def facts(layers: int):
        path = tmp_path / f"deep{layers}.yaml"
        path.write_text(f"specc: 1\nname: deep\nextends: tiny-gpt2\ndecoder: {{layers: {layers}}}\n")
        r = resolve(load_spec(path))
        times = []
        gc.collect()
        gc.disable()
        try:
            for _ in range(3):
                t0 = time.perf_counter()
                out = inspect_spec(r)
                times.append(time.perf_counter() - t0)
        finally:
            gc.enable()
        return out, min(times)

    small, t_small = facts(250)
    big, t_big = facts(2000)
    assert len(big["layers"]) == 2000
    assert big["layers"][-1]["parameters"] == small["layers"][0]["parameters"]
    assert big["flops_per_token"] - small["flops_per_token"] == 1750 * small["layers"][0]["flops_per_token"]
    assert t_big < 20 * max(t_small, 1e-3)  # linear: about 8x; a quadratic count: 64x (no wall-clock bound)


# the mixtures of experts in the catalog, each against its family's Hugging Face model at the config
# its spec cites, and their active parameters against the model cards' figures
MOE = {
    "mixtral-8x7b": ("MixtralForCausalLM", "MixtralConfig", dict(
        hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, vocab_size=32000, rope_theta=1e6, tie_word_embeddings=False)),
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        intermediate_size=6144, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], vocab_size=151936, tie_word_embeddings=False)),
    "gpt-oss-20b": ("GptOssForCausalLM", "GptOssConfig", dict(
        hidden_size=2880, num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
        intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088, sliding_window=128,
        tie_word_embeddings=False)),
}


@pytest.mark.parametrize("name", list(MOE))
def test_mixtures_of_experts_match_hugging_face(name):
    model_cls, cfg_cls, kwargs = MOE[name]
    facts = inspect_spec(resolve(load_spec(name)))
    assert facts["parameters"] == _hf_count(getattr(transformers, model_cls), getattr(transformers, cfg_cls)(**kwargs))
    assert sum(facts["parameters_by_component"].values()) == facts["parameters"]


def test_active_parameters_are_what_one_token_reads():
    """Every parameter but the routed experts a token's router does not choose: Mixtral 8x7B's
    46.7B and 12.9B (Jiang et al. 2024, section 2), Qwen3-30B-A3B's 30.5B and 3.3B (its model card),
    gpt-oss-20b's 20.91B and, leaving out the input embedding as its model card does, 3.61B
    (arXiv:2508.10925, Table 1). A dense model has them all active."""
    mixtral = inspect_spec(resolve(load_spec("mixtral-8x7b")))
    experts = mixtral["parameters_by_component"]["decoder.experts"]
    assert experts == 32 * 8 * 3 * 4096 * 14336
    assert mixtral["active_parameters"] == mixtral["parameters"] - experts // 8 * 6
    assert (round(mixtral["parameters"] / 1e8), round(mixtral["active_parameters"] / 1e8)) == (467, 129)
    qwen = inspect_spec(resolve(load_spec("qwen3-30b-a3b")))
    assert (round(qwen["parameters"] / 1e8), int(qwen["active_parameters"] / 1e8)) == (305, 33)
    oss = inspect_spec(resolve(load_spec("gpt-oss-20b")))
    assert round(oss["parameters"] / 1e7) == 2091
    assert round((oss["active_parameters"] - oss["parameters_by_component"]["embeddings"]) / 1e7) == 361
    assert [layer["active_parameters"] for layer in oss["layers"]][:2] == [oss["layers"][0]["active_parameters"]] * 2
    dense = inspect_spec(resolve(load_spec("mistral-7b")))
    assert dense["active_parameters"] == dense["parameters"]


def test_flops_of_a_mixture_follow_the_chosen_experts():
    """2 x the matrices a token passes through: the router's and its top_k experts', not all of
    them; the rest of the layer as a dense one's."""
    r = resolve(load_spec("mixtral-8x7b"))
    d, f, n = 4096, 14336, 128
    layer = inspect_spec(r, n)["layers"][0]
    attention = 2 * (4096 * 4096 * 2 + 4096 * 1024 * 2) + 2 * 32 * (128 + 128) * n
    assert layer["flops_per_token"] == attention + 2 * d * 8 + 2 * 2 * 3 * d * f
    assert (layer["experts"], layer["top_k"], layer["d_ff"]) == (8, 2, f)


def test_latent_attention_caches_its_latent_and_counts_its_projections(tmp_path):
    """DeepSeek-V3's attention shape (arXiv:2412.19437, section 4.2: 128 heads, q rank 1536, kv
    rank 512, 128 + 64 query / key dims, 128 value dims): a cache of 512 + 64 values per token and
    layer, not 128 x (192 + 128); its projections counted as transformers' DeepseekV3Attention holds them."""
    path = tmp_path / "mla.yaml"
    path.write_text("""\
specc: 1
name: mla
architecture: decoder
d_model: 7168
vocab: {size: 1000}
position: {kind: rotary, layout: interleaved}
norm: {kind: rmsnorm, placement: pre}
decoder:
  layers: 1
  attention: {kind: latent, heads: 128, d_k: 192, d_v: 128, rope_dims: 64, q_rank: 1536, kv_rank: 512}
  ffn: {d_ff: 64, activation: swiglu, bias: false}
serving: {precision: fp16}
""")
    facts = inspect_spec(resolve(load_spec(path)))
    assert facts["kv_cache_bytes_per_token"] == (512 + 64) * 2
    cfg = transformers.DeepseekV3Config(hidden_size=7168, num_attention_heads=128, q_lora_rank=1536, kv_lora_rank=512,
                                        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    with torch.device("meta"):
        hf = DeepseekV3Attention(cfg, 0)
    assert facts["parameters_by_component"]["decoder.attention"] == sum(p.numel() for p in hf.parameters())
