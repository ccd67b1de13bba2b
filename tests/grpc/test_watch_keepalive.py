"""A follower whose WatchIndex stream stalls goes out of sync within its silence bound.

A replica sends a keepalive (WatchIndexResponse.keepalive) on a stream idle
for WatchIndexRequest.keepalive_ms, only when the follower has read every
change; an IndexFollower that heard nothing for max_silence_s on a stream
whose replica sends keepalives answers no Match (its caller asks the
indexer) and opens the stream again (IndexFollower.stalls).

Real parts: an in-process memory replica on a loopback port, a real
IndexFollower, and for the stall the fault harness's TCP relay
(lab/faults/fleet.py Proxy), which stops relaying towards the follower
without closing anything: the black-holed path or stuck replica a follower
cannot tell from a quiet one. A follower broken on purpose (its bound
ignored) keeps answering from its stale copy through the stall and fails.
A replica that predates keepalives is played by a client interceptor that
drops keepalive_ms from the request (what such a replica does with it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest

from indexer.memory import MemoryIndex
from indexer.model import BlockStored, EventBatch, InstanceId
from indexer.server import WATCH_KEEPALIVE_MIN_MS
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from lab.faults.fleet import Proxy
from router_client.follower import RECEIVE_OPTIONS, IndexFollower
from tests.grpc.conftest import Harness, close_harness, make_config, open_harness
from tests.integration.test_zmq_subscriber import eventually

W0 = InstanceId("w0", 0)
#: Keepalive interval and silence bound of the stall tests (ms, s).
KEEPALIVE_MS = 100
SILENCE_S = 0.5
#: Room past the bound for a loaded machine's event loop, seconds.
SLACK_S = 0.5


@pytest.fixture
async def replica() -> AsyncIterator[Harness]:
    """A memory replica with w0/dp0 of model m registered."""
    h = await open_harness(make_config(), MemoryIndex())
    try:
        await h.stub.RegisterInstance(
            pb.RegisterInstanceRequest(
                instance=pb.InstanceRef(worker_id="w0", dp_rank=0),
                model="m",
                address="http://w0-0",
                lease_ttl_seconds=60,
                incarnation="i",
            )
        )
        yield h
    finally:
        await close_harness(h)


async def _store(h: Harness, hashes: range, sequence: int = 0) -> tuple[int, ...]:
    """Store ``hashes`` on w0 at the replica in the batch of ``sequence``; their keys."""
    keys = tuple(hashes)
    index = h.server.index
    assert isinstance(index, MemoryIndex)
    stored = BlockStored(block_hashes=tuple(hashes), block_keys=keys)
    await index.apply(EventBatch(W0, sequence, (stored,)))
    return keys


def _depth(f: IndexFollower, keys: tuple[int, ...]) -> int | None:
    """The depth w0 holds of ``keys`` as the follower answers (None: it does not)."""
    got = f.match("m", "", keys)
    if got is None:
        return None
    hit = got.matches.get("w0")
    return hit.depth if hit is not None else 0


async def test_an_idle_stream_gets_keepalives_and_stays_in_sync(replica: Harness) -> None:
    """An idle second: keepalives about every interval, the follower in sync
    throughout, no stall, no reconnect; a change still arrives at once."""
    f = IndexFollower(replica.server.address, keepalive_ms=KEEPALIVE_MS, max_silence_s=0.3)
    try:
        await f.start()
        assert await f.wait_synced(5)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            assert f.synced
            await asyncio.sleep(0.02)
        assert 5 <= f.keepalives <= 12
        assert f.stalls == 0 and f.reconnects == 0
        keys = await _store(replica, range(1, 5))
        await eventually(lambda: _depth(f, keys) == 4, within=2.0)
    finally:
        await f.close()


#: A keepalive interval long enough that a change held until the next one is
#: told from a loaded machine's delay (ms).
LONG_KEEPALIVE_MS = 3000


async def test_a_change_is_sent_at_once_not_with_the_next_keepalive(replica: Harness) -> None:
    """Just after a keepalive the next is LONG_KEEPALIVE_MS away: a change made
    then must reach the follower well before it (a replica that held changes
    for the keepalive would take the whole interval)."""
    f = IndexFollower(replica.server.address, keepalive_ms=LONG_KEEPALIVE_MS, max_silence_s=30.0)
    try:
        await f.start()
        assert await f.wait_synced(5)
        seen = f.keepalives
        await eventually(lambda: f.keepalives > seen, within=2 * LONG_KEEPALIVE_MS / 1e3)
        keys = await _store(replica, range(1, 5))
        t1 = time.monotonic()
        await eventually(lambda: _depth(f, keys) == 4, within=LONG_KEEPALIVE_MS / 1e3)
        assert time.monotonic() - t1 < LONG_KEEPALIVE_MS / 1e3 / 3
        assert f.stalls == 0 and f.reconnects == 0
    finally:
        await f.close()


async def test_the_replica_raises_a_short_interval_and_sends_none_unasked(
    replica: Harness,
) -> None:
    """keepalive_ms 1 is kept as WATCH_KEEPALIVE_MIN_MS (no busy loop): the
    snapshot's end announces it and the next keepalive comes that much later.
    A request without keepalive_ms gets none (the old behaviour)."""
    call = replica.stub.WatchIndex(pb.WatchIndexRequest(keepalive_ms=1))
    first = await call.read()
    assert isinstance(first, pb.WatchIndexResponse)
    assert first.changes[-1].WhichOneof("change") == "synced"
    assert first.keepalive.interval_ms == WATCH_KEEPALIVE_MIN_MS
    t0 = time.monotonic()
    second = await call.read()
    took = time.monotonic() - t0
    assert isinstance(second, pb.WatchIndexResponse)
    assert not second.changes and second.keepalive.interval_ms == WATCH_KEEPALIVE_MIN_MS
    assert WATCH_KEEPALIVE_MIN_MS / 1000 * 0.8 <= took < 1.0
    assert second.keepalive.position == replica.server.index.watch.position  # type: ignore[attr-defined]
    call.cancel()

    plain = replica.stub.WatchIndex(pb.WatchIndexRequest())
    first = await plain.read()
    assert isinstance(first, pb.WatchIndexResponse)
    assert not first.HasField("keepalive")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.5):
            await plain.read()
    plain.cancel()


class _IgnoresSilence(IndexFollower):
    """Broken on purpose: it asks for keepalives but never bounds the silence."""

    def silence_bound(self, keepalive: pb.WatchKeepalive) -> float | None:
        return None


async def _stall(h: Harness, cls: type[IndexFollower]) -> float:
    """Follow ``h`` through a relay, stall it, and return how long the follower
    kept answering; then check it resyncs, with what changed meanwhile, once
    the relay flows again. AssertionError when it answers past the bound."""
    proxy = await Proxy(lambda: h.server.port, lambda: 0).start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{proxy.port}", options=RECEIVE_OPTIONS)
    f = cls(channel=channel, keepalive_ms=KEEPALIVE_MS, max_silence_s=SILENCE_S)
    try:
        keys = await _store(h, range(1, 5))
        await f.start()
        assert await f.wait_synced(5)
        await eventually(lambda: _depth(f, keys) == 4, within=2.0)
        proxy.stall()
        t0 = time.monotonic()
        more = await _store(h, range(5, 9), 1)  # the stalled follower cannot see these
        try:
            await eventually(lambda: _depth(f, keys + more) is None, within=SILENCE_S + SLACK_S)
        except AssertionError:
            raise AssertionError(f"answered from a stalled stream past {SILENCE_S}s") from None
        answered_s = time.monotonic() - t0
        assert f.stalls == 1 and not f.synced
        await asyncio.sleep(0.3)
        assert _depth(f, keys) is None  # still out of sync while nothing flows
        proxy.resume()
        await eventually(lambda: _depth(f, keys + more) == 8, within=5.0)
        assert f.reconnects >= 1 and f.snapshots >= 2
        return answered_s
    finally:
        await f.close()
        await channel.close()
        await proxy.close()


async def test_a_stalled_stream_puts_the_follower_out_of_sync_within_the_bound(
    replica: Harness,
) -> None:
    """Stalled, the follower stops answering within max_silence_s (plus the
    loop's slack), stays out of sync, and resyncs once the stream flows."""
    answered_s = await _stall(replica, IndexFollower)
    print(f"answered for {answered_s:.3f}s after the stall")
    assert answered_s <= SILENCE_S + SLACK_S


async def test_a_follower_that_ignores_the_bound_fails_the_stall(replica: Harness) -> None:
    """The broken follower keeps answering from its stale copy while stalled."""
    with pytest.raises(AssertionError, match="answered from a stalled stream"):
        await _stall(replica, _IgnoresSilence)


class _DropKeepalive(grpc.aio.UnaryStreamClientInterceptor):
    """What a replica that predates keepalives does with keepalive_ms: nothing."""

    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        if isinstance(request, pb.WatchIndexRequest):
            request = pb.WatchIndexRequest(
                models=request.models,
                max_buffer=request.max_buffer,
                instance_parts=request.instance_parts,
            )
        return await continuation(client_call_details, request)


async def test_a_replica_without_keepalives_is_not_cut_off(replica: Harness) -> None:
    """No keepalive ever arrives: the bound does not apply, a quiet stream
    stays in sync well past max_silence_s."""
    channel = grpc.aio.insecure_channel(
        replica.server.address, options=RECEIVE_OPTIONS, interceptors=[_DropKeepalive()]
    )
    f = IndexFollower(channel=channel, keepalive_ms=KEEPALIVE_MS, max_silence_s=0.2)
    try:
        await f.start()
        assert await f.wait_synced(5)
        await asyncio.sleep(1.0)
        assert f.synced and f.keepalives == 0 and f.stalls == 0 and f.reconnects == 0
    finally:
        await f.close()
        await channel.close()
