"""``stop_tasks``: a close that cancels its background tasks is bounded both ways.

``with suppress(CancelledError): await task`` swallows the caller's own
cancellation (a shutdown timeout around the close never fires), and waits
forever for a task that outlives its cancel. Both are shown against real
tasks: one that ends, one that fails, one that turns its cancel into a retry.
"""

from __future__ import annotations

import asyncio
import logging
import time

import pytest

from kvmesh.tasks import stop_tasks


async def _stubborn(started: asyncio.Event, released: asyncio.Event) -> None:
    """A loop that takes its cancel for an error and carries on, as a client
    library that converts it and a caller that retries would (until the test
    releases it)."""
    started.set()
    while not released.is_set():
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            continue


def _release(task: asyncio.Future[None], released: asyncio.Event) -> None:
    released.set()
    task.cancel()


async def _failing() -> None:
    await asyncio.sleep(0)
    raise RuntimeError("boom")


async def test_tasks_that_end_are_cancelled_and_their_errors_retrieved() -> None:
    quiet = asyncio.ensure_future(asyncio.sleep(30))
    failed = asyncio.ensure_future(_failing())
    await asyncio.sleep(0.01)  # the failing one has failed
    t = time.monotonic()
    await stop_tasks(quiet, None, failed, what="test")
    assert time.monotonic() - t < 1
    assert quiet.cancelled()
    assert isinstance(failed.exception(), RuntimeError)  # retrieved, not raised


async def test_a_task_that_outlives_its_cancel_is_logged_and_left(
    caplog: pytest.LogCaptureFixture,
) -> None:
    started, released = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(_stubborn(started, released))
    await started.wait()
    t = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="kvmesh.tasks"):
        await stop_tasks(task, what="the watch feed", wait_s=0.2)
    took = time.monotonic() - t
    assert 0.2 <= took < 2, took
    assert not task.done()
    msgs = [r.getMessage() for r in caplog.records]
    assert any("the watch feed" in m and "_stubborn" in m for m in msgs), msgs
    _release(task, released)
    await asyncio.wait({task}, timeout=5)
    assert task.done()


async def test_the_callers_cancellation_ends_the_wait_at_once() -> None:
    started, released = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(_stubborn(started, released))
    await started.wait()
    t = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.1):
                await stop_tasks(task, what="test", wait_s=30)
        assert time.monotonic() - t < 2
    finally:
        _release(task, released)
        await asyncio.wait({task}, timeout=5)
