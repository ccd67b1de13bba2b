"""Error details in ``grpc-status-details-bin``, read with grpcio-status as any client would.

Every kvmesh error ends its call with a ``google.rpc.Status`` whose code and
message are the call's: INVALID_ARGUMENT carries a ``google.rpc.BadRequest``
naming the field, a per-client rate refusal a ``google.rpc.RetryInfo`` saying
when the next call is admitted. The Node.js client decodes the same bytes
(clients/node/test/status.test.js).
"""

from __future__ import annotations

import time
from typing import Any

import grpc
import grpc.aio
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from indexer.memory import MemoryIndex
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.tee.v1 import tee_pb2, tee_pb2_grpc
from tee.config import TeeConfig
from tee.server import TeeServer
from tests.grpc.conftest import (
    BLOCK,
    Harness,
    close_harness,
    expect_status,
    make_config,
    match,
    open_harness,
    ref,
)


def rich_status(err: grpc.aio.AioRpcError) -> status_pb2.Status:
    """The call's google.rpc.Status (from_call also checks its code and message are the call's)."""
    status = rpc_status.from_call(err)
    assert isinstance(status, status_pb2.Status), dict(err.trailing_metadata() or ())
    assert status.code == err.code().value[0]
    assert status.message == err.details()
    return status


def unpacked(detail: any_pb2.Any) -> error_details_pb2.BadRequest | error_details_pb2.RetryInfo:
    """One detail as the message it packs (only BadRequest and RetryInfo are expected)."""
    for cls in (error_details_pb2.BadRequest, error_details_pb2.RetryInfo):
        if detail.Is(cls.DESCRIPTOR):
            out = cls()
            assert detail.Unpack(out)
            return out
    raise AssertionError(f"unexpected detail {detail.type_url}")


async def test_invalid_argument_carries_a_field_violation(stub: Any) -> None:
    err = await expect_status(match(stub, [1, 2, 3, -1]), grpc.StatusCode.INVALID_ARGUMENT)
    details = [unpacked(d) for d in rich_status(err).details]
    assert len(details) == 1 and isinstance(details[0], error_details_pb2.BadRequest)
    [violation] = details[0].field_violations
    # The same field as the kvmesh metadata entry; the description is the message without it.
    assert violation.field == "token_ids[3]"
    assert dict(err.trailing_metadata() or ())["kvmesh-error-field"] == violation.field
    assert violation.description and not violation.description.startswith("token_ids")
    assert err.details() == f"{violation.field}: {violation.description}"


async def test_undecodable_bytes_name_the_request(harness: Harness) -> None:
    channel = harness.channel
    call = channel.unary_unary("/kvmesh.indexer.v1.IndexerService/Match")
    err = await expect_status(call(b"\xff\xff\xff"), grpc.StatusCode.INVALID_ARGUMENT)
    [detail] = rich_status(err).details
    bad = unpacked(detail)
    assert isinstance(bad, error_details_pb2.BadRequest)
    assert [v.field for v in bad.field_violations] == ["request"]
    assert "kvmesh.indexer.v1.MatchRequest" in bad.field_violations[0].description


async def test_rate_refusal_says_when_to_retry() -> None:
    # One Match per 1000 s, a bucket of one: the second call waits for a whole token.
    h = await open_harness(
        make_config(limits={"per_client": {"match_rps": 0.001, "match_burst": 1}}), MemoryIndex()
    )
    try:
        started = time.monotonic()
        await match(h.stub, list(range(BLOCK)))
        err = await expect_status(
            match(h.stub, list(range(BLOCK))), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        elapsed = time.monotonic() - started
        details = [unpacked(d) for d in rich_status(err).details]
        assert len(details) == 1 and isinstance(details[0], error_details_pb2.RetryInfo)
        delay = details[0].retry_delay.ToTimedelta().total_seconds()
        # A token every 1000 s, less what refilled between the two calls.
        assert 1000 - elapsed - 0.001 <= delay <= 1000
        assert dict(err.trailing_metadata() or ())["kvmesh-error-field"] == (
            "limits.per_client.match_rps"
        )
    finally:
        await close_harness(h)


async def test_other_errors_carry_their_status_without_details(stub: Any) -> None:
    err = await expect_status(
        stub.Heartbeat(pb.HeartbeatRequest(instance=ref("never-registered"))),
        grpc.StatusCode.NOT_FOUND,
    )
    status = rich_status(err)
    assert status.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert list(status.details) == []


async def test_every_service_sends_them() -> None:
    # The tee: another service behind the same call scope.
    cfg = TeeConfig.model_validate(
        {"port": 0, "metrics_port": 0, "sinks": [], "shutdown_deadline_s": 1}
    )
    server = await TeeServer(cfg).start()
    channel = grpc.aio.insecure_channel(server.address)
    try:
        stub = tee_pb2_grpc.TeeServiceStub(channel)
        event = tee_pb2.RoutedEvent(kind=tee_pb2.EVENT_KIND_INGEST, model="", input_ids=[1])
        err = await expect_status(
            stub.OfferEvents(tee_pb2.OfferEventsRequest(events=[event])),
            grpc.StatusCode.INVALID_ARGUMENT,
        )
        [detail] = rich_status(err).details
        bad = unpacked(detail)
        assert isinstance(bad, error_details_pb2.BadRequest)
        assert [v.field for v in bad.field_violations] == ["events[0].model"]
    finally:
        await channel.close()
        await server.stop(0)
