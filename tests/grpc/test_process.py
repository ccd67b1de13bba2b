"""A real ``kvmesh indexer serve`` process: start, serve, SIGTERM, graceful exit."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc


def kvmesh_command() -> list[str]:
    """The installed ``kvmesh`` console script, else ``python -m kvmesh.cli``."""
    script = Path(sys.executable).with_name("kvmesh")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvmesh.cli"]


async def start_serve(*extra: str, env: dict[str, str] | None = None) -> tuple[Any, str]:
    """Start ``kvmesh indexer serve`` on a free loopback port; return (process, address)."""
    proc = await asyncio.create_subprocess_exec(
        *kvmesh_command(),
        "indexer",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--block-size",
        "4",
        *extra,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    assert proc.stderr is not None
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, "server exited before serving"
        m = re.search(r"serving on (127\.0\.0\.1:\d+)", line)
        if m:
            return proc, m.group(1)


async def test_sigterm_drains_in_flight_stream_and_exits_zero() -> None:
    proc, address = await start_serve("--shutdown-grace", "10")
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.IndexerServiceStub(channel)
            await stub.RegisterInstance(
                pb.RegisterInstanceRequest(instance=pb.InstanceRef(worker_id="w"), model="m")
            )
            queue: asyncio.Queue[pb.PublishEventsStreamRequest | None] = asyncio.Queue()

            async def requests() -> Any:
                while (item := await queue.get()) is not None:
                    yield item

            def req(seq: int) -> pb.PublishEventsStreamRequest:
                return pb.PublishEventsStreamRequest(
                    batch=pb.EventBatch(
                        instance=pb.InstanceRef(worker_id="w"),
                        sequence=seq,
                        events=[pb.Event(cleared=pb.AllBlocksCleared())],
                    )
                )

            stream = stub.PublishEventsStream(requests())
            await queue.put(req(1))
            assert (await stream.read()).ack.outcome == pb.BATCH_OUTCOME_APPLIED

            proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.5)
            # The call in flight at SIGTERM goes on and completes...
            await queue.put(req(2))
            assert (await stream.read()).ack.outcome == pb.BATCH_OUTCOME_APPLIED
            await queue.put(None)
            assert await stream.code() == grpc.StatusCode.OK
            # ...while new calls are refused (never UNKNOWN).
            try:
                await stub.Ping(pb.PingRequest(), timeout=2)
            except grpc.aio.AioRpcError as e:
                assert e.code() in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ), e.code()
        code = await asyncio.wait_for(proc.wait(), 30)
        assert code == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_sigint_idle_server_exits_zero_quickly() -> None:
    proc, address = await start_serve()
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            await pb_grpc.IndexerServiceStub(channel).Ping(pb.PingRequest(), timeout=5)
        proc.send_signal(signal.SIGINT)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_port_in_use_exits_nonzero() -> None:
    proc, address = await start_serve()
    try:
        port = address.rsplit(":", 1)[1]
        other = await asyncio.create_subprocess_exec(
            *kvmesh_command(),
            "indexer",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            port,
            "--metrics-port",
            "0",
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(other.communicate(), 30)
        assert other.returncode == 1
        assert b"cannot" in err
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.wait_for(proc.wait(), 30)


async def _run_command(*args: str) -> tuple[int, str, str]:
    """Run the ``kvmesh`` command with ``args``; return (exit code, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        *kvmesh_command(),
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_bare_group_words_list_their_commands() -> None:
    groups = {
        "indexer": "serve",
        "bench": "indexer",
        "tee": "serve",
        "xfer": "serve",
        "cachesim": "report",
    }
    results = await asyncio.gather(*(_run_command(group) for group in groups))
    for (group, command), (code, _, err) in zip(groups.items(), results, strict=True):
        assert code == 2, (group, err)
        assert err.startswith(f"usage: kvmesh {group} COMMAND"), err
        assert f"\n  {command} " in err, err
        assert "unknown command" not in err


async def test_indexer_serve_help_is_its_own_parser() -> None:
    code, out, _ = await _run_command("indexer", "serve", "--help")
    assert code == 0
    assert out.startswith("usage: kvmesh indexer serve")
    assert "--zmq-endpoint" in out and "--print-config" in out
