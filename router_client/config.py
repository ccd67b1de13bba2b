"""Bucket configuration of a router: typed, validated, unknown keys rejected.

A *bucket* is a set of workers that serve one stage (prefill or decode) for
requests in a token range. Prefill ranges count *extend* tokens (the input
tokens of the request); decode ranges count input plus maximum output tokens.
Ranges are half-open: ``min_tokens <= n < max_tokens``. Buckets of one stage
and one rank must not overlap (which would be ambiguous); across ranks they
may, the lower rank being tried first. A file with buckets must name the
fleet's ``workers`` and hold at least one prefill and one decode bucket. A
file without buckets (or no file) routes every request over one global
domain of all workers, with ``limits`` as its admission limits.

Example (YAML; TOML and JSON carry the same keys)::

    workers: [p0, p1, d0, d1]
    slo_policy: best_effort
    cost: ttft                    # predicted time to first token, or blocks (router_client.cost)
    balance: 0.02                 # the blocks cost's one knob
    predictions: true             # route-time predictions (router_client.router)
    buckets:
      - {id: short, stage: prefill, rank: 0, workers: [p0], max_tokens: 8192,
         ttft_p95_ms: 300, limits: {max_pending_prefill_tokens: 65536}}
      - {id: long, stage: prefill, rank: 1, workers: [p1], max_tokens: 131072}
      - {id: all, stage: decode, workers: [d0, d1], max_tokens: 140000,
         tps_p05: 20, limits: {max_running_requests: 64}}
    indexer:                      # how Match calls reach the indexer
      target: dns:///kvmesh-indexer-headless.kvmesh.svc:50051   # every ready replica
      match_streams: 4            # spread this router's Matches over up to 4 replicas
      deadline_ms: 5
      tls:                        # kvmesh.tls.ClientTLS; empty: plaintext
        ca_file: /etc/kvmesh/tls/ca.crt
        cert_file: /etc/kvmesh/tls/tls.crt   # mutual TLS: the router's identity
        key_file: /etc/kvmesh/tls/tls.key

:func:`load_config` also reads ``KVMESH_ROUTER_…`` environment variables over
the file, nested keys joined by ``__`` (``KVMESH_ROUTER_INDEXER__TLS__CA_FILE``).

Every error is a :class:`~router_client.errors.ConfigError` whose ``field``
is the path of the offending value (``buckets[1].max_tokens``).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from kvmesh.balancing import LoadBalancing, channel_target
from kvmesh.configfile import ConfigError as FileConfigError
from kvmesh.configfile import StrictModel, load_layered, validation_problems
from kvmesh.tls import ClientTLS
from router_client.errors import ConfigError

Stage = Literal["prefill", "decode"]
SloPolicy = Literal["disabled", "slo_first", "best_effort"]
CostModel = Literal["blocks", "ttft"]

#: The default of :attr:`RouterConfig.balance`. A worker's load counts every
#: in-flight token (a 12k-token request is ~24 blocks of load) while a hit saves
#: only the matched blocks, so a small weight on load already breaks ties and
#: steers new conversations to idle workers without pulling a conversation off
#: the worker that holds it. Measured on the Mooncake conversation trace (R=4,
#: W=16): 0.02 reaches 97-99% of the pooled bound; 0.05 drops to 94%, 0.5 to 66%;
#: 0 (pure affinity) sends everything to the first holder of the shared block 0.
DEFAULT_BALANCE = 0.02

#: The default of :attr:`RouterConfig.prefill_tokens_per_s`, the prefill rate
#: of a worker whose engine reports none: about what an 8B model prefills on
#: one H100-class GPU (roughly 2 * 8e9 FLOPs a token against ~400 TFLOP/s
#: achieved in bf16 is ~25k tokens/s at best; attention, batching with decode
#: and longer contexts bring it to ~10k). It only scales the "ttft" cost when
#: no worker reports: with one default for all, the ranking is that of
#: ``queue + uncached`` tokens whatever its value.
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0

#: The default of :attr:`RouterConfig.predicted_weight`. A predicted block is
#: one a router sent the worker a request for, not yet confirmed by its engine:
#: the request may still fail, be preempted or evict it, or run after this one
#: (which then computes it too). Below 1, a confirmed hit of the same depth wins;
#: 0.9 still lets a predicted prefix beat a confirmed one a tenth shorter.
DEFAULT_PREDICTED_WEIGHT = 0.9

#: The default of :attr:`RouterConfig.spread_half_life_s`:
#: long against a conversation's life (its turns come minutes apart), so the
#: count a new conversation is placed by reflects the conversations a worker
#: holds, and short enough that it follows the fleet's traffic of the last
#: minutes rather than its history. The routing grid (docs/benchmarks.md)
#: measured 60 s, 300 s and no decay alike.
DEFAULT_SPREAD_HALF_LIFE_S = 300.0

#: The default of :attr:`RouterConfig.prefill_weight`: a token computed away
#: from its cache costs more than the time it takes this request. It is a second
#: copy the fleet's caches hold (evicting others), and prefill work every later
#: request on that worker queues behind. The routing grid (60 cells, three
#: settings of event lag and load reports; docs/benchmarks.md) measured 1, 1.25,
#: 1.5 and 2: at 1.5 the TTFT target held in 40, 40 and 39 of 40 cells against
#: 39, 39 and 38 at 1, with 4 points more of the pooled bound's hits and a lower
#: mean TTFT p95; 2 gave more hits still, but met the target in 39 cells and
#: evened request counts in fewer.
DEFAULT_PREFILL_WEIGHT = 1.5

#: The default of :attr:`RouterConfig.private_weight`. On the routing grid
#: (docs/benchmarks.md, "A conversation's own history weighs more") 4 kept the
#: TTFT target in all 40 cells with 4.6 points more of the pooled bound's hits
#: on average; 10 found more hits still but lost the TTFT target in 4 cells.
DEFAULT_PRIVATE_WEIGHT = 4.0

#: Prefix of the environment variables read by :func:`load_config`.
ENV_PREFIX = "KVMESH_ROUTER_"


class Limits(StrictModel):
    """Admission limits of a worker (None: no limit on that figure)."""

    max_running_requests: int | None = Field(default=None, ge=0)
    max_total_tokens: int | None = Field(default=None, ge=0)
    max_pending_prefill_tokens: int | None = Field(
        default=None, ge=0, description="cap on uncached prompt tokens waiting for prefill"
    )


class Bucket(StrictModel):
    """One bucket: the workers serving one stage for a token range."""

    id: str = Field(min_length=1)
    stage: Stage
    rank: int = Field(default=0, ge=0, description="lower ranks are tried first")
    workers: list[str] = Field(min_length=1)
    min_tokens: int = Field(default=0, ge=0, description="inclusive lower bound")
    max_tokens: int = Field(gt=0, description="exclusive upper bound")
    max_context: int | None = Field(
        default=None, gt=0, description="largest input + max output tokens a worker accepts"
    )
    ttft_p95_ms: float | None = Field(default=None, ge=0, description="TTFT p95 at capacity")
    tps_p05: float | None = Field(default=None, ge=0, description="decode tokens/s p05")
    limits: Limits = Limits()


class IndexerClientSettings(StrictModel):
    """How the router asks the indexer (see :mod:`router_client.indexer_client`)."""

    target: str = Field(
        default="",
        description="The indexer to dial when IndexerClient is given no target: host:port; "
        "dns:///name:port, every address the name resolves to (a headless Service: one "
        "connection per ready replica, re-resolved when a connection ends); or several "
        "replica addresses joined by commas (10.0.0.5:50051,10.0.0.6:50051, IP literals: "
        "one ipv4:/ipv6: target). Empty: the caller passes a target or a channel.",
    )
    load_balancing: LoadBalancing = Field(
        default="round_robin",
        description="gRPC client-side load balancing over the addresses the target "
        "resolves to: round_robin spreads calls (each Match, each MatchStream) over every "
        "ready replica; pick_first uses one replica (the first that answers) at a time.",
    )
    # A Match on a warm indexer takes well under a millisecond; 5 ms leaves
    # room for a loaded server without letting affinity hold a request up.
    deadline_ms: float = Field(default=5.0, gt=0)
    # Calls beyond this many in flight route on load at once instead of queueing.
    max_in_flight: int = Field(default=64, ge=1)
    # Consecutive failures that open the circuit; how long it stays open.
    breaker_failures: int = Field(default=5, ge=1)
    breaker_cooldown_s: float = Field(default=1.0, gt=0)
    match_stream: bool = Field(
        default=True,
        description="Send Matches over long-lived MatchStreams (many in flight, one HTTP/2 "
        "stream each), falling back to unary Match while a stream is down or the indexer "
        "lacks it; false: unary Match only.",
    )
    match_streams: int = Field(
        default=1,
        ge=1,
        le=64,
        description="MatchStreams one client keeps open, Matches dealt over them in turn. "
        "A stream is one call, placed on one replica by load_balancing: to spread one "
        "router's Matches over N indexer replicas at once, open N streams or a multiple of "
        "N (an autoscaled indexer: its maxReplicas). Each stream then carries a share of "
        "the Matches, so each of its messages batches fewer of them.",
    )
    match_stream_max_age_s: float = Field(
        default=20.0,
        ge=0,
        description="A MatchStream older than this is half-closed at its next Match (its "
        "replies still come) and a new one opened, placed anew by load_balancing: streams "
        "follow replicas as they come and go. Below the indexer's "
        "limits.max_connection_age_grace_s, so a stream leaves a connection the indexer "
        "ages out before that connection is closed under it. 0: streams live until they "
        "break.",
    )
    tls: ClientTLS = Field(
        default=ClientTLS(),
        description="TLS, client certificate and bearer token of the channel to the indexer "
        "(kvmesh.tls.ClientTLS); all empty: plaintext. Changed files open a new channel. "
        "With a list of addresses set tls.server_name to a name the certificate carries.",
    )

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        if value.strip():
            channel_target(value)  # raises ValueError naming the address at fault
        return value.strip()


class RouterConfig(StrictModel):
    """The whole router configuration (see the module docstring)."""

    model: str = Field(default="", description="model name sent with every Match")
    lora_name: str = ""
    workers: list[str] = Field(default_factory=list)
    buckets: list[Bucket] = Field(default_factory=list)
    slo_policy: SloPolicy = "disabled"
    balance: float = Field(
        default=DEFAULT_BALANCE,
        ge=0.0,
        le=1.0,
        description="0 pure cache affinity, 1 pure load balance (router_client.cost); "
        'the "blocks" cost only',
    )
    cost: CostModel = Field(
        default="ttft",
        description='How prefill candidates are ranked (router_client.cost): "ttft" (the '
        "default), the predicted time to first token in seconds, pending prefill tokens / "
        "rate + uncached prompt tokens / rate, rate being the worker's reported prefill "
        'tokens/s (moving average) or prefill_tokens_per_s; "blocks", (1 - balance) * '
        "uncached blocks + balance * load blocks. The routing grid (kvmesh replay --grid) "
        'chose the default: "ttft" met the TTFT target in every cell with no per-trace '
        'setting, "blocks" at balance 0.02 in 13 of 40.',
    )
    prefill_weight: float = Field(
        default=DEFAULT_PREFILL_WEIGHT,
        ge=1.0,
        le=100.0,
        description="The \"ttft\" cost's weight of the request's own uncached prefill "
        "against the queue ahead of it: 1 ranks by predicted TTFT exactly; above 1 a hit "
        "is worth more than the queue time it costs (each token computed away from its "
        "cache is a second copy the fleet's caches hold, evicting others, and work the "
        "worker's later requests queue behind). The default, 1.5, met the TTFT target in "
        "more cells of the routing grid than 1 or 2, with more hits than 1 "
        "(docs/benchmarks.md).",
    )
    private_weight: float = Field(
        default=DEFAULT_PRIVATE_WEIGHT,
        ge=1.0,
        le=100.0,
        description="The \"ttft\" cost's weight of the uncached prefill of a prompt's own "
        "part, in place of prefill_weight: the blocks after its deepest prefix that the "
        "prompts this router saw continued in three or more ways (a system prompt, a "
        "shared document). Recomputing a shared prefix elsewhere makes a replica many "
        "requests can use; moving a conversation off its history makes its later turns "
        "follow or recompute. Equal to prefill_weight: one weight for the whole prompt.",
    )
    spread_half_life_s: float = Field(
        default=DEFAULT_SPREAD_HALF_LIFE_S,
        ge=0.0,
        description='Under the "ttft" cost, workers predicted equal (no queue anywhere and '
        "equal hits: every new conversation) go to the one this router started the fewest "
        "requests on recently, each request counting half after this many seconds; then to "
        "the least loaded. New conversations then spread evenly in number, and their "
        "later turns with them. 0: the least loaded only.",
    )
    prefill_tokens_per_s: float = Field(
        default=DEFAULT_PREFILL_TOKENS_PER_S,
        gt=0,
        description='Prefill tokens/s of a worker whose engine reports none, for the "ttft" '
        "cost; the default is about an 8B model on one H100-class GPU.",
    )
    predictions: bool = Field(
        default=True,
        description="Route-time predictions: Match with include_predicted, count a worker's "
        "predicted prefix at predicted_weight a block, and after each decision record "
        "the chosen worker's blocks as predicted (PredictPlacement) in the background.",
    )
    prediction_ttl_ms: int = Field(
        default=10_000,
        ge=0,
        description="How long a recorded prediction lives without the engine's "
        "confirmation; 0: the indexer's default (the indexer caps it). It must cover "
        "the request's queue wait, its prefill and the event lag: the replay at load 0.9 "
        "with 5 s event lag recovered nothing at 2 s and all the lost hits at 10 s.",
    )
    shared_pending: bool = Field(
        default=True,
        description="With predictions on: a worker's pending prefill is the larger of this "
        "router's view (engine report plus its own requests since) and the blocks every "
        "router predicted for it that its engine has not confirmed, each until its "
        "request's predicted prefill end (MatchResponse.pending), "
        "so routers see each other's dispatches at their next Match and do not herd.",
    )
    predicted_weight: float = Field(
        default=DEFAULT_PREDICTED_WEIGHT,
        ge=0.0,
        le=1.0,
        description="Worth of a predicted, unconfirmed block relative to a GPU hit (< 1: the "
        "request that should produce it may fail, be evicted or run late).",
    )
    limits: Limits = Field(default=Limits(), description="limits of the global domain")
    load_stale_s: float = Field(
        default=5.0, gt=0, description="an engine load report older than this fails open"
    )
    indexer: IndexerClientSettings = IndexerClientSettings()


def _check(cfg: RouterConfig) -> list[tuple[str, str]]:
    """Cross-field problems as (field, message), in field order."""
    errs: list[tuple[str, str]] = []
    seen_workers: set[str] = set()
    for i, w in enumerate(cfg.workers):
        if w in seen_workers:
            errs.append((f"workers[{i}]", f"duplicate worker id {w!r}"))
        seen_workers.add(w)
    if not cfg.buckets:
        return errs
    known = set(cfg.workers)
    if not known:
        errs.append(("workers", "required when buckets are given"))
    seen_ids: set[str] = set()
    for i, b in enumerate(cfg.buckets):
        where = f"buckets[{i}]"
        if b.id in seen_ids:
            errs.append((f"{where}.id", f"duplicate bucket id {b.id!r}"))
        seen_ids.add(b.id)
        if b.max_tokens <= b.min_tokens:
            errs.append((f"{where}.max_tokens", f"empty range [{b.min_tokens}, {b.max_tokens})"))
        for j, w in enumerate(b.workers):
            if known and w not in known:
                errs.append((f"{where}.workers[{j}]", f"unknown worker id {w!r}"))
    for stage in ("prefill", "decode"):
        if not any(b.stage == stage for b in cfg.buckets):
            errs.append(("buckets", f"no {stage} bucket (a bucketed fleet needs both stages)"))
    for i, a in enumerate(cfg.buckets):
        for j in range(i + 1, len(cfg.buckets)):
            b = cfg.buckets[j]
            if a.stage != b.stage or a.rank != b.rank:
                continue
            if a.min_tokens < b.max_tokens and b.min_tokens < a.max_tokens:
                errs.append(
                    (
                        f"buckets[{j}].min_tokens",
                        f"range [{b.min_tokens}, {b.max_tokens}) overlaps bucket {a.id!r} "
                        f"[{a.min_tokens}, {a.max_tokens}) of the same stage and rank",
                    )
                )
    return errs


def _checked(cfg: RouterConfig) -> RouterConfig:
    """``cfg`` after the cross-field checks; raise :class:`ConfigError` naming the field."""
    errs = _check(cfg)
    if errs:
        raise ConfigError("; ".join(f"{f}: {m}" for f, m in errs), field=errs[0][0])
    return cfg


def parse_config(data: Mapping[str, Any]) -> RouterConfig:
    """Validate a configuration mapping; raise :class:`ConfigError` naming the field."""
    try:
        cfg = RouterConfig.model_validate(dict(data))
    except ValidationError as e:
        problems = validation_problems(e, RouterConfig)
        first = problems[0][0] if problems else ""
        raise ConfigError("; ".join(text for _, text in problems), field=first) from None
    return _checked(cfg)


def load_config(
    path: str | Path | None = None, *, environ: Mapping[str, str] | None = None
) -> RouterConfig:
    """Read a YAML (.yaml/.yml), TOML (.toml) or JSON (.json) config file, then the environment.

    ``KVMESH_ROUTER_…`` variables (nested keys joined by ``__``, e.g.
    ``KVMESH_ROUTER_INDEXER__TLS__CA_FILE``) override the file; ``environ``
    defaults to ``os.environ`` (:func:`kvmesh.configfile.load_layered`; an
    unknown key names the file or variable it came from).
    """
    try:
        cfg = load_layered(RouterConfig, path=path, env_prefix=ENV_PREFIX, environ=environ)
    except FileConfigError as e:
        text = "; ".join(t for _, t in e.problems) or str(e)
        raise ConfigError(text, field=e.field) from None
    return _checked(cfg)
