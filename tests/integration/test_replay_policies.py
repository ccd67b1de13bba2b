"""The replay on the bundled trace: deterministic per seed, figures named as documented."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvmesh.cli import main as kvmesh_main
from lab.sim.replay import POLICIES, ReplaySettings, run_replay
from lab.traces import load_mooncake


async def test_cache_shared_beats_the_rest_and_is_deterministic() -> None:
    trace = load_mooncake(limit=2000)
    settings = ReplaySettings(routers=4, workers=8, capacity=300, seed=3)
    a = await run_replay(trace, settings)
    b = await run_replay(trace, settings, ["cache_shared"])
    by = {r.policy: r for r in a.results}
    assert [r.policy for r in a.results] == list(POLICIES)
    assert by["cache_shared"].hit_rate == b.results[0].hit_rate  # same seed, same run
    assert by["cache_shared"].hit_rate > by["cache_local"].hit_rate > by["p2c"].hit_rate
    assert by["cache_shared"].bound_fraction > 0.9
    # the shared-block-0 trap: no single worker takes the stream
    assert by["cache_shared"].worker_cv < 0.5
    assert a.infinite_bound >= a.pooled_bound > 0


def test_cli_table_json_and_plot(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = kvmesh_main(
        [
            "replay",
            "--limit",
            "300",
            "--workers",
            "4",
            "--capacity",
            "100",
            "--json",
            str(js),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "cache_shared" in out and "pooled LRU" in out
    figs = json.loads(js.read_text())["figures"]
    for p in POLICIES:
        for suffix in ("hit_rate", "bound_fraction", "worker_cv", "ttft_p95_ms"):
            assert f"{p}_{suffix}" in figs
    assert {"pooled_bound_hit_rate", "infinite_cache_bound"} <= figs.keys()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert kvmesh_main(["replay", "--policies", "nope"]) == 2
    assert kvmesh_main(["replay", "--balance", "2"]) == 2
    assert kvmesh_main(["replay", "--private-weight", "0.5"]) == 2
    assert "--private-weight must lie in [1, 100]" in capsys.readouterr().err
    assert kvmesh_main(["replay", "--prefill-weight", "101"]) == 2
    assert kvmesh_main(["replay", "/nonexistent/trace.jsonl"]) == 2
