"""``kvmesh bench indexer --quick`` and ``kvmesh quickstart`` run end to end.

Real servers in child processes, a real redis-server; figures are checked for
presence and sanity, never for speed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab import quickstart
from lab.bench import indexer as bench

#: Every figure a run over both backends must write.
FIGURES = (
    "memory_ingest_blocks_per_s",
    "redis_ingest_blocks_per_s",
    "memory_grpc_match_p50_us",
    "memory_grpc_match_p99_us",
    "redis_grpc_match_p50_us",
    "redis_grpc_match_p99_us",
    "memory_grpc_match_256_p50_us",
    "redis_grpc_match_256_p50_us",
    "memory_grpc_matches_per_s",
    "redis_grpc_matches_per_s",
    "memory_inproc_match_p50_us",
    "redis_roundtrips_per_match",
    "redis_bytes_per_block_instance",
    "grpc_empty_rpc_p50_us",
    # Match during ZMQ ingest: real engine publishers into the memory backend.
    "memory_zmq_ingest_blocks_per_s",
    "memory_ingest_during_probe_blocks_per_s",
    "memory_match_during_ingest_p50_ms",
    "memory_match_during_ingest_p99_ms",
    "memory_health_during_ingest_p99_ms",
)


@pytest.mark.timeout(60)
def test_quick_bench_writes_every_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "bench.json"
    assert bench.main(["--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    figures = doc["figures"]
    for name in FIGURES:
        assert name in figures, name
        assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures[name])
    # Counted from commandstats: one EVALSHA per Match, the script's own reads excluded.
    assert figures["redis_roundtrips_per_match"] == 1.0
    assert (
        doc["params"]["redis_commands_during_matches"]["evalsha"]
        == doc["params"]["roundtrip_calls"]
    )
    assert figures["redis_commands_per_match"] > 1.0  # the script's reads are counted too
    assert doc["params"]["instances"] == 64
    # Every block the engines published was ingested (the round waits for it), and
    # the probes ran during the ingest.
    assert doc["params"]["zmq_publishers"] == 8
    assert doc["params"]["zmq_blocks_per_round"] > 0
    assert doc["params"]["zmq_matches_probed"] >= 1
    p50, p99 = (figures[f"memory_match_during_ingest_{q}_ms"] for q in ("p50", "p99"))
    assert p50 <= p99
    printed = capsys.readouterr().out
    assert "Redis round trips / Match" in printed and "memory" in printed
    assert "Match p99 during ZMQ ingest" in printed


@pytest.mark.timeout(60)
def test_quick_matchstream_bench_writes_its_figures(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "matchstream.json"
    assert bench.main(["--matchstream", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    figures = doc["figures"]
    for mode in ("unary", "stream"):
        for name in ("matches_per_server_cpu_s", "server_cpu_us_per_match", "matches_per_s"):
            v = figures[f"{mode}_{name}"]
            assert math.isfinite(v) and v > 0, (mode, name, v)
        assert figures[f"{mode}_ok_fraction"] == 1.0  # every Match answered, none timed out
    # Stream messages carry one Match (reply) or more: at most the 16 in flight.
    for name in ("matches_per_request_message", "replies_per_response_message"):
        assert 1.0 <= figures[f"stream_{name}"] <= 16.0, (name, figures[f"stream_{name}"])
    ratio = figures["stream_over_unary_matches_per_server_cpu_s"]
    assert ratio == pytest.approx(
        figures["stream_matches_per_server_cpu_s"] / figures["unary_matches_per_server_cpu_s"]
    )
    assert doc["params"]["concurrency"] == 16 and doc["params"]["instances"] == 64
    printed = capsys.readouterr().out
    assert "Matches / server CPU-second" in printed and "stream / unary" in printed
    assert "Matches / request message" in printed


def test_quickstart_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert quickstart.main(["--instances", "3", "--requests", "400", "--prompts", "2"]) == 0
    printed = capsys.readouterr().out
    for worker in ("engine-000", "engine-001", "engine-002"):
        assert worker in printed
    assert "distinct blocks indexed" in printed
    assert "prompt 2: 32 blocks -> 3 instances" in printed
