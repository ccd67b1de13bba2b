"""``kvmesh tee serve``: run the tee service.

Flags override environment variables (``KVMESH_TEE_…``, e.g.
``KVMESH_TEE_SEND_CONCURRENCY=32``), which override the ``--config`` file,
which overrides the defaults (tee/config.py). The server's TLS and policy:
``--tls-cert``, ``--tls-key``, ``--tls-client-ca``, ``--auth-policy`` (or
``KVMESH_TEE_TLS__CERT_FILE`` …); a sink's TLS is in its ``tls`` section of
the config file or ``KVMESH_TEE_SINKS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from kvmesh.clihelp import HelpFormatter, show_config_defaults
from kvmesh.tls import add_server_tls_args, server_tls_overrides
from tee.config import ConfigError, TeeConfig, load_tee_config


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh tee serve``."""
    p = argparse.ArgumentParser(
        prog="kvmesh tee serve",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON config file")
    p.add_argument("--host", help="listen address")
    p.add_argument("--port", type=int, help="gRPC port (0 picks a free one)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (0 disables)")
    p.add_argument(
        "--sink-http", action="append", metavar="URL", help="HTTP sink base URL (repeatable)"
    )
    p.add_argument(
        "--sink-grpc", action="append", metavar="HOST:PORT", help="gRPC sink (repeatable)"
    )
    p.add_argument("--send-concurrency", type=int, help="sends in flight per sink")
    p.add_argument("--queue-size", type=int, help="queue bound per sink")
    p.add_argument("--send-timeout", type=float, metavar="SECONDS", help="timeout of one send")
    p.add_argument(
        "--shutdown-deadline",
        type=float,
        metavar="SECONDS",
        help="on SIGTERM, how long queued events may drain",
    )
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    p.add_argument("--log-format", choices=["text", "json"], help="log line format")
    add_server_tls_args(p)
    p.add_argument(
        "--health-port", type=int, help="plaintext port serving only grpc.health.v1 (0: none)"
    )
    p.add_argument("--print-config", action="store_true", help="print the config and exit")
    show_config_defaults(p, TeeConfig, cli_overrides)
    return p


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The nested config dict the flags give (None = not given)."""
    sinks: list[dict[str, str]] | None = None
    if args.sink_http or args.sink_grpc:
        sinks = [{"type": "http", "url": u} for u in args.sink_http or []]
        sinks += [{"type": "grpc", "target": t} for t in args.sink_grpc or []]
    return {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "sinks": sinks,
        "send_concurrency": args.send_concurrency,
        "queue_size": args.queue_size,
        "send_timeout_s": args.send_timeout,
        "shutdown_deadline_s": args.shutdown_deadline,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "health_port": args.health_port,
        **server_tls_overrides(args),
    }


def config_from_argv(argv: Sequence[str]) -> tuple[TeeConfig, bool]:
    """Parse ``argv``; return the effective config and whether to only print it."""
    args = build_parser().parse_args(list(argv))
    return load_tee_config(args.config, cli=cli_overrides(args)), args.print_config


def main(argv: Sequence[str]) -> int:
    """Run ``kvmesh tee serve``; return the exit code."""
    try:
        config, print_only = config_from_argv(argv)
    except ConfigError as e:
        print(f"kvmesh tee serve: {e}", file=sys.stderr)
        return 2
    if print_only:
        print(config.model_dump_json(indent=2))
        return 0
    if not config.sinks:
        print("kvmesh tee serve: no sinks (use --sink-http / --sink-grpc)", file=sys.stderr)
        return 2
    from tee.server import run

    return run(config)
