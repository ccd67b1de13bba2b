"""The bridge's side of the indexer API's messages: domain batches out, states and acks in.

:func:`batch_to_pb` writes a decoded engine batch (indexer/kvevents/decode.py)
as the ``EventBatch`` the indexer's ``PublishEventsStream`` reads back with
:func:`indexer.convert.batch_from_pb`, field for field: hashes, parent, token
ids, block size, LoRA, tier, precomputed keys, the salt and multimodal extra
keys, the KV-cache group, ``counts_copies`` and the incarnation fence.

Two things a decoded event may hold have no field in the API, and sending the
event without them would key its blocks wrongly (a block keyed as plain tokens
that the engine hashed with more than its tokens): :func:`sendable` leaves
such events out and counts their blocks by reason, as the indexer skips them
on its own ZMQ path (``lookahead``: tokens past the block entered its hash;
``opaque_extras``: extra keys that are neither a salt nor a multimodal item,
e.g. prompt-embedding digests). The blocks that chain from them then arrive as
orphans: the index under-reports, never over.

:data:`ERRORS_BY_CODE` is the one table from a gRPC status code (a call's, or
an ack's ``BatchError.code``) to the error the stream logic acts on
(indexer/kvevents/sink.py).
"""

from __future__ import annotations

import re
from typing import cast

from indexer.model import (
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    InstanceId,
    InstanceSpec,
)
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)

#: Why the bridge left blocks out of a batch (the API cannot carry what keys them).
UNSENDABLE_REASONS = {
    "lookahead": "the engine hashed tokens past the block (speculative lookahead)",
    "opaque_extras": "extra keys that are neither a cache salt nor a multimodal item",
}

#: gRPC status code number -> the error raised for it. Unavailable means "try
#: again" to the stream logic: every code a healthy indexer answers while a
#: replica, its backend or its connection is away or overloaded. A code not
#: listed is a refusal of its own kind (a plain KvmeshError naming the code).
ERRORS_BY_CODE: dict[int, type[KvmeshError]] = {
    1: Unavailable,  # CANCELLED: a replica shutting down cancels its calls
    3: InvalidArgument,
    4: Unavailable,  # DEADLINE_EXCEEDED: a replica or its backend too slow
    5: NotFound,
    7: PermissionDenied,
    8: Unavailable,  # RESOURCE_EXHAUSTED: a rate limit or the overload guard
    9: FailedPrecondition,
    10: Unavailable,  # ABORTED
    14: Unavailable,
    16: Unauthenticated,
}

_CODE_NAMES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}

_EVENT_FIELD = re.compile(r"^events\[(\d+)\]")

_OUTCOMES = {
    pb.BATCH_OUTCOME_APPLIED: BatchOutcome.APPLIED,
    pb.BATCH_OUTCOME_DUPLICATE: BatchOutcome.DUPLICATE,
    pb.BATCH_OUTCOME_APPLIED_AFTER_GAP: BatchOutcome.APPLIED_AFTER_GAP,
}


def error_for(code: int, message: str, field: str = "") -> KvmeshError:
    """The error of status ``code`` (:data:`ERRORS_BY_CODE`), with the server's message."""
    cls = ERRORS_BY_CODE.get(code)
    if cls is not None:
        return cls(message, field=field)
    return KvmeshError(f"{_CODE_NAMES.get(code, str(code))}: {message}", field=field)


def event_index(field: str) -> int | None:
    """The event an error's field names (``events[3].stored.token_ids[7]`` -> 3)."""
    m = _EVENT_FIELD.match(field)
    return int(m.group(1)) if m else None


def sendable(events: tuple[Event, ...]) -> tuple[tuple[Event, ...], dict[str, int]]:
    """``events`` without those the API cannot carry, and their blocks by reason."""
    left_out: dict[str, int] = {}
    kept: list[Event] = []
    for ev in events:
        reason = ""
        if isinstance(ev, BlockStored):
            if ev.lookahead:
                reason = "lookahead"
            elif ev.extras is not None and any(e is not None and e.other for e in ev.extras):
                reason = "opaque_extras"
        if reason and isinstance(ev, BlockStored):
            left_out[reason] = left_out.get(reason, 0) + len(ev.block_hashes)
        else:
            kept.append(ev)
    if not left_out:
        return events, left_out
    return tuple(kept), left_out


def event_to_pb(ev: Event) -> pb.Event:
    """One domain event as its message (see the module doc for what it cannot carry)."""
    if isinstance(ev, BlockStored):
        s = pb.BlockStored(
            block_hashes=ev.block_hashes,
            token_ids=ev.token_ids,
            block_size=ev.block_size,
            lora_name=ev.lora_name,
            tier=cast(pb.Tier, ev.tier.value),
            block_keys=ev.block_keys or (),
            group_idx=ev.group,
            group_kind=ev.group_kind,
            sliding_window=ev.sliding_window,
        )
        if ev.parent_block_hash is not None:
            s.parent_block_hash = ev.parent_block_hash
        if ev.extras is not None:
            for e in ev.extras:
                x = s.extra_keys.add()
                if e is not None:
                    x.cache_salt = e.salt
                    for identifier, offset in e.media:
                        x.media.add(identifier=identifier, offset=offset)
        return pb.Event(stored=s)
    if isinstance(ev, BlockRemoved):
        tier = pb.TIER_UNSPECIFIED if ev.tier is None else cast(pb.Tier, ev.tier.value)
        return pb.Event(
            removed=pb.BlockRemoved(block_hashes=ev.block_hashes, tier=tier, group_idx=ev.group)
        )
    assert isinstance(ev, AllBlocksCleared)
    return pb.Event(cleared=pb.AllBlocksCleared())


def instance_to_pb(iid: InstanceId) -> pb.InstanceRef:
    """InstanceId -> InstanceRef."""
    return pb.InstanceRef(worker_id=iid.worker_id, dp_rank=iid.dp_rank)


def batch_to_pb(batch: EventBatch) -> pb.EventBatch:
    """A domain batch as its message, fences and ``counts_copies`` included."""
    return pb.EventBatch(
        instance=instance_to_pb(batch.instance),
        sequence=batch.sequence,
        timestamp=batch.timestamp,
        events=[event_to_pb(ev) for ev in batch.events],
        counts_copies=batch.counts_copies,
        incarnation=batch.incarnation,
    )


def spec_to_pb(spec: InstanceSpec) -> pb.RegisterInstanceRequest:
    """An instance's registration as its request."""
    return pb.RegisterInstanceRequest(
        instance=instance_to_pb(spec.instance),
        model=spec.model,
        address=spec.address,
        lease_ttl_seconds=spec.lease_ttl_s,
        incarnation=spec.incarnation,
    )


def result_from_ack(ack: pb.BatchAck) -> ApplyResult:
    """The ApplyResult of an ack that is not REJECTED."""
    return ApplyResult(
        outcome=_OUTCOMES[ack.outcome],
        applied_sequence=ack.applied_sequence,
        blocks_stored=ack.blocks_stored,
        blocks_removed=ack.blocks_removed,
        blocks_orphaned=ack.blocks_orphaned,
        stale=ack.stale,
        blocks_skipped=ack.blocks_skipped,
    )
