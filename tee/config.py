"""Configuration of the tee and cache simulator services: one typed model each, four layers.

Precedence, highest first: command-line flags > environment variables
(``KVMESH_TEE_<FIELD>`` / ``KVMESH_CACHESIM_<FIELD>``, nested fields joined by
``__``; a value starting with ``[`` or ``{`` is JSON) > a config file (YAML,
TOML or JSON by extension) > the defaults below. Unknown keys are rejected,
naming the key and where it came from.

Example tee file (YAML)::

    send_concurrency: 8          # or KVMESH_TEE_SEND_CONCURRENCY=8
    queue_size: 4096
    tls:                         # or KVMESH_TEE_TLS__CERT_FILE=... (mutual TLS for routers)
      cert_file: /certs/tls.crt
      key_file: /certs/tls.key
      client_ca_file: /certs/ca.crt
    auth:
      policy_file: /policy/policy.yaml   # or KVMESH_TEE_AUTH__POLICY_FILE=...
    sinks:
      - type: http
        url: https://cachesim:8470
        tls: {ca_file: /certs/ca.crt, cert_file: /certs/tls.crt, key_file: /certs/tls.key}
      - type: grpc
        target: cachesim:50062
        tls: {ca_file: /certs/ca.crt, cert_file: /certs/tls.crt, key_file: /certs/tls.key}

Without ``tls`` the servers listen in plaintext and without ``auth.policy_file``
every caller may call every method; both are logged as warnings at start.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmesh.auth import AuthSettings
from kvmesh.cachemodel import EvictionPolicy
from kvmesh.configfile import ConfigError as ConfigError
from kvmesh.configfile import env_overrides, merge, read_config_file
from kvmesh.grpcsvc import ClientLimits
from kvmesh.tls import ClientTLS, ServerTLS
from tee.client import DEFAULT_CONCURRENCY, DEFAULT_QUEUE_SIZE, DEFAULT_SEND_TIMEOUT_S, Tee
from tee.events import DEFAULT_MAX_INPUT_IDS

TEE_ENV_PREFIX = "KVMESH_TEE_"
CACHESIM_ENV_PREFIX = "KVMESH_CACHESIM_"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HttpSinkConfig(_Strict):
    """An HTTP sink speaking the cache-sim wire."""

    type: Literal["http"] = "http"
    url: str = Field(min_length=1, description="Base URL; events go to {url}/ingest_ids etc.")
    name: str = Field(default="", description="Metrics label; the URL when empty.")
    headers: dict[str, str] = Field(default_factory=dict, description="Extra request headers.")
    tls: ClientTLS = Field(
        default_factory=ClientTLS,
        description="CA, client certificate (mutual TLS), server name and bearer-token file "
        "for an https:// url; the token is sent as `Authorization: Bearer`.",
    )

    @model_validator(mode="after")
    def _scheme(self) -> HttpSinkConfig:
        scheme = urlsplit(self.url).scheme
        if scheme not in ("http", "https"):
            raise ValueError(f"url must start with http:// or https://, got {self.url!r}")
        if self.tls.active and scheme != "https":
            raise ValueError(f"tls is set but url {self.url!r} is not https://")
        if any(k.lower() == "authorization" for k in self.headers) and self.tls.token_file:
            raise ValueError("headers.Authorization and tls.token_file are both set")
        return self


class GrpcSinkConfig(_Strict):
    """A gRPC sink: another tee or a cache simulator (kvmesh.tee.v1.TeeService)."""

    type: Literal["grpc"] = "grpc"
    target: str = Field(min_length=1, description="host:port of the TeeService.")
    name: str = Field(default="", description="Metrics label; grpc://target when empty.")
    tls: ClientTLS = Field(
        default_factory=ClientTLS,
        description="CA, client certificate (mutual TLS), server name and bearer-token file "
        "of the channel; the channel is reopened when the files change.",
    )


SinkConfig = Annotated[HttpSinkConfig | GrpcSinkConfig, Field(discriminator="type")]


class _Served(_Strict):
    """Settings every served component shares: transport security, callers, probes, logs."""

    tls: ServerTLS = Field(
        default_factory=ServerTLS,
        description="Certificate, key and client CA (mutual TLS) of the gRPC port (and the "
        "cache simulator's HTTP port); empty: plaintext. Changed files are loaded for new "
        "connections.",
    )
    auth: AuthSettings = Field(
        default_factory=AuthSettings,
        description="Policy file mapping caller identities to roles; empty: authorization off.",
    )
    per_client: ClientLimits = Field(
        default_factory=ClientLimits,
        description="Per-client in-flight cap and rates (a client is a policy identity, or a "
        "peer host when authorization is off).",
    )
    health_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Extra plaintext port serving only grpc.health.v1 (for kubelet gRPC "
        "probes, which present no certificate); 0: none.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"


class TeeConfig(_Served):
    """Configuration of ``kvmesh tee serve`` (and of an embedded tee)."""

    host: str = Field(default="127.0.0.1", min_length=1, description="gRPC/metrics address.")
    port: int = Field(default=50061, ge=0, le=65535, description="gRPC port; 0 picks one.")
    metrics_port: int = Field(
        default=9465, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it."
    )
    sinks: list[SinkConfig] = Field(default_factory=list, description="Where events go.")
    queue_size: int = Field(
        default=DEFAULT_QUEUE_SIZE, ge=1, description="Queue bound per sink; beyond: dropped."
    )
    send_concurrency: int = Field(
        default=DEFAULT_CONCURRENCY,
        ge=1,
        le=4096,
        description="Sends in flight per sink; throughput is this / sink latency.",
    )
    send_timeout_s: float = Field(default=DEFAULT_SEND_TIMEOUT_S, gt=0, le=3600)
    max_input_ids: int = Field(
        default=DEFAULT_MAX_INPUT_IDS, ge=1, description="Most input_ids per event."
    )
    max_events_per_call: int = Field(
        default=4096, ge=1, description="Most events in one OfferEvents / stream message."
    )
    max_message_bytes: int = Field(default=64 << 20, ge=4096, description="Largest gRPC message.")
    shutdown_deadline_s: float = Field(
        default=5.0, ge=0, le=3600, description="On SIGTERM, how long queued events may drain."
    )

    @model_validator(mode="after")
    def _checks(self) -> TeeConfig:
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port are both {self.port}")
        if self.health_port and self.health_port in (self.port, self.metrics_port):
            raise ValueError(f"health_port {self.health_port} is also port or metrics_port")
        names = [s.name or getattr(s, "url", "") or getattr(s, "target", "") for s in self.sinks]
        if len(set(names)) != len(names):
            raise ValueError(f"sinks: names must be unique, got {names}")
        return self


class CacheSimConfig(_Served):
    """Configuration of ``kvmesh cachesim serve``."""

    host: str = Field(default="127.0.0.1", min_length=1, description="Listen address.")
    http_port: int = Field(
        default=8470, ge=0, le=65535, description="HTTP wire, /report, /metrics, /healthz."
    )
    grpc_port: int = Field(default=50062, ge=0, le=65535, description="gRPC; 0 picks one.")
    grpc_enabled: bool = True
    block_size: int = Field(default=16, ge=1, le=65536, description="Tokens per block.")
    worker_capacity_blocks: int | None = Field(
        default=16384,
        ge=0,
        description="Blocks per worker cache (16384 x 16 tokens ~ 262k tokens, a mid-size "
        "GPU's KV budget); null: unbounded.",
    )
    pooled_capacity_blocks: int | None = Field(
        default=None,
        ge=0,
        description="Capacity of the global oracle; null: workers seen x worker capacity.",
    )
    eviction: EvictionPolicy = EvictionPolicy.LRU
    window_s: float = Field(default=60.0, gt=0, le=86400, description="Sliding-window length.")
    max_input_ids: int = Field(default=DEFAULT_MAX_INPUT_IDS, ge=1)
    max_events_per_call: int = Field(default=4096, ge=1)
    max_message_bytes: int = Field(default=64 << 20, ge=4096)
    shutdown_grace_s: float = Field(default=5.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _checks(self) -> CacheSimConfig:
        ports = [p for p in (self.http_port, self.grpc_port if self.grpc_enabled else 0) if p]
        if self.health_port and self.health_port in ports:
            raise ValueError(f"health_port {self.health_port} is also http_port or grpc_port")
        if self.health_port and not self.grpc_enabled:
            raise ValueError("health_port serves gRPC health: it needs grpc_enabled")
        return self


# -- loading ------------------------------------------------------------------

_M = TypeVar("_M", bound=BaseModel)


def _drop_none(data: Mapping[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, Mapping):
            sub = _drop_none(value)
            if sub:
                out[key] = sub
        elif value is not None:
            out[key] = value
    return out


def _load(
    model: type[_M],
    prefix: str,
    file: str | os.PathLike[str] | None,
    environ: Mapping[str, str] | None,
    cli: Mapping[str, Any] | None,
) -> _M:
    layers: list[tuple[str, Mapping[str, Any]]] = []
    if file is not None:
        layers.append((f"config file {file}", read_config_file(file)))
    layers.append(("environment", env_overrides(prefix, environ)))
    if cli:
        layers.append(("command line", _drop_none(cli)))
    problems: list[str] = []
    merged: dict[str, Any] = {}
    for source, data in layers:
        for key in data:
            if key not in model.model_fields:
                where = (
                    f"environment variable {prefix}{key.upper()}"
                    if source == "environment"
                    else source
                )
                problems.append(f"unknown key {key!r} ({where})")
        merged = merge(merged, data)
    if problems:
        valid = ", ".join(sorted(model.model_fields))
        raise ConfigError("; ".join(problems) + f". Valid top-level keys: {valid}")
    try:
        return model.model_validate(merged)
    except ValidationError as e:
        lines = [
            f"{'.'.join(str(p) for p in i['loc']) or 'config'}: {i['msg']}" for i in e.errors()
        ]
        raise ConfigError(f"invalid {model.__name__}: " + "; ".join(lines)) from e


def load_tee_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> TeeConfig:
    """Build a :class:`TeeConfig` from defaults < file < ``KVMESH_TEE_…`` < ``cli``."""
    return _load(TeeConfig, TEE_ENV_PREFIX, file, environ, cli)


def load_cachesim_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> CacheSimConfig:
    """Build a :class:`CacheSimConfig` from defaults < file < ``KVMESH_CACHESIM_…`` < ``cli``."""
    return _load(CacheSimConfig, CACHESIM_ENV_PREFIX, file, environ, cli)


def build_tee(config: TeeConfig) -> Tee:
    """A :class:`tee.client.Tee` (not started) with the sinks ``config`` names.

    Raises :class:`kvmesh.tls.TLSFileError` (a :class:`ConfigError`) when a
    sink's certificate, key, CA or token file cannot be read.
    """
    from tee.sinks import GrpcSink, HttpSink, Sink

    sinks: list[Sink] = []
    for s in config.sinks:
        if isinstance(s, HttpSinkConfig):
            sinks.append(
                HttpSink(
                    s.url,
                    name=s.name,
                    # One keep-alive connection per in-flight send, never queued in the pool.
                    max_connections=config.send_concurrency,
                    extra_headers=s.headers,
                    tls=s.tls,
                )
            )
        else:
            sinks.append(GrpcSink(s.target, name=s.name, tls=s.tls))
    return Tee(
        sinks,
        queue_size=config.queue_size,
        concurrency=config.send_concurrency,
        send_timeout_s=config.send_timeout_s,
        max_input_ids=config.max_input_ids,
    )
