"""``kvmesh cachesim serve`` runs the cache simulator; ``kvmesh cachesim report`` prints its report.

Configuration of ``serve``: flags > ``KVMESH_CACHESIM_…`` > ``--config`` file >
defaults (tee/cachesim/config.py); TLS and policy with ``--tls-cert``, ``--tls-key``,
``--tls-client-ca``, ``--auth-policy`` (or ``KVMESH_CACHESIM_TLS__CERT_FILE`` …).
``report`` reads an ``https://`` URL with ``--ca-file``, ``--cert-file`` /
``--key-file`` (mutual TLS) and ``--token-file`` (bearer token).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Sequence
from typing import Any

from kvmesh.clihelp import HelpFormatter, show_config_defaults
from kvmesh.tls import ClientTLS, TLSFileError, add_server_tls_args, server_tls_overrides
from tee.cachesim.config import CacheSimConfig, ConfigError, load_cachesim_config
from tee.httpsec import ClientSSL


def _serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvmesh cachesim serve", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON config file")
    p.add_argument("--host", help="listen address")
    p.add_argument("--http-port", type=int, help="HTTP port (0 picks one)")
    p.add_argument("--grpc-port", type=int, help="gRPC port (0 picks one)")
    p.add_argument("--block-size", type=int, help="tokens per block")
    p.add_argument(
        "--worker-capacity", type=int, metavar="BLOCKS", help="KV cache blocks of each worker"
    )
    p.add_argument(
        "--pooled-capacity",
        type=int,
        metavar="BLOCKS",
        help="blocks of the global oracle (default: workers seen x worker capacity)",
    )
    p.add_argument("--eviction", choices=["lru", "fifo"], help="eviction policy of each cache")
    p.add_argument("--window", type=float, metavar="SECONDS", help="sliding window of the report")
    p.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")
    add_server_tls_args(p)
    p.add_argument(
        "--health-port", type=int, help="plaintext port serving only grpc.health.v1 (0: none)"
    )
    p.add_argument("--print-config", action="store_true", help="print the config and exit")
    show_config_defaults(p, CacheSimConfig, cli_overrides)
    return p


def cli_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The nested config dict the flags of ``serve`` give (None = not given)."""
    return {
        "host": args.host,
        "http_port": args.http_port,
        "grpc_port": args.grpc_port,
        "block_size": args.block_size,
        "worker_capacity_blocks": args.worker_capacity,
        "pooled_capacity_blocks": args.pooled_capacity,
        "eviction": args.eviction,
        "window_s": args.window,
        "log_level": args.log_level,
        "health_port": args.health_port,
        **server_tls_overrides(args),
    }


def serve(argv: Sequence[str]) -> int:
    """Run ``kvmesh cachesim serve``; return the exit code."""
    args = _serve_parser().parse_args(list(argv))
    try:
        config = load_cachesim_config(args.config, cli=cli_overrides(args))
    except ConfigError as e:
        print(f"kvmesh cachesim serve: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        print(config.model_dump_json(indent=2))
        return 0
    from tee.cachesim.server import run

    return run(config)


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def format_report(models: dict[str, Any]) -> str:
    """The text table of ``GET /report``'s ``models``."""
    lines: list[str] = []
    for model, r in models.items():
        lines.append(
            f"model {model}: {r['workers']} workers, {r['worker_capacity']} blocks each, "
            f"pooled {r['pooled_capacity']}, {r['policy']}"
        )
        lines.append(
            f"  {'span':<10}{'requests':>10}{'blocks':>12}{'hit rate':>10}"
            f"{'pooled':>9}{'infinite':>10}{'worker CV':>11}"
        )
        for span, label in (("total", "total"), ("window", f"last {r['window']['seconds']:g}s")):
            f = r[span]
            lines.append(
                f"  {label:<10}{f['requests']:>10}{f['blocks']:>12}"
                f"{_pct(f['routed']['hit_rate']):>10}{_pct(f['pooled_bound']['hit_rate']):>9}"
                f"{_pct(f['infinite_bound']['hit_rate']):>10}{f['worker_cv']:>11.3f}"
            )
        for worker, s in r["total"]["per_worker"].items():
            lines.append(
                f"    worker {worker:<20}{s['requests']:>8} req {_pct(s['hit_rate']):>8} hit"
            )
    return "\n".join(lines) if lines else "no events yet"


def report(argv: Sequence[str]) -> int:
    """Run ``kvmesh cachesim report``: fetch ``/report`` and print it; return the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh cachesim report", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--url", default="http://127.0.0.1:8470", help="simulator HTTP base URL")
    p.add_argument("--model", default="", help="only this model (default: every model)")
    p.add_argument("--json", action="store_true", help="print the raw JSON")
    p.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="HTTP request timeout"
    )
    p.add_argument("--ca-file", help="CA that signs the simulator's certificate (https)")
    p.add_argument("--cert-file", help="client certificate for mutual TLS")
    p.add_argument("--key-file", help="key of --cert-file")
    p.add_argument("--token-file", help="file holding a bearer token (https only)")
    args = p.parse_args(list(argv))
    url = args.url.rstrip("/") + "/report"
    if args.model:
        url += "?" + urllib.parse.urlencode({"model": args.model})
    request = urllib.request.Request(url)
    context = None
    try:
        tls = ClientTLS(
            ca_file=args.ca_file or "",
            cert_file=args.cert_file or "",
            key_file=args.key_file or "",
            token_file=args.token_file or "",
        )
        if tls.active:
            if not url.startswith("https://"):
                raise TLSFileError("TLS or token options need an https:// --url")
            client = ClientSSL(tls, what="kvmesh cachesim report")
            context = client.context
            if client.token:
                request.add_header("Authorization", f"Bearer {client.token}")
    except (ValueError, TLSFileError) as e:
        print(f"kvmesh cachesim report: {e}", file=sys.stderr)
        return 2
    try:
        with urllib.request.urlopen(request, timeout=args.timeout, context=context) as resp:
            data = json.load(resp)
    except urllib.error.HTTPError as e:
        print(f"kvmesh cachesim report: {url}: HTTP {e.code} {e.read().decode()}", file=sys.stderr)
        return 1
    except (urllib.error.URLError, OSError, ValueError) as e:
        print(f"kvmesh cachesim report: {url}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(data, indent=2) if args.json else format_report(data["models"]))
    return 0
