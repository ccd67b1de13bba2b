"""Engine-side client of a transfer sidecar (synchronous; engines' schedulers are).

Status codes map to exceptions with one fixed table (:data:`ERRORS`);
:class:`RoomStatus` values are the proto's and the engines' (Failed=0 …
Success=4). With a :class:`~kvmesh.tls.ClientTLS` the client dials with TLS
(a client certificate for mutual TLS, or a bearer token); when the files
change it opens a new channel for the following calls.

Chunks go one per call (:meth:`XferClient.add_transfer_request`, pipelined by
:meth:`~XferClient.add_transfer_request_nowait`), many in one all-or-nothing
call (:meth:`~XferClient.add_transfer_requests`), or coalesced
(:meth:`~XferClient.add_transfer_request_coalesced`): what callers hand the
client within ``coalesce_window_s`` goes out in one AddTransferRequests call
(at once when every room among those chunks has its last one), and each caller
still gets its own answer.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc

from kvmesh.api.xfer.v1 import xfer_pb2 as pb
from kvmesh.api.xfer.v1 import xfer_pb2_grpc as pb_grpc
from kvmesh.errors import (
    ERROR_FIELD_METADATA,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)
from kvmesh.tls import ChannelFactory, ClientTLS
from xfer.logic import MAX_BATCH_ENTRIES, AlreadyExists, ChunkRequest, RoomState, RoomStatus
from xfer.prefetch import ClaimOutcome, PrefetchState

#: gRPC status -> exception raised by the client.
ERRORS: dict[grpc.StatusCode, type[KvmeshError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
}

#: Default deadline of a call: the sidecar answers from memory, so anything
#: slower means it is stuck or gone.
DEFAULT_TIMEOUT_S = 5.0

#: Longest a ClaimPrefetch without ``timeout_ms`` may wait on the sidecar (the
#: prefetch's deadline, at most the default ``prefetch.max_ttl_s``).
_CLAIM_WAIT_S = 120.0


#: How long a chunk handed to :meth:`XferClient.add_transfer_request_coalesced`
#: waits for others to share its call: a fraction of one call's cost, so a
#: scheduler handing over a step's chunks in a loop sends them in one call.
DEFAULT_COALESCE_WINDOW_S = 0.0005

#: Most chunks one coalesced call carries (the sidecar takes up to
#: :data:`~xfer.logic.MAX_BATCH_ENTRIES`).
DEFAULT_MAX_BATCH = 64


def _field(e: grpc.RpcError) -> str:
    """The offending field the sidecar named in the trailing metadata ("" if none)."""
    if not isinstance(e, grpc.Call):
        return ""
    for k, v in e.trailing_metadata() or ():
        if k == ERROR_FIELD_METADATA:
            return v if isinstance(v, str) else bytes(v).decode("utf-8", "replace")
    return ""


def _raise(e: grpc.RpcError, field: str | None = None) -> KvmeshError:
    """The exception of a failed call; ``field`` renames the offending field the
    sidecar named (the entry's own name for a coalesced chunk)."""
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.INTERNAL
    details = (e.details() if isinstance(e, grpc.Call) else str(e)) or code.name
    named = _field(e)
    if named and details.startswith(f"{named}: "):
        details = details[len(named) + 2 :]
    return ERRORS.get(code, KvmeshError)(details, field=named if field is None else field)


def _entry(field: str) -> tuple[int, str] | None:
    """``(i, rest)`` of a field ``requests[i].rest`` (``None`` for any other)."""
    if not field.startswith("requests["):
        return None
    index, _, rest = field[len("requests[") :].partition("]")
    if not index.isdigit():
        return None
    return int(index), rest.removeprefix(".")


class AddFuture:
    """The pending answer of :meth:`XferClient.add_transfer_request_nowait`."""

    def __init__(self, future: grpc.Future[Any]) -> None:
        self._future = future

    def result(self) -> None:
        """Wait for the sidecar's answer; raise its error as an exception."""
        try:
            self._future.result()
        except grpc.RpcError as e:
            raise _raise(e) from None


def _batch(entries: Sequence[ChunkRequest]) -> pb.AddTransferRequestsRequest:
    """The AddTransferRequests request of ``entries``, built in place (a third cheaper
    than building each entry and copying it in) and field by field (64 one-page
    entries: 67 µs, against 94 with keyword arguments to ``add``)."""
    req = pb.AddTransferRequestsRequest()
    add = req.requests.add
    for room, pages, (start, end), is_last, aux_index, chunk_id in entries:
        m = add()
        m.room = room
        m.page_indices.extend(pages)
        m.index_slice_start = start
        m.index_slice_end = end
        m.chunk_id = chunk_id
        if is_last:
            m.is_last = True
        if aux_index:
            m.aux_index = aux_index
    return req


class CoalescedAdd:
    """The pending answer of :meth:`XferClient.add_transfer_request_coalesced`."""

    def __init__(self) -> None:
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()

    def result(self, timeout: float | None = None) -> None:
        """Wait until the sidecar queued the chunk; raise its error for this chunk (or
        the call's, when the call itself failed) as an exception."""
        self._future.result(timeout)

    def done(self) -> bool:
        """Whether the answer is in."""
        return self._future.done()


class XferClient:
    """A connection to one sidecar. Thread-safe (grpc channels are).

    ``tls``: how to dial (default plaintext); a sidecar with authorization
    expects an identity with role ``engine``. ``coalesce_window_s`` and
    ``max_batch``: how long, and up to how many chunks, chunks handed to
    :meth:`add_transfer_request_coalesced` gather before they go out in one call.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTLS | None = None,
        coalesce_window_s: float = DEFAULT_COALESCE_WINDOW_S,
        max_batch: int = DEFAULT_MAX_BATCH,
    ) -> None:
        if coalesce_window_s < 0:
            raise ValueError(f"coalesce_window_s must be >= 0, not {coalesce_window_s}")
        if not 1 <= max_batch <= MAX_BATCH_ENTRIES:
            raise ValueError(f"max_batch must be in [1, {MAX_BATCH_ENTRIES}], not {max_batch}")
        self.address = address
        self.timeout_s = timeout_s
        self.coalesce_window_s = coalesce_window_s
        self.max_batch = max_batch
        #: AddTransferRequests calls the coalescing sent (a resend counts again).
        self.coalesced_calls = 0
        #: Chunks handed to :meth:`add_transfer_request_coalesced`.
        self.coalesced_chunks = 0
        self._cond = threading.Condition()
        self._pending: list[tuple[ChunkRequest, CoalescedAdd]] = []
        self._pending_since = 0.0
        self._outstanding = 0
        self._closing = False
        self._flusher: threading.Thread | None = None
        self._factory = ChannelFactory(address, tls, what="xfer client")
        self._channel = self._factory.sync_channel()
        self._retired: grpc.Channel | None = None
        self._lock = threading.Lock()
        self._stub_: pb_grpc.XferServiceStub = pb_grpc.XferServiceStub(self._channel)

    @property
    def _stub(self) -> pb_grpc.XferServiceStub:
        with self._lock:
            if self._factory.stale():
                # Rotated certificates: new calls use a new channel; the one before
                # is closed at the next rotation (its calls are long finished).
                if self._retired is not None:
                    self._retired.close()
                self._retired, self._channel = self._channel, self._factory.sync_channel()
                self._stub_ = pb_grpc.XferServiceStub(self._channel)
            return self._stub_

    def register_room(
        self, room: int, prefill_address: str, dst_page_indices: Sequence[int], aux_index: int = 0
    ) -> int:
        """Decode: expect ``room`` from the prefill sidecar at ``prefill_address``;
        returns the room's generation. Bootstrapping continues in the background."""
        req = pb.RegisterRoomRequest(
            room=room,
            prefill_address=prefill_address,
            dst_page_indices=dst_page_indices,
            aux_index=aux_index,
        )
        try:
            resp = self._stub.RegisterRoom(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None
        return int(resp.generation)

    @staticmethod
    def _add_request(
        room: int,
        page_indices: Sequence[int],
        index_slice: tuple[int, int],
        is_last: bool,
        aux_index: int,
        chunk_id: int,
    ) -> pb.AddTransferRequestRequest:
        return pb.AddTransferRequestRequest(
            room=room,
            page_indices=page_indices,
            index_slice_start=index_slice[0],
            index_slice_end=index_slice[1],
            is_last=is_last,
            aux_index=aux_index,
            chunk_id=chunk_id,
        )

    def add_transfer_request(
        self,
        room: int,
        page_indices: Sequence[int],
        index_slice: tuple[int, int],
        is_last: bool,
        aux_index: int = 0,
        chunk_id: int = 0,
    ) -> None:
        """Prefill: queue one chunk; returns once the sidecar has checked and queued it
        (the transfer itself runs in the background: :meth:`poll` follows it)."""
        req = self._add_request(room, page_indices, index_slice, is_last, aux_index, chunk_id)
        try:
            self._stub.AddTransferRequest(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None

    def add_transfer_request_nowait(
        self,
        room: int,
        page_indices: Sequence[int],
        index_slice: tuple[int, int],
        is_last: bool,
        aux_index: int = 0,
        chunk_id: int = 0,
    ) -> AddFuture:
        """Like :meth:`add_transfer_request` without waiting for the sidecar's answer:
        calls are pipelined on the channel. :meth:`AddFuture.result` raises as the
        blocking call would."""
        req = self._add_request(room, page_indices, index_slice, is_last, aux_index, chunk_id)
        return AddFuture(self._stub.AddTransferRequest.future(req, timeout=self.timeout_s))

    def add_transfer_requests(self, entries: Sequence[ChunkRequest]) -> None:
        """Prefill: queue many chunks in one call, all or nothing. Each entry is
        :meth:`add_transfer_request`'s arguments ``(room, page_indices, index_slice,
        is_last, aux_index, chunk_id)``; an error names the first bad entry (field
        ``requests[i]....``) and then no entry was queued."""
        try:
            self._stub.AddTransferRequests(_batch(entries), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None

    def add_transfer_request_coalesced(
        self,
        room: int,
        page_indices: Sequence[int],
        index_slice: tuple[int, int],
        is_last: bool,
        aux_index: int = 0,
        chunk_id: int = 0,
    ) -> CoalescedAdd:
        """Like :meth:`add_transfer_request_nowait`, but the chunks handed to the client
        within ``coalesce_window_s`` (up to ``max_batch``) go out in one
        AddTransferRequests call, sooner once every room among them has its last
        chunk handed over (nothing more of theirs is coming).
        :meth:`CoalescedAdd.result` raises as the single call would: when the
        sidecar refuses one entry, that caller gets the error (its own field name,
        e.g. ``page_indices``) and the others are sent again."""
        entry = (room, page_indices, index_slice, is_last, aux_index, chunk_id)
        answer = CoalescedAdd()
        with self._cond:
            if self._closing:
                raise Unavailable("the client is closed")
            if self._flusher is None:
                self._flusher = threading.Thread(
                    target=self._flush_loop, name="xfer-client-coalesce", daemon=True
                )
                self._flusher.start()
            self.coalesced_chunks += 1
            self._hold([(entry, answer)])
        return answer

    def _hold(self, entries: list[tuple[ChunkRequest, CoalescedAdd]]) -> None:
        """Lock held: add ``entries`` to the chunks waiting for the next call."""
        if not self._pending:
            self._pending_since = time.monotonic()
        self._pending.extend(entries)
        if (
            len(self._pending) == len(entries)
            or len(self._pending) >= self.max_batch
            or any(e[3] for e, _ in entries)  # a last chunk: the call may be whole
        ):
            self._cond.notify_all()  # the flusher (close may wait on it too)

    def _whole(self) -> bool:
        """Lock held: whether every room with a chunk waiting has its last chunk
        waiting too. Then nothing more of those rooms is coming and the call goes
        at once: an engine handing over whole rooms (a prefill step's) does not
        wait out the window (0.5 ms of a one-room transfer's 5 here)."""
        last = {e[0] for e, _ in self._pending if e[3]}
        return all(e[0] in last for e, _ in self._pending)

    def _flush_loop(self) -> None:
        while True:
            with self._cond:
                # Closing: runs until the answers are in (a refusal may resend chunks).
                while not self._pending and not (self._closing and not self._outstanding):
                    self._cond.wait()
                if not self._pending:
                    return
                deadline = self._pending_since + self.coalesce_window_s
                while len(self._pending) < self.max_batch and not self._closing:
                    if self._whole():
                        break
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch = self._pending[: self.max_batch]
                del self._pending[: self.max_batch]
                self.coalesced_calls += 1
                self._outstanding += 1
            self._send(batch)

    def _send(self, batch: list[tuple[ChunkRequest, CoalescedAdd]]) -> None:
        req = _batch([e for e, _ in batch])
        try:
            call = self._stub.AddTransferRequests.future(req, timeout=self.timeout_s)
        except Exception as e:  # e.g. the channel closed under us
            self._settle(batch, None, Unavailable(f"AddTransferRequests not sent: {e}"))
            return
        call.add_done_callback(lambda c: self._settle(batch, c, None))

    def _settle(
        self,
        batch: list[tuple[ChunkRequest, CoalescedAdd]],
        call: Any,
        failure: KvmeshError | None,
    ) -> None:
        """Answer a coalesced call's callers; after a refusal naming one entry, that
        entry's caller gets the error and the others wait for the next call."""
        resend: list[tuple[ChunkRequest, CoalescedAdd]] = []
        if failure is None:
            try:
                call.result()
            except grpc.RpcError as e:
                named = _entry(_field(e))
                if named is not None and named[0] < len(batch):
                    index, rest = named
                    batch[index][1]._future.set_exception(_raise(e, rest))
                    resend = batch[:index] + batch[index + 1 :]
                else:
                    for _, answer in batch:
                        answer._future.set_exception(_raise(e))
            else:
                for _, answer in batch:
                    answer._future.set_result(None)
        else:
            for _, answer in batch:
                answer._future.set_exception(failure)
        with self._cond:
            self._outstanding -= 1
            if resend:
                self._hold(resend)
            self._cond.notify_all()

    def poll_bytes(self, room: int) -> tuple[RoomStatus, str, int]:
        """``(status, failure reason, bytes moved so far)`` of a room."""
        try:
            resp = self._stub.Poll(pb.PollRequest(room=room), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None
        return RoomStatus(resp.status), resp.failure_reason, int(resp.bytes)

    def poll_rooms(
        self,
        rooms: Sequence[int],
        wait_s: float = 0.0,
        known: Sequence[RoomStatus] | None = None,
    ) -> list[RoomState]:
        """The states of many rooms in one call, in their order (an unknown room is
        ``found`` False). With ``wait_s`` the sidecar answers once one room is gone,
        or differs from ``known`` (the statuses last seen, one per room), or, without
        ``known``, is terminal or changes status; at the latest after ``wait_s``.
        The call's deadline is the client's timeout past the wait."""
        req = pb.PollRoomsRequest(
            rooms=rooms,
            wait_ms=max(0, round(wait_s * 1e3)),
            known=[int(k) for k in known] if known is not None else [],  # type: ignore[misc]
        )
        try:
            resp = self._stub.PollRooms(req, timeout=self.timeout_s + wait_s)
        except grpc.RpcError as e:
            raise _raise(e) from None
        return [
            RoomState(s.room, s.found, RoomStatus(s.status), s.failure_reason, int(s.bytes))
            for s in resp.rooms
        ]

    def poll(self, room: int) -> tuple[RoomStatus, str]:
        """``(status, failure reason)`` of a room; :class:`NotFound` if unknown."""
        try:
            resp = self._stub.Poll(pb.PollRequest(room=room), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None
        return RoomStatus(resp.status), resp.failure_reason

    def clear(self, room: int) -> None:
        """Forget a room (decode: an unfinished room is aborted on prefill)."""
        try:
            self._stub.Clear(pb.ClearRequest(room=room), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None

    def prefetch(
        self,
        source_address: str,
        src_page_indices: Sequence[int],
        dst_page_indices: Sequence[int],
        *,
        prefetch_id: int = 0,
        ttl_ms: int = 0,
        deadline_ms: int = 0,
    ) -> tuple[int, PrefetchState]:
        """Decode (a router or the engine): start pulling ``src_page_indices`` of the
        sidecar at ``source_address`` into ``dst_page_indices``; returns ``(prefetch id,
        state)`` once the source accepted the read (the bytes land in the background)."""
        req, timeout = self._prefetch_request(
            source_address, src_page_indices, dst_page_indices, prefetch_id, ttl_ms, deadline_ms
        )
        try:
            resp = self._stub.Prefetch(req, timeout=timeout)
        except grpc.RpcError as e:
            raise _raise(e) from None
        return int(resp.prefetch_id), PrefetchState(resp.state)

    def prefetch_nowait(
        self,
        source_address: str,
        src_page_indices: Sequence[int],
        dst_page_indices: Sequence[int],
        *,
        prefetch_id: int,
        ttl_ms: int = 0,
        deadline_ms: int = 0,
    ) -> grpc.Future[Any]:
        """:meth:`prefetch` without waiting for the answer (a router issuing it ahead of
        dispatch); the future's ``result()`` raises ``grpc.RpcError`` on a refusal."""
        req, timeout = self._prefetch_request(
            source_address, src_page_indices, dst_page_indices, prefetch_id, ttl_ms, deadline_ms
        )
        return self._stub.Prefetch.future(req, timeout=timeout)

    def _prefetch_request(
        self,
        source_address: str,
        src_page_indices: Sequence[int],
        dst_page_indices: Sequence[int],
        prefetch_id: int,
        ttl_ms: int,
        deadline_ms: int,
    ) -> tuple[pb.PrefetchRequest, float]:
        """A Prefetch request and its call's timeout (past the pull's own deadline)."""
        req = pb.PrefetchRequest(
            prefetch_id=prefetch_id,
            source_address=source_address,
            src_page_indices=src_page_indices,
            dst_page_indices=dst_page_indices,
            ttl_ms=ttl_ms,
            deadline_ms=deadline_ms,
        )
        return req, max(self.timeout_s, deadline_ms / 1000 + 1.0)

    def cancel_prefetch(self, prefetch_id: int) -> PrefetchState:
        """Stop a prefetch and release its pages; returns its state before the cancel."""
        req = pb.CancelPrefetchRequest(prefetch_id=prefetch_id)
        try:
            resp = self._stub.CancelPrefetch(req, timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None
        return PrefetchState(resp.prior_state)

    def claim_prefetch(
        self, prefetch_id: int, *, timeout_ms: int = 0, fallback: bool = True
    ) -> tuple[ClaimOutcome, PrefetchState, str, int]:
        """Decode engine: the request arrived; take the prefetched pages. Returns
        ``(outcome, state as the claim arrived, failure reason, bytes)``; with
        ``fallback`` a prefetch that did not complete is pulled again."""
        req = pb.ClaimPrefetchRequest(
            prefetch_id=prefetch_id, timeout_ms=timeout_ms, fallback=fallback
        )
        # The sidecar bounds the claim by timeout_ms (or the prefetch's deadline, at
        # most prefetch.max_ttl_s): the call's own deadline is a margin above that.
        wait_s = timeout_ms / 1000 if timeout_ms else _CLAIM_WAIT_S
        try:
            resp = self._stub.ClaimPrefetch(req, timeout=max(self.timeout_s, wait_s + 1.0))
        except grpc.RpcError as e:
            raise _raise(e) from None
        return (
            ClaimOutcome(resp.outcome),
            PrefetchState(resp.prior_state),
            resp.failure_reason,
            int(resp.bytes),
        )

    def close(self) -> None:
        """Send the chunks still waiting to be coalesced, wait (up to ``timeout_s``)
        for the sidecar's answers to them, and close the channel."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
            deadline = time.monotonic() + self.timeout_s
            while self._pending or self._outstanding:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            for _, answer in self._pending:
                answer._future.set_exception(Unavailable("the client closed before sending"))
            self._pending.clear()
        if self._flusher is not None:
            self._flusher.join(timeout=1.0)
        self._channel.close()
        if self._retired is not None:
            self._retired.close()

    def __enter__(self) -> XferClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
