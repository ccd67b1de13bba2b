"""Conversion between kvmesh.indexer.v1 messages and the domain types.

No business logic: values are carried over as they are (token ids stay the
wire's int64, so that indexer/logic.py can reject a negative or too large id
naming its field). The only errors raised here are for messages that have no
domain form at all (an event with no kind, an unknown tier number), as
:class:`~kvmesh.errors.InvalidArgument` with the field path.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from indexer.model import (
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockExtras,
    BlockRemoved,
    BlockStored,
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
    Tier,
)
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.errors import InvalidArgument, KvmeshError
from kvmesh.protowire import varint as _varint

_LITTLE = sys.byteorder == "little"

#: gRPC status code numbers (google.rpc.Code) by name, for BatchError.code.
STATUS_CODE_NUMBERS: dict[str, int] = {
    "OK": 0,
    "CANCELLED": 1,
    "UNKNOWN": 2,
    "INVALID_ARGUMENT": 3,
    "DEADLINE_EXCEEDED": 4,
    "NOT_FOUND": 5,
    "ALREADY_EXISTS": 6,
    "PERMISSION_DENIED": 7,
    "RESOURCE_EXHAUSTED": 8,
    "FAILED_PRECONDITION": 9,
    "ABORTED": 10,
    "OUT_OF_RANGE": 11,
    "UNIMPLEMENTED": 12,
    "INTERNAL": 13,
    "UNAVAILABLE": 14,
    "DATA_LOSS": 15,
    "UNAUTHENTICATED": 16,
}

_OUTCOMES = {
    BatchOutcome.APPLIED: pb.BATCH_OUTCOME_APPLIED,
    BatchOutcome.DUPLICATE: pb.BATCH_OUTCOME_DUPLICATE,
    BatchOutcome.APPLIED_AFTER_GAP: pb.BATCH_OUTCOME_APPLIED_AFTER_GAP,
}


def instance_from_pb(ref: pb.InstanceRef) -> InstanceId:
    """InstanceRef -> InstanceId."""
    return InstanceId(ref.worker_id, ref.dp_rank)


def instance_to_pb(iid: InstanceId) -> pb.InstanceRef:
    """InstanceId -> InstanceRef."""
    return pb.InstanceRef(worker_id=iid.worker_id, dp_rank=iid.dp_rank)


def tier_from_pb(value: int, field: str, *, unspecified: Tier | None) -> Tier | None:
    """Tier enum number -> Tier; UNSPECIFIED gives ``unspecified``."""
    if value == pb.TIER_UNSPECIFIED:
        return unspecified
    try:
        return Tier(value)
    except ValueError:
        raise InvalidArgument(f"unknown tier {value}", field=field) from None


def spec_from_pb(req: pb.RegisterInstanceRequest) -> InstanceSpec:
    """RegisterInstanceRequest -> InstanceSpec (a lease of 0 is kept as 0)."""
    return InstanceSpec(
        instance=instance_from_pb(req.instance),
        model=req.model,
        address=req.address,
        lease_ttl_s=req.lease_ttl_seconds,
        incarnation=req.incarnation,
    )


def state_to_pb(state: InstanceState) -> pb.InstanceInfo:
    """InstanceState -> InstanceInfo."""
    spec = state.spec
    return pb.InstanceInfo(
        instance=instance_to_pb(spec.instance),
        model=spec.model,
        address=spec.address,
        incarnation=spec.incarnation,
        lease_ttl_seconds=spec.lease_ttl_s,
        lease_expires_at=state.lease_expires_at,
        live=state.live,
        stale=state.stale,
        applied_sequence=state.applied_sequence or 0,
        has_applied_sequence=state.applied_sequence is not None,
        blocks=state.blocks,
    )


def state_from_pb(info: pb.InstanceInfo) -> InstanceState:
    """InstanceInfo -> InstanceState."""
    return InstanceState(
        spec=InstanceSpec(
            instance=InstanceId(info.instance.worker_id, info.instance.dp_rank),
            model=info.model,
            address=info.address,
            lease_ttl_s=info.lease_ttl_seconds,
            incarnation=info.incarnation,
        ),
        lease_expires_at=info.lease_expires_at,
        live=info.live,
        stale=info.stale,
        applied_sequence=info.applied_sequence if info.has_applied_sequence else None,
        blocks=info.blocks,
    )


def event_from_pb(ev: pb.Event, path: str) -> Event:
    """Event -> BlockStored | BlockRemoved | AllBlocksCleared."""
    kind = ev.WhichOneof("kind")
    if kind == "stored":
        s = ev.stored
        tier = tier_from_pb(s.tier, f"{path}.stored.tier", unspecified=Tier.GPU)
        assert tier is not None
        return BlockStored(
            block_hashes=tuple(s.block_hashes),
            parent_block_hash=s.parent_block_hash if s.HasField("parent_block_hash") else None,
            token_ids=tuple(s.token_ids),
            block_size=s.block_size,
            lora_name=s.lora_name,
            tier=tier,
            block_keys=tuple(s.block_keys) if s.block_keys else None,
            extras=_extras_from_pb(s, f"{path}.stored"),
            group=s.group_idx,
            group_kind=s.group_kind,
            sliding_window=s.sliding_window,
        )
    if kind == "removed":
        r = ev.removed
        return BlockRemoved(
            block_hashes=tuple(r.block_hashes),
            tier=tier_from_pb(r.tier, f"{path}.removed.tier", unspecified=None),
            group=r.group_idx,
        )
    if kind == "cleared":
        return AllBlocksCleared()
    raise InvalidArgument("event has no kind (stored, removed or cleared)", field=path)


def _extras_from_pb(s: pb.BlockStored, path: str) -> tuple[BlockExtras | None, ...] | None:
    if not s.extra_keys:
        return None
    if len(s.extra_keys) != len(s.block_hashes):
        raise InvalidArgument(
            f"{len(s.extra_keys)} entries for {len(s.block_hashes)} block hashes; need one "
            "per hash (or none)",
            field=f"{path}.extra_keys",
        )
    out: list[BlockExtras | None] = []
    for e in s.extra_keys:
        media = tuple((m.identifier, m.offset) for m in e.media)
        out.append(BlockExtras(e.cache_salt, media) if e.cache_salt or media else None)
    return tuple(out) if any(x is not None for x in out) else None


def batch_from_pb(batch: pb.EventBatch) -> EventBatch:
    """EventBatch message -> EventBatch (field paths relative to the batch)."""
    return EventBatch(
        instance=instance_from_pb(batch.instance),
        sequence=batch.sequence,
        events=tuple(event_from_pb(ev, f"events[{i}]") for i, ev in enumerate(batch.events)),
        timestamp=batch.timestamp,
        incarnation=batch.incarnation,
        counts_copies=batch.counts_copies,
    )


def ack_to_pb(batch: pb.EventBatch, result: ApplyResult) -> pb.BatchAck:
    """ApplyResult of a batch -> BatchAck."""
    return pb.BatchAck(
        instance=batch.instance,
        sequence=batch.sequence,
        outcome=_OUTCOMES[result.outcome],
        applied_sequence=result.applied_sequence,
        blocks_stored=result.blocks_stored,
        blocks_removed=result.blocks_removed,
        blocks_orphaned=result.blocks_orphaned,
        stale=result.stale,
        blocks_skipped=result.blocks_skipped,
    )


def rejected_ack_to_pb(batch: pb.EventBatch, error: KvmeshError) -> pb.BatchAck:
    """A rejected batch -> BatchAck with outcome REJECTED and its BatchError."""
    return pb.BatchAck(
        instance=batch.instance,
        sequence=batch.sequence,
        outcome=pb.BATCH_OUTCOME_REJECTED,
        error=pb.BatchError(
            code=STATUS_CODE_NUMBERS.get(error.code, STATUS_CODE_NUMBERS["INTERNAL"]),
            message=error.message,
            field=error.field,
        ),
    )


def packed_token_ids(data: bytes, field: str = "packed_token_ids") -> array[int]:
    """Little-endian uint32 token ids as ``array('I')``: one copy, no step per id."""
    if len(data) % 4:
        raise InvalidArgument(
            f"{len(data)} bytes, not a whole number of 4-byte token ids", field=field
        )
    ids = array("I")
    ids.frombytes(data)
    if not _LITTLE:  # pragma: no cover - big-endian hosts
        ids.byteswap()
    return ids


def match_query_from_pb(req: pb.MatchRequest) -> MatchQuery:
    """MatchRequest -> MatchQuery (token ids stay raw int64, or the packed array)."""
    tokens: Sequence[int] = req.token_ids
    if req.packed_token_ids:
        if tokens:
            raise InvalidArgument(
                "give token_ids or packed_token_ids, not both", field="packed_token_ids"
            )
        tokens = packed_token_ids(req.packed_token_ids)
    return MatchQuery(
        namespace=Namespace(req.model, req.lora_name),
        token_ids=tokens,
        block_keys=req.block_keys,
        max_blocks=req.max_blocks,
        include_stale=req.include_stale,
        max_instances=req.max_instances,
        cache_salt=req.cache_salt,
        media=tuple((m.identifier, m.offset, m.length) for m in req.media),
        include_predicted=req.include_predicted,
    )


def prediction_from_pb(req: pb.PredictPlacementRequest) -> Prediction:
    """PredictPlacementRequest -> Prediction (an unset instance is an empty worker id)."""
    return Prediction(
        namespace=Namespace(req.model, req.lora_name),
        instance=instance_from_pb(req.instance),
        keys=req.block_keys,
        ttl_s=req.ttl_ms / 1000,
        pending_s=req.pending_ms / 1000 if req.pending_ms else None,
    )


def instance_match_to_pb(m: InstanceMatch) -> pb.InstanceMatch:
    """InstanceMatch -> InstanceMatch message."""
    return pb.InstanceMatch(
        instance=instance_to_pb(m.instance),
        address=m.address,
        depth=m.depth,
        gpu_blocks=m.gpu_blocks,
        cpu_blocks=m.cpu_blocks,
        disk_blocks=m.disk_blocks,
        stale=m.stale,
        tokens=m.tokens,
        predicted_depth=m.predicted_depth,
    )


# Field tags (field number << 3 | wire type) of MatchResponse and InstanceMatch,
# from proto/kvmesh/indexer/v1/indexer.proto; tests/unit/test_match_encoding.py
# checks the encoder against the protobuf runtime.
_TAG_MATCHES = b"\x0a"  # MatchResponse.matches = 1, length-delimited
_TAG_TOTAL_BLOCKS = b"\x10"  # MatchResponse.total_blocks = 2, varint
_TAG_BLOCK_SIZE = b"\x18"  # MatchResponse.block_size = 3, varint
_TAG_PENDING = b"\x22"  # MatchResponse.pending = 4, length-delimited
_PENDING_REPORTED = b"\x28\x01"  # MatchResponse.pending_reported = 5, true
_TAG_PENDING_BLOCKS = b"\x10"  # PendingPrefill.predicted_blocks = 2, varint
_TAG_INSTANCE = b"\x0a"  # InstanceMatch.instance = 1, length-delimited
_TAG_ADDRESS = b"\x12"  # InstanceMatch.address = 2, length-delimited
_TAG_DEPTH = b"\x18"  # InstanceMatch.depth = 3, varint
_TAG_GPU = b"\x20"  # InstanceMatch.gpu_blocks = 4
_TAG_CPU = b"\x28"  # InstanceMatch.cpu_blocks = 5
_TAG_DISK = b"\x30"  # InstanceMatch.disk_blocks = 6
_STALE_TRUE = b"\x38\x01"  # InstanceMatch.stale = 7, true
_TAG_TOKENS = b"\x40"  # InstanceMatch.tokens = 8, varint
_TAG_PREDICTED = b"\x48"  # InstanceMatch.predicted_depth = 9, varint


class MatchResponseEncoder:
    """Writes MatchResponse wire bytes directly, the Match hot path.

    Building one ``InstanceMatch`` message per holder costs about 3 µs in the
    protobuf runtime, and a Match on a shared system prompt returns every
    instance; this encoder caches each instance's ``instance`` + ``address``
    bytes and appends the few varints, and caches whole entries too (most
    holders of a hot prefix answer the same shallow depth call after call).
    The bytes are those the runtime would write (fields in number order,
    defaults omitted), so any protobuf library parses them.
    """

    #: Cached prefixes / entries before a cache starts over: bounds memory when
    #: instances or depths churn; a miss only costs rebuilding a few bytes.
    MAX_CACHED = 65536

    def __init__(self) -> None:
        self._prefixes: dict[tuple[InstanceId, str], bytes] = {}
        self._entries: dict[InstanceMatch, bytes] = {}

    def _prefix(self, iid: InstanceId, address: str) -> bytes:
        key = (iid, address)
        prefix = self._prefixes.get(key)
        if prefix is None:
            ref = instance_to_pb(iid).SerializeToString()
            prefix = _TAG_INSTANCE + _varint(len(ref)) + ref
            if address:
                addr = address.encode("utf-8")
                prefix += _TAG_ADDRESS + _varint(len(addr)) + addr
            if len(self._prefixes) >= self.MAX_CACHED:
                self._prefixes.clear()
            self._prefixes[key] = prefix
        return prefix

    def encode(self, result: MatchResult) -> bytes:
        """The serialized MatchResponse of ``result``."""
        parts: list[bytes] = []
        append = parts.append
        entries = self._entries
        for m in result.matches:
            entry = entries.get(m)
            if entry is None:
                entry = self._entry(m)
                if len(entries) >= self.MAX_CACHED:
                    entries.clear()
                entries[m] = entry
            append(entry)
        if result.total_blocks:
            append(_TAG_TOTAL_BLOCKS + _varint(result.total_blocks))
        if result.block_size:
            append(_TAG_BLOCK_SIZE + _varint(result.block_size))
        if result.pending is not None:
            varint = _varint
            for iid, n in result.pending.items():
                # PendingPrefill.instance = 1 is InstanceMatch's tag 1 too.
                body = self._prefix(iid, "")
                if n:
                    body += _TAG_PENDING_BLOCKS + varint(n)
                append(_TAG_PENDING + varint(len(body)) + body)
            append(_PENDING_REPORTED)
        return b"".join(parts)

    def _entry(self, m: InstanceMatch) -> bytes:
        varint = _varint
        body = self._prefix(m.instance, m.address)
        if m.depth:
            body += _TAG_DEPTH + varint(m.depth)
        if m.gpu_blocks:
            body += _TAG_GPU + varint(m.gpu_blocks)
        if m.cpu_blocks:
            body += _TAG_CPU + varint(m.cpu_blocks)
        if m.disk_blocks:
            body += _TAG_DISK + varint(m.disk_blocks)
        if m.stale:
            body += _STALE_TRUE
        if m.tokens:
            body += _TAG_TOKENS + varint(m.tokens)
        if m.predicted_depth:
            body += _TAG_PREDICTED + varint(m.predicted_depth)
        return _TAG_MATCHES + varint(len(body)) + body


def match_result_to_pb(result: MatchResult) -> pb.MatchResponse:
    """MatchResult -> MatchResponse."""
    pending = result.pending
    return pb.MatchResponse(
        matches=[instance_match_to_pb(m) for m in result.matches],
        total_blocks=result.total_blocks,
        block_size=result.block_size,
        pending=[
            pb.PendingPrefill(instance=instance_to_pb(iid), predicted_blocks=n)
            for iid, n in (pending or {}).items()
        ],
        pending_reported=pending is not None,
    )


def stats_to_pb(stats: ServiceStats) -> pb.GetStatsResponse:
    """ServiceStats -> GetStatsResponse."""
    idx, c = stats.index, stats.counters
    return pb.GetStatsResponse(
        backend=idx.backend,
        instances=idx.instances,
        instances_live=idx.instances_live,
        instances_stale=idx.instances_stale,
        blocks=idx.blocks,
        block_instances=idx.block_instances,
        namespaces=[
            pb.NamespaceStats(
                model=ns.namespace.model,
                lora_name=ns.namespace.lora_name,
                blocks=ns.blocks,
                block_instances=ns.block_instances,
            )
            for ns in idx.namespaces
        ],
        batches_applied=c.batches_applied,
        batches_duplicate=c.batches_duplicate,
        batches_rejected=c.batches_rejected,
        sequence_gaps=c.sequence_gaps,
        matches=c.matches,
        matched_blocks=c.matched_blocks,
        predicted_blocks=idx.predicted_blocks,
        predictions_recorded=c.predictions_recorded,
        predicted_matches=c.predicted_matches,
    )


def dumped_block_to_pb(ns: Namespace, key: int, holders: dict[InstanceId, int]) -> pb.DumpedBlock:
    """One block of a dump -> DumpedBlock (holders by worker id and rank, tiers fastest first)."""
    return pb.DumpedBlock(
        model=ns.model,
        lora_name=ns.lora_name,
        block_key=key,
        holders=[
            pb.DumpedHolder(
                instance=pb.InstanceRef(worker_id=inst.worker_id, dp_rank=inst.dp_rank),
                tiers=[pb.Tier.Name(t.value) for t in Tier if mask & t.bit],
            )
            for inst, mask in sorted(holders.items())
        ],
    )
