"""A router's follower (router_client/follower.py) answers what the replica answers.

A real in-process indexer (memory backend) serves WatchIndex on a loopback
port; a follower follows it over gRPC. A random workload goes through the
service (RegisterInstance, PublishEvents with stores, removals, tier moves,
clears, counted copies, orphans; Heartbeat; RemoveInstance; re-registration
with a new incarnation or model), the follower starting half-way (so its
snapshot holds a live index) and, in one run, told to resync. Once it has
applied everything the replica did, each prompt's Match from the follower is
compared with the replica's own Match. A follower broken on purpose (it
drops removals) fails the comparison.
"""

from __future__ import annotations

import random
import time
from typing import Any

import grpc
import pytest

from indexer.memory import MemoryIndex
from indexer.model import BlockStored, EventBatch, InstanceId, Tier
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.blockkeys import block_keys
from router_client.config import IndexerClientSettings
from router_client.follower import IndexFollower
from router_client.indexer_client import IndexerClient, MatchOutcome, instance_name
from tests.grpc.conftest import (
    BLOCK,
    Harness,
    close_harness,
    expect_status,
    make_config,
    open_harness,
)
from tests.integration.test_zmq_subscriber import eventually

MODELS = ("m", "m2")
WORKERS = [("w0", 0), ("w0", 1), ("w1", 0), ("w2", 0)]
TIERS = (pb.TIER_GPU, pb.TIER_CPU, pb.TIER_DISK)


class _World:
    """The workload's own bookkeeping: which hashes each instance announced."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        # A few shared stems, so that prompts share prefixes and blocks holders.
        self.stems = [[rng.randrange(50) for _ in range(BLOCK * 3)] for _ in range(3)]
        self.prompts: list[list[int]] = []
        self.seq: dict[tuple[str, int], int] = {}
        self.model: dict[tuple[str, int], str] = {}
        self.incarnation: dict[tuple[str, int], int] = {}
        self.hashes: dict[tuple[str, int], list[int]] = {}
        self.next_hash = 1

    def prompt(self) -> list[int]:
        rng = self.rng
        if self.prompts and rng.random() < 0.4:
            return rng.choice(self.prompts)
        stem = rng.choice(self.stems)[: BLOCK * rng.randrange(0, 4)]
        p = stem + [rng.randrange(50) for _ in range(BLOCK * rng.randrange(1, 5))]
        self.prompts.append(p)
        return p


async def _register(h: Harness, w: _World, key: tuple[str, int], *, new: bool = False) -> None:
    if new or key not in w.incarnation:
        w.incarnation[key] = w.incarnation.get(key, 0) + 1
        w.seq[key] = 0
        w.hashes[key] = []
    if key not in w.model or (new and w.rng.random() < 0.3):
        w.model[key] = w.rng.choice(MODELS)
    await h.stub.RegisterInstance(
        pb.RegisterInstanceRequest(
            instance=pb.InstanceRef(worker_id=key[0], dp_rank=key[1]),
            model=w.model[key],
            address=f"http://{key[0]}-{key[1]}",
            lease_ttl_seconds=60,
            incarnation=f"inc-{w.incarnation[key]}",
        )
    )


def _store(w: _World, key: tuple[str, int]) -> pb.Event:
    rng = w.rng
    p = w.prompt()
    n = len(p) // BLOCK
    hashes = list(range(w.next_hash, w.next_hash + n))
    w.next_hash += n
    w.hashes[key] += hashes
    lora = "lora" if rng.random() < 0.2 else ""
    return pb.Event(
        stored=pb.BlockStored(
            block_hashes=hashes,
            token_ids=p[: n * BLOCK],
            block_size=BLOCK,
            lora_name=lora,
            tier=rng.choice(TIERS),
        )
    )


def _events(w: _World, key: tuple[str, int]) -> list[pb.Event]:
    rng = w.rng
    out: list[pb.Event] = []
    for _ in range(rng.randrange(1, 4)):
        r = rng.random()
        held = w.hashes[key]
        if r < 0.55 or not held:
            out.append(_store(w, key))
        elif r < 0.75:
            gone = rng.sample(held, min(len(held), rng.randrange(1, 4)))
            tier = rng.choice((pb.TIER_UNSPECIFIED, *TIERS))
            out.append(pb.Event(removed=pb.BlockRemoved(block_hashes=gone, tier=tier)))
        elif r < 0.85:
            # A tier move: the same hashes stored on another tier, then removed from one.
            h = rng.sample(held, min(len(held), 2))
            out.append(pb.Event(removed=pb.BlockRemoved(block_hashes=h, tier=pb.TIER_GPU)))
        elif r < 0.9:
            out.append(pb.Event(cleared=pb.AllBlocksCleared()))
            w.hashes[key] = []
        else:
            # An orphan: a parent nobody announced.
            s = _store(w, key)
            s.stored.parent_block_hash = 10**9 + rng.randrange(1000)
            out.append(s)
    return out


async def _step(h: Harness, w: _World) -> None:
    rng = w.rng
    key = rng.choice(WORKERS)
    r = rng.random()
    if key not in w.incarnation or r < 0.04:
        await _register(h, w, key, new=key in w.incarnation)
        return
    ref = pb.InstanceRef(worker_id=key[0], dp_rank=key[1])
    if r < 0.08:
        await h.stub.Heartbeat(pb.HeartbeatRequest(instance=ref))
    elif r < 0.1:
        await h.stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref))
        for d in (w.incarnation, w.model, w.seq, w.hashes):
            d.pop(key, None)
    else:
        batch = pb.EventBatch(
            instance=ref,
            sequence=w.seq[key],
            events=_events(w, key),
            counts_copies=rng.random() < 0.3,
        )
        # Now and then a gap (the instance is stale until a clear) or a duplicate.
        r = rng.random()
        w.seq[key] += 2 if r < 0.03 else 0 if r < 0.06 else 1
        await h.stub.PublishEvents(pb.PublishEventsRequest(batch=batch))


async def _caught_up(h: Harness, f: IndexFollower, within: float = 10.0) -> None:
    hub = h.server.index.watch
    assert hub is not None
    await eventually(lambda: f.synced and f.position >= hub.position, within=within)


def _outcome(resp: pb.MatchResponse) -> dict[str, tuple[int, int, int, int]]:
    return {
        instance_name(m.instance.worker_id, m.instance.dp_rank): (
            m.depth,
            m.gpu_blocks,
            m.cpu_blocks,
            m.disk_blocks,
        )
        for m in resp.matches
    }


def _local(out: MatchOutcome | None) -> dict[str, tuple[int, int, int, int]]:
    assert out is not None and out.ok
    return {k: (v.depth, v.gpu_blocks, v.cpu_blocks, v.disk_blocks) for k, v in out.matches.items()}


async def _compare(h: Harness, w: _World, f: IndexFollower) -> int:
    """Every prompt under both models and LoRA names: the number that differ."""
    await _caught_up(h, f)
    wrong = hits = 0
    for p in [*w.prompts, *w.stems]:
        for model in MODELS:
            for lora in ("", "lora"):
                keys = block_keys(p, BLOCK, model, lora)
                resp = await h.stub.Match(
                    pb.MatchRequest(model=model, lora_name=lora, block_keys=keys)
                )
                if _outcome(resp) != _local(f.match(model, lora, keys)):
                    wrong += 1
                hits += len(resp.matches)
    assert hits > 20  # the comparison has something to compare
    return wrong


async def _run(seed: int, follower_cls: type[IndexFollower] = IndexFollower) -> int:
    h = await open_harness(make_config(), MemoryIndex())
    w = _World(random.Random(seed))
    f = follower_cls(h.server.address)
    try:
        for _ in range(150):  # before the follower: its snapshot holds them
            await _step(h, w)
        await f.start()
        assert await f.wait_synced(10)
        wrong = await _compare(h, w, f)
        for _ in range(250):  # while it follows
            await _step(h, w)
        wrong += await _compare(h, w, f)
        assert f.snapshots == 1 and f.divergences == 0
        assert f.local_matches > 0
        return wrong
    finally:
        await f.close()
        await close_harness(h)


@pytest.mark.parametrize("seed", [1, 2, 3])
async def test_the_follower_answers_what_the_replica_answers(seed: int) -> None:
    assert await _run(seed) == 0


class _DropsRemovals(IndexFollower):
    """Broken on purpose: applies every batch without its removals."""

    async def _on(self, ch: pb.WatchChange) -> None:
        if ch.WhichOneof("change") == "batch":
            keep = [e for e in ch.batch.events if e.WhichOneof("kind") != "removed"]
            del ch.batch.events[:]
            ch.batch.events.extend(keep)
        await super()._on(ch)


async def test_a_follower_that_drops_removals_fails_the_comparison() -> None:
    assert sum([await _run(seed, _DropsRemovals) for seed in (1, 2)]) > 0


async def test_a_follower_behind_its_buffer_resyncs_and_answers_the_same() -> None:
    index = MemoryIndex()
    h = await open_harness(make_config(watch={"buffer": 8}), index)
    w = _World(random.Random(5))
    f = IndexFollower(h.server.address)
    try:
        for _ in range(40):
            await _step(h, w)
        await f.start()
        assert await f.wait_synced(10)
        key = next(k for k in WORKERS if k in w.incarnation)
        iid = InstanceId(*key)
        # Applied in one step of the loop: the replica's stream cannot send any
        # of them before all are buffered, and 8 do not fit.
        for _ in range(50):
            tokens = w.prompt()
            n = len(tokens) // BLOCK
            ev = BlockStored(
                block_hashes=tuple(range(w.next_hash, w.next_hash + n)),
                parent_block_hash=None,
                token_ids=tuple(tokens[: n * BLOCK]),
                block_size=BLOCK,
                tier=Tier.CPU,
            )
            w.next_hash += n
            await index.apply(EventBatch(iid, w.seq[key], (ev,)))
            w.seq[key] += 1
        await eventually(lambda: f.resyncs > 0 and f.snapshots >= 2, within=10.0)
        assert await _compare(h, w, f) == 0
        assert h.server.servicer.watch_resyncs >= 1
    finally:
        await f.close()
        await close_harness(h)


async def test_an_indexer_client_with_a_follower_answers_in_process() -> None:
    h = await open_harness(make_config(), MemoryIndex())
    w = _World(random.Random(9))
    f = IndexFollower(h.server.address, models=list(MODELS))
    client: IndexerClient | None = None
    try:
        for _ in range(60):
            await _step(h, w)
        await f.start()
        assert await f.wait_synced(10)
        await _caught_up(h, f)
        # A prompt some instance holds, so that both answers name it.
        found = None
        for model in MODELS:
            for p in w.prompts:
                keys = block_keys(p, BLOCK, model)
                resp = await h.stub.Match(pb.MatchRequest(model=model, block_keys=keys))
                if resp.matches:
                    found = model, keys
                    break
            if found:
                break
        assert found, "no prompt of the workload is held"
        model, keys = found
        # A deadline a loaded test machine meets: the remote Match below is compared.
        settings = IndexerClientSettings(deadline_ms=5000)
        client = IndexerClient(h.server.address, model=model, follower=f, settings=settings)
        local = await client.match(keys)
        assert client.follower_matches == 1 and local.ok and local.matches
        # Not followed: another model goes to the indexer.
        assert f.match("not-followed", "", keys) is None
        await f.close()
        remote = await client.match(keys)  # the follower stopped: the indexer answers
        assert client.follower_matches == 1 and remote == local
    finally:
        if client is not None:
            await client.close()
        await f.close()
        await close_harness(h)


async def test_watch_index_refuses_what_it_cannot_serve() -> None:
    h = await open_harness(make_config(watch={"enabled": False}), MemoryIndex())
    try:
        call: Any = h.stub.WatchIndex(pb.WatchIndexRequest())
        err = await expect_status(call.read(), grpc.StatusCode.FAILED_PRECONDITION)
        assert "watch.enabled" in (err.details() or "")
    finally:
        await close_harness(h)
    h = await open_harness(make_config(), MemoryIndex())
    try:
        call = h.stub.WatchIndex(pb.WatchIndexRequest(models=["m", ""]))
        err = await expect_status(call.read(), grpc.StatusCode.INVALID_ARGUMENT)
        assert "models[1]" in (err.details() or "")
    finally:
        await close_harness(h)


async def test_past_its_bound_the_follower_drops_the_model_matched_least_recently() -> None:
    h = await open_harness(make_config(), MemoryIndex())
    w = _World(random.Random(11))
    try:
        for key, model in ((("w0", 0), "m"), (("w1", 0), "m2")):
            w.model[key] = model
            await _register(h, w, key)
        ref = {k: pb.InstanceRef(worker_id=k[0], dp_rank=k[1]) for k in (("w0", 0), ("w1", 0))}
        hot = w.prompt()
        for key in ref:
            for _ in range(3):
                batch = pb.EventBatch(
                    instance=ref[key], sequence=w.seq[key], events=[_store(w, key)]
                )
                w.seq[key] += 1
                await h.stub.PublishEvents(pb.PublishEventsRequest(batch=batch))
        f = IndexFollower(h.server.address, max_pairs=10_000)
        await f.start()
        assert await f.wait_synced(10)
        keys_m = block_keys(hot, BLOCK, "m")
        assert f.match("m", "", keys_m) is not None  # m matched, m2 never
        f.max_pairs = 1  # now over it: m2 (never matched) goes remote
        store = pb.EventBatch(
            instance=ref[("w0", 0)], sequence=w.seq[("w0", 0)], events=[_store(w, ("w0", 0))]
        )
        w.seq[("w0", 0)] += 1
        await h.stub.PublishEvents(pb.PublishEventsRequest(batch=store))
        await eventually(lambda: "m2" in f.dropped and f.synced, within=10.0)
        assert f.match("m2", "", block_keys(hot, BLOCK, "m2")) is None
        assert f.index.pairs_by_model().keys() <= {"m"}
        resp = await h.stub.Match(pb.MatchRequest(model="m", block_keys=keys_m))
        assert _outcome(resp) == _local(f.match("m", "", keys_m))
        await f.close()
    finally:
        await close_harness(h)


async def test_a_replica_stopping_ends_its_followers_at_once() -> None:
    """Followers are not in-flight work: a replica's graceful stop does not wait
    its grace period for them, and the follower stops answering (goes remote)."""
    h = await open_harness(make_config(shutdown_grace_s=5.0), MemoryIndex())
    f = IndexFollower(h.server.address)
    try:
        await f.start()
        assert await f.wait_synced(10)
        t0 = time.monotonic()
        await h.server.stop()
        assert time.monotonic() - t0 < 2.0
        await eventually(lambda: not f.synced, within=5.0)
        assert f.match("m", "", [1, 2]) is None
    finally:
        await f.close()
        await h.channel.close()
