"""SGLang's external KV indexer API on the kvmesh index: the logic, no grpc.

indexer/sglang/server.py converts ``kv_indexer.v1`` messages to the types
here and calls :class:`SglangCompat`, which works through the same
:class:`~indexer.logic.IndexerLogic` (validation, caps, counters) and the
same index as ``kvmesh.indexer.v1``.

Mapping:

- A worker is the instance ``(worker_id, dp_rank 0)`` in the namespace
  ``sglang.model`` (the API names no model). Hashes are SGLang's block hashes,
  used as block keys as they are (signed 64-bit on the wire, unsigned in the
  index), so the router's hashes of a prompt match the engine's.
- Tiers: HBM → GPU, DRAM → CPU, SSD → DISK.
- REPORT → ``BlockStored`` with ``block_keys`` = the hashes; REVOKE →
  ``BlockRemoved`` on that tier; CLEAR_ALL_AT_TIER → ``AllBlocksCleared``: the
  index has no per-tier clear, so clearing any tier clears the worker on every
  tier (under-reporting a hit is safe; SGLang's bridge clears all three tiers
  together anyway).
- Hybrid workers (a ``WorkerCacheSpec`` with SWA or Mamba components): each
  component a REPORT names is kept in a namespace of its own
  (``component:full`` / ``:swa`` / ``:mamba``, the page's hash as its key,
  a hash derived from it as the engine hash), and prefix matches apply
  SGLang's component rule (indexer/sglang/components.py). The spec is kept in
  the worker's incarnation, so every replica reads it; another spec resets the
  worker. Cost: their prefix match adds one lookup per page of the deepest
  FULL prefix for each of SWA and Mamba (run at once). A worker without a
  spec is legacy: pages count whole, and component masks are refused.
- Workers fed through this API carry an incarnation ``sglang/<epoch>/<nonce>``;
  a new ``worker_epoch`` resets the worker, and ConfigureExpectedWorkers only
  ever removes workers with such an incarnation (never a ZMQ-fed or
  kvmesh-API instance sharing the namespace).

Sequences (``seq``), with duplicate detection in every mode:

- ``seq`` at or below the last applied one is a duplicate: acknowledged with
  ``duplicate`` and not applied again — except ``seq`` 0 after a higher
  sequence without ``enforce_sequence``, which is a restarted event stream
  (publishers count from 0): the worker is reset and the batch applied.
- ``enforce_sequence``: the worker must hold a snapshot installed by
  ReplaceExternalKvSnapshot under the same ``worker_epoch``
  (FAILED_PRECONDITION otherwise), and a gap clears the worker and answers
  FAILED_PRECONDITION until a new snapshot is installed.
- Without it, a gap is applied and marks the worker stale, kvmesh's rule
  (indexer/index.py): stale workers are left out of prefix matches until a
  snapshot or a clear resyncs them.

Across replicas: each replica caches the registrations of the workers it
feeds (epoch, address) and reads them again from the index whenever a request
disagrees with the cache (another epoch or address: another replica may have
installed a snapshot or moved the worker meanwhile), after a batch finds the
worker gone, and at least every :data:`SPEC_CACHE_TTL_S`. A worker is reset
only when the index, not the cache, says its epoch differs. A batch that names
an epoch or enforces its sequence is fenced with the incarnation the replica
believes (``EventBatch.incarnation``, checked in the apply's own step): when
another replica re-registered the worker meanwhile (a snapshot, a removal by
ConfigureExpectedWorkers and a registration without epoch) the index refuses
it, and the request is judged again on the registration read anew. Every
batch is fenced with the address its request names too, so a replica whose
cache still holds that address does not skip the move another made.

Hit counters (GetExternalKvHitCounts) count, per hash, the prefix matches
that found it (every hash of ``hashes[0..best_prefix_blocks)``) and the
MatchExternalKv lookups with ``count_as_hit`` that found it. They are this
replica's, not shared between replicas, and bounded by
``sglang.max_hit_counters`` (oldest hash dropped first).
"""

from __future__ import annotations

import asyncio
import enum
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from indexer.config import SglangApiSettings
from indexer.logic import MAX_ADDRESS_BYTES, IndexerLogic, check_instance
from indexer.model import (
    AllBlocksCleared,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    InstanceId,
    InstanceSpec,
    InstanceState,
    MatchQuery,
    Namespace,
    Tier,
)
from indexer.sglang.components import (
    COMPONENT_FULL,
    COMPONENT_MAMBA,
    COMPONENT_SWA,
    COMPONENTS,
    CacheSpec,
    component_hash,
    prefix_blocks,
)
from kvmesh.errors import FailedPrecondition, InvalidArgument

#: The LoRA-name prefix of the namespaces holding hybrid workers' components
#: (``component:full``, ``component:swa``, ``component:mamba``).
COMPONENT_NS_PREFIX = "component:"
#: Fields of the fences a batch carries (EventBatch.incarnation, .address).
_FENCES = ("incarnation", "address")
#: Incarnation prefix of workers fed through this API.
INCARNATION_PREFIX = "sglang/"
#: Seconds a cached worker registration is believed when the request agrees
#: with it. Another replica may install a snapshot under a new epoch at any
#: time; a request naming another epoch or address rereads at once, and this
#: bounds how long a replica can take an old epoch's batch for the current
#: one. One reread (list_instances of the namespace) renews every worker, so
#: a busy replica costs one a second. It is also the least time between two
#: rereads for one worker's disagreeing requests (a bridge that keeps sending
#: an old epoch costs one a second).
SPEC_CACHE_TTL_S = 1.0


class ActionKind(enum.Enum):
    """Kind of one batch action."""

    REPORT = "report"
    REVOKE = "revoke"
    CLEAR = "clear"


@dataclass(frozen=True, slots=True)
class Action:
    """One action: ``hashes`` are unsigned 64-bit block keys.

    ``component_masks`` and ``block_sizes`` (REPORT only): none, or one per
    hash (indexer/sglang/components.py); ``path`` names the action in errors.
    """

    kind: ActionKind
    tier: Tier
    hashes: tuple[int, ...] = ()
    component_masks: tuple[int, ...] = ()
    block_sizes: tuple[int, ...] = ()
    path: str = "actions"


@dataclass(frozen=True, slots=True)
class ApplyRequest:
    """ApplyExternalKvBatch in domain form."""

    worker_id: str
    seq: int
    actions: tuple[Action, ...]
    worker_address: str = ""
    worker_epoch: str = ""
    enforce_sequence: bool = False
    #: The worker's WorkerCacheSpec; None: not sent (the registered one holds).
    cache_spec: CacheSpec | None = None


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """One worker's contiguous prefix."""

    worker_address: str
    matched_prefix_blocks: int
    worker_id: str


@dataclass(frozen=True, slots=True)
class PrefixResult:
    """MatchExternalKvPrefix in domain form."""

    matches: list[PrefixMatch]
    best_prefix_blocks: int
    blocks_read: int


@dataclass(slots=True)
class NodeMatch:
    """MatchExternalKv: which of the hashes one worker holds, by (fastest) tier, each
    with the components held there (0: a whole page, no component detail)."""

    worker_id: str
    address: str
    by_tier: dict[Tier, dict[int, int]] = field(default_factory=dict)


def make_incarnation(epoch: str, spec: CacheSpec | None = None) -> str:
    """A fresh incarnation for ``epoch`` (the nonce makes each one reset the worker),
    carrying the worker's cache spec, so that every replica reads it with the worker."""
    tail = f"+{spec.encode()}" if spec is not None else ""
    return f"{INCARNATION_PREFIX}{epoch}/{uuid.uuid4().hex[:8]}{tail}"


def epoch_of(incarnation: str) -> str | None:
    """The epoch in an incarnation made here; None for any other incarnation."""
    if not incarnation.startswith(INCARNATION_PREFIX):
        return None
    return incarnation[len(INCARNATION_PREFIX) :].rpartition("/")[0]


def spec_of(incarnation: str) -> CacheSpec | None:
    """The cache spec an incarnation made here carries; None: a legacy worker."""
    if not incarnation.startswith(INCARNATION_PREFIX):
        return None
    _, plus, text = incarnation.rpartition("/")[2].partition("+")
    return CacheSpec.decode(text) if plus else None


class SglangCompat:
    """The six ``kv_indexer.v1.KVIndexer`` calls on an :class:`IndexerLogic`.

    Used from the server's event loop. Holds a per-replica cache of the
    registrations of workers it feeds (worker id -> spec and when it was
    read), reread from the index on a miss, on a disagreement and after
    :data:`SPEC_CACHE_TTL_S` (see the module docstring), and the hit counters.
    """

    def __init__(self, logic: IndexerLogic, settings: SglangApiSettings) -> None:
        self.logic = logic
        self.settings = settings
        self.namespace = Namespace(settings.model, "")
        #: Where each component of hybrid workers' pages is kept (one namespace each).
        self.component_ns = {
            bit: Namespace(settings.model, f"{COMPONENT_NS_PREFIX}{label}")
            for bit, label in COMPONENTS
        }
        self.hit_counts: dict[int, int] = {}
        self._specs: dict[str, tuple[InstanceSpec, float]] = {}
        # The reread of the namespace in flight, shared by concurrent callers,
        # and when it started (monotonic).
        self._reload: asyncio.Task[None] | None = None
        self._reload_started = float("-inf")
        # Monotonic time of the last reread of every worker (-inf: never).
        self._read_at = float("-inf")

    # -- workers -------------------------------------------------------------

    async def _read_workers(self) -> None:
        """Reread every worker of the namespace from the index (the cache becomes that)."""
        started = time.monotonic()
        states = await self.logic.list_instances(self.namespace.model)
        specs = {
            st.spec.instance.worker_id: (st.spec, started)
            for st in states
            if st.spec.instance.dp_rank == 0
        }
        # A registration made here while the listing was in flight is newer.
        for wid, (spec, at) in self._specs.items():
            if at > started:
                specs[wid] = (spec, at)
        if started >= self._read_at:  # an older reread that ends later changes nothing
            self._specs = specs
            self._read_at = started

    async def _spec(self, worker_id: str, *, reread: bool = False) -> InstanceSpec | None:
        """The worker's registration: cached when younger than the TTL, else read.

        ``reread``: the caller's request disagrees with the cache: what the
        index holds now decides, so it is read by a reread that starts after
        this call (concurrent callers share it). Never by what an earlier
        reread for the same disagreement found: another replica may have
        moved the worker since (a new epoch), and judging by the older answer
        would reset the worker again and drop what it reported since.
        """
        entry = self._specs.get(worker_id)
        if reread:
            await self._reread_shared(fresh=True)
        elif entry is None or time.monotonic() - entry[1] >= SPEC_CACHE_TTL_S:
            await self._reread_shared()
        else:
            return entry[0]
        entry = self._specs.get(worker_id)
        return None if entry is None else entry[0]

    async def _reread_shared(self, *, fresh: bool = False) -> None:
        """Reread every worker, joining a reread already in flight (``fresh``:
        only one that started after this call)."""
        task = self._reload
        now = time.monotonic()
        if task is None or task.done() or (fresh and self._reload_started < now):
            self._reload_started = now
            task = self._reload = asyncio.ensure_future(self._read_workers())
            # Its error reaches every caller still waiting; none may be left.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(task)

    async def _layouts(self) -> dict[str, CacheSpec | None]:
        """Every worker's cache spec as this replica knows it, read at most
        :data:`SPEC_CACHE_TTL_S` ago (a Match uses it to pick each worker's rule)."""
        if time.monotonic() - self._read_at >= SPEC_CACHE_TTL_S:
            await self._reread_shared()
        return {w: spec_of(sp.incarnation) for w, (sp, _) in self._specs.items()}

    async def _register(
        self, worker_id: str, address: str, incarnation: str
    ) -> tuple[InstanceState, bool]:
        spec = InstanceSpec(
            instance=InstanceId(worker_id, 0),
            model=self.namespace.model,
            address=address,
            lease_ttl_s=self.settings.lease_ttl_s,
            incarnation=incarnation,
        )
        try:
            result = await self.logic.register(spec)
        except InvalidArgument as e:
            # Name the field the way this API does (register's paths are kvmesh's).
            raise InvalidArgument(e.message, field=_field_name(e.field)) from None
        self._specs[worker_id] = (result[0].spec, time.monotonic())
        return result

    def _events(
        self, worker_id: str, actions: Sequence[Action], spec: CacheSpec | None
    ) -> tuple[Event, ...]:
        """The index events of a batch's actions for a worker with cache ``spec``.

        A page with no component mask is stored whole in the main namespace;
        each component a hybrid worker reports is stored in that component's
        namespace, under a hash derived from the page's, when the spec lets
        it be served from that tier (indexer/sglang/components.py).
        """
        cap = self.logic.config.limits.max_blocks_per_event
        out: list[Event] = []

        def stored(hashes: Sequence[int], keys: Sequence[int], tier: Tier, lora: str) -> None:
            # Split long actions so that each event stays within the index's cap;
            # a REPORT names hashes, not where they sit in their chain.
            for i in range(0, len(hashes), cap):
                out.append(
                    BlockStored(
                        block_hashes=tuple(hashes[i : i + cap]),
                        tier=tier,
                        block_keys=tuple(keys[i : i + cap]),
                        lora_name=lora,
                        position_known=False,
                    )
                )

        def removed(hashes: Sequence[int], tier: Tier) -> None:
            for i in range(0, len(hashes), cap):
                out.append(BlockRemoved(block_hashes=tuple(hashes[i : i + cap]), tier=tier))

        for a in actions:
            if a.kind is ActionKind.CLEAR:
                if not out or not isinstance(out[-1], AllBlocksCleared):
                    out.append(AllBlocksCleared())
                continue
            if a.kind is ActionKind.REVOKE:
                removed(a.hashes, a.tier)
                if spec is not None:
                    for bit, _ in COMPONENTS:
                        if spec.components & bit:
                            removed([component_hash(h, bit) for h in a.hashes], a.tier)
                continue
            masks = self._check_components(worker_id, a, spec)
            whole = [h for h, m in zip(a.hashes, masks, strict=True) if not m]
            if whole:
                stored(whole, whole, a.tier, "")
            if spec is None:
                continue
            # A REPORT gives a page's placement on its tier anew: what it does not
            # name there any more (a component evicted) goes.
            parts = [h for h, m in zip(a.hashes, masks, strict=True) if m]
            if parts:
                removed(parts, a.tier)
            for bit, _ in COMPONENTS:
                if not spec.components & bit:
                    continue
                ok = spec.servable(bit, a.tier)
                pages = [h for h, m in zip(a.hashes, masks, strict=True) if ok and m & bit]
                gone = [
                    component_hash(h, bit)
                    for h, m in zip(a.hashes, masks, strict=True)
                    if not (ok and m & bit)
                ]
                if gone:
                    removed(gone, a.tier)
                if pages:
                    derived = [component_hash(h, bit) for h in pages]
                    stored(derived, pages, a.tier, self.component_ns[bit].lora_name)
        return tuple(out)

    def _check_components(self, worker_id: str, a: Action, spec: CacheSpec | None) -> Sequence[int]:
        """A REPORT's component masks, one per hash (0 where none was sent)."""
        n = len(a.hashes)
        sides = (("component_masks", a.component_masks), ("block_sizes", a.block_sizes))
        for name, values in sides:
            if values and len(values) != n:
                raise InvalidArgument(
                    f"{len(values)} entries for {n} hashes; send none or one per hash",
                    field=f"{a.path}.{name}",
                )
        if not any(a.component_masks):
            return (0,) * n
        if spec is None:
            raise InvalidArgument(
                f"worker {worker_id!r} has no cache_spec: send its WorkerCacheSpec "
                "(ConfigureExpectedWorkers, ApplyExternalKvBatch or "
                "ReplaceExternalKvSnapshot) before reporting components",
                field=f"{a.path}.component_masks",
            )
        page = self.settings.page_size
        for j, size in enumerate(a.block_sizes):
            if size and size != page:
                raise InvalidArgument(
                    f"{size} tokens, but sglang.page_size is {page}: set it to the "
                    "engine's --page-size",
                    field=f"{a.path}.block_sizes[{j}]",
                )
        return a.component_masks

    async def apply(self, req: ApplyRequest) -> tuple[int, bool]:
        """ApplyExternalKvBatch: ``(applied_seq, duplicate)``.

        A batch that names an epoch (or enforces its sequence) is fenced with
        the incarnation this replica believes the worker has: when another
        replica re-registered the worker meanwhile the index refuses it, and
        the request is judged again on the worker's registration read anew.
        """
        if not req.worker_id:
            raise InvalidArgument("must not be empty", field="worker_id")
        try:
            return await self._apply(req)
        except FailedPrecondition as e:
            if e.field not in _FENCES:
                raise
            self._specs.pop(req.worker_id, None)  # the next _spec reads the index
        try:
            return await self._apply(req)
        except FailedPrecondition as e:
            if e.field not in _FENCES:
                raise
            raise FailedPrecondition(
                f"worker {req.worker_id!r} is being re-registered concurrently; retry",
                field="worker_epoch",
            ) from None

    async def _apply(self, req: ApplyRequest) -> tuple[int, bool]:
        spec = await self._spec(req.worker_id)
        if spec is not None and _disagrees(spec, req):
            # Another replica may have installed a snapshot or moved the worker.
            spec = await self._spec(req.worker_id, reread=True)
        epoch = None if spec is None else epoch_of(spec.incarnation)
        have = None if spec is None else spec_of(spec.incarnation)
        want = req.cache_spec
        if req.enforce_sequence:
            if spec is None or not req.worker_epoch or epoch != req.worker_epoch:
                raise FailedPrecondition(
                    f"worker {req.worker_id!r} has no snapshot for epoch {req.worker_epoch!r}; "
                    "install one with ReplaceExternalKvSnapshot first",
                    field="worker_epoch",
                )
            if want is not None and want != have:
                raise FailedPrecondition(
                    f"worker {req.worker_id!r}'s snapshot was installed with another "
                    "cache_spec; install a new one",
                    field="cache_spec",
                )
            if spec.address != req.worker_address:
                await self._register(req.worker_id, req.worker_address, spec.incarnation)
        elif spec is None or (req.worker_epoch and epoch != req.worker_epoch):
            await self._register(
                req.worker_id,
                req.worker_address,
                make_incarnation(req.worker_epoch, want if want is not None else have),
            )
        elif want is not None and want != have:
            # Another cache layout: what the worker reported before says nothing of it.
            await self._register(
                req.worker_id,
                req.worker_address,
                make_incarnation(req.worker_epoch or epoch or "", want),
            )
        elif spec.address != req.worker_address:
            await self._register(req.worker_id, req.worker_address, spec.incarnation)
        known = self._specs.get(req.worker_id)
        layout = spec_of(known[0].incarnation) if known else want
        events = self._events(req.worker_id, req.actions, layout)
        cap = self.logic.config.limits.max_events_per_batch
        if len(events) > cap:
            raise InvalidArgument(
                f"the actions make {len(events)} events of at most "
                f"{self.logic.config.limits.max_blocks_per_event} blocks, more than "
                f"limits.max_events_per_batch ({cap}); split the batch",
                field="actions",
            )
        # A batch whose events follow a cache spec is fenced too: it must not
        # apply to a registration another replica made with another spec.
        fenced = req.enforce_sequence or bool(req.worker_epoch) or layout is not None
        batch = EventBatch(
            InstanceId(req.worker_id, 0),
            req.seq,
            events,
            incarnation=known[0].incarnation if fenced and known else "",
            address=req.worker_address,
        )
        try:
            result = await self.logic.publish(batch)
        except FailedPrecondition as e:
            if e.field in _FENCES:
                raise
            # Not registered any more (its lease ran out and it was reaped).
            self._specs.pop(req.worker_id, None)
            if req.enforce_sequence:
                raise FailedPrecondition(
                    f"worker {req.worker_id!r} expired; install a new snapshot",
                    field="worker_id",
                ) from None
            st, _ = await self._register(
                req.worker_id, req.worker_address, make_incarnation(req.worker_epoch, layout)
            )
            batch = replace(batch, incarnation=st.spec.incarnation if fenced else "")
            result = await self.logic.publish(batch)
        if result.outcome is BatchOutcome.DUPLICATE:
            if req.seq == 0 and result.applied_sequence > 0 and not req.enforce_sequence:
                # Publishers count from 0: a new stream, so a restarted worker.
                st, _ = await self._register(
                    req.worker_id, req.worker_address, make_incarnation(req.worker_epoch, layout)
                )
                batch = replace(batch, incarnation=st.spec.incarnation if fenced else "")
                result = await self.logic.publish(batch)
                return result.applied_sequence, False
            # A duplicate carries no news, but an idle worker's repeated
            # heartbeat batch must still keep its lease.
            await self.logic.heartbeat(batch.instance)
            return result.applied_sequence, True
        if result.outcome is BatchOutcome.APPLIED_AFTER_GAP and req.enforce_sequence:
            await self._register(req.worker_id, req.worker_address, make_incarnation("", layout))
            raise FailedPrecondition(
                f"sequence gap before seq {req.seq}: worker {req.worker_id!r} is cleared until "
                "a new snapshot is installed",
                field="seq",
            )
        return result.applied_sequence, False

    async def configure(
        self, workers: Sequence[tuple[str, str] | tuple[str, str, CacheSpec | None]]
    ) -> tuple[int, int]:
        """ConfigureExpectedWorkers with ``(worker_id, worker_address[, cache_spec])``.

        Registers (or renews) each listed worker and removes the workers this
        API fed before that are not listed. A listed cache spec other than the
        worker's resets it (its pages were reported for another layout).
        Returns ``(total, ready)``, ready meaning live, not stale, and holding
        an applied batch or snapshot.
        """
        seen: set[str] = set()
        for i, (wid, address, *_) in enumerate(workers):
            # Checked before any registration, so that a bad entry changes nothing.
            check_instance(InstanceId(wid, 0), prefix=f"workers[{i}]")
            if len(address.encode("utf-8")) > MAX_ADDRESS_BYTES:
                raise InvalidArgument(
                    f"longer than {MAX_ADDRESS_BYTES} bytes", field=f"workers[{i}].worker_address"
                )
            if wid in seen:
                raise InvalidArgument(f"{wid!r} is listed twice", field=f"workers[{i}].worker_id")
            seen.add(wid)
        states = await self.logic.list_instances(self.namespace.model)
        ours = {
            st.spec.instance.worker_id: st
            for st in states
            if st.spec.instance.dp_rank == 0 and epoch_of(st.spec.incarnation) is not None
        }
        ready = 0
        for i, (wid, address, *rest) in enumerate(workers):
            old = ours.get(wid)
            want = rest[0] if rest else None
            if old is None:
                incarnation = make_incarnation("", want)
            elif want is not None and want != spec_of(old.spec.incarnation):
                incarnation = make_incarnation(epoch_of(old.spec.incarnation) or "", want)
            else:
                incarnation = old.spec.incarnation
            address = address or (old.spec.address if old is not None else "")
            try:
                st, _ = await self._register(wid, address, incarnation)
            except InvalidArgument as e:
                where = f"workers[{i}].{e.field}" if e.field else f"workers[{i}]"
                raise InvalidArgument(e.message, field=where) from None
            if st.live and not st.stale and st.applied_sequence is not None:
                ready += 1
        for wid, st in ours.items():
            if wid not in seen:
                await self.logic.remove_instance(st.spec.instance)
                self._specs.pop(wid, None)
        return len(workers), ready

    async def replace_snapshot(
        self,
        worker_id: str,
        worker_address: str,
        worker_epoch: str,
        applied_seq: int,
        tiers: Sequence[tuple[Tier, Sequence[int]] | Action],
        cache_spec: CacheSpec | None = None,
    ) -> int:
        """ReplaceExternalKvSnapshot: clear the worker, store the snapshot, set its sequence.

        ``tiers``: per tier its hashes, or REPORT actions (with component masks).
        """
        if not worker_id:
            raise InvalidArgument("must not be empty", field="worker_id")
        actions = [
            t if isinstance(t, Action) else Action(ActionKind.REPORT, t[0], tuple(t[1]))
            for t in tiers
        ]
        actions = [a for a in actions if a.hashes]
        events = self._events(worker_id, actions, cache_spec)
        cap = self.logic.config.limits.max_events_per_batch
        if len(events) > cap:
            raise InvalidArgument(
                f"snapshot needs {len(events)} events of at most "
                f"{self.logic.config.limits.max_blocks_per_event} blocks, more than "
                f"limits.max_events_per_batch ({cap})",
                field="hashes_by_tier",
            )
        # A fresh incarnation resets the worker (blocks and sequence) in one
        # step; the snapshot then applies as its first batch.
        await self._register(worker_id, worker_address, make_incarnation(worker_epoch, cache_spec))
        batch = EventBatch(InstanceId(worker_id, 0), applied_seq, events)
        result = await self.logic.publish(batch)
        return result.applied_sequence

    # -- queries -------------------------------------------------------------

    def _count_hits(self, keys: Sequence[int]) -> None:
        cap = self.settings.max_hit_counters
        counts = self.hit_counts
        for k in keys:
            n = counts.get(k)
            if n is None:
                if cap == 0:
                    return
                if len(counts) >= cap:
                    del counts[next(iter(counts))]  # the oldest hash first
                counts[k] = 1
            else:
                counts[k] = n + 1

    async def match_prefix(self, keys: Sequence[int], max_blocks: int) -> PrefixResult:
        """MatchExternalKvPrefix: per worker, the largest gap-free prefix of ``keys``.

        Never rejected for length: beyond ``limits.max_match_blocks`` the tail
        is not looked at (``blocks_read`` says how many were), which can only
        under-report a match.
        """
        if not keys:
            raise InvalidArgument("must not be empty", field="hashes")
        cap = self.logic.config.limits.max_match_blocks
        limit = min(len(keys), max_blocks or len(keys), cap)
        used = list(keys[:limit])
        result = await self.logic.match(
            MatchQuery(self.namespace, block_keys=used, max_blocks=limit)
        )
        layouts = await self._layouts()
        rows = [
            (m.depth, m.instance.worker_id, m.address)
            for m in result.matches
            if layouts.get(m.instance.worker_id) is None  # legacy: whole pages count
        ]
        if any(v is not None for v in layouts.values()):
            rows += await self._component_rows(used, layouts)
        rows.sort(key=lambda r: (-r[0], r[1]))  # deepest first, then worker id
        matches: list[PrefixMatch] = []
        addresses: set[str] = set()
        for depth, wid, address in rows:
            # A worker with no address cannot be routed to; one address with
            # several ranks is reported once, at its deepest.
            if not address or address in addresses:
                continue
            addresses.add(address)
            matches.append(PrefixMatch(address, depth, wid))
        best = matches[0].matched_prefix_blocks if matches else 0
        self._count_hits(used[:best])
        return PrefixResult(matches, best, len(used))

    async def _holders(self, ns: Namespace, keys: Sequence[int]) -> list[set[InstanceId]]:
        """For each key, the live, fresh instances holding it in ``ns`` (one lookup per
        key, all at once)."""
        results = await asyncio.gather(
            *(self.logic.match(MatchQuery(ns, block_keys=[k], max_blocks=1)) for k in keys)
        )
        return [{m.instance for m in r.matches} for r in results]

    async def _component_rows(
        self, used: Sequence[int], layouts: dict[str, CacheSpec | None]
    ) -> list[tuple[int, str, str]]:
        """``(prefix, worker id, address)`` of the hybrid workers holding ``used[0]``.

        One Match of the FULL component gives each worker's FULL depth; when a
        worker has SWA or Mamba, that component is looked up page by page over
        the deepest FULL prefix (one index lookup per page and component, run
        at once), and the rule of indexer/sglang/components.py cuts it.
        """
        full = await self.logic.match(
            MatchQuery(self.component_ns[COMPONENT_FULL], block_keys=used, max_blocks=len(used))
        )
        found = []
        for m in full.matches:
            spec = layouts.get(m.instance.worker_id)
            if spec is not None and spec.usable:
                found.append((m, spec))
        if not found:
            return []
        deepest = max(m.depth for m, _ in found)
        held: dict[int, list[set[InstanceId]]] = {}
        for bit in (COMPONENT_SWA, COMPONENT_MAMBA):
            if any(spec.components & bit for _, spec in found):
                held[bit] = await self._holders(self.component_ns[bit], used[:deepest])
        rows = []
        for m, spec in found:
            per = {
                bit: [m.instance in h for h in held.get(bit, [])]
                for bit in (COMPONENT_SWA, COMPONENT_MAMBA)
            }
            n = prefix_blocks(
                spec,
                m.depth,
                per[COMPONENT_SWA],
                per[COMPONENT_MAMBA],
                self.settings.page_size,
            )
            if n:
                rows.append((n, m.instance.worker_id, m.address))
        return rows

    async def match_each(self, keys: Sequence[int], count_as_hit: bool) -> list[NodeMatch]:
        """MatchExternalKv: every worker holding any of ``keys``, each hash at its fastest tier.

        A diagnostic call: one index lookup per distinct hash.
        """
        _check_hashes(keys, self.logic.config.limits.max_match_blocks)
        nodes: dict[InstanceId, NodeMatch] = {}
        layouts = await self._layouts()
        spaces = [(0, self.namespace)]
        if any(v is not None for v in layouts.values()):
            spaces += [(bit, self.component_ns[bit]) for bit, _ in COMPONENTS]
        for k in dict.fromkeys(keys):
            any_found = False
            for bit, ns in spaces:
                result = await self.logic.match(MatchQuery(ns, block_keys=[k], max_blocks=1))
                for m in result.matches:
                    node = nodes.get(m.instance)
                    if node is None:
                        node = nodes[m.instance] = NodeMatch(m.instance.worker_id, m.address)
                    tier = Tier.GPU if m.gpu_blocks else Tier.CPU if m.cpu_blocks else Tier.DISK
                    at = node.by_tier.setdefault(tier, {})
                    at[k] = at.get(k, 0) | bit
                any_found = any_found or bool(result.matches)
            if count_as_hit and any_found:
                self._count_hits((k,))
        return [nodes[i] for i in sorted(nodes)]

    def hits(self, keys: Sequence[int]) -> list[tuple[int, int]]:
        """GetExternalKvHitCounts: ``(key, count)`` for each requested key, in order.

        At most ``limits.max_match_blocks`` keys, like MatchExternalKv: the
        answer is larger than the request, so an uncapped one could pass the
        message size limit.
        """
        _check_hashes(keys, self.logic.config.limits.max_match_blocks)
        return [(k, self.hit_counts.get(k, 0)) for k in keys]


def _disagrees(spec: InstanceSpec, req: ApplyRequest) -> bool:
    """Whether ``req`` names another epoch, address or cache spec than the registration
    ``spec``."""
    if spec.address != req.worker_address:
        return True
    if req.cache_spec is not None and req.cache_spec != spec_of(spec.incarnation):
        return True
    wants_epoch = req.enforce_sequence or bool(req.worker_epoch)
    return wants_epoch and epoch_of(spec.incarnation) != req.worker_epoch


def _check_hashes(keys: Sequence[int], cap: int) -> None:
    """A per-hash lookup's ``hashes``: 1 to ``cap`` (limits.max_match_blocks) of them."""
    if not keys:
        raise InvalidArgument("must not be empty", field="hashes")
    if len(keys) > cap:
        raise InvalidArgument(
            f"{len(keys)} hashes, more than the cap of {cap} (limits.max_match_blocks)",
            field="hashes",
        )


def _field_name(kvmesh_field: str) -> str:
    # The incarnation is made from the worker's epoch (make_incarnation).
    return {
        "instance.worker_id": "worker_id",
        "address": "worker_address",
        "incarnation": "worker_epoch",
    }.get(kvmesh_field, kvmesh_field)
