"""indexer.watch: a watcher reads every change of its namespaces, in order, once,
or is told to resync when it falls behind its bound; never silently less."""

from __future__ import annotations

import asyncio
import random

import pytest

from indexer.model import InstanceId, Namespace
from indexer.watch import Change, Resync, Watcher, WatchHub
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
