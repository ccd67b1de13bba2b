"""In-process index backend: the embedded default for a single replica.

Layout: per namespace a dict ``block key -> {instance: tier mask}``; per
instance its engine-hash map ``engine hash -> (namespace, key)``, which is also
the reverse index used to clear or remove the instance. Match walks the keys
in order and narrows the set of instances still holding the prefix, so its cost
is the number of (block, instance) pairs visited, never the size of the index.

Semantics are those of :mod:`indexer.index`. Every method runs to completion
without awaiting, so each is atomic on the event loop.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from indexer.errors import FailedPrecondition, NotFound
from indexer.index import Index
from indexer.model import (
    ALL_TIERS_MASK,
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
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
    NamespaceStats,
)
from kvmesh.blockkeys import chain_keys, namespace_seed

# Index of the fastest tier (0 gpu, 1 cpu, 2 disk) for each tier mask 1..7.
_FASTEST = (-1, 0, 1, 0, 2, 0, 1, 0)
# Number of bits set in each tier mask 0..7.
_POPCOUNT = (0, 1, 1, 2, 1, 2, 2, 3)


def _match_order(m: InstanceMatch) -> tuple[int, InstanceId]:
    return (-m.depth, m.instance)


@dataclass(slots=True)
class _Instance:
    spec: InstanceSpec
    lease_expires_at: float
    stale: bool = False
    applied_sequence: int | None = None
    bits: int = 0
    engine_hashes: dict[int, tuple[Namespace, int]] = field(default_factory=dict)


class MemoryIndex(Index):
    """The in-memory backend. ``clock`` returns seconds (tests pass a fake one)."""

    name = "memory"

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._instances: dict[InstanceId, _Instance] = {}
        self._blocks: dict[Namespace, dict[int, dict[InstanceId, int]]] = {}
        self._ns_pairs: dict[Namespace, int] = {}

    # -- instances -----------------------------------------------------------

    def _state(self, iid: InstanceId, inst: _Instance, now: float) -> InstanceState:
        return InstanceState(
            spec=inst.spec,
            lease_expires_at=inst.lease_expires_at,
            live=inst.lease_expires_at > now,
            stale=inst.stale,
            applied_sequence=inst.applied_sequence,
            blocks=inst.bits,
        )

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """Create or renew an instance (see :mod:`indexer.index`)."""
        now = self._clock()
        iid = spec.instance
        inst = self._instances.get(iid)
        reset = False
        if inst is None:
            inst = _Instance(spec=spec, lease_expires_at=now + spec.lease_ttl_s)
            self._instances[iid] = inst
            reset = True
        else:
            if inst.spec.incarnation != spec.incarnation or inst.spec.model != spec.model:
                self._clear(iid, inst)
                inst.stale = False
                inst.applied_sequence = None
                reset = True
            inst.spec = spec
            inst.lease_expires_at = now + spec.lease_ttl_s
        return self._state(iid, inst, now), reset

    async def heartbeat(self, instance: InstanceId) -> InstanceState:
        """Renew the lease; NotFound for an unknown instance."""
        inst = self._get(instance, NotFound)
        now = self._clock()
        inst.lease_expires_at = now + inst.spec.lease_ttl_s
        return self._state(instance, inst, now)

    async def remove_instance(self, instance: InstanceId) -> int:
        """Drop an instance and its blocks; return the entries dropped."""
        inst = self._get(instance, NotFound)
        removed = self._clear(instance, inst)
        del self._instances[instance]
        return removed

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """Registered instances, sorted by id."""
        now = self._clock()
        return [
            self._state(iid, inst, now)
            for iid, inst in sorted(self._instances.items())
            if not model or inst.spec.model == model
        ]

    async def reap_expired(self) -> list[InstanceId]:
        """Drop instances whose lease has expired."""
        now = self._clock()
        dead = [iid for iid, inst in self._instances.items() if inst.lease_expires_at <= now]
        for iid in dead:
            self._clear(iid, self._instances.pop(iid))
        return sorted(dead)

    def _get(self, iid: InstanceId, err: type[NotFound] | type[FailedPrecondition]) -> _Instance:
        inst = self._instances.get(iid)
        if inst is None:
            raise err(f"instance {iid} is not registered", field="instance")
        return inst

    # -- events --------------------------------------------------------------

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch (see :mod:`indexer.index`)."""
        iid = batch.instance
        inst = self._get(iid, FailedPrecondition)
        now = self._clock()
        inst.lease_expires_at = now + inst.spec.lease_ttl_s
        last = inst.applied_sequence
        seq = batch.sequence
        if last is not None and seq <= last:
            return ApplyResult(BatchOutcome.DUPLICATE, last, stale=inst.stale)
        gap = last is not None and seq > last + 1
        stored = removed = orphaned = 0
        cleared = False
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                s, r, o = self._store(iid, inst, ev)
                stored += s
                removed += r
                orphaned += o
            elif isinstance(ev, BlockRemoved):
                mask = ALL_TIERS_MASK if ev.tier is None else ev.tier.bit
                for h in ev.block_hashes:
                    removed += self._remove_hash(iid, inst, h, mask)
            elif isinstance(ev, AllBlocksCleared):
                removed += self._clear(iid, inst)
                cleared = True
        inst.applied_sequence = seq
        inst.stale = (inst.stale or gap) and not cleared
        outcome = BatchOutcome.APPLIED_AFTER_GAP if gap else BatchOutcome.APPLIED
        return ApplyResult(outcome, seq, stored, removed, orphaned, inst.stale)

    def _store(self, iid: InstanceId, inst: _Instance, ev: BlockStored) -> tuple[int, int, int]:
        ns = Namespace(inst.spec.model, ev.lora_name)
        if ev.block_keys is not None:
            keys: Sequence[int] = ev.block_keys
        else:
            if ev.parent_block_hash is None:
                parent = namespace_seed(ns.model, ns.lora_name)
            else:
                mapped = inst.engine_hashes.get(ev.parent_block_hash)
                if mapped is None or mapped[0] != ns:
                    return 0, 0, len(ev.block_hashes)
                parent = mapped[1]
            keys = chain_keys(parent, ev.token_ids, ev.block_size)
        table = self._blocks.setdefault(ns, {})
        bit = ev.tier.bit
        stored = removed = 0
        ehs = inst.engine_hashes
        for h, key in zip(ev.block_hashes, keys, strict=False):
            prev = ehs.get(h)
            if prev is not None and prev != (ns, key):
                removed += self._remove_hash(iid, inst, h, ALL_TIERS_MASK)
            ehs[h] = (ns, key)
            holders = table.get(key)
            if holders is None:
                holders = table[key] = {}
            old = holders.get(iid, 0)
            if not old & bit:
                if not old:
                    self._ns_pairs[ns] = self._ns_pairs.get(ns, 0) + 1
                holders[iid] = old | bit
                inst.bits += 1
                stored += 1
        return stored, removed, 0

    def _remove_hash(self, iid: InstanceId, inst: _Instance, h: int, mask: int) -> int:
        mapped = inst.engine_hashes.get(h)
        if mapped is None:
            return 0
        ns, key = mapped
        table = self._blocks.get(ns)
        holders = table.get(key) if table is not None else None
        old = holders.get(iid, 0) if holders is not None else 0
        new = old & ~mask
        cleared = _POPCOUNT[old] - _POPCOUNT[new]
        if holders is not None and table is not None and old:
            if new:
                holders[iid] = new
            else:
                del holders[iid]
                self._ns_pairs[ns] -= 1
                if not holders:
                    del table[key]
        if not new:
            del inst.engine_hashes[h]
        inst.bits -= cleared
        return cleared

    def _clear(self, iid: InstanceId, inst: _Instance) -> int:
        removed = 0
        for ns, key in inst.engine_hashes.values():
            table = self._blocks.get(ns)
            if table is None:
                continue
            holders = table.get(key)
            if holders is None:
                continue
            old = holders.pop(iid, 0)
            if old:
                removed += _POPCOUNT[old]
                self._ns_pairs[ns] -= 1
                if not holders:
                    del table[key]
        inst.engine_hashes.clear()
        inst.bits = 0
        return removed

    # -- reads ---------------------------------------------------------------

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        """Per-instance longest gap-free prefix of ``keys``, deepest first."""
        return self.match_sync(namespace, keys, include_stale=include_stale)

    def match_sync(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        """Synchronous :meth:`match`, for in-process callers and benchmarks."""
        table = self._blocks.get(namespace)
        if not table or not keys:
            return []
        first = table.get(keys[0])
        if not first:
            return []
        now = self._clock()
        instances = self._instances
        # instance -> [gpu, cpu, disk] blocks of the prefix held so far
        active: dict[InstanceId, list[int]] = {}
        for iid, mask in first.items():
            inst = instances[iid]
            if inst.lease_expires_at > now and (include_stale or not inst.stale):
                counts = [0, 0, 0]
                counts[_FASTEST[mask]] = 1
                active[iid] = counts
        done: list[tuple[InstanceId, list[int]]] = []
        for i in range(1, len(keys)):
            holders = table.get(keys[i])
            if holders is None:
                break
            for iid, counts in list(active.items()):
                held = holders.get(iid)
                if held is None:
                    done.append((iid, counts))
                    del active[iid]
                else:
                    counts[_FASTEST[held]] += 1
            if not active:
                break
        done.extend(active.items())
        out = []
        for iid, (g, c, d) in done:
            inst = instances[iid]
            out.append(InstanceMatch(iid, inst.spec.address, g + c + d, g, c, d, inst.stale))
        out.sort(key=_match_order)
        return out

    async def stats(self) -> IndexStats:
        """Sizes of the whole index."""
        now = self._clock()
        st = IndexStats(backend=self.name, instances=len(self._instances))
        for inst in self._instances.values():
            st.instances_live += inst.lease_expires_at > now
            st.instances_stale += inst.stale
        for ns, table in sorted(self._blocks.items(), key=lambda kv: str(kv[0])):
            if not table:
                continue
            pairs = self._ns_pairs.get(ns, 0)
            st.namespaces.append(NamespaceStats(ns, len(table), pairs))
            st.blocks += len(table)
            st.block_instances += pairs
        return st

    async def dump(self) -> IndexDump:
        """The whole content in canonical form."""
        now = self._clock()
        blocks = {
            ns: {k: dict(h) for k, h in table.items()}
            for ns, table in self._blocks.items()
            if table
        }
        return IndexDump(
            blocks=blocks,
            engine_hashes={
                iid: dict(inst.engine_hashes)
                for iid, inst in self._instances.items()
                if inst.engine_hashes
            },
            instances={
                iid: replace(self._state(iid, inst, now)) for iid, inst in self._instances.items()
            },
        )
