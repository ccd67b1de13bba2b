"""Calls beyond the connection pool wait for a connection instead of failing.

redis-py's pools raise MaxConnectionsError the moment every connection is in
use (100 by default): with 64 engines ingesting and routers probing, a burst
of calls failed as UNAVAILABLE although Redis was fine. The backend now holds
at most ``max_connections`` calls in flight and queues the rest.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from indexer.model import InstanceId, InstanceSpec
from indexer.redis.backend import RedisIndex


def _clients(server_url: str) -> int:
    import redis

    r = redis.Redis.from_url(server_url)
    try:
        return len(r.client_list())
    finally:
        r.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
async def test_a_burst_beyond_the_pool_waits_and_succeeds(
    cluster: bool, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_cluster" if cluster else "redis_server").url
    before = _clients(url) if not cluster else 0
    idx = RedisIndex(url, prefix=f"pool{uuid.uuid4().hex[:8]}", cluster=cluster, max_connections=4)
    try:
        specs = [
            InstanceSpec(InstanceId(f"w{i}", 0), model="m", address="a", incarnation="i")
            for i in range(40)
        ]
        await asyncio.gather(*(idx.register(s) for s in specs))
        # 400 calls at once against a pool of 4: none fails.
        states = await asyncio.gather(*(idx.heartbeat(s.instance) for s in specs * 10))
        assert len(states) == 400 and all(s.live for s in states)
        if not cluster:
            assert _clients(url) - before <= 4
    finally:
        await idx.close()


async def test_the_default_pool_takes_a_burst_larger_than_redis_pys_default(
    redis_server: Any,
) -> None:
    idx = RedisIndex(redis_server.url, prefix=f"pool{uuid.uuid4().hex[:8]}")
    try:
        spec = InstanceSpec(InstanceId("w", 0), model="m", address="a", incarnation="i")
        await idx.register(spec)
        states = await asyncio.gather(*(idx.heartbeat(spec.instance) for _ in range(300)))
        assert all(s.live for s in states)
    finally:
        await idx.close()
