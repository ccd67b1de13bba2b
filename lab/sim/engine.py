"""A simulated engine worker: an LRU KV cache that publishes real KV events, and a service model.

The cache is :class:`tee.cachesim.model.BlockCache` (the model the cache
simulator uses), of fixed capacity in blocks. Serving a request looks up its
prefix, inserts its blocks and publishes one event batch, exactly what an
engine adapter publishes: ``BlockRemoved`` for the evicted blocks, then
``BlockStored`` for the newly cached ones (engine hash = block key, with the
content keys precomputed), with consecutive per-instance sequence numbers.
Blocks are cached when the request is admitted, not when its prefill ends: a
replay compares routing, and counting at admission makes every policy see
the same stream order as the pooled bound.

Service model, in virtual seconds: at most ``max_running`` requests run at
once (the rest wait FIFO); prefills run one at a time, each taking
``uncached tokens / prefill_tokens_per_s``; then the request decodes for
``output tokens * decode_s_per_token``. TTFT = queueing + prefill wait +
prefill. Load reported to routers: running + queued requests, their input +
output tokens, and the uncached prefill tokens not yet computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, Tier
from router_client.load import WorkerLoad
from tee.cachesim.model import BlockCache

#: Publishes one event batch (the memory index's ``apply`` or a gRPC stream).
Publish = Callable[[EventBatch], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Time a simulated engine takes; defaults are a mid-size model on one GPU."""

    # ~10k prompt tokens/s of prefill: an 8B-class model on one H100-class GPU
    # with long prompts; at the trace's 3.4 req/s over 16 workers this keeps
    # prefill queues short but non-zero, so affinity shows in TTFT.
    prefill_tokens_per_s: float = 10_000.0
    # 30 ms per output token per request: a batched decode step.
    decode_s_per_token: float = 0.03
    # Concurrent requests per engine (its batch size).
    max_running: int = 32


@dataclass(slots=True)
class SimRequest:
    """A request inside a simulated engine."""

    id: int
    arrival: float
    keys: Sequence[int]
    input_tokens: int
    output_tokens: int
    hit_blocks: int = 0
    uncached_tokens: int = 0
    prefill_end: float = 0.0


@dataclass(slots=True)
class SimEngine:
    """One simulated worker (see the module docstring).

    ``schedule(at, callback)`` is the replay's event queue; ``on_load`` is
    told the engine's load after every change.
    """

    name: str
    capacity: int
    block_size: int
    publish: Publish
    schedule: Callable[[float, Callable[[float], None]], None]
    on_load: Callable[[str, WorkerLoad, float], None]
    on_finish: Callable[[SimRequest, float], None]
    model: ServiceModel = ServiceModel()
    cache: BlockCache = field(init=False)
    instance: InstanceId = field(init=False)
    sequence: int = 0
    running: int = 0
    waiting: deque[SimRequest] = field(default_factory=deque)
    tokens: int = 0
    pending_prefill: int = 0
    prefill_free_at: float = 0.0
    served: int = 0
    ttfts: list[float] = field(default_factory=list)
    # Integral of (running + waiting) over time, for the time-averaged load.
    load_area: float = 0.0
    _last_change: float = 0.0

    def __post_init__(self) -> None:
        self.cache = BlockCache(self.capacity)
        self.instance = InstanceId(self.name, 0)

    async def admit(self, req: SimRequest, now: float) -> int:
        """Take a request: cache lookup and insert, events published; returns hit blocks."""
        cache = self.cache
        keys = req.keys
        hits = cache.lookup_prefix(keys)
        limit = len(keys) if cache.capacity is None else min(len(keys), cache.capacity)
        new = [k for k in keys[hits:limit] if k not in cache]
        evicted = cache.insert(keys)
        req.hit_blocks = hits
        req.uncached_tokens = max(0, req.input_tokens - hits * self.block_size)
        if new or evicted:
            events: list[BlockStored | BlockRemoved] = []
            if evicted:
                events.append(BlockRemoved(tuple(evicted)))
            if new:
                first = keys.index(new[0])
                events.append(
                    BlockStored(
                        block_hashes=tuple(new),
                        parent_block_hash=keys[first - 1] if first > 0 else None,
                        block_size=self.block_size,
                        tier=Tier.GPU,
                        block_keys=tuple(new),
                    )
                )
            self.sequence += 1
            await self.publish(EventBatch(self.instance, self.sequence, tuple(events), now))
        self._account(now)
        self.tokens += req.input_tokens + req.output_tokens
        self.pending_prefill += req.uncached_tokens
        if self.running < self.model.max_running:
            self._start(req, now)
        else:
            self.waiting.append(req)
        self.on_load(self.name, self.load(), now)
        return hits

    def load(self) -> WorkerLoad:
        """The load this engine reports."""
        return WorkerLoad(self.running + len(self.waiting), self.tokens, self.pending_prefill)

    def _account(self, now: float) -> None:
        self.load_area += (self.running + len(self.waiting)) * (now - self._last_change)
        self._last_change = now

    def _start(self, req: SimRequest, now: float) -> None:
        self.running += 1
        start = max(now, self.prefill_free_at)
        end = start + req.uncached_tokens / self.model.prefill_tokens_per_s
        self.prefill_free_at = end
        req.prefill_end = end
        self.ttfts.append(end - req.arrival)
        self.schedule(end, lambda t: self._prefilled(req, t))
        finish = end + req.output_tokens * self.model.decode_s_per_token
        self.schedule(finish, lambda t: self._finished(req, t))

    def _prefilled(self, req: SimRequest, now: float) -> None:
        self.pending_prefill -= req.uncached_tokens
        self.on_load(self.name, self.load(), now)

    def _finished(self, req: SimRequest, now: float) -> None:
        self._account(now)
        self.running -= 1
        self.served += 1
        self.tokens -= req.input_tokens + req.output_tokens
        if self.waiting:
            self._start(self.waiting.popleft(), now)
        self.on_load(self.name, self.load(), now)
        self.on_finish(req, now)
