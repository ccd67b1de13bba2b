"""``kvmesh bench indexer``: ingest, Match latency and throughput, for both backends.

The index is built from the bundled Mooncake conversation trace, spread over
64 instances (sticky per conversation, see :mod:`indexer.workload`), through
the streaming publish call. For each backend (memory; redis on a private
``redis-server`` started by :class:`kvmesh.redisproc.RedisProcess`) an indexer
server runs in a child process, so the server has a core of its own and the
client's Python work does not share its interpreter, as in a deployment.

Prompts: 32-block prompts are the first 32 keys of trace requests with at
least 32 blocks (2,859 of them; each chain is held whole by the instance that
served it, and block 0 by every instance, so a Match walks 32 blocks and
returns up to 64 instances). The trace's longest request has 247 blocks, so
256-block prompts are its longest requests extended with keys nobody holds:
the walk covers every held block and stops at the first unknown one.

With ``--cluster`` the redis backend also runs against a private 3-master
Redis Cluster (:class:`kvmesh.redisproc.RedisClusterProcess`): ``cluster_*``
figures, with round trips counted over every master and the largest master's
share of all keys after the build.

Every latency figure has its floor measured in the same run: ``Ping`` on the
same server, which does no work. Figures are printed as one table with
targets, and written with ``--json FILE`` as ``{"figures": ..., "params": ...}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from indexer.config import IndexerConfig, Limits, RedisSettings
from indexer.workload import (
    TRACE_MODEL,
    PublishPlan,
    make_instances,
    match_request,
    percentile,
    plan_publish,
    publish_plan,
    register_all,
    sample_prompts,
)
from kvmesh.configfile import merge
from kvmesh.indexer.v1 import indexer_pb2 as pb
from kvmesh.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.tls import ChannelFactory, ClientTLS
from kvmesh.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake


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


def _serve_child(backend: str, redis_url: str, overrides: str = "") -> int:
    """Child process: serve, print ``PORT n``, stop when stdin closes."""
    from indexer.server import start_server
    from kvmesh.runtime import new_event_loop

    async def run() -> None:
        config = server_config(backend, redis_url, json.loads(overrides) if overrides else None)
        server = await start_server(config)
        print(f"PORT {server.port}", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
        await server.stop(0)

    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        runner.run(run())
    return 0


class ServerChild:
    """An indexer server in a child process (context manager); ``target`` to dial.

    ``overrides`` go over :func:`server_config` (e.g. ``tls``, ``auth``, ``limits``).
    """

    def __init__(
        self, backend: str, redis_url: str = "", overrides: Mapping[str, Any] | None = None
    ) -> None:
        self._args = [sys.executable, "-m", "indexer.bench", "--serve", backend]
        if redis_url:
            self._args += ["--redis-url", redis_url]
        if overrides:
            self._args += ["--server-config", json.dumps(overrides)]
        self._proc: subprocess.Popen[str] | None = None
        self.target = ""
        self.pid = 0

    def __enter__(self) -> ServerChild:
        self._proc = subprocess.Popen(
            self._args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self._proc.stdout is not None
        line = self._proc.stdout.readline()
        if not line.startswith("PORT "):
            self.__exit__()
            raise RuntimeError(f"indexer server did not start (got {line!r})")
        self.target = f"127.0.0.1:{int(line.split()[1])}"
        self.pid = self._proc.pid
        return self

    def cpu_seconds(self) -> float | None:
        """CPU time (user + system, every thread) the server has used so far; None off Linux."""
        try:
            stat = Path(f"/proc/{self.pid}/stat").read_text()
        except OSError:
            return None
        fields = stat.rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def __exit__(self, *exc: object) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            end_child(proc)


def end_child(proc: subprocess.Popen[str]) -> None:
    """Close a child's stdin (its signal to stop), wait up to 15 s, else kill it."""
    if proc.stdin is not None and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


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
    for path in sorted((Path(__file__).parent / "lua").glob("*.lua")):
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
    from indexer.convert import batch_from_pb
    from indexer.memory import MemoryIndex
    from indexer.model import InstanceId, InstanceSpec, Namespace

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


# -- report -----------------------------------------------------------------------

#: (row label, memory figure, redis figure, unit, target text, check(memory, redis)).
_Row = tuple[str, str | None, str | None, str, str]

_ROWS: tuple[_Row, ...] = (
    ("ingest, stream publish", "memory_ingest_blocks_per_s", "redis_ingest_blocks_per_s",
     "blocks/s", "mem >= 200k, redis >= 100k"),
    ("Match p50, 32 blocks", "memory_grpc_match_p50_us", "redis_grpc_match_p50_us",
     "µs", "mem <= 1.2x empty rpc, redis <= 1000"),
    ("Match p99, 32 blocks", "memory_grpc_match_p99_us", "redis_grpc_match_p99_us",
     "µs", "redis <= 3000"),
    ("Match p50, 256 blocks", "memory_grpc_match_256_p50_us", "redis_grpc_match_256_p50_us",
     "µs", ""),
    ("Match p99, 256 blocks", "memory_grpc_match_256_p99_us", "redis_grpc_match_256_p99_us",
     "µs", ""),
    ("empty rpc (Ping) p50", "memory_grpc_empty_rpc_p50_us", "redis_grpc_empty_rpc_p50_us",
     "µs", "the floor"),
    ("Match p50 / empty rpc p50", "memory_match_over_empty_rpc", "redis_match_over_empty_rpc",
     "x", "mem <= 1.2"),
    ("Matches/s, concurrent", "memory_grpc_matches_per_s", "redis_grpc_matches_per_s",
     "1/s", ""),
    ("Match p50, in-process", "memory_inproc_match_p50_us", None, "µs", ""),
    ("Redis round trips / Match", None, "redis_roundtrips_per_match", "", "== 1"),
    ("Redis commands / Match", None, "redis_commands_per_match", "", "incl. inside the script"),
    ("Redis bytes / (block, inst)", None, "redis_bytes_per_block_instance", "B", ""),
)  # fmt: skip


class ClusterClient:
    """The few calls the benchmark makes on Redis, summed over a cluster's masters."""

    def __init__(self, ports: Sequence[int]) -> None:
        import redis

        self._nodes = [redis.Redis(host="127.0.0.1", port=p) for p in ports]

    def info(self, section: str) -> dict[str, Any]:
        """``INFO section`` of every master, numbers summed field by field."""
        out: dict[str, Any] = {}
        for node in self._nodes:
            for k, v in node.info(section).items():
                if k == "cmdstat_info":
                    continue  # our own INFO calls, one per master, are no Match's
                if isinstance(v, dict):
                    acc = out.setdefault(k, {})
                    for f, x in v.items():
                        if isinstance(x, (int, float)):
                            acc[f] = acc.get(f, 0) + x
                elif isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
        return out

    def key_share_max(self) -> float:
        """Largest master's share of all keys (DBSIZE)."""
        sizes = [int(node.dbsize()) for node in self._nodes]
        return max(sizes) / max(1, sum(sizes))

    def close(self) -> None:
        """Close every connection."""
        for node in self._nodes:
            node.close()


def root_tag_share_max(trace: Sequence[TraceRequest], masters: int = 3) -> float:
    """Largest master's share of block keys if chains were tagged by their root
    block (anchor depth 0), with slots split evenly as ``--cluster create`` does."""
    from redis.crc import key_slot

    from indexer.keys import anchor_tag
    from kvmesh.traces import trace_block_key

    counts = [0] * masters
    for key in {
        trace_block_key(h): trace_block_key(r.hash_ids[0]) for r in trace for h in r.hash_ids
    }.items():
        counts[key_slot(b"{" + anchor_tag(key[1]) + b"}") * masters // 16384] += 1
    return max(counts) / max(1, sum(counts))


def format_cluster(f: dict[str, float]) -> str:
    """The Redis Cluster rows of a ``--cluster`` run."""
    rows = (
        ("Match p50, 32 blocks", "cluster_grpc_match_p50_us", "µs", "", True),
        ("Match p99, 32 blocks", "cluster_grpc_match_p99_us", "µs", "", True),
        ("Matches/s, concurrent", "cluster_grpc_matches_per_s", "1/s", "", True),
        ("ingest, stream publish", "cluster_ingest_blocks_per_s", "blocks/s", "", True),
        ("round trips / Match", "cluster_roundtrips_per_match", "", "== 1",
         f.get("cluster_roundtrips_per_match") == 1.0),
        ("largest shard's key share", "cluster_shard_key_share_max", "", "<= 0.5 (3 shards)",
         f.get("cluster_shard_key_share_max", 1.0) <= 0.5),
        ("  same, root-block tags", "cluster_shard_key_share_root_tag", "", "for comparison", True),
        ("bytes / (block, inst)", "cluster_bytes_per_block_instance", "B", "", True),
    )  # fmt: skip
    head = f"{'redis cluster, 3 masters':<28} {'value':>11} {'unit':<9} {'target':<20} {'':<5}"
    lines = [head, "-" * len(head)]
    for label, name, unit, target, ok in rows:
        verdict = ("pass" if ok else "SHORT") if target and target[0] in "=<" else ""
        lines.append(f"{label:<28} {fmt(f.get(name)):>11} {unit:<9} {target:<20} {verdict:<5}")
    return "\n".join(lines)


def _checks(f: dict[str, float]) -> dict[str, list[bool]]:
    """Per row label, whether each target holds (a row without a target has none)."""
    out: dict[str, list[bool]] = {}

    def add(label: str, ok: bool) -> None:
        out.setdefault(label, []).append(ok)

    if "memory_ingest_blocks_per_s" in f:
        add("ingest, stream publish", f["memory_ingest_blocks_per_s"] >= 200_000)
        add("Match p50 / empty rpc p50", f["memory_match_over_empty_rpc"] <= 1.2)
        add("Match p50, 32 blocks", f["memory_match_over_empty_rpc"] <= 1.2)
    if "redis_ingest_blocks_per_s" in f:
        add("ingest, stream publish", f["redis_ingest_blocks_per_s"] >= 100_000)
        add("Match p50, 32 blocks", f["redis_grpc_match_p50_us"] <= 1000)
        add("Match p99, 32 blocks", f["redis_grpc_match_p99_us"] <= 3000)
        add("Redis round trips / Match", f["redis_roundtrips_per_match"] == 1.0)
    return out


def fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v >= 1000:
        return f"{v:,.0f}"
    if v >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def format_table(figures: dict[str, float]) -> str:
    """The one table of a run: both backends side by side, targets and verdicts."""
    checks = _checks(figures)
    head = f"{'figure':<28} {'memory':>11} {'redis':>11} {'unit':<9} {'target':<38} {'':<5}"
    lines = [head, "-" * len(head)]
    for label, mem, red, unit, target in _ROWS:
        mv = figures.get(mem) if mem else None
        rv = figures.get(red) if red else None
        verdict = ""
        if label in checks:
            verdict = "pass" if all(checks[label]) else "SHORT"
        lines.append(f"{label:<28} {fmt(mv):>11} {fmt(rv):>11} {unit:<9} {target:<38} {verdict:<5}")
    return "\n".join(lines)


# -- entry point ------------------------------------------------------------------


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


def run_bench(
    params: BenchParams, backends: Sequence[str], cluster: bool = False
) -> tuple[dict[str, float], dict[str, Any]]:
    """Run the benchmark; return ``(figures, params)`` as written to JSON."""
    work = Workload.load(params)
    trace, plan, prompts32, prompts256 = work.trace, work.plan, work.prompts32, work.prompts256
    figures: dict[str, float] = {}
    extra: dict[str, Any] = {}
    if "memory" in backends:
        figures["memory_inproc_match_p50_us"] = inproc_match_p50(
            plan, prompts32, params.inproc_calls
        )
        bench_backend("memory", plan, prompts32, prompts256, params, figures, extra)
        figures["grpc_empty_rpc_p50_us"] = figures["memory_grpc_empty_rpc_p50_us"]
    if "redis" in backends:
        import redis

        from kvmesh.redisproc import RedisProcess

        with RedisProcess() as rp:
            client = redis.Redis.from_url(rp.url)
            try:
                bench_backend(
                    "redis", plan, prompts32, prompts256, params, figures, extra, rp.url, client
                )
            finally:
                client.close()
        figures.setdefault("grpc_empty_rpc_p50_us", figures["redis_grpc_empty_rpc_p50_us"])
    if cluster:
        from kvmesh.redisproc import RedisClusterProcess

        with RedisClusterProcess() as rc:
            cc = ClusterClient(rc.ports)
            try:
                bench_backend(
                    "cluster", plan, prompts32, prompts256, params, figures, extra, rc.url, cc
                )
            finally:
                cc.close()
        figures["cluster_shard_key_share_root_tag"] = root_tag_share_max(trace)
        extra["cluster"] = "3 masters, no replicas, anchor depth 1 (RedisSettings default)"
    run_params = {**work.describe(params), "roundtrip_calls": params.roundtrip_calls, **extra}
    return figures, run_params


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench indexer``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench indexer",
        description="Indexer benchmark on the Mooncake conversation trace, memory and redis.",
    )
    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    p.add_argument("--requests", type=int, help="trace requests to publish (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures")
    p.add_argument(
        "--backend", choices=("memory", "redis", "both"), default="both", help="default both"
    )
    p.add_argument(
        "--cluster", action="store_true", help="also run redis against a local 3-master cluster"
    )
    p.add_argument(
        "--floor", action="store_true", help="instead: the empty-RPC floor under gRPC variants"
    )
    p.add_argument(
        "--tls", action="store_true", help="instead: plaintext vs mTLS vs mTLS + client limits"
    )
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    p.add_argument("--server-config", default="", help=argparse.SUPPRESS)
    args, rest = p.parse_known_args(argv)
    if args.serve:
        return _serve_child(args.serve, args.redis_url, args.server_config)
    if args.floor:
        from indexer import bench_floor

        return bench_floor.main(rest + (["--json", args.json_path] if args.json_path else []))
    if args.tls:
        from indexer import bench_tls

        flags = (["--quick"] if args.quick else []) + (
            ["--requests", str(args.requests)] if args.requests is not None else []
        )
        return bench_tls.main(rest + flags + (["--json", args.json_path] if args.json_path else []))
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    params = QUICK_PARAMS if args.quick else DEFAULT_PARAMS
    if args.requests is not None:
        if args.requests < 1:
            p.error("--requests must be >= 1")
        params = BenchParams(**{**_asdict(params), "requests": args.requests})
    backends = ("memory", "redis") if args.backend == "both" else (args.backend,)
    t0 = time.perf_counter()
    figures, run_params = run_bench(params, backends, args.cluster)
    bad = [k for k, v in figures.items() if not math.isfinite(v)]
    print(
        f"kvmesh bench indexer: {run_params['requests']:,} requests, "
        f"{run_params['blocks_published']:,} blocks over {params.instances} instances, "
        f"{os.cpu_count()} cpus, {time.perf_counter() - t0:.0f} s"
    )
    print(format_table(figures))
    if args.cluster:
        print(format_cluster(figures))
    if args.json_path:
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump({"figures": figures, "params": run_params}, fh, indent=2, sort_keys=True)
            fh.write("\n")
    return 1 if bad else 0


def _asdict(params: BenchParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in BenchParams.__slots__}


if __name__ == "__main__":
    raise SystemExit(main())
