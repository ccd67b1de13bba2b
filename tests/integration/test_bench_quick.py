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
    printed = capsys.readouterr().out
    assert "Redis round trips / Match" in printed and "memory" in printed


def test_quickstart_prints_its_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert quickstart.main(["--instances", "3", "--requests", "400", "--prompts", "2"]) == 0
    printed = capsys.readouterr().out
    for worker in ("engine-000", "engine-001", "engine-002"):
        assert worker in printed
    assert "distinct blocks indexed" in printed
    assert "prompt 2: 32 blocks -> 3 instances" in printed
