"""The bridge's gRPC link to the indexer Service: an :class:`~indexer.kvevents.sink.EventSink`.

:class:`IndexerLink` gives the engine-stream subscriber (indexer/kvevents/
subscriber.py) the calls it makes on an indexer replica's own logic, over the
network: ``ListInstances``, ``RegisterInstance`` and ``Heartbeat`` as unary
calls with a deadline, batches over one long-lived ``PublishEventsStream``.
Any replica may answer any call: the index, instances and applied sequences
are in Redis.

The stream. Every batch is written to the open stream and waited for until its
ack comes (``indexer.ack_timeout_s``); the server answers a stream's batches in
order, so acks are matched to batches first in, first out (several endpoints
of one bridge share the stream, each waiting for its own ack). When the stream
breaks (the replica died or was restarted, its connection aged out, an ack did
not come), every batch waiting on it fails with
:class:`~kvmesh.errors.Unavailable`; the subscriber backs off and publishes the
same batch again, which opens a new stream, on a live replica (the channel's
``round_robin`` policy skips a dead address). A batch the old replica had
applied before it died is answered DUPLICATE by the new one: batches carry the
engine's sequence numbers and the index keeps the last applied one per
instance, so resending is idempotent. A batch is never dropped for a broken
stream: only the subscriber's own buffer drops, and what it drops it fetches
again from the engine (indexer/kvevents/buffer.py).

Each batch carries the incarnation this link last registered for its instance
as a fence: a batch for an instance someone else registered since (another
writer, an operator) is refused FAILED_PRECONDITION instead of being applied
to a stream it does not belong to, and the subscriber registers the instance
again and rebuilds it from the engine's replay.

Engine batches go out as the engine sent them, with ``counts_copies``; events
the API cannot carry are left out and counted (indexer/bridge/wire.py).
``skip_invalid`` (the subscriber always asks it) is kept over the network: an
ack refusing the batch with INVALID_ARGUMENT naming ``events[i]`` makes the
link drop that event and send the batch again, as the indexer's own ZMQ path
leaves out an event that does not validate instead of losing the batch.

A stream open longer than ``indexer.stream_max_age_s`` is closed when idle and
reopened at the next batch: an indexer ends every connection after
``limits.max_connection_age_s``, and a stream that ends while a batch is in
flight costs a resend. A channel whose connection went silent (no ack within
the timeout) is replaced, as is one whose TLS files changed (``ChannelFactory``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import grpc
import grpc.aio

from indexer import convert
from indexer.bridge import wire
from indexer.bridge.config import IndexerLinkSettings
from indexer.model import ApplyResult, EventBatch, InstanceId, InstanceSpec, InstanceState
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.balancing import balancing_options, channel_target
from kvmesh.errors import ERROR_FIELD_METADATA, InvalidArgument, KvmeshError, Unavailable
from kvmesh.tasks import stop_tasks
from kvmesh.tls import ChannelFactory

log = logging.getLogger(__name__)

_T = TypeVar("_T")

#: Channel reconnect backoff (gRPC's default starts at 1 s and grows to 2
#: minutes: a bridge whose only replica was down a while would keep failing
#: long after it serves again).
_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)

#: How long a replaced channel's last calls get before it is closed: only the
#: stream that failed, and unary calls bounded by their deadline, use it.
_RETIRE_GRACE_S = 5.0


@dataclass(slots=True)
class LinkCounters:
    """Transport counters of a link since the bridge started (see docs/engines.md)."""

    #: Batches written to a stream, resends included.
    batches_sent: int = 0
    #: Writes of a batch that was sent before and not acknowledged.
    batches_resent: int = 0
    #: Batches acknowledged applied or duplicate (each once), and their events.
    batches_published: int = 0
    events_published: int = 0
    #: Events dropped from a batch the indexer refused naming them (then resent).
    events_invalid: int = 0
    #: Blocks of events the API cannot carry, by reason (wire.UNSENDABLE_REASONS).
    blocks_unsendable: dict[str, int] = field(default_factory=dict)
    #: From acks: blocks the indexer skipped (another block size...) and orphaned.
    blocks_skipped: int = 0
    blocks_orphaned: int = 0
    streams_opened: int = 0
    stream_failures: int = 0
    ack_timeouts: int = 0
    channels_opened: int = 0
    #: Unary calls that failed, by status code name.
    call_failures: dict[str, int] = field(default_factory=dict)


class _Stream:
    """One ``PublishEventsStream`` call and the batches waiting for their acks."""

    def __init__(self, call: Any) -> None:
        self.call = call
        self.opened = time.monotonic()
        self.pending: deque[asyncio.Future[pb.BatchAck]] = deque()
        self.write_lock = asyncio.Lock()
        self.broken = False
        self.reader: asyncio.Task[None] | None = None

    def fail(self, error: KvmeshError) -> None:
        """Mark the stream broken and fail every batch still waiting on it."""
        self.broken = True
        while self.pending:
            fut = self.pending.popleft()
            if not fut.done():
                fut.set_exception(error)
        self.call.cancel()


def _code_of(e: grpc.aio.AioRpcError) -> int:
    code: grpc.StatusCode = e.code()
    number: int = code.value[0]
    return number


def _error_of(e: grpc.aio.AioRpcError, what: str) -> KvmeshError:
    """A failed call as the error the stream logic acts on (wire.ERRORS_BY_CODE)."""
    field_name = ""
    with contextlib.suppress(Exception):
        for key, value in e.trailing_metadata() or ():
            if key == ERROR_FIELD_METADATA:
                field_name = value if isinstance(value, str) else value.decode()
    return wire.error_for(_code_of(e), f"{what}: {e.details() or e.code().name}", field_name)


class IndexerLink:
    """The indexer Service as seen by the bridge's subscribers (see the module doc)."""

    def __init__(
        self,
        settings: IndexerLinkSettings,
        *,
        on_state: Callable[[bool], None] | None = None,
    ) -> None:
        self.settings = settings
        self.counters = LinkCounters()
        #: Whether the last call or ack reached an indexer (None: none made yet).
        self.up: bool | None = None
        self._on_state = on_state
        options = [
            *balancing_options(settings.load_balancing),
            *_CHANNEL_OPTIONS,
            ("grpc.max_send_message_length", settings.max_message_bytes),
        ]
        self._factory = ChannelFactory(
            channel_target(settings.target), settings.tls, options=options, what="bridge"
        )
        self._channel = self._new_channel()
        self._stub = pb_grpc.IndexerServiceStub(self._channel)
        self._stream: _Stream | None = None
        self._opening = asyncio.Lock()
        self._failures = 0  # streams in a row that failed
        #: The incarnation last registered per instance: the fence of its batches.
        self._incarnations: dict[InstanceId, str] = {}
        #: Per instance, the sequence of a batch written and not acknowledged.
        self._unacked: dict[InstanceId, int] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self._warned: set[str] = set()
        self._closed = False

    # -- plumbing --------------------------------------------------------------------

    def _new_channel(self) -> grpc.aio.Channel:
        self.counters.channels_opened += 1
        return self._factory.channel()

    def _replace_channel(self) -> None:
        """A new channel (new connections) for the calls from now on; the old one closes."""
        old = self._channel
        self._channel = self._new_channel()
        self._stub = pb_grpc.IndexerServiceStub(self._channel)
        task = asyncio.get_running_loop().create_task(old.close(grace=_RETIRE_GRACE_S))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    def _set_up(self, up: bool) -> None:
        if up != self.up:
            if up:
                log.info("bridge: the indexer at %s answers", self.settings.target)
            elif self.up is not None:
                log.warning("bridge: the indexer at %s does not answer", self.settings.target)
            self.up = up
            if self._on_state is not None:
                self._on_state(up)

    def _warn_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message, *args)

    async def _unary(self, what: str, call: Callable[[], Awaitable[_T]]) -> _T:
        if self._factory.stale():
            self._replace_channel()
        try:
            result = await call()
        except grpc.aio.AioRpcError as e:
            err = _error_of(e, what)
            name = e.code().name
            self.counters.call_failures[name] = self.counters.call_failures.get(name, 0) + 1
            if isinstance(err, Unavailable):
                self._set_up(False)
            else:
                self._set_up(True)  # it answered, with a refusal
            raise err from None
        self._set_up(True)
        return result

    # -- EventSink -------------------------------------------------------------------

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        """Every registered instance of ``model`` (``ListInstances``)."""
        resp = await self._unary(
            "ListInstances",
            lambda: self._stub.ListInstances(
                pb.ListInstancesRequest(model=model),
                timeout=self.settings.call_timeout_s,
                wait_for_ready=False,
            ),
        )
        return [convert.state_from_pb(info) for info in resp.instances]

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        """``RegisterInstance``; remembers the incarnation as the fence of later batches."""
        resp = await self._unary(
            "RegisterInstance",
            lambda: self._stub.RegisterInstance(
                wire.spec_to_pb(spec),
                timeout=self.settings.call_timeout_s,
                wait_for_ready=False,
            ),
        )
        self._incarnations[spec.instance] = spec.incarnation
        return convert.state_from_pb(resp.info), resp.reset

    async def heartbeat(self, instance: InstanceId) -> object:
        """``Heartbeat`` (NotFound when the index no longer holds the instance)."""
        return await self._unary(
            "Heartbeat",
            lambda: self._stub.Heartbeat(
                pb.HeartbeatRequest(instance=wire.instance_to_pb(instance)),
                timeout=self.settings.call_timeout_s,
                wait_for_ready=False,
            ),
        )

    async def publish(self, batch: EventBatch, *, skip_invalid: bool = False) -> ApplyResult:
        """Send one batch over the stream and wait for its ack (see the module doc)."""
        events, left_out = wire.sendable(batch.events)
        for reason, n in left_out.items():
            unsendable = self.counters.blocks_unsendable
            unsendable[reason] = unsendable.get(reason, 0) + n
            self._warn_once(
                f"unsendable:{reason}:{batch.instance}",
                "%s: %d block(s) left out (%s): the indexer API cannot key them; counted "
                "in kvmesh_bridge_blocks_unsendable_total, warned once per instance",
                batch.instance,
                n,
                wire.UNSENDABLE_REASONS[reason],
            )
        msg = wire.batch_to_pb(batch)
        if events is not batch.events:
            del msg.events[:]
            msg.events.extend(wire.event_to_pb(ev) for ev in events)
        msg.incarnation = self._incarnations.get(batch.instance, "")
        size = msg.ByteSize()
        if size > self.settings.max_message_bytes:
            raise InvalidArgument(
                f"batch {batch.sequence} is {size} bytes, above indexer.max_message_bytes "
                f"({self.settings.max_message_bytes})",
                field="batch",
            )
        while True:
            ack = await self._send(msg)
            if ack.outcome != pb.BATCH_OUTCOME_REJECTED:
                break
            err = wire.error_for(ack.error.code, ack.error.message, ack.error.field)
            index = wire.event_index(err.field)
            if (
                skip_invalid
                and isinstance(err, InvalidArgument)
                and index is not None
                and index < len(msg.events)
            ):
                del msg.events[index]
                self.counters.events_invalid += 1
                self._warn_once(
                    f"invalid:{batch.instance}",
                    "%s: the indexer refused an event of batch %d (%s); sending the batch "
                    "without it (counted in kvmesh_bridge_events_invalid_total, warned once "
                    "per instance)",
                    batch.instance,
                    batch.sequence,
                    err,
                )
                continue
            raise err
        result = wire.result_from_ack(ack)
        c = self.counters
        c.batches_published += 1
        c.events_published += len(msg.events)
        c.blocks_orphaned += result.blocks_orphaned
        if result.blocks_skipped:
            c.blocks_skipped += result.blocks_skipped
            self._warn_once(
                f"skipped:{batch.instance}",
                "%s: the indexer skipped %d block(s) of batch %d (most often a block size "
                "other than its model_block_sizes entry for this model, which must be the "
                "engine's block size); counted in kvmesh_bridge_blocks_skipped_total, "
                "warned once per instance",
                batch.instance,
                result.blocks_skipped,
                batch.sequence,
            )
        return result

    # -- the stream ------------------------------------------------------------------

    async def _send(self, msg: pb.EventBatch) -> pb.BatchAck:
        """Write ``msg`` on the open stream and wait for its ack (Unavailable when the
        stream breaks first)."""
        stream = await self._open_stream()
        iid = InstanceId(msg.instance.worker_id, msg.instance.dp_rank)
        if self._unacked.get(iid) == msg.sequence:
            self.counters.batches_resent += 1
        fut: asyncio.Future[pb.BatchAck] = asyncio.get_running_loop().create_future()
        try:
            async with stream.write_lock:
                if stream.broken:
                    raise Unavailable("the stream to the indexer broke")
                stream.pending.append(fut)
                self._unacked[iid] = msg.sequence
                await stream.call.write(pb.PublishEventsStreamRequest(batch=msg))
        except grpc.aio.AioRpcError as e:
            fut.cancel()  # nobody waits for it: the error is raised here
            error = self._stream_error(e)
            self._broke(stream, error)
            raise error from None
        except asyncio.InvalidStateError:
            fut.cancel()
            error = Unavailable("the stream to the indexer ended")
            self._broke(stream, error)
            raise error from None
        self.counters.batches_sent += 1
        try:
            ack = await asyncio.wait_for(fut, self.settings.ack_timeout_s)
        except TimeoutError:
            self.counters.ack_timeouts += 1
            log.warning(
                "bridge: no ack for batch %d of %s within %.1fs; reconnecting",
                msg.sequence,
                iid,
                self.settings.ack_timeout_s,
            )
            self._broke(stream, Unavailable("no ack in time"))
            # A connection that went silent may still look open to gRPC: new connections.
            self._replace_channel()
            raise Unavailable(f"no ack for batch {msg.sequence} in time") from None
        if ack.sequence != msg.sequence or ack.instance != msg.instance:
            self._broke(stream, Unavailable("ack out of order"))
            raise Unavailable(
                f"ack for batch {ack.sequence} of {ack.instance.worker_id!r} while waiting "
                f"for batch {msg.sequence} of {msg.instance.worker_id!r}"
            )
        if self._unacked.get(iid) == msg.sequence:
            del self._unacked[iid]
        self._failures = 0
        self._set_up(True)
        return ack

    def _broke(self, stream: _Stream, error: KvmeshError) -> None:
        if stream.broken:
            return
        self.counters.stream_failures += 1
        self._failures += 1
        stream.fail(error)
        if self._stream is stream:
            self._stream = None
        self._set_up(False)

    async def _open_stream(self) -> _Stream:
        """The open stream, or a new one (after a backoff when the last ones failed)."""
        async with self._opening:
            s = self._stream
            if s is not None and not s.broken:
                max_age = self.settings.stream_max_age_s
                aged = max_age > 0 and time.monotonic() - s.opened > max_age
                if not s.pending and (aged or self._factory.stale()):
                    self._retire(s)
                    if not aged:
                        self._replace_channel()  # rotated TLS files: new connections
                else:
                    return s
            if self._closed:
                raise Unavailable("the bridge is stopping")
            if self._failures:
                base = self.settings.reconnect_backoff_s * (2 ** min(self._failures - 1, 16))
                delay = min(base, self.settings.reconnect_backoff_max_s)
                await asyncio.sleep(delay * random.uniform(0.5, 1.0))
            call = self._stub.PublishEventsStream(wait_for_ready=False)
            s = _Stream(call)
            s.reader = asyncio.get_running_loop().create_task(
                self._read(s), name="kvmesh-bridge-acks"
            )
            self._stream = s
            self.counters.streams_opened += 1
            return s

    def _retire(self, s: _Stream) -> None:
        """End an idle stream cleanly (its reader sees the server end it)."""
        s.broken = True
        if self._stream is s:
            self._stream = None
        task = asyncio.get_running_loop().create_task(self._half_close(s))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    @staticmethod
    async def _half_close(s: _Stream) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
            async with s.write_lock:
                await s.call.done_writing()
        if s.reader is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(s.reader, _RETIRE_GRACE_S)
        s.call.cancel()

    async def _read(self, s: _Stream) -> None:
        """Hand each ack to the batch waiting first; fail them all when the stream ends."""
        error: KvmeshError = Unavailable("the stream to the indexer ended")
        try:
            while True:
                resp = await s.call.read()
                if resp is grpc.aio.EOF:
                    break
                if not s.pending:
                    error = Unavailable("an ack for no batch")
                    break
                fut = s.pending.popleft()
                if not fut.done():  # its publisher may have given up (cancelled)
                    fut.set_result(resp.ack)
        except grpc.aio.AioRpcError as e:
            if not s.broken:
                error = self._stream_error(e)
        except asyncio.CancelledError:
            pass
        if not s.broken:
            if s.pending:
                log.warning("bridge: the stream to the indexer broke: %s", error)
            self._broke(s, error)

    def _stream_error(self, e: grpc.aio.AioRpcError) -> Unavailable:
        """A failed stream as Unavailable (the batch is sent again on a new stream).

        A refusal of the stream itself (no role engine: the unary calls refuse
        it too, with their own error) is logged once per code.
        """
        err = _error_of(e, "PublishEventsStream")
        if not isinstance(err, Unavailable):
            self._warn_once(
                f"stream:{e.code().name}", "bridge: the indexer refused the stream: %s", err
            )
        return err if isinstance(err, Unavailable) else Unavailable(str(err))

    async def close(self) -> None:
        """End the stream and close the channel."""
        self._closed = True
        s, self._stream = self._stream, None
        if s is not None:
            s.fail(Unavailable("the bridge is stopping"))
            await stop_tasks(s.reader, what="bridge stream reader")
        for task in list(self._retiring):
            task.cancel()
        await self._channel.close(grace=None)
