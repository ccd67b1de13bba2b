"""``kvmesh bench soak`` end to end, short: two replica processes on a real
redis-server that is SIGKILLed and restarted once under load.

Checks that the soak runs, writes every figure, and that the only errors
clients saw were UNAVAILABLE while Redis was really down. Speed is not checked.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab.bench import soak

FIGURES = (
    "soak_events_per_s",
    "soak_matches_per_s",
    "soak_match_p50_us",
    "soak_match_p99_us",
    "soak_replica_rss_growth_mb_per_min",
    "soak_redis_memory_growth_mb_per_min",
    "soak_errors_unexpected",
    "soak_unavailable_in_outage",
    "soak_unavailable_outside_outage",
    "soak_redis_kills",
)


@pytest.mark.timeout(60)
def test_quick_soak_with_a_redis_kill(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "soak.json"
    argv = ["--duration", "8", "--interval", "1", "--kill-redis-every", "4", "--outage", "1"]
    argv += ["--grace", "1", "--quiet", "--json", str(out)]
    rc = soak.main(argv)
    text = capsys.readouterr().out
    data = json.loads(out.read_text())
    f, params = data["figures"], data["params"]
    assert rc == 0, (text, params["errors_by_call"])
    for name in FIGURES:
        assert name in f and math.isfinite(f[name]), name
    assert f["soak_redis_kills"] == 1
    assert f["soak_errors_unexpected"] == 0, params["errors_by_call"]
    assert f["soak_unavailable_outside_outage"] == 0
    # Both kinds of traffic flowed, and the system served again after the restart.
    assert f["soak_events_per_s"] > 0 and f["soak_matches_per_s"] > 0
    last = params["intervals"][-1]
    assert last["matches_per_s"] > 0 and last["events_per_s"] > 0
    assert params["outages"][0]["end"] is not None
    assert "errors, unexpected" in text
