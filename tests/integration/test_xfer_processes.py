"""Real sidecar processes moving real bytes, over NIXL and over TCP.

Every test runs on both backends (`make setup` installs NIXL). Each pair is
two ``kvmesh xfer serve`` processes; the test process plays both engines: it
creates the shared-memory pools, registers rooms on decode, adds chunks on
prefill and verifies every page byte for byte. The fault tests kill a sidecar
with SIGKILL mid-transfer.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.bench.xfer_procs import Sidecar, ThreadedSidecar
from xfer.client import XferClient
from xfer.config import PoolSettings, XferConfig
from xfer.logic import RoomStatus
from xfer.pool import KVPool, PoolGeometry
from xfer.transport import nixl_available
from xfer.wire import FLAG_AUX, FLAG_LAST, Tag

GEO = PoolGeometry(page_size=4096, page_count=512, aux_size=64, aux_count=16)
HEARTBEAT_S = 0.5

# Both backends always run: `make setup` installs nixl-cu12 (without torch).
BACKENDS = ["tcp", "nixl"]


def test_nixl_is_installed() -> None:
    """A missing NIXL is an installation error here, not a reason to skip."""
    assert nixl_available(), "nixl-cu12 is not importable: run `make setup`"


def _shm(tmp_path: Path) -> Path:
    d = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    return d


class Pools:
    def __init__(self, tmp_path: Path) -> None:
        tag = f"kvx-test-{os.getpid()}-{random.getrandbits(32):x}"
        base = _shm(tmp_path)
        self.prefill = KVPool.create(str(base / f"{tag}-p"), GEO)
        self.decode = KVPool.create(str(base / f"{tag}-d"), GEO)
        self.prefill.view[:] = os.urandom(GEO.total_bytes)

    def same(self, src: list[int], dst: list[int], aux_src: int, aux_dst: int) -> bool:
        ok = all(
            bytes(self.prefill.page(s)) == bytes(self.decode.page(d))
            for s, d in zip(src, dst, strict=True)
        )
        return ok and bytes(self.prefill.aux(aux_src)) == bytes(self.decode.aux(aux_dst))

    def close(self) -> None:
        for p in (self.prefill, self.decode):
            p.close()
            p.unlink()


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[Pools]:
    p = Pools(tmp_path)
    yield p
    p.close()


def _pair(pools: Pools, transport: str, *extra: str) -> tuple[Sidecar, Sidecar]:
    args = ["--heartbeat-interval-s", str(HEARTBEAT_S), "--waiting-timeout-s", "60", *extra]
    p = Sidecar("prefill", pools.prefill.path, GEO, transport=transport, extra=args)
    d = Sidecar("decode", pools.decode.path, GEO, transport=transport, extra=args)
    try:
        p.wait_ready()
        d.wait_ready()
    except BaseException:
        p.stop()
        d.stop()
        raise
    return p, d


def _wait(client: XferClient, room: int, want: set[RoomStatus], timeout: float = 15.0) -> float:
    """Seconds until ``room`` reaches a status in ``want`` (fails the test on timeout)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st, reason = client.poll(room)
        if st in want:
            return time.monotonic() - t0
        if st == RoomStatus.FAILED:
            pytest.fail(f"room {room} failed: {reason}")
        time.sleep(0.005)
    pytest.fail(f"room {room} stuck in {client.poll(room)}")


@pytest.mark.parametrize("transport", BACKENDS)
def test_rooms_move_byte_for_byte(pools: Pools, transport: str) -> None:
    ps, ds = _pair(pools, transport)
    rng = random.Random(11)
    try:
        with XferClient(ps.address) as pc, XferClient(ds.address) as dc:
            # Fragmented pages, plus one stretch contiguous on both sides (one run).
            rest = [x for x in range(GEO.page_count) if not 100 <= x < 110]
            dst_all = list(range(100, 110)) + rng.sample(rest, 6 * 40 - 10)
            src_all = list(range(300, 310)) + rng.sample(range(GEO.page_count), 6 * 40 - 10)
            rooms = []
            for i in range(6):
                room = 1000 + i
                src, dst = src_all[i * 40 : (i + 1) * 40], dst_all[i * 40 : (i + 1) * 40]
                dc.register_room(room, ps.address, dst, aux_index=i)
                rooms.append((room, src, dst, i + 8, i))
            for room, src, _, aux_src, _ in rooms:  # interleaved chunks, pipelined
                futs = [
                    pc.add_transfer_request_nowait(
                        room, src[c * 10 : (c + 1) * 10], (c * 10, (c + 1) * 10), c == 3, aux_src, c
                    )
                    for c in range(4)
                ]
                for f in futs:
                    f.result()
            for room, src, dst, aux_src, aux_dst in rooms:
                _wait(dc, room, {RoomStatus.SUCCESS})
                _wait(pc, room, {RoomStatus.SUCCESS})
                assert pools.same(src, dst, aux_src, aux_dst)
                dc.clear(room)
                pc.clear(room)
    finally:
        ps.stop()
        ds.stop()


@pytest.mark.parametrize("transport", BACKENDS)
def test_abort_from_decode_fails_the_room_on_prefill(pools: Pools, transport: str) -> None:
    ps, ds = _pair(pools, transport)
    try:
        with XferClient(ps.address) as pc, XferClient(ds.address) as dc:
            dc.register_room(1, ps.address, [1, 2, 3, 4], 0)
            _wait(dc, 1, {RoomStatus.WAITING_FOR_INPUT})
            pc.add_transfer_request(1, [5, 6], (0, 2), False, 0, 0)
            _wait(dc, 1, {RoomStatus.TRANSFERRING})
            dc.clear(1)
            deadline = time.monotonic() + 5
            while pc.poll(1)[0] != RoomStatus.FAILED and time.monotonic() < deadline:
                time.sleep(0.01)
            status, reason = pc.poll(1)
            assert status == RoomStatus.FAILED
            assert "aborted by decode" in reason
    finally:
        ps.stop()
        ds.stop()


@pytest.mark.parametrize("transport", BACKENDS)
@pytest.mark.parametrize("victim", ["decode", "prefill"])
def test_killed_peer_fails_rooms_within_two_heartbeats(
    pools: Pools, transport: str, victim: str
) -> None:
    ps, ds = _pair(pools, transport)
    try:
        with XferClient(ps.address) as pc, XferClient(ds.address) as dc:
            dc.register_room(2, ps.address, list(range(40)), 0)
            _wait(dc, 2, {RoomStatus.WAITING_FOR_INPUT})
            pc.add_transfer_request(2, list(range(100, 120)), (0, 20), False, 0, 0)
            _wait(dc, 2, {RoomStatus.TRANSFERRING})  # mid-transfer: half the pages sent
            survivor = pc if victim == "decode" else dc
            (ds if victim == "decode" else ps).kill()
            t0 = time.monotonic()
            while survivor.poll(2)[0] != RoomStatus.FAILED and time.monotonic() - t0 < 10:
                time.sleep(0.01)
            took = time.monotonic() - t0
            status, reason = survivor.poll(2)
            assert status == RoomStatus.FAILED, reason
            assert "unreachable" in reason or "transfer" in reason
            # Two heartbeat intervals, plus scheduling slack on a loaded host; the
            # waiting timeout (60 s) is far away, so only the heartbeat can do this.
            assert took < 2 * HEARTBEAT_S + 5.0, took
    finally:
        ps.stop()
        ds.stop()


@pytest.mark.parametrize("transport", BACKENDS)
def test_stale_notification_after_room_reuse(pools: Pools, transport: str) -> None:
    """A prefill sidecar in this process writes with the old generation's tag into a
    decode sidecar process: the recycled room must not complete."""
    cfg = XferConfig(
        role="prefill",
        port=0,
        metrics_port=0,
        transport=transport,  # type: ignore[arg-type]
        heartbeat_interval_s=HEARTBEAT_S,
        pool=PoolSettings(
            path=pools.prefill.path,
            page_size=GEO.page_size,
            page_count=GEO.page_count,
            aux_size=GEO.aux_size,
            aux_count=GEO.aux_count,
        ),
    )
    ds = Sidecar("decode", pools.decode.path, GEO, transport=transport)
    try:
        ds.wait_ready()
        with ThreadedSidecar(cfg) as tp, XferClient(tp.address) as pc, XferClient(ds.address) as dc:
            old = dc.register_room(3, tp.address, [1, 2], 0)
            _wait(dc, 3, {RoomStatus.WAITING_FOR_INPUT})
            dc.clear(3)
            pc.clear(3)
            new = dc.register_room(3, tp.address, [4, 5], 1)
            assert new != old
            _wait(dc, 3, {RoomStatus.WAITING_FOR_INPUT})
            server = tp.server
            assert server is not None
            peer = next(iter(server.logic.active_peers()))
            stale = Tag(3, old, 0, FLAG_LAST | FLAG_AUX, 1).encode()
            h = server.transport.post(peer, [(0, GEO.page_size, GEO.page_size)], stale)
            deadline = time.monotonic() + 5
            while server.transport.check(h) == "PROC" and time.monotonic() < deadline:
                time.sleep(0.001)
            server.transport.release(h)
            time.sleep(0.2)  # give the decode side time to (wrongly) act on it
            assert dc.poll(3)[0] == RoomStatus.WAITING_FOR_INPUT
            pc.add_transfer_request(3, [20, 21], (0, 2), True, 2, 0)
            _wait(dc, 3, {RoomStatus.SUCCESS})
            assert pools.same([20, 21], [4, 5], 2, 1)
    finally:
        ds.stop()


def test_without_nixl_the_tcp_backend_still_works(pools: Pools, tmp_path: Path) -> None:
    """NIXL hidden from the sidecars: nixl refuses to start with a clear error, tcp works."""
    shim = tmp_path / "shim"
    shim.mkdir()
    for name in ("nixl_cu12", "nixl"):
        (shim / f"{name}.py").write_text("raise ImportError('hidden by the test')\n")
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join([str(shim), *([old] if old else [])])
    try:
        bad = Sidecar("prefill", pools.prefill.path, GEO, transport="nixl")
        with pytest.raises(RuntimeError, match=r"NIXL is not installed.*--transport tcp"):
            bad.wait_ready()
        bad.stop()
        ps, ds = _pair(pools, "tcp")
    finally:
        if old is None:
            del os.environ["PYTHONPATH"]
        else:
            os.environ["PYTHONPATH"] = old
    try:
        with XferClient(ps.address) as pc, XferClient(ds.address) as dc:
            dc.register_room(4, ps.address, [7, 8, 9], 3)
            pc.add_transfer_request(4, [30, 31, 32], (0, 3), True, 4, 0)
            _wait(dc, 4, {RoomStatus.SUCCESS})
            assert pools.same([30, 31, 32], [7, 8, 9], 4, 3)
    finally:
        ps.stop()
        ds.stop()
