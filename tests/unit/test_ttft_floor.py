"""tools/ttft_floor.py: the TTFT p95 no routing can beat at a capacity."""

from __future__ import annotations

import pytest

from lab.traces import TraceRequest
from tools.ttft_floor import floor_p95_ms

BS = 512


def req(blocks: tuple[int, ...], tokens: int) -> TraceRequest:
    return TraceRequest(0.0, tokens, 10, blocks)


def test_a_repeat_prefills_only_what_no_cache_holds() -> None:
    """40 requests: a cold 4-block prompt, then 39 repeats of it with one block more.
    Each repeat reuses the 4 blocks (its last token is always computed: the fifth block
    is not reusable), so it prefills 1 block; the cold one 4 blocks."""
    first = req((1, 2, 3, 4), 4 * BS)
    repeats = [req((1, 2, 3, 4, 100 + i), 5 * BS) for i in range(39)]
    ms = floor_p95_ms([first, *repeats], workers=2, capacity=100, tokens_per_s=1000.0)
    assert ms == pytest.approx(1000.0 * BS / 1000.0)  # p95 of 39 x 1 block and 1 x 4
    # With no cache, every request prefills its whole prompt.
    tiny = floor_p95_ms([first, *repeats], workers=1, capacity=0, tokens_per_s=1000.0)
    assert tiny == pytest.approx(1000.0 * 5 * BS / 1000.0)
