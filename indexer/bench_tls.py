"""``kvmesh bench indexer --tls``: what transport security and the guard cost the indexer.

One run, the memory backend, the same trace requests and prompts, three server
modes, each an indexer in a child process of its own
(:class:`indexer.bench.ServerChild`):

- ``plaintext``, the baseline: no TLS, authorization off (the local-development
  default);
- ``mtls``: mutual TLS with ECDSA P-256 certificates from
  :mod:`kvmesh.devcerts` and a policy file (an engine identity publishes for
  every instance, a router identity reads), per-client limits at their
  defaults;
- ``mtls+limits``: as ``mtls``, with per-client Match and publish rates far
  above what a replica serves, so they never refuse but the token buckets run
  on every call.

Per mode, the figures of :func:`indexer.bench.bench_backend` (streamed ingest,
Ping and 32-block Match latency, concurrent Matches/s and the server's CPU time
per Match during them), published with the engine's certificate and read with
the router's, plus the cost of a new connection: the first Ping of a fresh
channel (TCP connect, the TLS handshake when there is one, HTTP/2 set-up and
the call), each channel with a connection of its own. Modes run in order, then
in reverse order in the next round, and each figure is the median over rounds,
so that slow drift on a shared machine weighs on every mode alike. The table
gives each figure per mode and its ratio to plaintext; ``--json FILE`` writes
``{"figures", "ratios", "rounds", "params"}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from indexer.bench import (
    DEFAULT_PARAMS,
    QUICK_PARAMS,
    BenchParams,
    Workload,
    bench_backend,
)
from indexer.bench import _fmt as fmt
from indexer.workload import percentile
from kvmesh.devcerts import Authority, write_bundle
from kvmesh.indexer.v1 import indexer_pb2 as pb
from kvmesh.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.tls import ChannelFactory, ClientTLS


@dataclass(frozen=True, slots=True)
class Mode:
    """One server configuration to measure."""

    key: str  # figure prefix
    label: str  # column title
    mutual_tls: bool
    rates: bool  # per-client match_rps / publish_rps set


MODES: tuple[Mode, ...] = (
    Mode("plaintext", "plaintext", mutual_tls=False, rates=False),
    Mode("mtls", "mtls", mutual_tls=True, rates=False),
    Mode("mtls_limits", "mtls+limits", mutual_tls=True, rates=True),
)
BASELINE = MODES[0]

#: Per-client rate of the ``mtls+limits`` mode: a million calls (batches) a
#: second is far above what one replica serves, so no call is refused, yet
#: every call refills and takes from its client's bucket.
NEVER_REFUSING_RPS = 1_000_000.0

#: New connections timed per mode and round: a handshake costs a few ms, so 50
#: take well under a second and give a stable p50.
CONNECTIONS = 50
QUICK_CONNECTIONS = 10

ENGINE_SAN = "spiffe://kvmesh/engine/bench"
ROUTER_SAN = "spiffe://kvmesh/router/bench"
IDENTITIES = {
    "server": ["localhost", "127.0.0.1"],
    "engine": [ENGINE_SAN],
    "router": [ROUTER_SAN],
}
POLICY = {
    "identities": [
        {"name": "bench-engine", "roles": ["engine"], "san": [ENGINE_SAN], "instances": ["*"]},
        {"name": "bench-router", "roles": ["router"], "san": [ROUTER_SAN]},
    ]
}

#: (row label, figure suffix, unit) of the table, in order.
ROWS: tuple[tuple[str, str, str], ...] = (
    ("Ping p50", "grpc_empty_rpc_p50_us", "µs"),
    ("Ping p99", "grpc_empty_rpc_p99_us", "µs"),
    ("Match p50, 32 blocks", "grpc_match_p50_us", "µs"),
    ("Match p99, 32 blocks", "grpc_match_p99_us", "µs"),
    ("Matches/s, concurrent", "grpc_matches_per_s", "1/s"),
    ("server CPU / Match, concurrent", "server_cpu_us_per_match", "µs"),
    ("ingest, stream publish", "ingest_blocks_per_s", "blocks/s"),
    ("new connection + Ping p50", "new_connection_p50_us", "µs"),
    ("new connection + Ping p99", "new_connection_p99_us", "µs"),
)


@dataclass(frozen=True, slots=True)
class Credentials:
    """The files of one run: server TLS and policy, the engine's and router's client TLS."""

    server_tls: dict[str, str]
    policy_file: str
    engine: ClientTLS
    router: ClientTLS

    @classmethod
    def write(cls, folder: Path) -> Credentials:
        """A fresh CA, the three identities and the policy under ``folder``."""
        paths = write_bundle(folder, IDENTITIES, authority=Authority("kvmesh bench CA"))
        policy = folder / "policy.json"
        policy.write_text(json.dumps(POLICY), encoding="utf-8")
        ca = str(paths["ca"])

        def client(name: str) -> ClientTLS:
            return ClientTLS(
                ca_file=ca, cert_file=str(paths[name]), key_file=str(paths[f"{name}_key"])
            )

        return cls(
            server_tls={
                "cert_file": str(paths["server"]),
                "key_file": str(paths["server_key"]),
                "client_ca_file": ca,
            },
            policy_file=str(policy),
            engine=client("engine"),
            router=client("router"),
        )

    def server(self, mode: Mode) -> dict[str, Any]:
        """Server config overrides of ``mode`` (none for plaintext)."""
        if not mode.mutual_tls:
            return {}
        out: dict[str, Any] = {"tls": self.server_tls, "auth": {"policy_file": self.policy_file}}
        if mode.rates:
            out["limits"] = {
                "per_client": {"match_rps": NEVER_REFUSING_RPS, "publish_rps": NEVER_REFUSING_RPS}
            }
        return out


def connect_latency(target: str, tls: ClientTLS | None, connections: int) -> list[float]:
    """µs from a fresh channel's first Ping to its answer, for ``connections`` channels.

    That is TCP connect, the TLS handshake (if any), HTTP/2 set-up and one
    call. Each channel has a subchannel pool of its own, so it never reuses
    a connection another channel opened (grpc's global pool may share them);
    credentials are built before the clock starts. The first few connections
    warm up and are not counted.
    """
    factory = ChannelFactory(
        target, tls, options=[("grpc.use_local_subchannel_pool", 1)], what="bench"
    )
    ping = pb.PingRequest()
    clock = time.perf_counter_ns
    out: list[float] = []
    warmup = min(5, max(1, connections // 10))
    for i in range(warmup + connections):
        with factory.sync_channel() as channel:
            stub = pb_grpc.IndexerServiceStub(channel)
            t0 = clock()
            stub.Ping(ping, timeout=30)
            if i >= warmup:
                out.append((clock() - t0) / 1000)
    return out


def connection_figures(tls: ClientTLS | None, connections: int, target: str) -> dict[str, float]:
    """p50 and p99 of :func:`connect_latency` (a ``probe`` of :func:`bench_backend`)."""
    lat = connect_latency(target, tls, connections)
    return {
        "new_connection_p50_us": percentile(lat, 0.5),
        "new_connection_p99_us": percentile(lat, 0.99),
    }


def run_modes(
    params: BenchParams, connections: int, rounds: int, modes: Sequence[Mode] = MODES
) -> tuple[dict[str, float], list[dict[str, float]], dict[str, Any]]:
    """Measure every mode ``rounds`` times; return (median figures, per round, params)."""
    work = Workload.load(params)
    per_round: list[dict[str, float]] = []
    extra: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-tls-") as tmp:
        creds = Credentials.write(Path(tmp))
        for r in range(rounds):
            figures: dict[str, float] = {}
            for mode in modes if r % 2 == 0 else tuple(reversed(modes)):
                client = (creds.engine, creds.router) if mode.mutual_tls else (None, None)
                bench_backend(
                    "memory",
                    work.plan,
                    work.prompts32,
                    work.prompts256,
                    params,
                    figures,
                    extra,
                    label=mode.key,
                    server=creds.server(mode),
                    engine_tls=client[0],
                    router_tls=client[1],
                    probe=functools.partial(connection_figures, client[1], connections),
                )
            per_round.append(figures)
    merged = {k: statistics.median(r[k] for r in per_round) for k in per_round[0]}
    run_params = {
        **work.describe(params),
        "modes": {m.key: m.label for m in modes},
        "backend": "memory",
        "rounds": rounds,
        "order": "modes in order, reversed every other round; figures are medians over rounds",
        "connections": connections,
        "connection_client": "grpc blocking stub, a fresh channel (own subchannel pool) per "
        "connection, first Ping timed",
        "certificates": "ECDSA P-256 leaf certificates and CA from kvmesh.devcerts",
        "mtls_limits_rps": NEVER_REFUSING_RPS,
        **extra,
    }
    return merged, per_round, run_params


def ratios(figures: dict[str, float], modes: Sequence[Mode] = MODES) -> dict[str, dict[str, float]]:
    """Each mode's table figures over the plaintext ones (suffix -> ratio), per mode key."""
    out: dict[str, dict[str, float]] = {}
    for mode in modes:
        out[mode.key] = {
            suffix: figures[f"{mode.key}_{suffix}"] / figures[f"{BASELINE.key}_{suffix}"]
            for _, suffix, _ in ROWS
            if f"{mode.key}_{suffix}" in figures and f"{BASELINE.key}_{suffix}" in figures
        }
    return out


def format_table(figures: dict[str, float], modes: Sequence[Mode] = MODES) -> str:
    """Figures per mode, each mode but plaintext followed by its ratio to plaintext."""
    rel = ratios(figures, modes)
    head = f"{'figure':<31} {'unit':<8}"
    for m in modes:
        head += f" {m.label:>11}"
        if m is not BASELINE:
            head += f" {'ratio':>6}"
    lines = [head, "-" * len(head)]
    for label, suffix, unit in ROWS:
        line = f"{label:<31} {unit:<8}"
        for m in modes:
            line += f" {fmt(figures.get(f'{m.key}_{suffix}')):>11}"
            if m is not BASELINE:
                r = rel[m.key].get(suffix)
                line += f" {'-' if r is None else f'{r:.3f}':>6}"
        lines.append(line)
    lines.append(
        f"ratio: the mode's figure / {BASELINE.label}'s (for 1/s and blocks/s, < 1 is slower)"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench indexer --tls``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench indexer --tls",
        description="What mutual TLS, authorization and per-client limits cost the indexer: "
        "plaintext vs mtls vs mtls+limits, memory backend, one run.",
    )
    p.add_argument("--json", dest="json_path", help="also write figures, ratios and params here")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures")
    p.add_argument("--requests", type=int, help="trace requests to publish (default: all)")
    p.add_argument("--rounds", type=int, help="times every mode is measured (default 2; --quick 1)")
    p.add_argument(
        "--connections", type=int, help=f"new connections timed per mode (default {CONNECTIONS})"
    )
    args = p.parse_args(argv)
    params = QUICK_PARAMS if args.quick else DEFAULT_PARAMS
    if args.requests is not None:
        if args.requests < 1:
            p.error("--requests must be >= 1")
        params = dataclasses.replace(params, requests=args.requests)
    rounds = args.rounds if args.rounds is not None else 1 if args.quick else 2
    connections = args.connections
    if connections is None:
        connections = QUICK_CONNECTIONS if args.quick else CONNECTIONS
    if rounds < 1 or connections < 1:
        p.error("--rounds and --connections must be >= 1")
    t0 = time.perf_counter()
    figures, per_round, run_params = run_modes(params, connections, rounds)
    rel = ratios(figures)
    bad = [k for k, v in figures.items() if not math.isfinite(v) or v <= 0]
    print(
        f"kvmesh bench indexer --tls: {run_params['requests']:,} requests, "
        f"{run_params['blocks_published']:,} blocks over {params.instances} instances, memory "
        f"backend, {rounds} round(s), {run_params['cpus']} cpus, {time.perf_counter() - t0:.0f} s"
    )
    print(format_table(figures))
    if bad:
        print(f"not finite or not positive: {', '.join(sorted(bad))}")
    if args.json_path:
        doc = {"figures": figures, "ratios": rel, "rounds": per_round, "params": run_params}
        with open(args.json_path, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=2, sort_keys=True)
            fh.write("\n")
    return 1 if bad else 0
