"""Two replays against one live indexer: the second starts from empty caches, as its engines do.

The replay's engines register under a new incarnation every run, which resets
what an earlier run left of them in the index. Without it the second run
routes on blocks no engine of its own holds (found running `kvmesh replay
--indexer` twice: cache_shared's hit rate fell from 16.3% to 11.1%).
"""

from __future__ import annotations

import grpc.aio

from indexer.memory import MemoryIndex
from indexer.model import BlockStored, EventBatch, InstanceId
from indexer.server import start_server
from lab.sim.publish import GrpcPublisher
from router_client import IndexerClient, IndexerClientSettings
from tests.grpc.conftest import make_config

MODEL = "replay-model"


async def test_a_later_replays_engines_hold_nothing_of_an_earlier_ones() -> None:
    server = await start_server(make_config(block_size=512), MemoryIndex())
    try:
        async with grpc.aio.insecure_channel(server.address) as channel:
            client = IndexerClient(
                channel=channel, settings=IndexerClientSettings(deadline_ms=2000), model=MODEL
            )
            first = GrpcPublisher(channel, MODEL)
            await first.register("engine-000")
            stored = BlockStored(block_hashes=(1, 2), parent_block_hash=None, block_keys=(7, 8))
            await first.publish(EventBatch(InstanceId("engine-000"), 1, (stored,)))
            await first.close()
            held = await client.match([7, 8])
            assert held.ok and held.matches["engine-000"].depth == 2
            second = GrpcPublisher(channel, MODEL)
            assert second.incarnation != first.incarnation
            await second.register("engine-000")
            again = await client.match([7, 8])
            assert again.ok and "engine-000" not in again.matches, again.matches
            await second.close()
    finally:
        await server.stop(0)
