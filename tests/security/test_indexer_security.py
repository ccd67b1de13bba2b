"""Tests that try to get into the indexer: mTLS, identities, roles, ownership, limits.

Every server here runs with mutual TLS and the test policy (tests/security/pki.py)
unless the test is about something else; clients dial with real certificates.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from indexer.config import IndexerConfig
from indexer.server import IndexerServer, start_server
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2 as spb
from kvmesh.api.kv_indexer.v1 import kv_indexer_pb2_grpc as spb_grpc
from kvmesh.tls import ChannelFactory, ClientTLS
from lab.devcerts import Authority
from tests.grpc.conftest import BLOCK, MODEL, batch, expect_status, ref, stored
from tests.security.pki import ADMIN_TOKEN, ROUTER_TOKEN, Pki

A = list(range(1, 1 + BLOCK))


def config(pki: Pki, **over: Any) -> IndexerConfig:
    base: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "block_size": BLOCK,
        "shutdown_grace_s": 0.5,
        "tls": pki.server_tls(),
        "auth": {"policy_file": pki.policy},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return IndexerConfig.model_validate(base)


@pytest.fixture
async def server(pki: Pki) -> AsyncIterator[IndexerServer]:
    s = await start_server(config(pki))
    try:
        yield s
    finally:
        await s.stop(0)


class Caller:
    """A channel and stubs presenting one identity."""

    def __init__(self, target: str, tls: dict[str, Any] | None) -> None:
        self.factory = ChannelFactory(
            target, ClientTLS.model_validate(tls) if tls is not None else None
        )
        self.channel = self.factory.channel()
        self.stub = pb_grpc.IndexerServiceStub(self.channel)
        self.sglang = spb_grpc.KVIndexerStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


@pytest.fixture
async def callers(pki: Pki, server: IndexerServer) -> AsyncIterator[Any]:
    made: list[Caller] = []

    def make(name: str | None, **extra: Any) -> Caller:
        tls = {**pki.client_tls(name), **extra}
        c = Caller(server.address, tls)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


async def register(stub: Any, worker: str, **kw: Any) -> Any:
    return await stub.RegisterInstance(
        pb.RegisterInstanceRequest(instance=ref(worker), model=MODEL, **kw), timeout=5
    )


def refusals(server: IndexerServer, method: str, code: str) -> float:
    v = server.metrics.refusals.labels(method, code)._value.get()
    return float(v)


# -- transport -------------------------------------------------------------------------


async def test_client_without_certificate_is_refused_at_handshake(
    pki: Pki, server: IndexerServer, callers: Any
) -> None:
    anon = callers(None)
    await expect_status(anon.stub.Ping(pb.PingRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
    # The server is still up for a client with a certificate.
    assert await callers("router-a").stub.Ping(pb.PingRequest(), timeout=5) is not None


async def test_certificate_from_another_ca_is_refused(pki: Pki, server: IndexerServer) -> None:
    rogue = Caller(
        server.address,
        {"ca_file": pki.ca, "cert_file": pki.rogue_cert(), "key_file": pki.rogue_key()},
    )
    try:
        await expect_status(
            rogue.stub.Match(pb.MatchRequest(model=MODEL, token_ids=A), timeout=5),
            grpc.StatusCode.UNAVAILABLE,
        )
    finally:
        await rogue.close()


async def test_client_refuses_a_server_signed_by_another_ca(pki: Pki) -> None:
    s = await start_server(
        config(
            pki,
            tls={
                "cert_file": str(Path(pki.rogue_ca).parent / "server.crt"),
                "key_file": str(Path(pki.rogue_ca).parent / "server.key"),
                "client_ca_file": pki.ca,
            },
        )
    )
    c = Caller(s.address, pki.client_tls("router-a"))
    try:
        await expect_status(c.stub.Ping(pb.PingRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE)
    finally:
        await c.close()
        await s.stop(0)


async def test_plaintext_client_cannot_talk_to_tls_server(server: IndexerServer) -> None:
    plain = Caller(server.address, None)
    try:
        await expect_status(
            plain.stub.Ping(pb.PingRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE
        )
    finally:
        await plain.close()


# -- roles and ownership -----------------------------------------------------------------


async def test_engine_publishes_only_for_its_own_instances(
    server: IndexerServer, callers: Any
) -> None:
    a = callers("engine-a").stub
    b = callers("engine-b").stub
    await register(a, "engine-a-0")
    await register(b, "engine-b-0")
    # Register, publish (unary and stream), heartbeat for another engine's instance.
    err = await expect_status(register(a, "engine-b-1"), grpc.StatusCode.PERMISSION_DENIED)
    assert "engine-a" in (err.details() or "") and "engine-b-1" in (err.details() or "")
    await expect_status(
        a.PublishEvents(
            pb.PublishEventsRequest(batch=batch(1, stored([1], A), worker="engine-b-0")),
            timeout=5,
        ),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    await expect_status(
        a.Heartbeat(pb.HeartbeatRequest(instance=ref("engine-b-0")), timeout=5),
        grpc.StatusCode.PERMISSION_DENIED,
    )

    async def frames() -> AsyncIterator[pb.PublishEventsStreamRequest]:
        yield pb.PublishEventsStreamRequest(batch=batch(1, stored([7], A), worker="engine-b-0"))
        yield pb.PublishEventsStreamRequest(batch=batch(1, stored([8], A), worker="engine-a-0"))

    acks = [r.ack async for r in a.PublishEventsStream(frames(), timeout=5)]
    assert [x.outcome for x in acks] == [pb.BATCH_OUTCOME_REJECTED, pb.BATCH_OUTCOME_APPLIED]
    assert acks[0].error.code == grpc.StatusCode.PERMISSION_DENIED.value[0]
    # Nothing of engine-b-0 was written by engine-a; its own publish worked.
    dump = await server.index.dump()
    holders = {i.worker_id for keys in dump.blocks.values() for h in keys.values() for i in h}
    assert holders == {"engine-a-0"}
    assert refusals(server, "RegisterInstance", "PERMISSION_DENIED") == 1
    assert refusals(server, "PublishEventsStream", "PERMISSION_DENIED") == 1


async def test_router_may_match_but_not_remove_or_publish(
    server: IndexerServer, callers: Any
) -> None:
    eng = callers("engine-a").stub
    router = callers("router-a").stub
    await register(eng, "engine-a-0")
    await eng.PublishEvents(
        pb.PublishEventsRequest(batch=batch(1, stored([1], A), worker="engine-a-0")), timeout=5
    )
    resp = await router.Match(pb.MatchRequest(model=MODEL, token_ids=A), timeout=5)
    assert [m.instance.worker_id for m in resp.matches] == ["engine-a-0"]
    err = await expect_status(
        router.RemoveInstance(pb.RemoveInstanceRequest(instance=ref("engine-a-0")), timeout=5),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    assert "router-a" in (err.details() or "") and "admin" in (err.details() or "")
    await expect_status(register(router, "engine-a-9"), grpc.StatusCode.PERMISSION_DENIED)
    # An engine may not Match (it is not a router).
    await expect_status(
        eng.Match(pb.MatchRequest(model=MODEL, token_ids=A), timeout=5),
        grpc.StatusCode.PERMISSION_DENIED,
    )
    # The admin may remove it.
    admin = callers("admin").stub
    removed = await admin.RemoveInstance(
        pb.RemoveInstanceRequest(instance=ref("engine-a-0")), timeout=5
    )
    assert removed.blocks_removed == 1
    assert refusals(server, "RemoveInstance", "PERMISSION_DENIED") == 1


async def test_certificate_not_in_policy_is_denied(server: IndexerServer, callers: Any) -> None:
    s = callers("stranger").stub
    err = await expect_status(
        s.Ping(pb.PingRequest(), timeout=5), grpc.StatusCode.PERMISSION_DENIED
    )
    assert "spiffe://kvmesh/stranger/x" in (err.details() or "")
    # Health stays open (probes present no identity).
    h = callers("stranger").health
    assert (await h.Check(health_pb2.HealthCheckRequest(), timeout=5)).status == 1


async def test_sglang_api_applies_only_owned_workers(server: IndexerServer, callers: Any) -> None:
    a = callers("engine-a").sglang

    def apply(worker: str) -> Any:
        return a.ApplyExternalKvBatch(
            spb.ApplyExternalKvBatchRequest(
                worker_id=worker,
                worker_address="http://x:1",
                seq=1,
                actions=[
                    spb.ExternalKvAction(type=spb.ACTION_REPORT, tier=spb.TIER_HBM, hashes=[11, 12])
                ],
            ),
            timeout=5,
        )

    await apply("engine-a-7")
    await expect_status(apply("engine-b-7"), grpc.StatusCode.PERMISSION_DENIED)
    # Routers may match through it; engines may not configure workers (admin only).
    await expect_status(
        a.ConfigureExpectedWorkers(spb.ConfigureExpectedWorkersRequest(), timeout=5),
        grpc.StatusCode.PERMISSION_DENIED,
    )


# -- bearer tokens -------------------------------------------------------------------------


async def test_bearer_tokens_over_tls(pki: Pki, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    s = await start_server(config(pki, tls={"client_auth": "optional"}))
    made: list[Caller] = []
    try:

        def caller(token: str | None) -> Caller:
            tls: dict[str, Any] = {"ca_file": pki.ca}
            if token is not None:
                tls["token_file"] = pki.token_file(token)
            c = Caller(s.address, tls)
            made.append(c)
            return c

        router = caller(ROUTER_TOKEN).stub
        await router.Match(pb.MatchRequest(model=MODEL, token_ids=A), timeout=5)
        await expect_status(
            router.RemoveInstance(pb.RemoveInstanceRequest(instance=ref("x")), timeout=5),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        admin = caller(ADMIN_TOKEN).stub
        await expect_status(
            admin.RemoveInstance(pb.RemoveInstanceRequest(instance=ref("x")), timeout=5),
            grpc.StatusCode.NOT_FOUND,  # authorized: the instance just does not exist
        )
        err = await expect_status(
            caller("not-a-token").stub.Ping(pb.PingRequest(), timeout=5),
            grpc.StatusCode.UNAUTHENTICATED,
        )
        assert "not-a-token" not in (err.details() or "")
        await expect_status(
            caller(None).stub.Ping(pb.PingRequest(), timeout=5),
            grpc.StatusCode.UNAUTHENTICATED,
        )
        assert s.authorizer.refusals[("Ping", "UNAUTHENTICATED")] == 2
        # Refusals are logged (who, what), never with a token.
        refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
        assert any("UNAUTHENTICATED Ping refused" in m for m in refused), refused
        assert any(
            "PERMISSION_DENIED RemoveInstance refused for router-token" in m for m in refused
        )
        for token in (ADMIN_TOKEN, ROUTER_TOKEN, "not-a-token"):
            assert token not in caplog.text
    finally:
        for c in made:
            await c.close()
        await s.stop(0)


async def test_token_over_plaintext_is_refused(pki: Pki) -> None:
    s = await start_server(config(pki, tls={"cert_file": "", "key_file": "", "client_ca_file": ""}))
    ch = grpc.aio.insecure_channel(s.address)
    try:
        stub = pb_grpc.IndexerServiceStub(ch)
        err = await expect_status(
            stub.Ping(pb.PingRequest(), metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),)),
            grpc.StatusCode.UNAUTHENTICATED,
        )
        assert "TLS" in (err.details() or "")
        assert ADMIN_TOKEN not in (err.details() or "")
    finally:
        await ch.close()
        await s.stop(0)


# -- certificate reload -----------------------------------------------------------------------


async def test_server_certificate_reload_without_restart(pki: Pki, tmp_path: Path) -> None:
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.crt", "server.key"):
        shutil.copy(Path(pki.root) / name, live / name)
    s = await start_server(
        config(
            pki,
            tls={
                "cert_file": str(live / "server.crt"),
                "key_file": str(live / "server.key"),
                "reload_interval_s": 0.05,
            },
        )
    )
    try:
        old = Caller(s.address, pki.client_tls("router-a"))
        await old.stub.Ping(pb.PingRequest(), timeout=5)
        await old.close()
        # Rotate to a certificate from a new CA (the new CA also signs nothing else).
        new_ca = Authority("rotated server CA")
        issued = new_ca.issue("server", ["localhost", "127.0.0.1"])
        (tmp_path / "new-ca.crt").write_bytes(new_ca.cert_pem)
        (live / "server.key.tmp").write_bytes(issued.key_pem)
        (live / "server.crt.tmp").write_bytes(issued.cert_pem)
        (live / "server.key.tmp").replace(live / "server.key")
        (live / "server.crt.tmp").replace(live / "server.crt")
        await asyncio.sleep(0.1)
        trusting_new = Caller(
            s.address,
            {
                "ca_file": str(tmp_path / "new-ca.crt"),
                "cert_file": pki.cert("router-a"),
                "key_file": pki.key("router-a"),
            },
        )
        trusting_old = Caller(s.address, pki.client_tls("router-a"))
        try:
            # The first handshake after the interval picks the new files up.
            for _ in range(20):
                try:
                    await trusting_new.stub.Ping(pb.PingRequest(), timeout=2)
                    break
                except grpc.aio.AioRpcError:
                    await asyncio.sleep(0.1)
            await trusting_new.stub.Ping(pb.PingRequest(), timeout=5)
            await expect_status(
                trusting_old.stub.Ping(pb.PingRequest(), timeout=5), grpc.StatusCode.UNAVAILABLE
            )
            assert s.tls_reloader.reloads >= 1
        finally:
            await trusting_new.close()
            await trusting_old.close()
        # A broken file keeps the last good certificate.
        (live / "server.crt").write_text("not a certificate")
        await asyncio.sleep(0.1)
        again = Caller(
            s.address,
            {
                "ca_file": str(tmp_path / "new-ca.crt"),
                "cert_file": pki.cert("router-a"),
                "key_file": pki.key("router-a"),
            },
        )
        try:
            await again.stub.Ping(pb.PingRequest(), timeout=5)
            assert s.tls_reloader.reload_failures >= 1
        finally:
            await again.close()
    finally:
        await s.stop(0)


async def test_policy_reload_grants_new_identity(pki: Pki, tmp_path: Path) -> None:
    import yaml

    policy = tmp_path / "policy.yaml"
    policy.write_text(Path(pki.policy).read_text())  # noqa: ASYNC240
    s = await start_server(
        config(pki, auth={"policy_file": str(policy), "reload_interval_s": 0.05})
    )
    c = Caller(s.address, pki.client_tls("stranger"))
    try:
        await expect_status(
            c.stub.Ping(pb.PingRequest(), timeout=5), grpc.StatusCode.PERMISSION_DENIED
        )
        doc = yaml.safe_load(policy.read_text())
        doc["identities"].append(
            {"name": "stranger", "roles": ["router"], "san": ["spiffe://kvmesh/stranger/*"]}
        )
        policy.write_text(yaml.safe_dump(doc))
        await asyncio.sleep(0.1)
        await c.stub.Ping(pb.PingRequest(), timeout=5)
        # A broken policy keeps the last good one.
        policy.write_text("identities: [{name: x}]")
        await asyncio.sleep(0.1)
        await c.stub.Ping(pb.PingRequest(), timeout=5)
        assert s.authorizer.reload_failures >= 1
    finally:
        await c.close()
        await s.stop(0)


async def test_revoking_an_engine_ends_the_stream_it_opened_before(
    pki: Pki, tmp_path: Path
) -> None:
    """A publish stream opened before its identity left the policy applies nothing after."""
    import yaml

    policy = tmp_path / "policy.yaml"
    policy.write_text(Path(pki.policy).read_text())  # noqa: ASYNC240
    s = await start_server(
        config(pki, auth={"policy_file": str(policy), "reload_interval_s": 0.05})
    )
    c = Caller(s.address, pki.client_tls("engine-a"))
    try:
        await register(c.stub, "engine-a-0")
        call = c.stub.PublishEventsStream(timeout=10)
        first = batch(1, stored([1], A), worker="engine-a-0")
        await call.write(pb.PublishEventsStreamRequest(batch=first))
        assert (await call.read()).ack.outcome == pb.BATCH_OUTCOME_APPLIED
        # The operator revokes engine-a while its stream stays open.
        doc = yaml.safe_load(policy.read_text())
        doc["identities"] = [i for i in doc["identities"] if i["name"] != "engine-a"]
        policy.write_text(yaml.safe_dump(doc))
        await asyncio.sleep(0.2)
        second = batch(2, stored([2], A, parent=1), worker="engine-a-0")
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await call.write(pb.PublishEventsStreamRequest(batch=second))
            await call.done_writing()
            while (resp := await call.read()) is not grpc.aio.EOF:
                assert resp.ack.outcome != pb.BATCH_OUTCOME_APPLIED, "a revoked engine applied"
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await c.close()
        await s.stop(0)


async def test_revoking_a_router_ends_the_watch_it_opened_before(pki: Pki, tmp_path: Path) -> None:
    """A WatchIndex (a server stream that only sends) opened before its identity
    left the policy ends PERMISSION_DENIED before it sends another change."""
    import yaml

    policy = tmp_path / "policy.yaml"
    policy.write_text(Path(pki.policy).read_text())  # noqa: ASYNC240
    s = await start_server(
        config(pki, auth={"policy_file": str(policy), "reload_interval_s": 0.05})
    )
    router = Caller(s.address, pki.client_tls("router-a"))
    engine = Caller(s.address, pki.client_tls("engine-a"))
    try:
        await register(engine.stub, "engine-a-0")
        watch = router.stub.WatchIndex(pb.WatchIndexRequest(), timeout=20)
        first = await watch.read()
        # The snapshot (one instance) and WatchSynced, in one response.
        assert [c.WhichOneof("change") for c in first.changes] == ["snapshot", "synced"]
        doc = yaml.safe_load(policy.read_text())
        doc["identities"] = [i for i in doc["identities"] if i["name"] != "router-a"]
        policy.write_text(yaml.safe_dump(doc))
        await asyncio.sleep(0.5)  # reloaded, and past the stream's recheck interval
        await engine.stub.PublishEvents(
            pb.PublishEventsRequest(batch=batch(0, stored([1], A), worker="engine-a-0"))
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            while (resp := await watch.read()) is not grpc.aio.EOF:
                kinds = [c.WhichOneof("change") for c in resp.changes]
                assert "batch" not in kinds, "a revoked router was sent a change"
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await router.close()
        await engine.close()
        await s.stop(0)


async def test_a_connection_that_never_starts_tls_is_closed(pki: Pki) -> None:
    s = await start_server(config(pki, limits={"handshake_timeout_s": 0.5}))
    host, port = s.address.rsplit(":", 1)
    try:
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            # No ClientHello: the server gives up on the handshake and closes.
            assert await asyncio.wait_for(reader.read(), 5.0) == b""
        finally:
            writer.close()
    finally:
        await s.stop(0)


async def test_connections_that_never_start_tls_hold_at_most_the_cap(pki: Pki) -> None:
    """200 connections that never send a ClientHello, against a cap of 16: the
    server holds 16 file descriptors for them (closing the others as it accepts
    them), and a real client gets in once the handshake timeout frees a slot."""
    s = await start_server(config(pki, limits={"handshake_timeout_s": 1.0, "max_connections": 16}))
    host, port = s.address.rsplit(":", 1)
    socks: list[socket.socket] = []

    def fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    base = fds()
    caller = None
    try:
        for _ in range(200):
            socks.append(socket.create_connection((host, int(port))))
        await asyncio.sleep(0.5)
        held = fds() - base - len(socks)  # our own ends are len(socks) of them
        assert held <= 16 + 2, held  # the cap (+ what the server may open meanwhile)
        caller = Caller(s.address, pki.client_tls("router-a"))
        resp = await caller.stub.GetStats(pb.GetStatsRequest(), timeout=10, wait_for_ready=True)
        assert resp is not None
    finally:
        for c in socks:
            c.close()
        if caller is not None:
            await caller.close()
        await s.stop(0)


# -- health port ---------------------------------------------------------------------------------


async def test_plaintext_health_port_serves_only_health(pki: Pki) -> None:
    from lab.redisproc import free_port

    s = await start_server(config(pki, health_port=free_port()))
    ch = grpc.aio.insecure_channel(f"127.0.0.1:{s.health_port}")
    try:
        h = health_pb2_grpc.HealthStub(ch)
        resp = await h.Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        await expect_status(
            pb_grpc.IndexerServiceStub(ch).Match(pb.MatchRequest(model=MODEL), timeout=5),
            grpc.StatusCode.UNIMPLEMENTED,
        )
    finally:
        await ch.close()
        await s.stop(0)


# -- limits ------------------------------------------------------------------------------------


async def test_flooding_client_is_limited_and_another_is_not(pki: Pki) -> None:
    s = await start_server(config(pki, limits={"per_client": {"match_rps": 20, "match_burst": 20}}))
    flood = Caller(s.address, pki.client_tls("router-a"))
    calm = Caller(s.address, pki.client_tls("router-b"))
    try:
        req = pb.MatchRequest(model=MODEL, token_ids=A * 64)
        results = await asyncio.gather(
            *(flood.stub.Match(req, timeout=10) for _ in range(200)), return_exceptions=True
        )
        codes = [
            r.code() if isinstance(r, grpc.aio.AioRpcError) else grpc.StatusCode.OK for r in results
        ]
        assert grpc.StatusCode.RESOURCE_EXHAUSTED in codes
        assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.RESOURCE_EXHAUSTED}

        # While router-a keeps flooding, every call of router-b succeeds within its deadline.
        async def flood_forever() -> None:
            while True:
                await asyncio.gather(
                    *(flood.stub.Match(req, timeout=10) for _ in range(50)), return_exceptions=True
                )

        task = asyncio.create_task(flood_forever())
        try:
            for _ in range(15):
                await calm.stub.Match(req, timeout=2)
        finally:
            task.cancel()
        refused = s.guard.limit_refusals
        assert refused.get(("Match", "match_rps"), 0) > 0
        assert refusals(s, "Match", "RESOURCE_EXHAUSTED") == refused[("Match", "match_rps")]
    finally:
        await flood.close()
        await calm.close()
        await s.stop(0)


async def test_in_flight_cap_per_client(pki: Pki) -> None:
    # An open stream counts as one call in flight for its whole life.
    s = await start_server(config(pki, limits={"per_client": {"max_in_flight": 2}}))
    a = Caller(s.address, pki.client_tls("engine-a"))
    b = Caller(s.address, pki.client_tls("engine-b"))
    try:
        await register(a.stub, "engine-a-0")
        streams = []
        for seq in (1, 2):
            st = a.stub.PublishEventsStream(timeout=10)
            await st.write(
                pb.PublishEventsStreamRequest(
                    batch=batch(seq, stored([seq], A), worker="engine-a-0")
                )
            )
            await st.read()  # its ack: the stream is open on the server
            streams.append(st)
        err = await expect_status(
            a.stub.Heartbeat(pb.HeartbeatRequest(instance=ref("engine-a-0")), timeout=5),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        md = dict(err.trailing_metadata() or ())
        assert md.get("kvmesh-error-field") == "limits.per_client.max_in_flight"
        # Another client is not affected.
        await register(b.stub, "engine-b-0")
        for st in streams:
            await st.done_writing()
            assert await st.code() == grpc.StatusCode.OK
        # The calls ended: room again.
        await a.stub.Heartbeat(pb.HeartbeatRequest(instance=ref("engine-a-0")), timeout=5)
    finally:
        await a.close()
        await b.close()
        await s.stop(0)


async def test_match_rate_limit_names_the_limit(pki: Pki) -> None:
    s = await start_server(config(pki, limits={"per_client": {"match_rps": 0.5, "match_burst": 3}}))
    c = Caller(s.address, pki.client_tls("router-a"))
    other = Caller(s.address, pki.client_tls("router-b"))
    try:
        req = pb.MatchRequest(model=MODEL, token_ids=A)
        for _ in range(3):
            await c.stub.Match(req, timeout=5)
        err = await expect_status(c.stub.Match(req, timeout=5), grpc.StatusCode.RESOURCE_EXHAUSTED)
        md = dict(err.trailing_metadata() or ())
        assert md.get("kvmesh-error-field") == "limits.per_client.match_rps"
        await other.stub.Match(req, timeout=5)  # its own bucket
    finally:
        await c.close()
        await other.close()
        await s.stop(0)


async def test_publish_rate_limit_on_streams_rejects_batches(pki: Pki) -> None:
    s = await start_server(
        config(pki, limits={"per_client": {"publish_rps": 0.5, "publish_burst": 2}})
    )
    c = Caller(s.address, pki.client_tls("engine-a"))
    try:
        await register(c.stub, "engine-a-0")

        async def frames() -> AsyncIterator[pb.PublishEventsStreamRequest]:
            for seq in (1, 2, 3):
                yield pb.PublishEventsStreamRequest(
                    batch=batch(seq, stored([seq], A), worker="engine-a-0")
                )

        acks = [r.ack async for r in c.stub.PublishEventsStream(frames(), timeout=5)]
        assert [a.outcome for a in acks][:2] == [pb.BATCH_OUTCOME_APPLIED] * 2
        assert acks[2].outcome == pb.BATCH_OUTCOME_REJECTED
        assert acks[2].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert acks[2].error.field == "limits.per_client.publish_rps"
    finally:
        await c.close()
        await s.stop(0)


async def test_namespace_and_instance_limits(pki: Pki) -> None:
    s = await start_server(
        config(pki, limits={"max_namespaces": 2, "max_instances_per_namespace": 2})
    )
    # An engine's registrations are held to the fleet's caps (an admin's are not:
    # tests/security/test_quotas.py, test_fleet_caps_leave_the_operator_headroom).
    c = Caller(s.address, pki.client_tls("engine-a"))
    try:
        for w in ("engine-a-a", "engine-a-b"):
            await register(c.stub, w)
        err = await expect_status(
            register(c.stub, "engine-a-c"), grpc.StatusCode.RESOURCE_EXHAUSTED
        )
        assert "max_instances_per_namespace" in (err.details() or "")
        await register(c.stub, "engine-a-a")  # a re-registration adds nothing
        await c.stub.RegisterInstance(
            pb.RegisterInstanceRequest(instance=ref("engine-a-m2"), model="second"), timeout=5
        )
        err = await expect_status(
            c.stub.RegisterInstance(
                pb.RegisterInstanceRequest(instance=ref("engine-a-m3"), model="third"), timeout=5
            ),
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        )
        assert "max_namespaces" in (err.details() or "")
        listed = await c.stub.ListInstances(pb.ListInstancesRequest(), timeout=5)
        assert sorted(i.instance.worker_id for i in listed.instances) == [
            "engine-a-a",
            "engine-a-b",
            "engine-a-m2",
        ]
    finally:
        await c.close()
        await s.stop(0)


async def test_only_admins_dump_the_index(server: IndexerServer, callers: Any) -> None:
    eng = callers("engine-a").stub
    await register(eng, "engine-a-0")
    await register(eng, "engine-a-1")
    b = list(range(100, 100 + BLOCK))
    await eng.PublishEvents(
        pb.PublishEventsRequest(
            batch=batch(1, stored([1], A), stored([2], b, parent=1), worker="engine-a-0")
        ),
        timeout=5,
    )
    await eng.PublishEvents(
        pb.PublishEventsRequest(
            batch=batch(1, stored([1], A, tier=pb.TIER_CPU), worker="engine-a-1")
        ),
        timeout=5,
    )
    admin = callers("admin").stub
    resps = [r async for r in admin.DumpIndex(pb.DumpIndexRequest(), timeout=5)]
    blocks = [blk for r in resps for blk in r.blocks]
    assert not any(r.truncated for r in resps)
    assert len(blocks) == 2 and {blk.model for blk in blocks} == {MODEL}
    holders = sorted((h.instance.worker_id, tuple(h.tiers)) for blk in blocks for h in blk.holders)
    assert holders == [
        ("engine-a-0", (pb.TIER_GPU,)),
        ("engine-a-0", (pb.TIER_GPU,)),
        ("engine-a-1", (pb.TIER_CPU,)),
    ]
    cut = [r async for r in admin.DumpIndex(pb.DumpIndexRequest(max_blocks=1), timeout=5)]
    assert sum(len(r.blocks) for r in cut) == 1 and cut[-1].truncated
    other = [r async for r in admin.DumpIndex(pb.DumpIndexRequest(model="other"), timeout=5)]
    assert sum(len(r.blocks) for r in other) == 0
    for who in ("router-a", "engine-a"):
        call = callers(who).stub.DumpIndex(pb.DumpIndexRequest(), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            async for _ in call:
                pass
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert refusals(server, "DumpIndex", "PERMISSION_DENIED") == 2


async def test_streams_per_connection_cap_holds_calls_in_the_client(pki: Pki) -> None:
    # HTTP/2 MAX_CONCURRENT_STREAMS: a third call on one connection waits in the
    # client until one of the two open ones ends; nothing is refused.
    s = await start_server(config(pki, limits={"max_streams_per_connection": 2}))
    a = Caller(s.address, pki.client_tls("engine-a"))
    try:
        await register(a.stub, "engine-a-0")
        open_streams = []
        for seq in (1, 2):
            st = a.stub.PublishEventsStream(timeout=20)
            await st.write(
                pb.PublishEventsStreamRequest(
                    batch=batch(seq, stored([seq], A), worker="engine-a-0")
                )
            )
            await st.read()
            open_streams.append(st)
        third = asyncio.ensure_future(
            a.stub.Heartbeat(pb.HeartbeatRequest(instance=ref("engine-a-0")), timeout=20)
        )
        done, _ = await asyncio.wait({third}, timeout=1.0)
        assert not done  # held by the connection's stream limit, not answered
        first = open_streams.pop(0)
        await first.done_writing()
        assert await first.code() == grpc.StatusCode.OK
        resp = await asyncio.wait_for(third, timeout=10)  # now it goes through
        assert resp.lease_expires_at > 0
        for st in open_streams:
            await st.done_writing()
        assert not s.guard.limit_refusals
    finally:
        await a.close()
        await s.stop(0)
