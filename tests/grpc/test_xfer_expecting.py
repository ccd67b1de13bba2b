"""A decode sidecar tells its transport when a room is unfinished, so that an
idle NIXL poller can rest (xfer/transport.py, ``NixlTransport.IDLE_POLL_S``);
a prefill sidecar, never notified, rests always.

Sidecars in threads of the test process (TCP: the transport records what it is
told, ``Transport.expecting``). Polling rests only while nothing is unfinished;
a room's first write must never wait for a resting poller.
"""

from __future__ import annotations

import time

from lab.bench.xfer_procs import ThreadedSidecar
from tests.grpc.conftest import room_until
from xfer.client import XferClient
from xfer.logic import RoomStatus


def _expecting(side: ThreadedSidecar) -> bool:
    assert side.server is not None
    return side.server.transport.expecting


def test_expecting_follows_the_unfinished_rooms(
    sidecars: tuple[ThreadedSidecar, ThreadedSidecar],
) -> None:
    p, d = sidecars
    assert not _expecting(p) and not _expecting(d)
    with XferClient(p.address) as pc, XferClient(d.address) as dc:
        dc.register_room(1, p.address, [1, 2], 0)
        dc.register_room(2, p.address, [3], 0)
        assert _expecting(d)  # from the room's creation, before any write
        for room in (1, 2):
            room_until(dc, room, RoomStatus.WAITING_FOR_INPUT)
        assert not _expecting(p)  # rooms on prefill too, but it is never notified
        pc.add_transfer_request(2, [5], (0, 1), True, 1, 0)
        room_until(dc, 2, RoomStatus.SUCCESS)
        assert _expecting(d)  # room 1 is still unfinished
        dc.clear(1)  # an unfinished room cleared (decode aborts it on prefill)
        deadline = time.monotonic() + 10
        while _expecting(d):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # A finished room cleared changes nothing; a new one starts it again.
        dc.clear(2)
        assert not _expecting(d)
        dc.register_room(3, p.address, [4], 0)
        assert _expecting(d)
