"""Configuration of an engine-side bridge (``kvmesh bridge``): one typed model, four layers.

Precedence, highest first: command-line flags > environment variables
``KVMESH_BRIDGE_<FIELD>`` (nested fields joined by ``__``, e.g.
``KVMESH_BRIDGE_INDEXER__TARGET``; a list as JSON, e.g.
``KVMESH_BRIDGE_ENGINE_EVENTS__ENDPOINTS='[{"worker_id": ...}]'``) > a config
file (YAML, TOML or JSON) > the defaults below. Unknown keys are rejected in
every layer, naming the key and where it came from.

``engine_events`` is the indexer's own section (indexer/config.py,
:class:`~indexer.config.EngineEventSettings`): moving an engine from an
indexer replica's subscribers to a bridge beside it moves its entry as it is.

Example file (YAML)::

    indexer:
      target: dns:///kvmesh-indexer-headless.kvmesh.svc:50051
      tls:
        ca_file: /etc/kvmesh/bridge-tls/ca.crt
        cert_file: /etc/kvmesh/bridge-tls/tls.crt
        key_file: /etc/kvmesh/bridge-tls/tls.key
    engine_events:
      endpoints:
        - worker_id: vllm-0
          model: meta-llama/Llama-3.1-8B-Instruct
          address: http://10.0.0.5:8000
          endpoint: ipc:///run/kvmesh-events/pub
          replay_endpoint: ipc:///run/kvmesh-events/replay
    incarnation_prefix: 6f1c2d3e-pod-uid
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from indexer.config import EngineEventSettings
from kvmesh.balancing import LoadBalancing, channel_target
from kvmesh.configfile import StrictModel, load_layered
from kvmesh.tls import ClientTLS

#: Prefix of the environment variables read by :func:`load_config`.
ENV_PREFIX = "KVMESH_BRIDGE_"


class IndexerLinkSettings(StrictModel):
    """How the bridge reaches the indexer Service (indexer/bridge/link.py)."""

    target: str = Field(
        default="127.0.0.1:50051",
        min_length=1,
        description="gRPC target of the indexer: host:port, a name resolving to every "
        "replica (dns:///kvmesh-indexer-headless.ns.svc:50051, a headless Service), a "
        "ClusterIP Service's name, or several replica addresses separated by commas "
        "(10.0.0.5:50051,10.0.0.6:50051). Any replica serves: the index is in Redis.",
    )
    load_balancing: LoadBalancing = Field(
        default="round_robin",
        description="round_robin: connect to every address the target resolves to and "
        "open each stream on a live one, so a dead replica's streams move to another at "
        "once; pick_first: one connection at a time.",
    )
    tls: ClientTLS = Field(
        default_factory=ClientTLS,
        description="TLS, client certificate (mutual TLS: the identity the policy gives "
        "role engine and this engine's worker ids) and bearer token of the channel "
        "(kvmesh.tls.ClientTLS); all empty: plaintext.",
    )
    call_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Deadline of RegisterInstance, Heartbeat and ListInstances.",
    )
    ack_timeout_s: float = Field(
        default=15.0,
        gt=0,
        description="Longest wait for a published batch's acknowledgement. Beyond it the "
        "stream is taken for dead (a replica that hangs, a connection that went silent): "
        "the channel is rebuilt and the batch sent again. Above the indexer's "
        "redis.write_timeout_s (10 s), which bounds one apply.",
    )
    stream_max_age_s: float = Field(
        default=120.0,
        ge=0,
        description="An idle stream older than this is closed and a new one opened at the "
        "next batch, before the indexer's limits.max_connection_age_s (300 s) ends its "
        "connection under it; a new stream is placed on a live replica anew. 0: never.",
    )
    reconnect_backoff_s: float = Field(
        default=0.1,
        gt=0,
        description="Wait before the first new stream after one failed; doubled (with "
        "jitter) for each failure in a row, up to reconnect_backoff_max_s.",
    )
    reconnect_backoff_max_s: float = Field(
        default=5.0,
        gt=0,
        description="Longest wait between stream attempts while the indexer stays down.",
    )
    max_message_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=4096,
        description="Largest batch message sent (the indexer's limits.max_message_bytes); "
        "a larger batch is refused here, its loss handled by "
        "engine_events.on_unrecoverable_gap, instead of failing the whole stream.",
    )

    @model_validator(mode="after")
    def _checks(self) -> IndexerLinkSettings:
        try:
            channel_target(self.target)
        except ValueError as e:
            raise ValueError(f"target: {e}") from None
        if self.reconnect_backoff_max_s < self.reconnect_backoff_s:
            raise ValueError("reconnect_backoff_max_s is below reconnect_backoff_s")
        for name in ("call_timeout_s", "ack_timeout_s", "stream_max_age_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be finite")
        return self


class BufferSettings(StrictModel):
    """The bounded buffer between each engine socket and the stream to the indexer."""

    max_batches: int = Field(
        default=4096,
        ge=1,
        description="Engine batches held while the indexer is slow or away. Beyond it new "
        "batches are dropped and counted (kvmesh_bridge_batches_dropped_total) and fetched "
        "again from the engine's replay socket; the engine is never slowed.",
    )
    max_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Bytes of engine batches held at most (a batch of a 16k-token prompt is "
        "about 50 KB); beyond it, as beyond max_batches. A replay after drops holds what "
        "the engine returns on top of it.",
    )


class BridgeConfig(StrictModel):
    """Configuration of one bridge (``kvmesh bridge``), run beside one engine."""

    indexer: IndexerLinkSettings = Field(default_factory=IndexerLinkSettings)
    engine_events: EngineEventSettings = Field(
        default_factory=EngineEventSettings,
        description="The engine's KV-event streams (one endpoint per data-parallel rank) and "
        "how gaps are handled: the indexer's engine_events section (indexer/config.py).",
    )
    buffer: BufferSettings = Field(default_factory=BufferSettings)
    default_lease_ttl_s: float = Field(
        default=30.0,
        gt=0,
        description="Lease of an endpoint whose lease_ttl_s is 0; heartbeats come every "
        "third of it while the engine's socket is connected.",
    )
    incarnation_prefix: str = Field(
        default="bridge",
        min_length=1,
        max_length=128,
        pattern=r"^[A-Za-z0-9._:-]+$",
        description="Incarnations the bridge registers are <prefix>-<random>. On start the "
        "bridge resumes an instance the index holds under its own prefix and resets one "
        "registered under another: give each engine process its own prefix (the pod's "
        "UID: the Helm snippet does), so a replaced pod never resumes its predecessor's "
        "stream.",
    )
    host: str = Field(
        default="127.0.0.1",
        min_length=1,
        description="Address of the metrics and health ports (0.0.0.0, or the pod IP, in a pod).",
    )
    metrics_port: int = Field(
        default=9466, ge=0, le=65535, description="Prometheus /metrics port; 0: none."
    )
    health_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Plaintext port serving only grpc.health.v1, for kubelet probes; 0: none. "
        "'' is SERVING while the bridge runs; service kvmesh.bridge is SERVING while the "
        "indexer answers (for dashboards: probing it would restart the bridge when the "
        "indexer is away).",
    )
    shutdown_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="On SIGTERM, how long the batches in flight get to be acknowledged.",
    )
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: Literal["text", "json"] = Field(
        default="text", description="json: one JSON object per line, for log collectors."
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> BridgeConfig:
        endpoints = self.engine_events.endpoints
        if not endpoints:
            raise ValueError(
                "engine_events.endpoints: give the engine's stream (worker_id, model, "
                "endpoint, replay_endpoint), e.g. --zmq-endpoint"
            )
        seen: set[tuple[str, int]] = set()
        for i, ep in enumerate(endpoints):
            if (ep.worker_id, ep.dp_rank) in seen:
                raise ValueError(
                    f"engine_events.endpoints[{i}]: instance {ep.worker_id}/dp{ep.dp_rank} "
                    "is listed twice"
                )
            seen.add((ep.worker_id, ep.dp_rank))
        if self.metrics_port and self.metrics_port == self.health_port:
            raise ValueError(f"metrics_port and health_port are both {self.metrics_port}")
        if not math.isfinite(self.shutdown_grace_s):
            raise ValueError("shutdown_grace_s: must be finite")
        return self


def load_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> BridgeConfig:
    """Build the config from defaults < ``file`` < environment < ``cli`` (``None`` skipped).

    Raises :class:`~kvmesh.configfile.ConfigError` naming every unknown key with its
    source and every invalid value with its field (:func:`kvmesh.configfile.load_layered`).
    """
    return load_layered(
        BridgeConfig, path=file, env_prefix=ENV_PREFIX, overrides=cli, environ=environ
    )
