"""The cluster client's own faults during a topology change answer Unavailable.

redis-py's cluster client, while its slot map is rebuilt (a node gone, a
failover), has raised AttributeError, KeyError or RuntimeError from its own
bookkeeping. Such a call got no answer from Redis: the index must say
Unavailable (which callers retry, and the ZMQ subscriber backs off on), not
let an internal error end the subscriber or reach a client as UNKNOWN.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from indexer.model import InstanceId, InstanceSpec
from indexer.redis.backend import RedisIndex
from kvmesh.errors import Unavailable


async def test_a_broken_slot_map_answers_unavailable_then_recovers(redis_cluster: Any) -> None:
    idx = RedisIndex(redis_cluster.url, prefix=f"f{uuid.uuid4().hex[:8]}", cluster=True)
    try:
        spec = InstanceSpec(InstanceId("w", 0), model="m", address="a", incarnation="i")
        await idx.register(spec)
        # The state redis-py's nodes manager is in halfway through a rebuild.
        nm = idx._r.nodes_manager
        saved = nm.slots_cache
        nm.slots_cache = {slot: [None] for slot in saved}
        try:
            with pytest.raises(Unavailable, match="cluster client fault"):
                await idx.heartbeat(spec.instance)
            with pytest.raises(Unavailable, match="cluster client fault"):
                await idx.list_instances()
        finally:
            nm.slots_cache = saved
        state = await idx.heartbeat(spec.instance)
        assert state.live
    finally:
        await idx.close()
