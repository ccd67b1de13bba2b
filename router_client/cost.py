"""The cost of sending a request's prefill to a worker: cache affinity against load.

For a prompt of ``n`` blocks and a candidate worker ``w``::

    uncached(w) = n - (gpu(w) * 1.0 + cpu(w) * 0.75 + disk(w) * 0.5)   (hit capped below)
    load(w)     = (tokens of requests running or queued on w
                   + uncached prefill tokens waiting on w) / block_size
    cost(w)     = (1 - balance) * uncached(w) + balance * load(w)

where ``gpu(w)``, ``cpu(w)``, ``disk(w)`` are the prompt's leading blocks the
worker holds per tier (from the indexer's Match), capped at the blocks the
engine reuses of the prompt (:func:`reusable_blocks`: never its last token).
Both terms are in blocks, so ``balance`` is the one knob: 0 is pure cache affinity (fewest blocks to
compute, load ignored), 1 is pure load balance (the prompt's cache ignored),
0.5 weighs a block of someone else's work on a worker the same as a block of
prefill the request would compute itself. The default, 0.02
(:data:`router_client.config.DEFAULT_BALANCE`, measured on the Mooncake
trace), lets load decide among workers holding equal prefixes (every new
conversation) and move a conversation only off a worker with far more work.
The lowest cost wins; equal costs are broken at random, never by worker
order: on a trace where every prompt shares its first block, breaking ties by
order would send every new conversation to the same worker.

Why load is counted in blocks: a hit saves the prefill of the hit blocks, and
a queue costs the time to work through it; both scale with tokens, so one
unit lets one knob trade them without a per-fleet calibration.
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
