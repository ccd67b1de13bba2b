"""Server behaviour: error mapping (never UNKNOWN), isolation, overload, health, reflection."""

from __future__ import annotations

import asyncio
import socket
import urllib.request
from collections.abc import Sequence
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from indexer.memory import MemoryIndex
from indexer.model import InstanceMatch, Namespace
from indexer.server import SERVICE_NAME, IndexerServicer
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.errors import Unavailable
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


class FlakyIndex(MemoryIndex):
    """A memory index that can be made to crash or to be 'down'."""

    def __init__(self) -> None:
        super().__init__()
        self.down = False

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        if self.down:
            raise Unavailable("backend down")
        if namespace.model == "boom":
            raise RuntimeError("bug in the backend")
        return await super().match(namespace, keys, include_stale=include_stale)

    async def ping(self) -> None:
        if self.down:
            raise Unavailable("backend down")


@pytest.fixture
async def flaky() -> Any:
    idx = FlakyIndex()
    h = await open_harness(make_config(health_check_interval_s=0.05), idx)
    try:
        yield h, idx
    finally:
        await close_harness(h)


async def _health(h: Harness, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(h.channel)
    resp = await stub.Check(health_pb2.HealthCheckRequest(service=service))
    return int(resp.status)


async def _wait_health(h: Harness, status: int, within: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + within
    while loop.time() < end:
        if await _health(h) == status and await _health(h, SERVICE_NAME) == status:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"health never became {status}")


async def test_unexpected_exception_is_internal_never_unknown(flaky: Any) -> None:
    h, _ = flaky
    err = await expect_status(match(h.stub, A, model="boom"), grpc.StatusCode.INTERNAL)
    assert "bug in the backend" not in (err.details() or "")  # no internals leak
    assert "RuntimeError" in (err.details() or "")


async def test_a_bad_client_does_not_affect_a_good_one(flaky: Any) -> None:
    h, _ = flaky
    await register(h.stub)
    await publish(h.stub, batch(1, stored([1], A)))
    bad = [match(h.stub, A, model="boom") for _ in range(20)]
    bad += [match(h.stub, [-1] * 8) for _ in range(20)]
    good = [match(h.stub, A) for _ in range(20)]
    results = await asyncio.gather(*bad, *good, return_exceptions=True)
    for r in results[:40]:
        assert isinstance(r, grpc.aio.AioRpcError)
        assert r.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.INVALID_ARGUMENT)
    for r in results[40:]:
        assert isinstance(r, pb.MatchResponse) and [m.depth for m in r.matches] == [1]


async def test_backend_down_is_unavailable_and_health_follows(flaky: Any) -> None:
    h, idx = flaky
    await _wait_health(h, health_pb2.HealthCheckResponse.SERVING)
    idx.down = True
    await expect_status(match(h.stub, A), grpc.StatusCode.UNAVAILABLE)
    await _wait_health(h, health_pb2.HealthCheckResponse.NOT_SERVING)
    assert (await h.stub.Ping(pb.PingRequest())) == pb.PingResponse()  # still up
    idx.down = False
    await _wait_health(h, health_pb2.HealthCheckResponse.SERVING)
    assert list((await match(h.stub, A)).matches) == []


async def test_overload_is_resource_exhausted() -> None:
    h = await open_harness(make_config(limits={"max_concurrent_rpcs": 1}), MemoryIndex())
    try:
        await register(h.stub)
        queue: asyncio.Queue[pb.PublishEventsStreamRequest | None] = asyncio.Queue()

        async def requests() -> Any:
            while (item := await queue.get()) is not None:
                yield item

        stream = h.stub.PublishEventsStream(requests())
        await queue.put(pb.PublishEventsStreamRequest(batch=batch(1, stored([1], A))))
        first = await stream.read()
        assert first.ack.outcome == pb.BATCH_OUTCOME_APPLIED  # the stream holds the one slot
        err = await expect_status(match(h.stub, A), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "max_concurrent_rpcs" in (err.details() or "")
        await queue.put(None)
        assert await stream.code() == grpc.StatusCode.OK
        assert [m.depth for m in (await match(h.stub, A)).matches] == [1]
    finally:
        await close_harness(h)


async def test_health_and_reflection_answer(harness: Harness) -> None:
    assert await _health(harness) == health_pb2.HealthCheckResponse.SERVING
    assert await _health(harness, SERVICE_NAME) == health_pb2.HealthCheckResponse.SERVING
    stub = reflection_pb2_grpc.ServerReflectionStub(harness.channel)
    call = stub.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = [s.name async for r in call for s in r.list_services_response.service]
    assert SERVICE_NAME in names and "grpc.health.v1.Health" in names


async def test_every_method_but_ping_is_wrapped() -> None:
    methods = pb.DESCRIPTOR.services_by_name["IndexerService"].methods_by_name
    for name in methods:
        fn = getattr(IndexerServicer, name)
        assert (getattr(fn, "__kvmesh_rpc__", None) == name) == (name != "Ping"), name


async def test_metrics_endpoint_exports_counters() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    h = await open_harness(make_config(metrics_port=port), MemoryIndex())
    try:
        await match(h.stub, A)
        await expect_status(match(h.stub, [-1]), grpc.StatusCode.INVALID_ARGUMENT)
        url = f"http://127.0.0.1:{h.server.metrics_port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read())
        text = body.decode()
        assert 'kvmesh_indexer_rpcs_total{code="OK",method="Match"} 1.0' in text
        assert 'kvmesh_indexer_rpcs_total{code="INVALID_ARGUMENT",method="Match"} 1.0' in text
        assert "kvmesh_indexer_matches_total 2.0" not in text  # the rejected one is not counted
        assert "kvmesh_indexer_matches_total 1.0" in text
    finally:
        await close_harness(h)


async def test_port_zero_reports_bound_port(harness: Harness) -> None:
    assert harness.server.port > 0
    assert harness.server.address == f"127.0.0.1:{harness.server.port}"


class _ReapFailsOnce(MemoryIndex):
    def __init__(self, clock: Any) -> None:
        super().__init__(clock=clock)
        self.failures = 1

    async def reap_expired(self) -> list[Any]:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("reap failed")
        return await super().reap_expired()


async def test_expired_lease_hidden_at_once_and_reaped_despite_errors(clock: Any) -> None:
    idx = _ReapFailsOnce(clock)
    h = await open_harness(make_config(reap_interval_s=0.05), idx)
    try:
        await register(h.stub, ttl=5)
        await publish(h.stub, batch(1, stored([1], A)))
        assert [m.depth for m in (await match(h.stub, A)).matches] == [1]
        clock.advance(6)
        assert list((await match(h.stub, A)).matches) == []  # invisible at once
        loop = asyncio.get_running_loop()
        end = loop.time() + 5
        while (await h.stub.ListInstances(pb.ListInstancesRequest())).instances:
            assert loop.time() < end, "never reaped"
            await asyncio.sleep(0.05)
        counters = h.server.logic.counters
        assert counters.reap_errors == 1 and counters.instances_reaped == 1
    finally:
        await close_harness(h)
