"""The router's IndexerClient over TLS: mutual TLS and a policy, fail-open, bearer tokens, rotation.

Every indexer here is a real server on a free 127.0.0.1 port with the test
PKI (tests/security/pki.py); the client dials it with ``settings.tls``.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from indexer.config import IndexerConfig
from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec
from indexer.server import IndexerServer, start_server
from kvmesh.tls import ClientTLS
from lab.devcerts import Authority
from router_client import (
    ConfigError,
    IndexerClient,
    IndexerClientSettings,
    MatchStatus,
    Router,
    RouteRequest,
    load_config,
    parse_config,
)
from tests.security.pki import IDENTITIES, ROUTER_TOKEN, Pki

MODEL = "tls/model"
KEYS = [11, 12, 13]
#: Generous: a first call includes the TCP connection and the TLS handshake.
DEADLINE_MS = 5000.0


async def _start(tls: dict[str, Any], pki: Pki, port: int = 0) -> IndexerServer:
    server = await start_server(
        IndexerConfig.model_validate(
            {
                "host": "127.0.0.1",
                "port": port,
                "metrics_port": 0,
                "block_size": 4,
                "shutdown_grace_s": 1.0,
                "tls": tls,
                "auth": {"policy_file": pki.policy},
            }
        )
    )
    # Blocks held by one engine instance, stored past the service (no caller identity).
    await server.index.register(InstanceSpec(InstanceId("engine-a-0"), MODEL, lease_ttl_s=600))
    ev = BlockStored(block_hashes=tuple(KEYS), block_size=4, block_keys=tuple(KEYS))
    await server.index.apply(EventBatch(InstanceId("engine-a-0"), 1, (ev,)))
    return server


@pytest.fixture
async def mtls_indexer(pki: Pki) -> AsyncIterator[IndexerServer]:
    """An indexer requiring client certificates of the fleet CA, with the test policy."""
    server = await _start(pki.server_tls(), pki)
    try:
        yield server
    finally:
        await server.stop(0)


@pytest.fixture
async def token_indexer(pki: Pki) -> AsyncIterator[IndexerServer]:
    """An indexer over TLS where a client certificate is optional (bearer tokens)."""
    server = await _start({**pki.server_tls(), "client_auth": "optional"}, pki)
    try:
        yield server
    finally:
        await server.stop(0)


def _client(address: str, tls: dict[str, Any], **settings: Any) -> IndexerClient:
    s = IndexerClientSettings.model_validate({"deadline_ms": DEADLINE_MS, **settings, "tls": tls})
    return IndexerClient(address, settings=s, model=MODEL)


async def test_match_with_the_router_certificate(pki: Pki, mtls_indexer: IndexerServer) -> None:
    client = _client(mtls_indexer.address, pki.client_tls("router-a"))
    try:
        out = await client.match([*KEYS, 14])
        assert out.status is MatchStatus.OK
        assert out.matches["engine-a-0"].depth == 3
        assert client.channels_opened == 1
    finally:
        await client.close()
    assert client.channels_closed == 1


async def test_an_engine_certificate_may_not_match(pki: Pki, mtls_indexer: IndexerServer) -> None:
    # PERMISSION_DENIED is a misconfiguration, not an outage: ERROR, breaker untouched.
    client = _client(mtls_indexer.address, pki.client_tls("engine-a"), breaker_failures=1)
    try:
        assert (await client.match(KEYS)).status is MatchStatus.ERROR
        assert (await client.match(KEYS)).status is MatchStatus.ERROR
        assert client.breaker.state == "closed"
    finally:
        await client.close()


async def test_without_a_client_certificate_the_router_fails_open(
    pki: Pki, mtls_indexer: IndexerServer
) -> None:
    """The refused handshake counts as an indexer failure; routing goes on by load."""
    client = _client(
        mtls_indexer.address,
        pki.client_tls(None),
        deadline_ms=2000,
        breaker_failures=2,
        breaker_cooldown_s=600,
    )
    try:
        # The bound is generous; the point is that match() returns rather than waits.
        first = await asyncio.wait_for(client.match(KEYS), timeout=30)
        assert first.status in (MatchStatus.UNAVAILABLE, MatchStatus.DEADLINE_EXCEEDED)
        assert first.matches == {}
        second = await asyncio.wait_for(client.match(KEYS), timeout=30)
        assert second.status in (MatchStatus.UNAVAILABLE, MatchStatus.DEADLINE_EXCEEDED)
        assert client.breaker.state == "open"
        router = Router(
            workers=["engine-a-0", "engine-b-0"],
            indexer=client,
            block_size=4,
            registry=CollectorRegistry(),
            seed=0,
        )
        d = await router.route(RouteRequest(1, 12, block_keys=KEYS), decode=False)
        assert d.prefill.reason == "indexer_unavailable"
        assert client.calls[MatchStatus.CIRCUIT_OPEN] == 1
    finally:
        await client.close()


async def test_bearer_token_over_tls(pki: Pki, token_indexer: IndexerServer) -> None:
    good = _client(
        token_indexer.address, {"ca_file": pki.ca, "token_file": pki.token_file(ROUTER_TOKEN)}
    )
    bad = _client(
        token_indexer.address,
        {"ca_file": pki.ca, "token_file": pki.token_file("not-a-known-token")},
        breaker_failures=1,
    )
    try:
        out = await good.match(KEYS)
        assert out.status is MatchStatus.OK and out.matches["engine-a-0"].depth == 3
        # UNAUTHENTICATED: an error of this router's setup, not an outage.
        assert (await bad.match(KEYS)).status is MatchStatus.ERROR
        assert bad.breaker.state == "closed"
    finally:
        await good.close()
        await bad.close()


def _read(path: str) -> bytes:
    return Path(path).read_bytes()


def _replace(path: Path, data: bytes) -> None:
    """Swap ``path``'s content in one rename, as a Secret update does."""
    tmp = path.with_name(path.name + ".new")
    tmp.write_bytes(data)
    os.replace(tmp, path)


async def test_rotated_certificate_moves_calls_to_a_new_channel(pki: Pki, tmp_path: Path) -> None:
    """New files → a new channel presenting them; the old channel closes; calls keep working.

    The router's certificate is replaced by one for the same identity from a
    second CA, which the server trusts besides the fleet CA. Then the server
    restarts trusting only the second CA: every connection is made anew, and
    only one presenting the rotated certificate can succeed.
    """
    second = Authority("kvmesh second CA")
    both, only_second = tmp_path / "both-ca.crt", tmp_path / "second-ca.crt"
    _replace(both, _read(pki.ca) + second.cert_pem)
    _replace(only_second, second.cert_pem)
    server = await _start({**pki.server_tls(), "client_ca_file": str(both)}, pki)
    port = server.port
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copyfile(pki.cert("router-a"), cert)
    shutil.copyfile(pki.key("router-a"), key)
    tls = {
        "ca_file": pki.ca,
        "cert_file": str(cert),
        "key_file": str(key),
        "reload_interval_s": 0.01,
    }
    client = _client(server.address, tls, deadline_ms=2000)
    old_identity = _client(server.address, pki.client_tls("router-a"), deadline_ms=2000)
    try:
        assert (await client.match(KEYS)).ok
        assert client.channels_opened == 1

        # The router's certificate is rotated: same identity, the second CA.
        issued = second.issue("router-a", IDENTITIES["router-a"])
        _replace(cert, issued.cert_pem)
        _replace(key, issued.key_pem)
        await asyncio.sleep(0.05)  # past the client's reload interval

        # Calls go on over the old channel while the new one connects, then move.
        assert (await client.match(KEYS)).ok
        assert client.channels_opened == 2
        for _ in range(600):
            if client.channels_closed == 1:
                break
            assert (await client.match(KEYS)).ok
            await asyncio.sleep(0.05)
        assert client.channels_closed == 1, "the old channel was not retired"
        assert (await client.match(KEYS)).ok
        # Not one call failed because of the rotation.
        assert client.calls[MatchStatus.UNAVAILABLE] == 0
        assert client.calls[MatchStatus.DEADLINE_EXCEEDED] == 0

        # The server restarts on the same port trusting only the second CA.
        await server.stop(0)
        server = await _start({**pki.server_tls(), "client_ca_file": str(only_second)}, pki, port)
        assert (await old_identity.match(KEYS)).status is MatchStatus.UNAVAILABLE
        out = await client.match(KEYS)
        for _ in range(100):  # the channel may be in reconnect backoff from the restart
            if out.ok:
                break
            await asyncio.sleep(0.1)
            out = await client.match(KEYS)
        assert out.status is MatchStatus.OK and out.matches["engine-a-0"].depth == 3
        assert client.channels_opened == 2
    finally:
        await client.close()
        await old_identity.close()
        await server.stop(0)
    assert client.channels_closed == 2


async def test_rotation_waits_for_a_complete_pair(pki: Pki, tmp_path: Path) -> None:
    """A certificate whose key is not written yet is not used; the pair is, once complete."""
    server = await _start(pki.server_tls(), pki)
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copyfile(pki.cert("router-a"), cert)
    shutil.copyfile(pki.key("router-a"), key)
    tls = {
        "ca_file": pki.ca,
        "cert_file": str(cert),
        "key_file": str(key),
        "reload_interval_s": 0.01,
    }
    client = _client(server.address, tls, deadline_ms=2000)
    try:
        assert (await client.match(KEYS)).ok
        _replace(cert, _read(pki.cert("router-b")))  # key still router-a's
        await asyncio.sleep(0.05)
        assert (await client.match(KEYS)).ok  # old channel, no new one
        assert client.channels_opened == 1
        _replace(key, _read(pki.key("router-b")))
        await asyncio.sleep(0.05)
        assert (await client.match(KEYS)).ok
        assert client.channels_opened == 2
    finally:
        await client.close()
        await server.stop(0)


def test_router_config_carries_the_indexer_tls(pki: Pki, tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text(f"model: m\nindexer:\n  tls:\n    ca_file: {pki.ca}\n")
    env = {
        "KVMESH_ROUTER_INDEXER__TLS__CERT_FILE": pki.cert("router-a"),
        "KVMESH_ROUTER_INDEXER__TLS__KEY_FILE": pki.key("router-a"),
        "KVMESH_ROUTER_INDEXER__DEADLINE_MS": "7",
    }
    cfg = load_config(path, environ=env)
    assert cfg.indexer.tls == ClientTLS(
        ca_file=pki.ca, cert_file=pki.cert("router-a"), key_file=pki.key("router-a")
    )
    assert cfg.indexer.deadline_ms == 7 and cfg.indexer.tls.active
    assert not load_config(path, environ={}).indexer.tls.cert_file
    with pytest.raises(ConfigError) as e:
        parse_config({"indexer": {"tls": {"cert_file": pki.cert("router-a")}}})
    assert e.value.field == "indexer.tls"
    with pytest.raises(ConfigError) as e:
        load_config(path, environ={"KVMESH_ROUTER_INDEXER__TLS__CA": "x"})
    assert e.value.field == "indexer.tls.ca"
