"""Two replicas' service layers over one real Redis: what one replica caches follows the other.

Each replica is an :class:`~indexer.logic.IndexerLogic` (and an
:class:`~indexer.sglang.compat.SglangCompat` on top of it) over its own
:class:`~indexer.redis.backend.RedisIndex`, both on one redis-server and key
prefix, as two indexer processes behind a load balancer would be. Every call
on one replica is followed by calls on the other that must see it: a worker's
SGLang epoch and address, an instance's model (block size and ownership).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import tracemalloc
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import indexer.logic as logic_mod
import indexer.sglang.compat as compat_mod
from indexer.config import IndexerConfig, SglangApiSettings
from indexer.logic import IndexerLogic
from indexer.memory import MemoryIndex
from indexer.model import (
    BatchOutcome,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    InstanceState,
    MatchQuery,
    Namespace,
    Tier,
)
from indexer.redis.backend import RedisIndex
from indexer.sglang.compat import Action, ActionKind, ApplyRequest, SglangCompat
from kvmesh.auth import Client, Principal, reset_current_client, set_current_client
from kvmesh.errors import FailedPrecondition, NotFound, PermissionDenied

W = InstanceId("w0", 0)
#: Block hashes as SGLang reports them (unsigned here, as the compat layer takes them).
H = (11, 12, 13, 14, 15, 16)


def config(**overrides: Any) -> IndexerConfig:
    base: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "metrics_port": 0, "block_size": 4}
    base.update(overrides)
    return IndexerConfig.model_validate(base)


@pytest.fixture
async def indexes(redis_server: Any) -> AsyncIterator[tuple[RedisIndex, RedisIndex]]:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    one = RedisIndex(redis_server.url, prefix=prefix)
    two = RedisIndex(redis_server.url, prefix=prefix)
    try:
        yield one, two
    finally:
        await one.close()
        await two.close()


@contextlib.contextmanager
def caller(name: str, *, instances: tuple[str, ...], models: tuple[str, ...]) -> Iterator[None]:
    """Run the block as an engine identity of the policy owning ``instances`` x ``models``."""
    principal = Principal(name, frozenset({"engine"}), "mtls", instances, models)
    token = set_current_client(Client(principal, name))
    try:
        yield
    finally:
        reset_current_client(token)


def stored(h: int, tokens: int, *, block_size: int, parent: int | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=(h,),
        parent_block_hash=parent,
        token_ids=tuple(range(tokens)),
        block_size=block_size,
    )


# -- the instance -> model cache of the logic ----------------------------------------


async def test_a_model_changed_on_another_replica_keys_batches_with_its_block_size(
    indexes: tuple[RedisIndex, RedisIndex],
) -> None:
    cfg = config(model_block_sizes={"m4": 4, "m8": 8})
    one, two = IndexerLogic(indexes[0], cfg), IndexerLogic(indexes[1], cfg)
    await one.register(InstanceSpec(W, "m4", "http://w0:1", 30.0, "first"))
    await one.publish(EventBatch(W, 0, (stored(1, 4, block_size=4),)))
    # The engine restarts serving another model; its registration lands on replica two.
    await two.register(InstanceSpec(W, "m8", "http://w0:1", 30.0, "second"))
    result = await one.publish(EventBatch(W, 0, (stored(1, 8, block_size=8),)))
    assert result.outcome is BatchOutcome.APPLIED and result.blocks_stored == 1
    # No block size given: the instance's model says 8.
    result = await one.publish(EventBatch(W, 1, (stored(2, 8, block_size=0, parent=1),)))
    assert result.blocks_stored == 1
    found = await one.match(MatchQuery(Namespace("m8"), token_ids=list(range(8)) * 2))
    assert [(m.instance, m.depth) for m in found.matches] == [(W, 2)]


async def test_ownership_follows_a_model_changed_on_another_replica(
    indexes: tuple[RedisIndex, RedisIndex],
) -> None:
    cfg = config()
    one, two = IndexerLogic(indexes[0], cfg), IndexerLogic(indexes[1], cfg)
    await one.register(InstanceSpec(W, "old", "http://w0:1", 30.0, "first"))
    await one.heartbeat(W)  # replica one now remembers w0 as a worker of "old"
    await two.register(InstanceSpec(W, "new", "http://w0:1", 30.0, "second"))
    with caller("engine-new", instances=("w0",), models=("new",)):
        # The owner of w0 under its current model may publish through either replica.
        result = await one.publish(EventBatch(W, 0, (stored(1, 4, block_size=4),)))
        assert result.outcome is BatchOutcome.APPLIED
        await one.heartbeat(W)


async def test_a_former_owner_is_refused_once_the_model_is_read_again(
    indexes: tuple[RedisIndex, RedisIndex], monkeypatch: pytest.MonkeyPatch
) -> None:
    # How long a remembered model is believed when nothing contradicts it.
    monkeypatch.setattr(logic_mod, "MODEL_CACHE_TTL_S", 0.05, raising=False)
    cfg = config()
    one, two = IndexerLogic(indexes[0], cfg), IndexerLogic(indexes[1], cfg)
    await one.register(InstanceSpec(W, "old", "http://w0:1", 30.0, "first"))
    with caller("engine-old", instances=("w0",), models=("old",)):
        await one.publish(EventBatch(W, 0, (stored(1, 4, block_size=4),)))
    await two.register(InstanceSpec(W, "new", "http://w0:1", 30.0, "second"))
    await asyncio.sleep(0.1)
    with caller("engine-old", instances=("w0",), models=("old",)):
        with pytest.raises(PermissionDenied):
            await one.publish(EventBatch(W, 0, (stored(1, 4, block_size=4),)))
        with pytest.raises(PermissionDenied):
            await one.remove_instance(W)
    assert [s.spec.model for s in await two.list_instances()] == ["new"]


async def test_a_disagreement_remembered_before_another_replica_changed_the_model(
    indexes: tuple[RedisIndex, RedisIndex],
) -> None:
    """A replica that just reread the model for a wrong batch still rereads it once
    another replica has changed it: a valid batch is never judged by the old model."""
    cfg = config(model_block_sizes={"m4": 4, "m8": 8})
    one, two = IndexerLogic(indexes[0], cfg), IndexerLogic(indexes[1], cfg)
    await one.register(InstanceSpec(W, "m4", "http://w0:1", 30.0, "first"))
    # Keyed with the wrong block size: replica one rereads, still m4, and skips it.
    wrong = await one.publish(EventBatch(W, 0, (stored(1, 8, block_size=8),)))
    assert wrong.blocks_skipped == 1
    # Within the second after that reread, the engine restarts serving m8.
    await two.register(InstanceSpec(W, "m8", "http://w0:1", 30.0, "second"))
    result = await one.publish(EventBatch(W, 0, (stored(1, 8, block_size=8),)))
    assert (result.blocks_stored, result.blocks_skipped) == (1, 0)


async def test_the_owner_of_a_gone_instance_is_told_it_is_gone() -> None:
    """A heartbeat or removal for an instance the index no longer holds (reaped,
    removed) answers NOT_FOUND to its owner, and PERMISSION_DENIED to others."""
    logic = IndexerLogic(MemoryIndex(), config())
    await logic.register(InstanceSpec(W, "m1", "http://w0:1", 30.0, "x"))
    await logic.remove_instance(W)
    with caller("engine-0", instances=("w0",), models=("m1",)):
        with pytest.raises(NotFound):
            await logic.heartbeat(W)
        with pytest.raises(NotFound):
            await logic.remove_instance(W)
    with caller("engine-1", instances=("w1",), models=("m1",)), pytest.raises(PermissionDenied):
        await logic.heartbeat(W)


class CountingIndex(MemoryIndex):
    """The memory backend, counting how often the instance table is read."""

    def __init__(self) -> None:
        super().__init__()
        self.listings = 0

    async def list_instances(self, model: str = "") -> list[InstanceState]:
        self.listings += 1
        return await super().list_instances(model)


async def test_a_batch_that_stays_wrong_rereads_the_model_once() -> None:
    index = CountingIndex()
    logic = IndexerLogic(index, config(model_block_sizes={"m4": 4, "m8": 8}))
    await logic.register(InstanceSpec(W, "m4", "http://w0:1", 30.0, "first"))
    before = index.listings
    for seq in range(20):  # an engine that keys with the wrong block size
        r = await logic.publish(EventBatch(W, seq, (stored(1, 8, block_size=8),)))
        assert r.blocks_skipped == 1 and r.blocks_stored == 0
    assert index.listings - before == 1
    assert logic.counters.events_skipped == {"block_size": 20}
    assert logic.counters.batches_rejected == 0


async def test_instances_removed_elsewhere_are_forgotten() -> None:
    # Two service layers over one shared index: replica two registers and
    # removes instances that replica one lists in between (as the SGLang API
    # and the ZMQ subscribers do); nothing of them may stay on replica one.
    index = MemoryIndex()
    cfg = config()
    one, two = IndexerLogic(index, cfg), IndexerLogic(index, cfg)

    async def churn(start: int, n: int) -> None:
        for i in range(start, start + n):
            iid = InstanceId(f"churned-worker-{i:06d}", 0)
            await two.register(InstanceSpec(iid, f"model-{i:06d}", "", 30.0, "x"))
            assert iid in {s.spec.instance for s in await one.list_instances()}
            await two.remove_instance(iid)

    n = 1500
    tracemalloc.start()
    try:
        await churn(0, n)
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        await churn(n, n)
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # A remembered (instance, model) costs well over 100 bytes (two strings, a
    # tuple, a table slot): n of them would be far above this.
    assert grown < 30 * n, f"{grown} bytes kept after {n} instances came and went"


# -- SGLang's API ---------------------------------------------------------------------


def report(hashes: tuple[int, ...]) -> tuple[Action, ...]:
    return (Action(ActionKind.REPORT, Tier.GPU, hashes),)


@pytest.fixture
def apis(indexes: tuple[RedisIndex, RedisIndex]) -> tuple[SglangCompat, SglangCompat]:
    cfg = config()
    settings = SglangApiSettings()
    return (
        SglangCompat(IndexerLogic(indexes[0], cfg), settings),
        SglangCompat(IndexerLogic(indexes[1], cfg), settings),
    )


async def best(api: SglangCompat, hashes: tuple[int, ...]) -> int:
    return (await api.match_prefix(hashes, 0)).best_prefix_blocks


async def test_a_new_epoch_installed_on_another_replica_is_not_reset(
    apis: tuple[SglangCompat, SglangCompat],
) -> None:
    one, two = apis
    await one.apply(ApplyRequest("w", 0, report(H[:2]), "http://w:1", "e1"))
    await two.replace_snapshot("w", "http://w:1", "e2", 10, [(Tier.GPU, H[:4])])
    seq, duplicate = await one.apply(ApplyRequest("w", 11, report(H[4:5]), "http://w:1", "e2"))
    assert (seq, duplicate) == (11, False)
    assert await best(one, H[:5]) == 5  # the snapshot survived, the batch went on top
    assert await best(two, H[:5]) == 5


async def test_enforce_sequence_accepts_a_snapshot_installed_on_another_replica(
    apis: tuple[SglangCompat, SglangCompat],
) -> None:
    one, two = apis
    await one.replace_snapshot("w", "http://w:1", "e1", 0, [(Tier.GPU, H[:1])])
    await two.replace_snapshot("w", "http://w:2", "e2", 10, [(Tier.GPU, H[:4])])
    req = ApplyRequest("w", 11, report(H[4:5]), "http://w:2", "e2", enforce_sequence=True)
    assert await one.apply(req) == (11, False)
    assert await best(one, H[:5]) == 5
    found = await one.match_prefix(H[:5], 0)
    assert [(m.worker_id, m.worker_address) for m in found.matches] == [("w", "http://w:2")]


async def test_an_address_change_after_a_snapshot_elsewhere_keeps_the_snapshot(
    apis: tuple[SglangCompat, SglangCompat],
) -> None:
    one, two = apis
    await one.apply(ApplyRequest("w", 0, report(H[:1]), "http://w:1"))
    await two.replace_snapshot("w", "http://w:1", "", 5, [(Tier.GPU, H[:4])])
    # The worker moved: its next batch names a new address, through replica one.
    assert await one.apply(ApplyRequest("w", 6, report(H[4:5]), "http://w:2")) == (6, False)
    found = await one.match_prefix(H[:5], 0)
    assert [(m.worker_address, m.matched_prefix_blocks) for m in found.matches] == [
        ("http://w:2", 5)
    ]


async def test_enforce_sequence_refuses_an_epoch_replaced_on_another_replica(
    apis: tuple[SglangCompat, SglangCompat], monkeypatch: pytest.MonkeyPatch
) -> None:
    # How long a cached worker registration is believed when nothing contradicts it.
    monkeypatch.setattr(compat_mod, "SPEC_CACHE_TTL_S", 0.05, raising=False)
    one, two = apis
    await one.replace_snapshot("w", "http://w:1", "e1", 0, [(Tier.GPU, H[:1])])
    await two.replace_snapshot("w", "http://w:1", "e2", 10, [(Tier.GPU, H[:4])])
    await asyncio.sleep(0.1)
    late = ApplyRequest("w", 11, report(H[4:5]), "http://w:1", "e1", enforce_sequence=True)
    with pytest.raises(FailedPrecondition):
        await one.apply(late)
    assert await best(two, H[:5]) == 4  # the epoch-e1 batch was not applied to epoch e2


async def test_a_replica_that_does_not_ingest_a_hybrid_instance_never_over_reports_it(
    indexes: tuple[RedisIndex, RedisIndex],
) -> None:
    # Replica one ingests a full-attention + sliding-window engine (its group
    # presence lives there); replica two only answers Matches. The window
    # group holds block 0 only, so the engine reuses 0 blocks of a 3-block
    # prompt (its window of 2 blocks must end at the hit): two must not say 3.
    cfg = config()
    one, two = IndexerLogic(indexes[0], cfg), IndexerLogic(indexes[1], cfg)
    plain = InstanceId("w1", 0)
    await one.register(InstanceSpec(W, "m", "http://w0:1", 30.0, "a"))
    await one.register(InstanceSpec(plain, "m", "http://w1:1", 30.0, "a"))
    tokens = tuple(range(16))
    full = BlockStored((1, 2, 3, 4), None, tokens, 4, group_kind="full_attention")
    swa = BlockStored(
        (1,), None, tokens[:4], 4, group=1, group_kind="sliding_window", sliding_window=8
    )
    await one.publish(EventBatch(W, 0, (full, swa)))
    await one.publish(EventBatch(plain, 0, (full,)))
    query = MatchQuery(Namespace("m", ""), token_ids=tokens[:13])
    ingesting = {m.instance: m.depth for m in (await one.match(query)).matches}
    assert ingesting == {plain: 3, W: 1}
    other = {m.instance: m.depth for m in (await two.match(query)).matches}
    assert other.get(W, 0) <= ingesting[W]  # under-reporting is allowed, over is not
    assert other[plain] == 3  # a full-attention instance is answered as before
