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

Instances sent in parts (WatchedInstance.part, more): the replica's part size
is lowered so that the workload's instances split; the follower answers the
same, one that installs only an instance's first part does not, and a part
lost or out of order is a gap: nothing of that snapshot is installed and the
follower takes a new one. An instance larger than the replica's message limit
reaches the follower in parts (and cannot whole), and a change larger than
grpc's default 4 MiB reaches it on its stream.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from typing import Any

import grpc
import pytest

from indexer.memory import MemoryIndex
from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, Tier
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.blockkeys import block_keys
from router_client.config import IndexerClientSettings
from router_client.follower import IndexFollower, _Gap
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
        #: Whether the workload sends route-time predictions (PredictPlacement),
        #: and the hits deepened by one that the comparisons saw.
        self.predict = True
        self.predicted_hits = 0
        #: The predictions' pending deadlines, drawn apart (the rest of the
        #: workload is what it was without them).
        self.pending_rng = random.Random(rng.getstate()[1][0])

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


async def _register_w0(h: Harness) -> None:
    """Register w0/dp0 of model m (lease 60 s), for the large-instance tests."""
    await h.stub.RegisterInstance(
        pb.RegisterInstanceRequest(
            instance=pb.InstanceRef(worker_id="w0", dp_rank=0),
            model="m",
            address="http://w0-0",
            lease_ttl_seconds=60,
            incarnation="i",
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
        if w.predict and rng.random() < 0.3:
            # A router sent a request there: its blocks predicted (some held already).
            p = w.prompt()
            lora = "lora" if rng.random() < 0.2 else ""
            await h.stub.PredictPlacement(
                pb.PredictPlacementRequest(
                    model=w.model[key],
                    lora_name=lora,
                    instance=ref,
                    block_keys=block_keys(p, BLOCK, w.model[key], lora),
                    ttl_ms=60_000,
                    # Pending prefill while predicted, for a moment (over
                    # before any comparison), or past the run.
                    pending_ms=w.pending_rng.choice((0, 1, 50_000)),
                )
            )


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


_Predicted = tuple[dict[str, tuple[int, int, int, int, int]], dict[str, int] | None]


def _outcome_predicted(resp: pb.MatchResponse) -> _Predicted:
    hits = {
        instance_name(m.instance.worker_id, m.instance.dp_rank): (
            m.depth,
            m.gpu_blocks,
            m.cpu_blocks,
            m.disk_blocks,
            m.predicted_depth,
        )
        for m in resp.matches
    }
    pending = (
        {
            instance_name(p.instance.worker_id, p.instance.dp_rank): p.predicted_blocks
            for p in resp.pending
        }
        if resp.pending_reported
        else None
    )
    return hits, pending


def _local_predicted(out: MatchOutcome | None) -> _Predicted:
    assert out is not None and out.ok
    hits = {
        k: (v.depth, v.gpu_blocks, v.cpu_blocks, v.disk_blocks, v.predicted_depth)
        for k, v in out.matches.items()
    }
    return hits, out.pending


async def _compare(h: Harness, w: _World, f: IndexFollower) -> int:
    """Every prompt under both models and LoRA names, with and without
    predictions: the number of answers that differ."""
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
                if not w.predict:
                    continue
                resp = await h.stub.Match(
                    pb.MatchRequest(
                        model=model, lora_name=lora, block_keys=keys, include_predicted=True
                    )
                )
                local = f.match(model, lora, keys, include_predicted=True)
                if _outcome_predicted(resp) != _local_predicted(local):
                    wrong += 1
                w.predicted_hits += sum(m.predicted_depth > m.depth for m in resp.matches)
    assert hits > 20  # the comparison has something to compare
    return wrong


async def _run(
    seed: int, follower_cls: type[IndexFollower] = IndexFollower, part_bytes: int = 0
) -> int:
    h = await open_harness(make_config(), MemoryIndex())
    if part_bytes:
        h.server.servicer.watch_part_bytes = part_bytes
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
        assert w.predicted_hits > 20  # the comparison has predictions to compare
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
    assert await _run(1, _DropsRemovals) > 0  # some hundreds of wrong answers


class _DropsPredictions(IndexFollower):
    """Broken on purpose: ignores the predictions recorded after its snapshot."""

    async def _on(self, ch: pb.WatchChange) -> None:
        if ch.WhichOneof("change") != "predicted":
            await super()._on(ch)


class _SnapshotWithoutPredictions(IndexFollower):
    """Broken on purpose: loads its snapshot without the instances' predictions."""

    async def _on(self, ch: pb.WatchChange) -> None:
        if ch.WhichOneof("change") == "snapshot":
            del ch.snapshot.predicted[:]
        await super()._on(ch)


class _IgnoresPendingDeadlines(IndexFollower):
    """Broken on purpose: counts each prediction as pending while it lives."""

    async def _on(self, ch: pb.WatchChange) -> None:
        kind = ch.WhichOneof("change")
        if kind == "predicted":
            ch.predicted.pending_until = 0.0
        elif kind == "snapshot":
            for p in ch.snapshot.predicted:
                p.pending_until = 0.0
        await super()._on(ch)


@pytest.mark.parametrize(
    "broken", [_DropsPredictions, _SnapshotWithoutPredictions, _IgnoresPendingDeadlines]
)
async def test_a_follower_that_misses_predictions_fails_the_comparison(
    broken: type[IndexFollower],
) -> None:
    assert await _run(1, broken) > 0  # some hundreds of wrong answers


async def test_predictions_reach_the_follower_and_end_with_their_engines_events() -> None:
    """One prediction, step by step: recorded at the replica, the follower's
    Match with predictions shows it (and the pending blocks) within the
    stream's delay; the engine's store confirms it in both; another expires
    in both at its expiry; a follower that did not ask for predictions (or
    whose replica does not carry them) leaves such Matches to the indexer."""
    h = await open_harness(make_config(), MemoryIndex())
    f = IndexFollower(h.server.address)
    plain = IndexFollower(h.server.address, predictions=False)
    try:
        await _register_w0(h)
        await f.start()
        await plain.start()
        assert await f.wait_synced(10) and await plain.wait_synced(10)
        assert f.predictions_followed and not plain.predictions_followed
        tokens = list(range(BLOCK * 4))
        keys = block_keys(tokens, BLOCK, "m", "")
        ref = pb.InstanceRef(worker_id="w0", dp_rank=0)
        await h.stub.PredictPlacement(
            pb.PredictPlacementRequest(model="m", instance=ref, block_keys=keys, ttl_ms=60_000)
        )
        await _caught_up(h, f)
        got = f.match("m", "", keys, include_predicted=True)
        assert got is not None and got.pending == {instance_name("w0", 0): 4}
        assert got.matches[instance_name("w0", 0)].predicted_depth == 4
        assert got.matches[instance_name("w0", 0)].depth == 0
        assert plain.match("m", "", keys, include_predicted=True) is None
        assert plain.match("m", "", keys) is not None  # the plain Match still local
        # The engine stores the first two blocks: their predictions are confirmed.
        await h.stub.PublishEvents(
            pb.PublishEventsRequest(
                batch=pb.EventBatch(
                    instance=ref,
                    sequence=0,
                    events=[
                        pb.Event(
                            stored=pb.BlockStored(
                                block_hashes=[1, 2], token_ids=tokens[: 2 * BLOCK], block_size=BLOCK
                            )
                        )
                    ],
                )
            )
        )
        await _caught_up(h, f)
        got = f.match("m", "", keys, include_predicted=True)
        assert got is not None and got.pending == {instance_name("w0", 0): 2}
        assert got.matches[instance_name("w0", 0)].depth == 2
        assert got.matches[instance_name("w0", 0)].predicted_depth == 4
        # A short-lived prediction of another prompt: gone in both at its expiry.
        other = block_keys([7] * BLOCK * 2, BLOCK, "m", "")
        await h.stub.PredictPlacement(
            pb.PredictPlacementRequest(model="m", instance=ref, block_keys=other, ttl_ms=2000)
        )
        sent = time.monotonic()  # recorded before this: it expires by sent + 2 s
        await _caught_up(h, f)
        got = f.match("m", "", other, include_predicted=True)
        assert got is not None and got.matches[instance_name("w0", 0)].predicted_depth == 2
        # (2 s: the follower's catch-up above must see it first, on a slow runner too)
        await asyncio.sleep(max(0.0, sent + 2.05 - time.monotonic()))
        got = f.match("m", "", other, include_predicted=True)
        assert got is not None and instance_name("w0", 0) not in got.matches
        resp = await h.stub.Match(
            pb.MatchRequest(model="m", block_keys=other, include_predicted=True)
        )
        assert not resp.matches
        # An IndexerClient answers Matches with predictions from the follower.
        client = IndexerClient(h.server.address, model="m", follower=f)
        try:
            out = await client.match(keys, include_predicted=True)
            assert out.ok and out.matches[instance_name("w0", 0)].predicted_depth == 4
            assert client.follower_matches == 1
        finally:
            await client.close()
    finally:
        await plain.close()
        await f.close()
        await close_harness(h)


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


async def _held_prompt(h: Harness, w: _World) -> tuple[str, list[int]]:
    """A model and the keys of a prompt some instance holds (so answers name it)."""
    for model in MODELS:
        for p in w.prompts:
            keys = block_keys(p, BLOCK, model)
            resp = await h.stub.Match(pb.MatchRequest(model=model, block_keys=keys))
            if resp.matches:
                return model, keys
    raise AssertionError("no prompt of the workload is held")


async def test_through_an_indexer_outage_the_client_answers_from_the_held_copy() -> None:
    """The indexer stops: the follower goes out of sync, the indexer does not
    answer, and the client answers from the copy the follower held, while the
    hold lasts; a follower without a hold (hold_s 0) leaves it to load alone."""
    h = await open_harness(make_config(), MemoryIndex())
    w = _World(random.Random(13))
    f = IndexFollower(h.server.address, models=list(MODELS))
    unheld = IndexFollower(h.server.address, models=list(MODELS), hold_s=0)
    clients: list[IndexerClient] = []
    try:
        for _ in range(60):
            await _step(h, w)
        for x in (f, unheld):
            await x.start()
            assert await x.wait_synced(10)
            await _caught_up(h, x)
        model, keys = await _held_prompt(h, w)
        settings = IndexerClientSettings(deadline_ms=500)
        client = IndexerClient(h.server.address, model=model, follower=f, settings=settings)
        bare = IndexerClient(h.server.address, model=model, follower=unheld, settings=settings)
        clients += [client, bare]
        before = await client.match(keys)
        assert client.follower_matches == 1 and before.ok and before.matches
        assert f.held_match(model, "", keys) is None  # in sync: nothing is held
        await h.server.stop()
        await eventually(lambda: not f.synced and not unheld.synced, within=5.0)
        during = await client.match(keys)
        assert during == before and client.follower_held_matches == 1 and f.held_matches == 1
        assert sum(n for st, n in client.calls.items() if st.value != "ok") >= 1
        assert 0 < f.held_age_s < f.hold_s
        gone = await bare.match(keys)
        assert not gone.ok and bare.follower_held_matches == 0
        f.hold_s = f.held_age_s / 2  # the hold ran out: nothing is held any more
        late = await client.match(keys)
        assert not late.ok and client.follower_held_matches == 1
    finally:
        for c in clients:
            await c.close()
        await f.close()
        await unheld.close()
        await h.channel.close()


async def test_out_of_sync_the_client_asks_a_live_indexer_before_the_held_copy() -> None:
    """The follower's replica stops, but the client's indexer answers: its
    answer (here: nothing held) is the one given, not the follower's copy."""
    a = await open_harness(make_config(), MemoryIndex())
    b = await open_harness(make_config(), MemoryIndex())
    w = _World(random.Random(17))
    f = IndexFollower(a.server.address, models=list(MODELS))
    client: IndexerClient | None = None
    try:
        for _ in range(60):
            await _step(a, w)
        await f.start()
        assert await f.wait_synced(10)
        await _caught_up(a, f)
        model, keys = await _held_prompt(a, w)
        settings = IndexerClientSettings(deadline_ms=5000)
        client = IndexerClient(b.server.address, model=model, follower=f, settings=settings)
        await a.server.stop()
        await eventually(lambda: not f.synced, within=5.0)
        assert f.held_match(model, "", keys) is not None  # the copy would answer
        out = await client.match(keys)
        assert out.ok and not out.matches and client.follower_held_matches == 0
    finally:
        if client is not None:
            await client.close()
        await f.close()
        await a.channel.close()
        await close_harness(b)


async def test_follower_hold_must_be_a_duration() -> None:
    for bad in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="hold_s"):
            IndexFollower("127.0.0.1:1", hold_s=bad)


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


# -- instances in parts ----------------------------------------------------------

#: Bytes of a snapshot part's stores in these tests (a store of 6 blocks, 5 of
#: a LoRA's): the workload's instances hold tens of blocks, so most go in
#: several parts.
PART_BYTES = 150


async def _snapshot(h: Harness, parts: bool = True) -> list[pb.WatchChange]:
    """The entries of one WatchIndex snapshot, WatchSynced last."""
    call: Any = h.stub.WatchIndex(pb.WatchIndexRequest(instance_parts=parts), timeout=20)
    out: list[pb.WatchChange] = []
    try:
        while not out or out[-1].WhichOneof("change") != "synced":
            resp = await call.read()
            assert resp.ByteSize() <= (1 << 20)
            out += resp.changes
    finally:
        call.cancel()
    return out


async def test_a_replica_splits_instances_only_for_a_follower_that_takes_parts() -> None:
    h = await open_harness(make_config(), MemoryIndex())
    h.server.servicer.watch_part_bytes = PART_BYTES
    w = _World(random.Random(1))
    try:
        for _ in range(150):
            await _step(h, w)
        whole = await _snapshot(h, parts=False)
        split = await _snapshot(h, parts=True)
        assert all(not c.snapshot.part and not c.snapshot.more for c in whole[:-1])
        instances = whole[-1].synced.instances
        assert instances == split[-1].synced.instances == len(whole) - 1 >= 2
        assert len(split) - 1 > instances  # some instance went in several parts
        for c in split[:-1]:
            bare = pb.EventBatch()
            bare.CopyFrom(c.snapshot.content)
            del bare.events[:]
            assert c.snapshot.content.ByteSize() - bare.ByteSize() <= PART_BYTES
        # Each instance's parts: numbered from 0, the last without more, its blocks
        # those of the whole entry in order.
        by_instance: dict[tuple[str, int], list[pb.WatchChange]] = {}
        for c in split[:-1]:
            ref = c.snapshot.info.instance
            by_instance.setdefault((ref.worker_id, ref.dp_rank), []).append(c)
        for c in whole[:-1]:
            ref = c.snapshot.info.instance
            got = by_instance[ref.worker_id, ref.dp_rank]
            assert [p.snapshot.part for p in got] == list(range(len(got)))
            assert [p.snapshot.more for p in got] == [True] * (len(got) - 1) + [False]
            assert {p.position for p in got} == {c.position}
            blocks = [
                (e.stored.lora_name, e.stored.tier, h_, k)
                for p in got
                for e in p.snapshot.content.events
                for h_, k in zip(e.stored.block_hashes, e.stored.block_keys, strict=True)
            ]
            assert blocks == [
                (e.stored.lora_name, e.stored.tier, h_, k)
                for e in c.snapshot.content.events
                for h_, k in zip(e.stored.block_hashes, e.stored.block_keys, strict=True)
            ]
    finally:
        await close_harness(h)


@pytest.mark.parametrize("seed", [1, 2])
async def test_a_follower_of_instances_in_parts_answers_what_the_replica_answers(
    seed: int,
) -> None:
    assert await _run(seed, part_bytes=PART_BYTES) == 0


class _FirstPartOnly(IndexFollower):
    """Broken on purpose: installs only the first part of each instance."""

    async def _on(self, ch: pb.WatchChange) -> None:
        if ch.WhichOneof("change") == "snapshot":
            if ch.snapshot.part:
                return
            ch.snapshot.more = False
        await super()._on(ch)


async def test_a_follower_that_installs_only_first_parts_fails_the_comparison() -> None:
    assert await _run(1, _FirstPartOnly, part_bytes=PART_BYTES) > 0


class _LosesAPart(IndexFollower):
    """Its first snapshot arrives without one part (as a broken stream would give it)."""

    lost = False

    async def _on(self, ch: pb.WatchChange) -> None:
        if not self.lost and ch.WhichOneof("change") == "snapshot" and ch.snapshot.part == 1:
            self.lost = True
            return
        await super()._on(ch)


async def test_a_part_lost_is_a_gap_and_the_next_snapshot_answers_the_same() -> None:
    h = await open_harness(make_config(), MemoryIndex())
    h.server.servicer.watch_part_bytes = PART_BYTES
    w = _World(random.Random(3))
    f = _LosesAPart(h.server.address)
    try:
        for _ in range(150):
            await _step(h, w)
        await f.start()
        assert await f.wait_synced(10)
        assert f.lost and f.gaps == 1 and f.reconnects >= 1
        assert f.snapshots == 1  # the broken one was never installed
        assert await _compare(h, w, f) == 0
    finally:
        await f.close()
        await close_harness(h)


def _fed(entries: Sequence[pb.WatchChange]) -> list[pb.WatchChange]:
    return [pb.WatchChange.FromString(c.SerializeToString()) for c in entries]


async def test_a_broken_sequence_of_parts_installs_nothing() -> None:
    """Fed straight to a follower: the snapshot whole installs; every kind of
    break (a part missing, two swapped, an instance's last part missing, the
    end of the snapshot or a change before the last part, an instance missing)
    is a gap."""
    h = await open_harness(make_config(), MemoryIndex())
    h.server.servicer.watch_part_bytes = PART_BYTES
    w = _World(random.Random(2))
    try:
        for _ in range(150):
            await _step(h, w)
        snap = await _snapshot(h)
    finally:
        await close_harness(h)
    body, synced = snap[:-1], snap[-1]
    cont = next(i for i, c in enumerate(body) if c.snapshot.part == 1)  # a part 1
    last = next(i for i in range(cont, len(body)) if not body[i].snapshot.more)
    first = cont - 1
    nxt = last + 1
    assert nxt < len(body), "the split instance is not the last"
    renewed = pb.WatchChange(position=synced.position, renewed=body[first].snapshot.info.instance)
    one_whole = [i for i, c in enumerate(body) if not c.snapshot.part and not c.snapshot.more]
    broken = {
        "a part missing": body[:cont] + body[cont + 1 :],
        "two parts swapped": [*body[:first], body[cont], body[first], *body[cont + 1 :]],
        "the last part missing": body[:last] + body[last + 1 :],
        "the end before the last part": body[:last],
        "a change before the last part": [*body[:last], renewed, *body[last:]],
        "an instance missing": body[:first] + body[nxt:],
    }
    if one_whole:
        i = one_whole[0]
        broken["an instance sent whole missing"] = body[:i] + body[i + 1 :]
    f = IndexFollower("127.0.0.1:9")  # never started: fed by hand
    try:
        for what, entries in broken.items():
            with pytest.raises(_Gap):
                for ch in _fed([*entries, synced]):
                    await f._on(ch)
            assert not f.synced and f._staging is None, what
        assert f.gaps == len(broken) and f.snapshots == 0
        for ch in _fed(snap):
            await f._on(ch)
        assert f.synced and f.snapshots == 1 and f.gaps == len(broken)
        assert f.index.pairs_by_model()
    finally:
        await f.close()


async def test_an_instance_larger_than_a_message_reaches_the_follower_in_parts() -> None:
    """The defect at a small scale: with a 256 KiB message limit, an instance of
    20,000 blocks (some 350 kB) cannot be sent whole, as a million blocks cannot
    at the default 16 MiB; in parts the follower takes it and answers the same."""
    index = MemoryIndex()
    h = await open_harness(make_config(limits={"max_message_bytes": 256 << 10}), index)
    rng = random.Random(12)
    iid = InstanceId("w0", 0)
    big = 1 << 63
    prompts: list[list[int]] = []
    f = IndexFollower(h.server.address)
    try:
        await _register_w0(h)
        for seq in range(320):  # 320 prompts of 64 blocks
            tokens = [rng.randrange(1 << 20) for _ in range(64 * BLOCK)]
            prompts.append(tokens)
            ev = BlockStored(
                # Engine hashes are 64-bit: 10 bytes each on the wire.
                block_hashes=tuple(range(big + seq * 64, big + seq * 64 + 64)),
                parent_block_hash=None,
                token_ids=tuple(tokens),
                block_size=BLOCK,
                tier=rng.choice((Tier.GPU, Tier.CPU)),
            )
            await index.apply(EventBatch(iid, seq, (ev,)))
        assert index.pairs_by_model() == {"m": 320 * 64}
        # Whole, the instance is more than the server sends in one message.
        call: Any = h.stub.WatchIndex(pb.WatchIndexRequest(), timeout=20)
        err = await expect_status(call.read(), grpc.StatusCode.RESOURCE_EXHAUSTED)
        assert "larger than max" in (err.details() or "")
        # grpc core ended that call: the replica's stream ends with it at once.
        hub = index.watch
        assert hub is not None
        await eventually(lambda: hub.watchers == 0, within=2.0)
        parts = await _snapshot(h)
        assert len(parts) - 1 >= 3 and parts[-1].synced.instances == 1
        assert all(c.ByteSize() < (128 << 10) for c in parts)
        await f.start()
        assert await f.wait_synced(10)
        assert f.index.pairs_by_model() == index.pairs_by_model()
        for tokens in rng.sample(prompts, 40):
            cut = tokens[: BLOCK * rng.randrange(1, 65)]
            keys = block_keys(cut, BLOCK, "m")
            resp = await h.stub.Match(pb.MatchRequest(model="m", block_keys=keys))
            assert resp.matches and _outcome(resp) == _local(f.match("m", "", keys))
    finally:
        await f.close()
        await close_harness(h)


async def test_a_change_larger_than_grpcs_default_message_reaches_the_follower() -> None:
    """A batch of 300,000 blocks is some 5.4 MB as a change: over grpc's default
    4 MiB a client receives, under the replica's 16 MiB. The follower takes it
    on its stream, without a reconnect or a new snapshot."""
    index = MemoryIndex()
    h = await open_harness(make_config(), index)
    f = IndexFollower(h.server.address)
    rng = random.Random(13)
    try:
        await _register_w0(h)
        await f.start()
        assert await f.wait_synced(10)
        n = 300_000
        stored = BlockStored(
            block_hashes=tuple((1 << 63) | rng.getrandbits(63) for _ in range(n)),
            block_keys=tuple(rng.getrandbits(64) for _ in range(n)),
        )
        await index.apply(EventBatch(InstanceId("w0", 0), 0, (stored,)))
        await eventually(lambda: f.changes_applied >= 1 or f.reconnects > 0, within=20.0)
        assert f.reconnects == 0 and f.snapshots == 1
        assert f.index.pairs_by_model() == index.pairs_by_model() == {"m": n}
    finally:
        await f.close()
        await close_harness(h)


async def test_changes_a_follower_fell_behind_by_come_in_bounded_responses() -> None:
    """A follower that stops reading while the replica applies 48 batches of
    16,384 blocks (some 22 MB of changes, under its buffer), then reads them
    all, each response within 1 MiB. Sent as one response of everything it
    missed, they were 16 MB in one message (a run of the previous servicer),
    at grpc's 16 MiB limit, past which the stream ends."""
    index = MemoryIndex()
    h = await open_harness(make_config(), index)
    hub = index.watch
    assert hub is not None
    rng = random.Random(14)
    iid = InstanceId("w0", 0)
    try:
        await _register_w0(h)
        call: Any = h.stub.WatchIndex(pb.WatchIndexRequest(instance_parts=True), timeout=30)
        first = await call.read()
        assert first.changes[-1].WhichOneof("change") == "synced"
        n = 16_384
        for seq in range(48):  # stored and removed again: the instance stays small
            hashes = tuple((1 << 63) | rng.getrandbits(63) for _ in range(n))
            stored = BlockStored(
                block_hashes=hashes, block_keys=tuple(rng.getrandbits(64) for _ in range(n))
            )
            await index.apply(EventBatch(iid, seq, (stored, BlockRemoved(hashes))))
        end = hub.position
        got: list[int] = []
        sizes: list[int] = []
        while not got or got[-1] < end:
            resp = await call.read()
            sizes.append(resp.ByteSize())
            got += [c.position for c in resp.changes]
        call.cancel()
        assert got == list(range(got[0], end + 1)) and len(got) == 48
        assert max(sizes) <= 1 << 20 and sum(sizes) > 16 << 20
    finally:
        await close_harness(h)
