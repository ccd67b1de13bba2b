"""SGLang's kv_indexer.v1.KVIndexer API served by a real in-process indexer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from indexer.memory import MemoryIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2 as spb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2_grpc as spb_grpc
from tests.grpc.conftest import Harness, close_harness, expect_status, make_config, open_harness

# Signed 64-bit hashes as SGLang sends them, negative ones included.
H = [978178666101069530, -895308556211281782, -8033692805846017938, 835415944263129316, 7, -1]
# Echoed byte for byte: not normalised in any way.
ADDR_A = "http://10.0.0.1:30000/ü?x=1 "
ADDR_B = "http://10.0.0.2:30000"


@pytest.fixture
async def h() -> AsyncIterator[Harness]:
    harness = await open_harness(make_config(), MemoryIndex())
    try:
        yield harness
    finally:
        await close_harness(harness)


@pytest.fixture
def sg(h: Harness) -> Any:
    return spb_grpc.KVIndexerStub(h.channel)


def report(hashes: list[int], tier: int = spb.TIER_HBM) -> spb.ExternalKvAction:
    return spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=tier, hashes=hashes)


def revoke(hashes: list[int], tier: int = spb.TIER_HBM) -> spb.ExternalKvAction:
    return spb.ExternalKvAction(type=spb.ACTION_REVOKE, tier=tier, hashes=hashes)


async def apply(
    sg: Any, worker: str, seq: int, *actions: spb.ExternalKvAction, address: str = "", **kw: Any
) -> spb.ApplyExternalKvBatchResponse:
    resp: spb.ApplyExternalKvBatchResponse = await sg.ApplyExternalKvBatch(
        spb.ApplyExternalKvBatchRequest(
            worker_id=worker,
            seq=seq,
            actions=list(actions),
            worker_address=address or (ADDR_A if worker == "a" else ADDR_B),
            **kw,
        )
    )
    return resp


async def prefix(sg: Any, hashes: list[int], max_blocks: int = 0) -> dict[str, int]:
    resp = await sg.MatchExternalKvPrefix(
        spb.MatchExternalKvPrefixRequest(hashes=hashes, max_blocks=max_blocks)
    )
    return {m.worker_address: m.matched_prefix_blocks for m in resp.matches}


async def test_prefix_match_is_gap_free_sorted_and_echoes_the_address(sg: Any) -> None:
    await apply(sg, "a", 0, report(H[:4]))
    await apply(sg, "b", 0, report(H[:2]), report(H[3:4]))
    resp = await sg.MatchExternalKvPrefix(spb.MatchExternalKvPrefixRequest(hashes=H[:5]))
    assert [(m.worker_address, m.matched_prefix_blocks, m.worker_id) for m in resp.matches] == [
        (ADDR_A, 4, "a"),
        (ADDR_B, 2, "b"),  # holds H[3] too, but not H[2]: the prefix stops at the gap
    ]
    assert resp.matches[0].worker_address.encode() == ADDR_A.encode()
    assert resp.best_prefix_blocks == 4
    assert resp.blocks_read == 5
    assert await prefix(sg, H[:5], max_blocks=1) == {ADDR_A: 1, ADDR_B: 1}
    assert await prefix(sg, [99, *H[:4]]) == {}  # a match starts at the first block


async def test_match_external_kv_round_trips_signed_hashes_and_tiers(sg: Any) -> None:
    await apply(sg, "a", 0, report([H[1], H[5]], spb.TIER_DRAM), report([H[2]], spb.TIER_SSD))
    resp = await sg.MatchExternalKv(
        spb.MatchExternalKvRequest(hashes=[H[1], H[2], H[5], 12345], count_as_hit=True)
    )
    assert len(resp.matches) == 1
    node = resp.matches[0]
    assert (node.worker_id, node.address) == ("a", ADDR_A)
    by_tier = {t.tier: list(t.hashes) for t in node.hashes_by_tier}
    assert by_tier == {spb.TIER_DRAM: [H[1], H[5]], spb.TIER_SSD: [H[2]]}
    counts = await sg.GetExternalKvHitCounts(
        spb.GetExternalKvHitCountsRequest(hashes=[H[1], 12345])
    )
    assert [(e.hash, e.hit_count_total) for e in counts.entries] == [(H[1], 1), (12345, 0)]


async def test_hit_counts_follow_prefix_matches(sg: Any) -> None:
    await apply(sg, "a", 0, report(H[:3]))
    for _ in range(3):
        await prefix(sg, H[:2])
    await prefix(sg, H[:3])
    counts = await sg.GetExternalKvHitCounts(spb.GetExternalKvHitCountsRequest(hashes=H[:4]))
    assert [e.hit_count_total for e in counts.entries] == [4, 4, 1, 0]


async def test_duplicates_are_acknowledged_and_not_reapplied(sg: Any) -> None:
    r = await apply(sg, "a", 1, report(H[:3]))
    assert (r.applied_seq, r.duplicate) == (1, False)
    r = await apply(sg, "a", 1, revoke(H[:1]))  # a retry carrying a different body
    assert (r.applied_seq, r.duplicate) == (1, True)
    assert await prefix(sg, H[:3]) == {ADDR_A: 3}
    r = await apply(sg, "a", 2, revoke(H[2:3]))
    assert (r.applied_seq, r.duplicate) == (2, False)
    assert await prefix(sg, H[:3]) == {ADDR_A: 2}


async def test_sequence_zero_after_higher_is_a_restarted_stream(sg: Any) -> None:
    await apply(sg, "a", 0, report(H[:3]))
    await apply(sg, "a", 1, report(H[3:4]))
    r = await apply(sg, "a", 0, report(H[:1]))  # the worker restarted: empty cache
    assert (r.applied_seq, r.duplicate) == (0, False)
    assert await prefix(sg, H[:4]) == {ADDR_A: 1}


async def test_a_new_epoch_resets_the_worker(sg: Any) -> None:
    await apply(sg, "a", 3, report(H[:3]), worker_epoch="e1")
    await apply(sg, "a", 1, report(H[:1]), worker_epoch="e2")
    assert await prefix(sg, H[:3]) == {ADDR_A: 1}


async def test_legacy_gap_marks_the_worker_stale(h: Harness, sg: Any) -> None:
    await apply(sg, "a", 0, report(H[:2]))
    r = await apply(sg, "a", 5, report(H[2:3]))
    assert r.applied_seq == 5
    assert await prefix(sg, H[:3]) == {}  # stale: hidden until a resync
    await sg.ReplaceExternalKvSnapshot(
        spb.ReplaceExternalKvSnapshotRequest(
            worker_id="a",
            worker_address=ADDR_A,
            applied_seq=9,
            hashes_by_tier=[spb.TierHashes(tier=spb.TIER_HBM, hashes=H[:3])],
        )
    )
    assert await prefix(sg, H[:3]) == {ADDR_A: 3}


async def test_enforced_sequence_needs_a_snapshot_and_fences_gaps(sg: Any) -> None:
    err = await expect_status(
        apply(sg, "a", 1, report(H[:1]), worker_epoch="e1", enforce_sequence=True),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    assert "snapshot" in (err.details() or "")
    await apply(sg, "a", 0, report(H[4:6]))  # what the snapshot replaces
    snap = await sg.ReplaceExternalKvSnapshot(
        spb.ReplaceExternalKvSnapshotRequest(
            worker_id="a",
            worker_address=ADDR_A,
            worker_epoch="e1",
            applied_seq=10,
            hashes_by_tier=[
                spb.TierHashes(tier=spb.TIER_HBM, hashes=H[:2]),
                spb.TierHashes(tier=spb.TIER_DRAM, hashes=H[2:3]),
            ],
        )
    )
    assert snap.applied_seq == 10
    assert await prefix(sg, H[:3]) == {ADDR_A: 3}
    assert await prefix(sg, H[4:6]) == {}  # replaced, not merged
    ok = dict(worker_epoch="e1", enforce_sequence=True)
    r = await apply(sg, "a", 11, report(H[3:4]), **ok)
    assert (r.applied_seq, r.duplicate) == (11, False)
    r = await apply(sg, "a", 10, revoke(H[:1]), **ok)
    assert r.duplicate
    await expect_status(
        apply(sg, "a", 12, report(H[:1]), worker_epoch="e0", enforce_sequence=True),
        grpc.StatusCode.FAILED_PRECONDITION,
    )
    await expect_status(apply(sg, "a", 13, **ok), grpc.StatusCode.FAILED_PRECONDITION)
    assert await prefix(sg, H[:4]) == {}  # a gap clears the worker
    await expect_status(apply(sg, "a", 14, **ok), grpc.StatusCode.FAILED_PRECONDITION)


async def test_clear_all_at_tier_clears_the_worker(sg: Any) -> None:
    await apply(sg, "a", 0, report(H[:2]))
    clear = spb.ExternalKvAction(type=spb.ACTION_CLEAR_ALL_AT_TIER, tier=spb.TIER_HBM)
    await apply(sg, "a", 1, clear, report(H[:1]))
    assert await prefix(sg, H[:2]) == {ADDR_A: 1}


async def test_configure_expected_workers_registers_and_scales_in(h: Harness, sg: Any) -> None:
    # A kvmesh-API instance in the same namespace is never touched by scale-in.
    await h.stub.RegisterInstance(
        pb.RegisterInstanceRequest(
            instance=pb.InstanceRef(worker_id="native"), model="sglang", address="http://n"
        )
    )
    resp = await sg.ConfigureExpectedWorkers(
        spb.ConfigureExpectedWorkersRequest(
            workers=[
                spb.ExpectedWorker(worker_id="a", worker_address=ADDR_A),
                spb.ExpectedWorker(worker_id="b", worker_address=ADDR_B),
            ]
        )
    )
    assert (resp.total_workers, resp.ready_workers) == (2, 0)
    await apply(sg, "a", 0, report(H[:2]))
    await apply(sg, "b", 0, report(H[:1]))
    resp = await sg.ConfigureExpectedWorkers(
        spb.ConfigureExpectedWorkersRequest(
            workers=[spb.ExpectedWorker(worker_id="a", worker_address=ADDR_A)]
        )
    )
    assert (resp.total_workers, resp.ready_workers) == (1, 1)
    assert await prefix(sg, H[:2]) == {ADDR_A: 2}
    listed = await h.stub.ListInstances(pb.ListInstancesRequest(model="sglang"))
    assert sorted(i.instance.worker_id for i in listed.instances) == ["a", "native"]
    await expect_status(
        sg.ConfigureExpectedWorkers(
            spb.ConfigureExpectedWorkersRequest(
                workers=[spb.ExpectedWorker(worker_id="a"), spb.ExpectedWorker(worker_id="a")]
            )
        ),
        grpc.StatusCode.INVALID_ARGUMENT,
    )


async def test_same_index_as_kvmesh_api(h: Harness, sg: Any) -> None:
    await apply(sg, "a", 0, report(H[:3]))
    resp = await h.stub.Match(
        pb.MatchRequest(model="sglang", block_keys=[k & (2**64 - 1) for k in H[:3]])
    )
    assert [(m.instance.worker_id, m.depth, m.address) for m in resp.matches] == [("a", 3, ADDR_A)]


@pytest.mark.parametrize(
    ("action", "field"),
    [
        (spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=spb.TIER_UNKNOWN, hashes=[1]), "tier"),
        (spb.ExternalKvAction(type=spb.ACTION_UNKNOWN, tier=spb.TIER_HBM, hashes=[1]), "type"),
        (spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=spb.TIER_HBM), "hashes"),
    ],
)
async def test_bad_actions_are_invalid_argument(
    sg: Any, action: spb.ExternalKvAction, field: str
) -> None:
    err = await expect_status(apply(sg, "a", 0, action), grpc.StatusCode.INVALID_ARGUMENT)
    assert dict(err.trailing_metadata() or ())["kvmesh-error-field"] == f"actions[0].{field}"


async def test_bad_requests_are_invalid_argument(sg: Any) -> None:
    await expect_status(apply(sg, "", 0, report([1])), grpc.StatusCode.INVALID_ARGUMENT)
    for call in (
        sg.MatchExternalKvPrefix(spb.MatchExternalKvPrefixRequest()),
        sg.MatchExternalKv(spb.MatchExternalKvRequest()),
        sg.GetExternalKvHitCounts(spb.GetExternalKvHitCountsRequest()),
        sg.ReplaceExternalKvSnapshot(spb.ReplaceExternalKvSnapshotRequest()),
    ):
        await expect_status(call, grpc.StatusCode.INVALID_ARGUMENT)


async def test_health_and_reflection_name_the_service(h: Harness) -> None:
    name = "kv_indexer.v1.KVIndexer"
    hc = health_pb2_grpc.HealthStub(h.channel)
    resp = await hc.Check(health_pb2.HealthCheckRequest(service=name))
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    rs = reflection_pb2_grpc.ServerReflectionStub(h.channel)
    call = rs.ServerReflectionInfo()
    await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
    reply = await call.read()
    await call.done_writing()
    assert name in {s.name for s in reply.list_services_response.service}


async def test_disabled_api_is_unimplemented() -> None:
    harness = await open_harness(make_config(sglang={"enabled": False}), MemoryIndex())
    try:
        sg = spb_grpc.KVIndexerStub(harness.channel)
        await expect_status(
            sg.MatchExternalKvPrefix(spb.MatchExternalKvPrefixRequest(hashes=[1])),
            grpc.StatusCode.UNIMPLEMENTED,
        )
    finally:
        await close_harness(harness)
