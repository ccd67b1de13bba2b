"""Several Redis backend replicas over one real redis-server: the cached instance table.

Each replica caches the instance table and the namespace constants. The
promise (indexer/redis/KEYS.md, "Instance table, leases, staleness"): a
replica's view lags the truth by at most ``instance_cache_ttl_s`` plus one
round trip; a live instance is never hidden past that bound, and an
expired, removed or re-registered one is never answered with its old id,
address or flags past it. The namespace cache is bounded and never holds a
namespace Redis does not know.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis

from indexer.model import (
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
)
from indexer.redis import keys as K
from indexer.redis.backend import RedisIndex
from kvmesh.blockkeys import block_keys
from kvmesh.errors import FailedPrecondition
from lab.redisproc import RedisProcess
from tests.conftest import FakeClock

MODEL = "m"
NS = Namespace(MODEL)
BS = 4  # tokens per block

#: The cache bound of the replicas under test: long enough that a Match
#: issued right after a refresh is inside it on a loaded machine, short
#: enough to keep the tests quick.
BOUND_S = 1.0


@pytest.fixture(scope="module")
def rproc() -> Iterator[RedisProcess]:
    """One private redis-server for this module (never the system one on 6379)."""
    with RedisProcess() as proc:
        assert proc.port != 6379
        yield proc


@pytest.fixture
def prefix() -> str:
    return f"r{uuid.uuid4().hex[:8]}"


class _DiesBeforePurging(RedisIndex):
    """A replica that stops between retiring an int id and purging its entries.

    The same state exists, for a while, whenever a huge instance is purged in
    chunks; a replica that dies mid-purge leaves it until the next reap.
    """

    async def _purge(self, int_id: bytes) -> None:
        return None


@pytest.fixture
async def pair(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> AsyncIterator[tuple[RedisIndex, RedisIndex]]:
    """Replica ``a`` (cache bound :data:`BOUND_S`) and replica ``b``, one Redis."""
    a = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=BOUND_S)
    b = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=BOUND_S)
    try:
        yield a, b
    finally:
        await a.close()
        await b.close()


def spec(i: InstanceId, ttl: float = 30.0, inc: str = "", address: str = "") -> InstanceSpec:
    return InstanceSpec(i, MODEL, address or f"http://{i.worker_id}", ttl, inc)


def toks(n_blocks: int, prompt: int = 1) -> tuple[int, ...]:
    return tuple(prompt * 100_000 + t for t in range(n_blocks * BS))


def store(n_blocks: int, lora: str = "", first_hash: int = 1) -> BlockStored:
    hashes = tuple(range(first_hash, first_hash + n_blocks))
    return BlockStored(hashes, None, toks(n_blocks), BS, lora_name=lora)


KEYS = block_keys(toks(4), BS, MODEL)


async def past_bound() -> None:
    await asyncio.sleep(BOUND_S * 1.1)


async def test_lapsed_lease_renewed_elsewhere_is_seen_once_the_bound_passes(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock
) -> None:
    a, b = pair
    x = InstanceId("x", 0)
    await b.register(spec(x, ttl=10))
    await b.apply(EventBatch(x, 1, (store(4),)))
    await a.list_instances()  # a's snapshot: x's lease ends at +10
    clock.advance(9)
    await b.heartbeat(x)  # renewed to +19 elsewhere (an ordinary renewal)
    clock.advance(2)  # past the lease a cached, inside the renewed one
    # Right after a's snapshot: the refresh is rate-limited, x may be hidden.
    await a.match(NS, KEYS)
    await past_bound()
    got = await a.match(NS, KEYS)
    assert [(m.instance, m.depth) for m in got] == [(x, 4)]


async def test_revived_elsewhere_is_seen_in_the_first_match_past_the_bound(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock
) -> None:
    a, b = pair
    x = InstanceId("x", 0)
    await b.register(spec(x, ttl=10))
    await b.apply(EventBatch(x, 1, (store(4),)))
    assert [m.instance for m in await a.match(NS, KEYS)] == [x]
    clock.advance(11)
    await past_bound()
    assert await a.match(NS, KEYS) == []  # expired, and a's snapshot says so
    await b.heartbeat(x)  # revived elsewhere
    await past_bound()
    got = await a.match(NS, KEYS)
    assert [(m.instance, m.depth) for m in got] == [(x, 4)]


async def test_reset_elsewhere_never_lists_an_instance_twice(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    # A long bound: only the unknown-id refresh makes `a` look at the table again.
    a = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=3600)
    b = _DiesBeforePurging(rproc.url, prefix=prefix, clock=clock)
    try:
        x = InstanceId("x", 0)
        await b.register(spec(x, inc="one", address="http://old"))
        await b.apply(EventBatch(x, 1, (store(2),)))
        assert [(m.instance, m.address) for m in await a.match(NS, KEYS)] == [(x, "http://old")]
        # A new incarnation: a new int id; the old one keeps its entries until purged.
        _, reset = await b.register(spec(x, inc="two", address="http://new"))
        assert reset
        await b.apply(EventBatch(x, 1, (store(4),)))
        # The script lists the old id (depth 2, known to `a`) before the new
        # one (depth 4, unknown to `a`, which refreshes on meeting it).
        got = await a.match(NS, KEYS)
        assert [(m.instance, m.depth, m.address) for m in got] == [(x, 4, "http://new")]
    finally:
        await a.close()
        await b.close()


async def test_lease_shortened_elsewhere_ends_within_the_bound(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock
) -> None:
    a, b = pair
    x = InstanceId("x", 0)
    await b.register(spec(x, ttl=100))
    await b.apply(EventBatch(x, 1, (store(4),)))
    assert [m.instance for m in await a.match(NS, KEYS)] == [x]
    state, reset = await b.register(spec(x, ttl=5))  # same incarnation, shorter lease
    assert not reset and state.lease_expires_at == clock() + 5
    clock.advance(6)  # past the new expiry, long before the old one
    await past_bound()
    assert await a.match(NS, KEYS) == []


async def test_address_changed_elsewhere_is_answered_within_the_bound(
    pair: tuple[RedisIndex, RedisIndex],
) -> None:
    a, b = pair
    x = InstanceId("x", 0)
    await b.register(spec(x, address="http://old"))
    await b.apply(EventBatch(x, 1, (store(4),)))
    assert [m.address for m in await a.match(NS, KEYS)] == ["http://old"]
    await b.register(spec(x, address="http://new"))
    await past_bound()
    trips = a.round_trips
    assert [m.address for m in await a.match(NS, KEYS)] == ["http://new"]
    # The Match saw the new generation, refreshed and asked again.
    assert a.round_trips - trips == 3


async def test_renewals_elsewhere_keep_a_match_at_one_round_trip(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    """Ordinary renewals do not move the generation: a steady fleet costs one
    EVALSHA per Match even when every Match checks the generation."""
    a = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=0.0)
    b = RedisIndex(rproc.url, prefix=prefix, clock=clock)
    try:
        x = InstanceId("x", 0)
        await b.register(spec(x, ttl=30))
        await b.apply(EventBatch(x, 1, (store(4),)))
        await a.match(NS, KEYS)
        trips = a.round_trips
        for s in range(2, 22):
            clock.advance(1)
            await b.heartbeat(x)
            await b.apply(EventBatch(x, s, ()))
            assert [m.depth for m in await a.match(NS, KEYS)] == [4]
        assert a.round_trips - trips == 20
    finally:
        await a.close()
        await b.close()


async def test_matches_on_invented_namespaces_cache_nothing(
    pair: tuple[RedisIndex, RedisIndex],
) -> None:
    a, b = pair
    x = InstanceId("x", 0)
    await b.register(spec(x))
    await b.apply(EventBatch(x, 1, (store(4),)))
    assert len(await a.match(NS, KEYS)) == 1
    assert (MODEL, "") in a._ns_cache  # a namespace Redis holds is cached
    for i in range(5000):
        assert await a.match(Namespace(f"invented-{i}", "lora"), KEYS) == []
    assert list(a._ns_cache) == [(MODEL, "")]
    assert len(a._ns_names) <= 1


async def test_namespace_cache_is_a_bounded_lru(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    a = RedisIndex(rproc.url, prefix=prefix, clock=clock, ns_cache_size=8)
    b = RedisIndex(rproc.url, prefix=prefix, clock=clock)
    try:
        x = InstanceId("x", 0)
        await b.register(spec(x))
        loras = [f"l{i}" for i in range(40)]
        await b.apply(
            EventBatch(x, 1, tuple(store(2, lora, 1 + 2 * i) for i, lora in enumerate(loras)))
        )
        for lora in loras:
            keys = block_keys(toks(2), BS, MODEL, lora)
            assert [m.depth for m in await a.match(Namespace(MODEL, lora), keys)] == [2]
            assert len(a._ns_cache) <= 8
        assert list(a._ns_cache) == [(MODEL, lora) for lora in loras[-8:]]
        assert len(a._ns_names) <= 8
    finally:
        await a.close()
        await b.close()


async def test_removed_elsewhere_is_not_answered_past_the_bound(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    a = RedisIndex(rproc.url, prefix=prefix, clock=clock, instance_cache_ttl_s=BOUND_S)
    b = _DiesBeforePurging(rproc.url, prefix=prefix, clock=clock)
    try:
        x = InstanceId("x", 0)
        await b.register(spec(x))
        await b.apply(EventBatch(x, 1, (store(4),)))
        assert [m.instance for m in await a.match(NS, KEYS)] == [x]
        await b.remove_instance(x)  # its entries stay until someone purges them
        await past_bound()
        assert await a.match(NS, KEYS) == []
    finally:
        await a.close()
        await b.close()


async def test_entries_of_an_id_no_table_holds_cost_one_reread(
    pair: tuple[RedisIndex, RedisIndex], rproc: RedisProcess
) -> None:
    a, b = pair
    x = InstanceId("x", 0)
    await b.register(spec(x))
    await b.apply(EventBatch(x, 1, (store(4),)))
    assert [m.instance for m in await a.match(NS, KEYS)] == [x]
    # An entry no instance row or retired id accounts for.
    r = redis.Redis(host=rproc.host, port=rproc.port)
    try:
        r.hset(K.block_key(a._prefix, K.ns_id(MODEL), KEYS[0]), "999999999", 1)
    finally:
        r.close()
    trips = a.round_trips
    assert [m.instance for m in await a.match(NS, KEYS)] == [x]
    assert a.round_trips - trips == 2  # the Match, one reread
    for _ in range(5):
        assert [m.instance for m in await a.match(NS, KEYS)] == [x]
    assert a.round_trips - trips == 2 + 5


async def test_a_replica_of_another_key_schema_is_refused_and_changes_nothing(
    rproc: RedisProcess, clock: FakeClock, prefix: str
) -> None:
    """Two versions writing one index would corrupt it: the second is refused, naming why."""
    spec = InstanceSpec(InstanceId("w", 0), MODEL, "http://w", 30.0, "x")
    a = RedisIndex(rproc.url, prefix=prefix, clock=clock)
    try:
        await a.register(spec)
        raw = redis.Redis.from_url(rproc.url)
        key = K.schema_key(prefix)
        assert raw.get(key) == str(K.SCHEMA_VERSION).encode()  # claimed by the first writer
        raw.set(key, b"1")  # as an index written by an older version
        b = RedisIndex(rproc.url, prefix=prefix, clock=clock)
        try:
            with pytest.raises(FailedPrecondition) as e:
                await b.register(InstanceSpec(InstanceId("v", 0), MODEL, "http://v", 30.0, "x"))
            assert e.value.field == "redis.prefix" and "schema 1" in e.value.message
        finally:
            await b.close()
        assert [s.spec.instance for s in await a.list_instances()] == [spec.instance]
    finally:
        await a.close()
