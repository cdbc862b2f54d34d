"""`specc import gguf`: small random-weight models of every architecture specc reads from GGUF,
written as llama.cpp's converter writes them (tests/helpers/ggufwrite.py: its names, metadata and tensor
changes; fp32 or Q8_0 blocks), imported and run. An fp32 file gives the Hugging Face model's
logits (BERT: its last hidden state, pooled embedding or classifier logits) within 1e-4 and its
greedy tokens; where transformers' own GGUF loading reads the architecture, the same file loaded by
transformers gives the same logits and tokens too (for a Q8_0 file, that is the reference: the
blocks are not the model's weights; for a BERT Q8_0 file, which transformers does not read, the
Hugging Face model with its weights put through gguf's own Q8_0 round trip is).

make test runs what an import decides (the spec and the weights) in specc's torch module, and
builds and runs in onnxruntime instead one file of each kind (a decoder at fp32 and Q8_0, a BERT,
a T5); make test-slow builds every other file: a build holds its graphs to that torch module
(verification), and each architecture's graphs are held to Hugging Face's model by
tests/importers/test_hf_import.py."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import specc
from specc.cli import main as cli
from specc.importers.gguf import import_gguf
from specc.importers.hf import CheckpointError
from specc.runtime import Session

transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf", reason="the gguf package (make install-real-models)")

from tests.helpers.ggufwrite import write_gguf  # noqa: E402
from tests.helpers.torchside import ONNX, TorchModel, paths  # noqa: E402

PROMPT = [5, 7, 9, 11, 3]
SMALL = dict(vocab_size=99, max_position_embeddings=64, initializer_range=0.5, bos_token_id=1, eos_token_id=2)
DEC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
           **SMALL)

# label -> (model class, config class, config kwargs, draws, transformers' GGUF loading reads it).
# Draws: parameters Hugging Face starts at constants (biases at 0, norms at 1 or 0) drawn at
# random, so that one mapped wrongly, or a change of the converter's left in place, shows.
# transformers' GGUF loading (5.24) reads fewer keys than llama.cpp writes: a case it is compared
# with keeps its defaults where it does not read the key (Gemma's query_pre_attn_scalar 256 and
# soft-caps 50 / 30, StableLM's quarter rotated, Phi-3 without a window).
BIASES = ("bias", 0.0, 0.5)
NORMS_0 = ("norm", 0.0, 0.5)
NORMS_1 = ("norm", 1.0, 0.3)
SMALL_BIASES = ("bias", 0.0, 0.1)
# Gemma 2's sublayer outputs normalised with gains about 5: at 1 its tied head repeats one token
POST_NORMS = ("post", 4.0, 1.0)
SINKS = ("sinks", 0.0, 1.0)
SELECTION = ("e_score_correction_bias", 0.0, 0.2)  # DeepSeek-V3's selection bias (a buffer)
LATENT = dict(SMALL, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
              intermediate_size=48, moe_intermediate_size=16, qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10,
              kv_lora_rank=16, n_routed_experts=8, n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1)
CASES = {
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(DEC, rope_theta=500.0), (), True),
    # q and k biases: permuted by the converter like the weights (transformers reads no attention_bias)
    "llama-bias": ("LlamaForCausalLM", "LlamaConfig", dict(DEC, attention_bias=True), (BIASES,), False),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", DEC, (BIASES,), True),
    # transformers reads no head size for qwen3 (its default 128); this one's is 16
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", dict(DEC, head_dim=16), (NORMS_0,), False),
    "gemma": ("GemmaForCausalLM", "GemmaConfig", dict(DEC, head_dim=16), (NORMS_0,), False),
    # Gemma 2: a window of 4 in layers 0 and 2; the file's caps (2 and 3 bind here); head size 16
    "gemma2-caps": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        DEC, num_hidden_layers=4, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        attn_logit_softcapping=2.0, final_logit_softcapping=3.0), (POST_NORMS, NORMS_0), False),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config", dict(
        DEC, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=256, sliding_window=4),
        (POST_NORMS, NORMS_0), True),
    # Gemma 3: layer 5 of 6 global, with its own rotary base (the sliding layers' from freq_base_swa)
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig", dict(
        DEC, tie_word_embeddings=False, num_hidden_layers=6, head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10.0}}), (NORMS_0,), False),
    "phi3": ("Phi3ForCausalLM", "Phi3Config", dict(DEC, sliding_window=4, pad_token_id=0), (), False),
    "phi3-nowindow": ("Phi3ForCausalLM", "Phi3Config", dict(DEC, pad_token_id=0), (), True),
    "stablelm": ("StableLmForCausalLM", "StableLmConfig", dict(DEC, use_qkv_bias=True), (BIASES, NORMS_0), True),
    "stablelm-parallel": ("StableLmForCausalLM", "StableLmConfig", dict(DEC, use_parallel_residual=True),
                          (NORMS_0,), True),
    "gptneox": ("GPTNeoXForCausalLM", "GPTNeoXConfig", dict(DEC, rotary_pct=0.5), (SMALL_BIASES, NORMS_1), False),
    "falcon-7b-form": ("FalconForCausalLM", "FalconConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, **SMALL), (SMALL_BIASES, NORMS_1), True),
    # the new architecture (Falcon-40B's): 2 key-value groups, two norms side by side
    "falcon-new": ("FalconForCausalLM", "FalconConfig", dict(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_kv_heads=2, new_decoder_architecture=True,
        **SMALL), (SMALL_BIASES, NORMS_1), False),
    "bloom": ("BloomForCausalLM", "BloomConfig", dict(hidden_size=32, n_layer=2, n_head=8, initializer_range=0.5,
                                                       vocab_size=99, bos_token_id=1, eos_token_id=2),
              (SMALL_BIASES, NORMS_1), True),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=1024,
                                                   bos_token_id=1, eos_token_id=2, initializer_range=0.5), (), True),
    "olmo2": ("Olmo2ForCausalLM", "Olmo2Config", dict(DEC, pad_token_id=0), (NORMS_1,), False),
    # mixtures of experts and latent attention: each layer's experts stacked by the converter.
    # transformers reads qwen2moe and qwen3moe files told their experts' width (it reads no
    # expert_feed_forward_length, 5.24); a Mixtral file (the llama architecture) as LLaMA, no
    # olmoe, gpt-oss (its own tensor names) or deepseek2 file
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", dict(DEC, intermediate_size=24, num_local_experts=4,
                                                             num_experts_per_tok=2), (NORMS_1,), False),
    "qwen2moe": ("Qwen2MoeForCausalLM", "Qwen2MoeConfig", dict(
        DEC, moe_intermediate_size=16, shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2),
        (BIASES, NORMS_1), {"moe_intermediate_size": 16, "shared_expert_intermediate_size": 24}),
    "qwen3moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", dict(
        DEC, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True), (NORMS_1,),
        {"moe_intermediate_size": 16}),
    "olmoe": ("OlmoeForCausalLM", "OlmoeConfig", dict(DEC, intermediate_size=16, num_experts=8, num_experts_per_tok=2,
                                                       pad_token_id=0), (NORMS_1,), False),
    # gpt-oss: windows of 4 in layers 0 and 2, sinks, YaRN, biased clamped experts
    "gpt-oss": ("GptOssForCausalLM", "GptOssConfig", dict(
        DEC, num_hidden_layers=3, head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
        sliding_window=4), (BIASES, NORMS_1, SINKS), False),
    # DeepSeek-V2-Lite's form (direct queries, greedy softmax routing, YaRN with mscale_all_dim) and
    # V3's (the queries' low rank, sigmoid routing with the selection bias in 2 of 4 groups)
    "deepseek-v2": ("DeepseekV2ForCausalLM", "DeepseekV2Config", dict(
        LATENT, q_lora_rank=None, routed_scaling_factor=1.5,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 0.707,
                         "mscale_all_dim": 0.707, "original_max_position_embeddings": 16}), (NORMS_1,), False),
    "deepseek-v3": ("DeepseekV3ForCausalLM", "DeepseekV3Config", dict(
        LATENT, q_lora_rank=24, n_group=4, topk_group=2, routed_scaling_factor=2.5, n_shared_experts=1),
        (NORMS_1, SELECTION), False),
}
# the seed a case's weights are drawn with, where 0's greedy tokens repeat
SEEDS = {"gemma3": 1, "stablelm-parallel": 1, "falcon-7b-form": 2, "bloom": 4}
# label, file type: fp32 for every case, Q8_0 blocks for some
# Q8_0 blocks are read alike for every architecture: make test keeps llama's, make test-slow the rest
SLOW_Q8 = pytest.mark.slow
# a second form of one architecture (Gemma 2 with its soft caps) runs in make test-slow
SLOW_F32 = ("gemma2-caps",)
RUNS = [(label, "F32") if label not in SLOW_F32 else pytest.param(label, "F32", marks=pytest.mark.slow) for label in CASES] + [
    ("llama", "Q8_0"), ("gpt-oss", "MXFP4")] + [
    pytest.param(label, "Q8_0", marks=SLOW_Q8) for label in ("gemma2", "falcon-7b-form", "gpt2", "qwen2moe", "qwen3moe")]
# the imports built and run in onnxruntime by make test (the others in torch there, built by make test-slow)
BUILT = {("llama", "F32"), ("llama", "Q8_0"), ("bert", "F32"), ("t5-gated", "F32")}


def _paths(runs) -> list:
    return paths(runs, lambda values: values not in BUILT)


class _Built:
    """The imported spec built, and its Session."""

    def __init__(self, spec, out: Path):
        specc.build(spec, out, progress=None)
        self.session = Session(out)

    def run(self, **inputs) -> dict:
        return self.session.run(**inputs)

    def greedy(self, prompt: list[int], new: int) -> list[int]:
        return self.session.generate(prompt, max_new_tokens=new).new_ids[0]


def _model(spec, tmp_path: Path, path: str):
    return _Built(spec, tmp_path / "build") if path == ONNX else TorchModel(spec)


def hf_model(label: str):
    model_cls, cfg_cls, kwargs, draws, _ = CASES[label]
    return _drawn(model_cls, cfg_cls, kwargs, draws, SEEDS.get(label, 0))


def _drawn(model_cls: str, cfg_cls: str, kwargs: dict, draws, seed: int, untie: bool = False):
    """A transformers model with DRAWS drawn at random (UNTIE: T5's head a parameter of its own,
    as FLAN-T5's checkpoints have it; transformers ties it to the table otherwise)."""
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
    if untie:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    with torch.no_grad():
        # DeepSeek-V3's selection bias is a buffer (the only one drawn)
        for name, p in [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if SELECTION[0] in n)]:
            rule = next(((mean, std) for part, mean, std in draws
                         if (name.endswith(".bias") if part == "bias" else part in name)), None)
            if rule is not None:
                p.normal_(*rule)
    return model.eval()


def _logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits.numpy()


def _greedy(model, ids: list[int], new: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False, pad_token_id=0)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("label,qtype,path", _paths(RUNS))
def test_a_gguf_file_imports_to_the_model_it_holds(tmp_path, label, qtype, path):
    model = hf_model(label)
    file = tmp_path / f"tiny-{label}-{qtype}.gguf"
    write_gguf(model, file, qtype)
    spec, _ = import_gguf(file, tmp_path / "m.yaml")
    s = _model(spec, tmp_path, path)
    got = s.run(input_ids=[PROMPT])["logits"]
    refs = [model] if qtype == "F32" else [_mxfp4_round_trip(model)] if qtype == "MXFP4" else []
    reads = CASES[label][4]
    if reads:  # transformers' own reading of the same file (told what it does not read)
        refs.append(transformers.AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=file.name, **(reads if isinstance(reads, dict) else {})).eval())
    assert refs
    new = s.greedy(PROMPT, 8)
    for ref in refs:
        assert np.abs(got - _logits(ref, PROMPT)).max() <= 1e-4
        want = _greedy(ref, PROMPT)
        assert len(set(want)) > 2
        assert new == want


def _mxfp4_round_trip(model):
    """gpt-oss's MODEL with its experts' weights put through gguf's own MXFP4 round trip as the
    file holds them (gate and up apart, each expert [out, in]): what an MXFP4 file's experts are."""
    kind = gguf.GGMLQuantizationType.MXFP4

    def trip(t: torch.Tensor) -> torch.Tensor:  # [E, in, out] as transformers holds it
        rows = np.ascontiguousarray(t.transpose(1, 2).numpy())
        return torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(rows, kind), kind)).transpose(1, 2)

    with torch.no_grad():
        for layer in model.model.layers:
            experts = layer.mlp.experts
            for k in (0, 1):
                experts.gate_up_proj[:, :, k::2] = trip(experts.gate_up_proj[:, :, k::2].contiguous())
            experts.down_proj.copy_(trip(experts.down_proj))
    return model


def test_routed_experts_files_import_as_the_families_spec(tmp_path):
    """What the MoE rows read from the metadata: Qwen3-MoE's renormalised weights (llama.cpp's
    qwen3moe), Qwen2-MoE's gated shared expert, DeepSeek-V3's sigmoid router from its gating
    function and its latent sizes from the _mla keys, gpt-oss's window pattern."""
    specs = {}
    for label in ("qwen3moe", "qwen2moe", "deepseek-v3", "gpt-oss"):
        write_gguf(hf_model(label), tmp_path / f"{label}.gguf")
        specs[label] = specc.resolve(specc.load_spec(import_gguf(tmp_path / f"{label}.gguf", tmp_path / f"{label}.yaml")[0]))
    assert specs["qwen3moe"].decoder.layers[0].ffn.router.normalize is True
    shared = specs["qwen2moe"].decoder.layers[0].ffn.shared
    assert (shared.d_ff, shared.gate) == (24, True)
    v3 = specs["deepseek-v3"].decoder.layers
    assert v3[0].ffn.kind == "dense" and v3[1].ffn.router.kind == "sigmoid" and v3[1].ffn.router.groups == 4
    assert (v3[1].attention.kind, v3[1].attention.d_k, v3[1].attention.d_v, v3[1].attention.q_rank) == ("latent", 20, 10, 24)
    windows = [layer.attention.pattern.kind for layer in specs["gpt-oss"].decoder.layers]
    assert windows == ["local", "full", "local"]


# --- BERT-family encoders and T5 ----------------------------------------------------------------

Pool = gguf.PoolingType
BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, initializer_range=0.2,
            vocab_size=99, max_position_embeddings=64)
ROBERTA = dict(BERT, pad_token_id=1, type_vocab_size=1, max_position_embeddings=66)
LAYER_NORMS = (("LayerNorm", 1.0, 0.3), ("layer_norm", 1.0, 0.3))
# label -> (model class, config class, config kwargs, the pooling type the file names, draws).
# The BERT converter's subclasses write DistilBERT and RoBERTa as bert (RoBERTa's positions cut to
# start at its padding id + 1): each is imported as the BERT it is stored as.
ENCODERS = {
    "bert": ("BertModel", "BertConfig", BERT, Pool.MEAN, (SMALL_BIASES, *LAYER_NORMS)),
    "bert-nopool": ("BertModel", "BertConfig", BERT, None, ()),
    "distilbert": ("DistilBertModel", "DistilBertConfig", dict(dim=32, n_layers=2, n_heads=4, hidden_dim=37,
                                                               initializer_range=0.2, vocab_size=99,
                                                               max_position_embeddings=64), Pool.CLS, LAYER_NORMS),
    "roberta": ("RobertaModel", "RobertaConfig", ROBERTA, Pool.LAST, (SMALL_BIASES, *LAYER_NORMS)),
    # RoBERTa's classification head (dense, tanh, projection on the first token): cls, cls.output
    "roberta-classifier": ("RobertaForSequenceClassification", "RobertaConfig", dict(ROBERTA, num_labels=3), None,
                           (SMALL_BIASES,)),
}
ENCODER_RUNS = [(label, "F32") for label in ENCODERS] + [pytest.param("bert", "Q8_0", marks=SLOW_Q8)]
IDS = [[2, 5, 7, 9, 11, 3, 0], [2, 4, 8, 15, 16, 3, 0]]  # no real token is RoBERTa's padding id 1
TYPES = [[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]]
MASK = [[1] * 7, [1] * 5 + [0, 0]]  # right padding in the second row


def _q8_0_round_trip(model):
    """MODEL with every weight the writer stores as Q8_0 (2-D, rows of whole 32-blocks) quantized
    and dequantized by gguf's own routines: what a Q8_0 file holds."""
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2 and p.shape[1] % 32 == 0:
                q = gguf.quants.quantize(p.numpy(), gguf.GGMLQuantizationType.Q8_0)
                p.copy_(torch.from_numpy(gguf.quants.dequantize(q, gguf.GGMLQuantizationType.Q8_0)))
    return model


@pytest.mark.parametrize("label,qtype,path", _paths(ENCODER_RUNS))
def test_a_bert_family_gguf_file_imports_to_the_encoder_it_holds(tmp_path, label, qtype, path):
    model_cls, cfg_cls, kwargs, pooling, draws = ENCODERS[label]
    model = _drawn(model_cls, cfg_cls, kwargs, draws, 0).eval()
    file = tmp_path / f"tiny-{label}-{qtype}.gguf"
    write_gguf(model, file, qtype, pooling=pooling)
    spec, _ = import_gguf(file, tmp_path / "m.yaml")
    ids, mask = torch.tensor(IDS), torch.tensor(MASK)
    typed = {"token_type_ids": torch.tensor(TYPES)} if model.config.to_dict().get("type_vocab_size", 1) > 1 else {}
    got = _model(spec, tmp_path, path).run(input_ids=ids.numpy(), attention_mask=mask.numpy(),
                                           **{k: v.numpy() for k, v in typed.items()})
    ref = model if qtype == "F32" else _q8_0_round_trip(model)
    with torch.no_grad():
        want = ref(input_ids=ids, attention_mask=mask, output_hidden_states=True, **typed)
    keep = mask.bool()
    hidden = want.hidden_states[-1]
    assert np.abs(got["last_hidden_state"][keep.numpy()] - hidden[keep].numpy()).max() <= 1e-4
    names = {"last_hidden_state"}
    if pooling is not None:  # the embedding llama.cpp gives for the file's pooling type
        last = keep.sum(1) - 1
        pooled = {Pool.MEAN: (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True),
                  Pool.CLS: hidden[:, 0], Pool.LAST: hidden[torch.arange(len(IDS)), last]}[pooling]
        assert np.abs(got["sentence_embedding"] - pooled.numpy()).max() <= 1e-4
        names.add("sentence_embedding")
    if "Classification" in model_cls:
        assert np.abs(got["logits"] - want.logits.numpy()).max() <= 1e-4
        names.add("logits")
    assert set(got) == names  # the converter writes no pooler and no MLM head
    assert not (tmp_path / "m.tokenizer").exists()  # transformers converts no bert tokenizer


T5 = dict(vocab_size=160, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
          decoder_start_token_id=0, eos_token_id=1, pad_token_id=0)
# label -> (config kwargs, seed, untied head, the tied head written as output.weight, draws).
# 8 buckets to llama.cpp's distance of 128 (the file has no key for it; the log buckets bind in the
# decoder by its tenth position)
T5_CASES = {
    # the original T5: ReLU, the head tied to the table (no output.weight), its input scaled
    "t5": (dict(T5, initializer_factor=2.0), 2, False, False, ()),
    # the same with the tied head in the file (an older checkpoint holds it as a tensor)
    "t5-head-copy": (dict(T5, initializer_factor=2.0), 2, False, True, ()),
    # FLAN-T5's form: gated GELU, an untied head not scaled; fewer decoder layers than encoder ones
    # (decoder_block_count; the converter names both stacks' blocks up to block_count)
    "t5-gated": (dict(T5, feed_forward_proj="gated-gelu", initializer_factor=1.5, num_layers=3, num_decoder_layers=2,
                      tie_word_embeddings=False), 0, True, False,
                 (("lm_head", 0.0, 0.5),)),
}
T5_RUNS = [(label, "F32") for label in T5_CASES] + [pytest.param("t5-gated", "Q8_0", marks=SLOW_Q8)]


def _t5_greedy(model, ids: list[int], new: int = 8) -> list[int]:
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=new, do_sample=False)
    return out[0, 1:].tolist()  # after the decoder start token


@pytest.mark.parametrize("label,qtype,path", _paths(T5_RUNS))
def test_a_t5_gguf_file_imports_to_the_model_it_holds(tmp_path, label, qtype, path):
    kwargs, seed, untie, head_copy, draws = T5_CASES[label]
    model = _drawn("T5ForConditionalGeneration", "T5Config", kwargs, draws, seed, untie=untie).eval()
    file = tmp_path / f"tiny-{label}-{qtype}.gguf"
    write_gguf(model, file, qtype, head_copy=head_copy)
    spec, _ = import_gguf(file, tmp_path / "m.yaml")
    assert (tmp_path / "m.tokenizer" / "tokenizer.json").is_file()  # the file's T5 vocabulary, carried
    s = _model(spec, tmp_path, path)
    dec = [0, 5, 6, 7]
    got = s.run(input_ids=[PROMPT], decoder_input_ids=[dec])["logits"]
    refs = [] if qtype != "F32" else [model]
    if untie:  # transformers reads the gated (FLAN-T5) form, told what it does not read (5.24): the
        # gate's activation (it sets is_gated_act, and computes the gate with ReLU where llama.cpp
        # computes GELU (tanh)) and decoder_block_count (it builds block_count decoder layers)
        refs.append(transformers.AutoModelForSeq2SeqLM.from_pretrained(
            tmp_path, gguf_file=file.name, dense_act_fn="gelu_new",
            num_decoder_layers=kwargs["num_decoder_layers"]).eval())
    assert refs
    new = s.greedy(PROMPT, 8)
    for ref in refs:
        with torch.no_grad():
            want = ref(input_ids=torch.tensor([PROMPT]), decoder_input_ids=torch.tensor([dec])).logits.numpy()
        assert np.abs(got - want).max() <= 1e-4
        tokens = _t5_greedy(ref, PROMPT)
        assert len(set(tokens)) > 2
        assert new == tokens


def _file(path, arch: str, keys: dict, tensors: dict | None = None) -> None:
    w = gguf.GGUFWriter(path, arch)
    for key, value in keys.items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, list):
            w.add_array(key, value)
        else:
            w.add_uint32(key, value)
    for name, t in (tensors or {"token_embd.weight": np.zeros((8, 4), np.float32)}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_what_cannot_be_imported_is_refused_naming_it(tmp_path):
    _file(tmp_path / "x.gguf", "mamba", {})
    with pytest.raises(CheckpointError, match="general.architecture 'mamba' has no importer .*; specc import gguf "
                                              "reads bert, bloom, deepseek2, falcon, gemma, gemma2, gemma3, gpt-oss, "
                                              "gpt2, gptneox, llama, olmo2, olmoe, phi3, qwen2, qwen2moe, qwen3, "
                                              "qwen3moe, stablelm, t5$"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "m.yaml")
    _file(tmp_path / "x.gguf", "t5encoder", {})
    with pytest.raises(CheckpointError, match="'t5encoder' has no importer \\(a T5 encoder alone \\(T5EncoderModel\\); "
                                              "specc's t5 family imports T5ForConditionalGeneration\\)"):
        import_gguf(tmp_path / "x.gguf", tmp_path / "m.yaml")
    (tmp_path / "y.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="y.gguf: not a GGUF file"):
        import_gguf(tmp_path / "y.gguf", tmp_path / "m.yaml")
    llama = {"llama.embedding_length": 4, "llama.block_count": 1, "llama.attention.head_count": 1}
    deepseek2 = {"deepseek2.embedding_length": 4, "deepseek2.block_count": 1, "deepseek2.attention.head_count": 1,
                 "deepseek2.feed_forward_length": 8, "deepseek2.attention.layer_norm_rms_epsilon": 1,
                 "deepseek2.rope.dimension_count": 2, "deepseek2.attention.key_length": 4,
                 "deepseek2.attention.value_length": 4, "deepseek2.attention.kv_lora_rank": 4,
                 "deepseek2.expert_count": 4, "deepseek2.expert_used_count": 2,
                 "deepseek2.expert_feed_forward_length": 8}
    bert = {"bert.embedding_length": 4, "bert.block_count": 1, "bert.attention.head_count": 1,
            "bert.feed_forward_length": 8, "bert.attention.layer_norm_epsilon": 1, "bert.context_length": 8}
    for keys, tensors, message in [
        ({**llama, "llama.rope.scaling.type": "yarn"}, None,
         "llama.rope.scaling.type: 'yarn': specc implements plain rotary positions only"),
        ({**llama, "llama.attention.head_count": 0}, None, "llama.attention.head_count: 0: a model has at least one"),
        ({**llama, "llama.attention.head_count_kv": [1, 1]}, None,
         r"llama.attention.head_count_kv is \[1, 1\]; specc reads one number here \(a value per layer"),
        (llama, {"token_embd.weight": np.zeros((8, 4), np.float32), "rope_freqs.weight": np.ones(2, np.float32)},
         "rope_freqs.weight: llama 3's rope scaling"),
        ({"olmo2.attention.sliding_window": 4}, None, "olmo2.attention.sliding_window: sliding windows"),
        ({"stablelm.embedding_length": 4}, {"token_embd.weight": np.zeros((8, 4), np.float32),
                                            "blk.0.attn_q_norm.weight": np.ones((1, 4), np.float32)},
         "blk.0.attn_q_norm.weight: a LayerNorm of its own for each head"),
        ({"gemma3.embedding_length": 4, "gemma3.block_count": 1, "gemma3.attention.head_count": 1,
          "gemma3.feed_forward_length": 8, "gemma3.context_length": 8}, None, "no gemma3.attention.layer_norm_rms_epsilon"),
        ({**bert, "bert.attention.causal": True}, None, "bert.attention.causal: true: a BERT used as a causal decoder"),
        ({**bert, "bert.attention.head_count_kv": 2}, None, "bert.attention.head_count_kv: 2: bert has a key and a value "
                                                           r"head per query head \(1\)"),
        ({**bert, "tokenizer.ggml.padding_token_id": "x"}, None, "tokenizer.ggml.padding_token_id: x: expected a token"),
        ({**bert, "bert.pooling_type": 4}, None, r"bert.pooling_type: 4: rank pooling without a classification head"),
        ({**bert, "bert.pooling_type": 9}, None, "bert.pooling_type: 9: not one of llama.cpp's pooling types specc pools"),
        ({"t5.embedding_length": 4}, {"token_embd.weight": np.zeros((8, 4), np.float32),
                                      "enc.blk.1.attn_rel_b.weight": np.zeros((1, 4), np.float32)},
         r"enc.blk.1.attn_rel_b.weight: a relative-position table in more than the first layer's self-attention \(UMT5\)"),
        # the MoE rows: a rope scaling the row does not read; DeepSeek-V2's softmax router with groups or
        # renormalised weights, where llama.cpp and transformers' DeepSeek-V2 differ
        ({"gpt-oss.rope.scaling.type": "linear"}, None,
         r"gpt-oss.rope.scaling.type: 'linear': specc implements plain rotary positions only \(and yarn for gpt-oss\)"),
        ({**deepseek2, "deepseek2.expert_group_count": 2}, None,
         "deepseek2.expert_group_count: 2 with softmax scores: llama.cpp scores each group by its two best experts"),
        ({**deepseek2, "deepseek2.expert_weights_norm": True}, None,
         "deepseek2.expert_weights_norm: true with softmax scores: transformers' DeepSeek-V2 never renormalises"),
    ]:
        arch = next(iter(keys)).split(".")[0]
        _file(tmp_path / "z.gguf", arch, keys, tensors)
        with pytest.raises(CheckpointError, match=message):
            import_gguf(tmp_path / "z.gguf", tmp_path / "m.yaml")
    assert not list(tmp_path.glob("m.*"))


def test_a_bert_classifier_without_its_pooler_is_refused(tmp_path):
    """BertForSequenceClassification's classifier reads the pooler, which the converter drops:
    its file (cls.output without cls) cannot give the model's logits."""
    model = _drawn("BertForSequenceClassification", "BertConfig", dict(BERT, num_labels=3), (), 0)
    write_gguf(model, tmp_path / "c.gguf")
    with pytest.raises(CheckpointError, match="c.gguf: cls.output.weight: BERT's classifier reads its pooler"):
        import_gguf(tmp_path / "c.gguf", tmp_path / "m.yaml")
    assert not list(tmp_path.glob("m.*"))


def test_cli_import_gguf(tmp_path, capsys):
    path = tmp_path / "tiny.gguf"
    write_gguf(hf_model("llama"), path)
    with pytest.raises(SystemExit) as done:
        cli(["import", "gguf", str(path), "-o", str(tmp_path / "m.yaml"), "--json"])
    assert done.value.code in (0, None)
    assert '"weights"' in capsys.readouterr().out
    with pytest.raises(SystemExit) as done:  # exists: refused without --force
        cli(["import", "gguf", str(path), "-o", str(tmp_path / "m.yaml")])
    assert done.value.code != 0


@pytest.mark.parametrize("general_name,want", [("SmolLM2 135M Instruct", "smollm2-135m-instruct"),
                                               ("  ***  ", "tiny.q8_0"), (None, "tiny.q8_0")])
def test_the_spec_is_named_after_the_files_general_name(tmp_path, general_name, want):
    """general.name where it makes a spec name, else the file's name; --name over both."""
    path = tmp_path / "Tiny.Q8_0.gguf"
    write_gguf(hf_model("llama"), path, name=general_name)
    spec, _ = import_gguf(path, tmp_path / "m.yaml", tokenizer=False)
    assert specc.load_spec(spec).name == want
    spec, _ = import_gguf(path, tmp_path / "m.yaml", tokenizer=False, force=True, name="mine")
    assert specc.load_spec(spec).name == "mine"
