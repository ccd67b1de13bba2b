"""gRPC transport of the tee service (``kvmesh tee serve``): ``kvmesh.tee.v1.TeeService``.

Routers in any language offer events here; the embedded :class:`tee.logic.Tee`
forwards them to the configured sinks. Serves ``grpc.health.v1`` and
reflection, Prometheus metrics on ``metrics_port``, and on :meth:`TeeServer.stop`
stops accepting calls, then drains the queues within ``shutdown_deadline_s``.

Security: the port serves TLS or mutual TLS from ``tls`` (certificates
reloaded when the files change) and every method runs in the call scope of
kvmesh/grpcsvc.py, behind a :class:`kvmesh.grpcsvc.Guard` with the rules of
:data:`TEE_RULES` and the policy of ``auth.policy_file``; refusals are
counted in ``kvmesh_tee_refusals_total``. Malformed input ends a call with
INVALID_ARGUMENT naming the field, anything unexpected with INTERNAL, never
UNKNOWN. Health is open to everyone, also on the optional plaintext
``health_port``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from grpc_health.v1 import health, health_pb2

from kvmesh import runtime
from kvmesh.api.tee.v1 import tee_pb2 as pb
from kvmesh.api.tee.v1 import tee_pb2_grpc as pb_grpc
from kvmesh.auth import Authorizer
from kvmesh.configfile import ConfigError
from kvmesh.errors import ResourceExhausted
from kvmesh.grpcsvc import (
    CallerTraceContext,
    Guard,
    HealthPort,
    MethodRule,
    add_guarded,
    add_health_and_reflection,
    capture_handlers,
    observed,
)
from kvmesh.runtime import host_port as _host_port
from kvmesh.runtime import setup_logging
from kvmesh.tls import add_port
from kvmesh.tracing import configure_tracing
from kvmesh.tracing import register_metrics as register_tracing_metrics
from tee.config import TeeConfig
from tee.convert import events_from_pb
from tee.factory import build_tee
from tee.logic import CloseReport, Tee
from tee.metrics import refusal_counter

log = logging.getLogger(__name__)

#: Full name of the service, as health checks and reflection know it.
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["TeeService"].full_name

#: Who may call each TeeService method of a tee (admin may call all). Routers
#: offer routed requests; a tee may be the gRPC sink of another tee (a fan-out
#: tree), which presents its ``tee`` identity. Nothing here resets state.
TEE_RULES: dict[str, MethodRule] = {
    "OfferEvents": MethodRule(("router", "tee"), rate="publish"),
    # A stream is admitted once; its messages are counted one by one.
    "StreamEvents": MethodRule(("router", "tee")),
    "GetTeeStats": MethodRule(("router",), rate="match"),
}


class TeeServicer(pb_grpc.TeeServiceServicer):
    """Offers received events to the tee.

    The offering methods are :func:`~kvmesh.grpcsvc.observed` by
    :attr:`calls`: with tracing on, the caller's trace context (call
    metadata) is current while they run, so that :meth:`Tee.offer` captures
    it into each event and the sinks receive it.
    """

    def __init__(self, tee: Tee, config: TeeConfig, guard_: Guard | None = None) -> None:
        self.tee = tee
        self.max_input_ids = config.max_input_ids
        self.max_events = config.max_events_per_call
        self.guard = guard_ if guard_ is not None else Guard("tee")
        #: Makes the caller's trace context current in the observed methods.
        self.calls = CallerTraceContext()

    def _offer(self, msgs: Any) -> tuple[int, int]:
        events = events_from_pb(msgs, self.max_input_ids, self.max_events)
        accepted = sum(1 for e in events if self.tee.offer(e))
        return accepted, len(events) - accepted

    @observed
    async def OfferEvents(
        self, request: pb.OfferEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OfferEventsResponse:
        """Offer a batch; malformed input is INVALID_ARGUMENT naming the field."""
        accepted, dropped = self._offer(request.events)
        return pb.OfferEventsResponse(accepted=accepted, dropped=dropped)

    @observed
    async def StreamEvents(
        self,
        request_iterator: AsyncIterator[pb.StreamEventsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.StreamEventsResponse:
        """Offer every message's events; a malformed one ends the stream with INVALID_ARGUMENT.

        A message beyond the caller's publish rate (``per_client.publish_rps``)
        is not offered: its events count as dropped, and the stream goes on.
        """
        accepted = dropped = 0
        async for request in request_iterator:
            try:
                self.guard.take_streamed("StreamEvents")
            except ResourceExhausted:
                dropped += len(request.events)
                continue
            a, d = self._offer(request.events)
            accepted += a
            dropped += d
        return pb.StreamEventsResponse(accepted=accepted, dropped=dropped)

    async def GetTeeStats(
        self, request: pb.GetTeeStatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetTeeStatsResponse:
        """Per-sink counters."""
        return pb.GetTeeStatsResponse(
            sinks=[pb.SinkStats(**s.as_dict()) for s in self.tee.stats()]  # type: ignore[arg-type]
        )


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
        registry = self.tee.metrics.registry
        register_tracing_metrics(registry)
        self.authorizer = Authorizer(config.auth, what="tee")
        self.guard = Guard("tee", self.authorizer, config.per_client, limits_field="per_client")
        self.refusals = refusal_counter(registry, "tee")
        refusals = self.refusals
        self.guard.on_refusal(lambda method, code: refusals.labels(method, code).inc())
        servicer = TeeServicer(self.tee, config, self.guard)
        handlers = capture_handlers(pb_grpc.add_TeeServiceServicer_to_server, servicer)
        add_guarded(
            self._server,
            SERVICE_NAME,
            handlers[SERVICE_NAME],
            TEE_RULES,
            self.guard,
            observer=servicer.calls,
        )
        add_health_and_reflection(self._server, self.health, [SERVICE_NAME], self.guard)
        #: Plaintext health-only port for kubelet probes (config.health_port).
        self._health_port = (
            HealthPort(self.health, _host_port(config.host, config.health_port))
            if config.health_port
            else None
        )
        self.health_port = 0
        #: The certificate reloader of the TLS port (None in plaintext).
        self.tls_reloader: Any = None
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: Any = None
        self.close_report: CloseReport | None = None

    @property
    def address(self) -> str:
        """host:port of the gRPC server."""
        return _host_port(self.config.host, self.port)

    async def start(self) -> TeeServer:
        """Bind, start the tee, then serve gRPC (and health, metrics)."""
        cfg = self.config
        self.port, self.tls_reloader = add_port(
            self._server, _host_port(cfg.host, cfg.port), cfg.tls, what="tee"
        )
        if self._health_port is not None:
            self.health_port = await self._health_port.start()
        await self.tee.start()
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
        if self._health_port is not None:
            await self._health_port.stop()
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
    return await runtime.serve_until_signal(
        TeeServer(config).start,
        errors=(OSError, RuntimeError, ConfigError),
        log=log,
        draining=f"draining (deadline {config.shutdown_deadline_s:.1f}s)",
    )


def run(config: TeeConfig) -> int:
    """Run a tee service in the foreground; return an exit code."""
    setup_logging(config.log_level, config.log_format)
    return runtime.run_main(lambda: serve_until_signal(config))
