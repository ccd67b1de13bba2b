"""Reads a router waits on give up after socket_timeout_s; writes wait up to write_timeout_s.

An apply of a long engine event can hold a loaded Redis for most of a second.
With one short timeout for everything, such writes were given up on while
they completed, their retries re-drove them, and a Cluster fed 16-token
blocks stopped making progress. A Match still fails fast on a hung Redis.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest

from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from indexer.redis.backend import RedisIndex
from kvmesh.blockkeys import block_keys
from kvmesh.errors import Unavailable

W = InstanceId("w", 0)


def _pause(server: Any, ms: int) -> None:
    r = server.client()
    try:
        r.execute_command("CLIENT", "PAUSE", ms, "ALL")
    finally:
        r.close()


async def test_a_write_outlasting_the_read_timeout_completes_and_a_match_fails_fast(
    redis_server: Any,
) -> None:
    idx = RedisIndex(
        redis_server.url,
        prefix=f"to{uuid.uuid4().hex[:8]}",
        socket_timeout_s=0.3,
        write_timeout_s=5.0,
    )
    try:
        await idx.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
        batch = EventBatch(W, 0, (BlockStored((1, 2), None, tuple(range(32)), 16),))
        _pause(redis_server, 1200)
        t0 = time.monotonic()
        with pytest.raises(Unavailable, match="socket_timeout_s"):
            await idx.match(Namespace("m"), [1, 2])
        assert time.monotonic() - t0 < 1.0
        with pytest.raises(Unavailable, match="socket_timeout_s"):
            await idx.ping()
        result = await idx.apply(batch)  # waits out the pause
        assert time.monotonic() - t0 >= 1.0
        assert result.blocks_stored == 2
        [m] = await idx.match(Namespace("m"), block_keys(tuple(range(32)), 16, "m"))
        assert m.depth == 2
    finally:
        await idx.close()


async def test_a_write_past_the_write_timeout_is_unavailable(redis_server: Any) -> None:
    idx = RedisIndex(
        redis_server.url,
        prefix=f"to{uuid.uuid4().hex[:8]}",
        socket_timeout_s=0.2,
        write_timeout_s=0.3,
    )
    try:
        _pause(redis_server, 800)
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            await idx.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
        assert time.monotonic() - t0 < 0.8
        await asyncio.sleep(0.9)
        state, _ = await idx.register(InstanceSpec(W, "m", "http://w", 30.0, "x"))
        assert state.live
    finally:
        await idx.close()
