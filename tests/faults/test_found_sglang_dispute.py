"""An SGLang batch judged by one replica's cached epoch resets a worker another replica moved.

Found by the fault harness (``kvmesh bench faults --target cluster --profile
sglang --replicas 3 --seed 129``, shrunk to ``--keep 347,351,355,356,357,365``):
``ack_lost``, DumpIndex lacking a block the worker reported in an
acknowledged batch. It does not depend on the backend.

1. replica 1 registers worker s0 without an epoch (its first batch);
2. replica 0 gets a batch of s0 for epoch e1 with ``enforce_sequence``: its
   cache (epoch '') disagrees, it rereads the index (still epoch ''), refuses
   it (FAILED_PRECONDITION, as the contract says) and remembers the
   disagreement (``SglangCompat._disputed``);
3. replica 1 gets a batch for epoch e1 without ``enforce_sequence``: the index
   says epoch '', so s0 is reset under a new incarnation of epoch e1;
4. replica 1 applies a batch of e1 that reports blocks (acknowledged);
5. replica 0, within ``SPEC_CACHE_TTL_S`` of step 2, gets a batch for epoch
   e1: its cache still says epoch '' and disagrees, but the disagreement is
   "the same" as in step 2 (same epoch and address), so it skips the reread
   and resets s0 again under a fresh incarnation: the blocks of step 4 are
   gone, though the index held epoch e1 all along.

indexer/CONSISTENCY.md: an SGLang worker's registration (epoch, address,
sequence) is judged by what the index holds when a batch is judged, never
by what one replica remembers (bound 0).
"""

from __future__ import annotations

import pytest

from indexer.model import Tier
from lab.faults.driver import RunParams, format_round, run_round
from lab.faults.faults import Target
from lab.faults.ops import DumpIndex, SgAction, SgApply

ADDR = "http://s0:9000"

SCRIPT = (
    SgApply(1, "s0", "next", (SgAction("report", Tier.GPU, 3, 0, 2),), ADDR),
    SgApply(0, "s0", "next", (SgAction("report", Tier.GPU, 3, 2, 3),), ADDR, "e1", True),
    SgApply(1, "s0", "next", (SgAction("report", Tier.GPU, 1, 0, 1),), ADDR, "e1"),
    SgApply(1, "s0", "next", (SgAction("report", Tier.CPU, 4, 0, 4),), ADDR, "e1"),
    SgApply(0, "s0", "next", (SgAction("revoke", Tier.GPU, 5, 0, 1),), ADDR, "e1"),
    DumpIndex(0),
)


@pytest.mark.parametrize("kind", ["standalone", "cluster"])
async def test_a_remembered_disagreement_never_resets_a_worker_another_replica_moved(
    kind: str, request: pytest.FixtureRequest
) -> None:
    target: Target = request.getfixturevalue(kind)
    res = await run_round(target, RunParams(profile="sglang", replicas=3, script=SCRIPT))
    assert not res.violations, format_round(res)
    assert res.operations == len(SCRIPT)
