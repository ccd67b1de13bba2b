"""The redis backend against a real local Redis Cluster: routing and master faults.

Semantics are checked by tests/contract (the ``redis-cluster`` backend); this
module covers what only cluster mode has: one EVALSHA on one master per
Match, keys spread by anchor, and a master killed and restarted under load.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import xxhash
from redis.crc import key_slot

from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace, Tier
from indexer.redis import keys as K
from indexer.redis.backend import RedisIndex
from kvmesh.errors import Unavailable
from lab.redisproc import RedisClusterProcess
from tests.conftest import FakeClock

MODEL = "m"
NS = Namespace(MODEL)
ROOT = 0xABCDEF  # one block every chain starts with: the hot root
CHAINS = 60  # distinct second blocks, so anchors land on every master


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcess]:
    """A private cluster: this module kills masters, so it shares none."""
    with RedisClusterProcess() as proc:
        yield proc


@pytest.fixture
async def idx(cluster: RedisClusterProcess, clock: FakeClock) -> AsyncIterator[RedisIndex]:
    index = RedisIndex(
        cluster.url, prefix=f"t{uuid.uuid4().hex[:8]}", clock=clock, cluster=True,
        socket_timeout_s=0.5,
    )  # fmt: skip
    try:
        yield index
    finally:
        await index.close()


def chain(i: int, depth: int = 6) -> list[int]:
    """Keys of chain ``i``: the shared root, then blocks of its own."""
    return [ROOT] + [xxhash.xxh3_64_intdigest(f"{i}/{d}".encode()) for d in range(1, depth)]


def owner(cluster: RedisClusterProcess, slot: int) -> int:
    """Index in ``cluster.nodes`` of the master serving ``slot``."""
    for node in cluster.nodes:
        if not node.running:
            continue
        r = redis.Redis(host=node.host, port=node.port)
        try:
            for lo, hi, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
                if lo <= slot <= hi:
                    return cluster.ports.index(int(master[1]))
        finally:
            r.close()
    raise AssertionError("no live node answered")


def calls(cluster: RedisClusterProcess) -> list[dict[str, int]]:
    """Per master, calls per command so far (INFO commandstats, without INFO)."""
    out = []
    for node in cluster.nodes:
        r = redis.Redis(host=node.host, port=node.port)
        try:
            st = r.info("commandstats")
        finally:
            r.close()
        out.append(
            {
                k.removeprefix("cmdstat_"): int(v["calls"])
                for k, v in st.items()
                if k != "cmdstat_info"
            }
        )
    return out


async def fill(idx: RedisIndex) -> InstanceId:
    w = InstanceId("w0")
    await idx.register(InstanceSpec(w, MODEL, "http://w0", 600.0))
    events = tuple(
        BlockStored(tuple(range(i * 100, i * 100 + 6)), None, (), 0, "", Tier.GPU, tuple(chain(i)))
        for i in range(CHAINS)
    )
    await idx.apply(EventBatch(w, 1, events))
    return w


def anchor_node(cluster: RedisClusterProcess, keys: list[int]) -> int:
    return owner(cluster, key_slot(b"{" + K.anchor_tag(keys[1]) + b"}"))


async def test_match_is_one_evalsha_on_one_master(
    idx: RedisIndex, cluster: RedisClusterProcess
) -> None:
    await fill(idx)
    for i in range(CHAINS):  # warm: topology, instance table, scripts
        assert (await idx.match(NS, chain(i)))[0].depth == 6
    before = calls(cluster)
    trips = idx.round_trips
    for i in range(CHAINS):
        got = await idx.match(NS, chain(i))
        assert [m.depth for m in got] == [6]
    after = calls(cluster)
    assert idx.round_trips - trips == CHAINS
    used = [i for i in range(3) if after[i].get("evalsha", 0) > before[i].get("evalsha", 0)]
    assert len(used) == 3  # anchors spread the hot root's chains over every master
    assert sum(after[i].get("evalsha", 0) - before[i].get("evalsha", 0) for i in range(3)) == CHAINS
    # A one-block prompt (the hot root alone) is served by any master's copy.
    assert [m.depth for m in await idx.match(NS, [ROOT])] == [1]


async def test_master_killed_then_restarted(idx: RedisIndex, cluster: RedisClusterProcess) -> None:
    w = await fill(idx)
    ctl = owner(cluster, key_slot(K.cluster_base(idx._prefix)))
    victim = next(i for i in range(3) if i != ctl)
    on_victim = [i for i in range(CHAINS) if anchor_node(cluster, chain(i)) == victim]
    elsewhere = [i for i in range(CHAINS) if anchor_node(cluster, chain(i)) != victim]
    assert on_victim and elsewhere
    for i in range(CHAINS):
        await idx.match(NS, chain(i))
    cluster.kill(victim)
    try:
        # Under load: the dead master's chains are UNAVAILABLE, the others keep serving.
        for _ in range(3):
            for i in on_victim[:5]:
                with pytest.raises(Unavailable):
                    await idx.match(NS, chain(i))
            for i in elsewhere[:10]:
                assert [m.depth for m in await idx.match(NS, chain(i))] == [6]
        # A write that needs the dead master fails cleanly, never crashes.
        keys = tuple(chain(on_victim[0]))
        ev = BlockStored(tuple(range(9000, 9006)), None, (), 0, "", Tier.CPU, keys)
        with pytest.raises(Unavailable):
            await idx.apply(EventBatch(w, 2, (ev,)))
    finally:
        cluster.restart(victim)
    # Back: the restarted master is empty (no persistence), but serves at once.
    for _ in range(50):
        try:
            got = await idx.match(NS, chain(on_victim[0]))
            break
        except Unavailable:
            await asyncio.sleep(0.1)
    else:
        raise AssertionError("the restarted master did not serve again")
    assert got == [] or got[0].depth <= 6
    for i in elsewhere[:10]:
        assert [m.depth for m in await idx.match(NS, chain(i))] == [6]
    await idx.heartbeat(w)
