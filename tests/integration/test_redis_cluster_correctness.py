"""The Redis Cluster layout under the faults a real cluster has: KEYS.md, "Redis Cluster".

Every test runs on a private 3-master cluster (lab/redisproc.py) and checks
what a router would see: the depths Match answers, from this replica and from
a fresh one.

- A stalled master (CLIENT PAUSE), a timeout or a cancelled caller between the
  control script and the data-node writes: the batch's writes stay pending and
  are finished by the retry, the next call, or another replica's maintenance
  (KEYS.md, "Apply: two phases").
- A slot that moves (MIGRATE, SETSLOT NODE), the slot of a copy tag included:
  Matches and applies keep working and find everything (KEYS.md, "Copy tags").
- Blocks whose chain position the apply cannot know (precomputed keys whose
  parent the instance does not map, SGLang's REPORT): still found by every
  Match that reaches them (KEYS.md, "Unplaced blocks").
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import redis
import xxhash
from redis.crc import key_slot

from indexer.config import IndexerConfig, Limits, SglangApiSettings
from indexer.logic import IndexerLogic
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
from indexer.redis.backend import RedisIndex
from indexer.sglang.compat import Action, ActionKind, ApplyRequest, SglangCompat
from kvmesh.blockkeys import block_keys
from kvmesh.errors import Unavailable
from lab.redisproc import RedisClusterProcess
from tests.conftest import FakeClock

MODEL = "m"
NS = Namespace(MODEL)
ROOT = 0xABCDEF  # one block every chain starts with
CHAINS = 40  # distinct second blocks: anchors on every master
W = InstanceId("w0")


@pytest.fixture(scope="module")
def cluster() -> Iterator[RedisClusterProcess]:
    """A private cluster: these tests pause masters and move slots."""
    with RedisClusterProcess() as proc:
        yield proc


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


def make(cluster: RedisClusterProcess, prefix: str, clock: FakeClock, **kw: Any) -> RedisIndex:
    # Short enough that a paused master cuts writes off: what these tests are about.
    kw.setdefault("socket_timeout_s", 0.3)
    kw.setdefault("write_timeout_s", 0.3)
    return RedisIndex(cluster.url, prefix=prefix, clock=clock, cluster=True, **kw)


@pytest.fixture
async def idx(
    cluster: RedisClusterProcess, prefix: str, clock: FakeClock
) -> AsyncIterator[RedisIndex]:
    index = make(cluster, prefix, clock)
    try:
        yield index
    finally:
        await index.close()


@contextlib.asynccontextmanager
async def replica(
    cluster: RedisClusterProcess, prefix: str, clock: FakeClock, **kw: Any
) -> AsyncIterator[RedisIndex]:
    """Another indexer replica on the same index."""
    index = make(cluster, prefix, clock, **kw)
    try:
        yield index
    finally:
        await index.close()


def chain(i: int, depth: int = 6) -> list[int]:
    """Keys of chain ``i``: the shared root, then blocks of its own."""
    return [ROOT] + [xxhash.xxh3_64_intdigest(f"{i}/{d}".encode()) for d in range(1, depth)]


def loose(i: int, depth: int = 6) -> list[int]:
    """Keys of a chain with a root of its own (shares no block with ``chain``)."""
    return [xxhash.xxh3_64_intdigest(f"loose {i}/{d}".encode()) for d in range(depth)]


def stored(i: int, tier: Tier = Tier.GPU) -> BlockStored:
    keys = tuple(chain(i))
    return BlockStored(tuple(range(i * 100, i * 100 + 6)), None, (), 0, "", tier, keys)


def removed(i: int) -> BlockRemoved:
    return BlockRemoved(tuple(range(i * 100, i * 100 + 6)))


def conn(port: int) -> Any:
    """A plain client of one node (commands go to it, cluster or not)."""
    return redis.Redis(host="127.0.0.1", port=port)


def slot_owner(cluster: RedisClusterProcess, slot: int) -> int:
    """Client port of the master serving ``slot``."""
    r = conn(cluster.ports[0])
    try:
        for lo, hi, master, *_ in r.execute_command("CLUSTER", "SLOTS"):
            if lo <= slot <= hi:
                return int(master[1])
    finally:
        r.close()
    raise AssertionError(f"slot {slot} is not served")


def anchor_slot(keys: list[int]) -> int:
    return key_slot(b"{" + K.anchor_tag(keys[1]) + b"}")


def control_port(cluster: RedisClusterProcess, prefix: str) -> int:
    return slot_owner(cluster, key_slot(K.cluster_base(prefix)))


def move_slot(cluster: RedisClusterProcess, slot: int, dst: int, *, migrate: bool = True) -> None:
    """Move ``slot`` to the master on port ``dst`` the way redis-cli reshards:
    IMPORTING / MIGRATING, MIGRATE of its keys, then SETSLOT NODE everywhere."""
    src = slot_owner(cluster, slot)
    s, d = conn(src), conn(dst)
    try:
        sid = s.execute_command("CLUSTER", "MYID").decode()
        did = d.execute_command("CLUSTER", "MYID").decode()
        if migrate:
            d.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", sid)
            s.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", did)
            while keys := s.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100):
                s.execute_command("MIGRATE", "127.0.0.1", dst, "", 0, 5000, "KEYS", *keys)
        else:
            assert s.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        for port in cluster.ports:
            r = conn(port)
            try:
                r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", did)
            finally:
                r.close()
    finally:
        s.close()
        d.close()
    cluster.wait_ok()


@contextlib.contextmanager
def paused(port: int, ms: int = 3000) -> Iterator[None]:
    """Writes (and scripts) on the master at ``port`` wait, as on a stalled node."""
    r = conn(port)
    try:
        r.execute_command("CLIENT", "PAUSE", ms, "WRITE")
        yield
    finally:
        r.execute_command("CLIENT", "UNPAUSE")
        r.close()


async def fill(idx: RedisIndex, chains: range = range(CHAINS), seq: int = 1) -> None:
    await idx.register(InstanceSpec(W, MODEL, "http://w0", 600.0))
    await idx.apply(EventBatch(W, seq, tuple(stored(i) for i in chains)))


async def depths(idx: RedisIndex, chains: range = range(CHAINS)) -> list[list[int]]:
    return [[m.depth for m in await idx.match(NS, chain(i))] for i in chains]


def data_master(cluster: RedisClusterProcess, prefix: str) -> int:
    """A master other than the control one, holding anchors of some chains."""
    ctl = control_port(cluster, prefix)
    return next(p for p in cluster.ports if p != ctl)


# -- the two-phase apply ---------------------------------------------------------


async def test_a_store_cut_off_by_a_stalled_master_is_written_by_the_retry(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str, clock: FakeClock
) -> None:
    await idx.register(InstanceSpec(W, MODEL, "http://w0", 600.0))
    batch = EventBatch(W, 1, tuple(stored(i) for i in range(CHAINS)))
    with paused(data_master(cluster, prefix)), pytest.raises(Unavailable):
        await idx.apply(batch)
    again = await idx.apply(batch)  # the publisher's retry of the unacknowledged batch
    assert again.applied_sequence == 1
    assert await depths(idx) == [[6]] * CHAINS
    async with replica(cluster, prefix, clock) as other:
        assert await depths(other) == [[6]] * CHAINS


async def test_a_removal_cut_off_by_a_stalled_master_is_written_by_the_retry(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str, clock: FakeClock
) -> None:
    await fill(idx)
    batch = EventBatch(W, 2, tuple(removed(i) for i in range(CHAINS)))
    with paused(data_master(cluster, prefix)), pytest.raises(Unavailable):
        await idx.apply(batch)
    again = await idx.apply(batch)
    assert again.outcome is BatchOutcome.DUPLICATE  # its control half did apply
    assert await depths(idx) == [[]] * CHAINS  # and now its removals too
    async with replica(cluster, prefix, clock) as other:
        assert await depths(other) == [[]] * CHAINS
    assert (await idx.dump()).blocks == {}


async def test_a_cancelled_apply_is_finished_by_the_next_batch(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str
) -> None:
    """A caller cancelled between the two halves (a gRPC deadline) loses nothing."""
    await idx.register(InstanceSpec(W, MODEL, "http://w0", 600.0))
    batch = EventBatch(W, 1, tuple(stored(i) for i in range(CHAINS)))
    meta = K.instance_key(K.cluster_base(prefix)[:-1].decode(), K.instance_name("w0", 0))
    ctl = conn(control_port(cluster, prefix))
    try:
        with paused(data_master(cluster, prefix)):
            task = asyncio.ensure_future(idx.apply(batch))
            for _ in range(200):  # until the control half has committed
                if ctl.hget(meta, "seq") == b"1":
                    break
                await asyncio.sleep(0.005)
            assert ctl.hget(meta, "seq") == b"1"
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
    finally:
        ctl.close()
    # The next batch of the stream (not a retry) finishes the cut-off one first.
    nxt = await idx.apply(EventBatch(W, 2, (stored(CHAINS),)))
    assert nxt.outcome is BatchOutcome.APPLIED
    assert await depths(idx, range(CHAINS + 1)) == [[6]] * (CHAINS + 1)


async def test_another_replica_finishes_writes_its_peer_left_pending(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str, clock: FakeClock
) -> None:
    """The publisher's replica died after the control half; nobody retries."""
    await fill(idx)
    # Every other chain loses its own blocks (the shared root stays).
    gone = tuple(BlockRemoved(tuple(range(i * 100 + 1, i * 100 + 6))) for i in range(0, CHAINS, 2))
    with paused(data_master(cluster, prefix)), pytest.raises(Unavailable):
        await idx.apply(EventBatch(W, 2, gone))
    async with replica(cluster, prefix, clock) as other:
        await other.maintain()  # what its reaper runs every reap_interval_s
        want = [[1] if i % 2 == 0 else [6] for i in range(CHAINS)]
        assert await depths(other) == want
        assert await depths(idx) == want


async def test_a_clear_cut_off_by_a_stalled_master_leaves_nothing_behind(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str, clock: FakeClock
) -> None:
    """Removals, a clear (a new int id) and new blocks in one batch, cut off:
    the retired id's entries and the new ones are all settled afterwards."""
    await fill(idx)
    batch = EventBatch(W, 2, (removed(0), AllBlocksCleared(), stored(CHAINS)))
    with paused(data_master(cluster, prefix)), pytest.raises(Unavailable):
        await idx.apply(batch)
    again = await idx.apply(batch)
    assert again.outcome is BatchOutcome.DUPLICATE
    await idx.reap_expired()  # finishes purges left behind, as the reaper does
    async with replica(cluster, prefix, clock) as other:
        for index in (idx, other):
            # Only the shared root is left of the old chains: the new one has it.
            assert await depths(index) == [[1]] * CHAINS
            assert await depths(index, range(CHAINS, CHAINS + 1)) == [[6]]
    dump = await idx.dump()
    assert sorted(dump.blocks[NS]) == sorted(chain(CHAINS))


async def test_a_late_write_of_an_older_batch_changes_nothing(idx: RedisIndex) -> None:
    """Data-node writes of a batch that arrive after a newer batch's are ignored
    (a write delayed past its caller's timeout, replayed here on purpose)."""
    writes: list[tuple[Any, ...]] = []
    real = idx._write_blocks

    async def record(*args: Any, **kw: Any) -> Any:
        writes.append(args)
        return await real(*args, **kw)

    idx._write_blocks = record  # type: ignore[method-assign]
    await fill(idx, range(4))
    first = list(writes)
    await idx.apply(EventBatch(W, 2, tuple(removed(i) for i in range(4))))
    assert await depths(idx, range(4)) == [[]] * 4
    for args in first:  # the store's writes, landing late
        await real(*args)
    assert await depths(idx, range(4)) == [[]] * 4


# -- slots that move ---------------------------------------------------------------


def a_slot_to_move(cluster: RedisClusterProcess, idx: RedisIndex, prefix: str) -> int:
    """The anchor slot of a chain whose master is neither control nor tag slot."""
    ctl_slot = key_slot(K.cluster_base(prefix))
    tag_slots = {key_slot(b"{" + K.node_tag(i) + b"}") for i in range(64)}
    for i in range(CHAINS):
        s = anchor_slot(chain(i))
        if s != ctl_slot and s not in tag_slots:
            return s
    raise AssertionError("no anchor slot to move")


async def test_matches_follow_an_anchor_slot_that_moved(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str, clock: FakeClock
) -> None:
    await fill(idx)
    assert await depths(idx) == [[6]] * CHAINS
    slot = a_slot_to_move(cluster, idx, prefix)
    moved = [i for i in range(CHAINS) if anchor_slot(chain(i)) == slot]
    src = slot_owner(cluster, slot)
    move_slot(cluster, slot, next(p for p in cluster.ports if p != src))
    # No UNAVAILABLE, not even once: the client follows the slot.
    assert await depths(idx) == [[6]] * CHAINS
    async with replica(cluster, prefix, clock) as other:
        assert await depths(other) == [[6]] * CHAINS
    # Writes follow it too: the moved chains lose their own blocks (the shared
    # root stays), then are stored again on CPU.
    gone = tuple(BlockRemoved(tuple(range(i * 100 + 1, i * 100 + 6))) for i in moved)
    await idx.apply(EventBatch(W, 2, gone))
    assert await depths(idx, range(moved[0], moved[0] + 1)) == [[1]]
    await idx.apply(EventBatch(W, 3, tuple(stored(i, Tier.CPU) for i in moved)))
    got = await idx.match(NS, chain(moved[0]))
    assert [(m.depth, m.gpu_blocks, m.cpu_blocks) for m in got] == [(6, 1, 5)]


async def test_a_chain_stored_after_its_empty_slot_was_reassigned(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str
) -> None:
    """SETSLOT NODE of a slot with no keys yet, then a chain anchored there."""
    await fill(idx, range(2))
    assert await depths(idx, range(2)) == [[6]] * 2
    i = next(j for j in range(1000, 2000) if anchor_slot(chain(j)) != anchor_slot(chain(0)))
    slot = anchor_slot(chain(i))
    r = conn(slot_owner(cluster, slot))
    try:
        assert r.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    finally:
        r.close()
    src = slot_owner(cluster, slot)
    move_slot(cluster, slot, next(p for p in cluster.ports if p != src), migrate=False)
    await idx.apply(EventBatch(W, 2, (stored(i),)))
    assert [m.depth for m in await idx.match(NS, chain(i))] == [6]


async def test_matches_survive_the_slot_of_a_copy_tag_moving(
    idx: RedisIndex, cluster: RedisClusterProcess, prefix: str, clock: FakeClock
) -> None:
    """A master whose copy tag's slot (shallow and unplaced copies, generation
    copy) moved away still answers every Match anchored on it, old and new
    replicas alike: it gets a new copy tag, seeded from another one."""
    await fill(idx)
    assert await depths(idx) == [[6]] * CHAINS
    ctl = control_port(cluster, prefix)
    src = next(p for p in cluster.ports if p != ctl)
    dst = next(p for p in cluster.ports if p not in (ctl, src))
    on_src = [i for i in range(CHAINS) if slot_owner(cluster, anchor_slot(chain(i))) == src]
    assert on_src
    # A chain stored without its position (as SGLang reports), anchored on src:
    # unplaced, so its copies live under the copy tags too.
    u = next(j for j in range(1000, 5000) if slot_owner(cluster, anchor_slot(loose(j))) == src)
    keys = tuple(loose(u))
    ev = BlockStored(keys, None, (), 0, "", Tier.GPU, keys, position_known=False)
    await idx.apply(EventBatch(W, 2, (ev,)))
    assert [m.depth for m in await idx.match(NS, loose(u))] == [6]
    # Every slot of src holding keys of this index, but its anchors: the copies go.
    r = conn(src)
    try:
        held = {key_slot(k) for k in r.scan_iter(match=f"{prefix}:*", count=1000)}
    finally:
        r.close()
    held -= {anchor_slot(chain(i)) for i in on_src} | {anchor_slot(loose(u))}
    assert held
    for slot in held:
        move_slot(cluster, slot, dst)
    assert await depths(idx) == [[6]] * CHAINS
    assert [m.depth for m in await idx.match(NS, loose(u))] == [6]
    # src serves a ready copy tag again (a new one, seeded).
    r = conn(ctl)
    try:
        registry = r.hgetall(K.key(K.cluster_base(prefix)[:-1].decode(), b"tags"))
    finally:
        r.close()
    ready = [t for t, state in registry.items() if t != b"#" and state == b"r"]
    assert src in {slot_owner(cluster, key_slot(b"{" + t + b"}")) for t in ready}
    async with replica(cluster, prefix, clock) as other:
        assert await depths(other) == [[6]] * CHAINS
        assert [m.depth for m in await other.match(NS, loose(u))] == [6]
        # A removal reaches every copy, wherever it lives now: the shared root
        # goes (engine hash 0 maps to it), which every master's Matches read.
        await other.apply(EventBatch(W, 3, (BlockRemoved((0, keys[3])),)))
        assert [m.depth for m in await other.match(NS, loose(u))] == [3]
        for index in (idx, other):
            assert await depths(index) == [[]] * CHAINS
            for _ in range(8):  # round robin over the copy tags
                assert await index.match(NS, [ROOT]) == []


# -- blocks the apply cannot place by chain position -------------------------------


@pytest.mark.parametrize("anchor_depth", [1, 2])
async def test_precomputed_keys_under_an_unknown_parent_are_found(
    cluster: RedisClusterProcess, prefix: str, clock: FakeClock, anchor_depth: int
) -> None:
    """The shrunk counterexample of the property test: block 2 with precomputed
    keys and a parent the instance does not map, then blocks 0-1 from tokens."""
    index = make(cluster, prefix, clock, anchor_depth=anchor_depth)
    try:
        prompt = [0, 0, 0, 0, 0, 0]
        keys = block_keys(prompt, 2, MODEL)
        await index.register(InstanceSpec(W, MODEL, "http://w0", 600.0))
        late = BlockStored((12,), 11, (), 0, "", Tier.GPU, (keys[2],))
        await index.apply(EventBatch(W, 1, (late,)))
        early = BlockStored((10, 11), None, tuple(prompt[:4]), 2)
        await index.apply(EventBatch(W, 2, (early,)))
        assert [m.depth for m in await index.match(NS, keys)] == [3]
        async with replica(cluster, prefix, clock, anchor_depth=anchor_depth) as other:
            assert [m.depth for m in await other.match(NS, keys)] == [3]
        # Removing the unplaced block removes it from every copy.
        await index.apply(EventBatch(W, 3, (BlockRemoved((12,)),)))
        assert [m.depth for m in await index.match(NS, keys)] == [2]
    finally:
        await index.close()


def sglang(index: RedisIndex, max_blocks_per_event: int = 4096) -> SglangCompat:
    cfg = IndexerConfig(limits=Limits(max_blocks_per_event=max_blocks_per_event))
    return SglangCompat(IndexerLogic(index, cfg), SglangApiSettings(model=MODEL))


@pytest.mark.parametrize("per_event", [4096, 5])
async def test_sglang_reports_in_two_batches_match_the_whole_prefix(
    idx: RedisIndex, per_event: int
) -> None:
    """SGLang's REPORT names hashes without their position: a 12-block prefix
    reported in two batches (and in chunks of 5 within a batch) matches 12."""
    api = sglang(idx, per_event)
    hashes = tuple(chain(7, 12))
    report = ActionKind.REPORT
    await api.apply(ApplyRequest("a", 1, (Action(report, Tier.GPU, hashes[:4]),), "http://a"))
    await api.apply(ApplyRequest("a", 2, (Action(report, Tier.GPU, hashes[4:]),), "http://a"))
    got = await api.match_prefix(hashes, 0)
    assert got.best_prefix_blocks == 12
    assert [(m.worker_id, m.matched_prefix_blocks) for m in got.matches] == [("a", 12)]
    revoke = ActionKind.REVOKE
    await api.apply(ApplyRequest("a", 3, (Action(revoke, Tier.GPU, hashes[6:7]),), "http://a"))
    assert (await api.match_prefix(hashes, 0)).best_prefix_blocks == 6
