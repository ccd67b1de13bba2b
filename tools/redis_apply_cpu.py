"""The Redis backend's apply path alone: the replica's own CPU per block.

A fresh redis-server on a free port, 8 instances, 1,200 batches of 4 stores of
160 16-token blocks each (a store's parent, four times in five, a block stored
before: the parent cache and its misses are exercised), applied one after the
other with ``RedisIndex.apply``. Prints this process's CPU seconds (Redis's are
not counted), the wall time, blocks per CPU-second and round trips.

    .venv/bin/python tools/redis_apply_cpu.py [--batches N] [--seed S]
        [--blocks-per-store B] [--part-blocks P]

``--blocks-per-store 1500`` makes 6,000-block batches, which go in parts of
``--part-blocks`` (the backend's default; 0: whole): the cost of parts.

Run it against two checkouts alternately (``PYTHONPATH=<checkout>``) to compare
a change of the apply path; the wall time is mostly Redis's.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import redis

from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec
from indexer.redis.backend import RedisIndex
from lab.redisproc import RedisProcess

INSTANCES = 8
STORES_PER_BATCH = 4
BLOCKS_PER_STORE = 160
BLOCK = 16


async def run(batches: int, seed: int, per_store: int, part_blocks: int | None) -> None:
    rng = random.Random(seed)
    insts = [InstanceId(f"w{i}", 0) for i in range(INSTANCES)]
    known: dict[InstanceId, list[int]] = {i: [] for i in insts}
    seqs = dict.fromkeys(insts, 0)
    todo = []
    for b in range(batches):
        inst = insts[b % INSTANCES]
        evs = []
        for _ in range(STORES_PER_BATCH):
            hashes = tuple(rng.getrandbits(63) for _ in range(per_store))
            toks = tuple(rng.randrange(1, 30_000) for _ in range(BLOCK * per_store))
            parent = rng.choice(known[inst]) if known[inst] and rng.random() < 0.8 else None
            evs.append(BlockStored(hashes, parent, toks, BLOCK))
            known[inst].extend(hashes[::16])
        seqs[inst] += 1
        todo.append(EventBatch(inst, seqs[inst], tuple(evs)))
    with RedisProcess() as proc:
        part = {} if part_blocks is None else {"apply_part_blocks": part_blocks}
        idx = RedisIndex(proc.url, prefix="cpu", parent_cache_size=50_000, **part)
        try:
            for inst in insts:
                await idx.register(InstanceSpec(inst, "m", f"http://{inst.worker_id}", 3600.0, "x"))
            with redis.Redis.from_url(proc.url) as plain:
                r0 = _redis_cpu(plain)
                c0, w0 = time.process_time(), time.perf_counter()
                for batch in todo:
                    await idx.apply(batch)
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                rcpu = _redis_cpu(plain) - r0
        finally:
            await idx.close()
    blocks = batches * STORES_PER_BATCH * per_store
    print(
        f"{blocks:,} blocks: apply CPU {cpu:.2f} s, wall {wall:.2f} s, "
        f"{blocks / cpu:,.0f} blocks per CPU-second, {idx.round_trips:,} round trips, "
        f"{idx.apply_parts:,} parts; Redis CPU {rcpu:.2f} s, {rcpu / blocks * 1e6:.2f} µs a block"
    )


def _redis_cpu(client: redis.Redis) -> float:
    info = client.info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--batches", type=int, default=1200)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--blocks-per-store", type=int, default=BLOCKS_PER_STORE)
    p.add_argument("--part-blocks", type=int, default=None)
    a = p.parse_args()
    asyncio.run(run(a.batches, a.seed, a.blocks_per_store, a.part_blocks))


if __name__ == "__main__":
    main()
