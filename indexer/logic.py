"""The indexer's logic: validation, keying, caps, counters and background tasks.

No grpc here: indexer/server.py converts messages (indexer/convert.py) to the
request types of indexer/model.py, calls :class:`IndexerLogic`, and the call
scope of kvmesh/grpcsvc.py maps raised :class:`~kvmesh.errors.KvmeshError`
codes to statuses. Every validation error names the offending field with the
path the proto uses, e.g. ``token_ids[3]`` or ``events[2].stored.token_ids[7]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import replace

from indexer.config import IndexerConfig
from indexer.groups import FULL_KINDS, Filtered, GroupTracker, Prompt
from indexer.index import Index
from indexer.model import (
    HYBRID_LORA,
    HYBRID_MARKER,
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    Counters,
    Event,
    EventBatch,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    MatchQuery,
    MatchResult,
    Namespace,
    Prediction,
    ServiceStats,
)
from indexer.quotas import QuotaPolicy, is_admin
from kvmesh.auth import current_client, require_owner
from kvmesh.blockkeys import TOKEN_ID_LIMIT, block_keys, namespace_seed
from kvmesh.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
    Unavailable,
)
from kvmesh.tasks import stop_tasks

log = logging.getLogger(__name__)

#: Longest worker id, model, LoRA name or incarnation accepted, in UTF-8 bytes.
MAX_NAME_BYTES = 256
#: Longest instance address accepted (a URL), in UTF-8 bytes.
MAX_ADDRESS_BYTES = 2048
#: Largest data-parallel rank accepted (fits the proto's uint32).
MAX_DP_RANK = (1 << 32) - 1
#: Blocks one DumpIndex returns when it names no max_blocks.
DUMP_MAX_BLOCKS = 100_000
#: Instances whose model a replica remembers at most. Far above a fleet (the
#: default limits allow 4,096 instances per namespace) so that a steady fleet
#: never evicts one; the bound only keeps churn (instances registered and
#: dropped over weeks, on any replica) from growing the table, at about 200
#: bytes an entry.
MODEL_CACHE_SIZE = 65_536
#: Seconds a remembered model is believed when nothing contradicts it. Another
#: replica may register the instance with another model at any time; a batch
#: whose block size disagrees or an ownership refusal rereads the model at
#: once, and this bounds how long a stale model can be believed where nothing
#: disagrees (an ownership check that should now refuse). One reread (one
#: list_instances) renews every entry, so a steady fleet costs one a second.
#: It is also the longest a reread for a disagreement about one instance is
#: believed, while the instance table's generation (Index.generation) stays
#: where it was: a caller that keeps sending what the backend's answer refuses
#: (a wrong block size, an instance it does not own) costs one generation
#: read a batch and one reread a second, and another replica's change of the
#: instance is read at once.
MODEL_CACHE_TTL_S = 1.0
#: LoRA name of the namespace where each hybrid instance (full attention plus
#: sliding-window or Mamba groups) holds one marker block, :data:`HYBRID_MARKER`.
#: Group presence lives on the replica that ingests the engine; the marker
#: tells every other replica which instances it cannot judge, so it leaves
#: them out of its answers (under-reporting) instead of answering their
#: full-attention depth uncut (over-reporting).
#: Seconds a replica believes which instances of a model are hybrid: a
#: hybrid instance another replica ingests may be answered uncut for up to
#: this long after its first hybrid batch.
HYBRID_CACHE_TTL_S = 0.25
#: Models whose hybrid instances a replica remembers at most (only models
#: whose Match found blocks enter, so invented names do not).
HYBRID_CACHE_SIZE = 4096
#: Why blocks of an event were left out of the index (the label of
#: ``kvmesh_indexer_events_skipped_total``), and what it means.
SKIP_REASONS: dict[str, str] = {
    "block_size": "the event's block_size is not the one this indexer keys the model with "
    "(block_size / model_block_sizes): a misconfigured block size (a hybrid instance's "
    "partial-block entries, a hash unit dividing the block, are kept for its hit rule)",
    "lookahead": "the engine hashed tokens past each block (lookahead hashing): the key "
    "cannot be derived from the block's tokens",
    "group_kind": "a KV-cache group of a kind whose hit rule the indexer does not know",
    "group_unplaced": "a non-full-attention group's blocks whose full-attention parent "
    "this replica has not seen (after a restart): their group presence is unknown",
    "partial_unplaced": "a partial-block entry (a hash unit finer than the block) whose "
    "parent is a unit no event keyed (vLLM publishes a tail two or three units into a block "
    "without the units before it): its prefix cannot be keyed from tokens; it is kept by "
    "its engine hash, which a Match by token ids computes (indexer/enginehash.py)",
    "invalid": "an event the engine sent that does not validate (named in the log)",
    "quota": "stores past a quota of the instance or of its identity (quotas.*: blocks per "
    "instance or identity, namespaces per identity): the index holds what fitted",
    "lora": "a LoRA name the identity's policy entry does not grant (its loras)",
}


def check_token_ids(token_ids: Sequence[int], field_name: str) -> None:
    """Raise InvalidArgument naming ``field_name[i]`` for the first id outside [0, 2^32)."""
    token_array(token_ids, field_name)


def token_array(token_ids: Sequence[int], field_name: str) -> array[int]:
    """``token_ids`` as ``array('I')`` (checked at C speed, one conversion for
    the check, the slicing and the hashing); InvalidArgument naming
    ``field_name[i]`` for the first id outside [0, 2^32)."""
    if type(token_ids) is array and token_ids.typecode == "I":
        return token_ids  # packed_token_ids: already uint32
    try:
        # A slice of a protobuf repeated field is a list: about a third faster
        # to convert than the field itself.
        return array("I", token_ids if type(token_ids) is list else token_ids[:])
    except (OverflowError, TypeError):
        pass
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or t < 0 or t >= TOKEN_ID_LIMIT:
            raise InvalidArgument(f"must be in [0, 2^32), got {t}", field=f"{field_name}[{i}]")
    raise InvalidArgument("not a list of token ids", field=field_name)  # pragma: no cover


#: Largest block size an event may declare (engines use 1 to a few thousand tokens).
MAX_BLOCK_SIZE = 1 << 16
#: Multimodal items a Match may name.
MAX_MEDIA_ITEMS = 1024


def _check_media(media: Sequence[tuple[str, int, int]], n_tokens: int) -> None:
    """Raise InvalidArgument naming ``media[i]`` for an item that cannot be in the prompt."""
    if len(media) > MAX_MEDIA_ITEMS:
        raise InvalidArgument(f"{len(media)} items, more than {MAX_MEDIA_ITEMS}", field="media")
    last = 0
    for i, (ident, offset, length) in enumerate(media):
        if offset < last:
            # The engine walks its items in prompt order (vLLM keeps them
            # sorted by offset); keys of items given otherwise never match.
            raise InvalidArgument(
                f"offset {offset} is before the previous item's {last}: give items in prompt order",
                field=f"media[{i}].offset",
            )
        last = offset
        if not ident or len(ident.encode("utf-8")) > MAX_NAME_BYTES:
            raise InvalidArgument(
                f"must be 1..{MAX_NAME_BYTES} bytes", field=f"media[{i}].identifier"
            )
        if offset < 0 or length < 1 or offset + length > n_tokens:
            raise InvalidArgument(
                f"placeholder tokens [{offset}, {offset + length}) are not inside the "
                f"{n_tokens}-token prompt",
                field=f"media[{i}].offset",
            )


def _check_name(value: str, field_name: str, *, required: bool = True) -> None:
    if required and not value:
        raise InvalidArgument("must not be empty", field=field_name)
    if len(value.encode("utf-8")) > MAX_NAME_BYTES:
        raise InvalidArgument(f"longer than {MAX_NAME_BYTES} bytes", field=field_name)


def check_instance(instance: InstanceId, prefix: str = "instance") -> None:
    """Validate an instance reference (worker id 1..256 bytes, rank a uint32)."""
    _check_name(instance.worker_id, f"{prefix}.worker_id")
    if not 0 <= instance.dp_rank <= MAX_DP_RANK:
        raise InvalidArgument("must be in [0, 2^32)", field=f"{prefix}.dp_rank")


def _size_error(ev: BlockStored, expected: int, path: str) -> InvalidArgument | None:
    """Why ``ev``'s tokens do not make blocks of ``expected`` tokens; None when they do."""
    n = len(ev.block_hashes)
    size = ev.block_size or expected
    if size != expected:
        return InvalidArgument(
            f"is {ev.block_size}, but the indexer keys this model with blocks of "
            f"{expected} tokens (block_size / model_block_sizes)",
            field=f"{path}.block_size",
        )
    if len(ev.token_ids) != n * size:
        return InvalidArgument(
            f"has {len(ev.token_ids)} ids; need len(block_hashes) x block_size = "
            f"{n} x {size} = {n * size}",
            field=f"{path}.token_ids",
        )
    return None


def _unit_entry(ev: BlockStored, expected: int) -> bool:
    """Whether ``ev`` is a partial-block entry of a namespace keyed by ``expected``-token
    blocks: whole units of a hash unit that divides the block (indexer/groups.py)."""
    size = ev.block_size
    return (
        0 < size < expected
        and expected % size == 0
        and len(ev.token_ids) == size * len(ev.block_hashes)
    )


def _reach(m: InstanceMatch) -> tuple[int, int, str, int]:
    """Which hits ``max_instances`` keeps with predictions: the farthest reach first."""
    return (-max(m.depth, m.predicted_depth), -m.depth, m.instance.worker_id, m.instance.dp_rank)


def _answer_order(m: InstanceMatch) -> tuple[int, int, str, int]:
    """The order of a Match answered with predictions: depth, then predicted_depth."""
    return (-m.depth, -m.predicted_depth, m.instance.worker_id, m.instance.dp_rank)


class IndexerLogic:
    """Request handling on top of an :class:`~indexer.index.Index`.

    One per replica, used from one event loop. ``on_backend_health`` is called
    with ``False`` as soon as a call finds the backend unavailable and with the
    result of each periodic ping afterwards, so that health status follows the
    backend (the server wires it to grpc.health.v1).
    """

    def __init__(
        self,
        index: Index,
        config: IndexerConfig,
        *,
        on_backend_health: Callable[[bool], None] | None = None,
    ) -> None:
        self.index = index
        self.config = config
        self.counters = Counters()
        self._on_health = on_backend_health
        self._healthy: bool | None = None
        self._tasks: list[asyncio.Task[None]] = []
        # instance -> (model, monotonic time it was read), for the block size
        # of a model-specific batch and for ownership checks; see
        # MODEL_CACHE_SIZE and MODEL_CACHE_TTL_S. Oldest insertion first.
        self._models: dict[InstanceId, tuple[str, float]] = {}
        # The reread of every instance in flight, shared by concurrent callers.
        self._reload: asyncio.Task[list[InstanceState]] | None = None
        # instance -> (monotonic time, instance-table generation) of its last reread
        # for a disagreement.
        self._disputed: dict[InstanceId, tuple[float, int | None]] = {}
        #: KV-cache groups of the instances this replica ingests (indexer/groups.py).
        self.groups = GroupTracker(config.engine_events.vllm_hash_seeds)
        # instance -> last sequence whose events the group tracker counted.
        self._counted: dict[InstanceId, int] = {}
        # (instance, reason) pairs already logged as skipped: warn once each.
        self._warned_skips: set[tuple[InstanceId, str]] = set()
        # model -> (its instances holding the hybrid marker, monotonic time read).
        self._hybrids: dict[str, tuple[frozenset[InstanceId], float]] = {}
        # Instances whose batches this replica applied (its group tracker saw
        # them), oldest first, at most MODEL_CACHE_SIZE.
        self._fed: dict[InstanceId, None] = {}
        #: Per-identity quotas of the callers (indexer/quotas.py); the hybrid
        #: marker is the service's own block, outside them.
        self.quotas = QuotaPolicy(config, free_loras=(HYBRID_LORA,))

    # -- background tasks ----------------------------------------------------

    def start(self) -> None:
        """Start the reaper and the backend health monitor on the running loop."""
        if self._tasks:
            return
        self._tasks = [
            asyncio.create_task(self._reap_loop(), name="kvmesh-reaper"),
            asyncio.create_task(self._health_loop(), name="kvmesh-health"),
        ]

    async def stop(self) -> None:
        """Stop the background tasks (the index is left open)."""
        tasks, self._tasks = self._tasks, []
        await stop_tasks(*tasks, what="indexer background tasks")

    async def reap_once(self) -> list[InstanceId]:
        """Drop expired instances now; backend errors are logged and counted, not raised."""
        try:
            reaped = await self.index.reap_expired()
        except Exception as e:  # the reaper must survive anything the backend does
            self.counters.reap_errors += 1
            if isinstance(e, Unavailable):
                self._set_health(False)
                log.warning("reaper: backend unavailable: %s", e)
            else:
                log.exception("reaper: reap_expired failed")
            return []
        if reaped:
            self.counters.instances_reaped += len(reaped)
            for iid in reaped:
                self._forget(iid)
            log.info("reaped %d expired instance(s): %s", len(reaped), ", ".join(map(str, reaped)))
        return reaped

    async def _reap_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.reap_interval_s)
            await self.reap_once()

    async def check_backend(self) -> bool:
        """Ping the backend once, update health, and return whether it serves."""
        try:
            await self.index.ping()
        except Exception as e:
            if not isinstance(e, KvmeshError):
                log.warning("backend ping failed: %r", e)
            self._set_health(False)
            return False
        self._set_health(True)
        return True

    async def _health_loop(self) -> None:
        while True:
            await self.check_backend()
            await asyncio.sleep(self.config.health_check_interval_s)

    @property
    def healthy(self) -> bool | None:
        """Last known backend health (None before the first check)."""
        return self._healthy

    def _set_health(self, ok: bool) -> None:
        if ok == self._healthy:
            return
        self._healthy = ok
        if ok:
            log.info("backend %s is serving", self.index.name)
        else:
            log.warning("backend %s is unavailable", self.index.name)
        if self._on_health is not None:
            self._on_health(ok)

    def _note_error(self, e: BaseException) -> None:
        if isinstance(e, Unavailable):
            self._set_health(False)

    # -- instances -----------------------------------------------------------

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """Validate and register an instance; a lease of 0 takes the default."""
        check_instance(spec.instance)
        _check_name(spec.model, "model")
        _check_name(spec.incarnation, "incarnation", required=False)
        if len(spec.address.encode("utf-8")) > MAX_ADDRESS_BYTES:
            raise InvalidArgument(f"longer than {MAX_ADDRESS_BYTES} bytes", field="address")
        ttl = spec.lease_ttl_s
        max_ttl = self.config.limits.max_lease_ttl_s
        if not math.isfinite(ttl) or ttl < 0 or ttl > max_ttl:
            raise InvalidArgument(
                f"must be in [0, {max_ttl:g}], got {ttl}", field="lease_ttl_seconds"
            )
        if ttl == 0:
            spec = replace(spec, lease_ttl_s=self.config.default_lease_ttl_s)
        require_owner(spec.model, spec.instance.worker_id)
        client = current_client()
        self.quotas.check_dp_rank(client, spec.instance.dp_rank)
        spec = replace(spec, quota=self.quotas.quota(client))
        try:
            if not is_admin(client):  # an operator may always register (SECURITY.md)
                await self._check_capacity(spec)
            state, reset = await self.index.register(spec)
        except Unavailable as e:
            self._note_error(e)
            raise
        self._remember(spec.instance, state.spec.model)
        if reset:
            self._forget_groups(spec.instance)
        return state, reset

    async def _check_capacity(self, spec: InstanceSpec) -> None:
        """RESOURCE_EXHAUSTED when a new instance would pass the namespace limits."""
        lim = self.config.limits
        states = await self.index.list_instances()
        per_model: dict[str, int] = {}
        for st in states:
            if st.spec.instance == spec.instance:
                return  # a re-registration adds nothing
            per_model[st.spec.model] = per_model.get(st.spec.model, 0) + 1
        n = per_model.get(spec.model, 0)
        if n == 0 and len(per_model) >= lim.max_namespaces:
            raise ResourceExhausted(
                f"{len(per_model)} namespaces already hold instances (limits.max_namespaces)",
                field="model",
            )
        if n >= lim.max_instances_per_namespace:
            raise ResourceExhausted(
                f"namespace {spec.model!r} already has {n} instances "
                "(limits.max_instances_per_namespace)",
                field="instance",
            )

    async def _check_owner(self, instance: InstanceId) -> None:
        """PERMISSION_DENIED unless the calling identity owns ``instance``."""
        c = current_client()
        if c is None or c.principal.via == "open" or "admin" in c.principal.roles:
            return
        # None: the index does not hold the instance (never registered, reaped,
        # removed): its owner by worker id is told so by the call (NOT_FOUND).
        model: str | None = None
        fresh = False
        with contextlib.suppress(FailedPrecondition):
            model, fresh = await self._model_of(instance)
        if not fresh and not c.principal.owns(model, instance.worker_id):
            # Refused on a remembered model: another replica may have changed it.
            model = None
            with contextlib.suppress(FailedPrecondition):
                model, _ = await self._model_of(instance, reread=True)
        require_owner(model, instance.worker_id)

    async def heartbeat(self, instance: InstanceId) -> InstanceState:
        """Renew an instance's lease (NotFound when unknown)."""
        check_instance(instance)
        await self._check_owner(instance)
        try:
            state = await self.index.heartbeat(instance)
        except NotFound:
            self._forget(instance)
            raise
        except Unavailable as e:
            self._note_error(e)
            raise
        self._remember(instance, state.spec.model)
        return state

    async def remove_instance(self, instance: InstanceId) -> int:
        """Drop an instance and its blocks; return the entries dropped."""
        check_instance(instance)
        await self._check_owner(instance)
        try:
            n = await self.index.remove_instance(instance)
        except NotFound:
            self._forget(instance)
            raise
        except Unavailable as e:
            self._note_error(e)
            raise
        self._forget(instance)
        return n

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """Every registered instance (of ``model`` when given)."""
        _check_name(model, "model", required=False)
        started = time.monotonic()
        try:
            states = await self.index.list_instances(model)
        except Unavailable as e:
            self._note_error(e)
            raise
        listed = {s.spec.instance for s in states}
        # What the listing covers and does not name is gone (removed or reaped,
        # maybe by another replica); an entry written while it was in flight
        # is newer than the listing and stays.
        for iid, (m, at) in list(self._models.items()):
            if iid not in listed and at <= started and (not model or m == model):
                self._forget(iid)
        for s in states:
            self._remember(s.spec.instance, s.spec.model, started)
        return states

    # -- the instance -> model cache -----------------------------------------

    def _remember(self, instance: InstanceId, model: str, at: float | None = None) -> None:
        """Note ``instance``'s model as the backend gave it (at ``at``, default now)."""
        models = self._models
        if instance not in models and len(models) >= MODEL_CACHE_SIZE:
            self._forget(next(iter(models)))  # the oldest entry first
        models[instance] = (model, time.monotonic() if at is None else at)

    def _forget(self, instance: InstanceId) -> None:
        self._models.pop(instance, None)
        self._disputed.pop(instance, None)
        self._forget_groups(instance)

    def _uncount(self, instance: InstanceId, filtered: Filtered, last: int | None) -> None:
        """Undo what the group tracker counted for a batch the index did not apply.

        A call that failed ambiguously (its reply lost) may have applied it:
        its retry then finds a duplicate, which drops the counts.
        """
        self.groups.rollback(filtered)
        if last is None:
            self._counted.pop(instance, None)
        else:
            self._counted[instance] = last

    def _fed_here(self, instance: InstanceId) -> None:
        fed = self._fed
        if instance in fed:
            return
        if len(fed) >= MODEL_CACHE_SIZE:
            del fed[next(iter(fed))]
        fed[instance] = None

    def _forget_groups(self, instance: InstanceId) -> None:
        self.groups.forget(instance)
        self._counted.pop(instance, None)
        self._fed.pop(instance, None)

    async def _reread_all(self) -> None:
        """Reread every instance's model; concurrent callers share one reread."""
        task = self._reload
        if task is None or task.done():
            task = self._reload = asyncio.ensure_future(self.list_instances())
            # Its error reaches every caller still waiting; none may be left.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        await asyncio.shield(task)

    async def _model_of(self, instance: InstanceId, *, reread: bool = False) -> tuple[str, bool]:
        """``instance``'s model and whether it was just read from the backend.

        A remembered model younger than :data:`MODEL_CACHE_TTL_S` is used as
        it is, unless ``reread``: then (a caller saw it disagree) the backend
        is asked at once. Raises FailedPrecondition for an unknown instance.
        """
        entry = self._models.get(instance)
        now = time.monotonic()
        if reread and entry is not None:
            # The backend was just asked for this disagreement: unless the
            # instance table changed since (another replica may have given the
            # instance another model), the caller is what disagrees.
            gen = await self.index.generation()
            last = self._disputed.get(instance)
            if (
                last is not None
                and now - last[0] < MODEL_CACHE_TTL_S
                and gen is not None
                and gen == last[1]
            ):
                return entry[0], True
            if len(self._disputed) >= MODEL_CACHE_SIZE:
                del self._disputed[next(iter(self._disputed))]
            self._disputed.pop(instance, None)
            self._disputed[instance] = (now, gen)
        if reread or entry is None:
            await self.list_instances()  # newer than the miss or the disagreement
        elif now - entry[1] >= MODEL_CACHE_TTL_S:
            await self._reread_all()
        else:
            return entry[0], False
        entry = self._models.get(instance)
        if entry is None:
            raise FailedPrecondition(f"instance {instance} is not registered", field="instance")
        return entry[0], True

    # -- events --------------------------------------------------------------

    async def publish(self, batch: EventBatch, *, skip_invalid: bool = False) -> ApplyResult:
        """Validate and apply one batch; counts it as applied, duplicate or rejected.

        Events the index cannot use (another block size, lookahead hashes, a
        group kind without a known hit rule) are left out and counted by
        reason (:data:`SKIP_REASONS`), never a reason to refuse the batch.
        ``skip_invalid`` (an engine's event stream, where refusing the batch
        would lose the instance's sequence): an event that does not validate
        is left out too, instead of refusing the batch.

        Raises a :class:`KvmeshError` for a rejected batch (nothing applied).
        """
        counted: Filtered | None = None
        skipped = 0
        last_counted = self._counted.get(batch.instance)
        try:
            check_instance(batch.instance)
            await self._check_owner(batch.instance)
            client = current_client()
            self.quotas.take_blocks(client, batch.events)
            batch, skipped = await self._validate_batch(batch, skip_invalid)
            batch, counted = await self._filter_groups(batch)
            if counted:
                # What the group tracker left out is skipped too (counted by reason).
                skipped += sum(counted.skipped.values())
            result = await self.index.apply(replace(batch, quota=self.quotas.quota(client)))
        except KvmeshError as e:
            self.counters.batches_rejected += 1
            self._note_error(e)
            if isinstance(e, FailedPrecondition) and e.field == "instance":
                self._forget(batch.instance)  # not registered (any more)
            elif counted:
                self._uncount(batch.instance, counted, last_counted)  # not applied (or not known)
            raise
        if result.outcome is BatchOutcome.DUPLICATE:
            self.counters.batches_duplicate += 1
            if counted:
                # The tracker counted a batch the index had applied before
                # (this replica took the instance over): its counts are not
                # to be trusted; without them removals pass (under-report).
                self._forget_groups(batch.instance)
        else:
            self.counters.batches_applied += 1
            self._fed_here(batch.instance)
            if result.outcome is BatchOutcome.APPLIED_AFTER_GAP:
                self.counters.sequence_gaps += 1
                log.warning(
                    "sequence gap for %s before batch %d: instance is stale until it resyncs",
                    batch.instance,
                    batch.sequence,
                )
            if result.blocks_orphaned:
                self._orphaned(batch.instance, result.blocks_orphaned)
            if result.blocks_over_quota:
                self._skipped(batch.instance, "quota", result.blocks_over_quota)
                skipped += result.blocks_over_quota
        return replace(result, blocks_skipped=skipped) if skipped else result

    def _orphaned(self, instance: InstanceId, blocks: int) -> None:
        self.counters.blocks_orphaned += blocks
        if (instance, "orphaned") not in self._warned_skips:
            if len(self._warned_skips) < MODEL_CACHE_SIZE:
                self._warned_skips.add((instance, "orphaned"))
            log.warning(
                "%s: %d stored block(s) name a parent the instance does not hold and cannot be "
                "keyed (events lost before them, or a stream that started mid-chain); counted in "
                "kvmesh_indexer_blocks_orphaned_total, warned once per instance",
                instance,
                blocks,
            )

    async def _filter_groups(self, batch: EventBatch) -> tuple[EventBatch, Filtered | None]:
        """The batch as the index applies it (indexer/groups.py), and what counting it did
        (None: nothing counted).

        A batch at or below the last one counted here is a duplicate: it
        passes as it is (the index drops it) and counts nothing.
        """
        iid = batch.instance
        last = self._counted.get(iid)
        if last is not None and batch.sequence <= last:
            return batch, None
        if not self.groups.hybrid(iid) and all(
            not isinstance(ev, BlockStored) or ev.group_kind in FULL_KINDS for ev in batch.events
        ):
            # One group: nothing to filter (validation kept no partial-block
            # entry, which it does only for a batch of a hybrid instance).
            return batch, None
        model, _ = await self._model_of(iid)  # keys of the other groups' blocks
        f = self.groups.filter(iid, model, batch.events, self.config.block_size_for(model))
        for reason, n in f.skipped.items():
            self._skipped(iid, reason, n)
        self._counted[iid] = batch.sequence
        if self.groups.hybrid(iid):
            # Every replica must know it cannot judge this instance (HYBRID_LORA);
            # last, so that a clear in the batch does not drop it.
            return replace(batch, events=(*f.events, _HYBRID_MARK)), f
        if len(f.events) == len(batch.events) and all(
            a is b for a, b in zip(f.events, batch.events, strict=True)
        ):
            return batch, f
        return replace(batch, events=f.events), f

    def _skipped(self, instance: InstanceId, reason: str, blocks: int, detail: str = "") -> None:
        """Count blocks of events left out for ``reason``; warn once per instance and reason."""
        if blocks <= 0:
            return
        skipped = self.counters.events_skipped
        skipped[reason] = skipped.get(reason, 0) + blocks
        if (instance, reason) not in self._warned_skips:
            if len(self._warned_skips) < MODEL_CACHE_SIZE:
                self._warned_skips.add((instance, reason))
            # Once per instance and reason, at WARNING: what a client sends
            # never makes the server log errors (a client could flood them).
            log.warning(
                "%s: %d block(s) of its events skipped (%s)%s; %s (counted in "
                "kvmesh_indexer_events_skipped_total)",
                instance,
                blocks,
                SKIP_REASONS.get(reason, reason),
                f": {detail}" if detail else "",
                "a Match by token ids finds them by the engine's hash of the prompt where it "
                "can compute it, else under-reports this instance"
                if reason == "partial_unplaced"
                else "the index does not hold them, so Match under-reports this instance",
            )

    async def _validate_batch(
        self, batch: EventBatch, skip_invalid: bool = False
    ) -> tuple[EventBatch, int]:
        """The batch with the events the index cannot use left out, and their blocks."""
        # batch.instance was checked by publish(), before the ownership check.
        lim = self.config.limits
        if len(batch.events) > lim.max_events_per_batch:
            raise InvalidArgument(
                f"{len(batch.events)} events, more than the cap of {lim.max_events_per_batch} "
                "(limits.max_events_per_batch); split the batch",
                field="events",
            )
        if batch.sequence < 0 or batch.sequence >= 1 << 64:
            raise InvalidArgument("must be in [0, 2^64)", field="sequence")
        events: list[Event | None] | None = None
        # Partial-block entries are kept for the hit rule of hybrid instances only.
        units = self.groups.hybrid(batch.instance) or any(
            isinstance(ev, BlockStored) and ev.group_kind not in FULL_KINDS for ev in batch.events
        )
        skipped = 0
        c = current_client()
        # An identity whose policy entry names its LoRAs (the others may use any).
        lora_rule = c.principal if c is not None and c.principal.loras != ("*",) else None
        for i, ev in enumerate(batch.events):
            fixed: Event | None = ev
            try:
                if isinstance(ev, BlockStored):
                    fixed = await self._validate_stored(
                        batch.instance, ev, f"events[{i}].stored", units
                    )
                    if (
                        fixed is not None
                        and lora_rule is not None
                        and not lora_rule.may_use_lora(fixed.lora_name)
                    ):
                        self._skipped(
                            batch.instance,
                            "lora",
                            len(ev.block_hashes),
                            f"a LoRA name its policy entry does not grant (loras "
                            f"{list(lora_rule.loras)})",
                        )
                        fixed = None
                    if fixed is None:
                        skipped += len(ev.block_hashes)
                elif isinstance(ev, BlockRemoved):
                    if len(ev.block_hashes) > lim.max_blocks_per_event:
                        raise InvalidArgument(
                            f"{len(ev.block_hashes)} blocks, more than the cap of "
                            f"{lim.max_blocks_per_event} (limits.max_blocks_per_event)",
                            field=f"events[{i}].removed.block_hashes",
                        )
                elif not isinstance(ev, AllBlocksCleared):  # pragma: no cover - convert guards
                    raise InvalidArgument("unknown event kind", field=f"events[{i}]")
            except InvalidArgument as e:
                if not skip_invalid:
                    raise
                n = len(ev.block_hashes) if isinstance(ev, BlockStored | BlockRemoved) else 0
                self._skipped(batch.instance, "invalid", n, f"{e.field}: {e.message}")
                skipped += n
                fixed = None
            if fixed is not ev:
                if events is None:
                    events = list(batch.events)
                events[i] = fixed
        if events is None:
            return batch, skipped
        return replace(batch, events=tuple(e for e in events if e is not None)), skipped

    async def _validate_stored(
        self, instance: InstanceId, ev: BlockStored, path: str, units: bool = False
    ) -> BlockStored | None:
        """The event as the index applies it; None (counted) when it is left out.

        ``units``: the instance has groups other than full attention, so a
        full-attention event of a hash unit finer than the block is a
        partial-block entry for the group tracker, not a wrong block size.
        """
        n = len(ev.block_hashes)
        cap = self.config.limits.max_blocks_per_event
        if n > cap:
            raise InvalidArgument(
                f"{n} blocks, more than the cap of {cap} (limits.max_blocks_per_event)",
                field=f"{path}.block_hashes",
            )
        _check_name(ev.lora_name, f"{path}.lora_name", required=False)
        _check_name(ev.group_kind, f"{path}.group_kind", required=False)
        if ev.block_size < 0 or ev.block_size > MAX_BLOCK_SIZE:
            raise InvalidArgument(f"must be in [0, {MAX_BLOCK_SIZE}]", field=f"{path}.block_size")
        if ev.group_kind not in FULL_KINDS:
            # Another group's blocks are placed by their hashes (the group
            # tracker), not keyed from their tokens: a Mamba group names one
            # hash for several blocks' tokens.
            return ev
        if ev.block_keys is not None:
            if len(ev.block_keys) != n:
                raise InvalidArgument(
                    f"{len(ev.block_keys)} keys for {n} block hashes; need one per hash",
                    field=f"{path}.block_keys",
                )
            return ev
        if self.config.model_block_sizes:
            model, fresh = await self._model_of(instance)
            expected = self.config.block_size_for(model)
            if (
                not fresh
                and _size_error(ev, expected, path) is not None
                and not _unit_entry(ev, expected)
            ):
                # The remembered model disagrees with the batch: another
                # replica may have registered the instance with another model.
                model, _ = await self._model_of(instance, reread=True)
                expected = self.config.block_size_for(model)
        else:
            expected = self.config.block_size
        if units and _unit_entry(ev, expected):
            # A partial-block entry (a hash unit finer than the block): the
            # group tracker keeps it for the hit rule, it never reaches the
            # index (indexer/groups.py).
            if ev.lookahead:
                self._skipped(instance, "lookahead", n)
                return None
            check_token_ids(ev.token_ids, f"{path}.token_ids")
            return ev
        if ev.block_size and ev.block_size != expected:
            # Another granularity than the index keys: a misconfigured block
            # size (or a partial-block entry that does not divide the block).
            self._skipped(
                instance,
                "block_size",
                n,
                f"block_size {ev.block_size}, the indexer keys this model with {expected}",
            )
            return None
        if ev.lookahead:
            self._skipped(instance, "lookahead", n)
            return None
        err = _size_error(ev, expected, path)
        if err is not None:
            raise err
        toks = token_array(ev.token_ids, f"{path}.token_ids")
        size = ev.block_size or expected
        if ev.block_size == size and toks is ev.token_ids:
            return ev
        # The ids go on as the array the check made: the backend's key
        # chaining hashes its bytes instead of converting every id again
        # (that second conversion was 7 % of a Redis replica's samples during
        # a 512-token ingest, py-spy).
        return replace(ev, block_size=size, token_ids=toks)

    # -- match ---------------------------------------------------------------

    def keys_for(self, query: MatchQuery) -> tuple[list[int], int]:
        """Validated, truncated block keys of a query, and the block size used (0 for keys)."""
        cap = self.config.limits.max_match_blocks
        if query.token_ids and query.block_keys:
            raise InvalidArgument("give token_ids or block_keys, not both", field="block_keys")
        if query.block_keys and (query.cache_salt or query.media):
            raise InvalidArgument(
                "cache_salt and media key token_ids; precomputed block_keys already include them",
                field="cache_salt" if query.cache_salt else "media",
            )
        if query.max_blocks < 0 or query.max_blocks > cap:
            raise InvalidArgument(
                f"must be in [0, {cap}] (limits.max_match_blocks), got {query.max_blocks}",
                field="max_blocks",
            )
        limit = query.max_blocks or cap
        ns = query.namespace
        _check_name(ns.model, "model")
        _check_name(ns.lora_name, "lora_name", required=False)
        if query.block_keys:
            keys = query.block_keys
            if not query.max_blocks and len(keys) > cap:
                raise InvalidArgument(
                    f"{len(keys)} blocks, more than the cap of {cap} (limits.max_match_blocks); "
                    "set max_blocks to look at a prefix",
                    field="block_keys",
                )
            return list(keys[:limit]), 0
        bs = self.config.block_size_for(ns.model)
        tokens = query.token_ids
        # Full blocks only. An engine computes at least the prompt's last token
        # (vLLM caps a hit at num_tokens - 1 tokens), so a prompt of exactly k
        # blocks reuses at most k - 1 of them: the router caps the depth, the
        # index answers what the instance holds.
        n_blocks = len(tokens) // bs
        field = "packed_token_ids" if type(tokens) is array else "token_ids"
        if not query.max_blocks and n_blocks > cap:
            raise InvalidArgument(
                f"{n_blocks} blocks of {bs} tokens, more than the cap of {cap} "
                "(limits.max_match_blocks); set max_blocks to look at a prefix",
                field=field,
            )
        ids = token_array(tokens, field)
        _check_media(query.media, len(tokens))
        if len(query.cache_salt.encode("utf-8")) > MAX_NAME_BYTES:
            raise InvalidArgument(f"longer than {MAX_NAME_BYTES} bytes", field="cache_salt")
        used = ids[: min(n_blocks, limit) * bs]
        return (
            block_keys(
                used, bs, ns.model, ns.lora_name, cache_salt=query.cache_salt, media=query.media
            ),
            bs,
        )

    async def match(self, query: MatchQuery) -> MatchResult:
        """Validate, key and truncate the prompt, then ask the index.

        With ``include_predicted`` (indexer/index.py, "Predictions") the hits
        carry ``predicted_depth``, and ``max_instances`` keeps the deepest by
        ``max(depth, predicted_depth)`` (the answer's order stays depth, then
        predicted_depth).
        """
        keys, bs = self.keys_for(query)
        # The query as the hybrid hit rule reads it, made once for both passes
        # below (lazy: it keys and hashes only what the rule asks of it).
        prompt: Prompt | None = None
        pending = None
        if keys:
            try:
                if query.include_predicted:
                    hits, pending = await self.index.match_with_pending(
                        query.namespace, keys, include_stale=query.include_stale
                    )
                else:
                    hits = await self.index.match(
                        query.namespace, keys, include_stale=query.include_stale
                    )
            except Unavailable as e:
                self._note_error(e)
                raise
            fed = self._fed
            if query.namespace.lora_name != HYBRID_LORA and any(
                h.instance not in fed for h in hits
            ):
                # Instances this replica does not ingest: their group presence
                # may be elsewhere. (Those it ingests, its tracker judges.)
                hybrids = await self._hybrids_of(query.namespace.model)
                if hybrids:
                    # Hybrid instances ingested elsewhere: their group presence
                    # is not here, so their hit cannot be cut; leave them out.
                    hits = [
                        h
                        for h in hits
                        if h.instance not in hybrids or self.groups.hybrid(h.instance)
                    ]
            if self.groups.hybrid_any():
                prompt = self._prompt(query, keys, bs)
                hits = await self._cut_hybrid(query, keys, prompt, hits)
        else:
            hits = []
        if bs and self.groups.hybrid_any():
            prompt = prompt or self._prompt(query, keys, bs)
            hits = await self._inside_first_block(query, prompt, hits)
        self.counters.matches += 1
        if hits:
            self.counters.matched_blocks += hits[0].depth
        if query.include_predicted:
            if any(h.predicted_depth > h.depth for h in hits):
                self.counters.predicted_matches += 1
            if query.max_instances and len(hits) > query.max_instances:
                kept = sorted(hits, key=_reach)[: query.max_instances]
                hits = sorted(kept, key=_answer_order)
        if query.max_instances and len(hits) > query.max_instances:
            hits = hits[: query.max_instances]
        if query.include_predicted and not keys:
            try:
                pending = await self.index.pending_predicted(query.namespace.model)
            except Unavailable as e:
                self._note_error(e)
                raise
        return MatchResult(hits, len(keys), bs, pending)

    async def predict(self, prediction: Prediction) -> tuple[int, int]:
        """Validate and record a route-time prediction (indexer/index.py,
        "Predictions"): the blocks recorded and the ttl applied, in ms."""
        ns = prediction.namespace
        _check_name(ns.model, "model")
        _check_name(ns.lora_name, "lora_name", required=False)
        check_instance(prediction.instance)
        lim = self.config.limits
        keys = prediction.keys
        if not keys:
            raise InvalidArgument("no block keys to predict", field="block_keys")
        if len(keys) > lim.max_blocks_per_event:
            raise InvalidArgument(
                f"{len(keys)} block keys, more than {lim.max_blocks_per_event} "
                "(limits.max_blocks_per_event)",
                field="block_keys",
            )
        ttl_ms = round(prediction.ttl_s * 1000)
        if not math.isfinite(prediction.ttl_s) or ttl_ms < 0:
            raise InvalidArgument(f"must be >= 0, got {prediction.ttl_s}", field="ttl_ms")
        ttl_ms = min(ttl_ms or lim.prediction_ttl_ms, lim.max_prediction_ttl_ms)
        # Advice: a failed prediction leaves health alone (the pings and the
        # Matches judge the backend; a Redis ACL without the rights predictions
        # need, SECURITY.md, must not take the replica out of service).
        pending_s = prediction.pending_s
        if pending_s is not None and not (math.isfinite(pending_s) and pending_s >= 0):
            raise InvalidArgument(f"must be >= 0, got {pending_s}", field="pending_ms")
        n = await self.index.predict(
            ns,
            prediction.instance,
            keys,
            ttl_ms / 1000,
            lim.max_predicted_blocks_per_instance,
            pending_s,
        )
        self.counters.predictions_recorded += n
        return n, ttl_ms

    async def _hybrids_of(self, model: str) -> frozenset[InstanceId]:
        """The instances of ``model`` that hold the hybrid marker, read at most
        :data:`HYBRID_CACHE_TTL_S` ago."""
        now = time.monotonic()
        entry = self._hybrids.get(model)
        if entry is not None and now - entry[1] < HYBRID_CACHE_TTL_S:
            return entry[0]
        try:
            marked = await self.index.match(
                Namespace(model, HYBRID_LORA), [HYBRID_MARKER], include_stale=True
            )
        except Unavailable as e:
            self._note_error(e)
            raise
        found = frozenset(m.instance for m in marked)
        self._hybrids.pop(model, None)
        if len(self._hybrids) >= HYBRID_CACHE_SIZE:
            del self._hybrids[next(iter(self._hybrids))]  # the oldest first
        self._hybrids[model] = (found, now)
        return found

    async def _cut_hybrid(
        self, query: MatchQuery, keys: list[int], prompt: Prompt, hits: list[InstanceMatch]
    ) -> list[InstanceMatch]:
        """Hits of hybrid instances cut back by their other groups (indexer/groups.py).

        A hybrid hit is computed for the engine's own limit (``len(token_ids)
        - 1`` tokens for a whole prompt): its rule is not monotone in the
        prompt's length, so a cap applied afterwards would not be the
        engine's answer. A hit that ends inside a block is ``depth`` whole
        blocks and ``tokens`` in all. A cut hit is asked of the index again
        for its shorter prefix, so that its per-tier counts are those of the
        whole blocks reused.
        """
        block = prompt.block_size
        out: list[InstanceMatch] = []
        cut: dict[int, dict[InstanceId, tuple[int, int]]] = {}
        for h in hits:
            if not self.groups.hybrid(h.instance) or not h.depth:
                # Not hybrid, or held by prediction only (nothing confirmed to cut).
                out.append(h)
                continue
            t = self.groups.hit(h.instance, prompt, h.depth)
            d, inside = divmod(t, block)
            tokens = t if inside else 0
            if d == h.depth:
                out.append(h._replace(tokens=tokens) if tokens else h)
            elif d > 0:
                cut.setdefault(d, {})[h.instance] = (tokens, h.predicted_depth)
            elif tokens:  # inside the first block: no whole block reused
                out.append(h._replace(depth=0, gpu_blocks=0, cpu_blocks=0, disk_blocks=0, tokens=t))
        for d, wanted in cut.items():
            again = await self.index.match(query.namespace, keys[:d], include_stale=True)
            out += [
                m._replace(tokens=wanted[m.instance][0], predicted_depth=wanted[m.instance][1])
                for m in again
                if m.instance in wanted and m.depth == d
            ]
        _by_reach(out, block)
        return out

    async def _inside_first_block(
        self, query: MatchQuery, prompt: Prompt, hits: list[InstanceMatch]
    ) -> list[InstanceMatch]:
        """``hits`` and the hybrid instances this replica ingests whose hit ends inside
        the prompt's first block (indexer/groups.py, ``inside_first_block``): listed
        with ``depth`` 0 and ``tokens``, if their lease is live (and not stale, unless
        the query includes stale instances)."""
        model = query.namespace.model
        found = self.groups.inside_first_block(model, prompt, {h.instance for h in hits})
        if not found:
            return hits
        states = {s.spec.instance: s for s in await self.index.list_instances(model)}
        out = list(hits)
        for iid, t in found:
            s = states.get(iid)
            if s is None or not s.live or (s.stale and not query.include_stale):
                continue
            out.append(InstanceMatch(iid, s.spec.address, 0, stale=s.stale, tokens=t))
        _by_reach(out, prompt.block_size)
        return out

    def _prompt(self, query: MatchQuery, keys: list[int], bs: int) -> Prompt:
        """The query as the hybrid hit rule reads it (``bs`` 0: it gave block keys)."""
        tokens = query.token_ids
        if not bs or not tokens:
            return Prompt(keys, bs or self.config.block_size_for(query.namespace.model))
        ns = query.namespace
        whole = len(keys) == len(tokens) // bs  # not truncated by max_blocks
        return Prompt(
            keys,
            bs,
            tokens=tokens,
            seed=namespace_seed(ns.model, ns.lora_name),
            cache_salt=query.cache_salt,
            media=query.media,
            limit=len(tokens) - 1 if whole else len(keys) * bs,
            lora_name=ns.lora_name,
        )

    # -- admin ---------------------------------------------------------------

    async def dump(
        self, model: str = "", max_blocks: int = 0
    ) -> tuple[list[tuple[Namespace, int, dict[InstanceId, int]]], bool]:
        """The index's blocks ``(namespace, key, {instance: tier mask})`` in order, and
        whether ``max_blocks`` (0: :data:`DUMP_MAX_BLOCKS`) cut them short."""
        _check_name(model, "model", required=False)
        cap = max_blocks or DUMP_MAX_BLOCKS
        # No health change on failure: a debugging read without SCAN rights
        # must not take the replica out of service. The backend holds at most
        # ``cap`` blocks' holders, whatever the size of the index.
        return await self.index.dump_blocks(model, cap)

    # -- stats ---------------------------------------------------------------

    async def stats(self) -> ServiceStats:
        """Shared index sizes plus this replica's counters."""
        try:
            idx = await self.index.stats()
        except Unavailable as e:
            self._note_error(e)
            raise
        return ServiceStats(idx, replace(self.counters))


def _by_reach(hits: list[InstanceMatch], block: int) -> None:
    """Sort a hybrid Match's hits as every Match answers: the most tokens reused first
    (``tokens``, or ``depth`` whole blocks), then the longest prediction, then by name."""
    hits.sort(
        key=lambda m: (
            -(m.tokens or m.depth * block),
            -m.predicted_depth,
            m.instance.worker_id,
            m.instance.dp_rank,
        )
    )


#: The marker a hybrid instance's batches store (HYBRID_LORA).
_HYBRID_MARK = BlockStored(
    block_hashes=(HYBRID_MARKER,),
    parent_block_hash=None,
    token_ids=(),
    block_size=0,
    lora_name=HYBRID_LORA,
    block_keys=(HYBRID_MARKER,),
)
