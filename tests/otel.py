"""OpenTelemetry's process-wide provider, installed and forgotten by tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

import router_client.metrics
from kvmesh import tracing


def reset_globals() -> None:
    """Forget OpenTelemetry's once-per-process global provider (test isolation)."""
    trace._TRACER_PROVIDER = None
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    tracing._enabled = False
    tracing._provider = None
    # The router's module-level proxy tracer caches the provider it first saw.
    router_client.metrics.tracer._real_tracer = None  # type: ignore[attr-defined]


@contextmanager
def installed_exporter() -> Iterator[InMemorySpanExporter]:
    """A global SDK provider exporting to memory, for servers and clients built after it."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=tracing.health_filtered_sampler())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    reset_globals()
    trace.set_tracer_provider(provider)
    assert tracing.tracing_enabled()
    try:
        yield exporter
    finally:
        provider.shutdown()
        reset_globals()
