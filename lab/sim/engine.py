"""A simulated engine worker: an LRU KV cache that publishes real KV events, and a service model.

The cache is :class:`tee.cachesim.model.BlockCache` (the model the cache
simulator uses), of fixed capacity in blocks. Serving a request looks up its
prefix, inserts its blocks and makes one event batch, exactly what an engine
adapter publishes: ``BlockRemoved`` for the evicted blocks, then
``BlockStored`` for the newly cached ones (engine hash = block key, with the
content keys precomputed), with consecutive per-instance sequence numbers.
The cache takes the blocks when the request is admitted: prefills run one at
a time in admission order, so a later request on the same engine starts its
prefill only after the blocks it finds have been computed, and every policy
sees the same stream order as the pooled bound.

When the index learns of them is the engine's ``event_lag_s``: ``None``
publishes the batch at admission (``kvmesh up``); a number publishes it that
many seconds after the request's prefill ends, as a real engine emits its
events once the blocks are computed and the events then travel to the
indexer (``kvmesh replay``). Deferred batches wait in :attr:`SimEngine.outbox`
until the driver awaits :meth:`SimEngine.flush`, once the clock has passed
their time, so batches of one engine reach the index in sequence order.

Service model (:class:`ServiceModel`), in virtual seconds: at most
``max_running`` requests run at once (the rest wait FIFO); prefills run one at
a time, each taking ``uncached tokens / prefill_tokens_per_s``; then the
request decodes for ``output tokens * decode_s_per_token``. Queueing delay =
prefill start - arrival (waiting for a slot, then for the prefill before it);
TTFT = queueing delay + prefill. Load reported to routers: running + queued
requests, their input + output tokens, and the uncached prefill tokens not yet
computed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace

from indexer.model import BlockRemoved, BlockStored, EventBatch, InstanceId, Tier
from router_client.load import WorkerLoad
from tee.cachesim.model import BlockCache

#: Publishes one event batch (the memory index's ``apply`` or a gRPC stream).
Publish = Callable[[EventBatch], Awaitable[None]]


@dataclass(frozen=True, slots=True)
class ServiceModel:
    """Time a simulated engine takes; defaults are a mid-size model on one GPU.

    ``kvmesh replay`` sets each figure with a flag (``--prefill-tokens-per-s``,
    ``--decode-ms-per-token``, ``--max-running``).
    """

    # ~10k prompt tokens/s of prefill: an 8B-class model on one H100-class GPU
    # with long prompts; at the trace's 3.4 req/s over 16 workers this keeps
    # prefill queues short but non-zero, so affinity shows in TTFT.
    prefill_tokens_per_s: float = 10_000.0
    # 30 ms per output token per request: a batched decode step.
    decode_s_per_token: float = 0.03
    # Concurrent requests per engine (its batch size).
    max_running: int = 32

    def prefill_s(self, uncached_tokens: int) -> float:
        """Seconds to prefill ``uncached_tokens``."""
        return uncached_tokens / self.prefill_tokens_per_s

    def decode_s(self, output_tokens: int) -> float:
        """Seconds to decode ``output_tokens``."""
        return output_tokens * self.decode_s_per_token


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
    prefill_start: float = 0.0
    prefill_end: float = 0.0
    # The event batch of its admission, while it waits for the prefill to end.
    batch: EventBatch | None = None


@dataclass(slots=True)
class SimEngine:
    """One simulated worker (see the module docstring).

    ``schedule(at, callback)`` is the replay's event queue; ``on_load`` is
    told the engine's load after every change. ``event_lag_s`` is None to
    publish at admission, else the delay after the prefill ends.
    """

    name: str
    capacity: int
    block_size: int
    publish: Publish
    schedule: Callable[[float, Callable[[float], None]], None]
    on_load: Callable[[str, WorkerLoad, float], None]
    on_finish: Callable[[SimRequest, float], None]
    model: ServiceModel = ServiceModel()
    event_lag_s: float | None = None
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
    #: Queueing delay of every started request (prefill start - arrival).
    queue_delays: list[float] = field(default_factory=list)
    #: Seconds the prefill was busy.
    prefill_busy_s: float = 0.0
    #: Work of the started requests in slot seconds (their prefill + decode).
    slot_work_s: float = 0.0
    #: Deferred batches whose time has come, for :meth:`flush`.
    outbox: deque[EventBatch] = field(default_factory=deque)
    # Integral of (running + waiting) over time, for the time-averaged load.
    load_area: float = 0.0
    _last_change: float = 0.0

    def __post_init__(self) -> None:
        self.cache = BlockCache(self.capacity)
        self.instance = InstanceId(self.name, 0)

    async def admit(self, req: SimRequest, now: float) -> int:
        """Take a request: cache lookup and insert, its event batch made; returns hit blocks.

        The batch is published now (``event_lag_s`` None) or queued for after
        the prefill.
        """
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
            batch = EventBatch(self.instance, self.sequence, tuple(events), now)
            if self.event_lag_s is None:
                await self.publish(batch)
            else:
                req.batch = batch
        self._account(now)
        self.tokens += req.input_tokens + req.output_tokens
        self.pending_prefill += req.uncached_tokens
        if self.running < self.model.max_running:
            self._start(req, now)
        else:
            self.waiting.append(req)
        self.on_load(self.name, self.load(), now)
        return hits

    async def flush(self) -> None:
        """Publish the deferred batches whose time has come, in sequence order."""
        while self.outbox:
            await self.publish(self.outbox.popleft())

    def load(self) -> WorkerLoad:
        """The load this engine reports."""
        return WorkerLoad(
            self.running + len(self.waiting),
            self.tokens,
            self.pending_prefill,
            self.model.prefill_tokens_per_s,
        )

    def _account(self, now: float) -> None:
        self.load_area += (self.running + len(self.waiting)) * (now - self._last_change)
        self._last_change = now

    def _start(self, req: SimRequest, now: float) -> None:
        self.running += 1
        start = max(now, self.prefill_free_at)
        end = start + self.model.prefill_s(req.uncached_tokens)
        self.prefill_free_at = end
        self.prefill_busy_s += end - start
        req.prefill_start = start
        req.prefill_end = end
        self.queue_delays.append(start - req.arrival)
        self.ttfts.append(end - req.arrival)
        self.schedule(end, lambda t: self._prefilled(req, t))
        batch = req.batch
        if batch is not None:
            req.batch = None
            # Prefill ends are non-decreasing per engine (one prefill at a
            # time, FIFO), so the outbox fills in sequence order.
            assert self.event_lag_s is not None
            self.schedule(end + self.event_lag_s, lambda t: self._emit(batch, t))
        decode = self.model.decode_s(req.output_tokens)
        self.slot_work_s += end - start + decode
        finish = end + decode
        self.schedule(finish, lambda t: self._finished(req, t))

    def _emit(self, batch: EventBatch, now: float) -> None:
        self.outbox.append(replace(batch, timestamp=now))

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
