"""Configuration of the tee and cache simulator services: one typed model each, four layers.

Precedence, highest first: command-line flags > environment variables
(``KVMESH_TEE_<FIELD>`` / ``KVMESH_CACHESIM_<FIELD>``, nested fields joined by
``__``; a value starting with ``[`` or ``{`` is JSON) > a config file (YAML,
TOML or JSON by extension) > the defaults below. Unknown keys are rejected,
naming the key and where it came from.

Example tee file (YAML)::

    send_concurrency: 8          # or KVMESH_TEE_SEND_CONCURRENCY=8
    queue_size: 4096
    sinks:
      - type: http
        url: http://cachesim:8470
      - type: grpc
        target: cachesim:50062
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmesh.cachemodel import EvictionPolicy
from kvmesh.configfile import ConfigError as ConfigError
from kvmesh.configfile import env_overrides, merge, read_config_file
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


class GrpcSinkConfig(_Strict):
    """A gRPC sink: another tee or a cache simulator (kvmesh.tee.v1.TeeService)."""

    type: Literal["grpc"] = "grpc"
    target: str = Field(min_length=1, description="host:port of the TeeService.")
    name: str = Field(default="", description="Metrics label; grpc://target when empty.")


SinkConfig = Annotated[HttpSinkConfig | GrpcSinkConfig, Field(discriminator="type")]


class TeeConfig(_Strict):
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
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"

    @model_validator(mode="after")
    def _checks(self) -> TeeConfig:
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port are both {self.port}")
        names = [s.name or getattr(s, "url", "") or getattr(s, "target", "") for s in self.sinks]
        if len(set(names)) != len(names):
            raise ValueError(f"sinks: names must be unique, got {names}")
        return self


class CacheSimConfig(_Strict):
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
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = "text"


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
    """A :class:`tee.client.Tee` (not started) with the sinks ``config`` names."""
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
                )
            )
        else:
            sinks.append(GrpcSink(s.target, name=s.name))
    return Tee(
        sinks,
        queue_size=config.queue_size,
        concurrency=config.send_concurrency,
        send_timeout_s=config.send_timeout_s,
        max_input_ids=config.max_input_ids,
    )
