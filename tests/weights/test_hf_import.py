"""`specc import hf`: small random-weight Hugging Face models (built from configs, nothing from a
hub) saved to folders, imported, built to ONNX, run in onnxruntime and compared with the Hugging
Face model itself: hidden states / logits within 1e-4, greedy generations token for token."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import specc  # noqa: E402
from specc.runtime import Session  # noqa: E402
from specc.importers.hf import CheckpointError, describe, import_hf  # noqa: E402

SMALL = dict(vocab_size=99, max_position_embeddings=64)
BERT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=37, initializer_range=0.2, **SMALL)
S2S = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
           encoder_ffn_dim=37, decoder_ffn_dim=48, init_std=0.5, **SMALL)

# label -> (model class, config class, config kwargs). Init ranges are raised from HF's 0.02: tiny
# random models at 0.02 repeat one token, and their next-token margins are small
CASES = {
    "bert-model": ("BertModel", "BertConfig", BERT),
    "bert-mlm": ("BertForMaskedLM", "BertConfig", dict(BERT, hidden_act="gelu_new")),
    "bert-classifier": ("BertForSequenceClassification", "BertConfig", dict(BERT, num_labels=3)),
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   bos_token_id=98, eos_token_id=98, initializer_range=0.5)),
    "llama-gqa": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                           num_key_value_heads=2, intermediate_size=48, rope_theta=500.0,
                                                           initializer_range=0.5, bos_token_id=1, eos_token_id=2, **SMALL)),
    "llama-tied": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                            intermediate_size=48, tie_word_embeddings=True, initializer_range=0.2,
                                                            bos_token_id=1, eos_token_id=2, **SMALL)),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(S2S, activation_function="gelu")),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", dict(S2S, scale_embedding=True, decoder_start_token_id=2)),
    "marian": ("MarianMTModel", "MarianConfig", dict(S2S, decoder_vocab_size=99, pad_token_id=98, decoder_start_token_id=98,
                                                     eos_token_id=0, scale_embedding=True, activation_function="swish")),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", dict(S2S, pad_token_id=0, eos_token_id=1,
                                                                         decoder_start_token_id=0)),
}
PROMPTS = [[5, 7, 9, 11, 3], [4, 8, 15, 16, 23, 42, 17]]
NEW = 8


def hf_model(label: str):
    model_cls, cfg_cls, kwargs = CASES[label]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs))
    return model.eval()


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """label -> (HF model, checkpoint dir, spec path, build dir); built once per module."""
    root = tmp_path_factory.mktemp("hf-import")
    cache: dict = {}

    def get(label: str):
        if label not in cache:
            model = hf_model(label)
            ckpt = root / f"ckpt-{label}"
            model.save_pretrained(ckpt)
            spec, _ = import_hf(ckpt, root / f"{label}.yaml")
            out = root / f"build-{label}"
            specc.build(spec, out, progress=None)
            cache[label] = (model, ckpt, spec, out)
        return cache[label]

    return get


def _close(got: np.ndarray, want: torch.Tensor, what: str) -> None:
    want = want.detach().numpy()
    assert got.shape == want.shape, what
    diff = float(np.abs(got - want).max())
    assert diff <= 1e-4, f"{what}: max |ORT - HF| = {diff}"


@pytest.mark.parametrize("label", [k for k in CASES if k.startswith("bert")])
def test_bert_outputs_match_hugging_face(imported, label):
    model, _, _, out = imported(label)
    s = Session(out)
    ids = torch.tensor([[2, 5, 7, 9, 11, 3, 0], [2, 4, 8, 15, 16, 3, 1]])
    types = torch.tensor([[0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 1, 1, 1, 1]])
    mask = torch.tensor([[1] * 7, [1] * 5 + [0, 0]])  # right padding in the second row
    with torch.no_grad():
        ref = model(input_ids=ids, token_type_ids=types, attention_mask=mask, output_hidden_states=True)
    got = s.run(input_ids=ids.numpy(), token_type_ids=types.numpy(), attention_mask=mask.numpy())
    keep = mask.numpy().astype(bool)
    _close(got["last_hidden_state"][keep], ref.hidden_states[-1][mask.bool()], f"{label} last_hidden_state")
    if label == "bert-model":
        _close(got["pooler_output"], ref.pooler_output, "pooler_output")
    elif label == "bert-mlm":
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


@pytest.mark.parametrize("label", ["gpt2", "llama-gqa", "llama-tied"])
def test_decoder_logits_and_greedy_match_hugging_face(imported, label):
    model, _, _, out = imported(label)
    s = Session(out)
    for prompt in PROMPTS:
        with torch.no_grad():
            ref = model(input_ids=torch.tensor([prompt])).logits
        _close(s.run(input_ids=[prompt])["logits"], ref, f"{label} logits")
    wants = [_hf_greedy(model, p, False) for p in PROMPTS]
    assert len({t for w in wants for t in w}) > 2  # models that repeat one token would prove little
    for prompt, want in zip(PROMPTS, wants):
        assert s.generate(prompt, max_new_tokens=NEW).new_ids[0] == want, (label, prompt)
    # a left-padded batch generates what each prompt generates alone
    assert s.generate(PROMPTS, max_new_tokens=NEW).new_ids == wants


@pytest.mark.parametrize("label", ["bart", "mbart", "marian", "pegasus"])
def test_encoder_decoder_outputs_and_greedy_match_hugging_face(imported, label):
    model, _, _, out = imported(label)
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


def test_imported_spec_reads_like_the_config(imported):
    _, _, spec_path, _ = imported("llama-gqa")
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
    model, _, spec_path, _ = imported("gpt2")
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
    for label in ("gpt2", "llama-gqa", "bert-model", "bart"):
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
    ("llama-gqa", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}}, "rope_type 'linear'"),
    ("llama-gqa", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type 'yarn'"),
    ("llama-gqa", {"hidden_act": "relu"}, "hidden_act 'relu'"),
    ("llama-gqa", {"eos_token_id": [2, 3]}, r"eos_token_id = \[2, 3\]"),
    ("bert-model", {"position_embedding_type": "relative_key"}, 'position_embedding_type = "relative_key"'),
    ("bert-model", {"architectures": ["BertForQuestionAnswering"]}, "BertForQuestionAnswering"),
    ("bert-model", {"model_type": "t5"}, "model_type 't5' has no importer"),
    ("bart", {"add_bias_logits": True}, "add_bias_logits = true"),
]


@pytest.mark.parametrize("label,changes,message", REFUSED, ids=[f"{r[0]}-{next(iter(r[1]))}" for r in REFUSED])
def test_configs_specc_cannot_express_are_refused_naming_the_field(saved, tmp_path, label, changes, message):
    src = _edit(saved[label], tmp_path / "ckpt", **changes)
    with pytest.raises(CheckpointError, match=message) as info:
        import_hf(src, tmp_path / "out.yaml")
    assert "config.json" in str(info.value)
    assert not (tmp_path / "out.yaml").exists() and not (tmp_path / "out.safetensors").exists()


def _edit_tensors(src: Path, dst: Path, change) -> Path:
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


TENSOR_REFUSALS = [
    ("bart", lambda t: t.__setitem__("final_logits_bias", t["final_logits_bias"] + 0.5), "final_logits_bias is not zero"),
    ("gpt2", lambda t: t.__setitem__("transformer.h.0.extra.weight", torch.ones(3)), "no place in the spec: transformer.h.0.extra"),
    ("gpt2", lambda t: t.pop("transformer.h.1.mlp.c_fc.bias"), "none of h.1.mlp.c_fc.bias"),
    ("gpt2", lambda t: t.__setitem__("lm_head.weight", torch.randn_like(t["transformer.wte.weight"])), "differs from the embedding table"),
    ("llama-gqa", lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight", torch.zeros(8, 32)), "shape \\(8, 32\\)"),
]


@pytest.mark.parametrize("label,change,message", TENSOR_REFUSALS, ids=["bias", "extra", "missing", "untied", "shape"])
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


def test_the_docs_print_the_mapping_tables():
    doc = (Path(__file__).parents[2] / "docs" / "import.md").read_text()
    assert describe() in doc, "docs/import.md is out of date: paste specc.importers.hf.describe() into it"
