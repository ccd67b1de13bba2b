"""The fleet under test: indexer replicas in this process, sharing one backend and one clock.

Each :class:`Replica` is a real :class:`~indexer.server.IndexerServer`
started with :func:`~indexer.server.start_server` on a free 127.0.0.1 port,
serving ``kvmesh.indexer.v1`` and SGLang's ``kv_indexer.v1`` on that port,
with a gRPC channel and both stubs to call it, and its
:class:`~indexer.logic.IndexerLogic` (and SGLang compat) to call the service
layer directly. Replica 0 also runs the ZMQ subscribers of the run's engines
(each endpoint in one replica only, as the deployment rule says).

Every backend takes the run's :class:`LeaseClock`, a settable clock that
judges leases, so that the harness jumps it past lease expiry at will.
Replica lag (``redis.instance_cache_ttl_s``) runs on ``time.monotonic()``, as
in production.

A replica restart stops the server (in-flight calls are cancelled), closes
its backend and starts a new server and backend on the same port: a Redis
backend comes back with a cold instance-table cache, the memory backend
empty.

The memory replica may also have a router's follower, one more reader in the
consistency contract: a :class:`FollowerLink` runs a :class:`HarnessFollower`
(a :class:`router_client.follower.IndexFollower`, the router's own code, that
also notes which run of the replica its copy was loaded from) in the harness's event
loop, following the memory replica through a real ``WatchIndex`` stream on
127.0.0.1. The stream goes through a :class:`Proxy`, a TCP relay in front of
the replica's port, so that the harness can cut it (every connection reset:
the follower reconnects and loads a new snapshot) or stall it (nothing
relayed towards the follower: it falls behind, and once the replica's buffer
for it overflows it is told to resync).

The driver (``lab/faults/driver.py``) asks the follower a Match after every
operation and checks it against the model (indexer/CONSISTENCY.md, "A
router's follower"): a follower that answers must have applied everything
its replica acknowledged within :data:`FOLLOWER_LAG_S` (the follower's lag
bound F as the harness holds it), and then answers as the replica would;
while out of sync it answers None (the router asks the indexer).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
import grpc.aio

from indexer.config import IndexerConfig
from indexer.index import Index
from indexer.logic import IndexerLogic
from indexer.memory import MemoryIndex
from indexer.redis.backend import RedisIndex
from indexer.server import IndexerServer, start_server
from indexer.sglang.compat import SglangCompat
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2_grpc as spb_grpc
from kvmesh.errors import KvmeshError, Unavailable
from lab.faults.engines import ZmqEngine
from lab.faults.faults import Target
from lab.faults.ops import BLOCK_SIZE, SG_MODEL, SG_TTL_S
from router_client.follower import RECEIVE_OPTIONS, IndexFollower

#: ``redis.instance_cache_ttl_s`` of the harness replicas: short, so that a run
#: can wait past it often, yet many calls long (a call takes a few ms), so the
#: "within the bound" cases are exercised too.
CACHE_TTL_S = 0.05

#: ``redis.socket_timeout_s`` and ``redis.write_timeout_s`` of the harness
#: replicas: shorter than the long Redis pauses the harness injects, so those
#: make calls (writes too) fail and run later.
SOCKET_TIMEOUT_S = 0.25

#: Client channel options: reconnect to a restarted replica within 100 ms
#: (gRPC's default backoff starts at 1 s).
CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 50),
    ("grpc.min_reconnect_backoff_ms", 50),
    ("grpc.max_reconnect_backoff_ms", 100),
)

#: Wraps a replica's backend (tests pass deliberately broken wrappers).
IndexWrapper = Callable[[Index, int], Index]


class ReplicaDown(Unavailable):
    """The replica is stopped (a call reached it between stop and start)."""


class LeaseClock:
    """The clock every backend of a run judges leases by (seconds; set by the harness)."""

    def __init__(self, start: float = 1_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        """Jump forward."""
        self.now += seconds


class Replica:
    """One indexer replica: server, backend, channel, stubs."""

    def __init__(self, fleet: Fleet, n: int) -> None:
        self.fleet = fleet
        self.n = n
        self.port = 0
        self.server: IndexerServer | None = None
        self.index: Index | None = None
        self.channel: grpc.aio.Channel | None = None
        self.stub: Any = None
        self.sg_stub: Any = None
        #: Moves on as the replica stops: what was read from it before belongs
        #: to an earlier run (a memory replica's index is lost at each stop).
        self.run = 0

    @property
    def logic(self) -> IndexerLogic:
        """The replica's service logic (:class:`ReplicaDown` while it is stopped)."""
        if self.server is None:
            raise ReplicaDown(f"replica {self.n} is down")
        return self.server.logic

    @property
    def compat(self) -> SglangCompat:
        """The replica's SGLang API logic (:class:`ReplicaDown` while it is stopped)."""
        if self.server is None:
            raise ReplicaDown(f"replica {self.n} is down")
        compat: SglangCompat = self.server.sglang.compat
        return compat

    @property
    def running(self) -> bool:
        """Whether the server is up."""
        return self.server is not None

    def config(self) -> IndexerConfig:
        """This replica's configuration (ZMQ endpoints on replica 0 only)."""
        f = self.fleet
        engines = [e.endpoint_settings() for e in f.engines] if self.n == 0 else []
        return IndexerConfig.model_validate(
            {
                "host": "127.0.0.1",
                "port": self.port,
                "metrics_port": 0,
                "backend": "memory" if f.target.kind == "memory" else "redis",
                "redis": {
                    "url": f.target.url or "redis://127.0.0.1:1/0",
                    "prefix": f.prefix,
                    "cluster": f.target.cluster,
                    "instance_cache_ttl_s": f.cache_ttl_s or CACHE_TTL_S,
                    "socket_timeout_s": SOCKET_TIMEOUT_S,
                    "write_timeout_s": SOCKET_TIMEOUT_S,
                },
                "block_size": BLOCK_SIZE,
                # Reaping is an operation of the harness, never a background surprise.
                "reap_interval_s": 3600.0,
                "health_check_interval_s": 0.5,
                "shutdown_grace_s": 0.0,
                "sglang": {"enabled": True, "model": SG_MODEL, "lease_ttl_s": SG_TTL_S},
                "engine_events": {
                    "endpoints": engines,
                    "replay_timeout_s": 0.5,
                    "on_unrecoverable_gap": f.zmq_policy,
                },
            }
        )

    def _backend(self, cfg: IndexerConfig) -> Index:
        f = self.fleet
        index: Index
        if f.target.kind == "memory":
            index = MemoryIndex(clock=f.clock)
        else:
            r = cfg.redis
            index = RedisIndex(
                r.url,
                prefix=r.prefix,
                clock=f.clock,
                cluster=r.cluster,
                instance_cache_ttl_s=r.instance_cache_ttl_s,
                socket_timeout_s=r.socket_timeout_s,
                write_timeout_s=r.write_timeout_s,
                apply_part_blocks=f.part_blocks[self.n % len(f.part_blocks)],
            )
        return f.wrap(index, self.n) if f.wrap is not None else index

    async def start(self) -> None:
        """Start the server (on the port it had, if any) and connect the stubs."""
        cfg = self.config()
        self.index = self._backend(cfg)
        self.server = await start_server(cfg, self.index)
        self.port = self.server.port
        self.channel = grpc.aio.insecure_channel(self.server.address, options=CHANNEL_OPTIONS)
        self.stub = pb_grpc.IndexerServiceStub(self.channel)
        self.sg_stub = spb_grpc.KVIndexerStub(self.channel)

    async def stop(self) -> None:
        """Stop the server at once (in-flight calls are cancelled) and close the backend."""
        self.run += 1
        server, index, channel = self.server, self.index, self.channel
        self.server = self.index = self.channel = None
        if server is not None:
            await server.stop(0)
        if index is not None:
            with contextlib.suppress(Exception):
                await index.close()
        if channel is not None:
            await channel.close()

    def subscriber(self, engine: int) -> Any:
        """The ZMQ subscriber of engine ``engine`` (replica 0 only; None when down)."""
        if self.server is None or self.server.subscribers is None:
            return None
        return self.server.subscribers.subscribers[engine]


#: Blocks per apply script of each replica over Redis, in turn (indexer/redis/
#: KEYS.md, "Apply in parts"): the harness's batches are a few 8-block chains, so
#: small parts cut most of them, replicas cut them differently, and a batch cut
#: off midway (a deadline, a restart) goes on through another replica.
PART_BLOCKS = (3, 2, 0)


class Fleet:
    """The replicas of one run over one target, with the run's clock and engines."""

    def __init__(
        self,
        target: Target,
        replicas: int,
        *,
        prefix: str,
        clock: LeaseClock,
        engines: Sequence[ZmqEngine] = (),
        cache_ttl_s: float = CACHE_TTL_S,
        wrap: IndexWrapper | None = None,
        zmq_policy: str = "reset",
        part_blocks: Sequence[int] = PART_BLOCKS,
    ) -> None:
        if target.kind == "memory" and replicas != 1:
            raise ValueError("the memory backend is one replica's own index: replicas=1")
        self.target = target
        self.prefix = prefix
        self.clock = clock
        self.engines = list(engines)
        self.cache_ttl_s = cache_ttl_s if target.kind != "memory" else 0.0
        self.wrap = wrap
        self.zmq_policy = zmq_policy
        #: Replica ``n`` applies batches in parts of ``part_blocks[n % len]`` blocks.
        self.part_blocks = tuple(part_blocks) or (0,)
        self.replicas = [Replica(self, i) for i in range(replicas)]

    async def start(self) -> None:
        """Start every replica."""
        for r in self.replicas:
            await r.start()

    async def restart(self, i: int) -> None:
        """Stop replica ``i`` and start it again on its port."""
        r = self.replicas[i]
        await r.stop()
        await r.start()

    async def close(self) -> None:
        """Stop every replica."""
        for r in self.replicas:
            await r.stop()


# -- a router's follower of the memory replica ---------------------------------------

#: The follower's lag bound F as the harness holds it, seconds: from the
#: replica acknowledging a change (or a stalled stream flowing again) to the
#: follower answering from a copy that holds it, or going out of sync. The
#: measured lag is a few ms (``kvmesh bench follower``); this leaves room for
#: the event loop of a loaded 2-core machine that runs replica, follower and
#: harness at once.
FOLLOWER_LAG_S = 1.0

#: Changes the replica may buffer for the follower before it is told to
#: resync (``WatchIndexRequest.max_buffer``): small, so that a stalled stream
#: overflows within a few operations.
FOLLOWER_BUFFER = 4

#: Options of the follower's channel on top of the router's (and the fleet's
#: short reconnect backoff, :data:`CHANNEL_OPTIONS`): a small HTTP/2
#: window the client grants and no window growth (BDP probing), so that a
#: stalled stream blocks the replica's sends after a few KiB and the changes
#: that follow back up in the replica's buffer for the follower (with grpc's
#: default window, hundreds of changes would fit in flight).
WINDOW_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.lookahead_bytes", 1024),
    ("grpc.http2.bdp_probe", 0),
)

#: Bytes relayed per read by the proxy.
_CHUNK = 65536


class HarnessFollower(IndexFollower):
    """The router's follower, noting where its copy came from.

    :attr:`synced_run` is the run of the replica (:attr:`Replica.run` of the
    connection the stream came over) whose snapshot the copy was loaded from,
    :attr:`unsynced_at` when the follower last went out of sync.
    """

    synced_run = -1
    unsynced_at = 0.0
    #: The run of the connection the stream comes over now (set by the link).
    run_of: Callable[[], int] = staticmethod(lambda: 0)

    def _set_synced(self, value: bool) -> None:
        if not value and (self.synced or not self.unsynced_at):
            self.unsynced_at = time.monotonic()
        super()._set_synced(value)

    async def _on(self, ch: pb.WatchChange) -> None:
        await super()._on(ch)
        if ch.WhichOneof("change") == "synced":
            self.synced_run = self.run_of()


class Proxy:
    """A TCP relay on 127.0.0.1 in front of a port, that cuts and stalls what it relays."""

    def __init__(self, upstream: Callable[[], int], run: Callable[[], int]) -> None:
        self._upstream = upstream
        self._run = run
        self._server: asyncio.Server | None = None
        self._conns: set[tuple[asyncio.StreamWriter, asyncio.StreamWriter]] = set()
        self._flowing = asyncio.Event()
        self._flowing.set()
        self.port = 0
        #: The upstream's run (``run()``) the newest connection was opened in.
        self.newest_run = -1

    async def start(self) -> Proxy:
        """Listen on a free port."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        run = self._run()
        try:
            ur, uw = await asyncio.open_connection("127.0.0.1", self._upstream())
        except OSError:
            cw.transport.abort()
            return
        pair = (cw, uw)
        self._conns.add(pair)
        self.newest_run = run
        try:
            await asyncio.gather(self._pipe(cr, uw, False), self._pipe(ur, cw, True))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._conns.discard(pair)
            cw.transport.abort()
            uw.transport.abort()

    async def _pipe(self, r: asyncio.StreamReader, w: asyncio.StreamWriter, down: bool) -> None:
        while data := await r.read(_CHUNK):
            if down:
                await self._flowing.wait()
            w.write(data)
            await w.drain()
        w.transport.abort()

    def cut(self) -> int:
        """Reset every connection relayed now; how many."""
        n = len(self._conns)
        for cw, uw in list(self._conns):
            cw.transport.abort()
            uw.transport.abort()
        return n

    def stall(self) -> None:
        """Stop relaying towards the client (what arrives waits, then backs up)."""
        self._flowing.clear()

    def resume(self) -> None:
        """Relay again."""
        self._flowing.set()

    async def close(self) -> None:
        """Stop listening and reset every connection."""
        self.resume()
        self.cut()
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5.0)


class FollowerLink:
    """A follower of the fleet's memory replica (or of Redis replica 0's copy of the
    shared index), through a :class:`Proxy`, with its faults."""

    def __init__(
        self,
        replica: Replica,
        clock: Callable[[], float],
        cls: type[HarnessFollower] = HarnessFollower,
    ) -> None:
        self.replica = replica
        self.proxy = Proxy(lambda: self.replica.port, lambda: self.replica.run)
        self._clock = clock
        self._cls = cls
        self.follower: HarnessFollower | None = None
        self._channel: grpc.aio.Channel | None = None
        #: The step at which a stall ends (-1: none under way).
        self.stall_until = -1
        #: When the stream last flowed again after a fault (monotonic).
        self.fault_end = -1e18

    @property
    def f(self) -> HarnessFollower:
        """The follower."""
        assert self.follower is not None
        return self.follower

    async def start(self, timeout_s: float) -> bool:
        """Start relaying and following; whether the follower synced within ``timeout_s``."""
        await self.proxy.start()
        self._channel = grpc.aio.insecure_channel(
            f"127.0.0.1:{self.proxy.port}",
            options=RECEIVE_OPTIONS + WINDOW_OPTIONS + CHANNEL_OPTIONS,
        )
        self.follower = self._cls(
            channel=self._channel, clock=self._clock, max_buffer=FOLLOWER_BUFFER
        )
        self.follower.run_of = lambda: self.proxy.newest_run
        await self.follower.start()
        return await self.follower.wait_synced(timeout_s)

    @property
    def stalled(self) -> bool:
        """Whether the stream is stalled now."""
        return self.stall_until >= 0

    def replica_position(self) -> int | None:
        """The replica's stream position now (None while it is down, or while a
        replica over Redis holds no copy of the index)."""
        server = self.replica.server
        if server is None:
            return None
        index = server.servicer.watch_index
        if index is None and server.servicer.watch_feed is not None:
            index = server.servicer.watch_feed.mirror
        if index is None or index.watch is None:
            return None
        position: int = index.watch.position
        return position

    async def redis_top(self) -> int | None:
        """Over Redis: the number of the change stream's last entry (every change
        acknowledged so far is at or before it); None elsewhere or while down."""
        server = self.replica.server
        if server is None or server.servicer.watch_feed is None:
            return None
        idx = server.servicer.watch_feed.index
        try:
            raw = await idx._cmd("GET", idx._base + b"wn")
        except KvmeshError:
            return None
        return int(raw) if raw is not None else 0

    def caught_up(self, top: int | None = None) -> bool:
        """Whether the follower answers from a copy holding every change its replica
        applied: in sync, loaded from the replica's current run, at the
        replica's position; over Redis (``top``: :meth:`redis_top`, read
        before), the replica's copy also holds every entry up to ``top``."""
        f, pos = self.f, self.replica_position()
        if top is not None:
            server = self.replica.server
            feed = server.servicer.watch_feed if server is not None else None
            if feed is None or feed.mirror is None or feed.position < top:
                return False
        return (
            f.synced and f.synced_run == self.replica.run and pos is not None and f.position >= pos
        )

    def cut(self) -> None:
        """Reset the follower's stream."""
        self.proxy.cut()
        self.fault_end = time.monotonic()

    def stall(self, until_step: int) -> None:
        """Stall the follower's stream until step ``until_step``."""
        self.proxy.stall()
        self.stall_until = until_step

    def resume(self) -> None:
        """Let the stalled stream flow again."""
        self.proxy.resume()
        self.stall_until = -1
        self.fault_end = time.monotonic()

    async def close(self) -> None:
        """Stop following and relaying."""
        if self.follower is not None:
            await self.follower.close()
        if self._channel is not None:
            await self._channel.close()
        await self.proxy.close()
