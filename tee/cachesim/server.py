"""Transports of the cache simulator (``kvmesh cachesim serve``).

HTTP (aiohttp), SGLang's cache-sim wire: ``POST /ingest_ids``,
``POST /extend_ids`` (JSON body, worker in ``x-kvmesh-worker``), plus
``GET /report[?model=M]`` (JSON), ``GET /metrics`` (Prometheus),
``GET /healthz``. Errors answer JSON ``{"error": ..., "field": ...}`` with 400
(malformed), 413 (over a cap), 408 (a body not sent within
``http_body_timeout_s``) or 404 (unknown model).

gRPC: ``kvmesh.tee.v1.TeeService`` (OfferEvents, StreamEvents: a tee's gRPC
sink points here) and ``kvmesh.tee.v1.CacheSimService.GetReport``, with
health and reflection. Both transports feed one :class:`CacheSimulator` on one
event loop, so no locking is needed.

Security: both ports serve TLS or mutual TLS from ``tls`` and reload changed
certificate files for new connections (gRPC on the next handshake, HTTP
every ``tls.reload_interval_s``). One :class:`kvmesh.grpcsvc.Guard` with the
policy of ``auth.policy_file`` checks every gRPC method (:data:`SIM_TEE_RULES`,
:data:`SIM_RULES`) and every HTTP path (:data:`HTTP_RULES`; refusals answer
401, 403 or 429 with the JSON error body); refusals of both transports are
counted in ``kvmesh_cachesim_refusals_total``. Every gRPC method runs in the
call scope of kvmesh/grpcsvc.py: a malformed event is INVALID_ARGUMENT naming
the field, an unknown model NOT_FOUND, anything unexpected INTERNAL, never
UNKNOWN.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
from aiohttp import web
from aiohttp.typedefs import Handler
from grpc_health.v1 import health, health_pb2
from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import choose_encoder
from prometheus_client.registry import Collector

from kvmesh import runtime
from kvmesh.api.tee.v1 import tee_pb2 as pb
from kvmesh.api.tee.v1 import tee_pb2_grpc as pb_grpc
from kvmesh.auth import Authorizer
from kvmesh.configfile import ConfigError
from kvmesh.errors import KvmeshError, ResourceExhausted
from kvmesh.grpcsvc import (
    Guard,
    HealthPort,
    MethodRule,
    add_guarded,
    add_health_and_reflection,
    capture_handlers,
)
from kvmesh.metrics import ComponentRegistry
from kvmesh.runtime import host_port as _host_port
from kvmesh.runtime import setup_logging
from kvmesh.tls import add_port
from tee.cachesim.config import BODY_READ_TIMEOUT_S as BODY_READ_TIMEOUT_S
from tee.cachesim.config import CacheSimConfig
from tee.cachesim.logic import CacheSimulator, SimSettings
from tee.convert import events_from_pb
from tee.errors import InvalidEvent, TeeError, TooLarge
from tee.events import REQUEST_ID_HEADER, WORKER_HEADER, EventKind, from_body
from tee.httpsec import HTTP_STATUS, HttpCall, ServerSSL
from tee.metrics import refusal_counter

#: Seconds the HTTP server keeps reading (and dropping) a request body it did
#: not read, after answering (413, 408, a refusal), so that the client reads the
#: reply before the connection closes. aiohttp's default of 10 s would let a
#: client that never completes its body hold the connection that much past the
#: 408.
HTTP_LINGER_S = 1.0

log = logging.getLogger(__name__)

TEE_SERVICE = pb.DESCRIPTOR.services_by_name["TeeService"].full_name
CACHESIM_SERVICE = pb.DESCRIPTOR.services_by_name["CacheSimService"].full_name

#: Who may call the simulator's TeeService (admin may call all): tees feed it,
#: and so may a router that feeds it directly. Nothing here resets state.
SIM_TEE_RULES: dict[str, MethodRule] = {
    "OfferEvents": MethodRule(("tee", "router"), rate="publish"),
    # A stream is admitted once; its messages are counted one by one.
    "StreamEvents": MethodRule(("tee", "router")),
    "GetTeeStats": MethodRule(("router",), rate="match"),
}
#: CacheSimService: the report is read by routers (and operators).
SIM_RULES: dict[str, MethodRule] = {"GetReport": MethodRule(("router",), rate="match")}
#: The HTTP paths. Metrics and health are open (scrapers and probes present
#: no policy identity; with mutual TLS they still need a certificate).
HTTP_RULES: dict[str, MethodRule] = {
    "/ingest_ids": SIM_TEE_RULES["OfferEvents"],
    "/extend_ids": SIM_TEE_RULES["OfferEvents"],
    "/report": SIM_RULES["GetReport"],
    "/metrics": MethodRule(()),
    "/healthz": MethodRule(()),
}


class _SimCollector(Collector):
    def __init__(self, sim: CacheSimulator) -> None:
        self.sim = sim

    def collect(self) -> Any:
        fams = {
            name: GaugeMetricFamily(f"kvmesh_cachesim_{name}", doc, labels=["model"])
            for name, doc in (
                ("hit_rate", "Routed hit rate since start."),
                ("pooled_bound_hit_rate", "Hit rate of the pooled (global oracle) cache."),
                ("infinite_bound_hit_rate", "Hit rate of an unbounded cache."),
                (
                    "available_hit_rate",
                    "Hit rate the best worker's cache held for each routed request.",
                ),
                ("optimal_share", "Share of routed requests sent to a worker holding it."),
                ("worker_cv", "Coefficient of variation of requests per worker."),
                ("requests", "Requests (ingest events) seen."),
                ("blocks", "Blocks of those requests."),
            )
        }
        for model, fleet in self.sim.models.items():
            fams["hit_rate"].add_metric([model], fleet.routed_stats.hit_rate)
            fams["pooled_bound_hit_rate"].add_metric([model], fleet.pooled_stats.hit_rate)
            fams["infinite_bound_hit_rate"].add_metric([model], fleet.infinite_stats.hit_rate)
            fams["available_hit_rate"].add_metric([model], fleet.available_stats.hit_rate)
            routed = fleet.routed_stats.requests
            share = fleet.optimal_decisions / routed if routed else 0.0
            fams["optimal_share"].add_metric([model], share)
            fams["worker_cv"].add_metric([model], fleet.worker_cv())
            fams["requests"].add_metric([model], fleet.pooled_stats.requests)
            fams["blocks"].add_metric([model], fleet.pooled_stats.blocks)
        yield from fams.values()


def _figures_pb(d: dict[str, Any]) -> pb.CacheFigures:
    def hs(x: dict[str, Any]) -> pb.HitStats:
        return pb.HitStats(**x)

    return pb.CacheFigures(
        requests=d["requests"],
        blocks=d["blocks"],
        routed=hs(d["routed"]),
        pooled_bound=hs(d["pooled_bound"]),
        infinite_bound=hs(d["infinite_bound"]),
        worker_cv=d["worker_cv"],
        workers=[pb.WorkerHitStats(worker=w, stats=hs(s)) for w, s in d["per_worker"].items()],
        available=hs(d["available"]),
        optimal_decisions=d["optimal_decisions"],
    )


def report_to_pb(report: dict[str, dict[str, Any]]) -> pb.GetReportResponse:
    """The gRPC form of :meth:`CacheSimulator.report`."""
    return pb.GetReportResponse(
        models=[
            pb.ModelReport(
                model=model,
                workers=r["workers"],
                total=_figures_pb(r["total"]),
                window=_figures_pb(r["window"]),
                window_seconds=r["window"]["seconds"],
            )
            for model, r in report.items()
        ]
    )


class CacheSimServicer(pb_grpc.TeeServiceServicer, pb_grpc.CacheSimServiceServicer):
    """Both gRPC services of the simulator."""

    def __init__(self, server: CacheSimServer) -> None:
        self.server = server

    def _apply(self, msgs: Any) -> int:
        c = self.server.config
        events = events_from_pb(msgs, c.max_input_ids, c.max_events_per_call)
        for e in events:
            self.server.apply(e)
        return len(events)

    async def OfferEvents(
        self, request: pb.OfferEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OfferEventsResponse:
        """Apply a batch (all or nothing: validated before any is applied)."""
        return pb.OfferEventsResponse(accepted=self._apply(request.events))

    async def StreamEvents(
        self,
        request_iterator: AsyncIterator[pb.StreamEventsRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> pb.StreamEventsResponse:
        """Apply every message's events."""
        n = dropped = 0
        async for request in request_iterator:
            try:
                self.server.guard.take_streamed("StreamEvents")
            except ResourceExhausted:
                # Beyond the caller's publish rate a message is dropped, not applied.
                dropped += len(request.events)
                continue
            n += self._apply(request.events)
        return pb.StreamEventsResponse(accepted=n, dropped=dropped)

    async def GetTeeStats(
        self, request: pb.GetTeeStatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetTeeStatsResponse:
        """A simulator has no sinks."""
        return pb.GetTeeStatsResponse()

    async def GetReport(
        self, request: pb.GetReportRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetReportResponse:
        """Report one model or all (NOT_FOUND for a model never seen)."""
        return report_to_pb(self.server.sim.report(request.model))


class CacheSimServer:
    """A running cache simulator: HTTP and gRPC transports over one :class:`CacheSimulator`."""

    def __init__(self, config: CacheSimConfig) -> None:
        self.config = config
        self.sim = CacheSimulator(
            SimSettings(
                block_size=config.block_size,
                worker_capacity_blocks=config.worker_capacity_blocks,
                pooled_capacity_blocks=config.pooled_capacity_blocks,
                eviction=config.eviction,
                window_s=config.window_s,
            )
        )
        self.registry = ComponentRegistry()
        self.registry.register(_SimCollector(self.sim))
        self.events_total = Counter(
            "kvmesh_cachesim_events",
            "Events received, by transport and outcome.",
            ["transport", "outcome"],
            registry=self.registry,
        )
        self.authorizer = Authorizer(config.auth, what="cachesim")
        self.guard = Guard(
            "cachesim", self.authorizer, config.per_client, limits_field="per_client"
        )
        self.refusals = refusal_counter(self.registry, "cachesim")
        refusals = self.refusals
        self.guard.on_refusal(lambda method, code: refusals.labels(method, code).inc())
        self.http_port = 0
        self.grpc_port = 0
        self.health_port = 0
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self._health_port: HealthPort | None = None
        self.health = health.aio.HealthServicer()
        #: The HTTP port's TLS context and reloader (None in plaintext).
        self.http_tls: ServerSSL | None = None
        self._http_tls_watch: asyncio.Task[None] | None = None
        #: The gRPC port's certificate reloader (None in plaintext).
        self.grpc_tls_reloader: Any = None

    def apply(self, event: Any) -> None:
        """Apply one validated event (both transports end here)."""
        self.sim.apply(event)

    # -- HTTP -------------------------------------------------------------------

    def _app(self) -> web.Application:
        # JSON of max_input_ids ids of up to 10 digits each, plus slack; larger is 413.
        self._max_body = self.config.max_input_ids * 11 + 65536
        app = web.Application(
            client_max_size=self._max_body,
            middlewares=[self._authorize],
        )
        app.router.add_post("/ingest_ids", self._ingest)
        app.router.add_post("/extend_ids", self._extend)
        app.router.add_get("/report", self._report)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        return app

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """Identity, role and per-client limits of an HTTP call, as for a gRPC one."""
        rule = HTTP_RULES.get(request.path)
        if rule is None:  # aiohttp answers 404 / 405
            return await handler(request)
        g = self.guard
        call: Any = HttpCall(request)
        try:
            client = g.identify(request.path, rule, call)
            g.take(client, rule.rate, request.path)
            g.enter(client, request.path)
        except KvmeshError as e:
            return web.json_response(
                {"error": str(e), "field": e.field}, status=HTTP_STATUS.get(e.code, 403)
            )
        try:
            return await handler(request)
        finally:
            g.exit(client)

    async def _ingest(self, request: web.Request) -> web.Response:
        return await self._event(EventKind.INGEST, request)

    async def _extend(self, request: web.Request) -> web.Response:
        return await self._event(EventKind.EXTEND, request)

    async def _event(self, kind: EventKind, request: web.Request) -> web.Response:
        try:
            announced = request.content_length
            if announced is not None and announced > self._max_body:
                # Refused before a byte of it is read.
                raise TooLarge(
                    f"request body of {announced} bytes, more than {self._max_body}", field="body"
                )
            # A client that announces a body and sends it slowly (or never) is
            # answered 408 instead of holding a connection and its buffer.
            timeout_s = self.config.http_body_timeout_s
            try:
                async with asyncio.timeout(timeout_s):
                    raw = await request.read()
            except web.HTTPRequestEntityTooLarge as e:
                raise TooLarge("request body too large", field="body") from e
            except TimeoutError:
                self.events_total.labels("http", "rejected").inc()
                resp = web.json_response(
                    {
                        "error": f"request body not sent within {timeout_s:g} s",
                        "field": "body",
                    },
                    status=408,
                )
                resp.force_close()  # the rest of the body is not read: the stream is lost
                return resp
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError) as e:
                # ValueError: not JSON, or a number past Python's digit limit.
                raise InvalidEvent(f"not JSON: {str(e)[:120]}", field="body") from e
            except RecursionError:
                raise InvalidEvent("JSON nested too deep", field="body") from None
            event = from_body(
                kind,
                body,
                worker=request.headers.get(WORKER_HEADER, ""),
                request_id_header=request.headers.get(REQUEST_ID_HEADER, ""),
                max_input_ids=self.config.max_input_ids,
            )
            blocks = self.sim.apply(event)
        except TeeError as e:
            self.events_total.labels("http", "rejected").inc()
            resp = web.json_response({"error": str(e), "field": e.field}, status=e.http_status)
            if not request.content.is_eof():
                resp.force_close()  # an oversize body left unread
            return resp
        self.events_total.labels("http", "applied").inc()
        return web.json_response({"ok": True, "blocks": blocks})

    async def _report(self, request: web.Request) -> web.Response:
        try:
            report = self.sim.report(request.query.get("model", ""))
        except TeeError as e:
            return web.json_response({"error": str(e), "field": e.field}, status=e.http_status)
        return web.json_response({"models": report})

    async def _metrics(self, request: web.Request) -> web.Response:
        # The format the scraper asks for (OpenMetrics or text), as start_http_server does.
        encode, content_type = choose_encoder(request.headers.get("Accept", ""))
        return web.Response(body=encode(self.registry), headers={"Content-Type": content_type})

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "SERVING"})

    # -- lifecycle ----------------------------------------------------------------

    @property
    def http_url(self) -> str:
        """Base URL of the HTTP transport (``https://`` with TLS)."""
        scheme = "https" if self.config.tls.enabled else "http"
        return f"{scheme}://{_host_port(self.config.host, self.http_port)}"

    @property
    def grpc_address(self) -> str:
        """host:port of the gRPC transport."""
        return _host_port(self.config.host, self.grpc_port)

    async def start(self) -> CacheSimServer:
        """Listen on both transports."""
        c = self.config
        if c.tls.enabled:
            self.http_tls = ServerSSL(c.tls, what="cachesim HTTP")
        else:
            log.warning(
                "cachesim HTTP: listening on %s in PLAINTEXT: any client on the network may "
                "call it; set tls.cert_file / tls.key_file (and tls.client_ca_file for mutual "
                "TLS) outside local development",
                _host_port(c.host, c.http_port),
            )
        self._runner = web.AppRunner(self._app(), access_log=None, lingering_time=HTTP_LINGER_S)
        await self._runner.setup()
        ssl_context = self.http_tls.context if self.http_tls is not None else None
        await web.TCPSite(self._runner, c.host, c.http_port, ssl_context=ssl_context).start()
        self.http_port = int(self._runner.addresses[0][1])
        if self.http_tls is not None:
            self._http_tls_watch = asyncio.get_running_loop().create_task(
                self.http_tls.watch(), name="cachesim-http-tls-reload"
            )
        if c.grpc_enabled:
            server = grpc.aio.server(
                options=[
                    ("grpc.max_receive_message_length", c.max_message_bytes),
                    ("grpc.so_reuseport", 0),
                ]
            )
            servicer = CacheSimServicer(self)
            tee_handlers = capture_handlers(pb_grpc.add_TeeServiceServicer_to_server, servicer)
            sim_handlers = capture_handlers(pb_grpc.add_CacheSimServiceServicer_to_server, servicer)
            add_guarded(server, TEE_SERVICE, tee_handlers[TEE_SERVICE], SIM_TEE_RULES, self.guard)
            add_guarded(
                server, CACHESIM_SERVICE, sim_handlers[CACHESIM_SERVICE], SIM_RULES, self.guard
            )
            add_health_and_reflection(
                server, self.health, [TEE_SERVICE, CACHESIM_SERVICE], self.guard
            )
            self.grpc_port, self.grpc_tls_reloader = add_port(
                server, _host_port(c.host, c.grpc_port), c.tls, what="cachesim gRPC"
            )
            if c.health_port:
                self._health_port = HealthPort(self.health, _host_port(c.host, c.health_port))
                self.health_port = await self._health_port.start()
            await server.start()
            self._grpc = server
            for name in ("", TEE_SERVICE, CACHESIM_SERVICE):
                await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("cachesim serving HTTP on %s, gRPC on %s", self.http_url, self.grpc_address)
        return self

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop both transports, letting in-flight calls finish within the grace period."""
        grace = self.config.shutdown_grace_s if grace_s is None else grace_s
        if self._grpc is not None:
            await self.health.enter_graceful_shutdown()
            await self._grpc.stop(grace)
            self._grpc = None
        if self._health_port is not None:
            await self._health_port.stop()
            self._health_port = None
        if self._http_tls_watch is not None:
            self._http_tls_watch.cancel()
            await asyncio.gather(self._http_tls_watch, return_exceptions=True)
            self._http_tls_watch = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def serve_until_signal(config: CacheSimConfig) -> int:
    """Serve until SIGTERM or SIGINT; return an exit code."""
    return await runtime.serve_until_signal(
        CacheSimServer(config).start, errors=(OSError, RuntimeError, ConfigError), log=log
    )


def run(config: CacheSimConfig) -> int:
    """Run a cache simulator in the foreground; return an exit code."""
    setup_logging(config.log_level, config.log_format)
    return runtime.run_main(lambda: serve_until_signal(config))
