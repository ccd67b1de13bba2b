"""Route-time predictions in the router: the cost counts a predicted prefix at
``predicted_weight``, route() Matches with include_predicted and records its choice
in the background, bounded; accounting keeps to confirmed blocks."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Sequence
from dataclasses import replace
from typing import Any

import grpc.aio
import pytest
from prometheus_client import CollectorRegistry

from indexer.memory import MemoryIndex
from router_client import (
    ConfigError,
    IndexerClient,
    IndexerClientSettings,
    MatchOutcome,
    MatchStatus,
    Router,
    RouteRequest,
    WorkerMatch,
    parse_config,
)
from router_client import cost as costmod
from router_client.router import pending_ms
from tests.grpc.conftest import (
    BLOCK,
    MODEL,
    Harness,
    close_harness,
    make_config,
    open_harness,
    register,
)

BS = 16


def req(i: object = 1, blocks: int = 10) -> RouteRequest:
    return RouteRequest(i, blocks * BS + 1, block_keys=list(range(100 * blocks, 101 * blocks)))


class ScriptedIndexer(IndexerClient):
    """An IndexerClient whose Match answers what a test sets and whose predict()
    waits on ``release`` (a slow indexer), recording every call.

    Its channel points nowhere and is never used: match() and predict() are the
    indexer client's surface the router relies on.
    """

    def __init__(self, channel: grpc.aio.Channel, answer: MatchOutcome) -> None:
        super().__init__(channel=channel)
        self.answer = answer
        self.match_calls: list[dict[str, Any]] = []
        self.predict_calls: list[tuple[str, list[int], int]] = []
        self.predicted: list[str] = []
        self.pending_ms: list[int] = []
        self.release = asyncio.Event()

    async def match(self, keys: Sequence[int], **kw: Any) -> MatchOutcome:
        self.match_calls.append(kw)
        return self.answer

    async def predict(
        self, worker_name: str, keys: Sequence[int], ttl_ms: int = 0, pending_ms: int = 0
    ) -> None:
        self.predict_calls.append((worker_name, list(keys), ttl_ms))
        self.pending_ms.append(pending_ms)
        await self.release.wait()
        self.predicted.append(worker_name)


@pytest.fixture
async def channel() -> AsyncIterator[grpc.aio.Channel]:
    ch = grpc.aio.insecure_channel("127.0.0.1:9")
    yield ch
    await ch.close()


def make_router(config: dict[str, Any], indexer: IndexerClient | None = None) -> Router:
    return Router(
        parse_config(config),
        workers=["a", "b", "c"],
        indexer=indexer,
        block_size=BS,
        seed=1,
        registry=CollectorRegistry(),
    )


# -- the cost helper -----------------------------------------------------------------


def test_a_predicted_prefix_counts_at_its_weight() -> None:
    m = WorkerMatch(2, 2, predicted_depth=8)
    assert costmod.cached_blocks_with_prediction(m, 10, BS, 0.9) == pytest.approx(7.2)
    # capped at the reusable blocks, like a hit
    assert costmod.cached_blocks_with_prediction(m, 5, BS, 0.9) == pytest.approx(4.5)
    # a confirmed hit worth more than the prediction stands
    deep = WorkerMatch(8, 8, predicted_depth=8)
    assert costmod.cached_blocks_with_prediction(deep, 10, BS, 0.9) == 8
    # no prediction asked for (predicted_depth 0), or no match: the confirmed hit
    assert costmod.cached_blocks_with_prediction(WorkerMatch(3, 3), 10, BS, 0.9) == 3
    assert costmod.cached_blocks_with_prediction(None, 10, BS, 0.9) == 0
    # a prefix held only by prediction (depth 0)
    only = WorkerMatch(0, predicted_depth=4)
    assert costmod.cached_blocks_with_prediction(only, 10, BS, 0.5) == 2


def test_prediction_settings_are_validated() -> None:
    cfg = parse_config({})
    # On by default (docs/benchmarks.md, "Routing under load": the grid with them and without).
    assert (cfg.predictions, cfg.prediction_ttl_ms, cfg.predicted_weight) == (True, 10_000, 0.9)
    assert cfg.shared_pending
    with pytest.raises(ConfigError) as e:
        parse_config({"predicted_weight": 1.5})
    assert e.value.field == "predicted_weight"
    with pytest.raises(ConfigError) as e:
        parse_config({"prediction_ttl_ms": -1})
    assert e.value.field == "prediction_ttl_ms"


# -- decide() --------------------------------------------------------------------------

#: a holds 7 blocks confirmed; b holds 2 and was just sent a request for all 10.
OUTCOME = MatchOutcome(
    MatchStatus.OK, {"a": WorkerMatch(7, 7, predicted_depth=7), "b": WorkerMatch(2, 2, 0, 0, 0, 10)}
)


@pytest.mark.parametrize("cost", ["blocks", "ttft"])
def test_a_predicted_prefix_wins_only_with_predictions_on(cost: str) -> None:
    on = make_router({"predictions": True, "cost": cost}).decide(req(), OUTCOME, decode=False)
    off = make_router({"predictions": False, "cost": cost}).decide(req(), OUTCOME, decode=False)
    assert on.prefill.worker == "b" and on.prefill.counted_blocks == pytest.approx(9.0)
    assert off.prefill.worker == "a" and off.prefill.counted_blocks == 7


@pytest.mark.parametrize("cost", ["blocks", "ttft"])
def test_other_routers_pending_prefill_steers_the_choice(cost: str) -> None:
    """MatchOutcome.pending: a worker other routers just sent prefill to looks
    busy to this router too, though it sent that worker nothing itself."""
    # No hit anywhere; the index says a has 400 blocks of prefill pending, c 1.
    outcome = MatchOutcome(MatchStatus.OK, {}, {"a": 400, "c": 1})
    chosen = set()
    for seed in range(20):
        r = make_router({"predictions": True, "cost": cost, "balance": 0.5})
        r.rng.seed(seed)
        chosen.add(r.decide(req(seed), outcome, decode=False).prefill.worker)
    assert chosen == {"b"}
    # Its own view counted alone (shared_pending off, or no predictions): a
    # worker with nothing started by this router and no report is idle.
    for config in ({"predictions": True, "shared_pending": False}, {"predictions": False}):
        chosen = set()
        for seed in range(20):
            r = make_router({**config, "cost": cost, "balance": 0.5})
            r.rng.seed(seed)
            chosen.add(r.decide(req(seed), outcome, decode=False).prefill.worker)
        assert "a" in chosen
    # The larger of the two views: this router's own pending prefill on b
    # (a request it started) outweighs the index's smaller figure for it.
    r = make_router({"predictions": True, "cost": cost, "balance": 0.5})
    r.started(RouteRequest("mine", 2000 * BS), r.decide(req(0), outcome, decode=False).prefill)
    assert r.seen_load("b", {"b": 3}).pending_prefill_tokens == 2000 * BS
    assert r.seen_load("a", {"a": 400}).pending_prefill_tokens == 400 * BS
    assert r.decide(req(1), outcome, decode=False).prefill.worker == "c"


def test_a_low_weight_leaves_the_confirmed_hit_ahead() -> None:
    r = make_router({"predictions": True, "predicted_weight": 0.5})
    assert r.decide(req(), OUTCOME, decode=False).prefill.worker == "a"


def test_accounting_counts_confirmed_blocks_only() -> None:
    r = make_router({"predictions": True})
    choice = r.decide(req(), OUTCOME, decode=False).prefill
    assert choice.worker == "b"
    assert (choice.cached_blocks, choice.best_cached_blocks) == (2, 7)
    acc = r.accounting
    assert (acc.suboptimal, acc.chosen_blocks, acc.left_blocks) == (1, 2, 5)


# -- route() ---------------------------------------------------------------------------


async def test_route_matches_with_predictions_and_records_the_choice_in_the_background(
    channel: grpc.aio.Channel,
) -> None:
    indexer = ScriptedIndexer(channel, OUTCOME)
    r = make_router({"predictions": True, "prediction_ttl_ms": 1500}, indexer)
    request = req()
    async with asyncio.timeout(5):  # the prediction waits on release: route() must not
        decision = await r.route(request, decode=False)
    assert indexer.match_calls == [{"include_predicted": True}]
    assert decision.prefill.worker == "b"
    # route() returned while the prediction still waits on the indexer
    await asyncio.sleep(0)
    assert indexer.predict_calls == [("b", list(request.block_keys or ()), 1500)]
    assert r.pending_predictions == 1 and indexer.predicted == []
    # Pending at the indexer until the predicted end of its prefill there.
    end_s = decision.prefill.prefill_end_s
    assert end_s > 0 and indexer.pending_ms == [math.ceil(end_s * 1000)]
    indexer.release.set()
    await r.wait_predictions()
    assert indexer.predicted == ["b"] and r.pending_predictions == 0
    assert r.predictions_sent == 1 and r.predictions_skipped == 0


def test_the_prefill_end_is_the_queue_then_the_uncached_prefill() -> None:
    """Choice.prefill_end_s: the queue ahead as the router sees it (its own
    view, or every router's pending prefill when larger), then the uncached
    part at the worker's rate; pending_ms rounds it up, 0 when not predicted."""
    r = make_router({"predictions": True, "prefill_tokens_per_s": 1000, "private_weight": 1.5})
    keys = list(range(10))
    outcome = MatchOutcome(MatchStatus.OK, {"a": WorkerMatch(4, 4, 0, 0)}, {"b": 3, "c": 5})
    request = RouteRequest(1, 10 * BS, block_keys=keys)
    choice = r.decide(request, outcome, n_blocks=10, decode=False).prefill
    assert choice.worker == "a"  # the hit, no queue anywhere it is seen
    assert choice.prefill_end_s == pytest.approx(6 * BS / 1000)
    assert pending_ms(choice) == math.ceil(6 * BS)
    # Every router's pending prefill on a is its queue now: a's end would be
    # (2 + 6) blocks' time, b's (1 + 10) and c's 10: c.
    outcome = MatchOutcome(MatchStatus.OK, {"a": WorkerMatch(4, 4, 0, 0)}, {"a": 8, "b": 1})
    choice = r.decide(request, outcome, n_blocks=10, decode=False).prefill
    assert choice.worker == "c" and choice.prefill_end_s == pytest.approx(10 * BS / 1000)
    outcome = MatchOutcome(MatchStatus.OK, {"a": WorkerMatch(4, 4, 0, 0)}, {"a": 2, "c": 5})
    choice = r.decide(request, outcome, n_blocks=10, decode=False).prefill
    assert choice.worker == "a" and choice.prefill_end_s == pytest.approx((2 + 6) * BS / 1000)
    assert pending_ms(replace(choice, prefill_end_s=0.0)) == 0
    assert pending_ms(replace(choice, prefill_end_s=1e-9)) == 1
    # Past what the field holds (a worker reporting no rate): pending while predicted.
    for end in (1e12, math.inf, math.nan):
        assert pending_ms(replace(choice, prefill_end_s=end)) == 0


async def test_pending_predictions_are_bounded(channel: grpc.aio.Channel) -> None:
    indexer = ScriptedIndexer(channel, OUTCOME)
    registry = CollectorRegistry()
    r = Router(
        parse_config({"predictions": True}),
        workers=["a", "b", "c"],
        indexer=indexer,
        block_size=BS,
        registry=registry,
    )
    # Half the client's in-flight bound, read when the prediction is made.
    indexer.settings = indexer.settings.model_copy(update={"max_in_flight": 4})
    assert r.max_pending_predictions == 2
    for i in range(5):
        await r.route(req(i), decode=False)
    assert (r.predictions_sent, r.predictions_skipped, r.pending_predictions) == (2, 3, 2)
    assert registry.get_sample_value("kvmesh_router_predictions_total", {"outcome": "sent"}) == 2
    skipped = registry.get_sample_value("kvmesh_router_predictions_total", {"outcome": "skipped"})
    assert skipped == 3
    indexer.release.set()
    await r.wait_predictions()
    await r.route(req(9), decode=False)  # room again once they are answered
    assert r.predictions_sent == 3


async def test_an_indexer_given_after_construction_gets_predictions(
    channel: grpc.aio.Channel,
) -> None:
    # An embedding (the replay among them) may set router.indexer after building it.
    r = make_router({"predictions": True}, None)
    assert r.max_pending_predictions == 0
    indexer = ScriptedIndexer(channel, OUTCOME)
    indexer.release.set()
    r.indexer = indexer
    await r.route(req(), decode=False)
    await r.wait_predictions()
    assert (r.predictions_sent, r.predictions_skipped) == (1, 0)
    assert len(indexer.predict_calls) == 1


async def test_predictions_off_asks_and_records_nothing(channel: grpc.aio.Channel) -> None:
    indexer = ScriptedIndexer(channel, OUTCOME)
    r = make_router({"predictions": False}, indexer)
    assert (await r.route(req(), decode=False)).prefill.worker == "a"
    await asyncio.sleep(0)
    assert indexer.match_calls == [{}]
    assert indexer.predict_calls == [] and r.pending_predictions == 0


async def test_a_prompt_without_keys_records_no_prediction(channel: grpc.aio.Channel) -> None:
    indexer = ScriptedIndexer(channel, OUTCOME)
    r = make_router({"predictions": True}, indexer)
    await r.route(RouteRequest(1, 10), decode=False)
    await asyncio.sleep(0)
    assert indexer.match_calls == [] and indexer.predict_calls == []


# -- against a real indexer --------------------------------------------------------------


@pytest.fixture
async def indexer() -> AsyncIterator[Harness]:
    h = await open_harness(make_config(), MemoryIndex())
    try:
        for w in ("a", "b", "c"):
            await register(h.stub, w)
        yield h
    finally:
        await close_harness(h)


@pytest.mark.parametrize("predictions", [True, False])
async def test_a_second_request_follows_the_first_before_any_event(
    indexer: Harness, predictions: bool
) -> None:
    """Three idle workers, no cache anywhere. With predictions, the router records
    where it sent the first request, and a second one of the same prompt, routed
    before any engine event, goes to the same worker; without, it lands anywhere."""
    # A deadline a loaded machine meets: a Match or prediction past the default
    # 5 ms would route on load alone, which is not what this test is about.
    settings = IndexerClientSettings(deadline_ms=2000)
    client = IndexerClient(channel=indexer.channel, settings=settings, model=MODEL)
    r = Router(
        # The blocks cost: under "ttft" the router's own bookkeeping puts the first
        # request's prefill in the follower's way on the predicted worker.
        parse_config({"cost": "blocks", "predictions": predictions}),
        workers=["a", "b", "c"],
        indexer=client,
        block_size=BLOCK,
        seed=3,
        registry=CollectorRegistry(),
    )
    keys = list(range(1000, 1008))
    followed = 0
    for i in range(12):
        prompt = [k + 100 * i for k in keys]
        first = await r.route(RouteRequest((i, 1), 8 * BLOCK + 1, block_keys=prompt), decode=False)
        await r.wait_predictions()
        second = await r.route(RouteRequest((i, 2), 8 * BLOCK + 1, block_keys=prompt), decode=False)
        assert first.prefill.cached_blocks == second.prefill.cached_blocks == 0
        if second.prefill.worker == first.prefill.worker:
            followed += 1
            if predictions:
                assert second.prefill.counted_blocks == pytest.approx(8 * 0.9)
    await r.wait_predictions()
    if predictions:
        assert followed == 12
        assert client.predict_calls[MatchStatus.OK] == 24
        assert r.predictions_sent == 24 and r.accounting.optimal == 24
    else:
        assert followed < 12
        assert r.predictions_sent == 0
