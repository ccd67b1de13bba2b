"""``kvmesh bench abuse --quick``: every attack refused on a default install, and a
deliberately weakened install reported as not refused (the bench can fail).

Real processes: the bench starts ``kvmesh indexer serve`` with mutual TLS and
the policy ``kvmesh certs`` writes, and attacks it over real sockets.
"""

from __future__ import annotations

import json
from pathlib import Path

from lab.bench import abuse


def _run(tmp_path: Path, *argv: str) -> tuple[int, dict[str, float]]:
    out = tmp_path / "abuse.json"
    code = abuse.main(["--quick", "--json", str(out), *argv])
    return code, json.loads(out.read_text())["figures"]


def test_quick_run_refuses_every_attack_and_spares_the_victims(tmp_path: Path) -> None:
    # The cache simulator's attacks: tests/security/test_bench_abuse_http.py.
    indexer_attacks = [a for a in abuse.ATTACKS if a not in abuse.HTTP_ATTACKS]
    code, figures = _run(tmp_path, "--attacks", ",".join(indexer_attacks))
    for attack in indexer_attacks:
        for suffix in abuse.FIGURE_SUFFIXES:
            assert f"abuse_{attack}_{suffix}" in figures, (attack, suffix)
        assert figures[f"abuse_{attack}_refused"] == 1.0, attack
        assert figures[f"abuse_{attack}_victim_ok_fraction"] >= abuse.MIN_VICTIM_OK, attack
    assert code == 0


def test_unlimited_quotas_let_the_register_flood_through(tmp_path: Path) -> None:
    weak = {"quotas": {"max_instances_per_identity": 0, "max_namespaces_per_identity": 0}}
    code, figures = _run(
        tmp_path, "--attacks", "register_flood", "--indexer-config", json.dumps(weak)
    )
    assert figures["abuse_register_flood_refused"] == 0.0
    assert code == 1


def test_without_a_handshake_timeout_stalled_connections_stay(tmp_path: Path) -> None:
    # gRPC's own handshake timeout (120 s) is what finding 6 met.
    weak = {"limits": {"handshake_timeout_s": 120}}
    code, figures = _run(tmp_path, "--attacks", "tls_stall", "--indexer-config", json.dumps(weak))
    assert figures["abuse_tls_stall_refused"] == 0.0
    assert code == 1


def test_without_block_quotas_the_flood_is_held_whole(tmp_path: Path) -> None:
    weak = {
        "quotas": {
            "max_blocks_per_instance": 0,
            "max_blocks_per_identity": 0,
            "publish_blocks_per_s": 0,
        }
    }
    code, figures = _run(tmp_path, "--attacks", "block_flood", "--indexer-config", json.dumps(weak))
    assert figures["abuse_block_flood_refused"] == 0.0
    assert code == 1
