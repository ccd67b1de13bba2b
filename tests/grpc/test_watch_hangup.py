"""A follower hanging up while its replica streams changes ends the stream quietly.

A follower process that dies (or resets its connection) with changes still
unread leaves the replica's send of the next one in flight; grpc core fails
that send, and when the failure reaches grpc before its own notice of the
hang-up, grpc logs ``ExecuteBatchError`` at ERROR. The stream wrapper of
kvmesh/grpcsvc.py writes each message itself and takes a failed send as the
end of the stream: nothing at ERROR, the handler closed, the follower's slot
in the hub and its call in the guard released.

Real parts: an in-process memory replica on a loopback port under ingest,
and follower processes that open WatchIndex streams, stop reading (the
replica's sends back up against flow control) and exit without closing.
With the wrapper that let grpc iterate the handler's messages, most such
hang-ups logged the ERROR line (2 to 4 of the 4 here, in each of 4 runs).
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from indexer.memory import MemoryIndex
from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, Tier
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from tests.grpc.conftest import close_harness, make_config, open_harness
from tests.integration.test_zmq_subscriber import eventually

ROOT = Path(__file__).resolve().parents[2]
#: Blocks per ingested batch: each change is about 30 kB on the wire, so a
#: second of ingest is far more than a stalled stream's flow-control window.
BATCH_BLOCKS = 2048
#: Streams each follower process opens, and follower processes.
STREAMS = 1
PROCESSES = 4
#: How long a follower leaves its streams unread before it exits (seconds).
STALL_S = 1.0

# A follower that opens STREAMS WatchIndex streams, reads each one's first
# response, stops reading, and exits without closing anything.
_FOLLOWER = """
import asyncio, os, sys
import grpc
from kvmesh.api.indexer.v1 import indexer_pb2 as pb, indexer_pb2_grpc as pb_grpc

async def main() -> None:
    target, streams, stall = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    calls = []
    for _ in range(streams):
        channel = grpc.aio.insecure_channel(target)  # one connection each
        call = pb_grpc.IndexerServiceStub(channel).WatchIndex(pb.WatchIndexRequest())
        await call.read()
        calls.append((channel, call))
    print("reading no more", flush=True)
    await asyncio.sleep(stall)
    os._exit(0)

asyncio.run(main())
"""


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def grpc_records() -> Iterator[_Records]:
    """Every record of grpc's loggers (cygrpc logs under grpc._cython.cygrpc, a child)."""
    handler = _Records()
    lg = logging.getLogger("grpc")
    level = lg.level
    lg.setLevel(logging.DEBUG)  # grpc's line for a cancelled call is at DEBUG
    lg.addHandler(handler)
    try:
        yield handler
    finally:
        lg.removeHandler(handler)
        lg.setLevel(level)


async def test_followers_hanging_up_mid_stream_log_nothing_and_free_their_slots(
    grpc_records: _Records,
) -> None:
    index = MemoryIndex()
    h = await open_harness(make_config(), index)
    hub = index.watch
    assert hub is not None
    iid = InstanceId("w", 0)
    await h.stub.RegisterInstance(
        pb.RegisterInstanceRequest(
            instance=pb.InstanceRef(worker_id=iid.worker_id, dp_rank=iid.dp_rank),
            model="m",
            address="http://w-0",
            lease_ttl_seconds=60,
            incarnation="i",
        )
    )
    stop = asyncio.Event()
    applied = 0

    async def ingest() -> None:
        # Each batch stores its blocks and removes them again: the changes are
        # large, the instance (and so each resync's snapshot) stays empty.
        nonlocal applied
        while not stop.is_set():
            lo = applied * BATCH_BLOCKS + 1
            hashes = tuple(range(lo, lo + BATCH_BLOCKS))
            stored = BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=(),
                block_size=0,
                tier=Tier.GPU,
                block_keys=hashes,
            )
            await index.apply(EventBatch(iid, applied, (stored, BlockRemoved(hashes))))
            applied += 1
            await asyncio.sleep(0.0005)

    task = asyncio.create_task(ingest())
    guard = h.server.guard
    try:
        for _ in range(PROCESSES):
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-c",
                _FOLLOWER,
                h.server.address,
                str(STREAMS),
                str(STALL_S),
                cwd=ROOT,
                stdout=asyncio.subprocess.PIPE,
            )
            assert proc.stdout is not None
            assert await asyncio.wait_for(proc.stdout.readline(), 30) == b"reading no more\n"
            assert hub.watchers == STREAMS
            assert await asyncio.wait_for(proc.wait(), 30) == 0
            # The handlers closed (the hub forgot them) and the calls ended in
            # the guard well within STREAM_HANGUP_WAIT_S: grpc's own notice of
            # the hang-up cancelled them.
            await eventually(lambda: hub.watchers == 0, within=3.0)
            await eventually(
                lambda: sum(s.in_flight for s in guard._clients.values()) == 0, within=3.0
            )
        before = applied
        await eventually(lambda: applied > before + 10, within=5.0)  # ingest went on
        await h.stub.Ping(pb.PingRequest(), timeout=5)
    finally:
        stop.set()
        await task
        await close_harness(h)
    errors = [
        f"{r.name}: {r.getMessage()}" for r in grpc_records.records if r.levelno >= logging.ERROR
    ]
    assert errors == []
    # The hang-ups did reach grpc: each stream ended cancelled.
    cancelled = [r for r in grpc_records.records if "RPC cancelled" in r.getMessage()]
    assert len(cancelled) >= PROCESSES * STREAMS
