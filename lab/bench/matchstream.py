"""``kvmesh bench indexer --matchstream``: Matches per server CPU-second, stream vs unary.

An indexer server (memory backend) runs in a child process
(:class:`lab.bench.indexer_common.ServerChild`) holding the Mooncake trace's
blocks over 64 instances, as ``kvmesh bench indexer`` builds it. This process
then drives the same Matches (32-block prompts by keys, see
:mod:`lab.bench.indexer`) through :class:`router_client.IndexerClient`, the
router's own client, ``concurrency`` of them in flight at once, in two modes:

- ``unary``: ``match_stream`` off, one Match RPC per Match;
- ``stream``: the default, every Match on the client's one MatchStream, which
  carries the Matches issued together in one message and the replies ready
  together in one message (``stream_matches_per_request_message`` and
  ``stream_replies_per_response_message`` say how many, on average).

Each round runs ``matches`` Matches per mode (the modes alternate round by
round, each on a fresh client, after a warm-up, so both see the same machine
state); the figure of a mode is the median over rounds of Matches per
CPU-second of the server process (user + system, every thread, from
``/proc/<pid>/stat``), beside wall-clock Matches/s and this client's own CPU
per Match. The ratio ``stream_over_unary_matches_per_server_cpu_s`` is what
one long-lived stream saves the indexer per Match.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc.aio

from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from kvmesh.runtime import new_event_loop
from lab.bench.indexer_common import QUICK_PARAMS, BenchParams, ServerChild, Workload, _build
from lab.bench.report import fmt, table, write_report
from lab.workload import TRACE_MODEL
from router_client import IndexerClient, IndexerClientSettings, MatchStatus

MODES = ("unary", "stream")

#: The target of the ratio (stream over unary, Matches per server CPU-second).
TARGET_RATIO = 3.0


@dataclass(frozen=True, slots=True)
class MatchStreamParams:
    """Sizes of one run."""

    requests: int | None = 3000  # trace requests published (None: all)
    matches: int = 20_000  # timed Matches per mode and round
    concurrency: int = 64  # Matches in flight (the client's max_in_flight)
    rounds: int = 3
    warmup: int = 2000


#: A smoke run for the tests: seconds, not figures.
QUICK = MatchStreamParams(requests=300, matches=600, concurrency=16, rounds=1, warmup=100)


@dataclass(slots=True)
class ModeRound:
    """One mode's figures in one round."""

    mode: str
    matches: int
    wall_s: float
    server_cpu_s: float
    client_cpu_s: float
    ok: int
    messages_sent: int  # MatchStream messages each way (0: unary)
    messages_received: int

    @property
    def per_server_cpu_s(self) -> float:
        """Matches per server CPU-second."""
        return self.matches / self.server_cpu_s if self.server_cpu_s > 0 else float("inf")


async def _drive(
    target: str, mode: str, prompts: Sequence[Sequence[int]], n: int, concurrency: int
) -> tuple[int, int, int]:
    """Send ``n`` Matches, ``concurrency`` at a time, on a fresh client; return the OK
    ones and the MatchStream messages sent and received."""
    settings = IndexerClientSettings(
        deadline_ms=30_000.0,  # a figure of CPU, not of latency: nothing may time out
        max_in_flight=concurrency,
        match_stream=mode == "stream",
    )
    async with grpc.aio.insecure_channel(target) as channel:
        client = IndexerClient(channel=channel, settings=settings, model=TRACE_MODEL)
        ok = 0
        next_i = 0

        async def worker() -> None:
            nonlocal ok, next_i
            while next_i < n:
                i = next_i
                next_i += 1
                out = await client.match(prompts[i % len(prompts)])
                ok += out.status is MatchStatus.OK

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        if mode == "stream" and (client.streams_opened != 1 or client.unary_calls):
            raise RuntimeError(
                f"stream mode did not stay on one stream: {client.streams_opened} opened, "
                f"{client.unary_calls} unary calls"
            )
        sent, received = client.stream_messages_sent, client.stream_messages_received
        await client.close()
        return ok, sent, received


def _round(
    server: ServerChild, mode: str, prompts: Sequence[Sequence[int]], p: MatchStreamParams
) -> ModeRound:
    def run(n: int) -> tuple[int, int, int]:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            return runner.run(_drive(server.target, mode, prompts, n, p.concurrency))

    run(p.warmup)
    cpu0 = server.cpu_seconds() or 0.0
    c0 = time.process_time()
    t0 = time.perf_counter()
    ok, sent, received = run(p.matches)
    wall = time.perf_counter() - t0
    client_cpu = time.process_time() - c0
    server_cpu = (server.cpu_seconds() or 0.0) - cpu0
    return ModeRound(mode, p.matches, wall, server_cpu, client_cpu, ok, sent, received)


def run_matchstream(p: MatchStreamParams) -> tuple[dict[str, float], dict[str, Any]]:
    """Run the benchmark; return ``(figures, params)`` as written to JSON."""
    work = Workload.load(BenchParams(**{**_asdict(QUICK_PARAMS), "requests": p.requests}))
    prompts = work.prompts32
    rounds: dict[str, list[ModeRound]] = {m: [] for m in MODES}
    with ServerChild("memory") as server:
        progress.phase(f"publishing {work.plan.blocks:,} blocks")
        asyncio.run(_build(server.target, work.plan))
        for r in range(p.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                progress.phase(f"round {r + 1}/{p.rounds}: {mode}")
                rounds[mode].append(_round(server, mode, prompts, p))
    figures: dict[str, float] = {}
    for mode, rs in rounds.items():
        figures[f"{mode}_matches_per_server_cpu_s"] = statistics.median(
            x.per_server_cpu_s for x in rs
        )
        figures[f"{mode}_server_cpu_us_per_match"] = statistics.median(
            x.server_cpu_s / x.matches * 1e6 for x in rs
        )
        figures[f"{mode}_matches_per_s"] = statistics.median(x.matches / x.wall_s for x in rs)
        figures[f"{mode}_client_cpu_us_per_match"] = statistics.median(
            x.client_cpu_s / x.matches * 1e6 for x in rs
        )
        figures[f"{mode}_ok_fraction"] = min(x.ok / x.matches for x in rs)
    figures["stream_matches_per_request_message"] = statistics.median(
        x.matches / x.messages_sent for x in rounds["stream"]
    )
    figures["stream_replies_per_response_message"] = statistics.median(
        x.matches / x.messages_received for x in rounds["stream"]
    )
    figures["stream_over_unary_matches_per_server_cpu_s"] = (
        figures["stream_matches_per_server_cpu_s"] / figures["unary_matches_per_server_cpu_s"]
    )
    params = {
        **work.describe(QUICK_PARAMS),
        "matches_per_round": p.matches,
        "concurrency": p.concurrency,
        "rounds": p.rounds,
        "warmup": p.warmup,
        "client": "router_client.IndexerClient (grpc.aio, uvloop), one process, fresh per round",
        "server_cpu": "/proc/<pid>/stat utime + stime of the server child",
        "rounds_detail": {
            m: [
                {
                    "wall_s": x.wall_s,
                    "server_cpu_s": x.server_cpu_s,
                    "client_cpu_s": x.client_cpu_s,
                    "stream_messages_sent": x.messages_sent,
                    "stream_messages_received": x.messages_received,
                }
                for x in rs
            ]
            for m, rs in rounds.items()
        },
    }
    for k in ("latency_calls", "latency_calls_256", "latency_client", "throughput_client"):
        params.pop(k, None)
    return figures, params


def format_table(f: dict[str, float]) -> str:
    """The table of a run: both modes side by side, and the ratio against its target."""
    head = f"{'figure':<32} {'unary':>11} {'stream':>11} {'unit':<8}"
    rows = (
        ("Matches / server CPU-second", "matches_per_server_cpu_s", "1/s"),
        ("server CPU / Match", "server_cpu_us_per_match", "µs"),
        ("Matches / s (wall)", "matches_per_s", "1/s"),
        ("client CPU / Match", "client_cpu_us_per_match", "µs"),
        ("answered OK", "ok_fraction", ""),
        ("Matches / request message", "matches_per_request_message", ""),
        ("replies / response message", "replies_per_response_message", ""),
    )
    lines = [
        f"{label:<32} {fmt(f.get('unary_' + k)):>11} {fmt(f.get('stream_' + k)):>11} {unit:<8}"
        for label, k, unit in rows
    ]
    ratio = f["stream_over_unary_matches_per_server_cpu_s"]
    verdict = "pass" if ratio >= TARGET_RATIO else "SHORT"
    footer = [
        f"stream / unary, Matches per server CPU-second: {ratio:.2f}x "
        f"(target >= {TARGET_RATIO:g}x: {verdict})"
    ]
    return table(head, lines, footer)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench indexer --matchstream``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench indexer --matchstream",
        description="Matches per server CPU-second over one MatchStream vs unary Match.",
        formatter_class=HelpFormatter,
    )
    d = MatchStreamParams()

    def sizes(name: str) -> str:
        return f"(default: {getattr(d, name)}; --quick {getattr(QUICK, name)})"

    p.add_argument("--json", dest="json_path", help="also write figures and params here")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures")
    p.add_argument("--requests", type=int, help=f"trace requests to publish {sizes('requests')}")
    p.add_argument(
        "--matches", type=int, help=f"timed Matches per mode and round {sizes('matches')}"
    )
    p.add_argument("--concurrency", type=int, help=f"Matches in flight {sizes('concurrency')}")
    p.add_argument(
        "--rounds", type=int, help=f"rounds (modes alternate within each) {sizes('rounds')}"
    )
    args = p.parse_args(argv)
    base = QUICK if args.quick else MatchStreamParams()
    params = MatchStreamParams(
        requests=args.requests if args.requests is not None else base.requests,
        matches=args.matches or base.matches,
        concurrency=args.concurrency or base.concurrency,
        rounds=args.rounds or base.rounds,
        warmup=base.warmup,
    )
    t0 = time.perf_counter()
    figures, run_params = run_matchstream(params)
    print(
        f"kvmesh bench indexer --matchstream: {params.matches:,} Matches x {params.rounds} "
        f"rounds per mode, {params.concurrency} in flight, {run_params['instances']} instances, "
        f"{os.cpu_count()} cpus, {time.perf_counter() - t0:.0f} s"
    )
    print(format_table(figures))
    if args.json_path:
        write_report(args.json_path, figures, run_params)
    return 0


def _asdict(params: BenchParams) -> dict[str, Any]:
    return {name: getattr(params, name) for name in BenchParams.__slots__}


if __name__ == "__main__":
    raise SystemExit(main())
