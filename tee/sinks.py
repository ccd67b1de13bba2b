"""Sinks: where a tee forwards events. One HTTP sink (SGLang's cache-sim wire), one gRPC sink.

A sink's :meth:`Sink.send` delivers one event or raises :class:`SendFailed`
with the failure ``kind`` the tee counts: ``"http"`` (the sink answered an
error status, including a refusal of the caller's identity), ``"error"``
(transport or protocol error, including a failed TLS handshake). Timeouts are
the tee's business (it wraps each send). Sinks are created and used on one
event loop; :meth:`Sink.close` releases connections.

Both sinks take a :class:`~kvmesh.tls.ClientTLS`: CA, client certificate
(mutual TLS), server-name override and bearer-token file, re-read when the
files change. A file that cannot be read at construction raises
:class:`~kvmesh.tls.TLSFileError` (a configuration error, before any event
is offered); later, a TLS problem only fails sends.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Literal, Protocol
from urllib.parse import urlsplit

import aiohttp
import grpc
import grpc.aio

from kvmesh.api.tee.v1 import tee_pb2 as pb
from kvmesh.api.tee.v1 import tee_pb2_grpc as pb_grpc
from kvmesh.balancing import balancing_options, channel_target
from kvmesh.configfile import ConfigError
from kvmesh.tls import ChannelFactory, ClientTLS, TLSFileError
from tee.events import EventKind, RoutedEvent
from tee.httpsec import ClientSSL

log = logging.getLogger(__name__)

#: How long a replaced gRPC channel may finish its calls before it is closed:
#: the tee's default send timeout, so a send in flight is never cut short.
CHANNEL_CLOSE_GRACE_S = 2.0

FailureKind = Literal["http", "error"]


class SendFailed(Exception):
    """One send failed; ``kind`` is the failure counter it lands in."""

    def __init__(self, kind: FailureKind, message: str) -> None:
        super().__init__(message)
        self.kind: FailureKind = kind


class Sink(Protocol):
    """Something a tee forwards events to."""

    name: str

    async def send(self, event: RoutedEvent) -> None:
        """Deliver ``event``; raise :class:`SendFailed` when the sink refuses it."""
        ...

    async def close(self) -> None:
        """Release connections; no send follows."""
        ...


class HttpSink:
    """POSTs events to ``{base_url}/ingest_ids`` or ``/extend_ids`` (SGLang's cache-sim wire).

    Any 2xx answer is success (the body is read and ignored); another status
    is ``failed{http}``; a refused connection, a reset or an answer that is not
    HTTP (or a failed TLS handshake) is ``failed{error}``. ``extra_headers``
    are added to every request, and the event's trace context
    (``traceparent``) as headers.
    Keeps up to ``max_connections`` keep-alive connections, which should be
    at least the tee's send concurrency or sends queue behind each other.

    With ``tls`` active the URL must be ``https://``: the server is verified
    against ``tls.ca_file`` (the system roots when empty), ``tls.cert_file``
    is presented for mutual TLS, and ``tls.token_file`` is sent as
    ``Authorization: Bearer <token>``. Changed files apply to new connections.
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str = "",
        max_connections: int = 64,
        extra_headers: dict[str, str] | None = None,
        tls: ClientTLS | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url
        self._max_connections = max_connections
        self._extra = dict(extra_headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._urls = {kind: f"{self.base_url}/{kind.value}" for kind in EventKind}
        self.tls = tls if tls is not None else ClientTLS()
        self._ssl: ClientSSL | None = None
        if self.tls.active:
            if urlsplit(self.base_url).scheme != "https":
                # Never a certificate or a token over plaintext.
                raise ConfigError(f"sink {self.name}: tls is set but the url is not https://")
            self._ssl = ClientSSL(self.tls, what=f"tee sink {self.name}")

    def _open(self) -> aiohttp.ClientSession:
        connector = aiohttp.TCPConnector(limit=self._max_connections, ttl_dns_cache=300)
        # No session-wide timeout: the tee's per-send timeout governs.
        self._session = aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=None)
        )
        return self._session

    async def send(self, event: RoutedEvent) -> None:
        """POST one event."""
        session = self._session or self._open()
        headers = event.headers()
        if self._extra:
            headers.update(self._extra)
        tls: dict[str, Any] = {}
        if self._ssl is not None:
            # A new context after a rotation opens new connections: the
            # connection pool is keyed by the context.
            self._ssl.refresh()
            tls["ssl"] = self._ssl.context
            if self.tls.server_name:
                tls["server_hostname"] = self.tls.server_name
            if self._ssl.token:
                headers["Authorization"] = f"Bearer {self._ssl.token}"
        try:
            async with session.post(
                self._urls[event.kind], data=event.body_bytes(), headers=headers, **tls
            ) as resp:
                await resp.read()
                if not 200 <= resp.status < 300:
                    raise SendFailed("http", f"HTTP {resp.status}")
        except aiohttp.ClientError as e:
            raise SendFailed("error", f"{type(e).__name__}: {e}") from e

    async def close(self) -> None:
        """Close the connection pool."""
        if self._session is not None:
            await self._session.close()
            self._session = None


def event_to_pb(event: RoutedEvent) -> pb.RoutedEvent:
    """The gRPC form of an event."""
    msg = pb.RoutedEvent(
        kind=pb.EVENT_KIND_INGEST if event.kind is EventKind.INGEST else pb.EVENT_KIND_EXTEND,
        model=event.model,
        input_ids=event.input_ids,
        request_id=event.request_id,
        worker=event.worker,
    )
    for name in ("prompt_len", "choice_index", "choice_count", "output_tokens"):
        value = getattr(event, name)
        if value is not None:
            setattr(msg, name, value)
    return msg


class GrpcSink:
    """Sends each event with ``kvmesh.tee.v1.TeeService/OfferEvents`` to ``target``.

    Serves as the sink for another tee or a cache simulator, and as the
    client a router embeds to send to a tee server. The event's trace context
    (``traceparent``) travels as call metadata. A gRPC error status is
    ``failed{http}`` (the sink answered, and refused, e.g. PERMISSION_DENIED);
    a call that never reached it (UNAVAILABLE, which includes a failed TLS
    handshake) is ``failed{error}``.

    ``tls`` (see :class:`~kvmesh.tls.ChannelFactory`): CA, client certificate,
    server name, bearer token as call credentials. When the files change a
    new channel is opened for the next sends and the old one closed once its
    calls are done.

    ``target`` may name several replicas of the sink (``dns:///name:port``, or
    addresses joined by commas: :func:`kvmesh.balancing.channel_target`); sends
    go round robin over the ready ones.
    """

    def __init__(self, target: str, *, name: str = "", tls: ClientTLS | None = None) -> None:
        self.target = target
        self.name = name or f"grpc://{target}"
        self.factory = ChannelFactory(
            channel_target(target),
            tls,
            options=balancing_options("round_robin"),
            what=f"tee sink {self.name}",
        )
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None
        self._closing: set[asyncio.Task[None]] = set()

    def _open(self) -> Any:
        old = self._channel
        try:
            channel = self.factory.channel()
        except TLSFileError as e:
            if self._stub is not None:  # keep the channel we have
                log.error("%s: cannot reopen the channel, keeping the old one: %s", self.name, e)
                return self._stub
            raise SendFailed("error", str(e)) from e
        self._channel = channel
        self._stub = pb_grpc.TeeServiceStub(channel)
        if old is not None:
            task = asyncio.get_running_loop().create_task(old.close(CHANNEL_CLOSE_GRACE_S))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
        return self._stub

    async def send(self, event: RoutedEvent) -> None:
        """Offer one event."""
        stub = self._stub
        if stub is None or self.factory.stale():
            stub = self._open()
        try:
            resp = await stub.OfferEvents(
                pb.OfferEventsRequest(events=[event_to_pb(event)]),
                metadata=event.trace_context or None,
            )
        except grpc.aio.AioRpcError as e:
            kind: FailureKind = "error" if e.code() == grpc.StatusCode.UNAVAILABLE else "http"
            raise SendFailed(kind, f"{e.code().name}: {e.details()}") from e
        if resp.accepted != 1:
            raise SendFailed("http", "sink dropped the event")

    async def close(self) -> None:
        """Close the channel (and any replaced one still finishing its calls)."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await asyncio.shield(channel.close())
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
