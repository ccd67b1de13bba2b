"""Transports: how bytes move from a prefill pool into a decode pool.

:class:`Transport` is the one interface; :class:`NixlTransport` (NIXL over
UCX, one-sided WRITE into the registered remote pool) and
:class:`TcpTransport` (a plain socket per peer, for hosts without NIXL) sit
beside it. Both deliver the same thing: after :meth:`Transport.post`, the
bytes of every run land in the peer's pool and then the peer's notification
handler receives the tag. Both check every run against the pools before any
byte moves.

What a receiver can refuse differs. A TCP receiver reads each frame's runs
and tag before its bytes: it refuses a sender that cannot prove it holds the
key its metadata carried (a challenge-response per connection, so a recorded
handshake cannot be replayed), and asks the write check
(:meth:`Transport.set_write_check`, the decode logic's room rules) before
writing a byte. A NIXL WRITE is
one-sided: the bytes land in the registered pool before the receiver hears
of them, so only the notification can be judged (by its sending agent's
name). See docs/xfer.md, "Security".

Thread-safety: ``post``/``check``/``release`` may be called from several
worker threads at once (one peer is only ever used by one queue, see
xfer/logic.py); the notification handler is called from one transport
thread.
"""

from __future__ import annotations

import abc
import collections
import contextlib
import hashlib
import hmac
import importlib
import itertools
import json
import logging
import secrets
import socket
import struct
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any, Literal

from kvmesh.errors import FailedPrecondition, InvalidArgument
from xfer.pool import KVPool

log = logging.getLogger(__name__)

#: Outcome of a posted transfer.
XferState = Literal["DONE", "PROC", "ERR"]

#: Called with (peer name, tag bytes) when a transfer from a peer has landed.
NotifHandler = Callable[[str, bytes], None]

#: Called with (peer name, tag bytes, runs as (destination offset, length))
#: before an incoming write lands; returns "" to allow it, else the reason.
WriteCheck = Callable[[str, bytes, Sequence[tuple[int, int]]], str]

#: Called with a reason of ``kvmesh_xfer_peer_refusals_total`` when the transport
#: itself refuses a peer (a data connection, a malformed frame).
RefusalHook = Callable[[str], None]


class NixlUnavailable(RuntimeError):
    """NIXL cannot be used here; the message says why and names the fallback."""


class Transport(abc.ABC):
    """Moves byte runs from the local pool into a peer's pool, then notifies the peer."""

    #: "nixl" or "tcp"; both sides of a room must use the same kind.
    kind: str = ""

    def __init__(self, pool: KVPool, name: str | None = None) -> None:
        self.pool = pool
        #: This side's agent name, unique per sidecar instance.
        self.name = name or f"kvx-{uuid.uuid4().hex[:12]}"
        self._handler: NotifHandler | None = None
        self._write_check: WriteCheck | None = None
        self._refusal_hook: RefusalHook | None = None
        #: Whether the logic has a room unfinished (:meth:`set_expecting`).
        self.expecting = False

    def set_notif_handler(self, handler: NotifHandler) -> None:
        """Route incoming notifications to ``handler`` (call before :meth:`start`)."""
        self._handler = handler

    def set_write_check(self, check: WriteCheck) -> None:
        """Ask ``check`` before an incoming write lands (call before :meth:`start`).

        Only transports that see a write before its bytes land can honour it
        (TCP); NIXL's one-sided writes cannot be stopped by the receiver.
        """
        self._write_check = check

    def set_refusal_hook(self, hook: RefusalHook) -> None:
        """Report what the transport itself refuses to ``hook`` (call before :meth:`start`)."""
        self._refusal_hook = hook

    def _refused(self, reason: str) -> None:
        if self._refusal_hook is not None:
            self._refusal_hook(reason)

    def set_expecting(self, expecting: bool) -> None:
        """Whether a room is unfinished, so that notifications may come
        (the logic says so as its first room starts and its last one ends).
        A transport that polls for them polls slowly while none is."""
        self.expecting = expecting

    def _notify(self, peer: str, tag: bytes) -> None:
        if self._handler is not None:
            try:
                self._handler(peer, tag)
            except Exception:
                log.exception("notification handler failed")

    @abc.abstractmethod
    def start(self) -> None:
        """Start listening / progress threads."""

    @abc.abstractmethod
    def metadata(self) -> bytes:
        """What a peer needs (once) to write into this side's pool."""

    @abc.abstractmethod
    def add_peer(self, name: str, metadata: bytes) -> None:
        """Learn a peer from its :meth:`metadata`; replaces an older entry of that name."""

    @abc.abstractmethod
    def has_peer(self, name: str) -> bool:
        """Whether :meth:`add_peer` was called for ``name`` (and not removed since)."""

    @abc.abstractmethod
    def remove_peer(self, name: str) -> None:
        """Forget a peer (e.g. it died or restarted)."""

    def peer_pool_size(self, name: str) -> int | None:
        """Bytes of the pool the peer's metadata registered (``None``: unknown peer, or a
        transport whose metadata does not say)."""
        return None

    @abc.abstractmethod
    def post(self, peer: str, runs: Sequence[tuple[int, int, int]], tag: bytes) -> Any:
        """Start writing ``runs`` ``(src_offset, dst_offset, length)`` to ``peer``; the
        peer is notified with ``tag`` once all of them landed. Returns a handle for
        :meth:`check`. Raises on a transfer that cannot start."""

    def read(self, peer: str, runs: Sequence[tuple[int, int, int]]) -> Any:
        """Start reading ``runs`` ``(local_offset, remote_offset, length)`` from ``peer``'s
        pool into the local pool (a prefetch). Returns a handle for :meth:`check`.
        Transports that cannot read from a peer raise FailedPrecondition."""
        raise FailedPrecondition(
            f"the {self.kind} transport cannot read from a peer; prefetch needs --transport nixl",
            field="transport",
        )

    @abc.abstractmethod
    def check(self, handle: Any) -> XferState:
        """State of a posted transfer."""

    def release(self, handle: Any) -> None:  # noqa: B027 - optional hook
        """Free a handle once it is DONE or ERR (or abandoned)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop threads and free resources. Idempotent."""


# -- NIXL -----------------------------------------------------------------------------

_NIXL_MD = struct.Struct("<QQ")  # remote pool base address, remote pool size


def check_runs(runs: Sequence[tuple[int, int, int]], lsize: int, rsize: int) -> None:
    """Raise :class:`InvalidArgument` naming the first run ``(local offset, remote
    offset, length)`` that is empty or outside the local (``lsize`` bytes) or the
    remote pool (``rsize``)."""
    for src, dst, n in runs:
        if src < 0 or n <= 0 or src + n > lsize or dst < 0 or dst + n > rsize:
            raise InvalidArgument(f"run {src}->{dst} ({n} bytes) outside a pool", field="run")


def import_nixl() -> Any:
    """The NIXL Python module, or :class:`NixlUnavailable` with the reason and the fix."""
    try:
        nixl_mod = importlib.import_module("nixl_cu12")
    except ImportError as e:
        try:
            nixl_mod = importlib.import_module("nixl")
        except ImportError:
            raise NixlUnavailable(
                f"NIXL is not installed ({e}); install it with "
                "`pip install --no-deps nixl-cu12 numpy`, or use --transport tcp"
            ) from e
    return nixl_mod


class NixlTransport(Transport):
    """NIXL agent over UCX with the whole pool registered as one DRAM segment.

    ``num_threads`` is passed to the UCX backend (its worker thread count; 0
    keeps NIXL's default). Notifications are drained by one poller thread.
    """

    kind = "nixl"

    #: Poller sleep bounds: it spins briefly after activity (a room's chunks
    #: arrive in bursts) and backs off when idle, doubling up to ``poll_max_s``
    #: (XferConfig.nixl_notify_poll_max_ms): the longest a room's first write
    #: waits to be seen, against the CPU an idle sidecar spends polling.
    _POLL_MIN_S = 0.0001
    POLL_MAX_S = 0.0005
    #: Poller pause while no room is unfinished on a decode sidecar, and
    #: always on a prefill one, which is never notified (:meth:`set_expecting`):
    #: a room starting wakes it at once. Polling every ``poll_max_s`` while
    #: idle cost an idle sidecar about 6 % of a core and every gRPC call on it
    #: 100-170 µs (its thread taking the GIL 2,000 times a second): an empty
    #: PollRooms to an idle prefill sidecar, three alternating pairs, p50
    #: 1,015-1,028 µs and p99 1.9-2.7 ms before, 843-929 µs and 1.5-1.7 ms
    #: resting. Not forever: UCX still gets its progress.
    IDLE_POLL_S = 0.05

    def __init__(
        self,
        pool: KVPool,
        name: str | None = None,
        *,
        num_threads: int = 0,
        progress_thread: bool = False,
        poll_max_s: float = POLL_MAX_S,
    ) -> None:
        super().__init__(pool, name)
        self._poll_max_s = max(self._POLL_MIN_S, poll_max_s)
        nixl_mod = import_nixl()
        # NIXL's progress thread polls UCX with no delay: it keeps one core
        # busy even when idle (measured: 100% of a core per sidecar). Our own
        # calls drive progress instead (check_xfer_state on the sender,
        # get_new_notifs in the poller on the receiver), so it is off by default.
        # RW sync: worker threads post concurrently while the poller reads notifications.
        cfg = nixl_mod.nixl_agent_config(
            enable_prog_thread=progress_thread,
            num_threads=num_threads,
            backends=["UCX"],
            sync_mode=nixl_mod.nixl_thread_sync_t.NIXL_THREAD_SYNC_RW,
        )
        try:
            self._agent = nixl_mod.nixl_agent(self.name, cfg)
        except Exception as e:
            raise NixlUnavailable(f"cannot create a NIXL agent: {e}") from e
        if "UCX" not in self._agent.backends:
            raise NixlUnavailable("NIXL has no UCX backend plugin here; use --transport tcp")
        g = pool.geometry
        self._reg = self._agent.register_memory([(pool.base_address, g.total_bytes, 0, "")], "DRAM")
        self._peers: dict[str, tuple[str, int, int]] = {}  # name -> (agent, base, size)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        #: Set while a room is unfinished (set_expecting), and to stop.
        self._expecting = threading.Event()
        self._poller: threading.Thread | None = None

    def set_expecting(self, expecting: bool) -> None:
        """Poll at full pace while ``expecting``; every :data:`IDLE_POLL_S` otherwise."""
        super().set_expecting(expecting)
        if expecting:
            self._expecting.set()
        else:
            self._expecting.clear()

    def start(self) -> None:
        """Start the notification poller."""
        self._poller = threading.Thread(target=self._poll_loop, name="nixl-notifs", daemon=True)
        self._poller.start()

    def _poll_loop(self) -> None:
        delay = self._POLL_MIN_S
        while not self._stop.is_set():
            try:
                notifs = self._agent.get_new_notifs()
            except Exception:
                log.exception("reading NIXL notifications failed")
                notifs = {}
            got = False
            for peer, msgs in notifs.items():
                for m in msgs:
                    got = True
                    self._notify(peer, bytes(m))
            if got:
                delay = self._POLL_MIN_S
            elif not self._expecting.is_set():
                # No room unfinished: wait for one to start (or the idle pause).
                self._expecting.wait(self.IDLE_POLL_S)
                delay = self._POLL_MIN_S
                continue
            else:
                delay = min(delay * 2, self._poll_max_s)
            self._stop.wait(delay)

    def metadata(self) -> bytes:
        """Pool base address and size, then NIXL's agent metadata."""
        g = self.pool.geometry
        md: bytes = self._agent.get_agent_metadata()
        return _NIXL_MD.pack(self.pool.base_address, g.total_bytes) + md

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Load the peer's NIXL agent metadata."""
        if len(metadata) <= _NIXL_MD.size:
            raise InvalidArgument("NIXL metadata too short", field="agent_metadata")
        base, size = _NIXL_MD.unpack_from(metadata)
        with self._lock:
            old = self._peers.pop(name, None)
            if old is not None:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(old[0])
            try:
                agent = self._agent.add_remote_agent(metadata[_NIXL_MD.size :])
            except Exception as e:
                raise InvalidArgument(
                    f"bad NIXL agent metadata: {e}", field="agent_metadata"
                ) from e
            agent_name = agent.decode() if isinstance(agent, bytes) else str(agent)
            self._peers[name] = (agent_name, base, size)

    def has_peer(self, name: str) -> bool:
        """Whether the peer's metadata is loaded."""
        return name in self._peers

    def peer_pool_size(self, name: str) -> int | None:
        """The pool size the peer's metadata gave."""
        entry = self._peers.get(name)
        return None if entry is None else entry[2]

    def remove_peer(self, name: str) -> None:
        """Invalidate the peer's metadata (disconnects)."""
        with self._lock:
            old = self._peers.pop(name, None)
        if old is not None:
            with contextlib.suppress(Exception):
                self._agent.remove_remote_agent(old[0])

    def post(self, peer: str, runs: Sequence[tuple[int, int, int]], tag: bytes) -> Any:
        """One NIXL WRITE of all runs (one descriptor per run) with ``tag`` as notification."""
        return self._xfer("WRITE", peer, runs, tag)

    def read(self, peer: str, runs: Sequence[tuple[int, int, int]]) -> Any:
        """One NIXL READ of all runs (one descriptor per run) from the peer's registered
        pool; no notification (the peer is not told)."""
        return self._xfer("READ", peer, [(lo, ro, n) for lo, ro, n in runs], b"")

    def _xfer(self, op: str, peer: str, runs: Sequence[tuple[int, int, int]], tag: bytes) -> Any:
        """Post ``op`` of ``runs`` ``(local_offset, remote_offset, length)``."""
        import numpy as np

        entry = self._peers.get(peer)
        if entry is None:
            raise FailedPrecondition(f"unknown peer {peer}", field="peer")
        agent, rbase, rsize = entry
        lbase = self.pool.base_address
        lsize = self.pool.geometry.total_bytes
        # Descriptors (address, length, device 0) by columns: a row at a time cost
        # 175 us for 64 runs and 430 for 450 (a coalesced write's), on the worker's
        # path to the copy; by columns 33 and 111.
        try:
            a = np.array(runs, dtype=np.int64).reshape(-1, 3)
            src, dst, n = a[:, 0], a[:, 1], a[:, 2]
            bad = bool(
                ((src < 0) | (n <= 0) | (src + n > lsize) | (dst < 0) | (dst + n > rsize)).any()
            )
        except OverflowError:  # a value beyond any pool
            bad = True
        if bad:
            check_runs(runs, lsize, rsize)  # names the first run outside
        local = np.zeros((len(runs), 3), dtype=np.uint64)
        remote = np.zeros((len(runs), 3), dtype=np.uint64)
        local[:, 0] = src + lbase
        local[:, 1] = n
        remote[:, 0] = dst + rbase
        remote[:, 1] = n
        ldesc = self._agent.get_xfer_descs(local, "DRAM")
        rdesc = self._agent.get_xfer_descs(remote, "DRAM")
        handle = self._agent.initialize_xfer(op, ldesc, rdesc, agent, tag)
        state = self._agent.transfer(handle)
        if state == "ERR":
            handle.release()
            raise ConnectionError(f"NIXL refused the {op} with {peer}")
        return handle

    def check(self, handle: Any) -> XferState:
        """NIXL's state of the transfer."""
        state: XferState = self._agent.check_xfer_state(handle)
        return state

    def release(self, handle: Any) -> None:
        """Release the NIXL handle (aborting it if still running)."""
        with contextlib.suppress(Exception):
            handle.release()

    def close(self) -> None:
        """Stop the poller and deregister the pool."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._expecting.set()  # (an idle poller wakes to see the stop)
        if self._poller is not None:
            self._poller.join(timeout=2)
        for name in list(self._peers):
            self.remove_peer(name)
        with contextlib.suppress(Exception):
            self._agent.deregister_memory(self._reg)


# -- TCP --------------------------------------------------------------------------------

# Wire version 3. The sender opens with a nonce; the receiver answers with a nonce of
# its own (the challenge); the sender sends its name and an HMAC-SHA256 under the
# receiver's key (from its metadata) over both nonces and the name; the receiver
# answers with its own HMAC. Each side proves it holds the key, and a recorded
# handshake proves nothing on another connection (the challenge is new). The key
# itself never travels on the data port. A receiver that refuses closes the
# connection without a word.
_OPEN = struct.Struct("<4s32s")  # magic, sender nonce
_CHALLENGE = struct.Struct("<4s32s")  # magic, receiver nonce
_HELLO = struct.Struct("<HH")  # sender name length, proof length; name, proof follow
_WELCOME = struct.Struct("<4s32s")  # magic, receiver proof
_FRAME = struct.Struct("<QIH")  # request id, run count, tag length
_RUN = struct.Struct("<QQ")  # destination offset, length
_ACK = struct.Struct("<QB")  # request id, status (0 ok, 1 rejected)
_TCP_MAGIC = b"kvt3"
_PROOF_SIZE = hashlib.sha256().digest_size
#: Longest sender name a hello may carry.
_MAX_HELLO_FIELD = 256
#: Accepted proofs remembered, to tell a replayed handshake from a wrong key (hours
#: of reconnections of a fleet's worth of peers, at 32 bytes each).
_SEEN_PROOFS = 4096

#: Largest run count of one frame; a frame claiming more is malformed and the
#: connection is dropped (a real chunk has at most one run per page).
_MAX_RUNS = 1 << 20


def _proof(key: str, side: bytes, first: bytes, second: bytes, name: bytes) -> bytes:
    msg = b"kvmesh xfer tcp v3 " + side + first + second + name
    return hmac.new(key.encode(), msg, hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    _recv_into(sock, memoryview(buf))
    return bytes(buf)


def _recv_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k


def open_tcp_link(
    host: str, port: int, name: str, key: str, timeout_s: float = 5.0
) -> socket.socket:
    """A data connection to a TCP receiver at ``host:port``, opened as sender ``name`` with
    the receiver's ``key`` (from its metadata; ``""`` presents no proof, which the receiver
    refuses): frames may follow at once. :class:`ConnectionError` when the receiver refuses
    the handshake or cannot prove it holds the key."""
    sock = socket.create_connection((host, port), timeout=timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        nonce = secrets.token_bytes(32)
        sock.sendall(_OPEN.pack(_TCP_MAGIC, nonce))
        magic, challenge = _CHALLENGE.unpack(_recv_exact(sock, _CHALLENGE.size))
        if magic != _TCP_MAGIC:
            raise ConnectionError(f"{host}:{port} is not a kvmesh TCP receiver of this version")
        nb = name.encode()
        proof = _proof(key, b"sender", challenge, nonce, nb) if key else b""
        sock.sendall(_HELLO.pack(len(nb), len(proof)) + nb + proof)
        magic, answer = _WELCOME.unpack(_recv_exact(sock, _WELCOME.size))
        expected = _proof(key, b"receiver", nonce, challenge, nb)
        if magic != _TCP_MAGIC or not hmac.compare_digest(answer, expected):
            raise ConnectionError(f"{host}:{port} did not prove it holds the key")
        sock.settimeout(None)
    except BaseException as e:
        sock.close()
        if isinstance(e, OSError | struct.error) and not isinstance(e, ConnectionError):
            raise ConnectionError(f"handshake with {host}:{port} failed: {e}") from e
        raise
    return sock


class _TcpPeer:
    """Sender side of one peer connection: frames out, acks in."""

    def __init__(self, name: str, host: str, port: int, my_name: str, key: str) -> None:
        self.name = name
        self.sock = open_tcp_link(host, port, my_name, key)
        self.send_lock = threading.Lock()
        self.state: dict[int, XferState] = {}
        self.dead = False
        self.reader = threading.Thread(target=self._read_acks, name=f"tcp-acks-{name}", daemon=True)
        self.reader.start()

    def _read_acks(self) -> None:
        try:
            while True:
                rid, status = _ACK.unpack(_recv_exact(self.sock, _ACK.size))
                self.state[rid] = "DONE" if status == 0 else "ERR"
                if status:
                    log.warning("peer %s refused a write (see its log for why)", self.name)
        except (OSError, ConnectionError):
            pass
        self.dead = True
        for rid, st in list(self.state.items()):
            if st == "PROC":
                self.state[rid] = "ERR"

    def close(self) -> None:
        self.dead = True
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class TcpTransport(Transport):
    """Plain TCP: each frame carries its runs, tag and bytes; the receiver writes
    them straight into its pool (after checking every run) and acknowledges.

    A connection must prove it holds the receiver's key, a random value of
    this instance that only its metadata carries (given to peers by
    Bootstrap), so a client that never bootstrapped cannot send frames at
    all; the proof answers a fresh challenge, so one recorded on the wire
    cannot be replayed. A connection that has not proved it within
    ``handshake_timeout_s`` is closed, and beyond ``max_handshakes``
    connections in their handshake a new one is closed at once.
    """

    kind = "tcp"

    def __init__(
        self,
        pool: KVPool,
        name: str | None = None,
        *,
        host: str = "127.0.0.1",
        advertise_host: str = "",
        handshake_timeout_s: float = 10.0,
        max_handshakes: int = 64,
    ) -> None:
        super().__init__(pool, name)
        self.handshake_timeout_s = handshake_timeout_s
        self.max_handshakes = max_handshakes
        self._handshaking = 0
        self._seen: set[bytes] = set()
        self._seen_order: collections.deque[bytes] = collections.deque()
        self._lsock = socket.create_server((host, 0))
        #: The host peers dial (the bind host unless advertised otherwise: a
        #: sidecar bound to 0.0.0.0 advertises its pod IP).
        self.host = advertise_host or host
        self.port: int = self._lsock.getsockname()[1]
        self._peers: dict[str, _TcpPeer] = {}
        self._peer_md: dict[str, bytes] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._last_refusal_log = -1e9
        self._key = secrets.token_hex(16)
        #: Connections closed in their handshake (no, a wrong or a replayed key proof;
        #: over the handshake cap).
        self.refused_connections = 0

    def start(self) -> None:
        """Start accepting peer connections."""
        threading.Thread(target=self._accept_loop, name="tcp-accept", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            with self._lock:
                full = self._handshaking >= self.max_handshakes
                if not full:
                    self._handshaking += 1
            if full:
                self._refuse_connection(
                    "tcp_handshake_limit",
                    f"{self.max_handshakes} connections are already in their handshake",
                )
                conn.close()
                continue
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._conns.add(conn)
            threading.Thread(target=self._serve_conn, args=(conn,), daemon=True).start()

    def _handshake(self, conn: socket.socket) -> str | None:
        """The sender's name once it proved it holds the key; ``None`` (refused, counted)."""
        try:
            conn.settimeout(self.handshake_timeout_s)
            magic, nonce = _OPEN.unpack(_recv_exact(conn, _OPEN.size))
            if magic != _TCP_MAGIC:
                self._refuse_connection("tcp_no_key", "not a kvmesh TCP sender of this version")
                return None
            challenge = secrets.token_bytes(32)
            conn.sendall(_CHALLENGE.pack(_TCP_MAGIC, challenge))
            nlen, plen = _HELLO.unpack(_recv_exact(conn, _HELLO.size))
            if nlen > _MAX_HELLO_FIELD or plen not in (0, _PROOF_SIZE):
                self._refuse_connection("tcp_no_key", "a malformed hello")
                return None
            name = _recv_exact(conn, nlen)
            proof = _recv_exact(conn, plen)
        except (OSError, struct.error):
            self._refuse_connection("tcp_no_key", "no hello before the handshake timeout")
            return None
        peer = name.decode("utf-8", "replace")
        if not proof:
            self._refuse_connection("tcp_no_key", f"{peer!r} presented no key")
            return None
        if not hmac.compare_digest(proof, _proof(self._key, b"sender", challenge, nonce, name)):
            with self._lock:
                replayed = proof in self._seen
            if replayed:
                self._refuse_connection("tcp_replayed_key", f"{peer!r} replayed a handshake")
            else:
                self._refuse_connection("tcp_wrong_key", f"{peer!r} did not prove this key")
            return None
        with self._lock:
            self._seen.add(proof)
            self._seen_order.append(proof)
            if len(self._seen_order) > _SEEN_PROOFS:
                self._seen.discard(self._seen_order.popleft())
        answer = _proof(self._key, b"receiver", nonce, challenge, name)
        try:
            conn.sendall(_WELCOME.pack(_TCP_MAGIC, answer))
            conn.settimeout(None)
        except OSError:
            return None
        return peer

    def _serve_conn(self, conn: socket.socket) -> None:
        pool = self.pool
        total = pool.geometry.total_bytes
        try:
            try:
                peer = self._handshake(conn)
            finally:
                with self._lock:
                    self._handshaking -= 1
            if peer is None:
                return
            while True:
                rid, nruns, tlen = _FRAME.unpack(_recv_exact(conn, _FRAME.size))
                if nruns > _MAX_RUNS:
                    self._refused("malformed")
                    log.warning("dropped the link of %s: a frame of %d runs", peer, nruns)
                    return
                runs = [_RUN.unpack_from(b, 0) for b in _chunks(conn, nruns)]
                tag = _recv_exact(conn, tlen)
                ok = all(off >= 0 and n > 0 and off + n <= total for off, n in runs)
                if self._write_check is not None:  # counts and logs its refusals
                    ok = not self._write_check(peer, tag, runs) and ok
                if not ok and sum(n for _, n in runs) > total:
                    return  # more bytes than the pool holds: malformed, drop the link
                for off, n in runs:
                    if ok:
                        _recv_into(conn, pool.view[off : off + n])
                    else:  # drain into scratch: nothing refused is ever written
                        _drain(conn, n)
                conn.sendall(_ACK.pack(rid, 0 if ok else 1))
                if ok:
                    self._notify(peer, tag)
                elif self._write_check is None:
                    log.warning("rejected a frame from %s with a run outside the pool", peer)
        except (OSError, struct.error):
            pass
        finally:
            self._conns.discard(conn)
            conn.close()

    def _refuse_connection(self, reason: str, why: str) -> None:
        with self._lock:
            self.refused_connections += 1
            now = time.monotonic()
            quiet = now - self._last_refusal_log < 10.0  # at most one line per 10 s
            if not quiet:
                self._last_refusal_log = now
        self._refused(reason)
        if not quiet:
            log.warning("refused a TCP data connection: %s", why)

    def metadata(self) -> bytes:
        """The listening endpoint, pool size and connection key, as JSON."""
        md = {
            "host": self.host,
            "port": self.port,
            "size": self.pool.geometry.total_bytes,
            "key": self._key,
        }
        return json.dumps(md).encode()

    def add_peer(self, name: str, metadata: bytes) -> None:
        """Remember the peer's endpoint; the connection opens on first use."""
        try:
            md = json.loads(metadata)
            _ = (str(md["host"]), int(md["port"]), int(md["size"]), str(md["key"]))
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"bad TCP metadata: {e}", field="agent_metadata") from e
        with self._lock:
            old = self._peers.pop(name, None)
            self._peer_md[name] = metadata
        if old is not None:
            old.close()

    def has_peer(self, name: str) -> bool:
        """Whether the peer's endpoint is known."""
        return name in self._peer_md

    def peer_pool_size(self, name: str) -> int | None:
        """The pool size the peer's metadata gave."""
        md = self._peer_md.get(name)
        return None if md is None else int(json.loads(md)["size"])

    def remove_peer(self, name: str) -> None:
        """Forget the peer and close its connection."""
        with self._lock:
            old = self._peers.pop(name, None)
            self._peer_md.pop(name, None)
        if old is not None:
            old.close()

    def _connection(self, name: str) -> _TcpPeer:
        with self._lock:
            peer = self._peers.get(name)
            if peer is not None and not peer.dead:
                return peer
            md = self._peer_md.get(name)
        if md is None:
            raise FailedPrecondition(f"unknown peer {name}", field="peer")
        info = json.loads(md)
        peer = _TcpPeer(name, info["host"], info["port"], self.name, str(info["key"]))
        with self._lock:
            self._peers[name] = peer
        return peer

    def post(self, peer: str, runs: Sequence[tuple[int, int, int]], tag: bytes) -> Any:
        """Send one frame with every run's bytes (blocking until handed to the kernel)."""
        md = self._peer_md.get(peer)
        if md is None:
            raise FailedPrecondition(f"unknown peer {peer}", field="peer")
        rsize = int(json.loads(md)["size"])
        check_runs(runs, self.pool.geometry.total_bytes, rsize)
        conn = self._connection(peer)
        rid = next(self._ids)
        header = _FRAME.pack(rid, len(runs), len(tag)) + b"".join(
            _RUN.pack(dst, n) for _, dst, n in runs
        )
        view = self.pool.view
        conn.state[rid] = "PROC"
        try:
            with conn.send_lock:
                conn.sock.sendall(header + tag)
                for src, _, n in runs:
                    conn.sock.sendall(view[src : src + n])
        except OSError as e:
            conn.state.pop(rid, None)
            conn.close()
            raise ConnectionError(f"sending to {peer} failed: {e}") from e
        return (conn, rid)

    def check(self, handle: Any) -> XferState:
        """DONE once the peer acknowledged the frame; ERR when it refused or the link died."""
        conn, rid = handle
        state: XferState = conn.state.get(rid, "ERR")
        if state == "PROC" and conn.dead:
            return "ERR"
        return state

    def release(self, handle: Any) -> None:
        """Forget the frame's state."""
        conn, rid = handle
        conn.state.pop(rid, None)

    def close(self) -> None:
        """Close the listener and every connection."""
        if self._closed:
            return
        self._closed = True
        # shutdown wakes the accept thread (a close from another thread does
        # not, on Linux: the thread stayed blocked for the life of the process)
        with contextlib.suppress(OSError):
            self._lsock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._lsock.close()
        for name in list(self._peers):
            self.remove_peer(name)
        for c in list(self._conns):
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)


def _drain(sock: socket.socket, n: int) -> None:
    scratch = memoryview(bytearray(min(n, 1 << 20)))
    while n > 0:
        k = min(n, len(scratch))
        _recv_into(sock, scratch[:k])
        n -= k


def _chunks(conn: socket.socket, nruns: int) -> list[bytes]:
    data = _recv_exact(conn, nruns * _RUN.size)
    return [data[i * _RUN.size : (i + 1) * _RUN.size] for i in range(nruns)]


def make_transport(
    kind: str,
    pool: KVPool,
    *,
    host: str = "127.0.0.1",
    advertise_host: str = "",
    nixl_threads: int = 0,
    nixl_progress_thread: bool = False,
    nixl_notify_poll_max_s: float = NixlTransport.POLL_MAX_S,
    tcp_handshake_timeout_s: float = 10.0,
    tcp_max_handshakes: int = 64,
) -> Transport:
    """The transport ``kind`` ("nixl" or "tcp") over ``pool``."""
    if kind == "nixl":
        return NixlTransport(
            pool,
            num_threads=nixl_threads,
            progress_thread=nixl_progress_thread,
            poll_max_s=nixl_notify_poll_max_s,
        )
    if kind == "tcp":
        return TcpTransport(
            pool,
            host=host,
            advertise_host=advertise_host,
            handshake_timeout_s=tcp_handshake_timeout_s,
            max_handshakes=tcp_max_handshakes,
        )
    raise ValueError(f"unknown transport {kind!r}")


def nixl_available() -> bool:
    """Whether NIXL can be imported here."""
    try:
        import_nixl()
    except NixlUnavailable:
        return False
    return True


def wait_state(transport: Transport, handle: Any, timeout_s: float) -> XferState:
    """Block until a posted transfer is DONE or ERR (or ``timeout_s`` passes: PROC)."""
    deadline = time.monotonic() + timeout_s
    delay = 0.00005
    while True:
        st = transport.check(handle)
        if st != "PROC" or time.monotonic() > deadline:
            return st
        time.sleep(delay)
        delay = min(delay * 2, 0.001)
