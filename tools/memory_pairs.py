"""The memory backend alone, in process: bytes per (block, instance), apply and Match speed.

The conversation trace spread over ``--instances`` engines as ``kvmesh bench
peer`` spreads it (:func:`lab.bench.peer.build_stream`: each request stores the
blocks its instance lacks, one event per request, ``--requests-per-batch``
events a batch), each 512-token trace id expanded into 512 / ``--block-size``
blocks with the bench's tokens and engine hashes. Every batch is built before
the clock; then:

- **apply**: ``MemoryIndex.apply`` of every batch, instances interleaved
  (keys chained from the token ids by the index, as on the engine path, but
  no decoding): blocks per second of wall and of this process's CPU;
- **memory**: the process's RSS growth over the apply (after a full
  collection), per (block, instance): what an operator pays;
- **Match**: ``match_sync`` over ``--queries`` prompts of ``--prompt-ids`` trace
  ids (keys computed before the clock), sequentially, p50 and p99; every
  answer is checked against what the stream stored (:func:`lab.bench.peer.expected_answer`);
- **remove**: every block removed again by its engine hashes, a stored
  event's at a time: blocks per second.

Each run is a fork of the process that built the workload, so every run
starts from the same heap.

    .venv/bin/python tools/memory_pairs.py [--requests N] [--block-size 16]
        [--instances 64] [--requests-per-batch 8] [--queries 200] [--prompt-ids 32]
        [--runs 3] [--baseline OTHER/indexer/memory.py] [--json F]

``--baseline`` loads another checkout's ``indexer/memory.py`` (the rest of the
index from this one) and runs it alternately with this one's: a change of the
memory backend against the code before, under the same noise; medians and
their ratio. No sockets, no other process.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.util
import json
import os
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any

from indexer.memory import MemoryIndex
from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from kvmesh.blockkeys import block_keys
from lab.bench.peer import build_stream, expected_answer, sample_prompts
from lab.engines.vllm_publishers import TRACE_BLOCK_TOKENS, engine_hashes, trace_tokens
from lab.traces import load_mooncake

MODEL = "m"


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _event(ids: list[int], parent: int | None, block_size: int) -> BlockStored:
    sub = TRACE_BLOCK_TOKENS // block_size
    return BlockStored(
        block_hashes=tuple(engine_hashes(ids, sub)),
        parent_block_hash=engine_hashes([parent], sub)[-1] if parent is not None else None,
        token_ids=tuple(trace_tokens(ids).reshape(-1).tolist()),
        block_size=block_size,
    )


def _load_backend(path: str | None) -> type[MemoryIndex]:
    """``MemoryIndex`` of this checkout, or of the ``indexer/memory.py`` at ``path``."""
    if path is None:
        return MemoryIndex
    spec = importlib.util.spec_from_file_location("baseline_memory", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    cls: type[MemoryIndex] = module.MemoryIndex
    return cls


@dataclass
class Workload:
    order: list[EventBatch]
    iids: list[InstanceId]
    queries: list[list[int]]
    want: list[dict[int, int]]
    pairs: int


def build(args: argparse.Namespace) -> Workload:
    trace = load_mooncake(limit=args.requests)
    stream = build_stream(trace, args.instances, args.requests_per_batch, args.block_size)
    sub = TRACE_BLOCK_TOKENS // args.block_size
    iids = [InstanceId(f"e{i}", 0) for i in range(args.instances)]
    # Instances interleaved, a batch each in turn, as the bench's publishers send them.
    order: list[EventBatch] = []
    longest = max(len(b) for b in stream.batches)
    for j in range(longest):
        for i, batches in enumerate(stream.batches):
            if j < len(batches):
                evs = tuple(_event(list(ids), p, args.block_size) for ids, p in batches[j])
                order.append(EventBatch(iids[i], j, evs))
    prompts = sample_prompts(trace, args.prompt_ids, args.queries)
    queries = [
        block_keys(trace_tokens(p).reshape(-1).tolist(), args.block_size, MODEL) for p in prompts
    ]
    want = [expected_answer(stream.held, p, sub) for p in prompts]
    return Workload(order, iids, queries, want, stream.pairs)


async def measure(cls: type[MemoryIndex], w: Workload, rounds: int) -> dict[str, float]:
    index = cls()
    for iid in w.iids:
        await index.register(InstanceSpec(iid, MODEL, f"http://{iid.worker_id}:1", 3600.0, "x"))
    gc.collect()
    rss0, cpu0, t0 = _rss(), _cpu(), time.perf_counter()
    for batch in w.order:
        await index.apply(batch)
    wall, cpu = time.perf_counter() - t0, _cpu() - cpu0
    gc.collect()
    grown = _rss() - rss0
    pairs = (await index.stats()).block_instances
    assert pairs == w.pairs, (pairs, w.pairs)
    ns = Namespace(MODEL)
    times: list[float] = []
    wrong = 0
    by_name = {iid.worker_id: i for i, iid in enumerate(w.iids)}
    for _ in range(rounds):
        for keys, want in zip(w.queries, w.want, strict=True):
            t = time.perf_counter()
            got = index.match_sync(ns, keys)
            times.append(time.perf_counter() - t)
            wrong += {by_name[m.instance.worker_id]: m.depth for m in got} != want
    times.sort()
    # Every block removed again, by the engines' own hashes, a stored event's at a time.
    removals = [
        EventBatch(
            b.instance,
            b.sequence + len(w.order),
            tuple(BlockRemoved(e.block_hashes) for e in b.events if isinstance(e, BlockStored)),
        )
        for b in w.order
    ]
    t0 = time.perf_counter()
    for batch in removals:
        await index.apply(batch)
    removed_s = time.perf_counter() - t0
    left = (await index.stats()).block_instances
    assert left == 0, left
    del index
    gc.collect()
    return {
        "remove_blocks_per_s": pairs / removed_s,
        "apply_blocks_per_s": pairs / wall,
        "apply_blocks_per_cpu_s": pairs / cpu,
        "rss_growth_bytes_per_pair": grown / pairs,
        "match_p50_us": statistics.median(times) * 1e6,
        "match_p99_us": times[int(0.99 * (len(times) - 1))] * 1e6,
        "wrong_answers": wrong,
    }


def _in_child(cls: type[MemoryIndex], w: Workload, rounds: int) -> dict[str, float]:
    """:func:`measure` in a forked child: each run starts from the same heap (RSS
    growth in one process would reuse what an earlier run freed)."""
    r, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(r)
        try:
            data = json.dumps(asyncio.run(measure(cls, w, rounds))).encode()
            with os.fdopen(wfd, "wb") as f:
                f.write(data)
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    if not data:
        raise SystemExit("a measuring child failed (its error is above)")
    out: dict[str, float] = json.loads(data)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--requests", type=int, default=1500)
    p.add_argument("--block-size", type=int, default=16, choices=(16, 32, 64, 128, 256, 512))
    p.add_argument("--instances", type=int, default=64)
    p.add_argument("--requests-per-batch", type=int, default=8)
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--prompt-ids", type=int, default=32)
    p.add_argument("--match-rounds", type=int, default=3, help="passes over the queries")
    p.add_argument(
        "--baseline",
        metavar="MEMORY_PY",
        help="another checkout's indexer/memory.py, run alternately with this one",
    )
    p.add_argument("--runs", type=int, default=3, help="runs of each side (alternating)")
    p.add_argument("--json", help="also write the figures here")
    args = p.parse_args()
    w = build(args)
    sides = {"this": _load_backend(None)}
    if args.baseline:
        sides["baseline"] = _load_backend(args.baseline)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in sides}
    for _ in range(args.runs):
        for name, cls in sides.items():
            runs[name].append(_in_child(cls, w, args.match_rounds))
    print(f"{w.pairs:,} (block, instance) pairs at {args.block_size}-token blocks; median of")
    print(f"{args.runs} runs each" + (", alternating" if args.baseline else ""))
    names = list(sides)
    print(
        f"{'figure':28}"
        + "".join(f"{n:>14}" for n in names)
        + ("   this/base" if args.baseline else "")
    )
    out: dict[str, Any] = {"pairs": w.pairs, "runs": runs}
    for fig in runs["this"][0]:
        meds = {n: statistics.median(r[fig] for r in runs[n]) for n in names}
        line = f"{fig:28}" + "".join(f"{meds[n]:>14,.1f}" for n in names)
        if args.baseline and meds["baseline"]:
            line += f"{meds['this'] / meds['baseline']:>12.3f}"
        print(line)
        out[fig] = meds
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
