"""A batch reviving a lapsed lease through the apply script's 'retry' never moved the generation.

Found by the fault harness (``kvmesh bench faults --target cluster --profile
migrate --replicas 3 --seed 325``, shrunk to ``--keep
125,161,205,206,207,209,210``; no migration is left in it): ``hidden_live``,
a replica leaving out a live instance past the lag bound.

``apply.lua`` / ``capply.lua`` renew the lease (``HSET exp``, ``ZADD lease``)
before they check the caller's parent mappings, and answer ``{'retry'}`` when
those are outdated, without bumping ``P:gen`` for the revival. The caller
retries with the mappings read from Redis; that attempt finds the lease
running (the first one renewed it), so ``revived`` is false and it does not
bump either. A replica whose cached table was read after the lease ran out
does not reread it for that lease (reviving it is supposed to bump the
generation, indexer/redis/backend.py ``_recompute_exclusions``) and keeps
leaving the instance out of its Matches, past ``instance_cache_ttl_s``.

The 'retry' comes from a replica whose cached int id of the instance is
outdated: another replica cleared the instance (a clear re-keys it), so the
parent it looks up in its old id's engine-hash map is absent, and the script
finds it in the new one.
"""

from __future__ import annotations

import pytest

from indexer.model import InstanceId
from lab.faults.driver import RunParams, format_round, run_round
from lab.faults.faults import Target
from lab.faults.ops import Clear, ClockJump, GetStats, Match, Publish, Register, Settle, Store

W0 = InstanceId("w0", 0)

SCRIPT = (
    Register(1, W0, "m", "http://w0-0:8000", 5.0, "a"),
    # Replica 0 clears the instance (a new int id) and stores block 0 of chain 0.
    Publish(0, W0, "next", (Clear(), Store(3, 0, 3))),
    ClockJump(61.0),  # the lease runs out
    GetStats(0),  # replica 0 reads the table: the lease has run out
    # Replica 1 still knows the old int id: its parent lookup is outdated ('retry').
    Publish(1, W0, "next", (Store(0, 1, 2),)),
    Settle(),  # past every lag bound
    Match(0, "m", "", 0, 2, via="logic"),
)


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
async def test_a_revival_through_a_retried_apply_reaches_every_replica(
    kind: str, request: pytest.FixtureRequest
) -> None:
    target: Target = request.getfixturevalue(kind)
    res = await run_round(target, RunParams(profile="core", replicas=3, script=SCRIPT))
    assert not res.violations, format_round(res)
    assert res.operations == len(SCRIPT)
