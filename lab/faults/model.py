"""The reference model of the fault harness: what a fleet of replicas must answer.

Three parts, all plain synchronous Python written from the contracts
(``indexer/index.py``, ``indexer/CONSISTENCY.md``, ``indexer/sglang/compat.py``),
not from either backend:

- :class:`IndexModel`: the index contract on flat dictionaries, the same
  semantics as ``tests/contract/reference.py`` (``tests/faults`` checks that
  the two agree on random operation sequences) with per-instance entries so
  that a long run stays fast. Leases are judged by the caller's ``now``.
- :class:`History`: every instance's *identity* (registered, address, stale
  flag, lease expiry, model) as a list of versions stamped with
  ``time.monotonic()``: when the write that made a version was sent and when
  the write that replaced it was acknowledged. A replica may answer from any
  version that was current within its lag bound (CONSISTENCY.md), and from
  none older than its own last write.
- :class:`FleetModel`: both, plus the fleet-level rules: SGLang workers
  (epochs, ``enforce_sequence``, restarted streams), what a fault may
  legitimately lose (a Redis restarted empty loses everything; a restarted
  memory replica loses its whole index) and the ZMQ engines' own view of
  their caches (:class:`EngineTruth`), against which a ZMQ-fed instance is
  checked (exactly, or as a subset after a loss replay could not fill).

Unacknowledged calls are not modelled as forks: the driver retries every
call that failed until it is acknowledged (the same request, so a batch
comes back DUPLICATE or APPLIED), after which the model holds exactly one
state again.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from indexer.model import (
    ALL_TIERS_MASK,
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
    Tier,
)
from indexer.sglang.compat import INCARNATION_PREFIX, epoch_of
from kvmesh.blockkeys import chain_keys, namespace_seed
from kvmesh.errors import FailedPrecondition, NotFound

_POP = (0, 1, 1, 2, 1, 2, 2, 3)

#: Versions of an instance's identity older than this (seconds past their end)
#: are dropped: far beyond any lag bound the harness allows, so a long run's
#: history stays small.
HISTORY_KEEP_S = 30.0


def fastest(mask: int) -> int:
    """Index (0 gpu, 1 cpu, 2 disk) of the fastest tier in a non-zero tier mask."""
    for t in Tier:
        if mask & t.bit:
            return t.value - 1
    raise ValueError("empty tier mask")


@dataclass
class MInstance:
    """One instance as the contract says it is."""

    spec: InstanceSpec
    exp: float
    stale: bool = False
    seq: int | None = None
    #: engine hash -> (namespace, content key)
    ehs: dict[int, tuple[Namespace, int]] = field(default_factory=dict)
    #: (namespace, content key) -> tier mask (never 0)
    entries: dict[tuple[Namespace, int], int] = field(default_factory=dict)

    def bits(self) -> int:
        """(block, tier) bits held (``InstanceState.blocks``)."""
        return sum(_POP[m] for m in self.entries.values())

    def state(self, now: float) -> InstanceState:
        """The instance as register / ListInstances report it."""
        return InstanceState(self.spec, self.exp, self.exp > now, self.stale, self.seq, self.bits())


class IndexModel:
    """The index contract (indexer/index.py) for one shared index, judged at ``now``."""

    def __init__(self) -> None:
        self.inst: dict[InstanceId, MInstance] = {}

    # -- instances -------------------------------------------------------------

    def register(self, spec: InstanceSpec, now: float) -> tuple[InstanceState, bool]:
        """Create, renew or reset (another incarnation or model) an instance."""
        old = self.inst.get(spec.instance)
        reset = (
            old is None or old.spec.incarnation != spec.incarnation or old.spec.model != spec.model
        )
        if reset:
            self.inst[spec.instance] = MInstance(spec, now + spec.lease_ttl_s)
        else:
            assert old is not None
            old.spec = spec
            old.exp = now + spec.lease_ttl_s
        return self.inst[spec.instance].state(now), reset

    def heartbeat(self, iid: InstanceId, now: float) -> InstanceState:
        """Renew a lease; NotFound for an unknown instance."""
        i = self.inst.get(iid)
        if i is None:
            raise NotFound(f"instance {iid} is not registered", field="instance")
        i.exp = now + i.spec.lease_ttl_s
        return i.state(now)

    def remove(self, iid: InstanceId) -> int:
        """Drop an instance; the (key, tier) bits it held. NotFound when unknown."""
        i = self.inst.pop(iid, None)
        if i is None:
            raise NotFound(f"instance {iid} is not registered", field="instance")
        return i.bits()

    def reap(self, now: float) -> list[InstanceId]:
        """Drop every instance whose lease has expired."""
        dead = sorted(iid for iid, i in self.inst.items() if i.exp <= now)
        for iid in dead:
            del self.inst[iid]
        return dead

    def clear_all(self) -> list[InstanceId]:
        """Everything gone (a Redis restarted empty); the instances that were there."""
        gone = sorted(self.inst)
        self.inst.clear()
        return gone

    # -- events ----------------------------------------------------------------

    def apply(self, batch: EventBatch, now: float) -> ApplyResult:
        """Apply one batch (FailedPrecondition for an unregistered instance)."""
        i = self.inst.get(batch.instance)
        if i is None:
            raise FailedPrecondition(f"instance {batch.instance} is not registered")
        i.exp = now + i.spec.lease_ttl_s
        if i.seq is not None and batch.sequence <= i.seq:
            return ApplyResult(BatchOutcome.DUPLICATE, i.seq, stale=i.stale)
        gap = i.seq is not None and batch.sequence > i.seq + 1
        stored = removed = orphaned = 0
        cleared = False
        for ev in batch.events:
            if isinstance(ev, AllBlocksCleared):
                removed += i.bits()
                i.entries.clear()
                i.ehs.clear()
                cleared = True
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    removed += self._remove_hash(i, h, ev.tier)
            else:
                s, r, o = self._store(i, ev)
                stored, removed, orphaned = stored + s, removed + r, orphaned + o
        i.seq = batch.sequence
        i.stale = (i.stale or gap) and not cleared
        outcome = BatchOutcome.APPLIED_AFTER_GAP if gap else BatchOutcome.APPLIED
        return ApplyResult(outcome, i.seq, stored, removed, orphaned, i.stale)

    @staticmethod
    def _keys(i: MInstance, ev: BlockStored) -> list[int] | None:
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

    def _store(self, i: MInstance, ev: BlockStored) -> tuple[int, int, int]:
        ns = Namespace(i.spec.model, ev.lora_name)
        keys = self._keys(i, ev)
        if keys is None:
            return 0, 0, len(ev.block_hashes)
        stored = removed = 0
        for h, k in zip(ev.block_hashes, keys, strict=False):
            if h in i.ehs and i.ehs[h] != (ns, k):
                removed += self._remove_hash(i, h, None)
            i.ehs[h] = (ns, k)
            old = i.entries.get((ns, k), 0)
            if not old & ev.tier.bit:
                stored += 1
            i.entries[(ns, k)] = old | ev.tier.bit
        return stored, removed, 0

    @staticmethod
    def _remove_hash(i: MInstance, h: int, tier: Tier | None) -> int:
        got = i.ehs.get(h)
        if got is None:
            return 0
        old = i.entries.get(got, 0)
        new = 0 if tier is None else old & ~tier.bit
        if new:
            i.entries[got] = new
        else:
            i.entries.pop(got, None)
            del i.ehs[h]
        return _POP[old] - _POP[new]

    # -- reads -----------------------------------------------------------------

    def depth(self, iid: InstanceId, ns: Namespace, keys: Sequence[int]) -> tuple[int, int, int]:
        """(gpu, cpu, disk) counts of the gap-free prefix of ``keys`` that ``iid`` holds."""
        i = self.inst.get(iid)
        tiers = [0, 0, 0]
        if i is None:
            return (0, 0, 0)
        for k in keys:
            mask = i.entries.get((ns, k))
            if not mask:
                break
            tiers[fastest(mask)] += 1
        return (tiers[0], tiers[1], tiers[2])

    def match(
        self, ns: Namespace, keys: Sequence[int], now: float, include_stale: bool = False
    ) -> list[InstanceMatch]:
        """Every live holder of ``keys[0]`` with its depth, deepest first."""
        out = []
        for iid, i in self.inst.items():
            if i.exp <= now or (i.stale and not include_stale):
                continue
            g, c, d = self.depth(iid, ns, keys)
            if g + c + d:
                out.append(InstanceMatch(iid, i.spec.address, g + c + d, g, c, d, i.stale))
        return sorted(out, key=lambda m: (-m.depth, m.instance))

    def blocks(self) -> dict[Namespace, dict[int, dict[InstanceId, int]]]:
        """``blocks[ns][key][instance] = tier mask`` (DumpIndex's content)."""
        out: dict[Namespace, dict[int, dict[InstanceId, int]]] = {}
        for iid, i in self.inst.items():
            for (ns, k), m in i.entries.items():
                out.setdefault(ns, {}).setdefault(k, {})[iid] = m
        return out

    def namespace_sizes(self) -> dict[Namespace, tuple[int, int]]:
        """Namespace -> (block keys with a holder, (key, instance) entries)."""
        keys: dict[Namespace, set[int]] = {}
        pairs: dict[Namespace, int] = {}
        for i in self.inst.values():
            for ns, k in i.entries:
                keys.setdefault(ns, set()).add(k)
                pairs[ns] = pairs.get(ns, 0) + 1
        return {ns: (len(ks), pairs[ns]) for ns, ks in keys.items()}


# -- identity history (replica lag) --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Identity:
    """What a Match answer may say about an instance besides its blocks."""

    registered: bool
    address: str = ""
    stale: bool = False
    exp: float = 0.0
    model: str = ""

    def visible(self, now: float, include_stale: bool) -> bool:
        """Whether Match may name the instance (registered, lease running, fresh)."""
        return self.registered and self.exp > now and (include_stale or not self.stale)


GONE = Identity(False)


#: Attributes of an identity a write may set: ``life`` (registered and lease),
#: ``address``, ``stale``. A replica answers its own writes of an attribute
#: at once; what other replicas wrote, within the lag bound.
ATTRIBUTES = frozenset({"life", "address", "stale"})


@dataclass(slots=True)
class Version:
    """One identity of an instance and when it was current (``time.monotonic()``)."""

    ident: Identity
    #: When the write that made it was sent (it may be served from then on).
    start: float
    #: When the write that replaced it was acknowledged (``inf``: still current).
    end: float = math.inf
    #: The replica whose write made it (None: a fault, or a write of no replica).
    writer: int | None = None
    #: The attributes that write set (its replica answers them from now on).
    wrote: frozenset[str] = ATTRIBUTES


class History:
    """Each instance's identity versions (see the module docstring)."""

    def __init__(self) -> None:
        self.versions: dict[InstanceId, list[Version]] = {}

    def current(self, iid: InstanceId) -> Identity:
        """The identity the model holds now."""
        vs = self.versions.get(iid)
        return vs[-1].ident if vs else GONE

    def note(
        self,
        iid: InstanceId,
        ident: Identity,
        sent: float,
        acked: float,
        writer: int | None,
        wrote: frozenset[str] = ATTRIBUTES,
    ) -> None:
        """Record the identity after a write sent at ``sent`` and acknowledged at ``acked``.

        A write that changes nothing still counts as the writer's own write of
        ``wrote`` (its replica must answer those from it or something newer).
        """
        vs = self.versions.setdefault(iid, [])
        if vs and vs[-1].ident == ident:
            if writer is not None:
                vs[-1].end = acked
                vs.append(Version(ident, sent, writer=writer, wrote=wrote))
            return
        if vs:
            vs[-1].end = acked
        elif not ident.registered:
            return
        vs.append(Version(ident, sent, writer=writer, wrote=wrote))
        cutoff = acked - HISTORY_KEEP_S
        while len(vs) > 1 and vs[0].end < cutoff:
            vs.pop(0)

    def admissible(
        self, iid: InstanceId, replica: int, t0: float, t1: float, lag: float, attr: str
    ) -> list[Identity]:
        """Identities whose ``attr`` replica ``replica`` may answer for a request sent
        at ``t0`` and answered at ``t1``: current at some time in ``[t0 - lag, t1]``,
        and none older than the replica's own last write of ``attr`` before ``t0``.

        An unregistered identity is admissible only while it is current: a new
        instance is visible to every replica at once (indexer/CONSISTENCY.md).
        """
        vs = self.versions.get(iid)
        if not vs:
            return [GONE]
        own = -1
        for j, v in enumerate(vs):
            if v.writer == replica and v.start < t0 and attr in v.wrote:
                own = j
        out: list[Identity] = []
        for j, v in enumerate(vs):
            if j < own:
                continue
            bound = lag if v.ident.registered else 0.0
            if v.start <= t1 and v.end >= t0 - bound:
                out.append(v.ident)
        return out or [vs[-1].ident]


# -- SGLang workers -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SgResult:
    """What ApplyExternalKvBatch answers: ``(applied_seq, duplicate)``."""

    applied_seq: int
    duplicate: bool


# -- ZMQ engines ------------------------------------------------------------------------


class EngineTruth:
    """A ZMQ engine's own cache: the index contract applied to its whole stream.

    Besides the cache, what the index must hold for the engine's instance
    (indexer/CONSISTENCY.md, "ZMQ-fed instances"):

    - ``lost``: batches the subscriber needed were gone from the replay buffer
      since the last reset point (a clear, a publisher restart, a rebuild
      from a complete buffer). Not lost: the index holds exactly this cache.
      Lost: with ``on_unrecoverable_gap=reset`` a subset of it, fresh; with
      ``stale``, anything, but the instance is stale (``must_be_stale``).
    - ``pending``: the sequence the subscriber will replay from at the engine's
      next batch (0: it rebuilds the instance, because the index lost it —
      Redis restarted empty, reaped, removed, a memory replica restarted — or
      it meets the stream for the first time). Settled by :meth:`replay_from`
      once that batch is sent, against the replay buffer as it is then.
    """

    def __init__(self, iid: InstanceId, model: str, policy: str = "reset") -> None:
        self.iid = iid
        self.model = model
        self.policy = policy
        self.index = IndexModel()
        self.seq = -1
        self.lost = False
        self.must_be_stale = False
        self.pending: int | None = None
        self.restart()

    def apply(self, events: Sequence[Event]) -> None:
        """Apply the engine's next batch.

        An engine's stream stores each physical copy of a block (vLLM): the
        engine holds a (block, tier) while more stores than removals of it
        came, and the index must drop it only then (indexer/groups.py).
        """
        self.seq += 1
        out: list[Event] = []
        for ev in events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    self.copies[(h, ev.tier)] += 1
                out.append(ev)
            elif isinstance(ev, BlockRemoved):
                tiers = list(Tier) if ev.tier is None else [ev.tier]
                gone = []
                for h in ev.block_hashes:
                    last = False
                    for t in tiers:
                        n = self.copies.get((h, t), 0)
                        if n <= 1:
                            self.copies.pop((h, t), None)
                            last = True
                        else:
                            self.copies[(h, t)] = n - 1
                    if last:
                        gone.append(h)
                out.append(replace(ev, block_hashes=tuple(gone)))
            else:
                self.copies.clear()
                out.append(ev)
        self.index.apply(EventBatch(self.iid, self.seq, tuple(out)), 0.0)
        if any(isinstance(e, AllBlocksCleared) for e in events):
            # A clear is a reset point: the index drops everything too and is
            # fresh again (what follows is a full replay of the cache).
            self.lost = self.must_be_stale = False

    def restart(self) -> None:
        """A restarted engine: an empty cache and a stream from sequence 0."""
        self.copies: Counter[tuple[int, Tier]] = Counter()
        self.index = IndexModel()
        self.index.register(InstanceSpec(self.iid, self.model, lease_ttl_s=math.inf), 0.0)
        self.seq = -1
        self.lost = self.must_be_stale = False
        self.pending = None

    def replay_from(self, needed: int, buffer_start: int, clear_replayed: bool) -> None:
        """The subscriber replayed from ``needed`` a buffer that starts at ``buffer_start``
        (``clear_replayed``: a batch it replayed holds a clear).

        ``needed`` 0 is a rebuild: a complete buffer makes the index exact
        again. Otherwise what the buffer lacks is lost; with policy ``stale``
        the instance is then stale, except when only batch 0 of a stream is
        lost (the index has no earlier sequence to see a gap from: the
        subscriber's documented exception). A replayed clear is a reset point
        either way.
        """
        if clear_replayed or buffer_start <= needed:
            if clear_replayed or needed == 0:
                self.lost = self.must_be_stale = False
            return
        self.lost = True
        only_first = needed == 0 and buffer_start == 1
        if self.policy == "stale" and not only_first:
            self.must_be_stale = True

    def index_lost(self) -> None:
        """The index lost the instance: its next batch makes the subscriber rebuild it."""
        self.pending = 0

    def entries(self) -> dict[tuple[Namespace, int], int]:
        """(namespace, key) -> tier mask the engine holds."""
        return dict(self.index.inst[self.iid].entries)


# -- the fleet --------------------------------------------------------------------------


class FleetModel:
    """The whole fleet as the contract says it is: index, identity history, SGLang rules."""

    def __init__(self, sglang_model: str, sglang_ttl_s: float) -> None:
        self.index = IndexModel()
        self.history = History()
        self.sglang_model = sglang_model
        self.sglang_ttl_s = sglang_ttl_s
        self._incarnations = 0
        #: Instances fed by ZMQ subscribers: checked against their engines' truth
        #: instead of this model (their writes happen in the background).
        self.zmq: dict[InstanceId, EngineTruth] = {}

    # -- identity bookkeeping ----------------------------------------------------

    def identity(self, iid: InstanceId) -> Identity:
        """The identity the index holds now."""
        i = self.index.inst.get(iid)
        if i is None:
            return GONE
        return Identity(True, i.spec.address, i.stale, i.exp, i.spec.model)

    def note(
        self,
        iids: Iterable[InstanceId],
        sent: float,
        acked: float,
        writer: int | None,
        wrote: frozenset[str] = ATTRIBUTES,
    ) -> None:
        """Record the identities of ``iids`` after a write of ``wrote`` by ``writer``."""
        for iid in iids:
            if iid not in self.zmq:
                self.history.note(iid, self.identity(iid), sent, acked, writer, wrote)

    def lose_everything(self, when: float) -> list[InstanceId]:
        """A Redis restarted empty (or a memory replica restarted): nothing is left."""
        gone = self.index.clear_all()
        for iid in list(self.history.versions):
            self.history.note(iid, GONE, when, when, None)
        return gone

    # -- SGLang (indexer/sglang/compat.py's contract, fleet-wide) ------------------

    def new_incarnation(self, epoch: str) -> str:
        """A fresh SGLang incarnation for ``epoch`` (its nonce is a counter here)."""
        self._incarnations += 1
        return f"{INCARNATION_PREFIX}{epoch}/m{self._incarnations}"

    def _sg_register(self, worker: str, address: str, incarnation: str, now: float) -> None:
        spec = InstanceSpec(
            InstanceId(worker, 0), self.sglang_model, address, self.sglang_ttl_s, incarnation
        )
        self.index.register(spec, now)

    def sg_epoch(self, worker: str) -> str | None:
        """The epoch of a worker fed through the SGLang API (None: none, or not one of its)."""
        i = self.index.inst.get(InstanceId(worker, 0))
        return None if i is None else epoch_of(i.spec.incarnation)

    def sg_apply(
        self,
        worker: str,
        seq: int,
        events: tuple[Event, ...],
        address: str,
        epoch: str,
        enforce: bool,
        now: float,
    ) -> SgResult:
        """ApplyExternalKvBatch; raises FailedPrecondition as the API does."""
        iid = InstanceId(worker, 0)
        w = self.index.inst.get(iid)
        cur = None if w is None else epoch_of(w.spec.incarnation)
        if enforce:
            if w is None or not epoch or cur != epoch:
                raise FailedPrecondition("no snapshot for this epoch", field="worker_epoch")
            if w.spec.address != address:
                self._sg_register(worker, address, w.spec.incarnation, now)
        elif w is None or (epoch and cur != epoch):
            self._sg_register(worker, address, self.new_incarnation(epoch), now)
        elif w.spec.address != address:
            self._sg_register(worker, address, w.spec.incarnation, now)
        batch = EventBatch(iid, seq, events)
        result = self.index.apply(batch, now)
        if result.outcome is BatchOutcome.DUPLICATE:
            if seq == 0 and result.applied_sequence > 0 and not enforce:
                self._sg_register(worker, address, self.new_incarnation(epoch), now)
                result = self.index.apply(batch, now)
                return SgResult(result.applied_sequence, False)
            self.index.heartbeat(iid, now)
            return SgResult(result.applied_sequence, True)
        if result.outcome is BatchOutcome.APPLIED_AFTER_GAP and enforce:
            self._sg_register(worker, address, self.new_incarnation(""), now)
            raise FailedPrecondition("sequence gap: cleared until a new snapshot", field="seq")
        return SgResult(result.applied_sequence, False)

    def sg_snapshot(
        self,
        worker: str,
        address: str,
        epoch: str,
        seq: int,
        events: tuple[Event, ...],
        now: float,
    ) -> int:
        """ReplaceExternalKvSnapshot: a fresh incarnation, then the snapshot as its first batch."""
        self._sg_register(worker, address, self.new_incarnation(epoch), now)
        return self.index.apply(
            EventBatch(InstanceId(worker, 0), seq, events), now
        ).applied_sequence

    def sg_configure(self, workers: Sequence[tuple[str, str]], now: float) -> tuple[int, int]:
        """ConfigureExpectedWorkers: register the listed, remove unlisted SGLang-fed workers."""
        ours = {
            iid.worker_id: i
            for iid, i in self.index.inst.items()
            if i.spec.model == self.sglang_model
            and iid.dp_rank == 0
            and epoch_of(i.spec.incarnation) is not None
        }
        ready = 0
        for wid, address in workers:
            old = ours.get(wid)
            inc = old.spec.incarnation if old is not None else self.new_incarnation("")
            addr = address or (old.spec.address if old is not None else "")
            self._sg_register(wid, addr, inc, now)
            st = self.index.inst[InstanceId(wid, 0)].state(now)
            if st.live and not st.stale and st.applied_sequence is not None:
                ready += 1
        listed = {w for w, _ in workers}
        for wid in ours:
            if wid not in listed:
                self.index.remove(InstanceId(wid, 0))
        return len(workers), ready


def same_incarnation(model_inc: str, got_inc: str) -> bool:
    """Whether an incarnation the index reports is the one the model holds.

    SGLang-made incarnations carry a random nonce in the service and a counter
    here: only their epochs can be compared.
    """
    if model_inc.startswith(INCARNATION_PREFIX):
        return epoch_of(model_inc) == epoch_of(got_inc)
    return model_inc == got_inc


def entries_of(
    blocks: dict[Namespace, dict[int, dict[InstanceId, int]]], iid: InstanceId
) -> dict[tuple[Namespace, int], int]:
    """One instance's entries out of a dump's ``blocks``."""
    out: dict[tuple[Namespace, int], int] = {}
    for ns, table in blocks.items():
        for k, holders in table.items():
            m = holders.get(iid)
            if m:
                out[(ns, k)] = m
    return out


def spec_with(spec: InstanceSpec, **changes: object) -> InstanceSpec:
    """``spec`` with fields replaced (typed shorthand for dataclasses.replace)."""
    return replace(spec, **changes)  # type: ignore[arg-type]


__all__ = [
    "ALL_TIERS_MASK",
    "ATTRIBUTES",
    "GONE",
    "EngineTruth",
    "FleetModel",
    "History",
    "Identity",
    "IndexModel",
    "MInstance",
    "SgResult",
    "Version",
    "entries_of",
    "fastest",
    "same_incarnation",
    "spec_with",
]
