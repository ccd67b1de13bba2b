"""Engine-side client of a transfer sidecar (synchronous; engines' schedulers are).

Status codes map to exceptions with one fixed table (:data:`ERRORS`);
:class:`RoomStatus` values are the proto's and the engines' (Failed=0 …
Success=4). With a :class:`~kvmesh.tls.ClientTLS` the client dials with TLS
(a client certificate for mutual TLS, or a bearer token); when the files
change it opens a new channel for the following calls.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from types import TracebackType
from typing import Any

import grpc

from kvmesh.api.xfer.v1 import xfer_pb2 as pb
from kvmesh.api.xfer.v1 import xfer_pb2_grpc as pb_grpc
from kvmesh.errors import (
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
from xfer.logic import AlreadyExists, RoomStatus

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


def _raise(e: grpc.RpcError) -> KvmeshError:
    code = e.code() if isinstance(e, grpc.Call) else grpc.StatusCode.INTERNAL
    details = e.details() if isinstance(e, grpc.Call) else str(e)
    return ERRORS.get(code, KvmeshError)(details or code.name)


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


class XferClient:
    """A connection to one sidecar. Thread-safe (grpc channels are).

    ``tls``: how to dial (default plaintext); a sidecar with authorization
    expects an identity with role ``engine``.
    """

    def __init__(
        self,
        address: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        tls: ClientTLS | None = None,
    ) -> None:
        self.address = address
        self.timeout_s = timeout_s
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

    def poll_bytes(self, room: int) -> tuple[RoomStatus, str, int]:
        """``(status, failure reason, bytes moved so far)`` of a room."""
        try:
            resp = self._stub.Poll(pb.PollRequest(room=room), timeout=self.timeout_s)
        except grpc.RpcError as e:
            raise _raise(e) from None
        return RoomStatus(resp.status), resp.failure_reason, int(resp.bytes)

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

    def close(self) -> None:
        """Close the channel."""
        self._channel.close()
        if self._retired is not None:
            self._retired.close()

    def __enter__(self) -> XferClient:
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
