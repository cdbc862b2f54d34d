"""specc/runtime/scheduler.py without a server: many requests of different lengths, arriving at
different times and decoded together in one batched step, give the tokens each gives alone with
Session.generate (greedy, and sampling with a seed); the limits (sequences, cache positions,
queue) hold and refuse what cannot fit; cancel and close free and refuse as they say."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import specc
from specc.runtime import RunError, Session
from specc.runtime.scheduler import (
    CANCELLED,
    LENGTH,
    STOP,
    Busy,
    GenerationLimits,
    GenerationRequest,
    InplaceBlock,
    Scheduler,
)

pytest.importorskip("onnxruntime")

# the first two through their in-place cache graphs, "/model" through model.onnx (Session(inplace=False)),
# the windowed one through model.onnx (GroupQueryAttention computes no windows)
DECODERS = ["tiny-gpt2", "tiny-llama", "tiny-llama/model", "tiny-llama-window"]

# tiny-llama with sliding windows of 6 in layers 0 and 2 (layer 1 global): window caches that the
# test's prompts (up to 30 tokens) and generations outgrow
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


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """name -> Session, built once under the session's base temp dir (shared with the other
    runtime test modules, which build the same specs there); NAME/model: without its in-place graph."""
    done: dict = {}

    def get(name: str) -> Session:
        if name.endswith("/model"):
            return Session(get(name.removesuffix("/model")).dir, inplace=False)
        if name not in done:
            root = tmp_path_factory.getbasetemp() / "specc-runtime-builds"
            spec = name
            if name == "tiny-llama-window":
                root.mkdir(parents=True, exist_ok=True)
                spec = root / f"{name}.yaml"
                spec.write_text(WINDOWED)
            done[name] = Session(specc.build(spec, root / name).out_dir)
        return done[name]

    return get


class Sink:
    """Collects a sequence's tokens and its end; `stop_after` ends it from the sink's side."""

    def __init__(self, stop_after: int | None = None):
        self.tokens: list[int] = []
        self.reason = self.error = None
        self.stop_after = stop_after
        self.finished = threading.Event()

    def token(self, token_id: int) -> bool:
        self.tokens.append(token_id)
        return self.stop_after is None or len(self.tokens) < self.stop_after

    def done(self, reason: str, error: str | None = None) -> None:
        self.reason, self.error = reason, error
        self.finished.set()


def requests(seed: int, n: int, vocab: int, context: int) -> list[GenerationRequest]:
    """n prompts of 1..30 tokens, each with its own max_tokens; a third keep the spec's eos."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        prompt = rng.integers(0, vocab, size=int(rng.integers(1, 31))).tolist()
        new = int(rng.integers(1, min(40, context - len(prompt)) + 1))
        out.append(GenerationRequest(ids=tuple(prompt), max_tokens=new, eos=None if i % 3 == 0 else -1))
    return out


def alone(session: Session, r: GenerationRequest) -> list[int]:
    """What Session.generate makes of the request, one prompt at a time."""
    return session.generate(list(r.ids), max_new_tokens=r.max_tokens, eos_id=r.eos, temperature=r.temperature,
                            top_k=r.top_k, top_p=r.top_p, seed=r.seed).new_ids[0]


@pytest.mark.parametrize("name", DECODERS)
def test_concurrent_requests_decoded_together_equal_each_alone(built, name):
    """24 requests from 6 threads, arriving while others decode, 4 rows at a time: each request's
    greedy tokens are the ones Session.generate gives it alone, and the steps were batched."""
    session = built(name)
    reqs = requests(0, 24, session.info.vocab_size, session.limits.context)
    scheduler = Scheduler(session, GenerationLimits(max_sequences=4, max_cache_tokens=4 * 128, max_waiting=100))
    assert isinstance(scheduler.block, InplaceBlock) == (name in ("tiny-gpt2", "tiny-llama"))
    sinks = [Sink() for _ in reqs]
    scheduler.start()
    try:
        def client(k: int) -> None:
            for i in range(k, len(reqs), 6):
                scheduler.submit(reqs[i], sinks[i])
                time.sleep(0.002 * (i % 4))
        threads = [threading.Thread(target=client, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for s in sinks:
            assert s.finished.wait(60)
    finally:
        scheduler.stop()
    for r, s in zip(reqs, sinks):
        want = alone(session, r)
        assert s.tokens == want, (r, s.reason)
        assert s.reason == (STOP if want and r.eos is None and want[-1] == session.info.tokens.eos else LENGTH)
    stats = scheduler.stats
    assert stats.prefills == len(reqs) and stats.tokens == sum(len(s.tokens) for s in sinks)
    # one token per row per step: batching made fewer steps than tokens after the prefills
    assert stats.steps < stats.tokens - len(reqs)


def test_sampled_requests_with_a_seed_equal_each_alone(built):
    session = built("tiny-llama")
    base = requests(1, 8, session.info.vocab_size, session.limits.context)
    reqs = [GenerationRequest(ids=r.ids, max_tokens=r.max_tokens, temperature=0.8 + 0.1 * (i % 3),
                              top_k=None if i % 2 else 50, top_p=0.9 if i % 3 == 0 else None, seed=i, eos=-1)
            for i, r in enumerate(base)]
    reqs.append(GenerationRequest(ids=(5, 6, 7), max_tokens=6, temperature=0.0, eos=-1))  # 0: greedy
    scheduler = Scheduler(session, GenerationLimits(4, 512, 100))
    sinks = [Sink() for _ in reqs]
    for r, s in zip(reqs, sinks):
        scheduler.submit(r, s)
    while scheduler.step():
        pass
    for r, s in zip(reqs, sinks):
        want = alone(session, GenerationRequest(ids=r.ids, max_tokens=r.max_tokens, eos=-1)) if r.temperature == 0 \
            else alone(session, r)
        assert s.tokens == want and s.reason == LENGTH


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-gpt2/model"])
def test_the_block_never_holds_more_than_its_limits(built, name):
    """max_sequences rows at most; the positions held within max_cache_tokens at every step,
    and its buffers never larger; requests wait (FIFO) rather than overflow it."""
    session = built(name)
    limits = GenerationLimits(max_sequences=3, max_cache_tokens=150, max_waiting=100)
    scheduler = Scheduler(session, limits)
    reqs = requests(2, 12, session.info.vocab_size, 70)
    sinks = [Sink() for _ in reqs]
    for r, s in zip(reqs, sinks):
        scheduler.submit(r, s)
    most_rows = most_cells = 0
    while scheduler.step():
        block = scheduler.block
        most_rows, most_cells = max(most_rows, block.rows), max(most_cells, block.held)
        held = [block.store, block.current] if isinstance(block, InplaceBlock) else block.buffers
        for turn in held:
            for buf_name, buf in turn.items():
                h, d, _ = block.shapes[buf_name]
                assert buf.size <= limits.max_cache_tokens * h * d
    assert most_rows <= 3 and most_cells <= 150
    assert most_rows >= 2  # it did batch
    for r, s in zip(reqs, sinks):
        assert s.tokens == alone(session, r)


def test_rows_leave_and_join_the_inplace_store_in_place(built):
    """InplaceBlock: a row that leaves before the end has a row from past the new end (here the
    last) moved into its place and a row that joins takes the next free one, in the same store; a
    row longer than the store's columns makes a new one, within max_cache_tokens; every request's
    tokens are its own alone."""
    session = built("tiny-gpt2")
    scheduler = Scheduler(session, GenerationLimits(max_sequences=4, max_cache_tokens=256, max_waiting=10))
    block = scheduler.block
    first = [GenerationRequest(ids=(1, 2, 3), max_tokens=4, eos=-1),  # ends first: row 0 leaves
             GenerationRequest(ids=(4, 5), max_tokens=30, eos=-1),
             GenerationRequest(ids=(6, 7, 8, 9), max_tokens=20, eos=-1)]
    later = [GenerationRequest(ids=(10, 11), max_tokens=8, eos=-1),
             GenerationRequest(ids=(12, 13, 14, 15, 16), max_tokens=95, eos=-1)]  # 100 positions: past 64
    sinks = {r: Sink() for r in first + later}

    def order() -> list:
        return [s.request for s in scheduler._active]

    for r in first:
        scheduler.submit(r, sinks[r])
    scheduler.step()
    store = block.store
    assert block.rows == 3 and block.capacity == 32  # the longest final length (4 + 20 is 24, 2 + 30 is 32)
    while not sinks[first[0]].finished.is_set():
        scheduler.step()
    assert order() == [first[2], first[1]] and block.store is store  # the last row took row 0's place
    moved = scheduler._active[0].length
    for buf in store.values():  # its positions copied as they were (row 2 is free now, not yet written)
        np.testing.assert_array_equal(buf[0, :, :moved], buf[2, :, :moved])
    scheduler.submit(later[0], sinks[later[0]])
    scheduler.step()
    assert order() == [first[2], first[1], later[0]] and block.store is store
    scheduler.submit(later[1], sinks[later[1]])  # waits until 2 rows x 100 positions fit in 256
    while later[1] not in order():
        assert scheduler.step()
    assert block.store is not store and block.capacity == 128 and block.rows <= 2  # 100 up to a power of 2
    for buf_name, buf in block.store.items():
        h, d, _ = block.shapes[buf_name]
        assert buf.size <= 256 * h * d
    while scheduler.step():
        pass
    for r, s in sinks.items():
        assert s.tokens == alone(session, r) and s.reason == LENGTH


def test_regroup_says_where_each_row_went_when_several_leave_and_join_at_once(built):
    """InplaceBlock.regroup alone, on rows whose caches are filled with their own number: rows
    leaving from the front and the end while others join in the same call (a row leaving from the
    middle: the test above), and the order it returns says which entry each row of the store now
    holds, every position intact."""
    session = built("tiny-gpt2")
    block = Scheduler(session, GenerationLimits(max_sequences=4, max_cache_tokens=4 * 64, max_waiting=1)).block

    def prefill(mark: float, n: int) -> dict:
        return {name: np.full((1, h, n, d), mark, dtype) for name, (h, d, dtype) in block.shapes.items()}

    def marks() -> list[float]:  # each row's one value over its positions, checked to be one
        first = next(iter(block.current.values()))
        out = []
        for r, (mark, n) in enumerate(rows):
            for buf in block.current.values():
                assert (buf[r, :, :n] == mark).all(), (r, mark)
            out.append(float(first[r, 0, 0, 0]))
        return out

    rows = [(1.0, 5), (2.0, 7), (3.0, 3), (4.0, 6)]  # (mark, positions)
    order = block.regroup([], [(prefill(m, n), n, 20) for m, n in rows])
    assert order == [0, 1, 2, 3] and marks() == [1.0, 2.0, 3.0, 4.0]
    store = block.store
    keep = [(1, 7, 20), (2, 3, 20)]  # rows 0 and 3 leave; 5.0 joins
    entries = [2.0, 3.0, 5.0]
    order = block.regroup(keep, [(prefill(5.0, 4), 4, 20)])
    rows = [[(2.0, 7), (3.0, 3), (5.0, 4)][k] for k in order]
    assert marks() == [entries[k] for k in order] == [3.0, 2.0, 5.0] and block.store is store
    keep = [(1, 7, 20)]  # rows 0 and 2 leave; two join
    order = block.regroup(keep, [(prefill(6.0, 2), 2, 20), (prefill(7.0, 9), 9, 20)])
    rows = [[(2.0, 7), (6.0, 2), (7.0, 9)][k] for k in order]
    assert marks() == [2.0, 6.0, 7.0] and block.store is store and block.rows == 3


def test_requests_that_cannot_fit_are_refused_and_a_full_queue_is_busy(built):
    session = built("tiny-gpt2")
    scheduler = Scheduler(session, GenerationLimits(max_sequences=1, max_cache_tokens=40, max_waiting=1))
    with pytest.raises(RunError, match=r"prompt \(30 tokens\) \+ max_tokens \(20\) is more than the server's cache "
                                       r"of 40 positions \(max_cache_tokens\)"):
        scheduler.submit(GenerationRequest(ids=tuple(range(30)), max_tokens=20), Sink())
    with pytest.raises(RunError, match="past the 128 positions"):
        scheduler.submit(GenerationRequest(ids=(1, 2), max_tokens=127), Sink())
    with pytest.raises(RunError, match="max_tokens must be at least 1, got 0"):
        scheduler.submit(GenerationRequest(ids=(1, 2), max_tokens=0), Sink())
    with pytest.raises(RunError, match=r"outside the vocabulary \(0..999\)"):
        scheduler.submit(GenerationRequest(ids=(1, 5000), max_tokens=2), Sink())
    with pytest.raises(RunError, match="input_ids: an empty prompt"):
        scheduler.submit(GenerationRequest(ids=(), max_tokens=2), Sink())
    first, second = Sink(), Sink()
    scheduler.submit(GenerationRequest(ids=(1, 2), max_tokens=5, eos=-1), first)
    with pytest.raises(Busy, match=r"1 requests waiting \(max_waiting 1\)"):
        scheduler.submit(GenerationRequest(ids=(3,), max_tokens=5), second)
    scheduler.step()  # the first is admitted: the queue has room again
    scheduler.submit(GenerationRequest(ids=(3,), max_tokens=5, eos=-1), second)
    scheduler.close()
    with pytest.raises(Busy, match="shutting down"):
        scheduler.submit(GenerationRequest(ids=(4,), max_tokens=5), Sink())
    while scheduler.step():  # what was queued before close() still runs to its end
        pass
    assert len(first.tokens) == 5 and len(second.tokens) == 5 and first.reason == second.reason == LENGTH


def test_cancel_frees_the_place_and_the_sink_can_stop(built):
    session = built("tiny-gpt2")
    scheduler = Scheduler(session, GenerationLimits(max_sequences=1, max_cache_tokens=128, max_waiting=4))
    long_one, waiting, stopper = Sink(), Sink(), Sink(stop_after=3)
    ticket = scheduler.submit(GenerationRequest(ids=(1, 2, 3), max_tokens=100, eos=-1), long_one)
    scheduler.submit(GenerationRequest(ids=(4, 5), max_tokens=4, eos=-1), waiting)
    for _ in range(5):  # the first iteration prefills (one token) and decodes (another)
        scheduler.step()
    assert len(long_one.tokens) == 6 and not waiting.tokens  # one place: the second waits
    scheduler.cancel(ticket)
    scheduler.step()
    assert long_one.reason == CANCELLED and len(long_one.tokens) == 6
    assert waiting.tokens  # admitted in the same iteration
    scheduler.submit(GenerationRequest(ids=(6,), max_tokens=10, eos=-1), stopper)
    while scheduler.step():
        pass
    assert waiting.reason == LENGTH and stopper.reason == STOP and len(stopper.tokens) == 3
    assert scheduler.stats.finished == {CANCELLED: 1, LENGTH: 1, STOP: 1}
    assert scheduler.block.rows == 0  # every row left the block


def test_limits_come_from_serving_generation_and_the_flags(built):
    session = built("tiny-gpt2")  # serving.batch.max 4, length.max 128
    assert GenerationLimits.of(session.info) == GenerationLimits(max_sequences=4, max_cache_tokens=512, max_waiting=64)
    assert GenerationLimits.of(session.info, max_sequences=2, max_waiting=0) == GenerationLimits(2, 256, 0)
    assert GenerationLimits.of(session.info, max_cache_tokens=1000).max_cache_tokens == 1000
    with pytest.raises(RunError, match=r"--max-sequences 5: the graphs take 1..serving.batch.max 4 rows"):
        GenerationLimits.of(session.info, max_sequences=5)


def test_the_spec_sets_the_limits_and_refuses_more_sequences_than_the_batch(spec_file):
    from specc.errors import SpecError
    from specc.spec import load_spec

    spec = load_spec(spec_file("""\
        specc: 1
        name: g
        extends: tiny-gpt2
        serving:
          generation: {max_sequences: 2, max_cache_tokens: 200, max_waiting: 5}
        """, name="g.yaml"))
    assert spec.serving.generation.max_sequences == 2 and spec.serving.generation.max_waiting == 5
    with pytest.raises(SpecError, match=r"serving.generation.max_sequences: 8 sequences decoded at once, more than "
                                        r"serving.batch.max 4"):
        load_spec(spec_file("""\
            specc: 1
            name: g
            extends: tiny-gpt2
            serving:
              generation: {max_sequences: 8}
            """, name="h.yaml"))


def test_encoder_decoders_are_not_scheduled(built):
    session = built("tiny-transformer")
    with pytest.raises(RunError, match="needs a decoder build"):
        Scheduler(session)
