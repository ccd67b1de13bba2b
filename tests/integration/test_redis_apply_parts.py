"""A long batch goes to Redis in parts: no script holds the server for long.

Redis runs one script at a time, and every other client's command waits for
it: another replica's Match, a health check, anything else sharing the
server. One apply script takes about 5 µs a block, and a batch may carry
hundreds of thousands of blocks (vLLM stores a whole prompt in one event: a
256k-token prompt is 16,384 blocks of 16 tokens, and a batch may hold 4,096
events). So a batch longer than ``apply_part_blocks`` is applied a part at a
time (indexer/redis/KEYS.md, "Apply in parts"), each part once, whichever
replica sends it, the sequence recorded by the last part.

Against a real redis-server:
- a 40,000-block batch: the longest script Redis logs (SLOWLOG, the server's
  own timing) stays far below what one script of the batch takes, and the
  index holds the whole batch;
- a writer cut off after three parts leaves them applied and the sequence
  unrecorded; another replica with another part size sends the batch again
  and it goes on where it stopped, with counted copies exactly as the memory
  backend counts them (a part applied twice would count its copies twice);
  the first writer's retry is then a DUPLICATE (also on a 3-master Cluster,
  where each part is a control-slot script and its data-node writes);
- a lease renewal does not wait for the queue of applies.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from typing import Any

import pytest
import redis

from indexer.memory import MemoryIndex
from indexer.model import (
    BatchOutcome,
    BlockRemoved,
    BlockStored,
    EventBatch,
    InstanceId,
    InstanceSpec,
    Namespace,
)
from indexer.redis.backend import RedisIndex
from kvmesh.blockkeys import block_keys

BLOCK = 16
INST = InstanceId("w0", 0)
SPEC = InstanceSpec(INST, "m", "http://w0", 3600.0, "x")


def _chain(rng: random.Random, n: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    hashes = tuple(rng.getrandbits(63) for _ in range(n))
    tokens = tuple(rng.randrange(1, 30_000) for _ in range(BLOCK * n))
    return hashes, tokens


def _evalsha_us(r: redis.Redis) -> list[int]:
    """Durations of the scripts SLOWLOG holds (Redis logs the commands a script
    runs too: only those over 1 ms are logged, and they are the scripts)."""
    return [
        int(e["duration"])
        for e in r.slowlog_get(4096)
        if bytes(e["command"]).upper().startswith(b"EVALSHA")
    ]


def _evalsha_calls(r: redis.Redis) -> int:
    return int(r.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0))


async def _long_script_ms(redis_server: Any, part_blocks: int) -> tuple[float, int, Any]:
    rng = random.Random(5)
    hashes, tokens = _chain(rng, 40_000)
    r = redis.Redis.from_url(redis_server.url)
    idx = RedisIndex(
        redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}", apply_part_blocks=part_blocks
    )
    try:
        await idx.register(SPEC)
        r.config_set("slowlog-max-len", 4096)
        r.config_set("slowlog-log-slower-than", 1000)
        r.slowlog_reset()
        calls = _evalsha_calls(r)
        res = await idx.apply(EventBatch(INST, 1, (BlockStored(hashes, None, tokens, BLOCK),)))
        durations = _evalsha_us(r)
        calls = _evalsha_calls(r) - calls
        assert res.outcome is BatchOutcome.APPLIED and res.blocks_stored == 40_000
        keys = block_keys(tokens[: BLOCK * 2048], BLOCK, "m")
        got = await idx.match(Namespace("m"), keys)
        assert [(m.instance, m.depth) for m in got] == [(INST, 2048)]
        state = next(s for s in await idx.list_instances() if s.spec.instance == INST)
        assert state.applied_sequence == 1 and not state.stale
        return max(durations) / 1e3, calls, idx.apply_parts
    finally:
        r.config_set("slowlog-log-slower-than", 10_000)
        r.close()
        await idx.close()


async def test_a_long_batch_never_holds_redis_long(redis_server: Any) -> None:
    """40,000 blocks in parts of 1,024: every script short; in one script, not."""
    longest, scripts, parts = await _long_script_ms(redis_server, 1024)
    assert parts == 40 and scripts >= 40
    whole, _, _ = await _long_script_ms(redis_server, 0)
    # One script of the whole batch takes about 200 ms here; parts about 5.
    assert whole > 100, whole
    assert longest < 50 and longest < whole / 4, (longest, whole)


class CutOff(RedisIndex):
    """A writer whose connection fails after ``parts`` parts of a batch."""

    parts = 3

    async def _apply(self, batch: EventBatch, part: str = "") -> Any:
        if part:
            if self.parts == 0:
                raise ConnectionError("cut off between two parts")
            self.parts -= 1
        return await super()._apply(batch, part)


def _batch(seq: int) -> EventBatch:
    """Stores of two chains, one hash of each stored twice (counted copies),
    and a removal of one of those copies: 700 blocks."""
    rng = random.Random(11)
    h1, t1 = _chain(rng, 300)
    h2, t2 = _chain(rng, 380)
    return EventBatch(
        INST,
        seq,
        (
            BlockStored(h1, None, t1, BLOCK),
            BlockStored(h2, None, t2, BLOCK),
            BlockStored(h1[:10], None, t1[: 10 * BLOCK], BLOCK),
            BlockRemoved(h1[:5]),
            BlockStored(h2[:5], None, t2[: 5 * BLOCK], BLOCK),
        ),
        counts_copies=True,
    )


async def _held(idx: Any, batch: EventBatch) -> list[tuple[int, int]]:
    """Depth of the instance on each chain of ``batch``, by tier counts."""
    out = []
    for ev in batch.events[:2]:
        assert isinstance(ev, BlockStored)
        got = await idx.match(Namespace("m"), block_keys(ev.token_ids, BLOCK, "m"))
        out.append(next(((m.depth, m.gpu_blocks) for m in got if m.instance == INST), (0, 0)))
    return out


@pytest.mark.parametrize(
    ("layout", "part_b"),
    [("standalone", 37), ("standalone", 100), ("standalone", 1024), ("cluster", 37)],
)
async def test_a_batch_cut_off_midway_goes_on_where_it_stopped(
    request: pytest.FixtureRequest, layout: str, part_b: int
) -> None:
    cluster = layout == "cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    a = CutOff(server.url, prefix=prefix, apply_part_blocks=100, cluster=cluster)
    b = RedisIndex(server.url, prefix=prefix, apply_part_blocks=part_b, cluster=cluster)
    ref = MemoryIndex()
    try:
        for idx in (a, b, ref):
            await idx.register(SPEC)
        h0, t0 = _chain(random.Random(3), 20)
        first = EventBatch(INST, 1, (BlockStored(h0, None, t0, BLOCK),))
        for idx in (b, ref):
            await idx.apply(first)
        batch = _batch(2)
        with pytest.raises(ConnectionError):
            await a.apply(batch)
        # Three parts of 100 blocks went in; the sequence is still the last batch's.
        assert await _held(b, batch) == [(300, 300), (0, 0)]
        state = next(s for s in await b.list_instances() if s.spec.instance == INST)
        assert state.applied_sequence == 1
        res = await b.apply(batch)
        assert res.outcome is BatchOutcome.APPLIED and res.applied_sequence == 2
        want = await ref.apply(batch)
        # Acknowledged with the whole batch's counts, the parts A applied included.
        assert res == want, (res, want)
        assert await _held(b, batch) == await _held(ref, batch)
        # The copies: the first five blocks of chain 1 were stored twice and
        # removed once, so one more removal drops them; a part applied twice
        # would have counted them three times, and they would stay.
        chain1 = batch.events[0]
        assert isinstance(chain1, BlockStored)
        again = EventBatch(INST, 3, (BlockRemoved(chain1.block_hashes[:5]),), counts_copies=True)
        for idx in (b, ref):
            await idx.apply(again)
        assert await _held(b, batch) == await _held(ref, batch) == [(0, 0), (380, 380)]
        a.parts = 100
        assert (await a.apply(batch)).outcome is BatchOutcome.DUPLICATE
    finally:
        await a.close()
        await b.close()


async def test_a_heartbeat_does_not_wait_for_the_queue_of_applies(redis_server: Any) -> None:
    """Applies take turns to write (``redis.max_writes_in_flight``), and one
    waiting longer than ``write_timeout_s`` for its turn fails. A lease renewal
    of an idle engine must not be one of them: behind sixteen engines' long
    batches it waited past the timeout, and an engine whose renewals fail
    while others ingest drops out of every Match when its lease runs out. It
    now waits for the script Redis is running at most."""
    idx = RedisIndex(
        redis_server.url,
        prefix=f"t{uuid.uuid4().hex[:8]}",
        apply_part_blocks=0,  # whole batches: the queue is long
        max_writes_in_flight=1,
        write_timeout_s=1.0,
    )
    rng = random.Random(2)
    busy = [InstanceId(f"b{i}", 0) for i in range(16)]
    try:
        for i in (INST, *busy):
            await idx.register(InstanceSpec(i, "m", f"http://{i.worker_id}", 3600.0, "x"))
        batches = []
        for i in busy:
            hashes, tokens = _chain(rng, 12_000)
            batches.append(EventBatch(i, 1, (BlockStored(hashes, None, tokens, BLOCK),)))
        tasks = [asyncio.ensure_future(idx.apply(b)) for b in batches]
        await asyncio.sleep(0.3)  # the applies are queued, one of them in Redis
        assert not all(t.done() for t in tasks)
        t0 = time.perf_counter()
        await idx.heartbeat(INST)
        waited = time.perf_counter() - t0
        done = sum(t.done() for t in tasks)
        # (Applies still waiting their turn after 1 s fail unsent: that is the bound.)
        await asyncio.gather(*tasks, return_exceptions=True)
        assert waited < 0.8, (waited, done)
    finally:
        await idx.close()


@pytest.mark.parametrize("layout", ["standalone", "cluster"])
async def test_an_event_whose_parent_is_unknown_is_orphaned_whole_across_parts(
    request: pytest.FixtureRequest, layout: str
) -> None:
    """Found by the fault harness: a store whose parent the instance does not
    hold is an orphan, every block of it, even where a later block's engine
    hash is one the instance holds (another chain stored it). Cut into parts,
    the piece after an orphaned piece names that block as its parent: it must
    be an orphan too, whichever replica sends it."""
    cluster = layout == "cluster"
    server = request.getfixturevalue("redis_cluster" if cluster else "redis_server")
    prefix = f"t{uuid.uuid4().hex[:8]}"
    rng = random.Random(8)
    ha, ta = _chain(rng, 3)
    hb, tb = _chain(rng, 3)
    # Chain B's first block is chain A's (same tokens, same engine hash).
    hb, tb = (ha[0], *hb[1:]), ta[:BLOCK] + tb[BLOCK:]
    batch = EventBatch(
        INST,
        1,
        (
            BlockStored(ha, None, ta, BLOCK),
            BlockStored(hb, 12345, tb, BLOCK),  # a parent nobody stored
        ),
    )
    ref = MemoryIndex()
    await ref.register(SPEC)
    want = await ref.apply(batch)
    assert (want.blocks_stored, want.blocks_orphaned) == (3, 3)
    for part in (2, 4):
        idx = RedisIndex(
            server.url, prefix=f"{prefix}{part}", apply_part_blocks=part, cluster=cluster
        )
        try:
            await idx.register(SPEC)
            got = await idx.apply(batch)
            assert (got.blocks_stored, got.blocks_orphaned) == (3, 3), (part, got)
            keys = block_keys(tb, BLOCK, "m")
            assert [m.depth for m in await idx.match(Namespace("m"), keys)] == [
                m.depth for m in await ref.match(Namespace("m"), keys)
            ]
        finally:
            await idx.close()
    # Cut off after the orphaned piece, and sent again by a replica that cuts otherwise.
    a = CutOff(server.url, prefix=f"{prefix}c", apply_part_blocks=4, cluster=cluster)
    b = RedisIndex(server.url, prefix=f"{prefix}c", apply_part_blocks=1, cluster=cluster)
    try:
        await a.register(SPEC)
        a.parts = 1  # 3 blocks of A and the first of B (an orphan), then cut off
        with pytest.raises(ConnectionError):
            await a.apply(batch)
        got = await b.apply(batch)
        assert (got.blocks_stored, got.blocks_orphaned) == (3, 3), got
        keys = block_keys(tb, BLOCK, "m")
        assert [m.depth for m in await b.match(Namespace("m"), keys)] == [1]
    finally:
        await a.close()
        await b.close()
