"""The prefetch part of ``kvmesh bench xfer`` end to end on tiny parameters (NIXL)."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from lab.bench import xfer as bench
from xfer.transport import nixl_available

FIGURES = {
    "prefetch_ondemand_ms_mean", "prefetch_ondemand_ms_p50", "prefetch_ondemand_ms_p99",
    "prefetch_prefetched_ms_mean", "prefetch_prefetched_ms_p50", "prefetch_prefetched_ms_p99",
    "prefetch_speedup", "prefetch_speedup_p50", "prefetch_ready_share", "prefetch_lead_ms",
    "prefetch_prefix_mib",
}  # fmt: skip


def test_prefetch_part_prints_the_ratio_and_writes_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert nixl_available(), "nixl-cu12 is not importable: run `make setup`"
    out = tmp_path / "p.json"
    argv = ["--prefetch", "--rooms", "2", "--pages", "8", "--page-size", "4096",
            "--prefetch-requests", "3", "--prefetch-lead-ms", "20", "--json", str(out)]  # fmt: skip
    # Every request's pages are compared with the source's (the bench raises otherwise).
    assert bench.main(argv) == 0
    table = capsys.readouterr().out
    assert "ondemand" in table and "prefetched" in table and "ratio" in table
    figures = json.loads(out.read_text())["figures"]
    assert set(figures) == FIGURES
    assert figures["prefetch_lead_ms"] == 20
    assert 0 <= figures["prefetch_ready_share"] <= 1
    for mode in ("ondemand", "prefetched"):
        assert 0 < figures[f"prefetch_{mode}_ms_p50"] <= figures[f"prefetch_{mode}_ms_p99"]
    ratio = figures["prefetch_ondemand_ms_mean"] / figures["prefetch_prefetched_ms_mean"]
    assert figures["prefetch_speedup"] == pytest.approx(ratio)


def test_the_page_check_catches_a_wrong_page(tmp_path: Path) -> None:
    p = bench.BenchParams(rooms=2, pages=4, page_size=4096)
    pools = bench._Pools(p, str(tmp_path))
    try:
        r = bench._plan(p, pools.geometry, random.Random(1), 0)[0]
        assert not bench._same_pages(pools, r.src, r.dst)
        for s, d in zip(r.src, r.dst, strict=True):
            pools.decode.page(d)[:] = pools.prefill.page(s)
        assert bench._same_pages(pools, r.src, r.dst)
        pools.decode.page(r.dst[2])[0] ^= 0xFF
        assert not bench._same_pages(pools, r.src, r.dst)
    finally:
        pools.close()


def test_prefetch_arguments_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main(["--transport", "tcp", "--prefetch"]) == 2
    assert bench.main(["--transport", "tcp", "--prefetch-requests", "0"]) == 2
    assert "--prefetch needs NIXL" in capsys.readouterr().err
