"""The fault harness's driver: runs a seeded operation sequence on a fleet and checks it.

One *round* (:func:`run_round`) starts a :class:`~lab.faults.fleet.Fleet`
of replicas over a :class:`~lab.faults.faults.Target` with a fresh key
prefix, executes operations one at a time on random replicas, through the
gRPC servicer (real stubs on real ports: ``kvmesh.indexer.v1`` and SGLang's
``kv_indexer.v1``) or the service layer directly (``IndexerLogic``,
``SglangCompat``), feeds ZMQ engines whose subscribers run in replica 0, and
injects faults between calls and while a call is in flight
(:class:`~lab.faults.ops.During`).

Every answer is checked against :class:`~lab.faults.model.FleetModel` by the
named invariants of :mod:`lab.faults.invariants` (the contract is
``indexer/CONSISTENCY.md``): after each operation its own answer, then a
probe Match on a random replica, and every :data:`FULL_CHECK_EVERY`
operations (and at the end, past every lag bound) ListInstances, DumpIndex
and GetStats and the ZMQ engines' caches. A round stops at its first
violation: past it the model and the fleet disagree, so later answers would
only repeat it.

A call that fails during a fault (or with a deadline of its own) is retried,
the same request, until it is acknowledged: an unacknowledged batch may or
may not have been applied, and the retry's DUPLICATE or APPLIED settles it.
After a fault that loses data (Redis restarted empty, a memory replica
restarted) the call is retried even when it succeeded, since its effect may
have been lost. A call that keeps failing :data:`RECOVERY_S` after the fault
ended is ``not_recovered``.

:func:`shrink` deletes operations from a failing round while the same
invariant still fails (bounded in time), and :func:`replay_line` prints the
minimal sequence as the seed plus the indices of the operations kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import random
import time
import tracemalloc
import uuid
import zlib
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import grpc.aio
import zmq.asyncio

from indexer.convert import STATUS_CODE_NUMBERS
from indexer.model import (
    AllBlocksCleared,
    ApplyResult,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    Event,
    EventBatch,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    MatchQuery,
    Namespace,
    Tier,
)
from indexer.sglang.compat import Action, ActionKind, ApplyRequest
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2 as spb
from kvmesh.blockkeys import block_keys, to_signed
from kvmesh.errors import FailedPrecondition, KvmeshError, NotFound
from lab.faults.engines import ZmqEngine
from lab.faults.faults import Target
from lab.faults.fleet import (
    FOLLOWER_LAG_S,
    Fleet,
    FollowerLink,
    HarnessFollower,
    IndexWrapper,
    LeaseClock,
    Replica,
)
from lab.faults.invariants import Violation
from lab.faults.model import FleetModel, Identity, same_incarnation
from lab.faults.ops import (
    BLOCK_SIZE,
    CHAIN_BLOCKS,
    CHAINS,
    HUGE_SEQ,
    MODELS,
    PROFILES,
    SG_MODEL,
    SG_TTL_S,
    SG_WORKERS,
    ZMQ_ENGINES,
    ZMQ_MODEL,
    Clear,
    ClockJump,
    DumpIndex,
    During,
    EventSpec,
    Failover,
    FaultOp,
    GetStats,
    Heartbeat,
    InventNames,
    ListInstances,
    Match,
    Migrate,
    Op,
    Pause,
    Publish,
    Reap,
    Register,
    Remove,
    RestartRedis,
    RestartReplica,
    SeqMode,
    Settle,
    SgAction,
    SgApply,
    SgConfigure,
    SgMatch,
    SgSnapshot,
    Store,
    Via,
    ZBurst,
    ZLateJoin,
    ZPublish,
    ZRemove,
    ZRestart,
    ZTruncate,
    chain_tokens,
    content_keys,
    describe,
    ehash,
    generate,
    profile_ops,
)
from lab.faults.stalls import STALL_S, StallWatch
from router_client.indexer_client import instance_name

log = logging.getLogger(__name__)

# -- tuning ----------------------------------------------------------------------------

#: Per-call deadline when an operation names none: far above any healthy call
#: (a few ms), so that only a hang reaches it.
CALL_TIMEOUT_S = 5.0

#: After a fault ended, how long a replica may still fail valid calls with
#: UNAVAILABLE: a socket timeout (0.25 s), a cluster topology reload and a
#: channel's reconnect backoff each fit many times over.
RECOVERY_S = 5.0
#: How much longer a follower that missed RECOVERY_S is waited for, only to say
#: in the violation whether it was late or stuck.
LATE_SYNC_S = 10.0

#: Slack added to every lag bound: the event loop of a loaded 2-core machine
#: can delay a call by this much between its timestamp and its work.
LAG_MARGIN_S = 0.025

#: Real time a paused Redis is given after its pause ends to run what queued.
PAUSE_DRAIN_S = 0.05

#: How long a ZMQ subscriber may take to catch up with its engine (replay
#: timeouts of 0.5 s and backoffs of up to 1 s included), and after a burst.
ZMQ_CATCH_UP_S = 8.0
ZMQ_BURST_CATCH_UP_S = 60.0

#: A ZMQ stream is padded to this many batches before its publisher restarts,
#: so that the new stream (which counts from 0) is seen going back, not as a gap.
ZMQ_RESTART_PAD = 64

#: The ingest time of a burst above which a Match answered only after the
#: whole burst means the replica served nothing meanwhile: 3,000 batches take
#: about 0.1 s on the memory backend, while a replica that gives way serves a
#: Match within a few ms of its arrival.
STARVE_MIN_S = 0.05

#: Bytes a replica may keep per name a client invented (a few pointers of
#: slack; a cache entry for a name costs 100-400 bytes).
NAME_BYTES_BOUND = 64

#: Longest a step (an operation, its probe, a full check) may take before it
#: counts as hung: every call has a deadline of its own (CALL_TIMEOUT_S) and
#: retries stop after RECOVERY_S, a ZMQ burst may take a minute to ingest, so
#: only a hang comes near it.
STEP_TIMEOUT_S = 120.0

#: Longest the fleet of a round may take to stop.
CLOSE_TIMEOUT_S = 30.0

#: Chance, per operation, that a round with a follower cuts its stream, and that
#: it stalls it (for FOLLOWER_STALL_STEPS operations).
FOLLOWER_CUT_P = 0.015
FOLLOWER_STALL_P = 0.03
FOLLOWER_STALL_STEPS = (15, 40)

#: Operations between two full checks (ListInstances, DumpIndex, GetStats, ZMQ).
FULL_CHECK_EVERY = 25

TRANSIENT = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED"})

# What each write sets (lab/faults/model.py, ATTRIBUTES).
_LIFE = frozenset({"life"})
_ADDRESS = frozenset({"address"})
_STALE = frozenset({"stale"})

_CODE_NAMES = {v: k for k, v in STATUS_CODE_NUMBERS.items()}
_OUTCOMES = {
    pb.BATCH_OUTCOME_APPLIED: BatchOutcome.APPLIED,
    pb.BATCH_OUTCOME_DUPLICATE: BatchOutcome.DUPLICATE,
    pb.BATCH_OUTCOME_APPLIED_AFTER_GAP: BatchOutcome.APPLIED_AFTER_GAP,
}
_SG_TIERS = {Tier.GPU: spb.TIER_HBM, Tier.CPU: spb.TIER_DRAM, Tier.DISK: spb.TIER_SSD}
_SG_KINDS = {
    "report": spb.ACTION_REPORT,
    "revoke": spb.ACTION_REVOKE,
    "clear": spb.ACTION_CLEAR_ALL_AT_TIER,
}


@dataclass(frozen=True)
class _Views:
    """The identities a replica may answer an instance with, per attribute."""

    life: list[Identity]
    stale: list[Identity]
    address: list[Identity]
    now: float

    @property
    def addresses(self) -> set[str]:
        """Addresses it may be answered with."""
        return {a.address for a in self.address if a.registered}

    @property
    def stale_flags(self) -> set[bool]:
        """Stale flags it may be answered with."""
        return {a.stale for a in self.stale if a.registered}

    def may_show(self, include_stale: bool) -> bool:
        """Some admissible view has it registered, live and (unless stale is asked for) fresh."""
        alive = any(a.registered and a.exp > self.now for a in self.life)
        return alive and (include_stale or False in self.stale_flags)

    def must_show(self, include_stale: bool) -> bool:
        """Every admissible view has it registered, live and (unless asked for) fresh."""
        alive = all(a.registered and a.exp > self.now for a in self.life)
        fresh = include_stale or all(a.registered and not a.stale for a in self.stale)
        return alive and fresh

    def describe(self, now: float) -> str:
        """The admissible views, for a violation's message."""

        def one(a: Identity) -> str:
            if not a.registered:
                return "unregistered"
            life = "live" if a.exp > now else f"expired {now - a.exp:g}s ago"
            return f"{a.address} {life}{' stale' if a.stale else ''}"

        return (
            f"life {[one(a) for a in self.life]}, stale flags {sorted(self.stale_flags)}, "
            f"addresses {sorted(self.addresses)}"
        )


class _Stop(Exception):
    """The round ends (first violation, or a fleet that does not recover)."""


@dataclass
class Reply:
    """A call's final answer: value or status code, and when it was sent and acknowledged."""

    value: Any
    code: str
    detail: str
    sent: float
    acked: float
    retried: bool


@dataclass
class _Fault:
    kind: str
    lossy: bool
    over: asyncio.Event


@dataclass
class RunParams:
    """What a round runs."""

    seed: int = 0
    profile: str = "all"
    replicas: int = 2
    #: Operations of the generated sequence to run (and a wall-clock cap, if > 0).
    ops: int = 200
    duration_s: float = 0.0
    #: Indices of the generated sequence to keep (None: all of the first ``ops``).
    keep: tuple[int, ...] | None = None
    wrap: IndexWrapper | None = None
    #: An explicit operation sequence instead of the generated one (regression
    #: tests of a known sequence); ``keep`` then indexes it.
    script: tuple[Op, ...] | None = None
    #: How long a ZMQ subscriber may take to catch up (``zmq_stuck`` beyond).
    zmq_catch_up_s: float = ZMQ_CATCH_UP_S
    #: Follow the memory replica (or Redis replica 0's copy of the index)
    #: with a router's follower and check its Matches (lab/faults/fleet.py);
    #: ``follower_cls`` (tests: a broken one) is its class.
    follower: bool = False
    follower_cls: type[HarnessFollower] = HarnessFollower


@dataclass
class RoundResult:
    """What a round did and found."""

    target: str
    params: RunParams
    operations: int = 0
    faults: Counter[str] = field(default_factory=Counter)
    violations: list[Violation] = field(default_factory=list)
    #: (index in the generated sequence, operation) of every operation run.
    ran: list[tuple[int, Op]] = field(default_factory=list)
    elapsed_s: float = 0.0
    #: The follower's Matches: checked (caught up, against the model), fallback
    #: (None: out of sync), behind (answered while its stream was stalled), and
    #: its snapshots, resyncs and reconnects.
    follower: Counter[str] = field(default_factory=Counter)


# -- wire helpers ----------------------------------------------------------------------


def event_to_pb(ev: Event) -> pb.Event:
    """A domain event as its kvmesh.indexer.v1 message."""
    if isinstance(ev, BlockStored):
        s = pb.BlockStored(
            block_hashes=list(ev.block_hashes),
            token_ids=list(ev.token_ids),
            block_size=ev.block_size,
            lora_name=ev.lora_name,
            tier=cast(pb.Tier, ev.tier.value),
            block_keys=list(ev.block_keys or ()),
        )
        if ev.parent_block_hash is not None:
            s.parent_block_hash = ev.parent_block_hash
        return pb.Event(stored=s)
    if isinstance(ev, BlockRemoved):
        tier = pb.TIER_UNSPECIFIED if ev.tier is None else cast(pb.Tier, ev.tier.value)
        return pb.Event(removed=pb.BlockRemoved(block_hashes=list(ev.block_hashes), tier=tier))
    return pb.Event(cleared=pb.AllBlocksCleared())


def batch_to_pb(b: EventBatch) -> pb.EventBatch:
    """A domain batch as its message."""
    return pb.EventBatch(
        instance=pb.InstanceRef(worker_id=b.instance.worker_id, dp_rank=b.instance.dp_rank),
        sequence=b.sequence,
        events=[event_to_pb(e) for e in b.events],
    )


def _match_from_pb(m: pb.InstanceMatch) -> InstanceMatch:
    return InstanceMatch(
        InstanceId(m.instance.worker_id, m.instance.dp_rank),
        m.address,
        m.depth,
        m.gpu_blocks,
        m.cpu_blocks,
        m.disk_blocks,
        m.stale,
    )


@dataclass(frozen=True)
class _Listed:
    iid: InstanceId
    model: str
    address: str
    incarnation: str
    ttl: float
    exp: float
    live: bool
    stale: bool
    seq: int | None
    blocks: int


def _listed_from_pb(i: pb.InstanceInfo) -> _Listed:
    return _Listed(
        InstanceId(i.instance.worker_id, i.instance.dp_rank),
        i.model,
        i.address,
        i.incarnation,
        i.lease_ttl_seconds,
        i.lease_expires_at,
        i.live,
        i.stale,
        i.applied_sequence if i.has_applied_sequence else None,
        i.blocks,
    )


def _listed_from_state(s: InstanceState) -> _Listed:
    sp = s.spec
    return _Listed(
        sp.instance,
        sp.model,
        sp.address,
        sp.incarnation,
        sp.lease_ttl_s,
        s.lease_expires_at,
        s.live,
        s.stale,
        s.applied_sequence,
        s.blocks,
    )


def sg_events(actions: Sequence[SgAction]) -> tuple[Event, ...]:
    """SGLang actions as the index events the API maps them to (consecutive clears merge)."""
    out: list[Event] = []
    for a in actions:
        if a.kind == "clear":
            if not out or not isinstance(out[-1], AllBlocksCleared):
                out.append(AllBlocksCleared())
            continue
        hashes = tuple(ehash("s", a.chain, j) for j in range(a.lo, min(a.hi, CHAIN_BLOCKS + 2)))
        if a.kind == "report":
            out.append(BlockStored(block_hashes=hashes, tier=a.tier, block_keys=hashes))
        else:
            out.append(BlockRemoved(block_hashes=hashes, tier=a.tier))
    return tuple(out)


# -- the driver ----------------------------------------------------------------------------


class Driver:
    """Executes operations on a fleet and checks every answer (see the module docstring)."""

    def __init__(
        self,
        fleet: Fleet,
        seed: int,
        *,
        engines: Sequence[ZmqEngine] = (),
        zmq_catch_up_s: float = ZMQ_CATCH_UP_S,
    ) -> None:
        self.fleet = fleet
        self.target = fleet.target
        self.clock: LeaseClock = fleet.clock
        self.model = FleetModel(SG_MODEL, SG_TTL_S)
        self.engines = list(engines)
        for e in self.engines:
            self.model.zmq[e.instance] = e.truth
        self.seed = seed
        self.zmq_catch_up_s = zmq_catch_up_s
        self.lag = fleet.cache_ttl_s + LAG_MARGIN_S
        self.faults: Counter[str] = Counter()
        self.violations: list[Violation] = []
        self.step = 0
        self.op: Op | None = None
        self.fault: _Fault | None = None
        self.fault_end = -math.inf
        self.purge_pending = False
        self._names = 0
        self.follower: FollowerLink | None = None
        self.follower_figures: Counter[str] = Counter()
        #: The machine's stalls of this process (lab/faults/stalls.py); run_round starts it.
        self.stalls = StallWatch()

    # -- plumbing --------------------------------------------------------------------

    @property
    def n(self) -> int:
        """Number of replicas."""
        return len(self.fleet.replicas)

    def rep(self, i: int) -> Replica:
        """Replica ``i`` (modulo the fleet size)."""
        return self.fleet.replicas[i % self.n]

    def violate(self, invariant: str, detail: str) -> None:
        """Record a violation and end the round."""
        assert self.op is not None
        self.violations.append(Violation(invariant, self.step, self.op, detail))
        raise _Stop(invariant)

    def _recovering(self) -> bool:
        return time.monotonic() - self.fault_end < RECOVERY_S

    async def _attempt(
        self,
        r: Replica,
        via: Via,
        grpc_fn: Callable[[Any, Any, float], Awaitable[Any]],
        logic_fn: Callable[[Replica], Awaitable[Any]],
        deadline_ms: float,
    ) -> tuple[Any, str, str]:
        timeout = deadline_ms / 1000 if deadline_ms else CALL_TIMEOUT_S
        try:
            if not r.running:
                return None, "UNAVAILABLE", "replica is down"
            if via == "grpc":
                return await grpc_fn(r.stub, r.sg_stub, timeout), "OK", ""
            return await asyncio.wait_for(logic_fn(r), timeout), "OK", ""
        except grpc.aio.AioRpcError as e:
            return None, e.code().name, e.details() or ""
        except KvmeshError as e:
            return None, e.code, str(e)
        except TimeoutError:
            return None, "DEADLINE_EXCEEDED", f"no answer within {timeout:g} s"
        except asyncio.CancelledError:
            me = asyncio.current_task()
            if me is not None and me.cancelling():
                raise
            return None, "CANCELLED", "cancelled inside the service"
        except Exception as e:  # a service error that is not a KvmeshError: INTERNAL to a client
            return None, "INTERNAL", f"{type(e).__name__}: {e}"

    async def call(
        self,
        replica: int,
        via: Via,
        grpc_fn: Callable[[Any, Any, float], Awaitable[Any]],
        logic_fn: Callable[[Replica], Awaitable[Any]],
        deadline_ms: float = 0.0,
    ) -> Reply:
        """One call, retried until acknowledged when a fault (or a deadline) explains a failure."""
        sent = time.monotonic()
        if deadline_ms:
            self.faults["deadline"] += 1
        v, code, detail = await self._attempt(
            self.rep(replica), via, grpc_fn, logic_fn, deadline_ms
        )
        fault = self.fault
        if fault is not None:
            await fault.over.wait()
        lossy = fault is not None and fault.lossy
        if code != "OK" and code not in TRANSIENT and not lossy:
            return Reply(v, code, detail, sent, time.monotonic(), False)
        if code == "OK" and not lossy:
            return Reply(v, code, detail, sent, time.monotonic(), False)
        if code in TRANSIENT and not (deadline_ms or fault is not None or self._recovering()):
            if self.stalls.during(sent, time.monotonic()) >= STALL_S:
                # The machine held this process past a socket timeout: not the fleet's doing.
                self.faults["machine_stall"] += 1
            else:
                self.violate("valid_rejected", f"{code} with no fault to explain it: {detail}")
        self.purge_pending = True
        start = time.monotonic()
        while True:
            v, code, detail = await self._attempt(self.rep(replica), via, grpc_fn, logic_fn, 0)
            if code not in TRANSIENT:
                return Reply(v, code, detail, sent, time.monotonic(), True)
            if time.monotonic() - max(start, self.fault_end) > RECOVERY_S:
                self.violate(
                    "not_recovered", f"still {code} {RECOVERY_S:g} s after the fault: {detail}"
                )
            await asyncio.sleep(0.02)

    def expect_ok(self, reply: Reply) -> None:
        """A call the contract accepts must be acknowledged."""
        if reply.code != "OK":
            self.violate("valid_rejected", f"{reply.code}: {reply.detail}")

    # -- running -------------------------------------------------------------------

    async def execute(self, op: Op) -> None:
        """Run one operation and check its answer."""
        if isinstance(op, Register):
            await self._register(op)
        elif isinstance(op, Heartbeat):
            await self._heartbeat(op)
        elif isinstance(op, Remove):
            await self._remove(op)
        elif isinstance(op, Reap):
            await self._reap(op)
        elif isinstance(op, Publish):
            await self._publish(op)
        elif isinstance(op, Match):
            await self._match(op)
        elif isinstance(op, ListInstances):
            await self._list(op.replica, op.via, op.model)
        elif isinstance(op, GetStats):
            await self._stats(op.replica, op.via)
        elif isinstance(op, DumpIndex):
            await self._dump(op.replica, op.via)
        elif isinstance(op, SgApply):
            await self._sg_apply(op)
        elif isinstance(op, SgSnapshot):
            await self._sg_snapshot(op)
        elif isinstance(op, SgConfigure):
            await self._sg_configure(op)
        elif isinstance(op, SgMatch):
            await self._sg_match(op)
        elif isinstance(op, ZPublish):
            await self._z_publish(op)
        elif isinstance(op, ZTruncate):
            self.faults["zmq_truncate"] += 1
            self.engines[op.engine % len(self.engines)].truncate(op.keep)
        elif isinstance(op, ZRestart):
            await self._z_restart(op)
        elif isinstance(op, ZLateJoin):
            await self._z_late_join(op)
        elif isinstance(op, ZRemove):
            await self._z_remove(op)
        elif isinstance(op, ZBurst):
            await self._z_burst(op)
        elif isinstance(op, ClockJump):
            self.faults["clock_jump"] += 1
            self.clock.advance(op.seconds)
        elif isinstance(op, Settle):
            await asyncio.sleep(self.lag + 2 * LAG_MARGIN_S)
        elif isinstance(op, InventNames):
            await self._invent_names(op)
        elif isinstance(op, During):
            await self._during(op)
        else:
            await self.inject(op)
            self.fault_end = time.monotonic()

    async def step_with_watchdog(self, op: Op, full: bool) -> None:
        """One operation, its probe and (``full``) a full check, within :data:`STEP_TIMEOUT_S`.

        Every call has its own deadline, so only a hang reaches this one: it is
        reported (``not_recovered``) with where each task of the loop waits.
        """

        async def step() -> None:
            await self.execute(op)
            await self.probe(op)
            if self.follower is not None:
                self.follower_fault()
                await self.follower_probe(op)
            if full:
                await self.full_check()

        task = asyncio.create_task(step())
        done, _ = await asyncio.wait({task}, timeout=STEP_TIMEOUT_S)
        if task in done:
            task.result()  # re-raises _Stop
            return
        stacks = [f"{t.get_name()}: {_awaiting(t)}" for t in asyncio.all_tasks()]
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait({task}, timeout=5.0)
        self.violate(
            "not_recovered",
            f"the operation did not finish within {STEP_TIMEOUT_S:g} s; waiting: "
            + "; ".join(x for x in sorted(stacks) if "server.pyx" not in x)[:2000],
        )

    async def inject(self, f: FaultOp) -> None:
        """Inject one fault (and book what it loses in the model)."""
        if isinstance(f, Pause):
            self.faults["pause"] += 1
            await self.target.pause(f.ms, f.node)
            await asyncio.sleep(f.ms / 1000 + PAUSE_DRAIN_S)
        elif isinstance(f, RestartRedis):
            self.faults["restart_redis"] += 1
            t = time.monotonic()
            await self.target.restart_empty()
            self._lose_everything(t)
            self.purge_pending = False
        elif isinstance(f, Migrate):
            self.faults["migrate"] += 1
            await self.target.migrate(self.fleet.prefix, f.what, f.to, f.split)
        elif isinstance(f, Failover):
            self.faults["failover"] += 1
            await self.target.failover(f.master)
        elif isinstance(f, RestartReplica):
            self.faults["restart_replica"] += 1
            i = f.replica % self.n
            t = time.monotonic()
            await self.fleet.restart(i)
            if self.target.kind == "memory":
                self._lose_everything(t)
            if i == 0:
                for j in range(len(self.engines)):
                    await self.wait_converged(j)

    def _lose_everything(self, when: float) -> None:
        """Redis restarted empty, or the memory replica restarted: the index holds nothing;
        ZMQ subscribers rebuild their instances from replay at their next batch."""
        self.model.lose_everything(when)
        for e in self.engines:
            e.truth.index_lost()

    async def _during(self, d: During) -> None:
        lossy = isinstance(d.fault, RestartRedis) or (
            isinstance(d.fault, RestartReplica) and self.target.kind == "memory"
        )
        self.fault = _Fault(type(d.fault).__name__, lossy, asyncio.Event())
        task = asyncio.create_task(self.execute(d.op))
        try:
            await asyncio.sleep(d.delay_ms / 1000)
            try:
                await self.inject(d.fault)
            finally:
                self.fault_end = time.monotonic()
                self.fault.over.set()
            await task
        finally:
            self.fault = None
            if not task.done():
                task.cancel()

    # -- kvmesh instances --------------------------------------------------------

    async def _register(self, op: Register) -> None:
        spec = InstanceSpec(op.inst, op.model, op.address, op.ttl, op.incarnation)
        req = pb.RegisterInstanceRequest(
            instance=pb.InstanceRef(worker_id=op.inst.worker_id, dp_rank=op.inst.dp_rank),
            model=op.model,
            address=op.address,
            lease_ttl_seconds=op.ttl,
            incarnation=op.incarnation,
        )

        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            return await stub.RegisterInstance(req, timeout=t)

        async def via_logic(r: Replica) -> Any:
            return await r.logic.register(spec)

        reply = await self.call(op.replica, op.via, via_grpc, via_logic, op.deadline_ms)
        now = self.clock()
        want, reset = self.model.index.register(spec, now)
        wrote = _LIFE | _ADDRESS | (_STALE if reset else frozenset())
        self.model.note([op.inst], reply.sent, reply.acked, op.replica % self.n, wrote)
        self.expect_ok(reply)
        if op.via == "grpc":
            got, got_reset = _listed_from_pb(reply.value.info), reply.value.reset
        else:
            got, got_reset = _listed_from_state(reply.value[0]), reply.value[1]
        if not reply.retried and got_reset != reset:
            self.violate("wrong_ack", f"register answered reset={got_reset}, contract: {reset}")
        self._compare_state(got, want, "register", exact_lease=True)

    def _compare_state(
        self, got: _Listed, want: InstanceState, what: str, *, exact_lease: bool
    ) -> None:
        sp = want.spec
        if got.address != sp.address:
            self.violate("stale_identity", f"{what}: address {got.address!r}, not {sp.address!r}")
        problems = []
        if got.model != sp.model:
            problems.append(f"model {got.model!r} != {sp.model!r}")
        if not same_incarnation(sp.incarnation, got.incarnation):
            problems.append(f"incarnation {got.incarnation!r} != {sp.incarnation!r}")
        if abs(got.ttl - sp.lease_ttl_s) > 1e-6:
            problems.append(f"ttl {got.ttl} != {sp.lease_ttl_s}")
        if exact_lease and abs(got.exp - want.lease_expires_at) > 1e-6:
            problems.append(f"lease expires at {got.exp!r}, not {want.lease_expires_at!r}")
        if got.live != want.live:
            problems.append(f"live {got.live} != {want.live}")
        if got.stale != want.stale:
            problems.append(f"stale {got.stale} != {want.stale}")
        if got.blocks != want.blocks:
            problems.append(f"blocks {got.blocks} != {want.blocks}")
        if got.seq != want.applied_sequence:
            if want.applied_sequence is not None and (
                got.seq is None or got.seq < want.applied_sequence
            ):
                self.violate(
                    "ack_lost",
                    f"{what}: {got.iid} applied sequence {got.seq}, acknowledged "
                    f"{want.applied_sequence}",
                )
            problems.append(f"applied sequence {got.seq} != {want.applied_sequence}")
        if problems:
            self.violate(
                "wrong_ack" if what != "list" else "wrong_read",
                f"{what} {got.iid}: " + "; ".join(problems),
            )

    async def _heartbeat(self, op: Heartbeat) -> None:
        ref = pb.InstanceRef(worker_id=op.inst.worker_id, dp_rank=op.inst.dp_rank)

        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            return await stub.Heartbeat(pb.HeartbeatRequest(instance=ref), timeout=t)

        async def via_logic(r: Replica) -> Any:
            return await r.logic.heartbeat(op.inst)

        reply = await self.call(op.replica, op.via, via_grpc, via_logic, op.deadline_ms)
        now = self.clock()
        try:
            want = self.model.index.heartbeat(op.inst, now)
        except NotFound:
            self.model.note([op.inst], reply.sent, reply.acked, op.replica % self.n, _LIFE)
            if reply.code == "OK":
                self.violate("ghost_instance", f"heartbeat of {op.inst}, not registered, accepted")
            if reply.code != "NOT_FOUND":
                self.violate("wrong_ack", f"heartbeat of an unknown instance: {reply.code}")
            return
        self.model.note([op.inst], reply.sent, reply.acked, op.replica % self.n, _LIFE)
        self.expect_ok(reply)
        # HeartbeatResponse and InstanceState both carry these two fields.
        exp, stale = reply.value.lease_expires_at, reply.value.stale
        if abs(exp - want.lease_expires_at) > 1e-6 or stale != want.stale:
            self.violate(
                "wrong_ack",
                f"heartbeat: expires {exp!r} stale {stale}, contract {want.lease_expires_at!r} "
                f"{want.stale}",
            )

    async def _remove(self, op: Remove) -> None:
        ref = pb.InstanceRef(worker_id=op.inst.worker_id, dp_rank=op.inst.dp_rank)

        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            resp = await stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref), timeout=t)
            return resp.blocks_removed

        async def via_logic(r: Replica) -> Any:
            return await r.logic.remove_instance(op.inst)

        reply = await self.call(op.replica, op.via, via_grpc, via_logic, op.deadline_ms)
        try:
            want = self.model.index.remove(op.inst)
        except NotFound:
            want = -1
        self.model.note([op.inst], reply.sent, reply.acked, op.replica % self.n, _LIFE)
        if want < 0:
            if reply.code != "NOT_FOUND":
                self.violate("wrong_ack", f"remove of an unknown instance: {reply.code}")
            return
        if reply.retried and reply.code == "NOT_FOUND":
            return  # the cut first attempt removed it
        self.expect_ok(reply)
        if not reply.retried and int(reply.value) != want:
            self.violate("wrong_ack", f"remove dropped {reply.value} entries, contract {want}")

    async def _reap(self, op: Reap) -> None:
        r = self.rep(op.replica)
        sent = time.monotonic()
        got: set[InstanceId] = set()
        start = time.monotonic()
        while True:
            before = r.logic.counters.reap_errors
            got.update(await r.logic.reap_once())
            if r.logic.counters.reap_errors == before:
                break
            if not self._recovering():
                self.violate("valid_rejected", "the reaper failed with no fault to explain it")
            if time.monotonic() - start > RECOVERY_S:
                self.violate("not_recovered", "the reaper kept failing after the fault")
            await asyncio.sleep(0.02)
        self.purge_pending = False
        want = self.model.index.reap(self.clock())
        self.model.note(want, sent, time.monotonic(), op.replica % self.n, _LIFE)
        for e in self.engines:
            if e.instance in got:
                e.truth.index_lost()
                got.discard(e.instance)
        if got != set(want):
            self.violate(
                "wrong_ack",
                f"reaped {sorted(map(str, got))}, contract {sorted(map(str, want))}",
            )

    # -- batches -----------------------------------------------------------------

    def kv_event(self, spec: EventSpec, model: str) -> Event:
        """The domain event a spec names for an instance of ``model``."""
        if isinstance(spec, Clear):
            return AllBlocksCleared()
        if not isinstance(spec, Store):
            return BlockRemoved(
                tuple(ehash("g", spec.chain, j, spec.lora) for j in spec.blocks), spec.tier
            )
        hi = min(spec.hi, CHAIN_BLOCKS)
        c, lo, lora = spec.chain, spec.lo, spec.lora
        # Blocks that start a prompt mid-chain are another prompt's blocks: an
        # engine's hash covers the whole prefix, so theirs differ from the
        # chain's (one engine hash never names blocks at two chain positions).
        family = f"p{lo}" if lo and spec.parent == "none" else "g"
        hashes = tuple(ehash(family, c, j, lora) for j in range(lo, hi))
        parent: int | None = None
        if spec.parent == "chain" and lo > 0:
            parent = ehash("g", c, lo - 1, lora)
        elif spec.parent == "unknown":
            parent = ehash("u", c, lo, lora)
        tokens = tuple(chain_tokens(c, hi)[lo * BLOCK_SIZE :])
        if spec.keys:
            # Without a parent the blocks start a prompt (BlockStored): their keys are
            # those of a chain of their own, as when the indexer computes them.
            keys = (
                block_keys(tokens, BLOCK_SIZE, model, lora)
                if lo and spec.parent == "none"
                else content_keys(c, hi, model, lora)[lo:hi]
            )
            return BlockStored(hashes, parent, (), 0, lora, spec.tier, tuple(keys))
        return BlockStored(hashes, parent, tokens, BLOCK_SIZE, lora, spec.tier)

    def seq_for(self, iid: InstanceId, mode: SeqMode) -> int:
        """The sequence a mode names for ``iid`` now."""
        i = self.model.index.inst.get(iid)
        last = -1 if i is None or i.seq is None else i.seq
        if mode == "dup":
            return max(last, 0)
        if mode == "gap":
            return last + 3
        if mode == "huge":
            return max(last + 2, HUGE_SEQ + 1)
        if mode == "zero":
            return 0
        return last + 1

    async def _publish(self, op: Publish) -> None:
        i = self.model.index.inst.get(op.inst)
        model = i.spec.model if i is not None else MODELS[0]
        batch = EventBatch(
            op.inst,
            self.seq_for(op.inst, op.seq),
            tuple(self.kv_event(e, model) for e in op.events),
        )
        msg = batch_to_pb(batch)

        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            if not op.stream:
                return (await stub.PublishEvents(pb.PublishEventsRequest(batch=msg), timeout=t)).ack
            call = stub.PublishEventsStream(timeout=t)
            try:
                # The call's own deadline does not wake a write still waiting for the
                # stream to open (a server stopping meanwhile): bound it here too.
                async with asyncio.timeout(t):
                    await call.write(pb.PublishEventsStreamRequest(batch=msg))
                    resp = await call.read()
                    await call.done_writing()
            finally:
                call.cancel()
            ack = resp.ack
            if ack.outcome == pb.BATCH_OUTCOME_REJECTED:
                raise _code_error(_CODE_NAMES.get(ack.error.code, "INTERNAL"), ack.error.message)
            return ack

        async def via_logic(r: Replica) -> Any:
            return await r.logic.publish(batch)

        reply = await self.call(op.replica, op.via, via_grpc, via_logic, op.deadline_ms)
        now = self.clock()
        try:
            want: ApplyResult | None = self.model.index.apply(batch, now)
        except FailedPrecondition:
            want = None
        self.model.note([op.inst], reply.sent, reply.acked, op.replica % self.n, _LIFE | _STALE)
        if want is None:
            if reply.code == "OK":
                self.violate("ghost_instance", f"a batch of {op.inst}, not registered, was applied")
            if reply.code != "FAILED_PRECONDITION":
                self.violate("wrong_ack", f"batch of an unregistered instance: {reply.code}")
            return
        self.expect_ok(reply)
        v = reply.value
        got = (
            ApplyResult(
                _OUTCOMES.get(v.outcome, BatchOutcome.DUPLICATE),
                v.applied_sequence,
                v.blocks_stored,
                v.blocks_removed,
                v.blocks_orphaned,
                v.stale,
            )
            if op.via == "grpc"
            else v
        )
        if reply.retried and got.outcome is BatchOutcome.DUPLICATE:
            if got.applied_sequence < batch.sequence:
                self.violate(
                    "ack_lost",
                    f"retried batch {batch.sequence} acknowledged as a duplicate of "
                    f"{got.applied_sequence}",
                )
            return
        if got != want:
            inv = "wrong_ack"
            if got.outcome is BatchOutcome.DUPLICATE and want.outcome is not BatchOutcome.DUPLICATE:
                inv = "valid_rejected"
            self.violate(inv, f"batch {batch.sequence} of {op.inst}: ack {got}, contract {want}")

    # -- Match -------------------------------------------------------------------

    def match_keys(
        self, model: str, lora: str, chain: int, blocks: int, by_keys: bool
    ) -> list[int]:
        """The block keys a Match of this kind looks up."""
        if model == ZMQ_MODEL and by_keys:
            return [ehash("z", chain, j) for j in range(blocks)]
        if model == SG_MODEL:
            return [ehash("s", chain, j) for j in range(blocks)]
        return content_keys(chain, blocks, model, lora)

    async def _match(self, op: Match) -> None:
        ns = Namespace(op.model, op.lora)
        keys = self.match_keys(op.model, op.lora, op.chain, op.blocks, op.by_keys)
        tokens = [] if op.by_keys else chain_tokens(op.chain, op.blocks)
        req = pb.MatchRequest(
            model=op.model,
            lora_name=op.lora,
            token_ids=tokens,
            block_keys=keys if op.by_keys else [],
            include_stale=op.include_stale,
            max_instances=op.max_instances,
        )
        query = MatchQuery(
            ns,
            token_ids=tokens,
            block_keys=keys if op.by_keys else (),
            include_stale=op.include_stale,
            max_instances=op.max_instances,
        )

        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            resp = await stub.Match(req, timeout=t)
            return [_match_from_pb(m) for m in resp.matches], resp.total_blocks

        async def via_logic(r: Replica) -> Any:
            res = await r.logic.match(query)
            return list(res.matches), res.total_blocks

        reply = await self.call(op.replica, op.via, via_grpc, via_logic, op.deadline_ms)
        self.expect_ok(reply)
        matches, total = reply.value
        if total != len(keys):
            self.violate("wrong_read", f"Match looked at {total} blocks of {len(keys)}")
        await self.check_match(
            op.replica % self.n, ns, keys, op.include_stale, op.max_instances, matches, reply
        )

    async def check_match(
        self,
        r: int,
        ns: Namespace,
        keys: Sequence[int],
        include_stale: bool,
        max_instances: int,
        got: Sequence[InstanceMatch],
        reply: Reply,
        who: str = "",
    ) -> None:
        """Check one Match answer of replica ``r`` (or of ``who``, answering as it
        would) against the model (see CONSISTENCY.md)."""
        now = self.clock()
        who = who or f"replica {r}"
        seen = Counter(m.instance for m in got)
        twice = [str(i) for i, c in seen.items() if c > 1]
        if twice:
            self.violate("listed_twice", f"Match named {twice} twice: {list(got)}")
        order = [(-m.depth, m.instance) for m in got]
        if order != sorted(order):
            self.violate("wrong_read", f"Match answer out of order: {list(got)}")
        if max_instances and len(got) > max_instances:
            self.violate("wrong_read", f"{len(got)} hits for max_instances={max_instances}")
        for m in got:
            truth = self.model.zmq.get(m.instance)
            if truth is not None:
                if m.stale:
                    continue  # after a loss, with policy stale: anything, but hidden
                want_d = sum(truth.index.depth(m.instance, ns, keys))
                if m.depth > want_d:
                    self.violate(
                        "zmq_phantom",
                        f"{who}: {m.instance} matched {m.depth} blocks; its engine holds {want_d}",
                    )
                continue
            v = self.views(m.instance, r, reply, now)
            if not v.may_show(include_stale):
                self.violate(
                    "ghost_instance",
                    f"{who} named {m.instance} ({m.address}); within the lag bound it "
                    f"was {v.describe(now)}",
                )
            if m.address not in v.addresses or m.stale not in v.stale_flags:
                self.violate(
                    "stale_identity",
                    f"{who} named {m.instance} at {m.address!r} stale={m.stale}; within "
                    f"the lag bound it was {v.describe(now)}",
                )
            g, c, d = self.model.index.depth(m.instance, ns, keys)
            if m.depth > g + c + d:
                self.violate(
                    "removed_reported",
                    f"{who}: {m.instance} matched {m.depth} blocks, holds {g + c + d}",
                )
            if m.depth < g + c + d:
                self.violate(
                    "ack_lost",
                    f"{who}: {m.instance} matched {m.depth} blocks, holds {g + c + d}",
                )
            if (m.gpu_blocks, m.cpu_blocks, m.disk_blocks) != (g, c, d):
                self.violate(
                    "wrong_read",
                    f"{who}: {m.instance} tiers {(m.gpu_blocks, m.cpu_blocks, m.disk_blocks)}, "
                    f"contract {(g, c, d)}",
                )
        floor = min((m.depth for m in got), default=0)
        for iid in self.model.index.inst:
            if iid in seen:
                continue
            depth = sum(self.model.index.depth(iid, ns, keys))
            if not depth:
                continue
            v = self.views(iid, r, reply, now)
            if not v.must_show(include_stale):
                continue
            if max_instances and len(got) == max_instances and depth <= floor:
                continue
            await self.left_out(
                r,
                iid,
                ns,
                keys,
                f"{who} left out {iid} (holds {depth} of {len(keys)} blocks, "
                f"{v.describe(now)} throughout the lag window); answer {list(got)}",
            )

    async def left_out(
        self, r: int, iid: InstanceId, ns: Namespace, keys: Sequence[int], detail: str
    ) -> None:
        """An instance the contract says an answer must name is missing: its blocks are
        lost (``ack_lost``) or the replica hid it (``hidden_live``); a dump tells which."""
        held = False
        with contextlib.suppress(Exception):
            blocks, _ = await self.rep(r).logic.dump(ns.model)
            held = any(n == ns and k == keys[0] and iid in h for n, k, h in blocks)
        if held:
            self.violate("hidden_live", detail)
        self.violate("ack_lost", detail + "; DumpIndex lacks its first block too")

    def views(self, iid: InstanceId, r: int, reply: Reply, now: float) -> _Views:
        """What replica ``r`` may say about ``iid`` in an answer (per attribute, see History)."""
        h = self.model.history
        t0, t1 = reply.sent, reply.acked
        return _Views(
            h.admissible(iid, r, t0, t1, self.lag, "life"),
            h.admissible(iid, r, t0, t1, self.lag, "stale"),
            h.admissible(iid, r, t0, t1, self.lag, "address"),
            now,
        )

    async def probe(self, op: Op) -> None:
        """A Match after every operation, on a replica and prompt drawn from the operation."""
        rng = random.Random(zlib.crc32(repr(op).encode()) ^ self.seed)
        up = [r for r in self.fleet.replicas if r.running]
        if not up:
            return
        r = rng.choice(up)
        spaces = [(m, "") for m in MODELS] + [(MODELS[0], "l"), (SG_MODEL, "")]
        if self.engines:
            spaces.append((ZMQ_MODEL, ""))
        model, lora = rng.choice(spaces)
        by_keys = model == ZMQ_MODEL and rng.random() < 0.5
        chain, blocks = rng.randrange(CHAINS), rng.randint(1, CHAIN_BLOCKS)
        include_stale = rng.random() < 0.3
        keys = self.match_keys(model, lora, chain, blocks, by_keys)
        query = MatchQuery(Namespace(model, lora), block_keys=keys, include_stale=include_stale)
        reply = await self.call(
            r.n, "logic", self._no_grpc, lambda rep: rep.logic.match(query), 0.0
        )
        self.expect_ok(reply)
        await self.check_match(
            r.n, Namespace(model, lora), keys, include_stale, 0, reply.value.matches, reply
        )

    # -- the follower ---------------------------------------------------------------

    def follower_fault(self) -> None:
        """Cut or stall the follower's stream, or end a stall, drawn from the seed and
        the operation's index (so that a replay with --keep draws the same)."""
        link = self.follower
        assert link is not None
        if link.stalled:
            if self.step >= link.stall_until:
                link.resume()
            return
        rng = random.Random(f"{self.seed}/follower/{self.step}")
        x = rng.random()
        if x < FOLLOWER_CUT_P:
            self.faults["follower_cut"] += 1
            link.cut()
        elif x < FOLLOWER_CUT_P + FOLLOWER_STALL_P:
            self.faults["follower_stall"] += 1
            link.stall(self.step + rng.randint(*FOLLOWER_STALL_STEPS))

    async def follower_probe(self, op: Op) -> None:
        """A Match on the follower, checked against the model (CONSISTENCY.md, "A
        router's follower"): None (out of sync) is a fallback, never wrong; an
        answer from a copy holding everything the replica acknowledged must be
        the replica's; one from a copy behind is polled until it catches up, and
        past FOLLOWER_LAG_S (unless the stream is stalled) is ``follower_lag``."""
        rng = random.Random(zlib.crc32(repr(op).encode()) ^ self.seed ^ 0x5F0110)
        spaces = [(m, "") for m in MODELS] + [(MODELS[0], "l"), (SG_MODEL, "")]
        if self.engines:
            spaces.append((ZMQ_MODEL, ""))
        model, lora = rng.choice(spaces)
        by_keys = model == ZMQ_MODEL and rng.random() < 0.5
        chain, blocks = rng.randrange(CHAINS), rng.randint(1, CHAIN_BLOCKS)
        await self.follower_check(model, lora, self.match_keys(model, lora, chain, blocks, by_keys))

    async def follower_check(self, model: str, lora: str, keys: Sequence[int]) -> None:
        """One Match on the follower, checked (see :meth:`follower_probe`)."""
        link = self.follower
        assert link is not None
        f = link.f
        ns = Namespace(model, lora)
        start = time.monotonic()
        while True:
            # Over Redis: every change acknowledged before this line is at or
            # before the stream's last entry now (read before the copy is).
            top = await link.redis_top() if self.target.kind != "memory" else None
            out = f.match(model, lora, keys)
            t = time.monotonic()
            if out is None:
                self.follower_figures["fallback"] += 1
                quiet = t - max(f.unsynced_at, link.fault_end, self.fault_end)
                if not f.synced and not link.stalled and quiet > RECOVERY_S:
                    self.violate(
                        "not_recovered",
                        f"the follower has been out of sync for {t - f.unsynced_at:.1f} s, "
                        f"{quiet:.1f} s after the last fault",
                    )
                return
            # The copy's own answer (addresses and stale flags too), read in the
            # same step of the loop as the router's.
            raw = f.index.match_sync(ns, keys)
            over_redis = self.target.kind != "memory"
            caught = link.caught_up(top) if top is not None or not over_redis else False
            named = {instance_name(m.instance.worker_id, m.instance.dp_rank): m for m in raw}
            seen = Counter(m.instance for m in raw)
            twice = [str(i) for i, c in seen.items() if c > 1]
            if twice:
                self.violate("listed_twice", f"the follower named {twice} twice: {raw}")
            mine = {
                n: (m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks) for n, m in named.items()
            }
            theirs = {
                n: (w.depth, w.gpu_blocks, w.cpu_blocks, w.disk_blocks)
                for n, w in out.matches.items()
            }
            if mine != theirs:
                self.violate("wrong_read", f"the follower answered {theirs}; its copy holds {mine}")
            if caught:
                self.follower_figures["checked"] += 1
                reply = Reply(None, "OK", "", t, t, False)
                await self.check_match(0, ns, keys, False, 0, raw, reply, who="follower")
                return
            if link.stalled:
                self.follower_figures["behind"] += 1
                return
            since = t - max(start, link.fault_end)
            if since > FOLLOWER_LAG_S:
                self.violate(
                    "follower_lag",
                    f"the follower answered from a copy at position {f.position} "
                    f"(loaded from the replica's run {f.synced_run}, which is in run "
                    f"{link.replica.run}); the replica is at {link.replica_position()}, "
                    f"{since:.2f} s after it acknowledged (F = {FOLLOWER_LAG_S:g} s)",
                )
            await asyncio.sleep(0.002)

    async def follower_final(self) -> None:
        """At the end of a round: the stream flowing again, the follower must be in
        sync within RECOVERY_S, and then answer every chain of every model."""
        link = self.follower
        assert link is not None
        if link.stalled:
            link.resume()
        if not await link.f.wait_synced(RECOVERY_S):
            f = link.f
            t0 = time.monotonic()
            late = await f.wait_synced(LATE_SYNC_S)
            after = (
                f"it synced {RECOVERY_S + time.monotonic() - t0:.1f} s after the stream flowed"
                if late
                else f"nor within {RECOVERY_S + LATE_SYNC_S:g} s"
            )
            self.violate(
                "not_recovered",
                f"the follower did not sync within {RECOVERY_S:g} s ({after}; "
                f"reconnects {f.reconnects}, resyncs {f.resyncs}, snapshots {f.snapshots}, "
                f"stalls {f.stalls}, gaps {f.gaps}, replica run {link.replica.run}, "
                f"proxy's newest connection in run {link.proxy.newest_run})",
            )
        spaces = [(m, "") for m in MODELS] + [(MODELS[0], "l"), (SG_MODEL, "")]
        for model, lora in spaces:
            for chain in range(CHAINS):
                keys = self.match_keys(model, lora, chain, CHAIN_BLOCKS, False)
                await self.follower_check(model, lora, keys)

    @staticmethod
    async def _no_grpc(stub: Any, sg: Any, t: float) -> Any:
        raise AssertionError("a logic-only call")

    # -- fresh reads ---------------------------------------------------------------

    async def _list(self, replica: int, via: Via, model: str) -> None:
        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            resp = await stub.ListInstances(pb.ListInstancesRequest(model=model), timeout=t)
            return [_listed_from_pb(i) for i in resp.instances]

        async def via_logic(r: Replica) -> Any:
            return [_listed_from_state(s) for s in await r.logic.list_instances(model)]

        reply = await self.call(replica, via, via_grpc, via_logic)
        self.expect_ok(reply)
        got: list[_Listed] = reply.value
        now = self.clock()
        ids = [x.iid for x in got]
        twice = sorted(str(i) for i, c in Counter(ids).items() if c > 1)
        if twice:
            self.violate("listed_twice", f"ListInstances named {twice} twice")
        if ids != sorted(ids):
            self.violate("wrong_read", "ListInstances out of order")
        want = {
            iid: i.state(now)
            for iid, i in self.model.index.inst.items()
            if not model or i.spec.model == model
        }
        by_id = {x.iid: x for x in got if x.iid not in self.model.zmq}
        for iid in sorted(set(want) - set(by_id)):
            self.violate("ack_lost", f"ListInstances left out {iid} (registered, acknowledged)")
        for iid in sorted(set(by_id) - set(want)):
            self.violate("ghost_instance", f"ListInstances named {iid}, not registered")
        for iid, st in want.items():
            self._compare_state(by_id[iid], st, "list", exact_lease=True)

    async def _dump(self, replica: int, via: Via, model: str = "") -> None:
        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            out: dict[Namespace, dict[int, dict[InstanceId, int]]] = {}
            async for resp in stub.DumpIndex(pb.DumpIndexRequest(model=model), timeout=t):
                for b in resp.blocks:
                    ns = Namespace(b.model, b.lora_name)
                    holders = out.setdefault(ns, {}).setdefault(b.block_key, {})
                    for h in b.holders:
                        mask = 0
                        for t_ in h.tiers:
                            mask |= Tier(t_).bit
                        holders[InstanceId(h.instance.worker_id, h.instance.dp_rank)] = mask
            return out

        async def via_logic(r: Replica) -> Any:
            blocks, _ = await r.logic.dump(model)
            out: dict[Namespace, dict[int, dict[InstanceId, int]]] = {}
            for ns, key, holders in blocks:
                out.setdefault(ns, {})[key] = dict(holders)
            return out

        if self.engines and (not model or model == ZMQ_MODEL):
            for j in range(len(self.engines)):
                await self.wait_converged(j)  # a rebuild that is due happens at the next batch
        reply = await self.call(replica, via, via_grpc, via_logic)
        self.expect_ok(reply)
        got: dict[Namespace, dict[int, dict[InstanceId, int]]] = reply.value
        want = self.model.index.blocks()
        flat_got = {
            (ns, k, iid): m
            for ns, t in got.items()
            for k, hs in t.items()
            for iid, m in hs.items()
            if iid not in self.model.zmq
        }
        flat_want = {
            (ns, k, iid): m
            for ns, t in want.items()
            if not model or ns.model == model
            for k, hs in t.items()
            for iid, m in hs.items()
        }
        for key in sorted(set(flat_want) | set(flat_got), key=str):
            g, w = flat_got.get(key, 0), flat_want.get(key, 0)
            if g & ~w:
                self.violate(
                    "removed_reported",
                    f"DumpIndex: {key[2]} holds {key[0]}/{key[1]:#x} tiers {g:03b}, "
                    f"contract {w:03b}",
                )
            if w & ~g:
                self.violate(
                    "ack_lost",
                    f"DumpIndex: {key[2]} lacks {key[0]}/{key[1]:#x} tiers {w:03b} (has {g:03b})",
                )
        if self.engines and (not model or model == ZMQ_MODEL):
            reply = await self.call(
                replica, "logic", self._no_grpc, lambda r: r.logic.list_instances(ZMQ_MODEL)
            )
            self.expect_ok(reply)
            listed = reply.value
            flags = {st.spec.instance: st.stale for st in listed}
            for e in self.engines:
                self._check_engine(e, got, flags.get(e.instance))

    async def _stats(self, replica: int, via: Via) -> None:
        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            s = await stub.GetStats(pb.GetStatsRequest(), timeout=t)
            return (
                s.instances,
                s.instances_live,
                s.instances_stale,
                {
                    Namespace(n.model, n.lora_name): (n.blocks, n.block_instances)
                    for n in s.namespaces
                },
            )

        async def via_logic(r: Replica) -> Any:
            s = (await r.logic.stats()).index
            return (
                s.instances,
                s.instances_live,
                s.instances_stale,
                {n.namespace: (n.blocks, n.block_instances) for n in s.namespaces},
            )

        reply = await self.call(replica, via, via_grpc, via_logic)
        self.expect_ok(reply)
        n, live, stale, per_ns = reply.value
        now = self.clock()
        insts = self.model.index.inst.values()
        want_n = len(insts)
        want_live = sum(i.exp > now for i in insts)
        want_stale = sum(i.stale for i in insts)
        extra = len(self.engines)  # ZMQ-fed instances come and go with their subscribers
        if not (want_n <= n <= want_n + extra and want_live <= live <= want_live + extra):
            self.violate(
                "wrong_read",
                f"GetStats: {n} instances ({live} live), contract {want_n} ({want_live} live)",
            )
        if not want_stale <= stale <= want_stale + extra:
            self.violate("wrong_read", f"GetStats: {stale} stale instances, contract {want_stale}")
        sizes = self.model.index.namespace_sizes()
        got = {ns: v for ns, v in per_ns.items() if ns.model != ZMQ_MODEL}
        for ns in sorted(set(sizes) | set(got), key=str):
            g, w = got.get(ns, (0, 0)), sizes.get(ns, (0, 0))
            if g == w:
                continue
            if self.purge_pending and g[0] >= w[0] and g[1] >= w[1]:
                continue  # retired entries are counted until their purge finishes
            self.violate("wrong_read", f"GetStats {ns}: (blocks, entries) {g}, contract {w}")

    async def full_check(self, replicas: Iterable[int] | None = None) -> None:
        """ListInstances, DumpIndex and GetStats (and the ZMQ engines) on some replicas."""
        which = list(replicas) if replicas is not None else [self.step % self.n]
        for e in range(len(self.engines)):
            await self.wait_converged(e)
        for i in which:
            if not self.rep(i).running:
                continue
            await self._list(i, "logic", "")
            await self._dump(i, "logic")
            await self._stats(i, "logic")

    # -- SGLang --------------------------------------------------------------------

    def sg_seq(self, worker: str, mode: SeqMode) -> int:
        """The sequence a mode names for an SGLang worker now."""
        return self.seq_for(InstanceId(worker, 0), mode)

    async def _sg_apply(self, op: SgApply) -> None:
        seq = self.sg_seq(op.worker, op.seq)
        events = sg_events(op.actions)
        req = spb.ApplyExternalKvBatchRequest(
            worker_id=op.worker,
            seq=seq,
            actions=[
                spb.ExternalKvAction(
                    type=_SG_KINDS[a.kind],
                    tier=_SG_TIERS[a.tier],
                    hashes=[
                        to_signed(ehash("s", a.chain, j))
                        for j in range(a.lo, min(a.hi, CHAIN_BLOCKS + 2))
                    ]
                    if a.kind != "clear"
                    else [],
                )
                for a in op.actions
            ],
            worker_address=op.address,
            worker_epoch=op.epoch,
            enforce_sequence=op.enforce,
        )
        dom = ApplyRequest(
            op.worker,
            seq,
            tuple(
                Action(
                    ActionKind(a.kind),
                    a.tier,
                    tuple(ehash("s", a.chain, j) for j in range(a.lo, min(a.hi, CHAIN_BLOCKS + 2)))
                    if a.kind != "clear"
                    else (),
                )
                for a in op.actions
            ),
            op.address,
            op.epoch,
            op.enforce,
        )

        async def via_grpc(_: Any, sg: Any, t: float) -> Any:
            resp = await sg.ApplyExternalKvBatch(req, timeout=t)
            return resp.applied_seq, resp.duplicate

        async def via_logic(r: Replica) -> Any:
            return await r.compat.apply(dom)

        reply = await self.call(op.replica, op.via, via_grpc, via_logic, op.deadline_ms)
        iid = InstanceId(op.worker, 0)
        try:
            want = self.model.sg_apply(
                op.worker, seq, events, op.address, op.epoch, op.enforce, self.clock()
            )
        except FailedPrecondition as e:
            self.model.note([iid], reply.sent, reply.acked, op.replica % self.n)
            if reply.code != "FAILED_PRECONDITION":
                self.violate(
                    "wrong_ack", f"SGLang batch {seq} of {op.worker}: {reply.code}, contract: {e}"
                )
            return
        self.model.note([iid], reply.sent, reply.acked, op.replica % self.n)
        self.expect_ok(reply)
        applied, dup = reply.value
        if reply.retried and dup:
            return
        if (applied, dup) != (want.applied_seq, want.duplicate):
            inv = "valid_rejected" if dup and not want.duplicate else "wrong_ack"
            self.violate(
                inv,
                f"SGLang batch {seq} of {op.worker}: (applied_seq, duplicate) {(applied, dup)}, "
                f"contract {(want.applied_seq, want.duplicate)}",
            )

    async def _sg_snapshot(self, op: SgSnapshot) -> None:
        hashes = tuple(ehash("s", op.chain, j) for j in range(op.blocks))
        events = sg_events([SgAction("report", op.tier, op.chain, 0, op.blocks)])
        req = spb.ReplaceExternalKvSnapshotRequest(
            worker_id=op.worker,
            worker_address=op.address,
            worker_epoch=op.epoch,
            applied_seq=op.seq,
            hashes_by_tier=[
                spb.TierHashes(tier=_SG_TIERS[op.tier], hashes=[to_signed(h) for h in hashes])
            ],
        )

        async def via_grpc(_: Any, sg: Any, t: float) -> Any:
            return (await sg.ReplaceExternalKvSnapshot(req, timeout=t)).applied_seq

        async def via_logic(r: Replica) -> Any:
            return await r.compat.replace_snapshot(
                op.worker, op.address, op.epoch, op.seq, [(op.tier, hashes)]
            )

        reply = await self.call(op.replica, op.via, via_grpc, via_logic)
        want = self.model.sg_snapshot(op.worker, op.address, op.epoch, op.seq, events, self.clock())
        self.model.note([InstanceId(op.worker, 0)], reply.sent, reply.acked, op.replica % self.n)
        self.expect_ok(reply)
        if int(reply.value) != want:
            self.violate("wrong_ack", f"snapshot applied_seq {reply.value}, contract {want}")

    async def _sg_configure(self, op: SgConfigure) -> None:
        req = spb.ConfigureExpectedWorkersRequest(
            workers=[spb.ExpectedWorker(worker_id=w, worker_address=a) for w, a in op.workers]
        )

        async def via_grpc(_: Any, sg: Any, t: float) -> Any:
            resp = await sg.ConfigureExpectedWorkers(req, timeout=t)
            return resp.total_workers, resp.ready_workers

        async def via_logic(r: Replica) -> Any:
            return await r.compat.configure(list(op.workers))

        reply = await self.call(op.replica, op.via, via_grpc, via_logic)
        want = self.model.sg_configure(op.workers, self.clock())
        self.model.note(
            [InstanceId(w, 0) for w in SG_WORKERS],
            reply.sent,
            reply.acked,
            op.replica % self.n,
            _LIFE | _ADDRESS,
        )
        self.expect_ok(reply)
        if not reply.retried and tuple(reply.value) != want:
            self.violate("wrong_ack", f"ConfigureExpectedWorkers {reply.value}, contract {want}")

    async def _sg_match(self, op: SgMatch) -> None:
        keys = [ehash("s", op.chain, j) for j in range(op.blocks)]
        req = spb.MatchExternalKvPrefixRequest(hashes=[to_signed(k) for k in keys])

        async def via_grpc(_: Any, sg: Any, t: float) -> Any:
            resp = await sg.MatchExternalKvPrefix(req, timeout=t)
            return (
                [(m.worker_id, m.worker_address, m.matched_prefix_blocks) for m in resp.matches],
                resp.best_prefix_blocks,
                resp.blocks_read,
            )

        async def via_logic(r: Replica) -> Any:
            res = await r.compat.match_prefix(keys, 0)
            return (
                [(m.worker_id, m.worker_address, m.matched_prefix_blocks) for m in res.matches],
                res.best_prefix_blocks,
                res.blocks_read,
            )

        reply = await self.call(op.replica, op.via, via_grpc, via_logic)
        self.expect_ok(reply)
        matches, best, read = reply.value
        r = op.replica % self.n
        now = self.clock()
        ns = Namespace(SG_MODEL, "")
        if read != len(keys) or best != (matches[0][2] if matches else 0):
            self.violate("wrong_read", f"SGLang prefix: best {best} read {read} for {matches}")
        addrs = Counter(a for _, a, _ in matches)
        workers = Counter(w for w, _, _ in matches)
        if any(c > 1 for c in addrs.values()) or any(c > 1 for c in workers.values()):
            self.violate("listed_twice", f"SGLang prefix answer repeats: {matches}")
        depths = [d for _, _, d in matches]
        if depths != sorted(depths, reverse=True):
            self.violate("wrong_read", f"SGLang prefix answer out of order: {matches}")
        for w, a, d in matches:
            iid = InstanceId(w, 0)
            v = self.views(iid, r, reply, now)
            if not v.may_show(False):
                self.violate("ghost_instance", f"SGLang prefix named {w}: {v.describe(now)}")
            if a not in v.addresses:
                self.violate(
                    "stale_identity", f"SGLang prefix named {w} at {a!r}: {v.describe(now)}"
                )
            want = sum(self.model.index.depth(iid, ns, keys))
            if d != want:
                self.violate(
                    "ack_lost" if d < want else "removed_reported",
                    f"SGLang prefix: {w} matched {d} blocks, holds {want}",
                )
        for iid, inst in self.model.index.inst.items():
            if inst.spec.model != SG_MODEL or iid.worker_id in workers:
                continue
            depth = sum(self.model.index.depth(iid, ns, keys))
            v = self.views(iid, r, reply, now)
            if not depth or not v.must_show(False):
                continue
            if len(v.addresses) != 1 or "" in v.addresses:
                continue
            (addr,) = v.addresses
            if any(a == addr and d >= depth for _, a, d in matches):
                continue  # reported once, by another worker behind the same address
            await self.left_out(
                r,
                iid,
                ns,
                keys,
                f"SGLang prefix left out {iid.worker_id} ({depth} blocks): {matches}",
            )

    # -- ZMQ -----------------------------------------------------------------------

    async def wait_converged(self, e: int, within: float = 0.0) -> None:
        """Wait until engine ``e``'s subscriber has taken every batch; nudge it with empty
        batches (an engine publishes all the time: a gap is only seen on the next batch)."""
        engine = self.engines[e]
        within = within or self.zmq_catch_up_s
        deadline = time.monotonic() + within
        truth = engine.truth
        if truth.pending is not None and self.fleet.replicas[0].running:
            # The subscriber replays when the next batch shows it what it lacks.
            await engine.publish(())
            needed, truth.pending = truth.pending, None
            truth.replay_from(needed, engine.buffer_start(), engine.clear_buffered(needed))
        nudge_at = time.monotonic() + 0.1
        while True:
            sub = self.fleet.replicas[0].subscriber(e)
            if sub is None:
                return
            # Idle too: the subscriber moves next_seq past a batch before it
            # applies it, and a batch that finds the instance gone registers
            # it and rebuilds before the index holds the engine's cache again.
            if sub.next_seq == engine.seq and sub.idle:
                return
            if time.monotonic() > deadline:
                self.violate(
                    "zmq_stuck",
                    f"engine {engine.worker} at sequence {engine.seq}, its subscriber expects "
                    f"{sub.next_seq} after {within:g} s",
                )
            if time.monotonic() > nudge_at:
                await engine.publish(())
                nudge_at = time.monotonic() + 0.1
            await asyncio.sleep(0.01)

    def _check_engine(
        self,
        e: ZmqEngine,
        blocks: dict[Namespace, dict[int, dict[InstanceId, int]]],
        stale: bool | None,
    ) -> None:
        """The engine's instance in a dump (and its stale flag) against the engine's cache."""
        got: dict[tuple[Namespace, int], int] = {}
        for ns, t in blocks.items():
            for k, hs in t.items():
                m = hs.get(e.instance)
                if m:
                    got[(ns, k)] = m
        want = e.truth.entries()
        if e.truth.must_be_stale:
            if stale is False:
                self.violate(
                    "zmq_lost",
                    f"{e.worker}: batches replay could not return are lost, yet the instance "
                    "is fresh (on_unrecoverable_gap=stale)",
                )
            return  # hidden: it may hold anything
        phantom = {k: m for k, m in got.items() if m & ~want.get(k, 0)}
        if phantom:
            (ns, key), mask = next(iter(phantom.items()))
            self.violate(
                "zmq_phantom",
                f"{e.worker}: the index holds {len(phantom)} entries its engine does not "
                f"(e.g. {ns}/{key:#x} tiers {mask:03b}, engine {want.get((ns, key), 0):03b})",
            )
        if e.truth.lost:
            return
        if stale:
            self.violate("zmq_lost", f"{e.worker}: stale though replay covered every gap")
        missing = {k: m for k, m in want.items() if m & ~got.get(k, 0)}
        if missing:
            self.violate(
                "zmq_lost",
                f"{e.worker}: the index lacks {len(missing)} of its engine's {len(want)} "
                "entries though replay covered every gap",
            )

    async def zmq_check(self) -> None:
        """Every engine converged, then its instance's entries against the engine's cache."""
        for e in range(len(self.engines)):
            await self.wait_converged(e)
        if not self.fleet.replicas[0].running:
            return
        await self._dump(0, "logic", ZMQ_MODEL)

    async def _z_publish(self, op: ZPublish) -> None:
        e = self.engines[op.engine % len(self.engines)]
        if op.drop_first:
            self.faults["zmq_drop"] += 1
            await e.publish(op.events, drop=True)
            await e.publish(())
        else:
            await e.publish(op.events)
        await self.zmq_check()

    async def _z_restart(self, op: ZRestart) -> None:
        i = op.engine % len(self.engines)
        e = self.engines[i]
        while e.seq < ZMQ_RESTART_PAD:
            await e.publish(())
        await self.wait_converged(i)
        self.faults["zmq_publisher_restart"] += 1
        await e.restart()
        await self.zmq_check()

    async def _z_late_join(self, op: ZLateJoin) -> None:
        i = op.engine % len(self.engines)
        e = self.engines[i]
        await self.wait_converged(i)
        self.faults["zmq_late_join"] += 1
        r0 = self.fleet.replicas[0]
        t = time.monotonic()
        await r0.stop()
        needed = e.seq  # the subscriber adopts its instance's next sequence from Redis
        rng = random.Random(zlib.crc32(repr(op).encode()) ^ self.seed)
        for _ in range(op.batches):
            chain = rng.randrange(CHAINS)
            await e.publish((Store(chain, 0, rng.randint(1, CHAIN_BLOCKS)),))
        if op.truncate:
            self.faults["zmq_truncate"] += 1
            e.truncate(1)
        await r0.start()
        if self.target.kind == "memory":
            self._lose_everything(t)  # a first contact: rebuilt from replay from 0
        else:
            e.truth.pending = needed  # it adopts its instance; the gap shows at the next batch
        await self.zmq_check()

    async def _z_remove(self, op: ZRemove) -> None:
        e = self.engines[op.engine % len(self.engines)]
        await self.wait_converged(op.engine % len(self.engines))
        ref = pb.InstanceRef(worker_id=e.instance.worker_id, dp_rank=e.instance.dp_rank)

        async def via_grpc(stub: Any, _: Any, t: float) -> Any:
            return await stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref), timeout=t)

        async def via_logic(r: Replica) -> Any:
            return await r.logic.remove_instance(e.instance)

        reply = await self.call(op.replica, op.via, via_grpc, via_logic)
        if reply.code not in ("OK", "NOT_FOUND"):
            self.violate("valid_rejected", f"RemoveInstance of {e.worker}: {reply.code}")
        e.truth.index_lost()
        await self.zmq_check()

    async def _z_burst(self, op: ZBurst) -> None:
        i = op.engine % len(self.engines)
        e = self.engines[i]
        await self.wait_converged(i)
        sub = self.fleet.replicas[0].subscriber(i)
        if sub is None:
            return
        for k in range(op.batches):
            await e.publish((Store(k % CHAINS, 0, CHAIN_BLOCKS),))
        end = e.seq
        t0 = time.monotonic()
        seen: list[tuple[float, int]] = []
        keys = self.match_keys(ZMQ_MODEL, "", 0, CHAIN_BLOCKS, e.keys == "engine_hashes")
        req = pb.MatchRequest(model=ZMQ_MODEL, block_keys=keys)
        stub = self.fleet.replicas[0].stub

        async def probe() -> None:
            try:
                await stub.Match(req, timeout=ZMQ_BURST_CATCH_UP_S)
            except grpc.aio.AioRpcError as e:
                self.violate("valid_rejected", f"Match during a burst: {e.code().name}")
            seen.append((time.monotonic(), sub.next_seq or 0))

        task = asyncio.create_task(probe())
        try:
            await self.wait_converged(i, ZMQ_BURST_CATCH_UP_S)
            ingest = time.monotonic() - t0
            await task
        finally:
            task.cancel()
        answered, at_seq = seen[0]
        if at_seq >= end and ingest >= STARVE_MIN_S and answered - t0 >= 0.9 * ingest:
            self.violate(
                "starved",
                f"a Match sent as {op.batches} batches arrived was answered after "
                f"{answered - t0:.2f} s, once all were ingested ({ingest:.2f} s)",
            )
        await self.zmq_check()

    # -- invented names -----------------------------------------------------------------

    async def _invent(self, n: int, tag: str) -> None:
        rng = random.Random(f"{self.seed}/{tag}")
        self._names += 1
        stem = f"{tag}{self._names}"
        up = [r for r in self.fleet.replicas if r.running]
        for j in range(n):
            a, b = rng.choice(up), rng.choice(up)
            name = f"{stem}-{j}"
            await a.logic.match(MatchQuery(Namespace(name), block_keys=[j + 1]))
            await b.logic.list_instances(name)
            with contextlib.suppress(NotFound):
                await a.logic.heartbeat(InstanceId(name, 0))
            iid = InstanceId(name, 1)
            spec = InstanceSpec(iid, MODELS[0], f"http://{name}", 5.0, "x")
            sent = time.monotonic()
            await a.logic.register(spec)
            self.model.index.register(spec, self.clock())
            await b.logic.list_instances()
            # Reaped first when a step takes longer than its lease (a loaded
            # machine, or a clock jump meanwhile): gone either way.
            with contextlib.suppress(NotFound):
                await a.logic.remove_instance(iid)
            self.model.index.remove(iid)
            self.model.note([iid], sent, time.monotonic(), a.n)
        # Whatever a replica keeps only until its next refresh is not growth.
        await asyncio.sleep(self.lag + LAG_MARGIN_S)
        for r in up:
            await r.logic.list_instances()
            await r.logic.match(MatchQuery(Namespace(MODELS[0]), block_keys=[1]))

    async def _invent_names(self, op: InventNames) -> None:
        kinds = 3  # per name: a model, a worker, an instance registered and removed
        tracemalloc.start(1)
        try:
            await self._invent(op.n, "warm")
            gc.collect()
            before = tracemalloc.take_snapshot()
            await self._invent(op.n, "x")
            gc.collect()
            after = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        flt = [tracemalloc.Filter(True, "*/indexer/*"), tracemalloc.Filter(True, "*/kvmesh/*")]
        diff = after.filter_traces(flt).compare_to(before.filter_traces(flt), "lineno")
        grown = sum(d.size_diff for d in diff)
        per_name = grown / (op.n * kinds)
        if per_name > NAME_BYTES_BOUND:
            top = sorted(diff, key=lambda d: -d.size_diff)[:3]
            where = "; ".join(
                f"{d.traceback[0].filename.rsplit('/', 2)[-2:]}:{d.traceback[0].lineno} "
                f"+{d.size_diff} B"
                for d in top
            )
            self.violate(
                "names_grow_memory",
                f"{grown} bytes kept for {op.n * kinds} invented names "
                f"({per_name:.0f} B each, bound {NAME_BYTES_BOUND}): {where}",
            )


def _awaiting(task: asyncio.Task[Any]) -> str:
    """Where a task waits: its coroutine chain, innermost last three frames first."""
    frames: list[str] = []
    aw: Any = task.get_coro()
    while aw is not None:
        frame = getattr(aw, "cr_frame", None) or getattr(aw, "ag_frame", None)
        if frame is None:
            frames.append(type(aw).__name__)
            break
        frames.append(f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}")
        aw = getattr(aw, "cr_await", None) or getattr(aw, "ag_await", None)
    return " < ".join(reversed(frames[-4:]))


def _code_error(code: str, message: str) -> KvmeshError:
    e = KvmeshError(message)
    e.code = code
    return e


# -- rounds ------------------------------------------------------------------------------


def uses_zmq(profile: str, target: str) -> bool:
    """Whether a profile's operations need ZMQ engines."""
    return any(k.startswith("z_") for k in profile_ops(profile, target))


def _ops_of(p: RunParams, target: str) -> Iterable[tuple[int, Op]]:
    gen: Iterable[Op] = (
        p.script if p.script is not None else generate(p.seed, p.profile, target, p.replicas)
    )
    keep = set(p.keep) if p.keep is not None else None
    last = max(keep) if keep else p.ops - 1
    for i, op in enumerate(gen):
        if i > last or (keep is None and i >= p.ops):
            return
        if keep is None or i in keep:
            yield i, op


async def run_round(target: Target, p: RunParams) -> RoundResult:
    """Run one round of ``p`` on ``target`` (see the module docstring)."""
    t_start = time.monotonic()
    res = RoundResult(target.kind, p)
    replicas = 1 if target.kind == "memory" else p.replicas
    clock = LeaseClock()
    ctx = zmq.asyncio.Context()
    engines: list[ZmqEngine] = []
    if uses_zmq(p.profile, target.kind):
        policy = PROFILES[p.profile].zmq_policy
        engines = [ZmqEngine(ctx, w, keys, policy).open() for w, keys in ZMQ_ENGINES]
    fleet = Fleet(
        target,
        replicas,
        prefix=f"f{uuid.uuid4().hex[:10]}",
        clock=clock,
        engines=engines,
        wrap=p.wrap,
        zmq_policy=PROFILES[p.profile].zmq_policy,
    )
    driver = Driver(fleet, p.seed, engines=engines, zmq_catch_up_s=p.zmq_catch_up_s)
    link: FollowerLink | None = None
    driver.stalls.start()
    try:
        await fleet.start()
        if p.follower:
            link = driver.follower = FollowerLink(fleet.replicas[0], clock, p.follower_cls)
            if not await link.start(RECOVERY_S):
                raise RuntimeError(f"the follower did not sync within {RECOVERY_S:g} s")
        since_full = 0
        for i, op in _ops_of(p, target.kind):
            if p.duration_s and time.monotonic() - t_start > p.duration_s:
                break
            driver.step, driver.op = i, op
            res.ran.append((i, op))
            try:
                await driver.step_with_watchdog(op, since_full + 1 >= FULL_CHECK_EVERY)
                since_full = (since_full + 1) % FULL_CHECK_EVERY
            except _Stop:
                break
            res.operations += 1
        if not driver.violations and res.ran:
            driver.op = res.ran[-1][1]
            try:
                await asyncio.sleep(driver.lag + 2 * LAG_MARGIN_S)
                await driver.full_check(range(replicas))
                if engines:
                    await driver.zmq_check()
                if link is not None:
                    await driver.follower_final()
            except _Stop:
                pass
    finally:
        if link is not None:
            if (f := link.follower) is not None:
                driver.follower_figures.update(
                    snapshots=f.snapshots, resyncs=f.resyncs, reconnects=f.reconnects
                )
            server = link.replica.server
            if server is not None and (feed := server.servicer.watch_feed) is not None:
                # The replica's copy of the Redis index (this run's feed).
                driver.follower_figures.update(
                    copy_made=feed.copies,
                    copy_resyncs=feed.resyncs,
                    copy_errors=feed.errors,
                    copy_reloads=feed.reloads,
                )
            await link.close()
        try:
            await asyncio.wait_for(fleet.close(), CLOSE_TIMEOUT_S)
        except TimeoutError:
            log.error("the fleet of round %d did not stop within %g s", p.seed, CLOSE_TIMEOUT_S)
        for e in engines:
            await e.close()
        ctx.destroy(linger=0)
        await driver.stalls.stop()
    res.faults = driver.faults
    res.violations = driver.violations
    res.follower = driver.follower_figures
    res.elapsed_s = time.monotonic() - t_start
    return res


async def shrink(target: Target, failed: RoundResult, budget_s: float = 60.0) -> RoundResult:
    """Delete operations from a failed round while its first invariant still fails.

    Delta debugging over the indices of the operations run (chunks, then
    halves of chunks...), each candidate run as a fresh round; stops when no
    single operation can go or ``budget_s`` is spent. Returns the smallest
    failing round found (the original when nothing reproduced).
    """
    if not failed.violations:
        return failed
    want = failed.violations[0].invariant
    best = failed
    idx = [i for i, _ in failed.ran]
    deadline = time.monotonic() + budget_s
    chunks = 2
    while len(idx) >= 2 and time.monotonic() < deadline:
        size = math.ceil(len(idx) / chunks)
        removed = False
        for lo in range(0, len(idx), size):
            if time.monotonic() > deadline:
                break
            cand = idx[:lo] + idx[lo + size :]
            if not cand:
                continue
            p = RunParams(
                seed=failed.params.seed,
                profile=failed.params.profile,
                replicas=failed.params.replicas,
                ops=failed.params.ops,
                keep=tuple(cand),
                wrap=failed.params.wrap,
                script=failed.params.script,
                zmq_catch_up_s=failed.params.zmq_catch_up_s,
                follower=failed.params.follower,
                follower_cls=failed.params.follower_cls,
            )
            got = await run_round(target, p)
            if got.violations and got.violations[0].invariant == want:
                best, idx = got, [i for i, _ in got.ran]
                chunks = max(chunks - 1, 2)
                removed = True
                break
        if not removed:
            if size == 1:
                break
            chunks = min(len(idx), chunks * 2)
    return best


def replay_line(res: RoundResult) -> str:
    """The command that replays a round's operations exactly."""
    p = res.params
    keep = ",".join(str(i) for i, _ in res.ran)
    return (
        f"kvmesh bench faults --target {res.target} --profile {p.profile} "
        f"--replicas {p.replicas} --seed {p.seed}{' --follower' if p.follower else ''} "
        f"--keep {keep}"
    )


def format_round(res: RoundResult) -> str:
    """A failing round as text: the violation, the replay command, the operations."""
    lines = [str(v) for v in res.violations[:1]]
    lines.append("replay: " + replay_line(res))
    lines += [f"  [{i}] {describe(op)}" for i, op in res.ran]
    return "\n".join(lines)
