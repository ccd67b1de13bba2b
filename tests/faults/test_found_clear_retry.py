"""A clear or a reset acknowledged by its retry while the cut first attempt's purge is unfinished.

Found by the fault harness (``kvmesh bench faults --targets cluster --profiles
deadline --seed 404``: ``removed_reported`` in rounds of seeds 425, 436 and
476, e.g. ``--target cluster --profile deadline --replicas 3 --seed 476 --keep
239,240,241,245,247``, which reproduces on most replays). The same race as
``test_found_removed_retry.py`` through the other writes that retire an int
id: a batch holding ``AllBlocksCleared`` and a registration that resets the
instance (another incarnation or model).

The first attempt's script retires the old id (its entries stay until
``_purge`` has deleted them) and its caller gives up (a deadline of a few ms).
The retry is a DUPLICATE (the batch) or a plain renewal (the registration):
acknowledged at once, while the old id's purge still runs in the background
(Cluster: the call is shielded) or was abandoned (standalone). Another
replica whose cached table (younger than its bound) maps the old id to the
instance keeps naming it with the blocks the clear or reset dropped.

indexer/CONSISTENCY.md: "which instance holds which block" has bound 0, and
``removed_reported`` forbids blocks reported after their removal (a clear, a
reset by a new incarnation) was acknowledged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from indexer.model import (
    AllBlocksCleared,
    BatchOutcome,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
)
from indexer.redis.backend import RedisIndex
from kvmesh.blockkeys import block_keys
from tests.faults.conftest import replica_pair

W = InstanceId("w", 0)
NS = Namespace("m")
TOKENS = tuple(range(32))


async def _cut_then_retry(
    a: RedisIndex, write: Callable[[], Awaitable[Any]], release: asyncio.Event
) -> Any:
    """Run ``write`` on ``a`` with its purge held until ``release``, give up once
    the id is retired, then send the same write again and return the retry's answer."""
    started = asyncio.Event()
    real_purge = a._purge

    async def slow_purge(int_id: bytes) -> None:
        started.set()
        await release.wait()  # the first attempt's purge is still under way
        await real_purge(int_id)

    a._purge = slow_purge  # type: ignore[method-assign]
    first = asyncio.ensure_future(write())
    try:
        await asyncio.wait_for(started.wait(), 5.0)  # the script ran: the old id is retired
        first.cancel()  # the caller's deadline
        with contextlib.suppress(asyncio.CancelledError):
            await first
    finally:
        a._purge = real_purge  # type: ignore[method-assign]
    return await write()


@pytest.mark.parametrize("target", ["standalone", "cluster"])
@pytest.mark.parametrize("kind", ["clear", "reset"])
async def test_a_retried_clear_or_reset_reports_no_old_blocks_on_another_replica(
    kind: str, target: str, request: pytest.FixtureRequest
) -> None:
    a, b = replica_pair(request, target)
    keys = block_keys(TOKENS, 16, "m")
    release = asyncio.Event()
    try:
        await a.register(InstanceSpec(W, "m", "http://w:9000", 30.0, "x"))
        await a.apply(EventBatch(W, 0, (BlockStored((1, 2), None, TOKENS, 16),)))
        # b reads the instance table now: within its bound from here on.
        assert [(m.instance, m.depth) for m in await b.match(NS, keys)] == [(W, 2)]

        if kind == "clear":
            batch = EventBatch(W, 1, (AllBlocksCleared(),))
            got = await _cut_then_retry(a, lambda: a.apply(batch), release)
            assert got.outcome is BatchOutcome.DUPLICATE
        else:
            spec = InstanceSpec(W, "m", "http://w:9000", 30.0, "y")
            _, reset = await _cut_then_retry(a, lambda: a.register(spec), release)
            assert not reset  # the retry renews what the cut attempt reset

        got_b = [(m.instance, m.depth) for m in await b.match(NS, keys)]
        assert got_b == [], f"blocks of {W} reported after its {kind} was acknowledged: {got_b}"
    finally:
        release.set()
        await asyncio.sleep(0.2)  # let a shielded purge finish before closing
        await a.close()
        await b.close()
