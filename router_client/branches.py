"""Where the prompts a router sees branch: the shared part of a prompt and its own.

A prompt's leading blocks are often shared: a system prompt, a tool context, a
retrieved document that many requests start with. What follows is usually the
request's own chain: a conversation's history, which only that conversation's
later turns reuse. The "ttft" cost weighs the two apart
(:attr:`router_client.config.RouterConfig.private_weight`): recomputing a
shared prefix on another worker makes one more copy of something many requests
use (a replica that spreads them), while moving a conversation away from its
history makes every later turn follow it or pay the recompute.

The tracker tells them apart by branching, the one thing a router sees of a
prompt's structure: a block key is **shared** once the prompts this router saw
continued it in :data:`FANOUT` or more different ways (a document many
questions follow, a system prompt many conversations follow); the shared part
of a prompt ends after its deepest shared block. Three, not two: a
conversation's next turn continues its last block differently from the turn
before (the turn's partial last block becomes a full block with the reply's
tokens), so every turn boundary of every conversation branches in two.

Memory is bounded: keys live in two generations of at most ``capacity`` keys
each; a key seen again moves to the newer one, and when the newer one is full
the older is dropped. A shared prefix is seen with every request that starts
with it, so it stays; a conversation's chain that is dropped is counted again
from its next turn (as private: the weight a new key gets).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

#: Distinct continuations that make a block key shared.
FANOUT = 3

#: Keys a generation holds before the older one is dropped (two generations:
#: about 2 x 40 MB at most in CPython; a few hundred long prompts' keys).
DEFAULT_CAPACITY = 1 << 18


class PrefixBranches:
    """The continuations of the block keys a router saw, up to :data:`FANOUT`
    distinct ones a key. Thread-safe."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, fanout: int = FANOUT) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if fanout < 2:
            raise ValueError("fanout must be at least 2")
        self._capacity = capacity
        self._fanout = fanout
        self._new: dict[int, tuple[int, ...]] = {}
        self._old: dict[int, tuple[int, ...]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def observe(self, keys: Sequence[int]) -> int:
        """Record the prompt ``keys`` and return the blocks of its shared part:
        one past its deepest key continued in :data:`FANOUT` or more ways, this
        prompt's continuation included (0: none is)."""
        fanout = self._fanout
        shared = 0
        with self._lock:
            new, old = self._new, self._old
            for i in range(len(keys) - 1):
                key, nxt = keys[i], keys[i + 1]
                seen = new.get(key)
                if seen is None:
                    seen = old.pop(key, None)
                    if seen is None:
                        seen = (nxt,)
                    elif len(seen) < fanout and nxt not in seen:
                        seen = (*seen, nxt)
                    new[key] = seen
                elif len(seen) < fanout and nxt not in seen:
                    seen = new[key] = (*seen, nxt)
                if len(seen) >= fanout:
                    shared = i + 1
                if len(new) >= self._capacity:
                    self._old, self._new = new, {}
                    new, old = self._new, self._old
        return shared
