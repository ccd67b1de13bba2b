"""``kvmesh replay --follower --outage``: a real ``kvmesh indexer serve`` killed and restarted.

600 requests of the bundled trace, the indexer down from 60 s to 90 s of
replay time (virtual: the outage costs the restart's wall time, about a
second). Figures measured on this slice (docs/benchmarks.md): cache_shared
14.9% remote, 14.6% follower (since the replay's calls to the indexer have a
1 s deadline instead of the router's 5 ms, both 8.8%, whatever the host's load);
in the outage window 8.8% without the outage,
3.5% through it in both modes (a follower that holds nothing, hold_s 0, is
out of sync, the remote Match fails, routing is load-only), 8.5% with the
follower's held copy (IndexFollower.hold_s at its default); 30 s after the
restart 21.8% (re-fed) against 3.6% with engines that do not re-send.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from lab.sim.outage import IndexerProcess, Outage
from lab.sim.replay import ReplaySettings, SharedRun, main, run_policy, trace_keys
from lab.traces import MOONCAKE_BLOCK_SIZE, load_mooncake

RUNS = (
    "cache_shared",
    "cache_shared_follower",
    "cache_shared_outage",
    "cache_shared_follower_outage",
    "cache_shared_follower_hold_outage",
)


def test_follower_through_an_outage(tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    # Without route-time predictions, as the figures above were measured: the
    # subject is the follower and the re-feed. (With them, on by default since,
    # one run's window after the restart had 0.747 of its hits without the
    # outage, against the 0.75 asked here; predictions recorded before the
    # restart went with the indexer's memory.)
    argv = [
        "--limit", "600", "--policies", "cache_shared", "--follower", "--follower-hold",
        "--no-predict",
    ]  # fmt: skip
    assert main([*argv, "--outage", "60:30", "--json", str(out)]) == 0
    f = json.loads(out.read_text())["figures"]
    for run in RUNS:
        assert 0 < f[f"{run}_hit_rate"] <= 1, run
        assert 0 <= f[f"{run}_outage_window_hit_rate"] <= 1, run
    # Without the outage the follower answers every Match, as well as the indexer
    # (with a 5 ms deadline on a busy host the remote run hit 4.9 % to 11.0 %
    # against the follower's 8.8 %: lab/sim/replay.py, REMOTE_DEADLINE_MS).
    assert f["cache_shared_follower_follower_share"] == 1.0
    assert f["follower_vs_remote_hit_ratio"] >= 0.95
    # Through the outage both modes route on load: the window loses its hits.
    baseline = f["cache_shared_follower_outage_window_hit_rate"]
    for run in ("cache_shared_outage", "cache_shared_follower_outage"):
        assert f[f"{run}_outage_window_hit_rate"] < 0.75 * baseline, run
        assert f[f"{run}_lost_batches"] > 0 and f[f"{run}_refed_blocks"] > 0, run
    assert f["cache_shared_follower_outage_follower_share"] < 0.95
    assert f["cache_shared_follower_outage_resync_s"] > 0
    # A copy held through the outage keeps most of them.
    held = f["cache_shared_follower_hold_outage_outage_window_hit_rate"]
    assert held > 1.5 * f["cache_shared_outage_outage_window_hit_rate"]
    assert f["cache_shared_follower_hold_outage_held_matches"] > 0
    # Re-fed after the restart, the next window finds the caches again.
    after = f["cache_shared_follower_after_window_hit_rate"]
    assert f["cache_shared_follower_outage_after_window_hit_rate"] > 0.75 * after


async def test_restart_without_refeed_loses_the_caches() -> None:
    """The check above on re-feeding, against engines that do not re-send (it fails there)."""
    trace = load_mooncake(limit=600)
    keys = trace_keys(trace)
    outage = Outage(60, 30)
    with tempfile.TemporaryDirectory() as d:
        proc = IndexerProcess(Path(d), MOONCAKE_BLOCK_SIZE)
        await proc.start()
        try:
            settings = ReplaySettings(indexer=proc.target, outage=outage, predict=False)
            after = {}
            for refeed in (True, False):
                run = SharedRun("x", True, outage, process=proc, refeed=refeed)
                r = await run_policy("cache_shared", trace, keys, settings, 1.0, run=run)
                assert r.outage_hit_rate is not None and r.after_hit_rate is not None
                after[refeed] = r.after_hit_rate
        finally:
            proc.close()
    assert after[False] < 0.75 * after[True], after
