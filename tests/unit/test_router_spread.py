"""Workers the "ttft" cost predicts equal go to the one a router started the fewest
requests on recently (``spread_half_life_s``): new conversations spread evenly in
number, and their later turns with them."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from router_client import MatchOutcome, MatchStatus, Router, RouteRequest, WorkerMatch, parse_config
from router_client.load import LoadTracker
from tests.conftest import FakeClock

BS = 16


def make_router(
    config: dict[str, Any], workers: list[str], clock: FakeClock, seed: int = 1
) -> Router:
    return Router(
        parse_config({"cost": "ttft", **config}),
        workers=workers,
        block_size=BS,
        seed=seed,
        clock=clock,
        registry=CollectorRegistry(),
    )


def req(i: int, tokens: int = 10 * BS) -> RouteRequest:
    return RouteRequest(i, tokens, block_keys=list(range(tokens // BS)))


def test_recent_requests_halve_every_half_life() -> None:
    clock = FakeClock(100.0)
    t = LoadTracker(clock=clock, spread_half_life_s=10.0)
    assert t.recent_requests("a") == 0.0
    t.start(1, "a", 100, 100)
    t.start(2, "a", 100, 100)
    t.finish(1)  # a finished request still counts: it was sent
    assert t.recent_requests("a") == pytest.approx(2.0)
    clock.now += 10.0
    assert t.recent_requests("a") == pytest.approx(1.0)
    t.start(3, "a", 100, 100)
    assert t.recent_requests("a") == pytest.approx(2.0)
    clock.now += 20.0
    assert t.recent_requests("a") == pytest.approx(0.5)
    assert t.recent_requests("b") == 0.0
    # Half-life 0: only this instant's requests count.
    t0 = LoadTracker(clock=clock, spread_half_life_s=0.0)
    t0.start(1, "a", 100, 100)
    assert t0.recent_requests("a") == 1.0
    clock.now += 0.001
    assert t0.recent_requests("a") == 0.0


def _route_in_turn(
    r: Router, clock: FakeClock, n: int, matches: dict[str, WorkerMatch]
) -> Counter[str]:
    """``n`` requests, each finished before the next: no queue anywhere, ever."""
    counts: Counter[str] = Counter()
    for i in range(n):
        choice = r.decide(req(i), MatchOutcome(MatchStatus.OK, matches), decode=False).prefill
        r.started(req(i), choice)
        r.finished(req(i))
        counts[choice.worker] += 1
        clock.now += 1.0
    return counts


def test_equal_workers_take_new_requests_in_turn() -> None:
    names = ["a", "b", "c", "d"]
    clock = FakeClock(100.0)
    counts = _route_in_turn(make_router({}, names, clock), clock, 40, {})
    assert counts == {w: 10 for w in names}


def test_without_the_spread_equal_workers_are_drawn_at_random() -> None:
    """The broken model: the same run with the spread off is uneven."""
    names = ["a", "b", "c", "d"]
    clock = FakeClock(100.0)
    r = make_router({"spread_half_life_s": 0}, names, clock)
    counts = _route_in_turn(r, clock, 40, {})
    assert max(counts.values()) - min(counts.values()) >= 3


def test_the_spread_never_outranks_a_hit() -> None:
    """Only workers predicted equal are told apart by it: a hit still wins every time."""
    names = ["a", "b", "c"]
    clock = FakeClock(100.0)
    r = make_router({"predictions": False}, names, clock)
    counts = _route_in_turn(r, clock, 12, {"b": WorkerMatch(4, 4)})
    assert counts == {"b": 12}


def test_an_old_count_is_forgotten() -> None:
    """A worker that took many requests long ago is as fresh as one that took none."""
    names = ["a", "b"]
    clock = FakeClock(100.0)
    r = make_router({"spread_half_life_s": 10}, names, clock)
    for i in range(20):
        r.started(req(i), r.decide(req(i), MatchOutcome(MatchStatus.OK), decode=False).prefill)
        r.finished(req(i))
    clock.now += 1_000.0  # a hundred half-lives
    counts = _route_in_turn(r, clock, 20, {})
    assert counts == {"a": 10, "b": 10}


@settings(max_examples=100, deadline=None, database=None)
@given(
    st.integers(2, 6), st.lists(st.floats(0.0, 30.0), min_size=1, max_size=40), st.integers(0, 99)
)
def test_each_choice_is_a_least_recently_sent_worker(
    n_workers: int, gaps: list[float], seed: int
) -> None:
    """Against a naive reference: the decayed count of every start, recomputed."""
    names = [f"w{i}" for i in range(n_workers)]
    clock = FakeClock(100.0)
    half_life = 7.0
    r = make_router({"spread_half_life_s": half_life}, names, clock, seed)
    sent: list[tuple[str, float]] = []
    for i, gap in enumerate(gaps):
        clock.now += gap
        recent = {
            w: sum(2.0 ** (-(clock.now - at) / half_life) for x, at in sent if x == w)
            for w in names
        }
        choice = r.decide(req(i), MatchOutcome(MatchStatus.OK), decode=False).prefill
        assert recent[choice.worker] == pytest.approx(min(recent.values()), abs=1e-9)
        r.started(req(i), choice)
        r.finished(req(i))
        sent.append((choice.worker, clock.now))


def test_a_worker_back_to_health_starts_level_with_the_others() -> None:
    """Out of the fleet its count decayed while the others' grew: without the level
    it would take every new conversation until it caught up."""
    names = ["a", "b", "c"]
    clock = FakeClock(100.0)
    r = make_router({"spread_half_life_s": 300}, names, clock)
    r.set_healthy("c", False)
    _route_in_turn(r, clock, 40, {})  # 20 each on a and b
    r.set_healthy("c", True)
    counts = _route_in_turn(r, clock, 30, {})
    assert counts == {"a": 10, "b": 10, "c": 10}
    # Marking a healthy worker healthy again changes nothing.
    before = r.load.recent_requests("a")
    r.set_healthy("a", True)
    assert r.load.recent_requests("a") == before
