"""Speculative decoding (specc/runtime/speculative.py) with the prompt-lookup drafter
(specc/decoding/draft.py): greedy tokens identical to plain greedy decoding over many seeded
prompts, repetitive ones among them so that drafts are accepted and rejected (the cache cut back),
EOS and max_new_tokens honoured; sampling's rule drawing from the target's distribution (exact
probabilities, and the model's own from full-sequence runs); the drafter against a brute-force
search, and the refusals."""
from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
from click.testing import CliRunner

import specc
from specc.cli import main
from specc.decoding import draft as draft_module
from specc.decoding import engine as engine_module
from specc.decoding.draft import MAX_NGRAM, MIN_NGRAM, PromptLookup, free_guess
from specc.runtime import RunError, Session
from specc.decoding.sampling import Sampler, distribution
from specc.runtime.generate import DecoderRunner, InplaceRunner, checks_drafts
from specc.runtime.scheduler import LENGTH, GenerationLimits, GenerationRequest, Scheduler
from specc.decoding.speculation import BUDGET, GUESSED, HORIZON, MAX_PAUSE, RESUME, STREAK
from specc.runtime import speculative as speculative_module
from specc.runtime.speculative import MAX_DRAFT, DraftLength, check
from specc.export import inplace as inplace_module
from specc.spec.io import LM_POSITIONS, SPARE_SEQUENCE

from tests.helpers import speclib

pytest.importorskip("onnxruntime")

SMALL = speclib.tiny({"vocab": {"size": 61, "tie_output": False}})
WINDOWED = speclib.tiny({"vocab": {"size": 61, "tie_output": False},
                         "decoder": {"attention": {"heads": 4, "pattern": {"kind": "local", "window": 3}}}})
TARGETS = {"tiny-llama": ("tiny-llama", 0), "tiny-gpt2": ("tiny-gpt2", 0), "small-seed3": (SMALL, 3)}
NEW = 24


class _StepClock:
    """`time` whose perf_counter moves one second a reading: every timed call (a plain step, a
    check) then lasts the same, so how often these tests draft hangs on acceptance alone, not on
    the machine's load (DraftLength's own tests below hand it timings)."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += 1.0
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture(autouse=True)
def step_clock(monkeypatch):
    clock = _StepClock()
    monkeypatch.setattr(speculative_module, "time", clock)
    monkeypatch.setattr(engine_module, "time", clock)
    return clock


@pytest.fixture
def single_token_matches(monkeypatch):
    """Prompt lookup drafting after a suffix of one token too: a seeded model's sampled text
    repeats tokens, rarely pairs of them, and the sampling tests need drafts at most steps,
    accepted and rejected (the rule they check does not depend on where drafts come from)."""
    monkeypatch.setattr(draft_module, "MIN_NGRAM", 1)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    done: dict = {}

    def get(label: str, spec=None, seed: int = 0) -> Session:
        if label not in done:
            spec, seed = TARGETS[label] if spec is None else (spec, seed)
            out = tmp_path_factory.getbasetemp() / "specc-speculative-builds" / label
            done[label] = Session(specc.build(spec, out, seed=seed).out_dir)
        return done[label]

    return get


def prompts(vocab: int, count: int = 24) -> list[list[int]]:
    """Seeded prompts: random ones, and ones that repeat a short random phrase (drafts to accept)."""
    rng = np.random.default_rng(53)
    out = [rng.integers(0, vocab, rng.integers(1, 16)).tolist() for _ in range(count // 2)]
    for _ in range(count - len(out)):
        phrase = rng.integers(0, vocab, rng.integers(2, 6)).tolist()
        out.append((phrase * 8)[: rng.integers(len(phrase) + 1, 30)])
    return out


# --- exactness -------------------------------------------------------------------------------------


@pytest.mark.parametrize("label", list(TARGETS))
def test_greedy_tokens_equal_plain_greedy_decoding(built, label):
    session = built(label)
    drafted = accepted = rejected_steps = 0
    for prompt in prompts(min(session.limits.vocab, 61)):
        plain = session.generate(prompt, NEW, eos_id=-1)
        spec = session.generate(prompt, NEW, eos_id=-1, speculative="ngram")
        assert spec.new_ids == plain.new_ids, prompt
        assert spec.ids == plain.ids
        s = spec.speculation
        drafted, accepted = drafted + s.drafted, accepted + s.accepted
        rejected_steps += s.accepted < s.drafted
        assert s.steps + 1 + s.accepted >= len(spec.new_ids[0])  # each call adds one token and its accepted drafts
    # both paths ran: drafts accepted (several tokens a call) and rejected (the cache cut back)
    assert accepted > 0 and rejected_steps > 0 and accepted < drafted


def test_fewer_target_calls_where_the_text_repeats(built):
    session = built("small-seed3")
    prompt = [7, 8, 9, 10, 11] * 6
    spec = session.generate(prompt, NEW, eos_id=-1, speculative="ngram")
    assert spec.new_ids == session.generate(prompt, NEW, eos_id=-1).new_ids
    if spec.speculation.accepted:  # the model continued the pattern: fewer calls than tokens
        assert spec.speculation.steps < NEW - 1


@pytest.mark.parametrize("n", [1, 2, 3, 5, 11])
def test_max_new_tokens_is_honoured(built, n):
    session = built("small-seed3")
    for prompt in prompts(61, 8):
        spec = session.generate(prompt, n, eos_id=-1, speculative="ngram")
        assert len(spec.new_ids[0]) == n
        assert spec.new_ids == session.generate(prompt, n, eos_id=-1).new_ids


def test_eos_stops_where_plain_decoding_stops(built):
    session = built("small-seed3")
    checked = 0
    for prompt in prompts(61):
        plain = session.generate(prompt, NEW, eos_id=-1).new_ids[0]
        for eos in set(plain[1:-1]):
            stop = plain.index(eos) + 1
            spec = session.generate(prompt, NEW, eos_id=eos, speculative="ngram")
            assert spec.new_ids[0] == plain[:stop]
            assert spec.new_ids == session.generate(prompt, NEW, eos_id=eos).new_ids
            checked += 1
    assert checked > 10


def test_on_token_sees_each_token_in_order(built):
    session = built("small-seed3")
    prompt = [3, 4, 5, 3, 4, 5, 3, 4]
    seen = []
    spec = session.generate(prompt, NEW, eos_id=-1, speculative="ngram", on_token=lambda step, new: seen.append((step, new)))
    assert seen == [(i, [t]) for i, t in enumerate(spec.new_ids[0])]


def test_model_onnx_without_the_inplace_graph_gives_the_same_tokens(built):
    session = built("tiny-llama")
    plain = Session(session.dir, inplace=False)
    for prompt in prompts(61, 6):
        assert plain.generate(prompt, NEW, eos_id=-1, speculative="ngram").new_ids == \
            session.generate(prompt, NEW, eos_id=-1).new_ids


def test_specc_generate_speculative_prints_the_same_tokens_and_its_acceptance(built):
    session = built("small-seed3")
    args = ["generate", str(session.dir), "--ids", "7,8,9,10,11,7,8,9,10,11,7,8", "--max-new-tokens", "16",
            "--eos-id", "-1", "--json"]
    plain, spec = CliRunner().invoke(main, args), CliRunner().invoke(main, args + ["--speculative", "ngram"])
    assert spec.exit_code == 0, spec.output
    assert json.loads(spec.stdout) == json.loads(plain.stdout)
    assert "specc: speculative ngram: " in spec.stderr and "drafted tokens accepted" in spec.stderr
    beams = CliRunner().invoke(main, args + ["--speculative", "ngram", "--beams", "2"])
    assert beams.exit_code == 1 and "beam search" in beams.stderr and "Traceback" not in beams.output


# --- a draft build -------------------------------------------------------------------------------


def test_a_draft_build_gives_plain_greedy_tokens_and_itself_drafts_all_accepted(built):
    session = built("small-seed3")
    itself = Session(session.dir)  # the same weights: every guess is the model's own choice
    other = built("small-seed4", SMALL, 4)
    for prompt in prompts(61, 12):
        plain = session.generate(prompt, NEW, eos_id=-1).new_ids
        same = session.generate(prompt, NEW, eos_id=-1, speculative=itself)
        assert same.new_ids == plain
        assert same.speculation.accepted == same.speculation.drafted > 0  # (how often it drafts: timings')
        assert session.generate(prompt, NEW, eos_id=-1, speculative=other).new_ids == plain
    eos = plain[0][5]
    assert session.generate(prompts(61)[-1], NEW, eos_id=eos, speculative=itself).new_ids == \
        session.generate(prompts(61)[-1], NEW, eos_id=eos).new_ids


def test_a_draft_builds_prompt_runs_before_the_first_token(built, monkeypatch):
    """As llama.cpp's speculative example evaluates the prompt with both models before it
    decodes: the draft build's prefill comes before the first token, so a check's time (the
    ledger's) and the decode's never hold it."""
    session = built("small-seed3")
    events: list[str] = []
    real = speculative_module.ModelDraft.prefill

    def prefill(self):
        events.append("draft prefill" if self.cached is None else "prefilled already")
        real(self)

    monkeypatch.setattr(speculative_module.ModelDraft, "prefill", prefill)
    got = session.generate([5, 6, 7, 8], 6, eos_id=-1, speculative=Session(session.dir),
                           on_token=lambda step, ids: events.append(f"token {step}"))
    assert events[:2] == ["draft prefill", "token 0"]
    assert "draft prefill" not in events[2:] and got.speculation.drafted > 0
    assert got.new_ids == session.generate([5, 6, 7, 8], 6, eos_id=-1).new_ids


def test_a_draft_build_of_another_vocabulary_is_refused(built):
    with pytest.raises(RunError, match="vocabulary of"):
        built("small-seed3").generate([1, 2, 3], 4, speculative=built("tiny-llama"))


def test_specc_generate_takes_a_draft_builds_directory(built):
    session = built("small-seed3")
    args = ["generate", str(session.dir), "--ids", "4,5,6", "--max-new-tokens", "12", "--eos-id", "-1", "--json"]
    plain, spec = CliRunner().invoke(main, args), CliRunner().invoke(main, args + ["--speculative", str(session.dir)])
    assert spec.exit_code == 0, spec.output
    assert json.loads(spec.stdout) == json.loads(plain.stdout)
    assert f"specc: speculative draft {session.dir}: " in spec.stderr
    missing = CliRunner().invoke(main, args + ["--speculative", str(session.dir) + "-none"])
    assert missing.exit_code == 1 and "not a specc build" in missing.stderr and "Traceback" not in missing.output


# --- sampling --------------------------------------------------------------------------------------


def test_the_sampling_rule_draws_each_token_from_the_targets_distribution():
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 1.5, (3, 5))
    draft = [2, 1]
    logits[0, 2] += 2.0  # drafts likely enough to be kept often, and rejected often
    logits[1, 1] += 2.0
    choose = Sampler(temperature=0.8, top_k=4, seed=0)
    p = distribution(logits, 0.8, 4, None)
    n = 60000
    first, second_after_x = np.zeros(5), np.zeros(5)
    kept = np.zeros(3)
    for _ in range(n):
        accepted, token = check(choose, logits, draft)
        kept[accepted] += 1
        made = draft[:accepted] + [token]
        first[made[0]] += 1
        if made[0] == 2 and len(made) > 1:
            second_after_x[made[1]] += 1
    assert kept.min() > 1000  # every path taken
    np.testing.assert_allclose(first / n, p[0], atol=0.01)
    np.testing.assert_allclose(second_after_x / second_after_x.sum(), p[1], atol=0.015)


@pytest.mark.parametrize("options", [{"temperature": 0.8}, {"temperature": 1.3, "top_k": 5}, {"temperature": 0.6, "top_p": 0.9}])
def test_a_seeds_sampled_tokens_are_plain_samplings(built, options, single_token_matches):
    """Sampled speculative decoding draws one uniform per token kept, as plain sampling does:
    the same seed, the same tokens, token for token, drafts accepted and rejected."""
    session = built("small-seed3")
    drafted = accepted = 0
    for i, prompt in enumerate(prompts(61, 12)):
        got = session.generate(prompt, NEW, seed=i, eos_id=-1, speculative="ngram", **options)
        assert got.new_ids == session.generate(prompt, NEW, seed=i, eos_id=-1, **options).new_ids
        drafted, accepted = drafted + got.speculation.drafted, accepted + got.speculation.accepted
    assert 0 < accepted < drafted


def test_speculative_sampling_keeps_the_models_distribution(built, single_token_matches):
    """The third token's distribution (the first a check of drafts makes: the first step after the
    prompt is a plain one, which checks are timed against) against the exact one."""
    session = built("small-seed3")
    prompt = session.generate([5, 6], 40, eos_id=-1).ids[0]  # its own text: tokens recur, drafts come
    runs = 2000
    thirds, drafted = np.zeros(61), 0
    for seed in range(runs):
        g = session.generate(prompt, 3, temperature=1.0, seed=seed, eos_id=-1, speculative="ngram")
        thirds[g.new_ids[0][2]] += 1
        drafted += g.speculation.drafted
    assert drafted > runs // 4
    again = [session.generate(prompt, 6, temperature=1.0, seed=7, speculative="ngram").new_ids for _ in range(2)]
    assert again[0] == again[1]  # a seed's tokens, run after run

    def after(prefixes: np.ndarray) -> np.ndarray:
        """The next token's exact distribution after each row, from full-sequence runs (no cache)."""
        return np.concatenate([distribution(session.run(input_ids=prefixes[i:i + 16])["logits"][:, -1], 1.0, None, None)
                               for i in range(0, len(prefixes), 16)])

    p0 = after(np.array([prompt]))[0]
    p1 = after(np.array([prompt + [t] for t in range(61)]))  # [t1, t2]
    p2 = after(np.array([prompt + [t, u] for t in range(61) for u in range(61)])).reshape(61, 61, 61)
    expected = runs * np.einsum("a,ab,abc->c", p0, p1, p2)
    big = expected >= 5  # chi-square over the cells expected 5 times or more, the rest pooled
    observed, expected = np.append(thirds[big], thirds[~big].sum()), np.append(expected[big], expected[~big].sum())
    observed, expected = observed[expected > 0], expected[expected > 0]
    chi2, df = (((observed - expected) ** 2) / expected).sum(), len(expected) - 1
    assert chi2 < df + 6 * np.sqrt(2 * df), (chi2, df)


# --- refusals --------------------------------------------------------------------------------------


@pytest.mark.parametrize("options, words", [
    ({"speculative": "medusa"}, "the drafters are ngram, or a draft build's Session"),
    ({"speculative": ["ngram"]}, "the drafters are ngram"),
    ({"speculative": "ngram", "beams": 2}, "beam search"),
    ({"speculative": "ngram", "input_ids": [[1, 2], [3, 4]]}, "one prompt"),
])
def test_what_it_does_not_do_is_a_run_error(built, options, words):
    session = built("small-seed3")
    options = {"input_ids": [1, 2, 3], **options}
    with pytest.raises(RunError, match=words):
        session.generate(options.pop("input_ids"), 4, **options)


def test_window_caches_are_refused(built):
    session = built("windowed", WINDOWED, 3)
    with pytest.raises(RunError, match="window of 3 positions"):
        session.generate([1, 2, 3], 4, speculative="ngram")


# --- the drafter and the draft length --------------------------------------------------------------


def brute_force(tokens: list[int], k: int) -> list[int]:
    for n in range(min(MAX_NGRAM, len(tokens)), MIN_NGRAM - 1, -1):
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):  # the latest occurrence before the suffix itself
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


def test_prompt_lookup_proposes_what_a_brute_force_search_finds():
    rng = np.random.default_rng(0)
    for _ in range(300):
        tokens = rng.integers(0, rng.integers(2, 8), rng.integers(1, 40)).tolist()
        cut = int(rng.integers(0, len(tokens) + 1))
        drafter = PromptLookup(tokens[:cut])
        drafter.extend(tokens[cut:])
        for k in (1, 3, 8):
            assert drafter.propose(k) == brute_force(tokens, k), (tokens, k)
    assert PromptLookup([1, 2, 3]).propose(4) == []
    assert PromptLookup([1, 2, 3, 1, 2]).propose(0) == []
    assert PromptLookup([9, 1, 2, 3, 4, 5, 1, 2]).propose(2) == [3, 4]
    assert MIN_NGRAM == 2 and PromptLookup([9, 1, 2, 3, 4, 5, 1]).propose(2) == []  # one token seen before: no draft
    assert PromptLookup([5, 1, 2, 7, 9, 1, 2, 8, 5, 1, 2]).propose(1) == [7]  # the longest suffix first: [5, 1, 2], not [1, 2]


def test_draft_length_weighs_a_check_against_plain_steps():
    length = DraftLength()
    assert length.next() == 0  # a plain step first: what checks are weighed against
    length.plain(1.0)
    k = length.next()
    length.update(k, 0, 2.5)  # all rejected at 2.5 steps: 1.5 lost, 2 tokens made
    wait = math.ceil((1.5 + 1.5) / BUDGET - 2 - HORIZON)  # until another 1.5 lost stays within the budget
    assert [length.next() for _ in range(min(wait, MAX_PAUSE))] == [0] * min(wait, MAX_PAUSE)
    assert length.next() == k == 1  # the cheapest probe, and again after the pause
    length.update(k, 0, 1.2)  # a cheap check that lost 0.2: within the budget, drafting goes on
    assert length.next() == 1 and length.balance == pytest.approx(-1.7)
    while length.balance + BUDGET * (length.tokens + HORIZON) >= 0.2 + 0.2:  # ... until such losses reach the budget
        length.update(1, 0, 1.2)
        assert length.next() == 1
    length.update(1, 0, 1.2)
    assert length.next() == 0
    cheap = DraftLength()
    assert cheap.next() == 0
    cheap.plain(1.0)
    for k in (1, 2, 4, MAX_DRAFT):  # all kept at the time of a step or two: doubled
        assert cheap.next() == k
        cheap.update(k, k, 2.0)
    for _ in range(20):  # checks that pay: 3 tokens for 2 steps' time
        cheap.update(cheap.next(), 2, 2.0)
        assert cheap.next() == 3
    cheap.update(3, 0, 2.0)  # a rejection after checks that gained: drafting goes on
    assert cheap.next() == 1
    dear = DraftLength()
    assert dear.next() == 0
    dear.plain(1.0)
    dear.update(dear.next(), 1, 3.0)  # kept, but slower than plain steps: a longer draft may pay
    assert dear.next() == 2
    dear.update(2, 1, 4.0)  # part kept, and slower than plain steps: a pause
    assert dear.next() == 0


def _lost_to_rejected_checks(cost: float, n: int, right=None, first: float = 1.0, capped: bool = True) -> float:
    """The plain steps that checks of `cost` steps, all rejected, lose over n tokens; right(i):
    whether the i-th plain step's guess was its token (None: no guesses); `first`: what the first
    plain step took (every other one takes 1); `capped`: DraftLength's."""
    length, made, lost, plain = DraftLength(capped), 1, 0.0, 0
    length.next()
    length.plain(first)
    while made < n:
        k = length.next()
        made += 1
        if k:
            length.update(k, 0, cost)
            lost += cost - 1
        else:
            length.plain(1.0)
            if right is not None:
                plain += 1
                length.guessed(right(plain))
    return lost


def test_drafting_on_text_with_nothing_to_copy_loses_at_most_its_budget():
    """Checks of one guess, each rejected and costing `cost` steps: over a generation of n tokens
    the steps they lose stay within BUDGET of n + HORIZON (one probe's loss beyond it at most),
    or where a check loses so much that MAX_PAUSE steps are too few, one loss a pause."""
    for cost in (1.2, 1.9, 2.4, 4.0):
        for n in (64, 128, 512):
            lost = _lost_to_rejected_checks(cost, n)
            assert lost <= max(BUDGET, (cost - 1) / (MAX_PAUSE + 1)) * (n + HORIZON) + (cost - 1), (cost, n, lost)


def test_a_drafter_whose_guesses_cost_pauses_as_long_as_its_budget_says():
    """Uncapped pauses (a draft build's): whatever a rejected check costs, the steps lost stay
    within BUDGET of n + HORIZON and one probe's loss, where MAX_PAUSE lets dear probes recur."""
    for cost in (2.4, 4.0, 8.0):
        for n in (128, 512, 2048):
            assert _lost_to_rejected_checks(cost, n, capped=False) <= BUDGET * (n + HORIZON) + (cost - 1), (cost, n)
    assert _lost_to_rejected_checks(8.0, 2048) > BUDGET * (2048 + HORIZON) + 7.0  # capped: every 64 steps


def test_a_draft_build_drafts_with_uncapped_pauses_and_prompt_lookup_with_capped_ones(built, monkeypatch):
    made: list[bool] = []

    class Recorded(DraftLength):
        def __init__(self, capped: bool = True):
            made.append(capped)
            super().__init__(capped)

    monkeypatch.setattr(speculative_module, "DraftLength", Recorded)
    session = built("small-seed3")
    session.generate([5, 6, 7, 8], 4, eos_id=-1, speculative="ngram")
    session.generate([5, 6, 7, 8], 4, eos_id=-1, speculative=Session(session.dir))
    assert made == [True, False]


def test_a_slow_first_plain_step_does_not_make_rejected_checks_look_cheap():
    """Checks are weighed against a plain step's time, measured first; where that first step was
    slow (the machine's hiccup: ten times the rest), a check faster than it corrects the estimate
    and a plain step measures again, so rejected checks still lose at most their budget (and
    one probe) instead of drafting on at every step."""
    for cost in (1.2, 1.9):
        lost = _lost_to_rejected_checks(cost, 128, first=10.0)
        assert lost <= BUDGET * (128 + HORIZON) + 2 * (cost - 1), (cost, lost)
        assert lost < 0.5 * 128 * (cost - 1)  # (drafting at every step would lose about n x (cost - 1))


def test_right_guesses_in_a_row_end_a_pause():
    """The plain steps of a pause still guess (prompt lookup's guesses are free): STREAK right
    guesses in a row end it, k at least RESUME, while another such loss stays within GUESSED x
    BUDGET; a wrong guess starts the count again."""
    length = DraftLength()
    length.next()
    length.plain(1.0)
    length.update(length.next(), 0, 2.5)  # lost 1.5: a pause of dozens of steps
    assert length.wait > STREAK + 2
    for right in [True] * (STREAK - 1) + [False] + [True] * (STREAK - 1):
        assert length.next() == 0
        length.guessed(right)
    assert length.next() == 0
    length.guessed(True)
    assert length.next() == RESUME
    spent = DraftLength()  # losses beyond what GUESSED x BUDGET allows: guesses do not end the pause
    spent.next()
    spent.plain(1.0)
    spent.balance = -GUESSED * BUDGET * (1 + HORIZON)
    spent.update(spent.next(), 0, 2.5)
    for _ in range(STREAK + 2):
        assert spent.next() == 0
        spent.guessed(True)


def test_guesses_right_in_streaks_before_checks_that_lose_spend_at_most_their_budget():
    """Text whose guesses come right STREAK times in a row (and then wrong), and whose checks are
    all rejected: the probes lose at most GUESSED x BUDGET of its tokens and HORIZON (one probe's
    loss beyond it), or one loss a pause where MAX_PAUSE steps are too few."""
    for cost in (1.2, 1.9, 2.4, 4.0):
        for n in (64, 128, 512):
            for period in (STREAK + 1, STREAK + 3, 10):
                lost = _lost_to_rejected_checks(cost, n, lambda i: i % period != 0)
                bound = max(GUESSED * BUDGET, (cost - 1) / (MAX_PAUSE + 1)) * (n + HORIZON) + (cost - 1)
                assert lost <= bound, (cost, n, period, lost)


def test_draft_length_grows_shrinks_and_pauses_without_timings():
    length = DraftLength()
    assert length.next() == 0  # the plain step first
    k = length.next()
    length.update(k, k)
    assert length.next() == 2 * k
    for _ in range(5):
        length.update(length.next(), length.next())
    assert length.next() == MAX_DRAFT
    length.update(MAX_DRAFT, 2)
    assert length.next() == 3
    length.update(3, 0)
    length.update(1, 0)  # two drafts in a row all rejected: plain steps for a while
    pauses = 0
    while length.next() == 0:
        pauses += 1
    assert pauses > 0


# --- the in-place graph checks drafts ---------------------------------------------------------------


@pytest.mark.parametrize("label", ["tiny-llama", "small-seed3"])
def test_the_inplace_graph_checks_drafts_as_model_onnx_does(built, label):
    """A speculative step's check on the in-place graph (its LM output holds a call's last
    io.LM_POSITIONS positions) gives model.onnx's logits at every checked position, after a cut back too."""
    session = built(label)
    assert checks_drafts(session)
    rng, vocab = np.random.default_rng(9), session.limits.vocab
    prompt = rng.integers(0, vocab, 5).tolist()
    ours, theirs = InplaceRunner(session, [prompt], 3 * LM_POSITIONS), DecoderRunner(session, [prompt], 0, 3 * LM_POSITIONS)
    np.testing.assert_allclose(ours.prefill(), theirs.prefill(), atol=1e-5)
    for t, keep in ((LM_POSITIONS, 2), (3, 0), (1, 1)):
        tokens = rng.integers(0, vocab, (1, t))
        got, want = ours.extend(tokens), theirs.extend(tokens)
        assert got.shape == want.shape == (1, t, vocab)
        np.testing.assert_allclose(got, want, atol=1e-5)
        total = len(theirs.mask[0]) - t + keep
        ours.truncate(total)
        theirs.truncate(total)
    longer = rng.integers(0, vocab, (1, LM_POSITIONS + 4))  # past LM_POSITIONS: the last ones alone
    np.testing.assert_allclose(ours.extend(longer), theirs.extend(longer)[:, -LM_POSITIONS:], atol=1e-5)


# --- in the serving engine ----------------------------------------------------------------------------


class _Sink:
    def __init__(self):
        self.tokens, self.reason = [], None

    def token(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return True

    def done(self, reason: str, error: str | None = None) -> None:
        self.reason = reason


def _serve(session, requests, rows: int):
    scheduler = Scheduler(session, GenerationLimits(max_sequences=rows, max_cache_tokens=rows * 128, max_waiting=100))
    sinks = [_Sink() for _ in requests]
    for r, s in zip(requests, sinks):
        scheduler.submit(r, s)
    while scheduler.step():
        pass
    return sinks, scheduler.stats


@pytest.mark.parametrize("rows", [1, 4])
def test_speculative_requests_in_the_engine_give_plain_greedy_tokens(built, rows):
    """Speculative and plain requests served together (rows 1: each alone, its drafts in its
    step's call; rows 4: drafts checked in calls of their own beside the batched step): each
    request's tokens are plain greedy decoding's, and drafts were accepted."""
    session = built("tiny-llama")
    reqs = [GenerationRequest(ids=tuple(p), max_tokens=NEW, eos=-1, speculative="ngram" if i % 4 else None)
            for i, p in enumerate(prompts(session.limits.vocab, 12))]
    sinks, stats = _serve(session, reqs, rows)
    for r, s in zip(reqs, sinks):
        assert s.tokens == session.generate(list(r.ids), NEW, eos_id=-1).new_ids[0] and s.reason == LENGTH
    assert stats.speculation.accepted > 0
    assert stats.steps < stats.tokens - len(reqs)


def test_sampled_speculative_requests_with_a_seed_repeat(built):
    """The engine's speculative sampling (the rule tested above) draws with the request's own
    generator: the same seed, the same tokens, another seed other tokens; max_tokens honoured."""
    session = built("tiny-llama")
    prompt = tuple([7, 8, 9, 10] * 6)

    def run(seed: int) -> list[int]:
        r = GenerationRequest(ids=prompt, max_tokens=NEW, eos=-1, temperature=0.7, seed=seed, speculative="ngram")
        (sink,), _ = _serve(session, [r], 1)
        assert len(sink.tokens) == NEW and sink.reason == LENGTH
        return sink.tokens

    assert run(1) == run(1) != run(2)


def test_plain_steps_weigh_prompt_lookups_guess_of_their_token(built, monkeypatch):
    """Session.generate and the engine's lone row ask prompt lookup for a guess on each step that
    drafted nothing and tell DraftLength whether it was that step's token (it ends pauses)."""
    session = built("tiny-llama")
    guesses, told = [], []

    def spy(drafter):
        guess = free_guess(drafter)
        guesses.append((len(drafter.tokens), guess))
        return guess

    monkeypatch.setattr(speculative_module, "free_guess", spy)
    monkeypatch.setattr(engine_module, "free_guess", spy)
    monkeypatch.setattr(DraftLength, "guessed", lambda self, right: told.append(right))
    monkeypatch.setattr(DraftLength, "next", lambda self: 0)  # a pause throughout: plain steps alone
    prompt = prompts(session.limits.vocab)[-1]
    text = prompt + session.generate(prompt, NEW, eos_id=-1).new_ids[0]
    runs = [lambda: session.generate(prompt, NEW, eos_id=-1, speculative="ngram"),
            lambda: _serve(session, [GenerationRequest(ids=tuple(prompt), max_tokens=NEW, eos=-1, speculative="ngram")], 1)]
    for run in runs:
        guesses.clear(), told.clear()
        run()
        assert len(told) == len(guesses) == NEW - 1
        assert told == [guess == text[at:at + 1] for at, guess in guesses]
        assert True in told and False in told


def test_sampled_speculative_requests_are_plain_sampled_requests(built, single_token_matches):
    session = built("small-seed3")
    prompt = tuple([7, 8, 9, 10] * 6)
    reqs = [GenerationRequest(ids=prompt, max_tokens=NEW, eos=-1, temperature=0.7, seed=seed, speculative=drafter)
            for seed in (1, 2) for drafter in ("ngram", None)]
    sinks, stats = _serve(session, reqs, 1)
    assert sinks[0].tokens == sinks[1].tokens != sinks[2].tokens == sinks[3].tokens
    assert stats.speculation.drafted > 0


# int8 activations, at widths where onnxruntime's one-position attention rounds otherwise than its
# several-position one (a head of 64; at the tiny specs' heads of 8 both agree anyway)
_INT8 = {"d_model": 128, "vocab": {"size": 61, "tie_output": False},
         "position": {"kind": "rotary", "max_length": 128}, "norm": {"kind": "rmsnorm"},
         "serving": {"precision": "int8", "length": {"min": 1, "opt": 16, "max": 128}},
         "decoder": {"attention": {"heads": 2, "kv_heads": 1}, "ffn": {"d_ff": 256, "activation": "swiglu"}}}
INT8 = speclib.tiny(_INT8)


def _single_steps_and_one_call(session, prompt, tokens) -> tuple[np.ndarray, np.ndarray]:
    """The logits of `tokens` after `prompt`, as single steps and as one call of them all."""
    alone = InplaceRunner(session, [prompt], len(tokens))
    alone.prefill()
    steps = np.stack([alone.step(np.array([t]))[0] for t in tokens])
    together = InplaceRunner(session, [prompt], len(tokens))
    together.prefill()
    return steps, together.extend(np.array([tokens]))[0]


@pytest.fixture(scope="module")
def int8_builds(tmp_path_factory):
    """INT8 built as specc builds it (its in-place graph with a spare position) and as a build made
    before the spare (inplace.spare off)."""
    root = tmp_path_factory.getbasetemp() / "specc-speculative-int8"
    spared = Session(specc.build(INT8, root / "spare", seed=3).out_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inplace_module, "spare", lambda r: False)
        unspared = Session(specc.build(INT8, root / "no-spare", seed=3).out_dir)
    return spared, unspared


def test_at_int8_activations_a_single_step_is_a_several_position_calls_row(int8_builds):
    """With the spare position every attention call has two or more, and a single step's logits
    are bit for bit those of the same position in a call of several (a check's), where without it
    they differ (the int8 codes of the next product move: docs/runtime.md)."""
    spared, unspared = int8_builds
    assert {t.dims[2] for n, t in spared.inplace.inputs.items() if n.startswith("past_key_values.")} == {SPARE_SEQUENCE}
    assert spared.info.activations == "int8"
    rng = np.random.default_rng(0)
    cases = [(rng.integers(0, 61, 40).tolist(), rng.integers(0, 61, 5).tolist()) for _ in range(6)]
    for prompt, tokens in cases:
        steps, call = _single_steps_and_one_call(spared, prompt, tokens)
        assert np.array_equal(steps, call)
    assert any(not np.array_equal(*_single_steps_and_one_call(unspared, p, t)) for p, t in cases)


def test_int8_activations_decode_speculatively_with_plain_greedy_tokens(int8_builds):
    """Session.generate and the engine (alone and beside other rows) give plain greedy decoding's
    tokens on a build with int8 activations, drafts accepted."""
    session = int8_builds[0]
    made = [(p, session.generate(p, NEW, eos_id=-1, speculative="ngram")) for p in prompts(61, 12)]
    for p, got in made:
        assert got.new_ids[0] == session.generate(p, NEW, eos_id=-1).new_ids[0]
    assert sum(g.speculation.accepted for _, g in made) > 0
    # to the build's last position (serving.length.max 128), whose spare lies past every table's row
    full = ([3, 14, 15, 9, 2, 6] * 17)[:100]
    assert session.generate(full, 28, eos_id=-1, speculative="ngram").new_ids == \
        session.generate(full, 28, eos_id=-1).new_ids
    reqs = [GenerationRequest(ids=tuple(p), max_tokens=NEW, eos=-1, speculative="ngram" if i % 3 else None)
            for i, p in enumerate(prompts(61, 6))]
    for rows in (1, 3):
        sinks, stats = _serve(session, reqs, rows)
        for r, s in zip(reqs, sinks):
            assert s.tokens == session.generate(list(r.ids), NEW, eos_id=-1).new_ids[0]
        assert stats.speculation.accepted > 0


# the same at int4 with int8 activations: 4-bit products, which some CPUs' kernels (AVX2 without
# AVX-512) multiply a lone row in apart from rows among others
INT4 = speclib.tiny(speclib.merge(_INT8, {"serving": {"precision": "int4", "activations": "int8"}}))


def _lone_row_apart() -> bool:
    """Whether this CPU's MatMulNBits (4-bit, blocks of 32, int8 activations) multiplies a lone row
    otherwise than the same row among others."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    k = n = 256
    node = helper.make_node("MatMulNBits", ["x", "w", "s"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                            block_size=32, accuracy_level=4)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
                              [numpy_helper.from_array(rng.integers(0, 256, (n, k // 32, 16), dtype=np.uint8), "w"),
                               numpy_helper.from_array(rng.random(n * k // 32, dtype=np.float32), "s")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    x = rng.standard_normal((2, k), dtype=np.float32)
    return not np.array_equal(session.run(None, {"x": x[:1]})[0][0], session.run(None, {"x": x})[0][0])


@pytest.fixture(scope="module")
def int4_builds(tmp_path_factory):
    """INT4 built as specc builds it (its 4-bit products given a spare row in a call of one
    position) and without those spare rows (inplace._single_row_spares off)."""
    root = tmp_path_factory.getbasetemp() / "specc-speculative-int4"
    spared = Session(specc.build(INT4, root / "spare", seed=3).out_dir)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(inplace_module, "_single_row_spares", lambda g, nodes: [])
        unspared = Session(specc.build(INT4, root / "no-spare-rows", seed=3).out_dir)
    return spared, unspared


def test_at_int4_with_int8_activations_every_4_bit_product_reads_two_rows_or_more(int4_builds):
    """Each 4-bit product of the in-place graph reads its input with a lone row given twice, and
    the graph's single steps are bit for bit a several-position call's rows; greedy speculative
    decoding gives plain decoding's tokens."""
    import onnx

    session = int4_builds[0]
    graph = onnx.load(str(session.dir / "inplace.onnx"), load_external_data=False).graph
    products = [n for n in graph.node if n.op_type == "MatMulNBits"]
    four = [n for n in products if any(a.name == "bits" and a.i == 4 for a in n.attribute)]
    assert four and all(n.input[0].endswith("/single/in") for n in four)
    rng = np.random.default_rng(1)
    for _ in range(6):
        prompt, tokens = rng.integers(0, 61, 40).tolist(), rng.integers(0, 61, 5).tolist()
        assert np.array_equal(*_single_steps_and_one_call(session, prompt, tokens))
    # one position's prompt is a lone row too
    assert np.array_equal(*_single_steps_and_one_call(session, [7], [3, 9, 4]))
    made = [(p, session.generate(p, NEW, eos_id=-1, speculative="ngram")) for p in prompts(61, 12)]
    for p, got in made:
        assert got.new_ids[0] == session.generate(p, NEW, eos_id=-1).new_ids[0]
    assert sum(g.speculation.accepted for _, g in made) > 0


def test_without_the_spare_rows_a_lone_rows_kernel_moves_int8_codes(int4_builds):
    """Where this CPU multiplies a lone row in a kernel of its own, the build without the products'
    spare rows computes a single step otherwise than a several-position call's row: what the spare
    rows are for."""
    if not _lone_row_apart():
        pytest.skip("this CPU's MatMulNBits multiplies a lone row as it does rows among others")
    unspared = int4_builds[1]
    rng = np.random.default_rng(1)
    cases = [(rng.integers(0, 61, 40).tolist(), rng.integers(0, 61, 5).tolist()) for _ in range(6)]
    assert any(not np.array_equal(*_single_steps_and_one_call(unspared, p, t)) for p, t in cases)


def test_builds_with_int8_activations_and_no_spare_position_are_refused(int8_builds):
    """An in-place graph without the spare position (a build made before it, or a model with routed
    experts) cannot check drafts at int8 activations: refused in words, in Session.generate and the
    engine; plain decoding runs."""
    session = int8_builds[1]
    with pytest.raises(RunError, match="int8 activations .* no spare position .* --activations fp32"):
        session.generate([1, 2, 3], 4, speculative="ngram")
    with pytest.raises(RunError, match="int8 activations"):
        Scheduler(session).check(GenerationRequest(ids=(1, 2), max_tokens=2, speculative="ngram"))
    assert session.generate([1, 2, 3], 4).new_ids  # plain decoding runs


def test_batched_rows_at_int8_activations_are_single_steps(built):
    """What int8 activations change is a call of several positions, not of several rows
    (docs/runtime.md): a decode step of two rows gives each row its own single step's logits, up
    to float rounding, where a moved 8-bit input code would show as a quantization step."""
    session = built("int8", speclib.tiny({"vocab": {"size": 61}, "serving": {"precision": "int8"}}), 3)
    rows, nxt = [[5, 9, 2, 7, 11, 3], [8, 1, 4, 4, 6, 12]], [17, 23]
    alone = []
    for row, token in zip(rows, nxt):
        runner = InplaceRunner(session, [row], 4)
        runner.prefill()
        alone.append(runner.step(np.array([token]))[0])
    runner = InplaceRunner(session, rows, 4)
    runner.prefill()
    together = runner.step(np.array(nxt))
    np.testing.assert_allclose(together, np.stack(alone), rtol=0, atol=1e-5)


def test_speculative_requests_are_refused_where_the_engine_cannot_check_drafts(built):
    session = built("tiny-llama")
    with pytest.raises(RunError, match="speculative: unknown drafter 'lookahead'"):
        Scheduler(session).check(GenerationRequest(ids=(1, 2), max_tokens=2, speculative="lookahead"))
    with pytest.raises(RunError, match="speculative: this build decodes with model.onnx"):
        Scheduler(Session(session.dir, inplace=False)).check(GenerationRequest(ids=(1, 2), max_tokens=2,
                                                                             speculative="ngram"))
