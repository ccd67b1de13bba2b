"""Block-cache model shared by the cache simulator (``tee/``) and offline replays (``lab/sim/``).

The model is deliberately small and pure Python: a worker's KV cache is a set of
block keys of fixed capacity (counted in blocks) with a pluggable eviction
policy, and a request hits the longest cached *prefix* of its block keys, the
way engines with prefix caching (vLLM, SGLang) reuse KV.

Public API (kept stable; both the live simulator and the replay harness use it):

- :class:`BlockCache` -- one cache: :meth:`~BlockCache.lookup_prefix`,
  :meth:`~BlockCache.insert`, :meth:`~BlockCache.access`.
- :func:`infinite_cache` / :func:`pooled_cache` -- the two bounds a routed fleet
  is compared against.
- :class:`HitStats` -- hit-rate accounting over block counts.
- :func:`worker_cv` -- coefficient of variation of per-worker load.
- :class:`SlidingWindow` -- time-bucketed :class:`HitStats` per label.
- :class:`FleetCache` -- per-worker caches plus the pooled and infinite bounds
  over the same stream, with totals and sliding windows.

None of these classes is thread-safe; each is meant to be owned by one task or
one thread. Time is always passed in (``now``, seconds, any monotonic origin)
so that replays can use trace time and tests stay deterministic.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

__all__ = [
    "AccessResult",
    "BlockCache",
    "EvictionPolicy",
    "FleetAccess",
    "FleetCache",
    "HitStats",
    "SlidingWindow",
    "infinite_cache",
    "pooled_cache",
    "worker_cv",
]


class EvictionPolicy(StrEnum):
    """Which block a full cache gives up.

    ``LRU``: the least recently used block; :meth:`BlockCache.insert` refreshes
    blocks already present. ``FIFO``: the block inserted longest ago; a block
    already present keeps its place.
    """

    LRU = "lru"
    FIFO = "fifo"


@dataclass(frozen=True, slots=True)
class AccessResult:
    """What one :meth:`BlockCache.access` did: prefix hits and evicted keys."""

    hits: int
    evicted: list[int]


class BlockCache:
    """A per-worker block cache of fixed capacity, counted in blocks.

    ``capacity=None`` is an unbounded cache (it never evicts). ``capacity=0``
    caches nothing.

    Semantics:

    - :meth:`lookup_prefix` is read-only: it returns how many leading keys are
      cached and changes no recency.
    - :meth:`insert` makes all of a request's keys resident and returns the keys
      it evicted to make room (never keys of the same call). It touches keys
      from the *last to the first*, so among one request's blocks the deepest
      is the least recent: eviction takes a prompt's tail before its prefix, as
      a radix-tree cache evicts leaves before their parents. Under LRU a key
      already present is refreshed; under FIFO it keeps its place. When a
      request has more keys than the capacity, only its first ``capacity`` keys
      are inserted (a cache cannot hold a prefix longer than itself).
    - :meth:`access` is ``lookup_prefix`` then ``insert``: what an engine does
      with one request.

    A key evicted from the middle of a cached prefix makes the keys after it
    unreachable to :meth:`lookup_prefix` until they are inserted again; they
    still occupy capacity until evicted, as in an engine whose cache is not a
    tree.
    """

    __slots__ = ("_blocks", "_capacity", "_lru", "policy")

    def __init__(
        self, capacity: int | None, policy: EvictionPolicy | str = EvictionPolicy.LRU
    ) -> None:
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
        self._capacity = capacity
        self.policy = EvictionPolicy(policy)
        self._lru = self.policy is EvictionPolicy.LRU
        # Insertion order of an OrderedDict is the eviction order: first = next
        # victim. move_to_end/popitem(last=False) are O(1) in C.
        self._blocks: OrderedDict[int, None] = OrderedDict()

    @property
    def capacity(self) -> int | None:
        """Capacity in blocks; ``None`` means unbounded."""
        return self._capacity

    def set_capacity(self, capacity: int | None) -> list[int]:
        """Change the capacity, evicting (in policy order) if it shrank; returns evicted keys."""
        if capacity is not None and capacity < 0:
            raise ValueError(f"capacity must be >= 0 or None, got {capacity}")
        self._capacity = capacity
        evicted: list[int] = []
        if capacity is not None:
            blocks = self._blocks
            while len(blocks) > capacity:
                evicted.append(blocks.popitem(last=False)[0])
        return evicted

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, key: object) -> bool:
        return key in self._blocks

    def keys(self) -> list[int]:
        """Resident keys in eviction order (next victim first)."""
        return list(self._blocks)

    def clear(self) -> None:
        """Drop every block (no eviction is reported)."""
        self._blocks.clear()

    def lookup_prefix(self, keys: Sequence[int]) -> int:
        """Number of leading ``keys`` that are resident (the prefix hit, in blocks)."""
        blocks = self._blocks
        n = 0
        for key in keys:
            if key not in blocks:
                break
            n += 1
        return n

    def insert(self, keys: Sequence[int]) -> list[int]:
        """Make ``keys`` resident (see the class docstring); returns the evicted keys."""
        capacity = self._capacity
        if capacity is not None and len(keys) > capacity:
            keys = keys[:capacity]
        blocks = self._blocks
        lru = self._lru
        evicted: list[int] = []
        for key in reversed(keys):
            if key in blocks:
                if lru:
                    blocks.move_to_end(key)
                continue
            if capacity is not None and len(blocks) >= capacity:
                evicted.append(blocks.popitem(last=False)[0])
            blocks[key] = None
        return evicted

    def access(self, keys: Sequence[int]) -> AccessResult:
        """Serve one request: prefix hits, then insert; see the class docstring."""
        hits = self.lookup_prefix(keys)
        return AccessResult(hits, self.insert(keys))


def infinite_cache() -> BlockCache:
    """An unbounded cache: the hit rate no capacity or routing could beat on a stream."""
    return BlockCache(None)


def pooled_cache(
    capacities: Iterable[int], policy: EvictionPolicy | str = EvictionPolicy.LRU
) -> BlockCache:
    """One cache holding every worker's capacity: what a perfect router could reach."""
    return BlockCache(sum(capacities), policy)


@dataclass(slots=True)
class HitStats:
    """Hit-rate accounting over block counts: hit rate = hit blocks / blocks."""

    requests: int = 0
    blocks: int = 0
    hit_blocks: int = 0

    def add(self, blocks: int, hit_blocks: int, requests: int = 1) -> None:
        """Count ``requests`` requests totalling ``blocks`` blocks of which ``hit_blocks`` hit."""
        self.requests += requests
        self.blocks += blocks
        self.hit_blocks += hit_blocks

    def merge(self, other: HitStats) -> None:
        """Add another accumulator into this one."""
        self.add(other.blocks, other.hit_blocks, other.requests)

    @property
    def hit_rate(self) -> float:
        """Hit blocks / blocks; 0.0 when no blocks were seen."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0

    def as_dict(self) -> dict[str, float]:
        """A JSON-friendly view."""
        return {
            "requests": self.requests,
            "blocks": self.blocks,
            "hit_blocks": self.hit_blocks,
            "hit_rate": self.hit_rate,
        }


def worker_cv(loads: Iterable[float]) -> float:
    """Coefficient of variation of per-worker load: population std / mean.

    0.0 for no workers or a zero mean (no load is perfectly balanced).
    """
    values = list(loads)
    if not values:
        return 0.0
    mean = math.fsum(values) / len(values)
    if mean == 0:
        return 0.0
    var = math.fsum((v - mean) ** 2 for v in values) / len(values)
    return math.sqrt(var) / mean


class SlidingWindow:
    """:class:`HitStats` per label over the last ``window_s`` seconds.

    Time is cut into ``buckets`` equal buckets; :meth:`totals` sums the buckets
    overlapping ``(now - window_s, now]``, so a window is exact to one bucket
    width. ``now`` must not go backwards by more than a bucket (late samples
    land in the newest bucket).
    """

    __slots__ = ("_buckets", "_width", "window_s")

    def __init__(self, window_s: float, buckets: int = 12) -> None:
        if window_s <= 0 or buckets <= 0:
            raise ValueError("window_s and buckets must be positive")
        self.window_s = window_s
        self._width = window_s / buckets
        # (bucket index, stats per label), oldest first.
        self._buckets: deque[tuple[int, dict[str, HitStats]]] = deque()

    def _expire(self, now: float) -> int:
        idx = math.floor(now / self._width)
        horizon = idx - round(self.window_s / self._width)
        buckets = self._buckets
        while buckets and buckets[0][0] <= horizon:
            buckets.popleft()
        return idx

    def add(self, now: float, label: str, blocks: int, hit_blocks: int, requests: int = 1) -> None:
        """Count one sample for ``label`` at time ``now``."""
        idx = self._expire(now)
        buckets = self._buckets
        if not buckets or buckets[-1][0] < idx:
            buckets.append((idx, {}))
        per_label = buckets[-1][1]
        stats = per_label.get(label)
        if stats is None:
            stats = per_label[label] = HitStats()
        stats.add(blocks, hit_blocks, requests)

    def totals(self, now: float) -> dict[str, HitStats]:
        """Stats per label over the window ending at ``now``."""
        self._expire(now)
        out: dict[str, HitStats] = {}
        for _, per_label in self._buckets:
            for label, stats in per_label.items():
                acc = out.get(label)
                if acc is None:
                    acc = out[label] = HitStats()
                acc.merge(stats)
        return out


@dataclass(frozen=True, slots=True)
class FleetAccess:
    """Hits of one request on its worker (``None`` when unrouted) and on both bounds.

    ``available_hits``: the longest prefix any worker's cache held when the
    request arrived (``None`` when unrouted): what the best decision would have hit.
    """

    worker_hits: int | None
    pooled_hits: int
    infinite_hits: int
    available_hits: int | None = None


#: Labels :class:`FleetCache` uses in its bounds window.
ROUTED, POOLED, INFINITE = "routed", "pooled", "infinite"
#: Labels of the decision accounting in the bounds window (OPTIMAL counts requests only).
AVAILABLE, OPTIMAL = "available", "optimal"


@dataclass(slots=True)
class FleetCache:
    """Per-worker caches of one model plus the pooled and infinite bounds on the same stream.

    Every request is replayed into the pooled cache (one cache with
    ``worker_capacity`` blocks per known worker, or ``pooled_capacity`` when
    given: the "global oracle") and the infinite cache; a request that names its
    worker is also replayed into that worker's cache (created on first sight,
    which grows the pooled capacity unless it is fixed). Worker CV is over
    requests per worker.

    **Decision accounting.** For a routed request, the *available* hit is the
    longest prefix any worker's cache holds before the request's own worker
    takes it in: the hit the best decision would have had. A decision is
    optimal when its worker's hit equals it. Available is at most the pooled
    bound's hit only on average: a fleet of small caches can hold a prefix the
    pooled LRU already evicted, so per request either can be larger.
    """

    worker_capacity: int | None
    policy: EvictionPolicy = EvictionPolicy.LRU
    pooled_capacity: int | None = None
    window_s: float = 60.0
    workers: dict[str, BlockCache] = field(default_factory=dict)
    pooled: BlockCache = field(init=False)
    infinite: BlockCache = field(default_factory=infinite_cache)
    routed_stats: HitStats = field(default_factory=HitStats)
    pooled_stats: HitStats = field(default_factory=HitStats)
    infinite_stats: HitStats = field(default_factory=HitStats)
    worker_stats: dict[str, HitStats] = field(default_factory=dict)
    available_stats: HitStats = field(default_factory=HitStats)
    optimal_decisions: int = 0
    worker_window: SlidingWindow = field(init=False)
    bounds_window: SlidingWindow = field(init=False)

    def __post_init__(self) -> None:
        self.policy = EvictionPolicy(self.policy)
        cap = self.pooled_capacity
        if cap is None and self.worker_capacity is not None:
            cap = 0  # grows by worker_capacity as workers appear
        self.pooled = BlockCache(cap, self.policy)
        self.worker_window = SlidingWindow(self.window_s)
        self.bounds_window = SlidingWindow(self.window_s)

    def worker(self, name: str) -> BlockCache:
        """The cache of worker ``name``, created (and the pool grown) on first use."""
        cache = self.workers.get(name)
        if cache is None:
            cache = self.workers[name] = BlockCache(self.worker_capacity, self.policy)
            self.worker_stats[name] = HitStats()
            if self.pooled_capacity is None and self.worker_capacity is not None:
                self.pooled.set_capacity(self.worker_capacity * len(self.workers))
        return cache

    def access(self, keys: Sequence[int], worker: str | None, now: float) -> FleetAccess:
        """Replay one request (its block keys, the worker it was routed to) at time ``now``."""
        n = len(keys)
        worker_hits: int | None = None
        available: int | None = None
        if worker is not None:
            cache = self.worker(worker)
            available = max(c.lookup_prefix(keys) for c in self.workers.values())
            worker_hits = cache.access(keys).hits
            self.worker_stats[worker].add(n, worker_hits)
            self.routed_stats.add(n, worker_hits)
            self.available_stats.add(n, available)
            self.optimal_decisions += worker_hits == available
            self.worker_window.add(now, worker, n, worker_hits)
            self.bounds_window.add(now, ROUTED, n, worker_hits)
            self.bounds_window.add(now, AVAILABLE, n, available)
            if worker_hits == available:
                self.bounds_window.add(now, OPTIMAL, 0, 0)
        pooled_hits = self.pooled.access(keys).hits
        infinite_hits = self.infinite.access(keys).hits
        self.pooled_stats.add(n, pooled_hits)
        self.infinite_stats.add(n, infinite_hits)
        self.bounds_window.add(now, POOLED, n, pooled_hits)
        self.bounds_window.add(now, INFINITE, n, infinite_hits)
        return FleetAccess(worker_hits, pooled_hits, infinite_hits, available)

    def insert(self, keys: Sequence[int], worker: str | None) -> None:
        """Cache ``keys`` without counting hits (e.g. prompt + output after a response)."""
        if worker is not None:
            self.worker(worker).insert(keys)
        self.pooled.insert(keys)
        self.infinite.insert(keys)

    def worker_cv(self) -> float:
        """Worker CV of requests per worker since the start."""
        return worker_cv(s.requests for s in self.worker_stats.values())

    def report(self, now: float) -> dict[str, object]:
        """Totals and the sliding window ending at ``now``, as a JSON-friendly dict."""
        window = self.bounds_window.totals(now)
        per_worker_window = self.worker_window.totals(now)
        return {
            "workers": len(self.workers),
            "worker_capacity": self.worker_capacity,
            "pooled_capacity": self.pooled.capacity,
            "policy": str(self.policy),
            "total": _bounds_dict(
                self.routed_stats,
                self.pooled_stats,
                self.infinite_stats,
                self.worker_stats,
                self.available_stats,
                self.optimal_decisions,
            ),
            "window": {
                "seconds": self.window_s,
                **_bounds_dict(
                    window.get(ROUTED, HitStats()),
                    window.get(POOLED, HitStats()),
                    window.get(INFINITE, HitStats()),
                    {w: per_worker_window.get(w, HitStats()) for w in self.workers},
                    window.get(AVAILABLE, HitStats()),
                    window.get(OPTIMAL, HitStats()).requests,
                ),
            },
        }


def _bounds_dict(
    routed: HitStats,
    pooled: HitStats,
    infinite: HitStats,
    workers: Mapping[str, HitStats],
    available: HitStats,
    optimal: int,
) -> dict[str, object]:
    return {
        "requests": pooled.requests,
        "blocks": pooled.blocks,
        "routed": routed.as_dict(),
        "pooled_bound": pooled.as_dict(),
        "infinite_bound": infinite.as_dict(),
        "worker_cv": worker_cv(s.requests for s in workers.values()),
        "per_worker": {w: s.as_dict() for w, s in sorted(workers.items())},
        "available": available.as_dict(),
        "optimal_decisions": optimal,
    }
