"""The Redis backend against a real redis-server: round trips, recovery, replicas, reaping.

Semantics shared with the memory backend are checked by tests/contract; this
module covers what only the Redis backend has: the one-round-trip contracts,
script reloading, Redis crashes, several replicas sharing one Redis, chunked
purging and the key schema itself.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from indexer.model import (
    AllBlocksCleared,
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
    Tier,
)
from indexer.redis import keys as K
from indexer.redis.backend import PURGE_CHUNK, RedisIndex
from kvmesh.blockkeys import block_keys
from kvmesh.errors import FailedPrecondition, NotFound, Unavailable
from lab.redisproc import RedisProcess
from tests.conftest import FakeClock

MODEL = "m"
NS = Namespace(MODEL)
BS = 4  # tokens per block: small prompts, many blocks


@pytest.fixture(scope="module")
def rproc() -> Iterator[RedisProcess]:
    """One private redis-server for this module (never the system one on 6379)."""
    with RedisProcess() as proc:
        assert proc.port != 6379
        yield proc


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture
async def idx(rproc: RedisProcess, clock: FakeClock, prefix: str) -> AsyncIterator[RedisIndex]:
    index = RedisIndex(rproc.url, prefix=prefix, clock=clock)
    try:
        yield index
    finally:
        await index.close()


def calls(proc: RedisProcess) -> dict[str, int]:
    """Calls per command so far (INFO commandstats, which also counts calls made
    inside scripts), without INFO itself."""
    r = redis.Redis(host=proc.host, port=proc.port)
    try:
        stats = r.info("commandstats")
    finally:
        r.close()
    return {
        name.removeprefix("cmdstat_"): int(v["calls"])
        for name, v in stats.items()
        if name != "cmdstat_info"
    }


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def inst(name: str, rank: int = 0) -> InstanceId:
    return InstanceId(name, rank)


def spec(i: InstanceId, ttl: float = 30.0, inc: str = "", model: str = MODEL) -> InstanceSpec:
    return InstanceSpec(i, model, f"http://{i.worker_id}:{i.dp_rank}", ttl, inc)


def tokens(prompt: int, n_blocks: int) -> tuple[int, ...]:
    return tuple(prompt * 100_000 + t for t in range(n_blocks * BS))


def store(
    hashes: range | tuple[int, ...],
    toks: tuple[int, ...],
    parent: int | None = None,
    tier: Tier = Tier.GPU,
) -> BlockStored:
    return BlockStored(tuple(hashes), parent, toks, BS, tier=tier)


async def test_match_is_one_evalsha_in_steady_state(idx: RedisIndex, rproc: RedisProcess) -> None:
    a, b = inst("a"), inst("b")
    await idx.register(spec(a))
    await idx.register(spec(b))
    toks = tokens(1, 32)
    await idx.apply(EventBatch(a, 1, (store(range(1, 33), toks),)))
    await idx.apply(EventBatch(b, 1, (store(range(1, 17), toks[: 16 * BS]),)))
    keys = block_keys(toks, BS, MODEL)
    first = await idx.match(NS, keys)  # warms the instance table
    assert [(m.instance, m.depth) for m in first] == [(a, 32), (b, 16)]
    before, trips = calls(rproc), idx.round_trips
    for _ in range(50):
        got = await idx.match(NS, keys)
    assert got == first
    assert idx.round_trips - trips == 50
    d = delta(before, calls(rproc))
    assert d["evalsha"] == 50
    assert not {"script", "eval"} & d.keys()  # no script reload


async def test_apply_is_one_evalsha_when_parents_are_cached(
    idx: RedisIndex, rproc: RedisProcess
) -> None:
    a = inst("a")
    await idx.register(spec(a))
    toks = tokens(2, 64)
    await idx.apply(EventBatch(a, 1, (store(range(1, 33), toks[: 32 * BS]),)))
    before, trips = calls(rproc), idx.round_trips
    res = await idx.apply(EventBatch(a, 2, (store(range(33, 65), toks[32 * BS :], parent=32),)))
    assert idx.round_trips - trips == 1
    assert delta(before, calls(rproc))["evalsha"] == 1
    assert (res.outcome, res.blocks_stored, res.blocks_orphaned) == (BatchOutcome.APPLIED, 32, 0)
    [m] = await idx.match(NS, block_keys(toks, BS, MODEL))
    assert m.depth == 64


async def test_parent_unknown_to_this_replica_is_fetched(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    one = RedisIndex(rproc.url, prefix=prefix, clock=clock)
    two = RedisIndex(rproc.url, prefix=prefix, clock=clock)
    try:
        a = inst("a")
        await one.register(spec(a))
        toks = tokens(3, 8)
        await one.apply(EventBatch(a, 1, (store(range(1, 5), toks[: 4 * BS]),)))
        # `two` never saw hash 4: one HMGET, then the script.
        await two.list_instances()  # warm its instance table
        before, trips = calls(rproc), two.round_trips
        res = await two.apply(EventBatch(a, 2, (store(range(5, 9), toks[4 * BS :], parent=4),)))
        assert two.round_trips - trips == 2
        assert delta(before, calls(rproc))["evalsha"] == 1
        assert res.blocks_stored == 4
        [m] = await one.match(NS, block_keys(toks, BS, MODEL))
        assert m.depth == 8
        # `one` cached hash 4 -> key; `two` clears the instance, so that entry is
        # outdated: the script must refuse it and `one` must chain from Redis' truth.
        await two.apply(EventBatch(a, 3, (AllBlocksCleared(),)))
        res = await one.apply(EventBatch(a, 4, (store(range(9, 11), tokens(4, 2), parent=4),)))
        assert (res.blocks_orphaned, res.blocks_stored) == (2, 0)
        assert (await one.dump()).blocks == {}
    finally:
        await one.close()
        await two.close()


async def test_noscript_reloads_transparently(idx: RedisIndex, rproc: RedisProcess) -> None:
    a = inst("a")
    await idx.register(spec(a))
    toks = tokens(5, 4)
    await idx.apply(EventBatch(a, 1, (store(range(1, 5), toks),)))
    r = redis.Redis(host=rproc.host, port=rproc.port)
    r.script_flush()
    r.close()
    [m] = await idx.match(NS, block_keys(toks, BS, MODEL))
    assert m.depth == 4
    res = await idx.apply(EventBatch(a, 2, (BlockRemoved((4,)),)))
    assert res.blocks_removed == 1


async def test_lease_expiry_hides_at_once_and_reap_drops_blocks(
    idx: RedisIndex, clock: FakeClock
) -> None:
    a, b = inst("a"), inst("b")
    await idx.register(spec(a, ttl=10))
    await idx.register(spec(b, ttl=100))
    toks = tokens(6, 4)
    keys = block_keys(toks, BS, MODEL)
    for i in (a, b):
        await idx.apply(EventBatch(i, 1, (store(range(1, 5), toks),)))
    assert {m.instance for m in await idx.match(NS, keys)} == {a, b}
    clock.advance(10)  # a's lease ends exactly now: expired
    assert [m.instance for m in await idx.match(NS, keys)] == [b]
    assert (await idx.stats()).instances_live == 1
    assert await idx.reap_expired() == [a]
    st = await idx.stats()
    assert (st.instances, st.blocks, st.block_instances) == (1, 4, 4)
    with pytest.raises(NotFound):
        await idx.heartbeat(a)
    with pytest.raises(FailedPrecondition):
        await idx.apply(EventBatch(a, 2, ()))


async def test_heartbeat_on_another_replica_is_seen(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    one = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=0.0)
    two = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=0.0)
    try:
        a = inst("a")
        await one.register(spec(a, ttl=10))
        toks = tokens(7, 2)
        await one.apply(EventBatch(a, 1, (store(range(1, 3), toks),)))
        keys = block_keys(toks, BS, MODEL)
        assert len(await one.match(NS, keys)) == 1
        clock.advance(8)
        await two.heartbeat(a)
        clock.advance(8)  # past the lease `one` cached, inside the renewed one
        assert [m.depth for m in await one.match(NS, keys)] == [2]
        await two.remove_instance(a)
        assert await one.match(NS, keys) == []
    finally:
        await one.close()
        await two.close()


async def test_instance_registered_elsewhere_appears_in_match(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    # A long cache TTL: only the unknown-id refresh can make `reader` see `b`.
    reader = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=3600)
    writer = RedisIndex(rproc.url, prefix=prefix, clock=clock)
    try:
        a, b = inst("a"), inst("b")
        toks = tokens(8, 3)
        keys = block_keys(toks, BS, MODEL)
        await writer.register(spec(a))
        await writer.apply(EventBatch(a, 1, (store(range(1, 4), toks),)))
        assert [m.instance for m in await reader.match(NS, keys)] == [a]
        await writer.register(spec(b))
        await writer.apply(EventBatch(b, 1, (store(range(1, 3), toks[: 2 * BS]),)))
        got = await reader.match(NS, keys)
        assert [(m.instance, m.depth, m.address) for m in got] == [
            (a, 3, "http://a:0"),
            (b, 2, "http://b:0"),
        ]
    finally:
        await reader.close()
        await writer.close()


async def test_huge_instance_is_purged_in_chunks(idx: RedisIndex, rproc: RedisProcess) -> None:
    a, b = inst("a"), inst("b")
    await idx.register(spec(a))
    await idx.register(spec(b))
    n = PURGE_CHUNK * 3 + 17
    keys = list(range(10**6, 10**6 + n))
    batch = 256
    for s, lo in enumerate(range(0, n, batch), start=1):
        ev = BlockStored(tuple(keys[lo : lo + batch]), block_keys=tuple(keys[lo : lo + batch]))
        await idx.apply(EventBatch(a, s, (ev,)))
    await idx.apply(EventBatch(b, 1, (BlockStored((1, 2), block_keys=(keys[0], keys[1])),)))
    assert (await idx.stats()).block_instances == n + 2
    trips = idx.round_trips
    assert await idx.remove_instance(a) == n
    assert idx.round_trips - trips >= 1 + 4  # remove + at least four purge chunks
    st = await idx.stats()
    assert (st.blocks, st.block_instances) == (2, 2)
    r = redis.Redis(host=rproc.host, port=rproc.port)
    try:
        left = list(r.scan_iter(match=K.base(idx._prefix) + b"b:*", count=1000))
        assert len(left) == 2
        assert r.scard(K.key(idx._prefix, K.DEAD)) == 0
    finally:
        r.close()
    [m] = await idx.match(NS, keys[:2])
    assert (m.instance, m.depth) == (b, 2)


async def test_clear_and_reset_rotate_and_purge(idx: RedisIndex) -> None:
    a = inst("a")
    await idx.register(spec(a, inc="x"))
    toks = tokens(9, 6)
    keys = block_keys(toks, BS, MODEL)
    await idx.apply(EventBatch(a, 1, (store(range(1, 7), toks),)))
    res = await idx.apply(EventBatch(a, 2, (AllBlocksCleared(), store(range(1, 3), toks[:8]))))
    assert (res.blocks_removed, res.blocks_stored) == (6, 2)
    [m] = await idx.match(NS, keys)
    assert m.depth == 2
    state, reset = await idx.register(spec(a, inc="y"))
    assert reset and state.blocks == 0 and state.applied_sequence is None
    assert await idx.match(NS, keys) == []
    assert (await idx.stats()).block_instances == 0


async def test_block_hash_stays_small_and_listpack_encoded(
    idx: RedisIndex, rproc: RedisProcess
) -> None:
    ids = [inst(f"w{i}") for i in range(8)]
    toks = tokens(10, 1)
    for i in ids:
        await idx.register(spec(i))
        await idx.apply(EventBatch(i, 1, (store((1,), toks, tier=Tier.CPU),)))
    [key] = block_keys(toks, BS, MODEL)
    name = K.block_key(idx._prefix, K.ns_id(MODEL), key)
    r = redis.Redis(host=rproc.host, port=rproc.port)
    try:
        assert r.object("encoding", name) == b"listpack"
        fields = r.hgetall(name)
        assert len(fields) == 8
        assert all(f.isdigit() and v == b"2" for f, v in fields.items())  # int id -> mask
    finally:
        r.close()


async def test_prefixes_are_isolated(rproc: RedisProcess, clock: FakeClock) -> None:
    one = RedisIndex(rproc.url, prefix=f"p{uuid.uuid4().hex[:6]}", clock=clock)
    two = RedisIndex(rproc.url, prefix=f"p{uuid.uuid4().hex[:6]}", clock=clock)
    try:
        a = inst("a")
        await one.register(spec(a))
        toks = tokens(11, 2)
        await one.apply(EventBatch(a, 1, (store(range(1, 3), toks),)))
        assert await two.match(NS, block_keys(toks, BS, MODEL)) == []
        assert await two.list_instances() == []
        assert (await two.dump()).blocks == {}
    finally:
        await one.close()
        await two.close()


# -- Redis down ---------------------------------------------------------------


async def _every_method_unavailable(idx: RedisIndex, budget_s: float) -> None:
    a = inst("a")
    calls_ = [
        idx.ping(),
        idx.register(spec(a)),
        idx.heartbeat(a),
        idx.apply(EventBatch(a, 9, (store(range(1, 2), tokens(1, 1)),))),
        idx.match(NS, [1, 2, 3]),
        idx.remove_instance(a),
        idx.list_instances(),
        idx.reap_expired(),
        idx.stats(),
        idx.dump(),
    ]
    for coro in calls_:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            await coro
        assert time.monotonic() - t0 < budget_s


async def test_redis_down_at_start_is_unavailable(clock: FakeClock) -> None:
    proc = RedisProcess()
    proc.start()
    url = proc.url
    proc.close()  # nothing listens on that port now
    idx = RedisIndex(url, clock=clock, socket_timeout_s=0.5)
    try:
        await _every_method_unavailable(idx, budget_s=5.0)
    finally:
        await idx.close()


async def test_killed_redis_is_unavailable_then_recovers(clock: FakeClock) -> None:
    with RedisProcess() as proc:
        idx = RedisIndex(proc.url, clock=clock, socket_timeout_s=0.5)
        try:
            a = inst("a")
            await idx.register(spec(a))
            toks = tokens(12, 4)
            keys = block_keys(toks, BS, MODEL)
            await idx.apply(EventBatch(a, 1, (store(range(1, 5), toks),)))
            assert len(await idx.match(NS, keys)) == 1
            proc.kill()
            assert not proc.ping()
            await _every_method_unavailable(idx, budget_s=5.0)
            proc.restart()  # same port, empty dataset, no scripts loaded
            assert proc.ping()
            await idx.ping()
            assert await idx.match(NS, keys) == []  # data went with the crash
            with pytest.raises(FailedPrecondition):
                await idx.apply(EventBatch(a, 2, (store(range(1, 5), toks),)))
            _, reset = await idx.register(spec(a))
            assert reset
            res = await idx.apply(EventBatch(a, 1, (store(range(1, 5), toks),)))
            assert res.outcome is BatchOutcome.APPLIED and res.blocks_stored == 4
            [m] = await idx.match(NS, keys)
            assert m.depth == 4
        finally:
            await idx.close()


async def test_redis_killed_during_a_stream_of_matches(clock: FakeClock) -> None:
    """Matches in flight when Redis dies fail fast with Unavailable, never hang."""
    with RedisProcess() as proc:
        idx = RedisIndex(proc.url, clock=clock, socket_timeout_s=0.5)
        try:
            a = inst("a")
            await idx.register(spec(a))
            toks = tokens(13, 8)
            await idx.apply(EventBatch(a, 1, (store(range(1, 9), toks),)))
            keys = block_keys(toks, BS, MODEL)
            outcomes: list[str] = []

            async def loop() -> None:
                for _ in range(400):
                    try:
                        await idx.match(NS, keys)
                        outcomes.append("ok")
                    except Unavailable:
                        outcomes.append("unavailable")
                    await asyncio.sleep(0.001)

            task = asyncio.create_task(loop())
            await asyncio.sleep(0.05)
            proc.kill()
            await asyncio.sleep(0.1)
            proc.restart()
            await asyncio.wait_for(task, 30)
            assert "unavailable" in outcomes
            assert outcomes[0] == "ok" and outcomes[-1] == "ok"
        finally:
            await idx.close()
