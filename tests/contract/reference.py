"""A deliberately naive index: the reference the backends are checked against.

Flat dictionaries, no incremental counters, Match recomputed per instance by
walking keys from 0. Written from the semantics in indexer/index.py, not from
either backend. ``BROKEN`` holds variants with one plausible bug each; the
property tests must catch every one of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from indexer.model import (
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    EventBatch,
    IndexDump,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
    Tier,
)
from kvmesh.blockkeys import chain_keys, namespace_seed
from kvmesh.errors import FailedPrecondition, NotFound


@dataclass
class _Inst:
    spec: InstanceSpec
    lease: float
    stale: bool = False
    seq: int | None = None
    ehs: dict[int, tuple[Namespace, int]] = field(default_factory=dict)
    #: Batches that count copies: (engine hash, tier bit) -> copies beyond the first.
    copies: dict[tuple[int, int], int] = field(default_factory=dict)


class ReferenceIndex:
    """Naive synchronous model of the index contract."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.inst: dict[InstanceId, _Inst] = {}
        # (instance, namespace, key) -> tier mask (never 0)
        self.entries: dict[tuple[InstanceId, Namespace, int], int] = {}

    # instances
    def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        now = self.clock()
        old = self.inst.get(spec.instance)
        reset = (
            old is None or old.spec.incarnation != spec.incarnation or old.spec.model != spec.model
        )
        if old is not None and reset:
            self.drop_entries(spec.instance)
        if reset:
            self.inst[spec.instance] = _Inst(spec, now + spec.lease_ttl_s)
        else:
            assert old is not None
            old.spec = spec
            old.lease = now + spec.lease_ttl_s
        return self.state(spec.instance), reset

    def state(self, iid: InstanceId) -> InstanceState:
        i = self.inst[iid]
        bits = sum(bin(m).count("1") for (j, _, _), m in self.entries.items() if j == iid)
        return InstanceState(i.spec, i.lease, i.lease > self.clock(), i.stale, i.seq, bits)

    def heartbeat(self, iid: InstanceId) -> InstanceState:
        if iid not in self.inst:
            raise NotFound("unknown", field="instance")
        self.inst[iid].lease = self.clock() + self.inst[iid].spec.lease_ttl_s
        return self.state(iid)

    def remove_instance(self, iid: InstanceId) -> int:
        if iid not in self.inst:
            raise NotFound("unknown", field="instance")
        n = self.drop_entries(iid)
        del self.inst[iid]
        return n

    def reap_expired(self) -> list[InstanceId]:
        now = self.clock()
        dead = sorted(i for i, v in self.inst.items() if v.lease <= now)
        for i in dead:
            self.drop_entries(i)
            del self.inst[i]
        return dead

    def drop_entries(self, iid: InstanceId) -> int:
        mine = [k for k in self.entries if k[0] == iid]
        n = sum(bin(self.entries.pop(k)).count("1") for k in mine)
        if iid in self.inst:
            self.inst[iid].ehs.clear()
            self.inst[iid].copies.clear()
        return n

    # events
    def apply(self, batch: EventBatch) -> ApplyResult:
        i = self.inst.get(batch.instance)
        if i is None:
            raise FailedPrecondition("unregistered", field="instance")
        i.lease = self.clock() + i.spec.lease_ttl_s
        if i.seq is not None and batch.sequence <= i.seq:
            return ApplyResult(BatchOutcome.DUPLICATE, i.seq, stale=i.stale)
        gap = i.seq is not None and batch.sequence > i.seq + 1
        stored = removed = orphaned = 0
        cleared = False
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                removed += self.drop_entries(batch.instance)
                cleared = True
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    tiers = list(Tier) if ev.tier is None else [ev.tier]
                    for t in tiers:
                        extra = i.copies.get((h, t.bit), 0) if batch.counts_copies else 0
                        if extra:
                            i.copies[(h, t.bit)] = extra - 1
                            if extra == 1:
                                del i.copies[(h, t.bit)]
                        else:
                            removed += self.remove_hash(batch.instance, h, t)
            elif isinstance(ev, BlockStored):
                s, r, o = self.store(batch.instance, ev, batch.counts_copies)
                stored, removed, orphaned = stored + s, removed + r, orphaned + o
        i.seq = batch.sequence
        i.stale = (i.stale or gap) and not cleared
        outcome = BatchOutcome.APPLIED_AFTER_GAP if gap else BatchOutcome.APPLIED
        return ApplyResult(outcome, i.seq, stored, removed, orphaned, i.stale)

    def keys_for(self, i: _Inst, ev: BlockStored) -> list[int] | None:
        ns = Namespace(i.spec.model, ev.lora_name)
        if ev.block_keys is not None:
            return list(ev.block_keys)
        if ev.parent_block_hash is None:
            parent = namespace_seed(ns.model, ns.lora_name)
        else:
            got = i.ehs.get(ev.parent_block_hash)
            if got is None or got[0] != ns:
                return None
            parent = got[1]
        return chain_keys(parent, ev.token_ids, ev.block_size)

    def store(
        self, iid: InstanceId, ev: BlockStored, counts_copies: bool = False
    ) -> tuple[int, int, int]:
        i = self.inst[iid]
        ns = Namespace(i.spec.model, ev.lora_name)
        keys = self.keys_for(i, ev)
        if keys is None:
            return 0, 0, len(ev.block_hashes)
        stored = removed = 0
        for h, k in zip(ev.block_hashes, keys, strict=False):
            if h in i.ehs and i.ehs[h] != (ns, k):
                removed += self.remove_hash(iid, h, None)
            i.ehs[h] = (ns, k)
            old = self.entries.get((iid, ns, k), 0)
            if not old & ev.tier.bit:
                stored += 1
            elif counts_copies:
                c = (h, ev.tier.bit)
                i.copies[c] = i.copies.get(c, 0) + 1
            self.entries[(iid, ns, k)] = old | ev.tier.bit
        return stored, removed, 0

    def remove_hash(self, iid: InstanceId, h: int, tier: Tier | None) -> int:
        i = self.inst[iid]
        if h not in i.ehs:
            return 0
        ns, k = i.ehs[h]
        old = self.entries.get((iid, ns, k), 0)
        new = 0 if tier is None else old & ~tier.bit
        for t in Tier:
            if old & t.bit and not new & t.bit:
                i.copies.pop((h, t.bit), None)
        if new:
            self.entries[(iid, ns, k)] = new
        else:
            self.entries.pop((iid, ns, k), None)
            del i.ehs[h]
        return bin(old).count("1") - bin(new).count("1")

    # reads
    def match(
        self, ns: Namespace, keys: Sequence[int], include_stale: bool = False
    ) -> list[InstanceMatch]:
        out = []
        now = self.clock()
        for iid, i in self.inst.items():
            if i.lease <= now or (i.stale and not include_stale):
                continue
            tiers = [0, 0, 0]
            d = 0
            while d < len(keys) and (iid, ns, keys[d]) in self.entries:
                mask = self.entries[(iid, ns, keys[d])]
                fastest = min(t for t in Tier if mask & t.bit)
                tiers[fastest.value - 1] += 1
                d += 1
            if d:
                out.append(InstanceMatch(iid, i.spec.address, d, *tiers, stale=i.stale))
        return sorted(out, key=lambda m: (-m.depth, m.instance.worker_id, m.instance.dp_rank))

    def dump(self) -> IndexDump:
        blocks: dict[Namespace, dict[int, dict[InstanceId, int]]] = {}
        for (iid, ns, k), m in self.entries.items():
            blocks.setdefault(ns, {}).setdefault(k, {})[iid] = m
        return IndexDump(
            blocks=blocks,
            engine_hashes={iid: dict(i.ehs) for iid, i in self.inst.items() if i.ehs},
            instances={iid: self.state(iid) for iid in self.inst},
        )


class _IgnoresGaps(ReferenceIndex):
    """Bug: a gap never marks the instance stale."""

    def apply(self, batch: EventBatch) -> ApplyResult:
        i = self.inst.get(batch.instance)
        if i is not None and i.seq is not None and batch.sequence > i.seq + 1:
            i.seq = batch.sequence - 1
        return super().apply(batch)


class _MatchCountsHoles(ReferenceIndex):
    """Bug: depth counts every held block of the query, gaps included."""

    def match(
        self, ns: Namespace, keys: Sequence[int], include_stale: bool = False
    ) -> list[InstanceMatch]:
        good = {m.instance: m for m in super().match(ns, keys, include_stale)}
        out = []
        for iid, m in good.items():
            extra = sum(1 for k in keys[m.depth :] if (iid, ns, k) in self.entries)
            out.append(
                InstanceMatch(
                    iid,
                    m.address,
                    m.depth + extra,
                    m.gpu_blocks + extra,
                    m.cpu_blocks,
                    m.disk_blocks,
                    m.stale,
                )
            )
        return sorted(out, key=lambda m: (-m.depth, m.instance.worker_id, m.instance.dp_rank))


class _RemoveIgnoresTier(ReferenceIndex):
    """Bug: removing a block from one tier drops it from every tier."""

    def remove_hash(self, iid: InstanceId, h: int, tier: Tier | None) -> int:
        return super().remove_hash(iid, h, None)


class _SeesExpired(ReferenceIndex):
    """Bug: Match does not hide instances whose lease has expired."""

    def match(
        self, ns: Namespace, keys: Sequence[int], include_stale: bool = False
    ) -> list[InstanceMatch]:
        saved = {iid: i.lease for iid, i in self.inst.items()}
        for i in self.inst.values():
            i.lease = float("inf")
        try:
            return super().match(ns, keys, include_stale)
        finally:
            for iid, lease in saved.items():
                self.inst[iid].lease = lease


BROKEN: dict[str, type[ReferenceIndex]] = {
    "ignores_gaps": _IgnoresGaps,
    "match_counts_holes": _MatchCountsHoles,
    "remove_ignores_tier": _RemoveIgnoresTier,
    "sees_expired": _SeesExpired,
}
