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

Transport of a Match (``settings.match_stream``, on by default): every Match
goes over one of the client's ``settings.match_streams`` long-lived
``MatchStream`` calls (dealt in turn), each opened at the first Match dealt to
it, each request tagged with an id and its reply matched by it (so many are in
flight on one HTTP/2 stream, and the indexer spends far less per Match than on
a call of its own). Matches issued while the stream's previous
message was being sent, or in the same event-loop turn, go out together in
one message, and each message of replies may answer many Matches: the
per-message cost, most of the indexer's cost per Match, is shared. The
deadline, the in-flight bound, the breaker and the outcomes are those of
unary Match: a reply that has not come within ``deadline_ms`` is
DEADLINE_EXCEEDED and dropped when it comes; an error reply maps its status
code as a call's status would. When the stream
fails (the indexer restarts, the connection drops, an indexer without
MatchStream answers UNIMPLEMENTED) the Matches waiting on it are re-sent as
unary calls within what is left of their deadline, and Matches go unary until
a new stream is opened: after :data:`_STREAM_RETRY_MIN_S`, doubling up to
:data:`_STREAM_RETRY_MAX_S` while streams keep failing before any reply, and
:data:`_STREAM_UNIMPLEMENTED_RETRY_S` after UNIMPLEMENTED. Opening a stream
never waits: the call object is made at once and the first request is written
behind it. A stream older than ``settings.match_stream_max_age_s`` is
half-closed at its next Match (its replies still come) and a new one takes its
place. With tracing on, Matches stay unary: the trace context travels in a
call's metadata, which a stream carries once, when it opens, and a
MatchStreamRequest has no field for it.

Replicas (:mod:`kvmesh.balancing`): the target may name every indexer replica,
as ``dns:///name:port`` (a headless Service) or as several addresses (one
``ipv4:`` target), and the channel spreads calls over them with
``settings.load_balancing`` (round robin by default). A unary Match is a call,
a MatchStream is one call for its whole life: each stream is placed on the
next replica when it opens, so ``match_streams`` streams spread one client's
Matches over that many replicas, and rotating them by age moves them onto
replicas added since (which the channel learns of when the indexer ages out a
connection: its ``limits.max_connection_age_s``).

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
from typing import Any

import grpc
import grpc.aio
from opentelemetry import trace

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.balancing import balancing_options, channel_target
from kvmesh.protowire import take
from kvmesh.protowire import varint as _varint
from kvmesh.tasks import stop_tasks
from kvmesh.tls import ChannelFactory, TLSFileError
from kvmesh.tracing import end_rpc_span, inject_context, rpc_client_attributes, tracing_enabled
from router_client.config import IndexerClientSettings
from router_client.metrics import tracer

_SERVICE: str = pb.DESCRIPTOR.services_by_name["IndexerService"].full_name
#: Name of the Match client span (the server span has the same name).
_MATCH_METHOD = f"{_SERVICE}/Match"
_PREDICT_METHOD = f"{_SERVICE}/PredictPlacement"
#: Path of the MatchStream method.
_MATCH_STREAM_PATH = f"/{_SERVICE}/MatchStream"

log = logging.getLogger(__name__)

#: How long a replacement channel may take to connect (TCP + TLS handshake)
#: before it is dropped and the old channel kept; generous because nothing
#: waits on it: calls go on over the old channel meanwhile.
_CONNECT_TIMEOUT_S = 10.0
#: Added to the Match deadline before a retired channel is closed: every call
#: on it ends by its deadline, the margin covers the event loop's scheduling.
_CLOSE_MARGIN_S = 1.0
#: Wait before opening a new MatchStream after one failed, doubled for each
#: stream in a row that fails before answering anything, up to the max. Short
#: first: a stream broken by one dropped connection should come back at once
#: (unary covers the gap); capped so that an indexer that stays down costs one
#: stream attempt every few seconds, not one per Match.
_STREAM_RETRY_MIN_S = 0.1
_STREAM_RETRY_MAX_S = 5.0
#: Wait after an indexer answered MatchStream UNIMPLEMENTED (an older replica):
#: it will not learn the method until it is upgraded, so ask again only
#: rarely; a rolling upgrade is picked up within this time.
_STREAM_UNIMPLEMENTED_RETRY_S = 60.0
#: Matches one MatchStreamRequest carries at most, and the bytes past which it
#: takes no more (it always takes one): every Match issued while the previous
#: send was pending goes out in the next message, up to these bounds. 256 is
#: four default windows (more than ``max_in_flight`` rarely waits at once);
#: 1 MiB stays far below the indexer's 16 MiB message limit however long the
#: prompts (8,192 block keys are about 80 KB).
_STREAM_MAX_BATCH = 256
_STREAM_MAX_BATCH_BYTES = 1 << 20


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


#: Outcomes of a Match the indexer did not answer, for which a follower out of
#: sync may answer from its held copy (ERROR is a refusal: a bug, not an outage).
_HOLD_STATUSES = frozenset(
    {
        MatchStatus.DEADLINE_EXCEEDED,
        MatchStatus.UNAVAILABLE,
        MatchStatus.RESOURCE_EXHAUSTED,
        MatchStatus.CIRCUIT_OPEN,
        MatchStatus.BUSY,
    }
)

#: Status codes that count as the indexer being unavailable (they trip the breaker).
_FAILURE_CODES = {
    grpc.StatusCode.DEADLINE_EXCEEDED: MatchStatus.DEADLINE_EXCEEDED,
    grpc.StatusCode.UNAVAILABLE: MatchStatus.UNAVAILABLE,
    grpc.StatusCode.RESOURCE_EXHAUSTED: MatchStatus.RESOURCE_EXHAUSTED,
}


#: grpc.StatusCode by its number (a MatchStreamResponse carries the number).
_CODES = {c.value[0]: c for c in grpc.StatusCode}


class _StreamBroken(Exception):
    """The MatchStream a request waited on ended before its reply came."""


class _StatusReply(Exception):
    """An error reply on the stream: the status unary Match would have ended with."""

    def __init__(self, code: grpc.StatusCode) -> None:
        super().__init__(code.name)
        self.status_code = code


def _expire(fut: asyncio.Future[pb.MatchStreamReply]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


# Field tags (proto/kvmesh/indexer/v1/indexer.proto): MatchStreamRequest
# matches = 1; MatchStreamItem request_id = 1 (varint), match = 2.
_TAG_MATCHES = b"\x0a"
_TAG_REQUEST_ID = b"\x08"
_TAG_MATCH = b"\x12"
#: MatchStreamItem.predict = 3 (length-delimited).
_TAG_PREDICT = b"\x1a"


def _stream_item(request_id: int, match: bytes, tag: bytes = _TAG_MATCH) -> bytes:
    """One entry of ``MatchStreamRequest.matches`` (tag, length, MatchStreamItem) for
    serialized MatchRequest ``match`` (or PredictPlacementRequest, with tag
    :data:`_TAG_PREDICT`); entries joined are a serialized MatchStreamRequest."""
    body = b"".join((_TAG_REQUEST_ID, _varint(request_id), tag, _varint(len(match)), match))
    return b"".join((_TAG_MATCHES, _varint(len(body)), body))


async def _ask(
    stream: _MatchStream, req: pb.MatchRequest | pb.PredictPlacementRequest, deadline_s: float
) -> pb.MatchStreamReply | None:
    """``req``'s reply on ``stream``, or None when the stream ended first (the
    caller goes unary); DEADLINE_EXCEEDED, as a :class:`_StatusReply`, past
    ``deadline_s``."""
    try:
        return await stream.ask(req, deadline_s)
    except TimeoutError:
        raise _StatusReply(grpc.StatusCode.DEADLINE_EXCEEDED) from None
    except _StreamBroken:
        return None


def _left(t0: float, deadline_s: float) -> float:
    """Seconds left of ``deadline_s`` counted from loop time ``t0``;
    DEADLINE_EXCEEDED, as a :class:`_StatusReply`, when none are."""
    left = deadline_s - (asyncio.get_running_loop().time() - t0)
    if left <= 0:
        raise _StatusReply(grpc.StatusCode.DEADLINE_EXCEEDED)
    return left


def _as_bytes(message: bytes) -> bytes:
    """Request serializer of the stream: its messages are built serialized."""
    return message


class _Slot:
    """One of a client's ``match_streams`` places: its open stream (None: none), when
    the next may open, and the wait after the next failure."""

    __slots__ = ("backoff", "retry_at", "stream")

    def __init__(self) -> None:
        self.stream: _MatchStream | None = None
        self.retry_at = 0.0
        self.backoff = _STREAM_RETRY_MIN_S


class _MatchStream:
    """One MatchStream call: request ids, a writer task batching the Matches, a
    reader task handing out replies.

    :meth:`ask` queues a Match; the writer sends every Match queued since its
    last send (or within the event-loop turn that woke it) as one message, up
    to :data:`_STREAM_MAX_BATCH` and :data:`_STREAM_MAX_BATCH_BYTES`. The
    reader hands each reply of a message to its Match by request id.
    ``on_end(stream, code)`` is called once when the call ends (``code`` None:
    the server ended it OK); every request still waiting then fails with
    :class:`_StreamBroken`. ``on_reply(stream)`` is called for the first reply.
    """

    def __init__(
        self,
        channel: grpc.aio.Channel,
        on_end: Callable[[_MatchStream, grpc.StatusCode | None], None],
        on_reply: Callable[[_MatchStream], None],
    ) -> None:
        method = channel.stream_stream(
            _MATCH_STREAM_PATH,
            request_serializer=_as_bytes,
            response_deserializer=pb.MatchStreamResponse.FromString,
        )
        self.call: grpc.aio.StreamStreamCall[bytes, pb.MatchStreamResponse] = method()
        #: When it opened (time.monotonic), for the client's rotation by age.
        self.opened_at = time.monotonic()
        #: The client's place this stream fills (None once the client let it go).
        self.slot: _Slot | None = None
        self._on_end = on_end
        self._on_reply = on_reply
        self.answered = False
        self.ended = False
        self.finishing = False
        self._pending: dict[int, asyncio.Future[pb.MatchStreamReply]] = {}
        self._next_id = 0
        # Serialized MatchStreamRequest.matches entries not yet sent, and the
        # future the writer waits on while there are none.
        self._outbox: list[bytes] = []
        self._wake: asyncio.Future[None] | None = None
        #: Messages written (each carrying one Match or more) and read (each
        #: carrying one reply or more).
        self.messages_sent = 0
        self.messages_received = 0
        self.late_replies = 0
        #: Matches whose deadline passed (or whose caller gave up) before they were sent.
        self.unsent_expired = 0
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._writer = loop.create_task(self._write())
        self._reader = loop.create_task(self._read())

    async def ask(
        self, match: pb.MatchRequest | pb.PredictPlacementRequest, deadline_s: float
    ) -> pb.MatchStreamReply:
        """Send ``match`` (a Match, or a prediction) with the next request id and
        wait for its reply, at most ``deadline_s`` seconds.

        Raises TimeoutError past it (a reply that comes later is dropped) and
        :class:`_StreamBroken` when the stream ends first.
        """
        if self.ended or self.finishing:
            raise _StreamBroken()
        self._next_id += 1
        rid = self._next_id
        fut: asyncio.Future[pb.MatchStreamReply] = self._loop.create_future()
        self._pending[rid] = fut
        tag = _TAG_PREDICT if isinstance(match, pb.PredictPlacementRequest) else _TAG_MATCH
        item = _stream_item(rid, match.SerializeToString(), tag)
        self._outbox.append(item)
        self._kick()
        timer = self._loop.call_later(deadline_s, _expire, fut)
        try:
            return await fut
        except BaseException:
            # Still queued (the writer is held back by flow control): a Match
            # past its deadline, or whose caller gave up, is never sent, to be
            # run for nobody.
            if self._outbox and self._drop_unsent(item):
                self.unsent_expired += 1
            raise
        finally:
            timer.cancel()
            self._pending.pop(rid, None)

    def _drop_unsent(self, item: bytes) -> bool:
        outbox = self._outbox
        for i in range(len(outbox) - 1, -1, -1):
            if outbox[i] is item:
                del outbox[i]
                return True
        return False

    def _kick(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)

    async def _write(self) -> None:
        call = self.call
        outbox = self._outbox
        try:
            while True:
                if not outbox:
                    if self.finishing:
                        break
                    self._wake = self._loop.create_future()
                    await self._wake
                    continue
                message = take(outbox, _STREAM_MAX_BATCH, _STREAM_MAX_BATCH_BYTES)
                self.messages_sent += 1
                await call.write(message)
            await call.done_writing()
        except asyncio.CancelledError:
            raise
        except Exception:
            # The call ended (the reader sees its status) or was cancelled.
            self.call.cancel()

    async def _read(self) -> None:
        code: grpc.StatusCode | None = None
        pending = self._pending
        try:
            while True:
                resp = await self.call.read()
                if not isinstance(resp, pb.MatchStreamResponse):
                    break  # EOF: the server ended the stream OK
                self.messages_received += 1
                if not self.answered:
                    self.answered = True
                    self._on_reply(self)
                for reply in resp.replies:
                    fut = pending.pop(reply.request_id, None)
                    if fut is None or fut.done():
                        self.late_replies += 1
                    else:
                        fut.set_result(reply)
        except asyncio.CancelledError:
            code = grpc.StatusCode.CANCELLED
        except grpc.aio.AioRpcError as e:
            code = e.code()
        except Exception:
            code = grpc.StatusCode.INTERNAL
            log.exception("indexer client: reading the MatchStream failed")
        self._end(code)

    def _end(self, code: grpc.StatusCode | None) -> None:
        if self.ended:
            return
        self.ended = True
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(_StreamBroken())
        self._pending.clear()
        self._writer.cancel()
        self._on_end(self, code)

    def finish(self) -> None:
        """Half-close: no new requests; those queued are sent and still get their replies."""
        self.finishing = True
        self._kick()

    async def close(self) -> None:
        """Cancel the call and wait for its tasks."""
        self.call.cancel()
        self._writer.cancel()
        for t in (self._writer, self._reader):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._end(grpc.StatusCode.CANCELLED)


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
    #: With predictions asked for: the prefix held confirmed or predicted
    #: (route-time predictions, PredictPlacement), >= ``depth``; 0 otherwise.
    predicted_depth: int = 0


@dataclass(frozen=True, slots=True)
class MatchOutcome:
    """What a Match attempt produced: ``matches`` by worker name when OK."""

    status: MatchStatus
    matches: dict[str, WorkerMatch] = field(default_factory=dict)
    #: With predictions asked for, on a backend that counts them: each worker's
    #: route-time predicted blocks its engine has not confirmed (every router's;
    #: absent: none). None: not reported.
    pending: dict[str, int] | None = None

    @property
    def ok(self) -> bool:
        """Whether the indexer answered."""
        return self.status is MatchStatus.OK


def instance_name(worker_id: str, dp_rank: int = 0) -> str:
    """The router's name of an indexer instance: the worker id, ``/dpN`` for rank N > 0."""
    return worker_id if dp_rank == 0 else f"{worker_id}/dp{dp_rank}"


def parse_instance_name(name: str) -> tuple[str, int]:
    """``(worker_id, dp_rank)`` of a name :func:`instance_name` made."""
    worker, sep, rank = name.rpartition("/dp")
    if sep and worker and rank.isdigit() and rank[0] != "0":
        return worker, int(rank)
    return name, 0


#: WorkerMatches made, by their fields (at most :data:`_HITS_MAX`; cleared when
#: full). A Match answers the holders of a shared prefix with the same hit
#: Match after Match, and making a frozen dataclass was half of converting a
#: response: 64 hits took 93 us, 42 with the made ones reused.
_HITS: dict[tuple[int, int, int, int, int, int], WorkerMatch] = {}
_HITS_MAX = 4096


def outcome_from_response(resp: pb.MatchResponse) -> MatchOutcome:
    """Convert a MatchResponse to an OK :class:`MatchOutcome`."""
    hits: dict[str, WorkerMatch] = {}
    made = _HITS
    for m in resp.matches:
        inst = m.instance
        key = (m.depth, m.gpu_blocks, m.cpu_blocks, m.disk_blocks, m.tokens, m.predicted_depth)
        hit = made.get(key)
        if hit is None:
            if len(made) >= _HITS_MAX:
                made.clear()
            hit = made[key] = WorkerMatch(*key)
        hits[instance_name(inst.worker_id, inst.dp_rank)] = hit
    return MatchOutcome(
        MatchStatus.OK,
        hits,
        {
            instance_name(p.instance.worker_id, p.instance.dp_rank): p.predicted_blocks
            for p in resp.pending
        }
        if resp.pending_reported
        else None,
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

    Pass ``target`` (``host:port``, ``dns:///name:port``, several replica
    addresses as a sequence or joined by commas: :func:`kvmesh.balancing.channel_target`;
    default ``settings.target``), dialled with ``settings.tls`` and
    ``settings.load_balancing`` plus any ``channel_options``, or a ready
    ``channel`` (closed by the caller then; ``settings.tls`` and the balancing
    are not used and the channel is never replaced). Use from one asyncio event
    loop. ``follower``: a :class:`router_client.follower.IndexFollower` (typed
    loosely: that module imports this one) that answers Matches in process
    while it is in sync; the others come here as before.

    ``channels_opened`` / ``channels_closed`` count this client's channels
    (a certificate rotation opens one and, once calls moved, closes one);
    ``streams_opened``, ``unary_calls`` (Matches sent as unary calls: stream
    off, down or broken, or tracing on), ``late_replies`` (stream replies
    that came after their deadline, dropped), ``unsent_expired`` (stream
    Matches whose deadline passed while they waited to be written: never
    sent), ``streams_rotated`` (streams let go at ``match_stream_max_age_s``)
    and ``stream_messages_sent`` / ``stream_messages_received`` (MatchStream
    messages, each carrying one Match or reply or more) tell how Matches travel.
    """

    def __init__(
        self,
        target: str | Sequence[str] | None = None,
        *,
        channel: grpc.aio.Channel | None = None,
        settings: IndexerClientSettings | None = None,
        model: str = "",
        lora_name: str = "",
        clock: Callable[[], float] = time.monotonic,
        channel_options: Sequence[tuple[str, Any]] = (),
        follower: Any = None,
    ) -> None:
        self.settings = settings or IndexerClientSettings()
        #: A router_client.follower.IndexFollower answering Matches in process
        #: while it is in sync (this client asks the indexer otherwise).
        self.follower = follower
        #: Matches the follower answered.
        self.follower_matches = 0
        #: Matches the follower answered from its held copy, out of sync, when
        #: the indexer did not answer (IndexFollower.held_match).
        self.follower_held_matches = 0
        if target is None and channel is None and self.settings.target:
            target = self.settings.target
        if (target is None) == (channel is None):
            raise ValueError("pass exactly one of target and channel (or set settings.target)")
        self._own_channel = channel is None
        self._factory: ChannelFactory | None = None
        if channel is None:
            assert target is not None
            self._factory = ChannelFactory(
                channel_target(target),
                self.settings.tls,
                options=[*balancing_options(self.settings.load_balancing), *channel_options],
                what="router: indexer client",
            )
            channel = self._factory.channel()
            # Connect to every address now, not at the first Match: streams opened
            # while only one replica is connected would all be placed on it.
            channel.get_state(try_to_connect=True)
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
        #: PredictPlacement attempts by how they ended (:meth:`predict`).
        self.predict_calls: dict[MatchStatus, int] = dict.fromkeys(MatchStatus, 0)
        # Decided once: tracing off leaves the call path as it was.
        self._tracing = tracing_enabled()
        # server.address/port of the client spans, from the target the channel dials
        # (none known for a ready channel).
        self._span_attributes = rpc_client_attributes(
            _MATCH_METHOD, self._factory.target if self._factory is not None else None
        )
        # The MatchStream places (each: its stream, when the next may open, the
        # wait after the next failure), the next one a Match is dealt to, and
        # every stream not yet ended (retired ones finishing included).
        self._use_stream = self.settings.match_stream and not self._tracing
        #: Whether predictions go on the MatchStream (items with ``predict``);
        #: false once the server showed it predates them.
        self._predict_on_stream = True
        #: Predictions sent as unary PredictPlacement calls (no stream, a stream
        #: that broke, or a server that takes none on it).
        self.predict_unary_calls = 0
        self._slots = [_Slot() for _ in range(self.settings.match_streams)]
        self._next_slot = 0
        self._max_age_s = self.settings.match_stream_max_age_s
        self._streams: set[_MatchStream] = set()
        self._closed = False
        self.streams_opened = 0
        self.streams_rotated = 0
        self.unary_calls = 0
        self._late_replies = 0
        self._unsent_expired = 0
        self._messages_sent = 0
        self._messages_received = 0

    async def match(self, keys: Sequence[int], *, include_predicted: bool = False) -> MatchOutcome:
        """Match ``keys``; never raises for indexer trouble (see the module docstring).

        ``include_predicted``: also count route-time predictions (every
        router's :meth:`predict`): each :class:`WorkerMatch` carries
        ``predicted_depth``, and workers holding the first block by
        prediction alone come with depth 0. The follower answers such a
        Match when its stream carries predictions
        (:attr:`IndexFollower.predictions_followed`); else it goes to the
        indexer, under the same deadline, bound and breaker.
        """
        if not keys:
            return self._count(MatchOutcome(MatchStatus.OK))
        follower = self.follower
        if follower is not None:
            local = follower.match(
                self._model, self._lora, keys, include_predicted=include_predicted
            )
            if local is not None:
                self.follower_matches += 1
                return self._count(local)
        out = await self._remote_match(keys, include_predicted)
        if follower is not None and out.status in _HOLD_STATUSES:
            # The indexer did not answer and the follower is out of sync: its
            # last copy, within its hold (router_client/follower.py), beats
            # routing on load alone. The failed attempt stays counted in calls.
            answer: MatchOutcome | None = follower.held_match(
                self._model, self._lora, keys, include_predicted=include_predicted
            )
            if answer is not None:
                self.follower_held_matches += 1
                return answer
        return out

    async def _remote_match(self, keys: Sequence[int], include_predicted: bool) -> MatchOutcome:
        """Match ``keys`` at the indexer (the stream or a unary call), guarded."""
        if self._factory is not None and self._replacing is None:
            self._maybe_replace_channel()
        if self.in_flight >= self.settings.max_in_flight:
            return self._count(MatchOutcome(MatchStatus.BUSY))
        if not self.breaker.allow():
            return self._count(MatchOutcome(MatchStatus.CIRCUIT_OPEN))
        timeout = self.settings.deadline_ms / 1000.0
        stream = self._open_stream() if self._use_stream else None
        req = pb.MatchRequest(
            model=self._model,
            lora_name=self._lora,
            block_keys=keys,
            max_blocks=len(keys),
            include_predicted=include_predicted,
        )
        self.in_flight += 1
        try:
            if stream is not None:
                resp = await self._stream_match(stream, req, timeout)
            else:
                self.unary_calls += 1
                if self._tracing:
                    resp = await self._traced_match(req)
                else:
                    resp = await self._stub.Match(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return self._failed(e.code())
        except _StatusReply as e:
            return self._failed(e.status_code)
        finally:
            self.in_flight -= 1
        self.breaker.success()
        return self._count(outcome_from_response(resp))

    async def predict(
        self, worker_name: str, keys: Sequence[int], ttl_ms: int = 0, pending_ms: int = 0
    ) -> MatchStatus:
        """Tell the indexer a request for ``keys`` was just sent to ``worker_name``
        (an :func:`instance_name`): every router's Match with ``include_predicted``
        then sees those blocks there for ``ttl_ms`` (0: the indexer's default)
        or until the engine's events confirm or drop them, and counts them in
        the worker's pending prefill (``MatchOutcome.pending``) for
        ``pending_ms`` at most (0: as long; the request's predicted prefill
        end, past which the engine's load report has it). An older indexer
        ignores ``pending_ms``.

        Advice, like a Match, under the Match deadline, the in-flight bound
        and the breaker: an item on the MatchStream the Matches use (no call
        of its own), or one unary PredictPlacement where there is no stream
        (``match_stream`` off, tracing on), the stream broke, or the server
        takes no predictions on it (:attr:`predict_unary_calls`). It never
        raises for indexer trouble and returns how it ended (OK, or why not:
        BUSY and CIRCUIT_OPEN send nothing; ERROR is a refusal such as
        NOT_FOUND for a worker the indexer does not hold live). Counted in
        :attr:`predict_calls`.
        """
        if not keys:
            return self._count_predict(MatchStatus.OK)
        if self.in_flight >= self.settings.max_in_flight:
            return self._count_predict(MatchStatus.BUSY)
        if not self.breaker.allow():
            return self._count_predict(MatchStatus.CIRCUIT_OPEN)
        worker_id, dp_rank = parse_instance_name(worker_name)
        req = pb.PredictPlacementRequest(
            model=self._model,
            lora_name=self._lora,
            instance=pb.InstanceRef(worker_id=worker_id, dp_rank=dp_rank),
            block_keys=keys,
            ttl_ms=ttl_ms,
            pending_ms=pending_ms,
        )
        timeout = self.settings.deadline_ms / 1000.0
        stream = self._open_stream() if self._use_stream and self._predict_on_stream else None
        self.in_flight += 1
        try:
            if stream is not None:
                await self._stream_predict(stream, req, timeout)
            elif self._tracing:
                self.predict_unary_calls += 1
                await self._traced_predict(req, timeout)
            else:
                self.predict_unary_calls += 1
                await self._stub.PredictPlacement(req, timeout=timeout)
        except grpc.aio.AioRpcError as e:
            return self._predict_failed(e.code())
        except _StatusReply as e:
            return self._predict_failed(e.status_code)
        finally:
            self.in_flight -= 1
        self.breaker.success()
        return self._count_predict(MatchStatus.OK)

    def _predict_failed(self, code: grpc.StatusCode) -> MatchStatus:
        return self._count_predict(self._failure(code))

    def _failure(self, code: grpc.StatusCode) -> MatchStatus:
        """The status of a call that ended with ``code``, told to the breaker: a
        refusal (ERROR) releases its probe, trouble counts as a failure."""
        status = _FAILURE_CODES.get(code)
        if status is None:
            self.breaker.release()
            return MatchStatus.ERROR
        self.breaker.failure()
        return status

    async def _stream_predict(
        self, stream: _MatchStream, req: pb.PredictPlacementRequest, deadline_s: float
    ) -> None:
        """A prediction over ``stream`` (MatchStreamItem.predict): no call of its
        own; unary within the deadline left if the stream breaks, and from then
        on for good if the server predates such items (it answers them as a
        Match without a MatchRequest: INVALID_ARGUMENT naming "model").

        Raises what the unary call would: an AioRpcError, or a
        :class:`_StatusReply` carrying an error reply's status.
        """
        t0 = asyncio.get_running_loop().time()
        reply = await _ask(stream, req, deadline_s)
        if (
            reply is not None
            and reply.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            and reply.field == "model"
            and req.model
        ):
            # The server took the item for a Match: it cannot take predictions
            # on the stream. Unary from here on.
            log.warning(
                "indexer client: the indexer takes no predictions on MatchStream "
                "(an older server); sending them as PredictPlacement calls"
            )
            self._predict_on_stream = False
            reply = None
        if reply is None:
            self.predict_unary_calls += 1
            await self._stub.PredictPlacement(req, timeout=_left(t0, deadline_s))
            return
        if reply.code:
            raise _StatusReply(_CODES.get(reply.code, grpc.StatusCode.UNKNOWN))

    def _count_predict(self, status: MatchStatus) -> MatchStatus:
        self.predict_calls[status] += 1
        return status

    def _failed(self, code: grpc.StatusCode) -> MatchOutcome:
        """The outcome of a Match that ended with status ``code``, told to the breaker."""
        return self._count(MatchOutcome(self._failure(code)))

    async def _stream_match(
        self, stream: _MatchStream, req: pb.MatchRequest, deadline_s: float
    ) -> pb.MatchResponse:
        """Match over ``stream``; unary within the deadline left if the stream breaks.

        Raises what the unary call would: an AioRpcError, or a
        :class:`_StatusReply` carrying an error reply's status.
        """
        t0 = asyncio.get_running_loop().time()
        reply = await _ask(stream, req, deadline_s)
        if reply is None:
            self.unary_calls += 1
            resp: pb.MatchResponse = await self._stub.Match(req, timeout=_left(t0, deadline_s))
            return resp
        if reply.code:
            raise _StatusReply(_CODES.get(reply.code, grpc.StatusCode.UNKNOWN))
        return reply.match

    # -- the MatchStream ---------------------------------------------------------------

    def _open_stream(self) -> _MatchStream | None:
        """The stream to send a Match on: the next place's open one, a new one (the
        place was empty, or its stream aged out), or None (go unary)."""
        slots = self._slots
        slot = slots[self._next_slot]
        if len(slots) > 1:
            self._next_slot = (self._next_slot + 1) % len(slots)
        stream = slot.stream
        now = time.monotonic()
        if stream is not None:
            if not self._max_age_s or now - stream.opened_at < self._max_age_s:
                return stream
            # Aged out: half-closed (its replies still come), replaced below by a
            # stream the channel places anew.
            slot.stream = stream.slot = None
            stream.finish()
            self.streams_rotated += 1
        elif now < slot.retry_at:
            return None
        if self._closed:
            return None
        stream = _MatchStream(self._channel, self._stream_ended, self._stream_answered)
        stream.slot = slot
        slot.stream = stream
        self._streams.add(stream)
        self.streams_opened += 1
        return stream

    def _stream_answered(self, stream: _MatchStream) -> None:
        if stream.slot is not None:
            stream.slot.backoff = _STREAM_RETRY_MIN_S

    def _stream_ended(self, stream: _MatchStream, code: grpc.StatusCode | None) -> None:
        """A stream ended: its place's Matches go unary until the next may open
        (module docstring)."""
        self._streams.discard(stream)
        self._late_replies += stream.late_replies
        self._unsent_expired += stream.unsent_expired
        self._messages_sent += stream.messages_sent
        self._messages_received += stream.messages_received
        slot = stream.slot
        if slot is None or slot.stream is not stream:
            return  # a retired stream (aged out, channel replaced) ending: nothing to decide
        slot.stream = stream.slot = None
        if code is grpc.StatusCode.UNIMPLEMENTED:
            wait = _STREAM_UNIMPLEMENTED_RETRY_S
            log.info(
                "indexer client: the indexer does not serve MatchStream; unary Match for %.0f s",
                wait,
            )
        else:
            wait = slot.backoff
            slot.backoff = min(_STREAM_RETRY_MAX_S, wait * 2)
            log.debug("indexer client: MatchStream ended (%s); unary for %.1f s", code, wait)
        slot.retry_at = time.monotonic() + wait

    @property
    def late_replies(self) -> int:
        """Stream replies that came after their Match's deadline (dropped)."""
        return self._late_replies + sum(s.late_replies for s in self._streams)

    @property
    def unsent_expired(self) -> int:
        """Stream Matches whose deadline passed while they waited to be sent (never sent)."""
        return self._unsent_expired + sum(s.unsent_expired for s in self._streams)

    @property
    def stream_messages_sent(self) -> int:
        """MatchStream messages written, each carrying one Match or more."""
        return self._messages_sent + sum(s.messages_sent for s in self._streams)

    @property
    def stream_messages_received(self) -> int:
        """MatchStream messages read, each carrying one reply or more."""
        return self._messages_received + sum(s.messages_received for s in self._streams)

    async def _traced_match(self, req: pb.MatchRequest) -> pb.MatchResponse:
        """Match under a CLIENT span whose context travels in the call's metadata
        (W3C ``traceparent``), so that the indexer's spans join the router's trace."""
        with tracer.start_as_current_span(
            _MATCH_METHOD,
            kind=trace.SpanKind.CLIENT,
            attributes={**self._span_attributes, "kvmesh.blocks": len(req.block_keys)},
        ) as span:
            try:
                resp: pb.MatchResponse = await self._stub.Match(
                    req,
                    timeout=self.settings.deadline_ms / 1000.0,
                    metadata=inject_context(),
                )
            except grpc.aio.AioRpcError as e:
                end_rpc_span(span, e.code().name, server=False)
                raise
            end_rpc_span(span, "OK", server=False)
            span.set_attribute("kvmesh.matches", len(resp.matches))
            return resp

    async def _traced_predict(self, req: pb.PredictPlacementRequest, deadline_s: float) -> None:
        """PredictPlacement under a CLIENT span carried in the call's metadata, as
        :meth:`_traced_match`: the prediction a decision sends in the background
        (its task took the decision's context) joins the decision's trace."""
        with tracer.start_as_current_span(
            _PREDICT_METHOD,
            kind=trace.SpanKind.CLIENT,
            attributes={**self._span_attributes, "kvmesh.blocks": len(req.block_keys)},
        ) as span:
            try:
                await self._stub.PredictPlacement(
                    req, timeout=deadline_s, metadata=inject_context()
                )
            except grpc.aio.AioRpcError as e:
                end_rpc_span(span, e.code().name, server=False)
                raise
            end_rpc_span(span, "OK", server=False)

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
            for slot in self._slots:
                if slot.stream is not None:
                    # Its Matches in flight are answered on the old channel; new
                    # ones open a stream on the new channel.
                    stream, slot.stream = slot.stream, None
                    stream.slot = None
                    stream.finish()
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
        """Close the channel if this client opened it (and any being replaced or retired).

        Any open MatchStream is cancelled first (a Match waiting on it is
        re-sent unary, within its deadline, on a channel still open or fails).
        """
        self._closed = True
        for slot in self._slots:
            if slot.stream is not None:
                slot.stream.slot = None
                slot.stream = None
        for stream in list(self._streams):
            await stream.close()
        if self._replacing is not None:
            await stop_tasks(self._replacing, what="indexer client: replacing a stream")
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)
        if self._own_channel:
            await self._close_channel(self._channel, None)
