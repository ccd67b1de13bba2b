"""The Redis backend's cache of engine-hash mappings (indexer/redis/backend.py,
``_ParentCache``): bounded, a mapping looked up again kept, a removal forgotten.

It is only a belief (the apply script checks a cached parent before writing;
tests/integration/test_redis_backend.py shows a warm apply is one EVALSHA), so
what matters here is the bound and that the hot entries stay.
"""

from __future__ import annotations

import random

from indexer.redis.backend import _ParentCache

N = b"w\x000"
NID = b"\x00" * 7 + b"\x01"


def test_it_holds_at_most_about_its_capacity() -> None:
    c = _ParentCache(1000)
    rng = random.Random(1)
    for _ in range(200):
        c.put(N, {rng.getrandbits(63): (NID, rng.getrandbits(64)) for _ in range(64)})
        assert len(c) < 1000 + 64
    assert len(c) >= 500 - 64


def test_the_last_mappings_written_and_those_read_again_stay() -> None:
    c = _ParentCache(1000)
    hot = {h: (NID, h + 1) for h in range(10)}
    c.put(N, hot)
    for i in range(100):
        c.put(N, {10_000 + 64 * i + j: (NID, j) for j in range(64)})
        for h, v in hot.items():  # a chain's tail, the parent of the next batch
            assert c.get((N, h)) == v, (i, h)
    last = {h: (NID, 7) for h in range(50_000, 50_010)}
    c.put(N, last)
    assert all(c.get((N, h)) == v for h, v in last.items())
    # another instance's mapping of the same hash is another entry
    assert c.get((b"x\x000", 0)) is None


def test_a_removed_mapping_is_forgotten_in_both_generations() -> None:
    c = _ParentCache(8)
    c.put(N, {1: (NID, 1), 2: (NID, 2), 3: (NID, 3), 4: (NID, 4)})  # rotated: older
    c.put(N, {5: (NID, 5)})
    c.pop((N, 1))
    c.pop((N, 5))
    assert c.get((N, 1)) is None and c.get((N, 5)) is None
    assert c.get((N, 2)) == (NID, 2)


def test_a_capacity_of_0_keeps_nothing() -> None:
    c = _ParentCache(0)
    c.put(N, {1: (NID, 1)})
    assert len(c) == 0 and c.get((N, 1)) is None
