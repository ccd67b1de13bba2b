"""The ZMQ subscriber against real sockets on 127.0.0.1 and vLLM-format frames.

The publisher here follows the documented wire of vLLM's ``ZmqEventPublisher``:
PUB ``[topic, 8-byte big-endian seq, msgpack batch]`` and a ROUTER replay
socket answering ``[b"", start_seq]`` with ``[b"", seq, payload]`` frames (or
``[b"", topic, seq, payload]``) and an end marker of seq -1 and no payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgpack  # type: ignore[import-untyped]
import pytest
import zmq
import zmq.asyncio

from indexer.kvevents.subscriber import EndpointSubscriber
from indexer.memory import MemoryIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2 as spb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2_grpc as spb_grpc
from tests.grpc.conftest import MODEL, Harness, close_harness, make_config, open_harness

END = (-1).to_bytes(8, "big", signed=True)


def _bind(sock: zmq.asyncio.Socket, addr: str) -> None:
    # ZMQ closes sockets in its I/O thread: a port just released by a closed
    # publisher can take a moment to become bindable again.
    deadline = time.monotonic() + 3.0
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class FakePublisher:
    """An engine's KV-event publisher: PUB socket plus ROUTER replay socket."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        pub: str = "tcp://127.0.0.1:*",
        replay: str = "tcp://127.0.0.1:*",
        echo_topic: bool = False,
        sndhwm: int | None = None,
    ) -> None:
        self.topic = b"kv"
        self.echo_topic = echo_topic
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        if sndhwm is not None:  # 0: queue without bound, never drop at the publisher
            self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        _bind(self.pub, pub)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        _bind(self.router, replay)
        self.endpoint = self.pub.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.replay_endpoint = self.router.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.buffer: list[tuple[int, bytes]] = []
        self.seq = 0
        self.replay_requests = 0
        self._task = asyncio.create_task(self._serve_replay())

    async def publish(self, payload: bytes, *, drop: bool = False) -> int:
        """Send the next batch (``drop``: keep it for replay only, as if ZMQ lost it)."""
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    async def send_raw(self, frames: list[bytes]) -> None:
        await self.pub.send_multipart(frames)

    async def _serve_replay(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            self.replay_requests += 1
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in self.buffer:
                if seq >= start:
                    head = [ident, b"", self.topic] if self.echo_topic else [ident, b""]
                    await self.router.send_multipart([*head, seq.to_bytes(8, "big"), payload])
            await self.router.send_multipart([ident, b"", END, b""])

    async def close(self) -> None:
        self._task.cancel()
        async with asyncio.timeout(10):  # a hang fails here, with its traceback
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(linger=0)
        self.router.close(linger=0)


def blocks(n: int, start: int = 0) -> list[int]:
    """Token ids of ``n`` 4-token blocks."""
    return list(range(start, start + 4 * n))


def map_batch(*events: dict[str, Any], rank: int = 0) -> bytes:
    """Current vLLM: the batch and its events as maps."""
    return msgpack.packb({"ts": time.time(), "events": list(events), "data_parallel_rank": rank})


def array_batch(*events: list[Any]) -> bytes:
    """Older vLLM / SGLang: the batch and its events as arrays."""
    return msgpack.packb([time.time(), list(events)])


def stored(hashes: list[int], tokens: list[int], parent: int | None = None) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": 4,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }


async def eventually(check: Callable[[], Any], within: float = 5.0) -> None:
    """Poll an async (or sync) check until it returns true."""
    deadline = time.monotonic() + within
    while True:
        result = check()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def start(pub: FakePublisher, **endpoint: Any) -> Harness:
    ep: dict[str, Any] = {
        "worker_id": "engine-0",
        "model": MODEL,
        "address": "http://engine-0:8000",
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint,
        "topic": "kv",
    }
    ep.update(endpoint)
    cfg = make_config(engine_events={"endpoints": [ep], "replay_timeout_s": 0.5})
    return await open_harness(cfg, MemoryIndex())


def sub(h: Harness) -> EndpointSubscriber:
    s: EndpointSubscriber = h.server.subscribers.subscribers[0]
    return s


async def depth(h: Harness, tokens: list[int]) -> int:
    resp = await h.stub.Match(pb.MatchRequest(model=MODEL, token_ids=tokens))
    return resp.matches[0].depth if resp.matches else 0


async def test_both_encodings_and_a_gap_filled_by_replay(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx, echo_topic=True)
    h = await start(pub)
    try:
        await eventually(lambda: sub(h).registered)
        t = blocks(4)
        await pub.publish(map_batch(stored([101, 102], t[:8])))  # current vLLM, maps
        await pub.publish(array_batch(["BlockStored", [103], 102, t[8:12], 4, None, "GPU"]))
        await pub.publish(array_batch(["BlockStored", [104], 103, t[12:16], 4, None]), drop=True)
        gone = {"type": "BlockRemoved", "block_hashes": [999], "medium": "GPU"}
        await pub.publish(map_batch(gone))
        await eventually(lambda: sub(h).next_seq == 4)
        assert await depth(h, t) == 4  # batch 2 was lost live and came back by replay
        c = sub(h).counters
        assert c.gaps >= 1 and c.batches_replayed >= 1 and c.unrecoverable_gaps == 0
        assert c.batches_applied == 4 and c.frames_malformed == 0
        listed = await h.stub.ListInstances(pb.ListInstancesRequest(model=MODEL))
        (info,) = listed.instances
        assert (info.applied_sequence, info.stale) == (3, False)
    finally:
        await close_harness(h)
        await pub.close()


async def test_late_joiner_replays_from_zero(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    t = blocks(3)
    # Published before any subscriber exists: lost to the slow joiner, kept for replay.
    await pub.publish(map_batch(stored([1], t[:4])))
    await pub.publish(map_batch(stored([2], t[4:8], parent=1)))
    h = await start(pub)
    try:
        await eventually(lambda: sub(h).registered)
        await pub.publish(map_batch(stored([3], t[8:12], parent=2)))
        await eventually(lambda: sub(h).next_seq == 3)
        assert await depth(h, t) == 3
        assert pub.replay_requests >= 1
    finally:
        await close_harness(h)
        await pub.close()


async def test_publisher_restart_resets_the_instance(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    h = await start(pub)
    try:
        await eventually(lambda: sub(h).registered)
        old, new = blocks(2), blocks(2, start=1000)
        await pub.publish(map_batch(stored([1], old[:4])))
        await pub.publish(map_batch(stored([2], old[4:], parent=1)))
        # A stream longer than what the restarted engine sends before the
        # subscriber reconnects (else a restart looks like a gap; see the module).
        for _ in range(60):
            await pub.publish(map_batch())
        await eventually(lambda: sub(h).next_seq == pub.seq)
        assert await depth(h, old) == 2
        incarnation = sub(h).incarnation
        endpoint, replay = pub.endpoint, pub.replay_endpoint
        await pub.close()
        pub = FakePublisher(ctx, pub=endpoint, replay=replay)  # same ports, counter from 0
        await pub.publish(map_batch(stored([7], new[:4])))
        await pub.publish(map_batch(stored([8], new[4:], parent=7)))

        async def restarted() -> bool:
            # Until the subscriber has reconnected, everything sent is lost to it
            # (only replay brings it back): keep the stream going, as an engine does.
            if sub(h).counters.publisher_restarts == 0:
                await pub.publish(map_batch())
                return False
            return sub(h).next_seq == pub.seq

        await eventually(restarted, within=10.0)
        assert await depth(h, new) == 2
        assert await depth(h, old) == 0  # a restarted engine has an empty cache
        assert sub(h).incarnation != incarnation
    finally:
        await close_harness(h)
        await pub.close()


async def test_malformed_frames_are_counted_never_fatal(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    h = await start(pub)
    try:
        await eventually(lambda: sub(h).registered)
        t = blocks(2)
        await pub.publish(map_batch(stored([1], t[:4])))
        await eventually(lambda: sub(h).next_seq == 1)
        await pub.send_raw([b"kv", b"\x00\x01", b"x"])  # sequence frame of 2 bytes
        await pub.send_raw([b"kv", b"only-two-frames"])
        await pub.publish(b"\xc1 not msgpack")  # seq 1: a lost batch (policy reset)
        await pub.publish(map_batch({"type": "Nope"}, stored([5], t[:4])))
        await eventually(lambda: sub(h).next_seq == 3)
        c = sub(h).counters
        assert c.frames_malformed == 3
        assert c.events_malformed == 1
        assert c.unrecoverable_gaps == 1
        assert await depth(h, t[:4]) == 1  # the good event of the last batch applied
        assert h.server.subscribers.counters().frames_malformed == 3
    finally:
        await close_harness(h)
        await pub.close()


async def test_engine_gone_lease_runs_out(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    h = await start(pub, lease_ttl_s=0.6)
    try:
        await eventually(lambda: sub(h).registered)
        t = blocks(1)
        await pub.publish(map_batch(stored([1], t)))
        await eventually(lambda: depth(h, t))
        await asyncio.sleep(0.8)  # heartbeats keep it while the engine is connected
        assert await depth(h, t) == 1
        await pub.close()
        await eventually(lambda: sub(h).connected_peers == 0)
        await eventually(lambda: _gone(h, t), within=3.0)
    finally:
        await close_harness(h)
        await pub.close()


async def _gone(h: Harness, tokens: list[int]) -> bool:
    return await depth(h, tokens) == 0


async def test_engine_hashes_serve_sglang_prefix_matches(ctx: zmq.asyncio.Context) -> None:
    pub = FakePublisher(ctx)
    h = await start(pub, model="sglang", keys="engine_hashes", worker_id="sgl-0")
    try:
        await eventually(lambda: sub(h).registered)
        hashes = [-5, 6, -7]
        await pub.publish(
            msgpack.packb(
                {
                    "ts": 0.0,
                    "events": [["BlockStored", hashes, None, blocks(3), 4, None, "GPU"]],
                    "attn_dp_rank": 0,
                }
            )
        )
        await eventually(lambda: sub(h).next_seq == 1)
        sg = spb_grpc.KVIndexerStub(h.channel)
        resp = await sg.MatchExternalKvPrefix(spb.MatchExternalKvPrefixRequest(hashes=hashes))
        assert [(m.worker_id, m.matched_prefix_blocks) for m in resp.matches] == [("sgl-0", 3)]
    finally:
        await close_harness(h)
        await pub.close()
