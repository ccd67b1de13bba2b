"""A DUPLICATE acknowledgement says the instance is stale; the same replica's Matches must too.

Found by the fault harness (``kvmesh bench faults --targets cluster --profiles
deadline --seed 404``, round seed 412, shrunk to ``--target cluster --profile
deadline --replicas 3 --seed 412 --keep 254,280,282,285,287``):
``stale_identity``, replica 2 naming w0/dp1 with ``stale=False`` although
every identity within the lag bound was stale.

Replica b applies a batch (its cached table: fresh). Replica a applies a
batch that skips sequences: the instance is stale. Replica b gets a batch at
or below the applied sequence: DUPLICATE, acknowledged with ``stale=True``.
``RedisIndex._apply`` renews the cached lease from that reply but not the
cached stale flag (the APPLIED branch updates both), so b's Matches keep
answering the instance as fresh until its table is read again.

indexer/CONSISTENCY.md: a replica's own writes (lease and stale flag on a
batch) show at once (bound 0); the harness books a batch's acknowledgement as
its replica's write of both, whatever its outcome.
"""

from __future__ import annotations

import pytest

from indexer.model import BatchOutcome, BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from kvmesh.blockkeys import block_keys
from tests.faults.conftest import replica_pair

X = InstanceId("x", 0)
NS = Namespace("m")
TOKENS = tuple(range(32))


@pytest.mark.parametrize("target", ["standalone", "cluster"])
async def test_a_duplicate_that_reports_stale_hides_the_instance_on_its_replica(
    target: str, request: pytest.FixtureRequest
) -> None:
    # A long cache TTL: only b's own write can tell it that x went stale.
    a, b = replica_pair(request, target)
    keys = block_keys(TOKENS, 16, "m")
    try:
        await a.register(InstanceSpec(X, "m", "http://x:9000", 30.0, "i"))
        await b.apply(EventBatch(X, 0, (BlockStored((1, 2), None, TOKENS, 16),)))
        assert [(m.instance, m.stale) for m in await b.match(NS, keys)] == [(X, False)]
        gap = await a.apply(EventBatch(X, 5, ()))
        assert (gap.outcome, gap.stale) == (BatchOutcome.APPLIED_AFTER_GAP, True)
        dup = await b.apply(EventBatch(X, 3, ()))
        assert (dup.outcome, dup.stale) == (BatchOutcome.DUPLICATE, True)

        assert await b.match(NS, keys) == [], "b acknowledged x as stale, then named it fresh"
        [m] = await b.match(NS, keys, include_stale=True)
        assert m.stale
    finally:
        await a.close()
        await b.close()
