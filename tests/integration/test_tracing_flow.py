"""One trace across the request flow, with an in-memory span exporter.

router decision → Match client span → indexer server span (context from gRPC
metadata) → ``index.match`` → Redis ``EVALSHA``, on a real in-process gRPC
server over a real Redis; the tee forwards ``traceparent`` to its HTTP and gRPC
sinks; an xfer pair records one span per room with its final status. And the
bad input: an OTLP collector that is down costs nothing but counted drops.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import generate_latest

from indexer.config import IndexerConfig
from indexer.redis.backend import RedisIndex
from indexer.server import start_server
from kvmesh import tracing
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.api.tee.v1 import tee_pb2 as tee_pb
from kvmesh.api.tee.v1 import tee_pb2_grpc as tee_pb_grpc
from lab.bench.testsink import TestSink
from lab.bench.xfer_procs import ThreadedSidecar
from router_client import IndexerClient, Router, RouteRequest
from router_client.config import IndexerClientSettings, RouterConfig
from router_client.indexer_client import MatchStatus
from tee.hooks import routed_request_hook
from tee.logic import Tee
from tee.sinks import GrpcSink, HttpSink
from tests.grpc.conftest import BLOCK, MODEL, batch, publish, register, stored
from tests.otel import installed_exporter, reset_globals
from xfer.client import XferClient
from xfer.config import PoolSettings, XferConfig

TOKENS = list(range(4 * BLOCK))


@pytest.fixture(scope="module")
def _provider() -> Iterator[InMemorySpanExporter]:
    with installed_exporter() as exporter:
        yield exporter


@pytest.fixture
def no_provider() -> Iterator[None]:
    """No global tracer provider during the test; the previous one restored after."""
    previous = trace._TRACER_PROVIDER
    reset_globals()
    yield
    tracing.shutdown_tracing()
    reset_globals()
    if previous is not None:
        trace.set_tracer_provider(previous)


@pytest.fixture
def spans(_provider: InMemorySpanExporter) -> InMemorySpanExporter:
    _provider.clear()
    return _provider


def _by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def _parent_of(span: ReadableSpan, spans: tuple[ReadableSpan, ...]) -> ReadableSpan:
    assert span.parent is not None, f"{span.name} has no parent"
    [parent] = [s for s in spans if s.context.span_id == span.parent.span_id]
    return parent


class _TeeGrpcSink(tee_pb_grpc.TeeServiceServicer):
    """A TeeService that records the metadata of each OfferEvents call."""

    def __init__(self) -> None:
        self.metadata: list[dict[str, str]] = []

    async def OfferEvents(
        self, request: tee_pb.OfferEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> tee_pb.OfferEventsResponse:
        self.metadata.append(dict(context.invocation_metadata() or ()))  # type: ignore[arg-type]
        return tee_pb.OfferEventsResponse(accepted=len(request.events))


@pytest.fixture
async def grpc_sink() -> AsyncIterator[tuple[_TeeGrpcSink, str]]:
    server = grpc.aio.server()
    sink = _TeeGrpcSink()
    tee_pb_grpc.add_TeeServiceServicer_to_server(sink, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    yield sink, f"127.0.0.1:{port}"
    await server.stop(0)


async def test_router_indexer_redis_and_tee_are_one_trace(
    spans: InMemorySpanExporter, redis_server: Any, grpc_sink: tuple[_TeeGrpcSink, str]
) -> None:
    index = RedisIndex(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
    config = IndexerConfig.model_validate(
        {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "block_size": BLOCK}
    )
    server = await start_server(config, index)
    http_sink = await TestSink().start()
    gsink, gaddr = grpc_sink
    tee = await Tee([HttpSink(http_sink.url), GrpcSink(gaddr)], concurrency=2).start()
    # A generous deadline: the default 5 ms can pass on a loaded test host, and
    # a Match that times out leaves the trace without its indexer part.
    client = IndexerClient(
        server.address, model=MODEL, settings=IndexerClientSettings(deadline_ms=5000)
    )
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            stub = pb_grpc.IndexerServiceStub(ch)
            await register(stub, "w0")
            await publish(stub, batch(1, stored([1, 2, 3], TOKENS[: 3 * BLOCK])))
        router = Router(
            RouterConfig(model=MODEL),
            workers=["w0", "w1"],
            indexer=client,
            block_size=BLOCK,
            seed=1,
            on_decision=routed_request_hook(tee, MODEL),
        )
        spans.clear()
        decision = await router.route(
            RouteRequest(request_id="r1", input_tokens=len(TOKENS), token_ids=TOKENS)
        )
        assert client.calls[MatchStatus.OK] == 1
        assert decision.prefill.worker == "w0"  # the indexer's answer counted
        await router.wait_predictions()  # the decision's prediction, in the background
        for _ in range(300):
            if http_sink.received and gsink.metadata:
                break
            await asyncio.sleep(0.01)
    finally:
        await tee.close(deadline_s=2.0)
        await http_sink.stop()
        await client.close()
        await server.stop(0)
        await index.close()

    got = spans.get_finished_spans()
    [route] = _by_name(got, "kvmesh.router.route")
    trace_id = route.context.trace_id
    assert all(s.context.trace_id == trace_id for s in got), [s.name for s in got]
    # the chain, leaf to root
    # (a Match may refresh the instance table and run again: more EVALSHAs)
    redis_calls = [
        s
        for s in _by_name(got, "EVALSHA")
        if (s.attributes or {}).get("kvmesh.redis.script") == "match"
    ]
    assert redis_calls and all(_parent_of(s, got).name == "index.match" for s in redis_calls)
    redis_call = redis_calls[0]
    assert redis_call.kind == trace.SpanKind.CLIENT
    attrs = dict(redis_call.attributes or {})
    assert attrs["db.system"] == "redis" and attrs["kvmesh.redis.script"] == "match"
    assert not any(isinstance(v, bytes) for v in attrs.values())
    assert set(attrs) <= {
        "db.system", "db.system.name", "db.operation.name", "server.address", "server.port",
        "kvmesh.redis.script",
    }  # fmt: skip
    index_match = _parent_of(redis_call, got)
    assert index_match.name == "index.match"
    assert (index_match.attributes or {})["kvmesh.backend"] == "redis"
    server_span = _parent_of(index_match, got)
    assert server_span.name == "kvmesh.indexer.v1.IndexerService/Match"
    assert server_span.kind == trace.SpanKind.SERVER
    assert server_span.parent is not None and server_span.parent.is_remote  # came over the wire
    client_span = _parent_of(server_span, got)
    assert client_span.kind == trace.SpanKind.CLIENT
    assert client_span.name == "kvmesh.indexer.v1.IndexerService/Match"
    assert _parent_of(client_span, got) is route
    chooses = _by_name(got, "kvmesh.router.choose")
    assert chooses and all(_parent_of(s, got) is route for s in chooses)
    # the decision's route-time prediction (on by default) joins the trace too:
    # its call under the route, the indexer's record of it under the call
    predicts = _by_name(got, "kvmesh.indexer.v1.IndexerService/PredictPlacement")
    [p_client] = [s for s in predicts if s.kind == trace.SpanKind.CLIENT]
    [p_server] = [s for s in predicts if s.kind == trace.SpanKind.SERVER]
    assert _parent_of(p_client, got) is route and _parent_of(p_server, got) is p_client
    # the tee carried the router's trace to both sinks
    [(_, body, headers)] = http_sink.received
    assert body["request_id"] == "r1"
    assert int(headers["traceparent"].split("-")[1], 16) == trace_id
    [md] = gsink.metadata
    assert int(md["traceparent"].split("-")[1], 16) == trace_id


def _xfer_config(role: str, path: Path) -> XferConfig:
    pool = PoolSettings(
        path=str(path), page_size=1024, page_count=16, aux_size=32, aux_count=2, create=True
    )
    return XferConfig(role=role, port=0, metrics_port=0, transport="tcp", pool=pool)  # type: ignore[arg-type]


def test_xfer_room_spans_end_with_their_status(spans: InMemorySpanExporter, tmp_path: Path) -> None:
    p = ThreadedSidecar(_xfer_config("prefill", tmp_path / "p"))
    d = ThreadedSidecar(_xfer_config("decode", tmp_path / "d"))
    p.start()
    d.start()
    try:
        with XferClient(p.address) as pc, XferClient(d.address) as dc:
            dc.register_room(7, p.address, [3, 4], 1)
            pc.add_transfer_request(7, [10, 11], (0, 2), True, 1, 0)
            dc.register_room(8, "127.0.0.1:1", [5], 0)  # nobody there: bootstrap fails
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and (dc.poll(7)[0], dc.poll(8)[0]) != (4, 0):
                time.sleep(0.01)
            assert dc.poll(7)[0] == 4 and dc.poll(8)[0] == 0
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and pc.poll(7)[0] != 4:
                time.sleep(0.01)
    finally:
        p.stop()
        d.stop()
    rooms = _by_name(spans.get_finished_spans(), "xfer.room")
    by = {(s.attributes["kvmesh.xfer.role"], s.attributes["kvmesh.room"]): s for s in rooms}  # type: ignore[index]
    assert by[("decode", 7)].attributes["kvmesh.xfer.status"] == "SUCCESS"  # type: ignore[index]
    assert by[("prefill", 7)].attributes["kvmesh.xfer.status"] == "SUCCESS"  # type: ignore[index]
    failed = by[("decode", 8)]
    assert failed.attributes["kvmesh.xfer.status"] == "FAILED"  # type: ignore[index]
    assert "bootstrap failed" in str(failed.attributes["kvmesh.xfer.reason"])  # type: ignore[index]
    assert failed.status.status_code == trace.StatusCode.ERROR
    # The prefill room joined the decode room's trace through Bootstrap's
    # metadata: as its child, or (when the engine's transfer request created
    # the room before the Bootstrap arrived) through a link.
    prefill, decode = by[("prefill", 7)], by[("decode", 7)]
    related = [prefill.parent] if prefill.parent is not None else []
    related += [link.context for link in prefill.links]
    assert decode.context.span_id in [c.span_id for c in related]


async def test_health_checks_and_ping_make_no_spans(spans: InMemorySpanExporter) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from indexer.memory import MemoryIndex

    config = IndexerConfig.model_validate({"host": "127.0.0.1", "port": 0, "metrics_port": 0})
    server = await start_server(config, MemoryIndex())
    try:
        async with grpc.aio.insecure_channel(server.address) as ch:
            await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            await pb_grpc.IndexerServiceStub(ch).Ping(pb.PingRequest())
            # a span someone else names after a health check is dropped by the sampler
            with trace.get_tracer("t").start_as_current_span("grpc.health.v1.Health/Check"):
                pass
    finally:
        await server.stop(0)
    assert spans.get_finished_spans() == ()


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_otlp_collector_down_keeps_serving_and_counts_dropped_spans(
    monkeypatch: pytest.MonkeyPatch, no_provider: None
) -> None:
    """Bad input: OTEL_EXPORTER_OTLP_ENDPOINT names a closed port."""
    from indexer.memory import MemoryIndex

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "1")  # seconds: give up fast
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")
    monkeypatch.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "16")
    monkeypatch.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "8")
    before = tracing.counts.snapshot()
    try:
        assert tracing.configure_tracing("kvmesh-indexer")
        config = IndexerConfig.model_validate({"host": "127.0.0.1", "port": 0, "metrics_port": 0})
        server = await start_server(config, MemoryIndex())
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                stub = pb_grpc.IndexerServiceStub(ch)
                await register(stub, "w0")
                started = time.monotonic()
                for i in range(200):
                    resp = await stub.Match(
                        pb.MatchRequest(model=MODEL, token_ids=[i] * BLOCK), timeout=2.0
                    )
                    assert not resp.matches
                # 200 Matches with a dead collector take no longer than without one
                assert time.monotonic() - started < 10
            registry = server.metrics.registry
        finally:
            await server.stop(0)
    finally:
        tracing.shutdown_tracing()  # flushes what is left: every export fails
    after = tracing.counts.snapshot()
    ended = after["ended"] - before["ended"]
    failed = after["failed"] - before["failed"]
    queue_full = after["queue_full"] - before["queue_full"]
    assert ended >= 200  # at least the server span of each Match
    assert after["exported"] == before["exported"]
    assert failed > 0 and failed + queue_full == ended
    text = generate_latest(registry).decode()
    assert 'kvmesh_tracing_spans_dropped_total{reason="export_failed"}' in text
    assert "kvmesh_tracing_spans_exported_total" in text


def test_otlp_grpc_export_reaches_a_collector(
    monkeypatch: pytest.MonkeyPatch, no_provider: None
) -> None:
    """The OTEL_* set-up really exports: a local OTLP/gRPC receiver gets the spans."""
    from concurrent import futures

    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2 as otlp_pb,
    )
    from opentelemetry.proto.collector.trace.v1 import (
        trace_service_pb2_grpc as otlp_grpc,
    )

    received: list[Any] = []

    class Collector(otlp_grpc.TraceServiceServicer):  # type: ignore[misc]
        def Export(self, request: Any, context: Any) -> Any:
            received.append(request)
            return otlp_pb.ExportTraceServiceResponse()

    collector = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    otlp_grpc.add_TraceServiceServicer_to_server(Collector(), collector)
    port = collector.add_insecure_port("127.0.0.1:0")
    collector.start()
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kvmesh-test")
    before = tracing.counts.snapshot()
    try:
        assert tracing.configure_tracing("kvmesh-indexer")
        with trace.get_tracer("t").start_as_current_span("work"):
            pass
        tracing.shutdown_tracing()
    finally:
        collector.stop(0)
    after = tracing.counts.snapshot()
    assert after["exported"] - before["exported"] == 1
    assert after["failed"] == before["failed"]
    [req] = received
    [rs] = req.resource_spans
    service = {a.key: a.value.string_value for a in rs.resource.attributes}["service.name"]
    assert service == "kvmesh-test"
    assert [s.name for ss in rs.scope_spans for s in ss.spans] == ["work"]


def test_tracing_stays_off_without_otel_variables(no_provider: None) -> None:
    assert not tracing.configure_tracing("kvmesh-indexer", environ={})
    assert not tracing.configure_tracing("x", environ={"OTEL_TRACES_EXPORTER": "none"})
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://127.0.0.1:1", "OTEL_SDK_DISABLED": "true"}
    assert not tracing.configure_tracing("x", environ=on)
