"""Cache simulator logic (no transport): routed-request events into per-model block caches.

Each model gets a :class:`tee.cachesim.model.FleetCache` (the same cache model
the offline replays use): a cache per worker named by the events, a pooled
cache with every worker's capacity (the global oracle) and an infinite cache.
An INGEST event looks up its prompt's blocks (counting hits) then caches
them; an EXTEND event caches prompt + output blocks without counting, as an
engine keeps the KV of what it generated. Block keys follow
docs/spec/block-keys.md, so a partial trailing block is not cached.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from kvmesh.blockkeys import TokenIdError, block_keys
from tee.cachesim.model import EvictionPolicy, FleetCache
from tee.errors import InvalidEvent, UnknownModel
from tee.events import EventKind, RoutedEvent


@dataclass(frozen=True, slots=True)
class SimSettings:
    """Cache geometry of the simulator (see tee/config.py for the documented defaults)."""

    block_size: int = 16
    worker_capacity_blocks: int | None = 16384
    pooled_capacity_blocks: int | None = None
    eviction: EvictionPolicy = EvictionPolicy.LRU
    window_s: float = 60.0


class CacheSimulator:
    """Per-model fleet caches fed by events; not thread-safe (one event loop owns it)."""

    def __init__(self, settings: SimSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.models: dict[str, FleetCache] = {}
        self.events = {EventKind.INGEST: 0, EventKind.EXTEND: 0}

    def _fleet(self, model: str) -> FleetCache:
        fleet = self.models.get(model)
        if fleet is None:
            s = self.settings
            fleet = self.models[model] = FleetCache(
                s.worker_capacity_blocks,
                s.eviction,
                pooled_capacity=s.pooled_capacity_blocks,
                window_s=s.window_s,
            )
        return fleet

    def apply(self, event: RoutedEvent) -> int:
        """Apply one validated event; return its block count."""
        try:
            keys = block_keys(event.input_ids, self.settings.block_size, event.model)
        except TokenIdError as e:
            raise InvalidEvent(str(e), field="input_ids") from e
        fleet = self._fleet(event.model)
        worker = event.worker or None
        if event.kind is EventKind.INGEST:
            fleet.access(keys, worker, self.clock())
        else:
            fleet.insert(keys, worker)
        self.events[event.kind] += 1
        return len(keys)

    def report(self, model: str = "") -> dict[str, dict[str, object]]:
        """Report per model (one model, or all when ``model`` is empty)."""
        now = self.clock()
        if model:
            fleet = self.models.get(model)
            if fleet is None:
                raise UnknownModel(f"no events seen for model {model!r}", field="model")
            return {model: fleet.report(now)}
        return {name: fleet.report(now) for name, fleet in sorted(self.models.items())}
