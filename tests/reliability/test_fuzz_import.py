"""Random JSON values in the config.json (and the weights index) of tiny GPT-2, LLaMA and BERT
checkpoints, through `specc import hf`.

Whatever the values, the importer either imports (exit 0, both files written) or refuses with exit
1 and one line naming the file (`.../config.json: FIELD ...`, or the index), never "internal
error", a traceback, a hang or a memory blow-up, and writes nothing when it refuses. The values
replace fields the importer reads, fields it refuses and fields it ignores, or delete them; they
are drawn from every JSON type, with integers up to 10^30 (a layer count that large would make
one object per layer), NaN and infinities, nesting and the strings the tables know.

Bounded like the spec fuzzers: SPECC_FUZZ_EXAMPLES (default 4) x 15 configs and x 5 indexes per
run, derandomized (the same values every run); the checkpoints are written once per module from
transformers configs built here (nothing is downloaded).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, example, given, note, settings
from hypothesis import strategies as st

from specc.cli import main

transformers = pytest.importorskip("transformers")

EXAMPLES = int(os.environ.get("SPECC_FUZZ_EXAMPLES", "4"))
COMMON = dict(deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# label -> (model class, config class, config kwargs): tiny, as in tests/importers/test_hf_import.py
MODELS = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(vocab_size=99, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                                   bos_token_id=98, eos_token_id=98)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                       num_key_value_heads=2, intermediate_size=48, vocab_size=99,
                                                       max_position_embeddings=64, bos_token_id=1, eos_token_id=2)),
    "bert": ("BertForSequenceClassification", "BertConfig", dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                                 intermediate_size=37, vocab_size=99,
                                                                 max_position_embeddings=64, num_labels=3)),
}
# fields the importer reads but a saved config may not hold (the defaults' and the hooks' fields)
EXTRA_FIELDS = ["model_type", "architectures", "n_inner", "scale_attn_weights", "head_dim", "rope_scaling",
                "rope_theta", "rope_parameters", "partial_rotary_factor", "id2label", "num_labels",
                "decoder_vocab_size", "position_embedding_type", "is_decoder", "unknown_field"]
KNOWN = ["gpt2", "llama", "bert", "bart", "GPT2LMHeadModel", "LlamaForCausalLM", "BertModel",
         "BertForSequenceClassification", "gelu", "gelu_new", "silu", "relu", "default", "linear", "absolute", ""]

json_scalars = st.one_of(
    st.none(), st.booleans(),
    st.integers(-5, 200), st.sampled_from([0, -1, 1, 2, 3, 4, 98, 99, 10**9, 2**63, 10**30, -(10**30)]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1e-5, 32.0, 1e308]),
    st.text(max_size=12), st.sampled_from(KNOWN),
)
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.sampled_from(["rope_type", "rope_theta", "type", "factor", "0", "1"]),
                                                 inner, max_size=3)), max_leaves=6)
DELETE = object()

# how many examples went each way, printed at the end of the module (pytest -s)
COUNTS = {"config imported": 0, "config refused": 0, "index imported": 0, "index refused": 0}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    import torch

    root = tmp_path_factory.mktemp("fuzz-import")
    out = {}
    for label, (model_cls, cfg_cls, kwargs) in MODELS.items():
        torch.manual_seed(0)
        getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**kwargs)).save_pretrained(root / label)
        out[label] = root / label
    return out


def run_import(ckpt: Path, out_dir: Path) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["import", "hf", str(ckpt), "-o", str(out_dir / "out.yaml")])
    return result.exit_code, result.output


@pytest.fixture(scope="module", autouse=True)
def report_counts():
    """Prints how many fuzzed checkpoints were imported and refused (pytest -s shows it)."""
    yield
    print(f"\nfuzz import: {COUNTS}")


def check(code: int, output: str, ckpt: Path, out_dir: Path, located_in: tuple[str, ...]) -> bool:
    """Whether it imported; asserts it either did (both files) or refused, located, writing nothing."""
    note(output)
    assert "internal error" not in output and "Traceback" not in output, output
    written = sorted(p.name for p in out_dir.iterdir())
    if code == 0:
        assert written == ["out.safetensors", "out.yaml"], (output, written)
        return True
    assert code == 1, (code, output)
    assert len(output.strip().splitlines()) == 1 and output.startswith("specc: error: "), output
    assert str(ckpt) in output and any(name in output for name in located_in), output
    assert written == [], (output, written)
    return False


# the fields of each saved config that are fuzzed (test_the_fuzzed_fields_are_the_saved_configs)
KEYS: dict[str, list[str]] = {
    "gpt2": ["activation_function", "add_cross_attention", "architectures", "attn_pdrop", "bos_token_id",
             "eos_token_id", "layer_norm_epsilon", "model_type", "n_embd", "n_head", "n_inner", "n_layer",
             "n_positions", "pad_token_id", "resid_pdrop", "scale_attn_by_inverse_layer_idx", "scale_attn_weights",
             "tie_word_embeddings", "vocab_size"],
    "llama": ["architectures", "attention_bias", "attention_dropout", "bos_token_id", "eos_token_id", "head_dim",
              "hidden_act", "hidden_size", "intermediate_size", "max_position_embeddings", "mlp_bias", "model_type",
              "num_attention_heads", "num_hidden_layers", "num_key_value_heads", "pad_token_id", "rms_norm_eps",
              "rope_parameters", "tie_word_embeddings", "vocab_size"],
    "bert": ["add_cross_attention", "architectures", "attention_probs_dropout_prob", "hidden_act",
             "hidden_dropout_prob", "hidden_size", "id2label", "intermediate_size", "is_decoder", "layer_norm_eps",
             "max_position_embeddings", "model_type", "num_attention_heads", "num_hidden_layers", "pad_token_id",
             "tie_word_embeddings", "type_vocab_size", "vocab_size"],
}


@st.composite
def config_edits(draw):
    """(label, {field: new value or DELETE}) for one to three fields of that checkpoint's config."""
    label = draw(st.sampled_from(sorted(MODELS)))
    fields = draw(st.lists(st.sampled_from(sorted(set(KEYS[label]) | set(EXTRA_FIELDS))), min_size=1, max_size=3,
                           unique=True))
    return label, {f: draw(st.one_of(st.just(DELETE), json_values)) for f in fields}


def test_the_fuzzed_fields_are_the_saved_configs(checkpoints):
    for label, ckpt in checkpoints.items():
        saved = json.loads((ckpt / "config.json").read_text())
        assert set(KEYS[label]) <= set(saved), (label, sorted(set(KEYS[label]) - set(saved)))


@settings(max_examples=15 * EXAMPLES, **COMMON)
@example(edit=("gpt2", {"unknown_field": 1}))  # the import path, for each family, every run
@example(edit=("llama", {"rope_parameters": DELETE}))
@example(edit=("bert", {"id2label": DELETE, "num_labels": 3}))
@given(edit=config_edits())
def test_fuzzed_config_imports_or_is_refused_with_a_location(checkpoints, edit):
    label, edits = edit
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out_dir = Path(tmp) / label, Path(tmp) / "out"
        shutil.copytree(checkpoints[label], ckpt)
        out_dir.mkdir()
        cfg = json.loads((ckpt / "config.json").read_text())
        for field, value in edits.items():
            if value is DELETE:
                cfg.pop(field, None)
            else:
                cfg[field] = value
        (ckpt / "config.json").write_text(json.dumps(cfg))
        note(f"{label}: {edits}")
        code, output = run_import(ckpt, out_dir)
        COUNTS["config imported" if check(code, output, ckpt, out_dir, ("config.json",)) else "config refused"] += 1


@settings(max_examples=5 * EXAMPLES, **COMMON)
@example(entries=["shard.safetensors", "./shard.safetensors"])
@given(entries=st.lists(st.one_of(json_values, st.sampled_from(["shard.safetensors", "./shard.safetensors", "..",
                                                                 "../shard.safetensors", "/shard.safetensors",
                                                                 "sub/../shard.safetensors", "config.json", "."])),
                        min_size=1, max_size=3))
def test_fuzzed_weights_index_imports_or_is_refused_with_a_location(checkpoints, entries):
    with tempfile.TemporaryDirectory() as tmp:
        ckpt, out_dir = Path(tmp) / "gpt2", Path(tmp) / "out"
        shutil.copytree(checkpoints["gpt2"], ckpt)
        out_dir.mkdir()
        (ckpt / "model.safetensors").rename(ckpt / "shard.safetensors")
        weight_map = {f"t{i}": e for i, e in enumerate(entries)}
        (ckpt / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        note(str(weight_map))
        code, output = run_import(ckpt, out_dir)
        # refused naming the index, or a file it names (with "named by model.safetensors.index.json")
        imported = check(code, output, ckpt, out_dir, ("model.safetensors.index.json",))
        COUNTS["index imported" if imported else "index refused"] += 1
