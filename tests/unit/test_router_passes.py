"""Each routing pass and fallback path, with asserted choices."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from router_client import (
    MatchOutcome,
    MatchStatus,
    NoHealthyWorker,
    Router,
    RouteRequest,
    WorkerLoad,
    WorkerMatch,
    parse_config,
)

BS = 16


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_router(config: dict[str, Any] | None = None, **kw: Any) -> Router:
    # The passes under the blocks cost, whose one knob these cases set; the
    # ttft cost has its own cases (test_cost_ttft.py).
    cfg = parse_config({"cost": "blocks", **(config or {})})
    kw.setdefault("workers", ["a", "b", "c"])
    kw.setdefault("seed", 1)
    return Router(cfg, block_size=BS, registry=CollectorRegistry(), **kw)


def ok(**depths: int) -> MatchOutcome:
    return MatchOutcome(MatchStatus.OK, {w: WorkerMatch(d, d) for w, d in depths.items()})


def req(i: object = 1, tokens: int = 10 * BS, out: int = 0, **kw: Any) -> RouteRequest:
    return RouteRequest(i, tokens, out, block_keys=list(range(tokens // BS)), **kw)


BUCKETS: dict[str, Any] = {
    "workers": ["p0", "p1", "p2", "d0", "d1"],
    "buckets": [
        {
            "id": "small",
            "stage": "prefill",
            "rank": 0,
            "workers": ["p0"],
            "max_tokens": 1000,
            "limits": {"max_running_requests": 1},
        },
        {
            "id": "any",
            "stage": "prefill",
            "rank": 1,
            "workers": ["p1", "p2"],
            "max_tokens": 100000,
            "limits": {"max_running_requests": 1},
        },
        {
            "id": "dec",
            "stage": "decode",
            "workers": ["d0", "d1"],
            "max_tokens": 100000,
            "limits": {"max_running_requests": 1},
        },
    ],
}


def test_pass1_prefers_the_deepest_match_at_equal_load() -> None:
    r = make_router()
    d = r.decide(req(), ok(a=1, b=8, c=1), decode=False)
    assert d.prefill.worker == "b"
    assert d.prefill.reason == "cache_candidate"
    assert d.prefill.pass_no == 1


def test_load_outweighs_a_shallow_match() -> None:
    r = make_router({"balance": 0.5})
    r.load.report("b", WorkerLoad(3, 30 * BS, 0), at=0.0)
    d = r.decide(req(), ok(a=1, b=3, c=1), decode=False)
    assert d.prefill.worker in ("a", "c")


def test_shared_first_block_does_not_pin_one_worker() -> None:
    # Every worker holds only block 0: the trap trace. Ties break at random and
    # load spreads the requests, so no worker takes them all.
    r = make_router()
    seen = set()
    for i in range(30):
        c = r.decide(req(i), ok(a=1, b=1, c=1), decode=False).prefill
        assert c.reason == "no_cache_candidate"
        r.started(req(i), c)
        seen.add(c.worker)
    assert seen == {"a", "b", "c"}


def test_indexer_unavailable_routes_on_load() -> None:
    r = make_router()
    r.load.report("a", WorkerLoad(5, 5000, 0), at=0.0)
    r.load.report("b", WorkerLoad(0, 0, 0), at=0.0)
    r.load.report("c", WorkerLoad(5, 5000, 0), at=0.0)
    d = r.decide(req(), MatchOutcome(MatchStatus.DEADLINE_EXCEEDED), decode=False)
    assert (d.prefill.worker, d.prefill.reason) == ("b", "indexer_unavailable")
    assert r.decisions[("prefill", "indexer_unavailable")] == 1


def test_unknown_instances_in_match_are_ignored_and_counted() -> None:
    r = make_router()
    d = r.decide(req(), ok(zz=9, b=2, a=1, c=1), decode=False)
    assert d.prefill.worker == "b"
    assert r.unknown_instances == 1


def test_buckets_rank_order_and_capacity_fallback_to_next_domain() -> None:
    clock = Clock()
    r = make_router(BUCKETS, clock=clock)
    small = req(1, tokens=10 * BS, out=16)
    d = r.decide(small, ok())
    assert d.prefill.worker == "p0" and d.prefill.domain == "small"
    assert d.decode is not None and d.decode.reason == "least_load"
    # p0 full (fresh report at its limit): pass 1 moves on to the next domain.
    r.load.report("p0", WorkerLoad(1, 100, 0), at=clock.now)
    d = r.decide(small, ok())
    assert d.prefill.domain == "any" and d.prefill.pass_no == 1


def test_pass2_p2c_only_when_nothing_is_admitted() -> None:
    clock = Clock()
    r = make_router(BUCKETS, clock=clock)
    for w, n in (("p0", 1), ("p1", 3), ("p2", 1), ("d0", 1), ("d1", 1)):
        r.load.report(w, WorkerLoad(n, n * 1000, 0), at=clock.now)
    d = r.decide(req(1, tokens=10 * BS), ok())
    assert d.prefill.pass_no == 2 and d.prefill.reason == "capacity_fallback_p2c"
    assert d.prefill.worker in ("p0", "p1", "p2")
    # the decode stage gets the same fallback
    assert d.decode is not None and d.decode.reason == "capacity_fallback_p2c"
    # p2c picks the lighter of its two: with p1 heaviest it never wins a pair
    # that contains a lighter worker.
    picks = {r.decide(req(i, tokens=10 * BS), ok()).prefill.worker for i in range(40)}
    assert "p1" not in picks


def test_stale_load_fails_open() -> None:
    clock = Clock()
    r = make_router(BUCKETS, clock=clock)
    r.load.report("p0", WorkerLoad(1, 100, 0), at=clock.now)
    clock.now += 60  # older than load_stale_s
    d = r.decide(req(1, tokens=10 * BS), ok())
    assert d.prefill.worker == "p0" and d.prefill.pass_no == 1


def test_request_longer_than_every_bucket_takes_range_fallback() -> None:
    r = make_router(BUCKETS)
    d = r.decide(req(1, tokens=200000), ok())
    assert d.prefill.reason == "range_fallback"
    assert d.prefill.domain == "any"  # the bucket reaching furthest
    assert d.decode is not None and d.decode.reason == "range_fallback"


def test_unhealthy_workers_and_no_healthy_worker() -> None:
    r = make_router(BUCKETS)
    r.set_healthy("p0", False)
    assert r.decide(req(1, tokens=10 * BS), ok()).prefill.domain == "any"
    for w in ("p1", "p2"):
        r.set_healthy(w, False)
    with pytest.raises(NoHealthyWorker) as exc:
        r.decide(req(1, tokens=10 * BS), ok())
    assert exc.value.stage == "prefill"
    with pytest.raises(KeyError):
        r.set_healthy("nope", True)


def test_slo_partition() -> None:
    cfg: dict[str, Any] = {
        "workers": ["fast", "slow", "d0"],
        "slo_policy": "best_effort",
        "buckets": [
            {
                "id": "a_slow",
                "stage": "prefill",
                "workers": ["slow"],
                "max_tokens": 10000,
                "ttft_p95_ms": 900,
            },
            {
                "id": "b_fast",
                "stage": "prefill",
                "rank": 1,
                "workers": ["fast"],
                "max_tokens": 10000,
                "ttft_p95_ms": 100,
            },
            {"id": "dec", "stage": "decode", "workers": ["d0"], "max_tokens": 100000},
        ],
    }
    r = make_router(cfg)
    assert r.decide(req(1, ttft_slo_ms=200), ok()).prefill.worker == "fast"
    assert r.decide(req(2), ok()).prefill.worker == "slow"  # no target: rank order
    cfg["slo_policy"] = "slo_first"
    r = make_router(cfg)
    assert [d.id for d in r.domains("prefill", req(1, ttft_slo_ms=200))] == ["b_fast"]
    r.set_healthy("fast", False)
    assert r.decide(req(1, ttft_slo_ms=200), ok()).prefill.worker == "slow"


def test_route_without_indexer_and_token_ids() -> None:
    import asyncio

    r = make_router()
    rq = RouteRequest(1, 64, token_ids=list(range(64)))
    assert len(r.keys_for(rq)) == 4
    d = asyncio.run(r.route(rq, decode=False))
    assert d.prefill.reason == "indexer_unavailable"


def test_a_hit_counts_only_the_blocks_the_engine_reuses() -> None:
    # A 10-block prompt of exactly 10 * BS tokens: the engine computes its last
    # token again, so at most 9 blocks are reused however many the worker holds.
    r = make_router()
    d = r.decide(req(), ok(a=10, b=9), decode=False)
    assert d.prefill.cached_blocks == 9
    r.started(req(), d.prefill)
    assert r.load.load(d.prefill.worker).pending_prefill_tokens == BS
    # One more token: all 10 whole blocks can be reused.
    longer = RouteRequest(2, 10 * BS + 1, 0, block_keys=list(range(10)))
    assert r.decide(longer, ok(a=10), decode=False).prefill.cached_blocks == 10
    # Equal reusable hits tie (broken at random), a deeper one still wins.
    r = make_router()
    picks = {r.decide(req(i), ok(a=10, b=9), decode=False).prefill.worker for i in range(40)}
    assert picks == {"a", "b"}
    assert r.decide(req(), ok(a=8, b=9), decode=False).prefill.worker == "b"


def test_a_hit_inside_a_block_counts_its_reused_part() -> None:
    # A hybrid engine reuses 2 whole blocks and 10 tokens of the third (the
    # indexer's tokens); another worker holds 2 whole blocks only.
    r = make_router()
    m = MatchOutcome(
        MatchStatus.OK,
        {"a": WorkerMatch(2, 2, tokens=2 * BS + 10), "b": WorkerMatch(2, 2)},
    )
    d = r.decide(req(), m, decode=False)
    assert d.prefill.worker == "a"
    assert d.prefill.cached_blocks == pytest.approx(2 + 10 / BS)
