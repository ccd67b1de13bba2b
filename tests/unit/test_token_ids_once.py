"""Token ids are converted once on the way in: the service's range check makes
the ``array('I')`` the backend's key chaining then hashes as it is.

A second conversion of every id (tuple to array, in the key chaining) was 7 %
of a Redis replica's samples during a 512-token ingest (py-spy).
"""

from __future__ import annotations

from array import array
from typing import Any

import pytest

from indexer.logic import IndexerLogic
from indexer.memory import MemoryIndex
from indexer.model import (
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    MatchQuery,
    Namespace,
)
from kvmesh.blockkeys import block_keys
from kvmesh.errors import InvalidArgument
from tests.integration.test_replicas_service import config

W = InstanceId("w", 0)
B = 4


class _Seen(MemoryIndex):
    """The memory backend, keeping the events it was asked to apply."""

    def __init__(self) -> None:
        super().__init__()
        self.applied: list[Any] = []

    async def apply(self, batch: EventBatch) -> Any:
        self.applied.extend(batch.events)
        return await super().apply(batch)


async def _logic() -> tuple[IndexerLogic, _Seen]:
    idx = _Seen()
    logic = IndexerLogic(idx, config(block_size=B))
    await logic.register(InstanceSpec(W, "m", "a:1"))
    return logic, idx


async def test_the_backend_gets_the_checked_array_and_keys_agree() -> None:
    logic, idx = await _logic()
    tokens = tuple(range(70_000, 70_012))  # three blocks, ids past 16 bits
    ev = BlockStored(block_hashes=(1, 2, 3), token_ids=tokens, block_size=B)
    await logic.publish(EventBatch(W, 1, (ev,)))
    (got,) = idx.applied
    assert type(got.token_ids) is array and got.token_ids.typecode == "I"
    assert tuple(got.token_ids) == tokens
    # The keys chained from the array are the ones a router computes from the ids.
    res = await logic.match(MatchQuery(Namespace("m"), block_keys=block_keys(tokens, B, "m")))
    assert [(h.instance, h.depth) for h in res.matches] == [(W, 3)]


async def test_an_id_out_of_range_is_still_named() -> None:
    logic, idx = await _logic()
    ev = BlockStored(block_hashes=(1, 2), token_ids=(1, 2, 3, 4, 5, 1 << 32, 7, 8), block_size=B)
    with pytest.raises(InvalidArgument) as err:
        await logic.publish(EventBatch(W, 1, (ev,)))
    assert err.value.field == "events[0].stored.token_ids[5]"
    assert idx.applied == []
