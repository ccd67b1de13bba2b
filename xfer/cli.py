"""``kvmesh xfer serve``: run a transfer sidecar (``main(argv)`` gets the words after it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from kvmesh.clihelp import HelpFormatter, show_config_defaults
from kvmesh.configfile import ConfigError
from kvmesh.tls import add_server_tls_args, server_tls_overrides
from xfer.config import XferConfig, load_config


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh xfer serve``."""
    p = argparse.ArgumentParser(
        prog="kvmesh xfer serve",
        description="Run a KV transfer sidecar. Flags override KVMESH_XFER_* variables, "
        "which override --config, which overrides the defaults shown here; see "
        "xfer/config.py for every setting.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON config file")
    p.add_argument(
        "--role", choices=["prefill", "decode"], help="which side of the transfer (required)"
    )
    p.add_argument("--host", help="gRPC, metrics and TCP transport address")
    p.add_argument("--port", type=int, help="gRPC port (0 picks a free one)")
    p.add_argument(
        "--advertise-address",
        metavar="HOST:PORT",
        help="address peers call this sidecar back at (default host:port; required on a "
        "decode sidecar with --host 0.0.0.0 or ::)",
    )
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0 disables)")
    p.add_argument(
        "--transport", choices=["nixl", "tcp"], help="nixl: NIXL over UCX; tcp: plain sockets"
    )
    p.add_argument(
        "--pool-path",
        metavar="FILE",
        help="shared-memory KV pool file, e.g. /dev/shm/kvmesh-pool-0 (required)",
    )
    p.add_argument("--page-size", type=int, help="bytes per KV page (required)")
    p.add_argument("--page-count", type=int, help="pages in the pool (required)")
    p.add_argument("--aux-size", type=int, help="bytes per aux slot")
    p.add_argument("--aux-count", type=int, help="aux slots after the pages")
    p.add_argument(
        "--create-pool",
        action="store_true",
        default=None,
        help="create the pool file if missing (tests, benchmarks)",
    )
    p.add_argument("--queues", type=int, help="transfer queues, one worker thread each")
    p.add_argument(
        "--max-inflight-per-queue", type=int, help="transfers a worker keeps posted at once"
    )
    p.add_argument(
        "--nixl-threads", type=int, help="NIXL UCX backend worker threads (0: NIXL's default)"
    )
    p.add_argument(
        "--nixl-progress-thread",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run NIXL's own progress thread (it busy-polls a core)",
    )
    p.add_argument(
        "--nixl-notify-poll-max-ms",
        type=float,
        help="longest pause of the idle NIXL notification poller (a room's first write is "
        "seen up to this late)",
    )
    p.add_argument(
        "--bootstrap-timeout-s",
        type=float,
        metavar="SECONDS",
        help="longest a room may stay Bootstrapping",
    )
    p.add_argument(
        "--waiting-timeout-s",
        type=float,
        metavar="SECONDS",
        help="longest a bootstrapped room may go without progress",
    )
    p.add_argument(
        "--heartbeat-interval-s", type=float, metavar="SECONDS", help="how often peers are pinged"
    )
    p.add_argument(
        "--prefetch-max-in-flight",
        type=int,
        help="prefetches open at once (pulling, or pulled and not claimed yet)",
    )
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    add_server_tls_args(p)
    p.add_argument(
        "--health-port", type=int, help="plaintext port serving only grpc.health.v1 (0: none)"
    )
    p.add_argument(
        "--peer-allow",
        action="append",
        metavar="PATTERN",
        help="glob on the certificate SANs of sidecars allowed as peers (repeatable; "
        "needs --tls-client-ca)",
    )
    p.add_argument(
        "--peer-secret-file", metavar="FILE", help="shared peer secret, sent and checked over TLS"
    )
    p.add_argument(
        "--peer-tls-ca",
        metavar="FILE",
        help="CA of peer sidecars' certificates (default with --tls-cert: --tls-client-ca)",
    )
    p.add_argument(
        "--peer-tls-cert",
        metavar="FILE",
        help="certificate presented to peers (default with --tls-cert: the server's own)",
    )
    p.add_argument("--peer-tls-key", metavar="FILE", help="private key of --peer-tls-cert")
    p.add_argument("--print-config", action="store_true", help="print the config and exit")
    p.add_argument(
        "--ready-file",
        metavar="FILE",
        help="write host:port here once serving (for supervisors and tests)",
    )
    show_config_defaults(p, XferConfig, overrides)
    return p


def overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """The nested config dict given by the flags (``None`` = not given)."""
    return {
        "role": ns.role,
        "host": ns.host,
        "port": ns.port,
        "advertise_address": ns.advertise_address,
        "metrics_port": ns.metrics_port,
        "transport": ns.transport,
        "queues": ns.queues,
        "max_inflight_per_queue": ns.max_inflight_per_queue,
        "nixl_threads": ns.nixl_threads,
        "nixl_progress_thread": ns.nixl_progress_thread,
        "nixl_notify_poll_max_ms": ns.nixl_notify_poll_max_ms,
        "bootstrap_timeout_s": ns.bootstrap_timeout_s,
        "waiting_timeout_s": ns.waiting_timeout_s,
        "heartbeat_interval_s": ns.heartbeat_interval_s,
        "log_level": ns.log_level,
        "pool": {
            "path": ns.pool_path,
            "page_size": ns.page_size,
            "page_count": ns.page_count,
            "aux_size": ns.aux_size,
            "aux_count": ns.aux_count,
            "create": ns.create_pool,
        },
        "health_port": ns.health_port,
        "prefetch": {"max_in_flight": ns.prefetch_max_in_flight},
        "peers": {
            "allowed_identities": ns.peer_allow,
            "shared_secret_file": ns.peer_secret_file,
            "tls": {
                "ca_file": ns.peer_tls_ca,
                "cert_file": ns.peer_tls_cert,
                "key_file": ns.peer_tls_key,
            },
        },
        **server_tls_overrides(ns),
    }


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvmesh xfer serve``; returns an exit code."""
    args = list(argv)
    if args[:1] == ["serve"]:
        args = args[1:]
    ns = build_parser().parse_args(args)
    try:
        config = load_config(ns.config, cli=overrides(ns))
    except ConfigError as e:
        print(f"kvmesh xfer serve: {e}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(json.dumps(config.model_dump(), indent=2))
        return 0
    from xfer.server import XferServer, run

    def ready(server: XferServer) -> None:
        if ns.ready_file:
            tmp = ns.ready_file + ".tmp"
            with open(tmp, "w") as f:
                f.write(server.address)
            os.replace(tmp, ns.ready_file)

    return run(config, ready)
