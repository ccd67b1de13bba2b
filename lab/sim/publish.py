"""Where simulated engines publish their KV events: an in-process index or a live indexer.

:class:`MemoryPublisher` applies batches to an :class:`indexer.memory.MemoryIndex`
(the same batch semantics the gRPC publish path applies). :class:`GrpcPublisher`
sends them over ``PublishEventsStream``, one stream per instance as an engine
adapter keeps one, and waits for each ack so that a replay stays in step with
the index; a broken stream or a missing ack is counted and the engine
carries on without publishing (the replay must finish when the indexer dies).
"""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import grpc
import grpc.aio

from indexer.memory import MemoryIndex
from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, InstanceSpec, Tier
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc

#: Lease of replay instances: a replay sends no heartbeats (applied batches renew it).
REPLAY_LEASE_S = 3600.0

#: How long a publish waits for its ack before giving the stream up.
ACK_TIMEOUT_S = 2.0


_TIER_PB = {Tier.GPU: pb.TIER_GPU, Tier.CPU: pb.TIER_CPU, Tier.DISK: pb.TIER_DISK}


def batch_to_pb(batch: EventBatch) -> pb.EventBatch:
    """The wire form of a batch (stored blocks carry precomputed content keys)."""
    events = []
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            stored = pb.BlockStored(
                block_hashes=ev.block_hashes,
                block_size=ev.block_size,
                lora_name=ev.lora_name,
                tier=_TIER_PB[ev.tier],
                block_keys=ev.block_keys or (),
            )
            if ev.parent_block_hash is not None:
                stored.parent_block_hash = ev.parent_block_hash
            events.append(pb.Event(stored=stored))
        elif isinstance(ev, BlockRemoved):
            events.append(pb.Event(removed=pb.BlockRemoved(block_hashes=ev.block_hashes)))
        else:
            events.append(pb.Event(cleared=pb.AllBlocksCleared()))
    return pb.EventBatch(
        instance=pb.InstanceRef(worker_id=batch.instance.worker_id, dp_rank=batch.instance.dp_rank),
        sequence=batch.sequence,
        timestamp=batch.timestamp,
        events=events,
    )


class MemoryPublisher:
    """Applies batches to an in-process memory index."""

    def __init__(self, index: MemoryIndex, model: str) -> None:
        self.index = index
        self.model = model
        self.batches = 0

    async def register(self, worker: str) -> None:
        """Register a simulated instance."""
        await self.index.register(
            InstanceSpec(InstanceId(worker, 0), self.model, lease_ttl_s=REPLAY_LEASE_S)
        )

    async def publish(self, batch: EventBatch) -> None:
        """Apply one batch."""
        await self.index.apply(batch)
        self.batches += 1

    async def close(self) -> None:
        """Nothing to release."""


class GrpcPublisher:
    """Publishes over ``PublishEventsStream`` to a live indexer (see the module docstring)."""

    def __init__(self, channel: grpc.aio.Channel, model: str) -> None:
        self.stub = pb_grpc.IndexerServiceStub(channel)
        self.model = model
        # A new incarnation per publisher: registering resets what an earlier
        # replay left of the same engines in a live index, so every run starts
        # from empty caches as its engines do.
        self.incarnation = f"replay-{secrets.token_hex(6)}"
        self._streams: dict[str, Any] = {}
        self._broken: set[str] = set()
        self.batches = 0
        self.failed = 0
        self.dropped = 0

    async def register(self, worker: str) -> None:
        """Register a simulated instance (long lease; batches renew it)."""
        await self.stub.RegisterInstance(
            pb.RegisterInstanceRequest(
                instance=pb.InstanceRef(worker_id=worker),
                model=self.model,
                lease_ttl_seconds=REPLAY_LEASE_S,
                incarnation=self.incarnation,
            )
        )

    async def publish(self, batch: EventBatch) -> None:
        """Send one batch and wait for its ack; failures are counted, never raised."""
        worker = batch.instance.worker_id
        if worker in self._broken:
            self.dropped += 1
            return
        try:
            call = self._streams.get(worker)
            if call is None:
                call = self._streams[worker] = self.stub.PublishEventsStream()
            await asyncio.wait_for(
                call.write(pb.PublishEventsStreamRequest(batch=batch_to_pb(batch))),
                ACK_TIMEOUT_S,
            )
            resp = await asyncio.wait_for(call.read(), ACK_TIMEOUT_S)
            if resp is grpc.aio.EOF:
                raise ConnectionError("stream ended")
            self.batches += 1
        except (
            grpc.aio.AioRpcError,
            grpc.aio.UsageError,
            asyncio.InvalidStateError,
            TimeoutError,
            ConnectionError,
        ):
            self.failed += 1
            self._broken.add(worker)
            call = self._streams.pop(worker, None)
            if call is not None:
                call.cancel()

    async def close(self) -> None:
        """End every stream."""
        for call in self._streams.values():
            call.cancel()
        self._streams.clear()
