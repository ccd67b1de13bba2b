"""The replay under load: the speed that reaches a utilisation, queueing growing with it,
the cache-aware policy's TTFT against P2C's on a cache-friendly family, the event lag."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvmesh.cli import main as kvmesh_main
from lab.sim.engine import ServiceModel
from lab.sim.replay import (
    PolicyResult,
    ReplayResult,
    ReplaySettings,
    offered_utilisation,
    run_replay,
)
from lab.synth import family, synthesize, write_trace
from lab.traces import TraceRequest, load_mooncake

#: 8 engines of 1,000 blocks: the chat family's pooled bound is ~43%, P2C finds ~24%.
# Without predictions: the index's own view (events), which a lag hides.
SETTINGS = ReplaySettings(
    routers=2, workers=8, capacity=1000, seed=1, cost_model="blocks", predict=False
)


@pytest.fixture(scope="module")
def chat() -> list[TraceRequest]:
    """A cache-friendly family: multi-turn chat behind shared system prompts."""
    return synthesize(family("chat", requests=2500), seed=4).requests


def _by(result: ReplayResult) -> dict[str, PolicyResult]:
    return {r.policy: r for r in result.results}


async def test_queueing_grows_with_load_and_cache_shared_keeps_ttft_down(
    chat: list[TraceRequest],
) -> None:
    runs = {
        load: await run_replay(chat, replace(SETTINGS, load=load), ["p2c", "cache_shared"])
        for load in (0.5, 0.9)
    }
    low, high = (_by(runs[x]) for x in (0.5, 0.9))
    # the same work at 1.8 times the rate: P2C is the basis, so it runs at the load
    assert runs[0.9].settings.speed == pytest.approx(1.8 * runs[0.5].settings.speed)
    for load, by in ((0.5, low), (0.9, high)):
        p2c, shared = by["p2c"], by["cache_shared"]
        assert p2c.utilisation == pytest.approx(load, abs=0.05)
        assert shared.hit_rate > 1.5 * p2c.hit_rate
        assert shared.utilisation < p2c.utilisation
        assert shared.ttft_p95_ms <= p2c.ttft_p95_ms
        assert shared.goodput >= p2c.goodput
        assert runs[load].offered.fleet == pytest.approx(load)
    for policy in ("p2c", "cache_shared"):
        q_low = low[policy].queue_mean_ms
        q_high = high[policy].queue_mean_ms
        assert q_high > 1.5 * q_low > 0
        assert high[policy].ttft_p99_ms >= high[policy].ttft_p95_ms
    assert high["p2c"].goodput < low["p2c"].goodput
    # where it matters most: near capacity, a clear TTFT margin (about 0.6x measured;
    # routing on load alone with the index blind gets about 0.9x)
    assert high["cache_shared"].ttft_p95_ms < 0.8 * high["p2c"].ttft_p95_ms


async def test_event_lag_hides_blocks_from_cache_shared(chat: list[TraceRequest]) -> None:
    trace = chat[:1200]
    prompt = await run_replay(trace, SETTINGS, ["cache_shared"])
    # a lag longer than the trace: the index never learns anything
    never = await run_replay(trace, replace(SETTINGS, event_lag_s=1e6), ["cache_shared"])
    a, b = prompt.results[0], never.results[0]
    assert b.hit_rate < 0.8 * a.hit_rate
    assert b.reasons.get("cache_candidate", 0) == 0 < a.reasons["cache_candidate"]


def test_offered_utilisation_scales_with_speed_and_counts_hits() -> None:
    trace = [
        TraceRequest(0.0, 2048, 100, (0, 1, 2, 3)),
        TraceRequest(10_000.0, 2048, 100, (0, 1, 2, 3)),
    ]
    model = ServiceModel(prefill_tokens_per_s=1024.0, decode_s_per_token=0.01, max_running=4)
    cold = offered_utilisation(trace, [0, 0], workers=2, service=model)
    # 2 prefills of 2 s over 2 workers x 10 s; slots: 2 x (2 + 1) s over 2 x 4 x 10 s
    assert cold.prefill == pytest.approx(0.2) and cold.slots == pytest.approx(0.075)
    warm = offered_utilisation(trace, [0, 4], workers=2, service=model)
    assert warm.prefill == pytest.approx(0.1)
    assert cold.scaled(3.0).fleet == pytest.approx(0.6)


def test_cli_load_figures_and_plot(
    chat: list[TraceRequest], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, js, png = tmp_path / "chat.jsonl", tmp_path / "r.json", tmp_path / "r.png"
    write_trace(chat[:600], path)
    rc = kvmesh_main(
        [
            "replay",
            str(path),
            "--policies",
            "p2c,cache_shared",
            "--workers",
            "4",
            "--load",
            "0.7",
            "--event-lag-ms",
            "50",
            "--ttft-slo-s",
            "1.5",
            "--max-running",
            "16",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("chat.jsonl: 600 requests")
    assert "for load 0.7" in out and "prefill end + 50 ms" in out and "TTFT SLO 1.5 s" in out
    report = json.loads(js.read_text())
    figs, params = report["figures"], report["params"]
    for p in ("p2c", "cache_shared"):
        for suffix in ("ttft_p99_ms", "queue_mean_ms", "goodput", "load_cv", "worker_cv"):
            assert f"{p}_{suffix}" in figs
    assert figs["offered_utilisation"] == pytest.approx(0.7)
    assert params["load"] == 0.7 and params["trace"] == "chat.jsonl"
    assert params["service"]["max_running"] == 16
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_refuses_load_with_speed(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvmesh_main(["replay", "--load", "0.5", "--speed", "2"]) == 2
    assert kvmesh_main(["replay", "--load", "0"]) == 2
    assert kvmesh_main(["replay", "--max-running", "0"]) == 2
    assert "--load" in capsys.readouterr().err


async def test_bundled_trace_loads_too() -> None:
    """The bundled trace's arrival span gives a finite speed for a load."""
    trace = load_mooncake(limit=1500)
    result = await run_replay(trace, replace(SETTINGS, load=0.7), ["p2c"])
    assert result.results[0].utilisation == pytest.approx(0.7, abs=0.05)
