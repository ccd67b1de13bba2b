"""The ZMQ subscriber recovering what the index or the engine's buffer lost, on real sockets.

The publisher is the vLLM-wire pair of tests/integration/test_zmq_subscriber.py
(PUB plus ROUTER replay). Two kinds of loss:

- the index lost the instance (an operator removed it, a Redis restarted
  empty): the subscriber registers it again, which resets it, and must
  rebuild it from the engine's replay buffer, not apply one batch on an
  empty instance;
- the engine's replay buffer no longer starts where the subscriber asks
  (a late joiner after the engine trimmed its buffer): the batches before
  its start are an unrecoverable gap, counted and handled by
  ``engine_events.on_unrecoverable_gap``.

And one thing the subscriber must not take from the rest of the process:
the event loop, while it drains a backlog.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq.asyncio

from indexer.index import Index
from indexer.memory import MemoryIndex
from indexer.model import ApplyResult, EventBatch, InstanceId
from indexer.redis.backend import RedisIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from lab.redisproc import RedisProcess
from tests.grpc.conftest import MODEL, Harness, close_harness, make_config, open_harness
from tests.integration.test_zmq_subscriber import (
    FakePublisher,
    blocks,
    depth,
    eventually,
    map_batch,
    stored,
    sub,
)

W = InstanceId("engine-0", 0)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def start(
    pub: FakePublisher, index: Index | None = None, *, policy: str = "reset", **endpoint: Any
) -> Harness:
    ep: dict[str, Any] = {
        "worker_id": W.worker_id,
        "model": MODEL,
        "address": "http://engine-0:8000",
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint,
        "topic": "kv",
        # Long enough that no heartbeat runs during a test: the loss must be
        # found by the stream itself.
        "lease_ttl_s": 120.0,
    }
    ep.update(endpoint)
    cfg = make_config(
        engine_events={
            "endpoints": [ep],
            "replay_timeout_s": 0.5,
            "on_unrecoverable_gap": policy,
        }
    )
    return await open_harness(cfg, index if index is not None else MemoryIndex())


async def listed(h: Harness) -> pb.InstanceInfo:
    resp = await h.stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
    (info,) = resp.instances
    return info


async def hits(h: Harness, tokens: list[int], *, include_stale: bool = False) -> list[Any]:
    resp = await h.stub.Match(
        pb.MatchRequest(model=MODEL, token_ids=tokens, include_stale=include_stale)
    )
    return [(m.depth, m.stale) for m in resp.matches]


async def publish_until_seen(h: Harness, pub: FakePublisher) -> None:
    """Publish empty batches until the subscriber applied one (a fresh SUB socket
    misses the first messages: ZMQ's slow joiner)."""

    async def seen() -> bool:
        if sub(h).next_seq == pub.seq:
            return True
        await pub.publish(map_batch())
        return False

    await eventually(seen)


# -- the index lost the instance --------------------------------------------------


async def _lose_and_rebuild(h: Harness, pub: FakePublisher, lose: Any) -> None:
    # Bounded well inside the test timeout, so that a hang fails with the
    # traceback of the await it hung in, not a timeout's thread dump.
    async with asyncio.timeout(40):
        await _lose_and_rebuild_unbounded(h, pub, lose)


async def _lose_and_rebuild_unbounded(h: Harness, pub: FakePublisher, lose: Any) -> None:
    await eventually(lambda: sub(h).registered)
    t = blocks(4)
    await pub.publish(map_batch(stored([1], t[:4])))
    await pub.publish(map_batch(stored([2], t[4:8], parent=1)))
    await pub.publish(map_batch(stored([3], t[8:12], parent=2)))
    await eventually(lambda: sub(h).next_seq == 3)
    assert await depth(h, t) == 3
    await lose()
    await pub.publish(map_batch(stored([4], t[12:16], parent=3)))
    await eventually(lambda: sub(h).next_seq == 4)

    # next_seq moves when a batch is taken, before it is applied, and the
    # rebuild this one sets off replays the stream first: wait for the answer
    # (under a full suite's load a Match once ran before the rebuild: depth 0).
    async def rebuilt() -> bool:
        return await depth(h, t) == 4

    await eventually(rebuilt)
    assert pub.replay_requests == 1  # the whole stream came back from the engine's buffer
    info = await listed(h)
    assert (info.applied_sequence, info.stale) == (3, False)
    assert sub(h).counters.rebuilds == 1


async def test_an_instance_the_index_dropped_is_rebuilt_from_replay(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = FakePublisher(ctx)
    h = await start(pub)
    try:

        async def lose() -> None:
            await h.index.remove_instance(W)  # e.g. an operator's RemoveInstance

        await _lose_and_rebuild(h, pub, lose)
    finally:
        await close_harness(h)
        await pub.close()


async def test_a_redis_restarted_empty_is_rebuilt_from_replay(ctx: zmq.asyncio.Context) -> None:
    with RedisProcess() as rp:
        pub = FakePublisher(ctx)
        h = await start(pub, RedisIndex(rp.url, prefix="zr"))
        try:

            async def lose() -> None:
                # The index is gone; apply answers "not registered". In a thread:
                # the indexer keeps running while its Redis restarts, as it would.
                await asyncio.to_thread(rp.restart)

            await _lose_and_rebuild(h, pub, lose)
        finally:
            await close_harness(h)
            await pub.close()


# -- the engine's buffer lost the start ---------------------------------------------


def root(k: int) -> tuple[bytes, list[int]]:
    """Batch ``k``: one block of its own (no parent), so each batch matches alone."""
    tokens = blocks(1, start=100 * (k + 1))
    return map_batch(stored([1000 + k], tokens)), tokens


async def _late_joiner(ctx: zmq.asyncio.Context, policy: str) -> tuple[Harness, FakePublisher]:
    pub = FakePublisher(ctx)
    for k in range(4):
        await pub.publish(root(k)[0])  # before any subscriber: lost live
    del pub.buffer[:2]  # the engine's replay buffer now starts at batch 2
    h = await start(pub, policy=policy)
    await eventually(lambda: sub(h).registered)
    await publish_until_seen(h, pub)
    return h, pub


async def test_a_late_joiner_missing_the_start_of_the_buffer_is_counted(
    ctx: zmq.asyncio.Context,
) -> None:
    h, pub = await _late_joiner(ctx, "reset")
    try:
        c = sub(h).counters
        assert c.unrecoverable_gaps == 1 and c.replays == 1
        assert await hits(h, root(0)[1]) == []  # batches 0 and 1 are gone
        assert await hits(h, root(2)[1]) == [(1, False)]  # policy reset: a subset, fresh
        assert (await listed(h)).stale is False
    finally:
        await close_harness(h)
        await pub.close()


async def test_a_late_joiner_missing_the_start_of_the_buffer_is_stale_under_policy_stale(
    ctx: zmq.asyncio.Context,
) -> None:
    h, pub = await _late_joiner(ctx, "stale")
    try:
        assert sub(h).counters.unrecoverable_gaps == 1
        assert await hits(h, root(2)[1]) == []  # hidden: Match does not name it
        assert await hits(h, root(2)[1], include_stale=True) == [(1, True)]
        assert (await listed(h)).stale is True
    finally:
        await close_harness(h)
        await pub.close()


async def test_a_late_joiner_without_replay_is_stale_under_policy_stale(
    ctx: zmq.asyncio.Context,
) -> None:
    pub = FakePublisher(ctx)
    for k in range(3):
        await pub.publish(root(k)[0])
    h = await start(pub, policy="stale", replay_endpoint=None)
    try:
        await eventually(lambda: sub(h).registered)
        await publish_until_seen(h, pub)
        assert sub(h).counters.unrecoverable_gaps == 1
        info = await listed(h)
        assert info.stale is True and info.applied_sequence == pub.seq - 1
        assert pub.replay_requests == 0
    finally:
        await close_harness(h)
        await pub.close()


# -- sharing the event loop ---------------------------------------------------------


class GatedIndex(MemoryIndex):
    """The memory backend, whose applies wait while ``gate`` is clear."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.gate.set()

    async def apply(self, batch: EventBatch) -> ApplyResult:
        await self.gate.wait()
        return await super().apply(batch)


async def test_a_backlog_gives_way_to_the_rest_of_the_process(ctx: zmq.asyncio.Context) -> None:
    # A publisher that queues rather than drops: under load a PUB socket at its
    # high-water mark drops the last batches of the burst, and nothing after them
    # would tell the subscriber they existed (here the stream ends with the burst).
    pub = FakePublisher(ctx, sndhwm=0)
    index = GatedIndex()
    h = await start(pub, index)
    try:
        await eventually(lambda: sub(h).registered)
        await publish_until_seen(h, pub)
        index.gate.clear()  # the subscriber stops at its next batch; the rest queues up
        n = 3000
        for k in range(n):
            await pub.publish(map_batch(stored([10_000 + k], blocks(1, start=4 * k))))
        await asyncio.sleep(0.5)  # ZMQ moves the backlog into the subscriber's queue
        before = sub(h).counters.batches_applied
        seen: list[int] = []
        asyncio.get_running_loop().call_later(
            0.001, lambda: seen.append(sub(h).counters.batches_applied)
        )
        index.gate.set()
        await eventually(lambda: sub(h).next_seq == pub.seq, within=60.0)
        # A timer due 1 ms after the backlog started ran long before its end.
        assert seen and seen[0] - before < n // 2, (before, seen, n)
        assert sub(h).counters.batches_applied - before == n
    finally:
        await close_harness(h)
        await pub.close()
