"""The engine: one step loop for every sequence a server decodes, one batched decode step for all
of them per iteration (iteration-level, "continuous" batching, as Orca, Yu et al. 2022, OSDI,
introduced it). Host-agnostic: a host hands it its graphs (graphs.GraphCall) and the build's facts
(facts.py), submits requests from its own threads and relays the tokens its sinks receive.

    submit(request, sink) --> checked (request.check) --> waiting (FIFO, at most max_waiting;
       |                                                   one more: Busy)
       | admitted when a place and the cache budget allow, in order of arrival
       v
    prefill alone (batch 1, an empty cache: what Session.generate runs for one prompt; or, where
       | the prompt begins with whole blocks the prefix cache holds, its positions after them:
       | prefix.py), the prompt's blocks kept in the prefix cache
       | its first token to the sink (sampling.Sampler: greedy, or the request's own generator)
       | its cache joins the store (stores.py: the in-place store, or the block)
       v
    each iteration: ONE decode step [B, 1] for all B active sequences -> one token each
       | (speculative requests: their drafts checked too, below)
       | a sequence leaves when it ends (eos, the sink says stop, max_tokens, cancelled)
       v
    the store regroups (rows that left dropped, rows that joined copied in)

A request with `speculative` (request.Request) has a drafter (draft.py) guess the tokens after
its text, and the target checks them (speculation.py's rule: the same greedy tokens, the
target's distribution when sampling). GroupQueryAttention takes several new positions after a
cache for one row at a time, so on the in-place store: a sequence decoding alone runs its token
and its k drafts in one call of k + 1 positions (as Session.generate does); among B rows, the
batched step gives its token's logits and a call of its own checks its drafts, which pays when
it accepts more than B drafts a check (each call reads the weights once, a step of B rows makes B
tokens), so a row drafts there only while its running mean of accepted drafts (DraftLength's) is
above B. Other rows decode as they would without it. The block store (model.onnx) refuses it.

Limits (facts.Limits): max_sequences rows at once; max_cache_tokens positions of the store,
counted as it is held (stores.py), reserved at admission for every row's final length (prompt +
max_tokens), so a running store never outgrows its budget; max_waiting requests queued;
prefix_cache_tokens positions of prompts' K/V kept apart from the store (prefix.py). A
request that could never fit (its own prompt + max_tokens past the budget or the context) is
refused at once (Refused); one that cannot fit now waits.

Threads: submit(), cancel(), close() from any thread; step() from one, the thread start() makes
or a test's own loop (`while engine.step(): pass`). Sinks are called from the step's thread.
"""
from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .errors import Busy, first_line
from .facts import Limits, Model
from .graphs import GraphCall
from .prefix import PrefixCache
from .draft import DRAFTERS, free_guess
from .errors import Refused
from .request import CANCELLED, ERROR, LENGTH, STOP, Request, check
from .sampling import Sampler
from .speculation import DraftLength, Speculation, refusal
from .speculation import check as check_drafts
from .stores import CacheBlock, InplaceBlock, choose_store

__all__ = ["CANCELLED", "ERROR", "LENGTH", "STOP", "Engine", "Sink", "Stats"]


class Sink(Protocol):
    """Where a sequence's tokens go, called from the engine's thread, in order. token() returns
    False to end the sequence there (a stop string found; finish reason "stop"); done() is
    called once, last, with the finish reason and, for ERROR, a one-line message. A sink may also
    have cancelled(), asked once an iteration: True ends the sequence (its client went away; a
    host that learns it otherwise calls Engine.cancel)."""

    def token(self, token_id: int) -> bool: ...

    def done(self, reason: str, error: str | None = None) -> None: ...


@dataclass
class Stats:
    """What the engine holds now, and what it has done since it started."""

    active: int = 0
    waiting: int = 0
    cache_positions: int = 0  # the store's positions as admission counts them
    steps: int = 0  # batched decode steps
    prefills: int = 0
    prefilled: int = 0  # prompt positions computed by prefills
    reused: int = 0  # prompt positions taken from the prefix cache instead
    tokens: int = 0  # tokens made
    finished: dict = field(default_factory=lambda: collections.Counter())
    speculation: Speculation = field(default_factory=Speculation)  # checks (steps), drafted, accepted


@dataclass(eq=False)
class _Sequence:
    ticket: int
    request: Request
    sink: Sink
    eos: int | None
    need: int  # positions of its final length: prompt + max_tokens
    choose: Sampler
    length: int = 0  # positions in the cache
    last: int = -1  # the token the next step feeds
    made: int = 0  # tokens made so far
    present: dict | None = None  # after prefill, before it joins the store: its own [1, H, p, Dh]
    ended: str | None = None
    drafter: Any = None  # speculative requests: the drafter, fed every token of the text
    drafts: DraftLength | None = None


class Engine:
    """Continuous batching over a decoder's graphs (the module's doc). `inplace`: the in-place
    cache graph's GraphCall, or None; `model`: makes the model graph's, asked only where the
    store needs it (stores.choose_store)."""

    def __init__(self, model: Callable[[], GraphCall], inplace: GraphCall | None, facts: Model, limits: Limits):
        self.facts = facts
        self.limits = limits
        self.block: CacheBlock | InplaceBlock = choose_store(limits, inplace, model)
        self.prefix = PrefixCache(limits.prefix_positions) \
            if limits.prefix_positions > 0 and self.block.reuses_prefixes else None
        self._lock = threading.Condition()
        self._waiting: collections.deque[_Sequence] = collections.deque()
        self._active: list[_Sequence] = []
        self._cancelled: set[int] = set()
        self._tickets = itertools.count(1)
        self._closed: str | None = None  # why new requests are refused (shutting down)
        self._thread: threading.Thread | None = None
        self._stop = False
        self.stats = Stats()

    @property
    def steps(self) -> int:
        """Batched decode steps so far (stats.steps)."""
        return self.stats.steps

    # --- the callers' side (any thread) ---------------------------------------------------------

    def check(self, request: Request) -> tuple[int, int | None]:
        """A request checked against the build and this engine's budget (request.check); returns
        (positions it needs, its eos). Refused with one line."""
        checked = check(self.facts, self.limits, request)
        if request.speculative is not None and not isinstance(self.block, InplaceBlock):
            raise Refused("speculative: this build decodes with model.onnx (it has no in-place cache graph), "
                          "whose store cannot check drafts; send the request without it")
        if request.speculative is not None and (why := refusal(self.facts.activations, self.block.facts.spare)):
            raise Refused(why)
        return checked

    def submit(self, request: Request, sink: Sink) -> int:
        """Queue a request; returns its ticket (for cancel). Refused for a bad request, Busy when
        the queue is full or the engine is shutting down; nothing is queued then."""
        need, eos = self.check(request)
        with self._lock:
            if self._closed:
                raise Busy(self._closed)
            if len(self._waiting) >= self.limits.max_waiting and not self._fits_now(need):
                raise Busy(f"server busy: {len(self._active)} sequences running and {len(self._waiting)} requests "
                           f"waiting (max_waiting {self.limits.max_waiting}); retry later")
            seq = _Sequence(next(self._tickets), request, sink, eos, need,
                            Sampler(request.temperature, request.top_k, request.top_p, request.seed))
            if request.speculative is not None:
                seq.drafter, seq.drafts = DRAFTERS[request.speculative](request.ids), DraftLength()
            self._waiting.append(seq)
            self.stats.waiting = len(self._waiting)
            self._lock.notify_all()
        return seq.ticket

    def cancel(self, ticket: int) -> None:
        """End a request (its client went away): it leaves at the next iteration, its sink told
        CANCELLED. Unknown or finished tickets are ignored."""
        with self._lock:
            self._cancelled.add(ticket)
            self._lock.notify_all()

    def cancel_all(self) -> None:
        """Cancel every request queued and running (a server stopping now): each leaves at the
        next iteration, its sink told CANCELLED."""
        with self._lock:
            self._cancelled.update(s.ticket for s in list(self._waiting) + self._active)
            self._lock.notify_all()

    def close(self, why: str = "server shutting down; retry on another server") -> None:
        """Refuse new requests (Busy with `why`); those queued and running go on to their end."""
        with self._lock:
            self._closed = why

    def idle(self) -> bool:
        with self._lock:
            return not self._waiting and not self._active

    def drain(self, timeout: float) -> bool:
        """close(), then wait up to `timeout` seconds for every queued and running request to
        end; True if they did."""
        self.close()
        deadline = time.monotonic() + timeout
        while not self.idle():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    # --- the engine's thread ------------------------------------------------------------------------

    def start(self) -> None:
        """Run step() on a thread of its own until stop()."""
        self._thread = threading.Thread(target=self._loop, name="specc-decoding", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Refuse new requests (close()), stop the thread; sequences still queued or running end
        CANCELLED."""
        self.close()
        with self._lock:
            self._stop = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join()
        for seq in list(self._active) + list(self._waiting):
            self._end(seq, CANCELLED)
        self._active, self._waiting = [], collections.deque()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._waiting and not self._active:
                    self._lock.wait()
                if self._stop:
                    return
            self.step()

    def step(self) -> bool:
        """One iteration: drop what was cancelled, admit what fits (each prefilled alone), one
        batched decode step for every active row, and let the rows that ended leave. Returns
        whether work remains."""
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [s for s in self._waiting if s.ticket in cancelled or _gone(s)]
            for seq in dropped:
                self._waiting.remove(seq)
        for seq in dropped + [s for s in self._active if s.ticket in cancelled or _gone(s)]:
            self._end(seq, CANCELLED)  # before admission: their places are free for it
        with self._lock:
            admitted = []
            while self._waiting and self._fits(self._waiting[0].need, admitted):
                admitted.append(self._waiting.popleft())
            self.stats.waiting = len(self._waiting)
        joining = []
        for seq in admitted:
            if seq.ticket in cancelled:
                self._end(seq, CANCELLED)
            elif self._prefill(seq):
                joining.append(seq)
        self._regroup(joining)
        if self._active:
            self._decode()
            self._regroup([])
        with self._lock:
            self.stats.active = len(self._active)
            self.stats.cache_positions = self.block.held
            return bool(self._waiting or self._active)

    # --- admission ---------------------------------------------------------------------------------

    def _fits(self, need: int, pending: list[_Sequence]) -> bool:
        """Whether one more row of `need` positions fits beside the active rows and `pending`
        (admitted this iteration): max_sequences rows, and rows x the longest final length
        within max_cache_tokens (the store never grows past what its rows end at)."""
        rows = [s.need for s in self._active if s.ended is None] + [s.need for s in pending]
        rows.append(need)
        return len(rows) <= self.limits.max_sequences and len(rows) * max(rows) <= self.limits.max_cache_tokens

    def _fits_now(self, need: int) -> bool:
        return not self._waiting and self._fits(need, [])

    # --- the graph calls ------------------------------------------------------------------------------

    def _prefill(self, seq: _Sequence) -> bool:
        """The prompt alone, batch 1, an empty cache: Session.generate's prefill of one prompt; or
        only its positions after the whole blocks the prefix cache holds of it. Its blocks are
        kept there. Its first token goes to the sink; False if the sequence ended there."""
        prompt = seq.request.ids
        k, past = self.prefix.lookup(prompt) if self.prefix is not None else (0, None)
        ids = np.asarray([prompt[k:]], dtype=np.int64)
        try:
            seq.present, logits = self.block.prefill(ids, past)
        except Exception as exc:  # the graph call failed: its row fails, the others go on
            self._end(seq, ERROR, first_line(exc) or type(exc).__name__)
            return False
        if self.prefix is not None:
            self.prefix.insert(prompt, seq.present)
        self.stats.prefills += 1
        self.stats.prefilled += len(prompt) - k
        self.stats.reused += k
        seq.length = len(prompt)
        return self._emit(seq, logits)

    def _decode(self) -> None:
        """One step [B, 1] for every active row: each row's last token at its own position; the
        drafts of speculative rows checked with it (the module's doc)."""
        rows = len(self._active)
        start = time.perf_counter()
        drafts = [self._draft(s, rows) for s in self._active]
        if rows == 1 and drafts[0]:
            seq, draft = self._active[0], drafts[0]
            try:
                logits = self.block.extend(0, np.array([[seq.last] + draft], dtype=np.int64), seq.length)[0]
            except Exception as exc:  # the graph call failed: its row fails
                self._end(seq, ERROR, first_line(exc) or type(exc).__name__)
                return
            self.stats.steps += 1
            self._checked(seq, draft, logits, time.perf_counter() - start)
            return
        ids = np.array([[s.last] for s in self._active], dtype=np.int64)
        try:
            logits = self.block.step(ids, np.array([s.length for s in self._active], dtype=np.int64))
        except Exception as exc:  # the graph call failed: every row of the step fails alike
            for seq in self._active:
                self._end(seq, ERROR, first_line(exc) or type(exc).__name__)
            self.block.regroup([], [])
            return
        self.stats.steps += 1
        if rows == 1 and self._active[0].drafts is not None:  # a plain step, what a check is weighed against
            self._active[0].drafts.plain(time.perf_counter() - start)
        for i, seq in enumerate(self._active):
            if seq.ended is not None:
                seq.length += 1
            elif drafts[i]:
                try:  # the token's position was written by the step; the drafts after it
                    after = self.block.extend(i, np.array([drafts[i]], dtype=np.int64), seq.length + 1)[0]
                except Exception as exc:  # the graph call failed: its row fails
                    seq.length += 1
                    self._end(seq, ERROR, first_line(exc) or type(exc).__name__)
                    continue
                self._checked(seq, drafts[i], np.concatenate([logits[i: i + 1], after]))
            else:
                seq.length += 1
                guess = free_guess(seq.drafter) if rows == 1 and seq.drafts is not None else None
                self._emit(seq, logits[i: i + 1])
                if guess is not None:
                    seq.drafts.guessed(guess == [seq.last])

    def _draft(self, seq: _Sequence, rows: int) -> list[int]:
        """A speculative row's guesses of the tokens after its last (none for another row, none
        among `rows` > 1 while its accepted drafts a check are not above `rows`): at most what
        its DraftLength says, its tokens left but the last, and the store's columns after it."""
        if seq.drafter is None or seq.ended is not None or (rows > 1 and seq.drafts.accepted <= rows):
            return []
        room = min(seq.request.max_tokens - seq.made - 1, self.block.capacity - seq.length - 1)
        k = min(seq.drafts.next(), room)
        return seq.drafter.propose(k) if k > 0 else []

    def _checked(self, seq: _Sequence, draft: list[int], logits: np.ndarray, seconds: float | None = None) -> None:
        """A row whose token and drafts were run ([1 + k, V] logits after each): the drafts it
        keeps and the token after them, to the sink (speculation.check); its cache holds the token
        and the drafts kept."""
        accepted, token = check_drafts(seq.choose, logits, draft)
        seq.drafts.update(len(draft), accepted, seconds)
        spec = self.stats.speculation
        spec.steps, spec.drafted, spec.accepted = spec.steps + 1, spec.drafted + len(draft), spec.accepted + accepted
        seq.length += 1 + accepted
        for t in draft[:accepted] + [token]:
            if not self._give(seq, t):
                return

    def _emit(self, seq: _Sequence, logits: np.ndarray) -> bool:
        """Choose the row's next token from its [1, V] logits (its Sampler, as Session.generate
        chooses for one prompt), hand it to the sink, and end the row where it ends. True while
        it goes on."""
        return self._give(seq, int(seq.choose(logits)[0]))

    def _give(self, seq: _Sequence, token: int) -> bool:
        """Hand `token` to the row's sink and end the row where it ends. True while it goes on."""
        seq.last, seq.made = token, seq.made + 1
        if seq.drafter is not None:
            seq.drafter.extend([token])
        self.stats.tokens += 1
        try:
            more = seq.sink.token(token) is not False
        except Exception:  # a sink's failure ends its own row only
            more = False
        if not more or (seq.eos is not None and token == seq.eos):
            self._end(seq, STOP)
        elif seq.made >= seq.request.max_tokens:
            self._end(seq, LENGTH)
        return seq.ended is None

    def _end(self, seq: _Sequence, reason: str, error: str | None = None) -> None:
        if seq.ended is not None:
            return
        seq.ended = reason
        self.stats.finished[reason] += 1
        try:
            seq.sink.done(reason, error)
        except Exception:  # noqa: S110 - a sink's failure cannot stop the others
            pass

    def _regroup(self, joining: list[_Sequence]) -> None:
        """Rows that ended leave the store and `joining` rows enter it (the store says in which
        order the rows then are); nothing is copied when no row leaves or joins."""
        keep = [(i, s) for i, s in enumerate(self._active) if s.ended is None]
        joining = [s for s in joining if s.ended is None]
        if len(keep) == len(self._active) and not joining:
            return
        entries = [s for _, s in keep] + joining
        order = self.block.regroup([(i, s.length, s.need) for i, s in keep],
                                   [(s.present, s.length, s.need) for s in joining])
        rows = [entries[k] for k in order]
        for s in joining:
            s.present = None
        with self._lock:
            self._active = rows


def _gone(seq: _Sequence) -> bool:
    """Whether the sequence's sink says its client went away (a sink without cancelled() never
    does; one whose cancelled() fails has lost its client)."""
    cancelled = getattr(seq.sink, "cancelled", None)
    if cancelled is None:
        return False
    try:
        return bool(cancelled())
    except Exception:
        return True
