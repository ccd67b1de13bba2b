"""Per-identity quotas against real servers: each quota, its policy override, admin
headroom, LoRA names, and the counts shared by two replicas over one Redis.

Mutual TLS and the test policy (tests/security/pki.py), on the memory backend
and a real redis-server. Issue 20's attacks at the defaults are in
test_quota_findings.py; the counts themselves, backend by backend, in
test_quota_accounting.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from indexer.config import Quotas
from indexer.model import Quota, QuotaUsage
from indexer.redis.backend import RedisIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.auth import IdentityQuotas
from tests.grpc.conftest import BLOCK, MODEL, batch, expect_status, ref
from tests.security.pki import Pki
from tests.security.quota_calls import (
    BACKENDS,
    backend_overrides,
    blocks_of,
    callers,
    chain,
    field_of,
    keyed,
    policy_with,
    publish,
    serving,
    try_register,
)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Config overrides of each backend."""
    return backend_overrides(request)


# -- finding 1: one engine denies registration to every other ----------------------------


async def test_an_instance_alone_in_its_namespace_may_change_model_at_the_cap(
    pki: Pki, tmp_path: Path, backend: dict[str, Any]
) -> None:
    policy = policy_with(tmp_path, **{"engine-a": {"quotas": {"max_namespaces_per_identity": 2}}})
    async with serving(pki, policy=policy, **backend) as s, callers(pki, s, "engine-a") as (eng_a,):
        assert await try_register(eng_a.stub, "engine-a-0", 0, "m1") is None
        assert await try_register(eng_a.stub, "engine-a-1", 0, "m2") is None
        err = await try_register(eng_a.stub, "engine-a-2", 0, "m3")
        assert err is not None and field_of(err) == "quotas.max_namespaces_per_identity"
        # engine-a-1 is alone in m2: restarting it on m3 keeps two namespaces.
        assert await try_register(eng_a.stub, "engine-a-1", 0, "m3") is None
        assert await try_register(eng_a.stub, "engine-a-2", 0, "m3") is None
        assert (await s.index.quota_usage("engine-a")).namespaces == 2


async def test_dp_rank_quota_and_a_policy_that_sets_its_own(pki: Pki, tmp_path: Path) -> None:
    policy = policy_with(
        tmp_path,
        **{"engine-b": {"quotas": {"max_dp_rank": 3, "max_instances_per_identity": 2}}},
    )
    async with (
        serving(pki, policy=policy) as s,
        callers(pki, s, "engine-a", "engine-b") as (
            eng_a,
            eng_b,
        ),
    ):
        assert s.config.quotas.max_dp_rank == 1023
        assert await try_register(eng_a.stub, "engine-a", 1023) is None
        err = await try_register(eng_a.stub, "engine-a", 1024)
        assert err is not None and field_of(err) == "quotas.max_dp_rank"
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        err = await try_register(eng_b.stub, "engine-b", 4)
        assert err is not None and field_of(err) == "quotas.max_dp_rank"
        assert await try_register(eng_b.stub, "engine-b", 3) is None
        assert await try_register(eng_b.stub, "engine-b", 2) is None
        err = await try_register(eng_b.stub, "engine-b", 1)
        assert err is not None and field_of(err) == "quotas.max_instances_per_identity"
        # engine-a's own quota is the default one.
        assert await try_register(eng_a.stub, "engine-a", 1) is None
        assert await try_register(eng_a.stub, "engine-a", 2) is None


async def test_fleet_caps_leave_the_operator_headroom(pki: Pki, backend: dict[str, Any]) -> None:
    """When engines together reach a fleet-wide cap, an admin still registers (and
    removes): the caps hold engines, not the operator."""
    async with (
        serving(pki, limits={"max_instances_per_namespace": 4}, **backend) as s,
        callers(pki, s, "engine-a", "engine-b", "admin") as (eng_a, eng_b, admin),
    ):
        for r in (0, 1):
            assert await try_register(eng_a.stub, "engine-a", r) is None
            assert await try_register(eng_b.stub, "engine-b", r) is None
        err = await try_register(eng_b.stub, "engine-b", 2)
        assert err is not None and "limits.max_instances_per_namespace" in (err.details() or "")
        assert await try_register(admin.stub, "ops-0") is None
        assert await try_register(admin.stub, "ops-1") is None
        await admin.stub.RemoveInstance(
            pb.RemoveInstanceRequest(instance=ref("engine-a", 1)), timeout=10
        )
        await admin.stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref("ops-0")), timeout=10)
        await admin.stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref("ops-1")), timeout=10)
        assert await try_register(eng_b.stub, "engine-b", 2) is None
        # An admin's instance counts under no identity.
        assert (await s.index.quota_usage("admin")).instances == 0
        assert (await s.index.quota_usage("engine-a")).instances == 1


# -- finding 2: one engine runs a replica out of memory ------------------------------------


async def test_blocks_past_the_instance_quota_are_skipped_and_counted(
    pki: Pki, backend: dict[str, Any]
) -> None:
    async with (
        serving(pki, quotas={"max_blocks_per_instance": 64}, **backend) as s,
        callers(pki, s, "engine-a", "engine-b", "router-a") as (eng_a, eng_b, router),
    ):
        assert await try_register(eng_a.stub, "engine-a") is None
        assert await try_register(eng_b.stub, "engine-b") is None
        acks = [
            await publish(eng_a.stub, batch(seq, chain(1 + 40 * seq, 40), worker="engine-a"))
            for seq in range(3)
        ]
        assert [a.outcome for a in acks] == [pb.BATCH_OUTCOME_APPLIED] * 3
        assert [a.blocks_stored for a in acks] == [40, 24, 0]
        assert [a.blocks_skipped for a in acks] == [0, 16, 40]
        assert await blocks_of(eng_a.stub, "engine-a") == 64
        assert s.logic.counters.events_skipped == {"quota": 56}
        # What it held is still there: the index was not dropped.
        tokens = list(range(BLOCK, 41 * BLOCK))
        found = await router.stub.Match(pb.MatchRequest(model=MODEL, token_ids=tokens), timeout=10)
        assert [(m.instance.worker_id, m.depth) for m in found.matches] == [("engine-a", 40)]
        # Removals free room for the next batches.
        ack = await publish(
            eng_a.stub,
            batch(
                3, pb.Event(removed=pb.BlockRemoved(block_hashes=range(31, 41))), worker="engine-a"
            ),
        )
        assert ack.blocks_removed == 10
        ack = await publish(eng_a.stub, batch(4, chain(500, 20), worker="engine-a"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (10, 10)
        # Another engine's instance is not affected.
        ack = await publish(eng_b.stub, batch(0, chain(1000, 60), worker="engine-b"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (60, 0)


async def test_the_blocks_of_an_identity_are_capped_together(
    pki: Pki, backend: dict[str, Any]
) -> None:
    over = {"quotas": {"max_blocks_per_instance": 0, "max_blocks_per_identity": 100}}
    async with (
        serving(pki, **over, **backend) as s,
        callers(pki, s, "engine-a", "engine-b", "admin") as (eng_a, eng_b, admin),
    ):
        for w in ("engine-a-0", "engine-a-1"):
            assert await try_register(eng_a.stub, w) is None
        assert await try_register(eng_b.stub, "engine-b") is None
        ack = await publish(eng_a.stub, batch(0, chain(1, 60), worker="engine-a-0"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (60, 0)
        ack = await publish(eng_a.stub, batch(0, chain(100, 60), worker="engine-a-1"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (40, 20)
        assert (await s.index.quota_usage("engine-a")).blocks == 100
        ack = await publish(eng_b.stub, batch(0, chain(200, 100), worker="engine-b"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (100, 0)
        # An instance that goes gives its blocks back to its identity.
        await admin.stub.RemoveInstance(
            pb.RemoveInstanceRequest(instance=ref("engine-a-0")), timeout=10
        )
        assert (await s.index.quota_usage("engine-a")).blocks == 40
        ack = await publish(eng_a.stub, batch(1, chain(300, 60), worker="engine-a-1"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (60, 0)


async def test_publish_rate_quota_refuses_with_a_retry_delay(pki: Pki) -> None:
    over = {"quotas": {"publish_blocks_per_s": 20, "publish_blocks_burst": 50}}
    async with (
        serving(pki, **over) as s,
        callers(pki, s, "engine-a", "engine-b") as (
            eng_a,
            eng_b,
        ),
    ):
        assert await try_register(eng_a.stub, "engine-a") is None
        assert await try_register(eng_b.stub, "engine-b") is None
        assert (
            await publish(eng_a.stub, batch(0, chain(1, 40), worker="engine-a"))
        ).blocks_stored == 40
        err = await expect_status(
            publish(eng_a.stub, batch(1, chain(41, 40), worker="engine-a")),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        assert field_of(err) == "quotas.publish_blocks_per_s"
        # A batch of the stream is refused in its ack; the stream goes on.
        call = eng_a.stub.PublishEventsStream()
        await call.write(
            pb.PublishEventsStreamRequest(batch=batch(1, chain(41, 40), worker="engine-a"))
        )
        ack = (await call.read()).ack
        assert ack.outcome == pb.BATCH_OUTCOME_REJECTED
        assert ack.error.field == "quotas.publish_blocks_per_s"
        await call.done_writing()
        assert await call.code() == grpc.StatusCode.OK
        # Another identity has a bucket of its own.
        assert (
            await publish(eng_b.stub, batch(0, chain(1, 40), worker="engine-b"))
        ).blocks_stored == 40
        assert s.config.quotas.publish_blocks_per_s == 20


# -- LoRA names ------------------------------------------------------------------------


async def test_the_policy_may_restrict_lora_names(pki: Pki, tmp_path: Path) -> None:
    policy = policy_with(tmp_path, **{"engine-a": {"loras": ["", "sql-*"]}})
    async with (
        serving(pki, policy=policy) as s,
        callers(pki, s, "engine-a", "engine-b", "router-a") as (eng_a, eng_b, router),
    ):
        assert await try_register(eng_a.stub, "engine-a") is None
        assert await try_register(eng_b.stub, "engine-b") is None
        ack = await publish(
            eng_a.stub,
            batch(
                0,
                keyed([1, 2]),
                keyed([3, 4, 5], lora="sql-1"),
                keyed([6, 7, 8, 9], lora="chat"),
                worker="engine-a",
            ),
        )
        assert (ack.outcome, ack.blocks_stored, ack.blocks_skipped) == (
            pb.BATCH_OUTCOME_APPLIED,
            5,
            4,
        )
        assert s.logic.counters.events_skipped == {"lora": 4}
        found = await router.stub.Match(
            pb.MatchRequest(model=MODEL, lora_name="chat", block_keys=[6]), timeout=10
        )
        assert not found.matches
        found = await router.stub.Match(
            pb.MatchRequest(model=MODEL, lora_name="sql-1", block_keys=[3]), timeout=10
        )
        assert [m.instance.worker_id for m in found.matches] == ["engine-a"]
        # engine-b's entry names no LoRAs: any.
        ack = await publish(eng_b.stub, batch(0, keyed([6], lora="chat"), worker="engine-b"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (1, 0)


async def test_lora_namespaces_count_until_the_instance_clears(
    pki: Pki, backend: dict[str, Any]
) -> None:
    async with (
        serving(pki, quotas={"max_namespaces_per_identity": 3}, **backend) as s,
        callers(pki, s, "engine-a", "engine-b") as (eng_a, eng_b),
    ):
        assert await try_register(eng_a.stub, "engine-a") is None
        assert await try_register(eng_b.stub, "engine-b") is None
        # The model is one namespace, two LoRAs the others; a third is skipped whole.
        ack = await publish(
            eng_a.stub,
            batch(
                0,
                keyed([1], lora="l1"),
                keyed([2, 3], lora="l2"),
                keyed([4, 5, 6], lora="l3"),
                keyed([7]),
                worker="engine-a",
            ),
        )
        assert (ack.blocks_stored, ack.blocks_skipped) == (4, 3)
        assert (await s.index.quota_usage("engine-a")).namespaces == 3
        ack = await publish(eng_b.stub, batch(0, keyed([4], lora="l3"), worker="engine-b"))
        assert (ack.blocks_stored, ack.blocks_skipped) == (1, 0)
        # After a clear its LoRA namespaces are free again.
        ack = await publish(
            eng_a.stub,
            batch(
                1, pb.Event(cleared=pb.AllBlocksCleared()), keyed([4], lora="l3"), worker="engine-a"
            ),
        )
        assert (ack.blocks_stored, ack.blocks_skipped) == (1, 0)
        assert (await s.index.quota_usage("engine-a")).namespaces == 2


# -- across replicas -----------------------------------------------------------------------


class PerReplicaQuotas(RedisIndex):
    """Deliberately broken: each replica counts quotas of its own (the identity is
    renamed per replica), as a per-replica counter would. The cross-replica check
    must catch it."""

    def _mine(self, quota: Quota | None) -> Quota | None:
        if quota is None or not quota.identity:
            return quota
        return dataclasses.replace(quota, identity=f"{quota.identity}@{id(self):x}")

    async def register(self, spec: Any) -> Any:
        return await super().register(dataclasses.replace(spec, quota=self._mine(spec.quota)))


async def cross_replica_counts(
    pki: Pki, indexes: tuple[RedisIndex, RedisIndex]
) -> tuple[int, int, QuotaUsage, QuotaUsage]:
    """engine-a registers 10 instances alternately on two replicas over one Redis
    (instance quota 6), then stores 60 blocks in each of two of them, one per replica
    (identity block quota 100): the instances registered, the blocks held and what
    each replica's index counts for engine-a."""
    over = {
        "quotas": {
            "max_instances_per_identity": 6,
            "max_blocks_per_instance": 0,
            "max_blocks_per_identity": 100,
        }
    }
    async with (
        serving(pki, index=indexes[0], **over) as one,
        serving(pki, index=indexes[1], **over) as two,
        callers(pki, one, "engine-a") as (a1,),
        callers(pki, two, "engine-a") as (a2,),
    ):
        registered = 0
        for r in range(10):
            stub = (a1, a2)[r % 2].stub
            registered += await try_register(stub, "engine-a", r) is None
        held = 0
        for r, c in ((0, a1), (1, a2)):
            b = pb.EventBatch(
                instance=ref("engine-a", r), sequence=0, events=[chain(1 + 100 * r, 60)]
            )
            held += (await publish(c.stub, b)).blocks_stored
        usage = (await one.index.quota_usage("engine-a"), await two.index.quota_usage("engine-a"))
        return registered, held, *usage


def two_replicas(
    redis_server: Any, kind: type[RedisIndex] = RedisIndex
) -> tuple[RedisIndex, RedisIndex]:
    prefix = f"x{uuid.uuid4().hex[:8]}"
    return kind(redis_server.url, prefix=prefix), kind(redis_server.url, prefix=prefix)


async def test_quotas_hold_across_two_replicas_over_one_redis(pki: Pki, redis_server: Any) -> None:
    registered, held, one, two = await cross_replica_counts(pki, two_replicas(redis_server))
    assert (registered, held) == (6, 100)
    assert one == two == QuotaUsage(instances=6, namespaces=1, blocks=100)


async def test_counting_per_replica_fails_the_cross_replica_check(
    pki: Pki, redis_server: Any
) -> None:
    registered, held, _, _ = await cross_replica_counts(
        pki, two_replicas(redis_server, PerReplicaQuotas)
    )
    # Each replica admits its own 6 instances and 100 blocks: the check above fails.
    assert (registered, held) == (10, 120)


# -- the policy's quotas -------------------------------------------------------------------


def test_the_policy_sets_the_same_quotas_the_config_does() -> None:
    assert set(IdentityQuotas.model_fields) == set(Quotas.model_fields)


async def test_a_policy_reload_changes_an_identity_s_quotas(pki: Pki, tmp_path: Path) -> None:
    def instances(n: int) -> str:
        return policy_with(tmp_path, **{"engine-a": {"quotas": {"max_instances_per_identity": n}}})

    policy, raised = instances(1), Path(instances(2))
    async with (
        serving(pki, auth={"policy_file": policy, "reload_interval_s": 0.05}) as s,
        callers(pki, s, "engine-a") as (eng_a,),
    ):
        assert await try_register(eng_a.stub, "engine-a", 0) is None
        err = await try_register(eng_a.stub, "engine-a", 1)
        assert err is not None and field_of(err) == "quotas.max_instances_per_identity"
        raised.replace(policy)  # noqa: ASYNC240
        await asyncio.sleep(0.2)
        assert await try_register(eng_a.stub, "engine-a", 1) is None
        err = await try_register(eng_a.stub, "engine-a", 2)
        assert err is not None and field_of(err) == "quotas.max_instances_per_identity"
