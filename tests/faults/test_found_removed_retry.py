"""A removal acknowledged by its retry while the cut first attempt's purge is unfinished.

Found by the fault harness (``kvmesh bench faults``, profile ``deadline``,
target ``cluster``: ``removed_reported``, not reproduced on replay). A
RemoveInstance whose caller gives up (a gRPC deadline of a few ms) after
``remove.lua`` ran leaves the retired id's entries on the data nodes while
its purge is still running (Cluster: the call is shielded and purges in the
background) or abandoned (standalone: the cancellation ends the purge). The
caller's retry finds the instance gone and answers NOT_FOUND at once: the
removal is acknowledged, yet another replica whose cached instance table is
younger than ``instance_cache_ttl_s`` still knows the old id as live and its
Match walks those entries, naming the removed instance with its blocks.

indexer/CONSISTENCY.md allows no lag for that: "which instance holds which
block" is read from the shared index (bound 0), and ``removed_reported``
forbids blocks reported after their removal (RemoveInstance) was
acknowledged. An uncut removal is fine: it purges before it answers.

The purge of the first attempt is held at a gate here, so the interleaving
is the same on every run.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from kvmesh.blockkeys import block_keys
from kvmesh.errors import NotFound
from tests.faults.conftest import replica_pair

W = InstanceId("w", 0)
NS = Namespace("m")
TOKENS = tuple(range(32))


@pytest.mark.parametrize("target", ["standalone", "cluster"])
async def test_a_retried_removal_reports_no_blocks_on_another_replica(
    target: str, request: pytest.FixtureRequest
) -> None:
    a, b = replica_pair(request, target)
    keys = block_keys(TOKENS, 16, "m")
    started, release = asyncio.Event(), asyncio.Event()
    real_purge = a._purge

    async def slow_purge(int_id: bytes) -> None:
        started.set()
        await release.wait()  # the first attempt's purge is still under way
        await real_purge(int_id)

    first: asyncio.Task[Any] | None = None
    try:
        await a.register(InstanceSpec(W, "m", "http://w:9000", 30.0, "x"))
        await a.apply(EventBatch(W, 0, (BlockStored((1, 2), None, TOKENS, 16),)))
        # b reads the instance table now: within its bound from here on.
        assert [(m.instance, m.depth) for m in await b.match(NS, keys)] == [(W, 2)]

        a._purge = slow_purge  # type: ignore[method-assign]
        first = asyncio.create_task(a.remove_instance(W))
        await asyncio.wait_for(started.wait(), 5.0)  # remove.lua ran: the id is retired
        first.cancel()  # the caller's deadline
        with contextlib.suppress(asyncio.CancelledError):
            await first
        a._purge = real_purge  # type: ignore[method-assign]

        # The retry: the instance is gone, the removal is acknowledged (NOT_FOUND).
        with pytest.raises(NotFound):
            await a.remove_instance(W)

        got = [(m.instance, m.depth) for m in await b.match(NS, keys)]
        assert got == [], f"blocks of {W} reported after its removal was acknowledged: {got}"
    finally:
        release.set()
        await asyncio.sleep(0.2)  # let a shielded purge finish before closing
        await a.close()
        await b.close()
