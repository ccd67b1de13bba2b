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
