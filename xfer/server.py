"""gRPC transport of ``kvmesh.xfer.v1.XferService`` (grpc.aio) and the sidecar's loops.

Transport only: rooms and transfers are xfer/logic.py. Every method is
registered in the call scope of kvmesh/grpcsvc.py (:data:`XFER_RULES`: engine
methods need role ``engine``, peer methods role ``peer``; undecodable
requests are INVALID_ARGUMENT), which maps a
:class:`~kvmesh.errors.KvmeshError` to the status its ``code`` names and
anything else to INTERNAL, so no call ends UNKNOWN, and makes the caller's
trace context current while a method runs. Peer methods also pass the peer
admission of xfer/peers.py (allowed certificate identities, shared secret);
its refusals are counted and logged with the guard's. Beside the service the
server runs

- the bootstrap of each registered room (decode → prefill, metadata once per
  peer, resent when the prefill side does not know it);
- a timeout sweep (bootstrap and waiting timeouts);
- heartbeats to every peer with unfinished rooms: each ping times out after
  one interval, so a dead peer's rooms fail within two intervals;
- aborts: a decode room that is cleared unfinished or times out is failed on
  the prefill side too.

It serves ``grpc.health.v1`` and reflection (also health alone in plaintext
on ``health_port``), Prometheus metrics on ``metrics_port`` and stops
gracefully on SIGTERM. Calls to peers use ``config.peer_tls()`` and, when
configured, the peer secret; a peer channel is rebuilt when its certificate
files change. The decode side dials the prefill address its engine names;
the prefill side dials back (Heartbeat) the ``advertise_address`` the decode
side sends in Bootstrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import logging
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from kvmesh import runtime
from kvmesh.api.xfer.v1 import xfer_pb2 as pb
from kvmesh.api.xfer.v1 import xfer_pb2_grpc as pb_grpc
from kvmesh.auth import Authorizer, peer_host
from kvmesh.configfile import ConfigError
from kvmesh.errors import (
    ERROR_FIELD_METADATA,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
)
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
from kvmesh.runtime import host_port
from kvmesh.tls import ChannelFactory, add_port
from kvmesh.tracing import configure_tracing
from kvmesh.tracing import register_metrics as register_tracing_metrics
from xfer.config import XferConfig
from xfer.logic import TERMINAL, Room, RoomState, RoomStatus, XferLogic, XferMetrics
from xfer.peers import SECRET_METADATA, PeerAdmission
from xfer.pool import KVPool, PoolGeometry
from xfer.prefetch import ClaimOutcome, Prefetch, PrefetchState, PrefetchTable
from xfer.transport import Transport, make_transport

log = logging.getLogger(__name__)

#: Full name of the service, as health checks and reflection know it.
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["XferService"].full_name

#: Deadline of a Bootstrap or Abort call to a peer: long enough for a loaded
#: peer on a small host, short next to the bootstrap timeout.
_PEER_CALL_TIMEOUT_S = 5.0

#: Rooms one PollRooms call may name, and its longest wait (ms).
MAX_POLL_ROOMS = 4096
MAX_POLL_WAIT_MS = 60_000
#: A waiting PollRooms answers this long before its call's deadline, so that the
#: caller gets the statuses rather than DEADLINE_EXCEEDED (seconds).
POLL_DEADLINE_MARGIN_S = 0.05

_STATUS_VALUES = frozenset(int(s) for s in RoomStatus)


def _moved(states: list[RoomState], base: list[RoomStatus], terminal: bool) -> bool:
    """Whether a waiting PollRooms answers now: a room is gone, or its status is not
    ``base``'s, or (``terminal``: the caller gave no known statuses) is terminal."""
    return any(
        not s.found or s.status != b or (terminal and s.status in TERMINAL)
        for s, b in zip(states, base, strict=True)
    )


async def _wait_rooms(
    logic: XferLogic, rooms: list[int], known: list[RoomStatus] | None, wait_s: float
) -> list[RoomState]:
    """The states of ``rooms`` once :func:`_moved` against ``known`` (without it:
    against their statuses when the watch began) or after ``wait_s``. The logic's
    threads wake this loop through :meth:`XferLogic.watch_rooms`; each wake is
    followed by a fresh read, so a change between two reads is never lost."""
    loop = asyncio.get_running_loop()
    woke = asyncio.Event()

    def wake() -> None:
        # Called by the logic's threads with its lock held; the loop may be closing.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(woke.set)

    states = logic.watch_rooms(rooms, wake)
    try:
        base = known if known is not None else [s.status for s in states]
        until = loop.time() + wait_s
        while not _moved(states, base, known is None):
            left = until - loop.time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(woke.wait(), left)
            woke.clear()
            states = logic.poll_rooms(rooms)
    finally:
        logic.unwatch_rooms(rooms, wake)
    return states


#: Who may call each XferService method (admin may call all): the engine beside
#: the sidecar drives rooms; the other side's sidecar bootstraps, aborts and pings.
XFER_RULES: dict[str, MethodRule] = {
    "RegisterRoom": MethodRule(("engine",)),
    "AddTransferRequest": MethodRule(("engine",)),
    "AddTransferRequests": MethodRule(("engine",)),
    "Poll": MethodRule(("engine",)),
    "PollRooms": MethodRule(("engine",)),
    "Clear": MethodRule(("engine",)),
    "Bootstrap": MethodRule(("peer",)),
    "Abort": MethodRule(("peer",)),
    "Heartbeat": MethodRule(("peer",)),
    # A router issues prefetches (it knows where a prefix is); the engine claims them.
    "Prefetch": MethodRule(("engine", "router")),
    "CancelPrefetch": MethodRule(("engine", "router")),
    "ClaimPrefetch": MethodRule(("engine",)),
    "OpenRead": MethodRule(("peer",)),
}


#: Peer methods: their callers must also pass the peer admission.
_PEER_METHODS = frozenset(m for m, rule in XFER_RULES.items() if rule.roles == ("peer",))

#: Set once the current call's caller passed the peer admission: a refusal after it
#: (another peer's room or agent) is counted by its own reason, not as not_admitted.
_ADMITTED: contextvars.ContextVar[bool] = contextvars.ContextVar("xfer_admitted", default=False)


def _auth_context(context: grpc.aio.ServicerContext[Any, Any]) -> tuple[list[str], bool]:
    """The caller's verified certificate SANs and whether the connection is TLS."""
    ac = context.auth_context() or {}
    sans = [v.decode("utf-8", "replace") for v in ac.get("x509_subject_alternative_name", [])]
    return sans, ac.get("transport_security_type") == [b"ssl"]


def _caller_name(context: grpc.aio.ServicerContext[Any, Any]) -> str:
    """How a refusal's log line names the caller: its certificate SANs, else its host."""
    sans, _ = _auth_context(context)
    return ",".join(sans) or peer_host(context.peer() or "")


class XferServicer(pb_grpc.XferServiceServicer):
    """XferService over one :class:`XferLogic`.

    Every method is :func:`~kvmesh.grpcsvc.observed` by :attr:`calls`: the
    caller's trace context (call metadata) becomes the parent of the room
    span a call creates (decode: the engine's RegisterRoom; prefill: the
    decode room, through Bootstrap).
    """

    def __init__(self, server: XferServer) -> None:
        self.server = server
        self.logic = server.logic
        #: Makes the caller's trace context current while a method runs.
        self.calls = CallerTraceContext()

    @observed
    async def RegisterRoom(
        self, request: pb.RegisterRoomRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.RegisterRoomResponse:
        """Register a decode room and start its bootstrap with the prefill side."""
        room = self.logic.register_room(
            request.room, request.prefill_address, list(request.dst_page_indices), request.aux_index
        )
        self.server.spawn(self.server.bootstrap(room))
        return pb.RegisterRoomResponse(generation=room.generation)

    @observed
    async def AddTransferRequest(
        self, request: pb.AddTransferRequestRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AddTransferRequestResponse:
        """Queue a transfer of a prefill room's pages (and aux slot) to its decode side."""
        self.logic.add_transfer_request(
            request.room,
            request.page_indices,
            (request.index_slice_start, request.index_slice_end),
            request.is_last,
            request.aux_index,
            request.chunk_id,
        )
        return pb.AddTransferRequestResponse()

    @observed
    async def AddTransferRequests(
        self, request: pb.AddTransferRequestsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AddTransferRequestsResponse:
        """Queue many chunks at once: every entry is checked first, then all are queued
        or, on an error naming the entry (``requests[i].…``), none is."""
        self.logic.add_transfer_requests(
            [
                (
                    e.room,
                    e.page_indices,
                    (e.index_slice_start, e.index_slice_end),
                    e.is_last,
                    e.aux_index,
                    e.chunk_id,
                )
                for e in request.requests
            ]
        )
        return pb.AddTransferRequestsResponse()

    @observed
    async def Poll(
        self, request: pb.PollRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PollResponse:
        """A room's status, failure reason and bytes moved."""
        status, reason, nbytes = self.logic.poll(request.room)
        return pb.PollResponse(status=int(status), failure_reason=reason, bytes=nbytes)  # type: ignore[arg-type]

    @observed
    async def PollRooms(
        self, request: pb.PollRoomsRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PollRoomsResponse:
        """Many rooms' states; with ``wait_ms``, once one of them changes (see the proto)."""
        bad = next((k for k in request.known if k not in _STATUS_VALUES), None)
        if bad is not None:
            raise InvalidArgument(f"unknown room status {bad}", field="known")
        known = [RoomStatus(k) for k in request.known]
        rooms = list(request.rooms)
        if not 0 < len(rooms) <= MAX_POLL_ROOMS:
            raise InvalidArgument(
                f"{len(rooms)} rooms; a call names 1 to {MAX_POLL_ROOMS}", field="rooms"
            )
        if request.wait_ms > MAX_POLL_WAIT_MS:
            raise InvalidArgument(
                f"wait_ms {request.wait_ms} is over {MAX_POLL_WAIT_MS}", field="wait_ms"
            )
        if known and len(known) != len(rooms):
            raise InvalidArgument(
                f"{len(known)} known statuses for {len(rooms)} rooms", field="known"
            )
        wait = request.wait_ms / 1e3
        left = context.time_remaining()
        if left is not None:
            wait = min(wait, left - POLL_DEADLINE_MARGIN_S)
        if wait <= 0:
            states = self.logic.poll_rooms(rooms)
        else:
            states = await _wait_rooms(self.logic, rooms, known or None, wait)
        return pb.PollRoomsResponse(
            rooms=[
                pb.RoomState(
                    room=s.room,
                    found=s.found,
                    status=int(s.status),  # type: ignore[arg-type]
                    failure_reason=s.failure_reason,
                    bytes=s.bytes,
                )
                for s in states
            ]
        )

    @observed
    async def Clear(
        self, request: pb.ClearRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClearResponse:
        """Forget a room; an unfinished decode room is aborted on the prefill side too."""
        unfinished = self.logic.clear(request.room)
        if unfinished is not None and self.logic.role == "decode":
            self.server.spawn(self.server.send_abort(unfinished, "cleared by the decode engine"))
        return pb.ClearResponse()

    @observed
    async def Bootstrap(
        self, request: pb.BootstrapRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.BootstrapResponse:
        """A decode sidecar names a room's destination (peer method, admitted first)."""
        identity = self.server.admit_peer(context)
        client = identity or peer_host(context.peer() or "")
        self.logic.admit_bootstrap(client)
        self.logic.bootstrap(
            client=client,
            room=request.room,
            generation=request.generation,
            dst_pages=list(request.dst_page_indices),
            aux_index=request.aux_index,
            peer_name=request.peer_name,
            peer_address=request.peer_address,
            metadata=request.agent_metadata,
            geometry=PoolGeometry(
                request.page_size, request.page_count, request.aux_size, request.aux_count
            ),
            transport_kind=request.transport,
            identity=identity,
        )
        # The decode side accepts this room's notifications only from this agent.
        return pb.BootstrapResponse(
            instance_id=self.server.instance_id, agent_name=self.server.transport.name
        )

    @observed
    async def Abort(
        self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.AbortResponse:
        """The other side fails a room (peer method, admitted first)."""
        identity = self.server.admit_peer(context)
        self.logic.abort(request.room, request.generation, request.reason, identity)
        return pb.AbortResponse()

    @observed
    async def Heartbeat(
        self, request: pb.HeartbeatRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.HeartbeatResponse:
        """A peer's liveness check: answers this sidecar's instance id (peer method)."""
        self.server.admit_peer(context)
        return pb.HeartbeatResponse(instance_id=self.server.instance_id)

    @observed
    async def Prefetch(
        self, request: pb.PrefetchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PrefetchResponse:
        """Start pulling a prefix from the sidecar that holds it (decode)."""
        pf = await self.server.prefetch(request)
        return pb.PrefetchResponse(prefetch_id=pf.id, state=int(pf.state))  # type: ignore[arg-type]

    @observed
    async def CancelPrefetch(
        self, request: pb.CancelPrefetchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.CancelPrefetchResponse:
        """Stop a prefetch and release its pages (decode)."""
        self.logic._require("decode")
        prior = self.server.prefetches.cancel(request.prefetch_id)
        return pb.CancelPrefetchResponse(prior_state=int(prior))  # type: ignore[arg-type]

    @observed
    async def ClaimPrefetch(
        self, request: pb.ClaimPrefetchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.ClaimPrefetchResponse:
        """The request arrived: take the prefetched pages (decode)."""
        outcome, prior, reason, nbytes = await self.server.claim(request)
        return pb.ClaimPrefetchResponse(
            outcome=int(outcome),  # type: ignore[arg-type]
            prior_state=int(prior),  # type: ignore[arg-type]
            failure_reason=reason,
            bytes=nbytes,
        )

    @observed
    async def OpenRead(
        self, request: pb.OpenReadRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.OpenReadResponse:
        """A decode sidecar asks for what it needs to read pages of this pool (peer method,
        admitted first; either role holds pages)."""
        self.server.admit_peer(context)
        tr = self.server.transport
        if request.transport != tr.kind:
            raise FailedPrecondition(
                f"the reader uses transport {request.transport!r}, this sidecar {tr.kind!r}",
                field="transport",
            )
        geo = self.server.pool.geometry
        if request.page_size != geo.page_size:
            raise InvalidArgument(
                f"reader page size {request.page_size} != page size {geo.page_size}",
                field="page_size",
            )
        if not request.src_page_indices:
            raise InvalidArgument("no source pages", field="src_page_indices")
        self.server.pool.check_pages(request.src_page_indices, "src_page_indices")
        return pb.OpenReadResponse(
            instance_id=self.server.instance_id,
            agent_name=tr.name,
            agent_metadata=tr.metadata(),
            page_count=geo.page_count,
        )


@dataclasses.dataclass
class _PeerChannel:
    """The channel to one peer and the factory that rebuilds it on rotation."""

    factory: ChannelFactory
    channel: grpc.aio.Channel
    stub: pb_grpc.XferServiceAsyncStub

    @classmethod
    def open(cls, factory: ChannelFactory) -> _PeerChannel:
        ch = factory.channel()
        return cls(factory, ch, pb_grpc.XferServiceStub(ch))


async def _close_later(channel: grpc.aio.Channel, delay_s: float) -> None:
    await asyncio.sleep(delay_s)
    await channel.close()


class XferServer:
    """One sidecar: pool, transport, logic, gRPC server and background loops."""

    def __init__(self, config: XferConfig, transport: Transport | None = None) -> None:
        self.config = config
        # Secret and certificate files first: a bad one fails the start, naming
        # the file, before the pool is mapped or a socket is bound.
        self.admission = PeerAdmission(config.peers)
        #: TLS of calls to peers.
        self.peer_tls = config.peer_tls()
        if self.peer_tls.active:
            ChannelFactory("peers", self.peer_tls, what="xfer peers")
        geo = config.pool.geometry()
        t0 = time.monotonic()
        if config.pool.create:
            self.pool = KVPool.create(config.pool.path, geo, populate=config.pool.populate)
        else:
            self.pool = KVPool.attach(config.pool.path, geo, populate=config.pool.populate)
        if config.pool.populate:
            log.info(
                "pool %s: %d bytes mapped, every page at once, in %.2f s",
                config.pool.path,
                geo.total_bytes,
                time.monotonic() - t0,
            )
        self.transport = transport or make_transport(
            config.transport,
            self.pool,
            host=config.host,
            advertise_host=(
                config.advertise_address.rsplit(":", 1)[0].strip("[]")
                if config.advertise_address
                else ""
            ),
            nixl_threads=config.nixl_threads,
            nixl_progress_thread=config.nixl_progress_thread,
            nixl_notify_poll_max_s=config.nixl_notify_poll_max_ms / 1e3,
            tcp_handshake_timeout_s=config.limits.tcp_handshake_timeout_s,
            tcp_max_handshakes=config.limits.tcp_max_handshakes,
        )
        self.metrics = XferMetrics()
        register_tracing_metrics(self.metrics.registry)
        self.logic = XferLogic(config, self.pool, self.transport, self.metrics)
        #: Decode: prefetches (xfer/prefetch.py).
        self.prefetches = PrefetchTable(config.prefetch, self.pool, self.transport, self.metrics)
        #: Changes on every start, so peers notice a restart.
        self.instance_id = uuid.uuid4().hex
        self.authorizer = Authorizer(config.auth, what="xfer")
        # Refusals raised past the guard (peer admission, room ownership) name
        # the caller by its certificate SANs: the identity peer admission checks.
        self.guard = Guard(
            "xfer", self.authorizer, config.limits.per_client, caller_name=_caller_name
        )
        refusals = self.metrics.refusals
        self.guard.on_refusal(lambda method, code: refusals.labels(method, code).inc())
        self.guard.on_refusal(self._count_not_admitted)
        self._server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", config.limits.max_message_bytes),
                ("grpc.max_send_message_length", config.limits.max_message_bytes),
            ]
        )
        servicer = XferServicer(self)
        handlers = capture_handlers(pb_grpc.add_XferServiceServicer_to_server, servicer)
        add_guarded(
            self._server,
            SERVICE_NAME,
            handlers[SERVICE_NAME],
            XFER_RULES,
            self.guard,
            observer=servicer.calls,
        )
        self.health = health.aio.HealthServicer()
        add_health_and_reflection(self._server, self.health, [SERVICE_NAME], self.guard)
        #: Plaintext health-only port for kubelet probes (config.health_port).
        self._health_port = (
            HealthPort(self.health, f"{config.host}:{config.health_port}")
            if config.health_port
            else None
        )
        self.health_port = 0
        self.tls_reloader: Any = None
        self.port = 0
        self.metrics_port = 0
        self._metrics_http: Any = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._channels: dict[str, _PeerChannel] = {}
        self._md_sent: set[str] = set()
        self._peer_instance: dict[str, str] = {}
        self._stopped = False

    @property
    def address(self) -> str:
        """host:port of the gRPC endpoint, as bound."""
        return host_port(self.config.host, self.port)

    @property
    def advertise_address(self) -> str:
        """host:port this sidecar gives its peers for calls back to it (the decode side
        sends it in Bootstrap; the prefill side heartbeats it): ``config.advertise_address``,
        else the bound address."""
        return self.config.advertise_address or self.address

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run ``coro`` in the background (kept referenced until done)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- security ---------------------------------------------------------------------------

    def admit_peer(self, context: grpc.aio.ServicerContext[Any, Any]) -> str:
        """The calling peer's certificate identity ("" without one) once it passes the
        peer admission; PermissionDenied / Unauthenticated otherwise."""
        sans, secure = _auth_context(context)
        secret = None
        for k, v in context.invocation_metadata() or ():
            if k == SECRET_METADATA:
                secret = v.encode() if isinstance(v, str) else bytes(v)
        identity = self.admission.admit(sans, secure, secret)
        _ADMITTED.set(True)
        return identity

    def _count_not_admitted(self, method: str, code: str) -> None:
        """Refusal hook of the guard: a peer method refused before its caller was admitted
        (policy, role, peer admission) is a not_admitted peer refusal."""
        if (
            method in _PEER_METHODS
            and code in ("UNAUTHENTICATED", "PERMISSION_DENIED")
            and not _ADMITTED.get()
        ):
            self.metrics.refuse("not_admitted")

    def _peer_metadata(
        self, extra: tuple[tuple[str, str], ...] = ()
    ) -> tuple[tuple[str, str], ...] | None:
        """Metadata of a call to a peer: ``extra`` plus the secret when one is configured."""
        md = extra
        secret = self.admission.secret
        if secret is not None:
            md = (*md, (SECRET_METADATA, secret.outgoing()))
        return md or None

    def _stub(self, address: str) -> pb_grpc.XferServiceAsyncStub:
        entry = self._channels.get(address)
        if entry is not None and entry.factory.stale():
            # Certificates rotated: new calls handshake with the new files; the
            # old channel closes once its calls are past their deadline.
            self.spawn(_close_later(entry.channel, _PEER_CALL_TIMEOUT_S))
            entry = _PeerChannel.open(entry.factory)
            self._channels[address] = entry
        if entry is None:
            factory = ChannelFactory(address, self.peer_tls, what=f"xfer peer {address}")
            entry = _PeerChannel.open(factory)
            self._channels[address] = entry
        return entry.stub

    # -- decode → prefill calls -----------------------------------------------------------------

    async def bootstrap(self, room: Room) -> None:
        """Send a registered room's destination to its prefill sidecar."""
        addr = room.peer
        geo = self.pool.geometry
        try:
            stub = self._stub(addr)
        except ConfigError as e:  # certificate files unreadable since the start
            self.logic.bootstrap_done(room.room, room.generation, f"peer channel: {e}")
            return
        error = ""
        agent = ""
        for attempt in range(2):
            send_md = addr not in self._md_sent or attempt > 0
            req = pb.BootstrapRequest(
                room=room.room,
                generation=room.generation,
                dst_page_indices=room.dst_pages,
                aux_index=room.aux_index,
                peer_name=self.transport.name,
                agent_metadata=self.transport.metadata() if send_md else b"",
                peer_address=self.advertise_address,
                page_size=geo.page_size,
                page_count=geo.page_count,
                aux_size=geo.aux_size,
                aux_count=geo.aux_count,
                transport=self.transport.kind,
            )
            try:
                resp = await stub.Bootstrap(
                    req,
                    timeout=_PEER_CALL_TIMEOUT_S,
                    metadata=self._peer_metadata(room.trace_context),
                )
            except grpc.aio.AioRpcError as e:
                error = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and not send_md:
                    self._md_sent.discard(addr)
                    continue  # the prefill side restarted or forgot us: resend metadata
                break
            if send_md:
                self._md_sent.add(addr)
            self._peer_instance.setdefault(addr, resp.instance_id)
            agent = resp.agent_name
            error = "" if agent else "the prefill sidecar did not name its transport agent"
            break
        self.logic.bootstrap_done(room.room, room.generation, error, peer_agent=agent or None)
        if error:
            log.info("room %d: bootstrap with %s failed: %s", room.room, addr, error)

    async def send_abort(self, room: Room, reason: str) -> None:
        """Tell the prefill side to fail ``room`` (best effort)."""
        if not room.peer:
            return
        with contextlib.suppress(grpc.aio.AioRpcError, ConfigError):
            await self._stub(room.peer).Abort(
                pb.AbortRequest(room=room.room, generation=room.generation, reason=reason),
                timeout=_PEER_CALL_TIMEOUT_S,
                metadata=self._peer_metadata(),
            )

    # -- prefetches (decode) ---------------------------------------------------------------------

    def _settled(self, pf: Prefetch) -> asyncio.Future[None]:
        """A future done once ``pf`` is no longer Pulling."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            if not fut.done():
                fut.set_result(None)

        def wake_soon() -> None:
            loop.call_soon_threadsafe(wake)

        self.prefetches.watch(pf, wake_soon)
        return fut

    async def prefetch(self, request: pb.PrefetchRequest) -> Prefetch:
        """Check a Prefetch, ask its source, post the read; returns the record."""
        self.logic._require("decode")
        if self.transport.kind != "nixl":
            raise FailedPrecondition(
                f"the {self.transport.kind} transport cannot read from a peer; prefetch needs "
                "--transport nixl",
                field="transport",
            )
        pf = self.prefetches.open(
            request.prefetch_id,
            request.source_address,
            list(request.src_page_indices),
            list(request.dst_page_indices),
            request.ttl_ms,
            request.deadline_ms,
        )
        await self._pull(pf, pf.attempt)
        return pf

    async def _pull(self, pf: Prefetch, attempt: int) -> None:
        """Ask ``pf``'s source for its transport metadata and hand the read to the puller.

        Returns early when the prefetch leaves Pulling meanwhile (a cancel). A source
        that is unreachable or refuses fails the prefetch and raises:
        INVALID_ARGUMENT naming the source's field (pages outside its pool, another
        page size), FAILED_PRECONDITION (``source_address``: unreachable, not a
        sidecar, another transport), DEADLINE_EXCEEDED past the pull's deadline."""
        left = pf.pull_deadline - time.monotonic()
        req = pb.OpenReadRequest(
            prefetch_id=pf.id,
            src_page_indices=pf.src_pages,
            peer_name=self.transport.name,
            page_size=self.pool.geometry.page_size,
            transport=self.transport.kind,
        )
        try:
            stub = self._stub(pf.source)
        except ConfigError as e:
            self.prefetches.fail(pf, f"peer channel: {e}", attempt)
            raise FailedPrecondition(f"peer channel: {e}", field="source_address") from None
        call: asyncio.Future[pb.OpenReadResponse] = asyncio.ensure_future(
            stub.OpenRead(req, timeout=max(left, 0.001), metadata=self._peer_metadata())
        )
        settled = self._settled(pf)
        waiting: list[asyncio.Future[Any]] = [call, settled]
        try:
            await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the caller hung up: no read is left behind
            call.cancel()
            self.prefetches.fail(pf, "the Prefetch call was cancelled", attempt)
            raise
        if not call.done():  # cancelled, or past its deadline, while the source was asked
            call.cancel()
            if pf.state == PrefetchState.CANCELLED:
                return
            raise DeadlineExceeded(
                f"source {pf.source}: {pf.reason or 'no answer'}", field="deadline_ms"
            )
        settled.cancel()
        try:
            resp = call.result()
        except grpc.aio.AioRpcError as e:
            code, details = e.code(), e.details() or e.code().name
            why = f"source {pf.source}: {code.name}: {details}"
            self.prefetches.fail(pf, why, attempt)
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                field = ""
                for k, v in e.trailing_metadata() or ():
                    if k == ERROR_FIELD_METADATA:
                        field = v if isinstance(v, str) else bytes(v).decode()
                raise InvalidArgument(why, field=field or "src_page_indices") from None
            if code == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise DeadlineExceeded(why, field="deadline_ms") from None
            raise FailedPrecondition(why, field="source_address") from None
        try:
            if not self.transport.has_peer(resp.agent_name):
                self.transport.add_peer(resp.agent_name, resp.agent_metadata)
            self.prefetches.start_read(pf, attempt, resp.agent_name, resp.page_count)
        except KvmeshError as e:
            self.prefetches.fail(pf, f"source {pf.source}: {e}", attempt)
            raise

    async def claim(
        self, request: pb.ClaimPrefetchRequest
    ) -> tuple[ClaimOutcome, PrefetchState, str, int]:
        """Answer a claim: (outcome, state as the claim arrived, failure reason, bytes)."""
        self.logic._require("decode")
        table = self.prefetches
        pf, prior = table.claim_begin(request.prefetch_id)
        outcome = ClaimOutcome.FAILED
        reason = ""
        try:
            timeout = request.timeout_ms / 1000 if request.timeout_ms else pf.deadline_s
            end = time.monotonic() + timeout
            if pf.state == PrefetchState.PULLING:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._settled(pf), max(0.0, end - time.monotonic()))
            state = pf.state
            if state == PrefetchState.READY:
                waited = prior != PrefetchState.READY
                outcome = ClaimOutcome.WAITED if waited else ClaimOutcome.READY
                return outcome, prior, "", pf.bytes
            reason = pf.reason or "the pull did not finish within the claim's timeout"
            if not request.fallback or state == PrefetchState.PULLING:
                return outcome, prior, reason, 0
            try:
                attempt = table.restart(pf, end)
                await self._pull(pf, attempt)
            except KvmeshError as e:
                return outcome, prior, f"{reason}; fallback: {e}", 0
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._settled(pf), max(0.0, end - time.monotonic()))
            if pf.state == PrefetchState.READY:
                outcome = ClaimOutcome.FALLBACK
                return outcome, prior, reason, pf.bytes
            return outcome, prior, f"{reason}; fallback: {pf.reason or 'timed out'}", 0
        finally:
            table.claim_end(pf, outcome)

    # -- loops --------------------------------------------------------------------------------

    async def _sweep_loop(self) -> None:
        # A quarter of the shortest timeout scale keeps failures prompt at a
        # negligible cost (the sweep is one pass over the rooms).
        period = min(0.25, self.config.heartbeat_interval_s / 4)
        while True:
            await asyncio.sleep(period)
            try:
                self.prefetches.tick()
                for r in self.logic.tick():
                    if self.logic.role == "decode":
                        self.spawn(self.send_abort(r, r.reason or "timed out"))
            except Exception:
                log.exception("timeout sweep failed")

    async def _heartbeat_loop(self) -> None:
        interval = self.config.heartbeat_interval_s
        while True:
            t0 = time.monotonic()
            peers = self.logic.active_peers()
            if peers:
                await asyncio.gather(*(self._ping(k, a, interval) for k, a in peers.items()))
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - t0)))

    async def _ping(self, key: str, address: str, deadline_s: float) -> None:
        try:
            resp = await self._stub(address).Heartbeat(
                pb.HeartbeatRequest(peer_name=self.transport.name),
                timeout=deadline_s,
                metadata=self._peer_metadata(),
            )
        except (grpc.aio.AioRpcError, ConfigError) as e:
            code = e.code().name if isinstance(e, grpc.aio.AioRpcError) else str(e)
            failed = self.logic.peer_failed(key, f"peer {address} is unreachable ({code})")
            if failed:
                log.warning("peer %s unreachable: failed %d rooms", address, len(failed))
            self._md_sent.discard(address)
            return
        known = self._peer_instance.get(address)
        if known is not None and known != resp.instance_id:
            self.logic.peer_failed(key, f"peer {address} restarted")
            self._md_sent.discard(address)
        self._peer_instance[address] = resp.instance_id

    # -- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        """Bind, start serving and start the loops."""
        cfg = self.config
        self.port, self.tls_reloader = add_port(
            self._server, f"{cfg.host}:{cfg.port}", cfg.tls, what="xfer"
        )
        if self._health_port is not None:
            self.health_port = await self._health_port.start()
        self.logic.start()
        if cfg.role == "decode":
            self.prefetches.start()
        await self._server.start()
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self.spawn(self._sweep_loop())
        self.spawn(self._heartbeat_loop())
        if cfg.metrics_port:
            from prometheus_client import start_http_server

            self._metrics_http, _ = start_http_server(
                cfg.metrics_port, addr=cfg.host, registry=self.metrics.registry
            )
            self.metrics_port = self._metrics_http.server_port
        # Only the decode side gives its address to a peer (prefill heartbeats it).
        advertised = f", advertised as {self.advertise_address}" if cfg.role == "decode" else ""
        log.info(
            "kvmesh xfer %s sidecar serving on %s%s (transport %s, agent %s, %d queues)",
            cfg.role,
            self.address,
            advertised,
            self.transport.kind,
            self.transport.name,
            cfg.queues,
        )

    async def stop(self, grace: float | None = None) -> None:
        """Stop serving, stop the loops and workers, unmap the pool. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.shutdown_grace_s if grace is None else grace
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
        if self._health_port is not None:
            await self._health_port.stop()
        for t in list(self._tasks):
            t.cancel()
        for entry in self._channels.values():
            await entry.channel.close()
        await asyncio.get_running_loop().run_in_executor(None, self.prefetches.stop)
        await asyncio.get_running_loop().run_in_executor(None, self.logic.stop)
        if self._metrics_http is not None:
            self._metrics_http.shutdown()
        log.info("kvmesh xfer stopped")


async def start_server(config: XferConfig) -> XferServer:
    """Start a sidecar for ``config`` (port 0 picks a free one: see ``server.port``)."""
    configure_tracing("kvmesh-xfer")
    server = XferServer(config)
    await server.start()
    return server


async def serve_until_signal(
    config: XferConfig, ready: Callable[[XferServer], None] | None = None
) -> int:
    """Serve until SIGTERM or SIGINT, then shut down; return an exit code."""
    return await runtime.serve_until_signal(
        lambda: start_server(config),
        errors=(OSError, KvmeshError, RuntimeError, ConfigError),
        log=log,
        ready=ready,
    )


def run(config: XferConfig, ready: Callable[[XferServer], None] | None = None) -> int:
    """Run a sidecar in the foreground (``kvmesh xfer serve``); return an exit code."""
    logging.basicConfig(
        stream=sys.stderr,
        level=config.log_level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return runtime.run_main(lambda: serve_until_signal(config, ready))
