"""Calls beyond the connection pool wait for a connection instead of failing.

redis-py's pools raise MaxConnectionsError the moment every connection is in
use (100 by default): with 64 engines ingesting and routers probing, a burst
of calls failed as UNAVAILABLE although Redis was fine. The backend now holds
at most ``max_connections`` calls in flight and queues the rest.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest

from indexer.model import InstanceId, InstanceSpec, Namespace
from indexer.redis.backend import RedisIndex


def _clients(server_url: str) -> int:
    import redis

    r = redis.Redis.from_url(server_url)
    try:
        return len(r.client_list())
    finally:
        r.close()


@pytest.mark.parametrize("cluster", [False, True], ids=["standalone", "cluster"])
async def test_a_burst_beyond_the_pool_waits_and_succeeds(
    cluster: bool, request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_cluster" if cluster else "redis_server").url
    before = _clients(url) if not cluster else 0
    idx = RedisIndex(url, prefix=f"pool{uuid.uuid4().hex[:8]}", cluster=cluster, max_connections=4)
    try:
        specs = [
            InstanceSpec(InstanceId(f"w{i}", 0), model="m", address="a", incarnation="i")
            for i in range(40)
        ]
        await asyncio.gather(*(idx.register(s) for s in specs))
        # 400 calls at once against a pool of 4: none fails.
        states = await asyncio.gather(*(idx.heartbeat(s.instance) for s in specs * 10))
        assert len(states) == 400 and all(s.live for s in states)
        if not cluster:
            assert _clients(url) - before <= 4
    finally:
        await idx.close()


async def test_the_default_pool_takes_a_burst_larger_than_redis_pys_default(
    redis_server: Any,
) -> None:
    idx = RedisIndex(redis_server.url, prefix=f"pool{uuid.uuid4().hex[:8]}")
    try:
        spec = InstanceSpec(InstanceId("w", 0), model="m", address="a", incarnation="i")
        await idx.register(spec)
        states = await asyncio.gather(*(idx.heartbeat(spec.instance) for _ in range(300)))
        assert all(s.live for s in states)
    finally:
        await idx.close()


async def _engines(idx: RedisIndex, n: int, blocks: int) -> tuple[list[InstanceId], Any]:
    """``n`` instances of model ``m`` registered, and one store of ``blocks``
    blocks (keys 1..blocks) for each to apply."""
    from indexer.model import BlockStored

    ids = [InstanceId(f"w{i}", 0) for i in range(n)]
    for iid in ids:
        await idx.register(InstanceSpec(iid, model="m", address="a", incarnation="i"))
    keys = tuple(range(1, blocks + 1))
    return ids, BlockStored(block_hashes=keys, block_keys=keys)


class _ScriptsInFlight:
    """Counts the calls of one Redis script in flight at once through a client
    class's ``execute_command`` (the real command runs): ``most`` at once,
    ``done`` finished, and for a ``probe`` script how many were done when each
    of its calls finished. :meth:`learn` gives it the index's script names."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, cls: Any, script: str, probe: str = ""
    ) -> None:
        self.names: dict[Any, str] = {}
        self.now = self.most = self.done = 0
        self.probe_done_at: list[int] = []
        real = cls.execute_command

        async def counting(client: Any, *args: Any, **kw: Any) -> Any:
            name = self.names.get(args[1]) if args and args[0] == "EVALSHA" else None
            if name != script:
                res = await real(client, *args, **kw)
                if probe and name == probe:
                    self.probe_done_at.append(self.done)
                return res
            self.now += 1
            self.most = max(self.most, self.now)
            try:
                return await real(client, *args, **kw)
            finally:
                self.now -= 1
                self.done += 1

        monkeypatch.setattr(cls, "execute_command", counting)

    def learn(self, idx: RedisIndex) -> None:
        """The script names of ``idx``."""
        self.names.update({s.sha: s.name for s in idx._scripts.values()})


@pytest.mark.parametrize("bound", [1, 0], ids=["one-write", "unbounded"])
async def test_writes_wait_their_turn_here_and_a_match_does_not_wait_behind_them(
    redis_server: Any, monkeypatch: pytest.MonkeyPatch, bound: int
) -> None:
    """``max_writes_in_flight``: 30 applies at once reach Redis one at a time,
    and a Match sent after them reaches it at once and is answered while most
    still wait. Unbounded, they are all sent together (the count can fail)."""
    from redis.asyncio import Redis

    from indexer.model import EventBatch

    count = _ScriptsInFlight(monkeypatch, Redis, "apply", probe="match")
    idx = RedisIndex(
        redis_server.url, prefix=f"wg{uuid.uuid4().hex[:8]}", max_writes_in_flight=bound
    )
    count.learn(idx)
    try:
        ids, stored = await _engines(idx, 30, 400)
        keys = stored.block_keys
        assert keys is not None
        applies = [asyncio.ensure_future(idx.apply(EventBatch(iid, 1, (stored,)))) for iid in ids]
        await asyncio.sleep(0)  # every apply is on its way (or at the gate)
        hits = await idx.match(Namespace("m"), keys[:32])
        await asyncio.gather(*applies)
        assert len(hits) >= 1 and count.done >= 30  # (and any check the apply script runs)
        if bound:
            assert count.most == 1
            # Answered before half of the applies sent ahead of it were.
            assert count.probe_done_at and count.probe_done_at[0] < 15
        else:
            assert count.most > 1
    finally:
        await idx.close()


@pytest.mark.parametrize("bound", [None, 0], ids=["default", "unbounded"])
async def test_a_cluster_replica_bounds_its_writes_in_flight_by_default(
    redis_cluster: Any, monkeypatch: pytest.MonkeyPatch, bound: int | None
) -> None:
    """Over a Cluster, by default, at most DEFAULT_CLUSTER_WRITES_IN_FLIGHT apply
    scripts are in flight at once (30 engines' batches sent together), so the
    replica works on a few batches at a time and a Match does not queue behind
    all of them; with 0, all go at once."""
    from redis.asyncio.cluster import RedisCluster

    from indexer.model import EventBatch
    from indexer.redis.backend import DEFAULT_CLUSTER_WRITES_IN_FLIGHT

    count = _ScriptsInFlight(monkeypatch, RedisCluster, "capply")
    idx = RedisIndex(
        redis_cluster.url,
        prefix=f"wc{uuid.uuid4().hex[:8]}",
        cluster=True,
        max_writes_in_flight=bound,
    )
    count.learn(idx)
    try:
        ids, stored = await _engines(idx, 30, 200)
        keys = stored.block_keys
        assert keys is not None
        await asyncio.gather(*(idx.apply(EventBatch(iid, 1, (stored,))) for iid in ids))
        hits = await idx.match(Namespace("m"), keys[:32])
        assert len(hits) == 30
        if bound is None:
            assert idx.max_writes_in_flight == DEFAULT_CLUSTER_WRITES_IN_FLIGHT
            assert count.most == DEFAULT_CLUSTER_WRITES_IN_FLIGHT
        else:
            assert count.most > DEFAULT_CLUSTER_WRITES_IN_FLIGHT
    finally:
        await idx.close()


async def test_a_stalled_redis_fails_the_queued_writes_after_one_timeout() -> None:
    """Writes waiting their turn give up after ``write_timeout_s`` of waiting,
    unsent: five applies against a Redis that answers nobody fail within about
    one timeout, not five one after the other."""
    import signal
    import time

    from indexer.model import BlockStored, EventBatch
    from kvmesh.errors import Unavailable
    from lab.redisproc import RedisProcess

    with RedisProcess() as server:
        idx = RedisIndex(
            server.url,
            prefix="stall",
            socket_timeout_s=0.5,
            write_timeout_s=1.0,
            max_writes_in_flight=1,
        )
        try:
            ids = [InstanceId(f"w{i}", 0) for i in range(5)]
            for iid in ids:
                await idx.register(InstanceSpec(iid, model="m", address="a", incarnation="i"))
            stored = BlockStored(block_hashes=(1, 2), block_keys=(1, 2))
            assert server._child is not None
            server._child.signal_group(signal.SIGSTOP)  # it answers nobody
            t0 = time.monotonic()
            got = await asyncio.gather(
                *(idx.apply(EventBatch(iid, 1, (stored,))) for iid in ids),
                return_exceptions=True,
            )
            took = time.monotonic() - t0
            assert all(isinstance(g, Unavailable) for g in got), got
            assert took < 3.0, took
            assert any("no turn to write" in str(g) for g in got)
        finally:
            server._child.signal_group(signal.SIGCONT)
            await idx.close()
