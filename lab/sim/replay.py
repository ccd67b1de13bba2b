"""``kvmesh replay``: a trace through routing policies, in virtual time.

Each trace request arrives at its trace time at one of ``R`` routers (chosen
at random per request with the seed), each router a
:class:`router_client.Router` of its own, and is routed to one of ``W``
simulated engines (:mod:`lab.sim.engine`) by the policy under test:

- ``round_robin``, ``random``, ``p2c`` (power of two choices on the router's
  load view): no cache knowledge;
- ``cache_local``: each router knows only what it routed itself (a per-router
  LRU model of every worker's cache, as SGLang's ``cache_aware`` keeps a
  per-router tree), scored by router_client's cost;
- ``cache_shared``: router_client over the kvmesh indexer, which the engines
  feed with their real KV events (in-process memory backend; ``--indexer
  ADDR`` drives a live indexer over gRPC instead).

Everything runs on one discrete-event queue, so a run is fast and, with the
in-process index, deterministic for a seed. Hit rates count prompt blocks
found cached on the chosen worker; the bounds are one LRU cache of ``W x
capacity`` blocks fed the whole stream in order (pooled) and an unbounded
one (infinite). Worker CV is the coefficient of variation of requests per
worker (load CV: of the time-averaged requests in flight).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import grpc.aio
from prometheus_client import CollectorRegistry

from indexer.memory import MemoryIndex
from indexer.model import Namespace
from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.report import write_report
from lab.sim.clock import VirtualClock
from lab.sim.engine import ServiceModel, SimEngine, SimRequest
from lab.sim.publish import GrpcPublisher, MemoryPublisher
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake, trace_block_key
from router_client.config import DEFAULT_BALANCE, RouterConfig
from router_client.indexer_client import (
    IndexerClient,
    MatchOutcome,
    MatchStatus,
    WorkerMatch,
    instance_name,
)
from router_client.load import WorkerLoad
from router_client.router import Choice, Router, RouteRequest
from tee.cachesim.model import BlockCache, HitStats, infinite_cache, pooled_cache, worker_cv

POLICIES = ("round_robin", "random", "p2c", "cache_local", "cache_shared")

#: Model name the simulated engines register under.
REPLAY_MODEL = "kvmesh-replay"


@dataclass(slots=True)
class ReplaySettings:
    """One replay's parameters (the command-line flags)."""

    routers: int = 4
    workers: int = 16
    capacity: int = 500
    seed: int = 0
    balance: float = DEFAULT_BALANCE
    indexer: str | None = None
    service: ServiceModel = field(default_factory=ServiceModel)


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


@dataclass(slots=True)
class ReplayResult:
    """All policies' figures plus the bounds."""

    settings: ReplaySettings
    requests: int
    pooled_bound: float
    infinite_bound: float
    results: list[PolicyResult]

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
        }
        for r in self.results:
            out[f"{r.policy}_hit_rate"] = r.hit_rate
            out[f"{r.policy}_bound_fraction"] = r.bound_fraction
            out[f"{r.policy}_worker_cv"] = r.worker_cv
            out[f"{r.policy}_ttft_p95_ms"] = r.ttft_p95_ms
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
    pooled = pooled_cache([capacity] * workers)
    inf = infinite_cache()
    ps, fs = HitStats(), HitStats()
    for k in keys:
        ps.add(len(k), pooled.access(k).hits)
        fs.add(len(k), inf.access(k).hits)
    return ps.hit_rate, fs.hit_rate


Chooser = Callable[[int, Router, RouteRequest, Sequence[int]], Awaitable[Choice]]


async def run_policy(
    policy: str,
    trace: Sequence[TraceRequest],
    keys: Sequence[Sequence[int]],
    settings: ReplaySettings,
    pooled_bound: float,
    *,
    on_request: Callable[[int], Awaitable[None]] | None = None,
) -> PolicyResult:
    """Replay the trace through one policy and return its figures.

    ``on_request(i)`` is awaited after the ``i``-th request was routed (tests
    use it to inject faults, e.g. stop the indexer mid-replay).
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r} (choose from {', '.join(POLICIES)})")
    t0 = time.perf_counter()
    sim = VirtualClock()
    names = [f"engine-{i:03d}" for i in range(settings.workers)]
    config = RouterConfig(model=REPLAY_MODEL, balance=settings.balance)
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

    def on_load(worker: str, load: WorkerLoad, at: float) -> None:
        for r in routers:
            r.load.report(worker, load, at)

    index: MemoryIndex | None = None
    publisher: MemoryPublisher | GrpcPublisher
    channel = None
    shared_grpc = policy == "cache_shared" and settings.indexer is not None
    if shared_grpc:
        channel = grpc.aio.insecure_channel(str(settings.indexer))
        publisher = GrpcPublisher(channel, REPLAY_MODEL)
        for r in routers:
            r.indexer = IndexerClient(channel=channel, settings=config.indexer, model=REPLAY_MODEL)
    else:
        index = MemoryIndex()
        publisher = MemoryPublisher(index, REPLAY_MODEL)
    if policy == "cache_shared":
        for n in names:
            await publisher.register(n)

    engines = {
        n: SimEngine(
            name=n,
            capacity=settings.capacity,
            block_size=MOONCAKE_BLOCK_SIZE,
            publish=publisher.publish if policy == "cache_shared" else _no_publish,
            schedule=sim.schedule,
            on_load=on_load,
            on_finish=lambda req, at: _finish(finished_by, req),
            model=settings.service,
        )
        for n in names
    }
    choose = _chooser(policy, names, settings, index, reasons)
    rng = random.Random(settings.seed)
    stats = HitStats()
    for i, (treq, k) in enumerate(zip(trace, keys, strict=True)):
        t = treq.timestamp / 1000.0
        sim.run_until(t)
        ri = rng.randrange(len(routers))
        router = routers[ri]
        rreq = RouteRequest(
            request_id=i,
            input_tokens=treq.input_length,
            max_output_tokens=treq.output_length,
            block_keys=k,
        )
        choice = await choose(ri, router, rreq, k)
        router.started(rreq, choice)
        finished_by[i] = (router, rreq)
        sreq = SimRequest(i, t, k, treq.input_length, treq.output_length)
        hits = await engines[choice.worker].admit(sreq, t)
        stats.add(len(k), hits)
        if on_request is not None:
            await on_request(i)
    sim.run_until(float("inf"))
    for r in routers:
        for (stage, why), count in r.decisions.items():
            if stage == "prefill":
                reasons[why] += count
    if channel is not None:
        await publisher.close()
        for r in routers:
            r.indexer = None
        await channel.close()
    end = max(sim.now, 1e-9)
    per_worker = [engines[n].served for n in names]
    ttfts = [x for n in names for x in engines[n].ttfts] or [0.0]  # 0 for an empty trace
    hit = stats.hit_rate
    return PolicyResult(
        policy=policy,
        hit_rate=hit,
        bound_fraction=hit / pooled_bound if pooled_bound else 0.0,
        worker_cv=worker_cv(per_worker),
        load_cv=worker_cv(engines[n].load_area / end for n in names),
        ttft_p50_ms=percentile(ttfts, 0.5) * 1000.0,
        ttft_p95_ms=percentile(ttfts, 0.95) * 1000.0,
        reasons=dict(sorted(reasons.items())),
        requests_per_worker=per_worker,
        seconds=time.perf_counter() - t0,
    )


async def _no_publish(batch: object) -> None:
    return None


def _finish(finished_by: dict[int, tuple[Router, RouteRequest]], req: SimRequest) -> None:
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
            return (await router.route(req, decode=False)).prefill

        return remote
    assert index is not None
    ns = Namespace(REPLAY_MODEL)

    async def shared(ri: int, router: Router, req: RouteRequest, keys: Sequence[int]) -> Choice:
        found = index.match_sync(ns, keys)
        matches = {
            instance_name(m.instance.worker_id, m.instance.dp_rank): WorkerMatch(
                m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks
            )
            for m in found
        }
        outcome = MatchOutcome(MatchStatus.OK, matches)
        return router.decide(req, outcome, n_blocks=len(keys), decode=False).prefill

    return shared


async def run_replay(
    trace: Sequence[TraceRequest],
    settings: ReplaySettings,
    policies: Sequence[str] = POLICIES,
    *,
    on_request: Callable[[str, int], Awaitable[None]] | None = None,
) -> ReplayResult:
    """Replay ``trace`` through each policy; ``on_request(policy, i)`` as in :func:`run_policy`."""
    keys = trace_keys(trace)
    pooled, inf = bounds(keys, settings.workers, settings.capacity)
    results = []
    for p in policies:
        hook = None if on_request is None else _bind(on_request, p)
        results.append(await run_policy(p, trace, keys, settings, pooled, on_request=hook))
    return ReplayResult(settings, len(trace), pooled, inf, results)


def _bind(
    fn: Callable[[str, int], Awaitable[None]], policy: str
) -> Callable[[int], Awaitable[None]]:
    async def hook(i: int) -> None:
        await fn(policy, i)

    return hook


def format_table(result: ReplayResult) -> str:
    """The policy table printed by ``kvmesh replay``."""
    s = result.settings
    lines = [
        f"{result.requests} requests, R={s.routers} routers, W={s.workers} workers, "
        f"{s.capacity} blocks/worker, seed {s.seed}, balance {s.balance}",
        f"bounds: pooled LRU ({s.workers}x{s.capacity} blocks) "
        f"{result.pooled_bound:.1%}, infinite cache {result.infinite_bound:.1%}",
        "",
        f"{'policy':<13} {'hit':>6} {'of pool':>8} {'req CV':>7} {'load CV':>8} "
        f"{'TTFT p50':>9} {'TTFT p95':>9}  decisions by reason",
    ]
    for r in result.results:
        why = ", ".join(f"{k} {v}" for k, v in r.reasons.items())
        lines.append(
            f"{r.policy:<13} {r.hit_rate:>6.1%} {r.bound_fraction:>8.1%} {r.worker_cv:>7.3f} "
            f"{r.load_cv:>8.3f} {r.ttft_p50_ms:>7.0f}ms {r.ttft_p95_ms:>7.0f}ms  {why}"
        )
    return "\n".join(lines)


def plotting_available() -> bool:
    """Whether :func:`plot` can run: matplotlib imports (checked before a run, not after)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def plot(result: ReplayResult, path: str | Path) -> None:
    """Bar charts of hit rate (with the bounds) and Worker CV per policy, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r.policy for r in result.results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.bar(names, [r.hit_rate * 100 for r in result.results], color="tab:blue")
    ax1.axhline(result.pooled_bound * 100, color="tab:green", ls="--", label="pooled bound")
    ax1.axhline(result.infinite_bound * 100, color="tab:gray", ls=":", label="infinite cache")
    ax1.set_ylabel("block hit rate (%)")
    ax1.legend(loc="lower right")
    ax2.bar(names, [r.worker_cv for r in result.results], color="tab:orange")
    ax2.set_ylabel("Worker CV (requests per worker)")
    s = result.settings
    fig.suptitle(f"R={s.routers} W={s.workers} capacity={s.capacity} blocks/worker")
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh replay``."""
    p = argparse.ArgumentParser(
        prog="kvmesh replay",
        description="Replay a trace through routing policies, in virtual time.",
        formatter_class=HelpFormatter,
    )
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
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="replay only the first N requests (default: all)",
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh replay``; returns the exit code."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    bad = [p for p in policies if p not in POLICIES]
    if bad or not policies:
        print(f"kvmesh replay: unknown policy {bad}; choose from {POLICIES}", file=sys.stderr)
        return 2
    if args.routers < 1 or args.workers < 2 or args.capacity < 0:
        print(
            "kvmesh replay: need --routers >= 1, --workers >= 2, --capacity >= 0", file=sys.stderr
        )
        return 2
    if not 0.0 <= args.balance <= 1.0:
        print("kvmesh replay: --balance must lie in [0, 1]", file=sys.stderr)
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
    settings = ReplaySettings(
        routers=args.routers,
        workers=args.workers,
        capacity=args.capacity,
        seed=args.seed,
        balance=args.balance,
        indexer=args.indexer,
    )
    started: dict[str, float] = {}

    async def report(policy: str, i: int) -> None:
        if policy not in started:
            started[policy] = time.monotonic()
            n = len(started)
            progress.phase(f"{policy} ({n}/{len(policies)}): {len(trace):,} requests")
        progress.tick(lambda: f"{policy}: {i + 1:,}/{len(trace):,} requests")

    result = asyncio.run(run_replay(trace, settings, policies, on_request=report))
    print(format_table(result))
    if args.json_path:
        write_report(args.json_path, result.figures(), result.params())
    if args.plot_path:
        plot(result, args.plot_path)
    return 0
