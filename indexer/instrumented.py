"""Metrics and traces: the :class:`InstrumentedIndex` decorator and the metric set.

Prometheus metrics live in a per-server :class:`Metrics` registry (so several
servers in one process, as in tests, never collide). OpenTelemetry spans are
created only when tracing is configured through the standard ``OTEL_*``
environment variables (see :func:`configure_tracing`); otherwise no span
object is ever built, so tracing off costs one attribute check per call.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from indexer.index import Index
from indexer.model import (
    ApplyResult,
    EventBatch,
    IndexDump,
    IndexStats,
    InstanceId,
    InstanceMatch,
    InstanceSpec,
    InstanceState,
    Namespace,
    QuotaUsage,
)
from kvmesh import tracing as _tracing
from kvmesh.errors import KvmeshError
from kvmesh.metrics import ComponentRegistry

log = logging.getLogger(__name__)

#: Latency buckets in seconds. A memory-backend Match takes tens of
#: microseconds and a Redis one a round trip (~0.1-1 ms), so the buckets start
#: far below prometheus_client's default 5 ms floor.
LATENCY_BUCKETS = (
    25e-6,
    50e-6,
    100e-6,
    250e-6,
    500e-6,
    1e-3,
    2.5e-3,
    5e-3,
    10e-3,
    25e-3,
    50e-3,
    100e-3,
    250e-3,
    1.0,
    5.0,
)

TRACER_NAME = "kvmesh.indexer"


class Metrics:
    """The indexer's Prometheus metrics, in one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else ComponentRegistry()
        r = self.registry
        self.backend_seconds = Histogram(
            "kvmesh_indexer_backend_seconds",
            "Latency of index backend calls.",
            ["backend", "method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.backend_errors = Counter(
            "kvmesh_indexer_backend_errors_total",
            "Failed index backend calls by gRPC status code.",
            ["backend", "method", "code"],
            registry=r,
        )
        self.backend_up = Gauge(
            "kvmesh_indexer_backend_up", "1 while the backend answers pings.", registry=r
        )
        self.rpc_seconds = Histogram(
            "kvmesh_indexer_rpc_seconds",
            "Latency of IndexerService calls (streams: whole stream).",
            ["method"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.rpcs = Counter(
            "kvmesh_indexer_rpcs_total",
            "Finished IndexerService calls by gRPC status code.",
            ["method", "code"],
            registry=r,
        )
        self.rpcs_in_flight = Gauge(
            "kvmesh_indexer_rpcs_in_flight", "IndexerService calls in progress.", registry=r
        )
        self.refusals = Counter(
            "kvmesh_indexer_refusals_total",
            "Calls refused before reaching the service: UNAUTHENTICATED and PERMISSION_DENIED "
            "(identity, role), RESOURCE_EXHAUSTED (per-client limits), INVALID_ARGUMENT "
            "(undecodable request), by method.",
            ["method", "code"],
            registry=r,
        )
        self.redis_watch_lag = Histogram(
            "kvmesh_indexer_redis_watch_lag_seconds",
            "A replica over Redis serving followers: each change's delay from its writer's "
            "apply to this replica's copy of the index (the writers' clocks; "
            "indexer/redis/KEYS.md, Watching).",
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        # Span export counters (process-wide): a down collector shows here.
        _tracing.register_metrics(r)

    def watch_counters(self, read: Callable[[], Mapping[str, int | dict[str, int]]]) -> None:
        """Export each ``name -> value`` of ``read()`` as ``kvmesh_indexer_<name>_total``
        (a dict value: one series per reason)."""
        self.registry.register(_CallbackCounters(read))


class _CallbackCounters(Collector):
    def __init__(self, read: Callable[[], Mapping[str, int | dict[str, int]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[CounterMetricFamily]:
        for name, value in self._read().items():
            if isinstance(value, dict):
                # A counter by reason: kvmesh_indexer_<name>_total{reason=...}.
                fam = CounterMetricFamily(
                    f"kvmesh_indexer_{name}",
                    f"Replica counter {name}, by reason.",
                    labels=["reason"],
                )
                for reason, n in sorted(value.items()):
                    fam.add_metric([reason], n)
                yield fam
                continue
            yield CounterMetricFamily(
                f"kvmesh_indexer_{name}", f"Replica counter {name}.", value=value
            )


# -- tracing --------------------------------------------------------------------


def tracing_enabled() -> bool:
    """Whether spans are recorded in this process (see :func:`kvmesh.tracing.tracing_enabled`)."""
    return _tracing.tracing_enabled()


def configure_tracing(environ: Mapping[str, str] | None = None) -> bool:
    """Set up tracing for an indexer from ``OTEL_*`` variables (see :mod:`kvmesh.tracing`)."""
    return _tracing.configure_tracing("kvmesh-indexer", environ)


# -- the decorator --------------------------------------------------------------


class InstrumentedIndex(Index):
    """An :class:`Index` that records latency, errors and spans of another one.

    Semantics, thread-safety and return values are those of the wrapped index.
    """

    def __init__(self, inner: Index, metrics: Metrics, *, tracing: bool | None = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.metrics = metrics
        self._tracing = tracing_enabled() if tracing is None else tracing
        self._tracer = trace.get_tracer(TRACER_NAME) if self._tracing else None
        self._hist = {
            m: metrics.backend_seconds.labels(inner.name, m)
            for m in (
                "register",
                "heartbeat",
                "remove_instance",
                "list_instances",
                "apply",
                "match",
                "predict",
                "pending_predicted",
                "reap_expired",
                "stats",
                "dump",
                "ping",
            )
        }

    @contextlib.contextmanager
    def _observe(
        self, method: str, attrs: dict[str, Any] | None = None, *, span: bool = True
    ) -> Iterator[None]:
        span_cm: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
        if span and self._tracer is not None:
            span_cm = self._tracer.start_as_current_span(
                f"index.{method}",
                attributes={"kvmesh.backend": self.name, **(attrs or {})},
            )
        start = time.perf_counter()
        with span_cm:
            try:
                yield
            except KvmeshError as e:
                self.metrics.backend_errors.labels(self.name, method, e.code).inc()
                raise
            except Exception:
                self.metrics.backend_errors.labels(self.name, method, "INTERNAL").inc()
                raise
            finally:
                self._hist[method].observe(time.perf_counter() - start)

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """See :meth:`Index.register`."""
        with self._observe("register"):
            return await self.inner.register(spec)

    async def heartbeat(self, instance: InstanceId) -> InstanceState:
        """See :meth:`Index.heartbeat`."""
        with self._observe("heartbeat"):
            return await self.inner.heartbeat(instance)

    async def remove_instance(self, instance: InstanceId) -> int:
        """See :meth:`Index.remove_instance`."""
        with self._observe("remove_instance"):
            return await self.inner.remove_instance(instance)

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """See :meth:`Index.list_instances`."""
        with self._observe("list_instances"):
            return await self.inner.list_instances(model)

    async def apply(self, batch: EventBatch) -> ApplyResult:
        """See :meth:`Index.apply`."""
        with self._observe("apply", {"kvmesh.events": len(batch.events)}):
            return await self.inner.apply(batch)

    async def match(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        include_stale: bool = False,
        include_predicted: bool = False,
    ) -> list[InstanceMatch]:
        """See :meth:`Index.match`."""
        with self._observe("match", {"kvmesh.blocks": len(keys)}):
            if include_predicted:
                return await self.inner.match(
                    namespace, keys, include_stale=include_stale, include_predicted=True
                )
            return await self.inner.match(namespace, keys, include_stale=include_stale)

    async def match_with_pending(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> tuple[list[InstanceMatch], dict[InstanceId, int] | None]:
        """See :meth:`Index.match_with_pending` (observed as a Match)."""
        with self._observe("match", {"kvmesh.blocks": len(keys)}):
            return await self.inner.match_with_pending(namespace, keys, include_stale=include_stale)

    async def pending_predicted(self, model: str) -> dict[InstanceId, int] | None:
        """See :meth:`Index.pending_predicted`."""
        with self._observe("pending_predicted", span=False):
            return await self.inner.pending_predicted(model)

    async def predict(
        self,
        namespace: Namespace,
        instance: InstanceId,
        keys: Sequence[int],
        ttl_s: float,
        max_per_instance: int,
        pending_s: float | None = None,
    ) -> int:
        """See :meth:`Index.predict`."""
        with self._observe("predict", {"kvmesh.blocks": len(keys)}):
            return await self.inner.predict(
                namespace, instance, keys, ttl_s, max_per_instance, pending_s
            )

    async def reap_expired(self) -> list[InstanceId]:
        """See :meth:`Index.reap_expired`."""
        with self._observe("reap_expired"):
            return await self.inner.reap_expired()

    async def stats(self) -> IndexStats:
        """See :meth:`Index.stats`."""
        with self._observe("stats"):
            return await self.inner.stats()

    async def dump(self) -> IndexDump:
        """See :meth:`Index.dump`."""
        with self._observe("dump"):
            return await self.inner.dump()

    async def dump_blocks(
        self, model: str, cap: int
    ) -> tuple[list[tuple[Namespace, int, dict[InstanceId, int]]], bool]:
        """See :meth:`Index.dump_blocks`."""
        with self._observe("dump"):
            return await self.inner.dump_blocks(model, cap)

    async def generation(self) -> int | None:
        """See :meth:`Index.generation`."""
        return await self.inner.generation()

    async def quota_usage(self, identity: str) -> QuotaUsage:
        """See :meth:`Index.quota_usage`."""
        return await self.inner.quota_usage(identity)

    async def ping(self) -> None:
        """See :meth:`Index.ping`; also sets ``kvmesh_indexer_backend_up``."""
        try:
            # No span: the health monitor pings every second; traces would drown in them.
            with self._observe("ping", span=False):
                await self.inner.ping()
        except BaseException:
            self.metrics.backend_up.set(0)
            raise
        self.metrics.backend_up.set(1)

    async def close(self) -> None:
        """Close the wrapped index."""
        await self.inner.close()


def backend_of(index: Index) -> Index:
    """The backend under ``index``'s instrumentation (``index`` itself when bare)."""
    return index.inner if isinstance(index, InstrumentedIndex) else index
