"""PollRooms: many rooms' states in one call, and a wait that ends when one changes.

Sidecars run in a thread of the test process (TCP backend) on free ports
(tests/grpc/conftest.py). A waiting call must answer when a room changes, not when
its wait ends: each such test waits far longer than the change takes, so a
server that slept out ``wait_ms`` fails it.
"""

from __future__ import annotations

import concurrent.futures
import time
from typing import Any

import grpc
import pytest

from kvmesh.api.xfer.v1 import xfer_pb2 as pb
from kvmesh.api.xfer.v1 import xfer_pb2_grpc as pb_grpc
from kvmesh.errors import InvalidArgument
from lab.bench.xfer_procs import ThreadedSidecar
from tests.grpc.conftest import XFER_AUX, XFER_PAGE, room_until
from xfer.client import XferClient
from xfer.logic import RoomStatus
from xfer.server import MAX_POLL_ROOMS, MAX_POLL_WAIT_MS

#: A wait no test should sit out (s): a change must end it long before.
LONG_WAIT_S = 20.0


def _watchers(side: ThreadedSidecar) -> dict[int, Any]:
    assert side.server is not None
    return side.server.logic._watchers


def test_rooms_are_answered_in_order_and_unknown_ones_as_not_found(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    p, d = sidecars
    with XferClient(p.address) as pc, XferClient(d.address) as dc:
        dc.register_room(1, p.address, [1, 2], 0)
        dc.register_room(2, p.address, [3], 0)
        room_until(dc, 2, RoomStatus.WAITING_FOR_INPUT)
        pc.add_transfer_request(2, [5], (0, 1), True, 1, 0)
        room_until(dc, 2, RoomStatus.SUCCESS)
        got = dc.poll_rooms([2, 99, 1])
        assert [s.room for s in got] == [2, 99, 1]
        assert [s.found for s in got] == [True, False, True]
        assert got[0].status == RoomStatus.SUCCESS and got[0].bytes == XFER_PAGE + XFER_AUX
        assert (got[2].status, got[2].failure_reason) == dc.poll(1)
        assert got[1].status == RoomStatus.FAILED and got[1].bytes == 0


def test_a_wait_ends_when_a_room_finishes(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    p, d = sidecars
    with (
        XferClient(p.address) as pc,
        XferClient(d.address) as dc,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        dc.register_room(3, p.address, [1, 2], 0)
        dc.register_room(4, p.address, [3, 4], 1)
        for room in (3, 4):
            room_until(dc, room, RoomStatus.WAITING_FOR_INPUT)
        t0 = time.monotonic()
        waiting = pool.submit(dc.poll_rooms, [3, 4], LONG_WAIT_S)
        time.sleep(0.3)
        assert not waiting.done()  # nothing terminal, nothing changed: it waits
        pc.add_transfer_request(4, [10, 11], (0, 2), True, 2, 0)
        got = waiting.result(timeout=LONG_WAIT_S)
        assert time.monotonic() - t0 < LONG_WAIT_S / 2
        # Without `known`, a status change of room 4 ends the wait (TRANSFERRING or
        # already SUCCESS); room 3 is as it was.
        assert got[0].status == RoomStatus.WAITING_FOR_INPUT
        assert got[1].status in (RoomStatus.TRANSFERRING, RoomStatus.SUCCESS)
    assert _watchers(d) == {}


def test_a_wait_with_known_statuses_ends_only_on_a_difference(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    p, d = sidecars
    with (
        XferClient(p.address) as pc,
        XferClient(d.address) as dc,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        dc.register_room(5, p.address, [1], 0)
        room_until(dc, 5, RoomStatus.WAITING_FOR_INPUT)
        # Known as BOOTSTRAPPING: it already differs, so the answer is at once.
        t0 = time.monotonic()
        got = dc.poll_rooms([5], LONG_WAIT_S, known=[RoomStatus.BOOTSTRAPPING])
        assert time.monotonic() - t0 < LONG_WAIT_S / 2
        assert got[0].status == RoomStatus.WAITING_FOR_INPUT
        waiting = pool.submit(dc.poll_rooms, [5], LONG_WAIT_S, [RoomStatus.WAITING_FOR_INPUT])
        time.sleep(0.3)
        assert not waiting.done()
        t0 = time.monotonic()
        pc.add_transfer_request(5, [9], (0, 1), True, 0, 0)
        assert waiting.result(timeout=LONG_WAIT_S)[0].status != RoomStatus.WAITING_FOR_INPUT
        assert time.monotonic() - t0 < LONG_WAIT_S / 2
        room_until(dc, 5, RoomStatus.SUCCESS)
        # Without `known`, a finished room answers at once.
        t0 = time.monotonic()
        assert dc.poll_rooms([5], LONG_WAIT_S)[0].status == RoomStatus.SUCCESS
        assert time.monotonic() - t0 < LONG_WAIT_S / 2
    assert _watchers(d) == {}


def test_a_cleared_room_ends_a_wait_and_an_idle_wait_runs_out(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    p, d = sidecars
    with XferClient(d.address) as dc, concurrent.futures.ThreadPoolExecutor(1) as pool:
        dc.register_room(6, p.address, [1], 0)
        room_until(dc, 6, RoomStatus.WAITING_FOR_INPUT)
        t0 = time.monotonic()
        got = dc.poll_rooms([6], 0.4)
        waited = time.monotonic() - t0
        assert 0.35 <= waited < LONG_WAIT_S / 2
        assert got[0].found and got[0].status == RoomStatus.WAITING_FOR_INPUT
        waiting = pool.submit(dc.poll_rooms, [6], LONG_WAIT_S)
        time.sleep(0.3)
        assert not waiting.done()
        t0 = time.monotonic()
        dc.clear(6)
        assert not waiting.result(timeout=LONG_WAIT_S)[0].found
        assert time.monotonic() - t0 < LONG_WAIT_S / 2
    assert _watchers(d) == {}


def test_a_wait_answers_before_the_call_deadline_and_a_cancelled_one_leaves_no_watch(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    p, d = sidecars
    with XferClient(d.address) as dc, grpc.insecure_channel(d.address) as ch:
        dc.register_room(7, p.address, [1], 0)
        room_until(dc, 7, RoomStatus.WAITING_FOR_INPUT)
        stub = pb_grpc.XferServiceStub(ch)
        req = pb.PollRoomsRequest(rooms=[7], wait_ms=MAX_POLL_WAIT_MS)
        t0 = time.monotonic()
        resp = stub.PollRooms(req, timeout=1.0)  # OK with the statuses, not DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 1.0
        assert RoomStatus(resp.rooms[0].status) == RoomStatus.WAITING_FOR_INPUT
        call = stub.PollRooms.future(req, timeout=30)
        deadline = time.monotonic() + 5
        while not _watchers(d) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 7 in _watchers(d)
        call.cancel()
        deadline = time.monotonic() + 5
        while _watchers(d) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert _watchers(d) == {}


@pytest.mark.parametrize(
    ("request_kw", "field"),
    [
        ({"rooms": []}, "rooms"),
        ({"rooms": list(range(MAX_POLL_ROOMS + 1))}, "rooms"),
        ({"rooms": [1], "wait_ms": MAX_POLL_WAIT_MS + 1}, "wait_ms"),
        ({"rooms": [1, 2], "known": [RoomStatus.SUCCESS]}, "known"),
        ({"rooms": [1], "known": [99]}, "known"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar], request_kw: dict[str, Any], field: str
) -> None:
    _, d = sidecars
    with grpc.insecure_channel(d.address) as ch:
        stub = pb_grpc.XferServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.PollRooms(pb.PollRoomsRequest(**request_kw), timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        trailing: dict[str, Any] = dict(e.value.trailing_metadata() or ())  # type: ignore[arg-type]
        assert trailing.get("kvmesh-error-field") == field
    with XferClient(d.address) as dc:
        assert dc.poll_rooms([1])[0].found is False  # the sidecar still serves
        if field == "known":
            with pytest.raises(InvalidArgument):
                dc.poll_rooms([1, 2], known=[RoomStatus.SUCCESS])
