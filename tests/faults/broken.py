"""Deliberately broken backends: each wraps a real one and breaks one rule of the contract.

The fault harness must catch every one of them (``test_broken.py``), which is
what shows that its invariants can fail.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

from indexer.convert import batch_from_pb
from indexer.index import Index
from indexer.memory import MemoryIndex
from indexer.model import (
    ApplyResult,
    BlockRemoved,
    BlockStored,
    EventBatch,
    IndexDump,
    IndexStats,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
)
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from lab.faults.fleet import HarnessFollower


class Delegating(Index):
    """Forwards every call to ``inner`` (the base of the broken variants)."""

    def __init__(self, inner: Index) -> None:
        self.inner = inner
        self.name = inner.name

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        return await self.inner.register(spec)

    async def heartbeat(self, instance: InstanceId) -> InstanceState:
        return await self.inner.heartbeat(instance)

    async def remove_instance(self, instance: InstanceId) -> int:
        return await self.inner.remove_instance(instance)

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        return await self.inner.list_instances(model)

    async def apply(self, batch: EventBatch) -> ApplyResult:
        return await self.inner.apply(batch)

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        return await self.inner.match(namespace, keys, include_stale=include_stale)

    async def reap_expired(self) -> list[InstanceId]:
        return await self.inner.reap_expired()

    async def stats(self) -> IndexStats:
        return await self.inner.stats()

    async def dump(self) -> IndexDump:
        return await self.inner.dump()

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()


class DropsOneBatch(Delegating):
    """Acknowledges the ``nth`` batch that stores blocks exactly as the backend would,
    but keeps none of its events (only its sequence and lease)."""

    def __init__(self, inner: Index, nth: int = 3) -> None:
        super().__init__(inner)
        assert isinstance(inner, MemoryIndex), "the shadow apply copies a memory index"
        self.left = nth

    async def apply(self, batch: EventBatch) -> ApplyResult:
        if any(isinstance(e, BlockStored) for e in batch.events):
            self.left -= 1
            if self.left == 0:
                shadow = copy.deepcopy(self.inner)
                try:
                    ack = await shadow.apply(batch)
                except Exception:
                    self.left = 1  # refused (not registered): drop the next one instead
                    raise
                if ack.blocks_stored == 0:
                    self.left = 1  # nothing stored (a duplicate, orphans): the next one
                    return await self.inner.apply(batch)
                await self.inner.apply(EventBatch(batch.instance, batch.sequence, ()))
                return ack
        return await self.inner.apply(batch)


class ListsTwice(Delegating):
    """Names the deepest hit of every Match twice."""

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        hits = await self.inner.match(namespace, keys, include_stale=include_stale)
        return hits[:1] + hits


class StaleAddressForever(Delegating):
    """Answers every instance with the first address a Match named it with."""

    def __init__(self, inner: Index) -> None:
        super().__init__(inner)
        self.first: dict[InstanceId, str] = {}

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        hits = await self.inner.match(namespace, keys, include_stale=include_stale)
        out = []
        for m in hits:
            address = self.first.setdefault(m.instance, m.address)
            out.append(m._replace(address=address))
        return out


class IgnoresRemoval(Delegating):
    """Answers RemoveInstance with the entries it would drop, and drops nothing."""

    async def remove_instance(self, instance: InstanceId) -> int:
        for st in await self.inner.list_instances():
            if st.spec.instance == instance:
                return st.blocks
        return await self.inner.remove_instance(instance)  # NotFound, as it should


#: name -> (wrapper, invariants that may catch it first: a dropped batch shows as a
#: missing block, or as a later clear that removes fewer entries than it should)
BROKEN: dict[str, tuple[type[Delegating], frozenset[str]]] = {
    "drops_one_batch": (DropsOneBatch, frozenset({"ack_lost", "wrong_ack"})),
    "lists_twice": (ListsTwice, frozenset({"listed_twice"})),
    "stale_address_forever": (StaleAddressForever, frozenset({"stale_identity"})),
    "ignores_removal": (IgnoresRemoval, frozenset({"ghost_instance", "removed_reported"})),
}


class FollowerIgnoresBlockRemovals(HarnessFollower):
    """A router's follower that applies every change but the BlockRemoved events
    of a batch: its copy keeps blocks its replica dropped (until a snapshot)."""

    async def _apply(self, ch: pb.WatchChange, kind: str | None) -> None:
        if kind != "batch":
            await super()._apply(ch, kind)
            return
        batch = batch_from_pb(ch.batch)
        kept = tuple(e for e in batch.events if not isinstance(e, BlockRemoved))
        await self.index.apply(dataclasses.replace(batch, events=kept))


class FollowerStopsApplying(HarnessFollower):
    """A router's follower that loads its snapshots but applies no change after
    one, and keeps answering: a consumer stuck while its copy looks in sync."""

    async def _on(self, ch: pb.WatchChange) -> None:
        if ch.WhichOneof("change") in ("snapshot", "synced", "resync"):
            await super()._on(ch)
