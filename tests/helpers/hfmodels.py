"""Small random-weight Hugging Face models of every family `specc import hf` reads, made from
configs (nothing from a hub): the checkpoints the import tests (tests/importers/test_hf_import.py)
and the clients' tests (tests/clients/test_in_clients_env.py) import."""
from __future__ import annotations

import torch
import transformers

SMALL = dict(vocab_size=99, max_position_embeddings=64)
BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, initializer_range=0.2, **SMALL)
S2S = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
           encoder_ffn_dim=37, decoder_ffn_dim=48, init_std=0.5, **SMALL)

# the mixtures of experts' and latent attention's shared sizes
MOE = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, initializer_range=0.5,
           bos_token_id=1, eos_token_id=2, **SMALL)
LATENT = dict(MOE, num_hidden_layers=3, num_key_value_heads=4, intermediate_size=48, moe_intermediate_size=16,
              qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, kv_lora_rank=16, n_routed_experts=8,
              n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, n_group=4, topk_group=2)

# label -> (model class, config class, config kwargs). Init ranges are raised from HF's 0.02: tiny
# random models at 0.02 repeat one token, and their next-token margins are small
CASES = {
    "bert-model": ("BertModel", "BertConfig", BERT),
    "bert-mlm": ("BertForMaskedLM", "BertConfig", dict(BERT, hidden_act="gelu_new")),
    "bert-classifier": ("BertForSequenceClassification", "BertConfig", dict(BERT, num_labels=3)),
    # RoBERTa: BERT's layers; positions from the padding id 1 + 1, one token type
    "roberta-model": ("RobertaModel", "RobertaConfig", dict(BERT, pad_token_id=1, type_vocab_size=1,
                                                            max_position_embeddings=66)),
    "roberta-mlm": ("RobertaForMaskedLM", "RobertaConfig", dict(BERT, pad_token_id=1, type_vocab_size=1,
                                                                max_position_embeddings=66)),
    # ELECTRA (the discriminator's body) with embeddings as wide as its layers
    "electra-model": ("ElectraModel", "ElectraConfig", dict(BERT, embedding_size=32)),
    # DistilBERT: BERT's layers under other names, no token types
    "distilbert-model": ("DistilBertModel", "DistilBertConfig", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                                                      initializer_range=0.2, **SMALL)),
    "distilbert-mlm": ("DistilBertForMaskedLM", "DistilBertConfig", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                                                          initializer_range=0.2, **SMALL)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   bos_token_id=98, eos_token_id=98, initializer_range=0.5)),
    "llama-gqa": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, intermediate_size=48, rope_theta=500.0,
                                                           initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    "llama-tied": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                            intermediate_size=48, tie_word_embeddings=True, initializer_range=0.2,
                                                            bos_token_id=1, eos_token_id=2, **SMALL)),
    # Mistral: LLaMA's layers; a sliding window of 4 binds on these prompts (5 and 7 tokens, 8 new)
    "mistral": ("MistralForCausalLM", "MistralConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                             num_key_value_heads=2, intermediate_size=48, sliding_window=None,
                                                             initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    "mistral-window": ("MistralForCausalLM", "MistralConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                                    num_key_value_heads=2, intermediate_size=48, sliding_window=4,
                                                                    initializer_range=0.5, bos_token_id=1, eos_token_id=2,
                                                                    **SMALL)),
    # Qwen2: biased q, k, v projections, the output's without
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, intermediate_size=48, initializer_range=0.5,
                                                       bos_token_id=1, eos_token_id=2, **SMALL)),
    # Qwen3: RMSNorm on each head's queries and keys (drawn at random), head_dim wider than hidden / heads
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                                       initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    # Gemma: GeGLU (tanh), the embedding scaled by sqrt(d_model), 1 + weight norms (drawn at random)
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                                       initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                       **SMALL)),
    # Phi-3: q, k, v in one projection (GQA: uneven parts), gate and up in another; a window of 4
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, intermediate_size=48, sliding_window=4,
                                                    initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0,
                                                    **SMALL)),
    # StableLM: LayerNorm, biased q, k, v (the output unbiased), a quarter of each head rotated
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                                num_key_value_heads=2, intermediate_size=48, use_qkv_bias=True,
                                                                initializer_range=0.5, bos_token_id=1, eos_token_id=2,
                                                                **SMALL)),
    # BLOOM: ALiBi (8 heads and 6, not a power of two), LayerNorm on the embeddings, q, k, v per head
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=8, initializer_range=0.5,
                                                       vocab_size=99, bos_token_id=1, eos_token_id=2, pad_token_id=3)),
    "bloom-6": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=36, n_layer=2, n_head=6, initializer_range=0.5,
                                                         vocab_size=99, bos_token_id=1, eos_token_id=2, pad_token_id=3)),
    # GPT-NeoX: attention and feed-forward side by side (two norms), q, k, v per head, a quarter rotated;
    # and its sequential form
    "gpt-neox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                              intermediate_size=48, initializer_range=0.5,
                                                              bos_token_id=1, eos_token_id=2, **SMALL)),
    "gpt-neox-sequential": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(hidden_size=32, num_hidden_layers=2,
                                                                         num_attention_heads=4, intermediate_size=48,
                                                                         use_parallel_residual=False, initializer_range=0.5,
                                                                         bos_token_id=1, eos_token_id=2, **SMALL)),
    # GPT-J: attention and feed-forward side by side from one norm, half of each head rotated in
    # interleaved pairs, a biased lm head
    "gptj": ("GPTJForCausalLM", "GPTJConfig", dict(n_embd=32, n_layer=2, n_head=4, rotary_dim=4, initializer_range=0.5,
                                                    vocab_size=99, n_positions=64, bos_token_id=1, eos_token_id=2)),
    # Falcon: the new architecture (2 key-value groups, two norms side by side), Falcon-7B's form
    # (multi-query, one norm side by side) and the sequential form (every head its own keys, biases)
    "falcon-new": ("FalconForCausalLM", "FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                              num_kv_heads=2, new_decoder_architecture=True,
                                                              initializer_range=0.5, vocab_size=99, bos_token_id=1,
                                                              eos_token_id=2, max_position_embeddings=64)),
    "falcon-7b-form": ("FalconForCausalLM", "FalconConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                                  initializer_range=0.5, vocab_size=99, bos_token_id=1,
                                                                  eos_token_id=2, max_position_embeddings=64)),
    "falcon-sequential": ("FalconForCausalLM", "FalconConfig", dict(hidden_size=32, num_hidden_layers=2,
                                                                     num_attention_heads=4, multi_query=False,
                                                                     parallel_attn=False, bias=True, initializer_range=0.5,
                                                                     vocab_size=99, bos_token_id=1, eos_token_id=2,
                                                                     max_position_embeddings=64)),
    "stablelm-parallel": ("StableLmForCausalLM", "StableLmConfig", dict(hidden_size=32, num_hidden_layers=2,
                                                                         num_attention_heads=4, num_key_value_heads=4,
                                                                         intermediate_size=48, use_parallel_residual=True, initializer_range=0.5,
                                                                         bos_token_id=1, eos_token_id=2, **SMALL)),
    # OLMo 2: each sublayer's output normalised, RMSNorm over all heads' queries and keys
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, intermediate_size=48, initializer_range=0.5,
                                                       bos_token_id=1, eos_token_id=2, pad_token_id=0, **SMALL)),
    # Gemma 2: sandwich norms, a window of 4 in layers 0 and 2 (1 and 3 global), scores and logits
    # soft-capped where the caps bind, query_pre_attn_scalar other than head_dim
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                                                          num_key_value_heads=2, head_dim=16, intermediate_size=48,
                                                          sliding_window=4, query_pre_attn_scalar=24,
                                                          attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                                                          initializer_range=0.5, bos_token_id=1, eos_token_id=2,
                                                          pad_token_id=0, **SMALL)),
    # Gemma 3: QK-norm, global layers (here 2 of 4) with a rotary base of their own; untied (its
    # tied head repeats one token at this size)
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        tie_word_embeddings=False, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        intermediate_size=48, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SMALL)),
    # rotary scaling, with small original lengths so that it binds on these prompts: linear
    # (position interpolation), Llama 3.1's (wavelengths on both sides of 8 and 2), YaRN (Qwen2.5's
    # form; GPT-NeoX's a quarter of each head rotated), Phi-3's LongRoPE (the prompts pass its
    # original length 4: the long factors, and the attention factor of 64 / 4), Gemma 3's linear
    # scaling of its global layers alone
    "llama-linear": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        rope_parameters={"rope_type": "linear", "factor": 4.0, "rope_theta": 500.0},
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    "llama3-scaled": ("LlamaForCausalLM", "LlamaConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8, "rope_theta": 500.0},
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    "qwen2-yarn": ("Qwen2ForCausalLM", "Qwen2Config", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16,
                         "rope_theta": 10000.0},
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    "gpt-neox-yarn": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, rotary_pct=0.5,
        rope_parameters={"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8,
                         "beta_fast": 4.0, "rope_theta": 100.0},
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    "phi3-longrope": ("Phi3ForCausalLM", "Phi3Config", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
        original_max_position_embeddings=4, sliding_window=None,
        rope_parameters={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6],
                         "long_factor": [1.5, 3.0, 6.0, 12.0], "rope_theta": 10000.0},
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SMALL)),
    "gemma3-scaled": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        tie_word_embeddings=False, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, intermediate_size=48, sliding_window=4, query_pre_attn_scalar=16,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}},
        initializer_range=0.5, bos_token_id=1, eos_token_id=2, pad_token_id=0, **SMALL)),
    # mixtures of experts: 4 to 8 experts of which 2 or 3 a token, routers drawn wide (the
    # choice varies from token to token); Mixtral's softmax router renormalised
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(MOE, intermediate_size=24, num_local_experts=4,
                                                             num_experts_per_tok=2)),
    # Qwen2-MoE: biased q, k, v, a gated shared expert, layer 1 dense (mlp_only_layers)
    "qwen2-moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        MOE, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=8, num_experts_per_tok=3, mlp_only_layers=[1])),
    # the same with a window of 4 in layer 0 (use_sliding_window: the even layers below max_window_layers)
    "qwen2-moe-window": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        MOE, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=16, shared_expert_intermediate_size=24,
        num_experts=8, num_experts_per_tok=3, use_sliding_window=True, sliding_window=4, max_window_layers=2)),
    # Qwen3-MoE: QK-norm, head_dim wider than hidden / heads, the chosen weights renormalised
    "qwen3-moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        MOE, head_dim=16, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    # OLMoE: QK-norm over all heads, the chosen probabilities as they are
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(MOE, intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                                       pad_token_id=0)),
    # GraniteMoE: top-k logits then their softmax, scores scaled by attention_multiplier, logits
    # divided by logits_scaling
    "granitemoe": ("GraniteMoeForCausalLM", "GraniteMoeConfig", dict(
        MOE, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2, attention_multiplier=0.2,
        logits_scaling=2.0)),
    # PhiMoE: LayerNorm, biased attention and lm head, the sparsemixer router (jitter 0.2 binds)
    "phimoe": ("PhimoeForCausalLM", "PhimoeConfig", dict(
        MOE, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2, attention_bias=True,
        lm_head_bias=True, router_jitter_noise=0.2)),
    # PhiMoE's LongRoPE as transformers computes it (the short factors, one scale)
    "phimoe-longrope": ("PhimoeForCausalLM", "PhimoeConfig", dict(
        MOE, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2, attention_bias=True,
        rope_parameters={"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.5, 3.0, 6.0, 12.0],
                         "short_mscale": 1.2, "long_mscale": 1.2, "original_max_position_embeddings": 4,
                         "rope_theta": 10000.0})),
    # gpt-oss: sinks, windows of 4 in layers 0 and 2, YaRN untruncated, clamped SwiGLU experts
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        MOE, num_hidden_layers=3, head_dim=16, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4)),
    # DeepSeek-V2-Lite's form: queries projected directly, group-limited softmax routing x 1.5, YaRN
    # with mscale_all_dim (the softmax scale times mscale^2), two shared experts, layer 0 dense
    "deepseek-v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        LATENT, q_lora_rank=None, routed_scaling_factor=1.5, topk_method="group_limited_greedy",
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 16, "beta_fast": 32.0,
                         "beta_slow": 1.0})),
    # DeepSeek-V3: the queries' low rank, sigmoid routing with the selection bias within 2 of 4
    # groups, renormalised x 2.5, a shared expert, layer 0 dense
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        LATENT, q_lora_rank=24, n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)),
    # OPT: pre-norm (and OPT-350m's post-norm), learned positions from row 2
    "opt": ("OPTForCausalLM", "OPTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                                                init_std=0.5, vocab_size=99, max_position_embeddings=64, pad_token_id=1,
                                                bos_token_id=2, eos_token_id=2, word_embed_proj_dim=32)),
    "opt-post": ("OPTForCausalLM", "OPTConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=48,
                                                     init_std=0.5, vocab_size=99, max_position_embeddings=64, pad_token_id=1,
                                                     bos_token_id=2, eos_token_id=2, word_embed_proj_dim=32,
                                                     do_layer_norm_before=False)),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(S2S, activation_function="gelu")),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", dict(S2S, scale_embedding=True, decoder_start_token_id=2)),
    "marian": ("MarianMTModel", "MarianConfig", dict(S2S, decoder_vocab_size=99, pad_token_id=98, decoder_start_token_id=98,
                                                     eos_token_id=0, scale_embedding=True, activation_function="swish")),
    # T5: bucketed relative positions (4 buckets to a distance of 8: the log buckets bind), unscaled
    # scores, RMSNorm; the original's ReLU and tied, rescaled head, and v1.1's gated GELU
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                          num_heads=4, relative_attention_num_buckets=8,
                                                          relative_attention_max_distance=8, initializer_factor=2.0,
                                                          decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)),
    "t5-gated": ("T5ForConditionalGeneration", "T5Config", dict(vocab_size=99, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                                                                num_heads=4,
                                                                feed_forward_proj="gated-gelu", initializer_factor=1.5,
                                                                decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", dict(S2S, pad_token_id=0, eos_token_id=1,
                                                                         decoder_start_token_id=0)),
}


# families whose biases Hugging Face initialises to zero but checkpoints do not have at zero: drawn
# at random, so that a bias mapped to the wrong projection (or dropped) changes the outputs
def _bias(name: str) -> bool:
    return name.endswith(".bias")


def _norm(name: str) -> bool:
    return "norm" in name


def _sinks(name: str) -> bool:
    return name.endswith(".sinks")


def _selection(name: str) -> bool:
    return name.endswith("e_score_correction_bias")


# Parameters Hugging Face initialises to constants but checkpoints do not have at them, drawn at
# random so that one mapped to the wrong place (or dropped) changes the outputs: label -> passes
# over the parameters, each drawing a parameter by the first of its rules (which, mean, std) that
# picks it. Biases start at zero (Qwen2's q, k, v); Gemma's norm weights at 0 (a gain of 1 + w,
# drawn so that the form is seen). BLOOM, GPT-NeoX, GPT-J and Falcon get norms about a gain of 1
# and small biases (drawn as the others, their heads repeat one token), as OLMo 2's norms (the
# sublayer outputs' scale).
ZERO_MEAN_BIASES = ((_bias, 0.0, 0.5),)
ZERO_MEAN_NORMS = ((_norm, 0.0, 0.5),)
NEAR_ONE = ((_bias, 0.0, 0.1), (_norm, 1.0, 0.3))
DRAWS = {
    "qwen2": (ZERO_MEAN_BIASES,), "stablelm": (ZERO_MEAN_BIASES, ZERO_MEAN_NORMS),
    **{label: (ZERO_MEAN_NORMS,) for label in ("gemma", "gemma2", "gemma3", "gemma3-scaled", "qwen3", "stablelm-parallel")},
    "olmo2": (((_norm, 1.0, 0.3),),),
    # the experts' families: their norms about 1, biases, sinks and DeepSeek-V3's selection bias
    **{label: (((_bias, 0.0, 0.3), (_norm, 1.0, 0.3), (_sinks, 0.0, 1.0), (_selection, 0.0, 0.2)),)
       for label in ("mixtral", "qwen2-moe", "qwen2-moe-window", "qwen3-moe", "olmoe", "granitemoe", "phimoe",
                     "phimoe-longrope", "gpt-oss", "deepseek-v2", "deepseek-v3")},
    **{label: (NEAR_ONE,) for label in ("bloom", "bloom-6", "gpt-neox", "gpt-neox-sequential", "gpt-neox-yarn", "gptj",
                                        "falcon-new",
                                        "falcon-7b-form", "falcon-sequential")},
}


# the seed a case is drawn from where not 0: seed 0's Qwen2-MoE with a window has a logit 1.02e-4
# from onnxruntime's (fp32 sums in another order; 2e-5 in torch), past the tests' 1e-4
SEEDS = {"qwen2-moe-window": 1}


def hf_model(label: str, seed: int | None = None, **changes):
    """CASES[label]'s model (its config with CHANGES), made at random from SEED (SEEDS', else 0),
    its DRAWS drawn."""
    model_cls, cfg_cls, kwargs = CASES[label]
    torch.manual_seed(SEEDS.get(label, 0) if seed is None else seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**kwargs, **changes}))
    with torch.no_grad():
        for rules in DRAWS.get(label, ()):
            # DeepSeek-V3's selection bias is a buffer (the only one drawn)
            for name, p in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if _selection(n))]:
                rule = next(((mean, std) for picks, mean, std in rules if picks(name)), None)
                if rule is not None:
                    p.normal_(*rule)
    return model.eval()
