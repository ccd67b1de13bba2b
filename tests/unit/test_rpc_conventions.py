"""The pieces of kvmesh/tracing.py that put RPC spans on the OpenTelemetry conventions.

No network: the target and peer strings a span's address attributes come
from (the conventions' own examples), the status rule over every gRPC code on
real SDK spans, and the precedence of the resource's ``service.name``.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import kvmesh
from kvmesh import tracing

#: gRPC codes a server span fails on (the OpenTelemetry gRPC conventions, server span).
SERVER_FAILURES = {
    "UNKNOWN",
    "DEADLINE_EXCEEDED",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
}


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("grpc.io:50051", {"server.address": "grpc.io", "server.port": 50051}),
        ("dns://1.2.3.4/grpc.io:50051", {"server.address": "grpc.io", "server.port": 50051}),
        ("dns:///indexer.ns.svc:50051", {"server.address": "indexer.ns.svc", "server.port": 50051}),
        (
            "unix:///run/containerd/containerd.sock",
            {"server.address": "/run/containerd/containerd.sock"},
        ),
        ("zk://zookeeper:2181/my-server", {"server.address": "zk://zookeeper:2181/my-server"}),
        (
            "ipv4:198.51.100.123:50051,198.51.100.124:50051",
            {"server.address": "ipv4:198.51.100.123:50051,198.51.100.124:50051"},
        ),
        ("ipv4:10.0.0.7:50051", {"server.address": "10.0.0.7", "server.port": 50051}),
        ("[::1]:50051", {"server.address": "::1", "server.port": 50051}),
        ("indexer", {"server.address": "indexer"}),
    ],
)
def test_server_address_and_port_come_from_the_target(
    target: str, expected: dict[str, str | int]
) -> None:
    assert tracing.target_attributes(target) == expected


@pytest.mark.parametrize(
    ("peer", "expected"),
    [
        ("ipv4:127.0.0.1:56984", {"network.peer.address": "127.0.0.1", "network.peer.port": 56984}),
        ("ipv6:%5B::1%5D:50316", {"network.peer.address": "::1", "network.peer.port": 50316}),
        ("unix:/tmp/kvmesh.sock", {"network.peer.address": "/tmp/kvmesh.sock"}),
        ("something-else", {}),
        (None, {}),
    ],
)
def test_network_peer_comes_from_the_servers_peer_string(
    peer: str | None, expected: dict[str, str | int]
) -> None:
    assert tracing.peer_attributes(peer) == expected


@pytest.fixture
def local_tracer() -> Iterator[tuple[trace.Tracer, InMemorySpanExporter]]:
    """An SDK tracer of its own (the global provider is left alone)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider.get_tracer("t"), exporter
    provider.shutdown()


@pytest.mark.parametrize("code", [c.name for c in grpc.StatusCode])
@pytest.mark.parametrize("server", [True, False], ids=["server", "client"])
def test_status_rule_over_every_grpc_code(
    local_tracer: tuple[trace.Tracer, InMemorySpanExporter], code: str, server: bool
) -> None:
    tracer, exporter = local_tracer
    span = tracer.start_span("s")
    tracing.end_rpc_span(span, code, server=server)
    span.end()
    [done] = exporter.get_finished_spans()
    attrs = dict(done.attributes or {})
    assert attrs["rpc.response.status_code"] == code
    failed = code in SERVER_FAILURES if server else code != "OK"
    assert (done.status.status_code == trace.StatusCode.ERROR) == failed
    assert attrs.get("error.type") == (code if failed else None)
    if not failed:
        assert done.status.status_code == trace.StatusCode.UNSET


def test_server_failures_are_the_conventions_list() -> None:
    assert set(tracing.GRPC_SERVER_ERRORS) == SERVER_FAILURES
    assert {c.name for c in grpc.StatusCode} >= SERVER_FAILURES


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({}, "kvmesh-tee"),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=tee-eu,team=serving"}, "tee-eu"),
        (
            {"OTEL_RESOURCE_ATTRIBUTES": "service.name=tee-eu", "OTEL_SERVICE_NAME": "tee-1"},
            "tee-1",
        ),
        ({"OTEL_RESOURCE_ATTRIBUTES": "service.name=tee%20eu"}, "tee eu"),
    ],
)
def test_service_name_is_ours_unless_the_environment_names_one(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], name: str
) -> None:
    # The SDK reads these from os.environ too: keep the machine's out of the test.
    monkeypatch.delenv("OTEL_RESOURCE_ATTRIBUTES", raising=False)
    monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
    attrs = tracing.service_resource("kvmesh-tee", env).attributes
    assert attrs["service.name"] == name
    assert attrs["service.version"] == kvmesh.__version__
    assert attrs["telemetry.sdk.name"] == "opentelemetry"
    if "team=serving" in env.get("OTEL_RESOURCE_ATTRIBUTES", ""):
        assert attrs["team"] == "serving"
