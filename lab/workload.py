"""Trace replay against an indexer over gRPC: the quickstart's and benchmark's workload.

A trace request becomes what an engine would publish: the blocks of its
prompt that the instance serving it does not hold yet, as one ``BlockStored``
whose engine hashes are the trace ids, whose content keys are
:func:`lab.traces.trace_block_key` of them, and whose parent is the id just
before the first new block. Requests of one conversation (same second block)
go to the same instance, as a cache-aware router would send them; every
request shares block 0, so every instance ends up holding it.

Everything here is client side: it speaks the public API through the
generated stubs, exactly as an engine or a router in another process would.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import grpc
import grpc.aio
import xxhash

from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from lab.traces import MOONCAKE_BLOCK_SIZE, TraceRequest, trace_block_key

#: Model name the replayed instances register under.
TRACE_MODEL = "mooncake-trace"


@dataclass(frozen=True, slots=True)
class ReplayInstance:
    """One simulated engine instance of a replay."""

    worker_id: str
    address: str

    @property
    def ref(self) -> pb.InstanceRef:
        """The instance as the API names it (dp rank 0)."""
        return pb.InstanceRef(worker_id=self.worker_id, dp_rank=0)


@dataclass(slots=True)
class PublishPlan:
    """Pre-built publish batches of a replay, grouped per instance in order."""

    instances: list[ReplayInstance]
    batches: dict[str, list[pb.PublishEventsStreamRequest]] = field(default_factory=dict)
    blocks: int = 0  # (block, instance) pairs the plan stores
    requests: int = 0

    @property
    def batch_count(self) -> int:
        """Number of batches in the plan."""
        return sum(len(b) for b in self.batches.values())


def make_instances(n: int) -> list[ReplayInstance]:
    """``n`` simulated instances with distinct worker ids and addresses."""
    if n < 1:
        raise ValueError(f"need at least one instance, got {n}")
    return [
        ReplayInstance(worker_id=f"engine-{i:03d}", address=f"http://engine-{i:03d}:8000")
        for i in range(n)
    ]


def instance_of(req: TraceRequest, n_instances: int) -> int:
    """Index of the instance serving ``req``: sticky per conversation.

    The conversation is named by the request's second block (the first one is
    the prompt prefix every request shares).
    """
    anchor = req.hash_ids[1] if len(req.hash_ids) > 1 else req.hash_ids[0]
    return xxhash.xxh3_64_intdigest(anchor.to_bytes(8, "little")) % n_instances


def plan_publish(
    requests: Sequence[TraceRequest],
    instances: Sequence[ReplayInstance],
    *,
    requests_per_batch: int = 8,
) -> PublishPlan:
    """Turn trace requests into per-instance publish batches.

    Each request contributes one ``BlockStored`` with only the blocks its
    instance does not hold yet (an engine announces newly cached blocks, not
    prefix-cache hits). ``requests_per_batch`` consecutive requests of one
    instance share a batch, as one engine step announces the blocks of
    several requests. Sequence numbers start at 1 per instance.
    """
    if requests_per_batch < 1:
        raise ValueError("requests_per_batch must be >= 1")
    held: list[set[int]] = [set() for _ in instances]
    events: dict[int, list[pb.Event]] = defaultdict(list)
    plan = PublishPlan(instances=list(instances), requests=len(requests))
    for req in requests:
        i = instance_of(req, len(instances))
        have = held[i]
        first_new = 0
        # Ids name prefixes: once one is missing, every later one is too.
        while first_new < len(req.hash_ids) and req.hash_ids[first_new] in have:
            first_new += 1
        new = req.hash_ids[first_new:]
        if not new:
            continue
        have.update(new)
        stored = pb.BlockStored(
            block_hashes=new,
            block_keys=[trace_block_key(h) for h in new],
            block_size=MOONCAKE_BLOCK_SIZE,
            tier=pb.TIER_GPU,
        )
        if first_new > 0:
            stored.parent_block_hash = req.hash_ids[first_new - 1]
        events[i].append(pb.Event(stored=stored))
        plan.blocks += len(new)
    for i, evs in events.items():
        inst = instances[i]
        out = plan.batches.setdefault(inst.worker_id, [])
        for start in range(0, len(evs), requests_per_batch):
            out.append(
                pb.PublishEventsStreamRequest(
                    batch=pb.EventBatch(
                        instance=inst.ref,
                        sequence=len(out) + 1,
                        events=evs[start : start + requests_per_batch],
                    )
                )
            )
    return plan


def prompt_keys(hash_ids: Sequence[int], length: int) -> list[int]:
    """Block keys of a ``length``-block prompt that starts with ``hash_ids``.

    Longer chains are cut; shorter ones are extended with keys no instance
    holds (fresh ids past the trace's id range), so a Match walks every held
    block of the chain and stops at the first extension.
    """
    ids = list(hash_ids[:length])
    fresh = (1 << 40) + (hash_ids[-1] << 12)
    while len(ids) < length:
        ids.append(fresh)
        fresh += 1
    return [trace_block_key(h) for h in ids]


def sample_prompts(requests: Sequence[TraceRequest], length: int, count: int) -> list[list[int]]:
    """Up to ``count`` prompts of ``length`` blocks taken from the trace.

    Requests with at least ``length`` blocks give their first ``length``
    keys (every one held by the instance that served the request); when the
    trace has too few, the longest requests are extended (see
    :func:`prompt_keys`). Picks are spread evenly over the candidates.
    """
    long_enough = [r for r in requests if len(r.hash_ids) >= length]
    pool = long_enough or sorted(requests, key=lambda r: len(r.hash_ids))[-max(count, 1) :]
    if not pool:
        return []
    step = max(1, len(pool) // count)
    return [prompt_keys(r.hash_ids, length) for r in pool[::step][:count]]


async def register_all(
    stub: pb_grpc.IndexerServiceAsyncStub,
    instances: Iterable[ReplayInstance],
    *,
    model: str = TRACE_MODEL,
    lease_ttl_s: float = 600.0,
) -> None:
    """Register every instance (long lease: a replay sends no heartbeats)."""
    for inst in instances:
        await stub.RegisterInstance(
            pb.RegisterInstanceRequest(
                instance=inst.ref,
                model=model,
                address=inst.address,
                lease_ttl_seconds=lease_ttl_s,
                incarnation="replay",
            )
        )


class PublishError(RuntimeError):
    """The indexer rejected a published batch."""


async def _publish_one_stream(
    stub: pb_grpc.IndexerServiceAsyncStub, batches: list[pb.PublishEventsStreamRequest]
) -> int:
    acked = 0
    call = stub.PublishEventsStream(iter(batches))
    async for resp in call:
        ack = resp.ack
        if ack.outcome not in (pb.BATCH_OUTCOME_APPLIED, pb.BATCH_OUTCOME_DUPLICATE):
            raise PublishError(
                f"{ack.instance.worker_id} seq {ack.sequence}: "
                f"{pb.BatchOutcome.Name(ack.outcome)} {ack.error.message}"
            )
        acked += 1
    return acked


async def publish_plan(
    stub: pb_grpc.IndexerServiceAsyncStub, plan: PublishPlan, *, streams: int | None = None
) -> float:
    """Publish a plan over streaming calls; return the seconds it took.

    One stream per instance by default (each engine keeps its own stream);
    ``streams`` folds instances onto fewer streams. Waits for every ack and
    raises :class:`PublishError` on a batch that was not applied.
    """
    per_stream: list[list[pb.PublishEventsStreamRequest]]
    groups = list(plan.batches.values())
    if streams is None or streams >= len(groups):
        per_stream = groups
    else:
        per_stream = [[] for _ in range(max(1, streams))]
        for j, g in enumerate(groups):
            per_stream[j % len(per_stream)].extend(g)
    t0 = time.perf_counter()
    acked = await asyncio.gather(*(_publish_one_stream(stub, b) for b in per_stream if b))
    elapsed = time.perf_counter() - t0
    if sum(acked) != plan.batch_count:
        raise PublishError(f"{sum(acked)} acks for {plan.batch_count} batches")
    return elapsed


def match_request(keys: Sequence[int], *, model: str = TRACE_MODEL) -> pb.MatchRequest:
    """A Match request for precomputed keys."""
    return pb.MatchRequest(model=model, block_keys=keys, max_blocks=len(keys))


def sync_channel(target: str, options: Sequence[tuple[str, int | str]] = ()) -> grpc.Channel:
    """A blocking channel to ``target`` (``host:port`` or ``unix:path``)."""
    return grpc.insecure_channel(target, options=list(options))


def aio_channel(target: str, options: Sequence[tuple[str, int | str]] = ()) -> grpc.aio.Channel:
    """An asyncio channel to ``target``."""
    return grpc.aio.insecure_channel(target, options=list(options))
