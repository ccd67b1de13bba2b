"""ZMQ subscribers to engine KV-event streams (vLLM and SGLang ``ZmqEventPublisher``).

One :class:`EndpointSubscriber` per configured engine endpoint
(``engine_events.endpoints``), run by :class:`EngineEventSubscribers` inside
the indexer process. Each decodes frames (indexer/kvevents/decode.py) and feeds
``IndexerLogic.publish`` (the path gRPC ``PublishEvents`` takes), with the
publisher's sequence number as the batch sequence.

Per endpoint, the subscriber keeps ``next_seq``, the sequence it expects next
(``None``: it knows nothing yet), and handles each live message ``seq``:

- ``seq == next_seq``: apply.
- ``seq > next_seq`` (a **gap**: ZMQ dropped batches, the backend was down
  long enough for the receive queue to overflow, or the subscriber joined
  late): ask the replay socket for everything from ``next_seq``
  (a DEALER sends ``[b"", start_seq]``; replies are ``[b"", seq, payload]``,
  or ``[b"", topic, seq, payload]`` from publishers that echo the topic,
  ending with seq -1 and an empty payload) and apply the missed batches in
  order. What replay cannot return is an **unrecoverable gap**, handled by
  ``engine_events.on_unrecoverable_gap``.
- First contact (``next_seq is None``) with ``seq > 0``: replay from 0 —
  the slow-joiner case, and how a restarted memory-backend replica rebuilds
  an instance from the engine's replay buffer. A replay that starts after
  the sequence asked for (the engine's buffer was trimmed) leaves the
  batches before its first one lost: an unrecoverable gap like any other.
- ``seq < next_seq``: a batch already applied through replay is skipped
  (it follows the live batch before it and has the bytes the replay returned
  for its sequence); otherwise the publisher **restarted** (its counter starts
  at 0 again), even right after a replay that covered the old stream. A
  restarted engine has an empty cache, so the instance is re-registered with
  a new incarnation, which resets it in the index (blocks, engine-hash map,
  sequence), and the new stream is applied from its start. The wire carries
  no publisher identity, so this is the only sign of a restart: a new stream
  that has already passed the old one's sequence when the subscriber sees
  it (the old stream was short, or the indexer was down meanwhile) looks
  like a gap and is replayed onto the old state.

A frame that is not a batch is counted and skipped, never fatal; its sequence
is lost like a dropped batch (replaying it would return the same bytes).

Unrecoverable gaps: policy ``reset`` drops what the instance holds and goes
on from the next batch. Policy ``stale`` leaves it to the index, which marks
an instance stale when a batch skips sequences; when the loss is at the start
of the stream (nothing applied yet, so the index holds no sequence to skip
from), the subscriber first applies an empty batch 0, after which the next
batch is a gap for the index too. A loss of batch 0 alone cannot be shown
that way: the instance then stays fresh with what follows (it is counted and
logged all the same).

The index losing the instance: when apply answers "not registered" (reaped
while the engine was away, removed by an operator, a Redis restarted empty)
or a heartbeat finds it gone, the subscriber registers it again, which
resets it, and **rebuilds** it: it replays the engine's buffer from its
start (counted in ``rebuilds``), so the index holds again what the engine
does. Without a replay endpoint the stream goes on, the batches before the
next one counted as an unrecoverable gap.

Sharing the event loop: an awaited receive that is ready at once does not
yield, and neither does the memory backend's apply, so a subscriber draining
a backlog would hold the loop (and every gRPC call and health probe) until
the backlog is gone. The subscribers of one event loop therefore share a
budget (:func:`indexer.pacing.loop_pacer`, with the memory backend's applies
of long batches) that makes them give way every
:data:`indexer.pacing.YIELD_EVERY_S` of their work, and queued messages are
received in a batch without a future each. A batch is decoded an event at a
time on that budget, and its apply is a piece of its own, whatever the
backend: a Redis replica that decoded and applied each batch in one piece
(1 to 5 ms at 512-token blocks) answered Matches during ingest at p99 82 to
102 ms, 38 to 40 in pieces, for 4 to 8 % of its ingest rate
(``kvmesh bench peer --block-size 512 --backend redis --peer none --pin``,
two runs each).

Liveness: the subscriber registers its instance when the engine's socket
connects and heartbeats while it stays connected (ZMQ socket monitor). When
the engine dies the heartbeats stop, the lease runs out, Match stops naming
the instance and the reaper frees its blocks. On start, an instance the
index already holds (redis backend, a replica restart) is adopted with its
incarnation and applied sequence, so the subscriber resumes from the next
batch instead of resetting it.

Where it runs: the subscriber feeds an :class:`indexer.kvevents.sink.EventSink`,
the indexer's own logic (``engine_events.endpoints`` of a replica) or, in
``kvmesh bridge`` beside the engine, a gRPC link to the indexer Service
(indexer/bridge/). :class:`SubscriberOptions` holds what differs: the
default lease, whether applies need the loop to take turns, the incarnation
prefix and whether an instance registered by someone else may be adopted,
and an optional bounded buffer between the socket and the stream logic
(indexer/kvevents/buffer.py). With the buffer, a reader task only moves
messages from the socket into it; when it is full a message is dropped and
counted, and the gap it leaves is settled like any other (replay, else
``on_unrecoverable_gap``): by the next message that shows it, or, once the
buffer runs empty with drops pending, at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, fields
from typing import TypeVar

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from indexer.config import EngineEventSettings, ZmqEndpointSettings
from indexer.instrumented import backend_of
from indexer.kvevents.buffer import BufferLimits, FrameBuffer
from indexer.kvevents.decode import MalformedFrame, decode_batch_paced, decode_seq
from indexer.kvevents.sink import EventSink
from indexer.logic import IndexerLogic
from indexer.memory import MemoryIndex
from indexer.model import BatchOutcome, EventBatch, InstanceId, InstanceSpec
from indexer.pacing import Pacer, loop_pacer, loop_turns
from kvmesh.errors import FailedPrecondition, InvalidArgument, KvmeshError, NotFound, Unavailable
from kvmesh.tasks import stop_tasks

log = logging.getLogger(__name__)

#: Replay stream end marker: seq -1 as 8 signed big-endian bytes.
REPLAY_END_SEQ = -1

#: ZMQ sockets one endpoint's subscriber may hold at once: its SUB, the two
#: PAIR sockets of the SUB's monitor, and a DEALER while it asks for a replay.
#: A ZMQ context opens 1,023 sockets unless told otherwise: about 340
#: endpoints (64 nodes of 8 data-parallel ranks are 512), and the next
#: subscriber failed with "Too many open files", its engine never indexed.
SOCKETS_PER_ENDPOINT = 4
#: File descriptors of one endpoint: a signalling descriptor per socket, and
#: the TCP connections of its SUB and DEALER, with room for a reconnect.
FDS_PER_ENDPOINT = 8
#: Descriptors the rest of the process needs (gRPC's listeners and clients,
#: Redis connections, logs), besides the subscribers'.
FDS_BESIDES = 256

#: Backoff while the backend is unavailable: start, cap (seconds). Short
#: enough that a restarted Redis is used again within a second; batches wait
#: in the ZMQ receive queue meanwhile, and overflow is replayed.
_BACKOFF_START_S = 0.05
_BACKOFF_CAP_S = 1.0

#: Queued live messages received in one go, without an awaited future each
#: (the asyncio socket's per-message cost: about 8 % of the ingest time, gone).
#: The budget is checked before each of them, so a drain never outlasts it.
_RECV_BATCH = 64

_CONNECTED_EVENTS = {zmq.EVENT_CONNECTED, zmq.EVENT_ACCEPTED}

_T = TypeVar("_T")


def curve_client_keys(secret_key_file: str) -> tuple[bytes, bytes]:
    """(public, secret) Z85 keys from a file holding the subscriber's Z85 secret key."""
    try:
        with open(secret_key_file, "rb") as f:
            secret = f.read().strip()
    except OSError as e:
        raise InvalidArgument(
            f"cannot read {secret_key_file!r}: {e.strerror or e}", field="curve_secret_key_file"
        ) from e
    try:
        public = zmq.curve_public(secret)
    except (zmq.ZMQError, ValueError) as e:
        raise InvalidArgument(
            f"{secret_key_file!r} does not hold a 40-character Z85 CURVE secret key",
            field="curve_secret_key_file",
        ) from e
    return public, secret


@dataclass(slots=True)
class SubscriberCounters:
    """Counters of one endpoint subscriber since this replica started."""

    messages: int = 0
    batches_applied: int = 0
    batches_duplicate: int = 0
    batches_rejected: int = 0
    frames_malformed: int = 0
    events_malformed: int = 0
    gaps: int = 0
    replays: int = 0
    replay_failures: int = 0
    batches_replayed: int = 0
    unrecoverable_gaps: int = 0
    publisher_restarts: int = 0
    registrations: int = 0
    #: Instances the index lost (reset on registering again) rebuilt from replay.
    rebuilds: int = 0
    dp_rank_mismatches: int = 0
    backend_retries: int = 0

    def add(self, other: SubscriberCounters) -> None:
        """Add ``other``'s counts into this one."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


def _digest(payload: bytes) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def _new_incarnation(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


#: Longest pause between restarts of a subscriber that keeps failing. A
#: refusal that does not fix itself (a policy that does not give this identity
#: the instance) then costs one log line every half minute, not every second.
_RESTART_CAP_S = 30.0


@dataclass(frozen=True, slots=True)
class SubscriberOptions:
    """How an endpoint subscriber runs, besides its endpoint's settings (see the module doc)."""

    #: Lease of an endpoint whose ``lease_ttl_s`` is 0.
    default_lease_ttl_s: float = 30.0
    #: The sink applies without awaiting I/O (the memory backend): the
    #: subscribers of a loop take turns (:func:`indexer.pacing.loop_turns`).
    applies_inline: bool = False
    #: Incarnations this subscriber registers are ``<prefix>-<random>``.
    incarnation_prefix: str = "zmq"
    #: On start, adopt the instance whatever incarnation the index holds for it;
    #: False: only one of this prefix (another is someone else's stream: reset it).
    adopt_foreign: bool = True
    #: Read the socket into a bounded buffer (None: straight from ZMQ's queue).
    buffer: BufferLimits | None = None


def logic_options(logic: IndexerLogic) -> SubscriberOptions:
    """The options of the subscribers an indexer replica runs on its own logic."""
    return SubscriberOptions(
        default_lease_ttl_s=logic.config.default_lease_ttl_s,
        applies_inline=isinstance(backend_of(logic.index), MemoryIndex),
    )


class EndpointSubscriber:
    """The SUB socket of one engine endpoint, feeding one instance."""

    def __init__(
        self,
        logic: EventSink,
        endpoint: ZmqEndpointSettings,
        settings: EngineEventSettings,
        context: zmq.asyncio.Context,
        pacer: Pacer | None = None,
        options: SubscriberOptions | None = None,
    ) -> None:
        if options is None:
            options = (
                logic_options(logic) if isinstance(logic, IndexerLogic) else SubscriberOptions()
            )
        self.logic = logic
        self.options = options
        self._pacer = pacer
        self.endpoint = endpoint
        self.settings = settings
        self.instance = InstanceId(endpoint.worker_id, endpoint.dp_rank)
        self.counters = SubscriberCounters()
        self.lease_ttl_s = endpoint.lease_ttl_s or options.default_lease_ttl_s
        #: Messages between the socket reader and the stream logic (None: unbuffered).
        self.buffer = FrameBuffer(options.buffer) if options.buffer is not None else None
        #: The sequence expected next; None before the first batch of a stream.
        self.next_seq: int | None = None
        self.incarnation = ""
        self.registered = False
        self.connected_peers = 0
        self._ctx = context
        self._lock = asyncio.Lock()  # one state change at a time (live, heartbeat, connect)
        # Digests of the batches the last replay applied, by sequence: a live batch
        # below next_seq with the same bytes was applied through replay; one with
        # other bytes, or one that does not follow the live batch before it, is
        # a restarted publisher's new stream.
        self._replayed: dict[int, bytes] = {}
        self._last_live: int | None = None
        self._engine_hash_keys = endpoint.keys == "engine_hashes"
        self._cpu_bound = options.applies_inline
        self._warned_rank = False
        self._stopping = False
        # Set when the index reset the instance this subscriber fed: rebuild it.
        self._needs_rebuild = False

    @property
    def idle(self) -> bool:
        """Whether nothing is being handled now (a batch, a rebuild, a heartbeat's repair)."""
        return not self._lock.locked()

    @property
    def pacer(self) -> Pacer:
        """The budget this subscriber's work draws on (the loop's unless given)."""
        return self._pacer or loop_pacer()

    def _secure(self, sock: zmq.asyncio.Socket) -> None:
        """CURVE client keys on ``sock`` when the endpoint names the engine's public key.

        The engine's socket is the CURVE server (it binds); a publisher
        without that key pair, or a man in the middle, never completes the
        handshake, and the traffic is encrypted.
        """
        ep = self.endpoint
        if not ep.curve_server_key:
            return
        public, secret = curve_client_keys(ep.curve_secret_key_file)
        sock.curve_serverkey = ep.curve_server_key.encode("ascii")
        sock.curve_publickey = public
        sock.curve_secretkey = secret

    # -- lifecycle -----------------------------------------------------------

    async def run(self) -> None:
        """Subscribe and process messages until cancelled."""
        ep = self.endpoint
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, self.settings.receive_hwm)
        sub.setsockopt(zmq.SUBSCRIBE, ep.topic.encode("utf-8"))
        self._secure(sub)
        monitor = sub.get_monitor_socket()
        tasks: list[asyncio.Task[None]] = []
        try:
            if ep.bind:
                sub.bind(ep.endpoint)
            else:
                sub.connect(ep.endpoint)
            await self._adopt()
            tasks = [
                asyncio.create_task(
                    self._watch(monitor), name=f"kvmesh-zmq-monitor-{ep.worker_id}"
                ),
                asyncio.create_task(self._heartbeat_loop(), name=f"kvmesh-zmq-hb-{ep.worker_id}"),
            ]
            # The same socket without asyncio: non-blocking reads, no future each.
            queued: zmq.Socket[bytes] = zmq.Socket.shadow(sub.underlying)
            if self.buffer is not None:
                tasks.append(
                    asyncio.create_task(
                        self._read_into(sub, queued, self.buffer),
                        name=f"kvmesh-zmq-reader-{ep.worker_id}",
                    )
                )
                await self._drain(self.buffer)
            while True:
                frames = await sub.recv_multipart()
                await self.pacer.pace()
                async with self._lock:
                    await self._on_live(frames)
                    for _ in range(_RECV_BATCH - 1):
                        await self.pacer.pace()
                        try:
                            frames = queued.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        await self._on_live(frames)
        finally:
            self._stopping = True
            await stop_tasks(*tasks, what="zmq subscriber")
            with contextlib.suppress(zmq.ZMQError):
                sub.disable_monitor()
            monitor.close(linger=0)
            sub.close(linger=0)

    @staticmethod
    async def _read_into(
        sub: zmq.asyncio.Socket, queued: zmq.Socket[bytes], buffer: FrameBuffer
    ) -> None:
        """Move every message from the socket into ``buffer`` (which drops when full)."""
        while True:
            buffer.put(await sub.recv_multipart())
            for _ in range(_RECV_BATCH - 1):
                try:
                    buffer.put(queued.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break

    async def _drain(self, buffer: FrameBuffer) -> None:
        """The stream logic over buffered messages; settles drops once the buffer is empty."""
        while True:
            if not buffer:
                dropped, through = buffer.take_drops()
                if dropped:
                    async with self._lock:
                        await self._settle_drops(through)
                    continue
            frames = await buffer.get()
            await self.pacer.pace()
            async with self._lock:
                await self._on_live(frames)
                for _ in range(_RECV_BATCH - 1):
                    await self.pacer.pace()
                    more = buffer.get_nowait()
                    if more is None:
                        break
                    await self._on_live(more)

    async def _settle_drops(self, through: int | None) -> None:
        """The buffer dropped batches up to ``through`` and nothing after them came:
        fill the gap from replay now, else handle it as an unrecoverable one, so the
        index does not wait for the engine's next batch to learn of the loss."""
        await self._ensure_registered()
        await self._rebuild()
        if through is None or (self.next_seq is not None and through < self.next_seq):
            return  # a later message showed the gap and it was settled then
        if self.next_seq is not None:
            self.counters.gaps += 1
        await self._catch_up(self.next_seq or 0)
        await self._rebuild()
        expected = 0 if self.next_seq is None else self.next_seq
        if through >= expected:
            await self._lost(expected, through + 1)
            self.next_seq = through + 1

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        """Track whether the engine is connected, from the socket monitor."""
        while True:
            event = parse_monitor_message(await monitor.recv_multipart())
            kind = event["event"]
            if kind in _CONNECTED_EVENTS:
                self.connected_peers += 1
                async with self._lock:
                    await self._ensure_registered()
                    await self._rebuild()
            elif kind == zmq.EVENT_DISCONNECTED:
                self.connected_peers = max(0, self.connected_peers - 1)

    async def _heartbeat_loop(self) -> None:
        # A third of the lease: two heartbeats may be lost before it runs out.
        interval = self.lease_ttl_s / 3
        while True:
            await asyncio.sleep(interval)
            if self.connected_peers <= 0:
                continue  # the engine is gone: let the lease run out
            async with self._lock:
                await self._heartbeat()

    async def _heartbeat(self) -> None:
        if not self.registered:
            await self._ensure_registered()
            await self._rebuild()
            return
        try:
            await self.logic.heartbeat(self.instance)
        except NotFound:
            # Reaped (the lease ran out while the engine was away), removed by an
            # operator, or the index lost it: its blocks are gone, rebuild them.
            log.info("%s: instance was dropped; registering it again", self.instance)
            await self._register(new=True)
            self._index_lost()
            await self._rebuild()
        except Unavailable as e:
            log.warning("%s: heartbeat: backend unavailable: %s", self.instance, e)

    # -- registration --------------------------------------------------------

    async def _adopt(self) -> None:
        """Take over an instance the index already holds (resume after a replica restart)."""
        while True:
            try:
                states = await self.logic.list_instances(self.endpoint.model)
                break
            except Unavailable:
                await asyncio.sleep(_BACKOFF_CAP_S)
        for st in states:
            if st.spec.instance == self.instance:
                if not self.options.adopt_foreign and not st.spec.incarnation.startswith(
                    f"{self.options.incarnation_prefix}-"
                ):
                    log.info(
                        "%s: the index holds it with incarnation %r, not one of this "
                        "subscriber's (%s-...): registering it anew",
                        self.instance,
                        st.spec.incarnation,
                        self.options.incarnation_prefix,
                    )
                    return
                self.incarnation = st.spec.incarnation
                if st.applied_sequence is not None:
                    self.next_seq = st.applied_sequence + 1
                log.info(
                    "%s: resuming incarnation %s after sequence %s",
                    self.instance,
                    self.incarnation,
                    st.applied_sequence,
                )
                return

    async def _register(self, *, new: bool) -> bool:
        """Register (``new``: with a fresh incarnation, which resets the instance).

        Returns whether the index reset the instance (or did not hold it).
        """
        if new or not self.incarnation:
            self.incarnation = _new_incarnation(self.options.incarnation_prefix)
        ep = self.endpoint
        spec = InstanceSpec(
            instance=self.instance,
            model=ep.model,
            address=ep.address,
            lease_ttl_s=self.lease_ttl_s,
            incarnation=self.incarnation,
        )
        _, reset = await self._retrying(lambda: self.logic.register(spec))
        self.registered = True
        self.counters.registrations += 1
        if new:
            self._replayed = {}
        return reset

    async def _ensure_registered(self) -> None:
        """Register unless done; a reset of an instance this subscriber fed is rebuilt."""
        if self.registered:
            return
        if await self._register(new=False):
            self._index_lost()

    def _index_lost(self) -> None:
        """The index reset the instance this subscriber fed: rebuild it (or count the loss)."""
        if self.next_seq is None:
            return  # nothing applied yet: the stream's start is still to come
        if self.endpoint.replay_endpoint:
            self._needs_rebuild = True
        else:
            self.next_seq = None  # the next batch finds the stream's start lost

    async def _rebuild(self) -> None:
        """Replay the engine's buffer from its start onto the reset instance, when due."""
        while self._needs_rebuild:
            self._needs_rebuild = False
            self.counters.rebuilds += 1
            log.warning(
                "%s: the index lost the instance; rebuilding it from the engine's replay buffer",
                self.instance,
            )
            self.next_seq = None
            self._replayed = {}
            await self._catch_up(0)

    async def _retrying(self, call: Callable[[], Awaitable[_T]]) -> _T:
        """Await ``call()`` until the backend serves (or the subscriber stops)."""
        delay = _BACKOFF_START_S
        while True:
            try:
                return await call()
            except Unavailable:
                if self._stopping:
                    raise
                self.counters.backend_retries += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, _BACKOFF_CAP_S)

    # -- the stream ----------------------------------------------------------

    async def _on_live(self, frames: list[bytes]) -> None:
        self.counters.messages += 1
        if len(frames) != 3:
            self.counters.frames_malformed += 1
            log.warning("%s: message of %d frames, not 3; skipped", self.instance, len(frames))
            return
        try:
            seq = decode_seq(frames[1])
        except MalformedFrame as e:
            self.counters.frames_malformed += 1
            log.warning("%s: %s; skipped", self.instance, e)
            return
        await self._ensure_registered()
        await self._rebuild()
        last_live, self._last_live = self._last_live, seq
        if self.next_seq is not None and seq < self.next_seq:
            if self._applied_through_replay(seq, frames[2], last_live):
                if seq == self.next_seq - 1:
                    # The live stream reached the end of the replay: from here on
                    # a lower sequence can only mean a restart.
                    self._replayed = {}
                return
            self.counters.publisher_restarts += 1
            log.warning(
                "%s: sequence went back from %d to %d: the publisher restarted; "
                "resetting the instance",
                self.instance,
                self.next_seq - 1,
                seq,
            )
            await self._register(new=True)
            self.next_seq = None
        if (self.next_seq is None and seq > 0) or (
            self.next_seq is not None and seq > self.next_seq
        ):
            if self.next_seq is not None:
                self.counters.gaps += 1
            await self._catch_up(self.next_seq or 0)
            await self._rebuild()
            if self.next_seq is not None and seq < self.next_seq:
                return  # the replay covered it
        expected = 0 if self.next_seq is None else self.next_seq
        if seq > expected:
            await self._lost(expected, seq)
        self._replayed = {}  # the live stream has caught up with the replay
        await self._apply(seq, frames[2])
        await self._rebuild()  # the index lost the instance: the replay brings this batch too

    def _applied_through_replay(self, seq: int, payload: bytes, last_live: int | None) -> bool:
        """Whether live batch ``seq`` (below next_seq) is one the last replay applied.

        The queued live batches a replay covered arrive after it in order and
        with the bytes the replay returned; a restarted publisher's new stream
        starts over (at or below the live batch before it) with other batches.
        """
        if last_live is not None and seq <= last_live:
            return False
        return self._replayed.get(seq) == _digest(payload)

    async def _catch_up(self, start: int) -> None:
        """Replay from ``start`` and apply what comes back, in order.

        Stops early when the index lost the instance meanwhile (a rebuild is due).
        """
        if not self.endpoint.replay_endpoint:
            return
        self.counters.replays += 1
        got = await self._replay(start)
        if got is None:
            self.counters.replay_failures += 1
            return
        self._replayed = {seq: _digest(payload) for seq, payload in got}
        for seq, payload in got:
            if self.next_seq is not None and seq < self.next_seq:
                continue
            # A buffer that starts after ``start`` lost what came before it.
            expected = start if self.next_seq is None else self.next_seq
            if seq > expected:
                await self._lost(expected, seq)
            self.counters.batches_replayed += 1
            await self._apply(seq, payload)
            if self._needs_rebuild:
                return
            await self.pacer.pace()
        log.info("%s: replayed %d batch(es) from %d", self.instance, len(got), start)

    async def _replay(self, start: int) -> list[tuple[int, bytes]] | None:
        """The publisher's buffered batches from ``start``; None when it does not answer."""
        assert self.endpoint.replay_endpoint
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        self._secure(sock)
        # A fresh socket per request: a late reply to a timed-out request must
        # never be read as the answer to the next one.
        try:
            sock.connect(self.endpoint.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            out: list[tuple[int, bytes]] = []
            timeout_ms = int(self.settings.replay_timeout_s * 1000)
            while True:
                if not await sock.poll(timeout_ms):
                    log.warning(
                        "%s: replay from %d: no reply within %.1fs",
                        self.instance,
                        start,
                        self.settings.replay_timeout_s,
                    )
                    return None
                frames = await sock.recv_multipart()
                if len(frames) == 3:
                    seq_b, payload = frames[1], frames[2]
                elif len(frames) == 4:
                    seq_b, payload = frames[2], frames[3]
                else:
                    self.counters.frames_malformed += 1
                    continue
                if len(seq_b) != 8:
                    self.counters.frames_malformed += 1
                    continue
                seq = int.from_bytes(seq_b, "big", signed=True)
                if seq == REPLAY_END_SEQ:
                    return out
                out.append((seq, payload))
                await self.pacer.pace()
        finally:
            sock.close(linger=0)

    async def _lost(self, expected: int, got: int) -> None:
        """Batches ``expected .. got-1`` are gone for good; ``got`` is applied next.

        ``next_seq`` None means the index holds no batch of this incarnation.
        """
        self.counters.unrecoverable_gaps += 1
        first = self.next_seq is None
        if self.settings.on_unrecoverable_gap == "reset":
            log.warning(
                "%s: batches %d..%d are lost; resetting the instance (policy reset)",
                self.instance,
                expected,
                got - 1,
            )
            # The stream goes on from ``got``, the reset instance's first batch
            # (replaying from 0 instead would only meet the same loss again).
            # At the stream's start there is nothing to drop.
            if not first:
                await self._register(new=True)
            return
        log.warning(
            "%s: batches %d..%d are lost; the instance is stale until the engine clears "
            "its cache (policy stale)",
            self.instance,
            expected,
            got - 1,
        )
        if not first:
            return  # ``got`` skips sequences after the last applied one: the index sees the gap
        if got < 2:
            log.warning(
                "%s: only batch 0 is lost, and the index cannot be shown a gap before its "
                "first sequence: the instance stays fresh",
                self.instance,
            )
            return
        # Nothing applied yet: an empty batch 0 gives the index a sequence for
        # ``got`` to skip from.
        marker = EventBatch(self.instance, 0, ())
        try:
            await self._retrying(lambda: self.logic.publish(marker))
        except KvmeshError as e:
            log.warning("%s: marking the gap failed: %s", self.instance, e)
            return
        self.next_seq = 1

    async def _apply(self, seq: int, payload: bytes) -> None:
        """Decode and publish one batch; ``next_seq`` moves past it whatever happens.

        On a backend that applies without I/O (memory), the subscribers of
        the loop take turns (:func:`indexer.pacing.loop_turns`): a long batch
        gives way to the loop between its slices, and the others would
        otherwise each decode theirs meanwhile and hold it, tens of millions
        of token ids for the collector to walk at its next collection (a 60 ms
        pause with 64 engines); one at a time, only one batch is decoded.
        """
        turns = loop_turns() if self._cpu_bound else None
        if turns is None:
            await self._decode_and_publish(seq, payload)
            return
        async with turns:
            # The turn may have come after others spent the loop's budget.
            await self.pacer.pace()
            await self._decode_and_publish(seq, payload)

    async def _decode_and_publish(self, seq: int, payload: bytes) -> None:
        self.next_seq = seq + 1
        try:
            decoded = await decode_batch_paced(
                payload, self.pacer.pace, engine_hash_keys=self._engine_hash_keys
            )
        except MalformedFrame as e:
            self.counters.frames_malformed += 1
            log.warning("%s: batch %d: %s; skipped", self.instance, seq, e)
            await self._lost(seq, seq + 1)
            return
        self.counters.events_malformed += decoded.malformed_events
        if decoded.dp_rank is not None and decoded.dp_rank != self.instance.dp_rank:
            self.counters.dp_rank_mismatches += 1
            if not self._warned_rank:
                self._warned_rank = True
                log.warning(
                    "%s: batches say data-parallel rank %d; applying them to the configured "
                    "rank %d (check the endpoint's dp_rank)",
                    self.instance,
                    decoded.dp_rank,
                    self.instance.dp_rank,
                )
        # An engine's own stream: a store per physical copy (EventBatch.counts_copies).
        batch = EventBatch(
            self.instance, seq, decoded.events, decoded.timestamp, counts_copies=True
        )
        # Decoding and applying are two pieces of event work, not one.
        await self.pacer.pace()
        try:
            try:
                result = await self._retrying(lambda: self.logic.publish(batch, skip_invalid=True))
            except FailedPrecondition:
                # Not registered: reaped while the engine was away, removed, or the
                # index lost it (a Redis restarted empty). Its blocks are gone:
                # register anew, then rebuild from replay (which brings this
                # batch too), or without replay count the loss and apply it.
                await self._register(new=True)
                self._index_lost()
                if self._needs_rebuild:
                    return
                if seq > 0:
                    await self._lost(0, seq)
                self.next_seq = seq + 1
                result = await self._retrying(lambda: self.logic.publish(batch, skip_invalid=True))
        except KvmeshError as e:
            self.counters.batches_rejected += 1
            log.warning("%s: batch %d rejected: %s", self.instance, seq, e)
            await self._lost(seq, seq + 1)
            return
        if result.outcome is BatchOutcome.DUPLICATE:
            self.counters.batches_duplicate += 1
        else:
            self.counters.batches_applied += 1


def ensure_fd_limit(want: int, what: str) -> int:
    """Raise this process's soft limit of open files to ``want`` where its hard
    limit allows (a container's is often 1,024 soft over a far higher hard
    one), saying so once; a warning naming both figures where it cannot. The
    soft limit after."""
    try:
        import resource
    except ImportError:  # not a Unix
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return want if soft == resource.RLIM_INFINITY else soft
    new = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if new > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (new, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-file limit from %d to %d: %s", soft, new, e)
            new = soft
        else:
            log.info("open-file limit raised from %d to %d for %s", soft, new, what)
    if new < want:
        log.warning(
            "%s need about %d open files, and this process may open %d (its hard limit): "
            "some engines will not be indexed; raise the limit (ulimit -n, or the "
            "container runtime's nofile)",
            what,
            want,
            new,
        )
    return new


class EngineEventSubscribers:
    """Every configured endpoint subscriber, started and stopped with their process
    (an indexer replica, or ``kvmesh bridge``)."""

    def __init__(
        self,
        logic: EventSink,
        settings: EngineEventSettings,
        options: SubscriberOptions | None = None,
    ) -> None:
        self.settings = settings
        self._ctx = zmq.asyncio.Context()
        n = len(settings.endpoints)
        sockets = SOCKETS_PER_ENDPOINT * n + 64
        if sockets > self._ctx.get(zmq.MAX_SOCKETS):
            self._ctx.set(zmq.MAX_SOCKETS, min(sockets, self._ctx.get(zmq.SOCKET_LIMIT)))
        if n:
            ensure_fd_limit(FDS_PER_ENDPOINT * n + FDS_BESIDES, f"{n} engine endpoints")
        # The subscribers share the loop's budget (indexer.pacing.loop_pacer):
        # together, and with the memory backend's long applies, they give way to the loop.
        self.subscribers = [
            EndpointSubscriber(logic, ep, settings, self._ctx, options=options)
            for ep in settings.endpoints
        ]
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        """Start one task per endpoint on the running loop."""
        for s in self.subscribers:
            task = asyncio.create_task(self._run(s), name=f"kvmesh-zmq-{s.instance}")
            self._tasks.append(task)

    @staticmethod
    async def _run(s: EndpointSubscriber) -> None:
        # A subscriber that fails restarts after a pause: one broken endpoint
        # must not stop the others or the server. A refusal (a KvmeshError: the
        # policy, a namespace cap) is one line, not a traceback; the pause
        # doubles while it keeps failing without having applied anything.
        pause = 1.0
        while True:
            applied = s.counters.batches_applied
            try:
                await s.run()
            except asyncio.CancelledError:
                raise
            except KvmeshError as e:
                log.error("%s: subscriber stopped: %s; restarting in %.0fs", s.instance, e, pause)
            except Exception:
                log.exception("%s: subscriber failed; restarting in %.0fs", s.instance, pause)
            await asyncio.sleep(pause)
            pause = 1.0 if s.counters.batches_applied > applied else min(pause * 2, _RESTART_CAP_S)

    def counters(self) -> SubscriberCounters:
        """Sum of every subscriber's counters."""
        total = SubscriberCounters()
        for s in self.subscribers:
            total.add(s.counters)
        return total

    async def stop(self) -> None:
        """Stop every subscriber and close the ZMQ context."""
        tasks, self._tasks = self._tasks, []
        if await stop_tasks(*tasks, what="zmq subscribers"):
            # term() would block the loop until their sockets close: left open.
            log.error("zmq subscribers: the ZMQ context is left open")
            return
        self._ctx.term()
