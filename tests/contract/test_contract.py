"""The index contract (indexer/index.py), example by example, on every backend."""

from __future__ import annotations

from typing import Any

import pytest

from indexer.model import (
    AllBlocksCleared,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
    Tier,
)
from kvmesh.blockkeys import block_keys
from kvmesh.errors import FailedPrecondition, NotFound
from tests.conftest import FakeClock

BS = 4
NS = Namespace("llama")
A = InstanceId("a", 0)
B = InstanceId("b", 0)
A1 = InstanceId("a", 1)
PROMPT = list(range(100, 132))  # 8 blocks of 4
KEYS = block_keys(PROMPT, BS, "llama")


def stored(first: int, last: int, *, tier: Tier = Tier.GPU, lora: str = "") -> BlockStored:
    """BlockStored for PROMPT's blocks [first, last), engine hash = 1000 + block."""
    return BlockStored(
        block_hashes=tuple(1000 + b for b in range(first, last)),
        parent_block_hash=1000 + first - 1 if first else None,
        token_ids=tuple(PROMPT[first * BS : last * BS]),
        block_size=BS,
        lora_name=lora,
        tier=tier,
    )


async def reg(index: Any, iid: InstanceId, *, ttl: float = 30.0, inc: str = "x") -> None:
    await index.register(
        InstanceSpec(iid, "llama", f"http://{iid.worker_id}:{iid.dp_rank}", ttl, inc)
    )


async def depths(index: Any, keys: list[int] = KEYS, **kw: Any) -> dict[InstanceId, int]:
    return {m.instance: m.depth for m in await index.match(NS, keys, **kw)}


async def test_match_returns_longest_prefix_per_instance_sorted(index: Any) -> None:
    await reg(index, A)
    await reg(index, B)
    await reg(index, A1)
    await index.apply(EventBatch(A, 0, (stored(0, 5),)))
    await index.apply(EventBatch(B, 0, (stored(0, 8),)))
    await index.apply(EventBatch(A1, 0, (stored(0, 5),)))
    result = await index.match(NS, KEYS)
    assert [(m.instance, m.depth) for m in result] == [(B, 8), (A, 5), (A1, 5)]
    assert result[0].address == "http://b:0"
    assert await index.match(NS, KEYS[:3]) and (await index.match(NS, KEYS[:3]))[0].depth == 3


async def test_equal_depths_are_ordered_by_instance_whatever_the_registration_order(
    index: Any,
) -> None:
    """Ties (deepest first) go by instance id, not by when instances registered, at
    every depth: the one-block holders of a shared first block too."""
    for inst in (B, A1, A):
        await reg(index, inst)
    for inst in (B, A1, A):
        await index.apply(EventBatch(inst, 0, (stored(0, 1),)))
    assert [m.instance for m in await index.match(NS, KEYS)] == sorted([A, A1, B])
    for inst in (B, A1, A):
        await index.apply(EventBatch(inst, 1, (stored(1, 3),)))
    assert [(m.instance, m.depth) for m in await index.match(NS, KEYS)] == [
        (A, 3),
        (A1, 3),
        (B, 3),
    ]


async def test_match_stops_at_first_gap(index: Any) -> None:
    await reg(index, A)
    await index.apply(EventBatch(A, 0, (stored(0, 8),)))
    await index.apply(EventBatch(A, 1, (BlockRemoved((1003,)),)))
    assert await depths(index) == {A: 3}
    # a prompt whose first block nobody holds matches nothing, even if later ones are held
    assert await depths(index, [12345, *KEYS[1:]]) == {}


async def test_tiers_are_counted_at_their_fastest_copy(index: Any) -> None:
    await reg(index, A)
    await index.apply(
        EventBatch(A, 0, (stored(0, 2), stored(2, 4, tier=Tier.CPU), stored(4, 6, tier=Tier.DISK)))
    )
    await index.apply(EventBatch(A, 1, (stored(2, 3, tier=Tier.GPU),)))  # block 2 now on GPU too
    [m] = await index.match(NS, KEYS)
    assert (m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks) == (6, 3, 1, 2)
    # leaving the GPU keeps the CPU copy
    res = await index.apply(EventBatch(A, 2, (BlockRemoved((1002,), Tier.GPU),)))
    assert res.blocks_removed == 1
    [m] = await index.match(NS, KEYS)
    assert (m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks) == (6, 2, 2, 2)
    # removal with no tier drops every copy
    res = await index.apply(EventBatch(A, 3, (BlockRemoved((1002,)),)))
    assert res.blocks_removed == 1
    assert await depths(index) == {A: 2}


async def test_apply_counts_changed_bits_and_is_idempotent(index: Any) -> None:
    await reg(index, A)
    r = await index.apply(EventBatch(A, 5, (stored(0, 4),)))
    assert (r.outcome, r.applied_sequence, r.blocks_stored) == (BatchOutcome.APPLIED, 5, 4)
    dup = await index.apply(EventBatch(A, 5, (AllBlocksCleared(),)))
    assert dup.outcome is BatchOutcome.DUPLICATE and dup.applied_sequence == 5
    old = await index.apply(EventBatch(A, 2, (AllBlocksCleared(),)))
    assert old.outcome is BatchOutcome.DUPLICATE
    assert await depths(index) == {A: 4}  # duplicates changed nothing
    again = await index.apply(EventBatch(A, 6, (stored(0, 4),)))  # same blocks again
    assert (again.outcome, again.blocks_stored) == (BatchOutcome.APPLIED, 0)


async def test_sequence_gap_marks_stale_until_resync(index: Any) -> None:
    await reg(index, A)
    await reg(index, B)
    await index.apply(EventBatch(A, 0, (stored(0, 4),)))
    await index.apply(EventBatch(B, 0, (stored(0, 2),)))
    r = await index.apply(EventBatch(A, 3, (stored(4, 6),)))
    assert (r.outcome, r.stale) == (BatchOutcome.APPLIED_AFTER_GAP, True)
    assert await depths(index) == {B: 2}  # stale A hidden by default
    flagged = await index.match(NS, KEYS, include_stale=True)
    assert [(m.instance, m.depth, m.stale) for m in flagged] == [(A, 6, True), (B, 2, False)]
    r = await index.apply(EventBatch(A, 4, (stored(6, 7),)))
    assert (r.outcome, r.stale) == (BatchOutcome.APPLIED, True)  # still stale
    r = await index.apply(EventBatch(A, 5, (AllBlocksCleared(), stored(0, 3))))
    assert (r.outcome, r.stale, r.blocks_removed, r.blocks_stored) == (
        BatchOutcome.APPLIED,
        False,
        7,
        3,
    )
    assert await depths(index) == {A: 3, B: 2}


async def test_events_of_unregistered_instance_are_refused(index: Any) -> None:
    with pytest.raises(FailedPrecondition):
        await index.apply(EventBatch(A, 0, (stored(0, 2),)))
    with pytest.raises(NotFound):
        await index.heartbeat(A)
    with pytest.raises(NotFound):
        await index.remove_instance(A)
    assert await index.match(NS, KEYS) == []


async def test_unknown_parent_makes_orphans_and_unknown_removals_are_ignored(index: Any) -> None:
    await reg(index, A)
    r = await index.apply(EventBatch(A, 0, (stored(2, 4),)))  # parent 1001 never stored
    assert (r.blocks_stored, r.blocks_orphaned) == (0, 2)
    r = await index.apply(EventBatch(A, 1, (BlockRemoved((77, 78)),)))
    assert (r.outcome, r.blocks_removed) == (BatchOutcome.APPLIED, 0)
    assert await depths(index) == {}


async def test_precomputed_keys_and_namespaces(index: Any) -> None:
    await reg(index, A)
    trace_keys = (7, 8, 9)
    ev = BlockStored(block_hashes=trace_keys, block_keys=trace_keys)
    await index.apply(EventBatch(A, 0, (ev,)))
    assert await depths(index, [7, 8, 9, 10]) == {A: 3}
    assert await index.match(Namespace("llama", "lora1"), [7, 8]) == []
    assert await index.match(Namespace("other"), [7, 8]) == []
    await index.apply(EventBatch(A, 1, (stored(0, 2, lora="lora1"),)))
    lora_keys = block_keys(PROMPT, BS, "llama", "lora1")
    assert [m.depth for m in await index.match(Namespace("llama", "lora1"), lora_keys)] == [2]
    assert await depths(index) == {}  # base namespace keys differ


async def test_lease_expiry_hides_at_once_and_reaping_drops_blocks(
    index: Any, clock: FakeClock
) -> None:
    await reg(index, A, ttl=10)
    await reg(index, B, ttl=100)
    await index.apply(EventBatch(A, 0, (stored(0, 4),)))
    await index.apply(EventBatch(B, 0, (stored(0, 2),)))
    clock.advance(9)
    await index.heartbeat(A)  # renewed until now + 10
    clock.advance(9)
    assert await depths(index) == {A: 4, B: 2}
    clock.advance(2)
    assert await depths(index) == {B: 2}  # invisible at once, before any reaping
    states = {s.spec.instance: s for s in await index.list_instances()}
    assert states[A].live is False and states[B].live is True
    assert await index.reap_expired() == [A]
    assert [s.spec.instance for s in await index.list_instances()] == [B]
    stats = await index.stats()
    assert (stats.instances, stats.blocks, stats.block_instances) == (1, 2, 2)


async def test_new_incarnation_resets_same_incarnation_renews(index: Any) -> None:
    await reg(index, A, inc="one")
    await index.apply(EventBatch(A, 7, (stored(0, 4),)))
    state, reset = await index.register(InstanceSpec(A, "llama", "http://new", 30.0, "one"))
    assert reset is False and state.applied_sequence == 7 and state.blocks == 4
    assert (await index.match(NS, KEYS))[0].address == "http://new"
    state, reset = await index.register(InstanceSpec(A, "llama", "http://new", 30.0, "two"))
    assert reset is True and state.applied_sequence is None and state.blocks == 0
    assert await depths(index) == {}
    r = await index.apply(EventBatch(A, 0, (stored(0, 1),)))  # sequence starts over
    assert r.outcome is BatchOutcome.APPLIED


async def test_a_fenced_batch_applies_only_to_its_incarnation(index: Any, clock: FakeClock) -> None:
    await reg(index, A, ttl=10.0, inc="one")
    r = await index.apply(EventBatch(A, 0, (stored(0, 2),), incarnation="one"))
    assert r.outcome is BatchOutcome.APPLIED
    await reg(index, A, ttl=10.0, inc="two")  # another writer re-registered it
    clock.advance(8.0)
    with pytest.raises(FailedPrecondition) as e:
        await index.apply(EventBatch(A, 0, (stored(0, 4),), incarnation="one"))
    assert e.value.field == "incarnation"
    assert await depths(index) == {}  # nothing applied
    st = (await index.list_instances())[0]
    assert st.applied_sequence is None
    clock.advance(3.0)  # the refused batch did not renew the lease
    assert not (await index.list_instances())[0].live
    await reg(index, A, ttl=10.0, inc="two")
    r = await index.apply(EventBatch(A, 0, (stored(0, 3),), incarnation="two"))
    assert r.outcome is BatchOutcome.APPLIED and await depths(index) == {A: 3}


async def test_an_engine_stream_keeps_a_block_until_its_last_copy_goes(index: Any) -> None:
    """vLLM stores one event per physical block: one hash can be in two blocks."""
    await reg(index, A)
    await reg(index, B)
    for iid in (A, B):
        copies = iid == A
        await index.apply(EventBatch(iid, 0, (stored(0, 3),), counts_copies=copies))
        await index.apply(EventBatch(iid, 1, (stored(1, 2),), counts_copies=copies))  # again
        await index.apply(
            EventBatch(iid, 2, (BlockRemoved((1001,), Tier.GPU),), counts_copies=copies)
        )
    # A holds block 1 still (its second copy); B's set semantics dropped it.
    assert await depths(index) == {A: 3, B: 1}
    await index.apply(EventBatch(A, 3, (BlockRemoved((1001,), Tier.GPU),), counts_copies=True))
    assert await depths(index) == {A: 1, B: 1}
    # A copy on another tier is its own: the GPU copies go, the CPU one stays.
    await index.apply(
        EventBatch(
            A, 4, (stored(1, 2), stored(1, 2), stored(1, 2, tier=Tier.CPU)), counts_copies=True
        )
    )
    await index.apply(EventBatch(A, 5, (BlockRemoved((1001,), None),), counts_copies=True))
    (hit,) = [m for m in await index.match(NS, KEYS) if m.instance == A]
    assert (hit.depth, hit.gpu_blocks, hit.cpu_blocks) == (3, 3, 0)
    await index.apply(EventBatch(A, 6, (BlockRemoved((1001,), Tier.GPU),), counts_copies=True))
    assert await depths(index) == {A: 1, B: 1}


async def test_a_hash_stored_as_another_block_loses_its_copies(index: Any) -> None:
    """One engine hash stored twice (two copies), then stored as a block of another
    namespace (the hash now names that block: the old one goes, copies and all),
    then removed: nothing is left, whether the batch counts copies or not. Found
    by the property test (Redis kept the new block: a copy of the old one still
    counted)."""
    h = 3685390413631870213

    def ev(lora: str) -> BlockStored:
        return BlockStored(block_hashes=(h,), token_ids=(0, 0), block_size=2, lora_name=lora)

    def held(lora: str = "") -> Any:
        return index.match(Namespace("llama", lora), block_keys([0, 0], 2, "llama", lora))

    for iid, counts_copies in ((A, True), (B, False)):
        await reg(index, iid)
        batch = (ev(""), ev(""), ev("lora"), BlockRemoved((h,)))
        got = await index.apply(EventBatch(iid, 0, batch, counts_copies=counts_copies))
        assert (got.blocks_stored, got.blocks_removed) == (2, 2), counts_copies
        assert await held("") == [] and await held("lora") == [], counts_copies
    # A copy counted before a removal that names the hash without counting
    # copies goes with the block.
    await index.apply(EventBatch(A, 1, (ev(""), ev("")), counts_copies=True))
    await index.apply(EventBatch(A, 2, (BlockRemoved((h,)),)))
    await index.apply(EventBatch(A, 3, (ev(""), BlockRemoved((h,))), counts_copies=True))
    assert await held() == []


async def test_remove_instance_and_stats(index: Any) -> None:
    await reg(index, A)
    await reg(index, B)
    await index.apply(EventBatch(A, 0, (stored(0, 4), stored(0, 2, tier=Tier.CPU))))
    await index.apply(EventBatch(B, 0, (stored(0, 3),)))
    stats = await index.stats()
    assert (stats.instances, stats.instances_live, stats.blocks, stats.block_instances) == (
        2,
        2,
        4,
        7,
    )
    assert [(n.namespace, n.blocks, n.block_instances) for n in stats.namespaces] == [(NS, 4, 7)]
    assert await index.remove_instance(A) == 6  # 4 GPU + 2 CPU entries
    assert await depths(index) == {B: 3}
    stats = await index.stats()
    assert (stats.instances, stats.blocks, stats.block_instances) == (1, 3, 3)


async def test_dump_is_canonical(index: Any) -> None:
    await reg(index, A)
    await index.apply(EventBatch(A, 0, (stored(0, 2, tier=Tier.CPU),)))
    dump = await index.dump()
    assert dump.blocks == {NS: {KEYS[0]: {A: Tier.CPU.bit}, KEYS[1]: {A: Tier.CPU.bit}}}
    assert dump.engine_hashes == {A: {1000: (NS, KEYS[0]), 1001: (NS, KEYS[1])}}
    assert dump.instances[A].applied_sequence == 0


async def test_unknown_namespace_and_empty_query(index: Any) -> None:
    assert await index.match(Namespace("nobody"), [1, 2, 3]) == []
    await reg(index, A)
    await index.apply(EventBatch(A, 0, (stored(0, 2),)))
    assert await index.match(NS, []) == []


async def test_generation_moves_with_every_change_of_the_instance_table(
    index: Any, clock: FakeClock
) -> None:
    """What a replica compares before rereading the table (IndexerLogic's model cache)."""
    seen = [await index.generation()]

    async def moved() -> bool:
        seen.append(await index.generation())
        return seen[-1] != seen[-2]

    await reg(index, A)
    assert await moved()
    await index.apply(EventBatch(A, 0, (stored(0, 2),)))
    await index.match(NS, KEYS)
    assert not await moved()  # blocks and reads are not the table
    await index.register(InstanceSpec(A, "other", "http://a:0", 30.0, "x"))  # a new model
    assert await moved()
    await index.register(InstanceSpec(A, "other", "http://a:0", 30.0, "y"))  # restarted
    assert await moved()
    await index.remove_instance(A)
    assert await moved()
    await reg(index, B, ttl=5.0)
    assert await moved()
    clock.advance(10.0)
    await index.reap_expired()
    assert await moved()
