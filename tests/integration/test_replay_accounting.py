"""The replay's decision accounting: what every engine held of a request when it was routed.

Each policy's per-request figures are checked against a naive recomputation
from the engines each request went to: one LRU cache per engine, every
engine's cached prefix read before the chosen one takes the request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from lab.sim.replay import POLICIES, PolicyResult, ReplaySettings, run_replay, trace_keys
from lab.synth import family, synthesize
from lab.traces import TraceRequest
from tee.cachesim.model import BlockCache

SETTINGS = ReplaySettings(routers=3, workers=6, capacity=120, seed=2, load=0.9, cost_model="blocks")


def chat(requests: int) -> list[TraceRequest]:
    """Multi-turn chat behind shared system prompts: prefixes worth routing to."""
    return synthesize(family("chat", requests=requests), seed=3).requests


def naive(
    keys: Sequence[Sequence[int]],
    workers: Sequence[int],
    n_workers: int,
    capacity: int,
    *,
    after_admission: bool = False,
) -> tuple[list[int], list[int]]:
    """(available, chosen) blocks of every request, replaying the routing decisions
    on fresh caches; ``after_admission`` reads them after the chosen one took the
    request (the broken accounting the replay must not do)."""
    caches = [BlockCache(capacity) for _ in range(n_workers)]
    available, chosen = [], []
    for k, w in zip(keys, workers, strict=True):
        if after_admission:
            caches[w].insert(k)
        prefixes = [c.lookup_prefix(k) for c in caches]
        available.append(max(prefixes))
        chosen.append(prefixes[w])
        if not after_admission:
            caches[w].insert(k)
    return available, chosen


def _totals(r: PolicyResult, keys: Sequence[Sequence[int]]) -> tuple[float, float, float]:
    blocks = sum(len(k) for k in keys)
    offered = sum(r.request_available)
    optimal = sum(1 for a, h in zip(r.request_available, r.request_hits, strict=True) if a == h)
    left = 1 - sum(r.request_hits) / offered if offered else 0.0
    return offered / blocks, optimal / len(keys), left


async def test_every_policy_accounts_what_the_engines_held_before_admission() -> None:
    trace = chat(400)
    keys = trace_keys(trace)
    result = await run_replay(trace, SETTINGS, POLICIES)
    for r in result.results:
        assert all(a >= h for a, h in zip(r.request_available, r.request_hits, strict=True))
        available, chosen = naive(keys, r.request_workers, SETTINGS.workers, SETTINGS.capacity)
        assert r.request_available == available, r.policy
        assert r.request_hits == chosen, r.policy
        broken, _ = naive(
            keys, r.request_workers, SETTINGS.workers, SETTINGS.capacity, after_admission=True
        )
        assert r.request_available != broken, r.policy  # the check can tell them apart
        avail, optimal, left = _totals(r, keys)
        assert r.available_hit_rate == avail
        assert r.optimal_share == optimal
        assert r.left_on_table == left
        assert r.available_hit_rate >= r.hit_rate
    by = {r.policy: r for r in result.results}
    # the cache-blind policies leave most of what was there; the shared index finds it
    assert by["cache_shared"].left_on_table < 0.5 * by["p2c"].left_on_table
    figures = result.figures()
    for p in POLICIES:
        for name in ("available_hit_rate", "optimal_share", "left_on_table", "load_view_gap"):
            assert f"{p}_{name}" in figures


def _spaced(trace: Sequence[TraceRequest], gap_ms: int) -> list[TraceRequest]:
    """The trace with one request every ``gap_ms``: each finishes before the next arrives."""
    return [dataclasses.replace(r, timestamp=i * gap_ms) for i, r in enumerate(trace)]


async def test_a_router_that_sees_every_cache_takes_the_best_engine_every_time() -> None:
    # Requests ten minutes apart: every engine's events are in the index before
    # the next arrival, so cache_shared with pure cache affinity (balance 0)
    # always picks an engine holding the longest prefix.
    trace = _spaced(chat(300), 600_000)
    settings = ReplaySettings(
        routers=2, workers=4, capacity=100, balance=0.0, seed=5, cost_model="blocks"
    )
    result = await run_replay(trace, settings, ["cache_shared", "random"])
    shared, rnd = result.results
    assert shared.optimal_share == 1.0
    assert shared.left_on_table == 0.0
    assert shared.hit_rate == shared.available_hit_rate > 0
    assert rnd.optimal_share < 0.9 and rnd.left_on_table > 0.1
