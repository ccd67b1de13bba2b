"""ZMQ subscriber counters on the indexer's Prometheus registry (``kvmesh_indexer_zmq_*``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import zmq.asyncio
from prometheus_client import generate_latest

from tests.grpc.conftest import close_harness
from tests.integration.test_zmq_subscriber import (
    FakePublisher,
    blocks,
    depth,
    eventually,
    map_batch,
    start,
    stored,
    sub,
)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def test_subscriber_counters_are_metrics(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    h = await start(pub)
    try:
        await eventually(lambda: sub(h).connected_peers > 0)
        toks = blocks(2)

        async def applied() -> bool:
            # Publish until one lands: a fresh SUB socket misses the first
            # messages (ZMQ's slow joiner), which replay then fills in.
            await pub.publish(map_batch(stored([1, 2], toks)))
            return await depth(h, toks) == 2

        await eventually(applied)
        await pub.publish(b"not msgpack")
        await eventually(lambda: sub(h).counters.frames_malformed >= 1)
        text = generate_latest(h.server.metrics.registry).decode()
        counters = sub(h).counters
        assert f"kvmesh_indexer_zmq_batches_applied_total {counters.batches_applied:.1f}" in text
        assert counters.batches_applied >= 1
        assert f"kvmesh_indexer_zmq_frames_malformed_total {counters.frames_malformed:.1f}" in text
        assert f"kvmesh_indexer_zmq_registrations_total {counters.registrations:.1f}" in text
        # The replica counter of the same name stays its own series.
        assert "kvmesh_indexer_batches_applied_total" in text
    finally:
        await close_harness(h)
        await pub.close()
