"""Batched submission against real sidecar processes: AddTransferRequests and coalescing.

One pair of ``kvmesh xfer serve`` processes (TCP transport) serves the whole
module; the test process plays both engines as tests/integration/test_xfer_processes.py
does and verifies every page byte for byte. A batch is all or nothing: a
refused batch leaves the decode pool untouched and the same chunks are
accepted afterwards (none was recorded). The latency test prints p50/p99 of
64-chunk batched calls next to 64 pipelined single calls; it asserts only a
loose bound, the figures are for the performance notes.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from collections.abc import Iterator

import pytest

from kvmesh.errors import InvalidArgument
from tests.integration.xfer_pair import SidecarPair, chunks, sidecar_pair, wait
from xfer.client import XferClient
from xfer.logic import MAX_BATCH_ENTRIES, ChunkRequest, RoomStatus
from xfer.pool import PoolGeometry

GEO = PoolGeometry(page_size=4096, page_count=1024, aux_size=64, aux_count=16)


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarPair]:
    with sidecar_pair(tmp_path_factory, GEO, tag="batch", waiting_timeout_s=60) as p:
        yield p


def test_a_batch_of_64_chunks_moves_every_byte(pair: SidecarPair) -> None:
    rng = random.Random(5)
    # Two rooms of 32 chunks (2 pages each) in one call, interleaved; fragmented pages.
    dst = rng.sample(range(GEO.page_count), 128)
    src = rng.sample(range(GEO.page_count), 128)
    pair.register(10, dst[:64], 1)
    pair.register(11, dst[64:], 2)
    a, b = chunks(10, src[:64], 2, 3), chunks(11, src[64:], 2, 4)
    batch = [e for ab in zip(a, b, strict=True) for e in ab]
    assert len(batch) == 64
    pair.pc.add_transfer_requests(batch)
    for room in (10, 11):
        wait(pair.dc, room, {RoomStatus.SUCCESS})
        wait(pair.pc, room, {RoomStatus.SUCCESS})
    assert pair.same(src[:64], dst[:64], 3, 1)
    assert pair.same(src[64:], dst[64:], 4, 2)
    assert pair.pc.poll_bytes(10)[2] == 64 * GEO.page_size + GEO.aux_size
    for room in (10, 11):
        pair.dc.clear(room)
        pair.pc.clear(room)


#: Entry 5 of a 16-chunk batch (2 pages a chunk, 32 destination pages) made bad, and
#: the field the refusal names.
BAD_ENTRIES: dict[str, tuple[ChunkRequest, str]] = {
    # A page outside the prefill pool (a forged index).
    "forged_page": ((0, [110, GEO.page_count], (10, 12), False, 6, 5), "page_indices"),
    # A slice longer than its pages.
    "slice_length": ((0, [110, 111], (10, 13), False, 6, 5), "page_indices"),
    # Entry 5 repeats entry 4's chunk id: only a check across the batch sees it.
    "repeated_id": ((0, [110, 111], (10, 12), False, 6, 4), "chunk_id"),
    # A slice past the room's destination pages (a check of the bootstrapped room).
    "past_the_room": ((0, [110, 111], (31, 33), False, 6, 5), "index_slice_end"),
}


@pytest.mark.parametrize("case", sorted(BAD_ENTRIES))
def test_one_bad_entry_refuses_the_whole_batch(pair: SidecarPair, case: str) -> None:
    room = 20 + sorted(BAD_ENTRIES).index(case)
    dst = list(range(600, 632))
    src = list(range(100, 132))
    pair.register(room, dst, 5)
    before = bytes(pair.decode.view[600 * GEO.page_size : 632 * GEO.page_size])
    good = chunks(room, src, 2, 6)  # 16 chunks
    entry, field = BAD_ENTRIES[case]
    bad = [*good[:5], (room, *entry[1:]), *good[6:]]
    with pytest.raises(InvalidArgument) as e:
        pair.pc.add_transfer_requests(bad)
    assert e.value.field == f"requests[5].{field}", str(e.value)
    assert str(e.value).startswith(f"requests[5].{field}: ")
    time.sleep(0.2)  # a write of an accepted entry would have landed by now
    assert bytes(pair.decode.view[600 * GEO.page_size : 632 * GEO.page_size]) == before
    assert pair.pc.poll_bytes(room) == (RoomStatus.WAITING_FOR_INPUT, "", 0)
    assert pair.dc.poll_bytes(room) == (RoomStatus.WAITING_FOR_INPUT, "", 0)
    # None of the entries was recorded: the very same good ones are accepted now.
    pair.pc.add_transfer_requests(good)
    wait(pair.dc, room, {RoomStatus.SUCCESS})
    assert pair.same(src, dst, 6, 5)
    pair.dc.clear(room)
    pair.pc.clear(room)


def test_a_batch_over_the_cap_or_empty_is_refused(pair: SidecarPair) -> None:
    over = [
        (30, [i % GEO.page_count], (i, i + 1), False, 0, i) for i in range(MAX_BATCH_ENTRIES + 1)
    ]
    for batch in (over, []):
        with pytest.raises(InvalidArgument) as e:
            pair.pc.add_transfer_requests(batch)
        assert e.value.field == "requests", str(e.value)
    # Nothing was recorded for room 30: the cap itself is accepted.
    pair.pc.add_transfer_requests(over[:MAX_BATCH_ENTRIES])
    assert pair.pc.poll(30)[0] == RoomStatus.BOOTSTRAPPING
    pair.pc.clear(30)


def test_coalescing_sends_fewer_calls_and_answers_every_caller(pair: SidecarPair) -> None:
    rooms = [40, 41, 42, 43]
    dst = {r: list(range(700 + 16 * i, 716 + 16 * i)) for i, r in enumerate(rooms)}
    src = {r: list(range(200 + 16 * i, 216 + 16 * i)) for i, r in enumerate(rooms)}
    for i, r in enumerate(rooms):
        pair.register(r, dst[r], 8 + i)
    errors: dict[int, list[BaseException | None]] = {}
    with XferClient(pair.ps.address, coalesce_window_s=0.002, max_batch=64) as client:

        def engine(r: int) -> None:
            answers = []
            for e in chunks(r, src[r], 1, r - 40):
                answers.append(client.add_transfer_request_coalesced(*e))
                if r == 41 and e[5] == 3:  # one forged chunk among the others
                    answers.append(
                        client.add_transfer_request_coalesced(
                            r, [GEO.page_count], (3, 4), False, 0, 99
                        )
                    )
            out: list[BaseException | None] = []
            for a in answers:
                try:
                    a.result(timeout=5)
                    out.append(None)
                except InvalidArgument as exc:
                    out.append(exc)
            errors[r] = out

        threads = [threading.Thread(target=engine, args=(r,)) for r in rooms]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=10)
        assert client.coalesced_chunks == 65
        assert 1 <= client.coalesced_calls < client.coalesced_chunks / 4, client.coalesced_calls
        print(f"\ncoalescing: {client.coalesced_chunks} chunks in {client.coalesced_calls} calls")
    for r in rooms:
        failed = [x for x in errors[r] if x is not None]
        if r == 41:
            assert len(failed) == 1 and len(errors[r]) == 17
            assert isinstance(failed[0], InvalidArgument)
            assert failed[0].field == "page_indices", str(failed[0])
            assert errors[r][4] is failed[0]  # the forged chunk's own caller
        else:
            assert failed == [] and len(errors[r]) == 16
        wait(pair.dc, r, {RoomStatus.SUCCESS})
        assert pair.same(src[r], dst[r], r - 40, 8 + rooms.index(r))
        pair.dc.clear(r)
        pair.pc.clear(r)


def test_coalescing_sends_whole_rooms_without_waiting_out_the_window(pair: SidecarPair) -> None:
    # A window far longer than any call: a room's first chunks alone wait it out,
    # and a call whose rooms all have their last chunk goes as soon as it is whole.
    window = 1.0
    dst = {r: list(range(800 + 8 * i, 808 + 8 * i)) for i, r in enumerate((60, 61, 62))}
    src = {r: list(range(100 + 8 * i, 108 + 8 * i)) for i, r in enumerate((60, 61, 62))}
    for i, r in enumerate((60, 61, 62)):
        pair.register(r, dst[r], i)
    with XferClient(pair.ps.address, coalesce_window_s=window, max_batch=64) as client:
        # Two whole rooms, chunk by chunk, interleaved as a prefill step hands them over.
        both = zip(chunks(60, src[60], 2, 5), chunks(61, src[61], 2, 6), strict=True)
        t = time.monotonic()
        answers = [client.add_transfer_request_coalesced(*e) for ab in both for e in ab]
        for a in answers:
            a.result(timeout=5)
        whole = time.monotonic() - t
        assert client.coalesced_calls == 1
        assert whole < window / 2, whole
        # The first half of a room: more of it may come, so it waits for the window.
        head = chunks(62, src[62], 2, 7)
        t = time.monotonic()
        for a in [client.add_transfer_request_coalesced(*e) for e in head[:2]]:
            a.result(timeout=5)
        assert time.monotonic() - t >= window * 0.9
        assert client.coalesced_calls == 2
        for a in [client.add_transfer_request_coalesced(*e) for e in head[2:]]:
            a.result(timeout=5)
    for r, aux in ((60, 5), (61, 6), (62, 7)):
        wait(pair.dc, r, {RoomStatus.SUCCESS})
        assert pair.same(src[r], dst[r], aux, (60, 61, 62).index(r))
        pair.dc.clear(r)
        pair.pc.clear(r)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def test_batched_call_latency_for_64_chunks(pair: SidecarPair) -> None:
    """p50/p99 of one 64-chunk AddTransferRequests call vs 64 pipelined single calls.

    One room of 256 destination pages takes every chunk (slices may repeat; chunk
    ids do not), so the chunks are queued and written as in service."""
    room = 50
    dst = list(range(256, 512))
    pair.register(room, dst, 0)
    rng = random.Random(9)
    next_id = 0

    def batch() -> list[ChunkRequest]:
        nonlocal next_id
        out: list[ChunkRequest] = []
        for _ in range(64):
            s = rng.randrange(0, 255)
            out.append((room, [rng.randrange(GEO.page_count)], (s, s + 1), False, 0, next_id))
            next_id += 1
        return out

    for _ in range(20):  # warm up both paths
        pair.pc.add_transfer_requests(batch())
    batched: list[float] = []
    for _ in range(200):
        b = batch()
        t0 = time.perf_counter()
        pair.pc.add_transfer_requests(b)
        batched.append(time.perf_counter() - t0)
    single: list[float] = []
    for _ in range(50):
        b = batch()
        t0 = time.perf_counter()
        for f in [pair.pc.add_transfer_request_nowait(*e) for e in b]:
            f.result()
        single.append(time.perf_counter() - t0)
    ms = 1e3
    print(
        f"\n64 chunks, one AddTransferRequests call: p50 {_pct(batched, 0.5) * ms:.3f} ms, "
        f"p99 {_pct(batched, 0.99) * ms:.3f} ms, mean {statistics.fmean(batched) * ms:.3f} ms "
        f"({len(batched)} calls)\n"
        f"64 chunks, 64 pipelined AddTransferRequest calls: p50 {_pct(single, 0.5) * ms:.3f} "
        f"ms, p99 {_pct(single, 0.99) * ms:.3f} ms ({len(single)} rounds)"
    )
    assert _pct(batched, 0.99) < 0.05
    assert pair.pc.poll(room)[0] in (RoomStatus.TRANSFERRING, RoomStatus.WAITING_FOR_INPUT)
    pair.dc.clear(room)
    pair.pc.clear(room)
