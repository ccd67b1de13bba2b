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

``MatchStream`` serves many Matches over one stream, many to a message each
way (:meth:`IndexerServicer.MatchStream`): the stream is admitted like any
call (identity, role, per-client ``max_in_flight``, where it counts as one,
and ``max_concurrent_rpcs``); each Match on it then takes a token of the
caller's ``match`` rate and counts as one more call against
``max_concurrent_rpcs`` while it runs, and is answered in band, an error
included, without ending the stream. Replies are written coalesced: every
reply ready when the writer wakes goes into one message.

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
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2
from opentelemetry import trace

from indexer import convert
from indexer.bridge import wire
from indexer.config import IndexerConfig
from indexer.factory import build_index
from indexer.index import Index
from indexer.instrumented import (
    TRACER_NAME,
    InstrumentedIndex,
    Metrics,
    backend_of,
    configure_tracing,
)
from indexer.logic import IndexerLogic, _check_name
from indexer.memory import MemoryIndex
from indexer.model import Namespace
from indexer.pacing import call_pacer
from indexer.redis.backend import RedisIndex
from indexer.redis.watchfeed import RedisWatchFeed
from indexer.rpc import IndexerCalls
from indexer.sglang.compat import SglangCompat
from indexer.sglang.server import SGLANG_SERVICE_NAME, SglangServicer, add_sglang_servicer
from indexer.watch import Change, Resync, WatchHub, snapshot_parts
from kvmesh import runtime
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.auth import Authorizer, Client, current_client
from kvmesh.balancing import connection_age_options
from kvmesh.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from kvmesh.grpcsvc import (
    HANDLER_FACTORIES,
    Guard,
    HealthPort,
    MethodRule,
    add_guarded,
    add_health_and_reflection,
    observed,
    status_code,
)
from kvmesh.protowire import take
from kvmesh.protowire import varint as _varint
from kvmesh.runtime import host_port as _host_port
from kvmesh.runtime import setup_logging as _setup_logging
from kvmesh.tls import add_port
from kvmesh.tracing import end_rpc_span, rpc_server_attributes

log = logging.getLogger(__name__)

#: Full name of the service, as health checks and reflection know it.
SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["IndexerService"].full_name


_PING_RESPONSE = pb.PingResponse()


#: Matches one MatchStream runs at once (computing or waiting to be written),
#: whatever the number of messages they came in; the stream's next message is
#: not read (nor the rest of a message started) until one ends, so a client
#: that sends faster than the server answers is held back by HTTP/2 flow
#: control instead of growing a task set. 64 is the router client's default
#: ``max_in_flight``: one router's whole window fits on its stream.
MATCH_STREAM_WINDOW = 64

#: Replies one MatchStreamResponse carries at most: the writer takes every
#: reply ready, up to this many (the window bounds them first unless it is
#: set larger), so that one send carries the replies of a whole window.
MATCH_STREAM_MAX_REPLIES = 256

#: Bytes past which a MatchStreamResponse takes no more replies (it always
#: takes one, however large). A quarter of grpc's default 4 MiB receive limit,
#: so that a client with default channel options reads any batch; replies are
#: a few hundred bytes each, so the count above binds first in practice.
MATCH_STREAM_MAX_REPLY_BYTES = 1 << 20

#: Method label of the per-Match metrics and spans of MatchStream (the stream
#: itself is recorded under "MatchStream", as every stream is: whole stream).
MATCH_STREAM_MATCH = "MatchStream.Match"
#: The same for the route-time predictions a MatchStream carries (an item with
#: ``predict``: PredictPlacement without a call of its own).
MATCH_STREAM_PREDICT = "MatchStream.PredictPlacement"


# Field tags (proto/kvmesh/indexer/v1/indexer.proto): MatchStreamResponse
# replies = 1 (length-delimited); MatchStreamReply request_id = 1 (varint),
# match = 2 (length-delimited). The match bytes are those of
# convert.MatchResponseEncoder, as unary Match sends them.
_TAG_REPLIES = b"\x0a"
_TAG_REQUEST_ID = b"\x08"
_TAG_MATCH = b"\x12"


def match_stream_reply(request_id: int, match: bytes) -> bytes:
    """One entry of ``MatchStreamResponse.replies``: a MatchStreamReply carrying
    serialized MatchResponse ``match``, with its tag and length.

    Entries concatenated are a serialized MatchStreamResponse (a repeated
    field's entries simply follow one another), so the writer joins them
    without building a message. ``match`` is always written, even empty, so
    that the reply has it set (what tells an answer from an error to a reader
    of the message).
    """
    head = _TAG_REQUEST_ID + _varint(request_id) if request_id else b""
    body = b"".join((head, _TAG_MATCH, _varint(len(match)), match))
    return b"".join((_TAG_REPLIES, _varint(len(body)), body))


def predict_stream_reply(request_id: int, predicted: int, ttl_ms: int) -> bytes:
    """The ``MatchStreamResponse.replies`` entry answering a prediction item:
    its PredictPlacementResponse (``predicted`` always set, even empty)."""
    answer = pb.PredictPlacementResponse(predicted_blocks=predicted, ttl_ms=ttl_ms)
    body = pb.MatchStreamReply(request_id=request_id, predicted=answer).SerializeToString()
    return _TAG_REPLIES + _varint(len(body)) + body


def match_stream_error(request_id: int, err: KvmeshError) -> bytes:
    """The ``MatchStreamResponse.replies`` entry of ``err``: the status unary
    Match would end with."""
    code = status_code(err.code)
    body = pb.MatchStreamReply(
        request_id=request_id, code=code.value[0], message=str(err), field=err.field
    ).SerializeToString()
    return _TAG_REPLIES + _varint(len(body)) + body


def _answers_without_io(index: Index) -> bool:
    """Whether ``index``'s Match completes without awaiting anything (the
    memory backend's, as built by :func:`~indexer.factory.build_index`).

    A subclass that overrides ``match`` (it may await) does not count.
    """
    inner = backend_of(index)
    return isinstance(inner, MemoryIndex) and type(inner).match is MemoryIndex.match


class _Undecodable:
    """A MatchStream frame that did not decode (see :func:`_decode_match_stream_request`)."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _decode_match_stream_request(raw: bytes) -> pb.MatchStreamRequest | _Undecodable:
    """Decode a MatchStream frame; an undecodable one is handed to the handler, not raised.

    The call scope would abort the call from the task reading the stream,
    which may be while the handler writes a reply (grpc allows one send at a
    time: the abort would fail); :meth:`IndexerServicer.MatchStream` ends the
    stream itself instead, from the writing task, once the replies in flight
    are written.
    """
    try:
        return pb.MatchStreamRequest.FromString(raw)
    except Exception as e:
        return _Undecodable(e)


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
    # The stream is admitted once; each of its Matches takes a "match" token.
    "MatchStream": MethodRule(("router",)),
    "GetStats": MethodRule(("router",)),
    "DumpIndex": MethodRule(("admin",)),
    "Ping": MethodRule(("*",)),
    "WatchIndex": MethodRule(("router",)),
    # One per routed request, as a Match is: the same role and rate.
    "PredictPlacement": MethodRule(("router",), rate="match"),
}

#: Converted watch changes kept for the next follower that reads them (each
#: change is converted once, however many followers read it).
WATCH_PB_CACHE = 8192
#: Bytes of entries one WatchIndexResponse carries before the next one starts
#: (snapshot entries and changes alike; an entry larger than this goes alone),
#: at most: half of limits.max_message_bytes when that is smaller.
WATCH_SNAPSHOT_BYTES = 1 << 20
#: Bytes an entry takes in its response besides its own: its tag and length.
WATCH_ENTRY_FRAMING = 6


def _keepalive(interval_ms: int, position: int) -> pb.WatchKeepalive | None:
    """The keepalive of a WatchIndex response at ``position`` (None: the
    follower asked for none, ``interval_ms`` 0)."""
    if not interval_ms:
        return None
    return pb.WatchKeepalive(interval_ms=interval_ms, position=position, sent_at=time.time())


def watch_part_bytes(response_bytes: int) -> int:
    """Bytes of the stores of one part of an instance's snapshot (for a follower
    that takes instances in parts, WatchIndexRequest.instance_parts) such that
    a part fits in a response of ``response_bytes``: a sixteenth of it, at most
    16 KiB, is left for the instance's registration and the framing (at 1 MiB,
    parts of some 57,000 blocks)."""
    return response_bytes - min(16 << 10, response_bytes // 16)


#: Models one WatchIndex call may name at most.
WATCH_MAX_MODELS = 1024
#: The shortest keepalive interval a follower gets (WatchIndexRequest.keepalive_ms
#: below it is raised to it): at most ten keepalives a second per follower.
WATCH_KEEPALIVE_MIN_MS = 100


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
            request_deserializer=(
                _decode_match_stream_request
                if method.name == "MatchStream"
                else getattr(pb, method.input_type.name).FromString
            ),
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

    def __init__(
        self,
        logic: IndexerLogic,
        metrics: Metrics,
        guard: Guard | None = None,
        *,
        match_stream_window: int = MATCH_STREAM_WINDOW,
        match_stream_inline: bool | None = None,
    ) -> None:
        if match_stream_window < 1:
            raise ValueError("match_stream_window must be at least 1")
        self.logic = logic
        self.guard = guard if guard is not None else Guard("indexer")
        self.metrics = metrics
        #: In-flight cap, metrics and spans of the observed methods.
        self.calls = IndexerCalls(metrics, logic.config.limits.max_concurrent_rpcs)
        self._match_encoder = convert.MatchResponseEncoder()
        #: Matches in flight per MatchStream at most (:data:`MATCH_STREAM_WINDOW`).
        self.match_stream_window = match_stream_window
        #: Whether MatchStream runs a message's Matches one after the other in
        #: the task reading the stream (no task per Match), which costs no
        #: concurrency when the backend answers without awaiting I/O; else one
        #: task per Match. None: decided by the backend (:func:`_answers_without_io`).
        self.match_stream_inline = (
            _answers_without_io(logic.index) if match_stream_inline is None else match_stream_inline
        )
        #: The backend WatchIndex follows (IndexerServer sets it for a memory
        #: backend with watch.enabled); None: WatchIndex is refused.
        self.watch_index: MemoryIndex | None = None
        #: A replica over standalone Redis: the copy of the index it serves
        #: WatchIndex from (indexer/redis/watchfeed.py); None otherwise.
        self.watch_feed: RedisWatchFeed | None = None
        #: Followers told to resync since the start.
        self.watch_resyncs = 0
        self._watch_pb: dict[int, tuple[pb.WatchChange, int]] = {}
        #: Bytes of entries one WatchIndexResponse carries (:data:`WATCH_SNAPSHOT_BYTES`).
        self.watch_response_bytes = min(
            WATCH_SNAPSHOT_BYTES, logic.config.limits.max_message_bytes // 2
        )
        #: Bytes of the stores of one part of a snapshot's instance (:func:`watch_part_bytes`).
        self.watch_part_bytes = watch_part_bytes(self.watch_response_bytes)
        self._stream_seconds = metrics.rpc_seconds.labels(MATCH_STREAM_MATCH)
        self._stream_ok = metrics.rpcs.labels(MATCH_STREAM_MATCH, "OK")
        self._predict_seconds = metrics.rpc_seconds.labels(MATCH_STREAM_PREDICT)
        self._predict_ok = metrics.rpcs.labels(MATCH_STREAM_PREDICT, "OK")

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
    async def MatchStream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[pb.MatchStreamRequest],
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[bytes]:
        """Many Matches over one stream, many to a message; replies (serialized)
        coalesced, in any order.

        A reader task takes messages and runs their Matches, at most
        :attr:`match_stream_window` of them unanswered whatever the messages
        they came in (the reader waits for a slot, part way through a message
        if need be: backpressure). With :attr:`match_stream_inline` it runs
        them itself one after the other, else it starts one task per Match.
        Each Match runs :meth:`_stream_match`, the unary path
        (:meth:`IndexerLogic.match` and the same encoder), and any error
        becomes that Match's error reply. This generator writes the replies:
        each time it wakes, every reply ready (up to
        :data:`MATCH_STREAM_MAX_REPLIES` and
        :data:`MATCH_STREAM_MAX_REPLY_BYTES`) goes into one response, so the
        replies of one message may span several responses and one response may
        answer several messages. Client half-close: the in-flight replies are
        written, then the stream ends OK. Cancellation (or the client going
        away) cancels the reader and every Match in flight. Undecodable request
        bytes cannot be answered by request id: nothing more is read, the
        replies in flight are written, and the stream ends INVALID_ARGUMENT
        naming "request", as any stream does.
        """
        window = self.match_stream_window
        inline = self.match_stream_inline
        pacer = call_pacer()
        run = self._traced_stream_match if self.calls.tracing else self._stream_match
        ready: list[bytes] = []  # replies.entries not yet written
        tasks: set[asyncio.Task[None]] = set()
        failure: list[BaseException] = []
        client = current_client()
        loop = asyncio.get_running_loop()
        # Matches started and not yet written; the future the writer waits on
        # for a reply (or the end), and the one the reader waits on for a slot.
        in_flight = 0
        ended = False
        writer_wait: asyncio.Future[None] | None = None
        reader_wait: asyncio.Future[None] | None = None

        def put(reply: bytes) -> None:
            ready.append(reply)
            if writer_wait is not None and not writer_wait.done():
                writer_wait.set_result(None)

        async def answer(item: pb.MatchStreamItem) -> None:
            put(await run(item, client))

        async def read() -> None:
            nonlocal in_flight, ended, reader_wait
            try:
                async for request in request_iterator:
                    if isinstance(request, _Undecodable):
                        failure.append(self._undecodable(request.error))
                        break
                    items = request.matches
                    i, n = 0, len(items)
                    while i < n:
                        free = window - in_flight
                        if free <= 0:
                            reader_wait = loop.create_future()
                            await reader_wait
                            continue
                        chunk = items[i : i + free]
                        i += len(chunk)
                        in_flight += len(chunk)
                        if inline:
                            for item in chunk:
                                # Matches that do no I/O run one after the
                                # other: between two, the loop gets its turn
                                # when the calls' budget is spent
                                # (indexer.pacing.call_pacer), else a message
                                # of 64 long Matches held health checks, other
                                # calls and ingest for their whole run.
                                await pacer.pace()
                                put(await run(item, client))
                        else:
                            for item in chunk:
                                task = loop.create_task(answer(item))
                                tasks.add(task)
                                task.add_done_callback(tasks.discard)
                while tasks:
                    await asyncio.wait(tuple(tasks))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # a bug: end the stream once the replies are out
                failure.append(e)
            ended = True
            if writer_wait is not None and not writer_wait.done():
                writer_wait.set_result(None)

        reader = loop.create_task(read())
        try:
            while True:
                if not ready:
                    if ended:
                        break
                    writer_wait = loop.create_future()
                    await writer_wait
                    continue
                before = len(ready)
                batch = take(ready, MATCH_STREAM_MAX_REPLIES, MATCH_STREAM_MAX_REPLY_BYTES)
                count = before - len(ready)
                yield batch
                in_flight -= count
                if reader_wait is not None and not reader_wait.done():
                    reader_wait.set_result(None)
            if failure:
                raise failure[0]
        finally:
            reader.cancel()
            for task in list(tasks):
                task.cancel()

    async def _traced_stream_match(self, item: pb.MatchStreamItem, client: Client | None) -> bytes:
        """:meth:`_stream_match` under a span of :data:`MATCH_STREAM_MATCH` (or
        :data:`MATCH_STREAM_PREDICT`), inside the stream's."""
        name = f"{SERVICE_NAME}/"
        name += MATCH_STREAM_PREDICT if item.HasField("predict") else MATCH_STREAM_MATCH
        with trace.get_tracer(TRACER_NAME).start_as_current_span(
            name, kind=trace.SpanKind.SERVER, attributes=rpc_server_attributes(name)
        ) as span:
            return await self._stream_match(item, client, span)

    async def _stream_match(
        self, item: pb.MatchStreamItem, client: Client | None, span: Any = None
    ) -> bytes:
        """One Match of a stream (or one prediction: an item with ``predict``):
        its reply entry, an error reply for any error.

        The per-Match share of the call scope: the caller's ``match`` rate (a
        prediction takes one too, as unary PredictPlacement does),
        ``max_concurrent_rpcs`` (this item counts as one call while it runs),
        latency and status counts under :data:`MATCH_STREAM_MATCH` (or
        :data:`MATCH_STREAM_PREDICT`), and the status on ``span``
        (:meth:`_traced_stream_match`).
        """
        rid = item.request_id
        predict = item.HasField("predict")
        calls = self.calls
        start = time.perf_counter()
        try:
            if client is not None:
                self.guard.take(client, "match", "MatchStream")
            calls.admit(field="limits.max_concurrent_rpcs")
            try:
                if predict:
                    n, ttl_ms = await self.logic.predict(convert.prediction_from_pb(item.predict))
                else:
                    result = await self.logic.match(convert.match_query_from_pb(item.match))
            finally:
                calls.in_flight -= 1
            if predict:
                reply = predict_stream_reply(rid, n, ttl_ms)
            else:
                reply = match_stream_reply(rid, self._match_encoder.encode(result))
        except KvmeshError as e:
            reply = self._stream_error(rid, e, span, predict)
        except Exception as e:
            what = "prediction" if predict else "Match"
            log.exception("internal error in a %s of a stream (request id %d)", what, rid)
            reply = self._stream_error(
                rid, KvmeshError(f"internal error: {type(e).__name__}"), span, predict
            )
        else:
            (self._predict_ok if predict else self._stream_ok).inc()
            if span is not None:
                end_rpc_span(span, "OK", server=True)
        (self._predict_seconds if predict else self._stream_seconds).observe(
            time.perf_counter() - start
        )
        return reply

    def _undecodable(self, err: Exception) -> InvalidArgument:
        """The error of an undecodable MatchStream frame, counted as the call scope counts one."""
        guard = self.guard
        guard.decode_errors["MatchStream"] = guard.decode_errors.get("MatchStream", 0) + 1
        self.metrics.refusals.labels("MatchStream", "INVALID_ARGUMENT").inc()
        return InvalidArgument(
            f"cannot decode the request as {pb.MatchStreamRequest.DESCRIPTOR.full_name}: "
            f"{type(err).__name__}: {err}",
            field="request",
        )

    def _stream_error(self, rid: int, err: KvmeshError, span: Any, predict: bool = False) -> bytes:
        """Count ``err`` as unary Match's (or PredictPlacement's) call scope
        would, and make its reply."""
        if isinstance(err, PermissionDenied | Unauthenticated):
            self.guard.refused("MatchStream", err)
        code = status_code(err.code).name
        self.metrics.rpcs.labels(
            MATCH_STREAM_PREDICT if predict else MATCH_STREAM_MATCH, code
        ).inc()
        if span is not None:
            end_rpc_span(span, code, server=True)
        return match_stream_error(rid, err)

    @observed
    async def PredictPlacement(
        self, request: pb.PredictPlacementRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PredictPlacementResponse:
        """Record a router's route-time prediction (indexer/index.py, "Predictions")."""
        n, ttl_ms = await self.logic.predict(convert.prediction_from_pb(request))
        return pb.PredictPlacementResponse(predicted_blocks=n, ttl_ms=ttl_ms)

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

    @observed
    async def WatchIndex(
        self, request: pb.WatchIndexRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[pb.WatchIndexResponse]:
        """A snapshot of the models asked for, then every change, batched per read
        (indexer/watch.py says what a follower is owed)."""
        index = self.watch_index
        if index is None and self.watch_feed is not None:
            # A replica over Redis serves its copy of the index (made on demand).
            feed = self.watch_feed
            index = feed.demand()
            if index is None:
                why = f" (the last attempt failed: {feed.last_error})" if feed.last_error else ""
                raise Unavailable(
                    f"this replica is copying the index from Redis for its followers{why}; retry"
                )
        if index is None or index.watch is None:
            raise FailedPrecondition(
                "WatchIndex needs watch.enabled (watch.enabled: false on this replica)",
                field="watch.enabled",
            )
        models = list(request.models)
        if len(models) > WATCH_MAX_MODELS:
            raise InvalidArgument(
                f"{len(models)} models, more than {WATCH_MAX_MODELS}", field="models"
            )
        for i, m in enumerate(models):
            _check_name(m, f"models[{i}]")
        hub = index.watch
        # Route-time predictions: a memory replica's own index holds them, and
        # the copy a replica over Redis keeps has them from the change stream.
        predictions = request.predictions
        watcher = hub.subscribe(
            [Namespace(m) for m in models], request.max_buffer, predictions=predictions
        )
        wanted = frozenset(models)
        in_parts = request.instance_parts
        bound = self.watch_response_bytes
        keepalive_ms = (
            max(request.keepalive_ms, WATCH_KEEPALIVE_MIN_MS) if request.keepalive_ms else 0
        )
        idle_s = keepalive_ms / 1000 if keepalive_ms else None
        try:
            while True:
                # Snapshot entries go several to a response (up to watch_response_bytes),
                # the last ones with WatchSynced: a follower that hangs up after the
                # snapshot finds no send of ours in flight. An instance goes in
                # parts of watch_part_bytes when the follower takes them
                # (a whole one past the message limit could never be sent).
                sent = 0
                batch: list[pb.WatchChange] = []
                size = 0
                async for pos, at, state, content in index.watch_snapshot(wanted):
                    # In the step that read the instance: its predictions as of then.
                    predicted = (
                        [
                            pb.WatchPredicted(
                                instance=convert.instance_to_pb(state.spec.instance),
                                lora_name=lora,
                                block_keys=keys,
                                expires_at=expiry,
                                pending_until=until,
                            )
                            for lora, keys, expiry, until in index.watch_predicted(
                                state.spec.instance
                            )
                        ]
                        if predictions
                        else ()
                    )
                    info = convert.state_to_pb(state)
                    parts = (
                        snapshot_parts(content, self.watch_part_bytes) if in_parts else [content]
                    )
                    last = len(parts) - 1
                    for i, part in enumerate(parts):
                        snap = pb.WatchedInstance(
                            info=info,
                            content=wire.batch_to_pb(part),
                            part=i,
                            more=i < last,
                            predicted=predicted if i == last else (),
                        )
                        entry = pb.WatchChange(position=pos, applied_at=at, snapshot=snap)
                        n = entry.ByteSize() + WATCH_ENTRY_FRAMING
                        if batch and size + n > bound:
                            yield pb.WatchIndexResponse(changes=batch)
                            batch, size = [], 0
                        batch.append(entry)
                        size += n
                    sent += 1
                batch.append(
                    pb.WatchChange(
                        position=hub.position,
                        applied_at=time.time(),
                        synced=pb.WatchSynced(instances=sent, predictions=predictions),
                    )
                )
                yield pb.WatchIndexResponse(
                    changes=batch, keepalive=_keepalive(keepalive_ms, hub.position)
                )
                while True:
                    got = await watcher.next(idle_s)
                    if got is None:
                        return  # the replica stops: the follower goes elsewhere
                    if not got:
                        # Nothing for keepalive_ms and the buffer empty: the
                        # follower holds every change; tell it the stream is up.
                        yield pb.WatchIndexResponse(
                            keepalive=_keepalive(keepalive_ms, hub.position)
                        )
                        continue
                    if isinstance(got, Resync):
                        self.watch_resyncs += 1
                        yield pb.WatchIndexResponse(
                            changes=[
                                pb.WatchChange(
                                    position=got.position,
                                    applied_at=time.time(),
                                    resync=pb.WatchResync(),
                                )
                            ]
                        )
                        watcher.restart(hub.position)
                        break
                    # Several changes to a response, up to watch_response_bytes: a
                    # follower far behind is sent what it missed in messages it
                    # (and grpc's limit) takes, not in one.
                    batch, size = [], 0
                    for c in got:
                        entry, n = self._watch_change(c)
                        if batch and size + n > bound:
                            yield pb.WatchIndexResponse(changes=batch)
                            batch, size = [], 0
                        batch.append(entry)
                        size += n
                    yield pb.WatchIndexResponse(changes=batch)
        finally:
            hub.unsubscribe(watcher)

    def _watch_change(self, c: Change) -> tuple[pb.WatchChange, int]:
        """``c`` as its message and the bytes it takes in a response, converted
        once for every follower."""
        cache = self._watch_pb
        got = cache.get(c.position)
        if got is not None:
            return got
        inst = convert.instance_to_pb(c.instance)
        if c.kind == "batch":
            batch, at = c.payload
            out = pb.WatchChange(position=c.position, applied_at=at, batch=wire.batch_to_pb(batch))
        elif c.kind == "registered":
            state, reset, at = c.payload
            out = pb.WatchChange(
                position=c.position,
                applied_at=at,
                registered=pb.WatchRegistered(info=convert.state_to_pb(state), reset=reset),
            )
        elif c.kind == "renewed":
            out = pb.WatchChange(position=c.position, applied_at=c.payload, renewed=inst)
        elif c.kind == "predicted":
            lora, keys, expiry, cap, at, until = c.payload
            out = pb.WatchChange(
                position=c.position,
                applied_at=at,
                predicted=pb.WatchPredicted(
                    instance=inst,
                    lora_name=lora,
                    block_keys=keys,
                    expires_at=expiry,
                    max_per_instance=cap,
                    pending_until=until,
                ),
            )
        else:
            reason, at = c.payload
            out = pb.WatchChange(
                position=c.position,
                applied_at=at,
                gone=pb.WatchGone(instance=inst, reason=reason),
            )
        if len(cache) >= WATCH_PB_CACHE:
            del cache[next(iter(cache))]  # the oldest first
        got = cache[c.position] = (out, out.ByteSize() + WATCH_ENTRY_FRAMING)
        return got

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
                ("grpc.server_handshake_timeout_ms", int(lim.handshake_timeout_s * 1000)),
                *(
                    [("grpc.max_allowed_incoming_connections", lim.max_connections)]
                    if lim.max_connections
                    else []
                ),
                *(
                    [("grpc.max_concurrent_streams", lim.max_streams_per_connection)]
                    if lim.max_streams_per_connection
                    else []
                ),
                # Connections age out so that clients spread over replicas added later.
                *connection_age_options(lim.max_connection_age_s, lim.max_connection_age_grace_s),
            ]
        )
        self.servicer = IndexerServicer(self.logic, self.metrics, self.guard)
        if config.watch.enabled and isinstance(index, MemoryIndex):
            index.watch = WatchHub(
                max_watchers=config.watch.max_followers, buffer=config.watch.buffer
            )
            self.servicer.watch_index = index
        elif config.watch.enabled and isinstance(index, RedisIndex):
            self.servicer.watch_feed = RedisWatchFeed(
                index,
                max_followers=config.watch.max_followers,
                buffer=config.watch.buffer,
                backlog=config.watch.redis_backlog,
                on_lag=self.metrics.redis_watch_lag.observe,
                max_pairs=config.watch.redis_max_pairs,
            )
            self.metrics.watch_counters(self.servicer.watch_feed.counters)
        if isinstance(index, RedisIndex):
            self.metrics.watch_counters(index.part_counters)
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
            "predictions_recorded": c.predictions_recorded,
            "predicted_matches": c.predicted_matches,
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
            watch = getattr(self.index, "watch", None)
            if watch is not None:
                watch.close()  # followers are not in-flight work: end them now
            if self.servicer.watch_feed is not None:
                await self.servicer.watch_feed.close()
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
