"""OpenTelemetry set-up shared by every kvmesh service, and its Prometheus counters.

Tracing is **off by default**. A service calls :func:`configure_tracing` at
start; it turns tracing on only when the standard ``OTEL_*`` variables ask
for it:

- ``OTEL_TRACES_EXPORTER``: ``otlp`` (default when an OTLP endpoint is set),
  ``console``, ``none``, or a comma-separated list of these;
- ``OTEL_EXPORTER_OTLP_ENDPOINT`` / ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``;
  setting one alone turns OTLP tracing on;
- ``OTEL_EXPORTER_OTLP_PROTOCOL`` / ``..._TRACES_PROTOCOL``: ``grpc``
  (default) or ``http/protobuf``;
- ``OTEL_SERVICE_NAME`` (default: the service's own name),
  ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``, ``OTEL_BSP_*``,
  ``OTEL_EXPORTER_OTLP_TIMEOUT``, headers, certificates...: read by the
  OpenTelemetry SDK and exporter themselves;
- ``OTEL_SDK_DISABLED=true`` keeps tracing off whatever else is set.

An application that embeds kvmesh components (a router with
:mod:`router_client` and :class:`tee.logic.Tee`) may instead install its own
SDK tracer provider; :func:`tracing_enabled` then reports tracing on as well.
Components decide whether to trace when they are built (so that tracing off
costs one attribute check per call), hence tracing must be set up before
servers, indexes and tees are created.

Spans of health checks (``grpc.health.v1``, ``Ping``, ``/healthz``, the xfer
peer heartbeat) are never sampled: :class:`HealthCheckFilter` drops them,
whoever creates them (kvmesh creates none, but auto-instrumentation would).

Export accounting: the exporter is wrapped so that every span handed to it is
counted as exported or failed, and the batch processor so that a span dropped
because the export queue is full is counted too. :func:`register_metrics`
exposes these counters in a service's Prometheus registry
(``kvmesh_tracing_spans_exported_total`` and
``kvmesh_tracing_spans_dropped_total{reason}``). An unreachable collector thus
never slows serving (exports run on the SDK's worker thread, off the event
loop) and shows up as a rising ``reason="export_failed"`` count.

RPC spans follow the OpenTelemetry semantic conventions for gRPC (v1.44):
:func:`rpc_server_attributes` and :func:`rpc_client_attributes` give a span
its attributes at creation (``rpc.system.name`` ``grpc``, the fully qualified
``rpc.method`` that is also the span name, ``server.address`` /
``server.port`` from a client's target, ``network.peer.*`` from a server's
peer) and :func:`end_rpc_span` its outcome (``rpc.response.status_code``, the
status name; ``error.type`` and status ERROR on failure). A server span fails
only on the codes that mean the server failed (:data:`GRPC_SERVER_ERRORS`):
a caller's bad argument, missing entity, lack of rights or cancellation
leaves its status unset. A client span fails on every code but OK.

The resource names the service: ``service.name`` is the service's own name
unless ``OTEL_SERVICE_NAME`` or ``OTEL_RESOURCE_ATTRIBUTES`` set one (the
environment wins), ``service.version`` is kvmesh's version.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from opentelemetry import propagate, trace
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from kvmesh import __version__

log = logging.getLogger(__name__)

#: Span name fragments of health checks and liveness pings: never sampled.
HEALTH_CHECK_MARKERS: tuple[str, ...] = ("grpc.health.v1.",)
#: Span name endings of health checks and liveness pings: never sampled.
HEALTH_CHECK_SUFFIXES: tuple[str, ...] = (
    "/Ping",
    "/healthz",
    "kvmesh.xfer.v1.XferService/Heartbeat",
)


# -- export accounting ------------------------------------------------------------


class SpanCounts:
    """Process-wide counts of spans by export outcome (thread-safe).

    ``ended`` counts sampled spans handed to the batch processor; each ends
    up ``exported``, ``failed`` (the exporter gave up: collector down,
    refused, timed out), ``queue_full`` (dropped before export) or is still
    queued.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.ended = 0
        self.exported = 0
        self.failed = 0
        self.queue_full = 0

    def add(self, field: str, n: int = 1) -> None:
        """Add ``n`` to the counter ``field``."""
        with self._lock:
            setattr(self, field, getattr(self, field) + n)

    def snapshot(self) -> dict[str, int]:
        """A consistent copy of the counters."""
        with self._lock:
            return {
                "ended": self.ended,
                "exported": self.exported,
                "failed": self.failed,
                "queue_full": self.queue_full,
            }


#: The counters of this process (one tracer provider per process).
counts = SpanCounts()


def _counting_exporter(inner: Any) -> Any:
    """Wrap a SpanExporter so that each span it is handed is counted by outcome."""
    from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

    class CountingSpanExporter(SpanExporter):
        """Delegates to ``inner``; counts spans exported and spans whose export failed."""

        def __init__(self) -> None:
            self.inner = inner

        def export(self, spans: Sequence[Any]) -> SpanExportResult:
            try:
                result: SpanExportResult = self.inner.export(spans)
            except Exception:
                # The SDK would log and swallow it; count the loss first.
                counts.add("failed", len(spans))
                raise
            counts.add("exported" if result is SpanExportResult.SUCCESS else "failed", len(spans))
            return result

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(self.inner.force_flush(timeout_millis))

    return CountingSpanExporter()


def _accounting_processor(exporter: Any) -> Any:
    """A BatchSpanProcessor (``OTEL_BSP_*`` settings) that also counts queue-full drops."""
    from opentelemetry.sdk.trace import SpanProcessor
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    class AccountingSpanProcessor(SpanProcessor):
        """Counts sampled spans ended, and those the full export queue drops."""

        def __init__(self) -> None:
            self.inner: Any = BatchSpanProcessor(exporter)
            # The SDK's batch queue is a bounded deque that silently drops its
            # oldest span when full; its own drop count goes only to an
            # OpenTelemetry meter, so look at the queue to count drops here.
            # If a later SDK moves these internals, drops go uncounted (the
            # exported/failed counts are unaffected).
            batch = getattr(self.inner, "_batch_processor", None)
            self._queue = getattr(batch, "_queue", None)
            self._max = getattr(batch, "_max_queue_size", None)

        def on_start(self, span: Any, parent_context: Any = None) -> None:
            self.inner.on_start(span, parent_context)

        def on_end(self, span: Any) -> None:
            if not (span.context and span.context.trace_flags.sampled):
                return
            counts.add("ended")
            queue = self._queue
            if queue is not None and self._max is not None and len(queue) >= self._max:
                counts.add("queue_full")
            self.inner.on_end(span)

        def shutdown(self) -> None:
            self.inner.shutdown()

        def force_flush(self, timeout_millis: int = 30000) -> bool:
            return bool(self.inner.force_flush(timeout_millis))

    return AccountingSpanProcessor()


class _TracingCollector(Collector):
    def collect(self) -> Iterable[CounterMetricFamily]:
        c = counts.snapshot()
        yield CounterMetricFamily(
            "kvmesh_tracing_spans_exported",
            "Spans the trace exporter delivered.",
            value=c["exported"],
        )
        dropped = CounterMetricFamily(
            "kvmesh_tracing_spans_dropped",
            "Spans lost: export failed (collector down or refusing) or export queue full.",
            labels=["reason"],
        )
        dropped.add_metric(["export_failed"], c["failed"])
        dropped.add_metric(["queue_full"], c["queue_full"])
        yield dropped


_registered: weakref.WeakSet[CollectorRegistry] = weakref.WeakSet()
_registered_lock = threading.Lock()


def register_metrics(registry: CollectorRegistry) -> None:
    """Expose the span export counters in ``registry`` (idempotent per registry)."""
    with _registered_lock:
        if registry in _registered:
            return
        registry.register(_TracingCollector())
        _registered.add(registry)


# -- RPC spans (OpenTelemetry semantic conventions for gRPC) ------------------------

#: ``rpc.system.name``: the RPC system, always ``grpc`` here.
RPC_SYSTEM_NAME = "rpc.system.name"
#: ``rpc.method``: ``<package>.<Service>/<Method>``, also the span name.
RPC_METHOD = "rpc.method"
#: ``rpc.response.status_code``: the gRPC status name (``OK``, ``NOT_FOUND``...).
#: Semantic conventions v1.44; a later draft renames it ``rpc.status_code``.
RPC_STATUS_CODE = "rpc.response.status_code"
#: ``error.type``: the status name again, on failed calls only.
ERROR_TYPE = "error.type"
#: ``server.address`` / ``server.port``: where a client span's call went (from its target).
SERVER_ADDRESS = "server.address"
SERVER_PORT = "server.port"
#: ``network.peer.address`` / ``network.peer.port``: who a server span's call came from.
NETWORK_PEER_ADDRESS = "network.peer.address"
NETWORK_PEER_PORT = "network.peer.port"

#: Status codes that make a server span failed: the server's own failures. Every
#: other code (INVALID_ARGUMENT, NOT_FOUND, ALREADY_EXISTS, FAILED_PRECONDITION,
#: OUT_OF_RANGE, UNAUTHENTICATED, PERMISSION_DENIED, CANCELLED, RESOURCE_EXHAUSTED,
#: ABORTED) reports what the caller asked or did and leaves the status unset, so
#: that an error rate on server spans counts only what the server has to fix.
GRPC_SERVER_ERRORS: frozenset[str] = frozenset(
    {"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS"}
)


def _split_host_port(hostport: str) -> tuple[str, int | None]:
    """``host:port``, ``[v6]:port``, ``host`` -> (host, port or None); a bare
    IPv6 address or a port that is no number leaves the whole string as host."""
    if hostport.startswith("["):
        host, _, rest = hostport[1:].partition("]")
        port = rest[1:] if rest.startswith(":") else ""
        return host, int(port) if port.isdigit() else None
    if hostport.count(":") == 1:
        host, _, port = hostport.partition(":")
        if port.isdigit():
            return host, int(port)
    return hostport, None


def target_attributes(target: str) -> dict[str, str | int]:
    """``server.address`` and ``server.port`` of a client's gRPC target string.

    As the conventions ask, from the target (never the resolved connection),
    so that every replica behind one name gives the same low-cardinality
    value: ``host:port`` and ``dns:[//authority/]host:port`` give the host and
    the port, ``unix:path`` the path alone; a target naming several addresses
    or a scheme gRPC resolves otherwise is the address whole, with no port.
    """
    t = target.strip()
    if t.startswith("unix:"):
        path = t[len("unix:") :]
        return {SERVER_ADDRESS: path[2:] if path.startswith("//") else path}
    if t.startswith("dns:"):
        rest = t[len("dns:") :]
        if rest.startswith("//"):
            rest = rest[2:].partition("/")[2]
        hostport = rest
    elif t.startswith(("ipv4:", "ipv6:")):
        if "," in t:
            return {SERVER_ADDRESS: t}
        hostport = t[len("ipv4:") :]
    elif "/" in t:  # another resolver's scheme (xds:///name, zk://...)
        return {SERVER_ADDRESS: t}
    else:
        hostport = t
    host, port = _split_host_port(hostport)
    attrs: dict[str, str | int] = {SERVER_ADDRESS: host}
    if port is not None:
        attrs[SERVER_PORT] = port
    return attrs


def peer_attributes(peer: str | None) -> dict[str, str | int]:
    """``network.peer.address`` / ``.port`` of a server-side ``context.peer()``
    (``ipv4:10.0.0.7:51234``, ``ipv6:%5B::1%5D:51234``, ``unix:/path``); empty
    for anything else."""
    if not peer:
        return {}
    kind, _, rest = unquote(peer).partition(":")
    if kind == "unix":
        return {NETWORK_PEER_ADDRESS: rest} if rest else {}
    if kind not in ("ipv4", "ipv6"):
        return {}
    host, port = _split_host_port(rest)
    attrs: dict[str, str | int] = {NETWORK_PEER_ADDRESS: host}
    if port is not None:
        attrs[NETWORK_PEER_PORT] = port
    return attrs


def rpc_server_attributes(full_method: str, peer: str | None = None) -> dict[str, str | int]:
    """The attributes a server span of ``full_method`` (``pkg.Service/Method``)
    starts with; ``peer`` is the call's ``context.peer()``."""
    return {RPC_SYSTEM_NAME: "grpc", RPC_METHOD: full_method, **peer_attributes(peer)}


def rpc_client_attributes(full_method: str, target: str | None) -> dict[str, str | int]:
    """The attributes a client span of ``full_method`` towards ``target`` (the
    string the channel was dialled with; None: unknown) starts with."""
    attrs: dict[str, str | int] = {RPC_SYSTEM_NAME: "grpc", RPC_METHOD: full_method}
    if target:
        attrs.update(target_attributes(target))
    return attrs


def rpc_failed(code: str, *, server: bool) -> bool:
    """Whether a call that ended with status ``code`` failed, seen from its
    server (:data:`GRPC_SERVER_ERRORS`) or its client (every code but OK)."""
    return code in GRPC_SERVER_ERRORS if server else code != "OK"


def end_rpc_span(span: trace.Span, code: str, *, server: bool) -> None:
    """Record on ``span`` that its call ended with status ``code`` (a
    ``grpc.StatusCode`` name): ``rpc.response.status_code``, and when the call
    failed (:func:`rpc_failed`) ``error.type`` and status ERROR. Does not end
    the span."""
    span.set_attribute(RPC_STATUS_CODE, code)
    if rpc_failed(code, server=server):
        span.set_attribute(ERROR_TYPE, code)
        span.set_status(trace.StatusCode.ERROR, code)


# -- sampling -----------------------------------------------------------------------


def is_health_check(name: str) -> bool:
    """Whether a span named ``name`` belongs to a health check or liveness ping."""
    return name.endswith(HEALTH_CHECK_SUFFIXES) or any(m in name for m in HEALTH_CHECK_MARKERS)


def _health_filter(base: Any) -> Any:
    from opentelemetry.sdk.trace.sampling import Decision, Sampler, SamplingResult

    class HealthCheckFilter(Sampler):
        """Drops health-check spans; asks ``base`` about every other span."""

        def should_sample(
            self,
            parent_context: Any,
            trace_id: int,
            name: str,
            kind: Any = None,
            attributes: Any = None,
            links: Any = None,
            trace_state: Any = None,
        ) -> SamplingResult:
            if is_health_check(name):
                return SamplingResult(Decision.DROP)
            result: SamplingResult = base.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )
            return result

        def get_description(self) -> str:
            return f"HealthCheckFilter{{{base.get_description()}}}"

    return HealthCheckFilter()


def health_filtered_sampler() -> Any:
    """The sampler ``OTEL_TRACES_SAMPLER`` names (default parent-based always-on),
    wrapped so that health-check spans are dropped."""
    from opentelemetry.sdk.trace import sampling

    getter = getattr(sampling, "_get_from_env_or_default", None)
    base = getter() if getter is not None else sampling.ParentBased(sampling.ALWAYS_ON)
    return _health_filter(base)


# -- set-up -------------------------------------------------------------------------


def _env_resource_attributes(env: Mapping[str, str]) -> dict[str, str]:
    """``OTEL_RESOURCE_ATTRIBUTES`` (``k=v,...``, values percent-decoded) and
    ``OTEL_SERVICE_NAME`` of ``env``, as the SDK reads them."""
    attrs: dict[str, str] = {}
    for item in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(","):
        key, sep, value = item.partition("=")
        if sep and key.strip():
            attrs[key.strip()] = unquote(value.strip())
        elif item.strip():
            log.warning("OTEL_RESOURCE_ATTRIBUTES: %r is not key=value; left out", item)
    if env.get("OTEL_SERVICE_NAME"):
        attrs["service.name"] = env["OTEL_SERVICE_NAME"]
    return attrs


def service_resource(service_name: str, environ: Mapping[str, str] | None = None) -> Any:
    """The OpenTelemetry resource of a kvmesh service's spans.

    ``service.name`` is ``service_name`` and ``service.version`` kvmesh's
    version, unless the environment says otherwise: ``OTEL_SERVICE_NAME``
    wins over a ``service.name`` in ``OTEL_RESOURCE_ATTRIBUTES``, which wins
    over the defaults here (so an operator can name each deployment). The
    SDK's own attributes (``telemetry.sdk.*``) and detectors are kept.
    ``environ`` replaces ``os.environ`` for the two variables.
    """
    from opentelemetry.sdk.resources import Resource

    env = os.environ if environ is None else environ
    ours = Resource.create({"service.name": service_name, "service.version": __version__})
    return ours.merge(Resource(_env_resource_attributes(env)))


_enabled = False
_provider: Any = None
_setup_lock = threading.Lock()


def tracing_enabled() -> bool:
    """Whether spans are recorded in this process: :func:`configure_tracing` turned
    tracing on, or the application installed an SDK tracer provider itself.

    Cheap after the first positive answer (OpenTelemetry's global provider is
    set once per process), about a microsecond before; components call it
    when they are built, not per request.
    """
    global _enabled
    if _enabled:
        return True
    provider = trace.get_tracer_provider()
    _enabled = not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)
    return _enabled


def _wanted(env: Mapping[str, str]) -> list[str]:
    """The exporters the ``OTEL_*`` variables ask for (empty: tracing off)."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return []
    raw = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    endpoint = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    if not raw:
        return ["otlp"] if endpoint else []
    names = [n.strip() for n in raw.split(",") if n.strip()]
    return [] if names == ["none"] else [n for n in names if n != "none"]


def _otlp_exporter(env: Mapping[str, str]) -> Any:
    """The OTLP span exporter for ``OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL``; None if unusable."""
    protocol = (
        env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
        or "grpc"
    ).strip()
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                OTLPSpanExporter as GrpcExporter,
            )

            return GrpcExporter()
        if protocol == "http/protobuf":
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter as HttpExporter,
            )

            return HttpExporter()
    except ImportError as e:
        log.warning("OTLP traces asked for but the exporter is not installed (%s)", e)
        return None
    log.warning("OTLP protocol %r is not supported (use grpc or http/protobuf)", protocol)
    return None


def configure_tracing(
    service_name: str = "kvmesh", environ: Mapping[str, str] | None = None
) -> bool:
    """Set up the OpenTelemetry SDK from the ``OTEL_*`` variables if they ask for it.

    ``service_name`` is the default ``service.name`` (see
    :func:`service_resource`). Returns whether tracing is on. Idempotent; when tracing is already
    on (set up here or by the application) nothing changes. ``environ``
    replaces ``os.environ`` for the on/off decision and the exporter choice
    (the exporter still reads its own settings from ``os.environ``).
    """
    global _enabled, _provider
    env = os.environ if environ is None else environ
    with _setup_lock:
        if tracing_enabled():
            return True
        wanted = _wanted(env)
        if not wanted:
            return False
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        exporters: list[Any] = []
        for name in wanted:
            if name == "console":
                exporters.append(ConsoleSpanExporter())
            elif name == "otlp":
                otlp = _otlp_exporter(env)
                if otlp is not None:
                    exporters.append(otlp)
            else:
                log.warning("OTEL_TRACES_EXPORTER %r is not supported (otlp, console)", name)
        if not exporters:
            log.warning("no usable trace exporter; tracing stays off")
            return False
        provider = TracerProvider(
            resource=service_resource(service_name, env), sampler=health_filtered_sampler()
        )
        for exporter in exporters:
            provider.add_span_processor(_accounting_processor(_counting_exporter(exporter)))
        trace.set_tracer_provider(provider)
        _provider = provider
        _enabled = True
        log.info("OpenTelemetry tracing on (exporters %s)", ",".join(wanted))
        return True


def shutdown_tracing() -> None:
    """Flush and stop the provider :func:`configure_tracing` installed (if any)."""
    provider = _provider
    if provider is not None:
        provider.shutdown()


def inject_context(span: trace.Span | None = None) -> tuple[tuple[str, str], ...]:
    """The trace context of ``span`` (default: the current span) as header pairs
    (``traceparent``, ``tracestate``...).

    Empty when there is no valid span. For gRPC metadata and HTTP headers,
    whose keys are lower case.
    """
    carrier: dict[str, str] = {}
    propagate.inject(carrier, None if span is None else trace.set_span_in_context(span))
    return tuple(carrier.items())


def extract_context(pairs: Iterable[tuple[str, Any]] | None) -> Any:
    """The trace context carried by gRPC metadata or header pairs (str values only)."""
    carrier = {k: v for k, v in pairs or () if isinstance(v, str)}
    return propagate.extract(carrier)
