"""Event publishing over gRPC: registration, sequences, staleness, caps, streams."""

from __future__ import annotations

from typing import Any

import grpc

from indexer.model import InstanceId
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from tests.grpc.conftest import (
    BLOCK,
    Harness,
    batch,
    cleared,
    expect_status,
    match,
    publish,
    ref,
    register,
    removed,
    stored,
)

A = list(range(1, 1 + BLOCK))
B = list(range(50, 50 + BLOCK))


async def test_events_from_unregistered_instance_fail_precondition(stub: Any) -> None:
    err = await expect_status(
        publish(stub, batch(1, stored([1], A), worker="ghost")),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert "ghost" in (err.details() or "")


async def test_duplicate_batch_is_acked_and_changes_nothing(harness: Harness) -> None:
    stub = harness.stub
    await register(stub)
    first = await publish(stub, batch(1, stored([1], A)))
    assert first.outcome == pb.BATCH_OUTCOME_APPLIED
    before = await harness.index.dump()
    # Same sequence, different content: must not be applied.
    dup = await publish(stub, batch(1, removed([1]), stored([2], B, parent=1)))
    assert dup.outcome == pb.BATCH_OUTCOME_DUPLICATE
    assert dup.applied_sequence == 1 and dup.blocks_stored == 0 and dup.blocks_removed == 0
    after = await harness.index.dump()
    assert after.blocks == before.blocks and after.engine_hashes == before.engine_hashes
    stats = await stub.GetStats(pb.GetStatsRequest())
    assert (stats.batches_applied, stats.batches_duplicate) == (1, 1)


async def test_sequence_gap_makes_instance_stale_until_cleared(stub: Any) -> None:
    await register(stub)
    await publish(stub, batch(1, stored([1], A)))
    gap = await publish(stub, batch(3, stored([2], B, parent=1)))
    assert gap.outcome == pb.BATCH_OUTCOME_APPLIED_AFTER_GAP and gap.stale
    assert list((await match(stub, A + B)).matches) == []  # hidden by default
    flagged = await match(stub, A + B, include_stale=True)
    assert [(m.depth, m.stale) for m in flagged.matches] == [(2, True)]
    assert (await stub.GetStats(pb.GetStatsRequest())).sequence_gaps == 1
    # Resync: a batch starting with AllBlocksCleared, then the replay.
    resync = await publish(stub, batch(4, cleared(), stored([1], A)))
    assert resync.outcome == pb.BATCH_OUTCOME_APPLIED and not resync.stale
    fresh = await match(stub, A + B)
    assert [(m.depth, m.stale) for m in fresh.matches] == [(1, False)]


async def test_removing_unknown_blocks_is_ignored(stub: Any) -> None:
    await register(stub)
    await publish(stub, batch(1, stored([1], A)))
    ack = await publish(stub, batch(2, removed([999, 12345])))
    assert ack.outcome == pb.BATCH_OUTCOME_APPLIED and ack.blocks_removed == 0
    assert [m.depth for m in (await match(stub, A)).matches] == [1]


async def test_too_many_events_per_batch_names_field(harness: Harness) -> None:
    cap = harness.server.config.limits.max_events_per_batch
    await register(harness.stub)
    err = await expect_status(
        publish(harness.stub, batch(1, *[cleared()] * (cap + 1))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert (err.details() or "").startswith("events:")
    assert str(cap) in (err.details() or "")


async def test_too_many_blocks_per_event_names_field(harness: Harness) -> None:
    cap = harness.server.config.limits.max_blocks_per_event
    await register(harness.stub)
    err = await expect_status(
        publish(harness.stub, batch(1, cleared(), removed(list(range(cap + 1))))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert (err.details() or "").startswith("events[1].removed.block_hashes:")


async def test_bad_token_id_in_event_names_path(stub: Any) -> None:
    await register(stub)
    tokens = [*A, *B]
    tokens[BLOCK + 2] = -7
    err = await expect_status(
        publish(stub, batch(1, cleared(), stored([1, 2], tokens))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert (err.details() or "").startswith(f"events[1].stored.token_ids[{BLOCK + 2}]:")


async def test_wrong_token_count_and_empty_event(stub: Any) -> None:
    await register(stub)
    err = await expect_status(
        publish(stub, batch(1, stored([1, 2], A))), grpc.StatusCode.INVALID_ARGUMENT
    )
    assert (err.details() or "").startswith("events[0].stored.token_ids:")
    err = await expect_status(publish(stub, batch(1, pb.Event())), grpc.StatusCode.INVALID_ARGUMENT)
    assert (err.details() or "").startswith("events[0]:")


async def test_rejected_batch_applies_nothing(harness: Harness) -> None:
    await register(harness.stub)
    await expect_status(
        publish(harness.stub, batch(1, stored([1], A), stored([2], [-1] * BLOCK, parent=1))),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    dump = await harness.index.dump()
    assert dump.engine_hashes.get(InstanceId("w0", 0), {}) == {}
    assert dump.instances[InstanceId("w0", 0)].applied_sequence is None


async def test_stream_acks_in_order_and_survives_a_rejected_batch(stub: Any) -> None:
    await register(stub)
    reqs = [
        batch(1, stored([1], A)),
        batch(2, stored([2], [1 << 32] * BLOCK, parent=1)),  # rejected
        batch(2, stored([2], B, parent=1)),  # same sequence, now valid
        batch(2, removed([2])),  # duplicate
        pb.EventBatch(instance=ref("ghost"), sequence=1, events=[cleared()]),  # unregistered
        batch(3, stored([3], A, parent=2)),
    ]
    call = stub.PublishEventsStream(pb.PublishEventsStreamRequest(batch=b) for b in reqs)
    acks = [r.ack async for r in call]
    assert await call.code() == grpc.StatusCode.OK
    assert [(a.instance.worker_id, a.sequence, a.outcome) for a in acks] == [
        ("w0", 1, pb.BATCH_OUTCOME_APPLIED),
        ("w0", 2, pb.BATCH_OUTCOME_REJECTED),
        ("w0", 2, pb.BATCH_OUTCOME_APPLIED),
        ("w0", 2, pb.BATCH_OUTCOME_DUPLICATE),
        ("ghost", 1, pb.BATCH_OUTCOME_REJECTED),
        ("w0", 3, pb.BATCH_OUTCOME_APPLIED),
    ]
    bad = acks[1].error
    assert bad.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert bad.field == "events[0].stored.token_ids[0]"
    assert acks[4].error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
    assert all(a.error.code not in (0, 2) for a in acks if a.outcome == pb.BATCH_OUTCOME_REJECTED)
    assert [m.depth for m in (await match(stub, A + B + A)).matches] == [3]


async def test_oversized_message_is_resource_exhausted() -> None:
    from indexer.memory import MemoryIndex
    from tests.grpc.conftest import close_harness, make_config, open_harness

    h = await open_harness(
        make_config(limits={"max_message_bytes": 64 * 1024, "max_match_blocks": 1024}),
        MemoryIndex(),
    )
    try:
        await register(h.stub)
        # 4000 blocks (under the per-event cap) of 5-byte token ids: ~80 KiB > 64 KiB.
        big = batch(1, stored(list(range(4000)), [1 << 31] * (4000 * BLOCK)))
        await expect_status(publish(h.stub, big), grpc.StatusCode.RESOURCE_EXHAUSTED)
        await expect_status(match(h.stub, [1 << 31] * 40_000), grpc.StatusCode.RESOURCE_EXHAUSTED)
        # The server still serves normal calls afterwards.
        assert (await publish(h.stub, batch(1, stored([1], A)))).blocks_stored == 1
    finally:
        await close_harness(h)


async def test_instances_lifecycle(stub: Any) -> None:
    r = await register(stub, address="http://10.0.0.1:8000", ttl=5)
    assert r.reset and r.info.lease_ttl_seconds == 5 and r.info.live
    again = await register(stub, address="http://10.0.0.1:8000", ttl=5)
    assert not again.reset
    hb = await stub.Heartbeat(pb.HeartbeatRequest(instance=ref()))
    assert hb.lease_expires_at > 0
    await publish(stub, batch(1, stored([1], A)))
    listed = await stub.ListInstances(pb.ListInstancesRequest())
    assert [(i.instance.worker_id, i.blocks, i.applied_sequence) for i in listed.instances] == [
        ("w0", 1, 1)
    ]
    gone = await stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref()))
    assert gone.blocks_removed == 1
    await expect_status(
        stub.Heartbeat(pb.HeartbeatRequest(instance=ref())), grpc.StatusCode.NOT_FOUND
    )
    await expect_status(
        stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref())), grpc.StatusCode.NOT_FOUND
    )


async def test_register_validation(stub: Any) -> None:
    err = await expect_status(
        stub.RegisterInstance(pb.RegisterInstanceRequest(instance=ref(""), model="m")),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert (err.details() or "").startswith("instance.worker_id:")
    err = await expect_status(
        stub.RegisterInstance(
            pb.RegisterInstanceRequest(instance=ref(), model="m", lease_ttl_seconds=-1)
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )
    assert (err.details() or "").startswith("lease_ttl_seconds:")
