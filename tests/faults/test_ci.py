"""The fault harness on every push: fixed seeds, every backend, every fault kind.

Each case is one round (lab/faults/driver.py) of a profile of
lab/faults/ops.py on 2 replicas over a private ``redis-server``, on 2
replicas over a private 3-master Redis Cluster with one replica per master,
or on one memory-backend replica; it must keep the contract
(indexer/CONSISTENCY.md) and inject the fault kinds its profile names.

Cases that fail on the code as it is are marked ``xfail(strict=True)`` with
the failure they show: once it is fixed the case passes, strict xfail turns
that into a failure, and the mark must go. A failing unmarked case prints its
violation shrunk (at most :data:`SHRINK_BUDGET_S`) with the command that
replays it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from indexer.model import InstanceId, Tier
from lab.faults.driver import RoundResult, RunParams, format_round, run_round, shrink
from lab.faults.ops import (
    ClockJump,
    During,
    Heartbeat,
    Match,
    Op,
    Pause,
    Publish,
    Register,
    SgAction,
    SgApply,
    SgConfigure,
    Store,
    ZBurst,
    ZPublish,
    ZRemove,
    ZRestart,
)

#: Seconds a failing case may spend shrinking its violation for the report.
SHRINK_BUDGET_S = 15.0

#: Fault kinds a profile's round must have injected (else it proved nothing).
FAULTS_OF: dict[str, tuple[str, ...]] = {
    "leases": ("clock_jump",),
    "pause": ("pause",),
    "restart": ("restart_redis",),
    "deadline": ("deadline",),
    "replica": ("restart_replica",),
    "migrate": ("migrate",),
    "failover": ("failover",),
    "zmq": ("zmq_drop", "zmq_truncate", "zmq_publisher_restart", "zmq_late_join"),
    "zmq_stale": ("zmq_truncate", "zmq_late_join"),
}

#: Fault kinds a round with a follower must have injected on its stream.
FOLLOWER_FAULTS = ("follower_cut", "follower_stall")


@dataclass(frozen=True)
class Case:
    """One CI round."""

    target: str
    profile: str
    seed: int
    ops: int
    zmq_catch_up_s: float = 8.0
    #: With a router's follower of the memory replica, its Matches checked too.
    follower: bool = False
    #: Why the case fails on the code as it is ('' : it passes).
    known: str = ""

    @property
    def id(self) -> str:
        return f"{self.target}-{self.profile}" + ("-follower" if self.follower else "")


CASES = [
    Case("standalone", "core", 1, 150),
    Case("standalone", "leases", 1, 150),
    Case("standalone", "bigseq", 1, 120),
    Case("standalone", "pause", 1, 100),
    Case("standalone", "restart", 2, 120),
    Case("standalone", "deadline", 1, 150),
    Case("standalone", "replica", 1, 120),
    Case("standalone", "sglang", 1, 150),
    Case("standalone", "zmq", 1, 80),
    Case("standalone", "zmq_stale", 1, 80),
    Case("standalone", "names", 1, 12),
    Case("cluster", "core", 1, 120),
    Case("cluster", "leases", 1, 100),
    Case("cluster", "bigseq", 1, 80),
    Case("cluster", "pause", 1, 80),
    Case("cluster", "deadline", 1, 120),
    Case("cluster", "replica", 1, 80),
    Case("cluster", "migrate", 1, 80),
    Case("cluster", "failover", 1, 60),
    Case("cluster", "sglang", 1, 80),
    Case("memory", "core", 8, 400),
    Case("memory", "leases", 1, 400),
    Case("memory", "replica", 1, 150),
    Case("memory", "sglang", 1, 150),
    Case("memory", "zmq", 1, 80),
    Case("memory", "zmq_stale", 10, 80),
    Case("memory", "starve", 1, 6),
    Case("memory", "names", 1, 12),
    # The follower through replica restarts, stream cuts and stalls (a couple of s).
    Case("memory", "replica", 3, 300, follower=True),
]


def _param(c: Case) -> object:
    marks = [pytest.mark.xfail(strict=True, reason=c.known)] if c.known else []
    return pytest.param(c, id=c.id, marks=marks)


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
async def test_fleet_keeps_the_contract(case: Case, request: pytest.FixtureRequest) -> None:
    target = request.getfixturevalue(case.target)
    p = RunParams(
        seed=case.seed,
        profile=case.profile,
        ops=case.ops,
        zmq_catch_up_s=case.zmq_catch_up_s,
        follower=case.follower,
    )
    res = await run_round(target, p)
    if res.violations:
        if not case.known:
            res = await shrink(target, res, SHRINK_BUDGET_S)
        pytest.fail(format_round(res), pytrace=False)
    assert res.operations == case.ops
    kinds = FAULTS_OF.get(case.profile, ()) + (FOLLOWER_FAULTS if case.follower else ())
    for kind in kinds:
        assert res.faults[kind] > 0, f"{case.id}: no {kind} injected in {dict(res.faults)}"
    if case.follower:
        assert res.follower["checked"] > 0, f"{case.id}: no follower answer checked"


async def _keeps_contract(
    request: pytest.FixtureRequest, target: str, script: tuple[Op, ...], **params: Any
) -> RoundResult:
    """Run one scripted round on ``target`` (a fixture name); it must keep the contract."""
    p = RunParams(ops=len(script), script=script, **params)
    res = await run_round(request.getfixturevalue(target), p)
    assert not res.violations, format_round(res)
    return res


#: An engine stores, publishes a backlog, loses its instance (an operator
#: removes it: the subscriber rebuilds it from replay from 0), then restarts.
_REBUILD_THEN_RESTART = (
    ZPublish(0, (Store(0, 0, 3),)),
    ZBurst(0, 70),
    ZRemove(0, 0),
    ZRestart(0),
)


@pytest.mark.parametrize("target", ["memory", "standalone"])
async def test_zmq_restart_after_a_rebuild(target: str, request: pytest.FixtureRequest) -> None:
    """The subscriber must see the restarted stream as new (the contract: the instance is
    reset and follows it), whatever it replayed just before."""
    res = await _keeps_contract(
        request, target, _REBUILD_THEN_RESTART, profile="zmq", zmq_catch_up_s=3.0
    )
    assert res.faults["zmq_publisher_restart"] == 1


#: Found by the harness (standalone, profile sglang, seed 1), shrunk: replica 1
#: removes worker s1 (not listed by ConfigureExpectedWorkers) and registers it
#: again without an epoch; replica 0 still holds its epoch e2 in its cache and
#: must refuse the enforce_sequence batch (no snapshot for e2 any more).
_EPOCH_GONE_ELSEWHERE = (
    SgApply(0, "s1", "next", (SgAction("report", Tier.GPU, 0, 0, 2),), "http://s1:9000", "e2"),
    SgConfigure(1, (("s0", "http://s0:9000"), ("s2", "http://s2:9000"))),
    SgApply(1, "s1", "dup", (SgAction("clear", Tier.DISK, 0, 0, 0),), "http://s1:9000", ""),
    SgApply(
        0,
        "s1",
        "next",
        (SgAction("report", Tier.GPU, 0, 1, 3),),
        "http://s1:9000",
        "e2",
        enforce=True,
    ),
)


@pytest.mark.parametrize("target", ["memory", "standalone", "cluster"])
async def test_an_epoch_dropped_by_another_replica_is_not_enforced_from_a_cache(
    target: str, request: pytest.FixtureRequest
) -> None:
    await _keeps_contract(request, target, _EPOCH_GONE_ELSEWHERE, profile="sglang")


#: Found by the harness (Cluster, profile pause, seed 14), shrunk: w1 stores
#: chain 2 through its chain (placed); w0/dp1 stores blocks 1..3 of chain 1,
#: which shares them, by precomputed keys without their parent (unplaced).
#: GetStats must count each shared key once.
_PLACED_AND_UNPLACED = (
    Register(1, InstanceId("w1", 0), "m", "http://w1-0:8000", 20.0, "a"),
    Publish(1, InstanceId("w1", 0), "next", (Store(2, 0, 3),)),
    Register(2, InstanceId("w0", 1), "m", "http://w0-1:8000", 20.0, "a"),
    Publish(1, InstanceId("w0", 1), "next", (Store(1, 1, 4, keys=True),), via="logic"),
)


@pytest.mark.parametrize("target", ["memory", "standalone", "cluster"])
async def test_stats_count_a_key_held_placed_and_unplaced_once(
    target: str, request: pytest.FixtureRequest
) -> None:
    await _keeps_contract(request, target, _PLACED_AND_UNPLACED, profile="core")


#: Found by the harness (Cluster, profile sglang, seed 29), shrunk: replica 1
#: caches worker s1 at :9001 (reading every worker for s2's batch); replica 0
#: moves s1 to :9000; replica 1's next batch for s1 names :9001 again and must
#: move it back, though its cache still agrees with the request.
_ADDRESS_MOVED_ELSEWHERE = (
    SgApply(2, "s1", "next", (SgAction("report", Tier.GPU, 3, 6, 8),), "http://s1:9001", "e2"),
    SgApply(1, "s2", "next", (SgAction("report", Tier.GPU, 1, 2, 5),), "http://s2:9000", "e2"),
    SgApply(0, "s1", "next", (SgAction("report", Tier.DISK, 0, 1, 3),), "http://s1:9000", "e2"),
    SgApply(1, "s1", "next", (SgAction("report", Tier.GPU, 4, 0, 1),), "http://s1:9001", "e2"),
)


@pytest.mark.parametrize("target", ["memory", "standalone", "cluster"])
async def test_an_address_moved_by_another_replica_is_moved_back_by_the_next_request(
    target: str, request: pytest.FixtureRequest
) -> None:
    await _keeps_contract(request, target, _ADDRESS_MOVED_ELSEWHERE, profile="sglang")


#: Found by the harness (Cluster, profile pause, seed 44), shrunk: w0/dp0's
#: lease runs out, replica 2 reads the table (w0/dp0 expired), replica 1
#: revives it with a batch; replica 2's next Match sees the generation move,
#: rereads the table, and must not leave w0/dp0 out by the old exclusions.
_REVIVED_ELSEWHERE = (
    Register(0, InstanceId("w0", 0), "m", "http://w0-0:8000", 60.0, "c"),
    ClockJump(61.0),
    Register(2, InstanceId("w0", 1), "m", "http://w0-1:8000", 20.0, "a", via="logic"),
    Publish(
        1, InstanceId("w0", 0), "gap", (Store(0, 7, 8), Store(1, 0, 1), Store(1, 0, 3, lora="l"))
    ),
    During(Pause(400), Heartbeat(0, InstanceId("w2", 0)), delay_ms=1.0),
)


async def test_a_lease_revived_elsewhere_is_matched_after_the_table_is_reread(
    request: pytest.FixtureRequest,
) -> None:
    # seed 44: the probe Match after each step is drawn from it (replica 2, chain 0).
    await _keeps_contract(
        request, "cluster", _REVIVED_ELSEWHERE, seed=44, profile="pause", replicas=3
    )


#: Found by the harness (Cluster, profile all, seed 32), shrunk: w2 stores the
#: first two blocks of chain 1, then blocks 2..4 by precomputed keys without a
#: parent. A chain without a parent starts a prompt (indexer.proto, BlockStored),
#: so the keys of such blocks are those of a chain of their own: the harness sent
#: chain 1's deeper keys instead, which the Cluster layout places at depth 0 and
#: a Match of chain 1 never finds there, while the other backends did.
_KEYED_ROOT = (
    Register(0, InstanceId("w2", 0), "m", "http://w2-0:8000", 60.0, "a"),
    Publish(0, InstanceId("w2", 0), "next", (Store(1, 0, 2),)),
    Publish(1, InstanceId("w2", 0), "next", (Store(1, 2, 5, keys=True, parent="none"),)),
    Match(1, "m", "", 1, 7),
    Match(0, "m", "", 1, 7, by_keys=True),
)


@pytest.mark.parametrize("target", ["memory", "standalone", "cluster"])
async def test_blocks_stored_by_keys_without_a_parent_start_a_chain(
    target: str, request: pytest.FixtureRequest
) -> None:
    await _keeps_contract(request, target, _KEYED_ROOT, profile="core")
