"""Sinks: where a tee forwards events. One HTTP sink (SGLang's cache-sim wire), one gRPC sink.

A sink's :meth:`Sink.send` delivers one event or raises :class:`SendFailed`
with the failure ``kind`` the tee counts: ``"http"`` (the sink answered an
error status), ``"error"`` (transport or protocol error). Timeouts are the
tee's business (it wraps each send). Sinks are created and used on one event
loop; :meth:`Sink.close` releases connections.
"""

from __future__ import annotations

import asyncio
from typing import Any, Literal, Protocol

import aiohttp
import grpc
import grpc.aio

from kvmesh.tee.v1 import tee_pb2 as pb
from kvmesh.tee.v1 import tee_pb2_grpc as pb_grpc
from tee.events import EventKind, RoutedEvent

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
    HTTP is ``failed{error}``. ``extra_headers`` are added to every request,
    and the event's trace context (``traceparent``) as headers.
    Keeps up to ``max_connections`` keep-alive connections, which should be
    at least the tee's send concurrency or sends queue behind each other.
    """

    def __init__(
        self,
        base_url: str,
        *,
        name: str = "",
        max_connections: int = 64,
        extra_headers: dict[str, str] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.name = name or self.base_url
        self._max_connections = max_connections
        self._extra = dict(extra_headers or {})
        self._session: aiohttp.ClientSession | None = None
        self._urls = {kind: f"{self.base_url}/{kind.value}" for kind in EventKind}

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
        try:
            async with session.post(
                self._urls[event.kind], data=event.body_bytes(), headers=headers
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

    Serves as the sink for another tee or a cache simulator. The event's
    trace context (``traceparent``) travels as call metadata. A gRPC error
    status is ``failed{http}`` (the sink answered, and refused); a call that
    never reached it (UNAVAILABLE) is ``failed{error}``.
    """

    def __init__(self, target: str, *, name: str = "") -> None:
        self.target = target
        self.name = name or f"grpc://{target}"
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def send(self, event: RoutedEvent) -> None:
        """Offer one event."""
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(self.target)
            self._stub = pb_grpc.TeeServiceStub(self._channel)
        try:
            resp = await self._stub.OfferEvents(
                pb.OfferEventsRequest(events=[event_to_pb(event)]),
                metadata=event.trace_context or None,
            )
        except grpc.aio.AioRpcError as e:
            kind: FailureKind = "error" if e.code() == grpc.StatusCode.UNAVAILABLE else "http"
            raise SendFailed(kind, f"{e.code().name}: {e.details()}") from e
        if resp.accepted != 1:
            raise SendFailed("http", "sink dropped the event")

    async def close(self) -> None:
        """Close the channel."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await asyncio.shield(channel.close())
