"""The routing decision: domains, two passes, cost, reasons.

For each stage (prefill, then decode when asked) independently:

1. **Domains.** With no buckets, one global domain of all healthy workers.
   Otherwise the buckets of the stage whose range holds the request's token
   count (prefill: input tokens; decode: input + max output) and whose
   ``max_context`` fits input + max output, ordered by rank then id. A request
   no bucket holds takes the **range fallback**: the buckets of the stage whose
   range lies nearest its token count (for a request longer than every
   bucket, those with the largest ``max_tokens``); those decisions carry the
   reason ``range_fallback``. Then the SLO partition (``slo_policy``):
   ``disabled`` keeps the order; ``best_effort`` moves buckets that meet the
   request's targets (``ttft_p95_ms <= ttft_slo_ms``, ``tps_p05 >= tps_slo``)
   before the others; ``slo_first`` keeps only those that meet them, unless
   none has a healthy worker. Members are intersected with healthy workers;
   empty domains drop out.
2. **Pass 1.** In each domain in order, the admitted workers (reported load
   within the bucket's limits; a missing or stale report admits) compete on
   :mod:`router_client.cost`; the first domain with an admitted worker wins.
3. **Pass 2**, only when no worker of any domain is admitted: power of two
   choices on load across the workers of all those domains (reason
   ``capacity_fallback_p2c``).
4. No domain with a healthy worker: :class:`NoHealthyWorker`.

Reasons: prefill pass 1 is ``cache_candidate`` when the admitted candidates
hold different amounts of the prompt (the cache had a say),
``no_cache_candidate`` when they all hold the same (often nothing), and
``indexer_unavailable`` when the indexer did not answer (load alone decided).
Decode pass 1 is ``least_load``. ``range_fallback`` replaces any pass-1
reason of a fallback domain.

**Accounting** (:class:`Accounting`, ``Router.accounting``, and the
``kvmesh_router_prefill_choices_total`` / ``kvmesh_router_cache_blocks_total``
counters): each prefill choice carries the chosen worker's tier-weighted
reusable cached blocks (``cached_blocks``) and the most of them any admitted
candidate of the domain that chose held (``best_cached_blocks``; pass 2: any
worker of the pool). A decision is ``optimal`` when the two are equal,
``suboptimal`` when the chosen worker holds less (load outweighed the cache),
``unknown`` when the indexer did not answer. Only confirmed blocks count:
a prediction is not a hit until the engine reports it.

**Predictions** (``predictions: true``): :meth:`Router.route` Matches with
``include_predicted``, the cost counts each worker's predicted prefix
(:func:`router_client.cost.cached_blocks_with_prediction`), and after the
decision the chosen worker's blocks are recorded as predicted
(``IndexerClient.predict``) in a background task the decision never waits
on; beyond ``Router.max_pending_predictions`` pending (:data:`PREDICTION_SHARE`
of the indexer client's ``max_in_flight``), a prediction is skipped and
counted. Admission and the load bookkeeping keep to confirmed blocks.

**Pending prefill shared through the indexer** (``shared_pending``, on with
predictions): a router knows its own requests at once and the others' only
from engine reports, which are as old as their period; routers that see only
their own work herd onto the same idle-looking worker. A Match with
predictions also answers each worker's predicted blocks its engine has not
confirmed (``MatchOutcome.pending``): the uncached prefill *every* router
sent it and its engine has not finished. The cost then takes, per worker,
the larger of that and this router's own pending prefill
(:meth:`Router.seen_load`); the larger, because this router's own requests
are in both. Admission still reads the engine's report only.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from prometheus_client import CollectorRegistry

from kvmesh.blockkeys import block_keys as compute_block_keys
from kvmesh.tracing import tracing_enabled
from router_client import cost as costmod
from router_client.branches import PrefixBranches
from router_client.config import Bucket, Limits, RouterConfig, Stage
from router_client.errors import NoHealthyWorker
from router_client.indexer_client import IndexerClient, MatchOutcome, MatchStatus
from router_client.load import LoadTracker, WorkerLoad
from router_client.metrics import RouterMetrics, default_metrics, tracer

log = logging.getLogger(__name__)

CACHE_CANDIDATE = "cache_candidate"
NO_CACHE_CANDIDATE = "no_cache_candidate"
INDEXER_UNAVAILABLE = "indexer_unavailable"
LEAST_LOAD = "least_load"
RANGE_FALLBACK = "range_fallback"
CAPACITY_FALLBACK_P2C = "capacity_fallback_p2c"

#: Every reason a decision can carry.
REASONS = (
    CACHE_CANDIDATE,
    NO_CACHE_CANDIDATE,
    INDEXER_UNAVAILABLE,
    LEAST_LOAD,
    RANGE_FALLBACK,
    CAPACITY_FALLBACK_P2C,
)

GLOBAL_DOMAIN = "global"

#: Share of the indexer client's ``max_in_flight`` that pending predictions may
#: take; a prediction past it is skipped. PredictPlacement and Match share the
#: client's in-flight bound, and a prediction is advice about the *next*
#: request while a Match decides this one: an indexer slow to answer
#: predictions must not pile up tasks in the router, nor take the window from
#: Matches: they get half of it, Matches keep at least the other half.
PREDICTION_SHARE = 0.5


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What the router knows of a request.

    Give ``block_keys`` (precomputed) or ``token_ids`` (keyed here with the
    config's model and the router's block size); with neither, no Match is made.
    With ``token_ids``, ``cache_salt`` and ``media`` (``(identifier, offset,
    length)`` of each multimodal item's placeholder tokens) are what the
    request gives the engine besides its tokens: they enter the keys the way
    the engine mixes them into its block hashes (docs/spec/block-keys.md,
    "Extra keys"), so a salted tenant or an image is matched only where it
    is cached. SLO targets are optional.
    """

    request_id: object
    input_tokens: int
    max_output_tokens: int = 0
    block_keys: Sequence[int] | None = None
    token_ids: Sequence[int] | None = None
    ttft_slo_ms: float | None = None
    tps_slo: float | None = None
    cache_salt: str = ""
    media: Sequence[tuple[str, int, int]] = ()


@dataclass(frozen=True, slots=True)
class Domain:
    """A set of workers competing in one pass-1 step."""

    id: str
    workers: tuple[str, ...]
    limits: Limits
    range_fallback: bool = False


@dataclass(frozen=True, slots=True)
class Choice:
    """The worker chosen for one stage, and why."""

    stage: Stage
    worker: str
    reason: str
    domain: str
    #: 1 or 2: the pass that chose.
    pass_no: int
    #: Tier-weighted reusable blocks of the prompt the worker holds, confirmed
    #: (prefill only).
    cached_blocks: float = 0.0
    #: The most ``cached_blocks`` of any admitted candidate of the domain that
    #: chose (pass 2: of any worker of the pool); prefill only.
    best_cached_blocks: float = 0.0
    #: The cached blocks the cost counted: ``cached_blocks``, or the worker's
    #: predicted prefix at ``predicted_weight`` when larger (prefill only).
    counted_blocks: float = 0.0
    #: The chosen worker's cost (pass 1): blocks, or under the "ttft" cost the
    #: predicted TTFT in seconds with the request's own prefill weighed
    #: ``prefill_weight`` times; 0 in pass 2.
    cost: float = 0.0
    #: Predicted seconds to the end of the request's prefill on the worker:
    #: the queue ahead as this router sees it, then the uncached part at the
    #: worker's rate (prefill, pass 1; 0 otherwise: not predicted). A route-time
    #: prediction counts as the worker's pending prefill this long.
    prefill_end_s: float = 0.0


@dataclass(slots=True)
class Accounting:
    """Prefill decisions against the best cached prefix admitted (module docstring).

    Blocks are tier-weighted, reusable and confirmed; ``left_blocks`` is the
    sum of ``best - chosen`` over the decisions the indexer answered.
    """

    optimal: int = 0
    suboptimal: int = 0
    #: Decisions the indexer did not answer (neither optimal nor not).
    unknown: int = 0
    available_blocks: float = 0.0
    chosen_blocks: float = 0.0
    left_blocks: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """A request's prefill choice and, when asked, its decode choice."""

    prefill: Choice
    decode: Choice | None


#: PredictPlacementRequest.pending_ms is a uint32.
_MAX_PENDING_MS = float(2**32 - 1)


def pending_ms(choice: Choice) -> int:
    """How long, in ms, a route-time prediction of ``choice`` counts as its
    worker's pending prefill: to the predicted end of the request's prefill
    (at least 1 ms), or 0 (as long as the prediction lives) when not predicted
    or beyond what the field holds (no ttl is that long)."""
    end_ms = choice.prefill_end_s * 1000
    if not 0 < end_ms < _MAX_PENDING_MS:  # also NaN and infinity
        return 0
    return max(1, math.ceil(end_ms))


class Router:
    """Chooses prefill and decode workers; one per router process.

    ``workers`` names the fleet when the config does not (a config with
    buckets lists them itself); all start healthy. ``indexer`` is optional:
    without it prefill routes on load alone (reason ``indexer_unavailable``).
    ``block_size`` is the indexer's tokens per block for the model. ``seed``
    fixes the tie-breaks; ``clock`` drives load staleness; ``registry`` takes
    the Prometheus counters (the process default when omitted).
    ``on_decision`` is called with each request and its decision, e.g.
    :func:`tee.hooks.routed_request_hook` to tee routed prompts to the cache
    simulator; it must not block, and an exception it raises is counted
    (``hook_errors``) and swallowed: the hook never fails a routing decision.
    """

    def __init__(
        self,
        config: RouterConfig | None = None,
        *,
        workers: Iterable[str] = (),
        indexer: IndexerClient | None = None,
        block_size: int = 16,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        registry: CollectorRegistry | None = None,
        on_decision: Callable[[RouteRequest, Decision], object] | None = None,
    ) -> None:
        self.config = config or RouterConfig()
        names = list(self.config.workers) or list(workers)
        self._workers: list[str] = names
        self._known = set(names)
        self._healthy = set(names)
        self.indexer = indexer
        self.block_size = block_size
        self.rng = random.Random(seed)
        self.load = LoadTracker(
            stale_after_s=self.config.load_stale_s,
            clock=clock,
            spread_half_life_s=self.config.spread_half_life_s,
        )
        cfg = self.config
        #: Where the prompts seen branch, when the cost weighs a prompt's own part
        #: apart (``private_weight``); None otherwise.
        self.branches: PrefixBranches | None = None
        if cfg.cost == "ttft" and cfg.private_weight != cfg.prefill_weight:
            self.branches = PrefixBranches()
        self.metrics = default_metrics() if registry is None else RouterMetrics(registry)
        #: Decisions by (stage, reason), mirrored from the Prometheus counter.
        self.decisions: Counter[tuple[str, str]] = Counter()
        self.unknown_instances = 0
        self._balance = self.config.balance
        self.on_decision = on_decision
        #: Exceptions raised by ``on_decision`` (swallowed).
        self.hook_errors = 0
        #: Prefill decisions against the best cached prefix admitted.
        self.accounting = Accounting()
        #: Route-time predictions sent, and skipped for too many pending.
        self.predictions_sent = 0
        self.predictions_skipped = 0
        # Pending predict() tasks, held so that they are not garbage-collected.
        self._predictions: set[asyncio.Task[object]] = set()
        # Decided once: with tracing off, route() builds no span at all.
        self._tracing = tracing_enabled()

    # -- fleet ---------------------------------------------------------------

    @property
    def workers(self) -> list[str]:
        """Every known worker, in configuration order."""
        return list(self._workers)

    def set_healthy(self, worker: str, healthy: bool) -> None:
        """Mark a known worker healthy or not (unknown names raise KeyError).

        A worker back to health counts as many recent requests as the least of
        the healthy ones (``spread_half_life_s``): while it was out the others'
        counts grew and its own decayed, and it would otherwise take every new
        conversation until it caught up."""
        if worker not in self._known:
            raise KeyError(worker)
        if healthy:
            if worker not in self._healthy and self._healthy:
                floor = min(self.load.recent_requests(w) for w in self._healthy)
                self.load.raise_recent_requests(worker, floor)
            self._healthy.add(worker)
        else:
            self._healthy.discard(worker)

    def healthy(self) -> set[str]:
        """The healthy workers."""
        return set(self._healthy)

    # -- domains -------------------------------------------------------------

    def domains(self, stage: Stage, req: RouteRequest) -> list[Domain]:
        """Ordered domains of ``stage`` for ``req``, healthy members only (module docstring)."""
        cfg = self.config
        if not cfg.buckets:
            members = tuple(w for w in self._workers if w in self._healthy)
            return [Domain(GLOBAL_DOMAIN, members, cfg.limits)] if members else []
        context = req.input_tokens + req.max_output_tokens
        tokens = req.input_tokens if stage == "prefill" else context
        staged = [b for b in cfg.buckets if b.stage == stage]
        fits = [
            b
            for b in staged
            if b.min_tokens <= tokens < b.max_tokens
            and (b.max_context is None or context <= b.max_context)
        ]
        fallback = not fits
        if fallback:
            # Nearest range: distance 0 inside, else to the nearer end.
            def distance(b: Bucket) -> int:
                if tokens >= b.max_tokens:
                    return tokens - b.max_tokens + 1
                return max(0, b.min_tokens - tokens)

            best = min(distance(b) for b in staged)
            fits = [b for b in staged if distance(b) == best]
        fits.sort(key=lambda b: (b.rank, b.id))
        ordered = self._slo_order(fits, req)
        out = []
        for b in ordered:
            members = tuple(w for w in b.workers if w in self._healthy)
            if members:
                out.append(Domain(b.id, members, b.limits, fallback))
        if not out and cfg.slo_policy == "slo_first" and len(ordered) < len(fits):
            for b in fits:
                members = tuple(w for w in b.workers if w in self._healthy)
                if members:
                    out.append(Domain(b.id, members, b.limits, fallback))
        return out

    def _slo_order(self, buckets: list[Bucket], req: RouteRequest) -> list[Bucket]:
        policy = self.config.slo_policy
        if policy == "disabled" or (req.ttft_slo_ms is None and req.tps_slo is None):
            return buckets

        def meets(b: Bucket) -> bool:
            if req.ttft_slo_ms is not None and (
                b.ttft_p95_ms is None or b.ttft_p95_ms > req.ttft_slo_ms
            ):
                return False
            return req.tps_slo is None or (b.tps_p05 is not None and b.tps_p05 >= req.tps_slo)

        good = [b for b in buckets if meets(b)]
        if policy == "slo_first":
            return good
        return good + [b for b in buckets if not meets(b)]

    # -- decisions -----------------------------------------------------------

    def keys_for(self, req: RouteRequest) -> Sequence[int]:
        """The request's block keys: given, or computed from its token ids."""
        if req.block_keys is not None:
            return req.block_keys
        if req.token_ids is not None:
            return compute_block_keys(
                req.token_ids,
                self.block_size,
                self.config.model,
                self.config.lora_name,
                cache_salt=req.cache_salt,
                media=req.media,
            )
        return ()

    async def route(self, req: RouteRequest, *, decode: bool = True) -> Decision:
        """Ask the indexer (if any), then :meth:`decide`. Never waits past the Match deadline.

        With tracing on, the whole decision is the span ``kvmesh.router.route``:
        the indexer's Match and the ``kvmesh.router.choose`` spans are its children.
        """
        if not self._tracing:
            return await self._route(req, decode)
        with tracer.start_as_current_span("kvmesh.router.route") as span:
            decision = await self._route(req, decode)
            span.set_attribute("kvmesh.worker", decision.prefill.worker)
            span.set_attribute("kvmesh.reason", decision.prefill.reason)
            return decision

    async def _route(self, req: RouteRequest, decode: bool) -> Decision:
        keys = self.keys_for(req)
        indexer = self.indexer
        predictions = self.config.predictions
        if indexer is None:
            outcome = MatchOutcome(MatchStatus.UNAVAILABLE)
        elif not keys:
            outcome = MatchOutcome(MatchStatus.OK)
        elif predictions:
            outcome = await indexer.match(keys, include_predicted=True)
        else:
            outcome = await indexer.match(keys)
        decision = self.decide(req, outcome, n_blocks=len(keys), decode=decode, keys=keys)
        if predictions and indexer is not None and keys:
            self._predict(indexer, decision.prefill, keys)
        return decision

    @property
    def max_pending_predictions(self) -> int:
        """Pending predictions past which the next is skipped (:data:`PREDICTION_SHARE`
        of the indexer client's ``max_in_flight``; read from the indexer the router
        has now, which may be set after construction)."""
        if self.indexer is None:
            return 0
        return max(1, int(self.indexer.settings.max_in_flight * PREDICTION_SHARE))

    def _predict(self, indexer: IndexerClient, choice: Choice, keys: Sequence[int]) -> None:
        """Record ``choice``'s worker as about to hold ``keys``, in the background
        (never awaited); pending prefill there until the predicted end of the
        request's prefill (:attr:`Choice.prefill_end_s`, when predicted)."""
        if len(self._predictions) >= self.max_pending_predictions:
            self.predictions_skipped += 1
            self.metrics.predictions.labels("skipped").inc()
            return
        task: asyncio.Task[object] = asyncio.get_running_loop().create_task(
            indexer.predict(
                choice.worker,
                keys,
                ttl_ms=self.config.prediction_ttl_ms,
                pending_ms=pending_ms(choice),
            )
        )
        self._predictions.add(task)
        task.add_done_callback(self._prediction_done)
        self.predictions_sent += 1
        self.metrics.predictions.labels("sent").inc()

    def _prediction_done(self, task: asyncio.Task[object]) -> None:
        self._predictions.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("a prediction failed", exc_info=task.exception())

    @property
    def pending_predictions(self) -> int:
        """Predictions sent and not answered yet."""
        return len(self._predictions)

    async def wait_predictions(self) -> None:
        """Wait for every pending prediction (at shutdown, or in a test)."""
        if self._predictions:
            await asyncio.gather(*self._predictions, return_exceptions=True)

    def decide(
        self,
        req: RouteRequest,
        outcome: MatchOutcome,
        *,
        n_blocks: int | None = None,
        decode: bool = True,
        keys: Sequence[int] | None = None,
    ) -> Decision:
        """Choose workers given a Match outcome (see the module docstring).

        ``n_blocks``: the prompt's full blocks (defaults to the key count).
        ``keys``: the request's block keys when the caller has them
        (:meth:`route` passes those it matched), so that token ids are keyed once.
        Raises :class:`NoHealthyWorker`.
        """
        if keys is None and (n_blocks is None or self.branches is not None):
            keys = self.keys_for(req)
        if n_blocks is None:
            n_blocks = len(keys or ())
        matches = outcome.matches
        if matches:
            unknown = [w for w in matches if w not in self._known]
            if unknown:
                self.unknown_instances += len(unknown)
                self.metrics.unknown_instances.inc(len(unknown))
        shared = None if self.branches is None else self._shared_blocks(keys or ())
        if shared is not None:
            part = min(shared, n_blocks)
            self.metrics.prompt_blocks.labels("shared").inc(part)
            self.metrics.prompt_blocks.labels("own").inc(n_blocks - part)
        prefill = self._choose("prefill", req, outcome, n_blocks, shared)
        self._account(outcome, prefill)
        dec = self._choose("decode", req, None, n_blocks) if decode else None
        decision = Decision(prefill, dec)
        if self.on_decision is not None:
            try:
                self.on_decision(req, decision)
            except Exception:  # the hook is advice-grade: never fail a decision
                self.hook_errors += 1
                log.debug("on_decision hook failed", exc_info=True)
        return decision

    def _shared_blocks(self, keys: Sequence[int]) -> int:
        """The blocks of the shared part of the prompt ``keys``
        (:mod:`router_client.branches`), recording it."""
        branches = self.branches
        return branches.observe(keys) if branches is not None and keys else 0

    def _choose(
        self,
        stage: Stage,
        req: RouteRequest,
        outcome: MatchOutcome | None,
        n_blocks: int,
        shared: int | None = None,
    ) -> Choice:
        with tracer.start_as_current_span("kvmesh.router.choose") as span:
            domains = self.domains(stage, req)
            if not domains:
                self._count(stage, "no_healthy_worker")
                raise NoHealthyWorker(stage)
            if shared is not None and span.is_recording():
                span.set_attribute("kvmesh.shared_blocks", shared)
            choice = self._pass1(stage, req, domains, outcome, n_blocks, shared)
            if choice is None:
                choice = self._pass2(stage, req, domains, outcome, n_blocks)
            self._count(stage, choice.reason)
            if span.is_recording():
                span.set_attribute("kvmesh.stage", stage)
                span.set_attribute("kvmesh.worker", choice.worker)
                span.set_attribute("kvmesh.reason", choice.reason)
                span.set_attribute("kvmesh.domain", choice.domain)
                span.set_attribute("kvmesh.pass", choice.pass_no)
            return choice

    def _count(self, stage: str, reason: str) -> None:
        self.decisions[(stage, reason)] += 1
        self.metrics.decisions.labels(stage, reason).inc()

    def _account(self, outcome: MatchOutcome, choice: Choice) -> None:
        """Count a prefill choice in :attr:`accounting` and its counters."""
        acc = self.accounting
        metrics = self.metrics
        if not outcome.ok:
            acc.unknown += 1
            metrics.prefill_choices.labels("unknown").inc()
            return
        best, chosen = choice.best_cached_blocks, choice.cached_blocks
        left = max(0.0, best - chosen)
        if left > 0:
            acc.suboptimal += 1
            metrics.prefill_choices.labels("suboptimal").inc()
        else:
            acc.optimal += 1
            metrics.prefill_choices.labels("optimal").inc()
        acc.available_blocks += best
        acc.chosen_blocks += chosen
        acc.left_blocks += left
        metrics.cache_blocks.labels("available").inc(best)
        metrics.cache_blocks.labels("chosen").inc(chosen)
        metrics.cache_blocks.labels("left").inc(left)

    def _pass1(
        self,
        stage: Stage,
        req: RouteRequest,
        domains: list[Domain],
        outcome: MatchOutcome | None,
        n_blocks: int,
        shared: int | None = None,
    ) -> Choice | None:
        bs = self.block_size
        cfg = self.config
        prefill = stage == "prefill"
        matches = outcome.matches if outcome is not None and prefill else {}
        weight = cfg.predicted_weight if cfg.predictions else None
        pending = self._pending(outcome) if prefill else None
        load = self.load
        reusable = costmod.reusable_blocks(req.input_tokens, n_blocks, bs)
        # Under the "ttft" cost, workers predicted equal (often: no queue anywhere)
        # are told apart by the requests this router started on them recently, so
        # new conversations spread evenly in number, then by their whole load,
        # decode included (the order the blocks cost gives them).
        tie_on_load = prefill and cfg.cost == "ttft"
        spread = tie_on_load and cfg.spread_half_life_s > 0
        for dom in domains:
            best: list[str] = []
            best_cost = 0.0
            best_key = (0.0, 0.0, 0.0)
            # Per admitted worker: (confirmed cached blocks, blocks the cost counted).
            cached_of: dict[str, tuple[float, float]] = {}
            for w in dom.workers:
                match = matches.get(w)
                confirmed = costmod.cached_blocks(match, reusable, bs) if match else 0.0
                uncached = max(0.0, n_blocks - confirmed)
                if not load.admits(w, dom.limits, int(uncached * bs)):
                    continue
                counted = confirmed
                if weight is not None and match is not None:
                    counted = costmod.cached_blocks_with_prediction(match, reusable, bs, weight)
                cached_of[w] = (confirmed, counted)
                wl = load.load(w) if pending is None else self.seen_load(w, pending)
                c = self._cost(stage, wl, req, n_blocks, counted, shared)
                key = (
                    c,
                    load.recent_requests(w) if spread else 0.0,
                    costmod.load_blocks(wl, bs) if tie_on_load else 0.0,
                )
                if not best or key < best_key:
                    best, best_cost, best_key = [w], c, key
                elif key == best_key:
                    best.append(w)
            if not best:
                continue
            worker = best[0] if len(best) == 1 else self.rng.choice(best)
            if dom.range_fallback:
                reason = RANGE_FALLBACK
            elif not prefill:
                reason = LEAST_LOAD
            elif outcome is None or not outcome.ok:
                reason = INDEXER_UNAVAILABLE
            elif len({counted for _, counted in cached_of.values()}) > 1:
                reason = CACHE_CANDIDATE
            else:
                reason = NO_CACHE_CANDIDATE
            confirmed, counted = cached_of[worker]
            most = max(c for c, _ in cached_of.values())
            end_s = 0.0
            if prefill:
                wl = load.load(worker) if pending is None else self.seen_load(worker, pending)
                end_s = self._ttft_s(wl, req, n_blocks, counted, 1.0)
            return Choice(
                stage, worker, reason, dom.id, 1, confirmed, most, counted, best_cost, end_s
            )
        return None

    def _pending(self, outcome: MatchOutcome | None) -> dict[str, int] | None:
        """The shared pending prefill of ``outcome`` when the router counts it."""
        if outcome is None or outcome.pending is None:
            return None
        cfg = self.config
        return outcome.pending if cfg.predictions and cfg.shared_pending else None

    def seen_load(self, worker: str, pending: dict[str, int]) -> WorkerLoad:
        """``worker``'s load as this router sees it, its pending prefill at least
        the unconfirmed predicted blocks every router sent it (``pending``)."""
        wl = self.load.load(worker)
        shared = pending.get(worker, 0) * self.block_size
        if shared > wl.pending_prefill_tokens:
            return replace(wl, pending_prefill_tokens=shared)
        return wl

    def _cost(
        self,
        stage: Stage,
        wl: WorkerLoad,
        req: RouteRequest,
        n_blocks: int,
        cached: float,
        shared: int | None = None,
    ) -> float:
        """The cost for ``req`` of a worker with load ``wl`` holding ``cached``
        blocks (:mod:`router_client.cost`); ``shared``: the blocks of the prompt's
        shared part when its own part weighs ``private_weight``."""
        bs = self.block_size
        if stage == "decode":
            return costmod.load_blocks(wl, bs)
        cfg = self.config
        if cfg.cost == "ttft":
            if shared is not None:
                rate = costmod.prefill_rate(wl, cfg.prefill_tokens_per_s)
                return costmod.predicted_ttft_split_s(
                    wl.pending_prefill_tokens,
                    req.input_tokens or n_blocks * bs,
                    cached * bs,
                    shared * bs,
                    rate,
                    cfg.prefill_weight,
                    cfg.private_weight,
                )
            return self._ttft_s(wl, req, n_blocks, cached, cfg.prefill_weight)
        uncached = max(0.0, n_blocks - cached)
        return costmod.cost(uncached, costmod.load_blocks(wl, bs), self._balance)

    def _ttft_s(
        self, wl: WorkerLoad, req: RouteRequest, n_blocks: int, cached: float, weight: float
    ) -> float:
        """Predicted seconds to ``req``'s first token on a worker with load ``wl``
        holding ``cached`` blocks, its own prefill weighted ``weight``
        (:func:`router_client.cost.predicted_ttft_s`)."""
        bs = self.block_size
        tokens = costmod.uncached_tokens(req.input_tokens or n_blocks * bs, cached, bs)
        rate = costmod.prefill_rate(wl, self.config.prefill_tokens_per_s)
        return costmod.predicted_ttft_s(wl.pending_prefill_tokens, tokens, rate, weight)

    def _pass2(
        self,
        stage: Stage,
        req: RouteRequest,
        domains: list[Domain],
        outcome: MatchOutcome | None,
        n_blocks: int,
    ) -> Choice:
        seen: dict[str, str] = {}
        for dom in domains:
            for w in dom.workers:
                seen.setdefault(w, dom.id)
        pool = list(seen)
        picks = self.rng.sample(pool, 2) if len(pool) >= 2 else pool
        pending = self._pending(outcome) if stage == "prefill" else None
        loads = [
            costmod.load_blocks(
                self.load.load(w) if pending is None else self.seen_load(w, pending),
                self.block_size,
            )
            for w in picks
        ]
        if len(picks) == 2 and loads[1] < loads[0]:
            worker = picks[1]
        elif len(picks) == 2 and loads[1] == loads[0]:
            worker = self.rng.choice(picks)
        else:
            worker = picks[0]
        if stage == "decode" or outcome is None or not outcome.matches:
            return Choice(stage, worker, CAPACITY_FALLBACK_P2C, seen[worker], 2)
        bs = self.block_size
        reusable = costmod.reusable_blocks(req.input_tokens, n_blocks, bs)
        matches = outcome.matches
        cached = {w: costmod.cached_blocks(matches.get(w), reusable, bs) for w in pool}
        mine = cached[worker]
        return Choice(
            stage, worker, CAPACITY_FALLBACK_P2C, seen[worker], 2, mine, max(cached.values()), mine
        )

    # -- load ----------------------------------------------------------------

    def started(self, req: RouteRequest, choice: Choice) -> None:
        """Record that ``req`` went to ``choice.worker`` (once per request and stage)."""
        tokens = req.input_tokens + req.max_output_tokens
        uncached = 0
        if choice.stage == "prefill":
            uncached = max(0, req.input_tokens - int(choice.cached_blocks * self.block_size))
        self.load.start((req.request_id, choice.stage), choice.worker, tokens, uncached)

    def finished(self, req: RouteRequest) -> None:
        """Record that ``req`` finished on every stage (idempotent)."""
        self.load.finish((req.request_id, "prefill"))
        self.load.finish((req.request_id, "decode"))
