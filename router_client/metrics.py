"""Prometheus counters and the OpenTelemetry tracer of the router client."""

from __future__ import annotations

from opentelemetry import trace
from prometheus_client import REGISTRY, CollectorRegistry, Counter

#: Tracer of routing decisions (a no-op until the process configures OpenTelemetry).
tracer = trace.get_tracer("kvmesh.router_client")


class RouterMetrics:
    """The router's counters in one Prometheus registry.

    ``decisions{stage, reason}`` counts every choice; ``unknown_instances``
    counts Match entries naming workers this router does not know.
    ``prefill_choices{outcome}`` and ``cache_blocks{kind}`` account for prefill
    decisions against the best cache hit admitted (:class:`router_client.router.Accounting`);
    ``predictions{outcome}`` counts route-time predictions recorded or skipped;
    ``prompt_blocks{part}`` the prompt blocks of prefill decisions by the part the
    ttft cost weighs them as (:mod:`router_client.branches`).
    """

    def __init__(self, registry: CollectorRegistry) -> None:
        self.decisions = Counter(
            "kvmesh_router_decisions",
            "Routing decisions by stage and reason",
            ["stage", "reason"],
            registry=registry,
        )
        self.unknown_instances = Counter(
            "kvmesh_router_unknown_instances",
            "Match entries naming an instance the router does not know",
            registry=registry,
        )
        self.prefill_choices = Counter(
            "kvmesh_router_prefill_choices",
            "Prefill decisions by outcome: optimal (the chosen worker holds the most "
            "reusable cached blocks admitted), suboptimal (less), unknown (no indexer answer)",
            ["outcome"],
            registry=registry,
        )
        self.cache_blocks = Counter(
            "kvmesh_router_cache_blocks",
            "Tier-weighted confirmed cached blocks of prefill decisions: available (the best "
            "admitted), chosen (the chosen worker's), left (available minus chosen)",
            ["kind"],
            registry=registry,
        )
        self.predictions = Counter(
            "kvmesh_router_predictions",
            "Route-time predictions (PredictPlacement) by outcome: sent, or skipped "
            "(too many pending)",
            ["outcome"],
            registry=registry,
        )
        self.prompt_blocks = Counter(
            "kvmesh_router_prompt_blocks",
            "Prompt blocks of prefill decisions by part, when the ttft cost weighs a "
            "prompt's own part apart (private_weight): shared (a prefix the prompts seen "
            "continue in three or more ways) or own",
            ["part"],
            registry=registry,
        )


_default: RouterMetrics | None = None


def default_metrics() -> RouterMetrics:
    """Metrics on the process-wide default registry (created once)."""
    global _default
    if _default is None:
        _default = RouterMetrics(REGISTRY)
    return _default
