"""`specc import hf`: small random-weight Hugging Face models (built from configs, nothing from a
hub) saved to folders, imported, built to ONNX, run in onnxruntime and compared with the Hugging
Face model itself: hidden states / logits within 1e-4, greedy generations token for token. A few
forms of a family whose graphs other cases build are run in specc's torch module by make test
(IN_TORCH) and built by make test-slow."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from click.testing import CliRunner

transformers = pytest.importorskip("transformers")

import specc  # noqa: E402
from specc.cli import main  # noqa: E402
from specc.runtime import Session  # noqa: E402
from specc.importers.hf import CheckpointError, describe, import_hf  # noqa: E402

from tests.helpers.hfmodels import CASES, hf_model  # noqa: E402
from tests.helpers.torchside import ONNX, TORCH, TorchModel, paths  # noqa: E402

PROMPTS = [[5, 7, 9, 11, 3], [4, 8, 15, 16, 23, 42, 17]]
NEW = 8


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """label -> (HF model, checkpoint dir, spec path); imported once per module."""
    root = tmp_path_factory.mktemp("hf-import")
    cache: dict = {}

    def get(label: str):
        if label not in cache:
            model = hf_model(label)
            ckpt = root / f"ckpt-{label}"
            model.save_pretrained(ckpt)
            spec, _ = import_hf(ckpt, root / f"{label}.yaml")
            cache[label] = (model, ckpt, spec)
        return cache[label]

    return get


@pytest.fixture(scope="module")
def built(imported, tmp_path_factory):
    """label -> (HF model, the build dir of its import); built once per module."""
    root = tmp_path_factory.mktemp("hf-build")
    cache: dict = {}

    def get(label: str):
        if label not in cache:
            model, _, spec = imported(label)
            specc.build(spec, root / label, progress=None)
            cache[label] = (model, root / label)
        return cache[label]

    return get


def _close(got: np.ndarray, want: torch.Tensor, what: str) -> None:
    want = want.detach().numpy()
    assert got.shape == want.shape, what
    diff = float(np.abs(got - want).max())
    assert diff <= 1e-4, f"{what}: max |ORT - HF| = {diff}"


SCALED = ["llama-linear", "llama3-scaled", "qwen2-yarn", "gpt-neox-yarn", "phi3-longrope", "gemma3-scaled"]
# mixtures of experts and latent attention
MOE = ["mixtral", "qwen2-moe", "qwen2-moe-window", "qwen3-moe", "olmoe", "granitemoe", "phimoe", "phimoe-longrope",
       "gpt-oss", "deepseek-v2", "deepseek-v3"]


@pytest.mark.parametrize("label", [k for k in CASES if k.startswith(("bert", "roberta", "electra", "distilbert"))])
def test_bert_outputs_match_hugging_face(built, label):
    model, out = built(label)
    s = Session(out)
    ids = torch.tensor([[2, 5, 7, 9, 11, 3, 0], [2, 4, 8, 15, 16, 3, 1]])  # no real token is RoBERTa's padding id 1
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]])
    if getattr(model.config, "type_vocab_size", 2) == 1:  # RoBERTa
        types = torch.zeros_like(types)
    mask = torch.tensor([[1] * 7, [1] * 5 + [0, 0]])  # right padding in the second row
    typed = {} if label.startswith("distilbert") else {"token_type_ids": types}  # DistilBERT has no token types
    with torch.no_grad():
        ref = model(input_ids=ids, attention_mask=mask, output_hidden_states=True, **typed)
    got = s.run(input_ids=ids.numpy(), attention_mask=mask.numpy(), **{k: v.numpy() for k, v in typed.items()})
    keep = mask.numpy().astype(bool)
    _close(got["last_hidden_state"][keep], ref.hidden_states[-1][mask.bool()], f"{label} last_hidden_state")
    if label.endswith("-model"):
        if getattr(ref, "pooler_output", None) is not None:  # DistilBERT has no pooler
            _close(got["pooler_output"], ref.pooler_output, "pooler_output")
        else:
            assert "pooler_output" not in got
    elif label.endswith("-mlm"):
        _close(got["logits"][keep], ref.logits[mask.bool()], "mlm logits")
    else:
        _close(got["logits"], ref.logits, "classifier logits")


def _hf_greedy(model, prompt: list[int], encoder_decoder: bool) -> list[int]:
    """Hugging Face's greedy generate. BART-style configs force EOS as the last token
    (forced_eos_token_id), so ask for one more token and keep the first NEW: those are free."""
    cfg = model.config
    gen = transformers.GenerationConfig(
        max_new_tokens=NEW + 1, do_sample=False, num_beams=1, eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id if cfg.pad_token_id is not None else cfg.eos_token_id,
        decoder_start_token_id=getattr(cfg, "decoder_start_token_id", None))
    ids = torch.tensor([prompt])
    with torch.no_grad():
        seq = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=gen)[0].tolist()
    return (seq[1:] if encoder_decoder else seq[len(prompt):])[:NEW]


DECODERS = ["gpt2", "llama-gqa", "llama-tied", "mistral", "mistral-window", "qwen2", "qwen3", "gemma", "gemma2",
            "gemma3", pytest.param("phi3", marks=pytest.mark.slow),  # phi3-longrope: the same family
            "stablelm", "stablelm-parallel", "olmo2", "bloom", pytest.param("bloom-6", marks=pytest.mark.slow),
            "gpt-neox", "gpt-neox-sequential", "gptj", "falcon-new", "falcon-7b-form", "falcon-sequential", "opt",
            "opt-post", *SCALED, *MOE]
# Imports run in torch by make test and built by make test-slow: a form of a family whose graphs
# another case here builds (the family's other form, a plain rope for its scaled one) or a kind of
# tests/export/test_build_kinds.py does (rotary-linear, -llama3, -yarn; overrides-scaling). A
# build holds its graphs to that same torch module (its verification).
IN_TORCH = ("llama-tied", "mistral", "stablelm-parallel", "gpt-neox-sequential", "falcon-sequential",
            "opt-post", "llama-linear", "llama3-scaled", "qwen2-yarn", "gpt-neox-yarn", "gemma3-scaled",
            # one mixture of experts (Qwen2-MoE: a gated shared expert, a dense layer) and one latent attention
            # (DeepSeek-V3) are built by make test; the other families' routers and attention are held to
            # transformers in torch there (tests/nn/test_moe_reference.py holds each block) and built by make test-slow
            *(label for label in MOE if label not in ("qwen2-moe", "deepseek-v3")))
# the builds another test here reads too: each label's tests on one worker, so that it is built once
SHARED = {label: pytest.mark.xdist_group(f"hf-{label}") for label in ("mistral-window", "gemma2", "phi3-longrope")}
DECODER_PATHS = paths([d if hasattr(d, "values") else (d,) for d in DECODERS], lambda v: v[0] in IN_TORCH,
                      lambda v: [SHARED[v[0]]] if v[0] in SHARED else [])


@pytest.mark.parametrize("label,path", DECODER_PATHS)
def test_decoder_logits_and_greedy_match_hugging_face(imported, built, label, path):
    """Logits within 1e-4 and greedy tokens, built (and a left-padded batch generating what each
    prompt does alone) or, for IN_TORCH, in specc's torch module."""
    if path == TORCH:
        model, _, spec = imported(label)
        s = TorchModel(spec)
    else:
        model, out = built(label)
        s = Session(out)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt])).logits
        _close(s.run(input_ids=[prompt])["logits"], ref, f"{label} logits")
    wants = [_hf_greedy(model, p, False) for p in PROMPTS]
    assert len({t for w in wants for t in w}) > 2  # models that repeat one token would prove little
    for prompt, want in zip(PROMPTS, wants):
        got = s.greedy(prompt, NEW) if path == TORCH else s.generate(prompt, max_new_tokens=NEW).new_ids[0]
        assert got == want, (label, prompt)
    if path == ONNX:  # a left-padded batch generates what each prompt generates alone
        assert s.generate(PROMPTS, max_new_tokens=NEW).new_ids == wants


@pytest.mark.parametrize("label", [pytest.param(label, marks=SHARED[label]) for label in ("mistral-window", "gemma2")])
def test_sliding_layers_keep_a_window_cache_as_hugging_face_does(built, label):
    """Hugging Face's sliding layers (every layer of Mistral's, every other of Gemma 2's) keep a
    window cache: so do the built graph's, sliding_window - 1 positions after the longer prompt
    (a token sees itself and those), the global layers' the whole prompt; the generations past
    the window are the ones test_decoder_logits_and_greedy_match_hugging_face checks."""
    model, out = built(label)
    cfg = model.config
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    prompt = PROMPTS[1]
    assert len(prompt) > cfg.sliding_window
    got = Session(out).run(input_ids=[prompt])
    want = {i: cfg.sliding_window - 1 if kind == "sliding_attention" else len(prompt) for i, kind in enumerate(kinds)}
    assert "full_attention" in kinds or label == "mistral-window"
    assert {i: got[f"present.{i}.key"].shape[2] for i in want} == want
    assert {i: got[f"present.{i}.value"].shape[2] for i in want} == want


@pytest.mark.parametrize("label", ["bart", "mbart", "marian", "pegasus", "t5", "t5-gated"])
def test_encoder_decoder_outputs_and_greedy_match_hugging_face(built, label):
    model, out = built(label)
    s = Session(out)
    start = model.config.decoder_start_token_id
    src = torch.tensor([PROMPTS[1], PROMPTS[0] + [0, 0]])
    mask = torch.tensor([[1] * 7, [1] * 5 + [0, 0]])
    dec = torch.tensor([[start, 5, 6, 7], [start, 9, 8, 7]])
    with torch.no_grad():
        ref = model(input_ids=src, attention_mask=mask, decoder_input_ids=dec)
    got = s.run(input_ids=src.numpy(), attention_mask=mask.numpy(), decoder_input_ids=dec.numpy())
    keep = mask.numpy().astype(bool)
    _close(got["encoder_last_hidden_state"][keep], ref.encoder_last_hidden_state[mask.bool()], f"{label} encoder")
    _close(got["logits"], ref.logits, f"{label} logits")
    wants = [_hf_greedy(model, p, True) for p in PROMPTS]
    assert len({t for w in wants for t in w}) > 2
    for prompt, want in zip(PROMPTS, wants):
        assert s.generate(prompt, max_new_tokens=NEW).new_ids[0] == want, (label, prompt)
    assert s.generate(PROMPTS, max_new_tokens=NEW).new_ids == wants  # right-padded sources


# the spec's scaling each imports to (the parity test above checks what it computes)
SCALINGS = {
    "llama-linear": {"kind": "linear", "factor": 4.0},
    "llama3-scaled": {"kind": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_length": 8},
    "qwen2-yarn": {"kind": "yarn", "factor": 4.0, "original_max_length": 16, "beta_fast": 32.0, "beta_slow": 1.0,
                   "truncate": True},
    "gpt-neox-yarn": {"kind": "yarn", "factor": 8.0, "original_max_length": 8, "beta_fast": 4.0, "beta_slow": 1.0,
                      "truncate": True},
    "phi3-longrope": {"kind": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.6], "long_factor": [1.5, 3.0, 6.0, 12.0],
                      "original_max_length": 4},
}


@pytest.mark.parametrize("label", list(SCALINGS))
def test_scaled_rope_imports_as_the_spec_says(imported, label):
    scaling = specc.load_spec(imported(label)[2]).position.scaling
    assert scaling.model_dump(include=set(SCALINGS[label])) == SCALINGS[label]


@SHARED["phi3-longrope"]
def test_longrope_within_the_original_length_turns_by_the_short_factors(built):
    """Prompts of 5 and 7 tokens pass Phi-3's original length 4 (the long factors); one of 3 stays
    within it, and its logits are Hugging Face's too (the short factors)."""
    model, out = built("phi3-longrope")
    s = Session(out)
    for prompt in ([5, 7, 9], [5, 7, 9, 11]):
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt])).logits
        _close(s.run(input_ids=[prompt])["logits"], ref, f"phi3-longrope logits of {len(prompt)} tokens")
    short = s.run(input_ids=[[5, 7, 9, 11]])["logits"][0, -1]
    longer = s.run(input_ids=[[5, 7, 9, 11, 3]])["logits"][0, 3]  # the same token, the long factors
    assert np.abs(short - longer).max() > 1e-3


def test_gpt_oss_mxfp4_experts_import_as_transformers_dequantizes_them(tmp_path):
    """The published gpt-oss checkpoints hold their experts as MXFP4 blocks and scales: imported
    as bfloat16 (exact), they compute what transformers' own dequantization
    (convert_moe_packed_tensors) gives the model."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = hf_model("gpt-oss", intermediate_size=32)  # MXFP4 groups of 32 along each expert's input
    model.save_pretrained(tmp_path / "ckpt")
    tensors = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for i, layer in enumerate(model.model.layers):
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(layer.mlp.experts, name)
            experts, d_in, d_out = param.shape  # transformers holds x @ W: [E, in, out]
            blocks = torch.randint(0, 256, (experts, d_out, d_in // 32, 16), generator=gen, dtype=torch.uint8)
            scales = torch.randint(122, 127, (experts, d_out, d_in // 32), generator=gen).to(torch.uint8)
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors.update({f"{key}_blocks": blocks, f"{key}_scales": scales})
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(tmp_path / "ckpt" / "model.safetensors"), metadata={"format": "pt"})
    spec, weights = import_hf(tmp_path / "ckpt", tmp_path / "m.yaml")
    assert load_file(str(weights))["decoder.layers.0.ffn.experts.up"].dtype == torch.bfloat16
    ours = TorchModel(spec)
    for prompt in PROMPTS:
        with torch.no_grad():
            want = model(input_ids=torch.tensor([prompt])).logits
        _close(ours.run(input_ids=[prompt])["logits"], want, "gpt-oss MXFP4 logits")


def test_gemma3_scales_its_global_layers_alone(imported):
    r = specc.resolve(specc.load_spec(imported("gemma3-scaled")[2]))
    kinds = [(a.rotary_base, a.rotary_scaling.model_dump()) for a in (layer.attention for layer in r.decoder.layers)]
    assert kinds == [(10.0, {"kind": "none"}), (1e6, {"kind": "linear", "factor": 8.0})] * 2


def test_imported_spec_reads_like_the_config(imported):
    _, _, spec_path = imported("llama-gqa")
    r = specc.resolve(specc.load_spec(spec_path))
    assert r.position.kind == "rotary" and r.position.base == 500.0
    assert r.norm.kind == "rmsnorm" and r.norm.placement == "pre"
    a = r.decoder.layers[0].attention
    assert (a.heads, a.kv_heads) == (4, 2)
    assert r.decoder.layers[0].ffn.activation == "swiglu"
    assert not r.vocab.tie_output
    marian = specc.resolve(specc.load_spec(imported("marian")[2]))
    assert (marian.position.kind, marian.position.layout, marian.vocab.scale) == ("sinusoidal", "halves", "sqrt_d_model")


# --- checkpoint formats ---------------------------------------------------------------------------


def test_pytorch_model_bin_imports_to_the_same_weights(tmp_path, imported):
    model, _, spec_path = imported("gpt2")
    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    # the older layout: config.json + a pickled state dict (with the tied lm_head.weight copy)
    model.config.to_json_file(ckpt / "config.json")
    state = model.state_dict()
    assert "lm_head.weight" in state
    torch.save(state, ckpt / "pytorch_model.bin")
    _, weights = import_hf(ckpt, tmp_path / "g.yaml")
    from safetensors.torch import load_file

    a, b = load_file(str(weights)), load_file(str(spec_path.with_suffix(".safetensors")))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)


class _Evil:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_a_pickle_with_code_is_refused_not_run(tmp_path, capsys):
    ckpt = tmp_path / "evil"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(hf_model("gpt2").config.to_dict()))
    torch.save({"wte.weight": _Evil()}, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="weights_only"):
        import_hf(ckpt, tmp_path / "evil.yaml")
    assert "pickled code ran" not in capsys.readouterr().out
    assert list(tmp_path.glob("evil.*")) == []


# --- refusals: no silent differences ---------------------------------------------------------------


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-saved")
    out = {}
    for label in ("gpt2", "llama-gqa", "bert-model", "bart", "qwen2", "electra-model", "falcon-new", "stablelm", "bloom",
                  "t5", "phi3", "olmo2", "gemma2", "mixtral", "qwen2-moe", "olmoe", "granitemoe", "phimoe", "gpt-oss",
                  "deepseek-v2", "deepseek-v3"):
        hf_model(label).save_pretrained(root / label)
        out[label] = root / label
    return out


def _edit(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


REFUSED = [
    ("gpt2", {"activation_function": "gelu_fast"}, "activation_function.*gelu_fast"),
    ("gpt2", {"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx = true"),
    ("gpt2", {"eos_token_id": 500}, "eos_token_id = 500 is outside the vocabulary"),
    ("llama-gqa", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}},
     "rope_parameters.rope_type 'dynamic': dynamic NTK scaling recomputes the frequencies"),
    ("llama-gqa", {"rope_scaling": {"type": "proportional", "factor": 4.0}},
     "rope_scaling.rope_type 'proportional': specc computes rope types default, linear, llama3, yarn, longrope"),
    ("llama-gqa", {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "rope_scaling.low_freq_factor is missing"),
    ("llama-gqa", {"rope_scaling": {"rope_type": "linear", "factor": 0.5}},
     r"rope_scaling \(or rope_parameters\) \(specc's position.scaling.factor\): input should be greater than or equal to 1"),
    ("llama-gqa", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0, "x"]}},
     "rope_scaling.long_factor: expected a list of numbers"),
    ("llama-gqa", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0],
                                    "original_max_position_embeddings": 8}}, "1 factors for 4 rotated pairs"),
    ("phi3", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "Phi-3's rope types are default and longrope"),
    ("llama-gqa", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    ("llama-gqa", {"eos_token_id": [2, 3]}, r"eos_token_id = \[2, 3\]"),
    ("llama-gqa", {"sliding_window": 1}, "sliding_window 1: a window must hold more than the token itself"),
    ("electra-model", {"embedding_size": 16}, "embedding_size 16: embeddings narrower than hidden_size"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window: sliding-window attention in some layers"),
    ("qwen2", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types: sliding-window attention"),
    ("bert-model", {"position_embedding_type": "relative_key"}, 'position_embedding_type = "relative_key"'),
    ("bert-model", {"architectures": ["BertForQuestionAnswering"]}, "BertForQuestionAnswering"),
    ("bert-model", {"model_type": "mamba"}, "model_type 'mamba' has no importer"),
    ("bart", {"add_bias_logits": True}, "add_bias_logits = true"),
    ("falcon-new", {"alibi": True}, "alibi true: Falcon's ALiBi is scaled"),
    ("falcon-new", {"num_ln_in_parallel_attn": 3}, "num_ln_in_parallel_attn 3"),
    ("stablelm", {"qk_layernorm": True}, "qk_layernorm = true"),
    ("bloom", {"apply_residual_connection_post_layernorm": True}, "apply_residual_connection_post_layernorm = true"),
    ("t5", {"feed_forward_proj": "gated-relu"}, "feed_forward_proj 'gated-relu' is not one specc computes exactly"),
    # mixtures of experts and latent attention
    ("mixtral", {"num_experts": 8}, "num_local_experts = 4 and num_experts = 8: transformers reads both as one field"),
    ("mixtral", {"num_experts_per_tok": 5}, r"num_experts_per_tok = 5 \(specc's decoder.ffn.top_k\)"),
    ("qwen2-moe", {"decoder_sparse_step": 0}, "decoder_sparse_step 0: must be at least 1"),
    ("qwen2-moe", {"layer_types": ["sliding_attention", "full_attention", "full_attention"]},
     "layer_types: sliding layers without use_sliding_window"),
    ("olmoe", {"clip_qkv": 8.0}, "clip_qkv = 8.0: specc cannot express this"),
    ("granitemoe", {"embedding_multiplier": 12.0}, "embedding_multiplier = 12.0: specc cannot express this"),
    ("granitemoe", {"residual_multiplier": 0.22}, "residual_multiplier = 0.22: specc cannot express this"),
    ("granitemoe", {"logits_scaling": 0}, "logits_scaling 0.0: must be positive"),
    ("phimoe", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}},
     "rope_parameters.rope_type 'yarn': PhiMoE's rope types are default and longrope"),
    ("phimoe", {"rope_parameters": {"rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
                                    "short_mscale": 1.2, "long_mscale": 1.3, "original_max_position_embeddings": 4,
                                    "rope_theta": 1e6}}, "short_mscale 1.2 and long_mscale 1.3"),
    ("phimoe", {"num_experts_per_tok": 3}, r"num_experts_per_tok = 3 \(specc's decoder.ffn"),
    ("gpt-oss", {"layer_types": ["sliding_attention"]}, "layer_types: expected 3 entries"),
    ("deepseek-v2", {"topk_method": "noaux_tc"}, "topk_method 'noaux_tc': DeepSeek-V2's routers are greedy and"),
    ("deepseek-v2", {"mlp_bias": True}, "mlp_bias = true: specc cannot express this"),
    ("deepseek-v2", {"num_key_value_heads": 2}, "num_key_value_heads 2: latent attention gives every head"),
    ("deepseek-v3", {"n_group": None}, "n_group: null"),
]


@pytest.mark.parametrize("label,changes,message", REFUSED, ids=[f"{r[0]}-{next(iter(r[1]))}" for r in REFUSED])
def test_configs_specc_cannot_express_are_refused_naming_the_field(saved, tmp_path, label, changes, message):
    src = _edit(saved[label], tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError, match=message) as info:
        import_hf(src, tmp_path / "out.yaml")
    assert "config.json" in str(info.value)
    assert not (tmp_path / "out.yaml").exists() and not (tmp_path / "out.safetensors").exists()


# the rope mapping as older configs write it (`rope_scaling`, its kind as `type`) and as
# transformers 5 does (`rope_parameters`), read by every family that reads LLaMA's rope fields
YARN = {"factor": 4.0, "original_max_position_embeddings": 16, "beta_fast": 8.0}
SCALED_FAMILIES = ["llama-gqa", "qwen2", "falcon-new", "stablelm", "phi3", "olmo2", "gemma2"]


@pytest.mark.parametrize("label", SCALED_FAMILIES)
def test_each_rotary_family_reads_the_rope_scaling(saved, tmp_path, label):
    want = {"kind": "yarn", "factor": 4.0, "original_max_length": 16, "beta_fast": 8.0, "beta_slow": 1.0, "truncate": True}
    if label == "phi3":  # Phi-3 reads yarn as longrope, its original length at the top level
        pairs = 4
        mapping = {"type": "yarn", "short_factor": [1.0] * pairs, "long_factor": [2.0] * pairs}
        want = {"kind": "longrope", "short_factor": [1.0] * pairs, "long_factor": [2.0] * pairs,
                "original_max_length": 16}
        extra = {"original_max_position_embeddings": 16}
    else:
        mapping, extra = {"type": "yarn", **YARN}, {}
    cfg = json.loads((saved[label] / "config.json").read_text())
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    legacy = _edit(saved[label], tmp_path / "legacy", rope_scaling=mapping, **extra)
    new = _edit(saved[label], tmp_path / "new", rope_parameters={**{("rope_type" if k == "type" else k): v
                                                                    for k, v in mapping.items()}, "rope_theta": theta},
                **extra)
    specs = []
    for src in (legacy, new):
        spec_path, _ = import_hf(src, tmp_path / f"{src.name}.yaml")
        spec = yaml.safe_load(spec_path.read_text())
        specs.append({k: v for k, v in spec.items() if k not in ("name", "weights")})
    assert specs[0] == specs[1]
    assert specs[0]["position"]["scaling"] == want


def _edit_tensors(src: Path, dst: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


TENSOR_REFUSALS = [
    ("bart", lambda t: t.__setitem__("final_logits_bias", t["final_logits_bias"] + 0.5), "final_logits_bias is not zero"),
    # one expert's tensor missing from a layer: named, not "none of"
    ("mixtral", lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight"),
     "has model.layers.1.block_sparse_moe.experts.0.w3.weight but not model.layers.1.block_sparse_moe.experts.3.w3"),
    ("gpt2", lambda t: t.__setitem__("transformer.h.0.extra.weight", torch.ones(3)), "no place in the spec: transformer.h.0.extra"),
    ("gpt2", lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), "none of h.1.mlp.c_fc.bias"),
    ("gpt2", lambda t: t.__setitem__("lm_head.weight", torch.randn_like(t["transformer.wte.weight"])), "differs from the embedding table"),
    ("llama-gqa", lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(8, 32)), "shape \\(8, 32\\)"),
]


@pytest.mark.parametrize("label,change,message", TENSOR_REFUSALS,
                         ids=["bias", "expert-missing", "extra", "missing", "untied", "shape"])
def test_checkpoint_tensors_that_would_change_the_result_are_refused(saved, tmp_path, label, change, message):
    src = _edit_tensors(saved[label], tmp_path / "ckpt", change)
    with pytest.raises(CheckpointError, match=message):
        import_hf(src, tmp_path / "out.yaml")
    assert list(tmp_path.glob("out.*")) == []


def test_tied_lm_head_equal_to_the_table_is_accepted(saved, tmp_path):
    src = _edit_tensors(saved["gpt2"], tmp_path / "ckpt",
                        lambda t: t.__setitem__("lm_head.weight", t["transformer.wte.weight"].clone()))
    import_hf(src, tmp_path / "out.yaml")
    assert (tmp_path / "out.safetensors").is_file()


def test_a_marian_table_that_is_not_the_sinusoid_is_refused(tmp_path):
    model = hf_model("marian")
    model.save_pretrained(tmp_path / "m")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(tmp_path / "m" / "model.safetensors"))
    table = model.model.encoder.embed_positions.weight.detach().clone()
    tensors["model.encoder.embed_positions.weight"] = table  # the true table: accepted
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    import_hf(tmp_path / "m", tmp_path / "ok.yaml")
    tensors["model.encoder.embed_positions.weight"] = table.flip(1)  # the interleaved-vs-halves kind of mistake
    save_file(tensors, str(tmp_path / "m" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="not the sinusoid table"):
        import_hf(tmp_path / "m", tmp_path / "bad.yaml")


def test_existing_outputs_need_force(saved, tmp_path):
    import_hf(saved["gpt2"], tmp_path / "g.yaml")
    with pytest.raises(CheckpointError, match="exists; pass --force"):
        import_hf(saved["gpt2"], tmp_path / "g.yaml")
    import_hf(saved["gpt2"], tmp_path / "g.yaml", force=True)


def test_import_hf_cli(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                  bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "ckpt")
    out = tmp_path / "m.yaml"
    res = CliRunner().invoke(main, ["import", "hf", str(tmp_path / "ckpt"), "-o", str(out), "--name", "tiny", "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output) == {"spec": str(out), "weights": str(tmp_path / "m.safetensors"), "tokenizer": None}
    spec = specc.load_spec(out)
    assert spec.name == "tiny" and spec.weights == "m.safetensors"
    again = CliRunner().invoke(main, ["import", "hf", str(tmp_path / "ckpt"), "-o", str(out)])
    assert again.exit_code == 1 and "--force" in again.output
    bad = CliRunner().invoke(main, ["import", "hf", str(tmp_path / "none"), "-o", str(tmp_path / "x.yaml")])
    assert bad.exit_code == 1 and "not a checkpoint folder" in bad.output and "Traceback" not in bad.output
    build = CliRunner().invoke(main, ["build", str(out), "-o", str(tmp_path / "b"), "--quiet"])
    assert build.exit_code == 0, build.output


def test_the_docs_print_the_mapping_tables():
    doc = (Path(__file__).parents[2] / "docs" / "import.md").read_text()
    assert describe() in doc, "docs/import.md is out of date: paste specc.importers.hf.describe() into it"


# --- hostile checkpoint folders (a red-team pass) ----------------------------------------------------
# Each folder is refused by `specc import hf` with exit 1 and one line naming the file and the config
# field, index entry or file: never "internal error", a traceback, a hang (a FIFO) or a read of
# /dev/zero, and nothing is written at -o.


def _config(**changes):
    def change(ckpt: Path) -> None:
        cfg = json.loads((ckpt / "config.json").read_text())
        cfg.update(changes)
        (ckpt / "config.json").write_text(json.dumps(cfg))
    return change


def _raw_config(text: str):
    return lambda ckpt: (ckpt / "config.json").write_text(text)


def _index(entry, name: str = "model.safetensors.index.json"):
    """model.safetensors becomes shard.safetensors, named by an index whose one entry is ENTRY."""
    def change(ckpt: Path) -> None:
        (ckpt / "model.safetensors").rename(ckpt / "shard.safetensors")
        (ckpt / name).write_text(json.dumps({"metadata": {}, "weight_map": {"transformer.wte.weight": entry}}))
    return change


def _link_shard_outside(ckpt: Path) -> None:
    (ckpt / "model.safetensors").rename(ckpt.parent / "outside.safetensors")
    (ckpt / "shard.safetensors").symlink_to(ckpt.parent / "outside.safetensors")
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"transformer.wte.weight": "shard.safetensors"}}))


def _link_model_outside(ckpt: Path) -> None:
    (ckpt / "model.safetensors").rename(ckpt.parent / "outside.safetensors")
    (ckpt / "model.safetensors").symlink_to(ckpt.parent / "outside.safetensors")


def _replace(name: str, make):
    """NAME in the checkpoint replaced by what MAKE(path) creates (a FIFO, a folder, a link)."""
    def change(ckpt: Path) -> None:
        (ckpt / name).unlink(missing_ok=True)
        make(ckpt / name)
    return change


def _fifo_shard(ckpt: Path) -> None:
    _index("shard.safetensors")(ckpt)
    (ckpt / "shard.safetensors").unlink()
    os.mkfifo(ckpt / "shard.safetensors")


def _weights_as(name: str, make):
    """model.safetensors removed, NAME (a weights file or index) made by MAKE(path)."""
    def change(ckpt: Path) -> None:
        (ckpt / "model.safetensors").unlink()
        make(ckpt / name)
    return change


def _sparse(size: int):
    def make(path: Path) -> None:
        with open(path, "r+b") as f:
            f.truncate(size)
    return make


def _tensor(name: str, value):
    """model.safetensors with NAME set to VALUE (a tensor)."""
    def change(ckpt: Path) -> None:
        from safetensors.torch import load_file, save_file

        tensors = load_file(str(ckpt / "model.safetensors"))
        tensors[name] = value
        save_file(tensors, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    return change


_DEEP = "[" * 200_000 + "]" * 200_000
_CFG = "config.json: "
_IDX = "model.safetensors.index.json: "
HOSTILE = [
    # config.json of the wrong types
    ("model_type-list", "gpt2", _config(model_type=["gpt2"]), _CFG + 'model_type: expected a string or null, got ["gpt2"]'),
    ("architectures-int", "gpt2", _config(architectures=5), _CFG + "architectures: expected a list of strings, got 5"),
    ("architectures-string", "gpt2", _config(architectures="GPT2LMHeadModel"),
     _CFG + 'architectures: expected a list of strings, got "GPT2LMHeadModel"'),
    ("eos-string", "gpt2", _config(eos_token_id="499"), _CFG + 'eos_token_id: expected an integer, a list of integers or null, got "499"'),
    ("eos-bool", "gpt2", _config(eos_token_id=True), _CFG + "eos_token_id: expected an integer"),
    ("n_embd-null", "gpt2", _config(n_embd=None), _CFG + "n_embd: expected an integer, got null"),
    ("n_embd-float", "gpt2", _config(n_embd=32.0), _CFG + "n_embd: expected an integer, got 32.0"),
    ("n_inner-string", "gpt2", _config(n_inner="x"), _CFG + 'n_inner: expected an integer or null, got "x"'),
    ("eps-string", "gpt2", _config(layer_norm_epsilon="1e-5"), _CFG + "layer_norm_epsilon: expected a number"),
    ("tie-int", "gpt2", _config(tie_word_embeddings=1), _CFG + "tie_word_embeddings: expected true or false, got 1"),
    ("activation-list", "gpt2", _config(activation_function=["gelu"]), _CFG + "activation_function: expected a string"),
    ("rope_scaling-int", "llama-gqa", _config(rope_scaling=5), _CFG + "rope_scaling: expected an object or null, got 5"),
    ("rope_theta-string", "llama-gqa", _config(rope_parameters={"rope_type": "default", "rope_theta": "1e4"}),
     _CFG + 'rope_parameters.rope_theta: expected a number, got "1e4"'),
    ("head_dim-string", "llama-gqa", _config(head_dim="8"), _CFG + 'head_dim: expected an integer or null, got "8"'),
    ("id2label-int", "bert-model", _config(architectures=["BertForSequenceClassification"], id2label=5),
     _CFG + "id2label: expected an object or null, got 5"),
    ("is_decoder-0", "bert-model", _config(is_decoder=0), _CFG + "is_decoder = 0: specc cannot express this"),
    ("nested-200000", "gpt2", _raw_config(_DEEP), _CFG + "cannot read it (JSON nested too deeply)"),
    ("not-an-object", "gpt2", _raw_config("[1, 2]"), _CFG + "not a JSON object"),
    # values of the right type that specc's spec refuses: named by the config field, not OUT.yaml
    ("n_embd-negative", "gpt2", _config(n_embd=-4), _CFG + "n_embd = -4 (specc's d_model): input should be greater than or equal to 1"),
    ("eps-nan", "gpt2", _config(layer_norm_epsilon=float("nan")), _CFG + "layer_norm_epsilon = NaN (specc's norm.eps)"),
    ("heads-huge", "gpt2", _config(n_head=10**9), _CFG + "n_head = 1000000000 (specc's decoder.attention.heads)"),
    # a layer count that would fill the memory when the spec is resolved
    ("n_layer-huge", "gpt2", _config(n_layer=10**9), _CFG + "n_layer = 1000000000: the checkpoint holds"),
    # index entries of the wrong types, or leading out of the folder
    ("weight_map-int", "gpt2", _index(5), _IDX + 'weight_map["transformer.wte.weight"] = 5: expected a file name'),
    ("weight_map-null", "gpt2", _index(None), _IDX + 'weight_map["transformer.wte.weight"] = null: expected a file name'),
    ("weight_map-list", "gpt2", _index(["shard.safetensors"]), _IDX + 'weight_map["transformer.wte.weight"] = ["shard.safetensors"]: expected'),
    ("weight_map-dotdot", "gpt2", _index("../../x.safetensors"),
     _IDX + 'weight_map["transformer.wte.weight"] = "../../x.safetensors": not a file name inside the checkpoint folder'),
    ("weight_map-absolute", "gpt2", _index("/etc/passwd"), _IDX + 'weight_map["transformer.wte.weight"] = "/etc/passwd": not a file name inside'),
    ("weight_map-link-outside", "gpt2", _link_shard_outside,
     _IDX + 'weight_map entry "shard.safetensors": leads to'),
    ("bin-index-dotdot", "gpt2", _index("../x.bin", "pytorch_model.bin.index.json"),
     'pytorch_model.bin.index.json: weight_map["transformer.wte.weight"] = "../x.bin": not a file name inside'),
    ("index-a-list", "gpt2", _weights_as("model.safetensors.index.json", lambda p: p.write_text("[]")),
     _IDX + "not a weights index (no weight_map object)"),
    # files that are not regular files, or too large, refused before they are read
    ("config-dev-zero", "gpt2", _replace("config.json", lambda p: p.symlink_to("/dev/zero")),
     _CFG + "a character device, not a regular file"),
    ("config-fifo", "gpt2", _replace("config.json", os.mkfifo), _CFG + "a FIFO, not a regular file"),
    ("config-directory", "gpt2", _replace("config.json", Path.mkdir), _CFG + "a directory, not a regular file"),
    ("config-dangling-link", "gpt2", _replace("config.json", lambda p: p.symlink_to(p.parent / "nowhere")),
     _CFG + "missing (a link to nowhere)"),
    ("config-link-loop", "gpt2", _replace("config.json", lambda p: p.symlink_to(p)), _CFG + "cannot read it"),
    ("config-100MiB", "gpt2", lambda ckpt: _sparse(100 * 2**20)(ckpt / "config.json"),
     _CFG + "104857600 bytes; a JSON file of a checkpoint is refused over 64 MiB"),
    ("model-fifo", "gpt2", _replace("model.safetensors", os.mkfifo), "model.safetensors: a FIFO, not a regular file"),
    ("model-link-outside", "gpt2", _link_model_outside, "model.safetensors: leads to"),
    ("index-fifo", "gpt2", _weights_as("model.safetensors.index.json", os.mkfifo), _IDX + "a FIFO, not a regular file"),
    ("index-100MiB", "gpt2", _weights_as("model.safetensors.index.json", lambda p: (p.touch(), _sparse(100 * 2**20)(p))),
     _IDX + "104857600 bytes"),
    ("shard-fifo", "gpt2", _fifo_shard, "shard.safetensors: a FIFO, not a regular file (named by model.safetensors.index.json)"),
    ("bin-fifo", "gpt2", _weights_as("pytorch_model.bin", os.mkfifo), "pytorch_model.bin: a FIFO, not a regular file"),
    ("bin-dev-zero", "gpt2", _weights_as("pytorch_model.bin", lambda p: p.symlink_to("/dev/zero")),
     "pytorch_model.bin: a character device, not a regular file"),
    # tensors a split, a transpose or an offset cannot take, and integer weights
    ("qkv-bias-0d", "gpt2", _tensor("transformer.h.0.attn.c_attn.bias", torch.zeros(())),
     _CFG + "transformer.h.0.attn.c_attn.bias has shape (); specc's decoder.layers.0.attention.q.bias needs (32,)"),
    ("positions-0d", "bart", _tensor("model.encoder.embed_positions.weight", torch.zeros(())),
     _CFG + "model.encoder.embed_positions.weight has shape ()"),
    ("embedding-int64", "gpt2", _tensor("transformer.wte.weight", torch.zeros(99, 32, dtype=torch.int64)),
     _CFG + "transformer.wte.weight holds int64; specc's embeddings.tokens.weight is a floating-point parameter"),
]


@contextmanager
def _no_hang(seconds: int = 60):
    """A hang (an open of a FIFO) fails the test instead of stopping the run."""
    def expire(signum, frame):
        raise TimeoutError(f"no answer in {seconds} s")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("label,change,message", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_hostile_checkpoint_folders_are_refused_naming_the_field_or_file(saved, tmp_path, label, change, message):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[label], ckpt)
    change(ckpt)
    (tmp_path / "out").mkdir()
    with _no_hang():
        result = CliRunner().invoke(main, ["import", "hf", str(ckpt), "-o", str(tmp_path / "out" / "out.yaml")])
    out = result.output
    assert result.exit_code == 1, out
    assert "internal error" not in out and "Traceback" not in out, out
    assert out.startswith("specc: error: ") and len(out.strip().splitlines()) == 1, out
    assert message in out, out
    assert str(ckpt) in out  # the file is named by its path
    assert list((tmp_path / "out").iterdir()) == []


def test_hostile_cases_cover_the_red_team_reproductions():
    names = {c[0] for c in HOSTILE}
    assert len(names) == len(HOSTILE) == 46
    assert {"model_type-list", "architectures-int", "architectures-string", "eos-string", "n_embd-null", "nested-200000",
            "weight_map-int", "weight_map-null", "weight_map-list", "weight_map-dotdot", "weight_map-absolute",
            "weight_map-link-outside", "config-dev-zero", "config-fifo"} <= names


@pytest.mark.parametrize("case", ["config-fifo", "nested-200000", "weight_map-int"])
def test_hostile_folders_through_the_real_process(saved, tmp_path, case):
    """The installed command's own exit path: exit 1, one line on stderr, no traceback."""
    _, label, change, message = next(c for c in HOSTILE if c[0] == case)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(saved[label], ckpt)
    change(ckpt)
    exe = Path(sys.executable).with_name("specc")
    proc = subprocess.run([str(exe), "import", "hf", str(ckpt), "-o", str(tmp_path / "o.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout == "" and len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "internal error" not in proc.stderr
    assert not (tmp_path / "o.yaml").exists() and not (tmp_path / "o.safetensors").exists()


def test_a_hugging_face_cache_snapshot_with_shards_in_blobs_imports(saved, tmp_path):
    """The hub cache keeps a snapshot's files as links to ../../blobs/HASH: those links leave the
    snapshot folder but stay in the repository, and are followed (a sharded index included)."""
    model = hf_model("gpt2")
    plain = tmp_path / "plain"
    model.save_pretrained(plain, max_shard_size="40KB")
    assert (plain / "model.safetensors.index.json").is_file()
    repo = tmp_path / "hub" / "models--tiny--gpt2"
    snapshot, blobs = repo / "snapshots" / "0123abc", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(plain.iterdir())):
        shutil.copyfile(f, blobs / f"blob{i}")
        (snapshot / f.name).symlink_to(Path("..", "..", "blobs", f"blob{i}"))
    _, weights = import_hf(snapshot, tmp_path / "g.yaml")
    _, direct = import_hf(plain, tmp_path / "d.yaml")
    from safetensors.torch import load_file

    a, b = load_file(str(weights)), load_file(str(direct))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # a link elsewhere from the same snapshot is still refused
    (snapshot / "model.safetensors.index.json").unlink()
    (snapshot / "model.safetensors").symlink_to(plain / next(p.name for p in plain.glob("model-*.safetensors")))
    with pytest.raises(CheckpointError, match="outside the checkpoint folder"):
        import_hf(snapshot, tmp_path / "h.yaml")
