"""kvmesh.tee.v1 over real gRPC: the tee service and the cache simulator's report."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.tee.v1 import tee_pb2 as pb
from kvmesh.api.tee.v1 import tee_pb2_grpc as pb_grpc
from lab.bench.testsink import TestSink
from tee.cachesim.config import CacheSimConfig
from tee.cachesim.server import CacheSimServer
from tee.config import ConfigError, TeeConfig, load_tee_config
from tee.server import TeeServer


def _ev(**kw: object) -> pb.RoutedEvent:
    base: dict[str, object] = {
        "kind": pb.EVENT_KIND_INGEST,
        "model": "m",
        "input_ids": [1, 2, 3, 4],
        "request_id": "r",
    }
    base.update(kw)
    return pb.RoutedEvent(**base)  # type: ignore[arg-type]


@pytest.fixture
async def tee_env() -> AsyncIterator[tuple[TeeServer, TestSink, grpc.aio.Channel]]:
    sink = await TestSink().start()
    cfg = TeeConfig.model_validate(
        {
            "port": 0,
            "metrics_port": 0,
            "sinks": [{"type": "http", "url": sink.url}],
            "max_input_ids": 100,
            "queue_size": 64,
            "shutdown_deadline_s": 2,
        }
    )
    server = await TeeServer(cfg).start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        yield server, sink, channel
    finally:
        await channel.close()
        await server.stop(0)
        await sink.stop()


@pytest.mark.parametrize(
    ("event", "field"),
    [
        (_ev(kind=pb.EVENT_KIND_UNSPECIFIED), "events[0].kind"),
        (_ev(model=""), "events[0].model"),
        (_ev(input_ids=[1, -5]), "events[0].input_ids"),
        (_ev(input_ids=[1 << 40]), "events[0].input_ids"),
        (_ev(input_ids=list(range(101))), "events[0].input_ids"),
        (_ev(prompt_len=9), "events[0].prompt_len"),
        (_ev(model="x" * 300), "events[0].model"),
    ],
)
async def test_malformed_events_are_invalid_argument(
    tee_env: tuple[TeeServer, TestSink, grpc.aio.Channel], event: pb.RoutedEvent, field: str
) -> None:
    server, _, channel = tee_env
    stub = pb_grpc.TeeServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.OfferEvents(pb.OfferEventsRequest(events=[event]))
    err = info.value
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    assert field in (err.details() or "")
    md = dict(err.trailing_metadata() or ())
    assert md.get("kvmesh-error-field") == field
    # Nothing was offered; the service is still up.
    assert server.tee.stats()[0].offered == 0
    resp = await stub.OfferEvents(pb.OfferEventsRequest(events=[_ev()]))
    assert resp.accepted == 1


async def test_stream_offer_forwards_and_stats_add_up(
    tee_env: tuple[TeeServer, TestSink, grpc.aio.Channel],
) -> None:
    _, sink, channel = tee_env
    stub = pb_grpc.TeeServiceStub(channel)

    async def requests() -> AsyncIterator[pb.StreamEventsRequest]:
        for i in range(10):
            yield pb.StreamEventsRequest(
                events=[_ev(request_id=f"r{i}", worker="w1"), _ev(kind=pb.EVENT_KIND_EXTEND)]
            )

    resp = await stub.StreamEvents(requests())
    assert resp.accepted + resp.dropped == 20
    deadline = time.monotonic() + 5
    while sink.count < resp.accepted:
        assert time.monotonic() < deadline
        await asyncio.sleep(0.01)
    stats = (await stub.GetTeeStats(pb.GetTeeStatsRequest())).sinks[0]
    assert stats.offered == 20 and stats.sink == sink.url
    assert stats.offered == (
        stats.sent + stats.dropped_full + stats.dropped_closed + stats.dropped_invalid
        + stats.failed_http + stats.failed_error + stats.failed_timeout
        + stats.queued + stats.in_flight
    )  # fmt: skip
    paths = {p for p, _, _ in sink.received}
    assert paths == {"ingest_ids", "extend_ids"}
    health = health_pb2_grpc.HealthStub(channel)
    h = await health.Check(health_pb2.HealthCheckRequest(service="kvmesh.tee.v1.TeeService"))
    assert h.status == health_pb2.HealthCheckResponse.SERVING


async def test_stream_with_malformed_event_ends_invalid_argument(
    tee_env: tuple[TeeServer, TestSink, grpc.aio.Channel],
) -> None:
    _, _, channel = tee_env
    stub = pb_grpc.TeeServiceStub(channel)

    async def requests() -> AsyncIterator[pb.StreamEventsRequest]:
        yield pb.StreamEventsRequest(events=[_ev()])
        yield pb.StreamEventsRequest(events=[_ev(), _ev(model="")])

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.StreamEvents(requests())
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "events[1].model" in (info.value.details() or "")


async def test_cachesim_report_over_grpc() -> None:
    server = await CacheSimServer(
        CacheSimConfig(http_port=0, grpc_port=0, block_size=2, worker_capacity_blocks=4)
    ).start()
    try:
        async with grpc.aio.insecure_channel(server.grpc_address) as channel:
            tee = pb_grpc.TeeServiceStub(channel)
            sim = pb_grpc.CacheSimServiceStub(channel)
            evs = [_ev(worker="w0"), _ev(worker="w0"), _ev(worker="w1")]
            assert (await tee.OfferEvents(pb.OfferEventsRequest(events=evs))).accepted == 3
            rep = (await sim.GetReport(pb.GetReportRequest(model="m"))).models[0]
            assert rep.model == "m" and rep.workers == 2
            assert rep.total.requests == 3 and rep.total.routed.hit_blocks == 2
            assert rep.total.infinite_bound.hit_blocks == 4
            assert rep.window.requests == 3 and rep.window_seconds == 60
            assert [w.worker for w in rep.total.workers] == ["w0", "w1"]
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await sim.GetReport(pb.GetReportRequest(model="other"))
            assert info.value.code() == grpc.StatusCode.NOT_FOUND
    finally:
        await server.stop(0)


def test_config_precedence_and_unknown_keys(tmp_path: Path) -> None:
    f = tmp_path / "tee.yaml"
    f.write_text("send_concurrency: 4\nqueue_size: 10\nsinks: [{type: http, url: 'http://a'}]\n")
    env = {"KVMESH_TEE_SEND_CONCURRENCY": "16", "KVMESH_TEE_QUEUE_SIZE": "20"}
    cfg = load_tee_config(f, environ=env, cli={"queue_size": 30, "send_timeout_s": None})
    assert (cfg.send_concurrency, cfg.queue_size, cfg.send_timeout_s) == (16, 30, 2.0)
    assert cfg.sinks[0].type == "http"
    assert load_tee_config(environ={}).send_concurrency == 8
    with pytest.raises(ConfigError, match="KVMESH_TEE_BOGUS"):
        load_tee_config(environ={"KVMESH_TEE_BOGUS": "1"})
    with pytest.raises(ConfigError, match="send_concurrency"):
        load_tee_config(environ={"KVMESH_TEE_SEND_CONCURRENCY": "0"})
    with pytest.raises(ConfigError, match="sinks"):
        load_tee_config(environ={"KVMESH_TEE_SINKS": '[{"type": "ftp", "url": "x"}]'})
