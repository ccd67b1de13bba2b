"""The cost of sending a request's prefill to a worker: cache affinity against load.

Two costs, chosen by :attr:`router_client.config.RouterConfig.cost`; the lowest
wins, equal costs are broken at random, never by worker order (on a trace
where every prompt shares its first block, breaking ties by order would send
every new conversation to the same worker).

**Cached blocks.** Both costs start from the prompt's leading blocks the worker
holds, weighted by tier (from the indexer's Match)::

    cached(w) = gpu(w) * 1.0 + cpu(w) * 0.75 + disk(w) * 0.5    (hit capped below)

capped at the blocks the engine reuses of the prompt (:func:`reusable_blocks`:
never its last token). With route-time predictions on
(:attr:`~router_client.config.RouterConfig.predictions`), a worker a router
just sent a request for the same prefix counts what it will hold
(:func:`cached_blocks_with_prediction`)::

    cached(w) = max(cached(w), min(predicted_depth(w), reusable) * predicted_weight)

**"blocks"**, in blocks::

    uncached(w) = n - cached(w)
    load(w)     = (tokens of requests running or queued on w
                   + uncached prefill tokens waiting on w) / block_size
    cost(w)     = (1 - balance) * uncached(w) + balance * load(w)

Both terms are in blocks, so ``balance`` is the one knob: 0 is pure cache affinity (fewest blocks to
compute, load ignored), 1 is pure load balance (the prompt's cache ignored),
0.5 weighs a block of someone else's work on a worker the same as a block of
prefill the request would compute itself. The default, 0.02
(:data:`router_client.config.DEFAULT_BALANCE`, measured on the Mooncake
trace), lets load decide among workers holding equal prefixes (every new
conversation) and move a conversation only off a worker with far more work.
Why load is counted in blocks: a hit saves the prefill of the hit blocks, and
a queue costs the time to work through it; both scale with tokens, so one
unit lets one knob trade them without a per-fleet calibration.

**"ttft"** (the default), in seconds: the request's predicted time to first
token on ``w`` (:func:`predicted_ttft_s`)::

    uncached_tokens(w) = input_tokens - cached(w) * block_size     (at least 0)
    queue_s(w)         = pending_prefill_tokens(w) / rate(w)
    prefill_s(w)       = uncached_tokens(w) / rate(w)
    ttft(w)            = queue_s(w) + prefill_s(w)

(``RouterConfig.prefill_weight``, 1.5 by default, weighs ``prefill_s`` that many
times: a ranking that values hits above the queue time they cost, since a token
computed away from its cache is a second copy in the fleet's caches and work the
worker's later requests wait behind; docs/benchmarks.md, the routing grid,
measures what it trades), where ``pending_prefill_tokens``
is the uncached prompt tokens waiting on the worker (its engine's last report
plus what this router sent it since) and ``rate(w)`` its prefill tokens per
second: the smoothed figure its engine reports
(:attr:`router_client.load.WorkerLoad.prefill_tokens_per_s`), else
:attr:`~router_client.config.RouterConfig.prefill_tokens_per_s`
(:func:`prefill_rate`). ``balance`` plays no part: a hit and a queue are
traded in the one unit they cost, time, and a slow worker's queue weighs more
than a fast one's. Workers predicted equal (no queue anywhere, equal hits) are
ordered by the requests this router started on them recently
(:meth:`router_client.load.LoadTracker.recent_requests`, with
:attr:`~router_client.config.RouterConfig.spread_half_life_s`), then by their
whole load in blocks, decode included, before the random tie-break: new
conversations spread evenly in number, so their later turns do too. Decode is
ranked by load in blocks whatever the cost.

A prompt's own part weighs more (``RouterConfig.private_weight``, 4 by default;
:func:`predicted_ttft_split_s`): the blocks after its **shared part**, the
deepest prefix the prompts this router saw continued in three or more ways (a
system prompt, a tool context, a document many questions follow;
:mod:`router_client.branches`)::

    cost(w) = (queue_tokens(w) + prefill_weight * uncached shared tokens(w)
                               + private_weight * uncached own tokens(w)) / rate(w)

Recomputing a shared prefix on an idle worker makes a replica that spreads the
requests using it; moving a conversation off its history makes its later turns
follow it or recompute it, so its own part holds its worker against a longer
queue. With one weight for both (``private_weight`` = ``prefill_weight``) the
cost is the one above.

Why "ttft" is the default: ``kvmesh replay --grid`` (five trace families, R 4
and 8, 500 and 2,000 blocks per worker, loads 0.7 and 0.9, 1 s event lag)
met the TTFT target (p95 <= 0.6x P2C's, lowest of all, best goodput) in 39 of
40 cells with "ttft" and in 13 with "blocks" at its default balance; no
family needed a setting of its own. It finds fewer hits than "blocks" (it
moves a turn off its cached worker when the queue there costs more than the
prefill saved), which docs/benchmarks.md reports; with ``prefill_weight`` 1.5
(the default since) it met the target in all 40 cells with more hits.
"""

from __future__ import annotations

from router_client.indexer_client import WorkerMatch
from router_client.load import WorkerLoad

#: Worth of a matched block by tier, relative to a GPU hit. A CPU hit skips
#: the recompute but pays a host-to-device copy; a disk hit pays a read that
#: can approach the recompute for short blocks, hence half.
GPU_WEIGHT = 1.0
CPU_WEIGHT = 0.75
DISK_WEIGHT = 0.5


def reusable_blocks(input_tokens: int, n_blocks: int, block_size: int) -> int:
    """The most leading blocks an engine reuses of an ``input_tokens`` prompt.

    vLLM and SGLang never reuse the whole prompt: the last token is computed
    again for its logits, so a hit ends at ``(input_tokens - 1) // block_size``
    whole blocks. Without a token count (0) the prompt's blocks are the limit.
    """
    if input_tokens <= 0:
        return n_blocks
    return min(n_blocks, (input_tokens - 1) // block_size)


def cached_blocks(
    match: WorkerMatch | None, limit: int | None = None, block_size: int = 0
) -> float:
    """Tier-weighted blocks of the prompt the worker holds (0 without a match),
    at most ``limit`` of them (:func:`reusable_blocks`; its tiers in proportion).

    A hit that ends inside a block (``match.tokens``, a hybrid engine's finer
    hash unit; the indexer has capped it already) adds that block's reused
    fraction, at the GPU weight, when ``block_size`` is given.
    """
    if match is None:
        return 0.0
    weighted = (
        match.gpu_blocks * GPU_WEIGHT
        + match.cpu_blocks * CPU_WEIGHT
        + match.disk_blocks * DISK_WEIGHT
    )
    if block_size and match.tokens > match.depth * block_size:
        return weighted + (match.tokens / block_size - match.depth) * GPU_WEIGHT
    if limit is not None and match.depth > limit:
        return weighted * max(0, limit) / match.depth
    return weighted


def load_blocks(load: WorkerLoad, block_size: int) -> float:
    """A worker's load in blocks: its in-flight tokens plus its pending prefill."""
    return (load.total_tokens + load.pending_prefill_tokens) / block_size


def cost(uncached: float, load: float, balance: float) -> float:
    """``(1 - balance) * uncached + balance * load`` (see the module docstring)."""
    return (1.0 - balance) * uncached + balance * load


def cached_blocks_with_prediction(
    match: WorkerMatch | None,
    limit: int | None = None,
    block_size: int = 0,
    predicted_weight: float = 0.0,
) -> float:
    """:func:`cached_blocks`, or the worker's predicted prefix at ``predicted_weight`` a
    block when that is worth more (the module docstring).

    ``match.predicted_depth`` (0 unless the Match asked for predictions) is the
    prefix held confirmed or predicted, capped at ``limit`` like a hit.
    """
    confirmed = cached_blocks(match, limit, block_size)
    if match is None or match.predicted_depth <= 0:
        return confirmed
    depth = match.predicted_depth if limit is None else min(match.predicted_depth, max(0, limit))
    return max(confirmed, depth * predicted_weight)


def uncached_tokens(input_tokens: int, cached: float, block_size: int) -> float:
    """The prompt tokens a worker holding ``cached`` weighted blocks computes (at least 0)."""
    return max(0.0, input_tokens - cached * block_size)


def prefill_rate(load: WorkerLoad, default_tokens_per_s: float) -> float:
    """A worker's prefill tokens per second: its reported figure, else the default."""
    rate = load.prefill_tokens_per_s
    return rate if rate > 0 else default_tokens_per_s


def predicted_ttft_s(
    pending_prefill_tokens: float,
    uncached_tokens: float,
    tokens_per_s: float,
    prefill_weight: float = 1.0,
) -> float:
    """Predicted TTFT in seconds: the queue ahead, then the request's own prefill, at
    ``tokens_per_s`` (``queue_s + prefill_s`` of the module docstring); with
    ``prefill_weight`` above 1, ``queue_s + prefill_weight * prefill_s``."""
    return (pending_prefill_tokens + prefill_weight * uncached_tokens) / tokens_per_s


def predicted_ttft_split_s(
    pending_prefill_tokens: float,
    input_tokens: float,
    cached_tokens: float,
    shared_tokens: float,
    tokens_per_s: float,
    shared_weight: float,
    private_weight: float,
) -> float:
    """:func:`predicted_ttft_s` with the prompt in two parts: its first
    ``shared_tokens`` (a prefix many prompts continue) weighted ``shared_weight``
    where uncached, the rest (the prompt's own) ``private_weight``
    (:mod:`router_client.branches`)::

        cost = (queue + shared_weight * uncached shared tokens
                      + private_weight * uncached own tokens) / rate
    """
    total = max(0.0, input_tokens)
    shared = min(max(0.0, shared_tokens), total)
    cached = min(max(0.0, cached_tokens), total)
    uncached_shared = max(0.0, shared - cached)
    uncached_own = total - max(cached, shared)
    return (
        pending_prefill_tokens + shared_weight * uncached_shared + private_weight * uncached_own
    ) / tokens_per_s
