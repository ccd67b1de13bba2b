"""An indexer replica killed while another serves, then restarted.

Two replica processes share one real redis-server. A client publishes to
replica A and matches on both; replica B is SIGKILLed mid-run. A must keep
answering correctly with no error at all; B's callers see only UNAVAILABLE
while it is down. B restarted on its port serves the whole index at once
(the index lives in Redis: no warm-up): its first Match after health turns
SERVING equals A's answer, for every chain published, including those
published while it was down.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import grpc
import grpc.aio
import pytest
import xxhash
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from lab.bench.soak import CHANNEL_OPTIONS, ReplicaProcess, wait_serving
from lab.redisproc import RedisProcess
from lab.workload import TRACE_MODEL

WORKERS = 4
DEPTH = 4


def chain(c: int) -> list[int]:
    """Block keys of chain ``c`` (a root of its own, so one instance holds it)."""
    return [xxhash.xxh3_64_intdigest(f"{c}/{d}".encode()) for d in range(DEPTH)]


def worker(c: int) -> str:
    return f"kill-engine-{c % WORKERS}"


def match_req(c: int) -> pb.MatchRequest:
    keys = chain(c)
    return pb.MatchRequest(model=TRACE_MODEL, block_keys=keys, max_blocks=len(keys))


def answer(resp: pb.MatchResponse) -> list[tuple[str, int]]:
    return [(m.instance.worker_id, m.depth) for m in resp.matches]


@pytest.fixture
def redis_url() -> Iterator[str]:
    with RedisProcess() as proc:
        yield proc.url


@pytest.mark.timeout(60)
async def test_replica_killed_while_another_serves(redis_url: str) -> None:
    loop = asyncio.get_running_loop()
    a, b = ReplicaProcess(redis_url), ReplicaProcess(redis_url)
    await asyncio.gather(loop.run_in_executor(None, a.start), loop.run_in_executor(None, b.start))
    cha = grpc.aio.insecure_channel(a.target, options=CHANNEL_OPTIONS)
    chb = grpc.aio.insecure_channel(b.target, options=CHANNEL_OPTIONS)
    try:
        await wait_serving(a.target)
        await wait_serving(b.target)
        sa, sb = pb_grpc.IndexerServiceStub(cha), pb_grpc.IndexerServiceStub(chb)
        for w in range(WORKERS):
            await sa.RegisterInstance(
                pb.RegisterInstanceRequest(
                    instance=pb.InstanceRef(worker_id=f"kill-engine-{w}"),
                    model=TRACE_MODEL,
                    address=f"http://kill-engine-{w}:8000",
                    lease_ttl_seconds=120,
                    incarnation="one",
                )
            )
        acked: list[int] = []  # chains whose batch A acknowledged
        a_checks = 0
        b_ok = 0
        b_errors: list[grpc.StatusCode] = []
        b_down = False
        stop = asyncio.Event()

        async def publish_and_check_a() -> None:
            nonlocal a_checks
            seqs = [0] * WORKERS
            stream = sa.PublishEventsStream()
            rng = random.Random(1)
            c = 0
            while not stop.is_set():
                w = c % WORKERS
                seqs[w] += 1
                keys = chain(c)
                batch = pb.EventBatch(
                    instance=pb.InstanceRef(worker_id=worker(c)),
                    sequence=seqs[w],
                    events=[
                        pb.Event(
                            stored=pb.BlockStored(block_hashes=keys, block_keys=keys, block_size=16)
                        )
                    ],
                )
                await stream.write(pb.PublishEventsStreamRequest(batch=batch))
                ack = (await stream.read()).ack
                assert ack.outcome == pb.BATCH_OUTCOME_APPLIED, ack
                acked.append(c)
                c += 1
                probe = acked[rng.randrange(len(acked))]
                got = answer(await sa.Match(match_req(probe), timeout=5))
                assert got == [(worker(probe), DEPTH)], (probe, got)
                a_checks += 1
                await asyncio.sleep(0.005)
            await stream.done_writing()

        async def check_b() -> None:
            nonlocal b_ok
            rng = random.Random(2)
            while not stop.is_set():
                if acked:
                    probe = acked[rng.randrange(len(acked))]
                    try:
                        got = answer(await sb.Match(match_req(probe), timeout=5))
                    except grpc.aio.AioRpcError as e:
                        assert b_down, f"B failed while up: {e.code()} {e.details()}"
                        b_errors.append(e.code())
                    else:
                        assert got == [(worker(probe), DEPTH)], (probe, got)
                        b_ok += 1
                await asyncio.sleep(0.01)

        tasks = [asyncio.create_task(publish_and_check_a()), asyncio.create_task(check_b())]
        await asyncio.sleep(1.5)
        assert b_ok > 0
        b_down = True
        await loop.run_in_executor(None, b.kill)
        checks_at_kill, acked_at_kill = a_checks, len(acked)
        await asyncio.sleep(1.5)
        # A served on, correctly, while B was dead (the task asserts each answer).
        assert a_checks > checks_at_kill and len(acked) > acked_at_kill
        await loop.run_in_executor(None, b.start)
        health = health_pb2_grpc.HealthStub(chb)
        while True:
            try:
                h = await health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                if h.status == health_pb2.HealthCheckResponse.SERVING:
                    break
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.02)
        # Right after SERVING: B answers as A does for every chain, including
        # the ones published while it was down. No warm-up.
        snapshot = list(acked)
        for c in snapshot:
            rb = await sb.Match(match_req(c), timeout=5)
            ra = await sa.Match(match_req(c), timeout=5)
            assert rb == ra, (c, answer(rb), answer(ra))
            assert answer(rb) == [(worker(c), DEPTH)]
        b_down = False
        await asyncio.sleep(0.5)
        stop.set()
        await asyncio.gather(*tasks)
        assert b_errors and set(b_errors) == {grpc.StatusCode.UNAVAILABLE}, b_errors
        assert len(snapshot) > acked_at_kill
    finally:
        await cha.close()
        await chb.close()
        await loop.run_in_executor(None, a.stop)
        await loop.run_in_executor(None, b.stop)
