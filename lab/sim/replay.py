"""``kvmesh replay``: a trace through routing policies, in virtual time.

Each trace request arrives at its trace time (divided by ``--speed``) at one
of ``R`` routers (chosen at random per request with the seed), each router a
:class:`router_client.Router` of its own, and is routed to one of ``W``
simulated engines (:mod:`lab.sim.engine`) by the policy under test:

- ``round_robin``, ``random``, ``p2c`` (power of two choices on the router's
  load view): no cache knowledge;
- ``cache_local``: each router knows only what it routed itself (a per-router
  LRU model of every worker's cache, as SGLang's ``cache_aware`` keeps a
  per-router tree), scored by router_client's cost;
- ``cache_shared``: router_client over the kvmesh indexer, which the engines
  feed with their real KV events (in-process memory backend; ``--indexer
  ADDR`` drives a live indexer over gRPC instead). An engine publishes a
  request's events when its prefill ends plus ``--event-lag-ms``, so a
  request arriving earlier with the same new prefix is routed without them,
  as a real router would route it.

**Follower and outage** (:mod:`lab.sim.outage`). ``--follower`` runs
cache_shared twice: its routers asking the indexer (remote) and asking an
:class:`router_client.follower.IndexFollower` of it first (follower), the
remote Match and load-only routing behind it as ``IndexerClient`` falls back.
Before each routing decision the replay waits (wall time, virtual time
stopped) until the follower applied what the indexer acknowledged, so the
two compare where answers come from, not the follower's lag. ``--outage
START_S:DURATION_S`` runs each mode once more with the indexer killed at
``START_S`` replay seconds after the first arrival and started again, empty,
at ``START_S + DURATION_S``; the engines then register again and publish
what they hold (:class:`lab.sim.outage.RefeedPublisher`), and the replay
waits for the follower to load its new snapshot. Either flag without
``--indexer`` starts ``kvmesh indexer serve`` (memory backend) on a free
loopback port for the replay; ``--outage`` needs that process.

Everything runs on one discrete-event queue, so a run is fast and, with the
in-process index, deterministic for a seed. Hit rates count prompt blocks
found cached on the chosen worker; the bounds are one LRU cache of ``W x
capacity`` blocks fed the whole stream in order (pooled) and an unbounded
one (infinite). Request CV is the coefficient of variation of requests per
worker; load CV, of the time-averaged requests in flight.

**Load.** The service model (:class:`lab.sim.engine.ServiceModel`: prefill
tokens per second, decode seconds per token, requests running at once; each
a flag) makes the trace's requests a known amount of work: prefill seconds
of the uncached prompt tokens (one prefill at a time per engine) and slot
seconds (prefill + decode, ``max_running`` slots per engine). The fleet's
utilisation is the larger of the two over the fleet's capacity during the
trace's arrival span; both scale with the arrival rate. ``--load U`` sets
``--speed`` so that it is ``U`` with the hits of a basis: ``p2c`` (the
default: the hits P2C routing finds at speed 1, so the cache-blind baseline
runs ``U`` busy and a policy that finds more hits runs cooler), ``pooled``
(the hits of the pooled bound: only a policy as good as the caches allow
stays at ``U``, every other one runs hotter, often past 1) or ``cold`` (no
hits at all). Each policy reports the utilisation it really caused
(``util``). Dividing the trace's times also shortens the gaps between a
conversation's turns; the replay reports the share of requests that arrive
before the previous turn of their conversation finished (conversations as
:func:`lab.synth.measure` reads them), which is 0 in a real fleet.

**TTFT.** Queueing delay is the wait from arrival to prefill start; TTFT adds
the prefill. Goodput is the share of requests whose TTFT is within
``--ttft-slo-s``.

**Decision accounting**, every policy: at each admission, before the chosen
engine's cache takes the request, every engine's cached prefix of it is read
(:func:`cached_prefixes`, read-only lookups). ``avail`` is the hit rate had
every request gone to the engine holding the longest prefix, ``optimal`` the
share of decisions that took that longest prefix (a request no engine holds
any of counts as optimal), ``left`` the share of those available blocks the
chosen engines did not hold. ``avail`` is not a bound: another decision
changes what the caches hold later.

**Load the routers see** (:class:`LoadFeed`). ``--load-view shared`` (the
default) hands each router the engines' load reports: at every change with
``--load-report-ms 0`` (no view is ever stale: no fleet has that), else each
engine reports every P ms of virtual time (100 ms by default, about what a
router polling its engines' load sees), the engines' phases spread over the
period, so between reports a router sees the last report plus the requests
it started itself and none of the other routers' work. ``--load-view local``
sends no reports: a router knows only what it started, as one without shared
load does. Each policy reports the age of the chosen engine's report at the
decisions (mean, p95; none in the local view) and the view gap: the mean
|requests in flight the router saw on the chosen engine - the real ones|.
``--herding 4,8,16`` runs cache_shared only, at each router count with the
local and the shared view, all at one speed (``--load`` on the basis at
``--routers``), and prints request CV, load CV, TTFT p95, hit rate, goodput,
view gap and report age per router count and view: whether routers that do
not see each other's work herd onto the same engines.

**The grid** (``--grid``, :mod:`lab.sim.grid`): trace families x router
counts x cache sizes x loads, cache_shared judged against P2C and the other
policies per cell, a table, ``--json`` and ``--png`` heat maps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import grpc.aio
from prometheus_client import CollectorRegistry

from indexer.memory import MemoryIndex
from indexer.model import InstanceId, Namespace
from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.report import write_report
from lab.sim.clock import VirtualClock
from lab.sim.engine import ServiceModel, SimEngine, SimRequest
from lab.sim.outage import (
    RECONNECT_OPTIONS,
    IndexerProcess,
    Outage,
    RefeedPublisher,
)
from lab.sim.publish import GrpcPublisher, MemoryPublisher
from lab.synth import measure
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake, trace_block_key
from router_client.config import (
    DEFAULT_BALANCE,
    DEFAULT_PREFILL_WEIGHT,
    DEFAULT_PRIVATE_WEIGHT,
    DEFAULT_SPREAD_HALF_LIFE_S,
    CostModel,
    RouterConfig,
)
from router_client.follower import DEFAULT_HOLD_S, RECEIVE_OPTIONS, IndexFollower
from router_client.indexer_client import (
    IndexerClient,
    MatchOutcome,
    MatchStatus,
    WorkerMatch,
    instance_name,
)
from router_client.load import WorkerLoad
from router_client.router import Choice, Router, RouteRequest, pending_ms
from tee.cachesim.model import BlockCache, HitStats, infinite_cache, pooled_cache, worker_cv

POLICIES = ("round_robin", "random", "p2c", "cache_local", "cache_shared")

#: Model name the simulated engines register under.
REPLAY_MODEL = "kvmesh-replay"

#: What a run without a trace path replays.
BUNDLED_TRACE = "mooncake conversation (bundled)"

#: The default TTFT SLO of goodput. A chat budget for prompts of several
#: thousand tokens: the bundled trace's median prompt (6.9k tokens) prefills in
#: 0.7 s at the default prefill rate, so 2 s leaves room for a short queue and
#: fails a request stuck behind a long one.
DEFAULT_TTFT_SLO_S = 2.0

LoadBasis = Literal["p2c", "pooled", "cold"]
LOAD_BASES: tuple[LoadBasis, ...] = ("p2c", "pooled", "cold")

#: What load the routers see (module docstring, "Load the routers see").
LoadView = Literal["shared", "local"]
LOAD_VIEWS: tuple[LoadView, ...] = ("shared", "local")


#: How often the replay's engines report their load by default, seconds.
DEFAULT_LOAD_REPORT_S = 0.1


@dataclass(slots=True)
class ReplaySettings:
    """One replay's parameters (the command-line flags).

    ``speed`` divides the trace's times; ``load``, when set, is the target
    utilisation :func:`run_replay` turns into a speed (module docstring).
    ``event_lag_s``: engines publish a request's events this long after its
    prefill ends. ``trace`` names the trace in the table and the plot.
    """

    routers: int = 4
    workers: int = 16
    capacity: int = 500
    seed: int = 0
    balance: float = DEFAULT_BALANCE
    indexer: str | None = None
    service: ServiceModel = field(default_factory=ServiceModel)
    speed: float = 1.0
    load: float | None = None
    load_basis: LoadBasis = "p2c"
    event_lag_s: float = 0.0
    ttft_slo_s: float = DEFAULT_TTFT_SLO_S
    trace: str = BUNDLED_TRACE
    #: Run cache_shared with a follower of the indexer too (module docstring).
    follower: bool = False
    #: Run cache_shared once more per mode through this indexer outage.
    outage: Outage | None = None
    #: Also an outage run whose follower holds its last copy while out of sync
    #: (IndexFollower's hold; the other follower runs hold nothing, hold_s 0).
    follower_hold: bool = False
    #: Engines report their load to every router this often, virtual seconds
    #: (0: at every change, so no router's view is ever stale; no fleet has
    #: that, so the default is a period a router polling its engines gets).
    load_report_s: float = DEFAULT_LOAD_REPORT_S
    #: ``shared``: the routers get the engines' reports; ``local``: none, only
    #: each router's own bookkeeping of the requests it started.
    load_view: LoadView = "shared"
    #: router_client's cost: ``ttft`` (its default: predicted time to first
    #: token; the engines report their prefill rate with their load) or
    #: ``blocks`` (cached blocks against load, weighed by ``balance``).
    cost_model: CostModel = "ttft"
    #: router_client's ``prefill_weight`` (the ttft cost's weight of the
    #: request's own prefill against the queue; 1: predicted TTFT exactly).
    prefill_weight: float = DEFAULT_PREFILL_WEIGHT
    #: router_client's ``private_weight`` (the ttft cost's weight of a prompt's
    #: own part, after the prefix other prompts continue; equal to
    #: ``prefill_weight``: the whole prompt alike).
    private_weight: float = DEFAULT_PRIVATE_WEIGHT
    #: router_client's ``spread_half_life_s`` (workers the ttft cost predicts
    #: equal go to the one a router started the fewest requests on recently;
    #: 0: to the least loaded).
    spread_half_life_s: float = DEFAULT_SPREAD_HALF_LIFE_S
    #: Route-time predictions (cache_shared): each decision records the chosen
    #: engine as about to hold the prompt's blocks for ``prediction_ttl_s``
    #: (virtual seconds), and Matches count them (router_client's
    #: ``predicted_weight``) until the engine's events confirm them. On, as in
    #: router_client.
    predict: bool = True
    prediction_ttl_s: float = 10.0
    #: With predictions: routers count every router's unconfirmed predictions
    #: on an engine as its pending prefill (router_client's ``shared_pending``).
    shared_pending: bool = True


#: Deadline of the routers' calls to an indexer process (``--indexer``,
#: ``--follower``, ``--outage``), in wall milliseconds (see run_policy).
REMOTE_DEADLINE_MS = 1000.0

#: Wall seconds the replay waits for the follower: to apply what the indexer
#: acknowledged before a decision, and to load a snapshot.
CATCH_UP_TIMEOUT_S = 2.0
SYNC_TIMEOUT_S = 60.0


@dataclass(slots=True)
class SharedRun:
    """How one cache_shared run reaches the indexer (``--follower``, ``--outage``)."""

    label: str
    follower: bool = False
    outage: Outage | None = None
    #: The follower holds its last copy while out of sync (IndexFollower.hold_s
    #: at its default; False: hold_s 0, out of sync it answers nothing).
    hold: bool = False
    #: After the restart the engines publish what they hold again (False: they
    #: carry on with their next batches only, and the index starts empty).
    refeed: bool = True
    process: IndexerProcess | None = None


@dataclass(frozen=True, slots=True)
class Utilisation:
    """A fleet's utilisation by resource: prefill seconds and request slots."""

    prefill: float
    slots: float

    @property
    def fleet(self) -> float:
        """The busier resource's utilisation."""
        return max(self.prefill, self.slots)

    def scaled(self, speed: float) -> Utilisation:
        """The same work arriving ``speed`` times faster."""
        return Utilisation(self.prefill * speed, self.slots * speed)


@dataclass(slots=True)
class PolicyResult:
    """Figures of one policy's run."""

    policy: str
    hit_rate: float
    bound_fraction: float
    worker_cv: float
    load_cv: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    reasons: dict[str, int]
    requests_per_worker: list[int]
    seconds: float
    ttft_p99_ms: float = 0.0
    queue_mean_ms: float = 0.0
    queue_p95_ms: float = 0.0
    #: Share of requests whose TTFT is within the SLO.
    goodput: float = 0.0
    #: Prefill seconds this policy caused over the fleet's prefill capacity.
    prefill_util: float = 0.0
    #: Slot seconds (prefill + decode) it caused over the fleet's slots.
    slot_util: float = 0.0
    #: Share of requests arriving before the previous turn of their conversation finished.
    early_turns: float = 0.0
    #: Hit blocks of every request, in trace order.
    request_hits: list[int] = field(default_factory=list, repr=False)
    #: Hit rate of the requests arriving during the outage window, and during
    #: as long a window after it (None without ``--outage``).
    outage_hit_rate: float | None = None
    after_hit_rate: float | None = None
    #: Matches the follower answered, of all the routers' Matches (follower runs).
    follower_matches: int = 0
    matches: int = 0
    #: Decisions made before the follower caught up within the timeout.
    catch_up_timeouts: int = 0
    #: Wall seconds from the indexer's restart to the follower in sync again.
    resync_s: float | None = None
    #: Batches the engines made that the indexer did not take, blocks published again.
    lost_batches: int = 0
    refed_blocks: int = 0
    #: Matches the follower's held copy answered while it was out of sync and
    #: the indexer did not answer (--follower-hold).
    held_matches: int = 0
    #: Decision accounting: the hit rate had every request gone to the engine
    #: holding the longest prefix of it, the share of decisions that took that
    #: longest prefix, and the share of those available blocks not taken.
    available_hit_rate: float = 0.0
    optimal_share: float = 0.0
    left_on_table: float = 0.0
    #: The longest cached prefix any engine held of every request at its
    #: admission, and the engine it went to (index into the fleet), in trace order.
    request_available: list[int] = field(default_factory=list, repr=False)
    request_workers: list[int] = field(default_factory=list, repr=False)
    #: Age of the chosen engine's load report at each decision, mean and p95
    #: (0 when engines report every change; None in the local view: no reports).
    report_age_mean_ms: float | None = 0.0
    report_age_p95_ms: float | None = 0.0
    #: Mean over decisions of |requests in flight on the chosen engine in the
    #: deciding router's view - the real ones|: what staleness costs the view.
    view_gap: float = 0.0

    @property
    def utilisation(self) -> float:
        """The busier resource's utilisation."""
        return max(self.prefill_util, self.slot_util)


@dataclass(slots=True)
class ReplayResult:
    """All policies' figures plus the bounds."""

    settings: ReplaySettings
    requests: int
    pooled_bound: float
    infinite_bound: float
    results: list[PolicyResult]
    #: Utilisation of the trace at ``settings.speed`` on the load basis.
    offered: Utilisation = Utilisation(0.0, 0.0)

    def params(self) -> dict[str, Any]:
        """What was replayed (the ``params`` of ``--json``): settings, requests, policies."""
        return {
            **asdict(self.settings),
            "requests": self.requests,
            "policies": [r.policy for r in self.results],
        }

    def figures(self) -> dict[str, float]:
        """The flat figures of ``--json`` (names fixed by the issue)."""
        out: dict[str, float] = {
            "pooled_bound_hit_rate": self.pooled_bound,
            "infinite_cache_bound": self.infinite_bound,
            "speed": self.settings.speed,
            "offered_utilisation": self.offered.fleet,
            "offered_prefill_utilisation": self.offered.prefill,
            "offered_slot_utilisation": self.offered.slots,
        }
        for r in self.results:
            out[f"{r.policy}_hit_rate"] = r.hit_rate
            out[f"{r.policy}_bound_fraction"] = r.bound_fraction
            out[f"{r.policy}_worker_cv"] = r.worker_cv
            out[f"{r.policy}_load_cv"] = r.load_cv
            out[f"{r.policy}_ttft_p50_ms"] = r.ttft_p50_ms
            out[f"{r.policy}_ttft_p95_ms"] = r.ttft_p95_ms
            out[f"{r.policy}_ttft_p99_ms"] = r.ttft_p99_ms
            out[f"{r.policy}_queue_mean_ms"] = r.queue_mean_ms
            out[f"{r.policy}_queue_p95_ms"] = r.queue_p95_ms
            out[f"{r.policy}_goodput"] = r.goodput
            out[f"{r.policy}_prefill_utilisation"] = r.prefill_util
            out[f"{r.policy}_slot_utilisation"] = r.slot_util
            out[f"{r.policy}_early_turns"] = r.early_turns
            out[f"{r.policy}_available_hit_rate"] = r.available_hit_rate
            out[f"{r.policy}_optimal_share"] = r.optimal_share
            out[f"{r.policy}_left_on_table"] = r.left_on_table
            out[f"{r.policy}_load_view_gap"] = r.view_gap
            if r.report_age_mean_ms is not None and r.report_age_p95_ms is not None:
                out[f"{r.policy}_load_report_age_mean_ms"] = r.report_age_mean_ms
                out[f"{r.policy}_load_report_age_p95_ms"] = r.report_age_p95_ms
            if r.outage_hit_rate is not None and r.after_hit_rate is not None:
                out[f"{r.policy}_outage_window_hit_rate"] = r.outage_hit_rate
                out[f"{r.policy}_after_window_hit_rate"] = r.after_hit_rate
            if r.policy.startswith("cache_shared_"):
                out[f"{r.policy}_lost_batches"] = r.lost_batches
                out[f"{r.policy}_refed_blocks"] = r.refed_blocks
            if r.policy.startswith("cache_shared_follower"):
                out[f"{r.policy}_follower_share"] = (
                    r.follower_matches / r.matches if r.matches else 0.0
                )
                out[f"{r.policy}_catch_up_timeouts"] = r.catch_up_timeouts
            if r.resync_s is not None:
                out[f"{r.policy}_resync_s"] = r.resync_s
            if r.policy.startswith("cache_shared_follower_hold"):
                out[f"{r.policy}_held_matches"] = r.held_matches
        by = {r.policy: r for r in self.results}
        pairs = (
            ("follower_vs_remote", "cache_shared_follower", "cache_shared"),
            ("follower_vs_remote_outage", "cache_shared_follower_outage", "cache_shared_outage"),
            ("follower_outage_vs_remote", "cache_shared_follower_outage", "cache_shared"),
            ("hold_vs_remote_outage", "cache_shared_follower_hold_outage", "cache_shared_outage"),
            ("hold_outage_vs_remote", "cache_shared_follower_hold_outage", "cache_shared"),
        )
        for name, a, b in pairs:
            local, remote = by.get(a), by.get(b)
            if local is None or remote is None:
                continue
            out[f"{name}_hit_ratio"] = local.hit_rate / remote.hit_rate if remote.hit_rate else 0.0
            if local.outage_hit_rate is not None and remote.outage_hit_rate:
                out[f"{name}_window_hit_ratio"] = local.outage_hit_rate / remote.outage_hit_rate
        return out


def trace_keys(trace: Sequence[TraceRequest]) -> list[list[int]]:
    """Block keys of every request (one key computation per distinct trace id)."""
    memo: dict[int, int] = {}
    out = []
    for req in trace:
        keys = []
        for h in req.hash_ids:
            k = memo.get(h)
            if k is None:
                k = memo[h] = trace_block_key(h)
            keys.append(k)
        out.append(keys)
    return out


def bounds(keys: Sequence[Sequence[int]], workers: int, capacity: int) -> tuple[float, float]:
    """(pooled, infinite) hit rates of the stream (see the module docstring)."""
    pooled, inf, _ = bounds_and_hits(keys, workers, capacity)
    return pooled, inf


def bounds_and_hits(
    keys: Sequence[Sequence[int]], workers: int, capacity: int
) -> tuple[float, float, list[int]]:
    """:func:`bounds` and the pooled cache's hit blocks of every request."""
    pooled = pooled_cache([capacity] * workers)
    inf = infinite_cache()
    ps, fs = HitStats(), HitStats()
    hits = []
    for k in keys:
        h = pooled.access(k).hits
        hits.append(h)
        ps.add(len(k), h)
        fs.add(len(k), inf.access(k).hits)
    return ps.hit_rate, fs.hit_rate, hits


def arrival_span_s(trace: Sequence[TraceRequest]) -> float:
    """Seconds from the trace's first arrival to its last (at speed 1)."""
    if len(trace) < 2:
        return 0.0
    return (trace[-1].timestamp - trace[0].timestamp) / 1000.0


def offered_utilisation(
    trace: Sequence[TraceRequest],
    hit_blocks: Sequence[int],
    workers: int,
    service: ServiceModel,
    block_size: int = MOONCAKE_BLOCK_SIZE,
) -> Utilisation:
    """The fleet's utilisation by the trace at speed 1, ``hit_blocks[i]`` of request
    ``i``'s blocks cached (module docstring). Zero for a trace without a span."""
    span = arrival_span_s(trace)
    if span <= 0 or workers <= 0:
        return Utilisation(0.0, 0.0)
    prefill_s = slot_s = 0.0
    for req, hits in zip(trace, hit_blocks, strict=True):
        p = service.prefill_s(max(0, req.input_length - hits * block_size))
        prefill_s += p
        slot_s += p + service.decode_s(req.output_length)
    return Utilisation(
        prefill_s / (workers * span), slot_s / (workers * service.max_running * span)
    )


class LoadFeed:
    """How the engines' load reaches the routers, and how stale it was at each decision.

    ``shared`` with ``period_s`` 0: every change is reported to every router
    at once. ``shared`` with a period: each engine reports to every router
    every ``period_s`` virtual seconds, the engines' phases spread evenly over
    the period (engines are not synchronised), so between two reports a
    router sees the last one plus what it started itself since, and none of
    the other routers' work. ``local``: no reports at all.

    An engine whose load did not change since its last report says the same
    thing at its next ones: its ticks pause until its load changes or a router
    is about to read it (:meth:`catch_up`), and then its latest report is
    delivered with the time it would have had. The routers see what they would
    have seen tick by tick, without a tick per engine every period through a
    trace's idle hours (a trace of requests ten minutes apart took 90 s of
    ticks at 100 ms).
    """

    def __init__(self, routers: Sequence[Router], view: LoadView, period_s: float) -> None:
        self.routers = routers
        self.view = view
        self.period_s = period_s
        #: When each engine last reported (periodic reports).
        self.reported_at: dict[str, float] = {}
        #: Age of the chosen engine's report at every decision (shared view).
        self.ages: list[float] = []
        self._gap = 0.0
        self._gap_samples = 0
        # Periodic reports: the load each engine last reported, the engines
        # whose load changed since, the paused ones (their last tick's time and
        # tick), the clock and the last tick allowed.
        self._said: dict[str, WorkerLoad] = {}
        self._dirty: set[str] = set()
        self._paused: dict[str, tuple[float, Callable[[float], None]]] = {}
        self._sim: VirtualClock | None = None
        self._last = 0.0

    @property
    def periodic(self) -> bool:
        """Whether the engines report on a timer rather than at every change."""
        return self.view == "shared" and self.period_s > 0

    def changed(self, worker: str, load: WorkerLoad, at: float) -> None:
        """An engine's load changed (:attr:`lab.sim.engine.SimEngine.on_load`)."""
        if self.view == "shared" and self.period_s <= 0:
            for r in self.routers:
                r.load.report(worker, load, at)
        elif self.periodic:
            self._dirty.add(worker)
            paused = self._paused.pop(worker, None)
            if paused is not None:
                # The reports it skipped said what it said last: the latest of
                # them goes out, then the ticks go on from it.
                at_tick = self._skipped(worker, paused[0], at)
                nxt = at_tick + self.period_s
                if nxt <= self._last:
                    assert self._sim is not None
                    self._sim.schedule(nxt, paused[1])

    def catch_up(self, now: float) -> None:
        """Before a decision at ``now``: each paused engine's latest report."""
        for worker, (at, tick) in list(self._paused.items()):
            self._paused[worker] = (self._skipped(worker, at, now), tick)

    def _skipped(self, worker: str, last_tick: float, now: float) -> float:
        """Deliver paused ``worker``'s latest tick at or before ``now`` (after
        ``last_tick``, its load unchanged since), and return its time."""
        k = math.floor((now - last_tick) / self.period_s)
        if k < 1:
            return last_tick
        at = last_tick + k * self.period_s
        self._deliver(worker, self._said[worker], at)
        return at

    def _deliver(self, worker: str, load: WorkerLoad, at: float) -> None:
        for r in self.routers:
            r.load.report(worker, load, at)
        self.reported_at[worker] = at
        self._said[worker] = load

    def start(
        self, sim: VirtualClock, fleet: Sequence[SimEngine], first: float, last: float
    ) -> None:
        """Schedule the periodic reports from before ``first`` (every engine has
        reported once by the first arrival) to the last arrival ``last``."""
        if not self.periodic:
            return
        self._sim, self._last = sim, last
        for i, engine in enumerate(fleet):
            at = first - self.period_s * i / len(fleet)
            self._dirty.add(engine.name)
            sim.schedule(at, self._ticker(sim, engine, last))

    def _ticker(self, sim: VirtualClock, engine: SimEngine, last: float) -> Callable[[float], None]:
        name = engine.name

        def tick(at: float) -> None:
            self._deliver(name, engine.load(), at)
            if name not in self._dirty:
                # Nothing changed since the last report: this one said the same,
                # and so would the next ones until it changes (changed) or a
                # router reads it (catch_up).
                self._paused[name] = (at, tick)
                return
            self._dirty.discard(name)
            if at + self.period_s <= last:
                sim.schedule(at + self.period_s, tick)

        return tick

    def observe(self, router: Router, chosen: SimEngine, now: float) -> None:
        """At a decision: the chosen engine's report age, and the gap between the
        requests in flight the router sees on it and the real ones."""
        if self.view == "shared":
            self.ages.append(now - self.reported_at[chosen.name] if self.periodic else 0.0)
        seen = router.load.load(chosen.name).running_requests
        self._gap += abs(seen - chosen.running - len(chosen.waiting))
        self._gap_samples += 1

    def age_ms(self, q: float | None) -> float | None:
        """Mean (``q`` None) or ``q``-quantile report age in ms; None without reports."""
        if self.view == "local":
            return None
        ages = self.ages or [0.0]
        return (sum(ages) / len(ages) if q is None else percentile(ages, q)) * 1000.0

    @property
    def view_gap(self) -> float:
        """Mean |requests in flight seen - real| on the chosen engine over decisions."""
        return self._gap / self._gap_samples if self._gap_samples else 0.0


def cached_prefixes(fleet: Sequence[SimEngine], keys: Sequence[int]) -> list[int]:
    """Each engine's cached prefix of ``keys``, in blocks (read-only lookups: call it
    before the chosen engine admits the request)."""
    return [e.cache.lookup_prefix(keys) for e in fleet]


Chooser = Callable[[int, Router, RouteRequest, Sequence[int]], Awaitable[Choice]]


async def run_policy(
    policy: str,
    trace: Sequence[TraceRequest],
    keys: Sequence[Sequence[int]],
    settings: ReplaySettings,
    pooled_bound: float,
    *,
    on_request: Callable[[int], Awaitable[None]] | None = None,
    previous_turn: Sequence[int | None] | None = None,
    run: SharedRun | None = None,
) -> PolicyResult:
    """Replay the trace through one policy and return its figures.

    ``run`` (cache_shared with ``settings.indexer``): a follower, an outage of
    ``run.process`` (module docstring); the result is labelled ``run.label``.

    ``on_request(i)`` is awaited after the ``i``-th request was routed (tests
    use it to inject faults, e.g. stop the indexer mid-replay).
    ``previous_turn[i]`` is the request before ``i`` in its conversation
    (None for a first turn), for the early-turn share (0 without it).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    t0 = time.perf_counter()
    sim = VirtualClock()
    names = [f"engine-{i:03d}" for i in range(settings.workers)]
    config = RouterConfig(
        model=REPLAY_MODEL,
        balance=settings.balance,
        cost=settings.cost_model,
        prefill_weight=settings.prefill_weight,
        private_weight=settings.private_weight,
        spread_half_life_s=settings.spread_half_life_s,
        prefill_tokens_per_s=settings.service.prefill_tokens_per_s,
        predictions=settings.predict,
        prediction_ttl_ms=max(1, round(settings.prediction_ttl_s * 1000)),
        shared_pending=settings.shared_pending,
    )
    if policy == "cache_shared" and settings.indexer is not None:
        # The replay's clock stands still while a call runs, so a wall-clock
        # deadline only makes decisions depend on the host's load: with 5 ms,
        # the same 600 requests hit 4.9 % on a busy host and 11.0 % on a quiet
        # one (the follower, answering in-process, 8.8 % every time). A call to
        # a stopped indexer still fails at once (connection refused).
        remote = config.indexer.model_copy(update={"deadline_ms": REMOTE_DEADLINE_MS})
        config = config.model_copy(update={"indexer": remote})
    routers = [
        Router(
            config,
            workers=names,
            block_size=MOONCAKE_BLOCK_SIZE,
            seed=settings.seed * 1000 + i,
            clock=lambda: sim.now,
            registry=CollectorRegistry(),
        )
        for i in range(settings.routers)
    ]
    reasons: Counter[str] = Counter()
    finished_by: dict[int, tuple[Router, RouteRequest]] = {}
    feed = LoadFeed(routers, settings.load_view, settings.load_report_s)

    index: MemoryIndex | None = None
    publisher: MemoryPublisher | GrpcPublisher | RefeedPublisher
    channel = None
    follower: IndexFollower | None = None
    follower_channel = None
    shared_grpc = policy == "cache_shared" and settings.indexer is not None
    refeed: RefeedPublisher | None = None
    if shared_grpc and run is not None:
        target = str(settings.indexer)
        channel = grpc.aio.insecure_channel(target, options=RECONNECT_OPTIONS)
        publisher = refeed = RefeedPublisher(channel, REPLAY_MODEL, MOONCAKE_BLOCK_SIZE)
        if run.follower:
            follower_channel = grpc.aio.insecure_channel(
                target, options=[*RECEIVE_OPTIONS, *RECONNECT_OPTIONS]
            )
            follower = IndexFollower(
                channel=follower_channel,
                models=[REPLAY_MODEL],
                hold_s=DEFAULT_HOLD_S if run.hold else 0.0,
            )
            await follower.start()
        for r in routers:
            r.indexer = IndexerClient(
                channel=channel, settings=config.indexer, model=REPLAY_MODEL, follower=follower
            )
    elif shared_grpc:
        channel = grpc.aio.insecure_channel(str(settings.indexer))
        publisher = GrpcPublisher(channel, REPLAY_MODEL)
        for r in routers:
            r.indexer = IndexerClient(channel=channel, settings=config.indexer, model=REPLAY_MODEL)
    else:
        # Virtual time: leases and predictions' ttls run on the replay's clock.
        index = MemoryIndex(clock=lambda: sim.now)
        publisher = MemoryPublisher(index, REPLAY_MODEL)
    if policy == "cache_shared":
        for n in names:
            await publisher.register(n)
    if follower is not None and not await follower.wait_synced(SYNC_TIMEOUT_S):
        raise RuntimeError(f"the follower did not sync within {SYNC_TIMEOUT_S:g} s")
    outage = run.outage if run is not None else None
    process = run.process if run is not None else None
    if outage is not None and process is None:
        raise ValueError("an outage needs the replay's own indexer process")
    t_first = trace[0].timestamp / 1000.0 / settings.speed if trace else 0.0
    down = False
    restarted = False
    timeouts = 0
    resync_s: float | None = None
    broken_at = 0

    publishes = policy == "cache_shared"
    engines = {
        n: SimEngine(
            name=n,
            capacity=settings.capacity,
            block_size=MOONCAKE_BLOCK_SIZE,
            publish=publisher.publish if publishes else _no_publish,
            schedule=sim.schedule,
            on_load=feed.changed,
            on_finish=lambda req, at: _finish(finished_by, finished_at, req, at),
            model=settings.service,
            event_lag_s=settings.event_lag_s if publishes else None,
        )
        for n in names
    }
    fleet = list(engines.values())
    slot = {n: j for j, n in enumerate(names)}
    finished_at = [0.0] * len(trace)
    arrivals = [0.0] * len(trace)
    request_hits = [0] * len(trace)
    available = [0] * len(trace)
    chosen_by = [0] * len(trace)
    optimal = 0
    choose = _chooser(policy, names, settings, index, reasons)
    rng = random.Random(settings.seed)
    stats = HitStats()
    speed = settings.speed
    if trace:
        feed.start(sim, fleet, t_first, trace[-1].timestamp / 1000.0 / speed)
    for i, (treq, k) in enumerate(zip(trace, keys, strict=True)):
        t = treq.timestamp / 1000.0 / speed
        sim.run_until(t)
        if outage is not None and process is not None and run is not None and not restarted:
            if not down and t - t_first >= outage.start_s:
                process.stop()
                down = True
                broken_at = follower.reconnects if follower is not None else 0
            if down and t - t_first >= outage.end_s:
                resync_s = await _restart(run, process, refeed, follower, broken_at)
                down, restarted = False, True
        published = False
        for e in fleet:
            if e.outbox:
                published = True
                await e.flush()
        if follower is not None and refeed is not None and published and not down:
            timeouts += not await _caught_up(follower, refeed.acked)
        ri = rng.randrange(len(routers))
        router = routers[ri]
        rreq = RouteRequest(
            request_id=i,
            input_tokens=treq.input_length,
            max_output_tokens=treq.output_length,
            block_keys=k,
        )
        feed.catch_up(t)
        choice = await choose(ri, router, rreq, k)
        feed.observe(router, engines[choice.worker], t)
        router.started(rreq, choice)
        finished_by[i] = (router, rreq)
        sreq = SimRequest(i, t, k, treq.input_length, treq.output_length)
        prefixes = cached_prefixes(fleet, k)
        hits = await engines[choice.worker].admit(sreq, t)
        stats.add(len(k), hits)
        arrivals[i] = t
        request_hits[i] = hits
        available[i] = max(prefixes)
        chosen_by[i] = slot[choice.worker]
        optimal += hits == available[i]
        if on_request is not None:
            await on_request(i)
    if down and process is not None and run is not None:
        # The outage outlasted the trace: the indexer is started again for the next run.
        resync_s = await _restart(run, process, refeed, follower, broken_at)
    sim.run_until(float("inf"))
    for e in fleet:
        await e.flush()
    for r in routers:
        for (stage, why), count in r.decisions.items():
            if stage == "prefill":
                reasons[why] += count
    follower_matches = matches = 0
    for r in routers:
        if r.indexer is not None:
            follower_matches += r.indexer.follower_matches
            matches += sum(r.indexer.calls.values())
    if follower is not None:
        await follower.close()
    if follower_channel is not None:
        await follower_channel.close()
    if refeed is not None:
        # The next run starts from an empty index.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await refeed.remove_all()
    if channel is not None:
        await publisher.close()
        for r in routers:
            r.indexer = None
        await channel.close()
    end = max(sim.now, 1e-9)
    per_worker = [e.served for e in fleet]
    ttfts = [x for e in fleet for x in e.ttfts] or [0.0]  # 0 for an empty trace
    queued = [x for e in fleet for x in e.queue_delays] or [0.0]
    span = arrival_span_s(trace) / speed
    capacity_s = len(fleet) * span
    early = 0
    if previous_turn is not None:
        early = sum(
            1
            for i, prev in enumerate(previous_turn)
            if prev is not None and arrivals[i] < finished_at[prev]
        )
    hit = stats.hit_rate
    prompt_blocks = sum(len(k) for k in keys)
    offered_hits = sum(available)
    windows: list[float | None] = [None, None]
    window = settings.outage if run is not None else None
    if window is not None:
        spans = ((window.start_s, window.end_s), (window.end_s, window.end_s + window.duration_s))
        for j, (a, b) in enumerate(spans):
            w = HitStats()
            for at, blocks, h in zip(arrivals, keys, request_hits, strict=True):
                if a <= at - t_first < b:
                    w.add(len(blocks), h)
            windows[j] = w.hit_rate
    return PolicyResult(
        policy=run.label if run is not None else policy,
        hit_rate=hit,
        bound_fraction=hit / pooled_bound if pooled_bound else 0.0,
        worker_cv=worker_cv(per_worker),
        load_cv=worker_cv(e.load_area / end for e in fleet),
        ttft_p50_ms=percentile(ttfts, 0.5) * 1000.0,
        ttft_p95_ms=percentile(ttfts, 0.95) * 1000.0,
        reasons=dict(sorted(reasons.items())),
        requests_per_worker=per_worker,
        seconds=time.perf_counter() - t0,
        ttft_p99_ms=percentile(ttfts, 0.99) * 1000.0,
        queue_mean_ms=sum(queued) / len(queued) * 1000.0,
        queue_p95_ms=percentile(queued, 0.95) * 1000.0,
        goodput=sum(1 for x in ttfts if x <= settings.ttft_slo_s) / len(ttfts),
        prefill_util=sum(e.prefill_busy_s for e in fleet) / capacity_s if span > 0 else 0.0,
        slot_util=(
            sum(e.slot_work_s for e in fleet) / (capacity_s * settings.service.max_running)
            if span > 0
            else 0.0
        ),
        early_turns=early / len(trace) if trace else 0.0,
        request_hits=request_hits,
        outage_hit_rate=windows[0],
        after_hit_rate=windows[1],
        follower_matches=follower_matches,
        matches=matches,
        catch_up_timeouts=timeouts,
        resync_s=resync_s,
        lost_batches=refeed.lost if refeed is not None else 0,
        refed_blocks=refeed.refed_blocks if refeed is not None else 0,
        held_matches=follower.held_matches if follower is not None else 0,
        available_hit_rate=offered_hits / prompt_blocks if prompt_blocks else 0.0,
        optimal_share=optimal / len(trace) if trace else 0.0,
        left_on_table=1.0 - sum(request_hits) / offered_hits if offered_hits else 0.0,
        request_available=available,
        request_workers=chosen_by,
        report_age_mean_ms=feed.age_ms(None),
        report_age_p95_ms=feed.age_ms(0.95),
        view_gap=feed.view_gap,
    )


async def _restart(
    run: SharedRun,
    process: IndexerProcess,
    refeed: RefeedPublisher | None,
    follower: IndexFollower | None,
    broken_at: int,
) -> float:
    """Start the indexer again, publish the engines' caches to it, wait for the
    follower's snapshot of the new server (its stream ended after the stop:
    ``reconnects`` past ``broken_at``); the wall seconds from the start to the
    follower in sync."""
    t0 = time.monotonic()
    await process.start()
    if refeed is not None:
        await refeed.refeed(republish=run.refeed)
    if follower is not None:
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while not (follower.synced and follower.reconnects > broken_at):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the follower did not sync within {SYNC_TIMEOUT_S:g} s")
            await asyncio.sleep(0.005)
        if refeed is not None:
            await _caught_up(follower, refeed.acked, SYNC_TIMEOUT_S)
    return time.monotonic() - t0


async def _caught_up(
    follower: IndexFollower, acked: dict[str, int], timeout_s: float = CATCH_UP_TIMEOUT_S
) -> bool:
    """Wait until the follower holds every batch the indexer acknowledged (each
    engine's last sequence); False when it is out of sync or not there in time."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not follower.synced:
            return False
        got = {
            s.spec.instance.worker_id: s.applied_sequence or 0
            for s in await follower.index.list_instances(REPLAY_MODEL)
        }
        if all(got.get(w, 0) >= seq for w, seq in acked.items()):
            return True
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.0005)


async def _no_publish(batch: object) -> None:
    return None


def _finish(
    finished_by: dict[int, tuple[Router, RouteRequest]],
    finished_at: list[float],
    req: SimRequest,
    at: float,
) -> None:
    finished_at[req.id] = at
    router, rreq = finished_by.pop(req.id)
    router.finished(rreq)


def _chooser(
    policy: str,
    names: list[str],
    settings: ReplaySettings,
    index: MemoryIndex | None,
    reasons: Counter[str],
) -> Chooser:
    """The routing function of ``policy`` (see the module docstring)."""
    if policy == "round_robin":
        counters = [0] * settings.routers

        async def rr(ri: int, router: Router, req: RouteRequest, keys: Sequence[int]) -> Choice:
            w = names[counters[ri] % len(names)]
            counters[ri] += 1
            reasons[policy] += 1
            return Choice("prefill", w, policy, "global", 1)

        return rr
    if policy == "random":

        async def rnd(ri: int, router: Router, req: RouteRequest, keys: Sequence[int]) -> Choice:
            reasons[policy] += 1
            return Choice("prefill", router.rng.choice(names), policy, "global", 1)

        return rnd
    if policy == "p2c":

        async def p2c(ri: int, router: Router, req: RouteRequest, keys: Sequence[int]) -> Choice:
            a, b = router.rng.sample(names, 2)
            la = router.load.load(a)
            lb = router.load.load(b)
            ka = la.total_tokens + la.pending_prefill_tokens
            kb = lb.total_tokens + lb.pending_prefill_tokens
            w = a if ka < kb else b if kb < ka else router.rng.choice((a, b))
            reasons[policy] += 1
            return Choice("prefill", w, policy, "global", 1)

        return p2c
    if policy == "cache_local":
        local = [{n: BlockCache(settings.capacity) for n in names} for _ in range(settings.routers)]

        async def loc(ri: int, router: Router, req: RouteRequest, keys: Sequence[int]) -> Choice:
            view = local[ri]
            matches = {}
            for n, cache in view.items():
                d = cache.lookup_prefix(keys)
                if d:
                    matches[n] = WorkerMatch(d, d)
            choice = router.decide(req, MatchOutcome(MatchStatus.OK, matches), decode=False).prefill
            view[choice.worker].insert(keys)
            return choice

        return loc
    if settings.indexer is not None:

        async def remote(ri: int, router: Router, req: RouteRequest, keys: Sequence[int]) -> Choice:
            choice = (await router.route(req, decode=False)).prefill
            # Virtual time stands still for the prediction, as it does for the Match.
            await router.wait_predictions()
            return choice

        return remote
    assert index is not None
    ns = Namespace(REPLAY_MODEL)

    predict = settings.predict
    ttl_s = settings.prediction_ttl_s

    async def shared(ri: int, router: Router, req: RouteRequest, keys: Sequence[int]) -> Choice:
        found = index.match_sync(ns, keys, include_predicted=predict)
        matches = {
            instance_name(m.instance.worker_id, m.instance.dp_rank): WorkerMatch(
                m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks, 0, m.predicted_depth
            )
            for m in found
        }
        pending = None
        if predict:
            # What a Match with include_predicted answers besides (MatchResponse.pending).
            pending = {
                instance_name(i.worker_id, i.dp_rank): n
                for i, n in index.pending_predicted_sync(REPLAY_MODEL).items()
            }
        outcome = MatchOutcome(MatchStatus.OK, matches, pending)
        choice = router.decide(req, outcome, n_blocks=len(keys), decode=False).prefill
        if predict and keys:
            # What router_client's route() sends PredictPlacement for, in process.
            index.predict_sync(
                ns,
                InstanceId(choice.worker, 0),
                keys,
                ttl_s,
                pending_s=pending_ms(choice) / 1000 or None,
            )
        return choice

    return shared


async def run_replay(
    trace: Sequence[TraceRequest],
    settings: ReplaySettings,
    policies: Sequence[str] = POLICIES,
    *,
    on_request: Callable[[str, int], Awaitable[None]] | None = None,
    basis: Utilisation | None = None,
) -> ReplayResult:
    """Replay ``trace`` through each policy; ``on_request(policy, i)`` as in :func:`run_policy`.

    With ``settings.load`` set, the replay runs at the speed that makes the
    trace's utilisation that load on ``settings.load_basis`` (the result's
    ``settings.speed``; the ``p2c`` basis first replays P2C at speed 1 for its
    hits, unless ``basis``, the :func:`basis_utilisation` of the same trace
    and settings, is given); raises ``ValueError`` when the trace has no
    arrival span to scale.
    """
    keys = trace_keys(trace)
    pooled, inf, pooled_hits = bounds_and_hits(keys, settings.workers, settings.capacity)
    previous = previous_turns(trace)
    service, workers = settings.service, settings.workers
    at_one = basis
    if at_one is None and (settings.load is not None or settings.load_basis != "p2c"):
        at_one = await _at_speed_one(trace, keys, settings, pooled, pooled_hits)
    if settings.load is not None:
        assert at_one is not None
        settings = replace(settings, speed=speed_for(settings.load, at_one))
    results = []
    runs = shared_runs(settings)
    process: IndexerProcess | None = None
    with contextlib.ExitStack() as stack:
        if runs and "cache_shared" in policies and settings.indexer is None:
            folder = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmesh-replay-")))
            process = IndexerProcess(folder, MOONCAKE_BLOCK_SIZE)
            stack.callback(process.close)
            await process.start()
            settings = replace(settings, indexer=process.target)
        plain: list[SharedRun | None] = [None]
        for p in policies:
            hook = None if on_request is None else _bind(on_request, p)
            for run in [*runs] or plain if p == "cache_shared" else plain:
                if run is not None:
                    run.process = process
                    hook = None if on_request is None else _bind(on_request, run.label)
                results.append(
                    await run_policy(
                        p,
                        trace,
                        keys,
                        settings,
                        pooled,
                        on_request=hook,
                        previous_turn=previous,
                        run=run,
                    )
                )
    if at_one is None:
        # The p2c basis at the given speed: the run's own P2C hits, or a run for them.
        ran = next((r for r in results if r.policy == "p2c"), None)
        if ran is None:
            ran = await run_policy("p2c", trace, keys, settings, pooled)
        at_one = offered_utilisation(trace, ran.request_hits, workers, service)
    offered = at_one.scaled(settings.speed)
    return ReplayResult(settings, len(trace), pooled, inf, results, offered)


def speed_for(load: float, at_one: Utilisation) -> float:
    """The speed at which a trace of utilisation ``at_one`` at speed 1 is ``load`` busy."""
    if at_one.fleet <= 0:
        raise ValueError("--load needs a trace whose requests span some time")
    return load / at_one.fleet


async def basis_utilisation(trace: Sequence[TraceRequest], settings: ReplaySettings) -> Utilisation:
    """The trace's utilisation at speed 1 on ``settings.load_basis`` (module docstring)."""
    keys = trace_keys(trace)
    pooled, _, pooled_hits = bounds_and_hits(keys, settings.workers, settings.capacity)
    return await _at_speed_one(trace, keys, settings, pooled, pooled_hits)


async def _at_speed_one(
    trace: Sequence[TraceRequest],
    keys: Sequence[Sequence[int]],
    settings: ReplaySettings,
    pooled: float,
    pooled_hits: Sequence[int],
) -> Utilisation:
    """:func:`basis_utilisation` with the keys and the pooled bound already computed."""
    if settings.load_basis == "pooled":
        hits: Sequence[int] = pooled_hits
    elif settings.load_basis == "cold":
        hits = [0] * len(trace)
    else:
        at_one = replace(settings, speed=1.0, load=None)
        hits = (await run_policy("p2c", trace, keys, at_one, pooled)).request_hits
    return offered_utilisation(trace, hits, settings.workers, settings.service)


@dataclass(slots=True)
class HerdingResult:
    """``--herding``: cache_shared at several router counts, each router's load view
    local and shared, all at one speed."""

    settings: ReplaySettings
    pooled_bound: float
    #: (routers, view) -> cache_shared's figures.
    runs: dict[tuple[int, LoadView], PolicyResult]

    def figures(self) -> dict[str, float]:
        """The flat figures of ``--json``: ``herding_R<routers>_<view>_<figure>``."""
        out: dict[str, float] = {"pooled_bound_hit_rate": self.pooled_bound}
        for (n, view), r in self.runs.items():
            pre = f"herding_R{n}_{view}"
            out[f"{pre}_worker_cv"] = r.worker_cv
            out[f"{pre}_load_cv"] = r.load_cv
            out[f"{pre}_ttft_p95_ms"] = r.ttft_p95_ms
            out[f"{pre}_hit_rate"] = r.hit_rate
            out[f"{pre}_goodput"] = r.goodput
            out[f"{pre}_load_view_gap"] = r.view_gap
            if r.report_age_mean_ms is not None and r.report_age_p95_ms is not None:
                out[f"{pre}_load_report_age_mean_ms"] = r.report_age_mean_ms
                out[f"{pre}_load_report_age_p95_ms"] = r.report_age_p95_ms
        return out


async def run_herding(
    trace: Sequence[TraceRequest], settings: ReplaySettings, routers: Sequence[int]
) -> HerdingResult:
    """cache_shared with ``n`` routers for each ``n`` of ``routers``, once with the
    local load view and once with ``settings``' shared one (its report period):
    whether routers that do not see each other's work herd onto the same engines.

    Every run goes at one speed: ``settings.load`` on the load basis with
    ``settings.routers`` routers and the shared view, else ``settings.speed``.
    """
    keys = trace_keys(trace)
    pooled, _, pooled_hits = bounds_and_hits(keys, settings.workers, settings.capacity)
    shared = replace(settings, load_view="shared")
    if settings.load is not None:
        at_one = await _at_speed_one(trace, keys, shared, pooled, pooled_hits)
        shared = replace(shared, speed=speed_for(settings.load, at_one))
    runs: dict[tuple[int, LoadView], PolicyResult] = {}
    for n in routers:
        for view in LOAD_VIEWS[::-1]:
            progress.phase(f"herding: cache_shared, R={n}, {view} load view")
            at = replace(shared, routers=n, load_view=view)
            runs[n, view] = await run_policy("cache_shared", trace, keys, at, pooled)
    return HerdingResult(shared, pooled, runs)


def format_herding(h: HerdingResult) -> str:
    """The table of ``--herding``: request and load CV, TTFT p95 and hit rate per
    router count and view."""
    s = h.settings
    period = "every change" if s.load_report_s <= 0 else f"every {s.load_report_s * 1000:g} ms"
    lines = [
        f"{s.trace}: herding of cache_shared, W={s.workers} workers, {s.capacity} "
        f"blocks/worker, seed {s.seed}, {cost_label(s)}, speed {s.speed:.3g}x"
        + (f" (load {s.load:g} on the {s.load_basis} basis)" if s.load is not None else ""),
        f"local: no engine reports, each router's own bookkeeping; shared: reports {period}",
        "",
        f"{'R':>3} {'view':<7} {'req CV':>7} {'load CV':>8} {'TTFT p95':>9} {'hit':>6} "
        f"{'goodput':>8} {'view gap':>9} {'age p95':>8}",
    ]
    for (n, view), r in h.runs.items():
        age = "-" if r.report_age_p95_ms is None else f"{r.report_age_p95_ms:.0f}ms"
        lines.append(
            f"{n:>3} {view:<7} {r.worker_cv:>7.3f} {r.load_cv:>8.3f} "
            f"{_secs(r.ttft_p95_ms):>9} {r.hit_rate:>6.1%} {r.goodput:>8.1%} "
            f"{r.view_gap:>9.2f} {age:>8}"
        )
    lines.append(
        "(view gap: mean |requests in flight the router sees on the chosen engine - real| "
        "at its decisions; age p95: of that engine's load report)"
    )
    return "\n".join(lines)


def shared_runs(settings: ReplaySettings) -> list[SharedRun]:
    """cache_shared's runs for ``--follower`` and ``--outage`` (none without them):
    remote and follower, each without and with the outage."""
    if not settings.follower and settings.outage is None:
        return []
    modes = [("cache_shared", False)]
    if settings.follower:
        modes.append(("cache_shared_follower", True))
    out = [SharedRun(label, f) for label, f in modes]
    if settings.outage is not None:
        out += [SharedRun(f"{label}_outage", f, settings.outage) for label, f in modes]
        if settings.follower and settings.follower_hold:
            out.append(SharedRun("cache_shared_follower_hold_outage", True, settings.outage, True))
    return out


def previous_turns(trace: Sequence[TraceRequest]) -> list[int | None]:
    """The request before each one in its conversation (None for a first turn), as
    :func:`lab.synth.measure` reads conversations."""
    last: dict[int, int] = {}
    out: list[int | None] = []
    for i, c in enumerate(measure(trace).conversation_of):
        out.append(last.get(c))
        last[c] = i
    return out


def _bind(
    fn: Callable[[str, int], Awaitable[None]], policy: str
) -> Callable[[int], Awaitable[None]]:
    async def hook(i: int) -> None:
        await fn(policy, i)

    return hook


def trace_name(path: str | Path | None) -> str:
    """How the table and the plot name a trace: its file name, or the bundled one."""
    return BUNDLED_TRACE if path is None else Path(path).name


def cost_label(s: ReplaySettings) -> str:
    """The router cost of a replay's header: ``cost ttft`` or ``cost blocks, balance B``,
    and ``predictions`` when on."""
    out = f"cost {s.cost_model}" + (f", balance {s.balance}" if s.cost_model == "blocks" else "")
    if s.predict:
        out += ", predictions" + ("" if s.shared_pending else " (own load only)")
    return out


def format_table(result: ReplayResult) -> str:
    """The policy table printed by ``kvmesh replay``."""
    s = result.settings
    m = s.service
    o = result.offered
    width = max([13, *(len(r.policy) for r in result.results)])
    pace = f"speed {s.speed:.3g}x" + (f" for load {s.load:g}" if s.load is not None else "")
    lines = [
        f"{s.trace}: {result.requests} requests, R={s.routers} routers, W={s.workers} workers, "
        f"{s.capacity} blocks/worker, seed {s.seed}, {cost_label(s)}",
        f"{pace}: utilisation {o.fleet:.2f} on the {s.load_basis} basis (prefill "
        f"{o.prefill:.2f}, slots {o.slots:.2f}); service: prefill "
        f"{m.prefill_tokens_per_s:g} tokens/s, "
        f"decode {m.decode_s_per_token * 1000:g} ms/token, {m.max_running} running; "
        f"events at prefill end + {s.event_lag_s * 1000:g} ms; TTFT SLO {s.ttft_slo_s:g} s",
        f"bounds: pooled LRU ({s.workers}x{s.capacity} blocks) "
        f"{result.pooled_bound:.1%}, infinite cache {result.infinite_bound:.1%}",
        "",
        f"{'policy':<{width}} {'hit':>6} {'of pool':>8} {'avail':>6} {'optimal':>8} "
        f"{'left':>6} {'req CV':>7} {'load CV':>8} {'util':>5} "
        f"{'TTFT p50':>9} {'p95':>7} {'p99':>7} {'queue':>7} {'goodput':>8}  decisions by reason",
    ]
    for r in result.results:
        why = ", ".join(f"{k} {v}" for k, v in r.reasons.items())
        lines.append(
            f"{r.policy:<{width}} {r.hit_rate:>6.1%} {r.bound_fraction:>8.1%} "
            f"{r.available_hit_rate:>6.1%} {r.optimal_share:>8.1%} {r.left_on_table:>6.1%} "
            f"{r.worker_cv:>7.3f} {r.load_cv:>8.3f} {r.utilisation:>5.2f} "
            f"{_secs(r.ttft_p50_ms):>9} {_secs(r.ttft_p95_ms):>7} {_secs(r.ttft_p99_ms):>7} "
            f"{_secs(r.queue_mean_ms):>7} {r.goodput:>8.1%}  {why}"
        )
    early = ", ".join(f"{r.policy} {r.early_turns:.1%}" for r in result.results)
    gaps = ", ".join(f"{r.policy} {r.view_gap:.2f}" for r in result.results)
    lines += [
        "(avail: hit rate had every request gone to the engine holding most of it; optimal: "
        "decisions that took that; left: share of those blocks not taken; util: the busier "
        "of prefill and slots, work caused over the fleet's capacity; queue: mean wait for "
        "the prefill to start; goodput: TTFT within the SLO)",
        f"requests arriving before their conversation's previous turn finished: {early}",
        f"{load_view_line(s, result.results)}; view gap (requests in flight on the "
        f"chosen engine, mean |seen - real|): {gaps}",
    ]
    lines += _shared_lines(result)
    return "\n".join(lines)


def load_view_line(s: ReplaySettings, results: Sequence[PolicyResult]) -> str:
    """What load the routers saw, and the report ages measured at the decisions."""
    if s.load_view == "local":
        return "load view: local (no engine reports, each router's own bookkeeping only)"
    if s.load_report_s <= 0:
        return "load view: shared, every change reported to every router at once"
    ages = ", ".join(
        f"{r.policy} {r.report_age_mean_ms:.0f}/{r.report_age_p95_ms:.0f}"
        for r in results
        if r.report_age_mean_ms is not None and r.report_age_p95_ms is not None
    )
    return (
        f"load view: shared, engines report every {s.load_report_s * 1000:g} ms "
        f"(the chosen engine's report age at decisions, mean/p95 ms: {ages})"
    )


def _shared_lines(result: ReplayResult) -> list[str]:
    """The table's lines for ``--follower`` and ``--outage`` (none without them)."""
    s = result.settings
    runs = [r for r in result.results if r.policy.startswith("cache_shared_")]
    if not runs:
        return []
    out = [""]
    if s.outage is not None:
        o = s.outage
        out.append(
            f"indexer outage from {o.start_s:g} s to {o.end_s:g} s (replay seconds after the "
            f"first arrival); window hit rates: during it, and {o.duration_s:g} s after it"
        )
    shared = [r for r in result.results if r.policy.startswith("cache_shared")]
    width = max(len(r.policy) for r in shared)
    for r in shared:
        parts = [f"{r.policy:<{width}} hit {r.hit_rate:.1%}"]
        if r.outage_hit_rate is not None and r.after_hit_rate is not None:
            parts.append(f"outage window {r.outage_hit_rate:.1%}, after {r.after_hit_rate:.1%}")
        if r.policy.startswith("cache_shared_follower"):
            share = r.follower_matches / r.matches if r.matches else 0.0
            parts.append(f"follower answered {share:.1%} of Matches")
        if r.resync_s is not None:
            parts.append(f"restart to in sync {r.resync_s:.2f} s wall")
        if r.lost_batches:
            parts.append(f"{r.lost_batches} batches lost, {r.refed_blocks} blocks re-published")
        if r.held_matches:
            parts.append(f"{r.held_matches} Matches from the held copy")
        out.append("; ".join(parts))
    figures = result.figures()
    ratios = [
        f"{k} {v:.3f}"
        for k, v in figures.items()
        if k.startswith("follower_vs_remote") and k.endswith("ratio")
    ]
    if ratios:
        out.append("follower / remote: " + ", ".join(ratios))
    return out


def _secs(ms: float) -> str:
    """Milliseconds as a table cell in seconds."""
    return f"{ms / 1000:.2f}s" if ms < 100_000 else f"{ms / 1000:,.0f}s"


def plotting_available() -> bool:
    """Whether :func:`plot` can run: matplotlib imports (checked before a run, not after)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(result: ReplayResult, path: str | Path) -> None:
    """A PNG of four panels per policy: hit rate (with the bounds), request and load CV,
    TTFT p50/p95/p99 (with the SLO) and goodput; the title names the trace and the load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = result.results
    names = [r.policy for r in res]
    xs = list(range(len(names)))
    fig, ((ax1, ax2), (ax3, ax4)) = plt.subplots(2, 2, figsize=(12, 8))
    ax1.bar(names, [r.hit_rate * 100 for r in res], color="tab:blue")
    ax1.axhline(result.pooled_bound * 100, color="tab:green", ls="--", label="pooled bound")
    ax1.axhline(result.infinite_bound * 100, color="tab:gray", ls=":", label="infinite cache")
    ax1.set_ylabel("block hit rate (%)")
    ax1.legend(loc="lower right")
    w = 0.4
    ax2.bar([x - w / 2 for x in xs], [r.worker_cv for r in res], w, label="requests")
    ax2.bar([x + w / 2 for x in xs], [r.load_cv for r in res], w, label="load (in flight)")
    ax2.set_ylabel("CV across workers")
    ax2.legend(loc="upper right")
    w = 0.27
    for j, q in enumerate(("p50", "p95", "p99")):
        values = [getattr(r, f"ttft_{q}_ms") / 1000 for r in res]
        ax3.bar([x + (j - 1) * w for x in xs], values, w, label=q)
    ax3.axhline(result.settings.ttft_slo_s, color="tab:red", ls="--", label="TTFT SLO")
    ax3.set_yscale("log")
    ax3.set_ylabel("TTFT (s)")
    ax3.legend(loc="upper right")
    ax4.bar(names, [r.goodput * 100 for r in res], color="tab:purple")
    ax4.set_ylim(0, 100)
    ax4.set_ylabel(f"goodput (% with TTFT <= {result.settings.ttft_slo_s:g} s)")
    for ax in (ax1, ax2, ax3, ax4):
        ax.set_xticks(xs, names, rotation=20)
    s = result.settings
    fig.suptitle(
        f"{s.trace}: R={s.routers} W={s.workers} capacity={s.capacity} blocks/worker; "
        f"speed {s.speed:.3g}x, utilisation {result.offered.fleet:.2f} on the "
        f"{s.load_basis} basis; event lag {s.event_lag_s * 1000:g} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _herding(
    trace: Sequence[TraceRequest],
    settings: ReplaySettings,
    routers: list[int],
    json_path: str | None,
) -> int:
    """``--herding``: the runs, the table, the report."""
    try:
        result = asyncio.run(run_herding(trace, settings, routers))
    except ValueError as e:
        print(f"kvmesh replay: {e}", file=sys.stderr)
        return 2
    print(format_herding(result))
    if json_path:
        params = {**asdict(result.settings), "requests": len(trace), "herding": routers}
        write_report(json_path, result.figures(), params)
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh replay``."""
    p = argparse.ArgumentParser(
        prog="kvmesh replay",
        description="Replay a trace through routing policies, in virtual time, at a chosen "
        "load: hit rate against the pooled bound, request and load CV, TTFT, queueing "
        "and goodput per policy.",
        formatter_class=HelpFormatter,
    )
    defaults = ServiceModel()
    p.add_argument(
        "trace", nargs="?", default=None, help="Mooncake JSONL trace (default: the bundled one)"
    )
    p.add_argument("--routers", type=int, default=4, help="routers, each its own router_client")
    p.add_argument("--workers", type=int, default=16, help="simulated engines")
    p.add_argument("--capacity", type=int, default=500, help="KV cache blocks per engine")
    p.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help=f"comma-separated routing policies (default: all of {','.join(POLICIES)})",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of router choice and tie-breaks")
    p.add_argument(
        "--balance",
        type=float,
        default=DEFAULT_BALANCE,
        help="cost knob: 0 pure cache affinity .. 1 pure load balance",
    )
    p.add_argument(
        "--cost",
        choices=("ttft", "blocks"),
        default="ttft",
        help="router_client's cost: predicted time to first token (queue plus uncached "
        "prefill at the engine's reported rate; the default), or cached blocks against load "
        "(--balance)",
    )
    p.add_argument(
        "--prefill-weight",
        type=float,
        default=DEFAULT_PREFILL_WEIGHT,
        help="router_client's prefill_weight: the ttft cost's weight of a prompt's uncached "
        "shared prefix against the queue (1: predicted TTFT exactly)",
    )
    p.add_argument(
        "--private-weight",
        type=float,
        default=DEFAULT_PRIVATE_WEIGHT,
        help="router_client's private_weight: the ttft cost's weight of the uncached rest "
        "of the prompt, past the prefix prompts continue in three or more ways (equal to "
        "--prefill-weight: the whole prompt alike)",
    )
    p.add_argument(
        "--own-load-only",
        action="store_true",
        help="with predictions: routers do not count the other routers' unconfirmed "
        "predictions as an engine's pending prefill (router_client's shared_pending off)",
    )
    p.add_argument(
        "--predict",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="route-time predictions (on, as in router_client): each decision marks the "
        "chosen engine as about to hold the prompt until its events confirm it, however "
        "late they come; --no-predict leaves them out",
    )
    p.add_argument(
        "--prediction-ttl-ms",
        type=float,
        default=10_000.0,
        metavar="MS",
        help="how long a prediction lives unconfirmed, replay ms (default 10000: it must "
        "outlast the queue, the prefill and the event lag)",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="replay only the first N requests (default: all)",
    )
    p.add_argument(
        "--load",
        type=float,
        default=None,
        metavar="U",
        help="target fleet utilisation, e.g. 0.5, 0.7, 0.9: sets the speed so that the "
        "service model's busier resource is U busy (default: the trace's own times)",
    )
    p.add_argument(
        "--load-basis",
        choices=LOAD_BASES,
        default="p2c",
        help="whose hits --load counts: P2C's at speed 1 (the cache-blind baseline runs at "
        "the load), the pooled bound's, or none (cold)",
    )
    p.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="divide the trace's arrival times by this (not with --load)",
    )
    p.add_argument(
        "--prefill-tokens-per-s",
        type=float,
        default=defaults.prefill_tokens_per_s,
        help="service model: uncached prompt tokens an engine prefills per second, one "
        "prefill at a time",
    )
    p.add_argument(
        "--decode-ms-per-token",
        type=float,
        default=defaults.decode_s_per_token * 1000.0,
        help="service model: milliseconds per output token of each running request",
    )
    p.add_argument(
        "--max-running",
        type=int,
        default=defaults.max_running,
        help="service model: requests an engine runs at once (the rest queue FIFO)",
    )
    p.add_argument(
        "--event-lag-ms",
        type=float,
        default=0.0,
        help="engines publish a request's KV events this long after its prefill ends",
    )
    p.add_argument(
        "--ttft-slo-s",
        type=float,
        default=DEFAULT_TTFT_SLO_S,
        help="TTFT SLO of goodput, seconds",
    )
    p.add_argument(
        "--load-report-ms",
        type=float,
        default=DEFAULT_LOAD_REPORT_S * 1000,
        metavar="P",
        help="engines report their load to the routers every P ms of virtual time, so a "
        "router sees the others' work up to P ms late (0: at every change)",
    )
    p.add_argument(
        "--load-view",
        choices=LOAD_VIEWS,
        default="shared",
        help="shared: routers get the engines' load reports; local: none, each router "
        "counts only the requests it started",
    )
    p.add_argument(
        "--herding",
        default=None,
        metavar="R,R,...",
        help="instead of the policies: cache_shared at each router count with the local "
        "and the shared load view, all at one speed (e.g. 4,8,16)",
    )
    p.add_argument("--json", dest="json_path", default=None, help="write figures here")
    p.add_argument(
        "--plot",
        dest="plot_path",
        default=None,
        help="write a PNG plot here (needs matplotlib: pip install 'kvmesh[replay]')",
    )
    p.add_argument(
        "--indexer",
        default=None,
        metavar="ADDR",
        help="drive a live indexer at ADDR over gRPC (cache_shared) (default: one in-process)",
    )
    p.add_argument(
        "--follower",
        action="store_true",
        help="run cache_shared also with a follower of the indexer answering Matches in "
        "process (without --indexer: the replay starts kvmesh indexer serve for it)",
    )
    p.add_argument(
        "--follower-hold",
        action="store_true",
        help="with --follower and --outage: one more outage run whose follower holds its "
        "last copy while out of sync (IndexFollower's default hold_s; the other follower "
        "runs set hold_s 0 and answer nothing out of sync)",
    )
    p.add_argument(
        "--outage",
        default=None,
        metavar="START_S:DURATION_S",
        help="run cache_shared also with the indexer killed START_S replay seconds after "
        "the first arrival and restarted, empty, DURATION_S later (not with --indexer: "
        "the replay starts and stops kvmesh indexer serve itself)",
    )
    return p


def check_args(args: argparse.Namespace) -> str | None:
    """What is wrong with the flags, or None."""
    if args.routers < 1 or args.workers < 2 or args.capacity < 0:
        return "need --routers >= 1, --workers >= 2, --capacity >= 0"
    if not 0.0 <= args.balance <= 1.0:
        return "--balance must lie in [0, 1]"
    for flag, value in (
        ("--prefill-weight", args.prefill_weight),
        ("--private-weight", args.private_weight),
    ):
        if not 1.0 <= value <= 100.0:
            return f"{flag} must lie in [1, 100] (router_client's bounds)"
    if args.load is not None and args.load <= 0:
        return "--load must be > 0"
    if args.load is not None and args.speed != 1.0:
        return "give --load or --speed, not both"
    if args.speed <= 0:
        return "--speed must be > 0"
    if args.prefill_tokens_per_s <= 0 or args.decode_ms_per_token < 0 or args.max_running < 1:
        return "need --prefill-tokens-per-s > 0, --decode-ms-per-token >= 0, --max-running >= 1"
    if args.event_lag_ms < 0 or args.ttft_slo_s <= 0:
        return "need --event-lag-ms >= 0 and --ttft-slo-s > 0"
    if args.load_report_ms < 0:
        return "--load-report-ms must be >= 0"
    if args.prediction_ttl_ms <= 0:
        return "--prediction-ttl-ms must be > 0"
    if args.herding is not None:
        try:
            counts = int_list(args.herding)
        except ValueError:
            return f"--herding takes router counts like 4,8,16, not {args.herding!r}"
        if not counts or min(counts) < 1:
            return "--herding needs router counts >= 1"
        if args.follower or args.outage or args.indexer or args.plot_path:
            return (
                "--herding runs the in-process cache_shared only: not with --follower, "
                "--outage, --indexer or --plot"
            )
    if args.follower_hold and not (args.follower and args.outage):
        return "--follower-hold needs --follower and --outage"
    if args.outage is not None:
        if args.indexer is not None:
            return "--outage stops the replay's own indexer: not with --indexer"
        try:
            Outage.parse(args.outage)
        except ValueError as e:
            return str(e)
    return None


def int_list(text: str) -> list[int]:
    """``"4,8,16"`` as integers; raises ``ValueError`` for anything else."""
    return [int(x) for x in text.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh replay`` without the grid; returns the exit code."""
    return run_args(build_parser().parse_args(list(sys.argv[1:] if argv is None else argv)))


def settings_of(args: argparse.Namespace) -> ReplaySettings:
    """The replay's settings from checked flags (:func:`check_args`)."""
    return ReplaySettings(
        routers=args.routers,
        workers=args.workers,
        capacity=args.capacity,
        seed=args.seed,
        balance=args.balance,
        indexer=args.indexer,
        service=ServiceModel(
            prefill_tokens_per_s=args.prefill_tokens_per_s,
            decode_s_per_token=args.decode_ms_per_token / 1000.0,
            max_running=args.max_running,
        ),
        speed=args.speed,
        load=args.load,
        load_basis=args.load_basis,
        event_lag_s=args.event_lag_ms / 1000.0,
        ttft_slo_s=args.ttft_slo_s,
        trace=trace_name(args.trace),
        follower=args.follower,
        follower_hold=args.follower_hold,
        outage=Outage.parse(args.outage) if args.outage is not None else None,
        load_report_s=args.load_report_ms / 1000.0,
        load_view=args.load_view,
        cost_model=args.cost,
        prefill_weight=args.prefill_weight,
        private_weight=args.private_weight,
        predict=args.predict,
        prediction_ttl_s=args.prediction_ttl_ms / 1000.0,
        shared_pending=not args.own_load_only,
    )


def run_args(args: argparse.Namespace) -> int:
    """``kvmesh replay`` on parsed flags: the policies, or ``--herding``."""
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(f"kvmesh replay: unknown policy {bad}; choose from {POLICIES}", file=sys.stderr)
        return 2
    problem = check_args(args)
    if problem is not None:
        print(f"kvmesh replay: {problem}", file=sys.stderr)
        return 2
    if args.plot_path and not plotting_available():
        print(
            "kvmesh replay: --plot needs matplotlib, which is not installed: "
            "pip install 'kvmesh[replay]' (or drop --plot)",
            file=sys.stderr,
        )
        return 2
    try:
        trace = load_mooncake(args.trace, limit=args.limit)
    except (OSError, ValueError) as e:
        print(f"kvmesh replay: {e}", file=sys.stderr)
        return 2
    settings = settings_of(args)
    if args.herding is not None:
        return _herding(trace, settings, int_list(args.herding), args.json_path)
    if (settings.follower or settings.outage) and "cache_shared" not in policies:
        print("kvmesh replay: --follower and --outage run cache_shared", file=sys.stderr)
        return 2
    started: dict[str, float] = {}
    total = len(policies) + max(0, len(shared_runs(settings)) - 1)

    async def report(policy: str, i: int) -> None:
        if policy not in started:
            started[policy] = time.monotonic()
            n = len(started)
            progress.phase(f"{policy} ({n}/{total}): {len(trace):,} requests")
        progress.tick(lambda: f"{policy}: {i + 1:,}/{len(trace):,} requests")

    try:
        result = asyncio.run(run_replay(trace, settings, policies, on_request=report))
    except ValueError as e:
        print(f"kvmesh replay: {e}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.json_path:
        write_report(args.json_path, result.figures(), result.params())
    if args.plot_path:
        plot(result, args.plot_path)
    return 0
