"""Unary calls keep moving while event work fills a replica's loop on a shared core.

A grpc.aio server (uvloop, the real health service) in a child process whose
loop is kept busy by paced event work: workers that burn the CPU for 0.5 to 3
ms a piece, await 1 ms of I/O (as a Redis apply does) and pace between pieces
with :class:`indexer.pacing.Pacer`. The child shares its core with a process
that only burns CPU (its Redis, another pod). The test sends 150 health checks
a second, open loop, as a router's Matches come, and measures how long they
take.

With one free turn per budget the calls queue for seconds: grpc.aio takes new
calls one at a time, two loop turns each at least, and gets fewer turns a
second than calls arrive. That model must fail the bound; the shipped number
of free turns (:data:`indexer.pacing.FREE_TURNS`) must meet it.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import random
import signal
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from indexer.pacing import FREE_TURNS, Pacer

#: Calls a second, and how long they are sent.
RATE = 150
SECONDS = 4.0
#: Workers of the child's event work.
WORKERS = 64
#: Median call time the shipped pacing must stay under. On a 2-core machine
#: the broken model's median was 1.8 to 2.6 s, the shipped one's 7 ms, with the
#: client's core idle or busy (3 runs). At 100 calls a second the broken
#: model's median fell to 0.14 to 0.25 s when the client's core was busy.
BOUND_S = 0.25


def _burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _server(port: int, free_turns: int, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    import uvloop

    async def main() -> None:
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        pacer = Pacer(free_turns=free_turns)
        rng = random.Random(7)

        async def worker() -> None:
            while True:
                await pacer.pace()
                _burn(rng.uniform(0.0005, 0.003))
                await asyncio.sleep(0.001)

        tasks = [asyncio.ensure_future(worker()) for _ in range(WORKERS)]
        await server.wait_for_termination()
        for t in tasks:
            t.cancel()

    uvloop.run(main())


def _hog(cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    while True:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def _busy_server(free_turns: int) -> Iterator[int]:
    """The child server and its neighbour on one core; yields the server's port."""
    ctx = mp.get_context("spawn")
    cpus = sorted(os.sched_getaffinity(0))
    # The server and the neighbour share the first core; the test's client
    # runs on the others (when there are any).
    cpu = cpus[0] if len(cpus) > 1 else None
    port = _free_port()
    procs = [
        ctx.Process(target=_server, args=(port, free_turns, cpu), daemon=True),
        ctx.Process(target=_hog, args=(cpu,), daemon=True),
    ]
    if cpu is not None:
        os.sched_setaffinity(0, set(cpus[1:]))
    try:
        for p in procs:
            p.start()
        yield port
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5)
        os.sched_setaffinity(0, set(cpus))


async def _call_times(port: int) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        deadline = time.monotonic() + 20
        while True:  # the child is serving
            try:
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=1)
                break
            except grpc.aio.AioRpcError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # the workers are running
        times: list[float] = []

        async def one() -> None:
            t = time.perf_counter()
            await stub.Check(health_pb2.HealthCheckRequest(), timeout=30)
            times.append(time.perf_counter() - t)

        calls = []
        start = time.perf_counter()
        n = int(RATE * SECONDS)
        for i in range(n):
            calls.append(asyncio.ensure_future(one()))
            await asyncio.sleep(max(0.0, start + (i + 1) / RATE - time.perf_counter()))
        await asyncio.gather(*calls)
        return sorted(times)


def _median_call_s(free_turns: int) -> float:
    with _busy_server(free_turns) as port:
        times = asyncio.run(_call_times(port))
    return times[len(times) // 2]


@pytest.mark.timeout(120)
def test_shipped_pacing_keeps_unary_calls_moving() -> None:
    median = _median_call_s(FREE_TURNS)
    assert median < BOUND_S, f"median call {median * 1000:.0f} ms with {FREE_TURNS} free turns"


@pytest.mark.timeout(120)
def test_one_free_turn_lets_unary_calls_queue() -> None:
    """The broken model: the bound above tells it from the shipped one."""
    median = _median_call_s(1)
    assert median >= BOUND_S, f"median call {median * 1000:.0f} ms with one free turn"
