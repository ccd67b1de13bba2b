"""kvmesh router_client: choose prefill and decode workers from indexer answers and load.

A router embeds one :class:`Router` per process::

    config = load_config("router.yaml")  # buckets; indexer deadline, breaker and tls
    indexer = IndexerClient("indexer:50051", settings=config.indexer, model=config.model)
    router = Router(config, indexer=indexer)
    decision = await router.route(RouteRequest("req-1", input_tokens=900, token_ids=ids))
    router.started(req, decision.prefill)   # ... and router.finished(req) at the end

This package imports the generated API, grpcio and kvmesh's shared modules
(:mod:`kvmesh.blockkeys`, :mod:`kvmesh.tls`, ...), never the indexer service
itself. See README.md for the file map.
"""

from router_client.config import (
    Bucket,
    IndexerClientSettings,
    Limits,
    RouterConfig,
    load_config,
    parse_config,
)
from router_client.errors import ConfigError, NoHealthyWorker, RouterError
from router_client.indexer_client import (
    CircuitBreaker,
    IndexerClient,
    MatchOutcome,
    MatchStatus,
    WorkerMatch,
    instance_name,
)
from router_client.load import LoadTracker, WorkerLoad
from router_client.router import REASONS, Choice, Decision, Domain, Router, RouteRequest

__all__ = [
    "REASONS",
    "Bucket",
    "Choice",
    "CircuitBreaker",
    "ConfigError",
    "Decision",
    "Domain",
    "IndexerClient",
    "IndexerClientSettings",
    "Limits",
    "LoadTracker",
    "MatchOutcome",
    "MatchStatus",
    "NoHealthyWorker",
    "RouteRequest",
    "Router",
    "RouterConfig",
    "RouterError",
    "WorkerLoad",
    "WorkerMatch",
    "instance_name",
    "load_config",
    "parse_config",
]
