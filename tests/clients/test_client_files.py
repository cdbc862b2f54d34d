"""What a build folder holds for other clients (specc/builder/clients.py, specc/importers/hf/as_config.py)
and the weights it ships once (model.safetensors only with keep_weights / --keep-weights).

The config.json a build writes is held to transformers' own reading of it (its model made from the
config counts the parameters specc counts), and the clients themselves run the builds in their
environment (.venv-clients): test_clients_run_the_builds_in_their_environment runs
tests/clients/test_in_clients_env.py there."""
from __future__ import annotations

import json
import os
import math
import subprocess
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

import specc
from specc.cli import main
from specc.builder.clients import CONFIG, GENAI, GENAI_CONFIG, GENERATION_CONFIG, OPTIMUM, OPTIMUM_DECODER, client_files
from specc.errors import BuildError
from specc.export import inplace, optimum_seq2seq
from specc.export.verify import tolerance
from specc.importers.hf import config_to_spec
from specc.importers.hf.as_config import hf_config
from specc.spec.costs import parameter_shapes
from specc.spec.load import load_spec, loads_spec
from specc.spec.manifest import MANIFEST, WEIGHTS_FILE
from specc.spec.resolve import resolve
from tests.helpers.chattokenizer import chat_spec

ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
CLIENTS_PYTHON = Path(os.environ.get("SPECC_CLIENTS_VENV", ROOT / ".venv-clients")) / "bin" / "python"

# catalog specs a Hugging Face family computes, and the model type that says so
DESCRIBED = {"tiny-gpt2": "gpt2", "gpt2-small": "gpt2", "tiny-llama": "llama", "llama-2-7b": "llama",
             "llama-3-8b": "llama", "llama-3.1-8b": "llama", "mistral-7b": "mistral", "qwen3-0.6b": "qwen3", "gpt-j-6b": "gptj",
             "tiny-bert": "bert", "bert-base": "bert", "mixtral-8x7b": "mixtral", "qwen3-30b-a3b": "qwen3_moe",
             "gpt-oss-20b": "gpt_oss"}


def resolved(name: str):
    return resolve(load_spec(name))


def count(spec) -> int:
    return sum(math.prod(s) for s in parameter_shapes(spec).values())


@pytest.mark.parametrize("name", sorted(DESCRIBED))
def test_config_json_is_read_by_transformers_as_the_spec(name):
    """transformers builds a model of the spec's size from the config (on the meta device: no
    memory), of the family named, and importing the config gives back the spec's computation."""
    r = resolved(name)
    config = hf_config(r).config
    assert config is not None and config["model_type"] == DESCRIBED[name]
    hf = transformers.AutoConfig.for_model(**config)
    arch = getattr(transformers, config["architectures"][0])
    with torch.device("meta"):
        model = arch(hf)
    n = sum(p.numel() for p in model.parameters())  # tied weights once, as specc counts them
    assert n == count(r)


# the mixtures of experts and latent attention the importer reads (tests/helpers/hfmodels.py), and the
# model type each one's config.json is written as (PhiMoE's LongRoPE as transformers computes it,
# one scale at every length, has no config that says so)
MOE_CONFIGS = {"mixtral": "mixtral", "qwen2-moe": "qwen2_moe", "qwen2-moe-window": "qwen2_moe", "qwen3-moe": "qwen3_moe",
               "olmoe": "olmoe", "granitemoe": "granitemoe", "phimoe": "phimoe", "gpt-oss": "gpt_oss",
               "deepseek-v2": "deepseek_v2", "deepseek-v3": "deepseek_v3"}


@pytest.mark.parametrize("label", sorted(MOE_CONFIGS))
def test_an_imported_mixture_of_experts_writes_the_config_it_came_from(label):
    """Each family's inverse: the spec a config imports as is written back as that model type,
    transformers' own config class reads it as a model of the spec's size (its selection bias, a
    buffer, counted), and its config, written out again, imports as the same computation."""
    from tests.helpers.hfmodels import CASES

    _, config_cls, kwargs = CASES[label]
    tensors = {str(i): i for i in range(999)}
    r = resolve(loads_spec(json.dumps(config_to_spec(getattr(transformers, config_cls)(**kwargs).to_dict(), tensors, "m"))))
    config = hf_config(r).config
    assert config is not None and config["model_type"] == MOE_CONFIGS[label], hf_config(r).why
    hf = transformers.AutoConfig.for_model(**config)
    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(hf)
    n = sum(p.numel() for p in model.parameters()) + sum(b.numel() for name, b in model.named_buffers()
                                                         if name.endswith("e_score_correction_bias"))
    assert n == count(r)
    again = resolve(loads_spec(json.dumps(config_to_spec(hf.to_dict(), tensors, r.name))))
    ignored = {"name", "description", "weights", "serving", "dropout", "tokens"}
    assert again.spec.model_dump(exclude=ignored) == r.spec.model_dump(exclude=ignored)


def test_a_config_is_kept_only_where_importing_it_gives_the_spec_back():
    """A GPT-2 whose score is unscaled writes scale_attn_weights false; one with a causal window
    (no GPT-2 field says so) gets no config.json, and the reason names the families tried."""
    dot = loads_spec("specc: 1\nname: g\nextends: tiny-gpt2\ndecoder: {attention: {score: dot}}\n")
    assert hf_config(resolve(dot)).config["scale_attn_weights"] is False
    windowed = loads_spec("specc: 1\nname: g\nextends: tiny-gpt2\n"
                          "decoder: {attention: {pattern: {kind: local, window: 8}}}\n")
    described = hf_config(resolve(windowed))
    assert described.config is None and "tried: gpt2" in described.why
    # a LLaMA with a window is Mistral's, whose sliding_window counts the token itself
    llama = loads_spec("specc: 1\nname: m\nextends: tiny-llama\ndecoder: {attention: {pattern: {kind: local, window: 8}}}\n")
    config = hf_config(resolve(llama)).config
    assert config["model_type"] == "mistral" and config["sliding_window"] == 9
    again = resolve(loads_spec(json.dumps(config_to_spec(config, {"x": 1} | {str(i): i for i in range(9)}, "m"))))
    assert again.spec.decoder.attention.pattern.window == 8


def test_latent_attention_gets_no_optimum_files_and_says_why():
    """DeepSeek's config.json is written back (test_an_imported_mixture_of_experts_writes_the_config_it_came_from),
    but Optimum feeds keys and values per head where the graph caches the latent: no files, and why."""
    from tests.helpers.hfmodels import CASES

    _, config_cls, kwargs = CASES["deepseek-v3"]
    r = resolve(loads_spec(json.dumps(config_to_spec(getattr(transformers, config_cls)(**kwargs).to_dict(),
                                                     {str(i): i for i in range(999)}, "m"))))
    assert hf_config(r).config is not None
    made = client_files(r, {g.name: f"{g.name}.onnx" for g in r.graphs})
    assert CONFIG not in made.files and "caches its latent and rotary key" in made.clients[OPTIMUM]["why"]


@pytest.mark.parametrize("name, client, why", [
    ("tiny-transformer", OPTIMUM, "tried: bart/mbart/marian/pegasus, t5"),  # Vaswani's interleaved sinusoids
    ("tiny-transformer", GENAI, "decoder-only"),
    ("tiny-bert", GENAI, "decoder-only"),
    ("gemma-3-1b", OPTIMUM, "no Hugging Face family"),
    ("qwen3-0.6b", OPTIMUM, "[batch, 8, 0, 64]"),  # Optimum's head size is hidden_size // heads
])
def test_what_a_client_cannot_run_gets_no_file_and_a_reason(name, client, why):
    r = resolved(name)
    made = client_files(r, {g.name: f"{g.name}.onnx" for g in r.graphs})
    assert "files" not in made.clients[client] and why in made.clients[client]["why"]
    if client == OPTIMUM:
        assert CONFIG not in made.files and GENERATION_CONFIG not in made.files
    else:
        assert GENAI_CONFIG not in made.files


def test_genai_config_names_the_graph_and_its_cache():
    r = resolved("tiny-llama")
    genai = client_files(r, {"model": "model.onnx"}).files[GENAI_CONFIG]
    decoder = genai["model"]["decoder"]
    sig = r.graphs[0]
    past = next(t for t in sig.inputs if t.name == "past_key_values.0.key")
    assert (decoder["num_key_value_heads"], decoder["head_size"]) == (past.dims[1], past.dims[3]) == (2, 16)
    assert set(decoder["inputs"]) - {"past_key_names", "past_value_names"} <= {t.name for t in sig.inputs}
    assert decoder["outputs"]["logits"] == "logits" and genai["search"]["past_present_share_buffer"] is False
    assert genai["model"]["eos_token_id"] == r.spec.tokens.eos and genai["model"]["type"] == "decoder"
    assert decoder["filename"] == "model.onnx"


def test_a_build_writes_the_clients_files_hashed_and_no_second_copy_of_the_weights(tmp_path):
    result = specc.build("tiny-gpt2", tmp_path / "b")
    out = result.out_dir
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [MANIFEST, "model.onnx", CONFIG, GENERATION_CONFIG, GENAI_CONFIG, inplace.FILE])
    assert [a["path"] for a in result.artifacts] == ["model.onnx", CONFIG, GENERATION_CONFIG, GENAI_CONFIG, inplace.FILE]
    assert result.manifest["clients"] == {OPTIMUM: {"files": [CONFIG, GENERATION_CONFIG]},
                                          GENAI: {"files": [GENAI_CONFIG]}}
    assert json.loads((out / GENERATION_CONFIG).read_text()) == {"bos_token_id": 999, "eos_token_id": 999}
    assert result.manifest["options"]["keep_weights"] is False
    # the graph is the weights' one copy: every parameter's bytes are in model.onnx
    graph_bytes = (out / "model.onnx").stat().st_size
    assert graph_bytes >= 4 * result.parameters
    assert (out / inplace.FILE).stat().st_size < graph_bytes / 20  # its weights are references into model.onnx
    # a client's file removed from the list and the folder is no cache hit
    manifest = json.loads((out / MANIFEST).read_text())
    manifest["artifacts"] = [a for a in manifest["artifacts"] if a["path"] != CONFIG]
    (out / MANIFEST).write_text(json.dumps(manifest))
    (out / CONFIG).unlink()
    again = specc.build("tiny-gpt2", tmp_path / "b")
    assert not again.cached and (out / CONFIG).is_file()


def test_keep_weights_keeps_model_safetensors_and_is_its_own_build(tmp_path):
    out = tmp_path / "b"
    kept = specc.build("tiny-llama", out, keep_weights=True)
    assert WEIGHTS_FILE in [a["path"] for a in kept.artifacts] and kept.manifest["options"]["keep_weights"] is True
    want = {k: v for k, v in specc.to_torch("tiny-llama", seed=0).state_dict().items()}
    got = load_file(str(out / WEIGHTS_FILE))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert specc.build("tiny-llama", out, keep_weights=True).cached
    # without the flag: not up to date, and the rebuild drops the file the previous build listed
    dropped = specc.build("tiny-llama", out)
    assert not dropped.cached and not (out / WEIGHTS_FILE).exists()
    assert specc.build("tiny-llama", out).cached


def test_cli_keep_weights(tmp_path):
    out = tmp_path / "b"
    result = CliRunner().invoke(main, ["build", "tiny-gpt2", "-o", str(out), "--keep-weights", "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert [a["path"] for a in doc["artifacts"]] == ["model.onnx", CONFIG, GENERATION_CONFIG, GENAI_CONFIG, inplace.FILE, WEIGHTS_FILE]


def test_a_triton_repository_gets_no_client_files(tmp_path):
    result = specc.build("tiny-gpt2", tmp_path / "repo", target="triton")
    assert "clients" not in result.manifest
    assert not any((tmp_path / "repo" / name).exists() for name in (CONFIG, GENERATION_CONFIG, GENAI_CONFIG))


@pytest.mark.skipif(not CLIENTS_PYTHON.exists(),
                    reason="the clients environment is missing: run `make install-clients` (.venv-clients)")
@pytest.mark.parametrize("marks", ["not slow", pytest.param("slow", marks=pytest.mark.slow)])
def test_clients_run_the_builds_in_their_environment(marks):
    """Optimum and onnxruntime-genai, in their own environment, on specc builds
    (tests/clients/test_in_clients_env.py): every test there runs and passes, none skipped (its
    slow ones with make test-slow)."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run([str(CLIENTS_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:logging",
                           "-m", marks, str(ROOT / "tests" / "clients" / "test_in_clients_env.py")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    tail = (proc.stdout + proc.stderr)[-3000:]
    assert proc.returncode == 0, tail
    assert " passed" in proc.stdout and "skipped" not in proc.stdout and "failed" not in proc.stdout, tail


def test_a_spec_that_carries_a_tokenizer_is_described_as_without_one(tmp_path):
    """The tokenizer a spec carries (an import's) changes nothing the graphs compute: its build gets
    the config.json of the same spec without it (Optimum opens a real import's build)."""
    def computed(config):  # the special ids apart: the chat spec names its tokenizer's
        return {k: v for k, v in config.items() if not k.endswith("_token_id")}

    plain = hf_config(resolved("tiny-llama")).config
    carried = hf_config(resolve(load_spec(chat_spec(tmp_path)))).config
    assert plain is not None and carried is not None and computed(carried) == computed(plain)
    assert carried["pad_token_id"] == 0  # chat_spec's


def test_window_caches_get_no_client_files_and_say_why():
    """A decoder whose sliding layers keep window caches gets no files for clients that feed every
    cache back at the sequence's length (onnxruntime-genai failed on one)."""
    r = resolve(loads_spec("specc: 1\nname: m\nextends: tiny-llama\ndecoder: {attention: {pattern: {kind: local, window: 8}}}\n"))
    made = client_files(r, {"model": "model.onnx"})
    assert made.files == {}
    for client in (OPTIMUM, GENAI):
        assert "keep only their window" in made.clients[client]["why"]


def _plain_session(path, graph: str):
    return ort.InferenceSession(str(path))


# tiny-transformer with Marian's sinusoids (every sine before the cosines) and LayerNorm eps: what
# Hugging Face's MarianMTModel computes
TINY_MARIAN = ("specc: 1\nname: tiny-marian\nextends: tiny-transformer\n"
               "position: {kind: sinusoidal, layout: halves, max_length: 128}\nnorm: {eps: 1.0e-5}\n")
T5_LIKE = ("specc: 1\nname: tiny-t5\nextends: tiny-transformer\nposition: {kind: bucketed, buckets: 8, max_distance: 16, "
           "max_length: 128}\nnorm: {kind: rmsnorm, placement: pre, final: true, eps: 1.0e-6}\n"
           "vocab: {scale: none}\nencoder: {attention: {score: dot, bias: false}, ffn: {bias: false}}\n"
           "decoder: {attention: {score: dot, bias: false}, ffn: {bias: false}}\n"
           "outputs: [{kind: lm, name: logits, scale: 0.125}]\n")


@pytest.mark.parametrize("text, model_type", [(TINY_MARIAN, "marian"), (T5_LIKE, "t5")])
def test_an_encoder_decoder_config_json_is_read_by_transformers_as_the_spec(text, model_type):
    """transformers' own config class, made from the config.json an encoder-decoder gets and
    written out again, imports as the spec's computation."""
    r = resolve(loads_spec(text))
    config = client_files(r, {g.name: f"{g.name}.onnx" for g in r.graphs}).files.get(CONFIG)
    assert config is not None and config["model_type"] == model_type, hf_config(r).why
    again = transformers.AutoConfig.for_model(**config).to_dict()
    spec = resolve(loads_spec(json.dumps(config_to_spec(again, {str(i): i for i in range(99)}, r.name))))
    assert spec.spec.model_dump(exclude={"name", "description", "weights", "serving", "dropout", "tokens"}) == \
        r.spec.model_dump(exclude={"name", "description", "weights", "serving", "dropout", "tokens"})


def test_an_encoder_decoder_build_writes_optimums_decoder_with_the_weights_once(tmp_path):
    """decoder_model_merged.onnx: listed, hashed and checked in the manifest, its weights read
    from the build's own graph files (the file holds none of them), and the check fails a
    composition that runs the wrong branch."""
    result = specc.build(loads_spec(TINY_MARIAN), tmp_path / "b")
    out = result.out_dir
    entry = result.manifest["clients"][OPTIMUM]
    assert entry["files"] == [CONFIG, GENERATION_CONFIG, OPTIMUM_DECODER] and entry["max_abs_diff"] <= 1e-5
    assert OPTIMUM_DECODER in [a["path"] for a in result.artifacts]
    merged = out / OPTIMUM_DECODER
    assert merged.stat().st_size < (out / "decoder.onnx").stat().st_size / 4
    import onnx

    model = onnx.load(str(merged), load_external_data=False)
    places = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert places == {"decoder.onnx", "encoder.onnx"}
    # the branches swapped: the first step would read the (empty) cross cache it is given
    branch = model.graph.node[0]
    then, other = (next(a for a in branch.attribute if a.name == n) for n in ("then_branch", "else_branch"))
    then.g.name, other.g.name = other.g.name, then.g.name
    swapped = onnx.GraphProto()
    swapped.CopyFrom(then.g)
    then.g.CopyFrom(other.g)
    other.g.CopyFrom(swapped)
    merged.write_bytes(model.SerializeToString())
    r = resolve(loads_spec(TINY_MARIAN))
    with pytest.raises(BuildError, match="differs from the build's decoder graph"):
        optimum_seq2seq.check(out, r, {"encoder": "encoder.onnx", "decoder": "decoder.onnx"},
                              _plain_session,
                              *tolerance("onnx", "fp32"))


def test_optimums_decoder_reads_weights_kept_as_external_data(tmp_path, monkeypatch):
    """Where the graphs keep their weights in .onnx.data files (past the protobuf limit), the merged
    decoder reads them there, and the build's check runs it (the folder moved first: the
    references are relative)."""
    import onnx

    import specc.export.onnx as onnx_export

    monkeypatch.setattr(onnx_export, "EXTERNAL_DATA_BYTES", 1)
    result = specc.build(loads_spec(TINY_MARIAN), tmp_path / "b")
    assert result.manifest["clients"][OPTIMUM]["max_abs_diff"] <= 1e-5
    moved = tmp_path / "moved"
    result.out_dir.rename(moved)
    model = onnx.load(str(moved / OPTIMUM_DECODER), load_external_data=False)
    places = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
    assert places == {"decoder.onnx.data", "encoder.onnx.data"}
    r = resolve(loads_spec(TINY_MARIAN))
    assert optimum_seq2seq.check(moved, r, {"encoder": "encoder.onnx", "decoder": "decoder.onnx"},
                                 _plain_session,
                                 *tolerance("onnx", "fp32")) <= 1e-5
