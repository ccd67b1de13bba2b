"""MatchStream over gRPC, and the router client's use of it.

A real server on 127.0.0.1 and real channels: answers equal unary Match's,
one Match to a message or many, replies out of order and coalesced (one
response answering several messages), in-band errors that leave the stream
usable, the per-stream window (on Matches, not messages), half-close and
cancellation, per-Match limits; then :class:`router_client.IndexerClient` on
the stream by default, batching concurrent Matches into few messages (counted
by the server), its deadline, and its fallback to unary Match against a server
without MatchStream or whose stream fails.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
import grpc.aio
import pytest

from indexer.memory import MemoryIndex
from indexer.model import InstanceMatch, Namespace
from indexer.pacing import call_pacer, loop_pacer
from indexer.server import INDEXER_RULES, IndexerServer, _serialize
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.blockkeys import block_keys
from kvmesh.grpcsvc import HANDLER_FACTORIES, add_guarded
from router_client import IndexerClient, IndexerClientSettings, MatchStatus
from tests.grpc.conftest import (
    BLOCK,
    MODEL,
    Harness,
    batch,
    close_harness,
    make_config,
    open_harness,
    publish,
    register,
    stored,
)

TOKENS = list(range(100, 100 + 4 * BLOCK))  # four full blocks
KEYS = block_keys(TOKENS, BLOCK, MODEL)
INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]


async def _seed(stub: Any) -> None:
    """w0 holds 4 blocks, w1 the first 2, w2 the first on CPU; w3 is stale."""
    for w in ("w0", "w1", "w2", "w3"):
        await register(stub, w)
    await publish(stub, batch(1, stored([11, 12, 13, 14], TOKENS), worker="w0"))
    await publish(stub, batch(1, stored([21, 22], TOKENS[: 2 * BLOCK]), worker="w1"))
    await publish(stub, batch(1, stored([31], TOKENS[:BLOCK], tier=pb.TIER_CPU), worker="w2"))
    await publish(stub, batch(1, stored([41, 42, 43], TOKENS[: 3 * BLOCK]), worker="w3"))
    await publish(stub, batch(3, stored([44], [1, 2, 3, 4], parent=43), worker="w3"))  # a gap


#: Requests whose answers must be the same over the stream and unary.
QUERIES: tuple[pb.MatchRequest, ...] = (
    pb.MatchRequest(model=MODEL, token_ids=TOKENS),
    pb.MatchRequest(model=MODEL, token_ids=[*TOKENS, 7, 7]),
    pb.MatchRequest(model=MODEL, token_ids=TOKENS, max_blocks=2),
    pb.MatchRequest(model=MODEL, token_ids=TOKENS, max_instances=1),
    pb.MatchRequest(model=MODEL, token_ids=TOKENS, include_stale=True),
    pb.MatchRequest(model=MODEL, block_keys=KEYS),
    pb.MatchRequest(model=MODEL, block_keys=KEYS[:3], include_stale=True),
    pb.MatchRequest(model=MODEL, block_keys=[KEYS[0], 99]),
    pb.MatchRequest(model=MODEL, token_ids=[]),
    pb.MatchRequest(model="no/such-model", token_ids=TOKENS),
)


def _call(h: Harness) -> grpc.aio.StreamStreamCall[Any, Any]:
    call: grpc.aio.StreamStreamCall[Any, Any] = h.stub.MatchStream()
    return call


def _msg(first_id: int, *reqs: pb.MatchRequest) -> pb.MatchStreamRequest:
    """One message carrying ``reqs``, request ids from ``first_id``."""
    return pb.MatchStreamRequest(
        matches=[pb.MatchStreamItem(request_id=first_id + i, match=r) for i, r in enumerate(reqs)]
    )


def _keys(*keys: int) -> pb.MatchRequest:
    return pb.MatchRequest(model=MODEL, block_keys=list(keys))


async def _read(
    call: grpc.aio.StreamStreamCall[Any, Any], n: int
) -> tuple[dict[int, pb.MatchStreamReply], list[list[int]]]:
    """Read responses until ``n`` replies came: the replies by id, and the ids of
    each response in the order read."""
    out: dict[int, pb.MatchStreamReply] = {}
    messages: list[list[int]] = []
    while len(out) < n:
        resp = await call.read()
        assert resp is not grpc.aio.EOF
        assert len(resp.replies) >= 1  # never an empty response
        messages.append([r.request_id for r in resp.replies])
        for r in resp.replies:
            assert r.request_id not in out  # one reply per Match
            out[r.request_id] = r
    assert len(out) == n
    return out, messages


async def _ask_all(
    call: grpc.aio.StreamStreamCall[Any, Any],
    reqs: Sequence[pb.MatchRequest],
    first_id: int = 1,
    *,
    together: bool = False,
) -> dict[int, pb.MatchStreamReply]:
    """Write every request (ids from ``first_id``), one message each or all in
    one (``together``), then read as many replies, by id."""
    if together:
        await call.write(_msg(first_id, *reqs))
    else:
        for i, r in enumerate(reqs):
            await call.write(_msg(first_id + i, r))
    return (await _read(call, len(reqs)))[0]


async def _assert_equal_to_unary(h: Harness) -> None:
    await _seed(h.stub)
    call = _call(h)
    n = len(QUERIES)
    # One Match to a message, then all of them in one message.
    for together, first_id in ((False, 1), (True, 1 + n)):
        replies = await _ask_all(call, QUERIES, first_id, together=together)
        assert sorted(replies) == list(range(first_id, first_id + n))
        for i, q in enumerate(QUERIES):
            unary = await h.stub.Match(q)
            r = replies[first_id + i]
            assert r.code == 0 and r.message == "" and r.field == ""
            assert r.HasField("match")
            assert r.match == unary, (together, i, q)
        assert len(replies[first_id].match.matches) == 3  # not trivially empty: w0, w1, w2
        assert len(replies[first_id + 4].match.matches) == 4  # the stale one too
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK


async def test_answers_equal_unary_memory(harness: Harness) -> None:
    assert harness.server.servicer.match_stream_inline  # memory: a message's Matches in turn
    await _assert_equal_to_unary(harness)


async def test_answers_equal_unary_memory_one_task_per_match(harness: Harness) -> None:
    harness.server.servicer.match_stream_inline = False
    await _assert_equal_to_unary(harness)


async def test_answers_equal_unary_redis(redis_server: Any) -> None:
    from indexer.redis.backend import RedisIndex

    index = RedisIndex(redis_server.url, prefix=f"t{uuid.uuid4().hex[:8]}")
    h = await open_harness(make_config(), index)
    try:
        assert not h.server.servicer.match_stream_inline  # redis: awaits I/O, one task each
        await _assert_equal_to_unary(h)
    finally:
        await close_harness(h)
        await index.close()


async def test_many_matches_in_one_message_answered_each_by_id(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _seed(harness.stub)
    # Inline Matches give the loop a turn once their budget is spent, and the
    # writer may then send the replies ready so far: on a loaded machine six
    # Matches outlast 2 ms. The budget is lifted so that the one-response claim
    # below is about coalescing, not about this machine's speed.
    monkeypatch.setattr(call_pacer(), "budget_s", 60.0)
    # Ids need not be consecutive nor ordered; 0 is an id like any other.
    ids = [0, 7, 3, 1 << 40, 99, 2]
    depth_of = {0: 4, 7: 1, 3: 2, 1 << 40: 3, 99: 0, 2: 4}
    msg = pb.MatchStreamRequest(
        matches=[
            pb.MatchStreamItem(
                request_id=rid,
                match=_keys(*(KEYS[: depth_of[rid]] if depth_of[rid] else [12345])),
            )
            for rid in ids
        ]
    )
    call = _call(harness)
    await call.write(msg)
    await call.write(pb.MatchStreamRequest())  # an empty message: nothing to answer
    replies, messages = await _read(call, len(ids))
    assert sorted(replies) == sorted(ids)
    for rid, r in replies.items():
        assert r.code == 0
        depths = {m.instance.worker_id: m.depth for m in r.match.matches}
        want = {w: min(d, depth_of[rid]) for w, d in (("w0", 4), ("w1", 2), ("w2", 1))}
        assert depths == {w: d for w, d in want.items() if d}, rid
    # The memory backend answers a message's Matches in turn: one response for them.
    assert len(messages) == 1
    await call.done_writing()
    assert await call.read() is grpc.aio.EOF  # the empty message got no reply
    assert await call.code() == grpc.StatusCode.OK


class GatedIndex(MemoryIndex):
    """A memory index whose Match waits: ``delays[keys[0]]`` seconds, or for ``gate``.

    Counts Matches running at once (``running``, ``peak``) and those cancelled.
    """

    def __init__(self) -> None:
        super().__init__()
        self.delays: dict[int, float] = {}
        self.gate: asyncio.Event | None = None
        self.running = 0
        self.peak = 0
        self.cancelled = 0

    async def match(
        self, namespace: Namespace, keys: Sequence[int], *, include_stale: bool = False
    ) -> list[InstanceMatch]:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(self.delays.get(keys[0], 0.0))
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        return self.match_sync(namespace, keys, include_stale=include_stale)


@pytest.fixture
async def gated() -> AsyncIterator[tuple[Harness, GatedIndex]]:
    index = GatedIndex()
    h = await open_harness(make_config(), index)
    try:
        yield h, index
    finally:
        await close_harness(h)


async def test_many_in_flight_answered_out_of_order(gated: tuple[Harness, GatedIndex]) -> None:
    h, index = gated
    await _seed(h.stub)
    n = 20
    # Match i waits (n - i) * 10 ms: the last sent is the first done.
    reqs = []
    for i in range(n):
        key = 1000 + i
        index.delays[key] = (n - i) * 0.01
        reqs.append(_keys(key))
    reqs.append(_keys(*KEYS))  # no delay: a real answer
    call = _call(h)
    await call.write(_msg(1, *reqs))  # all in one message
    replies, messages = await _read(call, len(reqs))
    order = [rid for m in messages for rid in m]
    for rid, resp in replies.items():
        assert resp.code == 0
        if rid == n + 1:
            assert [m.instance.worker_id for m in resp.match.matches] == ["w0", "w1", "w2"]
        else:
            assert resp.match.total_blocks == 1 and not resp.match.matches
    assert sorted(order) == list(range(1, n + 2))
    assert order != sorted(order)  # replies as they complete, not in request order
    assert order.index(n) < order.index(1)  # the shortest wait came back before the longest
    assert index.peak >= n // 2  # the Matches of one message ran at once, not one by one
    assert len(messages) > 1  # replies went out as they were ready, not all at the end
    call.cancel()


async def test_window_bounds_matches_in_flight(gated: tuple[Harness, GatedIndex]) -> None:
    h, index = gated
    h.server.servicer.match_stream_window = 4
    index.gate = asyncio.Event()
    call = _call(h)
    # Ten Matches in two messages: the window counts Matches, not messages.
    await call.write(_msg(1, *(_keys(i) for i in range(1, 8))))
    await call.write(_msg(8, *(_keys(i) for i in range(8, 11))))
    for _ in range(50):
        await asyncio.sleep(0.01)
        if index.running == 4:
            break
    await asyncio.sleep(0.05)
    assert index.running == 4  # the reader waits for a slot: the other six are not started
    index.gate.set()
    replies, _ = await _read(call, 10)
    assert sorted(replies) == list(range(1, 11))
    assert index.peak == 4
    call.cancel()


async def test_replies_coalesced_across_request_messages(
    gated: tuple[Harness, GatedIndex],
) -> None:
    h, index = gated
    index.gate = asyncio.Event()
    call = _call(h)
    for first in (1, 3, 5):  # three messages of two Matches
        await call.write(_msg(first, _keys(first), _keys(first + 1)))
    for _ in range(100):
        if index.running == 6:
            break
        await asyncio.sleep(0.01)
    assert index.running == 6
    index.gate.set()  # all six done in one turn of the loop: one response answers them
    replies, messages = await _read(call, 6)
    assert messages == [[1, 2, 3, 4, 5, 6]]
    assert all(r.code == 0 for r in replies.values())
    call.cancel()


async def test_bad_request_gets_an_error_reply_and_the_stream_goes_on(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    await _seed(harness.stub)
    # As in test_many_matches_in_one_message_answered_each_by_id: on a loaded
    # machine six inline Matches outlast the 2 ms budget, and the replies ready
    # by then go out first. The one-response claim below is about coalescing.
    monkeypatch.setattr(call_pacer(), "budget_s", 60.0)
    bad = {
        2: pb.MatchRequest(model=MODEL, token_ids=TOKENS, block_keys=[1, 2]),
        3: pb.MatchRequest(model="", token_ids=TOKENS),
        4: pb.MatchRequest(model=MODEL, token_ids=[1, 2, 3, -1, 5]),
        5: pb.MatchRequest(model=MODEL, token_ids=TOKENS, max_blocks=1 << 30),
    }
    good = pb.MatchRequest(model=MODEL, token_ids=TOKENS)
    call = _call(harness)
    reqs = [good, *bad.values(), good]
    # Errors and answers in one message, answered in one response.
    await call.write(_msg(1, *reqs))
    replies, messages = await _read(call, len(reqs))
    assert messages == [[1, 2, 3, 4, 5, 6]]
    for rid, req in bad.items():
        r = replies[rid]
        assert r.code == INVALID_ARGUMENT and not r.HasField("match"), r
        # Exactly what unary Match ends with: status, details, the field's metadata.
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await harness.stub.Match(req)
        err = info.value
        assert err.code().value[0] == r.code
        assert err.details() == r.message
        assert ("kvmesh-error-field", r.field) in tuple(err.trailing_metadata() or ())
    assert replies[2].field == "block_keys"
    assert replies[3].field == "model"
    assert replies[4].field == "token_ids[3]"
    assert replies[5].field == "max_blocks"
    for rid in (1, 6):
        assert replies[rid].code == 0 and len(replies[rid].match.matches) == 3
    # Still usable after the errors; an unset match is an empty MatchRequest.
    await call.write(pb.MatchStreamRequest(matches=[pb.MatchStreamItem(request_id=7)]))
    r = (await _read(call, 1))[0][7]
    assert (r.code, r.field) == (INVALID_ARGUMENT, "model")
    more = await _ask_all(call, [good], first_id=8)
    assert more[8].code == 0
    await call.done_writing()
    assert await call.code() == grpc.StatusCode.OK
    reg = harness.server.metrics.registry
    labels = {"method": "MatchStream.Match"}
    assert reg.get_sample_value("kvmesh_indexer_rpcs_total", {**labels, "code": "OK"}) == 3
    assert (
        reg.get_sample_value("kvmesh_indexer_rpcs_total", {**labels, "code": "INVALID_ARGUMENT"})
        == 5
    )


async def test_undecodable_frame_ends_the_stream_after_the_replies_in_flight(
    gated: tuple[Harness, GatedIndex],
) -> None:
    h, index = gated
    index.delays[5] = 0.1
    raw = h.channel.stream_stream("/kvmesh.indexer.v1.IndexerService/MatchStream")
    call: Any = raw()
    await call.write(_msg(9, _keys(5)).SerializeToString())
    await call.write(b"\xff\xff\xff")  # no request id can be read from it
    first = pb.MatchStreamResponse.FromString(await call.read())
    # Still answered, then the stream ends.
    assert [(r.request_id, r.code) for r in first.replies] == [(9, 0)]
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("kvmesh-error-field", "request") in tuple(await call.trailing_metadata() or ())
    assert h.server.guard.decode_errors["MatchStream"] == 1


async def test_half_close_writes_replies_in_flight_then_ends_ok(
    gated: tuple[Harness, GatedIndex],
) -> None:
    h, index = gated
    index.delays.update({1: 0.15, 2: 0.05})
    call = _call(h)
    await call.write(_msg(1, _keys(1), _keys(2)))
    await call.done_writing()  # before any reply
    got = [[r.request_id for r in resp.replies] async for resp in call]
    assert got == [[2], [1]]
    assert await call.code() == grpc.StatusCode.OK
    assert index.cancelled == 0


async def test_cancel_cancels_matches_in_flight(gated: tuple[Harness, GatedIndex]) -> None:
    h, index = gated
    index.gate = asyncio.Event()
    call = _call(h)
    await call.write(_msg(1, _keys(1), _keys(2)))
    await call.write(_msg(3, _keys(3)))
    for _ in range(100):
        if index.running == 3:
            break
        await asyncio.sleep(0.01)
    assert index.running == 3
    call.cancel()
    for _ in range(100):
        if index.cancelled == 3:
            break
        await asyncio.sleep(0.01)
    assert index.cancelled == 3 and index.running == 0
    # The server still serves new streams.
    index.gate.set()
    call2 = _call(h)
    replies = await _ask_all(call2, [pb.MatchRequest(model=MODEL, block_keys=[1])])
    assert replies[1].code == 0


async def test_match_rate_counts_each_streamed_match() -> None:
    h = await open_harness(
        make_config(limits={"per_client": {"match_rps": 0.001, "match_burst": 2}}), MemoryIndex()
    )
    try:
        call = _call(h)
        replies = await _ask_all(call, [_keys(1) for _ in range(3)], together=True)
        codes = sorted(r.code for r in replies.values())
        assert codes == [0, 0, RESOURCE_EXHAUSTED]
        refused = next(r for r in replies.values() if r.code)
        assert refused.field == "limits.per_client.match_rps"
    finally:
        await close_harness(h)


async def test_each_streamed_match_counts_against_max_concurrent_rpcs() -> None:
    index = GatedIndex()
    index.gate = asyncio.Event()
    # The stream is one call, its first Match a second; a third call is refused.
    h = await open_harness(make_config(limits={"max_concurrent_rpcs": 2}), index)
    try:
        call = _call(h)
        await call.write(_msg(1, _keys(1)))
        for _ in range(100):
            if index.running == 1:
                break
            await asyncio.sleep(0.01)
        await call.write(_msg(2, _keys(1)))
        r = (await _read(call, 1))[0][2]
        assert (r.request_id, r.code) == (2, RESOURCE_EXHAUSTED)
        assert r.field == "limits.max_concurrent_rpcs"
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await h.stub.Match(pb.MatchRequest(model=MODEL, block_keys=[1]))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        index.gate.set()
        r = (await _read(call, 1))[0][1]
        assert (r.request_id, r.code) == (1, 0)
        call.cancel()
    finally:
        await close_harness(h)


# -- the router client -----------------------------------------------------------------


def _streamed(h: Harness, code: str = "OK") -> float:
    v = h.server.metrics.registry.get_sample_value(
        "kvmesh_indexer_rpcs_total", {"method": "MatchStream.Match", "code": code}
    )
    return v or 0.0


def _unary(h: Harness) -> float:
    v = h.server.metrics.registry.get_sample_value(
        "kvmesh_indexer_rpcs_total", {"method": "Match", "code": "OK"}
    )
    return v or 0.0


async def test_router_client_uses_the_stream_by_default(harness: Harness) -> None:
    await _seed(harness.stub)
    assert IndexerClientSettings().match_stream is True
    client = IndexerClient(
        channel=harness.channel, model=MODEL, settings=IndexerClientSettings(deadline_ms=2000)
    )
    outs = await asyncio.gather(*(client.match(KEYS) for _ in range(30)))
    for out in outs:
        assert out.ok
        assert {w: m.depth for w, m in out.matches.items()} == {"w0": 4, "w1": 2, "w2": 1}
        assert out.matches["w2"].cpu_blocks == 1
    assert (client.streams_opened, client.unary_calls) == (1, 0)
    assert _streamed(harness) == 30 and _unary(harness) == 0
    assert client.calls[MatchStatus.OK] == 30
    await client.close()


async def test_router_client_setting_turns_the_stream_off(harness: Harness) -> None:
    await _seed(harness.stub)
    s = IndexerClientSettings(deadline_ms=2000, match_stream=False)
    client = IndexerClient(channel=harness.channel, model=MODEL, settings=s)
    assert (await client.match(KEYS)).matches["w0"].depth == 4
    assert (client.streams_opened, client.unary_calls) == (0, 1)
    assert _streamed(harness) == 0 and _unary(harness) == 1


class _LegacyServer:
    """A real grpc.aio server with IndexerService as before MatchStream, over a harness's
    servicer (same index), or with ``match_stream`` as its MatchStream handler."""

    def __init__(self, base: IndexerServer, match_stream: Any = None) -> None:
        servicer = base.servicer
        service = pb.DESCRIPTOR.services_by_name["IndexerService"]
        handlers = {}
        for m in service.methods:
            fn = getattr(servicer, m.name)
            if m.name == "MatchStream":
                if match_stream is None:
                    continue  # grpc answers UNIMPLEMENTED for a method it does not know
                fn = match_stream
            handlers[m.name] = HANDLER_FACTORIES[(m.client_streaming, m.server_streaming)](
                fn,
                request_deserializer=getattr(pb, m.input_type.name).FromString,
                response_serializer=_serialize,
            )
        self.server = grpc.aio.server()
        add_guarded(
            self.server,
            service.full_name,
            handlers,
            INDEXER_RULES,
            servicer.guard,
            observer=servicer.calls,
        )
        self.port = self.server.add_insecure_port("127.0.0.1:0")


@pytest.fixture
async def legacy(harness: Harness) -> AsyncIterator[tuple[Harness, grpc.aio.Channel]]:
    srv = _LegacyServer(harness.server)
    await srv.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        yield harness, channel
    finally:
        await channel.close()
        await srv.server.stop(0)


async def test_router_client_falls_back_to_unary_without_match_stream(
    legacy: tuple[Harness, grpc.aio.Channel],
) -> None:
    h, channel = legacy
    await _seed(h.stub)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        call = pb_stream(channel)
        await call.write(_msg(1, _keys(1)))
        await call.read()
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    client = IndexerClient(
        channel=channel, model=MODEL, settings=IndexerClientSettings(deadline_ms=2000)
    )
    # The first Matches meet UNIMPLEMENTED on the new stream and are re-sent unary.
    first = await asyncio.gather(*(client.match(KEYS) for _ in range(5)))
    assert all(o.ok and o.matches["w0"].depth == 4 for o in first)
    for _ in range(5):
        out = await client.match(KEYS)
        assert out.ok and out.matches["w0"].depth == 4
    assert client.streams_opened == 1  # not reopened for every Match
    assert client.unary_calls == 10 and _unary(h) == 10
    assert client.calls[MatchStatus.OK] == 10 and client.breaker.state == "closed"
    await client.close()


async def test_router_client_batches_concurrent_matches(harness: Harness) -> None:
    """Matches issued together go out in few messages: counted by the server, as read."""
    await _seed(harness.stub)
    sizes: list[int] = []  # Matches per message, as the server reads them
    servicer = harness.server.servicer

    async def counting(request_iterator: Any, context: Any) -> AsyncIterator[bytes]:
        async def counted() -> AsyncIterator[pb.MatchStreamRequest]:
            async for req in request_iterator:
                sizes.append(len(req.matches))
                yield req

        async for reply in servicer.MatchStream(counted(), context):
            yield reply

    srv = _LegacyServer(harness.server, counting)
    await srv.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        client = IndexerClient(
            channel=channel, model=MODEL, settings=IndexerClientSettings(deadline_ms=5000)
        )
        for wave in range(3):
            outs = await asyncio.gather(*(client.match(KEYS[: 1 + i % 4]) for i in range(40)))
            for i, out in enumerate(outs):  # each Match got its own reply
                assert out.ok, (wave, i, out)
                want = {"w0": 4, "w1": 2, "w2": 1}
                assert {w: m.depth for w, m in out.matches.items()} == {
                    w: min(d, 1 + i % 4) for w, d in want.items()
                }
        assert sum(sizes) == 120
        # One message per wave (the 40 are issued in one turn of the loop),
        # where one message per Match would be 120.
        assert len(sizes) <= 6, sizes
        assert client.stream_messages_sent == len(sizes)
        assert client.stream_messages_received < 120  # replies shared messages too
        assert (client.streams_opened, client.unary_calls, client.late_replies) == (1, 0, 0)
        assert _streamed(harness) == 120
        await client.close()
    finally:
        await channel.close()
        await srv.server.stop(0)


def pb_stream(channel: grpc.aio.Channel) -> grpc.aio.StreamStreamCall[Any, Any]:
    """A raw MatchStream call on ``channel``."""
    method = channel.stream_stream(
        "/kvmesh.indexer.v1.IndexerService/MatchStream",
        request_serializer=pb.MatchStreamRequest.SerializeToString,
        response_deserializer=pb.MatchStreamResponse.FromString,
    )
    return method()


async def test_router_client_resends_unary_when_the_stream_fails(harness: Harness) -> None:
    await _seed(harness.stub)
    seen: list[int] = []

    async def failing_stream(request_iterator: Any, context: Any) -> AsyncIterator[bytes]:
        async for req in request_iterator:
            seen.extend(m.request_id for m in req.matches)
            await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
        yield b""  # pragma: no cover - an async generator that never yields

    srv = _LegacyServer(harness.server, failing_stream)
    await srv.server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{srv.port}")
    try:
        client = IndexerClient(
            channel=channel, model=MODEL, settings=IndexerClientSettings(deadline_ms=2000)
        )
        out = await client.match(KEYS)
        assert out.ok and out.matches["w0"].depth == 4  # answered unary after the stream broke
        assert seen == [1] and client.streams_opened == 1 and client.unary_calls == 1
        assert client.breaker.state == "closed"
        await asyncio.sleep(0.25)  # past the first retry wait: a new stream is tried
        assert (await client.match(KEYS)).ok
        assert client.streams_opened == 2 and seen == [1, 1]
        await client.close()
    finally:
        await channel.close()
        await srv.server.stop(0)


async def test_router_client_deadline_on_the_stream(gated: tuple[Harness, GatedIndex]) -> None:
    h, index = gated
    await _seed(h.stub)
    index.delays[KEYS[0]] = 0.3
    s = IndexerClientSettings(deadline_ms=30, breaker_failures=2, breaker_cooldown_s=60)
    client = IndexerClient(channel=h.channel, model=MODEL, settings=s)
    assert (await client.match(KEYS)).status is MatchStatus.DEADLINE_EXCEEDED
    assert (await client.match(KEYS)).status is MatchStatus.DEADLINE_EXCEEDED
    assert (await client.match(KEYS)).status is MatchStatus.CIRCUIT_OPEN
    assert client.in_flight == 0
    await asyncio.sleep(0.45)  # both late replies came, and were dropped
    assert client.late_replies == 2
    assert (client.streams_opened, client.unary_calls) == (1, 0)  # the stream stayed up
    assert _streamed(h) == 2
    await client.close()


async def test_router_client_stream_in_flight_bound(gated: tuple[Harness, GatedIndex]) -> None:
    h, index = gated
    index.gate = asyncio.Event()
    s = IndexerClientSettings(deadline_ms=2000, max_in_flight=2)
    client = IndexerClient(channel=h.channel, model=MODEL, settings=s)
    tasks = [asyncio.create_task(client.match([1])) for _ in range(3)]
    await asyncio.sleep(0.1)
    index.gate.set()
    statuses = sorted(o.status.value for o in await asyncio.gather(*tasks))
    assert statuses == ["busy", "ok", "ok"]
    await client.close()


async def test_router_client_does_not_send_a_match_whose_deadline_passed_in_its_queue(
    gated: tuple[Harness, GatedIndex],
) -> None:
    """A Match still queued behind a blocked stream when its deadline passes is never sent.

    The server runs one Match at a time and it waits: the server stops reading,
    flow control stops the client's writes, and Matches queue in the client.
    Each is answered DEADLINE_EXCEEDED; those that had not been written by
    then must not reach the server later, to be run for nobody.
    """
    h, index = gated
    h.server.servicer.match_stream_window = 1
    index.gate = asyncio.Event()
    s = IndexerClientSettings(
        deadline_ms=200, breaker_failures=100_000, max_in_flight=100_000, match_stream=True
    )
    client = IndexerClient(channel=h.channel, model=MODEL, settings=s)
    n = 1000
    # About 40 kB each (4,000 64-bit keys): 40 MB, far more than the transport
    # buffers (grpc grows its flow-control window to several MB).
    prompts = [[(i << 40) + j + (1 << 63) for j in range(4000)] for i in range(n)]
    outcomes = await asyncio.gather(*(client.match(p) for p in prompts))
    assert {o.status for o in outcomes} == {MatchStatus.DEADLINE_EXCEEDED}
    assert client.unsent_expired > 0
    index.gate.set()
    # Let the server take whatever was written, until nothing more comes.
    seen, stable = -1.0, 0
    for _ in range(200):
        await asyncio.sleep(0.05)
        now = _streamed(h)
        stable = stable + 1 if now == seen else 0
        seen = now
        if stable >= 10:
            break
    # Each Match was sent or dropped unsent, and some were dropped: before, all n came.
    assert seen + client.unsent_expired == n
    assert seen < n
    await client.close()


class BusyIndex(MemoryIndex):
    """A memory index whose Match also computes for :data:`BUSY_S` first (a
    long prompt's Match), and logs the length of each Match's keys in order.
    Its Match still awaits nothing: MatchStream runs its Matches inline."""

    BUSY_S = 0.004

    def __init__(self) -> None:
        super().__init__()
        self.order: list[int] = []
        self.started = asyncio.Event()

    def match_sync(
        self,
        namespace: Namespace,
        keys: Sequence[int],
        *,
        include_stale: bool = False,
        include_predicted: bool = False,
    ) -> list[InstanceMatch]:
        self.order.append(len(keys))
        self.started.set()
        end = time.perf_counter() + self.BUSY_S
        while time.perf_counter() < end:
            pass
        return super().match_sync(
            namespace, keys, include_stale=include_stale, include_predicted=include_predicted
        )


async def test_a_long_message_of_inline_matches_lets_other_calls_in() -> None:
    """Between two inline Matches of one message the loop gets its turn: a unary
    Match sent once the message's first Match ran is answered before its last.

    The test's client shares the server's loop, so before the change it could
    not even send until the whole message had run (the unary Match came last).
    """
    index = BusyIndex()
    h = await open_harness(make_config(), index)
    try:
        await _seed(h.stub)
        assert server_inline(h)
        n = 40
        call = _call(h)
        index.order.clear()
        await call.write(_msg(1, *([_keys(*KEYS)] * n)))
        await index.started.wait()
        await h.stub.Match(_keys(KEYS[0]), timeout=30)
        replies, _ = await _read(call, n)
        call.cancel()
        assert all(r.code == 0 for r in replies.values())
        assert sorted(index.order) == [1] + [len(KEYS)] * n
        assert index.order.index(1) < n, index.order  # not after the whole message
    finally:
        await close_harness(h)


def server_inline(h: Harness) -> bool:
    """Whether the harness's servicer runs MatchStream's Matches inline."""
    return bool(h.server.servicer.match_stream_inline)


async def test_inline_matches_do_not_wait_at_event_works_gate() -> None:
    """Inline Matches give way to other calls, not to event work: with the
    event work's budget spent and its gate not yet open (a long piece of
    ingest holds it), a message of Matches is still answered. Before, each
    inline Match paced at that gate, two loop turns each time it was shut,
    turns that last 10 to 20 ms while a fleet's first batches are ingested."""
    h = await open_harness(make_config(), MemoryIndex())
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    pacer = loop_pacer()
    try:
        await _seed(h.stub)
        assert server_inline(h)
        call = _call(h)
        pacer._gate = gate  # event work spent the budget; its gate stays shut
        await call.write(_msg(1, *([_keys(*KEYS)] * 3)))
        replies, _ = await asyncio.wait_for(_read(call, 3), 5)
        call.cancel()
        assert sorted(replies) == [1, 2, 3]
        assert all(r.code == 0 and r.match.matches for r in replies.values())
    finally:
        pacer._gate = None
        gate.set_result(None)
        await close_harness(h)
