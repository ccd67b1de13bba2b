"""IndexerClient against an in-process indexer: answers, deadline, breaker, bound, outage."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from prometheus_client import CollectorRegistry

from indexer.memory import MemoryIndex
from indexer.model import (
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    Namespace,
)
from router_client import IndexerClient, IndexerClientSettings, MatchStatus, Router, RouteRequest
from tests.grpc.conftest import MODEL, Harness, close_harness, make_config, open_harness


async def _store(h: Harness, worker: str, keys: list[int]) -> None:
    await h.index.register(InstanceSpec(InstanceId(worker), MODEL, lease_ttl_s=600))
    ev = BlockStored(block_hashes=tuple(keys), block_size=4, block_keys=tuple(keys))
    await h.index.apply(EventBatch(InstanceId(worker), 1, (ev,)))


async def test_match_and_route_over_grpc(harness: Harness) -> None:
    await _store(harness, "w1", [11, 12, 13])
    await _store(harness, "w2", [11])
    client = IndexerClient(
        channel=harness.channel, model=MODEL, settings=IndexerClientSettings(deadline_ms=2000)
    )
    out = await client.match([11, 12, 13, 14])
    assert out.ok and out.matches["w1"].depth == 3 and out.matches["w2"].depth == 1
    router = Router(
        workers=["w1", "w2", "w3"],
        indexer=client,
        block_size=4,
        registry=CollectorRegistry(),
        seed=0,
    )
    d = await router.route(RouteRequest(1, 16, block_keys=[11, 12, 13, 14]), decode=False)
    assert (d.prefill.worker, d.prefill.reason) == ("w1", "cache_candidate")


class SlowIndex(MemoryIndex):
    """A memory index whose Match takes 300 ms."""

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        await asyncio.sleep(0.3)
        return self.match_sync(namespace, keys, include_stale=include_stale)


async def test_deadline_then_circuit_opens() -> None:
    h = await open_harness(make_config(), SlowIndex())
    try:
        await _store(h, "w1", [1])
        s = IndexerClientSettings(deadline_ms=20, breaker_failures=2, breaker_cooldown_s=60)
        client = IndexerClient(channel=h.channel, model=MODEL, settings=s)
        assert (await client.match([1])).status is MatchStatus.DEADLINE_EXCEEDED
        assert (await client.match([1])).status is MatchStatus.DEADLINE_EXCEEDED
        assert (await client.match([1])).status is MatchStatus.CIRCUIT_OPEN
        router = Router(workers=["w1", "w2"], indexer=client, registry=CollectorRegistry())
        d = await router.route(RouteRequest(1, 4, block_keys=[1]), decode=False)
        assert d.prefill.reason == "indexer_unavailable"
    finally:
        await close_harness(h)


async def test_in_flight_bound(harness: Harness) -> None:
    s = IndexerClientSettings(deadline_ms=2000, max_in_flight=1)
    client = IndexerClient(channel=harness.channel, model=MODEL, settings=s)
    a, b = await asyncio.gather(client.match([1]), client.match([1]))
    assert {a.status, b.status} == {MatchStatus.OK, MatchStatus.BUSY}


async def test_unavailable_after_the_server_stops() -> None:
    h = await open_harness(make_config())
    client = IndexerClient(
        channel=h.channel, model=MODEL, settings=IndexerClientSettings(deadline_ms=500)
    )
    assert (await client.match([1])).ok
    await h.server.stop(0)
    out = await client.match([1])
    assert out.status in (MatchStatus.UNAVAILABLE, MatchStatus.DEADLINE_EXCEEDED)
    await close_harness(h)
