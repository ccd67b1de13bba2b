"""The indexer's hooks into the call scope of kvmesh/grpcsvc.py.

Both gRPC services of an indexer (``kvmesh.indexer.v1.IndexerService``,
indexer/server.py, and SGLang's ``kv_indexer.v1.KVIndexer``,
indexer/sglang/server.py) register their methods through
:func:`kvmesh.grpcsvc.add_guarded`, which decodes requests, checks identity
and client limits and maps errors to statuses. Each service passes its own
:class:`IndexerCalls`, which adds to every method marked
:func:`kvmesh.grpcsvc.observed`:

- the in-flight cap ``limits.max_concurrent_rpcs`` of that service: beyond it
  a call is refused with RESOURCE_EXHAUSTED;
- per-method latency (``kvmesh_indexer_rpc_seconds``), status counts
  (``kvmesh_indexer_rpcs_total{method,code}``) and the in-flight gauge;
- a server span named ``<service>/<method>`` whose parent is the trace
  context of the call's metadata, when tracing is on, with the attributes
  and status of the OpenTelemetry gRPC conventions (kvmesh/tracing.py).
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import grpc
from opentelemetry import trace

from indexer.instrumented import TRACER_NAME, Metrics, tracing_enabled
from kvmesh.errors import ResourceExhausted
from kvmesh.grpcsvc import CallObserver
from kvmesh.tracing import end_rpc_span, extract_context, rpc_server_attributes


class IndexerCalls(CallObserver):
    """In-flight cap, metrics and server spans of one indexer gRPC service's calls."""

    def __init__(self, metrics: Metrics, max_concurrent_rpcs: int) -> None:
        self.metrics = metrics
        #: Calls of this service in flight at most (0: no limit).
        self.max_concurrent_rpcs = max_concurrent_rpcs
        #: Calls of this service in flight now.
        self.in_flight = 0
        #: Whether server spans are recorded (decided at construction).
        self.tracing = tracing_enabled()

    def admit(self, field: str = "") -> None:
        """Count one more call in flight, or raise RESOURCE_EXHAUSTED (naming ``field``)
        at the cap; the caller takes it off ``in_flight`` when the call ends."""
        limit = self.max_concurrent_rpcs
        if limit and self.in_flight >= limit:
            raise ResourceExhausted(
                f"server overloaded: {limit} calls in flight (limits.max_concurrent_rpcs); retry",
                field=field,
            )
        self.in_flight += 1

    def begin(self, service: str, method: str, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        """Admit the call under the in-flight cap; start its clock and, with tracing, its span."""
        m = self.metrics
        try:
            self.admit()
        except ResourceExhausted:
            m.rpcs.labels(method, "RESOURCE_EXHAUSTED").inc()
            raise
        m.rpcs_in_flight.inc()
        start = time.perf_counter()
        span_cm: contextlib.AbstractContextManager[Any] | None = None
        if self.tracing:
            span_cm = trace.get_tracer(TRACER_NAME).start_as_current_span(
                f"{service}/{method}",
                context=extract_context(context.invocation_metadata()),
                kind=trace.SpanKind.SERVER,
                attributes=rpc_server_attributes(f"{service}/{method}", context.peer()),
            )
            span_cm.__enter__()
        return start, span_cm

    def end(self, service: str, method: str, state: Any, code: str) -> None:
        """Record the call's latency and status; end its span (status ERROR only when the
        code is the server's failure: :func:`kvmesh.tracing.end_rpc_span`)."""
        start, span_cm = state
        self.in_flight -= 1
        m = self.metrics
        m.rpcs_in_flight.dec()
        m.rpc_seconds.labels(method).observe(time.perf_counter() - start)
        m.rpcs.labels(method, code).inc()
        if span_cm is not None:
            end_rpc_span(trace.get_current_span(), code, server=True)
            span_cm.__exit__(None, None, None)
