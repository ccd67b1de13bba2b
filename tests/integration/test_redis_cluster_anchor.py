"""Where the Cluster layout anchors a chain, at real block sizes (KEYS.md, "The hot root").

A chain's deep blocks are tagged by its block at the anchor depth, so chains
that share a system prompt go to one slot unless the anchor is past it. The
anchor was a depth in blocks, 1 by default: right for 512-token blocks, where
the conversation trace's shared 512 tokens are block 0, and wrong at vLLM's
default of 16, where the same tokens are blocks 0..31 and every chain's deep
blocks landed on one master (`kvmesh bench peer --block-size 16 --backend
cluster`: largest master's key share 1.0). The default is now a depth in
tokens (``redis.cluster_anchor_tokens``, 512), per model's block size.
"""

from __future__ import annotations

import uuid
from typing import Any

import pytest
import redis
import xxhash

from indexer.config import IndexerConfig
from indexer.factory import build_index
from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace, Tier
from indexer.redis.backend import RedisIndex
from kvmesh.errors import FailedPrecondition

MODEL = "m16"
#: Blocks every chain starts with: a 512-token system prompt at 16-token blocks.
SHARED = 32
#: Blocks of each chain past the shared ones.
OWN = 4
CHAINS = 60


def chain(i: int) -> list[int]:
    shared = [xxhash.xxh3_64_intdigest(f"system/{d}".encode()) for d in range(SHARED)]
    return shared + [xxhash.xxh3_64_intdigest(f"{i}/{d}".encode()) for d in range(OWN)]


def config(url: str, prefix: str, **redis_kw: Any) -> IndexerConfig:
    return IndexerConfig.model_validate(
        {
            "backend": "redis",
            "block_size": 16,
            "model_block_sizes": {"m512": 512, "m64": 64},
            "redis": {"url": url, "cluster": True, "prefix": prefix, **redis_kw},
        }
    )


def test_the_default_anchor_is_512_tokens_deep_whatever_the_block_size() -> None:
    cfg = config("redis://127.0.0.1:1", "t")
    assert [cfg.cluster_anchor_for(m) for m in (MODEL, "m64", "m512")] == [32, 8, 1]
    # An explicit depth is every model's; a long anchor stops at the scripts' byte.
    pinned = config("redis://127.0.0.1:1", "t", cluster_anchor_depth=3)
    assert [pinned.cluster_anchor_for(m) for m in (MODEL, "m512")] == [3, 3]
    deep = config("redis://127.0.0.1:1", "t", cluster_anchor_tokens=8192)
    assert deep.cluster_anchor_for(MODEL) == 255


def _block_keys_per_master(cluster: Any, prefix: str) -> list[int]:
    out = []
    for port in cluster.ports:
        r = redis.Redis(host="127.0.0.1", port=port)
        try:
            out.append(sum(1 for _ in r.scan_iter(match=f"{prefix}:b:*", count=1000)))
        finally:
            r.close()
    return out


@pytest.mark.parametrize("pinned", [None, 1])
async def test_chains_behind_a_shared_prompt_spread_over_the_masters(
    redis_cluster: Any, pinned: int | None
) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    extra = {} if pinned is None else {"cluster_anchor_depth": pinned}
    idx = build_index(config(redis_cluster.url, prefix, **extra))
    other = build_index(config(redis_cluster.url, prefix, **extra))
    assert isinstance(idx, RedisIndex) and isinstance(other, RedisIndex)
    w = InstanceId("w0")
    try:
        await idx.register(InstanceSpec(w, MODEL, "http://w0", 600.0))
        events = tuple(
            BlockStored(
                tuple(range(i * 1000, i * 1000 + SHARED + OWN)),
                None,
                (),
                0,
                "",
                Tier.GPU,
                tuple(chain(i)),
            )
            for i in range(CHAINS)
        )
        await idx.apply(EventBatch(w, 1, events))
        # Every chain is found whole, by this replica and by another one.
        for index in (idx, other):
            for i in range(0, CHAINS, 5):
                hits = await index.match(Namespace(MODEL), chain(i))
                assert [(h.instance, h.depth) for h in hits] == [(w, SHARED + OWN)]
        per_master = _block_keys_per_master(redis_cluster, prefix)
        share = max(per_master) / sum(per_master)
        if pinned is None:
            # 240 deep blocks over 60 anchors, and each master's copy of the 32
            # shared ones: about a third each.
            assert share <= 0.5, per_master
        else:
            # The old default: every chain anchored inside the shared prompt.
            assert share > 0.9, per_master
    finally:
        await idx.close()
        await other.close()


async def test_a_replica_under_another_anchor_rule_refuses_the_index(redis_cluster: Any) -> None:
    prefix = f"t{uuid.uuid4().hex[:8]}"
    first = build_index(config(redis_cluster.url, prefix))
    same = build_index(config(redis_cluster.url, prefix))
    other = build_index(config(redis_cluster.url, prefix, cluster_anchor_depth=1))
    w = InstanceId("w0")
    try:
        await first.register(InstanceSpec(w, MODEL, "http://w0", 600.0))
        keys = chain(0)
        stored = BlockStored(tuple(range(len(keys))), None, (), 0, "", Tier.GPU, tuple(keys))
        await first.apply(EventBatch(w, 1, (stored,)))
        assert [h.depth for h in await same.match(Namespace(MODEL), keys)] == [len(keys)]
        # Depth 1 would look for this chain's deep blocks under another tag.
        with pytest.raises(FailedPrecondition) as e:
            await other.match(Namespace(MODEL), keys)
        assert e.value.field == "redis.cluster_anchor_depth"
        assert "'tokens 512'" in str(e.value) and "'depth 1'" in str(e.value)
        # The index is as it was for the replicas that agree.
        assert [h.depth for h in await first.match(Namespace(MODEL), keys)] == [len(keys)]
    finally:
        for index in (first, same, other):
            await index.close()


def test_an_anchor_function_needs_a_rule_naming_it() -> None:
    with pytest.raises(ValueError, match="anchor_rule"):
        RedisIndex("redis://127.0.0.1:1", cluster=True, anchor_depth=lambda model: 2)
