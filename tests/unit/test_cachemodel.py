"""BlockCache against a naive list model, plus the stats helpers."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import find, given, settings
from hypothesis import strategies as st

from tee.cachesim.model import (
    BlockCache,
    EvictionPolicy,
    FleetCache,
    HitStats,
    SlidingWindow,
    infinite_cache,
    pooled_cache,
    worker_cv,
)


class NaiveCache:
    """Reference: a plain list in eviction order (index 0 = next victim)."""

    def __init__(self, capacity: int | None, policy: str, *, forward_touch: bool = False) -> None:
        self.capacity = capacity
        self.lru = policy == "lru"
        self.order: list[int] = []
        self.forward_touch = forward_touch  # a deliberately broken variant

    def lookup_prefix(self, keys: Sequence[int]) -> int:
        n = 0
        for k in keys:
            if k not in self.order:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> list[int]:
        if self.capacity is not None:
            keys = list(keys)[: self.capacity]
        evicted = []
        seq = keys if self.forward_touch else list(reversed(keys))
        for k in seq:
            if k in self.order:
                if self.lru:
                    self.order.remove(k)
                    self.order.append(k)
                continue
            if self.capacity is not None and len(self.order) >= self.capacity:
                evicted.append(self.order.pop(0))
            self.order.append(k)
        return evicted


keys_st = st.lists(st.integers(0, 12), max_size=8)
ops_st = st.lists(st.tuples(st.booleans(), keys_st), max_size=40)
cap_st = st.one_of(st.none(), st.integers(0, 10))
policy_st = st.sampled_from(["lru", "fifo"])
Ops = list[tuple[bool, list[int]]]


def _diverges(cap: int | None, policy: str, ops: Ops, model: NaiveCache) -> bool:
    real = BlockCache(cap, policy)
    for is_insert, keys in ops:
        if is_insert:
            if real.insert(keys) != model.insert(keys):
                return True
        elif real.lookup_prefix(keys) != model.lookup_prefix(keys):
            return True
        if real.keys() != model.order:
            return True
    return False


@settings(max_examples=300, deadline=None)
@given(cap_st, policy_st, ops_st)
def test_matches_naive_model(cap: int | None, policy: str, ops: Ops) -> None:
    assert not _diverges(cap, policy, ops, NaiveCache(cap, policy))
    real = BlockCache(cap, policy)
    for _, keys in ops:
        real.insert(keys)
        if cap is not None:
            assert len(real) <= cap


def test_property_catches_a_broken_model() -> None:
    # Touching keys first-to-last (prefix evicted before its tail) must be caught.
    example = find(
        st.tuples(st.integers(1, 6), ops_st),
        lambda a: _diverges(a[0], "lru", a[1], NaiveCache(a[0], "lru", forward_touch=True)),
        settings=settings(max_examples=2000, database=None),
    )
    assert example is not None


def test_lru_evicts_tail_before_prefix_and_refreshes() -> None:
    c = BlockCache(4)
    assert c.insert([1, 2, 3]) == []
    assert c.lookup_prefix([1, 2, 3, 9]) == 3
    assert c.insert([1, 2, 5, 6]) == [3]  # 3 was the deepest, least recent
    assert c.lookup_prefix([1, 2, 3]) == 2
    res = c.access([7])
    assert res.hits == 0 and res.evicted == [6]


def test_fifo_does_not_refresh() -> None:
    c = BlockCache(2, EvictionPolicy.FIFO)
    c.insert([1])
    c.insert([2])
    c.insert([1])  # no refresh under FIFO
    assert c.insert([3]) == [1]


def test_lookup_is_read_only_and_oversized_request_truncates() -> None:
    c = BlockCache(3)
    c.insert([1, 2])
    c.lookup_prefix([1])
    assert c.keys() == [2, 1]
    assert c.insert(list(range(10, 20))) == [2, 1]
    assert c.keys() == [12, 11, 10]
    assert BlockCache(0).insert([1, 2]) == []
    with pytest.raises(ValueError):
        BlockCache(-1)


def test_set_capacity_shrinks_in_policy_order() -> None:
    c = BlockCache(None)
    c.insert([1, 2, 3])
    assert c.set_capacity(1) == [3, 2]
    assert c.keys() == [1]


def test_bounds() -> None:
    inf = infinite_cache()
    inf.insert(list(range(1000)))
    assert len(inf) == 1000 and inf.capacity is None
    assert pooled_cache([3, 4, 5]).capacity == 12


def test_hit_stats_and_cv() -> None:
    s = HitStats()
    assert s.hit_rate == 0.0
    s.add(10, 4)
    s.add(10, 6)
    assert s.hit_rate == 0.5 and s.requests == 2
    assert worker_cv([]) == 0.0
    assert worker_cv([0, 0]) == 0.0
    assert worker_cv([5, 5, 5]) == 0.0
    assert math.isclose(worker_cv([1, 3]), 0.5)  # std 1, mean 2


def test_sliding_window_expires() -> None:
    w = SlidingWindow(10.0, buckets=10)
    w.add(0.5, "a", 10, 5)
    w.add(5.5, "a", 10, 0)
    w.add(5.5, "b", 4, 4)
    t = w.totals(6.0)
    assert t["a"].blocks == 20 and t["b"].hit_blocks == 4
    t = w.totals(12.0)  # the sample at 0.5 has left the window
    assert t["a"].blocks == 10 and t["a"].hit_blocks == 0
    assert w.totals(100.0) == {}


def test_fleet_cache_bounds_order() -> None:
    f = FleetCache(worker_capacity=4)
    prompt = [1, 2, 3, 4]
    for i in range(6):
        f.access(prompt, f"w{i % 2}", now=float(i))
    assert f.pooled.capacity == 8
    # Round-robin misses once per worker; the pooled and infinite caches once.
    assert f.routed_stats.hit_blocks == 16
    assert f.pooled_stats.hit_blocks == 20 == f.infinite_stats.hit_blocks
    assert f.worker_cv() == 0.0
    f.access([9], None, now=6.0)
    rep = f.report(now=6.0)
    total = rep["total"]
    assert isinstance(total, dict)
    assert total["requests"] == 7 and total["routed"]["requests"] == 6  # type: ignore[index]
    assert set(total["per_worker"]) == {"w0", "w1"}  # type: ignore[arg-type]
