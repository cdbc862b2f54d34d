"""The engine's prefix cache (specc/decoding/prefix.py) through the Scheduler: requests sharing a
long prompt prefix reuse its K/V and answer the greedy tokens they answer with the cache off and
that Session.generate gives each alone; the K/V a prefill computes after a reused past is the
K/V of a prefill of the whole prompt; a second request sharing a 1,000-token system prompt has a
time to first token at least 5x shorter than the first; memory stays within the budget under a
soak of distinct prompts, least recently used first out; a windowed build reuses nothing."""
from __future__ import annotations

import time

import numpy as np
import pytest

import specc
from specc.decoding.prefix import BLOCK, PrefixCache
from specc.runtime import Session
from specc.runtime.scheduler import GenerationLimits, GenerationRequest, Scheduler

pytest.importorskip("onnxruntime")

WINDOWED = """\
specc: 1
name: tiny-llama-window
extends: tiny-llama
decoder:
  layers: 3
  attention: {heads: 4, kv_heads: 2, pattern: {kind: local, window: 6}}
  ffn: {d_ff: 128}
  overrides: [{indices: [1], pattern: {kind: full}}]
"""
# a decoder big enough that a 1,000-token prefill costs what it costs a real one: attention and
# matmuls over the prompt, not the fixed cost of a call
SYSTEM_PROMPT = """\
specc: 1
name: llama-2k
extends: tiny-llama
d_model: 256
position: {kind: rotary, max_length: 2048}
decoder:
  layers: 4
  attention: {heads: 4, kv_heads: 2}
  ffn: {d_ff: 768}
serving:
  batch: {min: 1, opt: 2, max: 4}
  length: {min: 1, opt: 64, max: 2048}
"""


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    done: dict = {}

    def get(name: str) -> Session:
        if name.endswith("/model"):
            return Session(get(name.removesuffix("/model")).dir, inplace=False)
        if name not in done:
            root = tmp_path_factory.getbasetemp() / "specc-runtime-builds"
            root.mkdir(parents=True, exist_ok=True)
            spec = name
            if name in ("tiny-llama-window", "llama-2k"):
                spec = root / f"{name}.yaml"
                spec.write_text(WINDOWED if name == "tiny-llama-window" else SYSTEM_PROMPT)
            done[name] = Session(specc.build(spec, root / name).out_dir)
        return done[name]

    return get


def shared_prefix_requests(seed: int, n: int, prefix_len: int, vocab: int) -> list[GenerationRequest]:
    """n requests whose prompts begin with one of two shared prefixes (a system prompt, a
    conversation so far), then a few tokens of their own; some are another's prompt grown by a turn."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, size=prefix_len).tolist(), rng.integers(0, vocab, size=prefix_len + 7).tolist()]
    out: list[GenerationRequest] = []
    for i in range(n):
        if i % 4 == 3 and out:  # a conversation's next turn: the previous prompt, its answer's worth, a question
            base = list(out[-1].ids) + rng.integers(0, vocab, size=int(rng.integers(3, 20))).tolist()
        else:
            base = prefixes[i % 2] + rng.integers(0, vocab, size=int(rng.integers(1, 12))).tolist()
        out.append(GenerationRequest(ids=tuple(base[:100]), max_tokens=int(rng.integers(3, 20)), eos=-1))
    return out


class Sink:
    def __init__(self):
        self.tokens: list[int] = []
        self.reason = None
        self.first_at: float | None = None

    def token(self, token_id: int) -> bool:
        if self.first_at is None:
            self.first_at = time.perf_counter()
        self.tokens.append(token_id)
        return True

    def done(self, reason: str, error: str | None = None) -> None:
        self.reason = reason


def run(scheduler: Scheduler, reqs, together: bool) -> list[list[int]]:
    """Each request's tokens: all queued at once (decoded together), or one after another (each
    arriving after the last ended: the cache then holds every earlier prompt)."""
    sinks = [Sink() for _ in reqs]
    if together:
        for r, s in zip(reqs, sinks):
            scheduler.submit(r, s)
        while scheduler.step():
            pass
    else:
        for r, s in zip(reqs, sinks):
            scheduler.submit(r, s)
            while scheduler.step():
                pass
    return [s.tokens for s in sinks]


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-llama/model"])
def test_reused_prefixes_answer_what_the_cache_off_answers(built, name):
    session = built(name)
    reqs = shared_prefix_requests(0, 24, 40, session.info.vocab_size)
    on = Scheduler(session, GenerationLimits(max_sequences=4, max_cache_tokens=4 * 128, max_waiting=100))
    off = Scheduler(session, GenerationLimits(4, 4 * 128, 100, prefix_cache_tokens=0))
    assert on.prefix is not None and off.prefix is None
    for together in (False, True):
        got_on, got_off = run(on, reqs, together), run(off, reqs, together)
        assert got_on == got_off
    for r, tokens in zip(reqs, got_on):
        assert tokens == session.generate(list(r.ids), max_new_tokens=r.max_tokens, eos_id=-1).new_ids[0]
    # most of every prompt after the first two came from the cache
    assert on.stats.reused > on.stats.prefilled and off.stats.reused == 0
    assert on.prefix.stats.hits >= 2 * len(reqs) - 2


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-llama/model"])
def test_a_prefill_after_a_reused_past_computes_the_whole_prompts_kv(built, name):
    """The store's prefill of positions k.. after the cached K/V of positions ..k equals its prefill
    of the whole prompt: the same K/V for every position and the same last logits (to float32's
    rounding of sums in other shapes)."""
    session = built(name)
    block = Scheduler(session, GenerationLimits(2, 256, 4)).block
    ids = np.random.default_rng(3).integers(0, 1000, size=(1, 53))
    whole, logits = block.prefill(ids)
    k = 3 * BLOCK
    past = {n: a[:, :, :k].copy() for n, a in whole.items()}
    rest, rest_logits = block.prefill(ids[:, k:], past)
    for n in whole:
        np.testing.assert_allclose(rest[n], whole[n], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rest_logits, logits, rtol=1e-4, atol=1e-4)


def test_a_shared_system_prompt_is_prefilled_once(built):
    """Two chat requests sharing a 1,000-token system prompt, different questions: the later ones
    compute their question's positions alone (the whole blocks of the system prompt come from the
    cache), the answers those of the cache off. What that does to the time to first token is
    benchmarks/serve_load.py's (docs/benchmarks_serving.md); the times are printed here."""
    session = built("llama-2k")
    rng = np.random.default_rng(5)
    system = rng.integers(0, 1000, size=1000).tolist()
    questions = [rng.integers(0, 1000, size=20).tolist() for _ in range(4)]
    reqs = [GenerationRequest(ids=tuple(system + q), max_tokens=4, eos=-1) for q in questions]

    def ttft(scheduler: Scheduler, r) -> tuple[float, list[int]]:
        sink = Sink()
        t0 = time.perf_counter()
        scheduler.submit(r, sink)
        while scheduler.step():
            pass
        return sink.first_at - t0, sink.tokens

    on = Scheduler(session, GenerationLimits(2, 4096, 4))
    off = Scheduler(session, GenerationLimits(2, 4096, 4, prefix_cache_tokens=0))
    first, tokens = ttft(on, reqs[0])
    assert tokens == ttft(off, reqs[0])[1] and on.stats.prefilled == len(reqs[0].ids) and on.stats.reused == 0
    shared = 1000 // BLOCK * BLOCK
    later = []
    for r in reqs[1:]:
        before = on.stats.prefilled
        took, tokens = ttft(on, r)
        later.append(took)
        assert tokens == ttft(off, r)[1]
        assert on.stats.prefilled - before == len(r.ids) - shared  # the question and the system prompt's last part block
    assert on.stats.reused == 3 * shared and off.stats.reused == 0
    print(f"time to first token: {first * 1e3:.1f} ms, then {[round(t * 1e3, 1) for t in later]} ms")


def test_memory_stays_within_the_budget_least_recently_used_out(built):
    """A soak of 300 distinct prompts through a cache of 20 blocks: never more held; the prefix
    used last survives, the first prompts' blocks went; reuse still right."""
    session = built("tiny-llama")
    scheduler = Scheduler(session, GenerationLimits(4, 512, 400, prefix_cache_tokens=20 * BLOCK))
    rng = np.random.default_rng(9)
    hot = rng.integers(0, 1000, size=2 * BLOCK).tolist()
    most = 0
    sinks = []
    for i in range(300):
        ids = (hot if i % 10 == 0 else rng.integers(0, 1000, size=2 * BLOCK).tolist()) + [i % 1000]
        sinks.append(Sink())
        scheduler.submit(GenerationRequest(ids=tuple(ids), max_tokens=2, eos=-1), sinks[-1])
        while scheduler.step():
            most = max(most, scheduler.prefix.held)
    assert most <= 20 * BLOCK and scheduler.prefix.held == 20 * BLOCK
    assert scheduler.prefix.stats.evicted > 250
    assert scheduler.prefix.stats.hits >= 29  # the hot prefix, each tenth request, was never evicted
    first = scheduler.prefix._chain(hot)  # noqa: SLF001 - what it holds
    assert len(first) == 2


def test_the_cache_alone_keeps_chains_and_evicts_their_ends_first():
    shape = (2, BLOCK, 4)
    cache = PrefixCache(max_positions=5 * BLOCK)

    def present(n):
        return {"k": np.arange(n * np.prod(shape) // BLOCK, dtype=np.float32).reshape(1, 2, n, 4)}

    a = list(range(3 * BLOCK + 2))
    cache.insert(a, present(len(a)))
    assert cache.held == 3 * BLOCK
    k, past = cache.lookup(a)
    assert k == 3 * BLOCK and np.array_equal(past["k"], present(len(a))["k"][:, :, :k])
    assert cache.lookup(a[: 2 * BLOCK])[0] == BLOCK  # at most len - 1 positions: the last token is computed
    b = a[:BLOCK] + [7] * (3 * BLOCK)  # shares a's first block (touched last: the most recent)
    cache.insert(b, present(len(b)))  # 2 new blocks fit (5), then the third evicts a's last block
    assert cache.held == 5 * BLOCK and cache.stats.evicted == 1
    assert cache.lookup(a)[0] == 2 * BLOCK
    assert cache.lookup(b)[0] == 3 * BLOCK  # its 4 blocks less the one holding its last token
    c = [5] * (4 * BLOCK + 1)  # 4 blocks more: 4 go, the least recently used first (chains' ends)
    cache.insert(c, present(len(c)))
    assert cache.held == 5 * BLOCK and cache.lookup(c)[0] == 4 * BLOCK
    assert cache.lookup(a)[0] == cache.lookup(b)[0] == BLOCK  # their shared first block, used last, stays
    assert cache.lookup([9] * 40) == (0, None)


def test_a_windowed_build_reuses_nothing(built):
    """A sliding-window layer's cache keeps its last W positions, not the prompt's: no prefix cache."""
    assert Scheduler(built("tiny-llama-window"), GenerationLimits(2, 256, 4)).prefix is None


def test_the_spec_and_the_flag_set_its_budget(built, spec_file, tmp_path):
    from specc.errors import SpecError
    from specc.runtime.errors import RunError
    from specc.spec import load_spec

    info = built("tiny-gpt2").info
    assert GenerationLimits.of(info).prefix_positions == 512  # on by default: as many as max_cache_tokens
    assert GenerationLimits.of(info, prefix_cache_tokens=0).prefix_positions == 0
    with pytest.raises(RunError, match=r"--prefix-cache-tokens -1: must be at least 0"):
        GenerationLimits.of(info, prefix_cache_tokens=-1)
    spec = spec_file("""\
        specc: 1
        name: p
        extends: tiny-gpt2
        serving:
          generation: {prefix_cache_tokens: 64}
        """, name="p.yaml")
    session = Session(specc.build(spec, tmp_path / "p").out_dir)
    assert Scheduler(session).prefix.max_positions == 64
    assert Scheduler(session, GenerationLimits.of(session.info, prefix_cache_tokens=0)).prefix is None
    with pytest.raises(SpecError, match=r"q.yaml:5:\d+: serving.generation.prefix_cache_tokens: .*greater than or "
                                        r"equal to 0"):
        load_spec(spec_file("""\
            specc: 1
            name: q
            extends: tiny-gpt2
            serving:
              generation: {prefix_cache_tokens: -5}
            """, name="q.yaml"))
