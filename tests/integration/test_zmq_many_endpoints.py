"""One replica subscribed to more engines than ZMQ's default socket cap allows.

A ZMQ context opens at most 1,023 sockets unless told otherwise, and each
engine endpoint takes a SUB socket for its live stream and, while it catches
up, a DEALER for its replay requests. A fleet of 64 nodes with 8 data-parallel
ranks each is 512 endpoints: past about 500 of them, the next subscriber's
socket failed with "Too many open files" and its engine was never indexed.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio

from indexer.memory import MemoryIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from tests.grpc.conftest import MODEL, close_harness, make_config, open_harness
from tests.integration.test_zmq_subscriber import (
    FakePublisher,
    blocks,
    map_batch,
    stored,
)

#: Endpoints of the replica: with a replay socket each, well past 1,023 sockets.
ENDPOINTS = 600


@pytest.mark.timeout(120)
async def test_every_engine_of_a_large_fleet_is_indexed() -> None:
    # The engines' side is this test's own context, raised to fit them all.
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * ENDPOINTS)
    pubs = [FakePublisher(ctx) for _ in range(ENDPOINTS)]
    # Each engine holds one batch from before the replica subscribed: every
    # subscriber replays it, its DEALER open beside its SUB.
    for i, pub in enumerate(pubs):
        await pub.publish(map_batch(stored([i + 1], blocks(1, start=4 * i))))
    eps = [
        {
            "worker_id": f"engine-{i:03d}",
            "model": MODEL,
            "address": f"http://engine-{i:03d}:8000",
            "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint,
            "topic": "kv",
        }
        for i, pub in enumerate(pubs)
    ]
    cfg = make_config(engine_events={"endpoints": eps, "replay_timeout_s": 5.0})
    h = await open_harness(cfg, MemoryIndex())
    try:
        subs = h.server.subscribers.subscribers
        deadline = time.monotonic() + 60
        while True:
            behind = [
                i for i, s in enumerate(subs) if not (s.registered and (s.next_seq or 0) >= 1)
            ]
            if not behind:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"{len(behind)} of {ENDPOINTS} engines never indexed")
            # A live batch tells a subscriber what it missed (ZMQ drops what a
            # SUB socket sends before it connects): it replays from 0.
            for i in behind:
                gone = {"type": "BlockRemoved", "block_hashes": [999_999], "medium": "GPU"}
                await pubs[i].publish(map_batch(gone))
            await asyncio.sleep(0.5)
        # Each engine's first block, from before the replica subscribed, is its own.
        for i in range(0, ENDPOINTS, 7):
            resp = await h.stub.Match(pb.MatchRequest(model=MODEL, token_ids=blocks(1, 4 * i)))
            assert [m.instance.worker_id for m in resp.matches] == [f"engine-{i:03d}"]
    finally:
        await close_harness(h)
        for pub in pubs:
            await pub.close()
        ctx.destroy(linger=0)
