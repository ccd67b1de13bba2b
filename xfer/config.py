"""Configuration of a transfer sidecar: one typed model, four layers.

Precedence, highest first: command-line flags > environment variables
``KVMESH_XFER_<FIELD>`` (nested fields joined by ``__``, e.g.
``KVMESH_XFER_POOL__PAGE_SIZE``) > a config file (YAML, TOML or JSON) > the
defaults below. Unknown keys are rejected in every layer, naming the key
and where it came from.

Example file (YAML)::

    role: prefill
    transport: nixl
    pool: {path: /dev/shm/kvmesh-pool-0, page_size: 65536, page_count: 4096, aux_count: 256}
    queues: 4
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, model_validator

from kvmesh.auth import AuthSettings
from kvmesh.configfile import StrictModel, load_layered
from kvmesh.grpcsvc import ClientLimits
from kvmesh.tls import ClientTLS, ServerTLS
from xfer.pool import PoolGeometry

#: Prefix of the environment variables read by :func:`load_config`.
ENV_PREFIX = "KVMESH_XFER_"


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is an unspecified address (``0.0.0.0``, ``::``): bindable on every
    interface, but no address a peer can dial."""
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def _check_advertise_address(value: str) -> None:
    """``value`` must be ``host:port`` with a dialable host and a port in 1..65535."""
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"advertise_address {value!r}: expected host:port with a port in 1..65535 "
            "(an IPv6 address in brackets, [fd00::1]:50061)"
        )
    if ":" in host and not (host.startswith("[") and host.endswith("]")):
        raise ValueError(f"advertise_address {value!r}: put an IPv6 address in brackets")
    if is_wildcard(host):
        raise ValueError(
            f"advertise_address {value!r}: {host} is no address a peer can dial; give this "
            "sidecar's own address (e.g. the pod IP)"
        )


class PoolSettings(StrictModel):
    """The shared-memory KV pool the engine created (the sidecar attaches to it)."""

    path: str = Field(min_length=1, description="Pool file, e.g. /dev/shm/kvmesh-pool-0.")
    page_size: int = Field(gt=0, description="Bytes per KV page (all layers of one page).")
    page_count: int = Field(gt=0, description="Pages in the pool.")
    aux_size: int = Field(default=64, gt=0, description="Bytes per aux slot.")
    aux_count: int = Field(default=0, ge=0, description="Aux slots after the pages.")
    create: bool = Field(
        default=False, description="Create the pool file if missing (tests, benchmarks)."
    )
    populate: bool = Field(
        default=True,
        description="Map the pool with a page-table entry for every page made at start "
        "(MAP_POPULATE), so that no transfer waits for the kernel to map a page on its "
        "first use: kvmesh bench xfer's copy inside the sidecar ran at 0.55 of a raw "
        "write of the same runs without it, 0.7 to 1.0 with it. Costs the mapping's page "
        "tables up front (2 MiB per GiB of pool) and the time to make them; on a pool file "
        "with holes it also allocates them. false maps pages on first use.",
    )

    def geometry(self) -> PoolGeometry:
        """The pool's sizes."""
        return PoolGeometry(self.page_size, self.page_count, self.aux_size, self.aux_count)


class PeerSettings(StrictModel):
    """Which sidecars may act as this sidecar's peers, and how it dials them."""

    allowed_identities: list[str] = Field(
        default_factory=list,
        description="Glob patterns on the certificate SANs of sidecars allowed to call the "
        "peer methods (Bootstrap, Abort, Heartbeat), e.g. spiffe://fleet/xfer/decode-*. "
        "Needs mutual TLS (tls.client_ca_file, client_auth require). Empty: any caller "
        "with role peer.",
    )
    shared_secret_file: str = Field(
        default="",
        description="File holding the peer secret (at least 16 characters, one per line): "
        "the first line is sent with every call to a peer, every line is accepted from "
        "peers (two lines during a rotation). Re-read when it changes. Needs tls (the "
        "secret never travels in plaintext). Empty: no secret.",
    )
    tls: ClientTLS = Field(
        default_factory=ClientTLS,
        description="TLS of calls to peers. Left empty while tls.cert_file is set, peers are "
        "dialed with this sidecar's own certificate (tls.cert_file/key_file) and verified "
        "with tls.client_ca_file (the system CAs when that is empty).",
    )


class PeerLimits(StrictModel):
    """What one peer (a certificate identity; without one, a caller host) may ask of a
    prefill sidecar: rooms its Bootstrap calls open, and how fast it may call."""

    max_rooms: int = Field(
        # A decode sidecar bootstraps a room as its engine schedules the request, usually
        # moments before the prefill engine sends the first chunk; 4096 waiting rooms per
        # peer is far beyond that, and 16 peers at the cap still leave max_rooms room.
        default=4096,
        ge=0,
        description="Rooms one peer's Bootstraps may hold that the prefill engine has not "
        "sent a chunk for yet. At the cap its oldest finished one is forgotten; with none "
        "finished the Bootstrap is RESOURCE_EXHAUSTED. 0: no cap.",
    )
    bootstrap_rps: float = Field(
        # Two orders of magnitude above what one decode engine schedules per second.
        default=2000.0,
        ge=0,
        description="Bootstrap calls per second per peer (token bucket); beyond it "
        "RESOURCE_EXHAUSTED with a retry delay. 0: no limit.",
    )
    bootstrap_burst: int = Field(
        default=4096,
        ge=0,
        description="Bucket size of bootstrap_rps (a decode sidecar starting with a queue of "
        "rooms); 0: one second's worth.",
    )
    max_peers: int = Field(
        default=10_000,
        ge=1,
        description="Peers tracked at once; beyond it one without rooms is forgotten.",
    )


class XferLimits(StrictModel):
    """Per-client limits of the gRPC port, per-peer limits, and the TCP data port's."""

    per_client: ClientLimits = Field(
        # The local engine pipelines one AddTransferRequest per chunk
        # (add_transfer_request_nowait): a generous in-flight cap, so only a
        # runaway client hits it.
        default_factory=lambda: ClientLimits(max_in_flight=4096),
        description="Calls in flight per client (an identity, or a peer host without "
        "authorization); beyond it RESOURCE_EXHAUSTED.",
    )
    max_message_bytes: int = Field(
        default=4 << 20,
        ge=4096,
        description="Largest gRPC message; grpc answers RESOURCE_EXHAUSTED for a larger one "
        "(a transfer request names pages, never carries them: 4 MiB is ample).",
    )
    per_peer: PeerLimits = Field(default_factory=PeerLimits)
    tcp_handshake_timeout_s: float = Field(
        # A sidecar's handshake is two small messages on the cluster network.
        default=10.0,
        gt=0,
        description="TCP transport: a data connection that has not proved it holds the key "
        "within this time is closed.",
    )
    tcp_max_handshakes: int = Field(
        default=64,
        ge=1,
        description="TCP transport: data connections still in their handshake at once; one "
        "more is closed at once (each holds a thread until it authenticates).",
    )


class PrefetchSettings(StrictModel):
    """Prefetches of a decode sidecar: pulls of a prefix from the sidecar holding it,
    started before the request that needs it arrives (docs in xfer/README.md)."""

    max_in_flight: int = Field(
        default=256,
        ge=1,
        description="Prefetches open at once (pulling, or pulled and not claimed yet); one "
        "more is RESOURCE_EXHAUSTED.",
    )
    default_ttl_s: float = Field(
        default=10.0,
        gt=0,
        description="How long pulled pages wait for their claim when a Prefetch names no "
        "ttl; then they are released (Expired).",
    )
    max_ttl_s: float = Field(
        default=120.0, gt=0, description="Longest ttl a Prefetch may ask for (longer is cut)."
    )
    pull_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="How long a pull (asking the source, reading its pages) may take when a "
        "Prefetch names no deadline; then the prefetch fails.",
    )


class XferConfig(StrictModel):
    """Configuration of one sidecar (``kvmesh xfer serve``)."""

    role: Literal["prefill", "decode"] = Field(description="Which side of the transfer.")
    host: str = Field(default="127.0.0.1", min_length=1, description="gRPC/metrics/TCP address.")
    port: int = Field(default=50061, ge=0, le=65535, description="gRPC port; 0 picks a free one.")
    advertise_address: str = Field(
        default="",
        description="host:port this sidecar gives its peers for calls back to it. Only a "
        "decode sidecar gives one: it sends it in Bootstrap and the prefill sidecar "
        "heartbeats it (the decode side reaches the prefill one at the address its engine "
        "names in RegisterRoom). Empty: host:port (the bound port when port is 0); a "
        "decode sidecar whose host is 0.0.0.0 or :: must set it, e.g. to the pod IP and "
        "port. With TLS, peers verify this sidecar's certificate against its host (or "
        "against peers.tls.server_name).",
    )
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
    nixl_notify_poll_max_ms: float = Field(
        default=0.5,
        ge=0.1,
        le=100.0,
        description="Longest pause of the NIXL notification poller once idle (it polls every "
        "0.1 ms after a notification and backs off by doubling up to this): a room's first "
        "write is seen up to this much late. kvmesh bench xfer, one 4 MiB room: 7.1-7.2 ms "
        "to Success at 2, 4.8-5.1 at 0.5; an idle sidecar used 3, 5 and 7 % of a core at 2, "
        "1 and 0.5.",
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
    tls: ServerTLS = Field(
        default_factory=ServerTLS,
        description="TLS of the gRPC port (client_ca_file: mutual TLS). Empty: plaintext, "
        "logged as a warning at start.",
    )
    auth: AuthSettings = Field(
        default_factory=AuthSettings,
        description="Policy file: engine methods need role engine, peer methods role peer.",
    )
    peers: PeerSettings = Field(default_factory=PeerSettings)
    limits: XferLimits = Field(default_factory=XferLimits)
    prefetch: PrefetchSettings = Field(default_factory=PrefetchSettings)
    health_port: int = Field(
        default=0,
        ge=0,
        le=65535,
        description="Plaintext port serving only grpc.health.v1 (kubelet probes when the "
        "gRPC port needs client certificates); 0: none.",
    )

    @model_validator(mode="after")
    def _cross_checks(self) -> XferConfig:
        if self.advertise_address:
            _check_advertise_address(self.advertise_address)
        elif self.role == "decode" and is_wildcard(self.host):
            raise ValueError(
                f"advertise_address is required on a decode sidecar listening on {self.host}: "
                "the prefill sidecar calls back (Heartbeat) at the address this sidecar "
                f"advertises, and {self.host} is no address it can dial; set it to this "
                "sidecar's reachable host:port (in Kubernetes, the pod IP and the port)"
            )
        if self.metrics_port and self.metrics_port == self.port:
            raise ValueError(f"metrics_port and port are both {self.port}")
        if self.health_port and self.health_port in (self.port, self.metrics_port):
            raise ValueError(f"health_port {self.health_port} is also port or metrics_port")
        if self.peers.allowed_identities and not (
            self.tls.mutual and self.tls.client_auth == "require"
        ):
            raise ValueError(
                "peers.allowed_identities needs mutual TLS (tls.client_ca_file with "
                "tls.client_auth: require): a peer's identity is its client certificate"
            )
        if self.peers.shared_secret_file and not (self.tls.enabled and self.peer_tls().active):
            raise ValueError(
                "peers.shared_secret_file needs tls.cert_file and tls.key_file: the secret "
                "is never sent or accepted in plaintext"
            )
        for name in ("bootstrap_timeout_s", "waiting_timeout_s", "transfer_timeout_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name}: must be finite")
        for name in ("default_ttl_s", "max_ttl_s", "pull_timeout_s"):
            if not math.isfinite(getattr(self.prefetch, name)):
                raise ValueError(f"prefetch.{name}: must be finite")
        if not math.isfinite(self.limits.tcp_handshake_timeout_s):
            raise ValueError("limits.tcp_handshake_timeout_s: must be finite")
        if not math.isfinite(self.limits.per_peer.bootstrap_rps):
            raise ValueError("limits.per_peer.bootstrap_rps: must be finite")
        return self

    def peer_tls(self) -> ClientTLS:
        """TLS of this sidecar's calls to its peers: ``peers.tls`` when set, else (with
        ``tls.cert_file``) this sidecar's own certificate, verified by ``tls.client_ca_file``."""
        if self.peers.tls.active or not self.tls.enabled:
            return self.peers.tls
        return ClientTLS(
            enabled=True,
            ca_file=self.tls.client_ca_file,
            cert_file=self.tls.cert_file,
            key_file=self.tls.key_file,
            reload_interval_s=self.tls.reload_interval_s,
        )


def load_config(
    file: str | os.PathLike[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    cli: Mapping[str, Any] | None = None,
) -> XferConfig:
    """Build the config from defaults < ``file`` < environment < ``cli`` (``None`` skipped).

    Raises :class:`~kvmesh.configfile.ConfigError` naming every unknown key with its
    source and every invalid value with its field (:func:`kvmesh.configfile.load_layered`).
    """
    return load_layered(
        XferConfig, path=file, env_prefix=ENV_PREFIX, overrides=cli, environ=environ
    )
