"""The memory backend's apply of a long batch: a slice at a time, the loop running between.

A burst of engine events (vLLM at 16-token blocks sends batches of tens of
thousands of blocks) must not hold every Match and health probe until it is
applied, and the batch must still behave as one: its outcome is the whole
batch's, a caller's cancellation does not cut it short, later batches of the
instance come after it, and a reset or removal meanwhile leaves nothing of it.
"""

from __future__ import annotations

import asyncio

from indexer.memory import SLICE_WORK, MemoryIndex
from indexer.model import (
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
)
from kvmesh.blockkeys import block_keys

BS = 16
IID = InstanceId("w", 0)
NS = Namespace("m", "")
#: A chain long enough to be applied in many slices.
N_BLOCKS = 40 * SLICE_WORK // (1 + BS // 8)
TOKENS = [(i * 7919) % 50_000 for i in range(N_BLOCKS * BS)]
KEYS = block_keys(TOKENS, BS, "m", "")


def spec(incarnation: str = "a") -> InstanceSpec:
    return InstanceSpec(IID, "m", "http://w:8000", 600.0, incarnation)


def long_batch(seq: int = 0, incarnation: str = "") -> EventBatch:
    stored = BlockStored(tuple(range(1, N_BLOCKS + 1)), None, tuple(TOKENS), BS)
    return EventBatch(IID, seq, (stored,), incarnation=incarnation)


async def started(index: MemoryIndex) -> None:
    """Return once part of the long batch is visible (it is paused between slices)."""
    for _ in range(10_000):
        if await depth(index):
            return
        await asyncio.sleep(0)
    raise AssertionError("the long batch never became visible")


async def depth(index: MemoryIndex) -> int:
    got = await index.match(NS, KEYS)
    return got[0].depth if got else 0


async def test_match_is_answered_while_a_long_batch_applies() -> None:
    index = MemoryIndex()
    await index.register(spec())
    apply = asyncio.ensure_future(index.apply(long_batch()))
    seen = []
    while not apply.done():
        await asyncio.sleep(0)
        seen.append(await depth(index))
    result = await apply
    assert result.outcome is BatchOutcome.APPLIED and result.blocks_stored == N_BLOCKS
    # Answered before the batch was through, each a prefix of the chain, never shrinking.
    partial = [d for d in seen if d < N_BLOCKS]
    assert partial, "no Match was answered while the batch applied"
    assert seen == sorted(seen)
    assert await depth(index) == N_BLOCKS


async def test_cancelled_caller_does_not_cut_the_batch_short() -> None:
    index = MemoryIndex()
    await index.register(spec())
    apply = asyncio.ensure_future(index.apply(long_batch()))
    await started(index)
    apply.cancel()
    for _ in range(10_000):
        states = await index.list_instances()
        if states[0].applied_sequence == 0:
            break
        await asyncio.sleep(0)
    assert await depth(index) == N_BLOCKS
    assert states[0].blocks == N_BLOCKS
    # And its retry is a duplicate, as after any applied batch.
    again = await index.apply(long_batch())
    assert again.outcome is BatchOutcome.DUPLICATE


async def test_later_batches_of_the_instance_wait_for_it() -> None:
    index = MemoryIndex()
    await index.register(spec())
    first = asyncio.ensure_future(index.apply(long_batch(0)))
    await asyncio.sleep(0)
    dup = asyncio.ensure_future(index.apply(long_batch(0)))
    removal = asyncio.ensure_future(index.apply(EventBatch(IID, 1, (BlockRemoved((N_BLOCKS,)),))))
    results = await asyncio.gather(first, dup, removal)
    assert [r.outcome for r in results] == [
        BatchOutcome.APPLIED,
        BatchOutcome.DUPLICATE,
        BatchOutcome.APPLIED,
    ]
    assert results[2].blocks_removed == 1  # the removal came after the store
    assert await depth(index) == N_BLOCKS - 1


async def test_reset_while_the_batch_applies_leaves_nothing_of_it() -> None:
    index = MemoryIndex()
    await index.register(spec("a"))
    apply = asyncio.ensure_future(index.apply(long_batch(0, "a")))
    await started(index)
    _, reset = await index.register(spec("b"))  # the engine restarted
    assert reset
    await apply
    assert await depth(index) == 0
    states = await index.list_instances()
    assert states[0].blocks == 0 and states[0].applied_sequence is None
    stats = await index.stats()
    assert stats.blocks == 0 and stats.block_instances == 0


async def test_removal_while_the_batch_applies_leaves_nothing_of_it() -> None:
    index = MemoryIndex()
    await index.register(spec())
    apply = asyncio.ensure_future(index.apply(long_batch()))
    await started(index)
    await index.remove_instance(IID)
    await apply
    dump = await index.dump()
    assert not any(dump.blocks.values()) and not dump.instances
