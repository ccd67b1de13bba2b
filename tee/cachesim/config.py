"""Configuration of the cache simulator service: one typed model, four layers.

Precedence, highest first: command-line flags > environment variables
``KVMESH_CACHESIM_<FIELD>`` (nested fields joined by ``__``; a value starting
with ``[`` or ``{`` is JSON) > a config file (YAML, TOML or JSON by extension)
> the defaults below. Unknown keys are rejected in every layer, naming the key
and where it came from.

Example file (YAML)::

    http_port: 8470              # or KVMESH_CACHESIM_HTTP_PORT=8470
    block_size: 16
    worker_capacity_blocks: 16384
    eviction: lru
    tls:                         # or KVMESH_CACHESIM_TLS__CERT_FILE=...
      cert_file: /certs/tls.crt
      key_file: /certs/tls.key
      client_ca_file: /certs/ca.crt
    auth:
      policy_file: /policy/policy.yaml

The transport security, policy, per-client limits, health port and logging
settings are those of every served tee component (:class:`tee.config.ServedSettings`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from pydantic import Field, model_validator

from kvmesh.configfile import ConfigError as ConfigError
from kvmesh.configfile import load_layered
from tee.cachesim.model import EvictionPolicy
from tee.config import ServedSettings
from tee.events import DEFAULT_MAX_INPUT_IDS

#: Prefix of the environment variables read by :func:`load_cachesim_config`.
CACHESIM_ENV_PREFIX = "KVMESH_CACHESIM_"

#: Default of ``http_body_timeout_s``: far above what a healthy tee takes to
#: send the largest body it may (a few MB on a local network).
BODY_READ_TIMEOUT_S = 30.0


class CacheSimConfig(ServedSettings):
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
    http_body_timeout_s: float = Field(
        default=BODY_READ_TIMEOUT_S,
        gt=0,
        le=3600,
        description="Longest an HTTP client may take to send a request body; one that "
        "announces a body and sends it slowly (or never) is answered 408.",
    )
    shutdown_grace_s: float = Field(default=5.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _checks(self) -> CacheSimConfig:
        ports = [p for p in (self.http_port, self.grpc_port if self.grpc_enabled else 0) if p]
        if self.health_port and self.health_port in ports:
            raise ValueError(f"health_port {self.health_port} is also http_port or grpc_port")
        if self.health_port and not self.grpc_enabled:
            raise ValueError("health_port serves gRPC health: it needs grpc_enabled")
        return self


def load_cachesim_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> CacheSimConfig:
    """Build a :class:`CacheSimConfig` from defaults < file < ``KVMESH_CACHESIM_…`` < ``cli``
    (``None`` values of ``cli`` skipped; :func:`kvmesh.configfile.load_layered`)."""
    return load_layered(
        CacheSimConfig, path=file, env_prefix=CACHESIM_ENV_PREFIX, overrides=cli, environ=environ
    )
