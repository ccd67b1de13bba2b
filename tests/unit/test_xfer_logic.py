"""xfer logic without network: runs, tags, pool bounds, the status machine, faults.

Two :class:`XferLogic` (prefill, decode) over two pools in temporary files,
joined by an in-memory transport that copies bytes and delivers the tag, so
every rule is checked without sockets or NIXL. Every successful transfer is
verified byte for byte.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvmesh.errors import FailedPrecondition, InvalidArgument, NotFound
from xfer import transport as transport_mod
from xfer.config import PoolSettings, XferConfig
from xfer.logic import AlreadyExists, RoomStatus, XferLogic
from xfer.pool import KVPool, PoolGeometry
from xfer.transport import NixlUnavailable, Transport, XferState
from xfer.wire import FLAG_AUX, FLAG_LAST, Tag, decode_tags, encode_tags, merge_runs

GEO = PoolGeometry(page_size=256, page_count=64, aux_size=32, aux_count=8)


class MemTransport(Transport):
    """Copies runs straight into the peer's pool, then calls its handler."""

    kind = "mem"
    registry: dict[str, MemTransport] = {}

    def __init__(self, pool: KVPool, name: str) -> None:
        super().__init__(pool, name)
        self.peers: set[str] = set()
        self.fail_rooms: set[int] = set()
        self.registry[name] = self

    def start(self) -> None:
        pass

    def metadata(self) -> bytes:
        return self.name.encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        self.peers.add(name)

    def has_peer(self, name: str) -> bool:
        return name in self.peers

    def remove_peer(self, name: str) -> None:
        self.peers.discard(name)

    def post(self, peer: str, runs: Sequence[tuple[int, int, int]], tag: bytes) -> Any:
        tags = decode_tags(tag) or []
        if any(t.room in self.fail_rooms for t in tags):
            raise RuntimeError("injected failure")
        dst = self.registry[peer]
        for s, d, n in runs:
            dst.pool.view[d : d + n] = self.pool.view[s : s + n]
        dst._notify(self.name, tag)
        return object()

    def check(self, handle: Any) -> XferState:
        return "DONE"

    def close(self) -> None:
        pass


def _config(role: str, path: str, **kw: Any) -> XferConfig:
    pool = PoolSettings(
        path=path, page_size=GEO.page_size, page_count=GEO.page_count,
        aux_size=GEO.aux_size, aux_count=GEO.aux_count,
    )  # fmt: skip
    return XferConfig(role=role, pool=pool, metrics_port=0, transport="tcp", **kw)  # type: ignore[arg-type]


class Pair:
    """A prefill and a decode logic joined by :class:`MemTransport`."""

    def __init__(self, tmp: Path, **kw: Any) -> None:
        self.ppool = KVPool.create(str(tmp / "p"), GEO)
        self.dpool = KVPool.create(str(tmp / "d"), GEO)
        self.ppool.view[:] = os.urandom(GEO.total_bytes)
        self.pt = MemTransport(self.ppool, "prefill-agent")
        self.dt = MemTransport(self.dpool, "decode-agent")
        self.prefill = XferLogic(_config("prefill", self.ppool.path, **kw), self.ppool, self.pt)
        self.decode = XferLogic(_config("decode", self.dpool.path, **kw), self.dpool, self.dt)
        self.prefill.start()
        self.decode.start()

    def register(self, room: int, dst: Sequence[int], aux: int = 1, md: bool = True) -> int:
        """Register on decode and bootstrap on prefill (what the server does)."""
        r = self.decode.register_room(room, "prefill:1", dst, aux)
        self.prefill.bootstrap(
            room=room, generation=r.generation, dst_pages=dst, aux_index=aux,
            peer_name="decode-agent", peer_address="decode:1",
            metadata=b"md" if md else b"", geometry=GEO, transport_kind="mem",
        )  # fmt: skip
        self.decode.bootstrap_done(room, r.generation)
        return r.generation

    def wait(self, logic: XferLogic, room: int, timeout: float = 5.0) -> RoomStatus:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            st = logic.poll(room)[0]
            if st in (RoomStatus.SUCCESS, RoomStatus.FAILED):
                return st
            time.sleep(0.001)
        return logic.poll(room)[0]

    def same(self, src: Sequence[int], dst: Sequence[int], aux_src: int, aux_dst: int) -> bool:
        pages = all(
            bytes(self.ppool.page(s)) == bytes(self.dpool.page(d))
            for s, d in zip(src, dst, strict=True)
        )
        return pages and bytes(self.ppool.aux(aux_src)) == bytes(self.dpool.aux(aux_dst))

    def close(self) -> None:
        self.prefill.stop()
        self.decode.stop()
        self.ppool.close()
        self.dpool.close()


@pytest.fixture
def pair(tmp_path: Path) -> Iterator[Pair]:
    p = Pair(tmp_path)
    yield p
    p.close()


# -- pure helpers -------------------------------------------------------------------------


def test_merge_runs_contiguous_on_both_sides() -> None:
    assert merge_runs([1, 2, 3, 7, 8], [10, 11, 12, 20, 22]) == [(1, 10, 3), (7, 20, 1), (8, 22, 1)]
    assert merge_runs([5, 4], [1, 2]) == [(5, 1, 1), (4, 2, 1)]
    assert merge_runs([], []) == []
    with pytest.raises(ValueError):
        merge_runs([1], [1, 2])


def test_merge_runs_matches_per_page_pairs() -> None:
    rng = random.Random(3)
    for _ in range(200):
        n = rng.randint(1, 30)
        src = [rng.choice([i, i + 1]) + 2 * i for i in range(n)]
        dst = rng.sample(range(100), n)
        pairs = [(s + k, d + k) for s, d, c in merge_runs(src, dst) for k in range(c)]
        assert pairs == list(zip(src, dst, strict=True))


def test_tags_round_trip_single_and_multi() -> None:
    a = Tag(1, 2, 3, FLAG_LAST | FLAG_AUX, 4)
    b = Tag(2**63, 2**40, 0)
    assert Tag.decode(a.encode()) == a
    assert decode_tags(encode_tags([a])) == [a]
    assert decode_tags(encode_tags([a, b])) == [a, b]
    assert decode_tags(b"other notification") is None
    assert decode_tags(encode_tags([a, b])[:-1]) is None


def test_pool_bounds(tmp_path: Path) -> None:
    pool = KVPool.create(str(tmp_path / "p"), GEO)
    pool.check_pages([0, 63], "x")
    for bad in (-1, 64, 2**40):
        with pytest.raises(InvalidArgument):
            pool.check_pages([bad], "x")
    with pytest.raises(InvalidArgument):
        pool.check_aux(8, "aux")
    with pytest.raises(InvalidArgument):
        KVPool.attach(pool.path, PoolGeometry(256, 128, 32, 8))  # file too small
    pool.close()


# -- transfers ------------------------------------------------------------------------------


def test_chunked_transfer_arrives_byte_for_byte(pair: Pair) -> None:
    src, dst = [3, 4, 5, 9, 10, 40], [7, 8, 9, 30, 31, 2]
    gen = pair.register(1, dst, aux=2)
    assert gen > 0
    assert pair.decode.poll(1)[0] == RoomStatus.WAITING_FOR_INPUT
    pair.prefill.add_transfer_request(1, src[:4], (0, 4), False, 0, 0)
    pair.prefill.add_transfer_request(1, src[4:], (4, 6), True, 5, 1)
    assert pair.wait(pair.decode, 1) == RoomStatus.SUCCESS
    assert pair.wait(pair.prefill, 1) == RoomStatus.SUCCESS
    assert pair.same(src, dst, 5, 2)
    assert pair.prefill.poll(1)[2] == 6 * GEO.page_size + GEO.aux_size


def test_chunks_added_before_bootstrap_are_held(pair: Pair) -> None:
    pair.prefill.add_transfer_request(2, [1, 2], (0, 2), True, 0, 0)
    assert pair.prefill.poll(2)[0] == RoomStatus.BOOTSTRAPPING
    pair.register(2, [5, 6], aux=0)
    assert pair.wait(pair.decode, 2) == RoomStatus.SUCCESS
    assert pair.same([1, 2], [5, 6], 0, 0)


def test_decode_needs_every_chunk_and_the_aux(pair: Pair) -> None:
    gen = pair.register(3, [1, 2, 3])
    pair.decode.on_notification("x", Tag(3, gen, 1, FLAG_LAST | FLAG_AUX, 2).encode())
    assert pair.decode.poll(3)[0] == RoomStatus.TRANSFERRING  # chunk 0 missing
    pair.decode.on_notification("x", Tag(3, gen, 0).encode())
    assert pair.decode.poll(3)[0] == RoomStatus.SUCCESS
    gen = pair.register(4, [1])
    pair.decode.on_notification("x", Tag(4, gen, 0, FLAG_LAST, 1).encode())
    assert pair.decode.poll(4)[0] == RoomStatus.TRANSFERRING  # aux missing


def test_status_is_forward_only_except_failed(pair: Pair) -> None:
    gen = pair.register(5, [1])
    pair.decode.on_notification("x", Tag(5, gen, 0, FLAG_LAST | FLAG_AUX, 1).encode())
    assert pair.decode.poll(5)[0] == RoomStatus.SUCCESS
    pair.decode.bootstrap_done(5, gen, "late error")  # cannot move a finished room
    assert not pair.decode.fail(5, "too late")
    assert pair.decode.poll(5)[0] == RoomStatus.SUCCESS
    gen = pair.register(6, [1])
    assert pair.decode.fail(6, "because")
    pair.decode.on_notification("x", Tag(6, gen, 0, FLAG_LAST | FLAG_AUX, 1).encode())
    assert pair.decode.poll(6)[:2] == (RoomStatus.FAILED, "because")


def test_stale_notification_cannot_complete_a_recycled_room(pair: Pair) -> None:
    old = pair.register(7, [1, 2])
    pair.decode.clear(7)
    pair.prefill.clear(7)
    new = pair.register(7, [3, 4])
    assert new != old
    pair.decode.on_notification("x", Tag(7, old, 0, FLAG_LAST | FLAG_AUX, 1).encode())
    assert pair.decode.poll(7)[0] == RoomStatus.WAITING_FOR_INPUT
    assert pair.decode.metrics.stale_notifications._value.get() == 1
    pair.prefill.add_transfer_request(7, [10, 11], (0, 2), True, 3, 0)
    assert pair.wait(pair.decode, 7) == RoomStatus.SUCCESS
    assert pair.same([10, 11], [3, 4], 3, 1)


def test_worker_survives_an_exception_and_fails_only_that_room(pair: Pair) -> None:
    pair.register(8, [1, 2])
    pair.register(9, [3, 4])
    pair.pt.fail_rooms.add(8)
    pair.prefill.add_transfer_request(8, [1, 2], (0, 2), True, 0, 0)
    assert pair.wait(pair.prefill, 8) == RoomStatus.FAILED
    assert "injected failure" in pair.prefill.poll(8)[1]
    pair.prefill.add_transfer_request(9, [5, 6], (0, 2), True, 1, 0)
    assert pair.wait(pair.decode, 9) == RoomStatus.SUCCESS
    assert pair.same([5, 6], [3, 4], 1, 1)


def test_abort_from_decode_fails_the_prefill_room(pair: Pair) -> None:
    gen = pair.register(10, [1, 2])
    assert pair.prefill.abort(10, gen + 1, "wrong generation") is False
    assert pair.prefill.abort(10, gen, "cleared")
    status, reason, _ = pair.prefill.poll(10)
    assert status == RoomStatus.FAILED and "aborted by decode: cleared" in reason
    with pytest.raises(FailedPrecondition):
        pair.prefill.add_transfer_request(10, [1, 2], (0, 2), True, 0, 0)


def test_timeouts(tmp_path: Path) -> None:
    p = Pair(tmp_path, bootstrap_timeout_s=1.0, waiting_timeout_s=2.0)
    try:
        p.decode.register_room(11, "prefill:1", [1], 0)
        p.register(12, [2])
        now = time.monotonic()
        assert p.decode.tick(now + 0.5) == []
        assert [r.room for r in p.decode.tick(now + 1.5)] == [11]
        assert p.decode.poll(11)[:2] == (RoomStatus.FAILED, "bootstrap timed out")
        assert [r.room for r in p.decode.tick(now + 2.5)] == [12]
        assert "waiting" in p.decode.poll(12)[1]
    finally:
        p.close()


def test_dead_peer_fails_its_rooms(pair: Pair) -> None:
    pair.register(13, [1])
    assert pair.prefill.active_peers() == {"decode-agent": "decode:1"}
    assert pair.decode.active_peers() == {"prefill:1": "prefill:1"}
    failed = pair.prefill.peer_failed("decode-agent", "peer gone")
    assert [r.room for r in failed] == [13]
    assert pair.prefill.poll(13)[:2] == (RoomStatus.FAILED, "peer gone")
    assert pair.decode.peer_failed("prefill:1", "peer gone")[0].room == 13


# -- bad input --------------------------------------------------------------------------------


@pytest.mark.parametrize("pages", [[-1], [64], [0, 2**31]])
def test_out_of_range_or_negative_pages_rejected_before_any_write(
    pair: Pair, pages: list[int]
) -> None:
    before = bytes(pair.dpool.view)
    with pytest.raises(InvalidArgument, match="page index"):
        pair.decode.register_room(20, "prefill:1", pages, 0)
    pair.register(21, [1] * len(pages))
    with pytest.raises(InvalidArgument, match="page index"):
        pair.prefill.add_transfer_request(21, pages, (0, len(pages)), True, 0, 0)
    with pytest.raises(InvalidArgument, match="page index"):
        pair.prefill.bootstrap(
            room=22, generation=1, dst_pages=pages, aux_index=0, peer_name="decode-agent",
            peer_address="", metadata=b"", geometry=GEO, transport_kind="mem",
        )  # fmt: skip
    with pytest.raises(InvalidArgument, match="aux"):
        pair.prefill.add_transfer_request(21, [1], (0, 1), True, 99, 0)
    assert bytes(pair.dpool.view) == before


def test_mismatched_counts_rejected(pair: Pair) -> None:
    pair.register(23, [1, 2, 3])
    with pytest.raises(InvalidArgument, match="source pages for"):
        pair.prefill.add_transfer_request(23, [1, 2], (0, 3), True, 0, 0)
    with pytest.raises(InvalidArgument, match="fills destination pages"):
        pair.prefill.add_transfer_request(23, [1, 2], (2, 4), True, 0, 0)


def test_unknown_room(pair: Pair) -> None:
    with pytest.raises(NotFound):
        pair.prefill.poll(404)
    with pytest.raises(NotFound):
        pair.decode.clear(404)


def test_duplicate_bootstrap_rejected(pair: Pair) -> None:
    gen = pair.register(24, [1])
    with pytest.raises(AlreadyExists):
        pair.prefill.bootstrap(
            room=24, generation=gen, dst_pages=[1], aux_index=0, peer_name="decode-agent",
            peer_address="", metadata=b"", geometry=GEO, transport_kind="mem",
        )  # fmt: skip
    with pytest.raises(AlreadyExists):
        pair.decode.register_room(24, "prefill:1", [1], 0)


def test_bootstrap_from_unknown_peer_rejected(pair: Pair) -> None:
    with pytest.raises(FailedPrecondition, match="unknown peer"):
        pair.prefill.bootstrap(
            room=25, generation=1, dst_pages=[1], aux_index=0, peer_name="stranger",
            peer_address="", metadata=b"", geometry=GEO, transport_kind="mem",
        )  # fmt: skip
    with pytest.raises(InvalidArgument, match="page size"):
        pair.prefill.bootstrap(
            room=25, generation=1, dst_pages=[1], aux_index=0, peer_name="decode-agent",
            peer_address="", metadata=b"md", geometry=PoolGeometry(512, 64, 32, 8),
            transport_kind="mem",
        )  # fmt: skip


def test_wrong_role_and_duplicate_chunk(pair: Pair) -> None:
    with pytest.raises(FailedPrecondition, match="needs prefill"):
        pair.decode.add_transfer_request(1, [1], (0, 1), True, 0, 0)
    pair.register(26, [1, 2])
    pair.prefill.add_transfer_request(26, [1], (0, 1), False, 0, 0)
    with pytest.raises(InvalidArgument, match="already added"):
        pair.prefill.add_transfer_request(26, [1], (0, 1), False, 0, 0)


def test_nixl_missing_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real = transport_mod.importlib.import_module

    def fake(name: str, package: str | None = None) -> Any:
        if name.startswith("nixl"):
            raise ImportError(f"No module named {name!r}")
        return real(name, package)

    monkeypatch.setattr(transport_mod.importlib, "import_module", fake)
    assert not transport_mod.nixl_available()
    pool = KVPool.create(str(tmp_path / "p"), GEO)
    with pytest.raises(NixlUnavailable, match=r"pip install --no-deps nixl-cu12.*--transport tcp"):
        transport_mod.make_transport("nixl", pool)
    pool.close()
