"""The fault harness with a router's follower (lab/faults/fleet.py): of the memory replica,
and of a replica over standalone Redis (its copy of the shared index).

The follower (router_client/follower.py) follows the replica through a real
WatchIndex stream on 127.0.0.1, behind a relay that cuts and stalls it; the
driver checks its Matches against the model under the contract's follower
bound (indexer/CONSISTENCY.md, "A router's follower"). The round here is one
the unbroken follower passes; followers broken on purpose (tests/faults/broken.py)
must fail it, each by the invariant its bug breaks.
"""

from __future__ import annotations

import pytest

from indexer.model import InstanceId
from lab.faults.driver import RunParams, format_round, run_round
from lab.faults.faults import Target
from lab.faults.fleet import HarnessFollower
from lab.faults.ops import ClockJump, Publish, Register, Settle, Store
from tests.faults.broken import FollowerIgnoresBlockRemovals, FollowerStopsApplying

#: A round the unbroken follower passes, with stream cuts and stalls in it.
SEED, PROFILE, OPS = 3, "core", 300


async def test_a_follower_keeps_the_contract_through_cuts_and_stalls(memory: Target) -> None:
    res = await run_round(memory, RunParams(seed=SEED, profile=PROFILE, ops=OPS, follower=True))
    assert not res.violations, format_round(res)
    assert res.operations == OPS
    assert res.faults["follower_cut"] > 0 and res.faults["follower_stall"] > 0, res.faults
    # Answers were checked against the model, and the cuts made it load new snapshots.
    assert res.follower["checked"] > 50, res.follower
    assert res.follower["snapshots"] >= 2, res.follower


@pytest.mark.parametrize(
    ("broken", "caught_by"),
    [
        # A tier move is a store on the slower tier and a removal from the faster.
        (FollowerIgnoresBlockRemovals, {"removed_reported", "wrong_read"}),
        (FollowerStopsApplying, {"follower_lag"}),
    ],
)
async def test_a_broken_follower_is_caught(
    broken: type[HarnessFollower], caught_by: set[str], memory: Target
) -> None:
    p = RunParams(seed=SEED, profile=PROFILE, ops=OPS, follower=True, follower_cls=broken)
    res = await run_round(memory, p)
    assert res.violations, f"{broken.__name__}: {res.operations} operations and no violation"
    assert res.violations[0].invariant in caught_by, format_round(res)
    assert "follower" in res.violations[0].detail
    # The replay names the follower, so that it is run again.
    assert f"--seed {SEED} --follower --keep" in format_round(res)


W = InstanceId("w0", 0)

#: The follower's stream is cut at step 3 (drawn from seed 154), after the
#: instance's lease ran out on the replica's clock and before any reap.
_EXPIRED_THEN_CUT = (
    Register(0, W, "m", "http://w0-0:8000", 20.0, "a"),
    Publish(0, W, "next", (Store(0, 0, 3),)),
    ClockJump(61.0),
    Settle(),
    Settle(),
)


async def test_a_lease_that_ran_out_is_not_revived_by_a_follower_snapshot(
    memory: Target,
) -> None:
    """Found by the harness: a snapshot registered each instance anew with a whole
    lease, so one whose lease had run out at the replica was answered again after
    the follower resynced (``ghost_instance``; fails without the snapshot's lease in
    MemoryIndex.load_instance)."""
    p = RunParams(seed=154, profile="core", script=_EXPIRED_THEN_CUT, follower=True)
    p.ops = len(_EXPIRED_THEN_CUT)
    res = await run_round(memory, p)
    assert res.faults["follower_cut"] == 1, res.faults
    assert not res.violations, format_round(res)


async def test_a_change_the_follower_applies_late_renews_from_the_replicas_time(
    memory: Target,
) -> None:
    """Found by the harness (``kvmesh bench faults --targets memory --follower``,
    shrunk to ``--target memory --profile sglang --replicas 3 --seed 5 --follower
    --keep 151,160,162,166``): ``ghost_instance``, the follower naming an instance
    whose lease had run out 31 s before at the replica. A batch renews its
    instance's lease; the copy applied it after the clock had jumped and renewed
    from its own time. It now renews from the change's ``applied_at`` (fails
    without MemoryIndex.renewed_at in the follower)."""
    p = RunParams(seed=5, profile="sglang", replicas=3, keep=(151, 160, 162, 166), follower=True)
    p.ops = 167
    res = await run_round(memory, p)
    assert res.faults["clock_jump"] >= 1, res.faults
    assert not res.violations, format_round(res)


#: Rounds over two replicas sharing one Redis or one Cluster; the follower
#: follows replica 0's copy of the shared index (indexer/redis/watchfeed.py)
#: through stream cuts and stalls, with Redis stalled (CLIENT PAUSE) or
#: restarted empty, slots moved, and the control master failed over to its
#: replica. Restarts and failovers make the replica copy the index again.
REDIS_OPS = 250


@pytest.mark.parametrize(
    ("target", "profile", "seed", "copies"),
    [
        ("standalone", "core", 1, 1),
        ("standalone", "pause", 2, 2),
        ("standalone", "restart", 1, 2),
        ("cluster", "migrate", 2, 1),
        ("cluster", "failover", 1, 2),
    ],
)
async def test_a_follower_of_a_redis_replica_keeps_the_contract(
    request: pytest.FixtureRequest, target: str, profile: str, seed: int, copies: int
) -> None:
    t: Target = request.getfixturevalue(target)
    p = RunParams(seed=seed, profile=profile, ops=REDIS_OPS, follower=True)
    res = await run_round(t, p)
    assert not res.violations, format_round(res)
    assert res.operations == REDIS_OPS
    # Answers were checked (how many depends on how long the faults kept the
    # follower out of sync or behind, which a loaded machine stretches: 24 to
    # 60 of 250 operations have been seen).
    assert res.follower["checked"] >= 10, res.follower
    # Faults that lose the stream made the replica copy the index again, and
    # the follower answered checked Matches from the new copies.
    assert res.follower["copy_made"] >= copies, res.follower


async def test_a_broken_follower_of_a_redis_replica_is_caught(standalone: Target) -> None:
    p = RunParams(
        seed=2,
        profile="core",
        ops=REDIS_OPS,
        follower=True,
        follower_cls=FollowerIgnoresBlockRemovals,
    )
    res = await run_round(standalone, p)
    assert res.violations, f"{res.operations} operations and no violation"
    assert res.violations[0].invariant in {"removed_reported", "wrong_read"}, format_round(res)
    assert "follower" in res.violations[0].detail
