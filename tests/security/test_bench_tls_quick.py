"""``kvmesh bench indexer --tls --quick`` runs end to end and reports every mode.

Real indexer servers in child processes (plaintext, then mutual TLS with a
policy, then mutual TLS with per-client rates); figures are checked for
presence and sanity, never for speed. The same for ``--flood``: a calm client
alone, then beside a flooding client in a process of its own, limits off and on.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab.bench import indexer as bench
from lab.bench.tls import ALONE, FLOOD_POSITIVE, MODES, QUICK_FLOOD_PARAMS, ROWS, SCENARIOS

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


@pytest.mark.timeout(120)
def test_quick_flood_bench_reports_every_scenario(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "flood.json"
    assert bench.main(["--tls", "--flood", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    flood = doc["flood"]
    assert set(flood) == {sc.key for sc in SCENARIOS}
    assert doc["params"]["scenarios"] == {sc.key: sc.label for sc in SCENARIOS}
    for sc in SCENARIOS:
        f = flood[sc.key]
        # Every calm call was answered: router-b (one call in flight, 200/s) is
        # under the limited scenario's cap and rate by construction.
        assert f["calm_calls"] == QUICK_FLOOD_PARAMS.calm_calls
        assert f["calm_errors"] == {}, (sc.key, f["calm_errors"])
        present = [n for n in FLOOD_POSITIVE if n.startswith("calm_") or n == "server_cores"]
        if sc.flood:
            present += ["flood_accepted_per_s", "flood_client_cores"]
            share = f["flood_refused_share"]
            assert math.isfinite(share) and 0.0 <= share <= 1.0, (sc.key, share)
            # Beyond a connection's stream cap the server refuses new streams
            # (REFUSED_STREAM): the client sees UNAVAILABLE, and nothing else.
            allowed = {"UNAVAILABLE"} if sc.streams else set()
            assert set(f["flood_other_errors"]) <= allowed, (sc.key, f["flood_other_errors"])
            if not sc.limits:
                # Limits off: nothing refuses router-a, however hard it floods.
                assert share == 0.0 and f["flood_refused_per_s"] == 0.0
        else:
            assert "flood_accepted_per_s" not in f and "flood_refused_share" not in f
        for name in present:
            assert name in f, (sc.key, name)
            assert math.isfinite(f[name]) and f[name] > 0, (sc.key, name, f[name])
    assert flood[ALONE.key]["calm_p99_over_alone"] == 1.0

    printed = capsys.readouterr().out
    header = next(line for line in printed.splitlines() if line.startswith("scenario"))
    for column in ("calm p50", "calm p99", "p99/alone", "flood ok/s", "refused"):
        assert column in header
    for sc in SCENARIOS:
        assert any(line.startswith(sc.label) for line in printed.splitlines()), sc.label
