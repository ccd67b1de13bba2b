"""Conversion between kvmesh.indexer.v1 messages and the domain types.

No business logic: values are carried over as they are (token ids stay the
wire's int64, so that indexer/service.py can reject a negative or too large id
naming its field). The only errors raised here are for messages that have no
domain form at all (an event with no kind, an unknown tier number), as
:class:`~indexer.errors.InvalidArgument` with the field path.
"""

from __future__ import annotations

from indexer.errors import InvalidArgument, KvmeshError
from indexer.model import (
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
from indexer.service import MatchQuery, MatchResult, ServiceStats
from kvmesh.indexer.v1 import indexer_pb2 as pb

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
        )
    if kind == "removed":
        r = ev.removed
        return BlockRemoved(
            block_hashes=tuple(r.block_hashes),
            tier=tier_from_pb(r.tier, f"{path}.removed.tier", unspecified=None),
        )
    if kind == "cleared":
        return AllBlocksCleared()
    raise InvalidArgument("event has no kind (stored, removed or cleared)", field=path)


def batch_from_pb(batch: pb.EventBatch) -> EventBatch:
    """EventBatch message -> EventBatch (field paths relative to the batch)."""
    return EventBatch(
        instance=instance_from_pb(batch.instance),
        sequence=batch.sequence,
        events=tuple(event_from_pb(ev, f"events[{i}]") for i, ev in enumerate(batch.events)),
        timestamp=batch.timestamp,
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


def match_query_from_pb(req: pb.MatchRequest) -> MatchQuery:
    """MatchRequest -> MatchQuery (token ids stay raw int64)."""
    return MatchQuery(
        namespace=Namespace(req.model, req.lora_name),
        token_ids=req.token_ids,
        block_keys=req.block_keys,
        max_blocks=req.max_blocks,
        include_stale=req.include_stale,
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
    )


def match_result_to_pb(result: MatchResult) -> pb.MatchResponse:
    """MatchResult -> MatchResponse."""
    return pb.MatchResponse(
        matches=[instance_match_to_pb(m) for m in result.matches],
        total_blocks=result.total_blocks,
        block_size=result.block_size,
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
    )
