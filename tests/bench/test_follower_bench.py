"""``kvmesh bench follower --quick``: a real indexer child process (memory; or two
over one redis-server, the follower on one's copy of the shared index), a follower in
this one, Dynamo's RadixTree in its own interpreter; every figure reported, the
follower's answers equal to the indexer's, and Match without the network hop
faster than the one over gRPC."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from lab.bench import follower


@pytest.mark.parametrize("backend", ["memory", "redis"])
def test_quick_run_reports_every_figure_and_no_wrong_answer(tmp_path: Path, backend: str) -> None:
    out = tmp_path / "follower.json"
    assert follower.main(["--quick", "--backend", backend, "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["params"]["backend"] == backend
    figures = report["figures"]
    for n in follower.PROMPT_BLOCKS:
        for name in ("follower_match", "dynamo_inproc_match"):
            assert figures[f"{name}_{n}_p50_us"] > 0
            assert figures[f"{name}_{n}_p99_us"] >= figures[f"{name}_{n}_p50_us"]
        assert figures[f"follower_match_{n}_p50_us"] < figures[f"remote_match_{n}_p50_us"]
    assert figures["follower_wrong_answers"] == 0
    # With predictions: answered from the follower's copy too, and the same.
    assert figures["follower_pred_wrong_answers"] == 0
    for n in follower.PROMPT_BLOCKS:
        assert figures[f"follower_match_pred_{n}_p50_us"] > 0
        assert figures[f"follower_match_pred_{n}_p50_us"] < figures[f"remote_match_pred_{n}_p50_us"]
    assert figures["follower_lag_p99_ms"] >= figures["follower_lag_p50_ms"] > 0
    # RSS over a few thousand pairs is noise at --quick sizes: only reported.
    assert math.isfinite(figures["follower_bytes_per_block_instance"])
    assert figures["ingest_blocks_per_s"] > 0
