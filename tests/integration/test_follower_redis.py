"""A follower of a replica over Redis answers what every replica answers.

Two real indexer servers share one real redis-server (or one real 3-master Redis
Cluster) and key prefix, as two replicas behind a load balancer. A router's
follower (router_client/follower.py) follows replica B, which serves WatchIndex
from its copy of the shared index (indexer/redis/watchfeed.py, fed by the change
stream of indexer/redis/KEYS.md "Watching"). The random workload of
tests/integration/test_follower.py goes to either replica at random
(registrations, resets, stores, removals, tier moves, clears, counted copies,
orphans, heartbeats, removals), half of it before the follower starts. Once B's
copy holds every entry of the stream and the follower every change of B's copy,
each prompt's Match from the follower is compared with replica A's own Match,
which reads Redis.

Broken on purpose: a copy that drops the removals of the batches it applies
fails the comparison. Faults: the stream's counter lost (its next entry is not
the one expected) and the whole prefix wiped (a Redis restarted empty) make B
copy the index again and its followers take a new snapshot, after which they
answer what A answers again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from indexer.model import BatchOutcome, BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from indexer.redis.backend import RedisIndex
from indexer.redis.watchfeed import RedisWatchFeed
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.blockkeys import block_keys
from router_client.follower import IndexFollower
from tests.grpc.conftest import Harness, close_harness, expect_status, make_config, open_harness
from tests.integration.test_follower import BLOCK, _compare, _step, _World
from tests.integration.test_redis_apply_parts import CutOff
from tests.integration.test_zmq_subscriber import eventually


class _Either:
    """Each call on one of two replicas, at random (a load balancer)."""

    def __init__(self, a: Harness, b: Harness, rng: random.Random) -> None:
        self._pair = (a, b)
        self._rng = rng

    @property
    def stub(self) -> Any:
        return self._rng.choice(self._pair).stub


class _Pair:
    def __init__(self, a: Harness, b: Harness, ra: RedisIndex, rb: RedisIndex) -> None:
        self.a, self.b, self.ra, self.rb = a, b, ra, rb

    @property
    def feed(self) -> RedisWatchFeed:
        feed = self.b.server.servicer.watch_feed
        assert feed is not None
        return feed


@pytest.fixture(params=["standalone", "cluster"])
async def pair(request: pytest.FixtureRequest) -> AsyncIterator[_Pair]:
    """Two replicas over one standalone Redis, or over one 3-master Cluster
    (``parts``, ``cluster-parts``: every batch of three blocks or more applied
    in parts of two, KEYS.md "Apply in parts")."""
    cluster = request.param.startswith("cluster")
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    part = {"apply_part_blocks": 2} if request.param.endswith("parts") else {}
    ra = RedisIndex(server.url, prefix=prefix, cluster=cluster, **part)
    rb = RedisIndex(server.url, prefix=prefix, cluster=cluster, **part)
    a = await open_harness(make_config(), ra)
    b = await open_harness(make_config(), rb)
    try:
        yield _Pair(a, b, ra, rb)
    finally:
        await close_harness(a)
        await close_harness(b)
        await ra.close()
        await rb.close()


async def _caught_up(p: _Pair, f: IndexFollower, within: float = 15.0) -> None:
    """B's copy holds every entry of the stream, the follower every change of the copy."""
    feed = p.feed

    async def done() -> bool:
        top = await p.ra._cmd("GET", p.ra._base + b"wn")
        m = feed.mirror
        if top is None or m is None or m.watch is None or feed.position < int(top):
            return False
        return f.synced and f.position >= m.watch.position

    await eventually(done, within=within)


async def _start(p: _Pair, w: _World, follower_cls: type[IndexFollower] = IndexFollower) -> Any:
    either = _Either(p.a, p.b, w.rng)
    for _ in range(150):  # before the follower: B's copy and its snapshot hold them
        await _step(either, w)  # type: ignore[arg-type]
    f = follower_cls(p.b.server.address)
    await f.start()
    assert await f.wait_synced(20)
    return either, f


async def _compare_with_a(p: _Pair, w: _World, f: IndexFollower) -> int:
    await _caught_up(p, f)
    # A's view of the instance table may lag Redis by its instance_cache_ttl_s
    # (indexer/redis/KEYS.md, "The bound"): writes through B (a stale flag, a
    # reset) reach A's answers once its first Match past the bound checks the
    # generation. B's copy has them from the stream at once.
    await asyncio.sleep(p.ra._cache_ttl)
    return await _compare(_AsA(p), w, f)  # type: ignore[arg-type]


class _AsA:
    """What _compare needs of a harness: A's stub, and a hub already caught up."""

    def __init__(self, p: _Pair) -> None:
        self.stub = p.a.stub
        m = p.feed.mirror
        assert m is not None
        self.server = type("S", (), {"index": m})()


async def _run(p: _Pair, seed: int, follower_cls: type[IndexFollower] = IndexFollower) -> int:
    w = _World(random.Random(seed))
    either, f = await _start(p, w, follower_cls)
    try:
        wrong = await _compare_with_a(p, w, f)
        for _ in range(250):  # while it follows
            await _step(either, w)
        wrong += await _compare_with_a(p, w, f)
        assert p.feed.resyncs == 0 and p.feed.errors == 0
        assert p.feed.entries_applied > 0
        # Writers that learnt of the watch from their applies sent every batch
        # with its message: no instance had to be read again.
        assert p.feed.reloads == 0
        # Route-time predictions went through both replicas and reached the
        # copy (from the stream and in its first read) and the follower.
        assert w.predicted_hits > 20 and f.predictions_followed
        return wrong
    finally:
        await f.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_a_follower_of_a_redis_replica_answers_what_the_replicas_answer(
    pair: _Pair, seed: int
) -> None:
    assert await _run(pair, seed) == 0
    # Every registration, batch and removal reached the copy through the stream
    # (not by reading instances again: the writers knew someone watched).
    assert pair.feed.copies == 1


@pytest.mark.parametrize("pair", ["parts", "cluster-parts"], indirect=True)
async def test_the_same_with_batches_in_parts(pair: _Pair) -> None:
    """Every batch of three blocks or more in parts of two: the copy keeps
    each batch's parts and applies it whole at its last part."""
    assert await _run(pair, 1) == 0
    assert pair.feed.copies == 1
    assert pair.ra.batches_in_parts + pair.rb.batches_in_parts > 20


def _long(seq: int, seed: int, blocks: int = 0) -> EventBatch:
    """Two chains of 100 to 200 blocks (one of ``blocks``, when given)."""
    rng = random.Random(seed)
    events = []
    for _ in range(1 if blocks else 2):
        n = blocks or rng.randrange(100, 200)
        hashes = tuple(rng.getrandbits(63) for _ in range(n))
        tokens = tuple(rng.randrange(1, 30_000) for _ in range(BLOCK * n))
        events.append(BlockStored(hashes, None, tokens, BLOCK))
    return EventBatch(LONG, seq, tuple(events), counts_copies=True)


LONG = InstanceId("long", 0)


async def _same_in_copy(p: _Pair, *batches: EventBatch) -> None:
    """Once B's copy holds the whole stream: its Match of each chain equals Redis's."""
    feed = p.feed

    async def caught_up() -> bool:
        top = await p.ra._cmd("GET", p.ra._base + b"wn")
        return feed.mirror is not None and top is not None and feed.position >= int(top)

    await eventually(caught_up, within=15)
    assert feed.mirror is not None
    for batch in batches:
        for ev in batch.events:
            assert isinstance(ev, BlockStored)
            keys = block_keys(ev.token_ids, BLOCK, "m")
            want = await p.ra.match(Namespace("m"), keys, include_stale=True)
            got = await feed.mirror.match(Namespace("m"), keys, include_stale=True)
            assert [(m.instance, m.depth, m.stale) for m in got] == [
                (m.instance, m.depth, m.stale) for m in want
            ]


@pytest.mark.parametrize("pair", ["parts"], indirect=True)
async def test_a_batch_in_parts_reaches_the_copy_whole_cut_off_or_not(
    pair: _Pair, redis_server: Any
) -> None:
    """The copy keeps a batch's parts until its last, whichever replica sends
    them; a batch left midway (the engine went on) makes it read the instance."""
    w = _World(random.Random(4))
    _, f = await _start(pair, w)
    cut = CutOff(redis_server.url, prefix=pair.ra._prefix, apply_part_blocks=50)
    try:
        await pair.ra.register(InstanceSpec(LONG, "m", "http://long", 3600.0, "x"))
        one = _long(1, 1)
        cut.parts = 2
        with pytest.raises(ConnectionError):
            await cut.apply(one)
        assert pair.rb.apply_part_blocks == 2
        assert (await pair.rb.apply(one)).outcome is BatchOutcome.APPLIED
        await _same_in_copy(pair, one)
        assert pair.feed.reloads == 0
        # ... and the follower of the copy: the whole chain, from its own copy.
        chain = one.events[0]
        assert isinstance(chain, BlockStored)
        keys = block_keys(chain.token_ids, BLOCK, "m")

        def followed() -> bool:
            got = f.match("m", "", keys)
            return got is not None and any(m.depth == len(keys) for m in got.matches.values())

        await eventually(followed, within=10)
        # An event whose parent is unknown is an orphan whole, even where its
        # second block names a parent the instance holds (its first block's
        # engine hash is another chain's): the copy joins the event's pieces again.
        orphan = _long(2, 6)
        first = orphan.events[0]
        assert isinstance(first, BlockStored)
        twin = BlockStored(
            (first.block_hashes[0], *range(1, 200)),
            12345,
            tuple(first.token_ids[:BLOCK]) + tuple(range(1, 199 * BLOCK + 1)),
            BLOCK,
        )
        orphan = dataclasses.replace(orphan, events=(first, twin))
        got = await pair.rb.apply(orphan)
        assert got.blocks_orphaned == 199 + 1, got
        await _same_in_copy(pair, orphan)
        assert pair.feed.reloads == 0
        one = orphan
        # Left midway: batch 2 never finishes; batch 3 comes after (a gap), whole
        # (two blocks); then batch 4 is left midway, and batch 5 comes in parts.
        two, three, four, five = _long(3, 2), _long(4, 3, 1), _long(5, 4), _long(6, 5)
        cut.parts = 1
        with pytest.raises(ConnectionError):
            await cut.apply(two)
        assert (await pair.ra.apply(three)).outcome is BatchOutcome.APPLIED_AFTER_GAP
        await _same_in_copy(pair, one, two, three)
        assert pair.feed.reloads == 1
        cut.parts = 1
        with pytest.raises(ConnectionError):
            await cut.apply(four)
        assert (await pair.ra.apply(five)).outcome is BatchOutcome.APPLIED_AFTER_GAP
        await _same_in_copy(pair, one, two, three, four, five)
        # (Once when batch 5 met batch 4's parts, once at batch 5's last part:
        # the read may end inside one of its events.)
        assert pair.feed.reloads == 3
        assert await _compare_with_a(pair, w, f) == 0
    finally:
        await cut.close()
        await f.close()


class _DropsRemovals(RedisWatchFeed):
    """Broken on purpose: the copy applies every batch without its removals."""

    async def _apply(self, mirror: Any, f: dict[bytes, bytes]) -> None:
        if f.get(b"k") == b"b":
            batch = pb.EventBatch.FromString(f[b"x"])
            keep = [e for e in batch.events if e.WhichOneof("kind") != "removed"]
            del batch.events[:]
            batch.events.extend(keep)
            f = {**f, b"x": batch.SerializeToString()}
        await super()._apply(mirror, f)


class _DropsPredictions(RedisWatchFeed):
    """Broken on purpose: the copy skips the stream's route-time predictions."""

    async def _apply(self, mirror: Any, f: dict[bytes, bytes]) -> None:
        if f.get(b"k") == b"p":
            f = {**f, b"x": b""}
        await super()._apply(mirror, f)


class _IgnoresPendingDeadlines(RedisWatchFeed):
    """Broken on purpose: the copy counts each prediction as pending prefill
    while it lives, whatever its pending deadline ('q')."""

    async def _apply(self, mirror: Any, f: dict[bytes, bytes]) -> None:
        if f.get(b"k") == b"p":
            f = {k: v for k, v in f.items() if k != b"q"}
        await super()._apply(mirror, f)


# Standalone only: the copy reads one stream whatever the topology, and the
# comparison above runs over both.
@pytest.mark.parametrize("pair", ["standalone"], indirect=True)
@pytest.mark.parametrize("broken", [_DropsRemovals, _DropsPredictions, _IgnoresPendingDeadlines])
async def test_a_copy_that_drops_changes_fails_the_comparison(
    pair: _Pair, broken: type[RedisWatchFeed]
) -> None:
    feed = pair.feed
    pair.b.server.servicer.watch_feed = broken(
        feed.index, max_followers=8, buffer=4096, backlog=feed.backlog
    )
    try:
        # One seed: each broken copy gives some hundreds of wrong answers in it.
        assert await _run(pair, 1) > 0
    finally:
        await pair.b.server.servicer.watch_feed.close()


async def test_a_lost_entry_makes_the_replica_copy_again_and_followers_resync(
    pair: _Pair,
) -> None:
    w = _World(random.Random(7))
    either, f = await _start(pair, w)
    try:
        assert await _compare_with_a(pair, w, f) == 0
        snapshots = f.snapshots
        old = pair.feed.mirror
        assert old is not None and old.watch is not None
        # The counter lost: the next entry is numbered from the clock, not after ours.
        await pair.ra._cmd("DEL", pair.ra._base + b"wn")
        for _ in range(60):
            await _step(either, w)
        await eventually(lambda: pair.feed.resyncs >= 1, within=10)
        await eventually(lambda: f.snapshots > snapshots, within=20)
        assert await _compare_with_a(pair, w, f) == 0
        # The new copy's positions go on past the old one's: a follower still on
        # the old copy (its stream not ended yet) is never at a position of the new.
        new = pair.feed.mirror
        assert new is not None and new.watch is not None and new is not old
        assert new.watch.position > old.watch.position
    finally:
        await f.close()


async def test_a_redis_restarted_empty_makes_the_replica_copy_again(pair: _Pair) -> None:
    w = _World(random.Random(8))
    either, f = await _start(pair, w)
    try:
        assert await _compare_with_a(pair, w, f) == 0
        snapshots = f.snapshots
        # Every key of the prefix gone, as after a restart without persistence.
        for base in {pair.ra._base, pair.ra._prefix.encode() + b":"}:
            keys = [k async for k in pair.ra._r.scan_iter(match=base + b"*")]
            for k in keys:  # one at a time: a Cluster's keys are in many slots
                await pair.ra._cmd("UNLINK", k)
        await eventually(lambda: pair.feed.resyncs >= 1, within=10)
        await eventually(lambda: f.snapshots > snapshots, within=20)
        # The engines register again (their sequences start over) and publish.
        w.incarnation.clear()
        w.seq.clear()
        w.model.clear()
        w.hashes.clear()
        for _ in range(120):
            await _step(either, w)
        assert await _compare_with_a(pair, w, f) == 0
    finally:
        await f.close()


async def test_an_instance_read_again_reaches_followers_as_a_new_snapshot(pair: _Pair) -> None:
    """An ``r`` entry (a batch the quotas cut) makes the copy read the instance
    from Redis; its followers take a new snapshot and answer the same."""
    w = _World(random.Random(9))
    either, f = await _start(pair, w)
    try:
        assert await _compare_with_a(pair, w, f) == 0
        snapshots = f.snapshots
        key = next(k for k in w.incarnation)
        iname = f"{key[0]}\0{key[1]}".encode()
        base = pair.ra._base
        await pair.ra._r.eval(
            "local n = redis.call('INCR', KEYS[1]) "
            "redis.call('XADD', KEYS[2], '*', 'n', n, 'k', 'r', 'i', ARGV[1], 't', ARGV[2])",
            2,
            base + b"wn",
            base + b"w",
            iname,
            repr(pair.ra._clock()),
        )
        await eventually(lambda: pair.feed.reloads >= 1, within=10)
        await eventually(lambda: f.snapshots > snapshots, within=20)
        for _ in range(40):
            await _step(either, w)
        assert await _compare_with_a(pair, w, f) == 0
        assert pair.feed.resyncs == 0
    finally:
        await f.close()


async def test_until_the_copy_is_made_watch_index_says_unavailable(pair: _Pair) -> None:
    pair.feed.settle_s = 3.0
    call: Any = pair.b.stub.WatchIndex(pb.WatchIndexRequest())
    err = await expect_status(call.read(), grpc.StatusCode.UNAVAILABLE)
    assert "copying the index" in (err.details() or "")
    await eventually(lambda: pair.feed.mirror is not None, within=10)


async def test_a_user_without_the_stream_rights_is_told_and_keeps_writing(
    redis_server: Any,
) -> None:
    """A user made by the rule of before watching (no xadd, xread, xrevrange):
    WatchIndex answers UNAVAILABLE with the refusal (NOPERM in the wstart script, the
    ACL SETUSER to run), and writes go on: none of them appends to the stream."""
    from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
    from tests.conftest import FakeClock
    from tests.integration.test_predictions_redis import _acl_index

    idx = _acl_index(redis_server, FakeClock(), drop=("xadd", "xread", "xrevrange"))
    h = await open_harness(make_config(), idx)
    try:
        w0 = InstanceId("w0", 0)
        await idx.register(InstanceSpec(w0, "m", "http://w0", 60.0))
        call: Any = h.stub.WatchIndex(pb.WatchIndexRequest())
        await expect_status(call.read(), grpc.StatusCode.UNAVAILABLE)
        feed = h.server.servicer.watch_feed
        assert feed is not None
        await eventually(lambda: "NOPERM" in feed.last_error)
        call = h.stub.WatchIndex(pb.WatchIndexRequest())
        err = await expect_status(call.read(), grpc.StatusCode.UNAVAILABLE)
        details = err.details() or ""
        assert "NOPERM" in details and "wstart" in details and "ACL SETUSER" in details
        await idx.apply(EventBatch(w0, 1, (BlockStored(block_hashes=(1,), block_keys=(101,)),)))
        got = await idx.match(Namespace("m"), [101])
        assert [m.instance for m in got] == [w0]
    finally:
        await close_harness(h)
        await idx.close()


async def test_past_its_bound_the_copy_is_dropped_and_followers_are_refused(
    redis_server: Any,
) -> None:
    """``watch.redis_max_pairs``: a copy that would hold more (block, instance)
    pairs is dropped (the replica's memory is not the fleet's index), WatchIndex
    answers RESOURCE_EXHAUSTED naming the setting, and writes go on."""
    from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace

    prefix = f"t{uuid.uuid4().hex[:8]}"
    idx = RedisIndex(redis_server.url, prefix=prefix)
    h = await open_harness(make_config(watch={"redis_max_pairs": 10}), idx)
    try:
        w0 = InstanceId("w0", 0)
        await idx.register(InstanceSpec(w0, "m", "http://w0", 60.0))
        ev = BlockStored(block_hashes=tuple(range(1, 9)), block_keys=tuple(range(101, 109)))
        await idx.apply(EventBatch(w0, 1, (ev,)))
        f = IndexFollower(h.server.address)
        await f.start()
        assert await f.wait_synced(10)  # 8 pairs: within the bound
        feed = h.server.servicer.watch_feed
        assert feed is not None
        ev = BlockStored(block_hashes=tuple(range(9, 13)), block_keys=tuple(range(109, 113)))
        await idx.apply(EventBatch(w0, 2, (ev,)))  # 12 pairs: past it
        await eventually(lambda: feed.mirror is None and feed.refusals >= 1, within=10)
        await eventually(lambda: not f.synced, within=10)
        await f.close()
        call: Any = h.stub.WatchIndex(pb.WatchIndexRequest())
        err = await expect_status(call.read(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "watch.redis_max_pairs" in (err.details() or "")
        got = await idx.match(Namespace("m"), list(range(101, 113)))
        assert [(m.instance, m.depth) for m in got] == [(w0, 12)]
    finally:
        await close_harness(h)
        await idx.close()
