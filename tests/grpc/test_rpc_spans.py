"""RPC spans on the OpenTelemetry gRPC conventions, recorded from a real server and client.

An in-process indexer on a free 127.0.0.1 port and real channels, the spans
caught by the SDK's in-memory exporter: the attributes a server span and a
client span carry (``rpc.system.name``, the fully qualified ``rpc.method``,
``rpc.response.status_code``, ``server.*`` and ``network.peer.*``), nothing
of the older conventions left, and the status rule: a status the caller
caused leaves the server span's status unset while its client span fails, a
server failure fails both. Then the resource: ``service.version`` is
kvmesh's, ``service.name`` ours unless the ``OTEL_*`` variables name one.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import kvmesh
from indexer.memory import MemoryIndex
from indexer.model import InstanceMatch, Namespace
from kvmesh import tracing
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.errors import Unavailable
from router_client import IndexerClient, IndexerClientSettings, MatchStatus
from tests.grpc.conftest import (
    BLOCK,
    MODEL,
    Harness,
    close_harness,
    expect_status,
    make_config,
    open_harness,
    ref,
    register,
)
from tests.otel import installed_exporter, reset_globals

SERVICE = "kvmesh.indexer.v1.IndexerService"
MATCH = f"{SERVICE}/Match"
#: Attributes of the conventions before v1.37, which kvmesh no longer writes.
OLD_ATTRIBUTES = ("rpc.system", "rpc.service", "rpc.grpc.status_code")


@pytest.fixture(scope="module")
def _exporter() -> Iterator[InMemorySpanExporter]:
    """A global SDK provider for this module's servers and clients (built after it)."""
    with installed_exporter() as exporter:
        yield exporter


@pytest.fixture
def spans(_exporter: InMemorySpanExporter) -> InMemorySpanExporter:
    _exporter.clear()
    return _exporter


class _DownIndex(MemoryIndex):
    """A memory index whose Match fails as a backend that went away does."""

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        raise Unavailable("backend down (test)")


@pytest.fixture
async def served(spans: InMemorySpanExporter) -> AsyncIterator[Harness]:
    """A memory-backed indexer built while tracing is on (components decide when built)."""
    h = await open_harness(make_config(), MemoryIndex())
    try:
        yield h
    finally:
        await close_harness(h)


def _finished_server_spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [
        s
        for s in exporter.get_finished_spans()
        if s.name == name and s.kind == trace.SpanKind.SERVER
    ]


async def _server_spans(exporter: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    """The finished server spans named ``name``, waiting up to 5 s for one: the
    server ends a call's span after the status is sent, so a caller that has
    its answer may look before the span ended."""
    for _ in range(500):
        got = _finished_server_spans(exporter, name)
        if got:
            return got
        await asyncio.sleep(0.01)
    return _finished_server_spans(exporter, name)


def _attrs(span: ReadableSpan) -> dict[str, Any]:
    return dict(span.attributes or {})


async def test_server_span_of_a_call_that_succeeds(
    served: Harness, spans: InMemorySpanExporter
) -> None:
    await register(served.stub, "w0")
    await served.stub.Match(pb.MatchRequest(model=MODEL, token_ids=list(range(2 * BLOCK))))
    [span] = await _server_spans(spans, MATCH)
    attrs = _attrs(span)
    assert {k: attrs[k] for k in ("rpc.system.name", "rpc.method", "rpc.response.status_code")} == {
        "rpc.system.name": "grpc",
        "rpc.method": MATCH,  # fully qualified: the span name
        "rpc.response.status_code": "OK",
    }
    assert attrs["network.peer.address"] == "127.0.0.1"
    assert isinstance(attrs["network.peer.port"], int) and attrs["network.peer.port"] > 0
    assert set(attrs) == {
        "rpc.system.name",
        "rpc.method",
        "rpc.response.status_code",
        "network.peer.address",
        "network.peer.port",
    }
    assert not set(OLD_ATTRIBUTES) & set(attrs)
    assert span.status.status_code == trace.StatusCode.UNSET
    [registered] = await _server_spans(spans, f"{SERVICE}/RegisterInstance")
    assert _attrs(registered)["rpc.method"] == f"{SERVICE}/RegisterInstance"


@pytest.mark.parametrize(
    ("method", "request_", "code"),
    [
        ("Match", pb.MatchRequest(model=MODEL, token_ids=[-1] * BLOCK), "INVALID_ARGUMENT"),
        ("Match", pb.MatchRequest(model="", token_ids=[1] * BLOCK), "INVALID_ARGUMENT"),
        ("Heartbeat", pb.HeartbeatRequest(instance=ref("nobody")), "NOT_FOUND"),
    ],
)
async def test_a_status_the_caller_caused_leaves_the_server_span_unset(
    served: Harness, spans: InMemorySpanExporter, method: str, request_: Any, code: str
) -> None:
    await expect_status(getattr(served.stub, method)(request_), getattr(grpc.StatusCode, code))
    [span] = await _server_spans(spans, f"{SERVICE}/{method}")
    attrs = _attrs(span)
    assert attrs["rpc.response.status_code"] == code
    assert "error.type" not in attrs
    assert span.status.status_code == trace.StatusCode.UNSET


async def test_a_server_failure_fails_the_server_span(spans: InMemorySpanExporter) -> None:
    h = await open_harness(make_config(), _DownIndex())
    try:
        await register(h.stub, "w0")
        await expect_status(
            h.stub.Match(pb.MatchRequest(model=MODEL, token_ids=list(range(BLOCK)))),
            grpc.StatusCode.UNAVAILABLE,
        )
    finally:
        await close_harness(h)
    [span] = await _server_spans(spans, MATCH)
    attrs = _attrs(span)
    assert attrs["rpc.response.status_code"] == "UNAVAILABLE"
    assert attrs["error.type"] == "UNAVAILABLE"
    assert span.status.status_code == trace.StatusCode.ERROR


def _client_span(exporter: InMemorySpanExporter) -> ReadableSpan:
    [span] = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.CLIENT]
    return span


async def test_client_span_names_the_server_it_called(
    served: Harness, spans: InMemorySpanExporter
) -> None:
    await register(served.stub, "w0")
    client = IndexerClient(
        served.server.address, model=MODEL, settings=IndexerClientSettings(deadline_ms=5000)
    )
    try:
        spans.clear()
        outcome = await client.match([11, 12])
    finally:
        await client.close()
    assert outcome.status is MatchStatus.OK
    span = _client_span(spans)
    assert span.name == MATCH
    attrs = _attrs(span)
    assert attrs == {
        "rpc.system.name": "grpc",
        "rpc.method": MATCH,
        "server.address": "127.0.0.1",
        "server.port": served.server.port,
        "rpc.response.status_code": "OK",
        "kvmesh.blocks": 2,
        "kvmesh.matches": 0,
    }
    assert span.status.status_code == trace.StatusCode.UNSET
    # The server span of the same call is its child, over the wire.
    [server_span] = await _server_spans(spans, MATCH)
    assert server_span.parent is not None and server_span.parent.is_remote
    assert server_span.parent.span_id == span.context.span_id


async def test_a_status_the_caller_caused_fails_only_the_client_span(
    served: Harness, spans: InMemorySpanExporter
) -> None:
    """The same call, seen from both ends: an empty model is the caller's mistake."""
    client = IndexerClient(
        served.server.address, model="", settings=IndexerClientSettings(deadline_ms=5000)
    )
    try:
        spans.clear()
        outcome = await client.match([11])
    finally:
        await client.close()
    assert outcome.status is MatchStatus.ERROR
    client_span = _client_span(spans)
    assert _attrs(client_span)["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert _attrs(client_span)["error.type"] == "INVALID_ARGUMENT"
    assert client_span.status.status_code == trace.StatusCode.ERROR
    [server_span] = await _server_spans(spans, MATCH)
    assert _attrs(server_span)["rpc.response.status_code"] == "INVALID_ARGUMENT"
    assert "error.type" not in _attrs(server_span)
    assert server_span.status.status_code == trace.StatusCode.UNSET


async def test_each_match_of_a_stream_is_a_server_span(
    served: Harness, spans: InMemorySpanExporter
) -> None:
    call: grpc.aio.StreamStreamCall[Any, Any] = served.stub.MatchStream()
    ok = pb.MatchRequest(model=MODEL, token_ids=list(range(BLOCK)))
    bad = pb.MatchRequest(model="", token_ids=list(range(BLOCK)))
    await call.write(
        pb.MatchStreamRequest(
            matches=[
                pb.MatchStreamItem(request_id=1, match=ok),
                pb.MatchStreamItem(request_id=2, match=bad),
            ]
        )
    )
    replies: dict[int, pb.MatchStreamReply] = {}
    while len(replies) < 2:
        resp: Any = await call.read()
        assert resp is not grpc.aio.EOF
        replies.update({r.request_id: r for r in resp.replies})
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    assert replies[2].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    per_match = await _server_spans(spans, f"{SERVICE}/MatchStream.Match")
    by_code = {_attrs(s)["rpc.response.status_code"]: s for s in per_match}
    assert set(by_code) == {"OK", "INVALID_ARGUMENT"}
    for span in per_match:
        assert _attrs(span)["rpc.system.name"] == "grpc"
        assert _attrs(span)["rpc.method"] == f"{SERVICE}/MatchStream.Match"
        assert span.status.status_code == trace.StatusCode.UNSET  # neither failed the server
    [stream] = await _server_spans(spans, f"{SERVICE}/MatchStream")
    assert _attrs(stream)["rpc.response.status_code"] == "OK"
    assert all(
        s.parent is not None and s.parent.span_id == stream.context.span_id for s in per_match
    )


# -- the resource --------------------------------------------------------------------


@pytest.fixture
def no_provider() -> Iterator[None]:
    """No global tracer provider during the test; this module's restored after."""
    previous = trace._TRACER_PROVIDER
    reset_globals()
    yield
    tracing.shutdown_tracing()
    reset_globals()
    if previous is not None:
        trace.set_tracer_provider(previous)


def test_configured_tracing_names_the_service_and_its_version(
    monkeypatch: pytest.MonkeyPatch, no_provider: None
) -> None:
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=ix-eu,deployment.environment=prod")
    assert tracing.configure_tracing("kvmesh-indexer")
    resource = tracing._provider.resource
    assert resource.attributes["service.name"] == "ix-eu"  # the environment's name wins
    assert resource.attributes["service.version"] == kvmesh.__version__
    assert resource.attributes["deployment.environment"] == "prod"
