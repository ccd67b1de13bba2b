"""``kvmesh bench indexer``: ingest, Match latency and throughput, for both backends.

The index is built from the bundled Mooncake conversation trace, spread over
64 instances (sticky per conversation, see :mod:`lab.workload`), through
the streaming publish call. For each backend (memory; redis on a private
``redis-server`` started by :class:`lab.redisproc.RedisProcess`) an indexer
server runs in a child process (:class:`lab.bench.indexer_common.ServerChild`),
so the server has a core of its own and the client's Python work does not
share its interpreter, as in a deployment.

Prompts: 32-block prompts are the first 32 keys of trace requests with at
least 32 blocks (2,859 of them; each chain is held whole by the instance that
served it, and block 0 by every instance, so a Match walks 32 blocks and
returns up to 64 instances). The trace's longest request has 247 blocks, so
256-block prompts are its longest requests extended with keys nobody holds:
the walk covers every held block and stops at the first unknown one.

With ``--cluster`` the redis backend also runs against a private 3-master
Redis Cluster (:class:`lab.redisproc.RedisClusterProcess`): ``cluster_*``
figures, with round trips counted over every master and the largest master's
share of all keys after the build.

"Match during ingest" (memory backend; ``--no-zmq`` skips it, ``--zmq-only``
runs only it): ``zmq_publishers`` real engine publishers (ZMQ PUB plus ROUTER
replay, vLLM's msgpack wire) in a child process stream the trace at full speed
into an indexer child subscribed to every one of them, six times over, the
rounds alternately alone (``memory_zmq_ingest_blocks_per_s``, the three
pooled) and while a client sends a Match and a Ping every 10 ms and a health
check every 50 ms, each on time whether or not the last was answered
(``memory_ingest_during_probe_blocks_per_s``,
``memory_match_during_ingest_p50_ms`` / ``_p99_ms``,
``memory_health_during_ingest_p99_ms``): what a router and a kubelet see while
engines flood the replica.

``--matchstream`` runs instead :mod:`lab.bench.matchstream`: Matches per
server CPU-second over one MatchStream against unary Match.

Every latency figure has its floor measured in the same run: ``Ping`` on the
same server, which does no work. Figures are printed as one table with
targets, and written with ``--json FILE`` as ``{"figures": ..., "params": ...}``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Sequence
from typing import Any

import redis
from redis.crc import key_slot

from indexer.redis.keys import anchor_tag
from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from lab.bench import floor as bench_floor
from lab.bench import matchstream as bench_matchstream
from lab.bench import tls as bench_tls
from lab.bench.indexer_common import (
    DEFAULT_PARAMS,
    QUICK_PARAMS,
    BenchParams,
    Workload,
    bench_backend,
    bench_zmq_ingest,
    inproc_match_p50,
)
from lab.bench.report import fmt, table, write_report
from lab.redisproc import RedisClusterProcess, RedisProcess
from lab.traces import TraceRequest, trace_block_key

# -- report -----------------------------------------------------------------------

#: (row label, memory figure, redis figure, unit, target text, check(memory, redis)).
_Row = tuple[str, str | None, str | None, str, str]

_ROWS: tuple[_Row, ...] = (
    ("ingest, stream publish", "memory_ingest_blocks_per_s", "redis_ingest_blocks_per_s",
     "blocks/s", "mem >= 200k, redis >= 100k"),
    ("Match p50, 32 blocks", "memory_grpc_match_p50_us", "redis_grpc_match_p50_us",
     "µs", "mem <= 1.2x empty rpc, redis <= 1000"),
    ("Match p99, 32 blocks", "memory_grpc_match_p99_us", "redis_grpc_match_p99_us",
     "µs", "redis <= 3000"),
    ("Match p50, 256 blocks", "memory_grpc_match_256_p50_us", "redis_grpc_match_256_p50_us",
     "µs", ""),
    ("Match p99, 256 blocks", "memory_grpc_match_256_p99_us", "redis_grpc_match_256_p99_us",
     "µs", ""),
    ("empty rpc (Ping) p50", "memory_grpc_empty_rpc_p50_us", "redis_grpc_empty_rpc_p50_us",
     "µs", "the floor"),
    ("Match p50 / empty rpc p50", "memory_match_over_empty_rpc", "redis_match_over_empty_rpc",
     "x", "mem <= 1.2"),
    ("Matches/s, concurrent", "memory_grpc_matches_per_s", "redis_grpc_matches_per_s",
     "1/s", ""),
    ("Match p50, in-process", "memory_inproc_match_p50_us", None, "µs", ""),
    ("Redis round trips / Match", None, "redis_roundtrips_per_match", "", "== 1"),
    ("Redis commands / Match", None, "redis_commands_per_match", "", "incl. inside the script"),
    ("Redis bytes / (block, inst)", None, "redis_bytes_per_block_instance", "B", ""),
    ("ingest, ZMQ engines", "memory_zmq_ingest_blocks_per_s", None, "blocks/s", ""),
    ("  same, while probed", "memory_ingest_during_probe_blocks_per_s", None, "blocks/s",
     ">= 0.9x unprobed"),
    ("  server CPU per block", "memory_zmq_ingest_server_cpu_us_per_block", None, "µs", ""),
    ("  same, probed rounds", "memory_ingest_during_probe_server_cpu_us_per_block", None, "µs",
     ""),
    ("    less the probes' own", "memory_ingest_during_probe_net_cpu_us_per_block", None, "µs",
     ""),
    ("  probes alone: server CPU", "memory_probe_server_cpu_share", None, "share", ""),
    ("Match p50 during ZMQ ingest", "memory_match_during_ingest_p50_ms", None, "ms", ""),
    ("Match p99 during ZMQ ingest", "memory_match_during_ingest_p99_ms", None, "ms", "<= 50"),
    ("health p99 during ZMQ ingest", "memory_health_during_ingest_p99_ms", None, "ms",
     "<= 50"),
)  # fmt: skip


class ClusterClient:
    """The few calls the benchmark makes on Redis, summed over a cluster's masters."""

    def __init__(self, ports: Sequence[int]) -> None:
        self._nodes = [redis.Redis(host="127.0.0.1", port=p) for p in ports]

    def info(self, section: str) -> dict[str, Any]:
        """``INFO section`` of every master, numbers summed field by field."""
        out: dict[str, Any] = {}
        for node in self._nodes:
            for k, v in node.info(section).items():
                if k == "cmdstat_info":
                    continue  # our own INFO calls, one per master, are no Match's
                if isinstance(v, dict):
                    acc = out.setdefault(k, {})
                    for f, x in v.items():
                        if isinstance(x, (int, float)):
                            acc[f] = acc.get(f, 0) + x
                elif isinstance(v, (int, float)):
                    out[k] = out.get(k, 0) + v
        return out

    def config_set(self, name: str, value: Any) -> None:
        """``CONFIG SET`` on every master."""
        for node in self._nodes:
            node.config_set(name, value)

    def slowlog_reset(self) -> None:
        """``SLOWLOG RESET`` on every master."""
        for node in self._nodes:
            node.slowlog_reset()

    def slowlog_get(self, n: int) -> list[dict[str, Any]]:
        """Every master's ``SLOWLOG GET n``, one list (each master runs its own
        scripts: a long one holds that master's callers only)."""
        return [e for node in self._nodes for e in node.slowlog_get(n)]

    def key_share_max(self) -> float:
        """Largest master's share of all keys (DBSIZE)."""
        sizes = [int(node.dbsize()) for node in self._nodes]
        return max(sizes) / max(1, sum(sizes))

    def memory_share_max(self) -> float:
        """Largest master's share of the memory Redis uses (``used_memory``)."""
        used = [int(node.info("memory")["used_memory"]) for node in self._nodes]
        return max(used) / max(1, sum(used))

    def close(self) -> None:
        """Close every connection."""
        for node in self._nodes:
            node.close()


def root_tag_share_max(trace: Sequence[TraceRequest], masters: int = 3) -> float:
    """Largest master's share of block keys if chains were tagged by their root
    block (anchor depth 0), with slots split evenly as ``--cluster create`` does."""
    counts = [0] * masters
    for key in {
        trace_block_key(h): trace_block_key(r.hash_ids[0]) for r in trace for h in r.hash_ids
    }.items():
        counts[key_slot(b"{" + anchor_tag(key[1]) + b"}") * masters // 16384] += 1
    return max(counts) / max(1, sum(counts))


def format_cluster(f: dict[str, float]) -> str:
    """The Redis Cluster rows of a ``--cluster`` run."""
    rows = (
        ("Match p50, 32 blocks", "cluster_grpc_match_p50_us", "µs", "", True),
        ("Match p99, 32 blocks", "cluster_grpc_match_p99_us", "µs", "", True),
        ("Matches/s, concurrent", "cluster_grpc_matches_per_s", "1/s", "", True),
        ("ingest, stream publish", "cluster_ingest_blocks_per_s", "blocks/s", "", True),
        ("round trips / Match", "cluster_roundtrips_per_match", "", "== 1",
         f.get("cluster_roundtrips_per_match") == 1.0),
        ("largest shard's key share", "cluster_shard_key_share_max", "", "<= 0.5 (3 shards)",
         f.get("cluster_shard_key_share_max", 1.0) <= 0.5),
        ("  same, root-block tags", "cluster_shard_key_share_root_tag", "", "for comparison", True),
        ("bytes / (block, inst)", "cluster_bytes_per_block_instance", "B", "", True),
    )  # fmt: skip
    head = f"{'redis cluster, 3 masters':<28} {'value':>11} {'unit':<9} {'target':<20} {'':<5}"
    lines = []
    for label, name, unit, target, ok in rows:
        verdict = ("pass" if ok else "SHORT") if target and target[0] in "=<" else ""
        lines.append(f"{label:<28} {fmt(f.get(name)):>11} {unit:<9} {target:<20} {verdict:<5}")
    return table(head, lines)


def _checks(f: dict[str, float]) -> dict[str, list[bool]]:
    """Per row label, whether each target holds (a row without a target has none)."""
    out: dict[str, list[bool]] = {}

    def add(label: str, ok: bool) -> None:
        out.setdefault(label, []).append(ok)

    if "memory_ingest_blocks_per_s" in f:
        add("ingest, stream publish", f["memory_ingest_blocks_per_s"] >= 200_000)
        add("Match p50 / empty rpc p50", f["memory_match_over_empty_rpc"] <= 1.2)
        add("Match p50, 32 blocks", f["memory_match_over_empty_rpc"] <= 1.2)
    if "memory_ingest_during_probe_blocks_per_s" in f:
        add(
            "  same, while probed",
            f["memory_ingest_during_probe_blocks_per_s"]
            >= 0.9 * f["memory_zmq_ingest_blocks_per_s"],
        )
        add("Match p99 during ZMQ ingest", f["memory_match_during_ingest_p99_ms"] <= 50)
        add("health p99 during ZMQ ingest", f["memory_health_during_ingest_p99_ms"] <= 50)
    if "redis_ingest_blocks_per_s" in f:
        add("ingest, stream publish", f["redis_ingest_blocks_per_s"] >= 100_000)
        add("Match p50, 32 blocks", f["redis_grpc_match_p50_us"] <= 1000)
        add("Match p99, 32 blocks", f["redis_grpc_match_p99_us"] <= 3000)
        add("Redis round trips / Match", f["redis_roundtrips_per_match"] == 1.0)
    return out


def format_table(figures: dict[str, float]) -> str:
    """The one table of a run: both backends side by side, targets and verdicts."""
    checks = _checks(figures)
    head = f"{'figure':<28} {'memory':>11} {'redis':>11} {'unit':<9} {'target':<38} {'':<5}"
    lines = []
    for label, mem, red, unit, target in _ROWS:
        mv = figures.get(mem) if mem else None
        rv = figures.get(red) if red else None
        verdict = ""
        if label in checks:
            verdict = "pass" if all(checks[label]) else "SHORT"
        lines.append(f"{label:<28} {fmt(mv):>11} {fmt(rv):>11} {unit:<9} {target:<38} {verdict:<5}")
    return table(head, lines)


# -- entry point ------------------------------------------------------------------


def run_bench(
    params: BenchParams, backends: Sequence[str], cluster: bool = False, zmq: bool = True
) -> tuple[dict[str, float], dict[str, Any]]:
    """Run the benchmark; return ``(figures, params)`` as written to JSON.

    ``zmq``: with the memory backend, also the "Match during ingest" figures
    (:func:`lab.bench.indexer_common.bench_zmq_ingest`); with no backends, only those.
    """
    work = Workload.load(params)
    trace, plan, prompts32, prompts256 = work.trace, work.plan, work.prompts32, work.prompts256
    figures: dict[str, float] = {}
    extra: dict[str, Any] = {}
    if zmq and not backends:
        bench_zmq_ingest(trace, prompts32, params, figures, extra)
    if "memory" in backends:
        progress.phase("memory: in-process Match")
        figures["memory_inproc_match_p50_us"] = inproc_match_p50(
            plan, prompts32, params.inproc_calls
        )
        bench_backend("memory", plan, prompts32, prompts256, params, figures, extra)
        figures["grpc_empty_rpc_p50_us"] = figures["memory_grpc_empty_rpc_p50_us"]
        if zmq:
            bench_zmq_ingest(trace, prompts32, params, figures, extra)
    if "redis" in backends:
        with RedisProcess() as rp:
            client = redis.Redis.from_url(rp.url)
            try:
                bench_backend(
                    "redis", plan, prompts32, prompts256, params, figures, extra, rp.url, client
                )
            finally:
                client.close()
        figures.setdefault("grpc_empty_rpc_p50_us", figures["redis_grpc_empty_rpc_p50_us"])
    if cluster:
        with RedisClusterProcess() as rc:
            cc = ClusterClient(rc.ports)
            try:
                bench_backend(
                    "cluster", plan, prompts32, prompts256, params, figures, extra, rc.url, cc
                )
            finally:
                cc.close()
        figures["cluster_shard_key_share_root_tag"] = root_tag_share_max(trace)
        extra["cluster"] = "3 masters, no replicas, anchor depth 1 (RedisSettings default)"
    run_params = {**work.describe(params), "roundtrip_calls": params.roundtrip_calls, **extra}
    return figures, run_params


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench indexer``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench indexer",
        description="Indexer benchmark on the Mooncake conversation trace, memory and redis. "
        "--floor, --tls and --matchstream run another benchmark instead: with one of them, "
        "--help shows that benchmark's options.",
        formatter_class=HelpFormatter,
        add_help=False,  # --help with a mode flag is the mode's
    )
    p.add_argument("-h", "--help", action="store_true", help="show this help message and exit")
    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    p.add_argument("--requests", type=int, help="trace requests to publish (default: all)")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures")
    p.add_argument(
        "--backend",
        choices=("memory", "redis", "both"),
        default="both",
        help="index backends to measure",
    )
    p.add_argument(
        "--cluster", action="store_true", help="also run redis against a local 3-master cluster"
    )
    p.add_argument("--no-zmq", action="store_true", help="skip the Match-during-ZMQ-ingest figures")
    p.add_argument(
        "--zmq-only",
        action="store_true",
        help="only the Match-during-ZMQ-ingest figures (memory backend)",
    )
    p.add_argument(
        "--floor", action="store_true", help="instead: the empty-RPC floor under gRPC variants"
    )
    p.add_argument(
        "--tls", action="store_true", help="instead: plaintext vs mTLS vs mTLS + client limits"
    )
    p.add_argument(
        "--matchstream",
        action="store_true",
        help="instead: Matches per server CPU-second, one MatchStream vs unary Match",
    )
    args, rest = p.parse_known_args(argv)
    if args.help:
        if args.floor or args.matchstream or args.tls:
            rest.append("--help")
        else:
            p.print_help()
            p.exit()
    if args.floor:
        return bench_floor.main(rest + (["--json", args.json_path] if args.json_path else []))
    if args.matchstream:
        flags = (["--quick"] if args.quick else []) + (
            ["--requests", str(args.requests)] if args.requests is not None else []
        )
        return bench_matchstream.main(
            rest + flags + (["--json", args.json_path] if args.json_path else [])
        )
    if args.tls:
        flags = (["--quick"] if args.quick else []) + (
            ["--requests", str(args.requests)] if args.requests is not None else []
        )
        return bench_tls.main(rest + flags + (["--json", args.json_path] if args.json_path else []))
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    params = QUICK_PARAMS if args.quick else DEFAULT_PARAMS
    if args.requests is not None:
        if args.requests < 1:
            p.error("--requests must be >= 1")
        params = BenchParams(**{**_asdict(params), "requests": args.requests})
    backends: tuple[str, ...] = ("memory", "redis") if args.backend == "both" else (args.backend,)
    if args.zmq_only:
        backends = ()
    t0 = time.perf_counter()
    figures, run_params = run_bench(params, backends, args.cluster, not args.no_zmq)
    bad = [k for k, v in figures.items() if not math.isfinite(v)]
    print(
        f"kvmesh bench indexer: {run_params['requests']:,} requests, "
        f"{run_params['blocks_published']:,} blocks over {params.instances} instances, "
        f"{os.cpu_count()} cpus, {time.perf_counter() - t0:.0f} s"
    )
    print(format_table(figures))
    if args.cluster:
        print(format_cluster(figures))
    if args.json_path:
        write_report(args.json_path, figures, run_params)
    return 1 if bad else 0


def _asdict(params: BenchParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in BenchParams.__slots__}


if __name__ == "__main__":
    raise SystemExit(main())
