"""Stopping background tasks: what every close of a service or a client does.

Router-safe (asyncio and logging only): ``router_client`` stops its follower
and stream tasks with it too.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

log = logging.getLogger(__name__)

#: Longest a close waits for its background tasks to end once cancelled.
STOP_WAIT_S = 10.0


async def stop_tasks(
    *tasks: asyncio.Future[Any] | None, what: str, wait_s: float = STOP_WAIT_S
) -> set[asyncio.Future[Any]]:
    """Cancel ``tasks`` (None entries are skipped) and wait until they end, at most
    ``wait_s`` seconds; what they ended with is retrieved, not raised. Returns
    the tasks still running (none, unless one outlived its cancel).

    Bounded both ways, where ``with suppress(CancelledError): await task`` is not:
    a cancellation of the caller (a shutdown timeout around a close) ends the
    wait at once instead of being swallowed as the task's, and a task that
    outlives its cancel (a library that turned it into an error and retried)
    is logged with its stack, under ``what``, and left behind rather than
    holding the close forever."""
    live = [t for t in tasks if t is not None]
    for t in live:
        t.cancel()
    if not live:
        return set()
    done, pending = await asyncio.wait(live, timeout=wait_s)
    for t in done:
        if not t.cancelled() and t.exception() is not None:
            log.debug("%s: a task ended with %r while stopping", what, t.exception())
    for t in pending:
        frames = t.get_stack(limit=8) if isinstance(t, asyncio.Task) else []
        where = "; ".join(
            f"{f.f_code.co_filename}:{f.f_lineno} in {f.f_code.co_name}" for f in frames
        )
        log.error(
            "%s: a task did not end within %.1f s of its cancel, left running: %r at %s",
            what, wait_s, t, where or "?",
        )  # fmt: skip
    return pending
