"""After a Redis restarted empty, a new instance's int id was one a replica's cache gave another.

Found by the fault harness (``kvmesh bench faults``, target ``standalone``,
profile ``restart``, seed 924, shrunk to ``--keep 5,7,8,10,12``):
``removed_reported``, replica 2 naming w2/dp0 with 2 blocks after Redis lost
it. Standalone Redis numbered instances from 1 again after a restart; w0,
registered first after it, got the int id replica 2's cached table (younger
than its bound) still gave w2, and that replica's Matches named w2 with w0's
blocks. Ids now start from the server clock in both modes, as the Cluster's
did (indexer/redis/KEYS.md), so an id seen before a restart is never handed
out again after it.
"""

from __future__ import annotations

from indexer.model import InstanceId, Tier
from lab.faults.driver import RunParams, format_round, run_round
from lab.faults.faults import StandaloneTarget
from lab.faults.ops import Publish, Register, RestartRedis, Store

W0 = InstanceId("w0", 0)
W2 = InstanceId("w2", 0)

SCRIPT = (
    Register(2, W2, "m", "http://w2-0:8000", 20.0, "a"),
    RestartRedis(),
    Register(0, W0, "m2", "http://w0-0:8000", 20.0, "a"),
    Publish(1, W0, "next", (Store(1, 0, 2),)),
    Publish(0, W2, "next", (Store(4, 1, 3, Tier.CPU), Store(3, 0, 1, Tier.CPU))),
)


async def test_ids_handed_out_after_a_restart_were_never_seen_before_it(
    standalone: StandaloneTarget,
) -> None:
    res = await run_round(standalone, RunParams(profile="restart", replicas=3, script=SCRIPT))
    assert not res.violations, format_round(res)
