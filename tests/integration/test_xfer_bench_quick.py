"""The transfer benchmark end to end on tiny parameters (TCP, so it runs anywhere)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench import xfer as bench

FIGURES = {
    "serial_mean_ms", "async_mean_ms", "async_p99_ms", "speedup", "async_gbps",
    "memcpy_gbps", "add_request_p99_us",
}  # fmt: skip


def test_bench_prints_table_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "b.json"
    argv = ["--transport", "tcp", "--rooms", "3", "--pages", "8", "--chunks", "2",
            "--page-size", "4096", "--iters", "1", "--json", str(out)]  # fmt: skip
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "speedup" in table and "tcp_raw_gbps" in table
    data = json.loads(out.read_text())
    assert set(data["figures"]) >= FIGURES
    assert "tcp_raw_gbps" in data["figures"]
    assert data["params"]["rooms"] == 3
    assert all(v > 0 for v in data["figures"].values())


def test_fragmented_allocations_cover_pages_once() -> None:
    import random

    chunks = bench.fragmented(8, 64, 4, random.Random(1))
    flat = [p for c in chunks for p in c]
    assert len(flat) == len(set(flat)) == 64 and all(len(c) == 8 for c in chunks)
