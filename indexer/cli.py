"""``kvmesh indexer serve``: run one indexer replica (``main(argv)`` gets the words after it).

Flags override environment variables (``KVMESH_INDEXER_…``), which override
the ``--config`` file, which overrides the defaults (indexer/config.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from indexer.config import ConfigError, IndexerConfig, load_config
from kvmesh.clihelp import HelpFormatter, show_config_defaults
from kvmesh.tls import add_server_tls_args, server_tls_overrides


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh indexer serve``."""
    s = argparse.ArgumentParser(
        prog="kvmesh indexer serve",
        description="Run one indexer replica until SIGTERM or SIGINT.\n\n"
        "Flags override environment variables (KVMESH_INDEXER_…), which override the "
        "--config file, which overrides the defaults shown here (indexer/config.py).",
        formatter_class=HelpFormatter,
    )
    s.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON config file")
    s.add_argument("--host", help="listen address (the container image sets 0.0.0.0)")
    s.add_argument("--port", type=int, help="gRPC port (0 picks a free one)")
    s.add_argument("--metrics-port", type=int, help="Prometheus port (0 disables)")
    s.add_argument("--backend", choices=["memory", "redis"], help="index backend")
    s.add_argument("--redis-url", help="Redis URL for --backend redis")
    s.add_argument("--redis-prefix", help="prefix of every Redis key")
    s.add_argument("--redis-username", help="Redis ACL user")
    s.add_argument(
        "--redis-password-file",
        metavar="FILE",
        help="file holding the Redis password (re-read on reconnect; never put it in a flag)",
    )
    s.add_argument(
        "--zmq-endpoint",
        action="append",
        metavar="SPEC",
        help="subscribe to an engine's KV events (repeatable; replaces engine_events.endpoints): "
        "comma-separated key=value pairs, e.g. worker_id=w0,model=M,"
        "endpoint=tcp://10.0.0.5:5557,replay_endpoint=tcp://10.0.0.5:5558,"
        "address=http://10.0.0.5:8000 (also dp_rank, bind, topic, keys, lease_ttl_s)",
    )
    s.add_argument("--sglang-model", help="namespace of SGLang kv_indexer.v1 API workers")
    s.add_argument(
        "--no-sglang-api",
        dest="sglang_api",
        action="store_const",
        const=False,
        help="do not serve SGLang's kv_indexer.v1.KVIndexer",
    )
    s.add_argument("--block-size", type=int, help="tokens per block")
    s.add_argument("--max-match-blocks", type=int, help="most blocks one Match looks at")
    s.add_argument("--max-message-bytes", type=int, help="largest gRPC message")
    s.add_argument("--max-concurrent-rpcs", type=int, help="overload guard (0: no limit)")
    s.add_argument(
        "--default-lease-ttl",
        type=float,
        metavar="SECONDS",
        help="lease of an instance registered without one",
    )
    s.add_argument(
        "--shutdown-grace",
        type=float,
        metavar="SECONDS",
        help="time calls in flight get to finish on SIGTERM",
    )
    s.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    s.add_argument("--log-format", choices=["text", "json"], help="log line format")
    add_server_tls_args(s)
    s.add_argument(
        "--health-port", type=int, help="plaintext port serving only grpc.health.v1 (0: none)"
    )
    s.add_argument(
        "--print-config", action="store_true", help="print the effective config as JSON and exit"
    )
    show_config_defaults(s, IndexerConfig, cli_overrides)
    return s


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The nested config dict given by the flags of ``indexer serve`` (None = not given)."""
    return {
        "host": args.host,
        "port": args.port,
        "metrics_port": args.metrics_port,
        "backend": args.backend,
        "redis": {
            "url": args.redis_url,
            "prefix": args.redis_prefix,
            "username": args.redis_username,
            "password_file": args.redis_password_file,
        },
        "engine_events": {"endpoints": parse_zmq_endpoints(args.zmq_endpoint)},
        "sglang": {"enabled": args.sglang_api, "model": args.sglang_model},
        "block_size": args.block_size,
        "limits": {
            "max_match_blocks": args.max_match_blocks,
            "max_message_bytes": args.max_message_bytes,
            "max_concurrent_rpcs": args.max_concurrent_rpcs,
        },
        "default_lease_ttl_s": args.default_lease_ttl,
        "shutdown_grace_s": args.shutdown_grace,
        "log_level": args.log_level,
        "log_format": args.log_format,
        "health_port": args.health_port,
        **server_tls_overrides(args),
    }


def parse_zmq_endpoints(specs: list[str] | None) -> list[dict[str, str]] | None:
    """``--zmq-endpoint`` values (``key=value,...``) as endpoint dicts (None when not given)."""
    if not specs:
        return None
    out: list[dict[str, str]] = []
    for spec in specs:
        entry: dict[str, str] = {}
        for part in spec.split(","):
            key, sep, value = part.partition("=")
            if not sep or not key.strip():
                raise ConfigError(f"--zmq-endpoint {spec!r}: {part!r} is not key=value")
            entry[key.strip()] = value.strip()
        out.append(entry)
    return out


def config_from_args(args: argparse.Namespace) -> IndexerConfig:
    """Load the effective config for parsed ``indexer serve`` arguments."""
    return load_config(args.config, cli=cli_overrides(args))


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvmesh indexer serve``; returns the exit code."""
    return run(build_parser().parse_args(list(argv)))


def run(args: argparse.Namespace) -> int:
    """Run ``indexer serve`` with its parsed arguments; return the exit code."""
    try:
        config = config_from_args(args)
    except ConfigError as e:
        print(f"kvmesh indexer serve: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    from indexer.server import run as run_server

    return run_server(config)
