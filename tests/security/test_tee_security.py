"""Tests that try to get into the tee and the cache simulator: mTLS, identities, roles, reload.

Servers run with mutual TLS and the test policy (tests/security/pki.py) unless
the test is about something else: routers may offer to the tee; tees (and
routers) may feed the simulator; routers read its report; engines and
strangers may do neither. Clients dial with real certificates.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.api.tee.v1 import tee_pb2 as pb
from kvmesh.api.tee.v1 import tee_pb2_grpc as pb_grpc
from kvmesh.tls import ChannelFactory, ClientTLS, TLSFileError
from lab.bench.testsink import TestSink
from lab.devcerts import Authority
from tee.cachesim.cli import report as report_cli
from tee.cachesim.config import CacheSimConfig, load_cachesim_config
from tee.cachesim.server import CacheSimServer
from tee.cli import config_from_argv
from tee.config import ConfigError, TeeConfig, load_tee_config
from tee.events import EventKind, ingest
from tee.httpsec import ClientSSL
from tee.logic import Tee
from tee.metrics import LaneStats
from tee.server import TeeServer
from tee.sinks import GrpcSink, HttpSink, Sink
from tests.security.pki import ROUTER_TOKEN, Pki

BLOCK = 4
PROMPT = list(range(4 * BLOCK))
#: Every test channel gets its own connections: a reused connection would
#: skip the handshake a test is about.
OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]


def _ev(request_id: str, worker: str = "w0") -> pb.RoutedEvent:
    return pb.RoutedEvent(
        kind=pb.EVENT_KIND_INGEST,
        model="m",
        input_ids=PROMPT,
        request_id=request_id,
        worker=worker,
    )


def ctls(pki: Pki, name: str) -> ClientTLS:
    """A client's TLS presenting ``name``'s certificate."""
    return ClientTLS.model_validate(pki.client_tls(name))


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        out[k] = {**out[k], **v} if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def sim_config(pki: Pki, **over: Any) -> CacheSimConfig:
    base: dict[str, Any] = {
        "http_port": 0,
        "grpc_port": 0,
        "block_size": BLOCK,
        "shutdown_grace_s": 0.5,
        "tls": pki.server_tls(),
        "auth": {"policy_file": pki.policy},
    }
    return CacheSimConfig.model_validate(_merge(base, over))


def tee_config(pki: Pki, sinks: list[dict[str, Any]], **over: Any) -> TeeConfig:
    base: dict[str, Any] = {
        "port": 0,
        "metrics_port": 0,
        "sinks": sinks,
        "shutdown_deadline_s": 1,
        "tls": pki.server_tls(),
        "auth": {"policy_file": pki.policy},
    }
    return TeeConfig.model_validate(_merge(base, over))


class Caller:
    """A channel presenting one identity (or none) with the tee and simulator stubs."""

    def __init__(self, target: str, tls: dict[str, Any] | None) -> None:
        client_tls = ClientTLS.model_validate(tls) if tls is not None else None
        self.channel = ChannelFactory(target, client_tls, options=OWN_CONNECTIONS).channel()
        self.tee = pb_grpc.TeeServiceStub(self.channel)
        self.sim = pb_grpc.CacheSimServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def close(self) -> None:
        await self.channel.close()


@pytest.fixture
async def callers() -> AsyncIterator[Callable[[str, dict[str, Any] | None], Caller]]:
    made: list[Caller] = []

    def make(target: str, tls: dict[str, Any] | None) -> Caller:
        c = Caller(target, tls)
        made.append(c)
        return c

    try:
        yield make
    finally:
        for c in made:
            await c.close()


@pytest.fixture
async def sim(pki: Pki) -> AsyncIterator[CacheSimServer]:
    server = await CacheSimServer(sim_config(pki)).start()
    try:
        yield server
    finally:
        await server.stop(0)


async def expect_code(call: Any, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    assert info.value.code() == code, info.value.details()
    return info.value


async def until(cond: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


def settled(s: LaneStats) -> bool:
    return s.queued == 0 and s.in_flight == 0


def refusals(registry: Any, service: str, method: str, code: str) -> float:
    value = registry.get_sample_value(
        f"kvmesh_{service}_refusals_total", {"method": method, "code": code}
    )
    return float(value or 0.0)


# -- the whole path, as processes -------------------------------------------------------------


def kvmesh_command() -> list[str]:
    script = Path(sys.executable).with_name("kvmesh")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kvmesh.cli"]


async def start_process(
    args: list[str], pattern: str, env: dict[str, str] | None = None
) -> tuple[Any, re.Match[str], list[str]]:
    """Start ``kvmesh *args``; return it, the match of ``pattern`` in its log, and the log."""
    proc = await asyncio.create_subprocess_exec(
        *kvmesh_command(),
        *args,
        stderr=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    assert proc.stderr is not None
    lines: list[str] = []
    while True:
        line = (await asyncio.wait_for(proc.stderr.readline(), 30)).decode()
        assert line, f"kvmesh {args[0]} exited before serving: {lines}"
        lines.append(line)
        m = re.search(pattern, line)
        if m:
            return proc, m, lines


async def stop_process(proc: Any) -> int:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
        try:
            return int(await asyncio.wait_for(proc.wait(), 30))
        except TimeoutError:
            proc.kill()
            await proc.wait()
    return int(proc.returncode)


async def test_router_offers_reach_the_mtls_simulator_through_the_tls_grpc_sink(
    pki: Pki, callers: Callable[[str, dict[str, Any] | None], Caller]
) -> None:
    """Router -> tee (mTLS, env config) -> gRPC sink as `tee` -> simulator (mTLS, flags)."""
    sim_proc, m, sim_log = await start_process(
        [
            "cachesim", "serve", "--host", "127.0.0.1", "--http-port", "0", "--grpc-port", "0",
            "--block-size", str(BLOCK), "--tls-cert", pki.cert("server"),
            "--tls-key", pki.key("server"), "--tls-client-ca", pki.ca,
            "--auth-policy", pki.policy,
        ],
        r"cachesim serving HTTP on (\S+), gRPC on (127\.0\.0\.1:\d+)",
    )  # fmt: skip
    sim_url, sim_addr = m.group(1), m.group(2)
    tee_proc = None
    try:
        assert sim_url.startswith("https://")
        sink = {"type": "grpc", "target": sim_addr, "name": "sim", "tls": pki.client_tls("tee")}
        tee_proc, m, tee_log = await start_process(
            ["tee", "serve", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0"],
            r"tee serving on (127\.0\.0\.1:\d+)",
            env={
                "KVMESH_TEE_TLS__CERT_FILE": pki.cert("server"),
                "KVMESH_TEE_TLS__KEY_FILE": pki.key("server"),
                "KVMESH_TEE_TLS__CLIENT_CA_FILE": pki.ca,
                "KVMESH_TEE_AUTH__POLICY_FILE": pki.policy,
                "KVMESH_TEE_SINKS": json.dumps([sink]),
            },
        )
        tee_addr = m.group(1)
        for log in (sim_log, tee_log):
            assert not any("PLAINTEXT" in line or "authorization is OFF" in line for line in log)

        router = callers(tee_addr, pki.client_tls("router-a"))
        resp = await router.tee.OfferEvents(
            pb.OfferEventsRequest(events=[_ev("a"), _ev("b"), _ev("c", worker="w1")]), timeout=10
        )
        assert resp.accepted == 3

        async def sent() -> int:
            return (await router.tee.GetTeeStats(pb.GetTeeStatsRequest(), timeout=5)).sinks[0].sent

        deadline = time.monotonic() + 10
        while await sent() < 3:
            assert time.monotonic() < deadline, "the tee did not deliver"
            await asyncio.sleep(0.05)
        # The simulator counted them, as a router reading its report sees.
        reader = callers(sim_addr, pki.client_tls("router-a"))
        rep = (await reader.sim.GetReport(pb.GetReportRequest(model="m"), timeout=5)).models[0]
        assert rep.total.requests == 3 and rep.workers == 2
        assert rep.total.routed.hit_blocks == 4  # "b" hit "a"'s blocks on w0
        # Neither server lets a client without a certificate in.
        for addr in (tee_addr, sim_addr):
            anon = callers(addr, {"ca_file": pki.ca})
            await expect_code(
                anon.tee.GetTeeStats(pb.GetTeeStatsRequest(), timeout=5),
                grpc.StatusCode.UNAVAILABLE,
            )
        # The tee's own identity feeds the simulator but may not read its report.
        tee_identity = callers(sim_addr, pki.client_tls("tee"))
        await expect_code(
            tee_identity.sim.GetReport(pb.GetReportRequest(), timeout=5),
            grpc.StatusCode.PERMISSION_DENIED,
        )
        # The report CLI over https with a router certificate.
        code = await asyncio.to_thread(
            report_cli,
            ["--url", sim_url, "--json", "--ca-file", pki.ca,
             "--cert-file", pki.cert("router-a"), "--key-file", pki.key("router-a")],
        )  # fmt: skip
        assert code == 0
        assert await stop_process(tee_proc) == 0
        assert await stop_process(sim_proc) == 0
    finally:
        if tee_proc is not None and tee_proc.returncode is None:
            tee_proc.kill()
            await tee_proc.wait()
        if sim_proc.returncode is None:
            sim_proc.kill()
            await sim_proc.wait()


# -- who may call the tee ---------------------------------------------------------------------


async def test_tee_admits_routers_only(
    pki: Pki, callers: Callable[[str, dict[str, Any] | None], Caller]
) -> None:
    sink = await TestSink().start()
    server = await TeeServer(tee_config(pki, [{"type": "http", "url": sink.url}])).start()
    try:
        addr = server.address
        registry = server.tee.metrics.registry
        offer = pb.OfferEventsRequest(events=[_ev("x")])

        # No certificate, or one from another CA: refused in the handshake.
        anon = callers(addr, {"ca_file": pki.ca})
        await expect_code(anon.tee.OfferEvents(offer, timeout=5), grpc.StatusCode.UNAVAILABLE)
        rogue = callers(
            addr, {"ca_file": pki.ca, "cert_file": pki.rogue_cert(), "key_file": pki.rogue_key()}
        )
        await expect_code(rogue.tee.OfferEvents(offer, timeout=5), grpc.StatusCode.UNAVAILABLE)
        # A plaintext client does not get a TLS port to talk to.
        plain = callers(addr, None)
        await expect_code(plain.tee.OfferEvents(offer, timeout=5), grpc.StatusCode.UNAVAILABLE)

        # Verified identities without the router role: refused by the policy.
        for name in ("engine-a", "stranger"):
            c = callers(addr, pki.client_tls(name))
            err = await expect_code(
                c.tee.OfferEvents(offer, timeout=5), grpc.StatusCode.PERMISSION_DENIED
            )
            assert name in (err.details() or "") or "not in the policy" in (err.details() or "")

            async def stream() -> AsyncIterator[pb.StreamEventsRequest]:
                yield pb.StreamEventsRequest(events=[_ev("s")])

            await expect_code(
                c.tee.StreamEvents(stream(), timeout=5), grpc.StatusCode.PERMISSION_DENIED
            )
            await expect_code(
                c.tee.GetTeeStats(pb.GetTeeStatsRequest(), timeout=5),
                grpc.StatusCode.PERMISSION_DENIED,
            )
        assert refusals(registry, "tee", "OfferEvents", "PERMISSION_DENIED") == 2
        assert refusals(registry, "tee", "StreamEvents", "PERMISSION_DENIED") == 2
        assert server.tee.stats()[0].offered == 0

        # A router is in; health is open to any certificate holder.
        router = callers(addr, pki.client_tls("router-a"))
        assert (await router.tee.OfferEvents(offer, timeout=5)).accepted == 1
        await until(lambda: sink.count == 1)
        stranger = callers(addr, pki.client_tls("stranger"))
        h = await stranger.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        # A router bearer token over TLS, without a client certificate, is not enough
        # when certificates are required.
        token = callers(addr, {"ca_file": pki.ca, "token_file": pki.token_file(ROUTER_TOKEN)})
        await expect_code(token.tee.OfferEvents(offer, timeout=5), grpc.StatusCode.UNAVAILABLE)
    finally:
        await server.stop(0)
        await sink.stop()


async def test_tee_health_port_is_plaintext_and_health_only(
    pki: Pki, callers: Callable[[str, dict[str, Any] | None], Caller]
) -> None:
    sink = await TestSink().start()
    server = await TeeServer(
        tee_config(pki, [{"type": "http", "url": sink.url}], health_port=_free_port())
    ).start()
    try:
        probe = callers(f"127.0.0.1:{server.health_port}", None)
        h = await probe.health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        await expect_code(
            probe.tee.OfferEvents(pb.OfferEventsRequest(events=[_ev("x")]), timeout=5),
            grpc.StatusCode.UNIMPLEMENTED,
        )
    finally:
        await server.stop(0)
        await sink.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- who may feed the simulator ---------------------------------------------------------------


async def test_simulator_grpc_roles(
    pki: Pki, sim: CacheSimServer, callers: Callable[[str, dict[str, Any] | None], Caller]
) -> None:
    offer = pb.OfferEventsRequest(events=[_ev("a")])
    for name in ("tee", "router-a", "admin"):
        c = callers(sim.grpc_address, pki.client_tls(name))
        assert (await c.tee.OfferEvents(offer, timeout=5)).accepted == 1
    for name in ("engine-a", "stranger"):
        c = callers(sim.grpc_address, pki.client_tls(name))
        await expect_code(c.tee.OfferEvents(offer, timeout=5), grpc.StatusCode.PERMISSION_DENIED)
    tee_id = callers(sim.grpc_address, pki.client_tls("tee"))
    await expect_code(
        tee_id.sim.GetReport(pb.GetReportRequest(), timeout=5), grpc.StatusCode.PERMISSION_DENIED
    )
    assert sim.sim.events[EventKind.INGEST] == 3
    assert refusals(sim.registry, "cachesim", "OfferEvents", "PERMISSION_DENIED") == 2
    assert refusals(sim.registry, "cachesim", "GetReport", "PERMISSION_DENIED") == 1


async def test_sink_tls_failures_are_counted_never_raised(pki: Pki, sim: CacheSimServer) -> None:
    """A sink that cannot get in fails its sends; offer() stays a plain True."""
    sinks: list[Sink] = [
        # Trusts another CA: the simulator's certificate does not verify.
        GrpcSink(
            sim.grpc_address,
            name="wrong-ca",
            tls=ClientTLS(ca_file=pki.rogue_ca, cert_file=pki.cert("tee"), key_file=pki.key("tee")),
        ),
        # No client certificate.
        GrpcSink(sim.grpc_address, name="no-cert", tls=ClientTLS(ca_file=pki.ca)),
        # Plaintext to a TLS port.
        GrpcSink(sim.grpc_address, name="plaintext"),
        # Gets in, but an engine may not feed the simulator.
        GrpcSink(sim.grpc_address, name="engine", tls=ctls(pki, "engine-a")),
        HttpSink(sim.http_url, name="http-no-cert", tls=ClientTLS(ca_file=pki.ca)),
        HttpSink(sim.http_url.replace("https://", "http://"), name="http-plaintext"),
        HttpSink(sim.http_url, name="http-engine", tls=ctls(pki, "engine-a")),
    ]
    tee = await Tee(sinks, concurrency=2, send_timeout_s=5).start()
    n = 4
    try:
        for i in range(n):
            assert tee.offer(ingest("m", PROMPT, f"r{i}", worker="w0")) is True
        await until(lambda: all(settled(s) for s in tee.stats()), 20)
    finally:
        await tee.close(1)
    stats = {s.sink: s for s in tee.stats()}
    for s in stats.values():
        assert s.balanced() and s.sent == 0 and s.offered == n, s
    for name in ("wrong-ca", "no-cert", "plaintext", "http-no-cert", "http-plaintext"):
        assert stats[name].failed_error == n, stats[name]
    # The refusal is the sink's answer: counted as such.
    assert stats["engine"].failed_http == n and stats["http-engine"].failed_http == n
    assert sim.sim.events[EventKind.INGEST] == 0


def test_sink_tls_configuration_errors_name_the_problem(pki: Pki, tmp_path: Path) -> None:
    sink = {"type": "http", "url": "http://sim:8470", "tls": {"ca_file": pki.ca}}
    with pytest.raises(ConfigError, match="not https"):
        load_tee_config(environ={"KVMESH_TEE_SINKS": json.dumps([sink])})
    with pytest.raises(TLSFileError, match=r"tls\.ca_file"):
        HttpSink("https://sim:8470", tls=ClientTLS(ca_file=str(tmp_path / "missing.crt")))
    with pytest.raises(TLSFileError, match=r"tls\.ca_file"):
        GrpcSink("sim:50062", tls=ClientTLS(ca_file=str(tmp_path / "missing.crt")))


# -- the simulator's HTTP port ----------------------------------------------------------------


async def test_http_sink_over_mtls_and_refused_clients(pki: Pki, sim: CacheSimServer) -> None:
    assert sim.http_url.startswith("https://")
    tee = await Tee([HttpSink(sim.http_url, tls=ctls(pki, "tee"))]).start()
    try:
        for i in range(3):
            assert tee.offer(ingest("m", PROMPT, f"r{i}", worker="w0"))
        await until(lambda: settled(tee.stats()[0]))
    finally:
        await tee.close(1)
    assert tee.stats()[0].sent == 3
    assert sim.sim.events[EventKind.INGEST] == 3

    body = json.dumps({"model": "m", "input_ids": PROMPT}).encode()
    plain_url = sim.http_url.replace("https://", "http://")
    client = ClientTLS(ca_file=pki.ca)
    no_cert = ClientSSL(client).context
    async with aiohttp.ClientSession() as s:
        # Plaintext to the TLS port: no HTTP answer.
        with pytest.raises(aiohttp.ClientError):
            async with s.post(f"{plain_url}/ingest_ids", data=body) as r:
                await r.read()
        # TLS without a client certificate: refused in the handshake.
        with pytest.raises(aiohttp.ClientError):
            async with s.post(f"{sim.http_url}/ingest_ids", data=body, ssl=no_cert) as r:
                await r.read()
        # A router reads the report; a tee may not.
        router = ClientSSL(ctls(pki, "router-a")).context
        async with s.get(f"{sim.http_url}/report", ssl=router) as r:
            assert r.status == 200
            assert (await r.json())["models"]["m"]["total"]["requests"] == 3
        tee_ctx = ClientSSL(ctls(pki, "tee")).context
        async with s.get(f"{sim.http_url}/report", ssl=tee_ctx) as r:
            assert r.status == 403
            assert "may not call /report" in (await r.json())["error"]
        # Metrics and health need a certificate but no role.
        stranger = ClientSSL(ctls(pki, "stranger")).context
        async with s.get(f"{sim.http_url}/metrics", ssl=stranger) as r:
            assert r.status == 200
            text = await r.text()
    assert 'kvmesh_cachesim_refusals_total{code="PERMISSION_DENIED",method="/report"} 1.0' in text
    assert sim.sim.events[EventKind.INGEST] == 3


async def test_bearer_tokens_with_optional_client_certificates(
    pki: Pki, tmp_path: Path, callers: Callable[[str, dict[str, Any] | None], Caller]
) -> None:
    server = await CacheSimServer(sim_config(pki, tls={"client_auth": "optional"})).start()
    router_token = pki.token_file(ROUTER_TOKEN)
    wrong = tmp_path / "wrong-token"
    wrong.write_text("not-a-token\n")
    try:
        token = ClientTLS(ca_file=pki.ca, token_file=router_token)
        anon_tls = ClientTLS(ca_file=pki.ca)
        wrong_tls = ClientTLS(ca_file=pki.ca, token_file=str(wrong))
        sinks: list[Sink] = [
            HttpSink(server.http_url, name="http-token", tls=token),
            GrpcSink(server.grpc_address, name="grpc-token", tls=token),
            HttpSink(server.http_url, name="http-anon", tls=anon_tls),
            HttpSink(server.http_url, name="http-wrong", tls=wrong_tls),
            GrpcSink(server.grpc_address, name="grpc-anon", tls=anon_tls),
        ]
        tee = await Tee(sinks).start()
        try:
            for i in range(2):
                tee.offer(ingest("m", PROMPT, f"r{i}", worker="w0"))
            await until(lambda: all(settled(s) for s in tee.stats()))
        finally:
            await tee.close(1)
        stats = {s.sink: s for s in tee.stats()}
        assert stats["http-token"].sent == 2 and stats["grpc-token"].sent == 2
        # In the door (TLS), but no identity: refused with UNAUTHENTICATED / 401.
        for name in ("http-anon", "http-wrong", "grpc-anon"):
            assert stats[name].failed_http == 2, stats[name]
        assert server.sim.events[EventKind.INGEST] == 4
        assert refusals(server.registry, "cachesim", "/ingest_ids", "UNAUTHENTICATED") == 4
        assert refusals(server.registry, "cachesim", "OfferEvents", "UNAUTHENTICATED") == 2
        # The report CLI with a token (https) works; without one it is refused.
        ok = await asyncio.to_thread(
            report_cli,
            ["--url", server.http_url, "--ca-file", pki.ca, "--token-file", router_token],
        )
        anon = await asyncio.to_thread(report_cli, ["--url", server.http_url, "--ca-file", pki.ca])
        assert (ok, anon) == (0, 1)
    finally:
        await server.stop(0)


# -- certificate reload -----------------------------------------------------------------------


def _rotate(live: Path, tmp_path: Path) -> str:
    """Replace live/server.{crt,key} with a pair from a new CA; return that CA's file."""
    new_ca = Authority("rotated server CA")
    issued = new_ca.issue("server", ["localhost", "127.0.0.1"])
    ca_file = tmp_path / "new-ca.crt"
    ca_file.write_bytes(new_ca.cert_pem)
    (live / "server.key.tmp").write_bytes(issued.key_pem)
    (live / "server.crt.tmp").write_bytes(issued.cert_pem)
    (live / "server.key.tmp").replace(live / "server.key")
    (live / "server.crt.tmp").replace(live / "server.crt")
    return str(ca_file)


def _live_copy(pki: Pki, tmp_path: Path) -> dict[str, Any]:
    live = tmp_path / "live"
    live.mkdir()
    for name in ("server.crt", "server.key"):
        shutil.copy(Path(pki.root) / name, live / name)
    return {
        "cert_file": str(live / "server.crt"),
        "key_file": str(live / "server.key"),
        "client_ca_file": pki.ca,
        "reload_interval_s": 0.05,
    }


async def test_tee_server_certificate_reload(
    pki: Pki, tmp_path: Path, callers: Callable[[str, dict[str, Any] | None], Caller]
) -> None:
    sink = await TestSink().start()
    tls = _live_copy(pki, tmp_path)
    server = await TeeServer(tee_config(pki, [{"type": "http", "url": sink.url}], tls=tls)).start()
    try:
        offer = pb.OfferEventsRequest(events=[_ev("x")])
        before = callers(server.address, pki.client_tls("router-a"))
        assert (await before.tee.OfferEvents(offer, timeout=5)).accepted == 1
        await before.close()
        new_ca = _rotate(Path(tls["cert_file"]).parent, tmp_path)
        await asyncio.sleep(0.1)
        trusting_new = {
            "ca_file": new_ca,
            "cert_file": pki.cert("router-a"),
            "key_file": pki.key("router-a"),
        }
        deadline = time.monotonic() + 10
        while True:  # the first handshake after the interval loads the new files
            c = callers(server.address, trusting_new)
            try:
                assert (await c.tee.OfferEvents(offer, timeout=2)).accepted == 1
                break
            except grpc.aio.AioRpcError:
                assert time.monotonic() < deadline, "the new certificate was not served"
                await asyncio.sleep(0.05)
        assert server.tls_reloader.reloads >= 1
        old = callers(server.address, pki.client_tls("router-a"))
        await expect_code(old.tee.OfferEvents(offer, timeout=5), grpc.StatusCode.UNAVAILABLE)
    finally:
        await server.stop(0)
        await sink.stop()


async def test_simulator_http_certificate_reload(pki: Pki, tmp_path: Path) -> None:
    tls = _live_copy(pki, tmp_path)
    server = await CacheSimServer(sim_config(pki, tls=tls)).start()
    body = json.dumps({"model": "m", "input_ids": PROMPT}).encode()
    url = f"{server.http_url}/ingest_ids"
    old_ctx = ClientSSL(ctls(pki, "tee")).context
    try:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
            async with s.post(url, data=body, ssl=old_ctx) as r:
                assert r.status == 200
            new_ca = _rotate(Path(tls["cert_file"]).parent, tmp_path)
            new_ctx = ClientSSL(
                ClientTLS(ca_file=new_ca, cert_file=pki.cert("tee"), key_file=pki.key("tee"))
            ).context
            await until(lambda: server.http_tls is not None and server.http_tls.reloads >= 1)
            async with s.post(url, data=body, ssl=new_ctx) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientError):
                async with s.post(url, data=body, ssl=old_ctx) as r:
                    await r.read()
            # A broken certificate file keeps the one in use.
            await asyncio.to_thread(Path(tls["cert_file"]).write_text, "not a certificate")
            assert server.http_tls is not None
            await until(
                lambda: server.http_tls is not None and server.http_tls.reload_failures >= 1
            )
            async with s.post(url, data=body, ssl=new_ctx) as r:
                assert r.status == 200
        assert server.sim.events[EventKind.INGEST] == 3
    finally:
        await server.stop(0)


async def test_sinks_pick_up_rotated_client_certificates(
    pki: Pki, sim: CacheSimServer, tmp_path: Path
) -> None:
    """After the files change, new connections present the new certificate."""
    live = tmp_path / "client"
    live.mkdir()
    files = {"cert_file": str(live / "tls.crt"), "key_file": str(live / "tls.key")}
    shutil.copy(pki.cert("tee"), files["cert_file"])
    shutil.copy(pki.key("tee"), files["key_file"])
    tls = ClientTLS(ca_file=pki.ca, reload_interval_s=0.05, **files)
    sinks: list[Sink] = [
        GrpcSink(sim.grpc_address, name="grpc", tls=tls),
        HttpSink(sim.http_url, name="http", tls=tls),
    ]
    tee = await Tee(sinks).start()
    try:
        tee.offer(ingest("m", PROMPT, "before", worker="w0"))
        await until(lambda: all(s.sent == 1 for s in tee.stats()))
        # Rotate to an identity the simulator refuses: the refusals prove the swap.
        for src, dst in ((pki.cert("engine-a"), "cert_file"), (pki.key("engine-a"), "key_file")):
            tmp = Path(files[dst] + ".tmp")
            await asyncio.to_thread(shutil.copy, src, tmp)
            await asyncio.to_thread(os.replace, tmp, files[dst])
        await asyncio.sleep(0.1)
        i = 0
        deadline = time.monotonic() + 10
        while not all(s.failed_http >= 1 for s in tee.stats()):
            assert time.monotonic() < deadline, tee.stats()
            tee.offer(ingest("m", PROMPT, f"after{i}", worker="w0"))
            i += 1
            await asyncio.sleep(0.05)
    finally:
        await tee.close(1)
    assert all(s.balanced() for s in tee.stats())
    assert refusals(sim.registry, "cachesim", "OfferEvents", "PERMISSION_DENIED") >= 1
    assert refusals(sim.registry, "cachesim", "/ingest_ids", "PERMISSION_DENIED") >= 1


# -- configuration ----------------------------------------------------------------------------


def test_tls_and_policy_from_env_and_flags(pki: Pki) -> None:
    env = {
        "KVMESH_CACHESIM_TLS__CERT_FILE": pki.cert("server"),
        "KVMESH_CACHESIM_TLS__KEY_FILE": pki.key("server"),
        "KVMESH_CACHESIM_TLS__CLIENT_CA_FILE": pki.ca,
        "KVMESH_CACHESIM_AUTH__POLICY_FILE": pki.policy,
        "KVMESH_CACHESIM_PER_CLIENT__MAX_IN_FLIGHT": "7",
    }
    c = load_cachesim_config(environ=env)
    assert c.tls.mutual and c.auth.policy_file == pki.policy and c.per_client.max_in_flight == 7
    with pytest.raises(ConfigError, match="key_file"):
        load_cachesim_config(environ={"KVMESH_CACHESIM_TLS__CERT_FILE": pki.cert("server")})
    t, _ = config_from_argv(
        ["--sink-http", "http://sim:8470", "--tls-cert", pki.cert("server"),
         "--tls-key", pki.key("server"), "--tls-client-ca", pki.ca, "--auth-policy", pki.policy]
    )  # fmt: skip
    assert t.tls.cert_file == pki.cert("server") and t.tls.mutual
    assert t.auth.policy_file == pki.policy
    plain, _ = config_from_argv(["--sink-http", "http://sim:8470"])
    assert not plain.tls.enabled and not plain.auth.policy_file
