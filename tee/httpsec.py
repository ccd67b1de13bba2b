"""TLS and caller identity for the aiohttp transports (the cache simulator's HTTP port, HttpSink).

The gRPC ports get TLS, certificate reload and authorization from
:mod:`kvmesh.tls` and :mod:`kvmesh.grpcsvc`; this module gives the HTTP side
the same behaviour from the same settings:

- :class:`ServerSSL`: an :class:`ssl.SSLContext` for an aiohttp site built
  from a :class:`~kvmesh.tls.ServerTLS` (``CERT_REQUIRED`` with a client CA
  and ``client_auth: require``). :meth:`ServerSSL.check` loads changed files
  into the *same* context, which the listening socket keeps using, so new
  handshakes present the new certificate; a file that fails to load is
  logged and the previous certificate stays. A changed client CA is added to
  the trusted set (OpenSSL cannot remove one from a live context: dropping a
  CA takes a restart).
- :class:`ClientSSL`: the client side of a :class:`~kvmesh.tls.ClientTLS`
  (CA, client certificate, bearer token), rebuilt when the files change.
- :class:`HttpCall`: an aiohttp request seen as the caller of a gRPC call, so
  that :meth:`kvmesh.grpcsvc.Guard.identify` authenticates it (certificate
  SANs, or a bearer token over TLS) with the service's policy and counts its
  refusals with the gRPC ones.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Mapping, Sequence
from typing import Any

from aiohttp import web

from kvmesh.tls import ClientTLS, FileWatch, ServerTLS, TLSFileError, read_token_file

log = logging.getLogger(__name__)

#: HTTP status of each refusal a guard raises.
HTTP_STATUS: Mapping[str, int] = {
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "INVALID_ARGUMENT": 400,
}


def _load_server_files(ctx: ssl.SSLContext, tls: ServerTLS) -> None:
    try:
        ctx.load_cert_chain(tls.cert_file, tls.key_file)
    except (OSError, ssl.SSLError) as e:
        raise TLSFileError(
            f"cannot load tls.cert_file {tls.cert_file!r} with tls.key_file {tls.key_file!r}: {e}"
        ) from e
    if tls.client_ca_file:
        try:
            ctx.load_verify_locations(cafile=tls.client_ca_file)
        except (OSError, ssl.SSLError) as e:
            raise TLSFileError(f"cannot load tls.client_ca_file {tls.client_ca_file!r}: {e}") from e


class ServerSSL:
    """A server :class:`ssl.SSLContext` from ``tls`` whose certificate follows the files."""

    def __init__(self, tls: ServerTLS, *, what: str) -> None:
        if not tls.enabled:
            raise ValueError("ServerSSL needs tls.cert_file and tls.key_file")
        self.tls = tls
        self.what = what
        # Looked at by watch() every reload_interval_s, so no interval of its own.
        self._watch = FileWatch([tls.cert_file, tls.key_file, tls.client_ca_file], 0.0)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        _load_server_files(ctx, tls)
        if tls.mutual:
            ctx.verify_mode = (
                ssl.CERT_REQUIRED if tls.client_auth == "require" else ssl.CERT_OPTIONAL
            )
        #: The context to give the site; it stays the same object across reloads.
        self.context = ctx
        self.reloads = 0
        self.reload_failures = 0

    def check(self) -> bool:
        """Load the files into :attr:`context` if they changed; whether they were loaded."""
        stamp = self._watch.poll()
        if stamp is None:
            return False
        self._watch.commit(stamp)
        try:
            # A trial load first: a failed load_cert_chain may leave the live
            # context with the new certificate and the old key.
            _load_server_files(ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER), self.tls)
            _load_server_files(self.context, self.tls)
        except TLSFileError as e:
            self.reload_failures += 1
            log.error("%s: certificate reload failed, keeping the previous one: %s", self.what, e)
            return False
        self.reloads += 1
        log.info("%s: reloaded TLS certificates from %s", self.what, self.tls.cert_file)
        return True

    async def watch(self) -> None:
        """Run :meth:`check` every ``reload_interval_s`` until cancelled."""
        while True:
            await asyncio.sleep(self.tls.reload_interval_s)
            self.check()


class ClientSSL:
    """The client side of a :class:`ClientTLS` for aiohttp: an SSL context and a bearer token.

    Construction reads every file (raising :class:`TLSFileError` naming the
    bad one). :meth:`refresh` re-reads them when they changed, at most every
    ``reload_interval_s``; a failed re-read is logged and keeps the previous
    ones (retried at the next check).
    """

    def __init__(self, tls: ClientTLS, *, what: str = "client") -> None:
        self.tls = tls
        self.what = what
        self.reload_failures = 0
        self._watch = FileWatch(
            [tls.ca_file, tls.cert_file, tls.key_file, tls.token_file], tls.reload_interval_s
        )
        self.context, self.token = self._build()

    def _build(self) -> tuple[ssl.SSLContext, str]:
        t = self.tls
        try:
            ctx = ssl.create_default_context(cafile=t.ca_file or None)
        except (OSError, ssl.SSLError) as e:
            raise TLSFileError(f"cannot load tls.ca_file {t.ca_file!r}: {e}") from e
        if t.cert_file:
            try:
                ctx.load_cert_chain(t.cert_file, t.key_file)
            except (OSError, ssl.SSLError) as e:
                raise TLSFileError(
                    f"cannot load tls.cert_file {t.cert_file!r} with tls.key_file "
                    f"{t.key_file!r}: {e}"
                ) from e
        token = read_token_file(t.token_file) if t.token_file else ""
        return ctx, token

    def refresh(self) -> bool:
        """Rebuild when the files changed (checked at most every ``reload_interval_s``).

        Returns whether a new context was built.
        """
        stamp = self._watch.poll()
        if stamp is None:
            return False
        try:
            self.context, self.token = self._build()
        except TLSFileError as e:
            self.reload_failures += 1
            log.error(
                "%s: TLS files changed but cannot be loaded, keeping the previous ones: %s",
                self.what,
                e,
            )
            return False
        self._watch.commit(stamp)
        return True


class HttpCall:
    """An aiohttp request posing as a gRPC servicer context for :meth:`Guard.identify`.

    ``auth_context()`` has the keys gRPC's would: ``transport_security_type``
    ``[b"ssl"]`` over TLS and the verified client certificate's SANs and
    common name; ``invocation_metadata()`` carries the ``Authorization``
    header as ``authorization``.
    """

    def __init__(self, request: web.Request) -> None:
        self.request = request

    def peer(self) -> str:
        """``ipv4:host:port`` / ``ipv6:[host]:port`` of the client."""
        transport = self.request.transport
        name = transport.get_extra_info("peername") if transport is not None else None
        if not name:
            return ""
        host, port = name[0], name[1]
        return f"ipv6:[{host}]:{port}" if ":" in host else f"ipv4:{host}:{port}"

    def auth_context(self) -> dict[str, list[bytes]]:
        """The TLS facts of the connection, keyed as gRPC's auth context."""
        transport = self.request.transport
        if transport is None or transport.get_extra_info("sslcontext") is None:
            return {}
        out: dict[str, list[bytes]] = {"transport_security_type": [b"ssl"]}
        cert: Any = transport.get_extra_info("peercert")
        if cert:
            sans: Sequence[tuple[str, str]] = cert.get("subjectAltName", ())
            out["x509_subject_alternative_name"] = [v.encode() for _, v in sans]
            cns = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
            if cns:
                out["x509_common_name"] = [cns[0].encode()]
        return out

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        """The ``Authorization`` header, as gRPC metadata."""
        value = self.request.headers.get("Authorization")
        return (("authorization", value),) if value is not None else ()
