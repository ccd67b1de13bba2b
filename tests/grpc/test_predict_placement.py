"""PredictPlacement and Match include_predicted through the real gRPC servicer.

Happy path (recorded blocks, the ttl applied, predicted_depth, predicted-only
instances, expiry, what an engine event does to a prediction), refusals
(NOT_FOUND, INVALID_ARGUMENT naming the field, the router role under mTLS),
MatchStream with include_predicted, the router client's predict/match, and
the GetStats counters.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from indexer.memory import MemoryIndex
from indexer.server import start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.blockkeys import block_keys
from kvmesh.tls import ChannelFactory, ClientTLS
from router_client.config import IndexerClientSettings
from router_client.indexer_client import IndexerClient, MatchStatus, parse_instance_name
from tests.grpc.conftest import (
    BLOCK,
    MODEL,
    Harness,
    batch,
    cleared,
    close_harness,
    expect_status,
    make_config,
    open_harness,
    publish,
    ref,
    register,
    removed,
    stored,
)
from tests.security.pki import Pki, make_pki

TOKENS = list(range(100, 100 + 4 * BLOCK))  # four blocks
KEYS = block_keys(TOKENS, BLOCK, MODEL)


class Clock:
    """A settable clock for the memory backend (predictions expire by it)."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
async def timed() -> AsyncIterator[tuple[Harness, Clock]]:
    clock = Clock()
    h = await open_harness(make_config(), MemoryIndex(clock=clock))
    try:
        yield h, clock
    finally:
        await close_harness(h)


def predict_req(worker: str, keys: list[int], ttl_ms: int = 0, **kw: Any) -> Any:
    kw.setdefault("model", MODEL)
    return pb.PredictPlacementRequest(instance=ref(worker), block_keys=keys, ttl_ms=ttl_ms, **kw)


async def pmatch(stub: Any, keys: list[int] = KEYS, **kw: Any) -> list[tuple[str, int, int]]:
    resp = await stub.Match(
        pb.MatchRequest(model=MODEL, block_keys=keys, include_predicted=True, **kw)
    )
    return [(m.instance.worker_id, m.depth, m.predicted_depth) for m in resp.matches]


async def test_a_prediction_is_seen_then_expires(timed: tuple[Harness, Clock]) -> None:
    h, clock = timed
    stub = h.stub
    await register(stub, "w0")
    await register(stub, "w1")
    await publish(stub, batch(1, stored([1, 2], TOKENS[: 2 * BLOCK])))
    resp = await stub.PredictPlacement(predict_req("w0", KEYS))
    assert (resp.predicted_blocks, resp.ttl_ms) == (2, 2000)  # blocks 0, 1 are held
    resp = await stub.PredictPlacement(predict_req("w1", KEYS[:3], ttl_ms=500))
    assert (resp.predicted_blocks, resp.ttl_ms) == (3, 500)
    assert await pmatch(stub) == [("w0", 2, 4), ("w1", 0, 3)]
    # Without include_predicted: exactly as before (no field 9 on the wire).
    plain = await stub.Match(pb.MatchRequest(model=MODEL, block_keys=KEYS))
    assert [(m.instance.worker_id, m.depth, m.predicted_depth) for m in plain.matches] == [
        ("w0", 2, 0)
    ]
    assert b"\x48" not in plain.SerializeToString()[-4:]
    # max_instances ranks by the farther of depth and predicted_depth.
    assert await pmatch(stub, max_instances=1) == [("w0", 2, 4)]
    clock.now += 0.5
    assert await pmatch(stub) == [("w0", 2, 4)]  # w1's ttl ran out
    clock.now += 1.5
    assert await pmatch(stub) == [("w0", 2, 2)]
    # A cap on the ttl.
    resp = await stub.PredictPlacement(predict_req("w1", KEYS, ttl_ms=10**9))
    assert resp.ttl_ms == 30000
    stats = await stub.GetStats(pb.GetStatsRequest())
    assert stats.predicted_blocks == 4
    assert stats.predictions_recorded == 9
    assert stats.predicted_matches == 3


async def test_pending_ends_at_the_routers_deadline(timed: tuple[Harness, Clock]) -> None:
    """PredictPlacementRequest.pending_ms: the blocks leave MatchResponse.pending
    then, while the Match still sees them predicted; 0, or a value past the
    ttl, counts them while they live."""
    h, clock = timed
    stub = h.stub
    await register(stub, "w0")
    await register(stub, "w1")

    async def pending() -> dict[str, int]:
        r = await stub.Match(
            pb.MatchRequest(model=MODEL, block_keys=[7, 8], include_predicted=True)
        )
        return {p.instance.worker_id: p.predicted_blocks for p in r.pending}

    await stub.PredictPlacement(predict_req("w0", KEYS, ttl_ms=2000, pending_ms=300))
    await stub.PredictPlacement(predict_req("w1", KEYS[:2], ttl_ms=1000, pending_ms=5000))
    assert await pending() == {"w0": 4, "w1": 2}
    clock.now += 0.3
    assert await pending() == {"w1": 2}
    assert await pmatch(stub) == [("w0", 0, 4), ("w1", 0, 2)]
    clock.now += 0.7  # w1's ttl ran out: its deadline past the ttl counted while it lived
    assert await pending() == {}
    assert await pmatch(stub) == [("w0", 0, 4)]
    await stub.PredictPlacement(predict_req("w0", KEYS[:1]))  # again, with no deadline
    assert await pending() == {"w0": 1}


async def test_engine_events_confirm_and_drop_predictions(stub: Any) -> None:
    await register(stub, "w0")
    await stub.PredictPlacement(predict_req("w0", KEYS))
    assert await pmatch(stub) == [("w0", 0, 4)]
    # The engine stores the first two blocks: they are held now.
    await publish(stub, batch(1, stored([1, 2], TOKENS[: 2 * BLOCK])))
    assert await pmatch(stub) == [("w0", 2, 4)]
    # It evicts them: gone, and the prediction with them.
    await publish(stub, batch(2, removed([1, 2])))
    assert await pmatch(stub) == []
    await stub.PredictPlacement(predict_req("w0", KEYS))
    await publish(stub, batch(3, cleared()))
    assert await pmatch(stub) == []
    await stub.PredictPlacement(predict_req("w0", KEYS))
    await stub.RemoveInstance(pb.RemoveInstanceRequest(instance=ref("w0")))
    await register(stub, "w0")
    assert await pmatch(stub) == []


async def test_match_with_predictions_answers_the_pending_prefill(stub: Any) -> None:
    """MatchResponse.pending: every router's unconfirmed predictions per instance."""
    await register(stub, "w0")
    await register(stub, "w1")
    plain = await stub.Match(pb.MatchRequest(model=MODEL, block_keys=KEYS))
    assert not plain.pending_reported and not plain.pending
    resp = await stub.Match(pb.MatchRequest(model=MODEL, block_keys=KEYS, include_predicted=True))
    assert resp.pending_reported and not resp.pending  # reported: nothing pending
    await stub.PredictPlacement(predict_req("w0", KEYS))
    await stub.PredictPlacement(predict_req("w1", KEYS[:1]))

    async def pending() -> dict[str, int]:
        # Any prompt: the figure is the instances', not the prompt's.
        r = await stub.Match(
            pb.MatchRequest(model=MODEL, block_keys=[7, 8], include_predicted=True)
        )
        assert r.pending_reported
        return {p.instance.worker_id: p.predicted_blocks for p in r.pending}

    assert await pending() == {"w0": 4, "w1": 1}
    # w0's engine finishes the prefill of two blocks: two are left pending.
    await publish(stub, batch(1, stored([1, 2], TOKENS[: 2 * BLOCK]), worker="w0"))
    assert await pending() == {"w0": 2, "w1": 1}


async def test_refusals_name_the_field(stub: Any) -> None:
    await register(stub, "w0")
    await expect_status(
        stub.PredictPlacement(predict_req("nobody", KEYS)), grpc.StatusCode.NOT_FOUND
    )
    for req, field in [
        (predict_req("w0", KEYS, model=""), "model"),
        (pb.PredictPlacementRequest(model=MODEL, block_keys=KEYS), "instance.worker_id"),
        (predict_req("w0", []), "block_keys"),
        (predict_req("w0", list(range(16385))), "block_keys"),
    ]:
        err = await expect_status(stub.PredictPlacement(req), grpc.StatusCode.INVALID_ARGUMENT)
        md = dict(err.trailing_metadata() or ())
        assert md.get("kvmesh-error-field") == field, (field, md, err.details())
    await expect_status(
        stub.PredictPlacement(predict_req("w0", KEYS, model="other")),
        grpc.StatusCode.FAILED_PRECONDITION,
    )


async def test_match_stream_carries_include_predicted(stub: Any) -> None:
    await register(stub, "w0")
    await stub.PredictPlacement(predict_req("w0", KEYS[:2]))

    async def frames() -> AsyncIterator[pb.MatchStreamRequest]:
        yield pb.MatchStreamRequest(
            matches=[
                pb.MatchStreamItem(
                    request_id=1,
                    match=pb.MatchRequest(model=MODEL, block_keys=KEYS, include_predicted=True),
                ),
                pb.MatchStreamItem(
                    request_id=2, match=pb.MatchRequest(model=MODEL, block_keys=KEYS)
                ),
            ]
        )

    replies = {}
    async for resp in stub.MatchStream(frames()):
        for r in resp.replies:
            replies[r.request_id] = [
                (m.instance.worker_id, m.depth, m.predicted_depth) for m in r.match.matches
            ]
    assert replies == {1: [("w0", 0, 2)], 2: []}


async def test_router_client_predicts_and_matches(harness: Harness) -> None:
    stub = harness.stub
    await register(stub, "w0")
    await stub.RegisterInstance(
        pb.RegisterInstanceRequest(instance=ref("w1", 2), model=MODEL, address="http://w1")
    )
    client = IndexerClient(
        harness.server.address, model=MODEL, settings=IndexerClientSettings(deadline_ms=2000)
    )
    try:
        assert await client.predict("w1/dp2", KEYS) is MatchStatus.OK
        assert await client.predict("nobody", KEYS) is MatchStatus.ERROR
        got = await client.match(KEYS, include_predicted=True)
        assert got.ok and got.matches["w1/dp2"].predicted_depth == 4
        assert got.matches["w1/dp2"].depth == 0
        assert got.pending == {"w1/dp2": 4}
        plain = await client.match(KEYS)
        assert plain.matches == {} and plain.pending is None
    finally:
        await client.close()
    assert client.predict_calls[MatchStatus.OK] == 1
    assert parse_instance_name("w1/dp2") == ("w1", 2)
    assert parse_instance_name("w/dp0") == ("w/dp0", 0)


async def test_router_client_predict_never_raises_on_a_dead_indexer() -> None:
    client = IndexerClient("127.0.0.1:1", model=MODEL)
    try:
        status = await asyncio.wait_for(client.predict("w0", KEYS), 5)
        assert status in (MatchStatus.UNAVAILABLE, MatchStatus.DEADLINE_EXCEEDED)
    finally:
        await client.close()


async def test_predict_needs_the_router_role(tmp_path: Path) -> None:
    pki: Pki = make_pki(tmp_path)
    cfg = make_config(tls=pki.server_tls(), auth={"policy_file": pki.policy})
    server = await start_server(cfg)
    channels = []

    def stub_of(name: str) -> Any:
        ch = ChannelFactory(server.address, ClientTLS.model_validate(pki.client_tls(name)))
        channel = ch.channel()
        channels.append(channel)
        return pb_grpc.IndexerServiceStub(channel)

    try:
        eng, router = stub_of("engine-a"), stub_of("router-a")
        await eng.RegisterInstance(
            pb.RegisterInstanceRequest(instance=ref("engine-a-0"), model=MODEL), timeout=5
        )
        resp = await router.PredictPlacement(predict_req("engine-a-0", KEYS), timeout=5)
        assert resp.predicted_blocks == 4
        await expect_status(
            eng.PredictPlacement(predict_req("engine-a-0", KEYS), timeout=5),
            grpc.StatusCode.PERMISSION_DENIED,
        )
    finally:
        for channel in channels:
            await channel.close()
        await server.stop(0)


async def test_predictions_ride_the_match_stream(stub: Any) -> None:
    """An item with ``predict`` is a PredictPlacement on the stream: answered
    with ``predicted`` (or its error, naming the field, the stream going on),
    and seen by the Matches after it."""
    await register(stub, "w0")
    queue: asyncio.Queue[pb.MatchStreamRequest | None] = asyncio.Queue()

    async def frames() -> AsyncIterator[pb.MatchStreamRequest]:
        while (msg := await queue.get()) is not None:
            yield msg

    call = stub.MatchStream(frames())

    async def replies(n: int) -> dict[int, pb.MatchStreamReply]:
        out: dict[int, pb.MatchStreamReply] = {}
        while len(out) < n:
            resp = await call.read()
            for r in resp.replies:
                out[r.request_id] = r
        return out

    await queue.put(
        pb.MatchStreamRequest(
            matches=[
                pb.MatchStreamItem(request_id=1, predict=predict_req("w0", KEYS[:2])),
                pb.MatchStreamItem(request_id=2, predict=predict_req("nobody", KEYS)),
                pb.MatchStreamItem(request_id=3, predict=predict_req("w0", KEYS, model="")),
                pb.MatchStreamItem(request_id=4, predict=predict_req("w0", [])),
            ]
        )
    )
    got = await replies(4)
    assert got[1].code == 0 and got[1].predicted.predicted_blocks == 2
    assert got[1].predicted.ttl_ms > 0 and not got[1].HasField("match")
    assert got[2].code == grpc.StatusCode.NOT_FOUND.value[0] and not got[2].HasField("predicted")
    assert (got[3].code, got[3].field) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "model")
    assert (got[4].code, got[4].field) == (grpc.StatusCode.INVALID_ARGUMENT.value[0], "block_keys")
    # The stream goes on, and its next Match sees the prediction.
    await queue.put(
        pb.MatchStreamRequest(
            matches=[
                pb.MatchStreamItem(
                    request_id=5,
                    match=pb.MatchRequest(model=MODEL, block_keys=KEYS, include_predicted=True),
                )
            ]
        )
    )
    got = await replies(1)
    assert [(m.instance.worker_id, m.depth, m.predicted_depth) for m in got[5].match.matches] == [
        ("w0", 0, 2)
    ]
    await queue.put(None)
    assert await call.code() == grpc.StatusCode.OK
    assert await pmatch(stub) == [("w0", 0, 2)]


async def test_router_client_predicts_on_its_match_stream(harness: Harness) -> None:
    """No PredictPlacement call of its own: the prediction is an item on the
    stream the client's Matches use."""
    await register(harness.stub, "w0")
    client = IndexerClient(
        harness.server.address, model=MODEL, settings=IndexerClientSettings(deadline_ms=2000)
    )
    try:
        assert await client.predict("w0", KEYS) is MatchStatus.OK
        assert await client.predict("nobody", KEYS) is MatchStatus.ERROR
        got = await client.match(KEYS, include_predicted=True)
        assert got.ok and got.matches["w0"].predicted_depth == 4
        assert client.predict_unary_calls == 0 and client.unary_calls == 0
        assert client.streams_opened == 1
    finally:
        await client.close()


async def test_an_older_server_gets_predictions_as_calls(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server that predates predictions on the stream takes such an item for
    a Match without one (INVALID_ARGUMENT naming "model"): the client sends
    that prediction, and every later one, as a PredictPlacement call."""
    servicer = harness.server.servicer
    current = servicer._stream_match

    async def as_before(item: pb.MatchStreamItem, client: Any, span: Any = None) -> bytes:
        item.ClearField("predict")  # what a server without the field reads
        return await current(item, client, span)

    monkeypatch.setattr(servicer, "_stream_match", as_before)
    await register(harness.stub, "w0")
    client = IndexerClient(
        harness.server.address, model=MODEL, settings=IndexerClientSettings(deadline_ms=2000)
    )
    try:
        assert await client.predict("w0", KEYS[:2]) is MatchStatus.OK
        assert client.predict_unary_calls == 1
        assert await client.predict("w0", KEYS) is MatchStatus.OK
        assert client.predict_unary_calls == 2  # straight to the call
        got = await client.match(KEYS, include_predicted=True)
        assert got.ok and got.matches["w0"].predicted_depth == 4
    finally:
        await client.close()


@pytest.mark.parametrize("on_stream", [True, False])
async def test_a_busy_router_records_every_decisions_prediction(
    harness: Harness, on_stream: bool
) -> None:
    """16 routes at a time: each decision's prediction is recorded, none
    skipped for too many pending. As PredictPlacement calls (a call each,
    slower than the routes that made them) they piled up past the router's
    share of the in-flight bound and most were skipped."""
    from router_client.config import RouterConfig
    from router_client.router import Router, RouteRequest

    workers = [f"w{i}" for i in range(8)]
    for w in workers:
        await register(harness.stub, w)
    client = IndexerClient(
        harness.server.address, model=MODEL, settings=IndexerClientSettings(deadline_ms=5000)
    )
    client._predict_on_stream = on_stream
    router = Router(
        RouterConfig(model=MODEL, predictions=True),
        workers=workers,
        indexer=client,
        block_size=BLOCK,
        seed=1,
    )
    try:
        prompts = [list(range(i * 1000, i * 1000 + 16 * BLOCK)) for i in range(64)]
        for lo in range(0, 320, 16):
            await asyncio.gather(
                *(
                    router.route(
                        RouteRequest(
                            request_id=i,
                            input_tokens=16 * BLOCK,
                            block_keys=block_keys(prompts[i % 64], BLOCK, MODEL),
                        )
                    )
                    for i in range(lo, lo + 16)
                )
            )
        await router.wait_predictions()
        if on_stream:
            assert router.predictions_skipped == 0 and router.predictions_sent == 320
            assert client.predict_unary_calls == 0
        else:
            assert router.predictions_skipped > 0  # the failure the stream removes
    finally:
        await client.close()
