"""``kvmesh bench abuse --quick`` on the cache simulator's HTTP ingest: nested JSON, an
announced 200 MiB body and bodies that never complete all refused with the victim spared,
and a simulator that waits longer for a body than the bench allows reported as not refused.

Real processes: the bench starts ``kvmesh cachesim serve`` with mutual TLS and the
policy ``kvmesh certs`` writes, and attacks its HTTP port over real sockets.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from lab.bench import abuse


def _run(tmp_path: Path, *argv: str) -> tuple[int, dict[str, float], dict[str, Any]]:
    out = tmp_path / "abuse.json"
    code = abuse.main(["--quick", "--json", str(out), *argv])
    doc = json.loads(out.read_text())
    return code, doc["figures"], doc["attacks"]


def test_quick_run_refuses_the_http_attacks_and_spares_the_victim(tmp_path: Path) -> None:
    code, figures, details = _run(tmp_path, "--attacks", ",".join(abuse.HTTP_ATTACKS))
    for attack in abuse.HTTP_ATTACKS:
        assert attack in abuse.ATTACKS
        for suffix in (*abuse.FIGURE_SUFFIXES, "rss_before_mb", "rss_after_mb"):
            assert f"abuse_{attack}_{suffix}" in figures, (attack, suffix)
        assert figures[f"abuse_{attack}_refused"] == 1.0, (attack, details[attack])
        assert figures[f"abuse_{attack}_victim_ok_fraction"] >= abuse.MIN_VICTIM_OK, attack
        assert figures[f"abuse_{attack}_victim_calls"] > 0, attack
        assert not math.isnan(figures[f"abuse_{attack}_rss_after_mb"]), attack
    sizes = abuse.QUICK
    assert details["http_nested_json"]["statuses"] == {"400": sizes.nested_requests}
    assert details["http_oversize_body"]["statuses"] == {"413": sizes.oversize_requests}
    slow = details["http_slow_body"]
    assert slow["statuses"] == {"408": sizes.slow_connections}
    # Answered at the body timeout, not before: the simulator did wait for the body.
    assert slow["answered_s_max"] >= sizes.http_body_timeout_s
    assert code == 0


def test_a_long_body_timeout_lets_slow_bodies_hold_their_connections(tmp_path: Path) -> None:
    weak = {"http_body_timeout_s": 600}
    code, figures, details = _run(
        tmp_path, "--attacks", "http_slow_body", "--cachesim-config", json.dumps(weak)
    )
    assert figures["abuse_http_slow_body_refused"] == 0.0
    slow = details["http_slow_body"]
    assert slow["closed_fraction"] == 0.0
    assert slow["server_fds_after"] >= abuse.QUICK.slow_connections
    assert code == 1
