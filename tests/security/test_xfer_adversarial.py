"""The xfer sidecars under attack: what a peer may send, and what it gets written.

Every attack runs against real sidecars (``kvmesh xfer serve`` processes, or
sidecars in a thread of the test process where the attacker must reach into
one: a compromised prefill sidecar posting forged writes through its own
transport), over real TCP and real NIXL, and checks three things: the
attack is refused, it is counted in ``kvmesh_xfer_peer_refusals_total``
under its reason (scraped from the sidecar's /metrics, as Prometheus
would), and the pools are untouched outside the pages the legitimate rooms
own. Pools are shared-memory files full of random bytes, so a checksum of a
whole pool (or of everything but a room's pages) shows any stray write.

Attackers: ``stranger`` (a fleet certificate in no policy), the ``prefill``
identity calling where only decode sidecars are peers, a second prefill
sidecar Q admitted for its own room B attacking room A of prefill sidecar P,
a holder of the decode sidecar's TCP key sending frames by hand, an
eavesdropper replaying a recorded data connection, and a decode identity
flooding a prefill sidecar with rooms.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import socket
import struct
import threading
import time
import urllib.request
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.xfer.v1 import xfer_pb2 as pb
from kvmesh.api.xfer.v1 import xfer_pb2_grpc as pb_grpc
from kvmesh.tls import ChannelFactory, ClientTLS
from lab.bench.xfer_procs import Sidecar, ThreadedSidecar
from lab.devcerts import write_bundle
from lab.redisproc import free_port
from tests.security.pki import Pki
from xfer.client import XferClient
from xfer.config import XferConfig
from xfer.logic import RoomStatus
from xfer.pool import KVPool, PoolGeometry
from xfer.server import XferServer
from xfer.transport import TcpTransport, open_tcp_link, wait_state
from xfer.wire import FLAG_AUX, FLAG_LAST, Tag

GEO = PoolGeometry(page_size=4096, page_count=256, aux_size=64, aux_count=16)
PS = GEO.page_size
BACKENDS = ["tcp", "nixl"]
DECODE_PEERS = "spiffe://kvmesh/xfer/decode-*"
PREFILL_PEERS = "spiffe://kvmesh/xfer/prefill-*"
REFUSALS = "kvmesh_xfer_peer_refusals_total"

_FRAME = struct.Struct("<QIH")  # request id, run count, tag length (the TCP data frame)
_RUN = struct.Struct("<QQ")  # destination offset, length
_ACK = struct.Struct("<QB")  # request id, status


# -- pools and checksums ---------------------------------------------------------------------


class Pools:
    """Prefill pools and a decode pool in shared memory, every byte random."""

    def __init__(self, tmp_path: Path, n_prefill: int = 2) -> None:
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
        tag = f"kvx-adv-{os.getpid()}-{random.getrandbits(32):x}"
        self.prefill = [KVPool.create(str(base / f"{tag}-p{i}"), GEO) for i in range(n_prefill)]
        self.decode = KVPool.create(str(base / f"{tag}-d"), GEO)
        for p in [*self.prefill, self.decode]:
            p.view[:] = os.urandom(GEO.total_bytes)

    def close(self) -> None:
        for p in [*self.prefill, self.decode]:
            p.close()
            p.unlink()


@pytest.fixture
def pools(tmp_path: Path) -> Iterator[Pools]:
    p = Pools(tmp_path)
    yield p
    p.close()


def checksum(pool: KVPool, skip_pages: Iterable[int] = (), skip_aux: Iterable[int] = ()) -> str:
    """SHA-256 of the whole pool except the given pages and aux slots."""
    pages, aux = set(skip_pages), set(skip_aux)
    h = hashlib.sha256()
    for i in range(GEO.page_count):
        if i not in pages:
            h.update(pool.page(i))
    for i in range(GEO.aux_count):
        if i not in aux:
            h.update(pool.aux(i))
    return h.hexdigest()


def arrived(src: KVPool, dst: KVPool, pages: list[tuple[int, int]], aux: tuple[int, int]) -> bool:
    """Whether the (source, destination) pages and the aux slot of a room match."""
    same = all(bytes(src.page(s)) == bytes(dst.page(d)) for s, d in pages)
    return same and bytes(src.aux(aux[0])) == bytes(dst.aux(aux[1]))


# -- sidecars, callers, metrics -----------------------------------------------------------------


def secure_args(pki: Pki, name: str, allow: str, metrics_port: int, *extra: str) -> list[str]:
    """``kvmesh xfer serve`` flags: mutual TLS as ``name``, the test policy, the peers
    allowed, metrics on ``metrics_port``."""
    return [
        "--tls-cert", pki.cert(name), "--tls-key", pki.key(name), "--tls-client-ca", pki.ca,
        "--auth-policy", pki.policy, "--peer-allow", allow, "--heartbeat-interval-s", "0.5",
        "--metrics-port", str(metrics_port), *extra,
    ]  # fmt: skip


def secure_config(role: str, pool_path: str, pki: Pki, name: str, **over: Any) -> XferConfig:
    """A sidecar run in a thread, secured as :func:`secure_args`, metrics on a free port."""
    base: dict[str, Any] = {
        "role": role,
        "port": 0,
        "metrics_port": free_port(),
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


def decode_process(pki: Pki, pools: Pools, transport: str) -> tuple[Sidecar, int]:
    """A decode sidecar process (mutual TLS, peers prefill-*); its metrics port."""
    port = free_port()
    ds = Sidecar("decode", pools.decode.path, GEO, transport=transport,
                 extra=secure_args(pki, "decode", PREFILL_PEERS, port))  # fmt: skip
    ds.wait_ready()
    return ds, port


def tls_of(pki: Pki, name: str | None) -> ClientTLS:
    return ClientTLS.model_validate(pki.client_tls(name))


def engine(pki: Pki, address: str) -> XferClient:
    return XferClient(address, tls=tls_of(pki, "engine-a"))


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a sidecar's /metrics: (name, sorted labels) -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = float(s.value)
    return out


def refused(port: int, reason: str) -> float:
    """``kvmesh_xfer_peer_refusals_total{reason}`` of the sidecar serving metrics on ``port``;
    fails the test when the sidecar does not expose that reason."""
    samples = scrape(port)
    key = (REFUSALS, (("reason", reason),))
    assert key in samples, f"{REFUSALS}{{reason={reason!r}}} is not exposed"
    return samples[key]


def wait_refused(port: int, reason: str, want: float, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while refused(port, reason) < want:
        if time.monotonic() > deadline:
            pytest.fail(f"{reason} refusals stayed at {refused(port, reason)}, wanted {want}")
        time.sleep(0.02)


def rooms_tracked(port: int) -> float:
    return sum(v for (n, _), v in scrape(port).items() if n == "kvmesh_xfer_rooms")


def wait_status(client: XferClient, room: int, want: RoomStatus, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        st, reason = client.poll(room)
        if st == want:
            return reason
        if st == RoomStatus.FAILED:
            pytest.fail(f"room {room} failed: {reason}")
        time.sleep(0.005)
    pytest.fail(f"room {room} stuck in {client.poll(room)}, wanted {want.name}")


def peer_call(address: str, tls: ClientTLS, method: str, request: Any) -> grpc.StatusCode:
    """Call a peer method as the holder of ``tls``; the status code it ends with."""
    ch = ChannelFactory(address, tls).sync_channel()
    try:
        getattr(pb_grpc.XferServiceStub(ch), method)(request, timeout=10)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        assert isinstance(e, grpc.Call)
        return e.code()
    finally:
        ch.close()


def raw_call(address: str, tls: ClientTLS, method: str, body: bytes) -> tuple[grpc.StatusCode, str]:
    """Call ``method`` with a hand-encoded request body (fields a stub cannot encode)."""
    ch = ChannelFactory(address, tls).sync_channel()
    try:
        ch.unary_unary(f"/kvmesh.xfer.v1.XferService/{method}")(body, timeout=10)
        return grpc.StatusCode.OK, ""
    except grpc.RpcError as e:
        assert isinstance(e, grpc.Call)
        return e.code(), e.details() or ""
    finally:
        ch.close()


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def tcp_metadata(size: int = GEO.total_bytes) -> bytes:
    return json.dumps({"host": "127.0.0.1", "port": 1, "size": size, "key": "k"}).encode()


def bootstrap_request(room: int, **kw: Any) -> pb.BootstrapRequest:
    """A Bootstrap a TCP decode sidecar would send."""
    base: dict[str, Any] = dict(
        room=room, generation=7, dst_page_indices=[1, 2], aux_index=0, peer_name="agent-x",
        peer_address="127.0.0.1:1", page_size=GEO.page_size, page_count=GEO.page_count,
        aux_size=GEO.aux_size, aux_count=GEO.aux_count, transport="tcp",
        agent_metadata=tcp_metadata(),
    )  # fmt: skip
    base.update(kw)
    return pb.BootstrapRequest(**base)


def decode_agent(prefill: XferServer) -> str:
    """The transport name under which an in-process prefill sidecar knows the decode one."""
    peers = prefill.logic.active_peers()
    assert len(peers) == 1, peers
    return next(iter(peers))


def post(server: XferServer, peer: str, runs: list[tuple[int, int, int]], tag: Tag) -> str:
    """A raw write through a sidecar's own transport, past its logic; its final state."""
    h = server.transport.post(peer, runs, tag.encode())
    try:
        return wait_state(server.transport, h, 10.0)
    finally:
        server.transport.release(h)


def page_run(src: int, dst: int, n: int = 1) -> tuple[int, int, int]:
    return (src * PS, dst * PS, n * PS)


def aux_off(slot: int) -> int:
    return GEO.kv_bytes + slot * GEO.aux_size


def aux_run(src: int, dst: int) -> tuple[int, int, int]:
    return (aux_off(src), aux_off(dst), GEO.aux_size)


def tcp_key_of(prefill: XferServer, decode: str) -> tuple[int, str]:
    """Port and key of the decode sidecar's data port, as the prefill sidecar holds them."""
    assert isinstance(prefill.transport, TcpTransport)
    md = json.loads(prefill.transport._peer_md[decode])
    return int(md["port"]), str(md["key"])


def send_frame(
    sock: socket.socket, runs: list[tuple[int, int]], tag: bytes, fill: int = 0xEE, rid: int = 1
) -> int | None:
    """Send one data frame (its bytes ``fill``); the ack's status, or None when the receiver
    closed the connection instead."""
    header = _FRAME.pack(rid, len(runs), len(tag)) + b"".join(_RUN.pack(o, n) for o, n in runs)
    try:
        sock.sendall(header + tag)
        total = sum(n for _, n in runs)
        if total <= 4 * GEO.total_bytes:  # a huge claimed length: the header is the attack
            chunk = bytes([fill]) * min(total, 1 << 20)
            left = total
            while left:
                k = min(left, len(chunk))
                sock.sendall(chunk[:k])
                left -= k
        data = b""
        while len(data) < _ACK.size:
            got = sock.recv(_ACK.size - len(data))
            if not got:
                return None
            data += got
    except (ConnectionError, TimeoutError):
        return None
    got_rid, status = _ACK.unpack(data)
    assert got_rid == rid
    return status


def closed_by_peer(sock: socket.socket, timeout: float = 10.0) -> bool:
    """Whether the other end closes ``sock`` (without a byte of answer that matters) within
    ``timeout``; reads and drops whatever it sends first (a challenge)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset: closed all the same
        return True
    return True


# -- 1. an unlisted peer -------------------------------------------------------------------------


def test_an_unlisted_peer_cannot_bootstrap_abort_or_ping(pki: Pki, pools: Pools) -> None:
    """Identities that are not a sidecar's peers call its peer methods: a fleet certificate
    in no policy, the engine, a sidecar of the same side, no certificate and a certificate
    of another CA. All are refused (the last two in the handshake, so uncounted), the
    others each counted as not_admitted; no room appears and no byte of either pool
    changes. The admitted pair then moves a room, touching only its pages."""
    pport, dport = free_port(), free_port()
    ps = Sidecar("prefill", pools.prefill[0].path, GEO, transport="tcp",
                 extra=secure_args(pki, "prefill", DECODE_PEERS, pport))  # fmt: skip
    ds = Sidecar("decode", pools.decode.path, GEO, transport="tcp",
                 extra=secure_args(pki, "decode", PREFILL_PEERS, dport))  # fmt: skip
    try:
        ps.wait_ready()
        ds.wait_ready()
        p_before, d_before = checksum(pools.prefill[0]), checksum(pools.decode)
        denied = grpc.StatusCode.PERMISSION_DENIED
        # stranger: in no policy; engine-a: role engine; prefill: role peer, but a prefill
        # sidecar admits decode sidecars only.
        for name in ("stranger", "engine-a", "prefill"):
            assert peer_call(ps.address, tls_of(pki, name), "Bootstrap",
                             bootstrap_request(1)) == denied  # fmt: skip
        # ... and the decode identity is no peer of a decode sidecar.
        for name in ("stranger", "engine-a", "decode"):
            tls = tls_of(pki, name)
            assert peer_call(ds.address, tls, "Abort", pb.AbortRequest(room=1)) == denied
            assert peer_call(ds.address, tls, "Heartbeat", pb.HeartbeatRequest()) == denied
        rogue = ClientTLS(ca_file=pki.ca, cert_file=pki.rogue_cert("server"),
                          key_file=pki.rogue_key("server"))  # fmt: skip
        for tls in (tls_of(pki, None), rogue):
            code = peer_call(ps.address, tls, "Bootstrap", bootstrap_request(3))
            assert code == grpc.StatusCode.UNAVAILABLE
        assert refused(pport, "not_admitted") == 3
        assert refused(dport, "not_admitted") == 6
        with engine(pki, ps.address) as pc, engine(pki, ds.address) as dc:
            for client in (pc, dc):
                for room in (1, 3):
                    with pytest.raises(Exception, match="unknown room"):
                        client.poll(room)
            assert checksum(pools.prefill[0]) == p_before
            assert checksum(pools.decode) == d_before

            outside = checksum(pools.decode, [30, 31], [2])
            dc.register_room(9, ps.address, [30, 31], 2)
            pc.add_transfer_request(9, [40, 41], (0, 2), True, 3, 0)
            wait_status(dc, 9, RoomStatus.SUCCESS)
            assert arrived(pools.prefill[0], pools.decode, [(40, 30), (41, 31)], (3, 2))
            assert checksum(pools.decode, [30, 31], [2]) == outside
            assert checksum(pools.prefill[0]) == p_before
    finally:
        ps.stop()
        ds.stop()


# -- 2. a listed peer acting for another peer's room ------------------------------------------


@pytest.mark.parametrize("transport", BACKENDS)
def test_a_listed_peer_cannot_complete_write_or_abort_another_peers_room(
    pki: Pki, pools: Pools, transport: str
) -> None:
    """Prefill sidecar Q, admitted for its own room B, attacks room A of prefill sidecar P
    on the same decode sidecar: it writes and notifies A's pages with A's tag (even knowing
    A's generation), writes A's pages under B's tag, and aborts A guessing A's generation
    from B's (rooms registered one after the other). A is neither completed nor failed,
    each attempt is counted, and no byte outside A's pages changes (over NIXL a write is
    one-sided: it lands in the pages it names, so only what is outside A's pages is
    checked there; over TCP nothing lands at all). P then completes A."""
    ds, dport = decode_process(pki, pools, transport)
    over = {"transport": transport}
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill", **over)
    q_cfg = secure_config("prefill", pools.prefill[1].path, pki, "prefill", **over)
    try:
        with (
            ThreadedSidecar(p_cfg) as tp,
            ThreadedSidecar(q_cfg) as tq,
            engine(pki, tp.address) as pc,
            engine(pki, tq.address) as qc,
            engine(pki, ds.address) as dc,
        ):
            q = tq.server
            assert q is not None
            room_a, room_b = 41, 42
            a_dst, b_dst = [5, 6, 7, 8], [60, 61]
            gen_a = dc.register_room(room_a, tp.address, a_dst, 2)
            dc.register_room(room_b, tq.address, b_dst, 3)
            wait_status(dc, room_a, RoomStatus.WAITING_FOR_INPUT)
            wait_status(dc, room_b, RoomStatus.WAITING_FOR_INPUT)
            whole = checksum(pools.decode)
            outside_a = checksum(pools.decode, a_dst, [2])
            outside_ab = checksum(pools.decode, [*a_dst, *b_dst], [2, 3])
            to_decode = decode_agent(q)

            # A's own tag, pages and aux slot, from Q.
            tag_a = Tag(room_a, gen_a, 0, FLAG_LAST | FLAG_AUX, 1)
            state = post(q, to_decode, [page_run(90, 5, 4), aux_run(1, 2)], tag_a)
            if transport == "tcp":
                assert state == "ERR"
                wait_refused(dport, "foreign_agent", 1)
                # B's tag (Q's own room), A's pages.
                tag_b = Tag(room_b, q.logic.room_generation(room_b) or 0, 0, 0, 0)
                assert post(q, to_decode, [page_run(91, 5, 1)], tag_b) == "ERR"
                wait_refused(dport, "outside_room", 1)
                assert checksum(pools.decode) == whole
            else:
                assert state == "DONE"  # one-sided: the receiver cannot stop the bytes
                wait_refused(dport, "foreign_agent", 1)
            assert checksum(pools.decode, a_dst, [2]) == outside_a

            # Abort A on the decode side, guessing its generation from B's.
            gen_b = q.logic.room_generation(room_b)
            assert gen_b is not None
            before = refused(dport, "stale_generation")
            guesses = [g for g in range(gen_b - 8, gen_b + 9) if g != gen_b]
            q_tls = tls_of(pki, "prefill")
            for g in guesses:
                req = pb.AbortRequest(room=room_a, generation=g, reason="mine now")
                assert peer_call(ds.address, q_tls, "Abort", req) == grpc.StatusCode.OK
            assert dc.poll(room_a)[0] == RoomStatus.WAITING_FOR_INPUT
            assert refused(dport, "stale_generation") == before + len(guesses)
            assert checksum(pools.decode, a_dst, [2]) == outside_a

            pc.add_transfer_request(room_a, [80, 81, 82, 83], (0, 4), True, 4, 0)
            qc.add_transfer_request(room_b, [70, 71], (0, 2), True, 5, 0)
            wait_status(dc, room_a, RoomStatus.SUCCESS)
            wait_status(dc, room_b, RoomStatus.SUCCESS)
            a_pairs = list(zip([80, 81, 82, 83], a_dst, strict=True))
            assert arrived(pools.prefill[0], pools.decode, a_pairs, (4, 2))
            assert arrived(pools.prefill[1], pools.decode, [(70, 60), (71, 61)], (5, 3))
            assert checksum(pools.decode, [*a_dst, *b_dst], [2, 3]) == outside_ab
            assert ds.proc.poll() is None
    finally:
        ds.stop()


def test_a_write_before_the_bootstrap_answer_waits_for_it(pki: Pki, pools: Pools) -> None:
    """Room C is registered with a prefill address that has not answered its Bootstrap
    yet (it never does). Prefill sidecar Q, which holds the decode sidecar's TCP key for
    its own room B, writes C's pages with C's tag meanwhile: no agent is known for C yet,
    so the write must wait for the answer instead of landing. It is held, and refused once
    the room ends (cleared by its engine); not a byte of the pool changes."""
    ds, dport = decode_process(pki, pools, "tcp")
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers
    q_cfg = secure_config("prefill", pools.prefill[1].path, pki, "prefill")
    try:
        with ThreadedSidecar(q_cfg) as tq, engine(pki, ds.address) as dc:
            q = tq.server
            assert q is not None
            dc.register_room(42, tq.address, [60], 3)
            wait_status(dc, 42, RoomStatus.WAITING_FOR_INPUT)
            gen_c = dc.register_room(43, f"127.0.0.1:{silent.getsockname()[1]}", [20, 21], 1)
            whole = checksum(pools.decode)
            tag_c = Tag(43, gen_c, 0, FLAG_LAST | FLAG_AUX, 1)
            h = q.transport.post(decode_agent(q), [page_run(90, 20, 2), aux_run(0, 1)],
                                 tag_c.encode())  # fmt: skip
            time.sleep(0.5)
            assert dc.poll(43)[0] == RoomStatus.BOOTSTRAPPING
            assert checksum(pools.decode) == whole, "the write landed before the answer"
            assert q.transport.check(h) == "PROC"
            before = refused(dport, "stale_generation")
            dc.clear(43)
            assert wait_state(q.transport, h, 10.0) == "ERR"
            q.transport.release(h)
            assert refused(dport, "stale_generation") == before + 1
            assert checksum(pools.decode) == whole
    finally:
        silent.close()
        ds.stop()


def test_a_decode_peer_cannot_abort_rebootstrap_or_impersonate_another_peers_room(
    tmp_path: Path, pools: Pools
) -> None:
    """Two decode identities of one fleet on a prefill sidecar: decode-1 aborts decode-0's
    room, bootstraps it again, and bootstraps a room of its own under decode-0's agent
    name. Each is refused and counted as not_owner; decode-0's room keeps its pages."""
    paths = write_bundle(tmp_path / "fleet", {
        "prefill": ["127.0.0.1", "spiffe://t/xfer/prefill-0"],
        "decode-0": ["spiffe://t/xfer/decode-0"],
        "decode-1": ["spiffe://t/xfer/decode-1"],
    })  # fmt: skip
    ca = str(paths["ca"])

    def tls(name: str) -> ClientTLS:
        return ClientTLS(ca_file=ca, cert_file=str(paths[name]), key_file=str(paths[f"{name}_key"]))

    cfg = XferConfig.model_validate({
        "role": "prefill", "port": 0, "metrics_port": free_port(), "transport": "tcp",
        "shutdown_grace_s": 0, "heartbeat_interval_s": 60,
        "pool": {"path": pools.prefill[0].path, "page_size": GEO.page_size,
                 "page_count": GEO.page_count, "aux_size": GEO.aux_size,
                 "aux_count": GEO.aux_count},
        "tls": {"cert_file": str(paths["prefill"]), "key_file": str(paths["prefill_key"]),
                "client_ca_file": ca},
        "peers": {"allowed_identities": ["spiffe://t/xfer/decode-*"]},
    })  # fmt: skip
    with ThreadedSidecar(cfg) as tp:
        p = tp.server
        assert p is not None
        whole = checksum(pools.prefill[0])
        mine = bootstrap_request(10, peer_name="agent-0", generation=77)
        assert peer_call(tp.address, tls("decode-0"), "Bootstrap", mine) == grpc.StatusCode.OK
        other = tls("decode-1")
        abort = pb.AbortRequest(room=10, generation=77, reason="mine now")
        assert peer_call(tp.address, other, "Abort", abort) == grpc.StatusCode.PERMISSION_DENIED
        again = bootstrap_request(10, peer_name="agent-1", dst_page_indices=[100])
        assert peer_call(tp.address, other, "Bootstrap", again) == grpc.StatusCode.ALREADY_EXISTS
        posing = bootstrap_request(11, peer_name="agent-0")
        assert peer_call(tp.address, other, "Bootstrap", posing) == (
            grpc.StatusCode.PERMISSION_DENIED
        )
        assert refused(cfg.metrics_port, "not_owner") == 3
        snap = p.logic.room_snapshot(10)
        assert snap is not None and snap.status == RoomStatus.WAITING_FOR_INPUT
        assert snap.dst_pages == [1, 2] and snap.generation == 77
        assert p.logic.room_snapshot(11) is None
        assert checksum(pools.prefill[0]) == whole


# -- 3. forged page indices, aux indices and run lengths -----------------------------------------


def test_forged_runs_outside_the_pool_or_the_room_are_refused(pki: Pki, pools: Pools) -> None:
    """Prefill sidecar P, bootstrapped for room A (which owns the pool's last page), sends
    frames by hand on an authenticated data connection: runs that wrap around 2^64, end
    past the pool, have length zero or 2^64-1, run from the last page into the aux slots,
    spill out of A's aux slot or name room B's, sit off a page boundary, claim 2^20+1
    runs, or carry a tag that is not kvmesh's. Each is refused before a byte lands (a
    frame the receiver cannot drain ends the connection), counted under its reason, and
    the pool is byte for byte what it was. A and B then complete."""
    ds, dport = decode_process(pki, pools, "tcp")
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill")
    try:
        with (
            ThreadedSidecar(p_cfg) as tp,
            engine(pki, tp.address) as pc,
            engine(pki, ds.address) as dc,
        ):
            p = tp.server
            assert p is not None
            a_dst, b_dst = [252, 253, 254, 255], [10, 11]
            gen_a = dc.register_room(61, tp.address, a_dst, 14)
            dc.register_room(62, tp.address, b_dst, 15)
            wait_status(dc, 61, RoomStatus.WAITING_FOR_INPUT)
            wait_status(dc, 62, RoomStatus.WAITING_FOR_INPUT)
            port, key = tcp_key_of(p, decode_agent_of(p, 61))
            whole = checksum(pools.decode)
            tag_a = Tag(61, gen_a, 0, FLAG_LAST | FLAG_AUX, 1).encode()
            plain_a = Tag(61, gen_a, 0).encode()
            top = 1 << 64
            last = 255 * PS

            def link() -> socket.socket:
                return open_tcp_link("127.0.0.1", port, p.transport.name, key)

            # (runs, tag, reason, whether the receiver can still drain the frame)
            attacks: list[tuple[list[tuple[int, int]], bytes, str, bool]] = [
                ([(top - PS, 2 * PS)], tag_a, "out_of_range", True),  # wraps to [0, PS)
                ([(top - 1, 1)], tag_a, "out_of_range", True),  # "-1"
                ([(GEO.total_bytes - 1, 2)], tag_a, "out_of_range", True),  # past the end
                ([(last, 0)], tag_a, "out_of_range", True),  # length zero
                ([(last, PS + GEO.aux_size)], tag_a, "outside_room", True),  # into aux
                ([(aux_off(14), 2 * GEO.aux_size)], tag_a, "outside_room", True),  # spills
                ([(aux_off(15), GEO.aux_size)], tag_a, "outside_room", True),  # B's aux
                ([(aux_off(14), GEO.aux_size)], plain_a, "outside_room", True),  # unflagged
                ([(last + 1, PS)], tag_a, "outside_room", True),  # off a page boundary
                ([(b_dst[0] * PS, PS)], tag_a, "outside_room", True),  # B's page, A's tag
                ([(last, PS)], b"not a kvmesh tag", "malformed", True),
                ([(last, top - 1)], tag_a, "out_of_range", False),  # 2^64-1 bytes
                ([(0, PS)] * 2 + [(last, top - PS)], tag_a, "out_of_range", False),
            ]
            for runs, tag, reason, drained in attacks:
                before = refused(dport, reason)
                with link() as s:
                    status = send_frame(s, runs, tag)
                    if drained:
                        assert status == 1, (runs, tag)  # refused, connection kept
                        assert send_frame(s, [], Tag(62, 1, 0).encode(), rid=2) == 1
                    else:
                        assert status is None, (runs, tag)
                assert refused(dport, reason) >= before + 1, (runs, reason)
                assert checksum(pools.decode) == whole, (runs, reason)
            # A frame claiming more runs than any chunk has: the header alone ends the link.
            before = refused(dport, "malformed")
            with link() as s:
                s.sendall(_FRAME.pack(1, (1 << 20) + 1, len(tag_a)))
                assert closed_by_peer(s)
            assert refused(dport, "malformed") == before + 1
            assert checksum(pools.decode) == whole
            assert dc.poll(61)[0] == RoomStatus.WAITING_FOR_INPUT

            outside = checksum(pools.decode, [*a_dst, *b_dst], [14, 15])
            pc.add_transfer_request(61, [1, 2, 3, 4], (0, 4), True, 0, 0)
            pc.add_transfer_request(62, [5, 6], (0, 2), True, 1, 0)
            wait_status(dc, 61, RoomStatus.SUCCESS)
            wait_status(dc, 62, RoomStatus.SUCCESS)
            a_pairs = list(zip([1, 2, 3, 4], a_dst, strict=True))
            assert arrived(pools.prefill[0], pools.decode, a_pairs, (0, 14))
            assert arrived(pools.prefill[0], pools.decode, [(5, 10), (6, 11)], (1, 15))
            assert checksum(pools.decode, [*a_dst, *b_dst], [14, 15]) == outside
    finally:
        ds.stop()


def decode_agent_of(prefill: XferServer, room: int) -> str:
    snap = prefill.logic.room_snapshot(room)
    assert snap is not None and snap.peer
    return snap.peer


def test_forged_indices_and_geometry_in_bootstrap_are_refused(pki: Pki, pools: Pools) -> None:
    """A decode identity sends Bootstraps a stub could not encode: page and aux indices
    as the 10-byte varint of -1 (2^64-1; a uint32 field keeps 2^32-1), a page size of
    2^64-1, and a pool of 2^32-1 pages while the transport metadata it sends registers
    the real size (so every destination page beyond it would be past the peer's pool).
    Each is INVALID_ARGUMENT, counted as out_of_range, and leaves no room."""
    pport = free_port()
    ps = Sidecar("prefill", pools.prefill[0].path, GEO, transport="tcp",
                 extra=secure_args(pki, "prefill", DECODE_PEERS, pport))  # fmt: skip
    try:
        ps.wait_ready()
        tls = tls_of(pki, "decode")
        minus_one = varint((1 << 64) - 1)
        cases = {
            # field 3 (dst_page_indices, packed): -1
            "page -1": bootstrap_request(71).SerializeToString()
            + b"\x1a" + varint(len(minus_one)) + minus_one,
            # field 4 (aux_index): -1
            "aux -1": bootstrap_request(72).SerializeToString() + b"\x20" + minus_one,
            # field 8 (page_size): 2^64-1
            "page size": bootstrap_request(73).SerializeToString() + b"\x40" + minus_one,
            # a pool of 2^32-1 pages claimed, the real one registered; page 2^32-2 named
            "claimed pool": bootstrap_request(
                74, page_count=(1 << 32) - 1, dst_page_indices=[(1 << 32) - 2]
            ).SerializeToString(),
        }  # fmt: skip
        for what, body in cases.items():
            code, details = raw_call(ps.address, tls, "Bootstrap", body)
            assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, code, details)
        assert refused(pport, "out_of_range") == len(cases)
        with engine(pki, ps.address) as pc:
            for room in (71, 72, 73, 74):
                with pytest.raises(Exception, match="unknown room"):
                    pc.poll(room)
    finally:
        ps.stop()


# -- 4. a recycled room and a stale generation ------------------------------------------------


@pytest.mark.parametrize("transport", BACKENDS)
def test_a_recycled_room_is_not_completed_or_aborted_by_its_old_generation(
    pki: Pki, pools: Pools, transport: str
) -> None:
    """Room R is registered, bootstrapped with P, cleared unfinished and registered again
    (a new generation, new pages, P again: the one agent whose writes R accepts). P then
    sends a complete last chunk tagged with the old generation, and Aborts with it on the
    decode side; the decode sidecar Aborts P's side with the old generation too. The new
    room is neither completed nor failed, every stale message is counted, and the pool is
    untouched (TCP: not a byte; NIXL: outside the pages the stale write named)."""
    ds, dport = decode_process(pki, pools, transport)
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill", transport=transport)
    try:
        with (
            ThreadedSidecar(p_cfg) as tp,
            engine(pki, tp.address) as pc,
            engine(pki, ds.address) as dc,
        ):
            p = tp.server
            assert p is not None
            old = dc.register_room(3, tp.address, [1, 2], 0)
            wait_status(dc, 3, RoomStatus.WAITING_FOR_INPUT)
            dc.clear(3)
            pc.clear(3)
            new = dc.register_room(3, tp.address, [4, 5], 1)
            assert new != old
            wait_status(dc, 3, RoomStatus.WAITING_FOR_INPUT)
            wait_status(pc, 3, RoomStatus.WAITING_FOR_INPUT)
            whole = checksum(pools.decode)
            outside_written = checksum(pools.decode, [1, 2, 4, 5], [0, 1])
            before = refused(dport, "stale_generation")

            stale = Tag(3, old, 0, FLAG_LAST | FLAG_AUX, 1)
            state = post(p, decode_agent(p), [page_run(20, 1, 2), aux_run(2, 0)], stale)
            assert state == ("ERR" if transport == "tcp" else "DONE")
            wait_refused(dport, "stale_generation", before + 1)
            # The new pages too, under the old generation.
            state = post(p, decode_agent(p), [page_run(22, 4, 2), aux_run(3, 1)], stale)
            assert state == ("ERR" if transport == "tcp" else "DONE")
            wait_refused(dport, "stale_generation", before + 2)
            p_tls = tls_of(pki, "prefill")
            req = pb.AbortRequest(room=3, generation=old, reason="stale")
            assert peer_call(ds.address, p_tls, "Abort", req) == grpc.StatusCode.OK
            wait_refused(dport, "stale_generation", before + 3)
            assert dc.poll(3)[0] == RoomStatus.WAITING_FOR_INPUT
            if transport == "tcp":
                assert checksum(pools.decode) == whole
            else:
                assert checksum(pools.decode, [1, 2, 4, 5], [0, 1]) == outside_written

            # The decode sidecar's identity aborting P's room with the old generation.
            pport = p.config.metrics_port
            p_before = refused(pport, "stale_generation")
            d_tls = tls_of(pki, "decode")
            assert peer_call(tp.address, d_tls, "Abort", req) == grpc.StatusCode.OK
            assert refused(pport, "stale_generation") == p_before + 1
            assert pc.poll(3)[0] == RoomStatus.WAITING_FOR_INPUT

            outside = checksum(pools.decode, [4, 5], [1])
            pc.add_transfer_request(3, [30, 31], (0, 2), True, 6, 0)
            wait_status(dc, 3, RoomStatus.SUCCESS)
            assert arrived(pools.prefill[0], pools.decode, [(30, 4), (31, 5)], (6, 1))
            assert checksum(pools.decode, [4, 5], [1]) == outside
    finally:
        ds.stop()


# -- 5. the TCP data port and its key ------------------------------------------------------------


def _attacker_post(pool: KVPool, metadata: dict[str, Any], tag: Tag) -> str:
    """Post one write through a TCP transport of the attacker's own to the endpoint in
    ``metadata``; ERR when the connection is refused."""
    t = TcpTransport(pool)
    try:
        t.add_peer("victim", json.dumps(metadata).encode())
        try:
            h = t.post("victim", [page_run(0, 20)], tag.encode())
        except ConnectionError:
            return "ERR"
        return wait_state(t, h, 10.0)
    finally:
        t.close()


def test_the_tcp_data_port_refuses_no_key_a_wrong_key_and_a_handshake_flood(
    pki: Pki, pools: Pools
) -> None:
    """Senders without the decode sidecar's key: one that sends a frame at once, one that
    says nothing, one whose metadata has no key, one with a wrong key, and more idle
    connections than the handshake cap. Each connection is closed unanswered (the idle
    ones after the handshake timeout, the one over the cap at once) and counted under
    its reason; the pool does not change."""
    limits = {"tcp_handshake_timeout_s": 2.0, "tcp_max_handshakes": 4}
    cfg = secure_config("decode", pools.decode.path, pki, "decode", limits=limits)
    with ThreadedSidecar(cfg) as td, engine(pki, td.address) as dc:
        d = td.server
        assert d is not None and isinstance(d.transport, TcpTransport)
        mport, port = cfg.metrics_port, d.transport.port
        gen = dc.register_room(51, "127.0.0.1:1", [20], 0)  # bootstraps nowhere
        whole = checksum(pools.decode)
        tag = Tag(51, gen, 0, FLAG_LAST, 1)

        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            header = _FRAME.pack(1, 1, 29) + _RUN.pack(20 * PS, PS) + tag.encode()
            with_bytes = header + b"\xee" * PS
            with contextlib.suppress(ConnectionError):
                s.sendall(with_bytes)
            assert closed_by_peer(s)
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            assert closed_by_peer(s, timeout=10)  # after the handshake timeout
        md = json.loads(d.transport.metadata())
        assert _attacker_post(pools.prefill[1], {**md, "key": ""}, tag) == "ERR"
        wait_refused(mport, "tcp_no_key", 3)
        assert _attacker_post(pools.prefill[1], {**md, "key": "0" * 32}, tag) == "ERR"
        wait_refused(mport, "tcp_wrong_key", 1)

        idle = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(4)]
        time.sleep(0.2)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=10) as extra:
                assert closed_by_peer(extra, timeout=1.0)  # at once, not after 2 s
            wait_refused(mport, "tcp_handshake_limit", 1)
            for s in idle:
                assert closed_by_peer(s, timeout=10)
        finally:
            for s in idle:
                s.close()
        wait_refused(mport, "tcp_no_key", 7)
        assert d.transport.refused_connections >= 9
        assert checksum(pools.decode) == whole
        assert dc.poll(51)[0] != RoomStatus.SUCCESS


class Relay:
    """A TCP relay in front of a data port that records what the sender sends: an
    eavesdropper on the (unencrypted) data plane."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._lsock = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._lsock.getsockname()[1]
        self.sent = bytearray()
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self._lsock.accept()
        upstream = socket.create_connection(("127.0.0.1", self.upstream_port))
        back = threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True)
        back.start()
        self._pump(client, upstream, True)
        self.done.set()
        back.join(5)
        for s in (client, upstream, self._lsock):
            s.close()

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)


def test_a_recorded_tcp_connection_cannot_be_replayed(pki: Pki, pools: Pools) -> None:
    """An eavesdropper records prefill sidecar P's data connection (a legitimate first
    chunk of room A) and replays it on a connection of its own, followed by a forged
    last chunk of A. The replayed handshake is refused (counted as a replayed key): the
    forged bytes never land and A does not complete. P then completes A."""
    d_cfg = secure_config("decode", pools.decode.path, pki, "decode")
    p_cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill")
    with (
        ThreadedSidecar(d_cfg) as td,
        ThreadedSidecar(p_cfg) as tp,
        engine(pki, td.address) as dc,
        engine(pki, tp.address) as pc,
    ):
        d, p = td.server, tp.server
        assert d is not None and p is not None and isinstance(d.transport, TcpTransport)
        a_dst = [30, 31, 32, 33]
        gen_a = dc.register_room(81, tp.address, a_dst, 4)
        wait_status(dc, 81, RoomStatus.WAITING_FOR_INPUT)
        relay = Relay(d.transport.port)
        md = json.loads(d.transport.metadata())
        p.transport.add_peer("via-relay", json.dumps({**md, "port": relay.port}).encode())
        assert post(p, "via-relay", [page_run(40, 30, 2)], Tag(81, gen_a, 0)) == "DONE"
        p.transport.remove_peer("via-relay")
        assert relay.done.wait(10)
        recorded = bytes(relay.sent)
        wait_status(dc, 81, RoomStatus.TRANSFERRING)
        whole = checksum(pools.decode)

        forged_tag = Tag(81, gen_a, 1, FLAG_LAST | FLAG_AUX, 2).encode()
        runs = [(32 * PS, 2 * PS), (aux_off(4), GEO.aux_size)]
        forged = (
            _FRAME.pack(99, len(runs), len(forged_tag))
            + b"".join(_RUN.pack(o, n) for o, n in runs)
            + forged_tag
            + b"\xee" * (2 * PS + GEO.aux_size)
        )
        with socket.create_connection(("127.0.0.1", d.transport.port), timeout=10) as s:
            with contextlib.suppress(ConnectionError):
                s.sendall(recorded + forged)
            closed_by_peer(s, timeout=3)
        assert checksum(pools.decode) == whole, "the replayed connection wrote into the pool"
        assert dc.poll(81)[0] == RoomStatus.TRANSFERRING
        wait_refused(d_cfg.metrics_port, "tcp_replayed_key", 1)

        pc.add_transfer_request(81, [40, 41], (0, 2), False, 0, 0)
        pc.add_transfer_request(81, [42, 43], (2, 4), True, 5, 1)
        wait_status(dc, 81, RoomStatus.SUCCESS)
        pairs = list(zip([40, 41, 42, 43], a_dst, strict=True))
        assert arrived(pools.prefill[0], pools.decode, pairs, (5, 4))


def test_a_prefill_sidecar_accepts_no_writes_even_with_its_key(pki: Pki, pools: Pools) -> None:
    """A prefill sidecar only sends; its TCP key is never handed to anyone. Should it leak,
    its data port still writes nothing into the prefill pool: the frame is refused and
    counted."""
    cfg = secure_config("prefill", pools.prefill[0].path, pki, "prefill")
    with ThreadedSidecar(cfg) as tp:
        p = tp.server
        assert p is not None and isinstance(p.transport, TcpTransport)
        key = json.loads(p.transport.metadata())["key"]
        whole = checksum(pools.prefill[0])
        with open_tcp_link("127.0.0.1", p.transport.port, "intruder", key) as s:
            assert send_frame(s, [(5 * PS, PS)], Tag(1, 1, 0, FLAG_LAST, 1).encode()) == 1
        wait_refused(cfg.metrics_port, "write_to_prefill", 1)
        assert checksum(pools.prefill[0]) == whole


# -- 6. a peer flooding rooms ------------------------------------------------------------------


def test_a_peer_flooding_rooms_is_capped_and_rate_limited(
    tmp_path: Path, pools: Pools, monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode-0, an admitted peer of a prefill sidecar process, bootstraps rooms its
    prefill engine never asked for: beyond limits.per_peer.max_rooms open rooms it is
    RESOURCE_EXHAUSTED (room_limit), and once it frees them, beyond
    limits.per_peer.bootstrap_rps (room_rate). The sidecar never tracks more than the
    cap for it, and decode-1, another peer, still moves a room byte for byte."""
    paths = write_bundle(tmp_path / "fleet", {
        "prefill": ["127.0.0.1", "spiffe://t/xfer/prefill-0"],
        "decode-0": ["127.0.0.1", "spiffe://t/xfer/decode-0"],
        "decode-1": ["127.0.0.1", "spiffe://t/xfer/decode-1"],
        "engine": ["spiffe://t/engine/e"],
    })  # fmt: skip
    ca = str(paths["ca"])

    def tls(name: str) -> ClientTLS:
        return ClientTLS(ca_file=ca, cert_file=str(paths[name]), key_file=str(paths[f"{name}_key"]))

    cap, rps, burst = 8, 2, 12
    monkeypatch.setenv("KVMESH_XFER_LIMITS__PER_PEER__MAX_ROOMS", str(cap))
    monkeypatch.setenv("KVMESH_XFER_LIMITS__PER_PEER__BOOTSTRAP_RPS", str(rps))
    monkeypatch.setenv("KVMESH_XFER_LIMITS__PER_PEER__BOOTSTRAP_BURST", str(burst))
    pport = free_port()
    ps = Sidecar("prefill", pools.prefill[0].path, GEO, transport="tcp", extra=[
        "--tls-cert", str(paths["prefill"]), "--tls-key", str(paths["prefill_key"]),
        "--tls-client-ca", ca, "--peer-allow", "spiffe://t/xfer/decode-*",
        "--metrics-port", str(pport), "--heartbeat-interval-s", "60",
    ])  # fmt: skip
    for name in ("MAX_ROOMS", "BOOTSTRAP_RPS", "BOOTSTRAP_BURST"):
        monkeypatch.delenv(f"KVMESH_XFER_LIMITS__PER_PEER__{name}")
    d_cfg = XferConfig.model_validate({
        "role": "decode", "port": 0, "metrics_port": 0, "transport": "tcp",
        "shutdown_grace_s": 0, "heartbeat_interval_s": 60,
        "pool": {"path": pools.decode.path, "page_size": GEO.page_size,
                 "page_count": GEO.page_count, "aux_size": GEO.aux_size,
                 "aux_count": GEO.aux_count},
        "tls": {"cert_file": str(paths["decode-1"]), "key_file": str(paths["decode-1_key"]),
                "client_ca_file": ca},
        "peers": {"allowed_identities": ["spiffe://t/xfer/prefill-*"]},
    })  # fmt: skip
    try:
        ps.wait_ready()
        p_whole = checksum(pools.prefill[0])
        channel = ChannelFactory(ps.address, tls("decode-0")).sync_channel()
        stub = pb_grpc.XferServiceStub(channel)

        def call(method: str, req: Any) -> tuple[grpc.StatusCode, str]:
            try:
                getattr(stub, method)(req, timeout=10)
                return grpc.StatusCode.OK, ""
            except grpc.RpcError as e:
                assert isinstance(e, grpc.Call)
                return e.code(), e.details() or ""

        def bootstrap(room: int) -> tuple[grpc.StatusCode, str]:
            return call("Bootstrap", bootstrap_request(room, peer_name="flood", generation=room))

        t0 = time.monotonic()
        first = [bootstrap(1000 + i) for i in range(cap + 2)]
        assert [c for c, _ in first[:cap]] == [grpc.StatusCode.OK] * cap, first
        for code, details in first[cap:]:
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_rooms" in details
        assert refused(pport, "room_limit") == 2
        assert rooms_tracked(pport) == cap

        # Its rooms end (it aborts them): it may open new ones, but only at its rate.
        for i in range(cap):
            req = pb.AbortRequest(room=1000 + i, generation=1000 + i, reason="done")
            assert call("Abort", req)[0] == grpc.StatusCode.OK
        second = [bootstrap(2000 + i) for i in range(30)]
        elapsed = time.monotonic() - t0
        channel.close()
        ok = sum(c == grpc.StatusCode.OK for c, _ in second)
        limited = [d for c, d in second if c == grpc.StatusCode.RESOURCE_EXHAUSTED]
        # What the bucket held after the first burst, plus what it refilled since.
        assert 1 <= ok <= burst - (cap + 2) + rps * elapsed + 1, (ok, elapsed)
        assert len(limited) == 30 - ok and all("bootstrap_rps" in d for d in limited), second
        assert refused(pport, "room_rate") == len(limited)
        assert refused(pport, "room_limit") == 2
        assert rooms_tracked(pport) <= cap

        outside = checksum(pools.decode, [30, 31], [2])
        with (
            ThreadedSidecar(d_cfg) as td,
            XferClient(ps.address, tls=tls("engine")) as pc,
            XferClient(td.address, tls=tls("engine")) as dc,
        ):
            dc.register_room(1, ps.address, [30, 31], 2)
            pc.add_transfer_request(1, [40, 41], (0, 2), True, 3, 0)
            wait_status(dc, 1, RoomStatus.SUCCESS)
            assert arrived(pools.prefill[0], pools.decode, [(40, 30), (41, 31)], (3, 2))
            assert checksum(pools.decode, [30, 31], [2]) == outside
        assert checksum(pools.prefill[0]) == p_whole
    finally:
        ps.stop()
