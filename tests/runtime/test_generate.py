"""Session.generate (specc/runtime/generate.py): greedy decoding checked token for token against
the torch model's own full-recompute greedy loop (and the per-step logits of the cached ONNX loop
against torch's), ragged batches, input forms, EOS, length limits, sampling (seeded, top-k, top-p,
and the distribution of `sample` itself) and beam search against exhaustive and independent
references computed with torch."""
from __future__ import annotations


import numpy as np
import pytest
import torch

import specc
from specc.runtime import Generated, RunError, Session
from specc.runtime.captured import CapturedDecoder, CapturedRunner
from specc.decoding.sampling import greedy
from specc.runtime.generate import DecoderRunner, EncoderDecoderRunner, InplaceRunner, lm_output, log_softmax, sample
from specc.spec.io import present_to_past

from tests.helpers import speclib

pytest.importorskip("onnxruntime")

# vocabulary 61, learned positions (64), an untied head (tied tiny models tend to repeat one token)
SMALL = speclib.tiny({"vocab": {"size": 61, "tie_output": False}})
SMALL_SEED = 3  # built and compared with a seed other than the default
# SMALL with three layers, 0 and 2 sliding a window of 3 (layer 1 global): window caches, which the
# longer prompt and the generations outgrow
WINDOWED = speclib.tiny({"vocab": {"size": 61, "tie_output": False},
                         "decoder": {"layers": 3, "attention": {"heads": 4, "pattern": {"kind": "local", "window": 3}},
                                     "overrides": [{"indices": [1], "pattern": {"kind": "full"}}]}})
# every layer sliding (as Mistral's): no cache says how long the sequence is, the mask does
ALL_WINDOWED = speclib.tiny({"vocab": {"size": 61, "tie_output": False},
                             "decoder": {"attention": {"heads": 4, "pattern": {"kind": "local", "window": 3}}}})

TARGETS = {  # label -> (spec, seed)
    "tiny-gpt2": ("tiny-gpt2", 0),
    "tiny-llama": ("tiny-llama", 0),
    "tiny-transformer": ("tiny-transformer", 0),
    "small-seed3": (SMALL, SMALL_SEED),
    "small-window": (WINDOWED, SMALL_SEED),
    "all-windowed": (ALL_WINDOWED, SMALL_SEED),
}
DECODERS = ["tiny-gpt2", "tiny-llama", "small-seed3"]
PROMPTS = {  # two prompts of different lengths per target
    "tiny-gpt2": ([5, 6, 7], [400, 12, 999, 81, 3, 77]),
    "tiny-llama": ([5, 6, 7], [640, 12, 31, 81, 3, 770]),
    "tiny-transformer": ([5, 6, 7, 8, 9, 10, 11], [300, 301]),
    "small-seed3": ([5, 6, 7], [40, 12, 31, 8, 3, 17]),
    "small-window": ([5, 6, 7], [40, 12, 31, 8, 3, 17]),
    "all-windowed": ([5, 6, 7], [40, 12, 31, 8, 3, 17]),
}
NEW = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """label -> (Session, torch model with the same weights); each build once per module. The
    directories sit under the session's base temp dir, where the other runtime test modules find
    them already built (specc.build reuses an up-to-date output directory)."""
    done: dict = {}

    def get(label: str):
        if label not in done:
            spec, seed = TARGETS[label]
            out = tmp_path_factory.getbasetemp() / "specc-runtime-builds" / label
            result = specc.build(spec, out, seed=seed)
            done[label] = (Session(result.out_dir), specc.to_torch(spec, seed=seed))
        return done[label]

    return get


# --- torch references -------------------------------------------------------------------------------


def _logits(model, **inputs) -> np.ndarray:
    with torch.no_grad():
        return model(**{k: torch.as_tensor(v, dtype=torch.int64) for k, v in inputs.items()})["logits"].numpy()


def start_token(tokens: dict) -> int:
    """The decoder's first token of an encoder-decoder: decoder_start, else bos, else pad, else 0."""
    return next(t for t in (tokens.get("decoder_start"), tokens.get("bos"), tokens.get("pad"), 0) if t is not None)


def next_logits(model, arch: str, prompt: list[int], prefixes: list[list[int]], tokens: dict) -> np.ndarray:
    """Last-position logits [len(prefixes), V] after prompt + each prefix (all prefixes the same
    length), by a full forward pass without any cache."""
    if arch == "encoder-decoder":
        dec = [[start_token(tokens)] + p for p in prefixes]
        src = [prompt] * len(prefixes)
        return _logits(model, input_ids=src, decoder_input_ids=dec)[:, -1]
    return _logits(model, input_ids=[prompt + p for p in prefixes])[:, -1]


def torch_greedy(model, arch: str, prompt: list[int], n: int, tokens: dict, eos: int | None):
    """New ids of the model's own greedy loop (full recompute, argmax), stopping after eos, and
    the logits of each step [steps, V]."""
    new, steps = [], []
    for _ in range(n):
        logits = next_logits(model, arch, prompt, [new], tokens)[0]
        steps.append(logits)
        new.append(int(logits.argmax()))
        if eos is not None and new[-1] == eos:
            break
    return new, np.stack(steps)


def torch_logp(model, arch, prompt, tokens):
    def fn(prefixes):
        return log_softmax(next_logits(model, arch, prompt, prefixes, tokens))
    return fn


def reference_beam(logp_fn, k: int, n: int) -> tuple[list[int], float]:
    """Plain beam search without EOS: keep the k best (sum log p) prefixes at every step."""
    beams = [([], 0.0)]
    for _ in range(n):
        lp = logp_fn([seq for seq, _ in beams])
        cands = [(s + float(lp[b, t]), seq + [t]) for b, (seq, s) in enumerate(beams) for t in range(lp.shape[1])]
        cands.sort(key=lambda c: -c[0])
        beams = [(seq, s) for s, seq in cands[:k]]
    return beams[0]


def sum_logp(logp_fn, seq: list[int]) -> float:
    return sum(float(logp_fn([seq[:i]])[0, t]) for i, t in enumerate(seq))


def lp(n: int, alpha: float) -> float:
    return ((5 + n) / 6) ** alpha


def eos_of(session) -> int | None:
    return session.tokens.get("eos")


# --- greedy: token for token and logits step for step -----------------------------------------------


@pytest.mark.parametrize("label", list(TARGETS))
def test_greedy_matches_the_torch_greedy_loop(built, label):
    s, model = built(label)
    p0, p1 = PROMPTS[label]
    want = [torch_greedy(model, s.architecture, p, NEW, s.tokens, eos_of(s))[0] for p in (p0, p1)]
    alone = [s.generate(p, max_new_tokens=NEW) for p in (p0, p1)]
    batch = s.generate([p0, p1], max_new_tokens=NEW)
    assert isinstance(batch, Generated)
    prefix = [[start_token(s.tokens)]] * 2 if s.architecture == "encoder-decoder" else [p0, p1]
    for i in range(2):
        assert alone[i].new_ids == [want[i]], (label, i)
        assert batch.new_ids[i] == want[i], (label, i)  # each row of the ragged batch = that prompt alone
        assert batch.ids[i] == prefix[i] + want[i]
        assert len(want[i]) == NEW or want[i][-1] == eos_of(s)


@pytest.mark.parametrize("label", list(TARGETS))
def test_cached_loop_logits_match_torch_step_by_step(built, label):
    """Greedy ids alone are weak evidence (random tiny models repeat tokens): the logits the
    generation loop sees at every step of a padded batch equal torch's full recompute of each row."""
    s, model = built(label)
    prompts = list(PROMPTS[label])
    refs = [torch_greedy(model, s.architecture, p, NEW, s.tokens, None) for p in prompts]
    pad = 0
    if s.architecture == "encoder-decoder":
        runner = EncoderDecoderRunner(s, prompts, pad, start_token(s.tokens), NEW)
    else:
        runner = DecoderRunner(s, prompts, pad, NEW)
    logits = runner.prefill()
    for step in range(NEW):
        want = np.stack([r[1][step] for r in refs])
        assert logits.shape == want.shape
        diff = float(np.abs(logits - want).max())
        assert diff <= 1e-4 * max(1.0, float(np.abs(want).max())), (label, step, diff)
        if step < NEW - 1:
            logits = runner.step(np.array([r[0][step] for r in refs], dtype=np.int64))
    # the tokens are not all one repeated id in every model (some do vary)
    if label in ("tiny-llama", "small-seed3"):
        assert len(set(refs[0][0])) > 2


def test_a_build_with_another_seed_matches_torch_with_that_seed_only(built):
    s, model = built("small-seed3")
    prompt = PROMPTS["small-seed3"][1]
    got = s.run(input_ids=[prompt])["logits"]
    assert float(np.abs(got - _logits(model, input_ids=[prompt])).max()) < 1e-4
    other = specc.to_torch(SMALL, seed=0)
    assert float(np.abs(got - _logits(other, input_ids=[prompt])).max()) > 1e-2  # the seed matters


def test_encoder_decoder_ids_start_with_the_decoder_start_token(built):
    s, _ = built("tiny-transformer")
    g = s.generate([[5, 6, 7]], max_new_tokens=3)
    start = start_token(s.tokens)
    assert s.tokens.get("decoder_start") is None and s.tokens.get("bos") is None and s.tokens.get("pad") is None
    assert start == 0
    assert g.ids[0][0] == start and g.ids[0][1:] == g.new_ids[0] and len(g.new_ids[0]) == 3


# --- input forms ------------------------------------------------------------------------------------


def test_input_forms_give_the_same_result(built):
    s, _ = built("tiny-llama")
    p = [5, 6, 7]
    ref = s.generate(p, max_new_tokens=5)
    for form in ([p], (5, 6, 7), np.array(p), np.array([p], dtype=np.int64), np.array([p], dtype=np.int32),
                 [np.int64(5), np.int64(6), np.int64(7)]):
        got = s.generate(form, max_new_tokens=5)
        assert got.ids == ref.ids and got.new_ids == ref.new_ids, form
    q = [9, 10, 11]
    batch = s.generate([p, q], max_new_tokens=5)
    assert s.generate(np.array([p, q], dtype=np.int64), max_new_tokens=5) == batch
    assert batch.new_ids[0] == ref.new_ids[0]
    assert all(isinstance(x, int) for row in batch.ids for x in row)


@pytest.mark.parametrize("bad", [[], [[]], [[1, 2], []], [1.0, 2.0], [[1, 2], [3.5]], "1,2", [True, 2],
                                 np.array([[1.0, 2.0]])])
def test_bad_input_ids_are_run_errors(built, bad):
    s, _ = built("tiny-llama")
    with pytest.raises(RunError):
        s.generate(bad, max_new_tokens=2)


# --- EOS, lengths, vocabulary -----------------------------------------------------------------------


def test_eos_stops_its_row_while_the_other_continues(built):
    s, _ = built("tiny-llama")
    p0, p1 = PROMPTS["tiny-llama"]
    free = s.generate([p0, p1], max_new_tokens=NEW)
    g0, g1 = free.new_ids
    assert len(g0) == len(g1) == NEW  # the default eos (2) does not come up here
    # the first step k >= 2 whose token is new in row 0 and never produced by row 1
    k = next(k for k in range(2, NEW - 1) if g0[k] not in g0[:k] and g0[k] not in g1)
    calls = []
    got = s.generate([p0, p1], max_new_tokens=NEW, eos_id=g0[k], on_token=lambda step, new: calls.append((step, new)))
    assert got.new_ids[0] == g0[: k + 1]  # EOS kept, row shorter
    assert got.new_ids[1] == g1  # the other row runs to max_new_tokens
    assert got.ids[0] == p0 + g0[: k + 1]
    assert [c[0] for c in calls] == list(range(NEW))
    assert [c[1][0] for c in calls] == g0[: k + 1] + [None] * (NEW - k - 1)
    assert [c[1][1] for c in calls] == g1
    # EOS at the first step: a row of one token
    assert s.generate(p0, max_new_tokens=NEW, eos_id=g0[0]).new_ids == [[g0[0]]]


def test_generation_stops_when_every_row_is_done(built):
    s, _ = built("tiny-llama")
    p0, p1 = PROMPTS["tiny-llama"]
    free = s.generate([p0, p1], max_new_tokens=NEW)
    calls = []
    g = s.generate(p0, max_new_tokens=NEW, eos_id=free.new_ids[0][1], on_token=lambda step, new: calls.append(step))
    assert g.new_ids[0][-1] == free.new_ids[0][1] and len(g.new_ids[0]) <= 2
    assert calls == list(range(len(g.new_ids[0])))


def test_default_eos_is_the_spec_eos(built):
    s, _ = built("tiny-gpt2")
    assert s.tokens["eos"] == 999
    # a one-token prompt whose greedy next token is 999 (runs of serving.batch.max rows: run() takes no more)
    step = s.info.batch.max
    firsts = np.concatenate([s.run(input_ids=np.arange(i, min(i + step, 1000))[:, None])["logits"][:, -1].argmax(-1)
                             for i in range(0, 1000, step)])
    prompt = [int(np.nonzero(firsts == 999)[0][0])]
    other = [5, 6, 7]
    g = s.generate([prompt, other], max_new_tokens=6)
    assert g.new_ids[0] == [999]  # stopped at the spec's eos
    assert len(g.new_ids[1]) == 6 and 999 not in g.new_ids[1]
    # another eos_id replaces it: the row goes on past 999
    go_on = s.generate(prompt, max_new_tokens=6, eos_id=998).new_ids[0]
    assert go_on[0] == 999 and len(go_on) > 1


@pytest.mark.parametrize("n", [1, 3, 11])
def test_max_new_tokens_is_respected(built, n):
    s, _ = built("small-seed3")
    g = s.generate(list(PROMPTS["small-seed3"]), max_new_tokens=n)
    assert [len(r) for r in g.new_ids] == [n, n]
    assert [len(r) for r in g.ids] == [3 + n, 6 + n]


def test_max_new_tokens_below_one_is_a_run_error(built):
    s, _ = built("small-seed3")
    with pytest.raises(RunError, match="max_new_tokens"):
        s.generate([1, 2], max_new_tokens=0)


def test_learned_positions_limit_prompt_plus_new_tokens(built):
    s, _ = built("small-seed3")
    assert s.spec["position"] == {"kind": "learned", "max_length": 64}
    prompt = [7] * 60
    ok = s.generate([prompt, [1, 2]], max_new_tokens=4)  # 60 + 4 = 64 positions
    assert [len(r) for r in ok.new_ids] == [4, 4]
    with pytest.raises(RunError, match="64") as info:
        s.generate([prompt, [1, 2]], max_new_tokens=5)
    assert "60" in str(info.value)
    with pytest.raises(RunError, match="64"):
        s.generate([1] * 65, max_new_tokens=1)
    g, _ = built("tiny-gpt2")
    with pytest.raises(RunError, match="128"):
        g.generate([1] * 100, max_new_tokens=29)


def test_token_ids_outside_the_vocabulary_are_run_errors(built):
    s, _ = built("tiny-gpt2")
    with pytest.raises(RunError, match="1000"):
        s.generate([5, 1000], max_new_tokens=2)
    with pytest.raises(RunError, match="-1"):
        s.generate([[5, 6], [-1, 3]], max_new_tokens=2)
    small, _ = built("small-seed3")
    with pytest.raises(RunError, match="61"):
        small.generate([61], max_new_tokens=1)
    assert len(small.generate([60], max_new_tokens=1).new_ids[0]) == 1


@pytest.mark.parametrize("options, word", [
    ({"temperature": 0.0}, "temperature"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"), ({"top_k": 0}, "top_k"), ({"beams": 0}, "beams"),
    ({"beams": 2, "temperature": 1.0}, "beam"), ({"beams": 2, "do_sample": True}, "beam"),
])
def test_bad_generation_options_are_run_errors(built, options, word):
    s, _ = built("small-seed3")
    with pytest.raises(RunError, match=word):
        s.generate([1, 2, 3], max_new_tokens=2, **options)


# --- sampling -----------------------------------------------------------------------------------------


def test_sampling_with_a_seed_is_reproducible_and_seeds_differ(built):
    s, _ = built("tiny-llama")
    prompts = list(PROMPTS["tiny-llama"])
    a = s.generate(prompts, max_new_tokens=10, temperature=2.0, seed=1)
    b = s.generate(prompts, max_new_tokens=10, temperature=2.0, seed=1)
    c = s.generate(prompts, max_new_tokens=10, temperature=2.0, seed=2)
    greedy = s.generate(prompts, max_new_tokens=10)
    assert a == b
    assert a.new_ids[0] != c.new_ids[0] and a.new_ids[1] != c.new_ids[1]
    assert a.new_ids != greedy.new_ids
    # near-uniform sampling over 1000 ids: hardly any agreement position by position
    same = sum(x == y for r, q in zip(a.new_ids, c.new_ids) for x, y in zip(r, q))
    assert same <= 4
    assert all(0 <= x < 1000 for r in a.new_ids for x in r)


def test_top_k_one_and_a_tiny_top_p_are_greedy(built):
    s, _ = built("tiny-llama")
    prompts = list(PROMPTS["tiny-llama"])
    greedy = s.generate(prompts, max_new_tokens=NEW)
    assert s.generate(prompts, max_new_tokens=NEW, top_k=1, seed=4) == greedy
    assert s.generate(prompts, max_new_tokens=NEW, top_k=1, temperature=3.0, seed=5) == greedy
    assert s.generate(prompts, max_new_tokens=NEW, top_p=1e-6, seed=6) == greedy
    assert s.generate(prompts, max_new_tokens=NEW, top_p=1e-6, temperature=3.0, seed=7) == greedy


def test_do_sample_without_options_samples_at_temperature_one(built):
    s, _ = built("tiny-llama")
    a = s.generate([5, 6, 7], max_new_tokens=8, do_sample=True, seed=9)
    assert a == s.generate([5, 6, 7], max_new_tokens=8, temperature=1.0, seed=9)
    assert a != s.generate([5, 6, 7], max_new_tokens=8)


LOGITS = np.array([1.0, 0.8, 0.2, -0.5, -1.5])
DRAWS = 20000


def _frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=len(LOGITS)) / len(tokens)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_sample_draws_from_the_softmax(temperature):
    rng = np.random.default_rng(0)
    drawn = sample(np.tile(LOGITS, (DRAWS, 1)), rng, temperature, None, None)
    assert drawn.shape == (DRAWS,)
    np.testing.assert_allclose(_frequencies(drawn), _softmax(LOGITS / temperature), atol=0.015)


def test_sample_with_top_k_keeps_the_k_most_likely():
    rng = np.random.default_rng(1)
    drawn = sample(np.tile(LOGITS, (DRAWS, 1)), rng, 1.0, 2, None)
    freq = _frequencies(drawn)
    assert set(np.unique(drawn)) == {0, 1}
    np.testing.assert_allclose(freq[:2], _softmax(LOGITS[:2]), atol=0.015)


def test_sample_with_top_p_keeps_the_nucleus():
    p = _softmax(LOGITS)
    order = np.argsort(-p)
    nucleus = order[: int(np.searchsorted(np.cumsum(p[order]), 0.5)) + 1]  # smallest set reaching 0.5
    assert len(nucleus) == 2  # this distribution has a two-token nucleus at 0.5
    rng = np.random.default_rng(2)
    drawn = sample(np.tile(LOGITS, (DRAWS, 1)), rng, 1.0, None, 0.5)
    assert set(np.unique(drawn)) == set(nucleus.tolist())
    np.testing.assert_allclose(_frequencies(drawn)[nucleus], p[nucleus] / p[nucleus].sum(), atol=0.015)
    # top_p = 0.9 keeps four tokens
    drawn = sample(np.tile(LOGITS, (DRAWS, 1)), rng, 1.0, None, 0.9)
    assert set(np.unique(drawn)) == set(order[:4].tolist())


def test_sample_rows_are_independent_and_seeded():
    logits = np.stack([LOGITS, LOGITS[::-1]])
    a = [sample(logits, np.random.default_rng(3), 1.0, 1, None) for _ in range(2)]
    np.testing.assert_array_equal(a[0], [0, 4])  # top_k=1: the argmax of each row
    x = sample(np.tile(LOGITS, (500, 1)), np.random.default_rng(4), 1.0, None, None)
    y = sample(np.tile(LOGITS, (500, 1)), np.random.default_rng(4), 1.0, None, None)
    np.testing.assert_array_equal(x, y)


# --- beam search --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_two_step(built):
    """With the vocabulary-61 model: the log-probs of every one- and two-token continuation."""
    s, model = built("small-seed3")
    prompt = PROMPTS["small-seed3"][1]
    fn = torch_logp(model, "decoder", prompt, s.tokens)
    lp1 = fn([[]])[0]  # [61]
    lp2 = fn([[t] for t in range(61)])  # [61, 61]: row t1, column t2
    return s, prompt, lp1, lp2


def test_full_width_beam_search_finds_the_best_two_token_continuation(small_two_step):
    s, prompt, lp1, lp2 = small_two_step
    assert eos_of(s) is None
    total = lp1[:, None] + lp2  # every 2-token continuation, sum of log p
    best = np.unravel_index(total.argmax(), total.shape)
    ranked = np.sort(total.ravel())
    assert ranked[-1] - ranked[-2] > 1e-3  # no near tie to flip
    # every hypothesis has length 2, so the length penalty divides all of them alike
    for alpha in (0.0, 0.6, 2.0):
        got = s.generate(prompt, max_new_tokens=2, beams=61, length_penalty=alpha)
        assert got.new_ids == [[int(best[0]), int(best[1])]], alpha
        assert got.ids == [prompt + [int(best[0]), int(best[1])]]


def test_full_width_beam_search_with_eos_compares_lengths_with_the_penalty(small_two_step):
    """Make the most likely first token EOS: [EOS] (length 1) competes with the best two-token
    continuation not starting with EOS, scored sum(log p) / ((5 + n) / 6) ** alpha."""
    s, prompt, lp1, lp2 = small_two_step
    eos = int(lp1.argmax())
    cont = lp1[:, None] + lp2
    cont[eos, :] = -np.inf
    t1, t2 = (int(x) for x in np.unravel_index(cont.argmax(), cont.shape))

    def reference(alpha):
        return [eos] if lp1[eos] / lp(1, alpha) > cont[t1, t2] / lp(2, alpha) else [t1, t2]

    alphas = [0.0, 0.6, 2.0, 6.0, 12.0]
    results = {alpha: s.generate(prompt, max_new_tokens=2, beams=61, eos_id=eos, length_penalty=alpha).new_ids[0]
               for alpha in alphas}
    for alpha in alphas:
        assert results[alpha] == reference(alpha), alpha
    # the alphas cover both outcomes: a short finished hypothesis wins, then a longer one
    assert results[0.0] == [eos] and results[12.0] == [t1, t2]


@pytest.mark.parametrize("k", [2, 3, 4])
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("label", ["small-seed3", "small-window"])
def test_beam_search_equals_a_plain_reference_beam_search(built, k, which, label):
    """Six steps: beams get reordered (several children of one parent), so the cache rows must follow."""
    s, model = built(label)
    prompt = PROMPTS[label][which]
    fn = torch_logp(model, "decoder", prompt, s.tokens)
    want, want_score = reference_beam(fn, k, 6)
    got = s.generate(prompt, max_new_tokens=6, beams=k).new_ids[0]
    assert got == want
    assert abs(sum_logp(fn, got) - want_score) < 1e-4


@pytest.mark.parametrize("label", ["small-seed3", "tiny-llama", "tiny-transformer", "small-window"])
def test_reordered_beams_carry_their_own_cache(built, label):
    """Beam search moves cache rows to the beams' new slots. The tiny models' next-token ranking
    hardly depends on the history, so the beam ids alone would not show a stale cache: the logits do."""
    s, model = built(label)
    prompt = PROMPTS[label][0]
    if s.architecture == "encoder-decoder":
        runner = EncoderDecoderRunner(s, [prompt] * 3, 0, start_token(s.tokens), 2)
    else:
        runner = DecoderRunner(s, [prompt] * 3, 0, 2)
    runner.prefill()
    first, second, parents = [11, 22, 33], [44, 55, 44], [2, 0, 2]
    runner.step(np.array(first))
    runner.reorder(np.array(parents))
    got = runner.step(np.array(second))
    want = np.stack([next_logits(model, s.architecture, prompt, [[first[p], t]], s.tokens)[0]
                     for p, t in zip(parents, second)])
    stale = np.stack([next_logits(model, s.architecture, prompt, [[f, t]], s.tokens)[0] for f, t in zip(first, second)])
    assert float(np.abs(got - want).max()) < 2e-5
    assert float(np.abs(stale - want).max()) > 2e-4  # the history matters to the logits


@pytest.mark.parametrize("label", ["tiny-llama", "tiny-transformer", "small-window"])
def test_cpu_cache_is_allocated_once_and_written_in_place(built, label):
    """On CPU the loop's cache lives in two buffers per layer made before the prefill: every
    step's past_key_values.* point into them, alternating, and a step past the capacity is refused."""
    s, _ = built(label)
    prompt, new = PROMPTS[label][0], 3
    if s.architecture == "encoder-decoder":
        runner = EncoderDecoderRunner(s, [prompt] * 2, 0, start_token(s.tokens), new)
    else:
        runner = DecoderRunner(s, [prompt] * 2, 0, new)
    pairs = {"past_key_values." + n[len("present."):]: [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in pair]
             for n, pair in runner.kv.buffers.items()}
    assert pairs and all(".encoder." not in n for n in pairs)

    def side(name, value):
        start = value.data_ptr()
        hits = [i for i, (lo, hi) in enumerate(pairs[name]) if lo <= start < hi]
        assert len(hits) == 1, name
        return hits[0]

    runner.prefill()
    sides = []
    for step in range(new):
        assert set(runner.cache) == set(pairs)
        sides.append({side(n, v) for n, v in runner.cache.items()})
        if step < new - 1:
            runner.step(np.array([5, 6]))
        else:
            runner.reorder(np.array([1, 0]))  # a beam reorder takes the other buffer too
            sides.append({side(n, v) for n, v in runner.cache.items()})
    assert sides == [{0}, {1}, {0}, {1}]
    runner.step(np.array([5, 6]))  # the third new token: the capacity
    with pytest.raises(RunError, match="capacity"):
        runner.step(np.array([5, 6]))


def test_window_caches_hold_the_window_only(built):
    """A sliding layer's cache is its window long after a longer prompt and after every step (the
    global layer's grows), and its CPU buffers are sized for the window, not the generation."""
    s, _ = built("small-window")
    prompt = PROMPTS["small-window"][1]
    runner = DecoderRunner(s, [prompt, prompt[:2]], 0, 4)
    assert {n: b[0].size for n, b in runner.kv.buffers.items()} == {
        f"present.{i}.{w}": 2 * 4 * 3 * 8 if i != 1 else 2 * 4 * (6 + 4) * 8 for i in range(3) for w in ("key", "value")}
    runner.prefill()
    for total in range(6, 10):
        lengths = {n: v.shape()[2] for n, v in runner.cache.items()}
        assert lengths == {f"past_key_values.{i}.{w}": 3 if i != 1 else total for i in range(3) for w in ("key", "value")}
        runner.step(np.array([5, 6]))


def test_a_window_cache_continues_a_run_and_a_wrong_one_is_refused(built):
    """Session.run's presents fed back (with the mask over the whole sequence, or without: the
    global layer's cache says the length) give torch's logits; a window cache cut short of its
    window is refused naming it."""
    s, model = built("small-window")
    prompt = PROMPTS["small-window"][1]
    past = present_to_past(s.run(input_ids=[prompt]))
    want = _logits(model, input_ids=[prompt + [9]])[:, -1]
    for mask in ({"attention_mask": np.ones((1, len(prompt) + 1), np.int64)}, {}):
        got = s.run(input_ids=[[9]], **mask, **past)["logits"][:, -1]
        assert float(np.abs(got - want).max()) < 1e-4
    short = {**past, **{n: v[:, :, 1:] for n, v in past.items() if not n.startswith("past_key_values.1.")}}
    with pytest.raises(RunError, match=r"past_key_values\.0\.key: a window cache of 2 positions, .* min\(3, 6\) = 3"):
        s.run(input_ids=[[9]], **short)
    # and within one call, the window caches must agree
    with pytest.raises(RunError, match=r"past_key_values\.2\.key: past_sequence_window3 is 2 .* but 3 in past_key_values\.0\.key"):
        s.run(input_ids=[[9]], **{**past, "past_key_values.2.key": past["past_key_values.2.key"][:, :, 1:]})


def test_a_full_window_cache_needs_the_mask_that_says_the_length(built):
    """Every layer sliding: a run fed caches at their full window takes the mask over the whole
    sequence (torch's logits), and without one is refused naming attention_mask; while the
    caches are shorter than the window, they say the length themselves."""
    s, model = built("all-windowed")
    prompt = PROMPTS["all-windowed"][1]
    past = present_to_past(s.run(input_ids=[prompt]))
    assert {v.shape[2] for v in past.values()} == {3}
    got = s.run(input_ids=[[9]], attention_mask=np.ones((1, len(prompt) + 1), np.int64), **past)["logits"][:, -1]
    assert float(np.abs(got - _logits(model, input_ids=[prompt + [9]])[:, -1]).max()) < 1e-4
    with pytest.raises(RunError, match=r"^attention_mask: needed with a cache: every layer keeps a window of at most 3"):
        s.run(input_ids=[[9]], **past)
    short = present_to_past(s.run(input_ids=[prompt[:2]]))
    got = s.run(input_ids=[[9]], **short)["logits"][:, -1]
    assert float(np.abs(got - _logits(model, input_ids=[prompt[:2] + [9]])[:, -1]).max()) < 1e-4


def test_two_step_beam_search_never_scores_below_greedy(small_two_step):
    s, prompt, lp1, lp2 = small_two_step
    greedy = s.generate(prompt, max_new_tokens=2).new_ids[0]
    for k in (2, 4):
        beam = s.generate(prompt, max_new_tokens=2, beams=k).new_ids[0]
        assert lp1[beam[0]] + lp2[beam[0], beam[1]] >= lp1[greedy[0]] + lp2[greedy[0], greedy[1]] - 1e-6


def test_three_token_beam_search_scores_at_least_greedy_here(built):
    """Not a theorem for three tokens, but for this fixed model beam search (k=2) finds a
    continuation whose log-prob, computed with torch, is at least greedy's."""
    s, model = built("small-seed3")
    prompt = PROMPTS["small-seed3"][1]
    fn = torch_logp(model, "decoder", prompt, s.tokens)
    greedy = s.generate(prompt, max_new_tokens=3).new_ids[0]
    beam = s.generate(prompt, max_new_tokens=3, beams=2).new_ids[0]
    assert len(beam) == 3
    assert sum_logp(fn, beam) >= sum_logp(fn, greedy) - 1e-6


def test_beam_search_on_an_encoder_decoder_equals_the_reference(built):
    s, model = built("tiny-transformer")
    src = PROMPTS["tiny-transformer"][0]
    fn = torch_logp(model, "encoder-decoder", src, s.tokens)
    want, _ = reference_beam(fn, 3, 5)
    got = s.generate(src, max_new_tokens=5, beams=3)
    assert got.new_ids == [want]
    assert got.ids == [[start_token(s.tokens)] + want]


def test_beam_search_on_a_ragged_batch_equals_each_prompt_alone(built):
    s, _ = built("tiny-llama")
    p0, p1 = PROMPTS["tiny-llama"]
    batch = s.generate([p0, p1], max_new_tokens=5, beams=3)
    for i, p in enumerate((p0, p1)):
        assert batch.new_ids[i] == s.generate(p, max_new_tokens=5, beams=3).new_ids[0]
        assert batch.ids[i] == p + batch.new_ids[i]


def test_beam_search_with_eos_ends_at_eos_or_at_max_length(built):
    s, _ = built("tiny-llama")
    p0, p1 = PROMPTS["tiny-llama"]
    free = s.generate([p0, p1], max_new_tokens=6, beams=3)
    eos = free.new_ids[0][2]
    calls = []
    got = s.generate([p0, p1], max_new_tokens=6, beams=3, eos_id=eos, on_token=lambda step, new: calls.append(new))
    for row in got.new_ids:
        assert 1 <= len(row) <= 6
        assert (row[-1] == eos) or len(row) == 6
        assert eos not in row[:-1]
    # the winners are reported through on_token at the end, row by row
    assert [c[0] for c in calls if c[0] is not None] == got.new_ids[0]
    assert [c[1] for c in calls if c[1] is not None] == got.new_ids[1]


def test_one_beam_is_greedy(built):
    s, _ = built("small-seed3")
    prompts = list(PROMPTS["small-seed3"])
    assert s.generate(prompts, max_new_tokens=5, beams=1) == s.generate(prompts, max_new_tokens=5)


def test_captured_decoder_steps_equal_the_inplace_runner_on_cpu(tmp_path):
    """The GPU decoder's bound-buffer steps (specc/runtime/captured.py: a store of the build's whole
    length, total_sequence_length held at that length on every step, seqlens_k saying each row's
    length) give the logits the CPU's in-place runner gives; capture itself needs CUDA
    (tests/runtime/test_cuda.py)."""
    d = tmp_path / "llama"
    specc.build("tiny-llama", d, precision="fp16", progress=None)
    s = Session(d)
    prompts = [[5, 17, 33, 2, 9], [7, 7, 1, 400, 3]]
    decoder = CapturedDecoder(s.inplace, len(prompts), s.info.length.max, lm_output(s.info), capture=False)
    for run in range(2):  # the second generation reuses the store the first one wrote
        ours, theirs = CapturedRunner(decoder, prompts, 6), InplaceRunner(s, prompts, 6)
        a, b = ours.prefill(), theirs.prefill()
        np.testing.assert_array_equal(a, b)
        for _ in range(6):
            tokens = a.argmax(-1)
            a, b = ours.step(tokens), theirs.step(tokens)
            np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), atol=2e-3)
            assert (a.argmax(-1) == b.argmax(-1)).all()
        prompts = [p[::-1] for p in prompts]


def test_greedy_on_float16_is_numpys_argmax():
    """float16 rows are compared as ordered integers: the same choice as argmax over the floats
    (negatives, infinities, subnormals, ties: the first of equal maxima)."""
    rng = np.random.default_rng(0)
    rows = [rng.standard_normal((3, 50257)).astype(np.float16) * 30,
            -np.abs(rng.standard_normal((2, 1000))).astype(np.float16),  # all negative
            np.array([[-np.inf, -2.0, -np.inf, -2.0], [1e-7, 2e-7, 0.0, 1e-7], [np.inf, 1.0, np.inf, 0.0]], np.float16)]
    for x in rows:
        np.testing.assert_array_equal(greedy(x), x.astype(np.float32).argmax(-1))
    x32 = rng.standard_normal((2, 7)).astype(np.float32)
    np.testing.assert_array_equal(greedy(x32), x32.argmax(-1))
