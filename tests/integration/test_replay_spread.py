"""router_client's spread (``spread_half_life_s``) in the replay: new conversations go
to the engine a router sent the fewest requests recently, so request counts come out
even where the tie-break by load left them as uneven as P2C's."""

from __future__ import annotations

from lab.sim.grid import grid_trace
from lab.sim.replay import PolicyResult, ReplaySettings, run_replay


async def _run(spread_half_life_s: float) -> dict[str, PolicyResult]:
    settings = ReplaySettings(load=0.7, spread_half_life_s=spread_half_life_s)
    result = await run_replay(grid_trace("chat", 1000), settings, ["p2c", "cache_shared"])
    return {r.policy: r for r in result.results}


async def test_the_spread_evens_request_counts_without_costing_ttft() -> None:
    spread = await _run(300.0)
    off = await _run(0.0)
    p2c = spread["p2c"].worker_cv
    assert off["p2c"].worker_cv == p2c  # the baseline does not use router_client's cost
    # 2026-12-06: 0.035 with the spread, 0.104 without, P2C 0.101.
    assert spread["cache_shared"].worker_cv < 0.5 * p2c
    assert off["cache_shared"].worker_cv > 0.8 * p2c
    assert spread["cache_shared"].ttft_p95_ms < 1.1 * off["cache_shared"].ttft_p95_ms
