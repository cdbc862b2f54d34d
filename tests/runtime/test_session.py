"""specc.runtime.Session: loading a build directory, choosing execution providers, and run() on
decoder, encoder and encoder-decoder builds, checked against the torch model the build came from
(specc.to_torch with the build's seed)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

import specc
from specc.runtime import RunError, Session, choose_providers
from specc.runtime.arrays import save_npz
from specc.runtime.cache import empty_cache
from specc.runtime.graph import shape_of
from specc.spec.io import present_to_past as as_past

ort = pytest.importorskip("onnxruntime")

ATOL = 1e-4
CPU, CUDA, TRT = "CPUExecutionProvider", "CUDAExecutionProvider", "TensorrtExecutionProvider"


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    """name -> build directory; each catalog spec built once for this module. The directories sit
    under the session's base temp dir, so the other runtime test modules find them already built
    (specc.build reuses an up-to-date output directory)."""
    done: dict = {}

    def get(name: str):
        if name not in done:
            done[name] = specc.build(name, tmp_path_factory.getbasetemp() / "specc-runtime-builds" / name).out_dir
        return done[name]

    return get


@pytest.fixture(scope="module")
def models():
    done: dict = {}

    def get(name: str):
        if name not in done:
            done[name] = specc.to_torch(name, seed=0)
        return done[name]

    return get


def torch_run(model, **inputs) -> dict[str, np.ndarray]:
    with torch.no_grad():
        out = model(**{k: torch.as_tensor(np.asarray(v), dtype=torch.int64) for k, v in inputs.items()})
    return {k: v.numpy() for k, v in out.items()}


def assert_close(got: np.ndarray, want: np.ndarray, atol: float = ATOL) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    diff = float(np.abs(got - want).max())
    assert diff <= atol, diff


# --- providers ------------------------------------------------------------------------------------


def test_choose_providers_prefers_tensorrt_then_cuda_then_cpu():
    available = ["AzureExecutionProvider", CPU, CUDA, TRT]
    assert choose_providers(available) == [TRT, CUDA, CPU]
    assert choose_providers([CPU, CUDA]) == [CUDA, CPU]
    assert choose_providers([CPU, "AzureExecutionProvider"]) == [CPU]
    # CPU always ends the list, even when it is not reported available
    assert choose_providers([CUDA]) == [CUDA, CPU]


def test_choose_providers_keeps_the_requested_order():
    available = [CPU, CUDA, TRT]
    assert choose_providers(available, [CUDA]) == [CUDA, CPU]
    assert choose_providers(available, [CPU, CUDA]) == [CPU, CUDA]
    assert choose_providers(available, [CUDA, TRT]) == [CUDA, TRT, CPU]


def test_choose_providers_refuses_a_provider_that_is_not_available():
    with pytest.raises(RunError, match="CUDAExecutionProvider") as info:
        choose_providers([CPU], [CUDA])
    assert "not available" in str(info.value)
    assert CPU in str(info.value)  # names what is available


def test_session_loads_a_build_and_reports_the_provider_that_runs(builds):
    s = Session(builds("tiny-gpt2"))
    assert s.provider == CPU  # this machine has no GPU provider
    assert s.providers == [CPU]
    assert s.architecture == "decoder"
    assert set(s.graphs) == {"model"}
    assert s.output_names == ["logits"]
    assert s.tokens.get("eos") == 999
    assert s.manifest == json.loads((builds("tiny-gpt2") / "manifest.json").read_text())
    # asking for CPU explicitly gives the same
    assert Session(builds("tiny-gpt2"), providers=[CPU]).providers == [CPU]


def test_session_with_an_unavailable_provider_raises_run_error(builds):
    missing = next(p for p in (TRT, CUDA, "NoSuchExecutionProvider") if p not in ort.get_available_providers())
    with pytest.raises(RunError, match=missing):
        Session(builds("tiny-gpt2"), providers=[missing])


def test_a_directory_without_manifest_is_a_run_error_naming_it(tmp_path):
    empty = tmp_path / "not-a-build"
    empty.mkdir()
    with pytest.raises(RunError, match="manifest.json") as info:
        Session(empty)
    assert str(empty) in str(info.value)
    with pytest.raises(RunError, match="nowhere"):
        Session(tmp_path / "nowhere")


def test_a_manifest_that_is_not_json_is_a_run_error(tmp_path, builds):
    broken = tmp_path / "broken"
    shutil.copytree(builds("tiny-gpt2"), broken)
    (broken / "manifest.json").write_text("{not json")
    with pytest.raises(RunError, match="manifest"):
        Session(broken)


def test_a_missing_graph_file_is_a_run_error(tmp_path, builds):
    broken = tmp_path / "broken"
    shutil.copytree(builds("tiny-gpt2"), broken)
    (broken / "model.onnx").unlink()
    with pytest.raises(RunError, match="model.onnx"):
        Session(broken)


# --- run(): decoder -------------------------------------------------------------------------------


def test_decoder_run_with_input_ids_only_matches_torch(builds, models):
    s = Session(builds("tiny-gpt2"))
    ids = np.array([[5, 17, 300, 999, 2]], dtype=np.int64)
    out = s.run(input_ids=ids)
    want = torch_run(models("tiny-gpt2"), input_ids=ids)
    assert sorted(out) == ["logits"] + sorted(f"present.{i}.{kv}" for i in range(2) for kv in ("key", "value"))
    assert out["logits"].shape == (1, 5, 1000)
    assert_close(out["logits"], want["logits"])
    assert out["present.0.key"].shape == (1, 4, 5, 16)
    # a nested list and a 1-D list are read as the same one-row batch
    assert_close(s.run(input_ids=ids.tolist())["logits"], out["logits"], 0)
    assert_close(s.run(input_ids=[5, 17, 300, 999, 2])["logits"], out["logits"], 0)


def test_decoder_run_respects_an_explicit_attention_mask(builds, models):
    s = Session(builds("tiny-gpt2"))
    ids = np.array([[999, 999, 5, 6, 7], [1, 2, 3, 4, 5]], dtype=np.int64)
    mask = np.array([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=np.int64)
    got = s.run(input_ids=ids, attention_mask=mask)["logits"]
    want = torch_run(models("tiny-gpt2"), input_ids=ids, attention_mask=mask)["logits"]
    assert_close(got, want)
    # the padded row's real tokens see what the same row alone sees (positions count from the mask)
    alone = s.run(input_ids=[[5, 6, 7]])["logits"]
    assert_close(got[0, 2:], alone[0])
    # and the mask made a difference
    assert float(np.abs(got[0] - s.run(input_ids=ids[:1])["logits"][0]).max()) > 1e-3


def test_decoder_run_respects_explicit_position_ids(builds, models):
    s = Session(builds("tiny-gpt2"))
    ids = np.array([[5, 6, 7]], dtype=np.int64)
    pos = np.array([[10, 11, 12]], dtype=np.int64)
    got = s.run(input_ids=ids, position_ids=pos)["logits"]
    assert_close(got, torch_run(models("tiny-gpt2"), input_ids=ids, position_ids=pos)["logits"])
    default = s.run(input_ids=ids)["logits"]
    assert float(np.abs(got - default).max()) > 1e-3  # learned positions: they matter


def test_decoder_run_continues_from_a_cache(builds, models):
    """present.* fed back as past_key_values.* gives the logits of the whole sequence."""
    s = Session(builds("tiny-llama"))
    ids = np.array([[5, 6, 7, 8, 9]], dtype=np.int64)
    first = s.run(input_ids=ids[:, :3])
    past = {"past_key_values." + k[len("present."):]: v for k, v in first.items() if k.startswith("present.")}
    second = s.run(input_ids=ids[:, 3:], **past)
    whole = torch_run(models("tiny-llama"), input_ids=ids)["logits"]
    assert_close(second["logits"], whole[:, 3:])
    assert second["present.0.key"].shape[2] == 5


def test_run_refuses_unknown_inputs(builds):
    s = Session(builds("tiny-gpt2"))
    with pytest.raises(RunError, match="token_type_ids") as info:
        s.run(input_ids=[[1, 2]], token_type_ids=[[0, 0]])  # tiny-gpt2 has no token types
    assert "attention_mask" in str(info.value)  # names what the model takes
    with pytest.raises(RunError, match="decoder_input_ids"):
        s.run(input_ids=[[1, 2]], decoder_input_ids=[[0]])


def test_run_refuses_bad_input_ids(builds):
    s = Session(builds("tiny-gpt2"))
    with pytest.raises(RunError, match="input_ids"):
        s.run(attention_mask=[[1, 1]])
    with pytest.raises(RunError, match="input_ids"):
        s.run(input_ids=[[1.5, 2.0]])
    with pytest.raises(RunError, match="input_ids"):
        s.run(input_ids=np.zeros((1, 0), dtype=np.int64))
    with pytest.raises(RunError, match="input_ids"):
        s.run(input_ids=np.zeros((1, 2, 3), dtype=np.int64))


def test_run_with_a_token_id_past_the_vocabulary_is_a_run_error(builds):
    s = Session(builds("tiny-gpt2"))
    with pytest.raises(RunError, match="1000"):
        s.run(input_ids=[[5, 1000]])


def test_run_with_a_negative_token_id_is_a_run_error(builds):
    s = Session(builds("tiny-gpt2"))
    with pytest.raises(RunError):
        s.run(input_ids=[[5, -1]])


def test_run_with_ragged_rows_is_a_run_error(builds):
    s = Session(builds("tiny-gpt2"))
    with pytest.raises(RunError):
        s.run(input_ids=[[1, 2, 3], [4, 5]])


# --- run(): encoder -------------------------------------------------------------------------------


def test_encoder_run_matches_torch_with_default_token_types(builds, models):
    s = Session(builds("tiny-bert"))
    assert s.architecture == "encoder"
    assert "token_type_ids" in s.graphs["model"].inputs
    model = models("tiny-bert")
    ids = np.array([[101, 7, 8, 9, 102], [101, 40, 41, 0, 0]], dtype=np.int64)
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=np.int64)
    got = s.run(input_ids=ids, attention_mask=mask)
    assert set(s.output_names) == {"last_hidden_state", "pooler_output"}
    assert set(got) == {"last_hidden_state", "pooler_output"}
    want = torch_run(model, input_ids=ids, attention_mask=mask)
    for name in ("last_hidden_state", "pooler_output"):
        assert_close(got[name], want[name])
    # the default token types are zeros
    zeros = s.run(input_ids=ids, attention_mask=mask, token_type_ids=np.zeros_like(ids))
    assert_close(zeros["last_hidden_state"], got["last_hidden_state"], 0)
    # and explicit token types are used
    types = np.array([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0]], dtype=np.int64)
    typed = s.run(input_ids=ids, attention_mask=mask, token_type_ids=types)
    assert_close(typed["last_hidden_state"], torch_run(model, input_ids=ids, attention_mask=mask,
                                                       token_type_ids=types)["last_hidden_state"])
    assert float(np.abs(typed["last_hidden_state"] - got["last_hidden_state"]).max()) > 1e-3
    # no mask: all ones
    assert_close(s.run(input_ids=ids[:1])["pooler_output"], got["pooler_output"][:1])


def test_encoder_run_refuses_unknown_inputs(builds):
    s = Session(builds("tiny-bert"))
    with pytest.raises(RunError, match="position_ids"):
        s.run(input_ids=[[1, 2]], position_ids=[[0, 1]])


def test_generate_on_an_encoder_build_is_a_run_error(builds):
    s = Session(builds("tiny-bert"))
    with pytest.raises(RunError, match="decoder"):
        s.generate([1, 2, 3], max_new_tokens=2)


# --- run(): encoder-decoder -----------------------------------------------------------------------


def test_encoder_decoder_run_matches_torch(builds, models):
    s = Session(builds("tiny-transformer"))
    assert s.architecture == "encoder-decoder"
    assert set(s.graphs) == {"encoder", "decoder"}
    model = models("tiny-transformer")
    src = np.array([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0]], dtype=np.int64)
    mask = np.array([[1] * 6, [1, 1, 1, 0, 0, 0]], dtype=np.int64)
    dec = np.array([[0, 44, 45], [0, 46, 46]], dtype=np.int64)
    got = s.run(input_ids=src, attention_mask=mask, decoder_input_ids=dec)
    want = torch_run(model, input_ids=src, attention_mask=mask, decoder_input_ids=dec)
    assert got["logits"].shape == (2, 3, 1000)
    assert_close(got["logits"], want["logits"])
    assert "encoder_last_hidden_state" in got
    with torch.no_grad():
        enc = model.encode(input_ids=torch.from_numpy(src), attention_mask=torch.from_numpy(mask))
    assert_close(got["encoder_last_hidden_state"], enc["last_hidden_state"].numpy())
    assert got["present.0.decoder.key"].shape[:3] == (2, 4, 3)
    # the source mask matters: the padded row differs from an unmasked run over its padding
    unmasked = s.run(input_ids=src, decoder_input_ids=dec)["logits"]
    assert float(np.abs(unmasked[1] - got["logits"][1]).max()) > 1e-5
    assert_close(unmasked[0], got["logits"][0])


def test_encoder_decoder_run_without_decoder_ids_runs_the_encoder_only(builds, models):
    s = Session(builds("tiny-transformer"))
    src = np.array([[5, 6, 7]], dtype=np.int64)
    got = s.run(input_ids=src)
    assert list(got) == ["encoder_last_hidden_state"]
    with torch.no_grad():
        want = models("tiny-transformer").encode(input_ids=torch.from_numpy(src))["last_hidden_state"].numpy()
    assert_close(got["encoder_last_hidden_state"], want)


def test_encoder_decoder_run_refuses_unknown_inputs(builds):
    s = Session(builds("tiny-transformer"))
    with pytest.raises(RunError, match="bogus"):
        s.run(input_ids=[[1, 2]], bogus=[[1]], decoder_input_ids=[[0]])


# --- helpers --------------------------------------------------------------------------------------


def test_empty_cache_and_cross_cache(builds):
    s = Session(builds("tiny-transformer"))
    dec = s.graphs["decoder"]
    empty = empty_cache(dec, 3)
    assert sorted(empty) == sorted(n for n in dec.inputs if n.startswith("past_key_values.") and ".decoder." in n)
    assert all(v.shape == (3, 4, 0, 16) and v.dtype == np.float32 for v in empty.values())
    enc_out = s.graphs["encoder"].run({"input_ids": np.array([[1, 2, 3, 4]]), "attention_mask": np.ones((1, 4))})
    cross = as_past(enc_out)
    assert sorted(cross) == sorted(n for n in dec.inputs if ".encoder." in n)
    assert all(shape_of(v) == (1, 4, 4, 16) for v in cross.values())
    assert shape_of(np.zeros((2, 5))) == (2, 5)


def test_save_npz_writes_atomically(tmp_path):
    path = tmp_path / "out.npz"
    arrays = {"a": np.arange(6).reshape(2, 3), "present.0.key": np.ones((1, 2, 3, 4), np.float32)}
    save_npz(path, arrays)
    with np.load(path) as data:
        assert sorted(data.files) == sorted(arrays)
        np.testing.assert_array_equal(data["a"], arrays["a"])
    assert [p.name for p in tmp_path.iterdir()] == ["out.npz"]  # no temporary file left behind
