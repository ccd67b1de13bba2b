"""Configuration of the tee service: one typed model, four layers.

Precedence, highest first: command-line flags > environment variables
``KVMESH_TEE_<FIELD>`` (nested fields joined by ``__``; a value starting with
``[`` or ``{`` is JSON) > a config file (YAML, TOML or JSON by extension) >
the defaults below. Unknown keys are rejected in every layer, naming the key
and where it came from. The settings every served component shares
(:class:`ServedSettings`) are also the base of the cache simulator's config
(:mod:`tee.cachesim.config`); :func:`tee.factory.build_tee` turns a config
into a :class:`~tee.logic.Tee` with its sinks.

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
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from kvmesh.auth import AuthSettings
from kvmesh.balancing import channel_target
from kvmesh.configfile import ConfigError as ConfigError
from kvmesh.configfile import StrictModel, load_layered
from kvmesh.grpcsvc import ClientLimits
from kvmesh.tls import ClientTLS, ServerTLS
from tee.events import DEFAULT_MAX_INPUT_IDS

#: Prefix of the environment variables read by :func:`load_tee_config`.
TEE_ENV_PREFIX = "KVMESH_TEE_"

#: Default queue bound per sink. At 9 ms per send and 8 in flight a lane drains
#: ~890 events/s, so 4096 rides out ~4.5 s of a sink stall at full rate while
#: holding at most a few MB of token lists.
DEFAULT_QUEUE_SIZE = 4096
#: Default sends in flight per sink: throughput is concurrency / sink latency,
#: and 8 covers ~890 req/s at 9 ms without opening more connections than a
#: small simulator wants.
DEFAULT_CONCURRENCY = 8
#: Default per-send timeout: far above a healthy sink's milliseconds, short
#: enough that a hung sink frees its slots quickly.
DEFAULT_SEND_TIMEOUT_S = 2.0


class HttpSinkConfig(StrictModel):
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


class GrpcSinkConfig(StrictModel):
    """A gRPC sink: another tee or a cache simulator (kvmesh.tee.v1.TeeService)."""

    type: Literal["grpc"] = "grpc"
    target: str = Field(
        min_length=1,
        description="host:port of the TeeService; dns:///name:port or addresses joined by "
        "commas (IP literals) name several replicas, sent to round robin.",
    )
    name: str = Field(default="", description="Metrics label; grpc://target when empty.")
    tls: ClientTLS = Field(
        default_factory=ClientTLS,
        description="CA, client certificate (mutual TLS), server name and bearer-token file "
        "of the channel; the channel is reopened when the files change.",
    )

    @field_validator("target")
    @classmethod
    def _target(cls, value: str) -> str:
        channel_target(value)  # raises ValueError naming the address at fault
        return value


SinkConfig = Annotated[HttpSinkConfig | GrpcSinkConfig, Field(discriminator="type")]


class ServedSettings(StrictModel):
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


class TeeConfig(ServedSettings):
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


# -- loading ------------------------------------------------------------------


def load_tee_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> TeeConfig:
    """Build a :class:`TeeConfig` from defaults < file < ``KVMESH_TEE_…`` < ``cli``
    (``None`` values of ``cli`` skipped; :func:`kvmesh.configfile.load_layered`)."""
    return load_layered(
        TeeConfig, path=file, env_prefix=TEE_ENV_PREFIX, overrides=cli, environ=environ
    )
