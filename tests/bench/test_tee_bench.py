"""Smoke run of ``kvmesh bench tee`` (opt-in: ``pytest -m bench``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench.tee import main

FIGURES = {
    "tee_rps_n1",
    "tee_rps_n8",
    "tee_rps_n32",
    "tee_ideal_rps_n8",
    "tee_drops_below_capacity_n8",
    "tee_offer_p99_us",
}


@pytest.mark.bench
def test_bench_tee_writes_exact_figures(tmp_path: Path) -> None:
    out = tmp_path / "tee.json"
    args = ["--duration", "0.5", "--warmup", "0.2", "--latency-samples", "10"]
    assert main([*args, "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert set(data["figures"]) == FIGURES
    assert data["figures"]["tee_rps_n8"] > data["figures"]["tee_rps_n1"] > 0
    assert data["params"]["latency_ms"] == 9.0
