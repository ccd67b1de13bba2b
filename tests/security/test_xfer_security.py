"""Tests that try to get into the xfer sidecars: mTLS, roles, peer admission, forged writes.

Real sidecars throughout: ``kvmesh xfer serve`` processes where the test only
needs their API (and their /metrics), sidecars in a thread of the test
process where the test must reach into one (to post a forged write through
its transport, as a compromised or misconfigured peer would). Pools are
shared-memory files the test creates, so every page is checked byte for
byte. Identities come from the test PKI (tests/security/pki.py): ``prefill``
and ``decode`` are sidecars (role ``peer``), ``engine-a`` is the engine,
``stranger`` is signed by the fleet CA but known to no policy.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import socket
import struct
import time
import urllib.request
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families
from pydantic import ValidationError

from kvmesh.api.xfer.v1 import xfer_pb2 as pb
from kvmesh.api.xfer.v1 import xfer_pb2_grpc as pb_grpc
from kvmesh.configfile import ConfigError
from kvmesh.errors import InvalidArgument, PermissionDenied, Unavailable
from kvmesh.tls import ChannelFactory, ClientTLS
from lab.bench.xfer_procs import Sidecar, ThreadedSidecar
from lab.devcerts import write_bundle
from lab.redisproc import free_port
from tests.security.pki import Pki
from xfer import cli
from xfer.client import XferClient
from xfer.config import XferConfig, load_config
from xfer.logic import RoomStatus, XferLogic
from xfer.peers import SECRET_METADATA
from xfer.pool import KVPool, PoolGeometry
from xfer.server import XferServer
from xfer.transport import TcpTransport, wait_state
from xfer.wire import FLAG_AUX, FLAG_LAST, Tag

GEO = PoolGeometry(page_size=4096, page_count=256, aux_size=64, aux_count=16)
BACKENDS = ["tcp", "nixl"]
DECODE_PEERS = "spiffe://kvmesh/xfer/decode-*"
PREFILL_PEERS = "spiffe://kvmesh/xfer/prefill-*"


# -- pools, sidecars, callers --------------------------------------------------------------


class Pools:
    """A prefill and a decode pool in shared memory; the prefill one full of random bytes."""

    def __init__(self, tmp_path: Path, n_prefill: int = 1) -> None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
        tag = f"kvx-sec-{os.getpid()}-{random.getrandbits(32):x}"
        self.prefill = [KVPool.create(str(base / f"{tag}-p{i}"), GEO) for i in range(n_prefill)]
        self.decode = KVPool.create(str(base / f"{tag}-d"), GEO)
        for p in self.prefill:
            p.view[:] = os.urandom(GEO.total_bytes)

    def same(self, i: int, src: list[int], dst: list[int], aux_src: int, aux_dst: int) -> bool:
        """Whether prefill pool ``i``'s pages ``src`` (and aux) arrived at ``dst``."""
        p = self.prefill[i]
        pages = all(
            bytes(p.page(s)) == bytes(self.decode.page(d)) for s, d in zip(src, dst, strict=True)
        )
        return pages and bytes(p.aux(aux_src)) == bytes(self.decode.aux(aux_dst))

    def snapshot(self, pages: list[int], aux: int) -> bytes:
        """The decode pool's bytes of ``pages`` and aux slot ``aux``."""
        return b"".join(bytes(self.decode.page(i)) for i in pages) + bytes(self.decode.aux(aux))

    def close(self) -> None:
        for p in [*self.prefill, self.decode]:
            p.close()
            p.unlink()


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[Pools]:
    p = Pools(tmp_path, n_prefill=2)
    yield p
    p.close()


def secure_args(pki: Pki, name: str, allow: str, *extra: str) -> list[str]:
    """``kvmesh xfer serve`` flags: mutual TLS with ``name``'s certificate (also presented
    to peers), the test policy, and the allowed peer identities."""
    return [
        "--tls-cert", pki.cert(name), "--tls-key", pki.key(name), "--tls-client-ca", pki.ca,
        "--auth-policy", pki.policy, "--peer-allow", allow,
        "--heartbeat-interval-s", "0.5", *extra,
    ]  # fmt: skip


def secure_config(role: str, pool_path: str, pki: Pki, name: str, **over: Any) -> XferConfig:
    """The config of a sidecar run in a thread (same security as :func:`secure_args`)."""
    base: dict[str, Any] = {
        "role": role,
        "port": 0,
        "metrics_port": 0,
        "transport": "tcp",
        "heartbeat_interval_s": 0.5,
        "shutdown_grace_s": 0,
        "pool": {
            "path": pool_path,
            "page_size": GEO.page_size,
            "page_count": GEO.page_count,
            "aux_size": GEO.aux_size,
            "aux_count": GEO.aux_count,
        },
        "tls": {"cert_file": pki.cert(name), "key_file": pki.key(name), "client_ca_file": pki.ca},
        "auth": {"policy_file": pki.policy},
        "peers": {"allowed_identities": [DECODE_PEERS if role == "prefill" else PREFILL_PEERS]},
    }
    base.update(over)
    return XferConfig.model_validate(base)


def client_tls(pki: Pki, name: str | None) -> ClientTLS:
    """Client TLS presenting ``name``'s certificate (None: none)."""
    return ClientTLS.model_validate(pki.client_tls(name))


def engine(pki: Pki, address: str) -> XferClient:
    """The engine-side client, as engine-a."""
    return XferClient(address, tls=client_tls(pki, "engine-a"))


def wait_status(client: XferClient, room: int, want: RoomStatus, timeout: float = 20.0) -> str:
    """Wait until ``room`` is ``want``; returns its failure reason. Fails on a timeout or
    (unless Failed is wanted) on Failed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st, reason = client.poll(room)
        if st == want:
            return reason
        if st == RoomStatus.FAILED:
            pytest.fail(f"room {room} failed: {reason}")
        time.sleep(0.005)
    pytest.fail(f"room {room} stuck in {client.poll(room)}, wanted {want.name}")


def bootstrap_request(room: int, **kw: Any) -> pb.BootstrapRequest:
    """A Bootstrap a decode sidecar would send (TCP transport metadata that parses)."""
    md = json.dumps({"host": "127.0.0.1", "port": 1, "size": GEO.total_bytes, "key": "k"})
    base: dict[str, Any] = dict(
        room=room, generation=1, dst_page_indices=[1, 2], aux_index=0, peer_name="agent-x",
        peer_address="127.0.0.1:1", page_size=GEO.page_size, page_count=GEO.page_count,
        aux_size=GEO.aux_size, aux_count=GEO.aux_count, transport="tcp",
        agent_metadata=md.encode(),
    )  # fmt: skip
    base.update(kw)
    return pb.BootstrapRequest(**base)


def call_bootstrap(
    address: str, tls: ClientTLS | None, req: pb.BootstrapRequest, secret: str | None = None
) -> tuple[grpc.StatusCode, str, pb.BootstrapResponse | None]:
    """Call Bootstrap as a peer would: (status code, details, the answer when OK)."""
    ch = ChannelFactory(address, tls).sync_channel()
    md = ((SECRET_METADATA, secret),) if secret is not None else None
    try:
        resp = pb_grpc.XferServiceStub(ch).Bootstrap(req, timeout=10, metadata=md)
        return grpc.StatusCode.OK, "", resp
    except grpc.RpcError as e:
        assert isinstance(e, grpc.Call)
        return e.code(), e.details() or "", None
    finally:
        ch.close()


def refusals(server: XferServer, method: str, code: str) -> float:
    """``kvmesh_xfer_refusals_total{method, code}`` of an in-process sidecar."""
    v = server.metrics.registry.get_sample_value(
        "kvmesh_xfer_refusals_total", {"method": method, "code": code}
    )
    return v or 0.0


def scrape(port: int, name: str) -> float:
    """A counter from a sidecar process's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name:
                return float(s.value)
    return 0.0


def wait_metric(port: int, name: str, want: float, timeout: float = 10.0) -> None:
    """Wait until a counter of a sidecar process reaches ``want``."""
    deadline = time.monotonic() + timeout
    while scrape(port, name) < want:
        if time.monotonic() > deadline:
            pytest.fail(f"{name} stayed at {scrape(port, name)}, wanted {want}")
        time.sleep(0.02)


def decode_agent(prefill: XferServer) -> str:
    """The transport name under which an in-process prefill sidecar knows the decode one."""
    peers = prefill.logic.active_peers()
    assert len(peers) == 1, peers
    return next(iter(peers))


def post(server: XferServer, peer: str, runs: list[tuple[int, int, int]], tag: Tag) -> str:
    """Post a raw write through a sidecar's transport, bypassing its logic; its final state."""
    h = server.transport.post(peer, runs, tag.encode())
    try:
        return wait_state(server.transport, h, 10.0)
    finally:
        server.transport.release(h)


def page_run(src: int, dst: int, n: int = 1) -> tuple[int, int, int]:
    ps = GEO.page_size
    return (src * ps, dst * ps, n * ps)


def aux_run(src: int, dst: int) -> tuple[int, int, int]:
    return (GEO.kv_bytes + src * GEO.aux_size, GEO.kv_bytes + dst * GEO.aux_size, GEO.aux_size)


# -- mutual TLS between processes ------------------------------------------------------------


@pytest.mark.parametrize("transport", BACKENDS)
def test_mtls_sidecar_processes_move_rooms_byte_for_byte(
    pki: Pki, pools: Pools, transport: str
) -> None:
    """Two sidecar processes with mutual TLS, the policy and peer allow-lists: rooms move
    byte for byte, and each side's methods refuse the other roles."""
    ps = Sidecar("prefill", pools.prefill[0].path, GEO, transport=transport,
                 extra=secure_args(pki, "prefill", DECODE_PEERS))  # fmt: skip
    ds = Sidecar("decode", pools.decode.path, GEO, transport=transport,
                 extra=secure_args(pki, "decode", PREFILL_PEERS))  # fmt: skip
    try:
        ps.wait_ready()
        ds.wait_ready()
        rng = random.Random(5)
        with engine(pki, ps.address) as pc, engine(pki, ds.address) as dc:
            dst_all = rng.sample(range(GEO.page_count), 3 * 24)
            src_all = rng.sample(range(GEO.page_count), 3 * 24)
            rooms = []
            for i in range(3):
                src, dst = src_all[i * 24 : (i + 1) * 24], dst_all[i * 24 : (i + 1) * 24]
                dc.register_room(500 + i, ps.address, dst, aux_index=i)
                rooms.append((500 + i, src, dst, i + 8, i))
            for room, src, _, aux_src, _ in rooms:
                pc.add_transfer_request(room, src[:12], (0, 12), False, aux_src, 0)
                pc.add_transfer_request(room, src[12:], (12, 24), True, aux_src, 1)
            for room, src, dst, aux_src, aux_dst in rooms:
                wait_status(dc, room, RoomStatus.SUCCESS)
                wait_status(pc, room, RoomStatus.SUCCESS)
                assert pools.same(0, src, dst, aux_src, aux_dst)

            # A sidecar's identity (role peer) may not drive rooms; a router neither.
            for name in ("decode", "router-a"):
                with (
                    XferClient(ps.address, tls=client_tls(pki, name)) as other,
                    pytest.raises(PermissionDenied, match="may not call Poll"),
                ):
                    other.poll(500)
            # The engine may not act as a peer.
            code, details, _ = call_bootstrap(
                ps.address, client_tls(pki, "engine-a"), bootstrap_request(900)
            )
            assert code == grpc.StatusCode.PERMISSION_DENIED and "Bootstrap" in details
            # No client certificate, or no TLS at all: no handshake.
            for tls in (client_tls(pki, None), None):
                with (
                    XferClient(ps.address, tls=tls, timeout_s=5) as anonymous,
                    pytest.raises(Unavailable),
                ):
                    anonymous.poll(500)
        assert "PLAINTEXT" not in ps.log() and "PLAINTEXT" not in ds.log()
    finally:
        ps.stop()
        ds.stop()


# -- peer admission -------------------------------------------------------------------------


def test_bootstrap_from_unknown_peer_is_refused(
    pki: Pki, pools: Pools, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only allowed sidecar identities may bootstrap: a fleet certificate outside the
    policy, a peer identity outside peers.allowed_identities, a certificate of another CA
    and no certificate are all refused, counted, and leave no room behind."""
    caplog.set_level(logging.WARNING)
    # Heartbeats far apart: the accepted bootstrap below names a peer address nobody
    # serves, whose first failed ping would fail the room.
    cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill", heartbeat_interval_s=60)
    with ThreadedSidecar(cfg) as tp, engine(pki, tp.address) as pc:
        server = tp.server
        assert server is not None
        # stranger: signed by the fleet CA, in no policy.
        code, details, _ = call_bootstrap(tp.address, client_tls(pki, "stranger"),
                                          bootstrap_request(1))  # fmt: skip
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert "not in the policy" in details
        # prefill: role peer in the policy, but not an allowed peer of this sidecar.
        code, details, _ = call_bootstrap(tp.address, client_tls(pki, "prefill"),
                                          bootstrap_request(2))  # fmt: skip
        assert code == grpc.StatusCode.PERMISSION_DENIED, details
        assert "not an allowed peer" in details
        # Same SAN as a real sidecar, signed by another CA: the handshake fails.
        rogue = ClientTLS(ca_file=pki.ca, cert_file=pki.rogue_cert("server"),
                          key_file=pki.rogue_key("server"))  # fmt: skip
        code, _, _ = call_bootstrap(tp.address, rogue, bootstrap_request(3))
        assert code == grpc.StatusCode.UNAVAILABLE
        code, _, _ = call_bootstrap(tp.address, client_tls(pki, None), bootstrap_request(4))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert refusals(server, "Bootstrap", "PERMISSION_DENIED") == 2
        assert "not an allowed peer" in caplog.text
        for room in (1, 2, 3, 4):
            assert server.logic.room_snapshot(room) is None
        assert not server.transport.has_peer("agent-x")

        # The allowed identity is accepted and learns the prefill agent's name.
        code, details, answer = call_bootstrap(
            tp.address, client_tls(pki, "decode"), bootstrap_request(5)
        )
        assert code == grpc.StatusCode.OK, details
        assert answer is not None and answer.agent_name == server.transport.name
        assert answer.instance_id == server.instance_id
        assert pc.poll(5)[0] == RoomStatus.WAITING_FOR_INPUT

        # End to end: a decode sidecar dialing with the stranger's certificate.
        stranger_decode = secure_config(
            "decode", pools.decode.path, pki, "decode",
            peers={"tls": pki.client_tls("stranger"), "allowed_identities": [PREFILL_PEERS]},
        )  # fmt: skip
        with ThreadedSidecar(stranger_decode) as td, engine(pki, td.address) as dc:
            dc.register_room(6, tp.address, [7, 8], 0)
            reason = wait_status(dc, 6, RoomStatus.FAILED)
            assert "bootstrap failed: PERMISSION_DENIED" in reason
        assert server.logic.room_snapshot(6) is None
        assert refusals(server, "Bootstrap", "PERMISSION_DENIED") == 3


def test_a_peer_cannot_abort_or_impersonate_another_peers_rooms(
    tmp_path: Path, pools: Pools
) -> None:
    """Two decode identities of the same fleet: one cannot abort the other's room,
    re-bootstrap it, or bootstrap under the other's agent name."""
    paths = write_bundle(tmp_path / "fleet", {
        "prefill": ["127.0.0.1", "spiffe://t/xfer/prefill-0"],
        "decode-0": ["spiffe://t/xfer/decode-0"],
        "decode-1": ["spiffe://t/xfer/decode-1"],
    })  # fmt: skip
    ca = str(paths["ca"])

    def tls(name: str) -> ClientTLS:
        return ClientTLS(ca_file=ca, cert_file=str(paths[name]), key_file=str(paths[f"{name}_key"]))

    cfg = XferConfig.model_validate({
        "role": "prefill", "port": 0, "metrics_port": 0, "transport": "tcp",
        "shutdown_grace_s": 0, "heartbeat_interval_s": 60,
        "pool": {"path": pools.prefill[0].path, "page_size": GEO.page_size,
                 "page_count": GEO.page_count, "aux_size": GEO.aux_size,
                 "aux_count": GEO.aux_count},
        "tls": {"cert_file": str(paths["prefill"]), "key_file": str(paths["prefill_key"]),
                "client_ca_file": ca},
        "peers": {"allowed_identities": ["spiffe://t/xfer/decode-*"]},
    })  # fmt: skip
    with ThreadedSidecar(cfg) as tp:
        server = tp.server
        assert server is not None
        req = bootstrap_request(10, peer_name="agent-0", generation=77)
        assert call_bootstrap(tp.address, tls("decode-0"), req)[0] == grpc.StatusCode.OK

        ch = ChannelFactory(tp.address, tls("decode-1")).sync_channel()
        stub = pb_grpc.XferServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.Abort(pb.AbortRequest(room=10, generation=77, reason="mine now"), timeout=10)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        ch.close()
        code, _, _ = call_bootstrap(
            tp.address, tls("decode-1"), bootstrap_request(10, peer_name="agent-1")
        )
        assert code == grpc.StatusCode.ALREADY_EXISTS
        code, details, _ = call_bootstrap(
            tp.address, tls("decode-1"), bootstrap_request(11, peer_name="agent-0")
        )
        assert code == grpc.StatusCode.PERMISSION_DENIED and "agent-0" in details
        assert server.logic.room_snapshot(11) is None
        snap = server.logic.room_snapshot(10)
        assert snap is not None and snap.status == RoomStatus.WAITING_FOR_INPUT
        assert snap.dst_pages == [1, 2]
        assert refusals(server, "Abort", "PERMISSION_DENIED") == 1

        ch = ChannelFactory(tp.address, tls("decode-0")).sync_channel()
        pb_grpc.XferServiceStub(ch).Abort(
            pb.AbortRequest(room=10, generation=77, reason="done"), timeout=10
        )
        ch.close()
        snap = server.logic.room_snapshot(10)
        assert snap is not None and snap.status == RoomStatus.FAILED
        assert "aborted by decode: done" in snap.reason


def _secret_config(role: str, pool_path: str, pki: Pki, name: str, secret_file: Path) -> XferConfig:
    """Server TLS (no client certificates), no policy, a peer secret."""
    return secure_config(
        role, pool_path, pki, name,
        tls={"cert_file": pki.cert(name), "key_file": pki.key(name)},
        auth={},
        peers={"shared_secret_file": str(secret_file), "tls": {"ca_file": pki.ca}},
    )  # fmt: skip


def test_shared_secret_admits_peers_and_refuses_a_wrong_or_missing_one(
    pki: Pki, pools: Pools, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    old, new = "old-secret-0123456789abcdef", "new-secret-fedcba9876543210"
    p_file, good_file, wrong_file = tmp_path / "p", tmp_path / "good", tmp_path / "wrong"
    p_file.write_text(old + "\n")
    good_file.write_text(old + "\n")
    # A sidecar already at step two of a rotation: sends the new secret, accepts both.
    wrong_file.write_text(f"{new}\n{old}\n")
    tls = ClientTLS(ca_file=pki.ca)
    pcfg = _secret_config("prefill", pools.prefill[0].path, pki, "prefill", p_file)
    good = _secret_config("decode", pools.decode.path, pki, "decode", good_file)
    wrong = _secret_config("decode", pools.decode.path, pki, "decode", wrong_file)
    with (
        ThreadedSidecar(pcfg) as tp,
        ThreadedSidecar(good) as tg,
        ThreadedSidecar(wrong) as tw,
        XferClient(tp.address, tls=tls) as pc,
        XferClient(tg.address, tls=tls) as gc,
        XferClient(tw.address, tls=tls) as wc,
    ):
        assert tp.server is not None
        gc.register_room(20, tp.address, [30, 31], 2)
        pc.add_transfer_request(20, [40, 41], (0, 2), True, 3, 0)
        wait_status(gc, 20, RoomStatus.SUCCESS)
        assert pools.same(0, [40, 41], [30, 31], 3, 2)

        wc.register_room(21, tp.address, [32], 0)
        reason = wait_status(wc, 21, RoomStatus.FAILED)
        assert "bootstrap failed: UNAUTHENTICATED" in reason and "wrong peer secret" in reason
        assert tp.server.logic.room_snapshot(21) is None
        code, details, _ = call_bootstrap(tp.address, tls, bootstrap_request(22))
        assert code == grpc.StatusCode.UNAUTHENTICATED and "no peer secret" in details
        assert refusals(tp.server, "Bootstrap", "UNAUTHENTICATED") == 2
        assert "wrong peer secret" in caplog.text
        assert old not in caplog.text and new not in caplog.text

        # Rotation, step one: the prefill side accepts both; the new one gets in.
        p_file.write_text(f"{old}\n{new}\n")
        wc.clear(21)
        wc.register_room(21, tp.address, [33], 4)
        pc.add_transfer_request(21, [42], (0, 1), True, 5, 0)
        wait_status(wc, 21, RoomStatus.SUCCESS)
        assert pools.same(0, [42], [33], 5, 4)


def test_a_peer_secret_needs_tls_and_enough_characters(
    pki: Pki, pools: Pools, tmp_path: Path
) -> None:
    secret = tmp_path / "s"
    secret.write_text("0123456789abcdef0123\n")
    plain = {
        "role": "decode", "transport": "tcp",
        "pool": {"path": pools.decode.path, "page_size": GEO.page_size, "page_count": 4},
        "peers": {"shared_secret_file": str(secret)},
    }  # fmt: skip
    with pytest.raises(ValidationError, match="never sent or accepted in plaintext"):
        XferConfig.model_validate(plain)
    with pytest.raises(ValidationError, match="needs mutual TLS"):
        XferConfig.model_validate({**plain, "peers": {"allowed_identities": ["spiffe://x/*"]}})
    secret.write_text("short\n")
    cfg = _secret_config("decode", pools.decode.path, pki, "decode", secret)
    with pytest.raises(ConfigError, match="shorter than 16"):
        ThreadedSidecar(cfg).start()


# -- what a bootstrapped peer may write ---------------------------------------------------------


def _decode_process(pki: Pki, pools: Pools, transport: str) -> tuple[Sidecar, int]:
    metrics_port = free_port()
    ds = Sidecar("decode", pools.decode.path, GEO, transport=transport,
                 extra=secure_args(pki, "decode", PREFILL_PEERS,
                                   "--metrics-port", str(metrics_port)))  # fmt: skip
    ds.wait_ready()
    return ds, metrics_port


def test_forged_page_indices_are_refused_and_other_rooms_untouched(pki: Pki, pools: Pools) -> None:
    """Prefill sidecar P, bootstrapped for room A, forges writes into room B's pages (B
    belongs to prefill sidecar Q) and outside any room. The decode sidecar (TCP: it sees
    every run before a byte lands) refuses them; B's bytes do not change, A and B then
    complete correctly, and the decode sidecar keeps serving."""
    ds, mport = _decode_process(pki, pools, "tcp")
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill")
    q_cfg = secure_config("prefill", pools.prefill[1].path, pki, "prefill")
    try:
        with (
            ThreadedSidecar(p_cfg) as tp,
            ThreadedSidecar(q_cfg) as tq,
            engine(pki, tp.address) as pc,
            engine(pki, tq.address) as qc,
            engine(pki, ds.address) as dc,
        ):
            p, q = tp.server, tq.server
            assert p is not None and q is not None
            room_a, room_b = 31, 32
            a_dst, b_dst = [1, 2, 3, 4], [10, 11, 12, 13]
            gen_a = dc.register_room(room_a, tp.address, a_dst, 0)
            gen_b = dc.register_room(room_b, tq.address, b_dst, 1)
            wait_status(dc, room_a, RoomStatus.WAITING_FOR_INPUT)
            wait_status(dc, room_b, RoomStatus.WAITING_FOR_INPUT)
            b_before = pools.snapshot(b_dst, 1)
            untouched = pools.snapshot([100, 101], 9)
            decode = decode_agent(p)

            # Through the engine API: a slice beyond room A's four pages.
            with pytest.raises(InvalidArgument, match="fills destination pages"):
                pc.add_transfer_request(room_a, [50, 51, 52, 53, 54], (0, 5), True, 0, 0)

            # Through the transport: A's tag, B's pages (and B's aux slot).
            tag_a = Tag(room_a, gen_a, 0, FLAG_LAST | FLAG_AUX, 1)
            forged = [page_run(60, 10, 2), page_run(62, 12, 2), aux_run(0, 1)]
            assert post(p, decode, forged, tag_a) == "ERR"
            # A's tag, pages of no room at all.
            assert post(p, decode, [page_run(60, 100, 2)], tag_a) == "ERR"
            # B's own tag, from P (B was bootstrapped with Q).
            tag_b = Tag(room_b, gen_b, 0, FLAG_LAST | FLAG_AUX, 1)
            assert post(p, decode, [page_run(60, 10, 4), aux_run(0, 1)], tag_b) == "ERR"
            wait_metric(mport, "kvmesh_xfer_refused_writes_total", 3)
            assert pools.snapshot(b_dst, 1) == b_before
            assert pools.snapshot([100, 101], 9) == untouched
            assert dc.poll(room_a)[0] == RoomStatus.WAITING_FOR_INPUT
            assert dc.poll(room_b)[0] == RoomStatus.WAITING_FOR_INPUT
            assert "refused a write" in ds.log()

            qc.add_transfer_request(room_b, [70, 71, 72, 73], (0, 4), True, 5, 0)
            pc.add_transfer_request(room_a, [80, 81, 82, 83], (0, 4), True, 6, 0)
            wait_status(dc, room_b, RoomStatus.SUCCESS)
            wait_status(dc, room_a, RoomStatus.SUCCESS)
            assert pools.same(1, [70, 71, 72, 73], b_dst, 5, 1)
            assert pools.same(0, [80, 81, 82, 83], a_dst, 6, 0)
            assert ds.proc.poll() is None
            dc.register_room(33, tp.address, [20], 2)
            wait_status(dc, 33, RoomStatus.WAITING_FOR_INPUT)
    finally:
        ds.stop()


@pytest.mark.parametrize("transport", BACKENDS)
def test_notification_from_a_non_bootstrapped_agent_is_ignored(
    pki: Pki, pools: Pools, transport: str
) -> None:
    """Prefill sidecar Q (a legitimate peer of the decode sidecar for room B) writes and
    notifies room A, which was bootstrapped with P. The room must not complete: NIXL's
    write lands (one-sided) but its notification is counted as foreign and ignored; the
    TCP receiver refuses the write before a byte lands. P then completes the room."""
    ds, mport = _decode_process(pki, pools, transport)
    over = {"transport": transport}
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill", **over)
    q_cfg = secure_config("prefill", pools.prefill[1].path, pki, "prefill", **over)
    try:
        with (
            ThreadedSidecar(p_cfg) as tp,
            ThreadedSidecar(q_cfg) as tq,
            engine(pki, tp.address) as pc,
            engine(pki, ds.address) as dc,
        ):
            q = tq.server
            assert q is not None
            room_a, room_b = 41, 42
            gen_a = dc.register_room(room_a, tp.address, [5, 6], 2)
            dc.register_room(room_b, tq.address, [7], 3)
            wait_status(dc, room_a, RoomStatus.WAITING_FOR_INPUT)
            wait_status(dc, room_b, RoomStatus.WAITING_FOR_INPUT)
            a_before = pools.snapshot([5, 6], 2)

            tag = Tag(room_a, gen_a, 0, FLAG_LAST | FLAG_AUX, 1)
            state = post(q, decode_agent(q), [page_run(90, 5, 2), aux_run(1, 2)], tag)
            if transport == "nixl":
                assert state == "DONE"  # one-sided: the receiver cannot stop it
                wait_metric(mport, "kvmesh_xfer_foreign_notifications_total", 1)
            else:
                assert state == "ERR"
                wait_metric(mport, "kvmesh_xfer_refused_writes_total", 1)
                assert pools.snapshot([5, 6], 2) == a_before
            assert dc.poll(room_a)[0] == RoomStatus.WAITING_FOR_INPUT

            pc.add_transfer_request(room_a, [91, 92], (0, 2), True, 4, 0)
            wait_status(dc, room_a, RoomStatus.SUCCESS)
            assert pools.same(0, [91, 92], [5, 6], 4, 2)
    finally:
        ds.stop()


def test_notifications_before_the_bootstrap_answer_are_held_for_the_right_agent(
    tmp_path: Path,
) -> None:
    """The prefill side writes as soon as it accepts a bootstrap, so notifications may
    beat its answer (which names its agent): they are held, then only the named agent's
    count."""
    pool = KVPool.create(str(tmp_path / "d"), GEO)
    cfg = XferConfig.model_validate({
        "role": "decode", "transport": "tcp", "metrics_port": 0,
        "pool": {"path": pool.path, "page_size": GEO.page_size, "page_count": GEO.page_count,
                 "aux_size": GEO.aux_size, "aux_count": GEO.aux_count},
    })  # fmt: skip
    transport = TcpTransport(pool)
    logic = XferLogic(cfg, pool, transport)
    try:
        room = logic.register_room(1, "prefill:1", [3, 4], 0)
        gen = room.generation
        last = Tag(1, gen, 1, FLAG_LAST | FLAG_AUX, 2).encode()
        logic.on_notification("intruder", Tag(1, gen, 0).encode())
        logic.on_notification("intruder", last)
        logic.on_notification("prefill-agent", last)
        assert logic.poll(1)[0] == RoomStatus.BOOTSTRAPPING
        logic.bootstrap_done(1, gen, peer_agent="prefill-agent")
        assert logic.poll(1)[0] == RoomStatus.TRANSFERRING  # chunk 0 came from the intruder
        reg = logic.metrics.registry
        assert reg.get_sample_value("kvmesh_xfer_foreign_notifications_total") == 2
        logic.on_notification("prefill-agent", Tag(1, gen, 0).encode())
        assert logic.poll(1)[0] == RoomStatus.SUCCESS
        # Once the agent is known, writes are judged by it too (TCP asks first).
        logic.register_room(2, "prefill:1", [8], 1)
        gen2 = logic.room_generation(2)
        assert gen2 is not None
        logic.bootstrap_done(2, gen2, peer_agent="prefill-agent")
        tag2 = Tag(2, gen2, 0, FLAG_LAST | FLAG_AUX, 1).encode()
        ps = GEO.page_size
        aux = (GEO.kv_bytes + GEO.aux_size, GEO.aux_size)
        assert logic.authorize_write("prefill-agent", tag2, [(8 * ps, ps), aux]) == ""
        assert "another agent" in logic.authorize_write("intruder", tag2, [(8 * ps, ps)])
        assert "outside" in logic.authorize_write("prefill-agent", tag2, [(3 * ps, ps)])
        assert "whole pages" in logic.authorize_write("prefill-agent", tag2, [(8 * ps + 1, 10)])
        assert reg.get_sample_value("kvmesh_xfer_refused_writes_total") == 3
    finally:
        transport.close()
        pool.close()


class _AnonymousPrefill(pb_grpc.XferServiceServicer):
    """A prefill side that accepts every Bootstrap but names no transport agent (an
    outdated or misbehaving sidecar)."""

    def Bootstrap(
        self, request: pb.BootstrapRequest, context: grpc.ServicerContext
    ) -> pb.BootstrapResponse:
        return pb.BootstrapResponse(instance_id="anonymous")


def test_a_bootstrap_answer_without_the_agent_name_fails_the_room(pools: Pools) -> None:
    """Without the prefill agent's name the decode side could not tell its notifications
    from anyone else's: the room fails instead of accepting every agent."""
    fake = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_XferServiceServicer_to_server(_AnonymousPrefill(), fake)
    port = fake.add_insecure_port("127.0.0.1:0")
    fake.start()
    cfg = XferConfig.model_validate({
        "role": "decode", "port": 0, "metrics_port": 0, "transport": "tcp",
        "shutdown_grace_s": 0, "heartbeat_interval_s": 60,
        "pool": {"path": pools.decode.path, "page_size": GEO.page_size,
                 "page_count": GEO.page_count, "aux_size": GEO.aux_size,
                 "aux_count": GEO.aux_count},
    })  # fmt: skip
    try:
        with ThreadedSidecar(cfg) as td, XferClient(td.address) as dc:
            dc.register_room(70, f"127.0.0.1:{port}", [3], 0)
            reason = wait_status(dc, 70, RoomStatus.FAILED)
            assert "did not name its transport agent" in reason
    finally:
        fake.stop(0)


def test_tcp_data_port_refuses_a_sender_without_the_key(pki: Pki, pools: Pools) -> None:
    """Nothing reaches the decode pool through the TCP data port without the key that
    only a bootstrapped peer received (in the transport metadata, over TLS)."""
    cfg = secure_config("decode", pools.decode.path, pki, "decode")
    with ThreadedSidecar(cfg) as td, engine(pki, td.address) as dc:
        server = td.server
        assert server is not None and isinstance(server.transport, TcpTransport)
        gen = dc.register_room(51, "127.0.0.1:1", [9], 0)  # bootstraps nowhere: stays put
        before = pools.snapshot([9], 0)
        tag = Tag(51, gen, 0, FLAG_LAST, 1).encode()
        for key in (b"not-the-key", b""):
            with socket.create_connection(("127.0.0.1", server.transport.port), timeout=10) as s:
                name = b"intruder"
                hello = struct.pack("<4sHH", b"kvt2", len(name), len(key)) + name + key
                frame = struct.pack("<QIH", 1, 1, len(tag))
                run = struct.pack("<QQ", 9 * GEO.page_size, GEO.page_size)
                try:
                    s.sendall(hello + frame + run + tag + b"\xff" * GEO.page_size)
                    assert s.recv(16) == b""  # closed without an acknowledgement
                except ConnectionError:  # reset or broken pipe: closed all the same
                    pass
        assert server.transport.refused_connections == 2
        assert pools.snapshot([9], 0) == before
        assert dc.poll(51)[0] != RoomStatus.SUCCESS


def test_peer_certificate_rotation_takes_effect_without_restart(
    pki: Pki, pools: Pools, tmp_path: Path
) -> None:
    """The files behind peers.tls are replaced (a rotated Secret): the next call to the
    peer handshakes with the new certificate, no restart."""
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    shutil.copy(pki.cert("stranger"), cert)
    shutil.copy(pki.key("stranger"), key)
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill")
    d_cfg = secure_config(
        "decode", pools.decode.path, pki, "decode",
        peers={"allowed_identities": [PREFILL_PEERS], "tls": {
            "ca_file": pki.ca, "cert_file": str(cert), "key_file": str(key),
            "reload_interval_s": 0.05}},
    )  # fmt: skip
    with (
        ThreadedSidecar(p_cfg) as tp,
        ThreadedSidecar(d_cfg) as td,
        engine(pki, tp.address) as pc,
        engine(pki, td.address) as dc,
    ):
        dc.register_room(61, tp.address, [40], 0)
        assert "PERMISSION_DENIED" in wait_status(dc, 61, RoomStatus.FAILED)
        shutil.copy(pki.cert("decode"), cert)
        shutil.copy(pki.key("decode"), key)
        time.sleep(0.1)  # past reload_interval_s, so the next call checks the files
        dc.register_room(62, tp.address, [41], 1)
        pc.add_transfer_request(62, [42], (0, 1), True, 2, 0)
        wait_status(dc, 62, RoomStatus.SUCCESS)
        assert pools.same(0, [42], [41], 2, 1)


def test_security_flags_and_environment(pki: Pki, tmp_path: Path) -> None:
    """The CLI flags and KVMESH_XFER_* variables reach the config; peers are dialed with
    the sidecar's own certificate unless peers.tls says otherwise."""
    base = ["--role", "prefill", "--pool-path", "/dev/shm/x", "--page-size", "64",
            "--page-count", "4", "--transport", "tcp"]  # fmt: skip
    flags = [
        "--tls-cert", pki.cert("prefill"), "--tls-key", pki.key("prefill"),
        "--tls-client-ca", pki.ca, "--auth-policy", pki.policy, "--peer-allow", DECODE_PEERS,
        "--peer-allow", "spiffe://kvmesh/xfer/decode-b*", "--health-port", "50099",
    ]  # fmt: skip
    ns = cli.build_parser().parse_args([*base, *flags])
    cfg = load_config(cli=cli.overrides(ns))
    assert cfg.tls.mutual and cfg.auth.policy_file == pki.policy and cfg.health_port == 50099
    assert cfg.peers.allowed_identities == [DECODE_PEERS, "spiffe://kvmesh/xfer/decode-b*"]
    derived = cfg.peer_tls()
    assert (derived.ca_file, derived.cert_file, derived.key_file) == (
        pki.ca, pki.cert("prefill"), pki.key("prefill"),
    )  # fmt: skip
    ns = cli.build_parser().parse_args(
        [*base, *flags, "--peer-tls-ca", "/ca2", "--peer-tls-cert", "/c2", "--peer-tls-key", "/k2"]
    )
    assert load_config(cli=cli.overrides(ns)).peer_tls().cert_file == "/c2"
    secret = tmp_path / "s"
    secret.write_text("0123456789abcdef\n")
    env = {
        "KVMESH_XFER_TLS__CERT_FILE": pki.cert("prefill"),
        "KVMESH_XFER_TLS__KEY_FILE": pki.key("prefill"),
        "KVMESH_XFER_PEERS__SHARED_SECRET_FILE": str(secret),
        "KVMESH_XFER_AUTH__POLICY_FILE": pki.policy,
    }
    ns = cli.build_parser().parse_args(base)
    cfg = load_config(environ=env, cli=cli.overrides(ns))
    assert cfg.peers.shared_secret_file == str(secret) and cfg.peer_tls().active


def test_advertise_address_flag_environment_and_checks() -> None:
    """--advertise-address and KVMESH_XFER_ADVERTISE_ADDRESS reach the config; a decode
    sidecar on a wildcard host must name one (the prefill side dials it back), a prefill
    sidecar need not (nobody dials it at an address it gives); undialable ones are refused."""
    base = ["--pool-path", "/dev/shm/x", "--page-size", "64", "--page-count", "4"]
    ns = cli.build_parser().parse_args(
        [*base, "--role", "decode", "--host", "::", "--advertise-address", "[fd00::7]:50061"]
    )
    assert load_config(cli=cli.overrides(ns)).advertise_address == "[fd00::7]:50061"
    ns = cli.build_parser().parse_args([*base, "--role", "decode", "--host", "0.0.0.0"])
    env = {"KVMESH_XFER_ADVERTISE_ADDRESS": "10.1.2.3:50061"}
    assert load_config(environ=env, cli=cli.overrides(ns)).advertise_address == "10.1.2.3:50061"
    for host in ("0.0.0.0", "::"):
        ns = cli.build_parser().parse_args([*base, "--role", "decode", "--host", host])
        with pytest.raises(ConfigError, match="advertise_address is required on a decode"):
            load_config(cli=cli.overrides(ns))
        ns = cli.build_parser().parse_args([*base, "--role", "prefill", "--host", host])
        assert load_config(cli=cli.overrides(ns)).advertise_address == ""
    # A concrete host is its own default.
    ns = cli.build_parser().parse_args([*base, "--role", "decode", "--host", "10.0.0.5"])
    assert load_config(cli=cli.overrides(ns)).advertise_address == ""
    bad = {
        "0.0.0.0:50061": "no address a peer can dial",
        "[::]:50061": "no address a peer can dial",
        "10.0.0.5": "expected host:port",
        "10.0.0.5:0": "expected host:port",
        "10.0.0.5:http": "expected host:port",
        ":50061": "expected host:port",
        "fd00::7:50061": "IPv6 address in brackets",
    }
    for value, why in bad.items():
        ns = cli.build_parser().parse_args(
            [*base, "--role", "prefill", "--advertise-address", value]
        )
        with pytest.raises(ConfigError, match=why):
            load_config(cli=cli.overrides(ns))
    assert cli.main([*base, "--role", "decode", "--host", "0.0.0.0", "--print-config"]) == 2


def test_a_decode_sidecar_on_a_wildcard_host_is_dialed_back_at_its_advertised_address(
    pki: Pki, pools: Pools
) -> None:
    """A decode sidecar listening on 0.0.0.0 (as in a pod) sends its advertise address in
    Bootstrap; the prefill sidecar heartbeats it there, verifying its certificate against
    that host (127.0.0.1 is one of its SANs; 0.0.0.0 is not, so the old host:port would
    fail every ping and with it the room), and the room completes."""
    port = free_port()
    advertised = f"127.0.0.1:{port}"
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill")
    d_cfg = secure_config("decode", pools.decode.path, pki, "decode",
                          host="0.0.0.0", port=port, advertise_address=advertised)  # fmt: skip
    with (
        ThreadedSidecar(p_cfg) as tp,
        ThreadedSidecar(d_cfg) as td,
        engine(pki, tp.address) as pc,
        engine(pki, advertised) as dc,
    ):
        p, d = tp.server, td.server
        assert p is not None and d is not None
        assert d.address == f"0.0.0.0:{port}" and d.advertise_address == advertised
        dc.register_room(80, tp.address, [50, 51], 3)
        wait_status(dc, 80, RoomStatus.WAITING_FOR_INPUT)
        assert p.logic.active_peers() == {d.transport.name: advertised}
        # The prefill side's first successful ping records the decode instance id.
        deadline = time.monotonic() + 20
        while p._peer_instance.get(advertised) != d.instance_id:
            assert time.monotonic() < deadline, "the prefill sidecar never reached the decode one"
            time.sleep(0.02)
        assert pc.poll(80)[0] == RoomStatus.WAITING_FOR_INPUT
        pc.add_transfer_request(80, [60, 61], (0, 2), True, 4, 0)
        wait_status(dc, 80, RoomStatus.SUCCESS)
        assert pools.same(0, [60, 61], [50, 51], 4, 3)


def test_plaintext_health_port_serves_only_health(pki: Pki, pools: Pools) -> None:
    """kubelet probes need no certificate on health_port; the service is not there."""
    cfg = secure_config("decode", pools.decode.path, pki, "decode", health_port=free_port())
    with ThreadedSidecar(cfg) as td:
        server = td.server
        assert server is not None and server.health_port
        with grpc.insecure_channel(f"127.0.0.1:{server.health_port}") as ch:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:
                pb_grpc.XferServiceStub(ch).Poll(pb.PollRequest(room=1), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
