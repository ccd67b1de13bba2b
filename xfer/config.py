"""Configuration of a transfer sidecar: one typed model, four layers.

Precedence, highest first: command-line flags > environment variables
``KVMESH_XFER_<FIELD>`` (nested fields joined by ``__``, e.g.
``KVMESH_XFER_POOL__PAGE_SIZE``) > a config file (YAML, TOML or JSON) > the
defaults below. Unknown keys are rejected in every layer.

Example file (YAML)::

    role: prefill
    transport: nixl
    pool: {path: /dev/shm/kvmesh-pool-0, page_size: 65536, page_count: 4096, aux_count: 256}
    queues: 4
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kvmesh.configfile import ConfigError, format_validation_error, read_config_file
from kvmesh.configfile import env_overrides as _env_overrides
from xfer.pool import PoolGeometry

#: Prefix of the environment variables read by :func:`load_config`.
ENV_PREFIX = "KVMESH_XFER_"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=True)


class PoolSettings(_Strict):
    """The shared-memory KV pool the engine created (the sidecar attaches to it)."""

    path: str = Field(min_length=1, description="Pool file, e.g. /dev/shm/kvmesh-pool-0.")
    page_size: int = Field(gt=0, description="Bytes per KV page (all layers of one page).")
    page_count: int = Field(gt=0, description="Pages in the pool.")
    aux_size: int = Field(default=64, gt=0, description="Bytes per aux slot.")
    aux_count: int = Field(default=0, ge=0, description="Aux slots after the pages.")
    create: bool = Field(
        default=False, description="Create the pool file if missing (tests, benchmarks)."
    )

    def geometry(self) -> PoolGeometry:
        """The pool's sizes."""
        return PoolGeometry(self.page_size, self.page_count, self.aux_size, self.aux_count)


class XferConfig(_Strict):
    """Configuration of one sidecar (``kvmesh xfer serve``)."""

    role: Literal["prefill", "decode"] = Field(description="Which side of the transfer.")
    host: str = Field(default="127.0.0.1", min_length=1, description="gRPC/metrics/TCP address.")
    port: int = Field(default=50061, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    metrics_port: int = Field(
        default=9465, ge=0, le=65535, description="Prometheus /metrics port; 0 disables it."
    )
    transport: Literal["nixl", "tcp"] = Field(
        default="nixl", description="nixl: NIXL over UCX; tcp: plain sockets (no NIXL needed)."
    )
    pool: PoolSettings
    queues: int = Field(
        default=4,
        ge=1,
        le=64,
        description="Transfer queues, each with one worker thread; rooms are sharded by "
        "destination peer, so one slow peer stalls only its queue.",
    )
    max_inflight_per_queue: int = Field(
        default=16,
        ge=1,
        description="Transfers a worker keeps posted at once. 1 waits on every chunk before "
        "the next (the serial shape the benchmark compares against).",
    )
    nixl_threads: int = Field(
        default=0, ge=0, description="NIXL UCX backend worker threads (0: NIXL's default)."
    )
    nixl_progress_thread: bool = Field(
        default=False,
        description="Run NIXL's own progress thread. It busy-polls (a full core per sidecar "
        "even when idle); off, the sidecar's workers and notification poller drive progress.",
    )
    bootstrap_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest a room may stay Bootstrapping."
    )
    waiting_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="Longest a bootstrapped room may go without progress (no chunk queued, "
        "sent or arrived) before it fails.",
    )
    transfer_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest one posted transfer may take."
    )
    heartbeat_interval_s: float = Field(
        default=1.0,
        gt=0,
        description="Peers are pinged this often (each ping times out after one interval), "
        "so a dead peer's rooms fail within two intervals.",
    )
    max_rooms: int = Field(default=65536, ge=1, description="Most rooms tracked at once.")
    shutdown_grace_s: float = Field(default=5.0, ge=0, description="SIGTERM drain time.")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="after")
    def _cross_checks(self) -> XferConfig:
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port are both {self.port}")
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be finite")
        return self


def env_overrides(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The nested dict given by ``KVMESH_XFER_…`` variables."""
    return _env_overrides(ENV_PREFIX, environ)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in top.items():
        if v is None:
            continue
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        elif isinstance(v, Mapping):
            out[k] = _merge({}, v)
        else:
            out[k] = v
    return out


def load_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> XferConfig:
    """Build the config from defaults < ``file`` < environment < ``cli`` (``None`` skipped)."""
    merged: dict[str, Any] = {}
    if file is not None:
        merged = _merge(merged, read_config_file(file))
    merged = _merge(merged, env_overrides(environ))
    if cli:
        merged = _merge(merged, cli)
    try:
        return XferConfig.model_validate(merged)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, "xfer")) from e
