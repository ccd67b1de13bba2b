"""The memory backend: cached depth-1 answers follow their instance; blocks cost the GC nothing.

Most holders of a shared first block go no deeper, so the memory backend
caches their one-block answer (address, tiers, stale flag). These tests check
that an answer never outlives what it describes: an instance removed, reaped
or reset and registered again is answered with its new address and staleness,
and churn leaves nothing behind. And that stored blocks add no object for the
garbage collector to walk, whose full collections would otherwise pause
every Match for a time that grows with the index.
"""

from __future__ import annotations

import gc
import tracemalloc
from typing import Any

import pytest

from indexer.memory import MemoryIndex
from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from kvmesh.blockkeys import block_keys
from tests.conftest import FakeClock

BS = 4
NS = Namespace("llama")
PROMPT = list(range(100, 108))  # 2 blocks of 4
KEYS = block_keys(PROMPT, BS, "llama")
A = InstanceId("a", 0)
B = InstanceId("b", 0)


def first_block() -> BlockStored:
    """BlockStored of PROMPT's first block only: a depth-1 holder."""
    return BlockStored(block_hashes=(1000,), token_ids=tuple(PROMPT[:BS]), block_size=BS)


def both_blocks() -> BlockStored:
    """BlockStored of both of PROMPT's blocks: a depth-2 holder."""
    return BlockStored(block_hashes=(1000, 1001), token_ids=tuple(PROMPT), block_size=BS)


async def reg(
    index: MemoryIndex, iid: InstanceId, address: str, *, ttl: float = 30.0, inc: str = "x"
) -> None:
    await index.register(InstanceSpec(iid, "llama", address, ttl, inc))


async def hits(index: MemoryIndex, **kw: bool) -> dict[InstanceId, tuple[str, int, bool]]:
    return {m.instance: (m.address, m.depth, m.stale) for m in await index.match(NS, KEYS, **kw)}


async def test_a_removed_instance_registered_again_is_named_by_its_new_address() -> None:
    index = MemoryIndex()
    await reg(index, A, "http://old:1")
    await reg(index, B, "http://b:1")
    await index.apply(EventBatch(A, 0, (first_block(),)))
    await index.apply(EventBatch(B, 0, (both_blocks(),)))
    assert (await hits(index))[A] == ("http://old:1", 1, False)
    await index.remove_instance(A)
    await reg(index, A, "http://new:1")
    await index.apply(EventBatch(A, 0, (first_block(),)))
    assert (await hits(index))[A] == ("http://new:1", 1, False)


async def test_a_reaped_instance_registered_again_is_named_by_its_new_address() -> None:
    clock = FakeClock()
    index = MemoryIndex(clock=clock)
    await reg(index, A, "http://old:1", ttl=1.0)
    await index.apply(EventBatch(A, 0, (first_block(),)))
    assert (await hits(index))[A] == ("http://old:1", 1, False)
    clock.advance(2.0)
    assert await index.reap_expired() == [A]
    await reg(index, A, "http://new:1")
    await index.apply(EventBatch(A, 0, (first_block(),)))
    assert (await hits(index))[A] == ("http://new:1", 1, False)


async def test_a_stale_instance_removed_and_registered_again_is_fresh() -> None:
    index = MemoryIndex()
    await reg(index, A, "http://a:1")
    await index.apply(EventBatch(A, 0, (first_block(),)))
    await index.apply(EventBatch(A, 5, ()))  # a gap: stale
    assert (await hits(index, include_stale=True))[A] == ("http://a:1", 1, True)
    await index.remove_instance(A)
    await reg(index, A, "http://a:1")
    await index.apply(EventBatch(A, 0, (first_block(),)))
    assert await hits(index) == {A: ("http://a:1", 1, False)}


async def test_a_stale_instance_reset_by_a_new_incarnation_is_fresh() -> None:
    index = MemoryIndex()
    await reg(index, A, "http://a:1", inc="one")
    await index.apply(EventBatch(A, 0, (first_block(),)))
    await index.apply(EventBatch(A, 5, ()))
    assert (await hits(index, include_stale=True))[A] == ("http://a:1", 1, True)
    _, reset = await index.register(InstanceSpec(A, "llama", "http://a:1", 30.0, "two"))
    assert reset
    await index.apply(EventBatch(A, 0, (first_block(),)))
    assert await hits(index) == {A: ("http://a:1", 1, False)}


async def test_an_address_change_is_seen_by_the_next_match() -> None:
    index = MemoryIndex()
    await reg(index, A, "http://a:1")
    await index.apply(EventBatch(A, 0, (first_block(),)))
    assert (await hits(index))[A][0] == "http://a:1"
    await reg(index, A, "http://a:2")
    assert (await hits(index))[A][0] == "http://a:2"


async def _churn(index: MemoryIndex, start: int, n: int) -> None:
    for i in range(start, start + n):
        iid = InstanceId(f"churn-{i:06d}", 0)
        await reg(index, iid, f"http://churn-{i:06d}.pods.example:8000")
        await index.apply(EventBatch(iid, 0, (first_block(),)))
        assert (await hits(index))[iid][1] == 1
        await index.remove_instance(iid)


async def test_churn_leaves_no_cached_answers_behind() -> None:
    index = MemoryIndex()
    await reg(index, B, "http://b:1")
    await index.apply(EventBatch(B, 0, (both_blocks(),)))
    n = 2000
    tracemalloc.start()
    try:
        await _churn(index, 0, n)  # warms every table up to its steady size
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        await _churn(index, n, n)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # An answer kept per removed instance costs a few hundred bytes (its
    # address, worker id and the match tuple): n of them would be far above this.
    assert grown < 40 * n, f"{grown} bytes kept after {n} instances came and went"
    assert await hits(index) == {B: ("http://b:1", 2, False)}


async def test_stored_blocks_add_nothing_for_the_garbage_collector_to_walk() -> None:
    index = MemoryIndex()
    await reg(index, A, "http://a:1")
    await reg(index, B, "http://b:1")
    n = 20_000
    tokens = tuple(range(BS * 2 * n))
    # The first block of each instance makes the namespace's and the
    # instance's maps (a few hundred objects, however large the index grows).
    for iid in (A, B):
        ev = BlockStored(block_hashes=(1,), token_ids=tokens[:BS], block_size=BS)
        await index.apply(EventBatch(iid, 0, (ev,)))
    gc.collect()
    before = len(gc.get_objects())
    for iid in (A, B):
        ev = BlockStored(
            block_hashes=tuple(range(2, n + 1)),
            parent_block_hash=1,
            token_ids=tokens[BS : BS * n],
            block_size=BS,
        )
        await index.apply(EventBatch(iid, 1, (ev,)))
    gc.collect()
    added = len(gc.get_objects()) - before
    assert (await index.stats()).block_instances == 2 * n
    # A tracked container per block (its holder dict, its engine-hash entry)
    # would add tens of thousands here.
    assert added < 100, f"{added} more objects tracked after storing {n} blocks twice"


async def test_blocks_several_instances_hold_leave_no_large_container_to_walk() -> None:
    """A full collection walks every tracked container: none may grow with the index."""
    index = MemoryIndex()
    await reg(index, A, "http://a:1")
    await reg(index, B, "http://b:1")
    n = 20_000
    tokens = tuple(range(BS * n))
    ev = BlockStored(block_hashes=tuple(range(1, n + 1)), token_ids=tokens, block_size=BS)
    await index.apply(EventBatch(A, 0, (ev,)))
    # B holds the first ten blocks too: those have two holders.
    shared = BlockStored(
        block_hashes=tuple(range(1, 11)), token_ids=tokens[: 10 * BS], block_size=BS
    )
    await index.apply(EventBatch(B, 0, (shared,)))
    # The largest container the collector tracks among what the index holds
    # (other tests may leave large tracked containers of their own).
    largest, seen, todo = 0, set(), [index]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or isinstance(obj, type):
            continue
        seen.add(id(obj))
        if isinstance(obj, dict | list | set | tuple) and gc.is_tracked(obj):
            largest = max(largest, len(obj))
        if isinstance(obj, dict | list | set | tuple | MemoryIndex) or hasattr(obj, "__slots__"):
            todo.extend(o for o in gc.get_referents(obj) if not isinstance(o, int | str | bytes))
    # A block table with a dict of holders among its values is tracked, and
    # every collection of the oldest generation walks all n of its entries.
    assert largest < n, f"a tracked container of {largest} entries"
    assert (await index.stats()).block_instances == n + 10


class _KeepsAlikeAnswers(MemoryIndex):
    """Broken on purpose: answers of runs held alike outlive a change of their instances."""

    def _forget_hits(self, inst: Any) -> None:
        kept = dict(self._alike_cache)
        super()._forget_hits(inst)
        self._alike_cache.update(kept)


async def _alike(index: MemoryIndex) -> None:
    """A and B hold both blocks on the GPU alone: Match answers them as a run held alike."""
    for iid, address in ((A, "http://a:1"), (B, "http://b:1")):
        await reg(index, iid, address)
        await index.apply(EventBatch(iid, 0, (both_blocks(),)))
    assert await hits(index) == {A: ("http://a:1", 2, False), B: ("http://b:1", 2, False)}


@pytest.mark.parametrize("cls", [MemoryIndex, _KeepsAlikeAnswers])
async def test_a_run_held_alike_is_answered_with_its_instances_as_they_are_now(
    cls: type[MemoryIndex],
) -> None:
    index = cls()
    await _alike(index)
    await reg(index, A, "http://a:2")  # a new address
    gap = EventBatch(B, 2, (BlockStored(block_hashes=(7,), token_ids=(1, 2, 3, 4), block_size=BS),))
    await index.apply(gap)  # B misses batch 1: stale
    got = await hits(index, include_stale=True)
    want = {A: ("http://a:2", 2, False), B: ("http://b:1", 2, True)}
    if cls is MemoryIndex:
        assert got == want
    else:
        assert got != want  # the broken index answers from before the changes


async def test_an_answer_of_a_run_held_alike_is_a_copy() -> None:
    index = MemoryIndex()
    await _alike(index)
    first = index.match_sync(NS, KEYS)
    first.clear()  # a caller that changes what it was given
    assert len(index.match_sync(NS, KEYS)) == 2
    await index.remove_instance(A)
    assert [m.instance for m in index.match_sync(NS, KEYS)] == [B]
