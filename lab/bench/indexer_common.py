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
import contextlib
import functools
import json
import os
import platform
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import msgpack  # type: ignore[import-untyped]
import zmq
import zmq.asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer.config import IndexerConfig, Limits, RedisSettings
from indexer.convert import batch_from_pb
from indexer.memory import MemoryIndex
from indexer.model import InstanceId, InstanceSpec, Namespace
from indexer.redis.scripts import LUA_DIR
from indexer.server import start_server
from kvmesh import progress
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.configfile import merge
from kvmesh.stats import percentile
from kvmesh.tls import ChannelFactory, ClientTLS
from lab.children import ChildProcess, announce_ready, python_module, serve_until_told
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake, trace_block_key
from lab.workload import (
    TRACE_MODEL,
    PublishPlan,
    ReplayInstance,
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
    #: Engines (ZMQ PUB + ROUTER replay pairs) of the "Match during ingest" figures.
    zmq_publishers: int = 64
    #: Seconds between two probe rounds (a Match and a Ping; a health check every
    #: fifth round) while the ZMQ ingest runs: 100 Matches/s, a router's steady
    #: trickle, light next to the ingest itself.
    probe_interval_s: float = 0.01
    #: Longest a ZMQ ingest round may take before the run gives up on it.
    zmq_timeout_s: float = 300.0


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
    zmq_publishers=8,
    zmq_timeout_s=30.0,
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
        progress.phase(f"{name}: publishing {plan.blocks:,} blocks")
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
            progress.phase(f"{name}: Match latency")
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
        progress.phase(f"{name}: Match throughput for {params.throughput_s:g} s")
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


# -- Match during ZMQ ingest -------------------------------------------------------
#
# Engines publish with vLLM's ZMQ wire (PUB [topic, 8-byte big-endian seq,
# msgpack batch], ROUTER replay answering [b"", start] with [b"", seq, payload]
# frames and an end marker of seq -1) from a child process of their own; the
# indexer child subscribes to every one of them (engine_events.endpoints) and
# ingests with its own ZMQ subscribers, the path gRPC publishing does not take.

#: Topic the benchmark's engines publish on.
ZMQ_TOPIC = b"kv"
#: The replay stream's end marker: seq -1, 8 signed big-endian bytes.
_REPLAY_END = (-1).to_bytes(8, "big", signed=True)
#: Send high-water mark of an engine's PUB socket: vLLM's default (100,000
#: batches), so that a burst waits in the queues instead of being dropped.
_ENGINE_SNDHWM = 100_000
#: Seconds between two polls of ListInstances that tell whether a round has
#: been ingested. A full round takes about 0.3 s, so the end is seen 5 ms late
#: on average (2 %); each poll costs the server about 0.1 ms, so the polls
#: take about 1 % of it, in both rounds alike.
_DONE_POLL_S = 0.01
#: Ingest rounds of one run, alternately without probes and with them (even
#: rounds quiet, odd rounds probed). A round takes about 0.4 s here, so the
#: rate of one round swings by a tenth and more with what else the machine
#: does in it (one quiet and one probed round gave a ratio of 0.96 in one run
#: and 0.59 in another); each figure pools its kind's rounds.
ZMQ_ROUNDS = 6


def zmq_round_probed(r: int) -> bool:
    """Whether ingest round ``r`` runs while a client probes (the odd ones)."""
    return r % 2 == 1


def zmq_round_model(r: int) -> str:
    """Model (namespace) of ingest round ``r``: each round fills a namespace of its own."""
    return f"{TRACE_MODEL}-zmq{r}"


def zmq_plan(
    trace: Sequence[TraceRequest], publishers: int, requests_per_batch: int, r: int
) -> PublishPlan:
    """What the engines of round ``r`` publish: the trace over ``publishers`` instances."""
    instances = [
        ReplayInstance(f"zmq{r}-engine-{i:03d}", f"http://zmq{r}-engine-{i:03d}:8000")
        for i in range(publishers)
    ]
    return plan_publish(trace, instances, requests_per_batch=requests_per_batch)


def vllm_payload(batch: pb.EventBatch) -> bytes:
    """One batch in vLLM's msgpack wire (map form, as current vLLM encodes it).

    Engine hashes are the trace's block keys (the indexer subscribes with
    ``keys=engine_hashes``), so Match asks with the keys the gRPC figures use.
    """
    events = []
    for ev in batch.events:
        st = ev.stored
        parent = trace_block_key(st.parent_block_hash) if st.HasField("parent_block_hash") else None
        events.append(
            {
                "type": "BlockStored",
                "block_hashes": list(st.block_keys),
                "parent_block_hash": parent,
                "token_ids": [],
                "block_size": st.block_size,
                "lora_id": None,
                "medium": "GPU",
                "lora_name": None,
            }
        )
    return bytes(msgpack.packb({"ts": time.time(), "events": events, "data_parallel_rank": 0}))


class _Engine:
    """One engine's publisher (child side): PUB socket, ROUTER replay, the batches to send."""

    def __init__(self, ctx: zmq.asyncio.Context, worker_id: str, payloads: list[bytes]) -> None:
        self.worker_id = worker_id
        self.payloads = payloads
        self.sent = 0  # batches published so far: the replay buffer holds exactly these
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, _ENGINE_SNDHWM)
        self.pub.bind("tcp://127.0.0.1:*")
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind("tcp://127.0.0.1:*")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)

    async def serve_replay(self) -> None:
        """Answer replay requests from the batches sent so far."""
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for seq in range(start, self.sent):
                await self.router.send_multipart(
                    [ident, b"", seq.to_bytes(8, "big"), self.payloads[seq]]
                )
            await self.router.send_multipart([ident, b"", _REPLAY_END, b""])

    def close(self) -> None:
        """Close both sockets."""
        self.pub.close(linger=0)
        self.router.close(linger=0)


async def _stream(engines: Sequence[_Engine]) -> None:
    """Publish every engine's batches as fast as they go, engines interleaved."""
    longest = max((len(e.payloads) for e in engines), default=0)
    for k in range(longest):
        for e in engines:
            if k < len(e.payloads):
                await e.pub.send_multipart([ZMQ_TOPIC, k.to_bytes(8, "big"), e.payloads[k]])
                e.sent = k + 1
        await asyncio.sleep(0)  # let replay requests in between


def publish_child(requests: int | None, publishers: int, requests_per_batch: int) -> int:
    """Child process of :class:`EnginesChild`: bind every engine, announce them, publish on cue.

    Prints ``READY [[round, worker_id, endpoint, replay_endpoint], ...]``, then
    for each ``go R`` line on stdin publishes round R and prints ``SENT R``;
    exits when stdin closes.
    """

    async def run() -> None:
        ctx = zmq.asyncio.Context()
        trace = load_mooncake(limit=requests)
        rounds: list[list[_Engine]] = []
        for r in range(ZMQ_ROUNDS):
            plan = zmq_plan(trace, publishers, requests_per_batch, r)
            rounds.append(
                [
                    _Engine(
                        ctx,
                        inst.worker_id,
                        [vllm_payload(b.batch) for b in plan.batches.get(inst.worker_id, [])],
                    )
                    for inst in plan.instances
                ]
            )
        every = [e for engines in rounds for e in engines]
        tasks = [asyncio.create_task(e.serve_replay()) for e in every]
        announce_ready(
            json.dumps(
                [
                    [r, e.worker_id, e.endpoint, e.replay_endpoint]
                    for r, engines in enumerate(rounds)
                    for e in engines
                ]
            )
        )
        loop = asyncio.get_running_loop()
        try:
            while line := await loop.run_in_executor(None, sys.stdin.readline):
                cmd, _, arg = line.strip().partition(" ")
                if cmd == "go":
                    await _stream(rounds[int(arg)])
                    print(f"SENT {arg}", flush=True)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for e in every:
                e.close()
            ctx.term()

    asyncio.run(run())
    return 0


class EnginesChild:
    """The engines' publishers in a child process (context manager).

    ``endpoints`` are ``(round, worker_id, endpoint, replay_endpoint)``;
    :meth:`go` has round R published, :meth:`wait_sent` waits until it was.
    """

    def __init__(self, params: BenchParams) -> None:
        args = ["--publish", "--publishers", str(params.zmq_publishers)]
        args += ["--requests-per-batch", str(params.requests_per_batch)]
        if params.requests is not None:
            args += ["--requests", str(params.requests)]
        self.child = ChildProcess(
            python_module("lab.bench.indexer_common", *args), name="zmq engines", pipes=True
        )
        self.endpoints: list[tuple[int, str, str, str]] = []

    def __enter__(self) -> EnginesChild:
        self.child.start()
        try:
            self.endpoints = [tuple(e) for e in json.loads(self.child.wait_line())]
        except BaseException:
            self.child.stop()
            raise
        return self

    def go(self, r: int) -> None:
        """Have round ``r`` published (returns at once)."""
        self.child.send_line(f"go {r}")

    def wait_sent(self, r: int, timeout_s: float) -> None:
        """Wait until the child says round ``r`` is published."""
        while self.child.wait_line(timeout_s, word="SENT") != str(r):
            pass

    def __exit__(self, *exc: object) -> None:
        self.child.stop()


@dataclass(slots=True)
class _Probes:
    """Open-loop probes: every interval a Match and a Ping, a health check every fifth.

    Each probe is its own call, sent on time whether or not the earlier ones
    were answered, so a stalled server shows as long latencies, not as fewer
    samples.
    """

    stub: pb_grpc.IndexerServiceAsyncStub
    health: health_pb2_grpc.HealthStub
    reqs: Sequence[pb.MatchRequest]
    interval_s: float
    timeout_s: float
    match_ms: list[float] = field(default_factory=list)
    ping_ms: list[float] = field(default_factory=list)
    health_ms: list[float] = field(default_factory=list)
    _calls: set[asyncio.Task[None]] = field(default_factory=set)

    async def _timed(self, out: list[float], call: Callable[[], Any]) -> None:
        t0 = time.perf_counter()
        await call()
        out.append((time.perf_counter() - t0) * 1000)

    def _spawn(self, out: list[float], call: Callable[[], Any]) -> None:
        task = asyncio.create_task(self._timed(out, call))
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def run(self, stop: asyncio.Event) -> None:
        """Probe until ``stop`` is set, then wait for every answer."""
        ping, check = pb.PingRequest(), health_pb2.HealthCheckRequest()
        t, k = time.perf_counter(), 0
        while not stop.is_set():
            req = self.reqs[k % len(self.reqs)]
            timeout = self.timeout_s
            self._spawn(self.match_ms, functools.partial(self.stub.Match, req, timeout=timeout))
            self._spawn(self.ping_ms, functools.partial(self.stub.Ping, ping, timeout=timeout))
            if k % 5 == 0:
                self._spawn(
                    self.health_ms, functools.partial(self.health.Check, check, timeout=timeout)
                )
            k += 1
            t += self.interval_s
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), max(0.0, t - time.perf_counter()))
        await asyncio.gather(*self._calls)


async def _ingest_round(
    stub: pb_grpc.IndexerServiceAsyncStub,
    engines: EnginesChild,
    r: int,
    plan: PublishPlan,
    timeout_s: float,
    probes: _Probes | None,
) -> float:
    """Have round ``r`` published and wait until the indexer applied all of it; the seconds."""
    last = {w: len(b) - 1 for w, b in plan.batches.items() if b}
    req = pb.ListInstancesRequest(model=zmq_round_model(r))
    stop = asyncio.Event()
    t0 = time.perf_counter()
    engines.go(r)
    probing = asyncio.create_task(probes.run(stop)) if probes is not None else None
    try:
        while True:
            resp = await stub.ListInstances(req, timeout=timeout_s)
            seqs = {
                i.instance.worker_id: i.applied_sequence
                for i in resp.instances
                if i.has_applied_sequence
            }
            if all(seqs.get(w, -1) >= s for w, s in last.items()):
                break
            if time.perf_counter() - t0 > timeout_s:
                raise TimeoutError(f"ZMQ ingest round {r} not done after {timeout_s:.0f} s")
            await asyncio.sleep(_DONE_POLL_S)
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        if probing is not None:
            await probing
    engines.wait_sent(r, timeout_s)
    return elapsed


async def _zmq_rounds(
    srv: ServerChild,
    engines: EnginesChild,
    plans: Sequence[PublishPlan],
    prompts: Sequence[Sequence[int]],
    params: BenchParams,
) -> tuple[list[float], list[float | None], _Probes, float | None]:
    """Every round: their seconds, the server's CPU seconds in each, the probes
    of the probed rounds together; then the server's CPU seconds a second of
    probing costs without ingest (None where its CPU time cannot be read)."""
    async with grpc.aio.insecure_channel(srv.target) as channel:
        stub = pb_grpc.IndexerServiceStub(channel)
        want = len(engines.endpoints)
        deadline = time.perf_counter() + params.zmq_timeout_s
        # Every subscriber registers its instance once its engine's socket connects.
        while len((await stub.ListInstances(pb.ListInstancesRequest())).instances) < want:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"fewer than {want} ZMQ subscribers connected")
            await asyncio.sleep(_DONE_POLL_S)
        # The SUB sockets' subscriptions reach the publishers just after the connect.
        await asyncio.sleep(0.3)
        probes = _Probes(
            stub,
            health_pb2_grpc.HealthStub(channel),
            [],
            params.probe_interval_s,
            params.zmq_timeout_s,
        )
        seconds: list[float] = []
        cpu: list[float | None] = []
        for r, plan in enumerate(plans):
            probed = None
            if zmq_round_probed(r):
                # Probes ask for the namespace the round is filling.
                probes.reqs = [match_request(k, model=zmq_round_model(r)) for k in prompts]
                probed = probes
            before = srv.cpu_seconds()
            seconds.append(
                await _ingest_round(stub, engines, r, plan, params.zmq_timeout_s, probed)
            )
            after = srv.cpu_seconds()
            cpu.append(None if before is None or after is None else after - before)
        # The probes alone, as long as a probed round: what serving them costs
        # the server, which a probed round's ingest shares one interpreter with.
        alone = _Probes(
            stub,
            health_pb2_grpc.HealthStub(channel),
            probes.reqs,
            params.probe_interval_s,
            params.zmq_timeout_s,
        )
        span = sum(seconds[r] for r in range(len(plans)) if zmq_round_probed(r))
        span /= max(1, sum(zmq_round_probed(r) for r in range(len(plans))))
        stop = asyncio.Event()
        before = srv.cpu_seconds()
        probing = asyncio.create_task(alone.run(stop))
        await asyncio.sleep(span)
        stop.set()
        await probing
        after = srv.cpu_seconds()
        probe_cpu = None if before is None or after is None else (after - before) / span
        return seconds, cpu, probes, probe_cpu


def bench_zmq_ingest(
    trace: Sequence[TraceRequest],
    prompts: Sequence[Sequence[int]],
    params: BenchParams,
    figures: dict[str, float],
    extra: dict[str, Any],
) -> None:
    """Match, Ping and health latency while the memory backend ingests from ZMQ engines.

    ``params.zmq_publishers`` engines in a child process publish the trace
    (:func:`zmq_plan`) at full speed into an indexer child subscribed to all
    of them, :data:`ZMQ_ROUNDS` times: the even rounds alone, the odd ones
    while a client probes (:class:`_Probes`). Adds
    ``memory_zmq_ingest_blocks_per_s`` (the quiet rounds' blocks over their
    seconds), ``memory_ingest_during_probe_blocks_per_s`` (the probed
    rounds'), the server's CPU time per block in each kind
    (``..._server_cpu_us_per_block``), the probes'
    ``memory_{match,ping,health}_during_ingest_p{50,99}_ms`` and, in the run's
    params, each round's rate. A last round runs the probes alone:
    ``memory_probe_server_cpu_share`` is the server's CPU share serving them
    takes, and ``memory_ingest_during_probe_net_cpu_us_per_block`` the probed
    rounds' CPU per block less it (the ingest's own, to set against the quiet
    rounds': what giving way to calls costs the ingest).
    """
    progress.phase("memory: Match during ZMQ ingest")
    plans = [
        zmq_plan(trace, params.zmq_publishers, params.requests_per_batch, r)
        for r in range(ZMQ_ROUNDS)
    ]
    with EnginesChild(params) as engines:
        endpoints = [
            {
                "worker_id": worker,
                "model": zmq_round_model(r),
                "address": f"http://{worker}:8000",
                "endpoint": endpoint,
                "replay_endpoint": replay,
                "topic": ZMQ_TOPIC.decode(),
                "keys": "engine_hashes",
                "lease_ttl_s": 600.0,
            }
            for r, worker, endpoint, replay in engines.endpoints
        ]
        with ServerChild("memory", overrides={"engine_events": {"endpoints": endpoints}}) as srv:
            seconds, cpu, probes, probe_cpu = asyncio.run(
                _zmq_rounds(srv, engines, plans, prompts, params)
            )
    kinds = {"zmq_ingest": False, "ingest_during_probe": True}
    for name, probed in kinds.items():
        rounds = [r for r in range(len(plans)) if zmq_round_probed(r) == probed]
        blocks = sum(plans[r].blocks for r in rounds)
        figures[f"memory_{name}_blocks_per_s"] = blocks / sum(seconds[r] for r in rounds)
        used = [cpu[r] for r in rounds]
        if all(u is not None for u in used):
            # The server's CPU time per block: apart from the wall clock, which
            # other processes on the machine (the probing client among them) share.
            figures[f"memory_{name}_server_cpu_us_per_block"] = (
                sum(u for u in used if u is not None) * 1e6 / blocks
            )
        extra[f"zmq_round_blocks_per_s_{'probed' if probed else 'quiet'}"] = [
            round(plans[r].blocks / seconds[r]) for r in rounds
        ]
        if probed and probe_cpu is not None and all(u is not None for u in used):
            # Less what serving the probes took: the ingest's own CPU per block
            # while probed, against the quiet rounds' (pacing's own cost).
            net = sum(u for u in used if u is not None)
            net -= probe_cpu * sum(seconds[r] for r in rounds)
            figures["memory_ingest_during_probe_net_cpu_us_per_block"] = net * 1e6 / blocks
            figures["memory_probe_server_cpu_share"] = probe_cpu
    for name, lat in (
        ("match", probes.match_ms),
        ("ping", probes.ping_ms),
        ("health", probes.health_ms),
    ):
        figures[f"memory_{name}_during_ingest_p50_ms"] = percentile(lat, 0.5)
        figures[f"memory_{name}_during_ingest_p99_ms"] = percentile(lat, 0.99)
    extra["zmq_publishers"] = params.zmq_publishers
    extra["zmq_blocks_per_round"] = plans[1].blocks
    extra["zmq_batches_per_round"] = plans[1].batch_count
    extra["zmq_probe_interval_s"] = params.probe_interval_s
    extra["zmq_matches_probed"] = len(probes.match_ms)
    extra["zmq_wire"] = "vLLM ZMQ (map-form msgpack), keys=engine_hashes, replay ROUTER"


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
    """Entry point of the children: the server (``--serve BACKEND``) of :class:`ServerChild`,
    the engines (``--publish``) of :class:`EnginesChild`."""
    p = argparse.ArgumentParser(prog="python -m lab.bench.indexer_common")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--serve", help="backend: memory, redis or cluster")
    mode.add_argument("--publish", action="store_true", help="be the ZMQ engines")
    p.add_argument("--redis-url", default="")
    p.add_argument("--server-config", default="", help="JSON overrides of server_config")
    p.add_argument("--requests", type=int, default=None, help="trace requests (--publish)")
    p.add_argument("--publishers", type=int, default=64, help="engines per round (--publish)")
    p.add_argument("--requests-per-batch", type=int, default=8, help="(--publish)")
    args = p.parse_args(argv)
    if args.publish:
        return publish_child(args.requests, args.publishers, args.requests_per_batch)
    return serve_child(args.serve, args.redis_url, args.server_config)


if __name__ == "__main__":
    raise SystemExit(main())
