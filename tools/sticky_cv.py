"""How even can request counts be when every conversation stays on one engine?

For each family of the replay's grid (the bundled conversation trace and
lab.synth's families, 2,000 requests each), the coefficient of variation of
per-engine request counts under three assignments, none of which looks at
time or cache:

- ``hindsight``: whole conversations, largest first, each onto the engine with
  the fewest requests (knowing every conversation's length);
- ``sticky``: online, a conversation's first turn to the engine with the fewest
  requests so far, every later turn to that engine;
- ``p2c``: each request to the fewer-loaded of two engines drawn at random,
  counting requests (the replay's P2C counts load in flight instead).

    .venv/bin/python tools/sticky_cv.py [--engines 16] [--requests 2000]

Target (b) of the routing grid asks for request CV at most 1.2 times P2C's
together with hits near the pooled bound; this says whether keeping
conversations whole forbids the first half by itself.
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from collections import Counter
from collections.abc import Sequence

from lab.sim.grid import grid_families, grid_trace
from lab.synth import measure


def cv(counts: Sequence[int]) -> float:
    """Population CV of ``counts``."""
    return statistics.pstdev(counts) / statistics.mean(counts)


def hindsight(sizes: Sequence[int], engines: int) -> list[int]:
    """Whole conversations, largest first, onto the least-loaded engine."""
    bins = [0] * engines
    heap = [(0, i) for i in range(engines)]
    for size in sorted(sizes, reverse=True):
        load, i = heapq.heappop(heap)
        bins[i] += size
        heapq.heappush(heap, (load + size, i))
    return bins


def sticky(conversation_of: Sequence[int], engines: int) -> list[int]:
    """Online: a new conversation to the engine with the fewest requests so far."""
    counts = [0] * engines
    where: dict[int, int] = {}
    for c in conversation_of:
        if c not in where:
            where[c] = min(range(engines), key=counts.__getitem__)
        counts[where[c]] += 1
    return counts


def p2c(n: int, engines: int, seed: int = 1) -> list[int]:
    """Each request to the fewer-counted of two random engines."""
    rng = random.Random(seed)
    counts = [0] * engines
    for _ in range(n):
        a, b = rng.sample(range(engines), 2)
        counts[a if counts[a] <= counts[b] else b] += 1
    return counts


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=16)
    ap.add_argument("--requests", type=int, default=2000)
    a = ap.parse_args(argv)
    print(f"{'family':<14}{'requests':>9}{'convs':>7}{'longest':>8}"
          f"{'hindsight':>10}{'sticky':>8}{'p2c':>8}")  # fmt: skip
    for name in grid_families():
        conv = measure(grid_trace(name, a.requests)).conversation_of
        sizes = list(Counter(conv).values())
        print(
            f"{name:<14}{len(conv):>9}{len(sizes):>7}{max(sizes):>8}"
            f"{cv(hindsight(sizes, a.engines)):>10.4f}{cv(sticky(conv, a.engines)):>8.4f}"
            f"{cv(p2c(len(conv), a.engines)):>8.4f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
