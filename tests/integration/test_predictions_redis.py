"""Route-time predictions on the Redis backend: shared by replicas over one Redis.

Two :class:`RedisIndex` over one real redis-server are two replicas: a
prediction recorded through one is seen by the other's Match; it expires by
its stored expiry (the injected clock) and its Redis names carry a TTL, so
nothing outlives it; an engine's removal, a clear, a reset and a removal of
the instance drop it; the per-instance cap drops the oldest. On a Cluster
PredictPlacement is refused with FAILED_PRECONDITION naming it, and a Match
with predictions answers the confirmed hits.
"""

from __future__ import annotations

import secrets
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis

from indexer.model import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
)
from indexer.redis.backend import RedisIndex
from indexer.redis.connection import acl_rule
from kvmesh.errors import FailedPrecondition, NotFound, Unavailable
from tests.conftest import FakeClock

NS = Namespace("m")
W0, W1 = InstanceId("w0"), InstanceId("w1", 1)
KEYS = [101, 102, 103, 104]


@pytest.fixture
async def pair(redis_server: Any, clock: FakeClock) -> AsyncIterator[tuple[RedisIndex, RedisIndex]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = RedisIndex(redis_server.url, prefix=prefix, clock=clock)
    b = RedisIndex(redis_server.url, prefix=prefix, clock=clock)
    try:
        for w in (W0, W1):
            await a.register(InstanceSpec(w, NS.model, f"http://{w.worker_id}", 60.0))
        yield a, b
    finally:
        await a.close()
        await b.close()


def view(hits: list[Any]) -> list[tuple[InstanceId, int, int]]:
    return [(m.instance, m.depth, m.predicted_depth) for m in hits]


async def test_a_replica_sees_anothers_prediction_until_it_expires(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock, redis_server: Any
) -> None:
    a, b = pair
    await a.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1, 2), block_keys=(101, 102)),)))
    assert await a.predict(NS, W0, KEYS, 2.0, 100) == 2  # 101, 102 are held
    assert await a.predict(NS, W1, KEYS[:3], 1.0, 100) == 3
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 2, 4), (W1, 0, 3)]
    assert view(await b.match(NS, KEYS)) == [(W0, 2, 0)]
    # Nothing is kept without a TTL.
    r = redis.Redis.from_url(redis_server.url)
    try:
        names = [n for n in r.scan_iter(match=f"{a._prefix}:p*")]
        assert names and all(0 < r.pttl(n) <= 2000 for n in names)
    finally:
        r.close()
    clock.advance(1.0)
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 2, 4)]
    clock.advance(1.0)
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 2, 2)]


async def test_engine_events_and_instance_changes_drop_predictions(
    pair: tuple[RedisIndex, RedisIndex],
) -> None:
    a, b = pair
    await a.predict(NS, W0, KEYS, 5.0, 100)
    await a.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1, 2), block_keys=(101, 102)),)))
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 2, 4)]
    await a.apply(EventBatch(W0, 2, (BlockRemoved(block_hashes=(1,)),)))
    assert view(await b.match(NS, KEYS, include_predicted=True)) == []
    await a.predict(NS, W0, KEYS, 5.0, 100)
    await a.apply(EventBatch(W0, 3, (AllBlocksCleared(),)))
    assert view(await b.match(NS, KEYS, include_predicted=True)) == []
    await a.predict(NS, W0, KEYS, 5.0, 100)
    await a.register(InstanceSpec(W0, NS.model, "http://w0", 60.0, incarnation="new"))
    assert view(await b.match(NS, KEYS, include_predicted=True)) == []
    await a.predict(NS, W1, KEYS, 5.0, 100)
    await a.remove_instance(W1)
    await a.register(InstanceSpec(W1, NS.model, "http://w1", 60.0))
    assert view(await b.match(NS, KEYS, include_predicted=True)) == []


async def test_cap_refusals_and_expired_lease(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock
) -> None:
    a, b = pair
    await a.predict(NS, W0, [1, 2, 3], 5.0, 4)
    clock.advance(0.1)
    await a.predict(NS, W0, [4, 5, 2], 5.0, 4)  # past the cap of 4: key 1 goes
    assert view(await b.match(NS, [1, 2], include_predicted=True)) == []
    assert view(await b.match(NS, [2, 3, 4, 5], include_predicted=True)) == [(W0, 0, 4)]
    with pytest.raises(NotFound):
        await b.predict(NS, InstanceId("nobody"), [1], 1.0, 4)
    with pytest.raises(FailedPrecondition) as err:
        await b.predict(Namespace("other"), W0, [1], 1.0, 4)
    assert err.value.field == "model"
    clock.advance(61.0)
    with pytest.raises(NotFound):
        await b.predict(NS, W0, [1], 1.0, 4)


async def test_cluster_refuses_predict_and_matches_confirmed(
    redis_cluster: Any, clock: FakeClock
) -> None:
    idx = RedisIndex(
        redis_cluster.url, prefix=f"t{uuid.uuid4().hex[:8]}", clock=clock, cluster=True
    )
    try:
        await idx.register(InstanceSpec(W0, NS.model, "http://w0", 60.0))
        await idx.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1,), block_keys=(101,)),)))
        with pytest.raises(FailedPrecondition) as err:
            await idx.predict(NS, W0, KEYS, 1.0, 100)
        assert "PredictPlacement" in str(err.value) and "redis" in str(err.value)
        assert view(await idx.match(NS, KEYS, include_predicted=True)) == [(W0, 1, 1)]
    finally:
        await idx.close()


def _acl_index(redis_server: Any, clock: FakeClock, drop: tuple[str, ...] = ()) -> RedisIndex:
    """An index whose user has :func:`acl_rule`'s rights, less the commands ``drop``."""
    prefix = f"lp{uuid.uuid4().hex[:8]}"
    user, password = f"u-{prefix}", secrets.token_hex(12)
    rules = [r for r in acl_rule(prefix).split() if r.lstrip("+") not in drop]
    admin = redis.Redis.from_url(redis_server.url)
    try:
        admin.execute_command("ACL", "SETUSER", user, "reset", "on", f">{password}", *rules)
    finally:
        admin.close()
    return RedisIndex(
        redis_server.url, prefix=prefix, clock=clock, username=user, password=password
    )


async def test_an_older_acl_rule_refuses_only_predictions(
    redis_server: Any, clock: FakeClock
) -> None:
    """A user made by the rule of before predictions (no pexpire, pttl): PredictPlacement
    is UNAVAILABLE, the rest works (Match with predictions and the purge included)."""
    idx = _acl_index(redis_server, clock, drop=("pexpire", "pttl"))
    try:
        await idx.register(InstanceSpec(W0, NS.model, "http://w0", 60.0))
        await idx.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1,), block_keys=(101,)),)))
        with pytest.raises(Unavailable):
            await idx.predict(NS, W0, KEYS, 1.0, 10)
        assert view(await idx.match(NS, KEYS, include_predicted=True)) == [(W0, 1, 1)]
        await idx.apply(EventBatch(W0, 2, (AllBlocksCleared(),)))
        assert view(await idx.match(NS, KEYS)) == []
    finally:
        await idx.close()


async def test_predictions_need_only_the_least_acl_rule(
    redis_server: Any, clock: FakeClock
) -> None:
    """Predict, Match with predictions and the purge of a retired id's predictions,
    as a user with exactly :func:`acl_rule`'s rights."""
    idx = _acl_index(redis_server, clock)
    try:
        await idx.register(InstanceSpec(W0, NS.model, "http://w0", 60.0))
        assert await idx.predict(NS, W0, KEYS, 1.0, 2) == 4
        assert view(await idx.match(NS, KEYS, include_predicted=True)) == []  # cap 2: 101 went
        assert view(await idx.match(NS, KEYS[2:], include_predicted=True)) == [(W0, 0, 2)]
        await idx.apply(EventBatch(W0, 1, (AllBlocksCleared(),)))
        assert view(await idx.match(NS, KEYS[2:], include_predicted=True)) == []
    finally:
        await idx.close()
