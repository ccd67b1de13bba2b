"""How the Redis backend connects: credentials, TLS reasons, ACL rights and retries.

Security (SECURITY.md, "Redis"): an ACL user and password (from the URL, the
``password`` argument, or ``password_file``, read at every new connection so a
rotated Kubernetes Secret is picked up without a restart) and TLS for
``rediss://`` URLs, with a CA and an optional client certificate. Refused
credentials, a missing ACL right and a failed TLS verification raise
:class:`BackendAuthError`, whose message names the user and the redacted URL,
never the password (:func:`redact_url`).

The URL helpers (:func:`redact_url`, :func:`split_url_credentials`) need only
the standard library; :mod:`indexer.config` uses them to check and print a URL.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit, urlunsplit

from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.credentials import CredentialProvider
from redis.exceptions import AuthenticationError, RedisClusterException, RedisError
from redis.exceptions import ConnectionError as RedisConnectionError

from kvmesh.errors import Unavailable

__all__ = [
    "ACL_CLUSTER_COMMANDS",
    "ACL_COMMANDS",
    "CLIENT_ERRORS",
    "RETRY_ONCE_ON_CONNECTION_ERROR",
    "BackendAuthError",
    "Credentials",
    "PasswordFileError",
    "acl_rule",
    "glob_escape",
    "read_password_file",
    "redact_url",
    "split_url_credentials",
    "tls_reason",
]

#: Retry policy of every Redis client: one immediate retry on a connection
#: error only. A pooled connection that died with a Redis restart reconnects
#: instead of failing the first call after recovery (every script is
#: idempotent: applies carry sequence numbers). No retry on timeouts: a hung
#: Redis must surface as Unavailable within one socket timeout.
RETRY_ONCE_ON_CONNECTION_ERROR = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))

#: What a failed Redis call raises. RedisClusterException is no RedisError: the
#: cluster client raises it when no node can be reached or authenticated to.
CLIENT_ERRORS = (RedisError, RedisClusterException, OSError)

#: Query parameters of a Redis URL that carry a secret (redis-py reads ``password``).
_SECRET_QUERY_KEYS = frozenset({"password"})


#: Commands the backend sends: directly, and from inside its scripts (Redis
#: checks a script's calls against the caller's ACL too). SECURITY.md's rule is
#: built from these by :func:`acl_rule`; tests run the contract suite as a user
#: with exactly these rights.
ACL_COMMANDS = (
    # direct
    "ping", "evalsha", "script|load", "hgetall", "hmget", "smembers", "zrangebyscore",
    # inside scripts (indexer/redis/lua/)
    "del", "exists", "get", "hdel", "hget", "hincrby", "hlen", "hscan", "hset", "hsetnx",
    "incr", "sadd", "set", "srem", "time", "unlink", "zadd", "zrange", "zrem",
    # route-time predictions only: their names' TTLs (predict.lua), and the
    # pending prefill a Match with predictions answers (pmatch.lua)
    "pexpire", "pttl", "zcount",
    # WatchIndex served over Redis only (KEYS.md, "Watching"): the change stream
    "xadd", "xread", "xrevrange",
)  # fmt: skip
#: Extra commands of a cluster client: the slot map, and the command table
#: redis-py reads to find the keys of a command (both at discovery).
ACL_CLUSTER_COMMANDS = ("cluster|slots", "command")


def glob_escape(raw: bytes) -> bytes:
    """``raw`` with Redis's glob characters (``*?[]\\``) escaped: a literal in a pattern."""
    out = bytearray()
    for c in raw:
        if c in b"*?[]\\":
            out.append(0x5C)
        out.append(c)
    return bytes(out)


def acl_rule(prefix: str = "kvm", *, cluster: bool = False) -> str:
    """The least ACL rights of an indexer using key ``prefix``, as ``ACL SETUSER``
    rules (no channels, keys under the prefix only, the commands it sends).
    ``dump()``, a test and debugging aid, needs ``+scan`` on top."""
    glob = glob_escape(prefix.encode("utf-8")).decode("utf-8")
    keys = f"~{glob}:* ~{{{glob}}}:*" if cluster else f"~{glob}:*"
    commands = ACL_COMMANDS + (ACL_CLUSTER_COMMANDS if cluster else ())
    return f"resetkeys {keys} resetchannels -@all " + " ".join(f"+{c}" for c in commands)


class BackendAuthError(Unavailable):
    """Redis refused this replica: wrong or missing credentials (WRONGPASS,
    NOAUTH), a missing ACL right (NOPERM), an unreadable password file, or a
    TLS peer that does not verify. A configuration problem that retrying does
    not fix; ``kvmesh indexer serve`` exits when it sees one at start. The
    message names the user and the redacted URL, never the password."""


class PasswordFileError(AuthenticationError):
    """``password_file`` cannot be read (raised inside redis-py's connect)."""


def redact_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (userinfo and ``password=``
    query parameter): the only form of a Redis URL that may be logged or put in
    an error message."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, _, hostport = netloc.rpartition("@")
            user, colon, _ = userinfo.partition(":")
            netloc = f"{user}{':***' if colon else ''}@{hostport}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            query = urlencode(
                [(k, "***" if k.lower() in _SECRET_QUERY_KEYS else v) for k, v in pairs],
                safe="*",
            )
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:
        return "<unparsable Redis URL>"


def split_url_credentials(url: str) -> tuple[str, str, str | None]:
    """``(url without credentials, username, password or None)`` of a Redis URL.

    The credentials move from the URL to a credential provider, so that redis-py
    never holds the password in its connection settings.
    """
    parts = urlsplit(url)
    username, password = "", None
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, netloc = netloc.rpartition("@")
        user, colon, secret = userinfo.partition(":")
        username = unquote(user)
        password = unquote(secret) if colon else None
    kept: list[tuple[str, str]] = []
    for k, v in parse_qsl(parts.query, keep_blank_values=True):
        if k.lower() == "password":
            password = v
        elif k.lower() == "username":
            username = v
        else:
            kept.append((k, v))
    return urlunsplit(parts._replace(netloc=netloc, query=urlencode(kept))), username, password


def read_password_file(path: str) -> str:
    """The password in file ``path``; :class:`PasswordFileError` when it cannot be read."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
        raise PasswordFileError(f"cannot read redis.password_file {path}: {reason}") from None
    # A Secret written with `echo` ends in a newline that is not part of the password.
    return text.rstrip("\r\n")


class Credentials(CredentialProvider):
    """AUTH arguments for each new connection.

    With ``password_file`` the file is read on every new connection, so a
    rotated password is used as soon as a connection is (re)opened, including
    the immediate retry after an authentication failure. Never shows the
    password in its repr.
    """

    def __init__(self, username: str, password: str | None, password_file: str) -> None:
        self.username = username
        self._password = password
        self.password_file = password_file

    def get_credentials(self) -> tuple[str] | tuple[str, str]:
        """``(username, password)``, or ``(password,)`` for the default user."""
        if self.password_file:
            password = read_password_file(self.password_file)
        else:
            password = self._password or ""
        return (self.username, password) if self.username else (password,)

    async def get_credentials_async(self) -> tuple[str] | tuple[str, str]:
        """As :meth:`get_credentials` (a small local file read)."""
        return self.get_credentials()

    def __repr__(self) -> str:
        source = f"file {self.password_file}" if self.password_file else "***"
        return f"Credentials(username={self.username!r}, password={source})"


def tls_reason(text: str) -> str:
    """The OpenSSL reason inside a redis-py connection error message."""
    start = text.find("[SSL")
    if start < 0:
        return text
    return text[start:].split(" (_ssl.c", 1)[0].rstrip(".")


async def client_cert_refusal(
    url: str,
    *,
    ca_file: str | None,
    cert_file: str,
    key_file: str | None,
    check_hostname: bool,
    timeout_s: float,
) -> BaseException | None:
    """The TLS error a server at ``url`` sends when it refuses our client
    certificate, found by a TLS connection that sends nothing; None when it
    keeps the connection open for ``timeout_s`` (or cannot be reached at all).

    In TLS 1.3 the server checks the client's certificate after the client has
    finished its handshake: the client's first command is on its way when the
    alert comes, and a server closing with that command unread resets the
    connection, which can discard the alert before it is read. Under load a
    refused certificate then reads as "connection reset by peer", an outage to
    retry forever. A connection that sends nothing closes cleanly and reads
    the alert.
    """
    parts = urlsplit(url)
    host, port = parts.hostname or "localhost", parts.port or 6379
    try:
        ctx = ssl.create_default_context(cafile=ca_file)
        ctx.check_hostname = check_hostname
        ctx.load_cert_chain(cert_file, key_file)
    except (OSError, ValueError):  # files the connection itself fails on, and says so
        return None
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(
                host, port, ssl=ctx, server_hostname=host
            )
            await reader.read(1)
    except ssl.SSLError as e:
        return e
    except (OSError, TimeoutError):
        return None
    finally:
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
    return None
