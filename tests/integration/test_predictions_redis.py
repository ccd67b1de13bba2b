"""Route-time predictions on the Redis backend: shared by replicas over one Redis.

Two :class:`RedisIndex` over one real redis-server are two replicas: a
prediction recorded through one is seen by the other's Match; it expires by
its stored expiry (the injected clock) and its Redis names carry a TTL, so
nothing outlives it; an engine's removal, a clear, a reset and a removal of
the instance drop it; the per-instance cap drops the oldest. Each runs over a
standalone Redis and over a 3-master Cluster (predictions in the control
slot, KEYS.md "Predictions"), where prompts anchored on every master are
predicted and matched too.
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


@pytest.fixture(params=["redis", "redis-cluster"])
async def pair(
    request: pytest.FixtureRequest, clock: FakeClock
) -> AsyncIterator[tuple[RedisIndex, RedisIndex]]:
    """Two replicas over one standalone Redis, then over one 3-master Cluster."""
    cluster = request.param == "redis-cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = RedisIndex(server.url, prefix=prefix, clock=clock, cluster=cluster)
    b = RedisIndex(server.url, prefix=prefix, clock=clock, cluster=cluster)
    try:
        for w in (W0, W1):
            await a.register(InstanceSpec(w, NS.model, f"http://{w.worker_id}", 60.0))
        yield a, b
    finally:
        await a.close()
        await b.close()


def _client(request: pytest.FixtureRequest, idx: RedisIndex) -> Any:
    """A plain redis-py client of the Redis (or Cluster) behind ``idx``."""
    if idx.cluster:
        return redis.RedisCluster.from_url(request.getfixturevalue("redis_cluster").url)
    return redis.Redis.from_url(request.getfixturevalue("redis_server").url)


def _prediction_names(idx: RedisIndex, r: Any) -> list[bytes]:
    """Every Redis name of the predictions (KEYS.md: ``pr:``, ``po:``, ``pq:``)."""
    base = idx._base.decode()
    glob = base.replace("{", "[{]").replace("}", "[}]")
    return [n for what in ("pr:", "po:", "pq:") for n in r.scan_iter(match=f"{glob}{what}*")]


def view(hits: list[Any]) -> list[tuple[InstanceId, int, int]]:
    return [(m.instance, m.depth, m.predicted_depth) for m in hits]


async def test_a_replica_sees_anothers_prediction_until_it_expires(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    a, b = pair
    await a.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1, 2), block_keys=(101, 102)),)))
    # ttls of 20 and 10 s: the keys' Redis TTLs run on the real clock, and a
    # loaded machine may take more than a second between two lines here.
    assert await a.predict(NS, W0, KEYS, 20.0, 100) == 2  # 101, 102 are held
    assert await a.predict(NS, W1, KEYS[:3], 10.0, 100) == 3
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 2, 4), (W1, 0, 3)]
    assert view(await b.match(NS, KEYS)) == [(W0, 2, 0)]
    # Nothing is kept without a TTL.
    r = _client(request, a)
    try:
        names = _prediction_names(a, r)
        # 4 keys predicted, and per instance its order and pending deadlines.
        assert len(names) == 8 and all(0 < r.pttl(n) <= 20_000 for n in names)
    finally:
        r.close()
    clock.advance(10.0)
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 2, 4)]
    clock.advance(10.0)
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


async def test_pending_prefill_is_every_routers_unconfirmed_predictions(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock
) -> None:
    a, b = pair
    a.pending_reuse_s = b.pending_reuse_s = 0.0  # every read reads Redis
    await a.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1,), block_keys=(101,)),)))
    assert await b.pending_predicted(NS.model) == {}
    assert await a.predict(NS, W0, KEYS, 20.0, 100) == 3  # 101 is held
    assert await b.predict(NS, W1, KEYS[:2], 10.0, 100) == 2
    assert await a.predict(NS, W1, KEYS[:2], 10.0, 100) == 2  # the same blocks: counted once
    assert await b.pending_predicted(NS.model) == {W0: 3, W1: 2}
    assert await a.pending_predicted("another-model") == {}
    # The engine stores two of them: confirmed, so no longer pending; the
    # Match is what it was (a held block counts, predicted or not).
    stored = BlockStored(block_hashes=(2, 3), parent_block_hash=1, block_keys=(102, 103))
    await a.apply(EventBatch(W0, 2, (stored,)))
    assert await b.pending_predicted(NS.model) == {W0: 1, W1: 2}
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 3, 4), (W1, 0, 2)]
    clock.advance(10.0)  # W1's run out
    assert await b.pending_predicted(NS.model) == {W0: 1}
    clock.advance(10.0)
    assert await a.pending_predicted(NS.model) == {}
    # A replica reuses what it read for pending_reuse_s (a Match's depths are
    # still read each time).
    assert await b.pending_predicted(NS.model) == {}  # read now
    b.pending_reuse_s = 60.0
    await a.predict(NS, W0, KEYS, 10.0, 100)
    hits, pending = await b.match_with_pending(NS, KEYS)
    assert pending == {} and view(hits) == [(W0, 3, 4)]
    b.pending_reuse_s = 0.0
    hits, pending = await b.match_with_pending(NS, KEYS)
    assert pending == {W0: 1} and view(hits) == [(W0, 3, 4)]
    await a.apply(
        EventBatch(W0, 3, (BlockStored(block_hashes=(4,), parent_block_hash=3, block_keys=(104,)),))
    )
    # A stale instance is left out, like a dead one.
    await a.predict(NS, W1, KEYS, 10.0, 100)
    await a.apply(EventBatch(W1, 1, (BlockRemoved(block_hashes=(9,)),)))
    await a.apply(EventBatch(W1, 3, (BlockRemoved(block_hashes=(9,)),)))  # a gap: stale
    assert await a.pending_predicted(NS.model) == {}


async def test_pending_ends_at_the_routers_deadline(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock, request: pytest.FixtureRequest
) -> None:
    """A prediction recorded with ``pending_s`` leaves every replica's pending
    count at that deadline while its Match still sees it; predicted again, a
    key takes the newer deadline (or none); a store confirms it either way;
    predictions an older writer recorded (no ``pq:`` name) count until they
    expire."""
    a, b = pair
    a.pending_reuse_s = b.pending_reuse_s = 0.0
    assert await a.predict(NS, W0, KEYS, 10.0, 100, pending_s=1.0) == 4
    assert await a.predict(NS, W1, KEYS[:2], 10.0, 100, pending_s=3.0) == 2
    assert await b.pending_predicted(NS.model) == {W0: 4, W1: 2}
    clock.advance(1.5)
    assert await b.pending_predicted(NS.model) == {W1: 2}
    assert view(await b.match(NS, KEYS, include_predicted=True)) == [(W0, 0, 4), (W1, 0, 2)]
    # Two of W0's again: pending once more, one until a new deadline, one with none.
    await b.predict(NS, W0, KEYS[:1], 10.0, 100, pending_s=1.0)
    await b.predict(NS, W0, KEYS[1:2], 10.0, 100)
    assert await a.pending_predicted(NS.model) == {W0: 2, W1: 2}
    clock.advance(2.0)
    assert await a.pending_predicted(NS.model) == {W0: 1}
    # The engine stores it: confirmed, not pending.
    await a.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1, 2), block_keys=(101, 102)),)))
    assert await a.pending_predicted(NS.model) == {}
    # The ttl bounds the deadline: a pending_s past it counts while predicted.
    await a.predict(NS, W1, KEYS[2:], 2.0, 100, pending_s=5.0)
    assert await b.pending_predicted(NS.model) == {W1: 2}
    clock.advance(2.5)
    assert await b.pending_predicted(NS.model) == {}
    # An older writer's predictions: 'po:' and 'pr:' only.
    await a.predict(NS, W1, KEYS, 10.0, 100, pending_s=0.5)
    r = _client(request, a)
    try:
        for name in _prediction_names(a, r):
            if b"pq:" in name:
                r.delete(name)
    finally:
        r.close()
    clock.advance(1.0)
    # W0's last two (predicted at 0 s for 10 s) and W1's four, until they expire.
    assert await b.pending_predicted(NS.model) == {W0: 2, W1: 4}
    clock.advance(3.0)
    assert await b.pending_predicted(NS.model) == {W1: 4}


async def test_cap_refusals_and_expired_lease(
    pair: tuple[RedisIndex, RedisIndex], clock: FakeClock
) -> None:
    a, b = pair
    await a.predict(NS, W0, [1, 2, 3], 20.0, 4)
    clock.advance(0.1)
    await a.predict(NS, W0, [4, 5, 2], 20.0, 4)  # past the cap of 4: key 1 goes
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


def _anchors_on_every_master(r: Any, n: int) -> list[int]:
    """``n`` anchor keys whose slots (KEYS.md, "Key schema": top 16 bits) cover
    every master of the Cluster behind ``r``."""
    masters = {node.name for node in r.get_primaries()}
    by_master: dict[str, list[int]] = {}
    for top in range(1, 4096):
        key = (top << 48) | 7
        name = r.get_node_from_key(b"x{%04x}" % top).name
        by_master.setdefault(name, []).append(key)
    assert set(by_master) == masters
    picked = [keys[i] for i in range(n) for keys in by_master.values()]
    return picked[:n] if n >= len(masters) else picked


async def test_cluster_prompts_spanning_slots_and_a_clear(
    redis_cluster: Any, clock: FakeClock
) -> None:
    """Prompts anchored on every master: predictions made through one replica
    are seen by the other's Match whatever master holds the blocks; a clear
    purges the retired id's prediction names at once, and every name left
    carries a TTL and sits in the control slot."""
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = RedisIndex(redis_cluster.url, prefix=prefix, clock=clock, cluster=True)
    b = RedisIndex(redis_cluster.url, prefix=prefix, clock=clock, cluster=True)
    r: Any = redis.RedisCluster.from_url(redis_cluster.url)
    try:
        for w in (W0, W1):
            await a.register(InstanceSpec(w, NS.model, f"http://{w.worker_id}", 60.0))
        root = 5
        prompts = [[root, x, x + 1, x + 2] for x in _anchors_on_every_master(r, 6)]
        # W0 holds the first two blocks of each prompt; W1 nothing.
        for seq, p in enumerate(prompts, 1):
            hashes = (1000 * seq + 1, 1000 * seq + 2)
            stored = BlockStored(block_hashes=hashes, block_keys=(root, p[1]))
            await a.apply(EventBatch(W0, seq, (stored,)))
        for p in prompts:
            assert await a.predict(NS, W0, p, 5.0, 100) == 2
        assert await a.predict(NS, W1, prompts[0], 5.0, 100) == 4
        assert view(await b.match(NS, prompts[0], include_predicted=True)) == [
            (W0, 2, 4),
            (W1, 0, 4),
        ]
        for p in prompts[1:]:
            assert view(await b.match(NS, p, include_predicted=True)) == [(W0, 2, 4), (W1, 0, 1)]
        await a.apply(EventBatch(W0, len(prompts) + 1, (AllBlocksCleared(),)))
        for p in prompts[1:]:
            assert view(await b.match(NS, p, include_predicted=True)) == [(W1, 0, 1)]
        names = _prediction_names(a, r)
        # Left: W1's order, its pending deadlines and its 4 blocks, nothing of
        # W0's retired id.
        assert len(names) == 6
        ctl = r.keyslot(a._gen_key)
        assert all(r.keyslot(n) == ctl and 0 < r.pttl(n) <= 5000 for n in names)
    finally:
        r.close()
        await a.close()
        await b.close()


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
    is UNAVAILABLE, the rest works (Match with predictions and the purge included), and
    without +zcount the pending prefill is not reported (None), never an error."""
    idx = _acl_index(redis_server, clock, drop=("pexpire", "pttl", "zcount"))
    try:
        await idx.register(InstanceSpec(W0, NS.model, "http://w0", 60.0))
        await idx.apply(EventBatch(W0, 1, (BlockStored(block_hashes=(1,), block_keys=(101,)),)))
        with pytest.raises(Unavailable):
            await idx.predict(NS, W0, KEYS, 1.0, 10)
        assert view(await idx.match(NS, KEYS, include_predicted=True)) == [(W0, 1, 1)]
        assert await idx.pending_predicted(NS.model) is None
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
        assert await idx.predict(NS, W0, KEYS, 10.0, 2) == 4
        assert view(await idx.match(NS, KEYS, include_predicted=True)) == []  # cap 2: 101 went
        assert view(await idx.match(NS, KEYS[2:], include_predicted=True)) == [(W0, 0, 2)]
        assert await idx.pending_predicted(NS.model) == {W0: 2}
        await idx.apply(EventBatch(W0, 1, (AllBlocksCleared(),)))
        assert view(await idx.match(NS, KEYS[2:], include_predicted=True)) == []
    finally:
        await idx.close()
