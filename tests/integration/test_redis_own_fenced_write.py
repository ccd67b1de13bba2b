"""A replica's own write shows what its fence proved: an address fence that held.

Found by the fault harness (``kvmesh bench faults --target standalone
--profile sglang --seed 61``): another replica moved a worker to a new
address; this replica then applied the worker's batches fenced with the new
address (accepted: Redis had it), yet its Matches kept answering the old
address from its cached instance table.
"""

from __future__ import annotations

import uuid
from typing import Any

from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from indexer.redis.backend import RedisIndex
from kvmesh.blockkeys import block_keys

W = InstanceId("w", 0)


async def test_an_accepted_address_fence_updates_the_replicas_view(redis_server: Any) -> None:
    prefix = f"of{uuid.uuid4().hex[:8]}"
    # A long cache TTL: only the write itself can teach replica a the new address.
    a = RedisIndex(redis_server.url, prefix=prefix, instance_cache_ttl_s=60.0)
    b = RedisIndex(redis_server.url, prefix=prefix, instance_cache_ttl_s=60.0)
    try:
        await a.register(InstanceSpec(W, "m", "http://w:9000", 30.0, "x"))
        await a.apply(EventBatch(W, 0, (BlockStored((1,), None, tuple(range(16)), 16),)))
        keys = block_keys(tuple(range(32)), 16, "m")
        assert [m.address for m in await a.match(Namespace("m"), keys)] == ["http://w:9000"]
        await b.register(InstanceSpec(W, "m", "http://w:9001", 30.0, "x"))
        batch = EventBatch(
            W,
            1,
            (BlockStored((2,), 1, tuple(range(16, 32)), 16),),
            address="http://w:9001",
        )
        result = await a.apply(batch)
        assert result.blocks_stored == 1
        [m] = await a.match(Namespace("m"), keys)
        assert (m.address, m.depth) == ("http://w:9001", 2)
    finally:
        await a.close()
        await b.close()
