"""The memory backend's block tables grow one shard at a time.

A map grows by copying itself whole, in one step nothing can cut. The
block table of a namespace is therefore split into shards; but shards of
equal share fill alike (block keys are hashes), so all of them reached a
growth point within a few thousand keys of each other and were copied
back to back: at 16-token blocks, 17 to 47 ms slices of one apply and
plateaus of Match latency during ingest. These tests grow a real
MemoryIndex and watch each shard's size, and check that the growth points
are spread over the doubling of the table (indexer/memory.py, "Shards").
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence

import pytest
from preshed.maps import PreshMap

from indexer import memory
from indexer.memory import SHARDS, SLOTS, MemoryIndex
from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace

NS = Namespace("llama")
A = InstanceId("a", 0)
BATCH = 2_000
#: Keys stored in all: the tables pass one whole doubling after FROM.
TOTAL = 400_000
FROM = 100_000
#: A window of the table's growth, and the shards it may see grow at most
#: (spread evenly over a doubling, a tenth of the growth is log2(1.1) = 14 %
#: of it).
WINDOW = 1.10
MAX_GROWN_IN_WINDOW = SHARDS // 4


def _table_shards(index: MemoryIndex) -> Sequence[PreshMap]:
    return index._blocks[NS][:SHARDS]


def _hash_shards(index: MemoryIndex) -> Sequence[PreshMap]:
    return index._instances[(A.worker_id, A.dp_rank)].engine_hashes.shards


async def _growth_points(
    shards_of: Callable[[MemoryIndex], Sequence[PreshMap]] = _table_shards, seed: int = 7
) -> list[tuple[int, int]]:
    """(keys stored, shard) each time a map of ``shards_of`` the index grew,
    storing TOTAL random keys (as engine hashes too) on one instance."""
    index = MemoryIndex()
    await index.register(InstanceSpec(A, "llama", "http://a:1", 600.0, "x"))
    rng = random.Random(seed)
    points: list[tuple[int, int]] = []
    sizes: list[int] | None = None
    for seq, start in enumerate(range(0, TOTAL, BATCH)):
        keys = tuple(rng.getrandbits(63) for _ in range(BATCH))
        stored = BlockStored(block_hashes=keys, block_keys=keys, token_ids=(), block_size=16)
        await index.apply(EventBatch(A, seq, (stored,)))
        now = [d.capacity for d in shards_of(index)]
        if sizes is not None:
            points += [(start + BATCH, i) for i in range(len(now)) if now[i] != sizes[i]]
        sizes = now
    return points


def _most_in_a_window(points: list[tuple[int, int]]) -> int:
    """Most shards that grew within one WINDOW of the table's growth past FROM."""
    at = sorted(n for n, _ in points if n >= FROM)
    most = 0
    for i, n in enumerate(at):
        j = i
        while j < len(at) and at[j] <= n * WINDOW:
            j += 1
        most = max(most, j - i)
    return most


def test_every_shard_has_slots_and_the_first_slots_name_each_shard_once() -> None:
    shard_of = memory._SLOT_SHARD
    assert len(shard_of) == SLOTS
    assert shard_of[:SHARDS] == tuple(range(SHARDS))
    share = Counter(shard_of)
    assert set(share) == set(range(SHARDS))
    # Shares spread over a factor of two, smallest first.
    assert 1.8 <= share[SHARDS - 1] / share[0] <= 2.2
    assert [share[i] for i in range(SHARDS)] == sorted(share[i] for i in range(SHARDS))


async def test_shards_grow_one_at_a_time_over_a_doubling_of_the_table() -> None:
    points = await _growth_points()
    past = {i for n, i in points if n >= FROM}
    assert past == set(range(SHARDS))  # every shard grew in the doubling watched
    assert _most_in_a_window(points) <= MAX_GROWN_IN_WINDOW


async def test_shards_of_equal_share_grow_together(monkeypatch: pytest.MonkeyPatch) -> None:
    # The layout before: a slot per shard, as many each. The same measure must
    # catch it (nearly every shard grows within one window).
    monkeypatch.setattr(memory, "_SLOT_SHARD", tuple(i % SHARDS for i in range(SLOTS)))
    assert _most_in_a_window(await _growth_points()) > 3 * MAX_GROWN_IN_WINDOW


async def test_an_engines_hash_map_grows_one_shard_at_a_time() -> None:
    # An engine's map of its hashes was one dict: at 90 k hashes it grew in
    # one step of up to 16 ms of the loop, 165 times in one probed round of
    # the peer bench at 16-token blocks.
    points = await _growth_points(_hash_shards, seed=11)
    assert {i for n, i in points if n >= FROM} == set(range(memory.HASH_SHARDS))
    assert _most_in_a_window(points) <= memory.HASH_SHARDS // 4
