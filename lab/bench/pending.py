"""``kvmesh bench pending``: what a Match with route-time predictions costs, and
what answering the instances' pending prefill adds (``MatchResponse.pending``).

Per backend (memory, a standalone Redis, a 3-master Redis Cluster, each
started here), ``--instances`` instances register; the first holds a prompt
of ``--blocks`` blocks, the others its first block, and every other one has
50 blocks predicted. Then, one call at a time, in the index's own process
(no gRPC: the backend's cost alone), alternating mode by mode for
``--rounds`` rounds of ``--calls`` calls:

- ``plain``: ``match`` without predictions;
- ``predicted``: ``match(include_predicted=True)``;
- ``pending_each``: ``match_with_pending``, the pending prefill counted at
  every call (Redis: ``pending_reuse_s`` 0);
- ``pending``: ``match_with_pending`` as shipped (Redis reuses the count it
  read for ``PENDING_REUSE_S``).

Figures ``<backend>_<mode>_p50_us`` / ``_p99_us`` and the ratios
``ratio_<backend>_pending_each`` and ``ratio_<backend>_pending`` against
``predicted`` (the p50s). Every answer is checked: the holder's depth, and
the pending count of every predicting instance.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.report import fmt, table, write_report

BACKENDS = ("memory", "redis", "cluster")
MODES = ("plain", "predicted", "pending_each", "pending")
#: Blocks predicted for each predicting instance.
PREDICTED = 50


async def _fill(index: Any, instances: int, blocks: int) -> tuple[list[int], dict[Any, int]]:
    """Register and fill ``index``; the prompt's keys and the pending counts expected."""
    from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace

    ns = Namespace("m")
    keys = list(range(1_000, 1_000 + blocks))
    want: dict[Any, int] = {}
    for i in range(instances):
        iid = InstanceId(f"engine-{i:03d}")
        await index.register(InstanceSpec(iid, "m", f"http://e{i}", 3600.0, "a"))
        held = tuple(keys[: blocks if i == 0 else 1])
        await index.apply(EventBatch(iid, 1, (BlockStored(held, block_keys=held),)))
        if i % 2:
            base = 10_000_000 + i * 1_000
            await index.predict(ns, iid, range(base, base + PREDICTED), 3600.0, 65_536)
            want[iid] = PREDICTED
    return keys, want


async def _time(
    index: Any, keys: list[int], want: dict[Any, int], calls: int, rounds: int
) -> dict[str, list[float]]:
    from indexer.model import Namespace

    ns = Namespace("m")
    # Redis reuses the count it read (PENDING_REUSE_S); the memory backend counts each time.
    shipped = getattr(index, "pending_reuse_s", None)

    async def plain() -> None:
        hits = await index.match(ns, keys)
        assert hits[0].depth == len(keys), hits[:1]

    async def predicted() -> None:
        hits = await index.match(ns, keys, include_predicted=True)
        assert hits[0].depth == len(keys), hits[:1]

    async def with_pending() -> None:
        hits, pending = await index.match_with_pending(ns, keys)
        assert hits[0].depth == len(keys) and pending == want, (hits[:1], pending)

    async def pending_each() -> None:
        if shipped is None:
            return await with_pending()
        index.pending_reuse_s = 0.0
        try:
            await with_pending()
        finally:
            index.pending_reuse_s = shipped

    calls_of: dict[str, Callable[[], Awaitable[None]]] = {
        "plain": plain,
        "predicted": predicted,
        "pending_each": pending_each,
        "pending": with_pending,
    }
    lat: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(rounds):
        for mode in MODES:
            f = calls_of[mode]
            await f()  # warm
            for _ in range(calls):
                t0 = time.perf_counter()
                await f()
                lat[mode].append(time.perf_counter() - t0)
    return lat


async def _run(
    backend: str, url: str | None, instances: int, blocks: int, calls: int, rounds: int
) -> dict[str, list[float]]:
    from indexer.memory import MemoryIndex
    from indexer.redis.backend import RedisIndex

    index: Any
    if backend == "memory":
        index = MemoryIndex()
    else:
        assert url is not None
        index = RedisIndex(url, prefix="bp", cluster=backend == "cluster")
    try:
        keys, want = await _fill(index, instances, blocks)
        return await _time(index, keys, want, calls, rounds)
    finally:
        await index.close()


def _backend(backend: str, *args: int) -> dict[str, list[float]]:
    from lab.redisproc import RedisClusterProcess, RedisProcess

    if backend == "memory":
        return asyncio.run(_run(backend, None, *args))
    proc: Any = RedisClusterProcess() if backend == "cluster" else RedisProcess()
    with proc:
        return asyncio.run(_run(backend, proc.url, *args))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench pending``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench pending",
        description="What a Match with predictions costs, and what counting every instance's "
        "pending prefill adds, per backend (in process, one call at a time).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--backend", default=",".join(BACKENDS), help="memory, redis, cluster")
    p.add_argument("--instances", type=int, default=64, help="registered instances")
    p.add_argument("--blocks", type=int, default=32, help="blocks of the prompt Matched")
    p.add_argument("--calls", type=int, default=300, help="calls per mode and round")
    p.add_argument("--rounds", type=int, default=3, help="rounds, modes alternating")
    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    args = p.parse_args(argv)
    backends = [b.strip() for b in args.backend.split(",") if b.strip()]
    if not backends or set(backends) - set(BACKENDS):
        p.error(f"--backend takes some of {','.join(BACKENDS)}, not {args.backend!r}")
    if args.instances < 2 or args.blocks < 1 or args.calls < 1 or args.rounds < 1:
        p.error("--instances >= 2, --blocks, --calls and --rounds >= 1")
    figures: dict[str, float] = {}
    rows = []
    for b in backends:
        lat = _backend(b, args.instances, args.blocks, args.calls, args.rounds)
        cells = []
        for mode in MODES:
            for q, name in ((0.5, "p50"), (0.99, "p99")):
                figures[f"{b}_{mode}_{name}_us"] = percentile(lat[mode], q) * 1e6
            cells.append(
                f"{fmt(figures[f'{b}_{mode}_p50_us']):>8} {fmt(figures[f'{b}_{mode}_p99_us']):>8}"
            )
        base = figures[f"{b}_predicted_p50_us"]
        for mode in ("pending_each", "pending"):
            figures[f"ratio_{b}_{mode}"] = figures[f"{b}_{mode}_p50_us"] / base
        rows.append(
            f"{b:<8} {'  '.join(cells)}  {fmt(figures[f'ratio_{b}_pending_each']):>6} "
            f"{fmt(figures[f'ratio_{b}_pending']):>6}"
        )
    head = (
        f"{'backend':<8} {'plain p50':>8} {'p99':>8}  {'pred p50':>8} {'p99':>8}  "
        f"{'each p50':>8} {'p99':>8}  {'pend p50':>8} {'p99':>8}  {'each/':>6} {'pend/':>6}"
    )
    foot = [
        f"µs per call, in process; {args.instances} instances, a {args.blocks}-block prompt, "
        f"{args.rounds} x {args.calls} calls per mode; each: the pending prefill counted at "
        "every Match; pend: as shipped (Redis reuses it for 5 ms); ratios against pred (p50)"
    ]
    print(table(head, rows, foot))
    if args.json_path:
        params = {k: getattr(args, k) for k in ("instances", "blocks", "calls", "rounds")}
        write_report(args.json_path, figures, {**params, "backends": backends})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
