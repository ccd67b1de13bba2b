"""The router's view of the indexer: Match with a deadline, a bound and a breaker.

Affinity is advice: routing never waits on it. Each Match gets a short
deadline; at most ``max_in_flight`` calls run at once (a call beyond that is
not made); after ``breaker_failures`` consecutive failures the circuit opens
and no call is made for ``breaker_cooldown_s``, after which one probe call
decides whether it closes again. Whatever goes wrong, :meth:`IndexerClient.match`
returns a :class:`MatchOutcome` with a non-OK status and no matches, and the
router routes on load alone. It never raises for indexer trouble.

The client sends block keys (computed by the router with
:mod:`kvmesh.blockkeys`), never token ids.

Transport security: with ``settings.tls`` (:class:`kvmesh.tls.ClientTLS`) the
channel uses TLS, a client certificate (mutual TLS) and a bearer token, built
by :class:`kvmesh.tls.ChannelFactory`. A TLS handshake the server refuses ends
the call UNAVAILABLE, so it counts as an indexer failure like any other. When
the certificate files change (checked from :meth:`IndexerClient.match` at most
every ``tls.reload_interval_s``: one clock read per call), a new channel is
opened and connected in the background; calls move to it once it is ready, and
the old channel is closed when its calls have ended (they all carry the
deadline). Until then, and if the new channel cannot connect, calls keep using
the old one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
from opentelemetry import trace

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.tls import ChannelFactory, TLSFileError
from kvmesh.tracing import inject_context, tracing_enabled
from router_client.config import IndexerClientSettings
from router_client.metrics import tracer

_SERVICE: str = pb.DESCRIPTOR.services_by_name["IndexerService"].full_name
#: Name of the Match client span (the server span has the same name).
_MATCH_METHOD = f"{_SERVICE}/Match"

log = logging.getLogger(__name__)

#: How long a replacement channel may take to connect (TCP + TLS handshake)
#: before it is dropped and the old channel kept; generous because nothing
#: waits on it: calls go on over the old channel meanwhile.
_CONNECT_TIMEOUT_S = 10.0
#: Added to the Match deadline before a retired channel is closed: every call
#: on it ends by its deadline, the margin covers the event loop's scheduling.
_CLOSE_MARGIN_S = 1.0


class MatchStatus(enum.Enum):
    """How a Match attempt ended."""

    OK = "ok"
    DEADLINE_EXCEEDED = "deadline_exceeded"
    UNAVAILABLE = "unavailable"
    RESOURCE_EXHAUSTED = "resource_exhausted"
    CIRCUIT_OPEN = "circuit_open"
    #: ``max_in_flight`` calls were already running; this one was not made.
    BUSY = "busy"
    #: Any other status (e.g. INVALID_ARGUMENT): a bug, not an outage.
    ERROR = "error"


#: Status codes that count as the indexer being unavailable (they trip the breaker).
_FAILURE_CODES = {
    grpc.StatusCode.DEADLINE_EXCEEDED: MatchStatus.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: MatchStatus.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MatchStatus.RESOURCE_EXHAUSTED,
}


@dataclass(frozen=True, slots=True)
class WorkerMatch:
    """One worker's cached prefix of a prompt, per tier (see the proto's InstanceMatch)."""

    depth: int
    gpu_blocks: int = 0
    cpu_blocks: int = 0
    disk_blocks: int = 0
    #: The hit in tokens when it ends inside a block (a hybrid engine's finer
    #: hash unit); 0: ``depth`` whole blocks.
    tokens: int = 0


@dataclass(frozen=True, slots=True)
class MatchOutcome:
    """What a Match attempt produced: ``matches`` by worker name when OK."""

    status: MatchStatus
    matches: dict[str, WorkerMatch] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Whether the indexer answered."""
        return self.status is MatchStatus.OK


def instance_name(worker_id: str, dp_rank: int = 0) -> str:
    """The router's name of an indexer instance: the worker id, ``/dpN`` for rank N > 0."""
    return worker_id if dp_rank == 0 else f"{worker_id}/dp{dp_rank}"


def outcome_from_response(resp: pb.MatchResponse) -> MatchOutcome:
    """Convert a MatchResponse to an OK :class:`MatchOutcome`."""
    return MatchOutcome(
        MatchStatus.OK,
        {
            instance_name(m.instance.worker_id, m.instance.dp_rank): WorkerMatch(
                m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks, m.tokens
            )
            for m in resp.matches
        },
    )


class CircuitBreaker:
    """Consecutive-failure breaker: closed → open (cooldown) → half-open (one probe).

    Not thread-safe; used from one event loop.
    """

    def __init__(
        self, failures: int, cooldown_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._threshold = failures
        self._cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0
        self._open_until: float | None = None
        self._probing = False

    @property
    def state(self) -> str:
        """``"closed"``, ``"open"`` or ``"half_open"``."""
        if self._open_until is None:
            return "closed"
        return "open" if self._clock() < self._open_until else "half_open"

    def allow(self) -> bool:
        """Whether a call may be made now (in half-open state: one probe at a time)."""
        if self._open_until is None:
            return True
        if self._clock() < self._open_until or self._probing:
            return False
        self._probing = True
        return True

    def success(self) -> None:
        """A call succeeded: close the circuit."""
        self._failures = 0
        self._open_until = None
        self._probing = False

    def failure(self) -> None:
        """A call failed: count it; open (again) at the threshold or after a failed probe."""
        self._failures += 1
        if self._probing or self._failures >= self._threshold:
            self._open_until = self._clock() + self._cooldown_s
        self._probing = False

    def release(self) -> None:
        """A call ended with neither verdict (e.g. a bad request): free the probe slot."""
        self._probing = False


class IndexerClient:
    """Match calls to one indexer, guarded as the module docstring says.

    Pass ``target`` (``host:port``, dialled with ``settings.tls``) or a ready
    ``channel`` (closed by the caller then; ``settings.tls`` is not used and
    the channel is never replaced). Use from one asyncio event loop.

    ``channels_opened`` / ``channels_closed`` count this client's channels
    (a certificate rotation opens one and, once calls moved, closes one).
    """

    def __init__(
        self,
        target: str | None = None,
        *,
        channel: grpc.aio.Channel | None = None,
        settings: IndexerClientSettings | None = None,
        model: str = "",
        lora_name: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (target is None) == (channel is None):
            raise ValueError("pass exactly one of target and channel")
        self.settings = settings or IndexerClientSettings()
        self._own_channel = channel is None
        self._factory: ChannelFactory | None = None
        if channel is None:
            self._factory = ChannelFactory(
                str(target), self.settings.tls, what="router: indexer client"
            )
            channel = self._factory.channel()
        elif self.settings.tls.active:
            log.warning("indexer client: settings.tls is not used with a ready channel")
        self._channel = channel
        self._stub = pb_grpc.IndexerServiceStub(self._channel)
        self.channels_opened = 1 if self._own_channel else 0
        self.channels_closed = 0
        # A replacement channel being connected, and retired channels being closed.
        self._replacing: asyncio.Task[None] | None = None
        self._closing: set[asyncio.Task[None]] = set()
        # After a replacement failed (files that did not load, a channel that did
        # not connect): try again at this monotonic time even if the files did not
        # change again.
        self._retry_at: float | None = None
        self._model = model
        self._lora = lora_name
        self.breaker = CircuitBreaker(
            self.settings.breaker_failures, self.settings.breaker_cooldown_s, clock
        )
        self.in_flight = 0
        self.calls: dict[MatchStatus, int] = dict.fromkeys(MatchStatus, 0)
        # Decided once: tracing off leaves the call path as it was.
        self._tracing = tracing_enabled()

    async def match(self, keys: Sequence[int]) -> MatchOutcome:
        """Match ``keys``; never raises for indexer trouble (see the module docstring)."""
        if not keys:
            return self._count(MatchOutcome(MatchStatus.OK))
        if self._factory is not None and self._replacing is None:
            self._maybe_replace_channel()
        if self.in_flight >= self.settings.max_in_flight:
            return self._count(MatchOutcome(MatchStatus.BUSY))
        if not self.breaker.allow():
            return self._count(MatchOutcome(MatchStatus.CIRCUIT_OPEN))
        req = pb.MatchRequest(
            model=self._model, lora_name=self._lora, block_keys=keys, max_blocks=len(keys)
        )
        self.in_flight += 1
        try:
            if self._tracing:
                resp = await self._traced_match(req)
            else:
                resp = await self._stub.Match(req, timeout=self.settings.deadline_ms / 1000.0)
        except grpc.aio.AioRpcError as e:
            status = _FAILURE_CODES.get(e.code())
            if status is None:
                self.breaker.release()
                return self._count(MatchOutcome(MatchStatus.ERROR))
            self.breaker.failure()
            return self._count(MatchOutcome(status))
        finally:
            self.in_flight -= 1
        self.breaker.success()
        return self._count(outcome_from_response(resp))

    async def _traced_match(self, req: pb.MatchRequest) -> pb.MatchResponse:
        """Match under a CLIENT span whose context travels in the call's metadata
        (W3C ``traceparent``), so that the indexer's spans join the router's trace."""
        with tracer.start_as_current_span(
            _MATCH_METHOD,
            kind=trace.SpanKind.CLIENT,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": _SERVICE,
                "rpc.method": "Match",
                "kvmesh.blocks": len(req.block_keys),
            },
        ) as span:
            try:
                resp: pb.MatchResponse = await self._stub.Match(
                    req,
                    timeout=self.settings.deadline_ms / 1000.0,
                    metadata=inject_context(),
                )
            except grpc.aio.AioRpcError as e:
                span.set_attribute("rpc.grpc.status_code", e.code().name)
                raise
            span.set_attribute("rpc.grpc.status_code", "OK")
            span.set_attribute("kvmesh.matches", len(resp.matches))
            return resp

    def _count(self, outcome: MatchOutcome) -> MatchOutcome:
        self.calls[outcome.status] += 1
        return outcome

    # -- certificate rotation --------------------------------------------------------

    def _maybe_replace_channel(self) -> None:
        """Start replacing the channel when the certificate files changed (never blocks)."""
        assert self._factory is not None
        if self._retry_at is not None:
            if time.monotonic() < self._retry_at:
                return
        elif not self._factory.stale():
            return
        self._retry_at = None
        try:
            new = self._factory.channel()
        except TLSFileError as e:
            # Likely a rotation caught half-way (certificate written, key not yet).
            log.warning("indexer client: certificate files changed but do not load: %s", e)
            self._retry_at = time.monotonic() + self._factory.tls.reload_interval_s
            return
        self.channels_opened += 1
        self._replacing = asyncio.create_task(self._replace_channel(new))

    async def _replace_channel(self, new: grpc.aio.Channel) -> None:
        """Connect ``new``; then move calls to it and retire the old channel."""
        assert self._factory is not None
        try:
            try:
                await asyncio.wait_for(new.channel_ready(), _CONNECT_TIMEOUT_S)
            except asyncio.CancelledError:
                await self._close_channel(new, None)  # the client is closing
                raise
            except (TimeoutError, grpc.aio.UsageError):
                log.error(
                    "indexer client: a channel with the new certificate files did not "
                    "connect to %s within %.0f s; keeping the previous one",
                    self._factory.target,
                    _CONNECT_TIMEOUT_S,
                )
                self._retire(new, 0)
                self._retry_at = time.monotonic() + self._factory.tls.reload_interval_s
                return
            old, self._channel = self._channel, new
            self._stub = pb_grpc.IndexerServiceStub(new)
            log.info("indexer client: new certificates in use for %s", self._factory.target)
            self._retire(old, self.settings.deadline_ms / 1000.0 + _CLOSE_MARGIN_S)
        finally:
            self._replacing = None

    def _retire(self, channel: grpc.aio.Channel, grace: float) -> None:
        """Close ``channel`` in the background once its calls ended (at most ``grace`` s)."""
        task = asyncio.create_task(self._close_channel(channel, grace))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close_channel(self, channel: grpc.aio.Channel, grace: float | None) -> None:
        await channel.close(grace)
        self.channels_closed += 1

    async def close(self) -> None:
        """Close the channel if this client opened it (and any being replaced or retired)."""
        if self._replacing is not None:
            self._replacing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._replacing
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._own_channel:
            await self._close_channel(self._channel, None)
