"""The indexer over a real Redis that is down at start or dies mid-run.

While Redis is down every backend call answers UNAVAILABLE and health is
NOT_SERVING, the server stays up (Ping answers), and it recovers by itself
once Redis is back.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer.server import SERVICE_NAME
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from lab import redisproc
from tests.grpc.conftest import (
    BLOCK,
    Harness,
    batch,
    close_harness,
    expect_status,
    make_config,
    match,
    open_harness,
    publish,
    register,
    stored,
)

A = list(range(BLOCK))
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def own_redis() -> Iterator[Any]:
    """A Redis of this test alone (it gets killed)."""
    with redisproc.RedisProcess() as proc:
        yield proc


async def _redis_harness(url: str) -> Harness:
    cfg = make_config(
        backend="redis",
        redis={"url": url, "prefix": f"g{uuid.uuid4().hex[:8]}", "socket_timeout_s": 0.5},
        health_check_interval_s=0.1,
    )
    return await open_harness(cfg)  # the server builds (and owns) the RedisIndex


@pytest.fixture
async def redis_harness(own_redis: Any) -> AsyncIterator[Harness]:
    h = await _redis_harness(own_redis.url)
    try:
        yield h
    finally:
        await close_harness(h)


async def _status(h: Harness) -> tuple[int, int]:
    stub = health_pb2_grpc.HealthStub(h.channel)
    a = await stub.Check(health_pb2.HealthCheckRequest(service=""))
    b = await stub.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
    return int(a.status), int(b.status)


async def _wait_status(h: Harness, status: int, within: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while loop.time() < end:
        if await _status(h) == (status, status):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"health never became {status}")


async def _wait_ok(call: Any, within: float = 20.0) -> Any:
    """Retry ``call()`` while it is UNAVAILABLE; anything else fails the test."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
            if loop.time() > end:
                raise
            await asyncio.sleep(0.1)


async def test_redis_down_at_start_then_recovers(own_redis: Any) -> None:
    own_redis.kill()
    h = await _redis_harness(own_redis.url)
    try:
        assert await _status(h) == (NOT_SERVING, NOT_SERVING)
        await expect_status(match(h.stub, A), grpc.StatusCode.UNAVAILABLE)
        await expect_status(register(h.stub), grpc.StatusCode.UNAVAILABLE)
        await expect_status(h.stub.GetStats(pb.GetStatsRequest()), grpc.StatusCode.UNAVAILABLE)
        await h.stub.Ping(pb.PingRequest())  # the server itself is up
        own_redis.restart()
        await _wait_status(h, SERVING)
        await _wait_ok(lambda: register(h.stub))
        await publish(h.stub, batch(1, stored([1], A)))
        assert [m.depth for m in (await match(h.stub, A)).matches] == [1]
    finally:
        await close_harness(h)


async def test_redis_killed_mid_run_then_recovers(own_redis: Any, redis_harness: Harness) -> None:
    h = redis_harness
    await _wait_status(h, SERVING)
    await register(h.stub)
    await publish(h.stub, batch(1, stored([1], A)))
    assert [m.depth for m in (await match(h.stub, A)).matches] == [1]

    own_redis.kill()
    await expect_status(match(h.stub, A), grpc.StatusCode.UNAVAILABLE)
    await expect_status(
        publish(h.stub, batch(2, stored([2], A, parent=1))), grpc.StatusCode.UNAVAILABLE
    )
    stream = h.stub.PublishEventsStream(
        iter([pb.PublishEventsStreamRequest(batch=batch(2, stored([2], A, parent=1)))])
    )
    acks = [r.ack async for r in stream]
    assert [(a.outcome, a.error.code) for a in acks] == [
        (pb.BATCH_OUTCOME_REJECTED, grpc.StatusCode.UNAVAILABLE.value[0])
    ]
    await _wait_status(h, NOT_SERVING)
    await h.stub.Ping(pb.PingRequest())

    own_redis.restart()
    await _wait_status(h, SERVING)
    # Redis came back (possibly empty): the indexer serves again without a restart.
    await _wait_ok(lambda: register(h.stub))
    resp = await _wait_ok(lambda: match(h.stub, A))
    assert resp.total_blocks == 1
