"""The load the replay's routers see: reports every ``--load-report-ms``, staleness bounded
and measured, and the local view; ``--herding`` compares them."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.cli import main as kvmesh_main
from lab.sim.replay import PolicyResult, ReplaySettings, run_replay
from lab.traces import load_mooncake

# Reports at every change unless a test sets a period; no predictions (their
# shared pending prefill is a view of its own, tested apart below).
SETTINGS = ReplaySettings(
    routers=8, workers=8, capacity=300, seed=1, load=0.9, load_report_s=0.0, predict=False
)


async def _run(**changes: object) -> dict[str, PolicyResult]:
    trace = load_mooncake(limit=1000)
    result = await run_replay(trace, replace(SETTINGS, **changes), ["p2c", "cache_shared"])
    return {r.policy: r for r in result.results}


async def test_a_report_period_makes_the_view_stale_by_at_most_the_period() -> None:
    fresh = await _run()
    period = await _run(load_report_s=0.2)
    never = await _run(load_report_s=1e6)  # one report each, before the first arrival
    local = await _run(load_view="local")
    for p in ("p2c", "cache_shared"):
        assert fresh[p].report_age_p95_ms == 0.0 and fresh[p].view_gap == 0.0
        # staleness bounded by the period, measured where the decision was made
        age_mean, age_p95 = period[p].report_age_mean_ms, period[p].report_age_p95_ms
        assert age_mean is not None and age_p95 is not None
        assert 60 < age_mean < 140 and age_mean < age_p95 <= 200
        assert 0 < period[p].view_gap < never[p].view_gap
        # no report: a router sees only its own requests, as in the local view
        assert local[p].report_age_mean_ms is None
        assert never[p].view_gap == pytest.approx(local[p].view_gap, rel=0.1)
    # routers that do not see each other's work herd: P2C's tail grows
    assert never["p2c"].ttft_p95_ms > 1.3 * fresh["p2c"].ttft_p95_ms
    assert local["p2c"].ttft_p95_ms > 1.3 * fresh["p2c"].ttft_p95_ms


def test_cli_herding_table_and_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "h.json"
    argv = ["replay", "--limit", "400", "--workers", "6", "--capacity", "200", "--load", "0.9"]
    rc = kvmesh_main([*argv, "--herding", "2,6", "--load-report-ms", "100", "--json", str(js)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "herding of cache_shared" in out and "reports every 100 ms" in out
    figures = json.loads(js.read_text())["figures"]
    for n in (2, 6):
        for view in ("local", "shared"):
            for name in ("worker_cv", "load_cv", "ttft_p95_ms", "hit_rate", "load_view_gap"):
                assert f"herding_R{n}_{view}_{name}" in figures
        assert figures[f"herding_R{n}_shared_load_report_age_p95_ms"] <= 100
        assert f"herding_R{n}_local_load_report_age_p95_ms" not in figures
    assert kvmesh_main([*argv, "--herding", "x"]) == 2
    assert kvmesh_main([*argv, "--load-report-ms", "-1"]) == 2


async def test_pending_prefill_shared_through_the_index_stops_the_herd() -> None:
    """Routers that see only their own work herd (local view); with predictions,
    each Match also tells every router the prefill the others sent each engine
    (MatchResponse.pending), and the tail comes back to that of routers fed
    every engine's load at every change. With that figure left out (own load
    only) the predictions alone do not."""
    trace = load_mooncake(limit=1000)
    at = replace(SETTINGS, speed=1.0, load=None)
    fresh = await run_replay(trace, replace(at, predict=True), ["cache_shared"])
    settings = replace(at, load_view="local", predict=True)
    shared = await run_replay(trace, settings, ["cache_shared"])
    own = await run_replay(trace, replace(settings, shared_pending=False), ["cache_shared"])
    f, s, o = (r.results[0] for r in (fresh, shared, own))
    assert o.ttft_p95_ms > 1.5 * s.ttft_p95_ms
    assert s.ttft_p95_ms < 1.25 * f.ttft_p95_ms
    assert s.goodput > o.goodput
