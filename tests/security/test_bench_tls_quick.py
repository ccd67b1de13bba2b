"""``kvmesh bench indexer --tls --quick`` runs end to end and reports every mode.

Real indexer servers in child processes (plaintext, then mutual TLS with a
policy, then mutual TLS with per-client rates); figures are checked for
presence and sanity, never for speed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from indexer import bench
from indexer.bench_tls import MODES, ROWS

#: Figures every mode must have.
SUFFIXES = [suffix for _, suffix, _ in ROWS]


@pytest.mark.timeout(120)
def test_quick_tls_bench_reports_every_mode(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tls.json"
    assert bench.main(["--tls", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    figures, ratios = doc["figures"], doc["ratios"]
    assert set(ratios) == {m.key for m in MODES}
    for mode in MODES:
        for suffix in SUFFIXES:
            name = f"{mode.key}_{suffix}"
            assert name in figures, name
            assert math.isfinite(figures[name]) and figures[name] > 0, (name, figures[name])
            ratio = ratios[mode.key][suffix]
            assert math.isfinite(ratio) and ratio > 0, (mode.key, suffix, ratio)
        # The publish and the reads went through: every instance holds block 0.
        assert doc["params"][f"{mode.key}_instances_per_32_block_match"] == 64
    assert all(r == 1.0 for r in ratios["plaintext"].values())
    assert doc["params"]["modes"] == {m.key: m.label for m in MODES}
    assert len(doc["rounds"]) == doc["params"]["rounds"] == 1

    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("figure"))
    for mode in MODES:
        assert mode.label in header
    for label, _, _ in ROWS:
        assert label in printed
