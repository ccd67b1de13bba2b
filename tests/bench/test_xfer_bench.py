"""Opt-in: the default transfer benchmark (``pytest -m bench``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench import xfer as bench


@pytest.mark.bench
@pytest.mark.timeout(600)
def test_default_xfer_bench(tmp_path: Path) -> None:
    out = tmp_path / "xfer.json"
    assert bench.main(["--json", str(out)]) == 0
    figures = json.loads(out.read_text())["figures"]
    for name in ("serial_mean_ms", "async_mean_ms", "async_p99_ms", "speedup", "async_gbps",
                 "memcpy_gbps", "add_request_p99_us"):  # fmt: skip
        assert figures[name] > 0
