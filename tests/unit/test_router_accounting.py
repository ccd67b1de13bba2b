"""Decision accounting: each prefill choice against the best cached prefix admitted,
counted on the router and in Prometheus; checked against a naive recomputation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry

from router_client import (
    MatchOutcome,
    MatchStatus,
    Router,
    RouteRequest,
    WorkerLoad,
    WorkerMatch,
    parse_config,
)
from router_client import cost as costmod

BS = 16
NOW = 100.0


#: Each router's own Prometheus registry, to read its counters back.
REGISTRIES: dict[Router, CollectorRegistry] = {}


def make_router(config: dict[str, Any] | None = None, **kw: Any) -> Router:
    kw.setdefault("workers", ["a", "b", "c"])
    kw.setdefault("seed", 1)
    registry = CollectorRegistry()
    r = Router(
        parse_config(config or {}), block_size=BS, clock=lambda: NOW, registry=registry, **kw
    )
    REGISTRIES[r] = registry
    return r


def req(i: object = 1, tokens: int = 10 * BS + 1) -> RouteRequest:
    return RouteRequest(i, tokens, block_keys=list(range(tokens // BS)))


def ok(**depths: int) -> MatchOutcome:
    return MatchOutcome(MatchStatus.OK, {w: WorkerMatch(d, d) for w, d in depths.items()})


def sample(r: Router, name: str, **labels: str) -> float:
    value = REGISTRIES[r].get_sample_value(name, labels)
    return 0.0 if value is None else float(value)


# -- examples ------------------------------------------------------------------------


def test_a_choice_at_the_best_hit_is_optimal() -> None:
    r = make_router()
    choice = r.decide(req(), ok(a=2, b=8), decode=False).prefill
    assert choice.worker == "b"
    assert choice.cached_blocks == choice.best_cached_blocks == 8
    acc = r.accounting
    assert (acc.optimal, acc.suboptimal, acc.unknown) == (1, 0, 0)
    assert (acc.available_blocks, acc.chosen_blocks, acc.left_blocks) == (8, 8, 0)
    assert sample(r, "kvmesh_router_prefill_choices_total", outcome="optimal") == 1
    assert sample(r, "kvmesh_router_cache_blocks_total", kind="available") == 8
    assert sample(r, "kvmesh_router_cache_blocks_total", kind="left") == 0


def test_load_outweighing_the_hit_leaves_blocks_on_the_table() -> None:
    r = make_router({"cost": "blocks", "balance": 0.5})
    r.load.report("b", WorkerLoad(4, 40_000, 0), at=NOW)
    choice = r.decide(req(), ok(a=2, b=8), decode=False).prefill
    assert choice.worker != "b"
    assert choice.best_cached_blocks == 8
    acc = r.accounting
    assert (acc.optimal, acc.suboptimal) == (0, 1)
    assert acc.left_blocks == 8 - choice.cached_blocks
    assert sample(r, "kvmesh_router_prefill_choices_total", outcome="suboptimal") == 1
    assert sample(r, "kvmesh_router_cache_blocks_total", kind="chosen") == choice.cached_blocks
    assert sample(r, "kvmesh_router_cache_blocks_total", kind="left") == acc.left_blocks


def test_the_best_is_among_the_admitted_only() -> None:
    """b holds more but is full: the best a could do was a's own hit."""
    r = make_router({"limits": {"max_running_requests": 1}})
    r.load.report("b", WorkerLoad(1, 100, 0), at=NOW)
    choice = r.decide(req(), ok(a=3, b=9), decode=False).prefill
    assert choice.worker == "a" and choice.best_cached_blocks == 3
    assert r.accounting.optimal == 1


def test_pass2_accounts_over_the_pool() -> None:
    r = make_router({"limits": {"max_running_requests": 1}})
    for w in ("a", "b", "c"):
        r.load.report(w, WorkerLoad(1, 100, 0), at=NOW)
    choice = r.decide(req(), ok(a=3, b=9), decode=False).prefill
    assert choice.pass_no == 2
    assert choice.best_cached_blocks == 9
    assert choice.cached_blocks == {"a": 3, "b": 9, "c": 0}[choice.worker]


def test_no_indexer_answer_is_unknown_not_optimal() -> None:
    r = make_router()
    r.decide(req(), MatchOutcome(MatchStatus.DEADLINE_EXCEEDED), decode=False)
    acc = r.accounting
    assert (acc.optimal, acc.suboptimal, acc.unknown) == (0, 0, 1)
    assert acc.available_blocks == 0
    assert sample(r, "kvmesh_router_prefill_choices_total", outcome="unknown") == 1
    assert sample(r, "kvmesh_router_prefill_choices_total", outcome="optimal") == 0


async def test_route_without_an_indexer_is_unknown() -> None:
    r = make_router()
    await r.route(req())
    assert r.accounting.unknown == 1


def test_decode_choices_are_not_accounted() -> None:
    r = make_router()
    r.decide(req(), ok(a=4))
    acc = r.accounting
    assert acc.optimal + acc.suboptimal + acc.unknown == 1


# -- against a naive recomputation -----------------------------------------------------


def naive_cached(m: WorkerMatch | None, reusable: int) -> float:
    if m is None:
        return 0.0
    weighted = m.gpu_blocks * 1.0 + m.cpu_blocks * 0.75 + m.disk_blocks * 0.5
    if m.depth > reusable:
        weighted = weighted * reusable / m.depth
    return weighted


@dataclass
class Step:
    input_tokens: int
    answered: bool
    matches: dict[str, WorkerMatch]


NAMES = ["w0", "w1", "w2", "w3"]


@st.composite
def steps(draw: st.DrawFn) -> Step:
    input_tokens = draw(st.integers(BS, 30 * BS))
    n = input_tokens // BS
    matches: dict[str, WorkerMatch] = {}
    for w in NAMES:
        if draw(st.booleans()):
            gpu, cpu, disk = (draw(st.integers(0, n)) for _ in range(3))
            predicted = draw(st.integers(0, n + 2))
            if gpu + cpu + disk or predicted:
                depth = gpu + cpu + disk
                matches[w] = WorkerMatch(depth, gpu, cpu, disk, 0, max(depth, predicted))
    return Step(input_tokens, draw(st.booleans()), matches)


@settings(max_examples=200, deadline=None, database=None)
@given(
    st.lists(steps(), min_size=1, max_size=8),
    st.dictionaries(
        st.sampled_from(NAMES),
        st.builds(
            WorkerLoad,
            st.integers(0, 3),
            st.integers(0, 20_000),
            st.integers(0, 20_000),
            st.sampled_from([0.0, 2_000.0, 20_000.0]),
        ),
    ),
    st.sampled_from([None, 1, 2, 3]),
    st.sampled_from([None, 2_000, 20_000]),
    st.sampled_from(["blocks", "ttft"]),
    st.booleans(),
    st.integers(0, 2**16),
)
def test_accounting_equals_a_naive_recomputation(
    plan: list[Step],
    reports: dict[str, WorkerLoad],
    max_running: int | None,
    max_pending: int | None,
    cost: str,
    predictions: bool,
    seed: int,
) -> None:
    limits = {"max_running_requests": max_running, "max_pending_prefill_tokens": max_pending}
    config = {"cost": cost, "predictions": predictions, "balance": 0.3, "limits": limits}
    r = make_router(config, workers=NAMES, seed=seed)
    for w, load in reports.items():
        r.load.report(w, load, at=NOW - 1)
    want = {"optimal": 0, "suboptimal": 0, "unknown": 0}
    available = chosen = left = 0.0
    for i, step in enumerate(plan):
        n = step.input_tokens // BS
        reusable = costmod.reusable_blocks(step.input_tokens, n, BS)
        cached = {w: naive_cached(step.matches.get(w), reusable) for w in NAMES}
        admitted = [
            w for w in NAMES if r.load.admits(w, r.config.limits, int(max(0.0, n - cached[w]) * BS))
        ]
        outcome = MatchOutcome(
            MatchStatus.OK if step.answered else MatchStatus.UNAVAILABLE,
            step.matches if step.answered else {},
        )
        request = RouteRequest(i, step.input_tokens, block_keys=list(range(n)))
        choice = r.decide(request, outcome, decode=False).prefill
        r.started(request, choice)
        if not step.answered:
            want["unknown"] += 1
            continue
        best = max(cached[w] for w in (admitted or NAMES))
        mine = cached[choice.worker]
        assert choice.best_cached_blocks == pytest.approx(best)
        assert choice.cached_blocks == pytest.approx(mine)
        want["optimal" if mine >= best else "suboptimal"] += 1
        available += best
        chosen += mine
        left += best - mine
    acc = r.accounting
    assert {"optimal": acc.optimal, "suboptimal": acc.suboptimal, "unknown": acc.unknown} == want
    assert acc.available_blocks == pytest.approx(available)
    assert acc.chosen_blocks == pytest.approx(chosen)
    assert acc.left_blocks == pytest.approx(left)
    for outcome_label, count in want.items():
        got = sample(r, "kvmesh_router_prefill_choices_total", outcome=outcome_label)
        assert got == count
    for kind, total in (("available", available), ("chosen", chosen), ("left", left)):
        got = sample(r, "kvmesh_router_cache_blocks_total", kind=kind)
        assert got == pytest.approx(total)
