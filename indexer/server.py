"""gRPC transport of ``kvmesh.indexer.v1.IndexerService`` (grpc.aio, uvloop when present).

Transport only: messages are converted by indexer/convert.py and handled by
indexer/logic.py. Every method is registered in the call scope of
kvmesh/grpcsvc.py (:data:`INDEXER_RULES`), which decodes requests, checks
identity and per-client limits, and maps a
:class:`~kvmesh.errors.KvmeshError` to the status its ``code`` names (the
field goes into the message and the ``kvmesh-error-field`` trailing metadata)
and any other exception to INTERNAL with a log line, so no call ever ends
UNKNOWN. Every method but ``Ping`` is also :func:`~kvmesh.grpcsvc.observed`
by the service's :class:`~indexer.rpc.IndexerCalls`, which

- refuses a call beyond ``limits.max_concurrent_rpcs`` with RESOURCE_EXHAUSTED;
- records per-method latency and status counts, and a server span when
  tracing is on.

Message size: a request larger than ``limits.max_message_bytes`` is refused by
grpc itself with RESOURCE_EXHAUSTED before any handler runs (the caps on
blocks per Match and events per batch, checked by the logic, answer
INVALID_ARGUMENT naming the field).

The server also serves ``grpc.health.v1`` (SERVING / NOT_SERVING following the
backend, for both ``""`` and the service name), server reflection and, when
``sglang.enabled``, SGLang's ``kv_indexer.v1.KVIndexer`` (indexer/sglang/), and
on :meth:`IndexerServer.stop` stops accepting calls, lets in-flight ones
finish within the grace period and closes the backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from indexer import convert
from indexer.config import IndexerConfig
from indexer.factory import build_index
from indexer.index import Index
from indexer.instrumented import InstrumentedIndex, Metrics, configure_tracing
from indexer.logic import IndexerLogic
from indexer.rpc import IndexerCalls
from indexer.sglang.compat import SglangCompat
from indexer.sglang.server import SGLANG_SERVICE_NAME, SglangServicer, add_sglang_servicer
from kvmesh import runtime
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.auth import Authorizer, current_client
from kvmesh.errors import KvmeshError, PermissionDenied, Unauthenticated
from kvmesh.grpcsvc import (
    HANDLER_FACTORIES,
    Guard,
    HealthPort,
    MethodRule,
    add_guarded,
    add_health_and_reflection,
    observed,
)
from kvmesh.runtime import host_port as _host_port
from kvmesh.runtime import setup_logging as _setup_logging
from kvmesh.tls import add_port

log = logging.getLogger(__name__)

#: Full name of the service, as health checks and reflection know it.
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["IndexerService"].full_name


_PING_RESPONSE = pb.PingResponse()


def _serialize(message: Any) -> bytes:
    """Response serializer that also takes already serialized bytes."""
    if isinstance(message, bytes):
        return message
    data: bytes = message.SerializeToString()
    return data


#: Who may call each IndexerService method (admin may call all). Engines act
#: only for the instances the policy gives them (checked by the logic).
INDEXER_RULES: dict[str, MethodRule] = {
    "RegisterInstance": MethodRule(("engine",)),
    "Heartbeat": MethodRule(("engine",)),
    "PublishEvents": MethodRule(("engine",), rate="publish"),
    "PublishEventsStream": MethodRule(("engine",)),
    "RemoveInstance": MethodRule(("admin",)),
    "ListInstances": MethodRule(("router", "engine")),
    "Match": MethodRule(("router",), rate="match"),
    "GetStats": MethodRule(("router",)),
    "DumpIndex": MethodRule(("admin",)),
    "Ping": MethodRule(("*",)),
}


def add_servicer(
    servicer: IndexerServicer, server: grpc.aio.Server, guard: Guard | None = None
) -> None:
    """Register every IndexerService method behind ``guard`` (see kvmesh/grpcsvc.py).

    Built from the service descriptor instead of the generated
    ``add_IndexerServiceServicer_to_server`` so that a handler may return
    pre-serialized bytes (Match does); the guard decodes requests.
    """
    service = pb.DESCRIPTOR.services_by_name["IndexerService"]
    handlers = {}
    for method in service.methods:
        factory = HANDLER_FACTORIES[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = factory(
            getattr(servicer, method.name),
            request_deserializer=getattr(pb, method.input_type.name).FromString,
            response_serializer=_serialize,
        )
    add_guarded(
        server,
        service.full_name,
        handlers,
        INDEXER_RULES,
        guard or servicer.guard,
        observer=servicer.calls,
    )


class IndexerServicer(pb_grpc.IndexerServiceServicer):
    """grpc.aio servicer: converts messages and calls :class:`IndexerLogic`."""

    def __init__(self, logic: IndexerLogic, metrics: Metrics, guard: Guard | None = None) -> None:
        self.logic = logic
        self.guard = guard if guard is not None else Guard("indexer")
        self.metrics = metrics
        #: In-flight cap, metrics and spans of the observed methods.
        self.calls = IndexerCalls(metrics, logic.config.limits.max_concurrent_rpcs)
        self._match_encoder = convert.MatchResponseEncoder()

    @observed
    async def RegisterInstance(
        self, request: pb.RegisterInstanceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterInstanceResponse:
        """Register (or re-register) an instance and start its lease."""
        state, reset = await self.logic.register(convert.spec_from_pb(request))
        return pb.RegisterInstanceResponse(info=convert.state_to_pb(state), reset=reset)

    @observed
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HeartbeatResponse:
        """Renew an instance's lease."""
        state = await self.logic.heartbeat(convert.instance_from_pb(request.instance))
        return pb.HeartbeatResponse(lease_expires_at=state.lease_expires_at, stale=state.stale)

    @observed
    async def RemoveInstance(
        self, request: pb.RemoveInstanceRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RemoveInstanceResponse:
        """Drop an instance and all its blocks."""
        n = await self.logic.remove_instance(convert.instance_from_pb(request.instance))
        return pb.RemoveInstanceResponse(blocks_removed=n)

    @observed
    async def ListInstances(
        self, request: pb.ListInstancesRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ListInstancesResponse:
        """List registered instances."""
        states = await self.logic.list_instances(request.model)
        return pb.ListInstancesResponse(instances=[convert.state_to_pb(s) for s in states])

    @observed
    async def PublishEvents(
        self, request: pb.PublishEventsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PublishEventsResponse:
        """Apply one batch; a rejected batch is the call's error status."""
        result = await self.logic.publish(convert.batch_from_pb(request.batch))
        return pb.PublishEventsResponse(ack=convert.ack_to_pb(request.batch, result))

    @observed
    async def PublishEventsStream(
        self,
        request_iterator: AsyncIterator[pb.PublishEventsStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[pb.PublishEventsStreamResponse]:
        """Apply batches in order, one ack each; a rejected batch is reported in its ack."""
        client = current_client()
        async for request in request_iterator:
            batch = request.batch
            try:
                if client is not None:
                    self.guard.take(client, "publish", "PublishEventsStream")
                result = await self.logic.publish(convert.batch_from_pb(batch))
                ack = convert.ack_to_pb(batch, result)
            except KvmeshError as e:
                if isinstance(e, PermissionDenied | Unauthenticated):
                    self.guard.refused("PublishEventsStream", e)
                ack = convert.rejected_ack_to_pb(batch, e)
            except Exception as e:
                log.exception("internal error applying batch %d of a stream", batch.sequence)
                ack = convert.rejected_ack_to_pb(
                    batch, KvmeshError(f"internal error: {type(e).__name__}")
                )
            yield pb.PublishEventsStreamResponse(ack=ack)

    @observed
    async def Match(  # type: ignore[override]
        self, request: pb.MatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> bytes:
        """Which live instances hold the longest prefix of a prompt.

        Answers the serialized MatchResponse (see convert.MatchResponseEncoder);
        :func:`add_servicer` registers a serializer that passes bytes through.
        """
        result = await self.logic.match(convert.match_query_from_pb(request))
        return self._match_encoder.encode(result)

    @observed
    async def GetStats(
        self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetStatsResponse:
        """Index sizes plus this replica's counters."""
        return convert.stats_to_pb(await self.logic.stats())

    @observed
    async def DumpIndex(
        self, request: pb.DumpIndexRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.DumpIndexResponse]:
        """The index's content in chunks of 1,000 blocks (admin only)."""
        blocks, truncated = await self.logic.dump(request.model, request.max_blocks)
        chunk = 1000
        for lo in range(0, max(1, len(blocks)), chunk):
            part = blocks[lo : lo + chunk]
            yield pb.DumpIndexResponse(
                blocks=[convert.dumped_block_to_pb(ns, key, holders) for ns, key, holders in part],
                truncated=truncated and lo + chunk >= len(blocks),
            )

    async def Ping(
        self, request: pb.PingRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PingResponse:
        """Does no work (not observed: it cannot fail, and it is the latency floor)."""
        return _PING_RESPONSE


class IndexerServer:
    """A running indexer: gRPC server, health, reflection, metrics, background tasks."""

    def __init__(
        self,
        config: IndexerConfig,
        index: Index,
        *,
        owns_index: bool,
    ) -> None:
        self.config = config
        #: The backend as given or built (not the instrumented wrapper).
        self.index = index
        self.metrics = Metrics()
        self.metrics.watch_counters(self._counter_values)
        self._instrumented = InstrumentedIndex(index, self.metrics)
        self._owns_index = owns_index
        self.health = health.aio.HealthServicer()
        self._health_tasks: set[asyncio.Task[None]] = set()
        self.logic = IndexerLogic(
            self._instrumented, config, on_backend_health=self._on_backend_health
        )
        lim = config.limits
        self.authorizer = Authorizer(config.auth, what="indexer")
        self.guard = Guard("indexer", self.authorizer, lim.per_client)
        refusals = self.metrics.refusals
        self.guard.on_refusal(lambda method, code: refusals.labels(method, code).inc())
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", lim.max_message_bytes),
                ("grpc.max_send_message_length", lim.max_message_bytes),
                # Fail loudly when the port is taken instead of sharing it.
                ("grpc.so_reuseport", 0),
                *(
                    [("grpc.max_concurrent_streams", lim.max_streams_per_connection)]
                    if lim.max_streams_per_connection
                    else []
                ),
            ]
        )
        self.servicer = IndexerServicer(self.logic, self.metrics, self.guard)
        add_servicer(self.servicer, self._server, self.guard)
        #: Names whose health follows the backend ("" is the whole server).
        self._health_names = ["", SERVICE_NAME]
        if config.sglang.enabled:
            self.sglang = SglangServicer(
                SglangCompat(self.logic, config.sglang), self.metrics, self.guard
            )
            add_sglang_servicer(self.sglang, self._server, self.guard)
            self._health_names.append(SGLANG_SERVICE_NAME)
        #: ZMQ subscribers to engine KV events (imported only when configured).
        self.subscribers: Any = None
        if config.engine_events.endpoints:
            from indexer.kvevents.subscriber import EngineEventSubscribers

            self.subscribers = EngineEventSubscribers(self.logic, config.engine_events)
            # Prefixed: several subscriber counters (batches_applied...) share
            # their names with the replica counters above.
            self.metrics.watch_counters(self._subscriber_counter_values)
        add_health_and_reflection(self._server, self.health, self._health_names[1:], self.guard)
        #: Plaintext health-only port for kubelet probes (config.health_port).
        self._health_port = (
            HealthPort(self.health, _host_port(config.host, config.health_port))
            if config.health_port
            else None
        )
        self.health_port = 0
        self.tls_reloader: Any = None
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: Any = None
        self._stopped = False
        self._terminated = asyncio.Event()

    @property
    def address(self) -> str:
        """``host:port`` the server listens on (for a client to dial)."""
        return _host_port(self.config.host, self.port)

    def _counter_values(self) -> dict[str, int | dict[str, int]]:
        c = self.logic.counters
        return {
            "events_skipped": dict(c.events_skipped),
            "blocks_orphaned": c.blocks_orphaned,
            "batches_applied": c.batches_applied,
            "batches_duplicate": c.batches_duplicate,
            "batches_rejected": c.batches_rejected,
            "sequence_gaps": c.sequence_gaps,
            "matches": c.matches,
            "matched_blocks": c.matched_blocks,
            "instances_reaped": c.instances_reaped,
            "reap_errors": c.reap_errors,
        }

    def _subscriber_counter_values(self) -> dict[str, int]:
        """ZMQ subscriber counters summed over endpoints, as ``zmq_<name>``."""
        c = self.subscribers.counters()
        return {f"zmq_{f.name}": getattr(c, f.name) for f in dataclasses.fields(c)}

    def _on_backend_health(self, ok: bool) -> None:
        if self._stopped:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if ok
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        self.metrics.backend_up.set(1 if ok else 0)
        task = asyncio.get_running_loop().create_task(self._set_health(status))
        self._health_tasks.add(task)
        task.add_done_callback(self._health_tasks.discard)

    async def _set_health(self, status: int) -> None:
        for name in self._health_names:
            await self.health.set(name, status)

    async def start(self) -> None:
        """Bind, start serving, and start background tasks."""
        cfg = self.config
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        self.port, self.tls_reloader = add_port(
            self._server, _host_port(cfg.host, cfg.port), cfg.tls, what="indexer"
        )
        if self._health_port is not None:
            self.health_port = await self._health_port.start()
        await self._server.start()
        await self.logic.check_backend()
        if cfg.backend == "redis":
            await self._check_credentials()
        self.logic.start()
        if self.subscribers is not None:
            self.subscribers.start()
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            try:
                self._metrics_http, _ = start_http_server(
                    cfg.metrics_port, addr=cfg.host, registry=self.metrics.registry
                )
            except OSError as e:
                await self.stop(0)
                raise OSError(
                    f"cannot serve metrics on {_host_port(cfg.host, cfg.metrics_port)}: {e}"
                ) from e
            self.metrics_port = self._metrics_http.server_port
        log.info(
            "kvmesh indexer serving on %s (backend %s, block size %d)%s",
            self.address,
            self.index.name,
            cfg.block_size,
            f", metrics on :{self.metrics_port}" if self.metrics_port else "",
        )

    async def _check_credentials(self) -> None:
        """Refused Redis credentials or ACL rights end the start with one clear error.

        They never fix themselves, so the process exits (the CLI prints one
        line) rather than serving NOT_SERVING forever; a Redis that is only
        down is waited for, as before. The instance-table read runs a script,
        so a user without EVALSHA or with the wrong key pattern is caught too.
        """
        from indexer.redis.connection import BackendAuthError

        try:
            await self.index.list_instances()
        except BackendAuthError:
            await self.stop(0)
            raise
        except KvmeshError:
            pass

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let in-flight ones finish within ``grace`` seconds
        (default ``shutdown_grace_s``), then stop background tasks and close the
        backend (when the server built it). Idempotent."""
        if self._stopped:
            await self._terminated.wait()
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace is None else grace
        try:
            await self.health.enter_graceful_shutdown()
            await self._server.stop(grace)
            if self._health_port is not None:
                await self._health_port.stop()
            if self.subscribers is not None:
                await self.subscribers.stop()
            await self.logic.stop()
            for t in list(self._health_tasks):
                t.cancel()
            if self._owns_index:
                try:
                    await self.index.close()
                except Exception:
                    log.exception("closing the backend failed")
            if self._metrics_http is not None:
                http = self._metrics_http
                await asyncio.get_running_loop().run_in_executor(None, http.shutdown)
                http.server_close()
        finally:
            self._terminated.set()
            log.info("kvmesh indexer stopped")

    async def wait_for_termination(self) -> None:
        """Wait until :meth:`stop` has finished."""
        await self._terminated.wait()


async def start_server(config: IndexerConfig, index: Index | None = None) -> IndexerServer:
    """Start an indexer server for ``config``.

    ``index`` defaults to the backend the config names (built here, and closed
    by :meth:`IndexerServer.stop`); an index passed in is left open for the
    caller. ``config.port`` 0 picks a free port, see ``server.port``.
    """
    configure_tracing()
    owns = index is None
    if index is None:
        index = build_index(config)
    server = IndexerServer(config, index, owns_index=owns)
    try:
        await server.start()
    except BaseException:
        if owns:
            with contextlib.suppress(Exception):
                await index.close()
        raise
    return server


# -- the blocking entry point ----------------------------------------------------------


def setup_logging(config: IndexerConfig) -> None:
    """Configure root logging from ``log_level`` and ``log_format`` (to stderr)."""
    _setup_logging(config.log_level, config.log_format)


async def serve_until_signal(config: IndexerConfig) -> int:
    """Serve until SIGTERM or SIGINT, then shut down gracefully; return an exit code."""
    return await runtime.serve_until_signal(
        lambda: start_server(config),
        errors=(OSError, KvmeshError),
        log=log,
        draining=f"draining in-flight calls (grace {config.shutdown_grace_s:.1f}s)",
    )


def run(config: IndexerConfig) -> int:
    """Run an indexer in the foreground (the CLI's ``indexer serve``); return an exit code."""
    setup_logging(config)
    return runtime.run_main(lambda: serve_until_signal(config))
