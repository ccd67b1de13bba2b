"""``kvmesh bridge``: forward one engine's KV events to the indexer Service (``main(argv)``).

Flags override environment variables (``KVMESH_BRIDGE_…``), which override the
``--config`` file, which overrides the defaults (indexer/bridge/config.py).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from indexer.bridge.config import BridgeConfig, load_config
from indexer.cli import parse_zmq_endpoints
from kvmesh.configfile import ConfigError


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh bridge``."""
    p = argparse.ArgumentParser(
        prog="kvmesh bridge",
        description="Run beside an engine: subscribe to its KV-event sockets (vLLM or SGLang "
        "ZMQ publisher) and publish the events to the indexer Service over gRPC, any replica, "
        "with the engine's own registration, heartbeats, replay after gaps, and reconnects. "
        "Flags override KVMESH_BRIDGE_* variables, which override --config; see "
        "indexer/bridge/config.py for every setting.",
    )
    p.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON config file")
    p.add_argument(
        "--indexer",
        metavar="TARGET",
        help="gRPC target of the indexer: host:port, dns:///headless-service:port, or "
        "addr1:port,addr2:port (default 127.0.0.1:50051)",
    )
    p.add_argument(
        "--load-balancing",
        choices=["round_robin", "pick_first"],
        help="how streams are placed on the target's addresses (default round_robin)",
    )
    p.add_argument(
        "--zmq-endpoint",
        action="append",
        metavar="SPEC",
        help="an engine stream to forward (repeatable, one per data-parallel rank; replaces "
        "engine_events.endpoints): comma-separated key=value pairs, e.g. worker_id=vllm-0,"
        "model=M,endpoint=tcp://127.0.0.1:5557,replay_endpoint=tcp://127.0.0.1:5558,"
        "address=http://10.0.0.5:8000 (also dp_rank, bind, topic, keys, lease_ttl_s)",
    )
    p.add_argument(
        "--on-unrecoverable-gap",
        choices=["reset", "stale"],
        help="what a loss replay cannot fill does to the instance (default reset)",
    )
    p.add_argument("--incarnation-prefix", help="prefix of this engine's incarnations (pod UID)")
    p.add_argument(
        "--buffer-max-batches", type=int, help="engine batches held while the indexer is slow"
    )
    p.add_argument("--host", help="address of the metrics and health ports (default 127.0.0.1)")
    p.add_argument("--metrics-port", type=int, help="Prometheus port (default 9466; 0: none)")
    p.add_argument("--health-port", type=int, help="grpc.health.v1 port (default 0: none)")
    p.add_argument("--tls-ca", metavar="FILE", help="CA bundle of the indexer's certificate")
    p.add_argument("--tls-cert", metavar="FILE", help="client certificate (mutual TLS)")
    p.add_argument("--tls-key", metavar="FILE", help="private key of --tls-cert")
    p.add_argument(
        "--tls-server-name", metavar="NAME", help="name the indexer's certificate is checked for"
    )
    p.add_argument(
        "--token-file", metavar="FILE", help="bearer token sent to the indexer (needs TLS)"
    )
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--log-format", choices=["text", "json"])
    p.add_argument(
        "--print-config", action="store_true", help="print the effective config as JSON and exit"
    )
    return p


def cli_overrides(ns: argparse.Namespace) -> dict[str, Any]:
    """The nested config dict given by the flags (``None`` = not given)."""
    return {
        "indexer": {
            "target": ns.indexer,
            "load_balancing": ns.load_balancing,
            "tls": {
                "ca_file": ns.tls_ca,
                "cert_file": ns.tls_cert,
                "key_file": ns.tls_key,
                "server_name": ns.tls_server_name,
                "token_file": ns.token_file,
            },
        },
        "engine_events": {
            "endpoints": parse_zmq_endpoints(ns.zmq_endpoint),
            "on_unrecoverable_gap": ns.on_unrecoverable_gap,
        },
        "buffer": {"max_batches": ns.buffer_max_batches},
        "incarnation_prefix": ns.incarnation_prefix,
        "host": ns.host,
        "metrics_port": ns.metrics_port,
        "health_port": ns.health_port,
        "log_level": ns.log_level,
        "log_format": ns.log_format,
    }


def config_from_args(ns: argparse.Namespace) -> BridgeConfig:
    """The effective config of parsed ``kvmesh bridge`` arguments."""
    return load_config(ns.config, cli=cli_overrides(ns))


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvmesh bridge``; returns the exit code."""
    ns = build_parser().parse_args(list(argv))
    try:
        config = config_from_args(ns)
    except ConfigError as e:
        print(f"kvmesh bridge: {e}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    from indexer.bridge.service import run

    return run(config)
