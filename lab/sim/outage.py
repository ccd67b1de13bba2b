"""``kvmesh replay --follower`` and ``--outage``: the replay's own indexer, stopped and started.

:class:`IndexerProcess` is ``kvmesh indexer serve`` (memory backend) in a
child process on a free loopback port; :meth:`IndexerProcess.stop` kills it
(SIGKILL: an outage, not a drain) and :meth:`IndexerProcess.start` starts it
again on the same port, with an empty index, as a memory replica restarts.

:class:`RefeedPublisher` publishes the simulated engines' batches to it
(:class:`lab.sim.publish.GrpcPublisher`) and keeps, per engine, the blocks its
batches left resident (each with its parent) and the last sequence the indexer
acknowledged. After a restart, :meth:`RefeedPublisher.refeed` registers every
engine again and publishes, per engine, one batch holding those blocks in
chain order (parents first), numbered with the engine's last sequence, so the
batches that follow continue it: what an engine adapter that re-sends its
cache to a restarted indexer does. The batches dropped during the outage are
in that batch too (they were made; the indexer was not there to take them).

What a follower out of sync answers while the indexer is down is
:class:`router_client.follower.IndexFollower`'s own hold (``hold_s``);
``--follower-hold`` measures it beside a follower that holds nothing.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import grpc.aio

from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, Tier
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from lab.children import ChildProcess
from lab.redisproc import free_port
from lab.sim.publish import GrpcPublisher

HOST = "127.0.0.1"

#: Channel options of the replay's indexer channels: reconnect within a tenth of
#: a second of a restart, not after grpc's growing backoff (up to two minutes).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 200),
)


@dataclass(frozen=True, slots=True)
class Outage:
    """The indexer is down from ``start_s`` to ``start_s + duration_s``, replay
    seconds after the first request's arrival (the virtual clock: trace seconds
    divided by the speed)."""

    start_s: float
    duration_s: float

    @property
    def end_s(self) -> float:
        """When the indexer is started again."""
        return self.start_s + self.duration_s

    @classmethod
    def parse(cls, text: str) -> Outage:
        """``START_S:DURATION_S``, both seconds, ``START_S >= 0``, ``DURATION_S > 0``."""
        start, sep, duration = text.partition(":")
        try:
            out = cls(float(start), float(duration))
        except ValueError:
            raise ValueError(f"--outage wants START_S:DURATION_S, got {text!r}") from None
        if not sep or out.start_s < 0 or out.duration_s <= 0:
            raise ValueError(f"--outage wants START_S >= 0 and DURATION_S > 0, got {text!r}")
        return out


class IndexerProcess:
    """``kvmesh indexer serve`` (memory backend) on a free loopback port, owned by the replay."""

    def __init__(self, folder: Path, block_size: int, max_match_blocks: int = 4096) -> None:
        self.port = free_port(HOST)
        self.target = f"{HOST}:{self.port}"
        cfg = folder / "indexer.json"
        cfg.write_text(
            json.dumps(
                {
                    "host": HOST,
                    "port": self.port,
                    "metrics_port": 0,
                    "backend": "memory",
                    "block_size": block_size,
                    "log_level": "WARNING",
                    "watch": {"buffer": 65536},
                    "quotas": {"publish_blocks_per_s": 0},
                    "limits": {"max_match_blocks": max_match_blocks},
                }
            ),
            encoding="utf-8",
        )
        self.child = ChildProcess(
            [sys.executable, "-m", "kvmesh.cli", "indexer", "serve", "--config", str(cfg)],
            name="indexer",
            log_path=folder / "indexer.log",
        )
        #: Wall seconds of each start, until it answered Ping.
        self.start_s: list[float] = []

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start the server and wait until it answers Ping."""
        t0 = time.monotonic()
        self.child.start()
        async with grpc.aio.insecure_channel(self.target) as ch:
            stub = pb_grpc.IndexerServiceStub(ch)

            async def probe() -> bool:
                await stub.Ping(pb.PingRequest(), timeout=1.0)
                return True

            await self.child.wait_ready_async(probe, timeout_s, interval_s=0.05)
        self.start_s.append(time.monotonic() - t0)

    def stop(self) -> None:
        """Kill the server (its index is lost)."""
        self.child.kill()

    def close(self) -> None:
        """Stop the server for good."""
        if self.child.alive():
            self.child.stop()


class RefeedPublisher:
    """A :class:`GrpcPublisher` that can publish the engines' caches again (module docstring)."""

    def __init__(self, channel: grpc.aio.Channel, model: str, block_size: int) -> None:
        self.channel = channel
        self.model = model
        self.block_size = block_size
        self.inner = GrpcPublisher(channel, model)
        self.workers: list[str] = []
        #: Per engine: resident block -> its parent (None: a first block), in store order.
        self.resident: dict[str, dict[int, int | None]] = {}
        #: Per engine: the last sequence made and the last one the indexer acknowledged.
        self.made: dict[str, int] = {}
        self.acked: dict[str, int] = {}
        #: Batches made while the indexer could not take them (counted over restarts).
        self.lost = 0
        #: Blocks published again by :meth:`refeed`.
        self.refed_blocks = 0

    async def register(self, worker: str) -> None:
        """Register a simulated instance."""
        if worker not in self.resident:
            self.workers.append(worker)
            self.resident[worker] = {}
        await self.inner.register(worker)

    async def publish(self, batch: EventBatch) -> None:
        """Record what ``batch`` leaves resident, then publish it (failures counted)."""
        worker = batch.instance.worker_id
        held = self.resident.setdefault(worker, {})
        for ev in batch.events:
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    held.pop(h, None)
            elif isinstance(ev, BlockStored):
                parent = ev.parent_block_hash
                for h in ev.block_hashes:
                    held[h] = parent
                    parent = h
            else:
                held.clear()
        self.made[worker] = batch.sequence
        before = self.inner.batches
        await self.inner.publish(batch)
        if self.inner.batches > before:
            self.acked[worker] = batch.sequence
        else:
            self.lost += 1

    async def refeed(self, timeout_s: float = 30.0, *, republish: bool = True) -> None:
        """After a restart: every engine registered again and its resident blocks
        published in one batch (module docstring); ``republish`` False: registered
        only (its next batches continue from an empty index)."""
        await self.inner.close()
        await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        self.inner = GrpcPublisher(self.channel, self.model)
        for worker in self.workers:
            await self.inner.register(worker)
        for worker in self.workers:
            seq = self.made.get(worker)
            held = self.resident[worker]
            self.acked.pop(worker, None)  # the new server holds nothing of it yet
            if seq is None or not held or not republish:
                continue
            events = chains(held, self.block_size)
            before = self.inner.batches
            await self.inner.publish(EventBatch(InstanceId(worker, 0), seq, tuple(events), 0.0))
            if self.inner.batches > before:
                self.acked[worker] = seq
                self.refed_blocks += len(held)

    async def remove_all(self) -> None:
        """Drop every engine's instance from the indexer (the next run starts empty)."""
        stub = pb_grpc.IndexerServiceStub(self.channel)
        for worker in self.workers:
            await stub.RemoveInstance(
                pb.RemoveInstanceRequest(instance=pb.InstanceRef(worker_id=worker)), timeout=5.0
            )

    async def close(self) -> None:
        """End every stream."""
        await self.inner.close()


def chains(held: dict[int, int | None], block_size: int) -> list[BlockStored]:
    """``held`` (block -> parent) as stored chains, every parent before its children."""
    done: set[int] = set()
    out: list[BlockStored] = []
    for key in held:
        path: list[int] = []
        x: int | None = key
        while x is not None and x in held and x not in done:
            done.add(x)
            path.append(x)
            x = held[x]
        if path:
            path.reverse()
            out.append(
                BlockStored(
                    block_hashes=tuple(path),
                    parent_block_hash=held[path[0]],
                    block_size=block_size,
                    tier=Tier.GPU,
                    block_keys=tuple(path),
                )
            )
    return out
