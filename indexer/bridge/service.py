"""The bridge process: engine subscribers feeding the indexer link, metrics, health.

:class:`Bridge` runs one :class:`~indexer.kvevents.subscriber.EndpointSubscriber`
per ``engine_events.endpoints`` entry (the indexer's own stream logic: replay
on gaps, publisher restarts, rebuilds, liveness) over an
:class:`~indexer.bridge.link.IndexerLink` instead of an indexer's logic, each
with a bounded buffer between its socket and the link (``buffer``). Nothing
here waits on the engine or slows it: the subscribers only read.

Health (``health_port``): ``""`` is SERVING from start to stop, whatever the
indexer does, so a kubelet probe restarts a bridge that hangs, never one whose
indexer is away (restarting it would lose nothing but would not help either);
``kvmesh.bridge`` follows the link (SERVING while the indexer answers).
Stopping (SIGTERM) waits up to ``shutdown_grace_s`` for the buffered batches to
be acknowledged, then stops; an instance is left to its lease (removing it
takes role admin), which runs out unless another bridge takes it over.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from typing import Any

from grpc_health.v1 import health, health_pb2

from indexer.bridge.config import BridgeConfig
from indexer.bridge.link import IndexerLink
from indexer.bridge.metrics import BridgeCollector, Snapshot
from indexer.kvevents.buffer import BufferCounters, BufferLimits
from indexer.kvevents.subscriber import EngineEventSubscribers, SubscriberOptions
from kvmesh import runtime
from kvmesh.configfile import ConfigError
from kvmesh.errors import KvmeshError
from kvmesh.grpcsvc import HealthPort
from kvmesh.metrics import ComponentRegistry

log = logging.getLogger(__name__)

#: Health service name that follows the link to the indexer.
HEALTH_SERVICE = "kvmesh.bridge"

#: How often a stopping bridge looks whether its buffers are drained.
_DRAIN_POLL_S = 0.05

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Bridge:
    """A running bridge (see the module doc). Build and start it with :func:`start_bridge`."""

    def __init__(self, config: BridgeConfig) -> None:
        self.config = config
        self.health = health.aio.HealthServicer()
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.link = IndexerLink(config.indexer, on_state=self._on_link_state)
        options = SubscriberOptions(
            default_lease_ttl_s=config.default_lease_ttl_s,
            applies_inline=False,
            incarnation_prefix=config.incarnation_prefix,
            adopt_foreign=False,
            buffer=BufferLimits(config.buffer.max_batches, config.buffer.max_bytes),
        )
        self.subscribers = EngineEventSubscribers(self.link, config.engine_events, options)
        self.registry = ComponentRegistry()
        self.registry.register(BridgeCollector(self.snapshot))
        self._health_port = (
            HealthPort(self.health, runtime.host_port(config.host, config.health_port))
            if config.health_port
            else None
        )
        self.health_port = 0
        self.metrics_port = 0
        self._metrics_http: Any = None
        self._stopped = False

    # -- figures -----------------------------------------------------------------------

    def counters(self) -> dict[str, int | dict[str, int]]:
        """Every counter of the bridge, summed over its endpoints (metrics.py names them)."""
        out: dict[str, int | dict[str, int]] = {}
        sub = self.subscribers.counters()
        for f in dataclasses.fields(sub):
            out[f.name] = getattr(sub, f.name)
        buffers = BufferCounters()
        for s in self.subscribers.subscribers:
            if s.buffer is not None:
                b = s.buffer.counters
                buffers.accepted += b.accepted
                buffers.dropped += b.dropped
                buffers.bytes_dropped += b.bytes_dropped
        out["batches_buffered"] = buffers.accepted
        out["batches_dropped"] = buffers.dropped
        out["bytes_dropped"] = buffers.bytes_dropped
        link = self.link.counters
        for f in dataclasses.fields(link):
            value = getattr(link, f.name)
            out[f.name] = dict(value) if isinstance(value, dict) else value
        return out

    def snapshot(self) -> Snapshot:
        """Counters and gauges for a scrape (:class:`~indexer.bridge.metrics.BridgeCollector`)."""
        held = [s.buffer for s in self.subscribers.subscribers if s.buffer is not None]
        gauges = {
            "buffer_batches": float(sum(len(b) for b in held)),
            "buffer_bytes": float(sum(b.bytes for b in held)),
            "buffer_high_water_batches": float(
                max((b.counters.high_water for b in held), default=0)
            ),
            "indexer_up": 1.0 if self.link.up else 0.0,
            "engines_connected": float(
                sum(1 for s in self.subscribers.subscribers if s.connected_peers > 0)
            ),
        }
        return self.counters(), gauges

    # -- lifecycle ---------------------------------------------------------------------

    def _on_link_state(self, up: bool) -> None:
        if self._stopped:
            return
        task = asyncio.get_running_loop().create_task(
            self.health.set(HEALTH_SERVICE, _SERVING if up else _NOT_SERVING)
        )
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def start(self) -> None:
        """Open the health and metrics ports, then start the subscribers."""
        cfg = self.config
        await self.health.set("", _SERVING)
        await self.health.set(HEALTH_SERVICE, _NOT_SERVING)
        if self._health_port is not None:
            self.health_port = await self._health_port.start()
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            try:
                self._metrics_http, _ = start_http_server(
                    cfg.metrics_port, addr=cfg.host, registry=self.registry
                )
            except OSError as e:
                await self.stop(0)
                raise OSError(
                    f"cannot serve metrics on {runtime.host_port(cfg.host, cfg.metrics_port)}: {e}"
                ) from e
            self.metrics_port = self._metrics_http.server_port
        self.subscribers.start()
        eps = cfg.engine_events.endpoints
        log.info(
            "kvmesh bridge: %d engine stream(s) (%s) to the indexer at %s%s",
            len(eps),
            ", ".join(f"{ep.worker_id}/dp{ep.dp_rank} {ep.endpoint}" for ep in eps),
            cfg.indexer.target,
            f", metrics on :{self.metrics_port}" if self.metrics_port else "",
        )

    def drained(self) -> bool:
        """Whether every buffer is empty and no batch is being handled."""
        return all(
            (s.buffer is None or not s.buffer) and s.idle for s in self.subscribers.subscribers
        )

    async def stop(self, grace: float | None = None) -> None:
        """Wait up to ``grace`` seconds (default ``shutdown_grace_s``) for the buffered
        batches to be acknowledged, then stop everything. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace is None else grace
        deadline = time.monotonic() + grace
        for _ in range(math.ceil(grace / _DRAIN_POLL_S)):
            if self.drained() or time.monotonic() >= deadline:
                break
            await asyncio.sleep(_DRAIN_POLL_S)
        await self.health.enter_graceful_shutdown()
        await self.subscribers.stop()
        await self.link.close()
        for t in list(self._health_tasks):
            t.cancel()
        if self._health_port is not None:
            await self._health_port.stop()
        if self._metrics_http is not None:
            http = self._metrics_http
            await asyncio.get_running_loop().run_in_executor(None, http.shutdown)
            http.server_close()
        log.info("kvmesh bridge stopped")


async def start_bridge(config: BridgeConfig) -> Bridge:
    """Build and start a bridge on the running loop (TLS files are read here)."""
    bridge = Bridge(config)
    try:
        await bridge.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await bridge.stop(0)
        raise
    return bridge


def run(config: BridgeConfig) -> int:
    """Run a bridge in the foreground until SIGTERM or SIGINT; return an exit code."""
    runtime.setup_logging(config.log_level, config.log_format)
    return runtime.run_main(
        lambda: runtime.serve_until_signal(
            lambda: start_bridge(config),
            errors=(OSError, KvmeshError, ConfigError),
            log=log,
            draining=f"draining the buffered batches (grace {config.shutdown_grace_s:.1f}s)",
        )
    )
