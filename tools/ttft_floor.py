"""How low can a router take TTFT p95 on the routing grid's traces?

The floor of a cell: every request's prefill with no queue ahead of it, its hit
the pooled-LRU bound's (one cache holding every engine's blocks, the best any
routing reaches at that capacity), at the service model's prefill rate. Target
(a) of the grid asks for TTFT p95 at most 0.6 times P2C's; this prints, per cell
at load >= 0.7 of a ``kvmesh replay --grid --json`` file, the floor and the
subject's p95 as fractions of P2C's, the cells with the least room first.

    .venv/bin/python tools/ttft_floor.py grid.json [--subject cache_shared] [--top 10]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from lab.sim.grid import TARGET_A_LOAD, grid_trace
from lab.sim.replay import trace_keys
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest
from tee.cachesim.model import pooled_cache


def floor_p95_ms(
    trace: Sequence[TraceRequest], workers: int, capacity: int, tokens_per_s: float
) -> float:
    """TTFT p95 with no queue anywhere and the pooled bound's hits, in ms."""
    cache = pooled_cache([capacity] * workers)
    times = []
    for req, keys in zip(trace, trace_keys(trace), strict=True):
        hit = min(cache.lookup_prefix(keys), (req.input_length - 1) // MOONCAKE_BLOCK_SIZE)
        uncached = max(0, req.input_length - hit * MOONCAKE_BLOCK_SIZE)
        times.append(1000.0 * uncached / tokens_per_s)
        cache.insert(keys)
    times.sort()
    return times[int(0.95 * len(times))]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("grid_json")
    ap.add_argument("--subject", default="cache_shared")
    ap.add_argument("--top", type=int, default=10)
    a = ap.parse_args(argv)
    data = json.loads(Path(a.grid_json).read_text())
    figures, params = data["figures"], data["params"]
    workers = int(params["workers"])
    rate = float(params["service"]["prefill_tokens_per_s"])
    requests = params["requests"]
    rows = []
    for family in params["grid_families"]:
        trace = grid_trace(family, int(requests[family]))
        for capacity in params["grid_capacities"]:
            floor = floor_p95_ms(trace, workers, int(capacity), rate)
            for routers in params["grid_routers"]:
                for load in params["grid_loads"]:
                    if load < TARGET_A_LOAD:
                        continue
                    cell = f"{family}_R{routers}_C{capacity}_L{load}_"
                    p2c = figures[cell + "p2c_ttft_p95_ms"]
                    mine = figures[cell + f"{a.subject}_ttft_p95_ms"]
                    met = figures.get(cell + f"{a.subject}_target_a")
                    rows.append((floor / p2c, mine / p2c, family, routers, capacity, load, met))
    rows.sort(reverse=True)
    head = f"{a.subject}/P2C"
    w = max(18, len(head) + 2)
    print(f"{'family':<14}{'R':>3}{'cap':>6}{'load':>6}{'floor/P2C':>11}{head:>{w}}  (a)")
    for floor, mine, family, routers, capacity, load, met in rows[: a.top]:
        verdict = "pass" if met else "FAIL"
        print(
            f"{family:<14}{routers:>3}{capacity:>6}{load:>6}{floor:>11.3f}{mine:>{w}.3f}  {verdict}"
        )
    gaps = [mine - floor for floor, mine, *_ in rows]
    print(
        f"{len(rows)} cells: {a.subject} above the floor by {min(gaps):.3f}-{max(gaps):.3f} "
        f"of P2C's p95 (the target: at most 0.6)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
