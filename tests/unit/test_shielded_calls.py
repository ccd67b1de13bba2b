"""Calls the Redis backend finishes for a caller that gave up (indexer/redis/backend.py)."""

from __future__ import annotations

import asyncio
import gc
import logging

import pytest

from indexer.redis.backend import _shielded


async def _fails_later(started: asyncio.Event) -> None:
    started.set()
    await asyncio.sleep(0.01)
    raise RuntimeError("the script failed")


@pytest.mark.parametrize("wrap", ["shielded", "bare shield"])
async def test_a_failure_after_the_caller_gave_up_is_not_reported_as_never_retrieved(
    wrap: str, caplog: pytest.LogCaptureFixture
) -> None:
    started = asyncio.Event()
    coro = _fails_later(started)
    call = _shielded(coro) if wrap == "shielded" else asyncio.shield(coro)
    caller = asyncio.ensure_future(call)
    await started.wait()
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    await asyncio.sleep(0.05)  # the call runs to its end meanwhile
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        gc.collect()
    reported = any("never retrieved" in r.getMessage() for r in caplog.records)
    # asyncio.shield alone leaves the failure to the garbage collector's report.
    assert reported == (wrap == "bare shield")


async def test_the_caller_that_waits_gets_the_result_or_the_error() -> None:
    async def value() -> int:
        await asyncio.sleep(0)
        return 7

    assert await _shielded(value()) == 7
    with pytest.raises(RuntimeError, match="failed"):
        await _shielded(_fails_later(asyncio.Event()))
