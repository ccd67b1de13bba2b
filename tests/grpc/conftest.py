"""Fixtures of the gRPC tests: an in-process indexer on a free 127.0.0.1 port and a stub;
a prefill and a decode transfer sidecar in threads of the test process (TCP backend)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from indexer.config import IndexerConfig
from indexer.index import Index
from indexer.memory import MemoryIndex
from indexer.server import IndexerServer, start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from lab.bench.xfer_procs import ThreadedSidecar
from xfer.client import XferClient
from xfer.config import PoolSettings, XferConfig
from xfer.logic import RoomStatus

MODEL = "test/model"
BLOCK = 4  # small blocks keep token lists short


def make_config(**overrides: Any) -> IndexerConfig:
    """A test config: loopback, free port, no metrics endpoint, block size 4."""
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "block_size": BLOCK,
        "shutdown_grace_s": 1.0,
    }
    base.update(overrides)
    return IndexerConfig.model_validate(base)


class Harness:
    """A running server plus a connected async stub."""

    def __init__(self, server: IndexerServer, channel: grpc.aio.Channel) -> None:
        self.server = server
        self.channel = channel
        self.stub = pb_grpc.IndexerServiceStub(channel)

    @property
    def index(self) -> Index:
        return self.server.index


async def open_harness(config: IndexerConfig, index: Index | None = None) -> Harness:
    """Start a server and connect a stub to it."""
    server = await start_server(config, index)
    channel = grpc.aio.insecure_channel(
        server.address, options=[("grpc.max_receive_message_length", 64 << 20)]
    )
    return Harness(server, channel)


async def close_harness(h: Harness) -> None:
    """Close the channel and stop the server at once (bounded: a stop that hangs
    fails with the traceback of the await it hung in)."""
    async with asyncio.timeout(30):
        await h.channel.close()
        await h.server.stop(0)


@pytest.fixture
async def harness() -> AsyncIterator[Harness]:
    """A memory-backed server on a free port with default caps."""
    h = await open_harness(make_config(), MemoryIndex())
    try:
        yield h
    finally:
        await close_harness(h)


@pytest.fixture
def stub(harness: Harness) -> Any:
    """The async IndexerService stub of :func:`harness`."""
    return harness.stub


async def expect_status(call: Awaitable[Any], code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    """Await ``call`` and return its error, checking it ended with ``code`` (never UNKNOWN)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    err = info.value
    assert err.code() != grpc.StatusCode.UNKNOWN, err.details()
    assert err.code() == code, (err.code(), err.details())
    return err


def ref(worker: str = "w0", rank: int = 0) -> pb.InstanceRef:
    """An InstanceRef."""
    return pb.InstanceRef(worker_id=worker, dp_rank=rank)


async def register(
    stub: Any, worker: str = "w0", *, model: str = MODEL, address: str = "", ttl: float = 0
) -> pb.RegisterInstanceResponse:
    """Register ``worker`` (rank 0) for ``model``."""
    resp: pb.RegisterInstanceResponse = await stub.RegisterInstance(
        pb.RegisterInstanceRequest(
            instance=ref(worker),
            model=model,
            address=address or f"http://{worker}:8000",
            lease_ttl_seconds=ttl,
        )
    )
    return resp


def stored(
    hashes: list[int],
    tokens: list[int],
    *,
    parent: int | None = None,
    tier: int = pb.TIER_GPU,
    block_size: int = BLOCK,
) -> pb.Event:
    """A BlockStored event."""
    ev = pb.BlockStored(block_hashes=hashes, token_ids=tokens, block_size=block_size, tier=tier)
    if parent is not None:
        ev.parent_block_hash = parent
    return pb.Event(stored=ev)


def removed(hashes: list[int], tier: int = pb.TIER_UNSPECIFIED) -> pb.Event:
    """A BlockRemoved event."""
    return pb.Event(removed=pb.BlockRemoved(block_hashes=hashes, tier=tier))


def cleared() -> pb.Event:
    """An AllBlocksCleared event."""
    return pb.Event(cleared=pb.AllBlocksCleared())


def batch(seq: int, *events: pb.Event, worker: str = "w0") -> pb.EventBatch:
    """An EventBatch of ``worker``."""
    return pb.EventBatch(instance=ref(worker), sequence=seq, events=list(events))


async def publish(stub: Any, b: pb.EventBatch) -> pb.BatchAck:
    """Publish one batch with the unary call; return its ack."""
    resp: pb.PublishEventsResponse = await stub.PublishEvents(pb.PublishEventsRequest(batch=b))
    return resp.ack


async def match(stub: Any, tokens: list[int], **kw: Any) -> pb.MatchResponse:
    """Match ``tokens`` in the test model's namespace."""
    kw.setdefault("model", MODEL)
    resp: pb.MatchResponse = await stub.Match(pb.MatchRequest(token_ids=tokens, **kw))
    return resp


#: Pool of the test sidecars: page size, pages, aux slot size, aux slots.
XFER_PAGE, XFER_PAGES, XFER_AUX, XFER_AUXN = 1024, 64, 32, 4


def xfer_config(role: str, path: Path, **kw: Any) -> XferConfig:
    """A sidecar of ``role`` on a free port, TCP transport, its pool created at ``path``."""
    pool = PoolSettings(
        path=str(path),
        page_size=XFER_PAGE,
        page_count=XFER_PAGES,
        aux_size=XFER_AUX,
        aux_count=XFER_AUXN,
        create=True,
    )
    return XferConfig(role=role, port=0, metrics_port=0, transport="tcp", pool=pool, **kw)  # type: ignore[arg-type]


def room_until(dc: XferClient, room: int, status: RoomStatus, within: float = 10.0) -> None:
    """Poll ``room`` until it reaches ``status``; fail after ``within`` seconds."""
    deadline = time.monotonic() + within
    while dc.poll(room)[0] != status:
        assert time.monotonic() < deadline, f"room {room} never reached {status.name}"
        time.sleep(0.005)


@pytest.fixture
def sidecars(tmp_path: Path) -> Iterator[tuple[ThreadedSidecar, ThreadedSidecar]]:
    """A prefill and a decode sidecar, running."""
    p = ThreadedSidecar(xfer_config("prefill", tmp_path / "p"))
    d = ThreadedSidecar(xfer_config("decode", tmp_path / "d"))
    p.start()
    d.start()
    yield p, d
    p.stop()
    d.stop()
