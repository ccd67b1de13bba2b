"""``kvmesh bench holders``, at CI sizes: every case runs in a child process,
its Match is checked (every holder at the prompt's depth), and the figures and
the table come out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lab.bench.holders import CASES, main


def test_bench_holders_quick(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "holders.json"
    assert main(["--quick", "--prompt", "256", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "gc full ms" in printed and "bytes against 1 holder" in printed
    doc = json.loads(out.read_text())
    figures = doc["figures"]
    for _, holders in CASES:
        for name in ("bytes_per_block_instance", "full_collection_ms", "match_p50_us"):
            assert figures[f"holders_{holders}_{name}"] > 0, (holders, name)
    assert {f"ratio_holders_{h}_bytes" for _, h in CASES[1:]} <= figures.keys()
    assert doc["params"]["prompt"] == 256 and doc["params"]["quick"] is True


def test_a_case_whose_match_is_wrong_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """The case checks its Match: an index answering one block short must fail it."""
    import asyncio

    from indexer.memory import MemoryIndex
    from lab.bench import holders

    real = MemoryIndex.match_sync

    def short(self: MemoryIndex, namespace: object, keys: list[int], **kw: object) -> object:
        return real(self, namespace, keys[:-1], **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(MemoryIndex, "match_sync", short)
    with pytest.raises(AssertionError):
        asyncio.run(holders._case(2_000, 2, 64))
