"""The transfer logic of a sidecar: rooms, their status machine, queues and workers.

No grpc here (xfer/server.py is the transport). One :class:`XferLogic` serves
one role:

- **prefill**: :meth:`XferLogic.bootstrap` learns a room's destination (and,
  once per peer, the peer's transport metadata); :meth:`XferLogic.add_transfer_request`
  checks a chunk and queues it, returning at once
  (:meth:`XferLogic.add_transfer_requests`: many, all or none). ``queues`` worker threads,
  each owning the rooms of the peers hashed to it, merge the chunk's pages
  into runs contiguous on both sides, post one write (one descriptor per run,
  the last chunk also carries the aux slot) and keep up to
  ``max_inflight_per_queue`` writes in flight. A room succeeds when every chunk
  up to the last is written.
- **decode**: :meth:`XferLogic.register_room` assigns the room a random
  generation (only the room's engine and its prefill sidecar learn it);
  :meth:`XferLogic.on_notification` counts the chunks whose tags carry the
  current generation and come from the prefill agent the room was
  bootstrapped with (:meth:`XferLogic.bootstrap_done` records it; tags that
  arrive before it are held until then). Success needs every chunk and the
  aux slot. A transport that sees a write before it lands (TCP) asks
  :meth:`XferLogic.authorize_write` first: only the tagged rooms' own pages,
  from their own agent (a write for a room whose Bootstrap answer is still
  to come waits for it).

Prefill splits each written chunk's time into stages,
``kvmesh_xfer_stage_seconds{stage}`` (:data:`STAGES`): ``queue`` (put on its
worker's queue until the worker takes it), ``submit`` (the transport's post of
the write carrying it), ``transport`` (posted until the worker sees the write
done) and, once per room, ``notify`` (its last write seen done until Success).

What a peer sends and the sidecar refuses is counted by reason
(:data:`PEER_REFUSAL_REASONS`); a prefill sidecar also bounds what each peer's
Bootstraps may open (:mod:`xfer.quota`).

Status: ``Failed=0, Bootstrapping=1, WaitingForInput=2, Transferring=3,
Success=4``; forward-only, Failed reachable from any non-terminal state and
carrying a reason. Thread-safety: every method may be called from any thread
(one lock guards the rooms; transfers run outside it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import logging
import queue
import secrets
import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from opentelemetry import trace
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvmesh.errors import (
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
)
from kvmesh.metrics import ComponentRegistry, observe_many
from kvmesh.tracing import inject_context, tracing_enabled
from xfer.config import XferConfig
from xfer.pool import KVPool, PoolGeometry
from xfer.quota import PeerQuota
from xfer.transport import Transport
from xfer.wire import FLAG_AUX, FLAG_LAST, Tag, byte_runs, decode_tags, encode_tags, merge_runs

log = logging.getLogger(__name__)


class AlreadyExists(KvmeshError):
    """The room (or bootstrap) already exists."""

    code = "ALREADY_EXISTS"


class RoomStatus(enum.IntEnum):
    """Status of a room (values are the engines' and the proto's)."""

    FAILED = 0
    BOOTSTRAPPING = 1
    WAITING_FOR_INPUT = 2
    TRANSFERRING = 3
    SUCCESS = 4


#: The statuses a room never leaves.
TERMINAL = (RoomStatus.FAILED, RoomStatus.SUCCESS)

#: Why a sidecar refused what a peer sent: ``kvmesh_xfer_peer_refusals_total{reason}``.
PEER_REFUSAL_REASONS: dict[str, str] = {
    "not_admitted": "a peer method (Bootstrap, Abort, Heartbeat) called by a caller that is no "
    "admitted peer: not in the policy, not role peer, not in peers.allowed_identities, "
    "no or a wrong peer secret",
    "not_owner": "a peer acting on another peer's room or agent: Abort of a room another "
    "identity bootstrapped, Bootstrap under another identity's agent name, Bootstrap of a "
    "room another peer bootstrapped",
    "foreign_agent": "a notification or TCP write naming a room bootstrapped with another "
    "prefill agent",
    "stale_generation": "a notification, TCP write or Abort naming a generation that is not "
    "the room's current one, or a finished or unknown room",
    "out_of_range": "a page index, aux index, pool geometry or byte run outside the pool "
    "(Bootstrap against the claimed geometry and the peer's registered pool; TCP runs)",
    "outside_room": "a TCP run inside the pool but outside the tagged rooms' pages and aux "
    "slots (or off a page boundary)",
    "malformed": "a notification that is not kvmesh's, unparsable transport metadata, a TCP "
    "frame with more runs than any chunk has",
    "write_to_prefill": "a TCP write to a prefill sidecar, which receives none",
    "tcp_no_key": "a TCP data connection without a key proof: no hello within "
    "limits.tcp_handshake_timeout_s, another protocol or version, or an empty proof",
    "tcp_wrong_key": "a TCP data connection whose key proof does not verify",
    "tcp_replayed_key": "a TCP data connection replaying the key proof of an earlier one",
    "tcp_handshake_limit": "a TCP data connection beyond limits.tcp_max_handshakes still "
    "in their handshake",
    "room_limit": "a Bootstrap beyond limits.per_peer.max_rooms waiting rooms of its peer",
    "room_rate": "a Bootstrap beyond limits.per_peer.bootstrap_rps of its peer",
}


def _new_generation(previous: int) -> int:
    """A room registration's generation: 63 random bits (never 0 nor ``previous``).

    Random, not counted: the tag of every write and an Abort carry it, and only
    the room's engine and the prefill sidecar it was bootstrapped with learn it,
    so no other peer can guess a room's current generation from its own rooms'.
    """
    while True:
        g = secrets.randbits(63)
        if g and g != previous:
            return g


#: Stages of ``kvmesh_xfer_stage_seconds`` (prefill), in the order a chunk passes them.
STAGES = ("queue", "submit", "transport", "notify")

#: Buckets of ``kvmesh_xfer_stage_seconds``: from 2.5 us (a room's completion
#: bookkeeping) through 10 us..10 s (a queued chunk behind a stalled peer).
STAGE_BUCKETS = (
    2.5e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025,
    0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0,
)  # fmt: skip


class XferMetrics:
    """Prometheus metrics of one sidecar (its own registry)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or ComponentRegistry()
        r = self.registry
        self.rooms = Gauge("kvmesh_xfer_rooms", "Rooms by state", ["state"], registry=r)
        self.rooms_finished = Counter(
            "kvmesh_xfer_rooms_finished", "Rooms reaching a terminal state", ["state"], registry=r
        )
        # Buckets from 100 us (one small page run on loopback) to 30 s (the default timeouts).
        self.transfer_seconds = Histogram(
            "kvmesh_xfer_transfer_seconds",
            "First send (prefill) or first arrival (decode) to Success",
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30),
            registry=r,
        )
        self.bytes = Counter("kvmesh_xfer_bytes", "Bytes written or received", registry=r)
        # Descriptors per write: 1 for a fully contiguous chunk, up to one per page.
        self.descriptors = Histogram(
            "kvmesh_xfer_descriptors_per_transfer",
            "Descriptors (runs) per posted write",
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 1024),
            registry=r,
        )
        self.stale_notifications = Counter(
            "kvmesh_xfer_stale_notifications",
            "Notifications ignored (unknown room, older generation, finished room)",
            registry=r,
        )
        self.worker_errors = Counter(
            "kvmesh_xfer_worker_errors", "Exceptions caught by worker threads", registry=r
        )
        self.foreign_notifications = Counter(
            "kvmesh_xfer_foreign_notifications",
            "Notifications ignored because another agent than the room's bootstrapped "
            "prefill sidecar sent them",
            registry=r,
        )
        self.refused_writes = Counter(
            "kvmesh_xfer_refused_writes",
            "Incoming writes refused before landing (TCP): outside the pool, outside the "
            "tagged rooms' pages, or from another agent than the rooms' prefill sidecar",
            registry=r,
        )
        self.refusals = Counter(
            "kvmesh_xfer_refusals",
            "Calls refused: UNAUTHENTICATED and PERMISSION_DENIED (identity, role, peer "
            "admission), RESOURCE_EXHAUSTED (per-client limits), INVALID_ARGUMENT "
            "(undecodable request), by method",
            ["method", "code"],
            registry=r,
        )
        self.peer_refusals = Counter(
            "kvmesh_xfer_peer_refusals",
            "What peers sent that this sidecar refused, by reason (see docs/xfer.md, Security)",
            ["reason"],
            registry=r,
        )
        for reason in PEER_REFUSAL_REASONS:
            self.peer_refusals.labels(reason).inc(0)
        self.stage_seconds = Histogram(
            "kvmesh_xfer_stage_seconds",
            "Prefill: where a chunk's time goes, by stage: queue (queued until a worker takes "
            "it), submit (the transport's post of the write carrying it), transport (posted "
            "until the write is seen done), notify (per room: its last write seen done until "
            "Success)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=r,
        )
        # Bytes posted over seconds in the posts: the transport's own rate inside
        # the sidecar (with UCX's CMA the copy runs in the post), beside a raw
        # post of the same bytes (kvmesh bench xfer, post_vs_raw).
        self.post_seconds = Counter(
            "kvmesh_xfer_post_seconds",
            "Prefill: seconds the workers spent in the transport's post of writes",
            registry=r,
        )
        self.posted_bytes = Counter(
            "kvmesh_xfer_posted_bytes", "Prefill: bytes of the writes posted", registry=r
        )
        self.stage_queue = self.stage_seconds.labels("queue")
        self.stage_submit = self.stage_seconds.labels("submit")
        self.stage_transport = self.stage_seconds.labels("transport")
        self.stage_notify = self.stage_seconds.labels("notify")
        self.add_request_seconds = Histogram(
            "kvmesh_xfer_add_request_seconds",
            "Time add_transfer_request takes to check and queue a chunk",
            buckets=(1e-6, 5e-6, 1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 1e-3, 1e-2),
            registry=r,
        )
        for s in RoomStatus:
            self.rooms.labels(s.name.lower()).set(0)
        self.prefetches = Counter(
            "kvmesh_xfer_prefetches",
            "Decode: prefetches by event: issued (Prefetch accepted), claimed (ClaimPrefetch "
            "answered), cancelled, expired (not claimed within the ttl), failed",
            ["event"],
            registry=r,
        )
        for event in ("issued", "claimed", "cancelled", "expired", "failed"):
            self.prefetches.labels(event).inc(0)
        self.prefetch_claims = Counter(
            "kvmesh_xfer_prefetch_claims",
            "Decode: ClaimPrefetch answers by outcome: ready (the bytes were there), waited "
            "(for the pull in flight), fallback (pulled again at the claim), failed",
            ["outcome"],
            registry=r,
        )
        for outcome in ("ready", "waited", "fallback", "failed"):
            self.prefetch_claims.labels(outcome).inc(0)
        self.prefetches_open = Gauge(
            "kvmesh_xfer_prefetches_open",
            "Decode: prefetches pulling, or pulled and not claimed yet",
            registry=r,
        )
        self.prefetch_pull_seconds = Histogram(
            "kvmesh_xfer_prefetch_pull_seconds",
            "Decode: a prefetch's pull, from Prefetch (or a claim's fallback) to Ready",
            buckets=(1e-4, 5e-4, 1e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 30),
            registry=r,
        )

    def refuse(self, reason: str) -> None:
        """Count one refusal of ``reason`` (a key of :data:`PEER_REFUSAL_REASONS`)."""
        self.peer_refusals.labels(reason).inc()


@dataclasses.dataclass(eq=False)
class Room:
    """One room's state on this side."""

    room: int
    generation: int
    status: RoomStatus
    created: float
    progress_at: float
    reason: str = ""
    dst_pages: list[int] = dataclasses.field(default_factory=list)
    aux_index: int = 0
    peer: str = ""  # prefill: decode's peer name; decode: prefill's address
    #: Decode: the prefill sidecar's transport agent (from its Bootstrap answer);
    #: only its notifications count. None: not known yet (or not checked).
    peer_agent: str | None = None
    #: Prefill: certificate identity of the decode sidecar that bootstrapped the
    #: room ("" without mutual TLS); only it may abort the room.
    peer_identity: str = ""
    #: Prefill: the peer whose Bootstrap opened the room, while the engine has not
    #: claimed it (added a chunk): the room counts against that peer's quota.
    quota_key: str = ""
    #: Decode: notifications that arrived before the Bootstrap answer named the
    #: prefill agent, as (agent, tag); replayed or dropped by bootstrap_done.
    early: list[tuple[str, Tag]] = dataclasses.field(default_factory=list)
    peer_geometry: PoolGeometry | None = None
    bootstrapped: bool = False
    pending: list[Chunk] = dataclasses.field(default_factory=list)
    chunk_ids: set[int] = dataclasses.field(default_factory=set)
    last_chunk: int | None = None
    chunks_done: int = 0
    aux_done: bool = False
    bytes: int = 0
    first_send: float | None = None
    span: Any = None
    #: The room span's context as ``traceparent`` pairs (decode: sent with
    #: the Bootstrap call, so both sides of a transfer are one trace).
    trace_context: tuple[tuple[str, str], ...] = ()


class Chunk(NamedTuple):
    """One queued chunk of a room (a named tuple: made per chunk on the submission
    path, where a frozen dataclass's ``__init__`` cost 1.3 µs of a chunk's 5.7)."""

    room: int
    generation: int
    src_pages: tuple[int, ...]
    slice_start: int
    is_last: bool
    aux_index: int
    chunk_id: int
    #: Prefill: ``time.monotonic()`` when the chunk was put on its worker's queue
    #: (0 until then); the worker's take observes the ``queue`` stage.
    queued: float = 0.0


def _at_entry(index: int, err: KvmeshError) -> KvmeshError:
    """``err`` of entry ``index`` of a batch: its field becomes ``requests[index].field``."""
    where = f"requests[{index}]"
    err.field = f"{where}.{err.field}" if err.field else where
    return err


class RoomState(NamedTuple):
    """A room as :meth:`XferLogic.poll_rooms` reads it."""

    room: int
    #: False: the sidecar does not know the room (never registered, or cleared).
    found: bool
    status: RoomStatus
    failure_reason: str
    bytes: int


#: Arguments of one :meth:`XferLogic.add_transfer_request`: room, source pages,
#: destination slice, is_last, aux slot, chunk id.
ChunkRequest = tuple[int, Sequence[int], tuple[int, int], bool, int, int]

#: Most entries one AddTransferRequests call may carry: ample for a request's
#: chunks, and it bounds the work one call does under the rooms' lock.
MAX_BATCH_ENTRIES = 1024

_STOP = object()

#: Most chunks one write may carry. Coalescing amortises the per-write cost;
#: the cap bounds the notification size (29 bytes a chunk) and keeps one
#: write from holding a worker for long.
_MAX_COALESCE = 64


@dataclasses.dataclass(eq=False)
class _Inflight:
    handle: Any
    chunks: list[tuple[Chunk, int]]
    posted: float


class XferLogic:
    """Rooms and transfers of one sidecar (see the module docstring)."""

    def __init__(
        self,
        config: XferConfig,
        pool: KVPool,
        transport: Transport,
        metrics: XferMetrics | None = None,
    ) -> None:
        self.config = config
        self.role = config.role
        self.pool = pool
        self.transport = transport
        self.metrics = metrics or XferMetrics()
        self._rooms: dict[int, Room] = {}
        #: Rooms not finished (neither Success nor Failed). Decode: the
        #: transport polls for notifications (its prefill's writes landing) at
        #: full pace only while there are some. Prefill is never notified (its
        #: writes' states are polled by its workers, a prefetch's by its puller).
        self._unfinished = 0
        self._lock = threading.Lock()
        #: Notified whenever a room changes state or goes (writes held for a room's
        #: Bootstrap answer wait on it).
        self._changed = threading.Condition(self._lock)
        #: Room id -> callbacks of PollRooms calls waiting on it (:meth:`watch_rooms`);
        #: each is called, lock held, when the room changes status or goes.
        self._watchers: dict[int, list[Callable[[], None]]] = {}
        self._quota = PeerQuota(config.limits.per_peer)
        self._peer_addresses: dict[str, str] = {}  # prefill: peer name -> gRPC address
        # Prefill: peer name -> certificate identity that first bootstrapped with it,
        # so one peer cannot bootstrap under another's agent name.
        self._peer_identities: dict[str, str] = {}
        self._last_foreign_log = -1e9
        self._last_refusal_log = -1e9
        self._queues: list[queue.SimpleQueue[Any]] = [
            queue.SimpleQueue() for _ in range(config.queues)
        ]
        self._workers: list[threading.Thread] = []
        # Decided once: with tracing off no room span is built at all.
        self._tracer = trace.get_tracer("kvmesh.xfer") if tracing_enabled() else None
        transport.set_notif_handler(self.on_notification)
        transport.set_refusal_hook(self._transport_refused)
        if config.role == "decode":
            transport.set_write_check(self.authorize_write)
        else:
            transport.set_write_check(self._refuse_every_write)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self) -> None:
        """Start the transport and (prefill) the worker threads."""
        self.transport.start()
        if self.role == "prefill":
            for i, q in enumerate(self._queues):
                t = threading.Thread(target=self._worker, args=(q,), name=f"xfer-q{i}", daemon=True)
                t.start()
                self._workers.append(t)

    def stop(self) -> None:
        """Stop workers and the transport. Idempotent."""
        for q in self._queues:
            q.put(_STOP)
        for t in self._workers:
            t.join(timeout=2)
        self._workers.clear()
        self.transport.close()

    # -- status machine -----------------------------------------------------------------

    def _new_room(self, room: int, generation: int, status: RoomStatus, now: float) -> Room:
        if len(self._rooms) >= self.config.max_rooms:
            raise FailedPrecondition(
                f"{len(self._rooms)} rooms tracked (max_rooms); clear finished rooms", field="room"
            )
        r = Room(room, generation, status, created=now, progress_at=now)
        if self._tracer is not None:
            # One span per room, from its creation (bootstrap) to Success or
            # Failed (or Cleared); a child of the call that created the room.
            r.span = self._tracer.start_span(
                "xfer.room",
                attributes={
                    "kvmesh.room": room,
                    "kvmesh.xfer.role": self.role,
                    "kvmesh.xfer.generation": generation,
                },
            )
            r.trace_context = inject_context(r.span)
        self._rooms[room] = r
        self.metrics.rooms.labels(status.name.lower()).inc()
        if status not in TERMINAL:
            self._count_unfinished(1)
        return r

    def _count_unfinished(self, delta: int) -> None:
        """Lock held: one room more (``delta`` 1) or less unfinished; the
        transport hears when the first starts and the last ends."""
        before = self._unfinished
        self._unfinished = before + delta
        if (before == 0) != (self._unfinished == 0) and self.role == "decode":
            self.transport.set_expecting(self._unfinished > 0)

    def _set(self, r: Room, status: RoomStatus, reason: str = "") -> bool:
        """Move ``r`` to ``status`` if that is forward (or Failed from non-terminal)."""
        if r.status in TERMINAL or (status != RoomStatus.FAILED and status <= r.status):
            return False
        m = self.metrics
        m.rooms.labels(r.status.name.lower()).dec()
        m.rooms.labels(status.name.lower()).inc()
        r.status = status
        r.progress_at = time.monotonic()
        self._changed.notify_all()
        self._wake(r.room)
        if status == RoomStatus.FAILED:
            r.reason = reason
            log.info("room %d failed: %s", r.room, reason)
        if status in TERMINAL:
            self._count_unfinished(-1)
            m.rooms_finished.labels(status.name.lower()).inc()
            if status == RoomStatus.SUCCESS and r.first_send is not None:
                m.transfer_seconds.observe(time.monotonic() - r.first_send)
            if r.span is not None:
                r.span.set_attribute("kvmesh.xfer.status", status.name)
                r.span.set_attribute("kvmesh.xfer.bytes", r.bytes)
                if reason:
                    r.span.set_attribute("kvmesh.xfer.reason", reason)
                if status == RoomStatus.FAILED:
                    r.span.set_status(trace.StatusCode.ERROR, reason)
                r.span.end()
                r.span = None
        return True

    def fail(self, room: int, reason: str, generation: int | None = None) -> bool:
        """Fail ``room`` (only the given generation, when one is given)."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None or (generation is not None and r.generation != generation):
                return False
            return self._set(r, RoomStatus.FAILED, reason)

    def _wake(self, room: int) -> None:
        """Lock held: call the PollRooms waiters of ``room`` (it changed or went)."""
        watchers = self._watchers.get(room)
        if watchers:
            for wake in watchers:
                wake()

    def _states(self, rooms: Sequence[int]) -> list[RoomState]:
        """Lock held: the state of each of ``rooms`` (``found`` False for unknown ones)."""
        out = []
        for room in rooms:
            r = self._rooms.get(room)
            if r is None:
                out.append(RoomState(room, False, RoomStatus.FAILED, "", 0))
            else:
                out.append(RoomState(room, True, r.status, r.reason, r.bytes))
        return out

    def poll_rooms(self, rooms: Sequence[int]) -> list[RoomState]:
        """The state of each of ``rooms``, read at one instant (unknown rooms are
        ``found`` False, never an error)."""
        with self._lock:
            return self._states(rooms)

    def watch_rooms(self, rooms: Sequence[int], wake: Callable[[], None]) -> list[RoomState]:
        """Call ``wake`` (lock held: it must only schedule work) whenever one of
        ``rooms`` changes status or goes, until :meth:`unwatch_rooms`; returns their
        states at the instant the watch began, so no change falls between."""
        with self._lock:
            for room in rooms:
                self._watchers.setdefault(room, []).append(wake)
            return self._states(rooms)

    def unwatch_rooms(self, rooms: Sequence[int], wake: Callable[[], None]) -> None:
        """End a :meth:`watch_rooms` of the same rooms and callback."""
        with self._lock:
            for room in rooms:
                watchers = self._watchers.get(room)
                if watchers is None:
                    continue
                with contextlib.suppress(ValueError):
                    watchers.remove(wake)
                if not watchers:
                    del self._watchers[room]

    def poll(self, room: int) -> tuple[RoomStatus, str, int]:
        """``(status, failure reason, bytes)`` of a room; :class:`NotFound` if unknown."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                raise NotFound(f"unknown room {room}", field="room")
            return r.status, r.reason, r.bytes

    def clear(self, room: int) -> Room | None:
        """Forget a room. Returns it when it was not finished (decode aborts it on prefill)."""
        with self._lock:
            r = self._rooms.pop(room, None)
            if r is None:
                raise NotFound(f"unknown room {room}", field="room")
            self._forget(r)
            unfinished = r.status not in TERMINAL
            if r.span is not None:
                r.span.set_attribute("kvmesh.xfer.status", "CLEARED")
                r.span.end()
                r.span = None
        return r if unfinished else None

    def _forget(self, r: Room) -> None:
        """Bookkeeping of a room just removed from the table (lock held)."""
        self.metrics.rooms.labels(r.status.name.lower()).dec()
        if r.status not in TERMINAL:
            self._count_unfinished(-1)
        if r.quota_key:
            self._quota.release(r.quota_key, r.room)
        self._changed.notify_all()
        self._wake(r.room)

    def _refused(self, reason: str, err: KvmeshError) -> KvmeshError:
        """Count a refusal of ``reason``; returns ``err`` to raise."""
        self.metrics.refuse(reason)
        return err

    def _transport_refused(self, reason: str) -> None:
        self.metrics.refuse(reason)

    def room_generation(self, room: int) -> int | None:
        """Generation of a tracked room (``None`` if unknown)."""
        with self._lock:
            r = self._rooms.get(room)
            return None if r is None else r.generation

    def tick(self, now: float | None = None) -> list[Room]:
        """Fail rooms past their bootstrap or waiting timeout; return them."""
        now = time.monotonic() if now is None else now
        cfg = self.config
        failed = []
        with self._lock:
            for r in self._rooms.values():
                if r.status == RoomStatus.BOOTSTRAPPING:
                    if now - r.created > cfg.bootstrap_timeout_s:
                        self._set(r, RoomStatus.FAILED, "bootstrap timed out")
                        failed.append(r)
                elif (
                    r.status in (RoomStatus.WAITING_FOR_INPUT, RoomStatus.TRANSFERRING)
                    and now - r.progress_at > cfg.waiting_timeout_s
                ):
                    self._set(r, RoomStatus.FAILED, "timed out waiting for input")
                    failed.append(r)
        return failed

    def active_peers(self) -> dict[str, str]:
        """Peers with unfinished rooms: key -> gRPC address (for heartbeats)."""
        with self._lock:
            keys = {r.peer for r in self._rooms.values() if r.peer and r.status not in TERMINAL}
        if self.role == "decode":
            return {k: k for k in keys}
        return {k: self._peer_addresses[k] for k in keys if k in self._peer_addresses}

    def peer_failed(self, peer: str, reason: str) -> list[Room]:
        """Fail every unfinished room of ``peer``; return them."""
        out = []
        with self._lock:
            for r in self._rooms.values():
                if r.peer == peer and self._set(r, RoomStatus.FAILED, reason):
                    out.append(r)
        if self.role == "prefill" and out:
            self.transport.remove_peer(peer)
            with self._lock:
                self._peer_identities.pop(peer, None)
        return out

    # -- prefill ----------------------------------------------------------------------------

    def bootstrap(
        self,
        *,
        room: int,
        generation: int,
        dst_pages: Sequence[int],
        aux_index: int,
        peer_name: str,
        peer_address: str,
        metadata: bytes,
        geometry: PoolGeometry,
        transport_kind: str,
        identity: str = "",
        client: str = "",
    ) -> None:
        """Prefill: record a room's destination from the decode sidecar.

        ``identity`` is the caller's certificate identity ("" without mutual
        TLS): an agent name stays bound to the identity that first used it, and
        only that identity may abort the room. ``client`` names the caller for
        its quota (:mod:`xfer.quota`; default the identity, else the agent
        name): the rooms it opens that the engine has not claimed yet. Its
        Bootstrap rate is :meth:`admit_bootstrap`'s, which the gRPC server
        calls first.
        """
        self._require("prefill")
        quota_key = client or identity or peer_name
        if transport_kind != self.transport.kind:
            raise FailedPrecondition(
                f"decode uses transport {transport_kind!r}, this sidecar {self.transport.kind!r}",
                field="transport",
            )
        if not dst_pages:
            raise InvalidArgument("no destination pages", field="dst_page_indices")
        out_of_range = self._check_destination(geometry, dst_pages, aux_index)
        if out_of_range is not None:
            raise self._refused("out_of_range", out_of_range)
        if not peer_name:
            raise InvalidArgument("peer_name is required", field="peer_name")
        if identity:
            with self._lock:
                owner = self._peer_identities.setdefault(peer_name, identity)
            if owner != identity:
                raise self._refused(
                    "not_owner",
                    PermissionDenied(
                        f"agent {peer_name!r} was bootstrapped by another peer identity",
                        field="peer_name",
                    ),
                )
        if metadata:
            if not self.transport.has_peer(peer_name):
                try:
                    self.transport.add_peer(peer_name, metadata)
                except InvalidArgument as e:
                    raise self._refused("malformed", e) from None
        elif not self.transport.has_peer(peer_name):
            raise FailedPrecondition(
                f"unknown peer {peer_name}: its first bootstrap must carry agent metadata",
                field="agent_metadata",
            )
        registered = self.transport.peer_pool_size(peer_name)
        if registered is not None and geometry.total_bytes > registered:
            # The claimed geometry decides every destination offset: it may not name
            # bytes beyond the pool the peer's transport metadata registered.
            raise self._refused(
                "out_of_range",
                InvalidArgument(
                    f"decode pool geometry claims {geometry.total_bytes} bytes; its transport "
                    f"registered {registered}",
                    field="page_count",
                ),
            )
        now = time.monotonic()
        with self._lock:
            r = self._rooms.get(room)
            if r is not None and r.bootstrapped:
                if r.status not in TERMINAL or r.generation == generation:
                    err = AlreadyExists(f"room {room} is already bootstrapped", field="room")
                    if r.peer != peer_name or r.peer_identity != identity:
                        raise self._refused("not_owner", err)
                    raise err
                del self._rooms[room]
                self._forget(r)
                r = None
            if r is None:
                self._make_room_for(quota_key)
                r = self._new_room(room, generation, RoomStatus.BOOTSTRAPPING, now)
                r.quota_key = quota_key
                self._quota.add(quota_key, room)
            elif r.status == RoomStatus.FAILED:
                raise FailedPrecondition(f"room {room} failed: {r.reason}", field="room")
            elif r.span is not None:
                # The engine's transfer request came first and started the span;
                # link it to the decode room's trace, which Bootstrap carries.
                caller = trace.get_current_span().get_span_context()
                if caller.is_valid:
                    r.span.add_link(caller)
            for c in r.pending:
                self._check_slice(c, len(dst_pages))
            r.generation = generation
            r.dst_pages = list(dst_pages)
            r.aux_index = aux_index
            r.peer = peer_name
            r.peer_identity = identity
            r.peer_geometry = geometry
            r.bootstrapped = True
            self._peer_addresses[peer_name] = peer_address
            self._set(r, RoomStatus.WAITING_FOR_INPUT)
            pending, r.pending = r.pending, []
            for c in pending:
                self._enqueue(r, c._replace(generation=generation, queued=now))

    def admit_bootstrap(self, client: str) -> None:
        """Prefill: count one Bootstrap call of peer ``client`` against its rate
        (``limits.per_peer.bootstrap_rps``), or raise RESOURCE_EXHAUSTED (room_rate)."""
        self._require("prefill")
        with self._lock:
            try:
                self._quota.take(client)
            except ResourceExhausted as e:
                raise self._refused("room_rate", e) from None

    def _check_destination(
        self, geometry: PoolGeometry, dst_pages: Sequence[int], aux_index: int
    ) -> InvalidArgument | None:
        """Why a Bootstrap's geometry, pages or aux slot are out of range (``None``: fine)."""
        mine = self.pool.geometry
        if geometry.page_size != mine.page_size:
            return InvalidArgument(
                f"decode page size {geometry.page_size} != prefill page size {mine.page_size}",
                field="page_size",
            )
        if geometry.aux_count and (not mine.aux_count or geometry.aux_size != mine.aux_size):
            return InvalidArgument("aux slots differ between decode and prefill", field="aux_size")
        n = geometry.page_count
        for i in dst_pages:
            if not 0 <= i < n:
                return InvalidArgument(f"page index {i} outside [0, {n})", field="dst_page_indices")
        if geometry.aux_count and not 0 <= aux_index < geometry.aux_count:
            return InvalidArgument(
                f"aux index {aux_index} outside [0, {geometry.aux_count})", field="aux_index"
            )
        return None

    def _make_room_for(self, quota_key: str) -> None:
        """Lock held: let ``quota_key`` open one more room, forgetting its oldest finished
        one at the cap, or raise RESOURCE_EXHAUSTED when all of its rooms are open."""
        if not self._quota.full(quota_key):
            return
        for room in self._quota.rooms(quota_key):
            old = self._rooms.get(room)
            if old is None or old.quota_key != quota_key:
                self._quota.release(quota_key, room)
                return
            if old.status in TERMINAL:
                del self._rooms[room]
                self._forget(old)
                return
        cap = self.config.limits.per_peer.max_rooms
        raise self._refused(
            "room_limit",
            ResourceExhausted(
                f"peer {quota_key!r} holds {cap} open rooms the prefill engine has not sent "
                "yet (limits.per_peer.max_rooms)",
                field="limits.per_peer.max_rooms",
            ),
        )

    @staticmethod
    def _check_slice(c: Chunk, n_dst: int) -> None:
        end = c.slice_start + len(c.src_pages)
        if end > n_dst:
            raise InvalidArgument(
                f"chunk {c.chunk_id} fills destination pages [{c.slice_start}, {end}) but the "
                f"room has {n_dst}",
                field="index_slice_end",
            )

    def _check_chunk(
        self,
        room: int,
        page_indices: Sequence[int],
        index_slice: tuple[int, int],
        is_last: bool,
        aux_index: int,
        chunk_id: int,
    ) -> Chunk:
        """The chunk an AddTransferRequest names, once its slice, pages and aux slot
        are in range (the checks that need no room state)."""
        # A tuple first: the checks below iterate it in C, a message's repeated
        # field through its own iterator (1.6 µs more a chunk for min() alone).
        pages = tuple(page_indices)
        start, end = index_slice
        if start < 0 or end < start:
            raise InvalidArgument(
                f"bad index slice [{start}, {end})",
                field="index_slice_start" if start < 0 else "index_slice_end",
            )
        if end - start != len(pages):
            raise InvalidArgument(
                f"{len(pages)} source pages for {end - start} destination pages",
                field="page_indices",
            )
        if not pages and not is_last:
            raise InvalidArgument("empty chunk", field="page_indices")
        self.pool.check_pages(pages, "page_indices")
        if is_last and self.pool.geometry.aux_count:
            self.pool.check_aux(aux_index, "aux_index")
        return Chunk(room, 0, pages, start, is_last, aux_index, chunk_id)

    def _check_room(self, r: Room | None, chunk: Chunk, ids: set[int], last: int | None) -> None:
        """Lock held: raise unless room ``r`` (``None``: not tracked yet) may take
        ``chunk``, given the chunk ids it holds (``ids``) and its last chunk (``last``)."""
        chunk_id = chunk.chunk_id
        if r is not None and r.status in TERMINAL:
            what = f"failed: {r.reason}" if r.status == RoomStatus.FAILED else "finished"
            raise FailedPrecondition(f"room {chunk.room} {what}", field="room")
        if chunk_id in ids:
            raise InvalidArgument(f"chunk {chunk_id} already added", field="chunk_id")
        # Chunks may arrive in any order (pipelined calls); ids must fit under the last.
        if last is not None and (chunk.is_last or chunk_id > last):
            raise InvalidArgument(f"chunk {chunk_id} after the last chunk {last}", field="chunk_id")
        if chunk.is_last and ids and max(ids) > chunk_id:
            raise InvalidArgument(f"last chunk {chunk_id} below chunk {max(ids)}", field="chunk_id")
        if r is not None and r.bootstrapped:
            self._check_slice(chunk, len(r.dst_pages))

    def _accept(self, chunk: Chunk, now: float) -> None:
        """Lock held: record a checked chunk in its room (opened if new) and queue it,
        or hold it until the room's Bootstrap."""
        room = chunk.room
        r = self._rooms.get(room)
        if r is None:
            r = self._new_room(room, 0, RoomStatus.BOOTSTRAPPING, now)
        r.chunk_ids.add(chunk.chunk_id)
        if r.quota_key:  # the engine claims a room a peer's Bootstrap opened
            self._quota.release(r.quota_key, room)
            r.quota_key = ""
        if chunk.is_last:
            r.last_chunk = chunk.chunk_id
        r.progress_at = now
        if r.bootstrapped:
            c = chunk
            # Built directly: dataclasses.replace costs several times more per chunk.
            self._enqueue(
                r,
                Chunk(
                    room,
                    r.generation,
                    c.src_pages,
                    c.slice_start,
                    c.is_last,
                    c.aux_index,
                    c.chunk_id,
                    now,
                ),
            )
        else:
            r.pending.append(chunk)

    def add_transfer_request(
        self,
        room: int,
        page_indices: Sequence[int],
        index_slice: tuple[int, int],
        is_last: bool,
        aux_index: int,
        chunk_id: int,
    ) -> None:
        """Prefill: check one chunk and queue it; returns at once (never waits on I/O)."""
        t0 = time.perf_counter()
        self._require("prefill")
        chunk = self._check_chunk(room, page_indices, index_slice, is_last, aux_index, chunk_id)
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                # Raises at max_rooms before anything is recorded.
                r = self._new_room(room, 0, RoomStatus.BOOTSTRAPPING, time.monotonic())
            self._check_room(r, chunk, r.chunk_ids, r.last_chunk)
            self._accept(chunk, time.monotonic())
        self.metrics.add_request_seconds.observe(time.perf_counter() - t0)

    def add_transfer_requests(self, entries: Sequence[ChunkRequest]) -> None:
        """Prefill: check many chunks, then queue all of them or, on any error, none.

        ``entries`` are :meth:`add_transfer_request`'s arguments, 1 to
        :data:`MAX_BATCH_ENTRIES` of them (INVALID_ARGUMENT, field ``requests``,
        otherwise). Each entry gets that call's checks, in order, as if the
        entries before it were queued (so one batch may carry a room's chunks up
        to its last); an error is the one the single call raises, with its
        field prefixed by the entry, e.g. ``requests[3].page_indices``."""
        t0 = time.perf_counter()
        self._require("prefill")
        n = len(entries)
        if not 0 < n <= MAX_BATCH_ENTRIES:
            raise InvalidArgument(
                f"{n} entries; a call carries 1 to {MAX_BATCH_ENTRIES}", field="requests"
            )
        chunks: list[Chunk] = []
        try:
            for e in entries:
                chunks.append(self._check_chunk(*e))
        except KvmeshError as err:
            raise _at_entry(len(chunks), err) from None
        with self._lock:
            # Per room touched: (room or None, chunk ids, last chunk) as if the
            # entries before were queued.
            seen: dict[int, tuple[Room | None, set[int], int | None]] = {}
            new_rooms = 0
            for i, c in enumerate(chunks):
                state = seen.get(c.room)
                if state is None:
                    r = self._rooms.get(c.room)
                    if r is None:
                        if len(self._rooms) + new_rooms >= self.config.max_rooms:
                            raise _at_entry(
                                i,
                                FailedPrecondition(
                                    f"{len(self._rooms)} rooms tracked and {new_rooms} more in "
                                    "this call (max_rooms); clear finished rooms",
                                    field="room",
                                ),
                            )
                        new_rooms += 1
                        state = (None, set(), None)
                    else:
                        state = (r, set(r.chunk_ids), r.last_chunk)
                r, ids, last = state
                try:
                    self._check_room(r, c, ids, last)
                except KvmeshError as err:
                    raise _at_entry(i, err) from None
                ids.add(c.chunk_id)
                seen[c.room] = (r, ids, c.chunk_id if c.is_last else last)
            # Every entry checked: queue them all (nothing below raises).
            now = time.monotonic()
            for c in chunks:
                self._accept(c, now)
        observe_many(self.metrics.add_request_seconds, (time.perf_counter() - t0) / n, n)

    def _enqueue(self, r: Room, chunk: Chunk) -> None:
        # Sharded by destination: one peer's chunks stay in order on one worker,
        # and a stuck peer delays only the rooms hashed with it.
        q = self._queues[zlib.crc32(r.peer.encode()) % len(self._queues)]
        q.put(chunk)

    def abort(self, room: int, generation: int, reason: str, identity: str = "") -> bool:
        """The other side gave up on a room: fail it (only its current generation).

        Prefill: with mutual TLS only the identity that bootstrapped the room may
        abort it (PERMISSION_DENIED otherwise). Decode: the generation is the
        proof (random per registration, known only to the room's engine and the
        prefill sidecar it was bootstrapped with). An Abort naming another
        generation of a tracked room is ignored and counted as stale."""
        with self._lock:
            r = self._rooms.get(room)
            if r is None:
                return False
            if self.role == "prefill" and r.peer_identity and identity != r.peer_identity:
                raise self._refused(
                    "not_owner",
                    PermissionDenied(
                        f"room {room} was bootstrapped by another peer identity", field="room"
                    ),
                )
            if r.generation != generation:
                self.metrics.refuse("stale_generation")
                return False
            side = "decode" if self.role == "prefill" else "prefill"
            return self._set(r, RoomStatus.FAILED, f"aborted by {side}: {reason}")

    # -- workers ------------------------------------------------------------------------------

    def _worker(self, q: queue.SimpleQueue[Any]) -> None:
        limit = self.config.max_inflight_per_queue
        inflight: list[_Inflight] = []
        idle = 0.00005
        while True:
            batch: list[Any] = []
            if len(inflight) < limit:
                try:
                    if inflight:
                        batch.append(q.get_nowait())
                    else:
                        batch.append(q.get(timeout=0.5))
                except queue.Empty:
                    pass
                # Coalesce what is already queued (each write has a fixed cost
                # of about half a millisecond in NIXL on this class of host);
                # serial mode (one in flight) keeps one chunk per write.
                while batch and limit > 1 and len(batch) < _MAX_COALESCE:
                    try:
                        batch.append(q.get_nowait())
                    except queue.Empty:
                        break
            if any(item is _STOP for item in batch):
                for f in inflight:
                    self.transport.release(f.handle)
                return
            if batch:
                taken = time.monotonic()
                observe = self.metrics.stage_queue.observe
                for c in batch:
                    observe(taken - c.queued)
                try:
                    self._post(batch, inflight)
                except Exception as e:  # the worker survives; only these rooms fail
                    self.metrics.worker_errors.inc()
                    log.warning("posting a write failed: %s", e, exc_info=True)
                    for c in batch:
                        self.fail(c.room, f"transfer failed: {e}", c.generation)
                idle = 0.00005
                if len(inflight) < limit:
                    continue
            if inflight:
                if not self._reap(inflight):
                    # Nothing finished: back off from 50 us to 1 ms so waiting
                    # workers leave the CPU to the transport's progress thread.
                    time.sleep(idle)
                    idle = min(idle * 2, 0.001)
                else:
                    idle = 0.00005

    def _chunk_runs(self, chunk: Chunk) -> tuple[str, list[tuple[int, int, int]], Tag] | None:
        """The peer, byte runs and tag of a chunk (``None`` if its room is gone)."""
        with self._lock:
            r = self._rooms.get(chunk.room)
            if r is None or r.generation != chunk.generation or r.status in TERMINAL:
                return None
            dst = r.dst_pages[chunk.slice_start : chunk.slice_start + len(chunk.src_pages)]
            peer, geo, aux_dst = r.peer, r.peer_geometry, r.aux_index
        assert geo is not None
        page_size = self.pool.geometry.page_size
        runs = byte_runs(merge_runs(chunk.src_pages, dst), page_size)
        flags = 0
        if chunk.is_last:
            flags |= FLAG_LAST
            if geo.aux_count:
                flags |= FLAG_AUX
                size = geo.aux_size
                runs.append(
                    (self.pool.aux_offset(chunk.aux_index), geo.kv_bytes + aux_dst * size, size)
                )
        return (
            peer,
            runs,
            Tag(chunk.room, chunk.generation, chunk.chunk_id, flags, chunk.chunk_id + 1),
        )

    def _post(self, batch: list[Chunk], inflight: list[_Inflight]) -> None:
        """Post one write per peer for ``batch`` (one descriptor per run, all tags in one
        notification). A chunk whose runs cannot be built fails only its own room."""
        groups: dict[
            str, tuple[list[tuple[int, int, int]], list[Tag], list[tuple[Chunk, int]]]
        ] = {}
        for chunk in batch:
            try:
                built = self._chunk_runs(chunk)
            except Exception as e:
                self.metrics.worker_errors.inc()
                log.warning("room %d chunk %d: %s", chunk.room, chunk.chunk_id, e, exc_info=True)
                self.fail(chunk.room, f"transfer failed: {e}", chunk.generation)
                continue
            if built is None:
                continue
            peer, runs, tag = built
            if not runs:  # an empty last chunk without aux: nothing to move
                self._chunk_done(chunk, 0, time.monotonic())
                continue
            g = groups.setdefault(peer, ([], [], []))
            g[0].extend(runs)
            g[1].append(tag)
            g[2].append((chunk, sum(n for _, _, n in runs)))
        for peer, (runs, tags, chunks) in groups.items():
            notif = encode_tags(tags)
            submit = time.monotonic()
            try:
                handle = self.transport.post(peer, runs, notif)
            except Exception as e:
                self.metrics.worker_errors.inc()
                log.warning("write to %s failed: %s", peer, e, exc_info=True)
                for c, _ in chunks:
                    self.fail(c.room, f"transfer failed: {e}", c.generation)
                continue
            now = time.monotonic()
            self.metrics.post_seconds.inc(now - submit)
            self.metrics.posted_bytes.inc(sum(n for _, n in chunks))
            self.metrics.descriptors.observe(len(runs))
            # Each chunk observes the write carrying it.
            observe_many(self.metrics.stage_submit, now - submit, len(chunks))
            with self._lock:
                for c, _ in chunks:
                    r = self._rooms.get(c.room)
                    if r is None or r.generation != c.generation:
                        continue
                    if r.first_send is None:
                        r.first_send = now
                    self._set(r, RoomStatus.TRANSFERRING)
            inflight.append(_Inflight(handle, chunks, now))

    def _reap(self, inflight: list[_Inflight]) -> bool:
        progressed = False
        now = time.monotonic()
        for item in list(inflight):
            try:
                state = self.transport.check(item.handle)
            except Exception as e:
                state = "ERR"
                log.warning("checking a transfer failed: %s", e)
            if state == "PROC" and now - item.posted <= self.config.transfer_timeout_s:
                continue
            inflight.remove(item)
            progressed = True
            done = time.monotonic()
            self.transport.release(item.handle)
            for chunk, nbytes in item.chunks:
                if state == "DONE":
                    self.metrics.stage_transport.observe(done - item.posted)
                    try:
                        self._chunk_done(chunk, nbytes, done)
                    except Exception as e:
                        self.metrics.worker_errors.inc()
                        self.fail(chunk.room, f"completing a chunk failed: {e}", chunk.generation)
                elif state == "ERR":
                    self.fail(
                        chunk.room, "transfer error reported by the transport", chunk.generation
                    )
                else:
                    self.fail(chunk.room, "transfer timed out", chunk.generation)
        return progressed

    def _chunk_done(self, chunk: Chunk, nbytes: int, done: float) -> None:
        """A chunk's write was seen done at ``done`` (``time.monotonic()``); the room's
        last one observes the ``notify`` stage when the room succeeds."""
        self.metrics.bytes.inc(nbytes)
        with self._lock:
            r = self._rooms.get(chunk.room)
            if r is None or r.generation != chunk.generation:
                return
            r.chunks_done += 1
            r.bytes += nbytes
            r.progress_at = time.monotonic()
            if (
                r.last_chunk is not None
                and r.chunks_done == r.last_chunk + 1
                and self._set(r, RoomStatus.SUCCESS)
            ):
                self.metrics.stage_notify.observe(time.monotonic() - done)

    # -- decode --------------------------------------------------------------------------------

    def register_room(
        self, room: int, prefill_address: str, dst_pages: Sequence[int], aux_index: int
    ) -> Room:
        """Decode: expect a room; returns it (Bootstrapping) with its new generation."""
        self._require("decode")
        if not prefill_address:
            raise InvalidArgument("prefill_address is required", field="prefill_address")
        if not dst_pages:
            raise InvalidArgument("no destination pages", field="dst_page_indices")
        self.pool.check_pages(dst_pages, "dst_page_indices")
        if self.pool.geometry.aux_count:
            self.pool.check_aux(aux_index, "aux_index")
        with self._lock:
            old = self._rooms.get(room)
            if old is not None:
                if old.status not in TERMINAL:
                    raise AlreadyExists(f"room {room} is in use; clear it first", field="room")
                del self._rooms[room]
                self._forget(old)
            gen = _new_generation(old.generation if old is not None else 0)
            r = self._new_room(room, gen, RoomStatus.BOOTSTRAPPING, time.monotonic())
            r.dst_pages = list(dst_pages)
            r.aux_index = aux_index
            r.peer = prefill_address
            return dataclasses.replace(r, span=None)

    def bootstrap_done(
        self, room: int, generation: int, error: str = "", peer_agent: str | None = None
    ) -> None:
        """Decode: the prefill side accepted (``error`` empty) or refused the bootstrap.

        ``peer_agent`` is the prefill sidecar's transport agent named in its
        answer (``BootstrapResponse.agent_name``): from now on only its
        notifications count for the room, and those that arrived before (held)
        are replayed; the others are counted as foreign and dropped. ``None``
        does not check agents (the server always passes the name, and fails the
        bootstrap of an answer without one).
        """
        with self._lock:
            r = self._rooms.get(room)
            if r is None or r.generation != generation:
                return
            early, r.early = r.early, []
            if error:
                self._set(r, RoomStatus.FAILED, f"bootstrap failed: {error}")
                return
            r.peer_agent = peer_agent
            r.bootstrapped = True
            self._set(r, RoomStatus.WAITING_FOR_INPUT)
            self._changed.notify_all()  # writes held for this answer may be judged now
            for agent, tag in early:
                self._arrived(agent, tag)

    def on_notification(self, peer: str, data: bytes) -> None:
        """Decode: a write from agent ``peer`` landed. Tags of another generation, and
        tags from another agent than the room's prefill sidecar, are ignored."""
        tags = decode_tags(data)
        if tags is None:
            self.metrics.stale_notifications.inc()
            self.metrics.refuse("malformed")
            return
        with self._lock:
            for tag in tags:
                self._arrived(peer, tag)

    def _foreign(self, agent: str, room: int) -> None:
        self.metrics.foreign_notifications.inc()
        self.metrics.refuse("foreign_agent")
        now = time.monotonic()
        if now - self._last_foreign_log >= 10.0:  # at most one line per 10 s
            self._last_foreign_log = now
            log.warning(
                "room %d: ignored a notification from agent %r, not the room's prefill sidecar",
                room,
                agent,
            )

    def _arrived(self, agent: str, tag: Tag) -> None:
        m = self.metrics
        r = self._rooms.get(tag.room)
        if r is None or r.generation != tag.generation or r.status in TERMINAL:
            m.stale_notifications.inc()
            m.refuse("stale_generation")
            return
        if r.status == RoomStatus.BOOTSTRAPPING and not r.bootstrapped:
            # The prefill side answered Bootstrap and wrote at once; its answer,
            # naming its agent, is not processed yet. Hold the tag (a room has
            # at most one chunk per page, plus an empty last one).
            if len(r.early) > len(r.dst_pages):
                self._foreign(agent, tag.room)
            else:
                r.early.append((agent, tag))
            return
        if r.peer_agent is not None and agent != r.peer_agent:
            self._foreign(agent, tag.room)
            return
        if tag.chunk in r.chunk_ids:
            m.stale_notifications.inc()
            return
        now = time.monotonic()
        if r.first_send is None:
            r.first_send = now
        r.chunk_ids.add(tag.chunk)
        r.progress_at = now
        if tag.flags & FLAG_LAST:
            r.last_chunk = tag.n_chunks - 1
        if tag.flags & FLAG_AUX:
            r.aux_done = True
        if r.status < RoomStatus.TRANSFERRING:
            self._set(r, RoomStatus.TRANSFERRING)
        need_aux = self.pool.geometry.aux_count > 0
        if (
            r.last_chunk is not None
            and len(r.chunk_ids) == r.last_chunk + 1
            and all(i in r.chunk_ids for i in range(r.last_chunk + 1))
            and (r.aux_done or not need_aux)
        ):
            g = self.pool.geometry
            r.bytes = len(r.dst_pages) * g.page_size + (g.aux_size if need_aux else 0)
            m.bytes.inc(r.bytes)
            self._set(r, RoomStatus.SUCCESS)

    def authorize_write(self, agent: str, data: bytes, runs: Sequence[tuple[int, int]]) -> str:
        """Decode: may ``agent`` write ``runs`` ``(offset, length)`` tagged ``data``?
        ``""`` if so, else why not (the transport then drops the bytes unwritten);
        a refusal is counted under its reason and logged.

        A write may only touch the destination pages (and, flagged, the aux
        slot) of the rooms its tags name, each of the current generation,
        unfinished, and bootstrapped with ``agent``. A write for a room whose
        Bootstrap answer (naming its agent) has not been processed yet waits
        for it, at most ``bootstrap_timeout_s``: until then no agent is known
        to be the room's, so nothing may land in its pages.
        """
        verdict = self._write_refusal(agent, data, runs)
        if verdict is None:
            return ""
        reason, why = verdict
        self.metrics.refused_writes.inc()
        self.metrics.refuse(reason)
        now = time.monotonic()
        with self._lock:
            if now - self._last_refusal_log >= 10.0:  # at most one line per 10 s
                self._last_refusal_log = now
                log.warning("refused a write from agent %r: %s", agent, why)
        return why

    def _write_refusal(
        self, agent: str, data: bytes, runs: Sequence[tuple[int, int]]
    ) -> tuple[str, str] | None:
        """``(reason, why)`` a write is refused, ``None`` when it may land."""
        tags = decode_tags(data)
        if tags is None:
            return "malformed", "not a kvmesh notification"
        g = self.pool.geometry
        for off, n in runs:
            if off < 0 or n <= 0 or off + n > g.total_bytes:
                return "out_of_range", f"run at {off} ({n} bytes) is outside the pool"
        deadline = time.monotonic() + self.config.bootstrap_timeout_s
        with self._lock:
            while True:
                verdict = self._judge_write(agent, tags, runs)
                if verdict != "wait":
                    return verdict if isinstance(verdict, tuple) else None
                left = deadline - time.monotonic()
                if left <= 0:
                    return "foreign_agent", "no Bootstrap answer named the room's agent in time"
                self._changed.wait(left)

    def _judge_write(
        self, agent: str, tags: Sequence[Tag], runs: Sequence[tuple[int, int]]
    ) -> tuple[str, str] | str | None:
        """Lock held: the refusal of a write, ``None`` to allow it, or ``"wait"`` while a
        tagged room's Bootstrap answer is still to come."""
        g = self.pool.geometry
        pages: set[int] = set()
        aux: set[int] = set()
        for t in tags:
            r = self._rooms.get(t.room)
            if r is None or r.generation != t.generation or r.status in TERMINAL:
                return (
                    "stale_generation",
                    f"room {t.room} generation {t.generation} is not expected",
                )
            if r.status == RoomStatus.BOOTSTRAPPING and not r.bootstrapped:
                return "wait"
            if r.peer_agent is not None and r.peer_agent != agent:
                return "foreign_agent", f"room {t.room} was bootstrapped with another agent"
            pages.update(r.dst_pages)
            if t.flags & FLAG_AUX and g.aux_count:
                aux.add(g.kv_bytes + r.aux_index * g.aux_size)
        ps = g.page_size
        for off, n in runs:
            if off in aux and n == g.aux_size:
                continue
            if off % ps or n % ps:
                return "outside_room", f"run at {off} ({n} bytes) is not whole pages of a room"
            first = off // ps
            if any(p not in pages for p in range(first, first + n // ps)):
                return (
                    "outside_room",
                    f"run at {off} ({n} bytes) is outside the tagged rooms' pages",
                )
        return None

    def _refuse_every_write(self, agent: str, data: bytes, runs: Sequence[tuple[int, int]]) -> str:
        """Prefill: the write check of the TCP data port. A prefill sidecar only sends and
        never hands its key out; should one arrive, nothing lands."""
        self.metrics.refuse("write_to_prefill")
        now = time.monotonic()
        with self._lock:
            if now - self._last_refusal_log >= 10.0:
                self._last_refusal_log = now
                log.warning("refused a write from agent %r: a prefill sidecar receives none", agent)
        return "a prefill sidecar receives no writes"

    def _require(self, role: str) -> None:
        if self.role != role:
            raise FailedPrecondition(f"this is a {self.role} sidecar; the call needs {role}")

    def room_snapshot(self, room: int) -> Room | None:
        """A copy of a room's record (tests, debugging)."""
        with self._lock:
            r = self._rooms.get(room)
            return None if r is None else dataclasses.replace(r, span=None)
