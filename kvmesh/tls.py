"""TLS and mutual TLS for every kvmesh gRPC server and client, with certificate reload.

Servers: :class:`ServerTLS` names a certificate chain, its key and, for mutual
TLS, the CA bundle that signs client certificates. :func:`add_port` binds a
port with it, or in plaintext with a warning when no certificate is given.
The credentials are *dynamic*: gRPC asks for the current certificates on
every new handshake, and :class:`_ServerCertReloader` answers with the files
re-read when their modification time changed (checked at most every
``reload_interval_s``), so a rotated Kubernetes Secret takes effect for new
connections without a restart. A file that fails to load is logged and the
previous certificates stay in use.

Clients: :class:`ClientTLS` names the CA that signs servers, an optional
client certificate (mutual TLS), a server-name override and an optional
bearer-token file. :class:`ChannelFactory` builds ``grpc.aio`` channels with
those credentials and says when the files changed (:meth:`ChannelFactory.stale`)
so that a long-lived client can open a new channel; a bearer token is sent
as ``authorization: Bearer …`` call credentials (only over TLS: gRPC itself
refuses call credentials on a plaintext channel, and kvmesh servers ignore a
token that arrives in plaintext).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import grpc
from pydantic import Field, model_validator

from kvmesh.configfile import ConfigError, StrictModel

log = logging.getLogger(__name__)

__all__ = [
    "ChannelFactory",
    "ClientTLS",
    "ServerTLS",
    "TLSFileError",
    "add_port",
    "server_credentials",
]


class TLSFileError(ConfigError):
    """A certificate, key or CA file is missing, unreadable or not PEM."""


class ServerTLS(StrictModel):
    """Transport security of a server port (all empty: plaintext)."""

    cert_file: str = Field(
        default="",
        description="PEM certificate chain the server presents (a Kubernetes TLS Secret's "
        "tls.crt). Empty: plaintext, logged as a warning at start.",
    )
    key_file: str = Field(default="", description="PEM private key of cert_file (tls.key).")
    client_ca_file: str = Field(
        default="",
        description="PEM CA bundle that signs client certificates (ca.crt). Set: mutual TLS, "
        "clients without a certificate from this CA are refused during the handshake "
        "(client_auth: require), or are not asked for one (client_auth: optional).",
    )
    client_auth: Literal["require", "optional"] = Field(
        default="require",
        description="With client_ca_file: require a client certificate (mutual TLS), or "
        "do not request one (optional: gRPC Python cannot request a certificate without "
        "requiring it, so on such a port callers identify with bearer tokens only; run "
        "token clients and certificate clients on separate replicas or ports).",
    )
    reload_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="How often, at most, the files' modification times are checked on a new "
        "handshake; changed files are loaded for new connections without a restart.",
    )

    @model_validator(mode="after")
    def _pairs(self) -> ServerTLS:
        if bool(self.cert_file) != bool(self.key_file):
            missing = "key_file" if self.cert_file else "cert_file"
            raise ValueError(f"tls.{missing} is required with the other (certificate and key)")
        if self.client_ca_file and not self.cert_file:
            raise ValueError("tls.client_ca_file needs tls.cert_file and tls.key_file")
        return self

    @property
    def enabled(self) -> bool:
        """Whether the port serves TLS."""
        return bool(self.cert_file)

    @property
    def mutual(self) -> bool:
        """Whether clients are asked for certificates."""
        return bool(self.client_ca_file)


class ClientTLS(StrictModel):
    """Transport security of a client's channel to a kvmesh server."""

    enabled: bool = Field(
        default=False,
        description="Dial with TLS. Implied when any file below is set; alone, the system "
        "CA roots verify the server.",
    )
    ca_file: str = Field(
        default="", description="PEM CA bundle that signs the server's certificate."
    )
    cert_file: str = Field(
        default="", description="PEM client certificate chain for mutual TLS (tls.crt)."
    )
    key_file: str = Field(default="", description="PEM private key of cert_file (tls.key).")
    server_name: str = Field(
        default="",
        description="Name to verify the server certificate against (and send as SNI) "
        "instead of the target's host.",
    )
    token_file: str = Field(
        default="",
        description="File holding a bearer token sent as `authorization: Bearer <token>` "
        "(re-read when it changes). Needs TLS.",
    )
    reload_interval_s: float = Field(
        default=10.0,
        gt=0,
        description="How often, at most, the files are checked for changes; a long-lived "
        "client then opens a new channel with them.",
    )

    @model_validator(mode="after")
    def _pairs(self) -> ClientTLS:
        if bool(self.cert_file) != bool(self.key_file):
            missing = "key_file" if self.cert_file else "cert_file"
            raise ValueError(f"tls.{missing} is required with the other (certificate and key)")
        return self

    @property
    def active(self) -> bool:
        """Whether the channel uses TLS."""
        return self.enabled or bool(self.ca_file or self.cert_file or self.token_file)


def _read(path: str, what: str) -> bytes:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise TLSFileError(f"cannot read {what} {path!r}: {e.strerror or e}") from e
    if b"-----BEGIN" not in data:
        raise TLSFileError(f"{what} {path!r} is not PEM (no '-----BEGIN' line)")
    return data


def file_stamp(paths: Sequence[str]) -> tuple[tuple[int, int, int, int], ...]:
    """A stamp of ``paths`` that changes when any file is replaced or rewritten.

    ctime and inode too: a Kubernetes Secret update swaps a symlink
    (``..data``), which may keep the target's mtime.
    """
    out = []
    for p in paths:
        try:
            st = os.stat(p)
            out.append((st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_size))
        except OSError:
            out.append((-1, -1, -1, -1))
    return tuple(out)


class FileWatch:
    """Says whether files changed, looking at most every ``interval_s`` seconds.

    The one change detector of every reloading piece (server certificates,
    client channels, bearer tokens, the policy file, the HTTP SSL contexts).
    :meth:`poll` answers the new stamp when the files differ from the last
    :meth:`commit`; a caller commits once it has loaded them (or gives up on
    this version), so a failed load can be retried at the next look.
    """

    __slots__ = ("_checked", "interval_s", "paths", "stamp")

    def __init__(self, paths: Sequence[str], interval_s: float) -> None:
        self.paths = [p for p in paths if p]
        self.interval_s = interval_s
        self._checked = time.monotonic()
        self.stamp = file_stamp(self.paths)

    def poll(self) -> tuple[tuple[int, int, int, int], ...] | None:
        """The new stamp when the files changed since the last commit, else None."""
        if not self.paths:
            return None
        now = time.monotonic()
        if now - self._checked < self.interval_s:
            return None
        self._checked = now
        stamp = file_stamp(self.paths)
        return None if stamp == self.stamp else stamp

    def commit(self, stamp: tuple[tuple[int, int, int, int], ...] | None = None) -> None:
        """Record ``stamp`` (default: the files as they are now) as seen."""
        self.stamp = stamp if stamp is not None else file_stamp(self.paths)


def _check_pair(cert: bytes, key: bytes, cert_path: str) -> None:
    """Fail early, naming the file, when the key does not belong to the certificate."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        crt = x509.load_pem_x509_certificate(cert)
        pk = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as e:
        raise TLSFileError(f"cannot parse certificate or key of {cert_path!r}: {e}") from e
    pub = serialization.PublicFormat.SubjectPublicKeyInfo
    enc = serialization.Encoding.DER
    if crt.public_key().public_bytes(enc, pub) != pk.public_key().public_bytes(enc, pub):
        raise TLSFileError(f"key_file does not match the certificate in {cert_path!r}")


@dataclass
class _Loaded:
    cert: bytes
    key: bytes
    ca: bytes | None


class _ServerCertReloader:
    """gRPC's certificate-config fetcher: new files on change, old ones on failure."""

    def __init__(self, tls: ServerTLS, what: str) -> None:
        self.tls = tls
        self.what = what
        self._watch = FileWatch(
            [tls.cert_file, tls.key_file, tls.client_ca_file], tls.reload_interval_s
        )
        self._lock = threading.Lock()
        self.reloads = 0
        self.reload_failures = 0
        self.current = self._load()

    def _load(self) -> _Loaded:
        t = self.tls
        cert = _read(t.cert_file, "tls.cert_file")
        key = _read(t.key_file, "tls.key_file")
        _check_pair(cert, key, t.cert_file)
        ca = _read(t.client_ca_file, "tls.client_ca_file") if t.client_ca_file else None
        return _Loaded(cert, key, ca)

    def config(self) -> Any:
        c = self.current
        return grpc.ssl_server_certificate_configuration([(c.key, c.cert)], root_certificates=c.ca)

    def __call__(self) -> Any:
        """Called by gRPC on each handshake: a new configuration, or None (keep)."""
        with self._lock:
            stamp = self._watch.poll()
            if stamp is None:
                return None
            self._watch.commit(stamp)  # a broken version is reported once, not per handshake
            try:
                self.current = self._load()
            except TLSFileError as e:
                self.reload_failures += 1
                log.error(
                    "%s: certificate reload failed, keeping the previous one: %s", self.what, e
                )
                return None
            self.reloads += 1
            log.info("%s: reloaded TLS certificates from %s", self.what, self.tls.cert_file)
            return self.config()


def server_credentials(tls: ServerTLS, what: str = "server") -> tuple[Any, _ServerCertReloader]:
    """Dynamic server credentials for ``tls`` and their reloader (for counters)."""
    reloader = _ServerCertReloader(tls, what)
    creds = grpc.dynamic_ssl_server_credentials(
        reloader.config(),
        reloader,
        require_client_authentication=tls.mutual and tls.client_auth == "require",
    )
    return creds, reloader


def add_port(
    server: grpc.aio.Server, address: str, tls: ServerTLS | None, *, what: str
) -> tuple[int, _ServerCertReloader | None]:
    """Bind ``address`` with TLS (or plaintext, with a warning); return (port, reloader)."""
    reloader = None
    try:
        if tls is not None and tls.enabled:
            creds, reloader = server_credentials(tls, what)
            port = server.add_secure_port(address, creds)
        else:
            log.warning(
                "%s: listening on %s in PLAINTEXT: any client on the network may call it; "
                "set tls.cert_file / tls.key_file (and tls.client_ca_file for mutual TLS) "
                "outside local development",
                what,
                address,
            )
            port = server.add_insecure_port(address)
    except RuntimeError as e:
        raise OSError(f"cannot listen on {address}: {e}") from e
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    if reloader is not None:
        log.info(
            "%s: TLS on %s (%s)",
            what,
            address,
            "mutual TLS, client certificates "
            + ("required" if tls and tls.client_auth == "require" else "optional")
            if tls and tls.mutual
            else "server TLS",
        )
    return port, reloader


def read_token_file(path: str) -> str:
    """The bearer token in ``path`` (surrounding whitespace dropped); TLSFileError if none."""
    try:
        with open(path, encoding="utf-8") as f:
            token = f.read().strip()
    except OSError as e:
        raise TLSFileError(f"cannot read tls.token_file {path!r}: {e.strerror or e}") from e
    if not token:
        raise TLSFileError(f"tls.token_file {path!r} is empty")
    return token


class _TokenPlugin(grpc.AuthMetadataPlugin):
    """Call credentials: ``authorization: Bearer <token>`` read from a file on change."""

    def __init__(self, path: str, interval_s: float) -> None:
        self.path = path
        self._watch = FileWatch([path], interval_s)
        self._lock = threading.Lock()
        self._token = read_token_file(path)  # fail at construction when unreadable

    def token(self) -> str:
        """The token, re-read when the file changed (looked at once per interval, not per call)."""
        with self._lock:
            stamp = self._watch.poll()
            if stamp is not None:
                self._token = read_token_file(self.path)
                self._watch.commit(stamp)
            return self._token

    def __call__(
        self, context: grpc.AuthMetadataContext, callback: grpc.AuthMetadataPluginCallback
    ) -> None:
        try:
            callback((("authorization", f"Bearer {self.token()}"),), None)
        except TLSFileError as e:
            callback((), e)


class ChannelFactory:
    """Builds ``grpc.aio`` channels for one target with a :class:`ClientTLS`."""

    def __init__(
        self,
        target: str,
        tls: ClientTLS | None = None,
        *,
        options: Sequence[tuple[str, Any]] = (),
        what: str = "client",
    ) -> None:
        self.target = target
        self.tls = tls if tls is not None else ClientTLS()
        self.what = what
        self._options = list(options)
        self._watch = FileWatch(
            [self.tls.ca_file, self.tls.cert_file, self.tls.key_file], self.tls.reload_interval_s
        )
        self._plugin = (
            _TokenPlugin(self.tls.token_file, self.tls.reload_interval_s)
            if self.tls.token_file
            else None
        )
        if self.tls.active:
            self._credentials()  # fail now, naming the file, rather than on the first call
        else:
            log.debug("%s: plaintext channel to %s", what, target)

    def _credentials(self) -> grpc.ChannelCredentials:
        t = self.tls
        ca = _read(t.ca_file, "tls.ca_file") if t.ca_file else None
        cert = key = None
        if t.cert_file:
            cert = _read(t.cert_file, "tls.cert_file")
            key = _read(t.key_file, "tls.key_file")
            _check_pair(cert, key, t.cert_file)
        creds = grpc.ssl_channel_credentials(ca, key, cert)
        if self._plugin is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.metadata_call_credentials(self._plugin, name="kvmesh-bearer")
            )
        return creds

    def options(self) -> list[tuple[str, Any]]:
        """Channel options, with the server-name override when set."""
        opts = list(self._options)
        if self.tls.active and self.tls.server_name:
            opts.append(("grpc.ssl_target_name_override", self.tls.server_name))
            opts.append(("grpc.default_authority", self.tls.server_name))
        return opts

    def channel(self) -> grpc.aio.Channel:
        """A new channel to the target (secure when TLS is configured)."""
        self._watch.commit()
        if not self.tls.active:
            return grpc.aio.insecure_channel(self.target, options=self.options())
        return grpc.aio.secure_channel(self.target, self._credentials(), options=self.options())

    def sync_channel(self) -> grpc.Channel:
        """A blocking-API channel (for the engine-side clients that are not asyncio)."""
        self._watch.commit()
        if not self.tls.active:
            return grpc.insecure_channel(self.target, options=self.options())
        return grpc.secure_channel(self.target, self._credentials(), options=self.options())

    def stale(self) -> bool:
        """Whether the certificate files changed since the last channel was built.

        Checked at most every ``reload_interval_s``; a client that sees True
        builds a new channel (new handshakes use the new certificate) and closes
        the old one after its calls finish.
        """
        return self._watch.poll() is not None


def add_server_tls_args(parser: Any) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-client-ca`` and ``--auth-policy`` flags."""
    parser.add_argument("--tls-cert", metavar="FILE", help="server certificate chain (PEM)")
    parser.add_argument("--tls-key", metavar="FILE", help="server private key (PEM)")
    parser.add_argument(
        "--tls-client-ca", metavar="FILE", help="CA of client certificates: mutual TLS"
    )
    parser.add_argument(
        "--auth-policy", metavar="FILE", help="policy file mapping identities to roles"
    )


def server_tls_overrides(args: Any) -> dict[str, Any]:
    """The ``tls`` / ``auth`` config overrides given by :func:`add_server_tls_args` flags."""
    return {
        "tls": {
            "cert_file": getattr(args, "tls_cert", None),
            "key_file": getattr(args, "tls_key", None),
            "client_ca_file": getattr(args, "tls_client_ca", None),
        },
        "auth": {"policy_file": getattr(args, "auth_policy", None)},
    }
