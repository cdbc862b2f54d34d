"""A specc build folder opened by the clients people use, in their own environment (.venv-clients,
`make install-clients`: optimum-onnx, which pins transformers below 4.58, and onnxruntime-genai):
Optimum's ORTModelForCausalLM, ORTModelForFeatureExtraction and ORTModelForSeq2SeqLM load the folder as it is, and
onnxruntime-genai runs it through the genai_config.json the build writes; each gives the outputs
and greedy tokens specc.runtime.Session gives (what `specc run` / `specc generate` print).
tests/clients/test_client_files.py runs this file in that environment."""
from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import specc
from specc.runtime import Session
from specc.spec.load import loads_spec

optimum_ort = pytest.importorskip("optimum.onnxruntime", reason="the clients environment is missing: make install-clients")
og = pytest.importorskip("onnxruntime_genai", reason="the clients environment is missing: make install-clients")
torch = pytest.importorskip("torch")

from tests.helpers.hfmodels import hf_model  # noqa: E402

from specc.importers.hf import import_hf  # noqa: E402

PROMPTS = [[5, 17, 400, 23, 9], [88, 3]]  # two lengths: the second row is left-padded
NEW = 12
# decoders no Hugging Face family computes (no config.json): onnxruntime-genai runs them all the same
VARIANTS = {"alibi": "position: {kind: alibi}", "relative": "position: {kind: relative, max_length: 128}",
            "bigbird": "decoder: {attention: {pattern: {kind: bigbird, block: 4, window: 1, global: 1, random: 1}}}"}


# decoders other Hugging Face families compute (the build writes their config.json): rope scaling
# (Llama 3.1's), Gemma (scaled embedding, 1 + weight norms, tanh GeGLU), GPT-NeoX (a quarter of
# each head rotated, YaRN, attention and MLP side by side)
FAMILIES = {
    "llama3-rope": "extends: tiny-llama\nposition: {kind: rotary, max_length: 128, scaling: {kind: llama3, factor: 8.0, "
                   "low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_length: 32}}",
    "gemma": "extends: tiny-llama\nvocab: {size: 1000, tie_output: false, scale: sqrt_d_model}\n"
             "norm: {kind: rmsnorm, unit_offset: true}\ndecoder: {ffn: {activation: geglu_tanh}}",
    "neox-yarn": "extends: tiny-gpt2\nvocab: {tie_output: false}\nposition: {kind: rotary, max_length: 128, fraction: 0.25, "
                 "scaling: {kind: yarn, factor: 4.0, original_max_length: 32}}\nnorm: {kind: layernorm, eps: 1.0e-5}\n"
                 "decoder: {parallel: two_norms, ffn: {activation: gelu}}",
}


# the builds whose seeded weights already give varied tokens (x8 makes this one repeat two tokens)
UNSCALED = {"neox-yarn": 1}


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """Builds whose seeded weights are scaled up (matrices x8, but UNSCALED), so that greedy
    decoding picks varied tokens and a wrong cache or position shows in them."""
    specs = {name: name for name in ("tiny-gpt2", "tiny-llama", "tiny-bert")}
    specs.update({k: loads_spec(f"specc: 1\nname: {k}\nextends: tiny-gpt2\n{text}\n") for k, text in VARIANTS.items()})
    specs.update({k: loads_spec(f"specc: 1\nname: {k}\n{text}\n") for k, text in FAMILIES.items()})
    made = {}
    for name, spec in specs.items():
        root = tmp_path_factory.mktemp(name)
        specc.save_weights(specc.to_torch(spec, seed=0), root / "w.safetensors")
        weights = load_file(str(root / "w.safetensors"))
        scale = UNSCALED.get(name, 8)
        save_file({k: v * scale if v.ndim == 2 else v for k, v in weights.items()}, str(root / "x.safetensors"))
        made[name] = specc.build(spec, root / "build", weights=root / "x.safetensors").out_dir
    return made


def specc_tokens(build, prompts=PROMPTS) -> list[list[int]]:
    return Session(build).generate(prompts, max_new_tokens=NEW).new_ids


def left_padded(prompts, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", *FAMILIES])
def test_optimum_causal_lm_generates_specc_tokens(builds, name):
    build = builds[name]
    want = specc_tokens(build)
    assert all(len(set(row)) >= 3 for row in want), want  # varied: a broken cache would show
    model = optimum_ort.ORTModelForCausalLM.from_pretrained(build)
    session = Session(build)
    pad = session.info.pad_id
    ids, mask = left_padded(PROMPTS, pad)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, num_beams=1,
                         pad_token_id=pad, eos_token_id=None)
    got = out[:, ids.shape[1]:].tolist()
    assert got == want
    # one forward on the padded batch: the logits of every real token as specc run computes them
    logits = model(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    ref = session.run(input_ids=ids.numpy(), attention_mask=mask.numpy())["logits"]
    real = mask.numpy().astype(bool)
    np.testing.assert_allclose(logits.detach().numpy()[real], ref[real], atol=1e-4, rtol=1e-4)


def test_optimum_feature_extraction_gives_specc_hidden_states(builds):
    build = builds["tiny-bert"]
    model = optimum_ort.ORTModelForFeatureExtraction.from_pretrained(build)
    ids, mask = left_padded(PROMPTS, 0)
    types = torch.zeros_like(ids)
    types[:, -2:] = 1
    got = model(input_ids=ids, attention_mask=mask, token_type_ids=types).last_hidden_state.detach().numpy()
    ref = Session(build).run(input_ids=ids.numpy(), attention_mask=mask.numpy(), token_type_ids=types.numpy())
    real = mask.numpy().astype(bool)
    np.testing.assert_allclose(got[real], ref["last_hidden_state"][real], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", *VARIANTS, *FAMILIES])
def test_onnxruntime_genai_generates_specc_tokens(builds, name):
    build = builds[name]
    assert (build / "genai_config.json").is_file()
    assert (build / "config.json").is_file() == (name not in VARIANTS)
    model = og.Model(str(build))
    for prompt in [*PROMPTS, [5, 17, 400, 23, 9, 44, 61, 2, 90, 11]]:  # the last one past a window of 3
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + NEW, do_sample=False)
        generator = og.Generator(model, params)
        generator.append_tokens(np.array([prompt], dtype=np.int32))
        got = []
        while not generator.is_done():
            generator.generate_next_token()
            got.append(int(generator.get_next_tokens()[0]))
        assert got == specc_tokens(build, [prompt])[0]


# encoder-decoders of three Hugging Face families (tests/helpers/hfmodels.py), made at random (the seed
# chosen so that greedy decoding varies), imported with `specc import hf` and built:
# family -> (seed, config changes)
SEQ2SEQ = {"marian": (2, {}), "bart": (2, {"decoder_layers": 3}), "t5": (1, {})}
SOURCES = [[5, 7, 9, 11, 3], [4, 8, 15, 16, 23, 42, 17]]

# decoders of the families whose config.json is written from their own rules (BLOOM, Falcon's two
# forms, StableLM with its layers side by side), made at random (tests/helpers/hfmodels.py)
IMPORTED = ("bloom", "falcon-new", "falcon-7b-form", "stablelm-parallel")


def _imported(tmp_path, label: str, seed: int = 0, **changes):
    """tests/helpers/hfmodels.py's model LABEL, its checkpoint imported with `specc import hf` and built."""
    hf = hf_model(label, seed, **changes)
    hf.generation_config.forced_eos_token_id = None  # BART's and Marian's default; specc's generate forces nothing
    hf.save_pretrained(tmp_path / "ckpt")
    spec, _ = import_hf(tmp_path / "ckpt", tmp_path / "imported.yaml")
    return hf, specc.build(spec, tmp_path / "build").out_dir


@pytest.mark.slow  # beside the decoders above, which make test runs (make test-slow runs these too)
@pytest.mark.parametrize("family", IMPORTED)
def test_optimum_causal_lm_generates_the_tokens_of_specc_and_transformers(tmp_path, family):
    """The config.json these families get (their own fields, written from the spec) opens the
    build in ORTModelForCausalLM, whose greedy tokens are specc's and transformers' own."""
    hf, build = _imported(tmp_path, family)
    assert (build / "config.json").is_file()
    model = optimum_ort.ORTModelForCausalLM.from_pretrained(build)
    ours = Session(build).generate(SOURCES, max_new_tokens=NEW, eos_id=-1).new_ids
    assert ours[0] != ours[1], ours
    for prompt, want in zip(SOURCES, ours):
        ids = torch.tensor([prompt])
        options = dict(attention_mask=torch.ones_like(ids), max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                       num_beams=1)
        got = model.generate(ids, **options)[0, len(prompt):].tolist()
        with torch.no_grad():
            theirs = hf.generate(ids, **options)[0, len(prompt):].tolist()
        assert got == want == theirs


@pytest.mark.parametrize("family", sorted(SEQ2SEQ))
def test_optimum_seq2seq_lm_generates_the_tokens_of_specc_and_transformers(tmp_path, family):
    """ORTModelForSeq2SeqLM opens the build (its encoder graph, and decoder_model_merged.onnx
    composed from the build's graphs) and greedy decoding gives specc's tokens, and the tokens
    transformers' own model gives on the checkpoint the build was imported from."""
    seed, changes = SEQ2SEQ[family]
    hf, build = _imported(tmp_path, family, seed, **changes)
    assert (build / "decoder_model_merged.onnx").is_file()
    model = optimum_ort.ORTModelForSeq2SeqLM.from_pretrained(build)
    assert model.decoder.is_merged
    ours = Session(build).generate(SOURCES, max_new_tokens=NEW, eos_id=-1).new_ids
    assert ours[0] != ours[1] and any(len(set(row)) >= 2 for row in ours), ours  # varied: a wrong cache would show
    for source, want in zip(SOURCES, ours):
        ids = torch.tensor([source])
        mask = torch.ones_like(ids)
        options = dict(attention_mask=mask, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, num_beams=1)
        out = model.generate(ids, **options)
        with torch.no_grad():
            theirs = hf.generate(ids, **options)[0, 1:].tolist()
        assert out[0, 1:].tolist() == want == theirs
        # one forward on the whole target: the logits specc run computes
        logits = model(input_ids=ids, attention_mask=mask, decoder_input_ids=out[:, :-1]).logits.detach().numpy()
        ref = Session(build).run(input_ids=ids.numpy(), attention_mask=mask.numpy(),
                                 decoder_input_ids=out[:, :-1].numpy())["logits"]
        np.testing.assert_allclose(logits, ref, atol=1e-4, rtol=1e-4)
