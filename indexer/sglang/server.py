"""gRPC transport of SGLang's ``kv_indexer.v1.KVIndexer`` on the indexer's server.

Converts messages (``sfixed64`` hashes to unsigned block keys and back,
``TierType`` to :class:`~indexer.model.Tier`) and calls
:class:`~indexer.sglang.compat.SglangCompat`. Every method runs in the same
call scope as ``IndexerService`` (kvmesh/grpcsvc.py): a
:class:`~kvmesh.errors.KvmeshError` ends the call with its status, anything
else with INTERNAL, never UNKNOWN; the overload guard, per-method metrics and
server spans of indexer/rpc.py apply too.
"""

from __future__ import annotations

from typing import Any

import grpc

from indexer.instrumented import Metrics
from indexer.model import Tier
from indexer.rpc import IndexerCalls
from indexer.sglang.compat import Action, ActionKind, ApplyRequest, SglangCompat
from indexer.sglang.components import CacheSpec
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2 as spb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2_grpc as spb_grpc
from kvmesh.blockkeys import to_signed, to_unsigned
from kvmesh.errors import InvalidArgument
from kvmesh.grpcsvc import Guard, MethodRule, add_guarded, capture_handlers, observed

#: Full name of the service, as health checks and reflection know it.
SGLANG_SERVICE_NAME: str = spb.DESCRIPTOR.services_by_name["KVIndexer"].full_name

_TIERS: dict[int, Tier] = {spb.TIER_HBM: Tier.GPU, spb.TIER_DRAM: Tier.CPU, spb.TIER_SSD: Tier.DISK}
_TIER_NUMBERS: dict[Tier, Any] = {tier: number for number, tier in _TIERS.items()}
_KINDS: dict[int, ActionKind] = {
    spb.ACTION_REPORT: ActionKind.REPORT,
    spb.ACTION_REVOKE: ActionKind.REVOKE,
    spb.ACTION_CLEAR_ALL_AT_TIER: ActionKind.CLEAR,
}


def _keys(hashes: Any) -> list[int]:
    return [to_unsigned(h) for h in hashes]


def _tier(value: int, field: str) -> Tier:
    tier = _TIERS.get(value)
    if tier is None:
        raise InvalidArgument(f"must be TIER_HBM, TIER_DRAM or TIER_SSD, got {value}", field=field)
    return tier


def action_from_pb(a: spb.ExternalKvAction, path: str) -> Action:
    """ExternalKvAction -> Action (INVALID_ARGUMENT for an unknown type or tier)."""
    kind = _KINDS.get(a.type)
    if kind is None:
        raise InvalidArgument(f"unsupported action type {a.type}", field=f"{path}.type")
    tier = _tier(a.tier, f"{path}.tier")
    if kind is not ActionKind.CLEAR and not a.hashes:
        raise InvalidArgument("must not be empty", field=f"{path}.hashes")
    if kind is ActionKind.CLEAR:
        return Action(kind, tier, path=path)
    return Action(
        kind,
        tier,
        tuple(_keys(a.hashes)),
        tuple(a.component_masks) if kind is ActionKind.REPORT else (),
        tuple(a.block_sizes) if kind is ActionKind.REPORT else (),
        path,
    )


def spec_from_pb(msg: Any, name: str = "cache_spec") -> CacheSpec | None:
    """The message's WorkerCacheSpec field (None when not sent)."""
    if not msg.HasField(name):
        return None
    c = getattr(msg, name)
    return CacheSpec(
        c.version,
        c.components,
        c.swa_window_tokens,
        c.full_tier_mask,
        c.swa_tier_mask,
        c.mamba_tier_mask,
    )


class SglangServicer(spb_grpc.KVIndexerServicer):
    """grpc.aio servicer of ``kv_indexer.v1.KVIndexer`` over :class:`SglangCompat`."""

    def __init__(self, compat: SglangCompat, metrics: Metrics, guard: Guard | None = None) -> None:
        self.compat = compat
        self.metrics = metrics
        self.guard = guard if guard is not None else Guard("indexer")
        #: In-flight cap, metrics and spans of this service's calls.
        self.calls = IndexerCalls(metrics, compat.logic.config.limits.max_concurrent_rpcs)

    @observed
    async def ApplyExternalKvBatch(
        self, request: spb.ApplyExternalKvBatchRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> spb.ApplyExternalKvBatchResponse:
        """Apply one ordered batch of a worker (duplicates acknowledged, not reapplied)."""
        req = ApplyRequest(
            worker_id=request.worker_id,
            seq=request.seq,
            actions=tuple(
                action_from_pb(a, f"actions[{i}]") for i, a in enumerate(request.actions)
            ),
            worker_address=request.worker_address,
            worker_epoch=request.worker_epoch,
            enforce_sequence=request.enforce_sequence,
            cache_spec=spec_from_pb(request),
        )
        applied, duplicate = await self.compat.apply(req)
        return spb.ApplyExternalKvBatchResponse(applied_seq=applied, duplicate=duplicate)

    @observed
    async def ConfigureExpectedWorkers(
        self,
        request: spb.ConfigureExpectedWorkersRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> spb.ConfigureExpectedWorkersResponse:
        """Register the listed workers; remove the ones this API fed that are not listed."""
        total, ready = await self.compat.configure(
            [(w.worker_id, w.worker_address, spec_from_pb(w)) for w in request.workers]
        )
        return spb.ConfigureExpectedWorkersResponse(total_workers=total, ready_workers=ready)

    @observed
    async def ReplaceExternalKvSnapshot(
        self,
        request: spb.ReplaceExternalKvSnapshotRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> spb.ReplaceExternalKvSnapshotResponse:
        """Clear the worker, store its snapshot and set its sequence checkpoint."""
        tiers = [
            Action(
                ActionKind.REPORT,
                _tier(t.tier, f"hashes_by_tier[{i}].tier"),
                tuple(_keys(t.hashes)),
                tuple(t.component_masks),
                tuple(t.block_sizes),
                f"hashes_by_tier[{i}]",
            )
            for i, t in enumerate(request.hashes_by_tier)
        ]
        applied = await self.compat.replace_snapshot(
            request.worker_id,
            request.worker_address,
            request.worker_epoch,
            request.applied_seq,
            tiers,
            spec_from_pb(request),
        )
        return spb.ReplaceExternalKvSnapshotResponse(applied_seq=applied)

    @observed
    async def MatchExternalKvPrefix(
        self,
        request: spb.MatchExternalKvPrefixRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> spb.MatchExternalKvPrefixResponse:
        """Per worker, the largest gap-free prefix of the prompt's hashes, deepest first."""
        result = await self.compat.match_prefix(_keys(request.hashes), request.max_blocks)
        return spb.MatchExternalKvPrefixResponse(
            matches=[
                spb.ExternalKvPrefixMatch(
                    worker_address=m.worker_address,
                    matched_prefix_blocks=m.matched_prefix_blocks,
                    worker_id=m.worker_id,
                )
                for m in result.matches
            ],
            best_prefix_blocks=result.best_prefix_blocks,
            blocks_read=result.blocks_read,
        )

    @observed
    async def MatchExternalKv(
        self, request: spb.MatchExternalKvRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> spb.MatchExternalKvResponse:
        """Which workers hold each hash, by tier."""
        nodes = await self.compat.match_each(_keys(request.hashes), request.count_as_hit)
        return spb.MatchExternalKvResponse(
            matches=[
                spb.ExternalKvNodeMatch(
                    worker_id=n.worker_id,
                    address=n.address,
                    hashes_by_tier=[
                        _tier_hashes(tier, held, self.compat.settings.page_size)
                        for tier, held in sorted(n.by_tier.items())
                    ],
                )
                for n in nodes
            ]
        )

    @observed
    async def GetExternalKvHitCounts(
        self,
        request: spb.GetExternalKvHitCountsRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> spb.GetExternalKvHitCountsResponse:
        """Hit counts of the requested hashes on this replica."""
        counts = self.compat.hits(_keys(request.hashes))
        return spb.GetExternalKvHitCountsResponse(
            entries=[spb.HitCountEntry(hash=to_signed(k), hit_count_total=n) for k, n in counts]
        )


def _tier_hashes(tier: Tier, held: dict[int, int], page_size: int) -> spb.TierHashes:
    """One tier of a MatchExternalKv answer: component masks and page sizes only
    when some hash has components (a legacy answer stays as it was)."""
    msg = spb.TierHashes(tier=_TIER_NUMBERS[tier], hashes=[to_signed(k) for k in held])
    if any(held.values()):
        msg.component_masks.extend(held.values())
        msg.block_sizes.extend(page_size if m else 0 for m in held.values())
    return msg


#: Who may call each KVIndexer method (admin may call all). Engines apply
#: batches and snapshots only for the workers the policy gives them;
#: ConfigureExpectedWorkers removes workers, so it is an admin call.
SGLANG_RULES: dict[str, MethodRule] = {
    "ConfigureExpectedWorkers": MethodRule(("admin",)),
    "ReplaceExternalKvSnapshot": MethodRule(("engine",), rate="publish"),
    "ApplyExternalKvBatch": MethodRule(("engine",), rate="publish"),
    "MatchExternalKv": MethodRule(("router",), rate="match"),
    "MatchExternalKvPrefix": MethodRule(("router",), rate="match"),
    "GetExternalKvHitCounts": MethodRule(("router",)),
}


def add_sglang_servicer(
    servicer: SglangServicer, server: grpc.aio.Server, guard: Guard | None = None
) -> None:
    """Register ``kv_indexer.v1.KVIndexer`` on ``server`` behind ``guard``."""
    for name, handlers in capture_handlers(
        spb_grpc.add_KVIndexerServicer_to_server, servicer
    ).items():
        add_guarded(
            server, name, handlers, SGLANG_RULES, guard or servicer.guard, observer=servicer.calls
        )
