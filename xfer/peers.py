"""Which sidecars may act as peers: certificate identities and the shared secret.

No grpc here: xfer/server.py hands :meth:`PeerAdmission.admit` what the call
carried (the caller's verified certificate SANs, whether the connection is
TLS, the secret header) and maps the errors to status codes.

- ``peers.allowed_identities``: glob patterns on the SANs of the caller's
  client certificate (verified by mutual TLS). No certificate:
  UNAUTHENTICATED; a certificate that matches no pattern: PERMISSION_DENIED.
- ``peers.shared_secret_file``: the caller sends the secret in the
  :data:`SECRET_METADATA` header; it is compared with every accepted line of
  the file by :func:`hmac.compare_digest`. Missing, wrong, or arriving over a
  plaintext connection: UNAUTHENTICATED. The secret never appears in an
  error message or a log line.
"""

from __future__ import annotations

import fnmatch
import hmac
import threading
from collections.abc import Sequence

from kvmesh.configfile import ConfigError
from kvmesh.errors import PermissionDenied, Unauthenticated
from kvmesh.tls import FileWatch
from xfer.config import PeerSettings

#: Call metadata carrying the peer secret (sidecar to sidecar, over TLS only).
SECRET_METADATA = "kvmesh-peer-secret"

#: Shortest secret accepted: 16 characters (e.g. ``openssl rand -hex 32`` gives 64).
MIN_SECRET_LEN = 16


class SecretFile:
    """The peer secret file, re-read when it changes (looked at on every use).

    The first non-empty line is what this sidecar sends; every non-empty line
    is accepted, so a rotation is: add the new secret as a second line on
    every sidecar, move it first, then drop the old one.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()
        # Interval 0: peer calls are rare (bootstrap, heartbeats), so every use
        # looks at the file and a rotation takes effect at once.
        self._watch = FileWatch([path], 0.0)
        self._lines: list[bytes] = []
        self.reload_failures = 0
        self._load()  # fail at start, naming the file, rather than on the first call

    def _load(self) -> None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except OSError as e:
            raise ConfigError(
                f"cannot read peers.shared_secret_file {self.path!r}: {e.strerror or e}"
            ) from e
        lines = [ln.strip() for ln in raw.splitlines() if ln.strip()]
        if not lines:
            raise ConfigError(f"peers.shared_secret_file {self.path!r} is empty")
        short = [i + 1 for i, ln in enumerate(lines) if len(ln) < MIN_SECRET_LEN]
        if short:
            raise ConfigError(
                f"peers.shared_secret_file {self.path!r}: line {short[0]} is shorter than "
                f"{MIN_SECRET_LEN} characters"
            )
        self._lines = lines

    def _current(self) -> list[bytes]:
        with self._lock:
            stamp = self._watch.poll()
            if stamp is not None:
                self._watch.commit(stamp)
                try:
                    self._load()
                except ConfigError:
                    # Keep the previous secret: a half-written file must not
                    # lock every peer out. Counted; the path is in the config.
                    self.reload_failures += 1
            return self._lines

    def outgoing(self) -> str:
        """The secret to send."""
        return self._current()[0].decode("utf-8", "replace")

    def matches(self, secret: bytes) -> bool:
        """Whether ``secret`` is one of the accepted lines (constant time per line)."""
        ok = False
        for line in self._current():
            ok |= hmac.compare_digest(line, secret)
        return ok


class PeerAdmission:
    """Decides whether the caller of a peer method is an allowed peer."""

    def __init__(self, settings: PeerSettings) -> None:
        self.patterns = list(settings.allowed_identities)
        path = settings.shared_secret_file
        self.secret = SecretFile(path) if path else None

    @property
    def active(self) -> bool:
        """Whether any check is configured."""
        return bool(self.patterns) or self.secret is not None

    def admit(self, sans: Sequence[str], secure: bool, secret: bytes | None) -> str:
        """The caller's certificate identity (``""`` without a certificate), or raise
        PermissionDenied / Unauthenticated naming what is wrong (never the secret)."""
        identity = ",".join(sans)
        if self.patterns:
            if not sans:
                raise Unauthenticated(
                    "no client certificate: peers must present one (peers.allowed_identities)"
                )
            if not any(fnmatch.fnmatchcase(s, p) for p in self.patterns for s in sans):
                raise PermissionDenied(
                    f"certificate identity {identity!r} is not an allowed peer "
                    "(peers.allowed_identities)"
                )
        if self.secret is not None:
            if secret is None:
                raise Unauthenticated("no peer secret (peers.shared_secret_file)")
            if not secure:
                raise Unauthenticated("a peer secret is accepted over TLS only")
            if not self.secret.matches(secret):
                raise Unauthenticated("wrong peer secret (peers.shared_secret_file)")
        return identity
