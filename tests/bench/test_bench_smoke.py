"""Opt-in benchmark smoke runs (``pytest -m bench``): the real code paths, small sizes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench import indexer as bench

pytestmark = pytest.mark.bench


@pytest.mark.timeout(300)
def test_bench_indexer_small(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert bench.main(["--requests", "2000", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    assert figures["redis_roundtrips_per_match"] == 1.0
    assert figures["grpc_empty_rpc_p50_us"] > 0


@pytest.mark.timeout(300)
def test_floor_table(tmp_path: Path) -> None:
    out = tmp_path / "floor.json"
    args = ["--floor", "--calls", "200", "--rounds", "1", "--only", "lean", "--json", str(out)]
    assert bench.main(args) == 0
    rows = json.loads(out.read_text())["floor"]
    assert rows[0]["variant"].startswith("baseline")
    assert all(r["p50_us"] > 0 for r in rows)
