"""Who is calling, and what they may do: identities, roles and the policy file.

A caller's identity comes from its mutual-TLS client certificate (the
certificate's SANs: SPIFFE/URI and DNS names) or from a bearer token
(``authorization: Bearer <token>``, accepted over TLS only). A policy file
maps identities to roles and, for engines, to the instances they own::

    # policy.yaml
    identities:
      - name: engine-0                 # the name logs and metrics use
        roles: [engine]
        san: ["spiffe://fleet/engine/engine-0"]   # glob patterns on SANs
        instances: ["engine-0"]        # glob patterns on worker ids it may publish for
        models: ["*"]                  # glob patterns on models (default: any)
        loras: ["", "sql-*"]           # glob patterns on LoRA names ('' the base model)
        quotas: {max_instances_per_identity: 8}   # the indexer's quotas.* for it
      - name: routers
        roles: [router]
        san: ["spiffe://fleet/router/*"]
      - name: ops
        roles: [admin]
        token_sha256: ["9f86d081884c7d65..."]   # sha256 hex of the token, never the token

Roles: ``engine`` (register, heartbeat, publish events for owned instances),
``router`` (Match, list, stats; offer routed requests to a tee), ``tee``
(send to the cache simulator), ``peer`` (xfer sidecars of the other side),
``admin`` (everything, including removing any instance). Each service
states which roles each of its methods accepts.

Outcomes: no certificate and no token, an unknown token or a token over
plaintext → UNAUTHENTICATED; a verified identity that the policy does not
list, or a role or instance it does not grant → PERMISSION_DENIED. Every
refusal is counted and logged (identity and method, never a token).

Without a policy file authorization is off (every caller may do
everything), which the services log as a warning at start. The policy file
is re-read when it changes (checked at most every ``reload_interval_s``); a
file that fails to parse keeps the previous policy and is logged.
"""

from __future__ import annotations

import contextvars
import fnmatch
import hashlib
import hmac
import logging
import re
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator

from kvmesh.configfile import ConfigError, StrictModel, format_validation_error, read_config_file
from kvmesh.errors import PermissionDenied, Unauthenticated
from kvmesh.tls import FileWatch

log = logging.getLogger(__name__)

ROLES = ("engine", "router", "tee", "peer", "admin")
Role = Literal["engine", "router", "tee", "peer", "admin"]

_SHA256_HEX = re.compile(r"^[0-9a-f]{64}$")


class IdentityQuotas(StrictModel):
    """One identity's own values of the indexer's ``quotas`` (indexer/config.py
    ``Quotas``, same names and meanings); a field left out takes the indexer's."""

    max_instances_per_identity: int | None = Field(default=None, ge=0)
    max_namespaces_per_identity: int | None = Field(default=None, ge=0)
    max_dp_rank: int | None = Field(default=None, ge=0, lt=1 << 32)
    max_blocks_per_instance: int | None = Field(default=None, ge=0)
    max_blocks_per_identity: int | None = Field(default=None, ge=0)
    publish_blocks_per_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    publish_blocks_burst: int | None = Field(default=None, ge=0)


class IdentityRule(StrictModel):
    """One identity of the policy: how it is recognised and what it may do."""

    name: str = Field(min_length=1, max_length=128, description="Name used in logs and metrics.")
    roles: list[Role] = Field(min_length=1, description="Roles granted.")
    san: list[str] = Field(
        default_factory=list,
        description="Glob patterns matched against the client certificate's SANs.",
    )
    token_sha256: list[str] = Field(
        default_factory=list, description="SHA-256 (hex) of accepted bearer tokens."
    )
    instances: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Glob patterns of worker ids an engine identity may publish for.",
    )
    models: list[str] = Field(
        default_factory=lambda: ["*"], description="Glob patterns of models it may touch."
    )
    loras: list[str] = Field(
        default_factory=lambda: ["*"],
        description="Glob patterns of the LoRA names an engine identity may store blocks "
        "under ('' is the base model; the indexer skips and counts the others).",
    )
    quotas: IdentityQuotas = Field(
        default_factory=lambda: IdentityQuotas(),
        description="This identity's own values of the indexer's quotas.",
    )

    @field_validator("token_sha256")
    @classmethod
    def _hex(cls, v: list[str]) -> list[str]:
        for i, h in enumerate(v):
            if not _SHA256_HEX.match(h):
                raise ValueError(
                    f"token_sha256[{i}] must be 64 lowercase hex digits (sha256 of the token; "
                    "`printf %s TOKEN | sha256sum`)"
                )
        return v


class PolicyFile(StrictModel):
    """The policy file's schema."""

    identities: list[IdentityRule] = Field(default_factory=list)


class AuthSettings(StrictModel):
    """Authorization settings of a server."""

    policy_file: str = Field(
        default="",
        description="Policy file (YAML, JSON or TOML) mapping identities to roles and "
        "instances. Empty: authorization off, every caller may call every method.",
    )
    reload_interval_s: float = Field(
        default=10.0, gt=0, description="How often, at most, the policy file is checked."
    )


@dataclass(frozen=True, slots=True)
class Principal:
    """An authenticated caller (or the anonymous caller when authorization is off)."""

    name: str
    roles: frozenset[str]
    via: str  # "mtls", "token", "open" (authorization off)
    instances: tuple[str, ...] = ("*",)
    models: tuple[str, ...] = ("*",)
    #: Certificate SANs or "" (for logs).
    subject: str = ""
    loras: tuple[str, ...] = ("*",)
    #: The policy's own quota values for this identity (None: the indexer's).
    quotas: IdentityQuotas | None = None

    def may_use_lora(self, lora_name: str) -> bool:
        """Whether this caller may store blocks under LoRA ``lora_name`` ('' the base model)."""
        if self.loras == ("*",) or "admin" in self.roles or self.via == "open":
            return True
        return any(fnmatch.fnmatchcase(lora_name, p) for p in self.loras)

    def has_any(self, roles: Iterable[str]) -> bool:
        """Whether any of ``roles`` is granted (admin is granted everything)."""
        return "admin" in self.roles or any(r in self.roles for r in roles)

    def owns(self, model: str | None, worker_id: str) -> bool:
        """Whether this caller may act for ``worker_id`` serving ``model`` (None:
        for ``worker_id`` whatever its model: an instance the index does not hold)."""
        if "admin" in self.roles or self.via == "open":
            return True
        return any(fnmatch.fnmatchcase(worker_id, p) for p in self.instances) and (
            model is None or any(fnmatch.fnmatchcase(model, p) for p in self.models)
        )


#: The caller of every call when authorization is off.
OPEN = Principal("anonymous", frozenset(ROLES), "open")


@dataclass(slots=True)
class Client:
    """The caller of the current call: who, and the key its limits are counted under."""

    principal: Principal
    key: str


_client: contextvars.ContextVar[Client | None] = contextvars.ContextVar(
    "kvmesh_client", default=None
)


def current_client() -> Client | None:
    """The caller of the call being handled (set by the server's guard)."""
    return _client.get()


def set_current_client(client: Client | None) -> contextvars.Token[Client | None]:
    """Set the caller for the running call (the guard does this)."""
    return _client.set(client)


def reset_current_client(token: contextvars.Token[Client | None]) -> None:
    """Undo :func:`set_current_client`.

    A streaming handler's generator may be finalized from another context
    (grpc closes an abandoned generator elsewhere); the token is then foreign
    and the variable is just cleared in the current one.
    """
    try:
        _client.reset(token)
    except ValueError:
        _client.set(None)


def require_owner(model: str | None, worker_id: str, field_name: str = "instance") -> None:
    """Raise PERMISSION_DENIED unless the current caller owns ``worker_id`` of ``model``
    (None: of any model, for an instance the index does not hold)."""
    c = _client.get()
    if c is None or c.principal.owns(model, worker_id):
        return
    of_model = "" if model is None else f" of model {model!r}"
    raise PermissionDenied(
        f"identity {c.principal.name!r} may not act for instance {worker_id!r}{of_model} "
        f"(policy: instances {list(c.principal.instances)}, models "
        f"{list(c.principal.models)})",
        field=field_name,
    )


def peer_host(peer: str) -> str:
    """The host part of a gRPC peer string (``ipv4:10.0.0.1:5555`` → ``10.0.0.1``)."""
    if peer.startswith("ipv6:"):
        rest = peer[5:]
        if rest.startswith("["):
            return rest[1 : rest.find("]")] if "]" in rest else rest
        return rest
    if peer.startswith("ipv4:"):
        return peer[5:].rsplit(":", 1)[0]
    return peer


def _token_of(metadata: Iterable[Any]) -> str | None:
    for k, v in metadata:
        if k == "authorization":
            value = v.decode("latin-1") if isinstance(v, bytes) else str(v)
            scheme, _, token = value.partition(" ")
            if scheme.lower() != "bearer" or not token.strip():
                raise Unauthenticated(
                    "authorization metadata must be 'Bearer <token>'", field="authorization"
                )
            return token.strip()
    return None


@dataclass
class _Index:
    by_hash: dict[str, IdentityRule] = field(default_factory=dict)
    rules: list[IdentityRule] = field(default_factory=list)
    #: Principals by certificate SANs, resolved once per loaded policy.
    by_sans: dict[tuple[str, ...], Principal] = field(default_factory=dict)


#: Cached "no rule matches these SANs".
_NOT_LISTED = Principal("", frozenset(), "none")


class Authorizer:
    """Authenticates callers of one server and checks their roles against the policy."""

    def __init__(self, settings: AuthSettings, *, what: str) -> None:
        self.settings = settings
        self.what = what
        self.enabled = bool(settings.policy_file)
        self._lock = threading.Lock()
        self._watch = FileWatch([settings.policy_file], settings.reload_interval_s)
        self._index = _Index()
        self.reloads = 0
        self.reload_failures = 0
        #: Refusals by (method, status name).
        self.refusals: dict[tuple[str, str], int] = {}
        self._on_refusal: list[Any] = []
        self._last_log: dict[tuple[str, str, str], float] = {}
        if self.enabled:
            self._index = self._load()
        else:
            log.warning(
                "%s: authorization is OFF (no auth.policy_file): any client may call every "
                "method; set a policy file outside local development",
                what,
            )

    # -- policy ---------------------------------------------------------------

    def _load(self) -> _Index:
        path = self.settings.policy_file
        try:
            raw = read_config_file(path)
        except ConfigError as e:
            raise ConfigError(f"auth.policy_file: {e}") from e
        try:
            policy = PolicyFile.model_validate(raw)
        except ValidationError as e:
            raise ConfigError(format_validation_error(e, f"policy file {path}")) from e
        idx = _Index(rules=list(policy.identities))
        for rule in policy.identities:
            for h in rule.token_sha256:
                idx.by_hash[h] = rule
        return idx

    def _maybe_reload(self) -> None:
        with self._lock:
            stamp = self._watch.poll()
            if stamp is None:
                return
            self._watch.commit(stamp)  # a broken version is reported once, not per call
            try:
                self._index = self._load()
            except ConfigError as e:
                self.reload_failures += 1
                log.error("%s: policy reload failed, keeping the previous policy: %s", self.what, e)
                return
            self.reloads += 1
            log.info("%s: reloaded policy %s", self.what, self.settings.policy_file)

    # -- per call -------------------------------------------------------------

    def on_refusal(self, callback: Any) -> None:
        """Call ``callback(method, code_name)`` on every refusal (metrics)."""
        self._on_refusal.append(callback)

    def refuse(self, method: str, err: Unauthenticated | PermissionDenied, who: str) -> None:
        """Count and log (rate-limited per identity and method) a refusal."""
        key = (method, err.code)
        self.refusals[key] = self.refusals.get(key, 0) + 1
        for cb in self._on_refusal:
            cb(method, err.code)
        now = time.monotonic()
        lk = (method, err.code, who)
        if now - self._last_log.get(lk, -1e9) >= 10.0:
            if len(self._last_log) > 4096:
                self._last_log.clear()
            self._last_log[lk] = now
            log.warning("%s: %s %s refused for %s: %s", self.what, err.code, method, who, err)

    def authenticate(self, auth_context: Mapping[str, Any], metadata: Iterable[Any]) -> Principal:
        """The caller's principal, from its certificate or bearer token.

        ``auth_context`` is ``ServicerContext.auth_context()``, ``metadata``
        the invocation metadata. Raises Unauthenticated / PermissionDenied.
        """
        if not self.enabled:
            return OPEN
        self._maybe_reload()
        idx = self._index
        secure = auth_context.get("transport_security_type") == [b"ssl"]
        token = _token_of(metadata)
        if token is not None:
            if not secure:
                raise Unauthenticated(
                    "bearer tokens are accepted over TLS only", field="authorization"
                )
            digest = hashlib.sha256(token.encode("utf-8")).hexdigest()
            for h, rule in idx.by_hash.items():
                if hmac.compare_digest(h, digest):
                    return _principal(rule, "token")
            raise Unauthenticated("bearer token not recognised", field="authorization")
        sans = [
            v.decode("utf-8", "replace")
            for v in auth_context.get("x509_subject_alternative_name", [])
        ]
        if not sans:
            if auth_context.get("x509_common_name"):
                raise PermissionDenied(
                    "client certificate has no subject alternative name; identities are SANs"
                )
            raise Unauthenticated(
                "no client certificate and no bearer token"
                + ("" if secure else " (plaintext connection)")
            )
        key = tuple(sans)
        hit = idx.by_sans.get(key)
        if hit is None:
            hit = _NOT_LISTED
            for rule in idx.rules:
                if any(fnmatch.fnmatchcase(s, p) for p in rule.san for s in sans):
                    hit = _principal(rule, "mtls", subject=",".join(sans))
                    break
            if len(idx.by_sans) >= 4096:
                idx.by_sans.clear()
            idx.by_sans[key] = hit
        if hit is _NOT_LISTED:
            raise PermissionDenied(f"certificate identity {','.join(sans)!r} is not in the policy")
        return hit


def _principal(rule: IdentityRule, via: str, subject: str = "") -> Principal:
    return Principal(
        name=rule.name,
        roles=frozenset(rule.roles),
        via=via,
        instances=tuple(rule.instances),
        models=tuple(rule.models),
        subject=subject,
        loras=tuple(rule.loras),
        quotas=rule.quotas if rule.quotas.model_fields_set else None,
    )


def token_sha256(token: str) -> str:
    """The hex SHA-256 a policy file lists for ``token``."""
    return hashlib.sha256(token.encode("utf-8")).hexdigest()


def token_main(argv: Sequence[str] | None = None) -> int:
    """``kvmesh token``: print a new random bearer token and its policy hash."""
    import argparse
    import secrets

    from kvmesh.clihelp import HelpFormatter

    p = argparse.ArgumentParser(
        prog="kvmesh token",
        description="Print a new random bearer token (keep it secret: put it in a Secret and "
        "point the client's tls.token_file at it) and the token_sha256 a policy file lists.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--token-file", metavar="FILE", help="hash this existing token file instead")
    args = p.parse_args(argv)
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
    else:
        token = secrets.token_urlsafe(32)
        print(f"token:        {token}")
    print(f"token_sha256: {token_sha256(token)}")
    return 0
