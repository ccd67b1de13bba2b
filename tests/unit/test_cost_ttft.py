"""The "ttft" cost: predicted time to first token, queue plus own prefill, at each
worker's learned prefill rate; checked against a naive reference on random fleets."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from router_client import (
    ConfigError,
    MatchOutcome,
    MatchStatus,
    Router,
    RouteRequest,
    WorkerLoad,
    WorkerMatch,
    parse_config,
)
from router_client import cost as costmod
from router_client.config import DEFAULT_PRIVATE_WEIGHT
from router_client.load import PREFILL_RATE_ALPHA, LoadTracker

BS = 16
NOW = 100.0
DEFAULT_RATE = 10_000.0
PREDICTED_WEIGHT = 0.9


def make_router(config: dict[str, Any], workers: list[str], seed: int = 1) -> Router:
    return Router(
        parse_config(config),
        workers=workers,
        block_size=BS,
        seed=seed,
        clock=lambda: NOW,
        registry=CollectorRegistry(),
    )


def req(tokens: int, i: object = 1) -> RouteRequest:
    return RouteRequest(i, tokens, block_keys=list(range(tokens // BS)))


# -- the reference -------------------------------------------------------------------


def naive_cached(m: WorkerMatch | None, reusable: int) -> float:
    """Tier-weighted blocks, scaled down to the reusable ones."""
    if m is None:
        return 0.0
    weighted = m.gpu_blocks * 1.0 + m.cpu_blocks * 0.75 + m.disk_blocks * 0.5
    if m.depth > reusable:
        weighted = weighted * reusable / m.depth
    return weighted


def naive_ttft(
    report: WorkerLoad | None, cached: float, input_tokens: int, weight: float = 1.0
) -> float:
    """Queue, then the request's own prefill (``weight`` times), at the worker's rate."""
    rate = report.prefill_tokens_per_s if report and report.prefill_tokens_per_s > 0 else 0.0
    rate = rate or DEFAULT_RATE
    queue = report.pending_prefill_tokens if report else 0
    return queue / rate + weight * max(0.0, input_tokens - cached * BS) / rate


def naive_admits(report: WorkerLoad | None, limits: dict[str, int], prefill: int) -> bool:
    """The bucket limits on a fresh engine report (none: admitted)."""
    if report is None:
        return True
    cap_running = limits.get("max_running_requests")
    if cap_running is not None and report.running_requests + 1 > cap_running:
        return False
    cap = limits.get("max_pending_prefill_tokens")
    return cap is None or report.pending_prefill_tokens + prefill <= cap


@dataclass
class Fleet:
    names: list[str]
    input_tokens: int
    matches: dict[str, WorkerMatch]
    reports: dict[str, WorkerLoad]
    limits: dict[str, int]


@st.composite
def fleets(draw: st.DrawFn) -> Fleet:
    names = [f"w{i}" for i in range(draw(st.integers(2, 6)))]
    input_tokens = draw(st.integers(BS, 40 * BS))
    n_blocks = input_tokens // BS
    matches: dict[str, WorkerMatch] = {}
    reports: dict[str, WorkerLoad] = {}
    for w in names:
        if draw(st.booleans()):
            gpu, cpu, disk = (draw(st.integers(0, n_blocks)) for _ in range(3))
            depth = gpu + cpu + disk
            predicted = max(depth, draw(st.integers(0, n_blocks + 2)))
            if predicted:
                matches[w] = WorkerMatch(depth, gpu, cpu, disk, 0, predicted)
        if draw(st.booleans()):
            reports[w] = WorkerLoad(
                draw(st.integers(0, 8)),
                draw(st.integers(0, 50_000)),
                draw(st.integers(0, 50_000)),
                draw(st.sampled_from([0.0, 1_500.0, 4_000.0, 10_000.0, 25_000.0, 80_000.0])),
            )
    limits: dict[str, int] = {}
    if draw(st.booleans()):
        limits["max_pending_prefill_tokens"] = draw(st.integers(0, 60_000))
    if draw(st.booleans()):
        limits["max_running_requests"] = draw(st.integers(1, 8))
    return Fleet(names, input_tokens, matches, reports, limits)


@settings(max_examples=300, deadline=None, database=None, report_multiple_bugs=False)
@given(
    fleets(),
    st.booleans(),
    st.integers(0, 2**16),
    st.sampled_from([1.0, 1.0, 2.0, 7.5]),
    st.sampled_from([None, 4.0]),
)
def check_ttft_choice_is_the_naive_minimum(
    fleet: Fleet, predictions: bool, seed: int, weight: float, private: float | None
) -> None:
    """``private``: the weight of the prompt's own part (None: ``weight`` too). The
    router has seen no other prompt, so all of this one is its own."""
    names = fleet.names
    config = {
        "cost": "ttft",
        "limits": fleet.limits,
        "predictions": predictions,
        "prefill_weight": weight,
        "private_weight": weight if private is None else private,
    }
    if private is not None:
        weight = private
    r = make_router(config, names, seed)
    for w, load in fleet.reports.items():
        r.load.report(w, load, at=NOW)
    n_blocks = fleet.input_tokens // BS
    reusable = costmod.reusable_blocks(fleet.input_tokens, n_blocks, BS)
    choice = r.decide(
        req(fleet.input_tokens), MatchOutcome(MatchStatus.OK, fleet.matches), decode=False
    ).prefill
    ttft: dict[str, float] = {}
    for w in names:
        m = fleet.matches.get(w)
        cached = naive_cached(m, reusable)
        prefill = int(max(0.0, n_blocks - cached) * BS)  # admission: confirmed blocks only
        if predictions and m is not None:
            cached = max(cached, min(m.predicted_depth, reusable) * PREDICTED_WEIGHT)
        if naive_admits(fleet.reports.get(w), fleet.limits, prefill):
            ttft[w] = naive_ttft(fleet.reports.get(w), cached, fleet.input_tokens, weight)
    if not ttft:
        assert choice.pass_no == 2
        return
    assert choice.pass_no == 1
    assert choice.worker in ttft
    assert ttft[choice.worker] == pytest.approx(min(ttft.values()), rel=1e-9, abs=1e-12)
    assert choice.cost == pytest.approx(ttft[choice.worker], rel=1e-9, abs=1e-12)


def test_ttft_choice_minimises_the_naive_predicted_ttft() -> None:
    check_ttft_choice_is_the_naive_minimum()


def test_a_cost_that_ignores_the_queue_fails_the_property(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def own_prefill_only(pending: float, uncached: float, rate: float, weight: float) -> float:
        return weight * uncached / rate

    monkeypatch.setattr(costmod, "predicted_ttft_s", own_prefill_only)
    with pytest.raises(AssertionError):
        check_ttft_choice_is_the_naive_minimum()


def test_a_cost_that_ignores_the_rate_fails_the_property(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def tokens_only(pending: float, uncached: float, rate: float, weight: float) -> float:
        return pending + weight * uncached

    monkeypatch.setattr(costmod, "predicted_ttft_s", tokens_only)
    with pytest.raises(AssertionError):
        check_ttft_choice_is_the_naive_minimum()


def test_a_cost_that_ignores_the_prefill_weight_fails_the_property(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def unweighted(pending: float, uncached: float, rate: float, weight: float) -> float:
        return (pending + uncached) / rate

    monkeypatch.setattr(costmod, "predicted_ttft_s", unweighted)
    with pytest.raises(AssertionError):
        check_ttft_choice_is_the_naive_minimum()


# -- examples ------------------------------------------------------------------------


def test_a_prefill_weight_keeps_a_hit_behind_a_short_queue() -> None:
    """a holds 9 of 10 blocks behind 1,000 tokens at 10,000 tokens/s (0.1 s of queue);
    b is idle and cold (161 tokens to compute, 16 ms). By predicted TTFT b wins; with
    the request's prefill weighed 8 times (129 ms against 0.1 s + 8 * 1.7 ms), a does."""
    matches = MatchOutcome(MatchStatus.OK, {"a": WorkerMatch(9, 9)})
    picks = {}
    for weight in (1.0, 8.0):
        config = {"cost": "ttft", "prefill_weight": weight, "private_weight": weight}
        r = make_router(config, ["a", "b"])
        r.load.report("a", WorkerLoad(1, 1_000, 1_000, DEFAULT_RATE), at=NOW)
        picks[weight] = r.decide(req(10 * BS + 1), matches, decode=False).prefill.worker
    assert picks == {1.0: "b", 8.0: "a"}
    with pytest.raises(ConfigError) as e:
        parse_config({"prefill_weight": 0.5})
    assert e.value.field == "prefill_weight"


def test_ttft_leaves_a_slow_queue_the_blocks_cost_keeps() -> None:
    """A holds 9 of 10 blocks behind 2,000 tokens at 1,000 tokens/s (2 s of queue); b is
    idle and cold. In blocks a wins (1 block to compute, a small load); in time b does
    (10 blocks at the default rate: 16 ms against 2 s)."""
    matches = MatchOutcome(MatchStatus.OK, {"a": WorkerMatch(9, 9)})
    picks = {}
    for cost in ("blocks", "ttft"):
        r = make_router({"cost": cost}, ["a", "b"])
        r.load.report("a", WorkerLoad(1, 2_000, 2_000, 1_000.0), at=NOW)
        picks[cost] = r.decide(req(10 * BS + 1), matches, decode=False).prefill
    assert picks["blocks"].worker == "a"
    assert picks["ttft"].worker == "b"
    # The cost weighs the request's own prefill (private_weight: the router has seen
    # no other prompt, so none of this one is shared); its predicted TTFT (the
    # predicted end of its prefill) does not.
    own = (10 * BS + 1) / DEFAULT_RATE
    assert picks["ttft"].cost == pytest.approx(DEFAULT_PRIVATE_WEIGHT * own)
    assert picks["ttft"].prefill_end_s == pytest.approx(own)


def test_ttft_prefers_the_faster_worker_at_equal_queue() -> None:
    r = make_router({"cost": "ttft"}, ["a", "b"])
    r.load.report("a", WorkerLoad(1, 8_000, 8_000, 4_000.0), at=NOW)
    r.load.report("b", WorkerLoad(1, 8_000, 8_000, 40_000.0), at=NOW)
    for i in range(10):
        choice = r.decide(req(64 * BS, i), MatchOutcome(MatchStatus.OK), decode=False).prefill
        assert choice.worker == "b"


def test_ttft_ties_are_broken_at_random() -> None:
    r = make_router({"cost": "ttft"}, ["a", "b", "c"])
    picks = {
        r.decide(req(10 * BS, i), MatchOutcome(MatchStatus.OK), decode=False).prefill.worker
        for i in range(40)
    }
    assert picks == {"a", "b", "c"}


def test_the_router_counts_its_own_pending_prefill_in_the_queue() -> None:
    """Requests this router started since the report are in the queue too."""
    r = make_router({"cost": "ttft"}, ["a", "b"])
    first = r.decide(req(100 * BS, 1), MatchOutcome(MatchStatus.OK), decode=False).prefill
    r.started(req(100 * BS, 1), first)
    second = r.decide(req(100 * BS, 2), MatchOutcome(MatchStatus.OK), decode=False).prefill
    assert second.worker != first.worker


# -- the learned rate ----------------------------------------------------------------


def test_the_reported_prefill_rate_is_a_moving_average() -> None:
    t = LoadTracker(clock=lambda: NOW)
    assert t.load("a").prefill_tokens_per_s == 0.0
    t.report("a", WorkerLoad(0, 0, 0, 10_000.0), at=1.0)
    assert t.load("a").prefill_tokens_per_s == 10_000.0
    t.report("a", WorkerLoad(0, 0, 0, 20_000.0), at=2.0)
    expected = 10_000.0 + PREFILL_RATE_ALPHA * 10_000.0
    assert t.load("a").prefill_tokens_per_s == pytest.approx(expected)
    t.report("a", WorkerLoad(0, 0, 0, 0.0), at=3.0)  # not reported: the average stays
    t.report("a", WorkerLoad(0, 0, 0, 90_000.0), at=0.5)  # older snapshot: ignored
    assert t.load("a").prefill_tokens_per_s == pytest.approx(expected)


def test_prefill_rate_falls_back_to_the_default() -> None:
    assert costmod.prefill_rate(WorkerLoad(), 7.0) == 7.0
    assert costmod.prefill_rate(WorkerLoad(prefill_tokens_per_s=3.0), 7.0) == 3.0
    assert costmod.predicted_ttft_s(1_000, 500, 10_000.0) == pytest.approx(0.15)
    assert costmod.uncached_tokens(100, 9.5, BS) == 0.0
    assert costmod.uncached_tokens(100, 2.5, BS) == 60.0


def test_cost_settings_are_validated() -> None:
    cfg = parse_config({"cost": "ttft", "prefill_tokens_per_s": 5000})
    assert cfg.cost == "ttft" and cfg.prefill_tokens_per_s == 5000
    assert parse_config({}).cost == "ttft"
    with pytest.raises(ConfigError) as e:
        parse_config({"cost": "seconds"})
    assert e.value.field == "cost"
    with pytest.raises(ConfigError) as e:
        parse_config({"prefill_tokens_per_s": 0})
    assert e.value.field == "prefill_tokens_per_s"
