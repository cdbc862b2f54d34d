"""The prefix cache: the K/V of prompts the engine has prefilled, kept in blocks of BLOCK positions,
so that a request whose prompt begins with tokens computed before (a chat client re-sending its
conversation, an agent's long system prompt) prefills only the rest.

    a block's key = (its parent block's id, its BLOCK tokens): a block is found only after the
        whole prefix it was computed after (a chain from the prompt's first token; vLLM's automatic
        prefix caching keys its blocks alike)

    lookup(ids)           the longest chain of cached blocks that begins `ids`, at most len(ids) - 1
        |                 positions (the last token is always computed: its logits choose the first
        |                 new token); copied out as one past [1, H, k, Dh] per cache tensor
        v
    the store's prefill of ids[k:] after that past (stores.py: positions k.. of the same graph)
        |
        v
    insert(ids, present)  the prompt's whole blocks not cached yet, copied out of the prefill's
                          present [1, H, p, Dh]

Held within `max_positions` positions (each block BLOCK of them, every cache tensor's): the least
recently used block leaves first, and the blocks after it in its chain with it (nothing could reach
them). Using a chain touches its blocks from the last to the first, so a chain is shortened from its
end. Only the engine's thread calls it.

The arithmetic of the positions after the reused ones is the graph's, run on a past instead of on
the whole prompt: the same function, evaluated in other shapes, so its floating-point sums may end
in other last bits than a prefill of the whole prompt (greedy tokens are compared with the cache on
and off in the tests). Builds whose caches keep a window (a sliding-window layer's last W positions)
reuse nothing: their present holds no whole prompt (stores.py says which do).
"""
from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field

import numpy as np

BLOCK = 16  # positions per block: a prompt reuses whole blocks


@dataclass(eq=False)
class _Block:
    key: tuple  # (the parent's id, 0 for the first block; its tokens)
    id: int
    parent: _Block | None
    arrays: dict  # cache name -> [H, BLOCK, Dh], a copy of the prefill's
    children: set = field(default_factory=set)


@dataclass
class PrefixStats:
    """What the prefix cache has done: requests that reused positions, the positions reused and
    those prefilled (all requests), blocks evicted; and what it holds now."""

    hits: int = 0
    reused: int = 0
    prefilled: int = 0
    evicted: int = 0
    held: int = 0  # positions held now (blocks x BLOCK)


class PrefixCache:
    """The prefix cache of one engine (the module's doc), within `max_positions` positions."""

    def __init__(self, max_positions: int, block: int = BLOCK):
        self.max_positions, self.block = max_positions, block
        self.blocks: collections.OrderedDict[tuple, _Block] = collections.OrderedDict()  # least recently used first
        self.ids = itertools.count(1)
        self.stats = PrefixStats()

    @property
    def held(self) -> int:
        return len(self.blocks) * self.block

    def _chain(self, ids) -> list[_Block]:
        """The cached blocks that begin `ids`, in order, as far as they go (whole blocks only)."""
        chain, parent = [], 0
        for start in range(0, len(ids) - self.block + 1, self.block):
            found = self.blocks.get((parent, tuple(ids[start:start + self.block])))
            if found is None:
                break
            chain.append(found)
            parent = found.id
        return chain

    def _touch(self, chain: list[_Block]) -> None:
        for b in reversed(chain):  # the first block the most recent: a chain is shortened from its end
            self.blocks.move_to_end(b.key)

    def lookup(self, ids) -> tuple[int, dict | None]:
        """(k, past): the first k positions of `ids` cached, k < len(ids), and their K/V, one array
        [1, H, k, Dh] per cache name; (0, None) where no whole block is cached."""
        chain = self._chain(list(ids)[: len(ids) - 1])
        k = len(chain) * self.block
        self.stats.prefilled += len(ids) - k
        if not chain:
            return 0, None
        self._touch(chain)
        self.stats.hits += 1
        self.stats.reused += k
        names = chain[0].arrays.keys()
        return k, {name: np.concatenate([b.arrays[name] for b in chain], axis=1)[None] for name in names}

    def insert(self, ids, present: dict) -> None:
        """Keep the whole blocks of `ids` not cached yet, from their prefill's `present` (cache name
        -> [1, H, >= len(ids), Dh]), evicting the least recently used where the budget is full."""
        ids = list(ids)
        chain, parent = self._chain(ids), None
        if chain:
            parent = chain[-1]
        for start in range(len(chain) * self.block, len(ids) - self.block + 1, self.block):
            if self.block > self.max_positions:
                break
            while self.held + self.block > self.max_positions and self.blocks:
                self._evict(next(iter(self.blocks.values())))
                if parent is not None and parent.key not in self.blocks:  # its own chain went: stop here
                    return self._settle(chain)
            key = (parent.id if parent is not None else 0, tuple(ids[start:start + self.block]))
            arrays = {name: np.array(a[0, :, start:start + self.block]) for name, a in present.items()}
            block = _Block(key, next(self.ids), parent, arrays)
            if parent is not None:
                parent.children.add(block)
            self.blocks[key] = block
            chain.append(block)
            parent = block
        self._settle(chain)

    def _settle(self, chain: list[_Block]) -> None:
        self._touch([b for b in chain if b.key in self.blocks])
        self.stats.held = self.held

    def _evict(self, block: _Block) -> None:
        """Drop `block` and every block after it in its chains."""
        stack = [block]
        while stack:
            b = stack.pop()
            if self.blocks.pop(b.key, None) is None:
                continue
            self.stats.evicted += 1
            stack.extend(b.children)
            if b.parent is not None:
                b.parent.children.discard(b)

    def clear(self) -> None:
        self.blocks.clear()
        self.stats.held = 0
