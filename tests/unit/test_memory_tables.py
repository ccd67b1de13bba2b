"""The memory backend's maps of 64-bit ints (indexer/memory.py, "Tables").

Keys are mixed by a secret odd multiplier and two folds before they reach an
open-addressing map, which finds a key's home from its low bits and probes
linearly: unmixed, keys a client or an engine chose with equal low bits
would share one run of cells, and every store would walk it. Deleted
entries leave tombstones that only a copy of the map clears. These tests
check the mix (a bijection, the vector path equal to the scalar one, keys of
regular shapes spread), that such keys store as fast as random ones, and
that churn does not grow the maps; each with the broken variant it must
catch.
"""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest

from indexer import memory
from indexer.memory import MemoryIndex
from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, InstanceSpec

A = InstanceId("a", 0)
U64 = (1 << 64) - 1
#: Keys of regular shapes a client giving keys, or an engine, may send.
FAMILIES: dict[str, Callable[[int], int]] = {
    "sequential": lambda i: i,
    "high word": lambda i: i << 32,
    "both words": lambda i: i << 32 | i,
    "top bits": lambda i: i << 48,
    "strided": lambda i: i << 20,
}


def test_the_mix_is_a_bijection_and_both_paths_agree(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = random.Random(5)
    edges = [0, 1, 2, (1 << 32) - 1, 1 << 32, 1 << 63, U64 - 1, U64]
    keys = edges + [rng.getrandbits(64) for _ in range(2_000)]
    mixed = [memory._mixed(k) for k in keys]
    assert all(0 <= m <= U64 for m in mixed)
    assert len(set(mixed)) == len(keys)
    assert [memory._unmixed(m) for m in mixed] == keys
    for n in (3, memory.MIX_VECTOR_FROM - 1, memory.MIX_VECTOR_FROM, 500):
        assert memory._mixed_all(keys[:n]) == mixed[:n]
        assert memory._mixed_all(tuple(keys[:n])) == mixed[:n]
    # Without numpy (a router-only install's follower): Python throughout.
    monkeypatch.setattr(memory, "MIX_VECTOR_FROM", 1 << 62)
    assert memory._mixed_all(keys) == mixed


def _homes(family: Callable[[int], int], n: int = 4096, bits: int = 16) -> tuple[int, int]:
    """Distinct home cells (low ``bits`` of the mixed key) and the most keys
    one shard's slot range gets, over ``n`` keys of ``family``."""
    mixed = [memory._mixed(family(i)) for i in range(1, n + 1)]
    homes = len({m & ((1 << bits) - 1) for m in mixed})
    per_shard: dict[int, int] = {}
    for m in mixed:
        shard = memory._SLOT_SHARD[m >> memory._SLOT_SHIFT]
        per_shard[shard] = per_shard.get(shard, 0) + 1
    return homes, max(per_shard.values())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_keys_of_regular_shapes_spread_over_homes_and_shards(name: str) -> None:
    homes, most = _homes(FAMILIES[name])
    # 4,096 random keys take about 3,970 of 65,536 homes, and the largest
    # shard its share of them (binomial: within a few of its standard deviations).
    largest = max(Counter(memory._SLOT_SHARD).values()) / memory.SLOTS * 4096
    assert homes >= 3_800, f"{name}: {homes} homes"
    assert most <= largest + 5 * largest**0.5, f"{name}: {most} keys in one shard"


def test_a_mix_without_its_secret_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    # Multiplier 1: the folds alone, a function anyone can invert.
    monkeypatch.setattr(memory, "_MIX", 1)
    assert min(_homes(f)[0] for f in FAMILIES.values()) < 100


async def _store_seconds(keys: list[int]) -> float:
    """Seconds to store ``keys`` (given as block keys and as engine hashes) on one instance."""
    index = MemoryIndex()
    await index.register(InstanceSpec(A, "m", "http://a:1", 600.0, "x"))
    t = time.perf_counter()
    for seq, lo in enumerate(range(0, len(keys), 2_000)):
        chunk = tuple(keys[lo : lo + 2_000])
        ev = BlockStored(block_hashes=chunk, block_keys=chunk, token_ids=(), block_size=16)
        await index.apply(EventBatch(A, seq, (ev,)))
    took = time.perf_counter() - t
    assert (await index.stats()).block_instances == len(keys)
    return took


async def _ratio(n: int = 20_000) -> float:
    """Storing keys that share their low bits once mixed by the folds alone,
    against as many random keys (best of three each)."""
    rng = random.Random(9)
    shaped = [FAMILIES["both words"](i) for i in range(1, n + 1)]
    plain = [rng.getrandbits(64) for _ in range(n)]
    return min([await _store_seconds(shaped) for _ in range(3)]) / min(
        [await _store_seconds(plain) for _ in range(3)]
    )


async def test_keys_built_to_collide_store_as_fast_as_random_ones() -> None:
    assert await _ratio() < 2.0


async def test_without_the_secret_such_keys_take_quadratic_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(memory, "_MIX", 1)
    assert await _ratio(n=6_000) > 5.0


def _capacity(index: MemoryIndex) -> int:
    """Cells of every map of the index (block tables and engine-hash maps)."""
    tables = sum(t.capacity for ts in index._blocks.values() for t in ts[: memory.SHARDS])
    hashes = sum(
        t.capacity for inst in index._instances.values() for t in inst.engine_hashes.shards
    )
    return tables + hashes


def _cycles(rng: random.Random, n: int) -> Iterator[tuple[tuple[int, ...], tuple[int, ...]]]:
    while True:
        keys = tuple(rng.getrandbits(64) for _ in range(n))
        hashes = tuple(rng.getrandbits(64) for _ in range(n))
        yield keys, hashes


async def _churned(cycles: int, n: int = 5_000) -> tuple[int, int]:
    """Capacity after the first of ``cycles`` stores of ``n`` new blocks
    (each removed before the next), and after the last."""
    index = MemoryIndex()
    await index.register(InstanceSpec(A, "m", "http://a:1", 600.0, "x"))
    seq = 0
    first = 0
    for c, (keys, hashes) in zip(range(cycles), _cycles(random.Random(4), n), strict=False):
        ev = BlockStored(block_hashes=hashes, block_keys=keys, token_ids=(), block_size=16)
        await index.apply(EventBatch(A, seq, (ev,)))
        if c == 0:
            first = _capacity(index)
        await index.apply(EventBatch(A, seq + 1, (BlockRemoved(hashes),)))
        seq += 2
        st = await index.stats()
        assert st.blocks == st.block_instances == 0
        assert len(index._instances[(A.worker_id, A.dp_rank)].engine_hashes) == 0
    return first, _capacity(index)


async def test_churn_does_not_grow_the_maps() -> None:
    first, last = await _churned(30)
    assert last <= 2 * first, f"{first} cells after one cycle, {last} after 30"


async def test_maps_never_copied_grow_with_churn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(memory, "REBUILD_MIN", 1 << 62)
    first, last = await _churned(30)
    assert last > 4 * first
