"""A replica's callers at once share reads of the instance table, and none gets an old one.

Seen in ``kvmesh bench peer --backend redis``: at the start of an ingest round
64 engines registered (each registration reads the whole table for the
capacity check) and sent their first batches (each first batch of an
instance reads it again): 128 snapshot scripts at once, about 80 ms each,
and N^2 rows for a fleet of N engines.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from indexer.model import InstanceId, InstanceSpec
from indexer.redis.backend import RedisIndex
from kvmesh.errors import Unavailable


def _spec(i: int) -> InstanceSpec:
    return InstanceSpec(InstanceId(f"w{i}", 0), "m", f"http://w{i}:9000", 30.0, "x")


async def test_callers_at_once_share_two_reads(redis_server: Any) -> None:
    """Fifty callers at once: one read for the first, one queued for the other 49
    (the first's may have started before their calls), not fifty."""
    prefix = f"rs{uuid.uuid4().hex[:8]}"
    a = RedisIndex(redis_server.url, prefix=prefix)
    try:
        for i in range(3):
            await a.register(_spec(i))
        await a.list_instances()  # the schema check and its first read are done
        before = a.round_trips
        results = await asyncio.gather(*(a.list_instances() for _ in range(50)))
        assert a.round_trips - before == 2
        assert all(
            [s.spec.instance for s in r] == [_spec(i).instance for i in range(3)] for r in results
        )
        # One caller alone still reads once.
        before = a.round_trips
        await a.list_instances()
        assert a.round_trips - before == 1
    finally:
        await a.close()


async def test_a_caller_sees_what_was_registered_before_its_call(redis_server: Any) -> None:
    """Sharing reads never serves a table read before the caller's call, while
    other reads come and go. (A model that gave a caller the read in flight,
    which may predate the call, is caught by the count above: one read, not two.)"""
    prefix = f"rs{uuid.uuid4().hex[:8]}"
    a = RedisIndex(redis_server.url, prefix=prefix)
    b = RedisIndex(redis_server.url, prefix=prefix)
    try:
        await a.register(_spec(0))
        await a.list_instances()
        for i in range(1, 11):
            first = asyncio.ensure_future(a.list_instances())
            await asyncio.sleep(0)  # its read is on its way
            await b.register(_spec(i))
            later = await a.list_instances()
            assert _spec(i).instance in [s.spec.instance for s in later]
            await first
    finally:
        await a.close()
        await b.close()


async def test_a_failed_read_fails_its_callers_and_the_next_read_goes_on(
    redis_server: Any,
) -> None:
    prefix = f"rs{uuid.uuid4().hex[:8]}"
    a = RedisIndex(redis_server.url, prefix=prefix, socket_timeout_s=0.2, write_timeout_s=0.2)
    try:
        await a.register(_spec(0))
        await a.list_instances()
        with redis_server.client() as c:
            c.execute_command("CLIENT", "PAUSE", 600, "ALL")  # Redis answers nobody for 0.6 s
        got = await asyncio.gather(*(a.list_instances() for _ in range(5)), return_exceptions=True)
        assert all(isinstance(e, Unavailable) for e in got), got
        await asyncio.sleep(0.7)
        assert [s.spec.instance for s in await a.list_instances()] == [_spec(0).instance]
    finally:
        await a.close()
