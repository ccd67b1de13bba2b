"""An instance's engine-hash entries name their namespace by its place among
the instance's own namespaces, not by the index's number of it
(indexer/memory.py, ``_Instance.nids``).

With the index's number, an entry was ``number << 64 | key``: for every
namespace but the index's first one, a new int a (block, instance) pair,
about 36 bytes of the 150 a pair takes. With the place, the namespace an
instance stored in first has place 0 and the entry is the key itself. These
tests measure the bytes, and check that entries of several namespaces on one
instance (LoRA adapters) still remove, clear and dump right.
"""

from __future__ import annotations

import gc
import random
import tracemalloc

from indexer.memory import MemoryIndex
from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
)

PAIRS = 40_000
PER_BATCH = 2_000
#: Of about 150 bytes a pair either way; the namespace number made it 37 more.
MAX_EXTRA_BYTES = 12.0


def _stored(keys: tuple[int, ...], hashes: tuple[int, ...], lora: str = "") -> BlockStored:
    return BlockStored(
        block_hashes=hashes, block_keys=keys, token_ids=(), block_size=16, lora_name=lora
    )


async def _bytes_per_pair(index: MemoryIndex, iid: InstanceId, rng: random.Random) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for seq in range(PAIRS // PER_BATCH):
            keys = tuple(rng.getrandbits(64) for _ in range(PER_BATCH))
            hashes = tuple(rng.getrandbits(64) for _ in range(PER_BATCH))
            await index.apply(EventBatch(iid, seq, (_stored(keys, hashes),)))
            del keys, hashes
        gc.collect()
        return (tracemalloc.get_traced_memory()[0] - before) / PAIRS
    finally:
        tracemalloc.stop()


async def test_a_model_that_is_not_the_first_costs_no_more_a_pair() -> None:
    index = MemoryIndex()
    rng = random.Random(3)
    first, later = InstanceId("first", 0), InstanceId("later", 0)
    await index.register(InstanceSpec(first, "m-first", "http://a:1", 600.0, "x"))
    await index.register(InstanceSpec(later, "m-later", "http://b:1", 600.0, "x"))
    # m-first becomes the index's first namespace before either is measured.
    await index.apply(EventBatch(first, 0, (_stored((1,), (1,)),)))
    await index.apply(EventBatch(first, 1, (AllBlocksCleared(),)))
    on_later = await _bytes_per_pair(index, later, rng)
    await index.register(InstanceSpec(first, "m-first", "http://a:1", 600.0, "y"))
    on_first = await _bytes_per_pair(index, first, rng)
    assert on_later - on_first < MAX_EXTRA_BYTES, (on_later, on_first)


async def _depths(index: MemoryIndex, ns: Namespace, keys: list[int]) -> dict[str, int]:
    return {m.instance.worker_id: m.depth for m in await index.match(ns, keys)}


async def test_entries_of_several_namespaces_remove_clear_and_dump() -> None:
    index = MemoryIndex()
    a = InstanceId("a", 0)
    await index.register(InstanceSpec(a, "m", "http://a:1", 600.0, "x"))
    base, lora = Namespace("m"), Namespace("m", "adapter")
    # Another instance makes the base model the index's namespace 0, so that on
    # ``a`` (LoRA first) places and the index's numbers differ.
    z = InstanceId("z", 0)
    await index.register(InstanceSpec(z, "m", "http://z:1", 600.0, "x"))
    await index.apply(EventBatch(z, 0, (_stored((99,), (99,)),)))
    assert index._ns_ids[base] == 0
    kb, hb = [11, 12, 13], [101, 102, 103]
    kl, hl = [21, 22, 23], [201, 202, 203]
    # The LoRA namespace first: it takes place 0 on this instance.
    await index.apply(EventBatch(a, 0, (_stored(tuple(kl), tuple(hl), "adapter"),)))
    await index.apply(EventBatch(a, 1, (_stored(tuple(kb), tuple(hb)),)))
    assert await _depths(index, lora, kl) == {"a": 3}
    assert await _depths(index, base, kb) == {"a": 3}
    dumped = {h: (ns, key) for h, (ns, key) in (await index.dump()).engine_hashes[a].items()}
    assert dumped == {
        **{h: (lora, k) for h, k in zip(hl, kl, strict=True)},
        **{h: (base, k) for h, k in zip(hb, kb, strict=True)},
    }
    # Removals by engine hash find each block in its own namespace.
    await index.apply(EventBatch(a, 2, (BlockRemoved((hb[1], hl[2])),)))
    assert await _depths(index, base, kb) == {"a": 1}
    assert await _depths(index, lora, kl) == {"a": 2}
    # A store whose parent is in the other namespace is not chained to it.
    orphan = BlockStored(
        block_hashes=(301,),
        parent_block_hash=hb[0],
        token_ids=tuple(range(16)),
        block_size=16,
        lora_name="adapter",
    )
    result = await index.apply(EventBatch(a, 3, (orphan,)))
    assert result.blocks_orphaned == 1
    # A clear drops both; after it the base model takes place 0.
    await index.apply(EventBatch(a, 4, (AllBlocksCleared(),)))
    assert await _depths(index, base, kb) == {}
    assert await _depths(index, lora, kl) == {}
    await index.apply(EventBatch(a, 5, (_stored(tuple(kb), tuple(hb)),)))
    assert await _depths(index, base, kb) == {"a": 3}
    inst = index._instances[("a", 0)]
    assert inst.nids == [index._ns_ids[base]]
    assert all(e == k for e, k in zip((inst.engine_hashes.get(h) for h in hb), kb, strict=True))
