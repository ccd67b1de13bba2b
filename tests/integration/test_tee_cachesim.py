"""The tee feeding the real cache simulator over HTTP and gRPC; the report endpoint and CLI."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import aiohttp
import pytest

from tee.cachesim.cli import report as report_cli
from tee.cachesim.config import CacheSimConfig
from tee.cachesim.server import CacheSimServer
from tee.events import extend, ingest
from tee.logic import Tee
from tee.sinks import GrpcSink, HttpSink

BLOCK = 4


@pytest.fixture
async def sim() -> AsyncIterator[CacheSimServer]:
    cfg = CacheSimConfig(
        http_port=0, grpc_port=0, block_size=BLOCK, worker_capacity_blocks=8, window_s=60
    )
    server = await CacheSimServer(cfg).start()
    try:
        yield server
    finally:
        await server.stop(0)


async def _settle(tee: Tee, n: int) -> None:
    deadline = time.monotonic() + 10
    while sum(s.sent for s in tee.stats()) < n:
        assert time.monotonic() < deadline, tee.stats()
        await asyncio.sleep(0.01)


@pytest.mark.parametrize("transport", ["http", "grpc"])
async def test_tee_to_simulator_hit_rates(sim: CacheSimServer, transport: str) -> None:
    sink = HttpSink(sim.http_url) if transport == "http" else GrpcSink(sim.grpc_address)
    tee = await Tee([sink], concurrency=1).start()  # one in flight: order is kept
    prompt = list(range(16))  # 4 blocks
    try:
        tee.offer(ingest("m", prompt, "a", worker="w0"))
        tee.offer(ingest("m", prompt, "b", worker="w0"))  # 4 hits
        tee.offer(ingest("m", prompt, "c", worker="w1"))  # 0 routed hits; bounds hit
        tee.offer(extend("m", prompt, list(range(100, 108)), "c", worker="w1"))
        tee.offer(ingest("m", [*prompt, *range(100, 108)], "d", worker="w1"))  # 6 hits
        tee.offer(ingest("m", prompt, "e"))  # unrouted: bounds only
        await _settle(tee, 6)
    finally:
        await tee.close(1)
    total = sim.sim.report("m")["m"]["total"]
    assert isinstance(total, dict)
    assert total["requests"] == 5 and total["blocks"] == 22
    assert total["routed"] == {"requests": 4, "blocks": 18, "hit_blocks": 10, "hit_rate": 10 / 18}
    assert total["infinite_bound"]["hit_blocks"] == 4 + 4 + 6 + 4
    assert total["pooled_bound"]["hit_blocks"] == 18  # 16 blocks fit in the pool
    assert set(total["per_worker"]) == {"w0", "w1"}
    assert total["worker_cv"] == 0.0  # 2 requests each


async def test_http_rejects_bad_input_and_report_cli(
    sim: CacheSimServer, capsys: pytest.CaptureFixture[str]
) -> None:
    async with aiohttp.ClientSession() as s:
        bad = [
            (b"not json", 400, "body"),
            (json.dumps({"model": "m", "input_ids": [-1]}).encode(), 400, "input_ids"),
            (json.dumps({"input_ids": [1]}).encode(), 400, "model"),
        ]
        for body, status, field in bad:
            async with s.post(f"{sim.http_url}/ingest_ids", data=body) as r:
                assert r.status == status
                assert (await r.json())["field"] == field
        huge = json.dumps({"model": "m", "input_ids": [1] * (1 << 20 + 1)}).encode()
        async with s.post(f"{sim.http_url}/ingest_ids", data=huge) as r:
            assert r.status == 413
        ok = json.dumps({"model": "m", "input_ids": list(range(8))}).encode()
        async with s.post(
            f"{sim.http_url}/ingest_ids", data=ok, headers={"x-kvmesh-worker": "w3"}
        ) as r:
            assert r.status == 200 and (await r.json())["blocks"] == 2
        async with s.get(f"{sim.http_url}/report?model=nope") as r:
            assert r.status == 404
        async with s.get(f"{sim.http_url}/metrics") as r:
            assert 'kvmesh_cachesim_requests{model="m"} 1.0' in await r.text()
    # The CLI is synchronous (urllib): run it off the loop that serves the simulator.
    code = await asyncio.to_thread(report_cli, ["--url", sim.http_url])
    out = capsys.readouterr().out
    assert code == 0 and "model m: 1 workers" in out and "worker w3" in out
    code = await asyncio.to_thread(report_cli, ["--url", sim.http_url, "--json"])
    assert json.loads(capsys.readouterr().out)["models"]["m"]["total"]["requests"] == 1
    assert await asyncio.to_thread(report_cli, ["--url", "http://127.0.0.1:9"]) == 1


async def test_http_refuses_deep_nesting_without_a_traceback(sim: CacheSimServer) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    async with aiohttp.ClientSession() as s:
        async with s.post(f"{sim.http_url}/ingest_ids", data=deep) as r:
            assert r.status == 400
            assert (await r.json())["field"] == "body"
        async with s.get(f"{sim.http_url}/healthz") as r:
            assert r.status == 200  # still up


async def _raw_post(sim: CacheSimServer, head: bytes, body: bytes = b"") -> bytes:
    """POST by hand (a client that announces more than it sends); the reply's status line."""
    host, port = sim.http_url.removeprefix("http://").rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(head + body)
        await writer.drain()
        return await asyncio.wait_for(reader.readline(), 10.0)
    finally:
        writer.close()


async def test_http_refuses_an_announced_oversize_body_at_once(sim: CacheSimServer) -> None:
    head = (
        b"POST /ingest_ids HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: 209715200\r\n\r\n"
    )
    t0 = time.monotonic()
    status = await _raw_post(sim, head, b'{"model": "m", ')  # 200 MiB announced, 15 B sent
    assert status.startswith(b"HTTP/1.1 413"), status
    assert time.monotonic() - t0 < 5.0


async def test_http_gives_up_on_a_body_that_stalls() -> None:
    cfg = CacheSimConfig(
        http_port=0,
        grpc_port=0,
        block_size=BLOCK,
        worker_capacity_blocks=8,
        window_s=60,
        http_body_timeout_s=0.5,
    )
    sim = await CacheSimServer(cfg).start()
    try:
        head = (
            b"POST /ingest_ids HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: 1000\r\n\r\n"
        )
        t0 = time.monotonic()
        status = await _raw_post(sim, head, b'{"model": "m", ')
        assert status.startswith(b"HTTP/1.1 408"), status
        assert time.monotonic() - t0 < 5.0  # the configured timeout, not the default 30 s
    finally:
        await sim.stop(0)


async def test_http_errors_do_not_echo_huge_input(sim: CacheSimServer) -> None:
    bodies = [
        b'{"model": "m", "input_ids": [' + b"9" * 4000 + b"]}",  # a 4,000-digit id
        b'{"model": "m", "input_ids": [' + b"9" * 5000 + b"]}",  # past Python's digit limit
        json.dumps({"model": "m", "x" * 5000: 1}).encode(),  # a 5,000-character field name
    ]
    async with aiohttp.ClientSession() as s:
        for body in bodies:
            async with s.post(f"{sim.http_url}/ingest_ids", data=body) as r:
                assert r.status == 400
                assert len(await r.read()) < 400
