"""ZMQ engines of the fault harness: vLLM's KV-event wire on real sockets.

A :class:`ZmqEngine` is what an inference engine's ``ZmqEventPublisher`` is
to the indexer (``indexer/kvevents/subscriber.py``): a PUB socket sending
``[topic, 8-byte big-endian seq, msgpack batch]`` and a ROUTER replay socket
answering ``[b"", start_seq]`` with ``[b"", seq, payload]`` frames from its
buffer, ending with seq -1 and an empty payload. Batches are maps of events
as current vLLM writes them. The harness can make it lose a live batch,
forget the head of its replay buffer, and restart (a new publisher on the
same ports, sequence from 0, an empty cache).

The engine keeps its own view of its cache, :class:`~lab.faults.model.EngineTruth`:
the decoded events of its whole stream applied by the index contract. The
index must never hold more than that for the engine's instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any

import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio

from indexer.kvevents.decode import decode_batch
from indexer.model import InstanceId, Tier
from lab.faults.model import EngineTruth
from lab.faults.ops import (
    BLOCK_SIZE,
    CHAIN_BLOCKS,
    ZMQ_MODEL,
    Clear,
    Drop,
    EventSpec,
    Store,
    chain_tokens,
    ehash,
)

#: Replay stream end marker: seq -1 as 8 signed big-endian bytes.
END = (-1).to_bytes(8, "big", signed=True)

#: Seconds to keep trying to bind a port a closed socket just released: ZMQ
#: closes sockets in its I/O thread, so the port comes free a moment later.
_REBIND_S = 3.0

_MEDIUM = {Tier.GPU: "GPU", Tier.CPU: "CPU", Tier.DISK: "DISK"}

TOPIC = b"kv"


def _bind(sock: zmq.asyncio.Socket, addr: str) -> None:
    deadline = time.monotonic() + _REBIND_S
    while True:
        try:
            sock.bind(addr)
            return
        except zmq.ZMQError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


def event_map(spec: EventSpec) -> dict[str, Any]:
    """One event as current vLLM encodes it (a tagged map)."""
    if isinstance(spec, Clear):
        return {"type": "AllBlocksCleared"}
    if isinstance(spec, Drop):
        return {
            "type": "BlockRemoved",
            "block_hashes": [ehash("z", spec.chain, j) for j in spec.blocks],
            "medium": _MEDIUM[spec.tier or Tier.GPU],
        }
    assert isinstance(spec, Store)
    hi = min(spec.hi, CHAIN_BLOCKS)
    tokens = chain_tokens(spec.chain, hi)[spec.lo * BLOCK_SIZE :]
    return {
        "type": "BlockStored",
        "block_hashes": [ehash("z", spec.chain, j) for j in range(spec.lo, hi)],
        "parent_block_hash": ehash("z", spec.chain, spec.lo - 1) if spec.lo else None,
        "token_ids": tokens,
        "block_size": BLOCK_SIZE,
        "lora_id": None,
        "medium": _MEDIUM[spec.tier],
        "lora_name": None,
    }


def batch_payload(events: Sequence[EventSpec]) -> bytes:
    """A msgpack batch in current vLLM's map form."""
    data: bytes = msgpack.packb(
        {"ts": 0.0, "events": [event_map(e) for e in events], "data_parallel_rank": 0}
    )
    return data


class ZmqEngine:
    """One engine's publisher (PUB + ROUTER replay) and its own view of its cache."""

    def __init__(
        self, ctx: zmq.asyncio.Context, worker: str, keys: str, policy: str = "reset"
    ) -> None:
        self.ctx = ctx
        self.worker = worker
        self.keys = keys
        self.instance = InstanceId(worker, 0)
        self.address = f"http://{worker}:8000"
        self.truth = EngineTruth(self.instance, ZMQ_MODEL, policy)
        #: The sequence of the next batch.
        self.seq = 0
        self.buffer: list[tuple[int, bytes]] = []
        #: Sequences of the batches that hold an AllBlocksCleared.
        self.clears: set[int] = set()
        self.replay_requests = 0
        self.endpoint = ""
        self.replay_endpoint = ""
        self._pub: zmq.asyncio.Socket | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    def open(self) -> ZmqEngine:
        """Bind the sockets (the first time on free ports, then on the same ones)."""
        pub = self.ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        _bind(pub, self.endpoint or "tcp://127.0.0.1:*")
        router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        _bind(router, self.replay_endpoint or "tcp://127.0.0.1:*")
        self.endpoint = pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        self._pub, self._router = pub, router
        self._task = asyncio.create_task(self._serve_replay(router))
        return self

    def endpoint_settings(self) -> dict[str, Any]:
        """The ``engine_events.endpoints`` entry a replica subscribes with."""
        return {
            "worker_id": self.worker,
            "model": ZMQ_MODEL,
            "address": self.address,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": TOPIC.decode(),
            "keys": self.keys,
            # Longer than any run: heartbeats (a third of it, in real seconds) never fire.
            "lease_ttl_s": 3600.0,
        }

    async def publish(self, events: Sequence[EventSpec], *, drop: bool = False) -> int:
        """Send the next batch (``drop``: kept for replay only, as if ZMQ lost it)."""
        payload = batch_payload(events)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        decoded = decode_batch(payload, engine_hash_keys=self.keys == "engine_hashes")
        self.truth.apply(decoded.events)
        if any(isinstance(e, Clear) for e in events):
            self.clears.add(seq)
        if not drop:
            assert self._pub is not None
            await self._pub.send_multipart([TOPIC, seq.to_bytes(8, "big"), payload])
        return seq

    def truncate(self, keep: int) -> None:
        """Forget all but the last ``keep`` batches of the replay buffer."""
        self.buffer = self.buffer[-keep:] if keep else []

    def clear_buffered(self, start: int) -> bool:
        """Whether a batch still in the buffer, at or after ``start``, holds a clear."""
        lo = max(start, self.buffer_start())
        return any(s >= lo for s in self.clears)

    def buffer_start(self) -> int:
        """The lowest sequence replay can still return (``seq`` when the buffer is empty)."""
        return self.buffer[0][0] if self.buffer else self.seq

    async def restart(self) -> None:
        """A restarted publisher: same ports, sequence from 0, empty buffer and cache."""
        await self._close_sockets()
        self.seq = 0
        self.buffer = []
        self.clears = set()
        self.truth.restart()
        self.open()

    async def _serve_replay(self, router: zmq.asyncio.Socket) -> None:
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3:
                continue
            self.replay_requests += 1
            ident, _, start_b = frames
            start = int.from_bytes(start_b, "big")
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await router.send_multipart([ident, b"", seq.to_bytes(8, "big"), payload])
            await router.send_multipart([ident, b"", END, b""])

    async def _close_sockets(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        self._pub = self._router = None

    async def close(self) -> None:
        """Close the sockets."""
        await self._close_sockets()
