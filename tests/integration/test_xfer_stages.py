"""Where a transfer's time goes: ``kvmesh_xfer_stage_seconds{stage}`` of real sidecars.

One pair of ``kvmesh xfer serve`` processes (TCP transport) with /metrics on
free ports; the test process plays both engines, moves rooms three ways
(single calls, one batched call, chunks added before the room's Bootstrap so
they are held and released by it), verifies the bytes and scrapes both
sidecars. Every written chunk passes queue, submit and transport once, every
room notify once; no observation is longer than the test's own transfer
phase, and the decode side, which writes nothing, observes no stage.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from lab.bench.xfer import StageHistogram, parse_stages
from tests.integration.xfer_pair import SidecarPair, chunks, sidecar_pair, wait
from xfer.logic import STAGES, RoomStatus
from xfer.pool import PoolGeometry

GEO = PoolGeometry(page_size=4096, page_count=512, aux_size=64, aux_count=16)
PAGES = 16  # pages per room
PER = 4  # pages per chunk: 4 chunks a room


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarPair]:
    with sidecar_pair(tmp_path_factory, GEO, tag="stages", waiting_timeout_s=30, metrics=True) as p:
        yield p


def test_every_chunk_and_room_passes_each_stage_once(pair: SidecarPair) -> None:
    before = parse_stages(pair.ps.metrics_text())
    rng = random.Random(11)
    rooms = {"single": [20, 21], "batched": [22, 23], "held": [24, 25]}
    all_rooms = [r for rs in rooms.values() for r in rs]
    dst = rng.sample(range(GEO.page_count), PAGES * len(all_rooms))
    src = rng.sample(range(GEO.page_count), PAGES * len(all_rooms))
    plan = {
        room: (src[i * PAGES : (i + 1) * PAGES], dst[i * PAGES : (i + 1) * PAGES], i, 8 + i)
        for i, room in enumerate(all_rooms)
    }  # room -> (source pages, destination pages, aux source, aux destination)
    t0 = time.monotonic()
    for room in rooms["held"]:  # queued by the Bootstrap that follows, not by the call
        s, _, aux_src, _ = plan[room]
        pair.pc.add_transfer_requests(chunks(room, s, PER, aux_src))
    for room in all_rooms:
        _, d, _, aux_dst = plan[room]
        pair.dc.register_room(room, pair.ps.address, d, aux_index=aux_dst)
    for room in rooms["single"] + rooms["batched"]:
        wait(pair.dc, room, {RoomStatus.WAITING_FOR_INPUT})
    for room in rooms["single"]:
        s, _, aux_src, _ = plan[room]
        for entry in chunks(room, s, PER, aux_src):
            pair.pc.add_transfer_request(*entry)
    pair.pc.add_transfer_requests(
        [e for room in rooms["batched"] for e in chunks(room, plan[room][0], PER, plan[room][2])]
    )
    for room in all_rooms:
        wait(pair.dc, room, {RoomStatus.SUCCESS})
        wait(pair.pc, room, {RoomStatus.SUCCESS})
    wall = time.monotonic() - t0
    for room in all_rooms:
        s, d, aux_src, aux_dst = plan[room]
        assert pair.same(s, d, aux_src, aux_dst), room

    after = parse_stages(pair.ps.metrics_text())
    moved = {s: after[s].minus(before[s]) for s in STAGES}
    n_chunks = len(all_rooms) * PAGES // PER
    want = {"queue": n_chunks, "submit": n_chunks, "transport": n_chunks}
    want["notify"] = len(all_rooms)
    for stage, h in moved.items():
        assert h.count == want[stage], (stage, h)
        assert h.buckets[-1] == (float("inf"), h.count), (stage, h.buckets)
        assert h.total > 0, stage
        # Seconds on one clock: no observation outlasts the transfer phase itself.
        assert h.total <= h.count * wall, (stage, h.total, wall)
        assert h.quantile(0.5) > 0, stage
    for room in all_rooms:
        pair.dc.clear(room)
        pair.pc.clear(room)


def test_decode_side_observes_no_stage(pair: SidecarPair) -> None:
    # Runs after the transfers above: the decode sidecar received every room.
    decode = parse_stages(pair.ds.metrics_text())
    assert decode == {s: StageHistogram(0.0, 0.0, decode[s].buckets) for s in STAGES}
    assert len(decode["queue"].buckets) > 1
