"""``kvmesh bench soak``: indexer replicas on one Redis under mixed load, with faults.

What runs:

- **Redis**: a private ``redis-server`` (:class:`lab.redisproc.RedisProcess`)
  or, with ``--cluster``, a private 3-master Redis Cluster. By default it keeps
  an append-only file fsynced on every write (``--redis-persistence aof``), so
  a killed and restarted Redis comes back with every acknowledged write: then
  the only error a client may see is UNAVAILABLE while it is down. With
  ``none`` a restart loses the index; engines see their instance gone
  (FAILED_PRECONDITION / NOT_FOUND), re-register and start over, and those
  answers are counted as ``lost_state`` (expected after a data-losing restart).
- **Replicas**: ``--replicas`` indexer servers, each its own process
  (:class:`ReplicaProcess`), on fixed ports so that a killed replica comes back
  where its clients dial.
- **Engines** (``--engines``): the Mooncake conversation trace, split over the
  engines sticky per conversation (:func:`lab.workload.instance_of`) and
  replayed in a loop at ``--event-rate`` trace requests per second in total.
  Each engine models its KV cache as a :class:`tee.cachesim.model.BlockCache`
  LRU of ``--capacity`` blocks, the way :mod:`lab.sim.engine` does: a
  request publishes ``BlockRemoved`` for what it evicted and ``BlockStored``
  for what it added, so the index (and Redis memory) stays bounded however
  long the soak runs. Each engine keeps one ``PublishEventsStream`` to its
  replica and sends one batch at a time, waiting for its ack (an engine
  adapter must: a later batch applied after a rejected one would be a
  sequence gap); events produced meanwhile go into the next batch. A
  rejected batch is sent again with the same sequence; a broken stream fails
  over to the next replica. Every ``--heartbeat`` seconds each engine renews
  its lease.
- **Routers** (``--routers``): Matches at ``--match-rate`` per second in
  total, alternating over every replica, for prompts the engines served
  recently (so they hit).
- **Faults**: ``--kill-redis-every S`` SIGKILLs Redis (with ``--cluster``: one
  master, in turn) every S seconds and restarts it ``--outage`` seconds later;
  ``--kill-replica-every S`` does the same to one replica at a time.

Reported per ``--interval``: events/s, Matches/s, Match p50/p99, RSS of every
replica, Redis ``used_memory``, errors. Memory growth is the least-squares
slope over the second half of the run (of the last uninterrupted process, so
a restarted replica's fresh RSS is not read as shrinkage). Errors are counted
by status code, and UNAVAILABLE is split into inside an injected outage
(from the kill until ``--grace`` seconds after the restart) and outside;
``soak_errors_unexpected`` is every error but UNAVAILABLE inside an outage
(and ``lost_state`` answers with ``--redis-persistence none``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import platform
import random
import tempfile
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc
import grpc.aio
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer.config import IndexerConfig, Limits, RedisSettings
from indexer.server import setup_logging, start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.clihelp import HelpFormatter
from kvmesh.progress import phase
from kvmesh.stats import percentile
from lab.bench.report import fmt, write_report
from lab.children import (
    ChildExited,
    ChildNotReady,
    ChildProcess,
    python_module,
    serve_until_told,
)
from lab.redisproc import HOST, RedisClusterProcess, RedisProcess, free_port
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, load_mooncake, trace_block_key
from lab.workload import TRACE_MODEL, instance_of
from tee.cachesim.model import BlockCache

#: Per-call deadline of every client call: long enough for a loaded 2-core
#: machine, short enough that a hung call shows up as an error, not a stall.
CALL_TIMEOUT_S = 5.0

#: Client channel options: reconnect to a restarted replica within half a
#: second (gRPC's default backoff starts at 1 s and grows to 2 minutes, so a
#: client of a replica that was down a few seconds would keep failing
#: long after it serves again).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
)

#: Most events per published batch (the server's default cap is 4096).
MAX_EVENTS_PER_BATCH = 1024

#: Redis arguments of ``--redis-persistence aof``: every write reaches the
#: append-only file before Redis answers it, so a SIGKILL loses nothing a
#: client was told succeeded. They come after RedisProcess's own
#: ``--appendonly no`` and override it.
AOF_ARGS = ("--appendonly", "yes", "--appendfsync", "always")


# -- replicas ---------------------------------------------------------------------


def replica_config(port: int, redis_url: str, *, cluster: bool = False) -> IndexerConfig:
    """Config of one soak replica: the redis backend, short timeouts, no metrics port.

    A short socket timeout and health interval make a dead Redis show as
    UNAVAILABLE within about a second and a restarted one used again as fast.
    """
    return IndexerConfig(
        host=HOST,
        port=port,
        metrics_port=0,
        backend="redis",
        redis=RedisSettings(url=redis_url, cluster=cluster, socket_timeout_s=0.5),
        model_block_sizes={TRACE_MODEL: MOONCAKE_BLOCK_SIZE},
        # 512-token blocks: the default 8192-block cap would not fit the message limit.
        limits=Limits(max_match_blocks=4096),
        health_check_interval_s=0.5,
        reap_interval_s=5.0,
        log_level="WARNING",
    )


def _serve_replica(port: int, redis_url: str, cluster: bool) -> int:
    """Child process of :class:`ReplicaProcess`: serve, announce the port, stop when told."""
    config = replica_config(port, redis_url, cluster=cluster)
    setup_logging(config)

    return serve_until_told(lambda: start_server(config), lambda server: server.stop(0))


class ReplicaProcess:
    """One indexer replica in a child process, on a port kept across restarts.

    :meth:`kill` is a crash (SIGKILL); :meth:`start` after it brings the
    replica back on the same port. The child's log goes to ``log_path``.
    """

    def __init__(
        self, redis_url: str, *, cluster: bool = False, log_dir: str | None = None
    ) -> None:
        self.redis_url = redis_url
        self.cluster = cluster
        self.port = free_port()
        self.restarts = 0
        self._log_dir = log_dir or tempfile.mkdtemp(prefix="kvmesh-soak-")
        self.log_path = os.path.join(self._log_dir, f"replica-{self.port}.log")
        args = ["--serve-replica", str(self.port), "--redis-url", self.redis_url]
        self.child = ChildProcess(
            python_module("lab.bench.soak", *args, *(["--cluster"] if cluster else [])),
            name=f"replica :{self.port}",
            log_path=self.log_path,
            pipes=True,
        )

    @property
    def target(self) -> str:
        """``host:port`` to dial."""
        return f"{HOST}:{self.port}"

    @property
    def pid(self) -> int | None:
        """Process id while running."""
        return self.child.pid if self.child.alive() else None

    def start(self, timeout_s: float = 15.0) -> ReplicaProcess:
        """Start the child and wait until it serves (its backend answered); return self."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.child.start()
            try:
                self.child.wait_line(max(0.0, deadline - time.monotonic()))
                return self
            except (ChildExited, ChildNotReady):
                self.child.kill()
            # The port of a killed replica can take a moment to be free again;
            # any other failure is final.
            log_text = self.child.log_text(2000)
            if "cannot listen" not in log_text or time.monotonic() > deadline:
                raise RuntimeError(f"replica on :{self.port} did not start:\n{log_text}")
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the replica, as a crash would."""
        self.child.kill()

    def restart(self) -> None:
        """Kill (if running) and start again on the same port."""
        self.kill()
        self.restarts += 1
        self.start()

    def stop(self) -> None:
        """Graceful stop: stdin closed and SIGTERM, SIGKILL if it hangs."""
        self.child.stop()

    def rss_mb(self) -> float | None:
        """Resident set size of the child in MB (None when not running)."""
        return self.child.rss_mb()

    def __enter__(self) -> ReplicaProcess:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def wait_serving(target: str, within_s: float = 30.0) -> None:
    """Wait until the server at ``target`` answers health SERVING."""
    loop = asyncio.get_running_loop()
    end = loop.time() + within_s
    async with grpc.aio.insecure_channel(target, options=CHANNEL_OPTIONS) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                r = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                if r.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            if loop.time() > end:
                raise TimeoutError(f"{target} not SERVING within {within_s} s")
            await asyncio.sleep(0.05)


# -- Redis --------------------------------------------------------------------------


class SoakRedis:
    """The soak's Redis: standalone or a 3-master cluster, kill/restart and memory."""

    def __init__(self, *, cluster: bool, persistence: str) -> None:
        self.cluster = cluster
        self.persistence = persistence
        self.restarts = 0
        self._next_victim = 0
        self._victim = 0
        self._standalone: RedisProcess | None = None
        self._cluster: RedisClusterProcess | None = None

    @property
    def url(self) -> str:
        """URL replicas connect to."""
        if self._cluster is not None:
            return self._cluster.url
        assert self._standalone is not None
        return self._standalone.url

    def start(self) -> SoakRedis:
        """Start the server(s)."""
        aof = AOF_ARGS if self.persistence == "aof" else ()
        if self.cluster:
            self._cluster = RedisClusterProcess().start()
            if aof:
                for node in self._cluster.nodes:
                    r = redis.Redis(host=node.host, port=node.port)
                    try:
                        r.config_set("appendonly", "yes")
                        r.config_set("appendfsync", "always")
                    finally:
                        r.close()
                    # So that a restart reads the file back instead of starting empty.
                    node.extra_args = (*node.extra_args, *aof)
        else:
            self._standalone = RedisProcess(extra_args=aof).start()
        return self

    def kill(self) -> str:
        """SIGKILL Redis (a cluster: its next master in turn); return what was killed."""
        if self._cluster is not None:
            i = self._next_victim % len(self._cluster.nodes)
            self._next_victim += 1
            self._cluster.kill(i)
            self._victim = i
            return f"master {i}"
        assert self._standalone is not None
        self._standalone.kill()
        return "redis"

    def restart(self) -> None:
        """Start what :meth:`kill` killed, on the same port; wait until it serves."""
        self.restarts += 1
        if self._cluster is not None:
            self._cluster.restart(self._victim)
        else:
            assert self._standalone is not None
            self._standalone.start()

    def used_memory_mb(self) -> float | None:
        """``INFO memory used_memory`` (summed over masters) in MB; None when any is down."""
        ports = (
            self._cluster.ports
            if self._cluster is not None
            else [self._standalone.port if self._standalone else 0]
        )
        total = 0
        for port in ports:
            r = redis.Redis(host=HOST, port=port, socket_timeout=0.5, socket_connect_timeout=0.5)
            try:
                total += int(r.info("memory")["used_memory"])
            except redis.RedisError:
                return None
            finally:
                r.close()
        return total / 2**20

    def close(self) -> None:
        """Stop everything and delete the data directories."""
        if self._cluster is not None:
            self._cluster.close()
        if self._standalone is not None:
            self._standalone.close()


# -- measurement state --------------------------------------------------------------


@dataclass(slots=True)
class ErrorRecord:
    """One failed call or rejected batch, as a client saw it."""

    t: float  # seconds since the soak started
    code: str  # gRPC status code name (or STALE for a batch acked stale)
    what: str  # register, publish, heartbeat, match
    replica: int  # the replica the call went to


@dataclass(slots=True)
class Outage:
    """An injected fault: from the kill until the restart finished (``end`` None: ongoing)."""

    kind: str  # "redis" or "replica"
    target: str
    start: float
    end: float | None = None
    replica: int = -1  # for kind "replica"


@dataclass(slots=True)
class Stats:
    """Everything the clients count, shared by the tasks of the soak process."""

    t0: float = 0.0
    events: int = 0  # BlockStored + BlockRemoved events in applied batches
    blocks: int = 0  # blocks those events named
    batches: int = 0
    batches_duplicate: int = 0
    heartbeats: int = 0
    registrations: int = 0
    resyncs: int = 0
    failovers: int = 0
    match_lat_us: list[float] = field(default_factory=list)  # the current interval
    match_all_us: list[float] = field(default_factory=list)
    matches: int = 0
    match_hits: int = 0
    errors: list[ErrorRecord] = field(default_factory=list)
    outages: list[Outage] = field(default_factory=list)
    redis_restarts: int = 0  # restarts so far (a registration older than one lost state)

    def now(self) -> float:
        """Seconds since the soak started."""
        return time.monotonic() - self.t0

    def error(self, code: grpc.StatusCode | str, what: str, replica: int) -> None:
        """Record an error."""
        name = code if isinstance(code, str) else code.name
        self.errors.append(ErrorRecord(self.now(), name, what, replica))


def _code_name(e: grpc.aio.AioRpcError) -> str:
    return e.code().name


# -- engines ------------------------------------------------------------------------


class SoakEngine:
    """A simulated engine publishing its LRU cache's events (see the module docstring)."""

    def __init__(
        self,
        name: str,
        requests: Sequence[TraceRequest],
        capacity: int,
        stubs: Sequence[pb_grpc.IndexerServiceAsyncStub],
        home: int,
        stats: Stats,
        recent: deque[list[int]],
        *,
        lease_s: float,
    ) -> None:
        self.name = name
        self.ref = pb.InstanceRef(worker_id=name, dp_rank=0)
        self.requests = requests
        self.cache = BlockCache(capacity)
        self.stubs = stubs
        self.replica = home
        self.stats = stats
        self.recent = recent
        self.lease_s = lease_s
        self.sequence = 0
        self.pending: list[pb.Event] = []
        self.has_pending = asyncio.Event()
        self.incarnations = 0
        self.registered_epoch = -1  # redis_restarts when last registered
        self._cursor = 0
        self._stream: Any = None

    # -- the cache model ------------------------------------------------------

    def serve_next(self) -> None:
        """Serve the next trace request: cache lookup/insert, events queued."""
        req = self.requests[self._cursor % len(self.requests)]
        self._cursor += 1
        ids = req.hash_ids
        cache = self.cache
        hits = cache.lookup_prefix(ids)
        limit = len(ids) if cache.capacity is None else min(len(ids), cache.capacity)
        new = [h for h in ids[hits:limit] if h not in cache]
        evicted = cache.insert(ids)
        if evicted:
            self.pending.append(pb.Event(removed=pb.BlockRemoved(block_hashes=evicted)))
        if new:
            first = ids.index(new[0])
            stored = pb.BlockStored(
                block_hashes=new,
                block_keys=[trace_block_key(h) for h in new],
                block_size=MOONCAKE_BLOCK_SIZE,
                tier=pb.TIER_GPU,
            )
            if first > 0:
                stored.parent_block_hash = ids[first - 1]
            self.pending.append(pb.Event(stored=stored))
        if self.pending:
            self.has_pending.set()
        self.recent.append([trace_block_key(h) for h in ids[:limit]])

    # -- the wire -------------------------------------------------------------

    @property
    def stub(self) -> pb_grpc.IndexerServiceAsyncStub:
        """The stub of the replica this engine talks to now."""
        return self.stubs[self.replica]

    async def register(self, *, new: bool) -> None:
        """Register (``new``: a fresh incarnation, which resets the instance)."""
        if new:
            self.incarnations += 1
            # What an engine does when the index lost its instance: start over
            # from an empty cache, as the reset index now believes it has.
            self.cache.clear()
            self.pending.clear()
            self.sequence = 0
        while True:
            epoch = self.stats.redis_restarts
            try:
                await self.stub.RegisterInstance(
                    pb.RegisterInstanceRequest(
                        instance=self.ref,
                        model=TRACE_MODEL,
                        address=f"http://{self.name}:8000",
                        lease_ttl_seconds=self.lease_s,
                        incarnation=f"soak-{self.name}-{self.incarnations}",
                    ),
                    timeout=CALL_TIMEOUT_S,
                )
                self.stats.registrations += 1
                self.registered_epoch = epoch
                return
            except grpc.aio.AioRpcError as e:
                self.stats.error(_code_name(e), "register", self.replica)
                await self._fail_over()

    async def _fail_over(self) -> None:
        """Drop the stream, move to the next replica, pause a little."""
        self._drop_stream()
        self.replica = (self.replica + 1) % len(self.stubs)
        self.stats.failovers += 1
        await asyncio.sleep(0.1)

    def _drop_stream(self) -> None:
        if self._stream is not None:
            self._stream.cancel()
            self._stream = None

    async def send_loop(self) -> None:
        """Send pending events one batch at a time, each until it is applied."""
        while True:
            await self.has_pending.wait()
            events = self.pending[:MAX_EVENTS_PER_BATCH]
            del self.pending[: len(events)]
            if not self.pending:
                self.has_pending.clear()
            if not events:
                continue
            self.sequence += 1
            batch = pb.EventBatch(instance=self.ref, sequence=self.sequence, events=events)
            await self._deliver(batch)

    async def _deliver(self, batch: pb.EventBatch) -> None:
        """Send ``batch`` until it is applied (or its instance had to start over)."""
        delay = 0.05
        while True:
            try:
                if self._stream is None:
                    self._stream = self.stub.PublishEventsStream()
                call = self._stream
                await asyncio.wait_for(
                    call.write(pb.PublishEventsStreamRequest(batch=batch)), CALL_TIMEOUT_S
                )
                resp = await asyncio.wait_for(call.read(), CALL_TIMEOUT_S)
                if resp is grpc.aio.EOF:
                    raise ConnectionError("stream ended")
            except grpc.aio.AioRpcError as e:
                self.stats.error(_code_name(e), "publish", self.replica)
                await self._fail_over()
                continue
            except (TimeoutError, ConnectionError, grpc.aio.UsageError, asyncio.InvalidStateError):
                self.stats.error("DEADLINE_EXCEEDED", "publish", self.replica)
                await self._fail_over()
                continue
            ack = resp.ack
            if ack.outcome in (pb.BATCH_OUTCOME_APPLIED, pb.BATCH_OUTCOME_DUPLICATE):
                if ack.stale:
                    self.stats.error("STALE", "publish", self.replica)
                if ack.outcome == pb.BATCH_OUTCOME_DUPLICATE:
                    self.stats.batches_duplicate += 1
                self.stats.batches += 1
                self.stats.events += len(batch.events)
                self.stats.blocks += sum(
                    len(ev.stored.block_hashes) + len(ev.removed.block_hashes)
                    for ev in batch.events
                )
                return
            code = grpc.StatusCode.INTERNAL
            for c in grpc.StatusCode:
                if c.value[0] == ack.error.code:
                    code = c
            self.stats.error(code, "publish", self.replica)
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                # The index no longer knows the instance (Redis lost its state):
                # start over; this batch's events describe a cache now cleared.
                await self.register(new=True)
                self.stats.resyncs += 1
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def heartbeat_once(self) -> None:
        """Renew the lease once; an instance the index lost is registered anew."""
        try:
            await self.stub.Heartbeat(
                pb.HeartbeatRequest(instance=self.ref), timeout=CALL_TIMEOUT_S
            )
            self.stats.heartbeats += 1
        except grpc.aio.AioRpcError as e:
            self.stats.error(_code_name(e), "heartbeat", self.replica)
            if e.code() == grpc.StatusCode.NOT_FOUND:
                await self.register(new=True)
                self.stats.resyncs += 1

    def close(self) -> None:
        """End the stream."""
        self._drop_stream()


# -- the soak -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SoakParams:
    """What one soak run does (the CLI's flags)."""

    duration_s: float = 600.0
    replicas: int = 2
    engines: int = 8
    routers: int = 4
    event_rate: float = 40.0  # trace requests per second over all engines
    match_rate: float = 200.0  # Matches per second over all routers
    capacity: int = 1000  # blocks per engine's LRU
    lease_s: float = 15.0
    heartbeat_s: float = 3.0
    interval_s: float = 0.0  # 0: duration / 20, at least 1 s
    kill_redis_every_s: float = 0.0
    kill_replica_every_s: float = 0.0
    outage_s: float = 2.0
    grace_s: float = 2.0
    cluster: bool = False
    persistence: str = "aof"
    seed: int = 1

    @property
    def interval(self) -> float:
        """Seconds per reported interval."""
        return self.interval_s or max(1.0, self.duration_s / 20)


def _paced(rate: float) -> Any:
    """An async generator of ticks at ``rate`` per second (never bursts after a stall)."""

    async def gen() -> Any:
        period = 1.0 / rate
        loop = asyncio.get_running_loop()
        nxt = loop.time()
        while True:
            nxt += period
            delay = nxt - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            elif delay < -1.0:
                nxt = loop.time()  # fell behind by over a second: do not catch up in a burst
            yield None

    return gen()


async def _engine_driver(engine: SoakEngine, rate: float, stop: asyncio.Event) -> None:
    async for _ in _paced(rate):
        if stop.is_set():
            return
        engine.serve_next()


async def _heartbeats(engines: Sequence[SoakEngine], every: float, stop: asyncio.Event) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        if stop.is_set():
            return
        await asyncio.gather(*(e.heartbeat_once() for e in engines))


async def _router(
    k: int,
    stubs: Sequence[pb_grpc.IndexerServiceAsyncStub],
    rate: float,
    recent: deque[list[int]],
    stats: Stats,
    stop: asyncio.Event,
) -> None:
    rng = random.Random(k)
    i = k
    async for _ in _paced(rate):
        if stop.is_set():
            return
        if not recent:
            continue
        keys = recent[rng.randrange(len(recent))]
        replica = i % len(stubs)
        i += 1
        t0 = time.perf_counter()
        try:
            resp = await stubs[replica].Match(
                pb.MatchRequest(model=TRACE_MODEL, block_keys=keys, max_blocks=len(keys)),
                timeout=CALL_TIMEOUT_S,
            )
        except grpc.aio.AioRpcError as e:
            stats.error(_code_name(e), "match", replica)
            continue
        us = (time.perf_counter() - t0) * 1e6
        stats.match_lat_us.append(us)
        stats.match_all_us.append(us)
        stats.matches += 1
        if resp.matches:
            stats.match_hits += 1


async def _faults(
    p: SoakParams,
    redis: SoakRedis,
    replicas: Sequence[ReplicaProcess],
    stats: Stats,
    stop: asyncio.Event,
) -> None:
    """Kill and restart Redis and replicas on their schedules (last one ends in time)."""
    plan: list[tuple[float, str]] = []
    for every, kind in ((p.kill_redis_every_s, "redis"), (p.kill_replica_every_s, "replica")):
        if every > 0:
            t = every
            # Leave time after the last restart to see the system serve again.
            while t + p.outage_s + p.grace_s < p.duration_s:
                plan.append((t, kind))
                t += every
    plan.sort()
    loop = asyncio.get_running_loop()
    victim = 0
    for at, kind in plan:
        delay = at - stats.now()
        if delay > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), delay)
        if stop.is_set():
            return
        # The window opens before the kill: clients see the failure while the
        # kill call is still returning.
        start = stats.now()
        if kind == "redis":
            what = await loop.run_in_executor(None, redis.kill)
            outage = Outage("redis", what, start)
            stats.outages.append(outage)
            await asyncio.sleep(p.outage_s)
            stats.redis_restarts += 1
            await loop.run_in_executor(None, redis.restart)
        else:
            i = victim % len(replicas)
            victim += 1
            rep = replicas[i]
            await loop.run_in_executor(None, rep.kill)
            outage = Outage("replica", f"replica {i}", start, replica=i)
            stats.outages.append(outage)
            await asyncio.sleep(p.outage_s)
            rep.restarts += 1
            await loop.run_in_executor(None, rep.start)
        outage.end = stats.now()


@dataclass(slots=True)
class Interval:
    """One reported interval."""

    t: float
    events_per_s: float
    matches_per_s: float
    match_p50_us: float | None
    match_p99_us: float | None
    rss_mb: list[float | None]
    rss_epoch: list[int]
    redis_mb: float | None
    redis_epoch: int
    errors: int


def _slope_mb_per_min(points: Sequence[tuple[float, float]]) -> float | None:
    """Least-squares slope of ``(seconds, MB)`` points, in MB per minute."""
    if len(points) < 2:
        return None
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    sxx = sum((t - mx) ** 2 for t, _ in points)
    if sxx == 0:
        return None
    sxy = sum((t - mx) * (v - my) for t, v in points)
    return sxy / sxx * 60.0


def growth(samples: Sequence[tuple[float, float | None, int]], half: float) -> float | None:
    """Memory slope (MB/min) over samples at ``t >= half`` of the last process epoch."""
    usable = [(t, v, e) for t, v, e in samples if v is not None and t >= half]
    if not usable:
        return None
    last = usable[-1][2]
    return _slope_mb_per_min([(t, v) for t, v, e in usable if e == last and v is not None])


def classify(stats: Stats, p: SoakParams) -> dict[str, Any]:
    """Errors by code, UNAVAILABLE inside/outside outages, and the unexpected count."""

    def in_outage(err: ErrorRecord) -> bool:
        for o in stats.outages:
            end = (o.end if o.end is not None else math.inf) + p.grace_s
            if o.start <= err.t <= end and (o.kind == "redis" or o.replica == err.replica):
                return True
        return False

    by_code = Counter(e.code for e in stats.errors)
    unavailable_in = sum(1 for e in stats.errors if e.code == "UNAVAILABLE" and in_outage(e))
    unavailable_out = by_code.get("UNAVAILABLE", 0) - unavailable_in
    lost_state = 0
    if p.persistence == "none" and stats.redis_restarts:
        # After a Redis restart without persistence the index is empty: an
        # engine learns it from these answers, once per restart.
        lost_state = sum(
            1
            for e in stats.errors
            if e.code in ("FAILED_PRECONDITION", "NOT_FOUND")
            and e.what in ("publish", "heartbeat")
            and any(o.kind == "redis" and o.start <= e.t for o in stats.outages)
        )
    unexpected = len(stats.errors) - unavailable_in - lost_state
    return {
        "by_code": dict(sorted(by_code.items())),
        "by_call": dict(sorted(Counter(f"{e.what}:{e.code}" for e in stats.errors).items())),
        "unavailable_in_outage": unavailable_in,
        "unavailable_outside_outage": unavailable_out,
        "lost_state": lost_state,
        "unexpected": unexpected,
        # Each one in full (time, call, replica): these are what to look into.
        "unexpected_errors": [
            asdict(e) for e in stats.errors if not (e.code == "UNAVAILABLE" and in_outage(e))
        ][:200],
    }


async def _soak(
    p: SoakParams,
    trace: Sequence[TraceRequest],
    redis: SoakRedis,
    replicas: Sequence[ReplicaProcess],
    progress: bool,
) -> tuple[Stats, list[Interval]]:
    stats = Stats()
    channels = [grpc.aio.insecure_channel(r.target, options=CHANNEL_OPTIONS) for r in replicas]
    stubs = [pb_grpc.IndexerServiceStub(ch) for ch in channels]
    per_engine: list[list[TraceRequest]] = [[] for _ in range(p.engines)]
    for req in trace:
        per_engine[instance_of(req, p.engines)].append(req)
    recent: deque[list[int]] = deque(maxlen=2000)
    engines = [
        SoakEngine(
            f"soak-engine-{i:02d}",
            reqs or list(trace[:1]),
            p.capacity,
            stubs,
            i % len(replicas),
            stats,
            recent,
            lease_s=p.lease_s,
        )
        for i, reqs in enumerate(per_engine)
    ]
    stop = asyncio.Event()
    tasks: list[asyncio.Task[Any]] = []
    intervals: list[Interval] = []
    try:
        for e in engines:
            await e.register(new=False)
        stats.errors.clear()  # start-up is not part of the soak
        stats.t0 = time.monotonic()
        loop = asyncio.get_running_loop()
        for e in engines:
            tasks.append(asyncio.create_task(e.send_loop()))
            tasks.append(asyncio.create_task(_engine_driver(e, p.event_rate / p.engines, stop)))
        tasks.append(asyncio.create_task(_heartbeats(engines, p.heartbeat_s, stop)))
        for k in range(p.routers):
            tasks.append(
                asyncio.create_task(
                    _router(k, stubs, p.match_rate / p.routers, recent, stats, stop)
                )
            )
        fault_task = asyncio.create_task(_faults(p, redis, replicas, stats, stop))
        last_t, last_events, last_matches, last_errors = 0.0, 0, 0, 0
        next_at = p.interval
        while next_at <= p.duration_s + 1e-9:
            await asyncio.sleep(max(0.0, next_at - stats.now()))
            redis_mb = await loop.run_in_executor(None, redis.used_memory_mb)
            # Everything else is read at one instant, with no await in between,
            # so that the counts and latencies of a row cover the same time.
            now = stats.now()
            lat, stats.match_lat_us = stats.match_lat_us, []
            rss = [r.rss_mb() for r in replicas]
            dt = max(1e-9, now - last_t)
            row = Interval(
                t=now,
                events_per_s=(stats.events - last_events) / dt,
                matches_per_s=(stats.matches - last_matches) / dt,
                match_p50_us=percentile(lat, 0.5) if lat else None,
                match_p99_us=percentile(lat, 0.99) if lat else None,
                rss_mb=rss,
                rss_epoch=[r.restarts for r in replicas],
                redis_mb=redis_mb,
                redis_epoch=stats.redis_restarts if p.persistence == "none" else 0,
                errors=len(stats.errors) - last_errors,
            )
            intervals.append(row)
            if progress:
                print(_interval_line(row), flush=True)
            last_t, last_events, last_matches = now, stats.events, stats.matches
            last_errors = len(stats.errors)
            next_at += p.interval
            while next_at < stats.now():  # a late sample skips the slots it missed
                next_at += p.interval
        stop.set()
        fault_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fault_task
        # A fault cut short by the end of the run still gets its process back.
        for o in stats.outages:
            if o.end is None:
                if o.kind == "redis":
                    await loop.run_in_executor(None, redis.restart)
                else:
                    await loop.run_in_executor(None, replicas[o.replica].start)
                o.end = stats.now()
    finally:
        stop.set()
        await _cancel_all(tasks)
        for e in engines:
            e.close()
        for ch in channels:
            await ch.close()
    return stats, intervals


async def _cancel_all(tasks: Sequence[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait until every one has ended.

    Cancels again while any is left: on Python 3.11 ``asyncio.wait_for`` can
    swallow a cancellation that races with its inner call finishing, and the
    task then goes on to its next await.
    """
    pending = {t for t in tasks if not t.done()}
    while pending:
        for t in pending:
            t.cancel()
        _, pending = await asyncio.wait(pending, timeout=1.0)
    for t in tasks:
        if not t.cancelled():
            with contextlib.suppress(Exception):
                t.result()


def _f(v: float | None, width: int) -> str:
    return f"{fmt(v):>{width}}"


def _interval_header(replicas: int) -> str:
    rss = " ".join(f"{f'rss r{i} MB':>10}" for i in range(replicas))
    return (
        f"{'t s':>6} {'events/s':>9} {'matches/s':>9} {'p50 µs':>8} {'p99 µs':>8} "
        f"{rss} {'redis MB':>9} {'errors':>6}"
    )


def _interval_line(r: Interval) -> str:
    rss = " ".join(_f(v, 10) for v in r.rss_mb)
    return (
        f"{r.t:>6.0f} {_f(r.events_per_s, 9)} {_f(r.matches_per_s, 9)} "
        f"{_f(r.match_p50_us, 8)} {_f(r.match_p99_us, 8)} {rss} {_f(r.redis_mb, 9)} "
        f"{r.errors:>6}"
    )


def run_soak(p: SoakParams, *, progress: bool = False) -> tuple[dict[str, float], dict[str, Any]]:
    """Run a soak; return ``(figures, params)`` as written to JSON."""
    trace = load_mooncake()
    log_dir = tempfile.mkdtemp(prefix="kvmesh-soak-")
    phase(f"starting Redis and {p.replicas} indexer replicas")
    redis = SoakRedis(cluster=p.cluster, persistence=p.persistence).start()
    replicas: list[ReplicaProcess] = []
    try:
        replicas = [
            ReplicaProcess(redis.url, cluster=p.cluster, log_dir=log_dir) for _ in range(p.replicas)
        ]
        # Start the children together: each spends a second or two importing.
        procs = [r.start for r in replicas]
        with _pool(len(procs)) as pool:
            list(pool.map(lambda f: f(), procs))
        if progress:
            print(_interval_header(p.replicas), flush=True)
        phase(f"load for {p.duration_s:g} s")
        stats, intervals = asyncio.run(_soak(p, trace, redis, replicas, progress))
    finally:
        for r in replicas:
            r.stop()
        redis.close()
    errs = classify(stats, p)
    half = p.duration_s / 2
    rss_growth = [
        growth([(iv.t, iv.rss_mb[i], iv.rss_epoch[i]) for iv in intervals], half)
        for i in range(p.replicas)
    ]
    redis_growth = growth([(iv.t, iv.redis_mb, iv.redis_epoch) for iv in intervals], half)
    measured = intervals[-1].t if intervals else p.duration_s
    p99s = [iv.match_p99_us for iv in intervals if iv.match_p99_us is not None]
    rss_last = [
        next((iv.rss_mb[i] for iv in reversed(intervals) if iv.rss_mb[i] is not None), None)
        for i in range(p.replicas)
    ]
    figures: dict[str, float] = {
        "soak_events_per_s": stats.events / measured,
        "soak_blocks_per_s": stats.blocks / measured,
        "soak_batches_per_s": stats.batches / measured,
        "soak_matches_per_s": stats.matches / measured,
        "soak_match_p50_us": percentile(stats.match_all_us, 0.5) if stats.match_all_us else -1,
        "soak_match_p99_us": percentile(stats.match_all_us, 0.99) if stats.match_all_us else -1,
        "soak_match_p99_us_worst_interval": max(p99s) if p99s else -1,
        "soak_match_hit_share": stats.match_hits / max(1, stats.matches),
        "soak_replica_rss_growth_mb_per_min": max(
            (g for g in rss_growth if g is not None), default=math.nan
        ),
        "soak_replica_rss_mb_max": max((v for v in rss_last if v is not None), default=math.nan),
        "soak_redis_memory_growth_mb_per_min": (
            redis_growth if redis_growth is not None else math.nan
        ),
        "soak_redis_memory_mb": next(
            (iv.redis_mb for iv in reversed(intervals) if iv.redis_mb is not None), math.nan
        ),
        "soak_errors_total": float(len(stats.errors)),
        "soak_errors_unexpected": float(errs["unexpected"]),
        "soak_unavailable_in_outage": float(errs["unavailable_in_outage"]),
        "soak_unavailable_outside_outage": float(errs["unavailable_outside_outage"]),
        "soak_redis_kills": float(sum(1 for o in stats.outages if o.kind == "redis")),
        "soak_replica_kills": float(sum(1 for o in stats.outages if o.kind == "replica")),
        "soak_heartbeats": float(stats.heartbeats),
    }
    run_params: dict[str, Any] = {
        **asdict(p),
        "interval_s": p.interval,
        "trace": "mooncake_conversation_trace (looped)",
        "trace_requests": len(trace),
        "redis": "3-master cluster" if p.cluster else "standalone",
        "errors_by_code": errs["by_code"],
        "errors_by_call": errs["by_call"],
        "lost_state_answers": errs["lost_state"],
        "unexpected_errors": errs["unexpected_errors"],
        "replica_rss_growth_mb_per_min": rss_growth,
        "batches_duplicate": stats.batches_duplicate,
        "registrations": stats.registrations,
        "resyncs": stats.resyncs,
        "failovers": stats.failovers,
        "outages": [asdict(o) for o in stats.outages],
        "intervals": [asdict(iv) for iv in intervals],
        "replica_logs": log_dir,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "grpcio": grpc.__version__,
    }
    return figures, run_params


@contextlib.contextmanager
def _pool(n: int) -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(max_workers=max(1, n)) as pool:
        yield pool


_SUMMARY: tuple[tuple[str, str, str], ...] = (
    ("events/s (applied)", "soak_events_per_s", "1/s"),
    ("blocks/s (stored + removed)", "soak_blocks_per_s", "1/s"),
    ("Matches/s", "soak_matches_per_s", "1/s"),
    ("Match p50", "soak_match_p50_us", "µs"),
    ("Match p99", "soak_match_p99_us", "µs"),
    ("Match p99, worst interval", "soak_match_p99_us_worst_interval", "µs"),
    ("Matches with a hit", "soak_match_hit_share", ""),
    ("replica RSS growth, 2nd half", "soak_replica_rss_growth_mb_per_min", "MB/min"),
    ("replica RSS at the end (max)", "soak_replica_rss_mb_max", "MB"),
    ("Redis used_memory growth, 2nd half", "soak_redis_memory_growth_mb_per_min", "MB/min"),
    ("Redis used_memory at the end", "soak_redis_memory_mb", "MB"),
    ("Redis kills / replica kills", "", ""),
    ("UNAVAILABLE inside outages", "soak_unavailable_in_outage", "count"),
    ("UNAVAILABLE outside outages", "soak_unavailable_outside_outage", "count"),
    ("errors, unexpected", "soak_errors_unexpected", "count"),
)


def format_summary(figures: dict[str, float], run_params: dict[str, Any]) -> str:
    """The summary table of a run."""
    lines = [f"{'figure':<36} {'value':>10} unit", "-" * 54]
    for label, name, unit in _SUMMARY:
        if not name:
            kills = f"{figures['soak_redis_kills']:.0f} / {figures['soak_replica_kills']:.0f}"
            lines.append(f"{label:<36} {kills:>10}")
            continue
        v = figures.get(name)
        text = f"{v:>10.0f}" if unit == "count" and v is not None else _f(v, 10)
        lines.append(f"{label:<36} {text} {unit if unit != 'count' else ''}".rstrip())
    lines.append(f"errors by code: {run_params['errors_by_code'] or 'none'}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench soak``; exit code 1 when an unexpected error was seen."""
    d = SoakParams()
    ap = argparse.ArgumentParser(
        prog="kvmesh bench soak",
        description="Mixed load (KV events, Matches, heartbeats) on indexer replicas sharing "
        "one Redis, with optional Redis and replica kills.",
        formatter_class=HelpFormatter,
    )
    ap.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    ap.add_argument("--replicas", type=int, default=d.replicas, help="indexer replica processes")
    ap.add_argument("--engines", type=int, default=d.engines, help="simulated publishing engines")
    ap.add_argument("--routers", type=int, default=d.routers, help="Match clients")
    ap.add_argument(
        "--event-rate", type=float, default=d.event_rate,
        help="trace requests served per second over all engines (each publishes its events)",
    )  # fmt: skip
    ap.add_argument("--match-rate", type=float, default=d.match_rate, help="Matches per second")
    ap.add_argument("--capacity", type=int, default=d.capacity, help="blocks per engine's LRU")
    ap.add_argument("--lease", type=float, default=d.lease_s, help="instance lease, seconds")
    ap.add_argument("--heartbeat", type=float, default=d.heartbeat_s, help="heartbeat period")
    ap.add_argument(
        "--interval", type=float, default=0.0, help="report period, seconds (0: duration/20)"
    )
    ap.add_argument(
        "--kill-redis-every",
        type=float,
        default=0.0,
        metavar="S",
        help="kill and restart Redis every S seconds (0: never)",
    )
    ap.add_argument(
        "--kill-replica-every",
        type=float,
        default=0.0,
        metavar="S",
        help="kill and restart an indexer replica every S seconds (0: never)",
    )
    ap.add_argument("--outage", type=float, default=d.outage_s, help="seconds a victim stays down")
    ap.add_argument(
        "--grace", type=float, default=d.grace_s,
        help="seconds after a restart that still count as the outage",
    )  # fmt: skip
    ap.add_argument("--cluster", action="store_true", help="a local 3-master Redis Cluster")
    ap.add_argument(
        "--redis-persistence",
        choices=("aof", "none"),
        default=d.persistence,
        help="Redis persistence across its kills",
    )
    ap.add_argument("--json", dest="json_path", help="also write figures and params here")
    ap.add_argument("--quiet", action="store_true", help="no per-interval lines while running")
    ap.add_argument("--serve-replica", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.serve_replica is not None:
        return _serve_replica(a.serve_replica, a.redis_url, a.cluster)
    if a.duration <= 0 or a.replicas < 1 or a.engines < 1 or a.routers < 0:
        ap.error("--duration, --replicas and --engines must be positive")
    if a.event_rate <= 0 or a.match_rate <= 0:
        ap.error("--event-rate and --match-rate must be positive")
    p = SoakParams(
        duration_s=a.duration,
        replicas=a.replicas,
        engines=a.engines,
        routers=a.routers,
        event_rate=a.event_rate,
        match_rate=a.match_rate,
        capacity=a.capacity,
        lease_s=a.lease,
        heartbeat_s=a.heartbeat,
        interval_s=a.interval,
        kill_redis_every_s=a.kill_redis_every,
        kill_replica_every_s=a.kill_replica_every,
        outage_s=a.outage,
        grace_s=a.grace,
        cluster=a.cluster,
        persistence=a.redis_persistence,
    )
    t0 = time.perf_counter()
    figures, run_params = run_soak(p, progress=not a.quiet)
    faults = []
    if p.kill_redis_every_s:
        faults.append(f"Redis killed every {p.kill_redis_every_s:g} s")
    if p.kill_replica_every_s:
        faults.append(f"a replica killed every {p.kill_replica_every_s:g} s")
    print(
        f"kvmesh bench soak: {p.duration_s:g} s, {p.replicas} replicas on "
        f"{run_params['redis']} Redis ({p.persistence}), {p.engines} engines, "
        f"{p.routers} routers, {'; '.join(faults) or 'no faults'}; "
        f"{os.cpu_count()} cpus, {time.perf_counter() - t0:.0f} s"
    )
    print(format_summary(figures, run_params))
    if a.json_path:
        write_report(a.json_path, figures, run_params)
    return 1 if figures["soak_errors_unexpected"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
