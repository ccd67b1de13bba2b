"""The quota counts, backend by backend (indexer/index.py, "Quotas").

Every write keeps them in the step that makes it: registrations (new, renewed,
reset to another incarnation or model), batches (stores, removals, clears,
LoRA namespaces), removals and reaps. A seeded random walk drives the memory
backend and a Redis one (standalone and Cluster, tests/conftest.py) side by
side: every answer and every count must agree, and the counts must equal what
the index holds (its dump). Then the cases one by one.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from indexer.index import Index
from indexer.memory import MemoryIndex
from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
    Quota,
    QuotaUsage,
)
from kvmesh.errors import KvmeshError, NotFound, ResourceExhausted
from lab.redisproc import RedisProcess
from tests.conftest import FakeClock, make_index

FREE = "kvmesh:free"
QUOTAS = {
    ident: Quota(
        identity=ident,
        max_instances=3,
        max_namespaces=3,
        max_blocks=40,
        max_blocks_per_instance=16,
        free_loras=(FREE,),
    )
    for ident in ("x", "y")
}
#: What a write without an identity is held to (the indexer's anonymous caller).
ANONYMOUS = Quota(max_blocks_per_instance=16, free_loras=(FREE,))
INSTANCES = [InstanceId(w, r) for w in ("a", "b", "c", "d") for r in (0, 1, 2)]
LORAS = ("", "", "l1", "l2", "l3", FREE)


def keyed(hashes: list[int], lora: str) -> BlockStored:
    # Keys repeat across hashes (h % 37): an instance may hold more engine
    # hashes than (block, tier) entries, which its usage counts.
    return BlockStored(
        block_hashes=tuple(hashes), block_keys=tuple(h % 37 for h in hashes), lora_name=lora
    )


def chained(parent: int | None, hashes: list[int]) -> BlockStored:
    return BlockStored(
        block_hashes=tuple(hashes),
        parent_block_hash=parent,
        token_ids=tuple(t % 7 for t in range(4 * hashes[0], 4 * (hashes[0] + len(hashes)))),
        block_size=4,
    )


def random_events(rng: random.Random) -> tuple[Event, ...]:
    out: list[Event] = []
    for _ in range(rng.randint(1, 4)):
        k = rng.random()
        hashes = rng.sample(range(1, 80), rng.randint(1, 9))
        if k < 0.45:
            out.append(keyed(hashes, rng.choice(LORAS)))
        elif k < 0.65:
            out.append(chained(rng.choice([None, *range(1, 80)]), sorted(hashes)))
        elif k < 0.9:
            out.append(BlockRemoved(block_hashes=tuple(hashes)))
        else:
            out.append(AllBlocksCleared())
    return tuple(out)


async def held(index: Index, owners: dict[InstanceId, str], ident: str) -> tuple[int, int, int]:
    """(instances, blocks, least namespaces) of ``ident`` recomputed from the index."""
    dump = await index.dump()
    mine = {iid for iid in dump.instances if owners.get(iid) == ident}
    blocks = sum(
        max(dump.instances[iid].blocks, len(dump.engine_hashes.get(iid, {}))) for iid in mine
    )
    namespaces = {Namespace(dump.instances[iid].spec.model) for iid in mine}
    for ns, table in dump.blocks.items():
        if ns.lora_name != FREE and any(h in mine for holders in table.values() for h in holders):
            namespaces.add(ns)
    return len(mine), blocks, len(namespaces)


async def outcome(call: Any) -> Any:
    try:
        r = await call
    except KvmeshError as e:
        return (type(e).__name__, e.field)
    if isinstance(r, tuple):  # register: (state, reset)
        return (r[0].spec, r[0].blocks, r[1])
    if isinstance(r, int):
        return r
    return (r.outcome, r.blocks_stored, r.blocks_removed, r.blocks_orphaned, r.blocks_over_quota)


@pytest.mark.parametrize("backend", ["redis", "redis-cluster"])
@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_counts_agree_with_the_memory_backend_and_the_index(
    backend: str, seed: int, clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(seed)
    ref = MemoryIndex(clock=clock)
    other = make_index(backend, clock, request)
    owners: dict[InstanceId, str] = {}
    seqs: dict[InstanceId, int] = {}
    seen: set[Any] = set()  # what the walk went through
    try:
        for step in range(240):
            iid = rng.choice(INSTANCES)
            k = rng.random()
            if k < 0.3:
                # A new instance: either identity or none; an existing one: any identity
                # (both have the same caps; a write held to none may take an owner
                # past its quotas, as an admin's may).
                ident = rng.choice(["x", "x", "y", None] if iid not in owners else ["x", "y"])
                spec = InstanceSpec(
                    iid,
                    rng.choice(["m1", "m1", "m2", f"m{rng.randint(3, 9)}"]),
                    lease_ttl_s=rng.choice([5.0, 30.0]),
                    incarnation=rng.choice(["i", "i", "j"]),
                    quota=QUOTAS[ident] if ident else ANONYMOUS,
                )
                got = [await outcome(ix.register(spec)) for ix in (ref, other)]
                if iid not in owners and not isinstance(got[0][0], str):
                    owners[iid] = ident or ""
                seen.add(got[0][1] if isinstance(got[0][0], str) else "registered")
            elif k < 0.85:
                seqs[iid] = seqs.get(iid, -1) + 1
                q = QUOTAS.get(owners.get(iid, ""), ANONYMOUS)
                b = EventBatch(iid, seqs[iid], random_events(rng), quota=q)
                got = [await outcome(ix.apply(b)) for ix in (ref, other)]
                if not isinstance(got[0][0], str) and got[0][4]:
                    seen.add("over quota")
            elif k < 0.93:
                got = [await outcome(ix.remove_instance(iid)) for ix in (ref, other)]
                if not isinstance(got[0], tuple):
                    owners.pop(iid, None)
                    seqs.pop(iid, None)
            else:
                clock.advance(rng.choice([1.0, 10.0]))
                got = [sorted(await ix.reap_expired()) for ix in (ref, other)]
                for gone in got[0]:
                    owners.pop(gone, None)
                    seqs.pop(gone, None)
                    seen.add("reaped")
            assert got[0] == got[1], (step, got)
            for ident, q in QUOTAS.items():
                usage = [await ix.quota_usage(ident) for ix in (ref, other)]
                assert usage[0] == usage[1], (step, ident, usage)
                u = usage[0]
                instances, blocks, least_ns = await held(ref, owners, ident)
                assert (u.instances, u.blocks) == (instances, blocks), (step, ident, u)
                assert least_ns <= u.namespaces <= q.max_namespaces, (step, ident, u)
                assert u.instances <= q.max_instances
            dump = await ref.dump()
            for held_by in INSTANCES:  # no instance over its quota (free stores aside)
                bits = sum(
                    bin(holders.get(held_by, 0)).count("1")
                    for ns, table in dump.blocks.items()
                    if ns.lora_name != FREE
                    for holders in table.values()
                )
                hashes = sum(
                    ns.lora_name != FREE for ns, _ in dump.engine_hashes.get(held_by, {}).values()
                )
                assert max(bits, hashes) <= 16, (step, held_by)
        assert seen >= {
            "registered",
            "quotas.max_instances_per_identity",
            "quotas.max_namespaces_per_identity",
            "over quota",
            "reaped",
        }, seen
    finally:
        await other.close()


async def test_a_refused_registration_changes_nothing(index: Index) -> None:
    q = Quota(identity="x", max_instances=1, max_namespaces=1)
    await index.register(InstanceSpec(InstanceId("a"), "m1", quota=q))
    before = await index.quota_usage("x")
    for spec, field in (
        (InstanceSpec(InstanceId("b"), "m1", quota=q), "quotas.max_instances_per_identity"),
        (InstanceSpec(InstanceId("a"), "m2", quota=q), None),  # alone in m1: it may move
    ):
        if field is None:
            await index.register(spec)
            continue
        with pytest.raises(ResourceExhausted) as info:
            await index.register(spec)
        assert info.value.field == field
        assert InstanceId("b") not in {s.spec.instance for s in await index.list_instances()}
        assert await index.quota_usage("x") == before
    q2 = Quota(identity="x", max_instances=2, max_namespaces=1)
    with pytest.raises(ResourceExhausted) as info:
        await index.register(InstanceSpec(InstanceId("b"), "m3", quota=q2))
    assert info.value.field == "quotas.max_namespaces_per_identity"
    assert await index.quota_usage("x") == QuotaUsage(1, 1, 0)


async def test_renewal_by_anyone_keeps_the_owner_and_counts_once(index: Index) -> None:
    x, y = QUOTAS["x"], QUOTAS["y"]
    a = InstanceId("a")
    await index.register(InstanceSpec(a, "m1", quota=x))
    await index.apply(EventBatch(a, 0, (keyed([1, 2, 3], "l1"),), quota=x))
    for q in (x, y, None, ANONYMOUS):
        await index.register(InstanceSpec(a, "m1", quota=q))
        assert await index.quota_usage("x") == QuotaUsage(1, 2, 3)
        assert await index.quota_usage("y") == QuotaUsage()
    # A reset (another incarnation) gives back its blocks and LoRA namespaces.
    await index.register(InstanceSpec(a, "m1", incarnation="2", quota=y))
    assert await index.quota_usage("x") == QuotaUsage(1, 1, 0)


async def test_removal_and_reaping_give_everything_back(index: Index, clock: FakeClock) -> None:
    x = QUOTAS["x"]
    for w in ("a", "b"):
        await index.register(InstanceSpec(InstanceId(w), "m1", lease_ttl_s=5, quota=x))
        await index.apply(EventBatch(InstanceId(w), 0, (keyed([1, 2], "l1"),), quota=x))
    assert await index.quota_usage("x") == QuotaUsage(2, 2, 4)
    await index.remove_instance(InstanceId("a"))
    assert await index.quota_usage("x") == QuotaUsage(1, 2, 2)
    clock.advance(10)
    assert await index.reap_expired() == [InstanceId("b")]
    assert await index.quota_usage("x") == QuotaUsage()
    with pytest.raises(NotFound):
        await index.remove_instance(InstanceId("b"))
    for w in "abc":  # the whole quota again
        await index.register(InstanceSpec(InstanceId(w), "m1", quota=x))


async def test_a_clear_gives_back_blocks_and_lora_namespaces(index: Index) -> None:
    x = QUOTAS["x"]
    a = InstanceId("a")
    await index.register(InstanceSpec(a, "m1", quota=x))
    r = await index.apply(
        EventBatch(a, 0, (keyed(list(range(1, 11)), "l1"), keyed([20, 21], "l2")), quota=x)
    )
    assert (r.blocks_stored, r.blocks_over_quota) == (12, 0)
    assert await index.quota_usage("x") == QuotaUsage(1, 3, 12)
    # Stores of the same batch after a clear have the whole room again.
    r = await index.apply(
        EventBatch(a, 1, (AllBlocksCleared(), keyed(list(range(40, 60)), "l3")), quota=x)
    )
    assert (r.blocks_stored, r.blocks_over_quota) == (16, 4)
    assert await index.quota_usage("x") == QuotaUsage(1, 2, 16)


async def test_counts_start_again_with_a_redis_restarted_empty(clock: FakeClock) -> None:
    """A Redis restarted empty holds no instance and no count: an identity gets its
    whole quota again (its engines re-register), not a count left from before."""
    from indexer.redis.backend import RedisIndex

    q = Quota(identity="x", max_instances=2)
    with RedisProcess() as proc:
        index = RedisIndex(proc.url, prefix="r", clock=clock)
        try:
            for w in "ab":
                await index.register(InstanceSpec(InstanceId(w), "m1", quota=q))
            with pytest.raises(ResourceExhausted):
                await index.register(InstanceSpec(InstanceId("c"), "m1", quota=q))
            proc.restart()
            assert await index.quota_usage("x") == QuotaUsage()
            for w in "cd":
                await index.register(InstanceSpec(InstanceId(w), "m1", quota=q))
            with pytest.raises(ResourceExhausted):
                await index.register(InstanceSpec(InstanceId("a"), "m1", quota=q))
        finally:
            await index.close()
