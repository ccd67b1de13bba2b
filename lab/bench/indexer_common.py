"""What every indexer benchmark shares: sizes, the server in a child process, the measurements.

:class:`ServerChild` runs an indexer server (:func:`server_config` with
overrides: TLS, authorization, limits) in a child process of its own
(:class:`lab.children.ChildProcess`, ``python -m lab.bench.indexer_common
--serve BACKEND``), so the server has a core of its own and the client's
Python work does not share its interpreter, as in a deployment.
:func:`bench_backend` runs every gRPC measurement against one such server;
:class:`Workload` is what a run publishes and asks. ``kvmesh bench indexer``
(:mod:`lab.bench.indexer`) and its ``--tls`` runs (:mod:`lab.bench.tls`)
are built on these.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc

from indexer.config import IndexerConfig, Limits, RedisSettings
from indexer.convert import batch_from_pb
from indexer.memory import MemoryIndex
from indexer.model import InstanceId, InstanceSpec, Namespace
from indexer.redis.scripts import LUA_DIR
from indexer.server import start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.configfile import merge
from kvmesh.stats import percentile
from kvmesh.tls import ChannelFactory, ClientTLS
from lab.children import ChildProcess, python_module, serve_until_told
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake
from lab.workload import (
    TRACE_MODEL,
    PublishPlan,
    make_instances,
    match_request,
    plan_publish,
    publish_plan,
    register_all,
    sample_prompts,
)


@dataclass(frozen=True, slots=True)
class BenchParams:
    """Sizes of one benchmark run."""

    requests: int | None  # trace requests published (None: all 12,031)
    instances: int = 64
    requests_per_batch: int = 8
    latency_calls: int = 2000  # sequential Matches (and as many Pings) per prompt size
    latency_calls_256: int = 500
    roundtrip_calls: int = 1000  # Matches counted in Redis commandstats
    concurrency: int = 32  # in-flight Matches for the throughput figure
    throughput_s: float = 3.0
    inproc_calls: int = 5000


DEFAULT_PARAMS = BenchParams(requests=None)
#: Small enough for a test run in a few seconds; the figures are only indicative.
QUICK_PARAMS = BenchParams(
    requests=600,
    latency_calls=200,
    latency_calls_256=50,
    roundtrip_calls=200,
    concurrency=8,
    throughput_s=0.3,
    inproc_calls=500,
)


def server_config(
    backend: str, redis_url: str = "", overrides: Mapping[str, Any] | None = None
) -> IndexerConfig:
    """Config of the benchmarked server, with ``overrides`` (nested: tls, auth...) on top.

    Background work that would touch Redis during a measurement (health pings,
    reaping) is pushed out to an hour: it is not what a figure measures, and
    it would add commands to the round-trip count.
    """
    config = IndexerConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=0,
        backend="memory" if backend == "memory" else "redis",
        redis=(
            RedisSettings(url=redis_url, cluster=backend == "cluster")
            if redis_url
            else RedisSettings()
        ),
        model_block_sizes={TRACE_MODEL: MOONCAKE_BLOCK_SIZE},
        limits=Limits(max_match_blocks=4096, max_concurrent_rpcs=0),
        reap_interval_s=3600.0,
        health_check_interval_s=3600.0,
        log_level="WARNING",
    )
    if not overrides:
        return config
    return IndexerConfig.model_validate(merge(config.model_dump(), overrides))


def serve_child(backend: str, redis_url: str, overrides: str = "") -> int:
    """Child process of :class:`ServerChild`: serve, announce the port, stop when told."""

    config = server_config(backend, redis_url, json.loads(overrides) if overrides else None)
    return serve_until_told(lambda: start_server(config), lambda server: server.stop(0))


class ServerChild:
    """An indexer server in a child process (context manager); ``target`` to dial.

    ``overrides`` go over :func:`server_config` (e.g. ``tls``, ``auth``, ``limits``).
    """

    def __init__(
        self, backend: str, redis_url: str = "", overrides: Mapping[str, Any] | None = None
    ) -> None:
        args = ["--serve", backend]
        if redis_url:
            args += ["--redis-url", redis_url]
        if overrides:
            args += ["--server-config", json.dumps(overrides)]
        self.child = ChildProcess(
            python_module("lab.bench.indexer_common", *args), name="indexer server", pipes=True
        )
        self.target = ""
        self.pid = 0

    def __enter__(self) -> ServerChild:
        self.child.start()
        try:
            port = int(self.child.wait_line())
        except BaseException:
            self.child.stop()
            raise
        self.target = f"127.0.0.1:{port}"
        self.pid = self.child.pid or 0
        return self

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, every thread) the server has used so far; None off Linux."""
        return self.child.cpu_seconds()

    def __exit__(self, *exc: object) -> None:
        self.child.stop()


# -- measurements -----------------------------------------------------------------


def interleaved_latency(
    stub: pb_grpc.IndexerServiceStub, reqs: Sequence[pb.MatchRequest], calls: int
) -> tuple[list[float], list[float]]:
    """Sequential Match and Ping latencies (µs), alternating call by call.

    Alternating makes both see the same machine state (noisy neighbours,
    frequency changes), so their ratio is fair.
    """
    ping = pb.PingRequest()
    for i in range(max(50, calls // 10)):
        stub.Match(reqs[i % len(reqs)])
        stub.Ping(ping)
    clock = time.perf_counter_ns
    m: list[float] = []
    p: list[float] = []
    for i in range(calls):
        t0 = clock()
        stub.Match(reqs[i % len(reqs)])
        t1 = clock()
        stub.Ping(ping)
        t2 = clock()
        m.append((t1 - t0) / 1000)
        p.append((t2 - t1) / 1000)
    return m, p


async def _throughput(
    target: str,
    reqs: Sequence[pb.MatchRequest],
    concurrency: int,
    seconds: float,
    tls: ClientTLS | None = None,
) -> float:
    async with ChannelFactory(target, tls, what="bench").channel() as channel:
        stub = pb_grpc.IndexerServiceStub(channel)
        for r in reqs[:concurrency]:
            await stub.Match(r)
        done = 0
        stop_at = 0.0

        async def worker(k: int) -> None:
            nonlocal done
            i = k
            while time.perf_counter() < stop_at:
                await stub.Match(reqs[i % len(reqs)])
                done += 1
                i += concurrency

        t0 = time.perf_counter()
        stop_at = t0 + seconds
        await asyncio.gather(*(worker(k) for k in range(concurrency)))
        return done / (time.perf_counter() - t0)


def match_throughput(
    target: str,
    reqs: Sequence[pb.MatchRequest],
    concurrency: int,
    seconds: float,
    tls: ClientTLS | None = None,
) -> float:
    """Matches per second with ``concurrency`` calls in flight from one grpc.aio client."""
    return asyncio.run(_throughput(target, reqs, concurrency, seconds, tls))


async def _build(target: str, plan: PublishPlan, tls: ClientTLS | None = None) -> float:
    """Register the plan's instances and publish it; return the publish seconds."""
    async with ChannelFactory(target, tls, what="bench").channel() as channel:
        stub = pb_grpc.IndexerServiceStub(channel)
        await register_all(stub, plan.instances)
        return await publish_plan(stub, plan)


def _commandstats(client: Any) -> dict[str, int]:
    raw: dict[str, dict[str, Any]] = client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in raw.items()}


#: Commands that run a server-side script: each is one round trip from a client.
SCRIPT_ENTRY_COMMANDS = frozenset({"eval", "evalsha", "eval_ro", "evalsha_ro", "fcall", "fcall_ro"})


def script_called_commands() -> frozenset[str]:
    """Commands the backend's Lua scripts call (``redis.call('X', ...)``), lower case.

    Redis counts a command a script runs in ``commandstats`` like a client's
    command, so these are taken out of a round-trip count.
    """
    found: set[str] = set()
    for path in sorted(LUA_DIR.glob("*.lua")):
        found.update(m.lower() for m in _REDIS_CALL.findall(path.read_text(encoding="utf-8")))
    return frozenset(found)


_REDIS_CALL = re.compile(r"redis\.p?call\(\s*['\"]([A-Za-z_|]+)['\"]")


def count_roundtrips(
    client: Any, stub: pb_grpc.IndexerServiceStub, reqs: Sequence[pb.MatchRequest], calls: int
) -> tuple[float, float, dict[str, int]]:
    """Redis round trips and commands per Match, from ``INFO commandstats`` deltas.

    Runs ``calls`` Matches between two snapshots. The second INFO counts the
    first one, which is taken out. A round trip is a command a client sent:
    script entries (EVALSHA...) plus any command that no backend script calls;
    commands that scripts call are counted as run inside a script. Returns
    ``(round trips per match, commands per match, per-command delta)``.
    """
    before = _commandstats(client)
    for i in range(calls):
        stub.Match(reqs[i % len(reqs)])
    after = _commandstats(client)
    delta = {k: v - before.get(k, 0) for k, v in after.items()}
    delta["info"] = delta.get("info", 0) - 1
    delta = {k: v for k, v in delta.items() if v > 0}
    in_scripts = script_called_commands()
    trips = sum(v for k, v in delta.items() if k in SCRIPT_ENTRY_COMMANDS or k not in in_scripts)
    return trips / calls, sum(delta.values()) / calls, delta


def inproc_match_p50(plan: PublishPlan, prompts: Sequence[Sequence[int]], calls: int) -> float:
    """p50 (µs) of ``MemoryIndex.match`` called directly, no gRPC, same index content."""

    async def run() -> float:
        index = MemoryIndex()
        for inst in plan.instances:
            await index.register(
                InstanceSpec(InstanceId(inst.worker_id), TRACE_MODEL, inst.address, 600.0)
            )
        for batches in plan.batches.values():
            for req in batches:
                await index.apply(batch_from_pb(req.batch))
        ns = Namespace(TRACE_MODEL)
        keys = [list(p) for p in prompts]
        for i in range(min(calls, 200)):
            await index.match(ns, keys[i % len(keys)])
        clock = time.perf_counter_ns
        lat: list[float] = []
        for i in range(calls):
            t0 = clock()
            await index.match(ns, keys[i % len(keys)])
            lat.append((clock() - t0) / 1000)
        return percentile(lat, 0.5)

    return asyncio.run(run())


# -- one backend ------------------------------------------------------------------


def bench_backend(
    backend: str,
    plan: PublishPlan,
    prompts32: Sequence[Sequence[int]],
    prompts256: Sequence[Sequence[int]],
    params: BenchParams,
    figures: dict[str, float],
    extra: dict[str, Any],
    redis_url: str = "",
    redis_client: Any = None,
    *,
    label: str = "",
    server: Mapping[str, Any] | None = None,
    engine_tls: ClientTLS | None = None,
    router_tls: ClientTLS | None = None,
    probe: Callable[[str], dict[str, float]] | None = None,
) -> None:
    """Run every gRPC measurement against one backend; add its figures.

    Figures are named ``<label>_...`` (default: the backend). ``server`` goes
    over the server's config (:class:`ServerChild`); the index is published
    with ``engine_tls`` and read (Match, Ping, GetStats) with ``router_tls``
    (None: plaintext). ``probe(target)``, last, adds figures of its own.
    """
    name = label or backend
    reqs32 = [match_request(k) for k in prompts32]
    reqs256 = [match_request(k) for k in prompts256]
    with ServerChild(backend, redis_url, server) as srv:
        mem_before = int(redis_client.info("memory")["used_memory"]) if redis_client else 0
        publish_s = asyncio.run(_build(srv.target, plan, engine_tls))
        figures[f"{name}_ingest_blocks_per_s"] = plan.blocks / publish_s
        with ChannelFactory(srv.target, router_tls, what="bench").sync_channel() as channel:
            stub = pb_grpc.IndexerServiceStub(channel)
            stats = stub.GetStats(pb.GetStatsRequest())
            extra[f"{name}_block_instances"] = stats.block_instances
            if redis_client is not None:
                used = int(redis_client.info("memory")["used_memory"]) - mem_before
                figures[f"{name}_bytes_per_block_instance"] = used / max(1, stats.block_instances)
                if backend == "cluster":
                    figures["cluster_shard_key_share_max"] = redis_client.key_share_max()
            m32, ping = interleaved_latency(stub, reqs32, params.latency_calls)
            m256, ping256 = interleaved_latency(stub, reqs256, params.latency_calls_256)
            resp = stub.Match(reqs32[0])
            extra[f"{name}_instances_per_32_block_match"] = len(resp.matches)
            if redis_client is not None:
                rt, cmds, per_cmd = count_roundtrips(
                    redis_client, stub, reqs32, params.roundtrip_calls
                )
                figures[f"{name}_roundtrips_per_match"] = rt
                figures[f"{name}_commands_per_match"] = cmds
                extra[f"{name}_commands_during_matches"] = per_cmd
        figures[f"{name}_grpc_match_p50_us"] = percentile(m32, 0.5)
        figures[f"{name}_grpc_match_p99_us"] = percentile(m32, 0.99)
        figures[f"{name}_grpc_match_256_p50_us"] = percentile(m256, 0.5)
        figures[f"{name}_grpc_match_256_p99_us"] = percentile(m256, 0.99)
        figures[f"{name}_grpc_empty_rpc_p50_us"] = percentile(ping + ping256, 0.5)
        figures[f"{name}_grpc_empty_rpc_p99_us"] = percentile(ping + ping256, 0.99)
        cpu0 = srv.cpu_seconds()
        rate = match_throughput(
            srv.target, reqs32, params.concurrency, params.throughput_s, router_tls
        )
        cpu1 = srv.cpu_seconds()
        figures[f"{name}_grpc_matches_per_s"] = rate
        if cpu0 is not None and cpu1 is not None:
            # The run's Matches: the timed ones plus one warm-up per worker.
            calls = rate * params.throughput_s + params.concurrency
            figures[f"{name}_server_cpu_us_per_match"] = (cpu1 - cpu0) * 1e6 / calls
        figures[f"{name}_match_over_empty_rpc"] = (
            figures[f"{name}_grpc_match_p50_us"] / figures[f"{name}_grpc_empty_rpc_p50_us"]
        )
        if probe is not None:
            figures.update({f"{name}_{k}": v for k, v in probe(srv.target).items()})


# -- what a run publishes and asks ------------------------------------------------


@dataclass(frozen=True, slots=True)
class Workload:
    """What a run publishes and asks: trace requests, their publish plan, the prompts."""

    trace: list[TraceRequest]
    plan: PublishPlan
    prompts32: list[list[int]]
    prompts256: list[list[int]]

    @classmethod
    def load(cls, params: BenchParams) -> Workload:
        """The workload of ``params`` (trace prefix, instances, batching)."""
        trace = load_mooncake(limit=params.requests)
        instances = make_instances(params.instances)
        plan = plan_publish(trace, instances, requests_per_batch=params.requests_per_batch)
        return cls(trace, plan, sample_prompts(trace, 32, 256), sample_prompts(trace, 256, 64))

    def describe(self, params: BenchParams) -> dict[str, Any]:
        """The run parameters every indexer benchmark writes to its JSON."""
        return {
            "trace": "mooncake_conversation_trace",
            "requests": len(self.trace),
            "instances": params.instances,
            "assignment": "sticky per conversation (hash of the second block id)",
            "blocks_published": self.plan.blocks,
            "batches": self.plan.batch_count,
            "requests_per_batch": params.requests_per_batch,
            "publish_streams": len(self.plan.batches),
            "block_size": MOONCAKE_BLOCK_SIZE,
            "prompts_32": len(self.prompts32),
            "prompts_256": len(self.prompts256),
            "prompt_method": "32: first 32 keys of requests with >= 32 blocks; 256: longest "
            "requests extended with unheld keys",
            "latency_calls": params.latency_calls,
            "latency_calls_256": params.latency_calls_256,
            "latency_client": "grpc blocking stub, one call in flight, Match and Ping alternating",
            "throughput_client": f"grpc.aio, {params.concurrency} calls in flight, one process",
            "throughput_s": params.throughput_s,
            "server": "indexer.server in a child process (grpc.aio on uvloop)",
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "grpcio": grpc.__version__,
        }


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the server child (``--serve BACKEND``) of :class:`ServerChild`."""
    p = argparse.ArgumentParser(prog="python -m lab.bench.indexer_common")
    p.add_argument("--serve", required=True, help="backend: memory, redis or cluster")
    p.add_argument("--redis-url", default="")
    p.add_argument("--server-config", default="", help="JSON overrides of server_config")
    args = p.parse_args(argv)
    return serve_child(args.serve, args.redis_url, args.server_config)


if __name__ == "__main__":
    raise SystemExit(main())
