"""gRPC transport of the tee service (``kvmesh tee serve``): ``kvmesh.tee.v1.TeeService``.

Routers in any language offer events here; the embedded :class:`tee.client.Tee`
forwards them to the configured sinks. Serves ``grpc.health.v1`` and
reflection, Prometheus metrics on ``metrics_port``, and on :meth:`TeeServer.stop`
stops accepting calls, then drains the queues within ``shutdown_deadline_s``.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from opentelemetry import context as otel_context

from kvmesh.runtime import new_event_loop, setup_logging
from kvmesh.tee.v1 import tee_pb2 as pb
from kvmesh.tee.v1 import tee_pb2_grpc as pb_grpc
from kvmesh.tracing import configure_tracing, extract_context, tracing_enabled
from kvmesh.tracing import register_metrics as register_tracing_metrics
from tee.client import CloseReport, Tee
from tee.config import TeeConfig, build_tee
from tee.grpc_common import events_from_pb, guard

log = logging.getLogger(__name__)

#: Full name of the service, as health checks and reflection know it.
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["TeeService"].full_name


class TeeServicer(pb_grpc.TeeServiceServicer):
    """Offers received events to the tee."""

    def __init__(self, tee: Tee, config: TeeConfig) -> None:
        self.tee = tee
        self.max_input_ids = config.max_input_ids
        self.max_events = config.max_events_per_call
        self.tracing = tracing_enabled()

    def _offer(self, msgs: Any, context: grpc.aio.ServicerContext[Any, Any]) -> tuple[int, int]:
        events = events_from_pb(msgs, self.max_input_ids, self.max_events)
        token = None
        if self.tracing:
            # The caller's trace context (call metadata) becomes current, so that
            # Tee.offer captures it into each event and the sinks receive it.
            token = otel_context.attach(extract_context(context.invocation_metadata()))
        try:
            accepted = sum(1 for e in events if self.tee.offer(e))
        finally:
            if token is not None:
                otel_context.detach(token)
        return accepted, len(events) - accepted

    async def OfferEvents(
        self, request: pb.OfferEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OfferEventsResponse:
        """Offer a batch; malformed input is INVALID_ARGUMENT naming the field."""

        async def body() -> pb.OfferEventsResponse:
            accepted, dropped = self._offer(request.events, context)
            return pb.OfferEventsResponse(accepted=accepted, dropped=dropped)

        return await guard(context, "OfferEvents", body)

    async def StreamEvents(
        self,
        request_iterator: AsyncIterator[pb.StreamEventsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.StreamEventsResponse:
        """Offer every message's events; a malformed one ends the stream with INVALID_ARGUMENT."""

        async def body() -> pb.StreamEventsResponse:
            accepted = dropped = 0
            async for request in request_iterator:
                a, d = self._offer(request.events, context)
                accepted += a
                dropped += d
            return pb.StreamEventsResponse(accepted=accepted, dropped=dropped)

        return await guard(context, "StreamEvents", body)

    async def GetTeeStats(
        self, request: pb.GetTeeStatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetTeeStatsResponse:
        """Per-sink counters."""
        return pb.GetTeeStatsResponse(
            sinks=[pb.SinkStats(**s.as_dict()) for s in self.tee.stats()]  # type: ignore[arg-type]
        )


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


class TeeServer:
    """A running tee service: gRPC server, health, reflection, metrics, the tee itself."""

    def __init__(self, config: TeeConfig, tee: Tee | None = None) -> None:
        self.config = config
        self.tee = tee if tee is not None else build_tee(config)
        self.health = health.aio.HealthServicer()
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", config.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        register_tracing_metrics(self.tee.metrics.registry)
        pb_grpc.add_TeeServiceServicer_to_server(TeeServicer(self.tee, config), self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            [SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME], self._server
        )
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: Any = None
        self.close_report: CloseReport | None = None

    @property
    def address(self) -> str:
        """host:port of the gRPC server."""
        return _host_port(self.config.host, self.port)

    async def start(self) -> TeeServer:
        """Start the tee, then serve gRPC (and metrics)."""
        await self.tee.start()
        self.port = self._server.add_insecure_port(_host_port(self.config.host, self.config.port))
        await self._server.start()
        if self.config.metrics_port:
            from prometheus_client import start_http_server

            self._metrics_http, _ = start_http_server(
                self.config.metrics_port, self.config.host, registry=self.tee.metrics.registry
            )
            self.metrics_port = self._metrics_http.server_port
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("tee serving on %s with %d sinks", self.address, len(self.tee.lanes))
        return self

    async def stop(self, grace_s: float = 1.0) -> CloseReport:
        """Refuse new calls, finish in-flight ones, then drain the tee within its deadline."""
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace_s)
        report = await self.tee.close(self.config.shutdown_deadline_s)
        self.close_report = report
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
            self._metrics_http = None
        for lane in report.lanes:
            log.info(
                "tee sink %s closed: sent %d, dropped %d, failed %d",
                lane.sink,
                lane.sent,
                lane.dropped,
                lane.failed,
            )
        return report


async def serve_until_signal(config: TeeConfig) -> int:
    """Serve until SIGTERM or SIGINT, then drain; return an exit code."""
    configure_tracing("kvmesh-tee")
    try:
        server = await TeeServer(config).start()
    except (OSError, RuntimeError) as e:
        log.error("cannot start: %s", e)
        return 1
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("signal received: draining (deadline %.1fs)", config.shutdown_deadline_s)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.remove_signal_handler(sig)
    await server.stop()
    return 0


def run(config: TeeConfig) -> int:
    """Run a tee service in the foreground; return an exit code."""
    setup_logging(config.log_level, config.log_format)
    with asyncio.Runner(loop_factory=new_event_loop) as runner:
        return runner.run(serve_until_signal(config))
