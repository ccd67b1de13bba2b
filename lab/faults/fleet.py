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
"""

from __future__ import annotations

import contextlib
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
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2_grpc as spb_grpc
from kvmesh.errors import Unavailable
from lab.faults.engines import ZmqEngine
from lab.faults.faults import Target
from lab.faults.ops import BLOCK_SIZE, SG_MODEL, SG_TTL_S

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
