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

Memory is bounded: keys live in two generations of ``capacity`` keys each (a
generation may overrun by one prompt's keys); a key seen again moves to the
newer one, and when the newer one is full the older is dropped. A shared
prefix is seen with every request that starts with it, so it stays; a
conversation's chain that is dropped is counted again from its next turn (as
its own part: the weight a new key gets).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from itertools import compress
from operator import ne

#: Distinct continuations that make a block key shared.
FANOUT = 3

#: Keys a generation holds before the older one is dropped (two generations:
#: about 2 x 40 MB at most in CPython; a few hundred long prompts' keys).
DEFAULT_CAPACITY = 1 << 18


#: A key continued :data:`FANOUT` or more ways (its continuations are no longer kept).
_SHARED = object()


class PrefixBranches:
    """The continuations of the block keys a router saw, up to :data:`FANOUT`
    distinct ones a key. Thread-safe.

    A key's entry is the one key that followed it (an int: most keys, the
    prompt's own chain, held without a new object), a tuple of the distinct
    ones while fewer than :data:`FANOUT`, then a marker. A prompt is walked in C
    (``map``) where it repeats what was seen; Python runs only where it differs.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, fanout: int = FANOUT) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        if fanout < 2:
            raise ValueError("fanout must be at least 2")
        self._capacity = capacity
        self._fanout = fanout
        self._new: dict[int, object] = {}
        self._old: dict[int, object] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._new) + len(self._old)

    def observe(self, keys: Sequence[int]) -> int:
        """Record the prompt ``keys`` and return the blocks of its shared part:
        one past its deepest key continued in :data:`FANOUT` or more ways, this
        prompt's continuation included (0: none is)."""
        n = len(keys)
        if n < 2:
            return 0
        ks = list(keys)
        with self._lock:
            if len(set(ks)) != n:  # a key twice in one prompt: in order, one at a time
                return self._observe_each(ks)
            new, old = self._new, self._old
            heads, nexts = ks[:-1], ks[1:]
            vals = list(map(new.get, heads))
            if None in vals:
                # Not in the newer generation: moved up from the older, or new.
                pop = old.pop
                for i in [i for i, v in enumerate(vals) if v is None]:
                    vals[i] = new[heads[i]] = pop(heads[i], nexts[i])
            shared = 0
            for i in compress(range(n - 1), map(ne, vals, nexts)):
                entry = self._continued(vals[i], nexts[i])
                if entry is not None:
                    new[heads[i]] = entry
                if entry is _SHARED or vals[i] is _SHARED:
                    shared = i + 1
            if len(new) >= self._capacity:
                self._old, self._new = new, {}
        return shared

    def _continued(self, entry: object, nxt: int) -> object | None:
        """A key's entry once ``nxt`` (not ``entry`` itself) followed it, or None
        when it does not change (shared already, or ``nxt`` among its continuations)."""
        if entry is _SHARED:
            return None
        if type(entry) is tuple:
            if nxt in entry:
                return None
            seen: tuple[object, ...] = (*entry, nxt)
        else:
            seen = (entry, nxt)
        return _SHARED if len(seen) >= self._fanout else seen

    def _observe_each(self, keys: list[int]) -> int:
        """:meth:`observe` a key at a time (under the lock), for a prompt that
        repeats a key, whose continuations then depend on the order."""
        shared = 0
        new, old = self._new, self._old
        for i in range(len(keys) - 1):
            key, nxt = keys[i], keys[i + 1]
            v = new.get(key)
            if v is None:
                v = new[key] = old.pop(key, nxt)
            entry = None if v == nxt else self._continued(v, nxt)
            if entry is not None:
                new[key] = entry
            if entry is _SHARED or v is _SHARED:
                shared = i + 1
        if len(new) >= self._capacity:
            self._old, self._new = new, {}
        return shared
