"""indexer.watch: a watcher reads every change of its namespaces, in order, once,
or is told to resync when it falls behind its bound; never silently less. A
snapshot's instance cut into parts keeps every block, in order, each part
within its bound (a million blocks: each response under 1 MiB, where the
instance whole is over grpc's 16 MiB limit)."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from indexer.bridge import wire
from indexer.model import BlockStored, EventBatch, InstanceId, Namespace, Tier
from indexer.server import WATCH_SNAPSHOT_BYTES, watch_part_bytes
from indexer.watch import (
    Change,
    Resync,
    Watcher,
    WatchHub,
    event_wire_bytes,
    snapshot_parts,
)
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.errors import InvalidArgument, ResourceExhausted, Unavailable

A = Namespace("m", "")
B = Namespace("m", "lora")
W0 = InstanceId("w0", 0)


def _reference(
    published: list[tuple[int, Namespace | None]], watched: frozenset[Namespace]
) -> list[int]:
    """Positions a watcher of ``watched`` must read (the naive model)."""
    return [p for p, ns in published if ns is None or not watched or ns in watched]


class DroppingWatcher(Watcher):
    """Broken on purpose: drops the oldest change when full instead of telling to resync."""

    def _offer(self, change: Change) -> None:
        if len(self._queue) >= self.buffer:
            self._queue.popleft()
        self._queue.append(change)
        self._ready.set()


async def _run(seed: int, hub: WatchHub, watcher: Watcher) -> tuple[list[int], list[int]]:
    """Publish a random stream while a watcher reads with random pauses; return
    what it read and what the model says it should have read, since its last
    (re)start."""
    rng = random.Random(seed)
    published: list[tuple[int, Namespace | None]] = []
    read: list[int] = []
    done = asyncio.Event()

    async def reader() -> None:
        nonlocal read
        while not done.is_set() or watcher.pending:
            try:
                got = await asyncio.wait_for(watcher.next(), 0.05)
            except TimeoutError:
                continue
            if isinstance(got, Resync):
                # A fresh snapshot in the same step: everything up to now is in it.
                watcher.restart(hub.position)
                read = []
                continue
            read += [c.position for c in got]
            await asyncio.sleep(0)

    task = asyncio.create_task(reader())
    for _ in range(2000):
        ns = rng.choice([A, B, None])
        kind = "expired" if ns is None else rng.choice(["stored", "removed", "cleared"])
        pos = hub.publish(kind, ns, W0, rng.randrange(1 << 20))
        published.append((pos, ns))
        if rng.random() < 0.1:
            await asyncio.sleep(0)  # let the reader catch up now and then
    done.set()
    await task
    start = watcher.start
    return read, _reference([p for p in published if p[0] > start], watcher.namespaces)


@pytest.mark.parametrize("seed", range(5))
async def test_a_watcher_reads_every_change_once_in_order_or_resyncs(seed: int) -> None:
    hub = WatchHub(max_watchers=2, buffer=16)
    watcher = hub.subscribe([A])
    read, expected = await _run(seed, hub, watcher)
    assert read == expected
    assert watcher.resyncs > 0  # bursts of up to ~40 changes exceed a bound of 16


async def test_a_large_buffer_never_resyncs() -> None:
    hub = WatchHub(buffer=10_000)
    watcher = hub.subscribe()
    read, expected = await _run(7, hub, watcher)
    assert read == expected and len(read) == 2000
    assert watcher.resyncs == 0


async def test_a_watcher_that_drops_silently_fails_the_model() -> None:
    hub = WatchHub(buffer=16)
    broken = DroppingWatcher(frozenset([A]), 16, hub.position)
    hub._watchers.append(broken)
    read, expected = await _run(0, hub, broken)
    assert read != expected


def test_the_hub_is_bounded_and_names_its_settings() -> None:
    hub = WatchHub(max_watchers=1, buffer=8)
    w = hub.subscribe(buffer=100)
    assert w.buffer == 8  # a client's hint never exceeds the replica's bound
    with pytest.raises(ResourceExhausted) as e:
        hub.subscribe()
    assert e.value.field == "watch.max_followers"
    hub.unsubscribe(w)
    hub.unsubscribe(w)
    assert hub.watchers == 0
    with pytest.raises(InvalidArgument) as e2:
        hub.subscribe(buffer=-1)
    assert e2.value.field == "max_buffer"
    with pytest.raises(InvalidArgument) as e3:
        WatchHub(buffer=0)
    assert e3.value.field == "watch.buffer"


def test_positions_move_with_nobody_watching() -> None:
    hub = WatchHub()
    assert [hub.publish("stored", A, W0, i) for i in range(3)] == [1, 2, 3]
    w = hub.subscribe()
    assert w.start == 3 and w.pending == 0
    hub.publish("stored", B, W0, 4)
    assert w.pending == 1


async def test_a_closed_hub_ends_its_watchers_and_refuses_new_ones() -> None:
    hub = WatchHub()
    w = hub.subscribe()
    hub.publish("stored", A, W0, 1)
    hub.close()
    got = await w.next()
    assert isinstance(got, list) and len(got) == 1  # what was left comes first
    assert await asyncio.wait_for(w.next(), 1.0) is None
    with pytest.raises(Unavailable):
        hub.subscribe()


# -- a snapshot's instance in parts --------------------------------------------


def _content(rng: random.Random, stores: int) -> EventBatch:
    """An instance as a snapshot reads it: a store per (LoRA, tier), then copies
    (one hash stored again n times), LoRA names up to the 256 bytes allowed."""
    events = []
    loras = ["", "l" * 256, "adapter"]
    for _ in range(stores):
        n = rng.choice([0, 1, 3, rng.randrange(1, 400)])
        hashes = tuple(rng.randrange(1 << 64) for _ in range(n))
        events.append(
            BlockStored(
                block_hashes=hashes,
                lora_name=rng.choice(loras),
                tier=rng.choice(list(Tier)),
                block_keys=tuple(rng.randrange(1 << 64) for _ in range(n)),
            )
        )
    for _ in range(rng.randrange(0, 30)):
        h, k = rng.randrange(1 << 64), rng.randrange(1 << 64)
        c = rng.randrange(1, 4)
        events.append(
            BlockStored(block_hashes=(h,) * c, lora_name=rng.choice(loras), block_keys=(k,) * c)
        )
    return EventBatch(InstanceId("w0", 3), 41, tuple(events), counts_copies=True)


def _flat(parts: list[EventBatch]) -> list[tuple[str, Tier, int, int]]:
    out = []
    for part in parts:
        for ev in part.events:
            assert isinstance(ev, BlockStored) and ev.block_keys is not None
            out += [
                (ev.lora_name, ev.tier, h, k)
                for h, k in zip(ev.block_hashes, ev.block_keys, strict=True)
            ]
    return out


def _events_bytes(batch: EventBatch) -> int:
    """What ``batch``'s events take in its message."""
    full = wire.batch_to_pb(batch)
    bare = pb.EventBatch()
    bare.CopyFrom(full)
    del bare.events[:]
    return full.ByteSize() - bare.ByteSize()


@pytest.mark.parametrize("seed", range(4))
def test_parts_keep_every_block_in_order_each_within_its_bound(seed: int) -> None:
    rng = random.Random(seed)
    content = _content(rng, rng.randrange(1, 12))
    for ev in content.events:  # the bound is one: every event is at most it
        assert _events_bytes(EventBatch(content.instance, 0, (ev,))) <= event_wire_bytes(ev)
    for max_bytes in (1, 60, 400, 5000, 1 << 20):
        parts = snapshot_parts(content, max_bytes)
        assert _flat(parts) == _flat([content])
        assert {(p.instance, p.sequence, p.counts_copies) for p in parts} == {
            (content.instance, 41, True)
        }
        for p in parts:
            blocks = sum(len(ev.block_hashes) for ev in p.events if isinstance(ev, BlockStored))
            within = sum(event_wire_bytes(ev) for ev in p.events) <= max_bytes
            assert within or blocks <= 1  # a part holds one block at least
            assert _events_bytes(p) <= max(max_bytes, sum(event_wire_bytes(ev) for ev in p.events))
        if sum(event_wire_bytes(ev) for ev in content.events) <= max_bytes:
            assert parts == [content]
        else:
            assert len(parts) > 1


def test_a_million_block_instance_goes_in_parts_each_under_the_message_limit() -> None:
    """The default quota, 1,048,576 blocks an instance, with 64-bit hashes and
    names of the longest allowed: whole, over grpc's 16 MiB; in parts, each
    response within WATCH_SNAPSHOT_BYTES."""
    rng = random.Random(0)
    n = 1 << 20
    half = n // 2
    hashes = [(1 << 63) | rng.getrandbits(63) for _ in range(n)]
    keys = [rng.getrandbits(64) for _ in range(n)]
    name = "x" * 256
    content = EventBatch(
        InstanceId(name, 7),
        123,
        tuple(
            BlockStored(
                block_hashes=tuple(hashes[lo : lo + half]),
                lora_name=lora,
                tier=tier,
                block_keys=tuple(keys[lo : lo + half]),
            )
            for lo, lora, tier in ((0, "", Tier.GPU), (half, name, Tier.CPU))
        ),
        counts_copies=True,
    )
    info = pb.InstanceInfo(
        instance=pb.InstanceRef(worker_id=name, dp_rank=7),
        model=name,
        address=name,
        incarnation=name,
        lease_ttl_seconds=60,
        lease_expires_at=time.time(),
        live=True,
        applied_sequence=123,
        has_applied_sequence=True,
        blocks=n,
    )

    def response(part: EventBatch, i: int, more: bool) -> pb.WatchIndexResponse:
        snap = pb.WatchedInstance(info=info, content=wire.batch_to_pb(part), part=i, more=more)
        entry = pb.WatchChange(position=1 << 40, applied_at=time.time(), snapshot=snap)
        return pb.WatchIndexResponse(changes=[entry])

    assert response(content, 0, False).ByteSize() > 16 << 20
    parts = snapshot_parts(content, watch_part_bytes(WATCH_SNAPSHOT_BYTES))
    sizes = [response(p, i, i < len(parts) - 1).ByteSize() for i, p in enumerate(parts)]
    assert max(sizes) <= WATCH_SNAPSHOT_BYTES
    assert len(parts) == 19 and sum(sizes) > 16 << 20
    assert (
        sum(len(ev.block_hashes) for p in parts for ev in p.events if isinstance(ev, BlockStored))
        == n
    )
