"""``Index.dump_blocks``, what DumpIndex answers: the first ``cap`` blocks in
order, read without loading the whole index (SECURITY.md, finding 6: DumpIndex
used to read everything before its 100,000-block cap).

Each backend's answer is compared with the reference of the base class (read
from the whole ``dump()``) for random contents and every interesting cap; then
the cost: on the memory backend the allocations of a capped dump do not grow
with the index, on Redis the holders of the capped blocks alone are read.
"""

from __future__ import annotations

import random
import tracemalloc
from typing import Any

import pytest
import redis

from indexer.index import Index
from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Tier
from kvmesh.blockkeys import block_keys

BS = 4
MODELS = ("llama", "qwen")


async def fill(index: Any, rng: random.Random, prompts: int) -> None:
    """Three instances over two models, some blocks shared, one LoRA, tiers mixed;
    one instance removed after publishing (its blocks must not show)."""
    insts = [InstanceId(f"w{i}", i % 2) for i in range(4)]
    for n, inst in enumerate(insts):
        await index.register(InstanceSpec(inst, MODELS[n % 2], f"http://w{n}", 30.0, "x"))
    seqs = dict.fromkeys(insts, 0)
    for p in range(prompts):
        inst = insts[rng.randrange(len(insts))]
        model = MODELS[insts.index(inst) % 2]
        lora = "ad" if rng.random() < 0.2 else ""
        # a shared stem so that blocks have several holders
        tokens = [7, 7, 7, 7] * rng.randrange(3) + [rng.randrange(1000) for _ in range(4 * 3)]
        keys = block_keys(tokens, BS, model, lora)
        ev = BlockStored(
            block_hashes=tuple(range(p * 100, p * 100 + len(keys))),
            parent_block_hash=None,
            token_ids=tuple(tokens),
            block_size=BS,
            lora_name=lora,
            tier=rng.choice((Tier.GPU, Tier.GPU, Tier.CPU)),
        )
        await index.apply(EventBatch(inst, seqs[inst], (ev,)))
        seqs[inst] += 1
    await index.remove_instance(insts[3])


@pytest.mark.parametrize("seed", [1, 2])
async def test_capped_dump_equals_the_reference_at_every_cap(index: Any, seed: int) -> None:
    await fill(index, random.Random(seed), 60)
    whole, more = await Index.dump_blocks(index, "", 1 << 30)
    assert not more and len(whole) > 50
    for model in ("", *MODELS, "absent"):
        n = sum(1 for ns, _, _ in whole if not model or ns.model == model)
        for cap in sorted({1, 2, 7, max(1, n - 1), max(1, n), n + 1, 1000}):
            got = await index.dump_blocks(model, cap)
            assert got == await Index.dump_blocks(index, model, cap), (model, cap)
            assert got[1] == (n > cap)


async def test_a_broken_dump_fails_the_comparison(index: Any) -> None:
    """The comparison above can fail: an answer cut one block short, or out of
    order, is told apart from the reference."""
    await fill(index, random.Random(3), 20)
    ref, _ = await Index.dump_blocks(index, "", 10)
    got, _ = await index.dump_blocks("", 10)
    assert got == ref
    assert got[:-1] != ref
    assert list(reversed(got)) != ref


async def _memory_peak(coro: Any) -> int:
    tracemalloc.start()
    try:
        await coro
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


async def test_memory_backend_capped_dump_does_not_hold_the_index() -> None:
    from indexer.memory import MemoryIndex

    index = MemoryIndex()
    inst = InstanceId("w", 0)
    await index.register(InstanceSpec(inst, "llama", "http://w", 30.0, "x"))
    rng = random.Random(0)
    for seq in range(100):
        keys = tuple(rng.getrandbits(63) for _ in range(2000))
        ev = BlockStored(
            block_hashes=keys,
            parent_block_hash=None,
            token_ids=(),
            block_size=BS,
            block_keys=keys,
        )
        await index.apply(EventBatch(inst, seq, (ev,)))
    whole = await _memory_peak(Index.dump_blocks(index, "", 10))
    capped = await _memory_peak(index.dump_blocks("", 10))
    # 200,000 blocks: the whole dump allocates tens of MB, the capped one the
    # keys it compares at a time (nsmallest keeps 11), well under 1 MB
    assert whole > 20 << 20, whole
    assert capped < 1 << 20, capped


async def test_redis_capped_dump_reads_the_holders_of_the_capped_blocks_alone(
    redis_server: Any,
) -> None:
    from indexer.redis.backend import RedisIndex

    index = RedisIndex(redis_server.url, prefix="dumpcap")
    try:
        inst = InstanceId("w", 0)
        await index.register(InstanceSpec(inst, "llama", "http://w", 30.0, "x"))
        keys = tuple(range(1, 5001))
        ev = BlockStored(
            block_hashes=keys,
            parent_block_hash=None,
            token_ids=(),
            block_size=BS,
            block_keys=keys,
        )
        await index.apply(EventBatch(inst, 0, (ev,)))
        r = redis.Redis.from_url(redis_server.url)

        def hgetalls() -> int:
            stats = r.info("commandstats").get("cmdstat_hgetall", {})
            return int(stats.get("calls", 0))

        before = hgetalls()
        got, more = await index.dump_blocks("", 10)
        capped = hgetalls() - before
        assert more and [k for _, k, _ in got] == list(range(1, 11))
        before = hgetalls()
        await Index.dump_blocks(index, "", 10)
        whole = hgetalls() - before
        # the namespace table, then the 11 blocks kept (one more than fits, to
        # know the answer is cut short): one HGETALL each
        assert capped <= 12 < 5000 <= whole, (capped, whole)
        r.close()
    finally:
        await index.close()
