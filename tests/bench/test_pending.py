"""``kvmesh bench pending``, at CI sizes: every mode's answer is checked inside the
bench (the holder's depth, every predicting instance's pending count)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench.pending import MODES, main


def test_bench_pending_small(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "pending.json"
    args = ["--backend", "memory,redis", "--instances", "8", "--calls", "5", "--rounds", "1"]
    assert main([*args, "--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    for b in ("memory", "redis"):
        for mode in MODES:
            assert figures[f"{b}_{mode}_p99_us"] >= figures[f"{b}_{mode}_p50_us"] > 0
        assert figures[f"ratio_{b}_pending"] > 0
    assert "each/" in capsys.readouterr().out


def test_bench_pending_refuses_an_unknown_backend() -> None:
    with pytest.raises(SystemExit):
        main(["--backend", "mongodb"])
