"""The one validation of inputs (specc/runtime/inputs.py), in process: Session.run's feeds and
Session.generate's prompts and options against the builds' signatures and limits, and --input
files read within those limits. Each refusal is a RunError of one line naming the input and the
offending value or shape; each limit is also passed at its edge.

The limits of the catalog's tiny builds: vocabulary 1000 (tiny-bert: 2 token types), serving.batch
1..4, serving.length 1..128; tiny-gpt2 and tiny-bert learn 128 positions, tiny-llama rotates them,
tiny-transformer adds sinusoids."""
from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

import specc
from specc.runtime import RunError, Session
from specc.runtime.inputs import Limits, check_feeds, max_elements, read_inputs

from tests.helpers.hostile import npz_bomb

pytest.importorskip("onnxruntime")

I64 = np.int64


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    """name -> Session; the builds sit where the other runtime test modules put theirs."""
    done: dict = {}

    def get(name: str) -> Session:
        if name not in done:
            done[name] = Session(specc.build(name, tmp_path_factory.getbasetemp() / "specc-runtime-builds" / name).out_dir)
        return done[name]

    return get


def cache(layers: int = 2, batch: int = 1, heads: int = 4, past: int = 2, width: int = 16, dtype=np.float32,
          part: str = "") -> dict[str, np.ndarray]:
    part = f".{part}" if part else ""
    return {f"past_key_values.{i}{part}.{kv}": np.zeros((batch, heads, past, width), dtype)
            for i in range(layers) for kv in ("key", "value")}


def refused(fn, *words: str) -> str:
    with pytest.raises(RunError) as info:
        fn()
    message = str(info.value)
    assert "\n" not in message and "Traceback" not in message, message
    for word in words:
        assert word in message, (word, message)
    return message


# --- Session.run: one table of refusals --------------------------------------------------------------

RUN_REFUSALS = [  # (id, build, inputs, words the one line holds)
    ("negative-id", "tiny-gpt2", {"input_ids": [[-5, 9, 2]]}, ["input_ids", "[-5]", "0..999"]),
    ("id-past-vocab", "tiny-gpt2", {"input_ids": [[5000, 9]]}, ["input_ids", "[5000]"]),
    ("float-ids", "tiny-gpt2", {"input_ids": [[1.5, 2.0]]}, ["input_ids", "integers", "float64"]),
    ("bool-ids", "tiny-gpt2", {"input_ids": np.ones((1, 2), bool)}, ["input_ids", "integers", "bool"]),
    ("huge-uint-ids", "tiny-gpt2", {"input_ids": np.array([[2**63 + 5]], np.uint64)}, ["input_ids", "vocabulary"]),
    ("ragged", "tiny-gpt2", {"input_ids": [[1, 2, 3], [4, 5]]}, ["input_ids", "different lengths"]),
    ("empty-sequence", "tiny-gpt2", {"input_ids": np.zeros((1, 0), I64)}, ["input_ids", "empty sequence", "[1, 0]"]),
    ("empty-batch", "tiny-gpt2", {"input_ids": np.zeros((0, 3), I64)}, ["input_ids", "empty batch"]),
    ("rank-3", "tiny-gpt2", {"input_ids": np.zeros((1, 2, 3), I64)}, ["input_ids", "[1, 2, 3]"]),
    ("batch-past-max", "tiny-gpt2", {"input_ids": np.ones((5, 3), I64)}, ["input_ids", "batch of 5", "serving.batch.max 4"]),
    ("sequence-past-max", "tiny-gpt2", {"input_ids": np.ones((1, 129), I64)}, ["input_ids", "129", "serving.length.max 128"]),
    ("mask-values", "tiny-gpt2", {"input_ids": [[5, 9, 2]], "attention_mask": [[7, -1, 0]]},
     ["attention_mask", "0 or 1", "-1", "7"]),
    ("mask-float", "tiny-gpt2", {"input_ids": [[5, 9]], "attention_mask": [[1.0, 1.0]]}, ["attention_mask", "integers"]),
    ("mask-length", "tiny-gpt2", {"input_ids": [[5, 9]], "attention_mask": [[1, 1, 1]]},
     ["attention_mask", "covers 3", "expected 2"]),
    ("mask-batch", "tiny-gpt2", {"input_ids": [[5, 9]], "attention_mask": [[1, 1], [1, 1]]}, ["batch is 2", "input_ids"]),
    ("negative-position", "tiny-gpt2", {"input_ids": [[5, 9, 2]], "position_ids": [[0, -1, 2]]},
     ["position_ids", "[-1]", "learned positions"]),
    ("position-past-table", "tiny-gpt2", {"input_ids": [[5, 9, 2]], "position_ids": [[0, 1, 500]]},
     ["position_ids", "[500]", "(0..127)"]),
    ("rotary-negative-position", "tiny-llama", {"input_ids": [[5, 9]], "position_ids": [[-3, 1]]},
     ["position_ids", "[-3]", "negative"]),
    ("cache-heads", "tiny-gpt2", {"input_ids": [[1]], **cache(heads=3)}, ["past_key_values.0.key", "[1, 3, 2, 16]"]),
    ("cache-head-dim", "tiny-gpt2", {"input_ids": [[1]], **cache(width=8)}, ["past_key_values.0.key", "[1, 4, 2, 8]"]),
    ("cache-rank", "tiny-gpt2", {"input_ids": [[1]], **{k: v[0] for k, v in cache().items()}},
     ["past_key_values.0.key", "4 dims", "[4, 2, 16]"]),
    ("cache-batch", "tiny-gpt2", {"input_ids": [[1]], **cache(batch=2)}, ["batch is", "past_key_values"]),
    ("cache-ints", "tiny-gpt2", {"input_ids": [[1]], **cache(dtype=np.int64)}, ["past_key_values.0.key", "floats"]),
    ("cache-partial", "tiny-gpt2", {"input_ids": [[1]], "past_key_values.0.key": np.zeros((1, 4, 2, 16), np.float32)},
     ["past_key_values.0.key", "whole", "past_key_values.1.value"]),
    ("cache-past-length", "tiny-gpt2", {"input_ids": [[1, 2]], **cache(past=127)},
     ["127 cached + 2 new", "serving.length.max 128"]),
    ("cache-gqa-heads", "tiny-llama", {"input_ids": [[1]], **cache(heads=4)}, ["past_key_values.0.key", "[batch, 2,"]),
    ("token-type-past-vocab", "tiny-bert", {"input_ids": [[1, 2]], "token_type_ids": [[0, 2]]},
     ["token_type_ids", "[2]", "(0..1)"]),
    ("negative-token-type", "tiny-bert", {"input_ids": [[1, 2]], "token_type_ids": [[0, -1]]}, ["token_type_ids", "[-1]"]),
    ("unknown-input", "tiny-gpt2", {"input_ids": [[1, 2]], "token_type_ids": [[0, 0]]},
     ["unknown input(s) token_type_ids", "attention_mask"]),
    ("encoder-mask", "tiny-transformer", {"input_ids": [[1, 2]], "attention_mask": [[1, 2]]}, ["attention_mask", "[2]"]),
    ("decoder-negative-id", "tiny-transformer", {"input_ids": [[1, 2]], "decoder_input_ids": [[0, -3]]},
     ["decoder_input_ids", "[-3]"]),
    ("decoder-id-past-vocab", "tiny-transformer", {"input_ids": [[1, 2]], "decoder_input_ids": [[0, 1000]]},
     ["decoder_input_ids", "[1000]"]),
    ("decoder-float-ids", "tiny-transformer", {"input_ids": [[1, 2]], "decoder_input_ids": [[0.5]]},
     ["decoder_input_ids", "integers"]),
    ("decoder-batch", "tiny-transformer", {"input_ids": [[1, 2]], "decoder_input_ids": [[0, 3], [1, 1]]},
     ["decoder_input_ids", "batch is 2", "encoder_attention_mask"]),
    ("decoder-too-long", "tiny-transformer", {"input_ids": [[1, 2]], "decoder_input_ids": np.zeros((1, 129), I64)},
     ["decoder_input_ids", "serving.length.max 128"]),
    ("source-too-long", "tiny-transformer", {"input_ids": np.ones((1, 129), I64)}, ["input_ids", "serving.length.max"]),
]


@pytest.mark.parametrize("name, inputs, words", [c[1:] for c in RUN_REFUSALS], ids=[c[0] for c in RUN_REFUSALS])
def test_run_refuses_with_one_line_naming_the_input(session, name, inputs, words):
    refused(lambda: session(name).run(**inputs), *words)


def test_run_takes_every_limit_at_its_edge(session):
    g = session("tiny-gpt2")
    assert g.run(input_ids=np.full((4, 128), 7, I64))["logits"].shape == (4, 128, 1000)  # batch.max x length.max
    ids = [[0, 999]]
    out = g.run(input_ids=ids, attention_mask=[[0, 1]], position_ids=[[0, 127]])
    assert out["logits"].shape == (1, 2, 1000)
    step = g.run(input_ids=[[1]], **cache(past=127))  # 127 cached + 1 new = 128
    assert step["present.0.key"].shape == (1, 4, 128, 16)
    # any integer dtype is read as int64, with the same answer
    for dtype in (np.int32, np.uint16, np.uint64):
        np.testing.assert_array_equal(g.run(input_ids=np.array(ids, dtype))["logits"], g.run(input_ids=ids)["logits"])
    # rotary positions have no table: positions past serving.length.max are not refused
    assert session("tiny-llama").run(input_ids=[[5, 9]], position_ids=[[500, 501]])["logits"].shape == (1, 2, 1000)
    b = session("tiny-bert")
    assert b.run(input_ids=[[1, 2]], token_type_ids=[[0, 1]])["last_hidden_state"].shape == (1, 2, 64)


def test_check_feeds_returns_contiguous_arrays_in_the_signature_dtypes(session):
    g = session("tiny-gpt2")
    feeds = check_feeds(g.info.graphs["model"], {"input_ids": np.array([[1, 2]], np.int32),
                                                 **cache(dtype=np.float64, past=3),
                                                 "attention_mask": np.ones((1, 5), np.uint8)}, g.limits)
    assert feeds["input_ids"].dtype == np.int64 and feeds["attention_mask"].dtype == np.int64
    assert all(feeds[k].dtype == np.float32 and feeds[k].flags.c_contiguous for k in cache())
    assert g.limits == Limits(vocab=1000, target_vocab=1000, type_vocab=0, batch=4, length=128, positions=128)
    assert session("tiny-bert").limits.type_vocab == 2 and session("tiny-llama").limits.positions is None


# --- Session.generate: options, prompts, lengths, beams --------------------------------------------

GENERATE_REFUSALS = [  # (id, build, prompt, options, words)
    ("temperature-nan", "tiny-gpt2", [1, 2], {"temperature": float("nan")}, ["temperature", "nan"]),
    ("temperature-inf", "tiny-gpt2", [1, 2], {"temperature": float("inf")}, ["temperature", "inf"]),
    ("temperature-negative", "tiny-gpt2", [1, 2], {"temperature": -0.5}, ["temperature"]),
    ("top-p-nan", "tiny-gpt2", [1, 2], {"top_p": float("nan")}, ["top_p", "(0, 1]"]),
    ("top-p-zero", "tiny-gpt2", [1, 2], {"top_p": 0.0}, ["top_p"]),
    ("top-p-past-one", "tiny-gpt2", [1, 2], {"top_p": 1.01}, ["top_p"]),
    ("top-k-negative", "tiny-gpt2", [1, 2], {"top_k": -1}, ["top_k", "-1"]),
    ("top-k-float", "tiny-gpt2", [1, 2], {"top_k": 2.5}, ["top_k"]),
    ("seed-negative", "tiny-gpt2", [1, 2], {"seed": -1, "do_sample": True}, ["seed", "-1"]),
    ("length-penalty-nan", "tiny-gpt2", [1, 2], {"beams": 2, "length_penalty": float("nan")}, ["length_penalty"]),
    ("max-new-float", "tiny-gpt2", [1, 2], {"max_new_tokens": 2.0}, ["max_new_tokens"]),
    ("max-new-absurd", "tiny-gpt2", [1, 2], {"max_new_tokens": 100_000_000},
     ["max_new_tokens (100000000)", "128 positions", "at most 126 new tokens"]),
    ("beams-absurd", "tiny-gpt2", [1, 2], {"beams": 100_000}, ["beams (100000)", "4 x 128 = 512"]),
    ("beams-past-budget", "tiny-gpt2", [7] * 100, {"beams": 5, "max_new_tokens": 3}, ["beams (5)", "103 positions"]),
    ("eos-float", "tiny-gpt2", [1, 2], {"eos_id": 2.5}, ["eos_id", "integer", "2.5"]),
    ("pad-negative", "tiny-gpt2", [1, 2], {"pad_id": -1}, ["pad_id -1", "(0..999)"]),
    ("pad-past-vocab", "tiny-gpt2", [1, 2], {"pad_id": 1000}, ["pad_id 1000"]),
    ("prompts-past-batch", "tiny-gpt2", [[1, 2]] * 5, {}, ["input_ids", "5 prompts", "serving.batch.max 4"]),
    ("prompt-past-length", "tiny-gpt2", [1] * 129, {"max_new_tokens": 1}, ["input_ids", "129 tokens"]),
    ("negative-id", "tiny-gpt2", [[5, 6], [-1, 3]], {}, ["input_ids", "[-1]"]),
    ("float-ids", "tiny-gpt2", [[1.5, 2.0]], {}, ["input_ids", "integers", "1.5"]),
    ("decoder-positions", "tiny-transformer", [1, 2], {"max_new_tokens": 128},
     ["max_new_tokens (128)", "128 decoder positions", "at most 127"]),
]


@pytest.mark.parametrize("name, prompt, options, words", [c[1:] for c in GENERATE_REFUSALS],
                         ids=[c[0] for c in GENERATE_REFUSALS])
def test_generate_refuses_before_anything_is_allocated(session, monkeypatch, name, prompt, options, words):
    """Nothing is allocated for a refused generation: no runner (its cache buffers) is made."""
    import specc.runtime.generate as gen

    def never(*args, **kwargs):
        raise AssertionError("a runner was made for a refused generation")

    monkeypatch.setattr(gen, "DecoderRunner", never)
    monkeypatch.setattr(gen, "EncoderDecoderRunner", never)
    options = {"max_new_tokens": 4, **options}
    refused(lambda: session(name).generate(prompt, **options), *words)


def test_generate_takes_every_limit_at_its_edge(session):
    g = session("tiny-gpt2")
    assert len(g.generate([7] * 120, max_new_tokens=8).new_ids[0]) <= 8  # 120 + 8 = 128 positions
    refused(lambda: g.generate([7] * 120, max_new_tokens=9), "at most 8 new tokens")
    assert len(g.generate([[1, 2]] * 4, max_new_tokens=2).new_ids) == 4  # serving.batch.max prompts
    assert len(g.generate([7] * 100, max_new_tokens=3, beams=4).new_ids[0]) <= 3  # 4 x 103 positions <= 512
    assert len(g.generate([1, 2], max_new_tokens=6, eos_id=-1).new_ids[0]) == 6  # an id never produced: no stop
    t = session("tiny-transformer")
    assert len(t.generate([1, 2], max_new_tokens=3).new_ids[0]) <= 3


# --- input files ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bomb(tmp_path_factory):
    return npz_bomb(tmp_path_factory.getbasetemp() / "bomb.npz")


def test_an_npz_bomb_is_refused_by_its_header_before_it_is_unpacked(session, bomb, monkeypatch):
    g = session("tiny-gpt2")
    assert bomb.stat().st_size < 2 << 20

    def never(*args, **kwargs):
        raise AssertionError("np.load was called")

    monkeypatch.setattr(np, "load", never)
    tracemalloc.start()
    try:
        message = refused(lambda: read_inputs(bomb, g.info.graphs["model"], g.limits),
                          str(bomb), "input_ids", "134217728", "serving.length.max 128")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # the header only
    assert "sequence" in message


def test_npz_headers_are_checked_against_the_signature(session, tmp_path):
    g = session("tiny-gpt2")
    graph = g.info.graphs["model"]
    cases = {
        "floats": ({"input_ids": np.ones((1, 3))}, ["input_ids", "integers", "float64"]),
        "unknown": ({"input_ids": np.ones((1, 3), I64), "bogus": np.ones(2)}, ["unknown input(s) bogus"]),
        "no-ids": ({"attention_mask": np.ones((1, 3), I64)}, ["input_ids"]),
        "batch": ({"input_ids": np.ones((9, 3), I64)}, ["batch of 9"]),
        "cache": ({"input_ids": np.ones((1, 1), I64), **cache(heads=2)}, ["past_key_values.0.key"]),
    }
    for name, (arrays, words) in cases.items():
        path = tmp_path / f"{name}.npz"
        np.savez(path, **arrays)
        refused(lambda: read_inputs(path, graph, g.limits), str(path), *words)
    good = tmp_path / "good.npz"
    np.savez(good, input_ids=np.arange(3), attention_mask=np.ones(3, I64))  # 1-D: one row, as run() reads it
    arrays = read_inputs(good, graph, g.limits)
    np.testing.assert_array_equal(g.run(**arrays)["logits"], g.run(input_ids=[[0, 1, 2]])["logits"])


def test_an_encoder_decoder_npz_may_name_decoder_input_ids(session, tmp_path):
    t = session("tiny-transformer")
    enc, dec = t.info.graphs["encoder"], t.info.graphs["decoder"]
    good = tmp_path / "good.npz"
    np.savez(good, input_ids=np.array([[5, 6, 7]]), decoder_input_ids=np.array([[0, 44]]))
    arrays = read_inputs(good, enc, t.limits, dec)
    np.testing.assert_array_equal(t.run(**arrays)["logits"],
                                  t.run(input_ids=[[5, 6, 7]], decoder_input_ids=[[0, 44]])["logits"])
    long = tmp_path / "long.npz"
    np.savez(long, input_ids=np.array([[5, 6, 7]]), decoder_input_ids=np.zeros((1, 500), I64))
    refused(lambda: read_inputs(long, enc, t.limits, dec), "decoder_input_ids", "sequence of 500")
    refused(lambda: read_inputs(good, enc, t.limits), "unknown input(s) decoder_input_ids")  # no decoder: not an input


def test_a_json_file_larger_than_the_limits_take_is_refused_unread(session, tmp_path):
    g = session("tiny-gpt2")
    graph = g.info.graphs["model"]
    cap = max_elements(graph, g.limits) * 32 + 4096
    big = tmp_path / "big.json"
    big.write_text("[[1" + ", 1" * (cap // 3) + "]]")
    refused(lambda: read_inputs(big, graph, g.limits), str(big), "bytes", "refused")
    small = tmp_path / "small.json"
    small.write_text(json.dumps({"input_ids": [[1, 2]]}))
    assert read_inputs(small, graph, g.limits) == {"input_ids": [[1, 2]]}
