"""The tee against real HTTP sinks on 127.0.0.1: delivery, faults, bursts, slow vs fast sinks."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable

from lab.bench.testsink import TestSink, start_garbage_server
from tee.events import extend, ingest
from tee.logic import Tee
from tee.metrics import LaneStats
from tee.sinks import HttpSink


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _until(cond: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def _settled(s: LaneStats) -> bool:
    return s.queued == 0 and s.in_flight == 0


async def _offer_checked(tee: Tee, n: int, every: int = 50) -> list[bool]:
    """Offer n events from the loop, checking each answer and that the books balance.

    ``offer`` is a plain function (no await inside), so it cannot wait on a
    sink; its cost is measured by ``kvmesh bench tee``, not asserted here.
    """
    results = []
    for i in range(n):
        ok = tee.offer(ingest("m", list(range(32)), f"r{i}", worker=f"w{i % 3}"))
        assert isinstance(ok, bool)
        results.append(ok)
        if i % every == 0:
            assert all(s.balanced() for s in tee.stats())
            await asyncio.sleep(0)
    return results


async def test_delivers_wire_exactly() -> None:
    sink = await TestSink().start()
    tee = await Tee([HttpSink(sink.url)], concurrency=4).start()
    try:
        assert tee.offer(ingest("m", [1, 2, 3], "req-1", worker="w7"))
        assert tee.offer(extend("m", [1, 2, 3], [4, 5], "req-1", worker="w7"))
        await _until(lambda: tee.stats()[0].sent == 2)
    finally:
        await tee.close(1)
        await sink.stop()
    received = sorted(sink.received, key=lambda r: r[0])
    (p1, b1, h1), (p2, b2, h2) = received
    assert (p1, p2) == ("extend_ids", "ingest_ids")
    assert b2 == {"model": "m", "input_ids": [1, 2, 3], "request_id": "req-1"}
    assert b1["prompt_len"] == 3 and b1["output_tokens"] == 2 and b1["input_ids"][-1] == 5
    assert h2["x-kvmesh-worker"] == "w7" and h2["x-request-id"] == "req-1"
    assert h1["content-type"] == "application/json"


async def _fault_case(
    url: str, expect: str, send_timeout_s: float = 2.0, n: int = 120
) -> LaneStats:
    tee = await Tee([HttpSink(url)], concurrency=8, send_timeout_s=send_timeout_s).start()
    await _offer_checked(tee, n)
    await _until(lambda: _settled(tee.stats()[0]))
    s = tee.stats()[0]
    await tee.close(1)
    assert s.balanced(), s
    assert s.sent == 0 and s.offered == n
    assert getattr(s, f"failed_{expect}") == n, s
    return s


async def test_sink_refused() -> None:
    await _fault_case(f"http://127.0.0.1:{_free_port()}", "error")


async def test_sink_answers_500() -> None:
    sink = await TestSink(status=500, record=False).start()
    try:
        await _fault_case(sink.url, "http")
        assert sink.count == 120
    finally:
        await sink.stop()


async def test_sink_answers_garbage() -> None:
    server, url = await start_garbage_server()
    try:
        await _fault_case(url, "error", n=40)
    finally:
        server.close()


async def test_sink_slow_times_out_and_lane_keeps_going() -> None:
    sink = await TestSink(latency_s=1.0, record=False).start()
    try:
        s = await _fault_case(sink.url, "timeout", send_timeout_s=0.1, n=24)
        assert s.failed_timeout == 24
    finally:
        await sink.stop()


async def test_burst_fills_queue_counts_drops_then_recovers() -> None:
    sink = await TestSink(latency_s=0.005, record=False).start()
    tee = await Tee([HttpSink(sink.url)], concurrency=2, queue_size=100).start()
    try:
        results = [tee.offer(ingest("m", [i])) for i in range(1000)]  # no yield: a burst
        s = tee.stats()[0]
        assert s.dropped_full == results.count(False) == 900 and s.queued == 100
        assert s.balanced()
        await _until(lambda: _settled(tee.stats()[0]))
        assert tee.offer(ingest("m", [1]))  # accepting again
        await _until(lambda: tee.stats()[0].sent == 101)
        assert tee.stats()[0].balanced()
    finally:
        await tee.close(1)
        await sink.stop()
    assert sink.count == 101


async def test_slow_sink_never_stalls_fast_sink() -> None:
    slow = await TestSink(latency_s=0.5, record=False).start()
    fast = await TestSink(record=False).start()
    # Queues large enough that neither lane drops: what is checked is that the
    # fast lane delivers everything while the slow one still holds most of it.
    tee = await Tee(
        [HttpSink(slow.url, name="slow"), HttpSink(fast.url, name="fast")],
        concurrency=2,
        queue_size=500,
    ).start()
    try:
        for i in range(200):
            tee.offer(ingest("m", [i]))
            if i % 5 == 0:
                assert all(s.balanced() for s in tee.stats())
                await asyncio.sleep(0.005)
        await _until(lambda: tee.stats()[1].sent == 200, within_s=10)
        by = {s.sink: s for s in tee.stats()}
        # The slow sink (2 sends of 0.5 s at a time) has delivered a handful.
        assert by["fast"].sent == 200 and by["fast"].dropped == 0
        assert by["slow"].sent < 50 and by["slow"].queued + by["slow"].in_flight > 150
        assert all(s.balanced() for s in by.values())
    finally:
        report = await tee.close(0.2)
        await slow.stop()
        await fast.stop()
    assert not report.drained_in_time and report.abandoned > 0
    slow_final = next(s for s in report.lanes if s.sink == "slow")
    assert slow_final.queued == 0 and slow_final.in_flight == 0 and slow_final.balanced()
    assert tee.offer(ingest("m", [1])) is False  # closed
    assert tee.stats()[0].dropped_closed >= 1


async def test_graceful_close_drains_everything_within_deadline() -> None:
    sink = await TestSink(latency_s=0.01, record=False).start()
    tee = await Tee([HttpSink(sink.url)], concurrency=8).start()
    try:
        for i in range(200):
            tee.offer(ingest("m", [i]))
        report = await tee.close(10)
    finally:
        await sink.stop()
    assert report.drained_in_time and report.abandoned == 0
    assert report.lanes[0].sent == 200 == sink.count


async def test_in_flight_is_bounded_by_concurrency() -> None:
    sink = await TestSink(latency_s=0.05, record=False).start()
    tee = await Tee([HttpSink(sink.url)], concurrency=3).start()
    peak = 0

    async def watch() -> None:
        nonlocal peak
        while True:
            peak = max(peak, tee.stats()[0].in_flight)
            await asyncio.sleep(0.002)

    watcher: Awaitable[None] = asyncio.ensure_future(watch())
    try:
        for i in range(30):
            tee.offer(ingest("m", [i]))
        await _until(lambda: tee.stats()[0].sent == 30)
    finally:
        watcher.cancel()  # type: ignore[attr-defined]
        await tee.close(1)
        await sink.stop()
    assert peak == 3
