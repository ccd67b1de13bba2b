"""The floor Python gRPC sets: empty-RPC latency under server and client variants.

``kvmesh bench indexer --floor`` starts, for each variant, a server in a child
process that answers only ``Ping`` (does no work) and times sequential calls
from this process. Variants change one thing at a time against a baseline:
the server's runtime (grpc.aio on uvloop or on asyncio, or the thread-pool
``grpc.server``), the client (blocking stub or grpc.aio), the transport (TCP
on 127.0.0.1 or a unix domain socket) and channel options. The answer tells
which configuration the indexer server and its clients should adopt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio

from kvmesh import progress
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.report import write_report
from lab.children import (
    ChildProcess,
    announce_ready,
    python_module,
    until_stopped,
    until_stopped_sync,
)

Options = list[tuple[str, Any]]


@dataclass(frozen=True, slots=True)
class FloorVariant:
    """One configuration of server and client to time."""

    name: str
    server: str = "aio-uvloop"  # aio-uvloop | aio-asyncio | threads
    client: str = "sync"  # sync | aio | aio-uvloop
    transport: str = "tcp"  # tcp | unix
    server_options: Options = field(default_factory=list)
    client_options: Options = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)  # both processes
    server_env: dict[str, str] = field(default_factory=dict)
    client_env: dict[str, str] = field(default_factory=dict)


#: Channel options that strip work from every call: no channelz bookkeeping,
#: no retry machinery, the minimal filter stack (no deadline/size filters).
LEAN_OPTIONS: Options = [
    ("grpc.enable_channelz", 0),
    ("grpc.enable_retries", 0),
    ("grpc.minimal_stack", 1),
]

#: The older iomgr TCP client and listener instead of the EventEngine ones.
NO_EVENT_ENGINE = {"GRPC_EXPERIMENTS": "-event_engine_client,-event_engine_listener"}

VARIANTS: tuple[FloorVariant, ...] = (
    FloorVariant("baseline: aio+uvloop server, sync client, tcp"),
    FloorVariant("aio server on asyncio loop", server="aio-asyncio"),
    FloorVariant("thread-pool grpc.server", server="threads"),
    FloorVariant("grpc.aio client (asyncio loop)", client="aio"),
    FloorVariant("grpc.aio client (uvloop)", client="aio-uvloop"),
    FloorVariant("unix domain socket", transport="unix"),
    FloorVariant(
        "client: enable_retries=0",
        client_options=[("grpc.enable_retries", 0)],
    ),
    FloorVariant(
        "channelz off (both sides)",
        server_options=[("grpc.enable_channelz", 0)],
        client_options=[("grpc.enable_channelz", 0)],
    ),
    FloorVariant(
        "minimal_stack (both sides)",
        server_options=[("grpc.minimal_stack", 1)],
        client_options=[("grpc.minimal_stack", 1)],
    ),
    FloorVariant(
        "server so_reuseport=0",
        server_options=[("grpc.so_reuseport", 0)],
    ),
    FloorVariant(
        "keepalive 10 s (both sides)",
        server_options=[("grpc.keepalive_time_ms", 10_000)],
        client_options=[("grpc.keepalive_time_ms", 10_000)],
    ),
    FloorVariant("GRPC_POLL_STRATEGY=poll", env={"GRPC_POLL_STRATEGY": "poll"}),
    FloorVariant(
        "GRPC_EXPERIMENTS=-event_engine_client,-event_engine_listener",
        env=NO_EVENT_ENGINE,
    ),
    FloorVariant(
        "server GRPC_EXPERIMENTS=-event_engine_listener",
        server_env={"GRPC_EXPERIMENTS": "-event_engine_listener"},
    ),
    FloorVariant(
        "client GRPC_EXPERIMENTS=-event_engine_client",
        client_env={"GRPC_EXPERIMENTS": "-event_engine_client"},
    ),
    FloorVariant(
        "GRPC_EXPERIMENTS=-event_engine_for_all_other_endpoints",
        env={"GRPC_EXPERIMENTS": "-event_engine_for_all_other_endpoints"},
    ),
    FloorVariant(
        "GRPC_EXPERIMENTS=-event_engine_callback_cq",
        env={"GRPC_EXPERIMENTS": "-event_engine_callback_cq"},
    ),
    FloorVariant(
        "lean options (both sides)",
        server_options=LEAN_OPTIONS,
        client_options=LEAN_OPTIONS,
    ),
    FloorVariant(
        "lean options + unix socket",
        transport="unix",
        server_options=LEAN_OPTIONS,
        client_options=LEAN_OPTIONS,
    ),
    FloorVariant(
        "threads server + lean + unix",
        server="threads",
        transport="unix",
        server_options=LEAN_OPTIONS,
        client_options=LEAN_OPTIONS,
    ),
    FloorVariant(
        "lean + no EventEngine client/listener",
        server_options=LEAN_OPTIONS,
        client_options=LEAN_OPTIONS,
        env=NO_EVENT_ENGINE,
    ),
    FloorVariant(
        "lean + no EventEngine + unix socket",
        transport="unix",
        server_options=LEAN_OPTIONS,
        client_options=LEAN_OPTIONS,
        env=NO_EVENT_ENGINE,
    ),
)


class _AioPing(pb_grpc.IndexerServiceServicer):
    # Only Ping is served; the other methods keep the generated UNIMPLEMENTED ones.

    async def Ping(
        self, request: pb.PingRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.PingResponse:
        return pb.PingResponse()


class _SyncPing(pb_grpc.IndexerServiceServicer):
    def Ping(self, request: pb.PingRequest, context: grpc.ServicerContext) -> pb.PingResponse:
        return pb.PingResponse()


def _bind(target: str) -> str:
    return "127.0.0.1:0" if target == "tcp" else target


def _serve(kind: str, target: str, options: Options) -> None:
    """Child process: serve Ping on ``target``, announce the port, stop when told."""
    if kind == "threads":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=options)
        pb_grpc.add_IndexerServiceServicer_to_server(_SyncPing(), server)  # type: ignore[abstract]
        port = server.add_insecure_port(_bind(target))
        server.start()
        announce_ready(port)
        until_stopped_sync()
        server.stop(0)
        return

    async def run() -> None:
        server = grpc.aio.server(options=options)
        pb_grpc.add_IndexerServiceServicer_to_server(_AioPing(), server)  # type: ignore[abstract]
        port = server.add_insecure_port(_bind(target))
        await server.start()
        announce_ready(port)
        await until_stopped()
        await server.stop(0)

    if kind == "aio-uvloop":
        import uvloop

        uvloop.run(run())
    else:
        asyncio.run(run())


class ServerProcess:
    """A Ping-only server variant in a child process (context manager)."""

    def __init__(
        self, kind: str, transport: str, options: Options, env: dict[str, str] | None = None
    ) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="kvmesh-floor-")
        self._bind = "tcp" if transport == "tcp" else f"unix:{self._tmp.name}/ping.sock"
        argv = python_module(
            "lab.bench.floor",
            "--serve",
            kind,
            "--bind",
            self._bind,
            "--options",
            json.dumps(options),
        )
        self.child = ChildProcess(
            argv, name="floor server", env={**os.environ, **(env or {})}, pipes=True
        )
        self.target = ""

    def __enter__(self) -> ServerProcess:
        self.child.start()
        try:
            port = int(self.child.wait_line())
        except BaseException:
            self.__exit__()
            raise
        self.target = f"127.0.0.1:{port}" if self._bind == "tcp" else self._bind
        return self

    def __exit__(self, *exc: object) -> None:
        self.child.stop()
        self._tmp.cleanup()


#: Seconds a client process gets to time its Pings and print them: 3,000 calls
#: take well under a second; a loaded machine or a slow variant may take far longer.
CLIENT_TIMEOUT_S = 300.0


def client_process_pings(
    client: str,
    target: str,
    options: Options,
    calls: int,
    env: dict[str, str] | None = None,
) -> list[float]:
    """Run :func:`time_pings` in a fresh child process (so env vars apply to it)."""
    argv = python_module(
        "lab.bench.floor",
        "--client", client, "--target", target,
        "--options", json.dumps(options), "--calls", str(calls),
    )  # fmt: skip
    with ChildProcess(
        argv, name="floor client", env={**os.environ, **(env or {})}, pipes=True
    ) as child:
        samples: list[float] = json.loads(child.read_line(CLIENT_TIMEOUT_S))
    return samples


def time_sync_pings(target: str, options: Options, calls: int, warmup: int) -> list[float]:
    """Latencies (µs) of ``calls`` sequential Pings from a blocking stub."""
    with grpc.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.IndexerServiceStub(channel)
        req = pb.PingRequest()
        for _ in range(warmup):
            stub.Ping(req)
        out: list[float] = []
        clock = time.perf_counter_ns
        for _ in range(calls):
            t0 = clock()
            stub.Ping(req)
            out.append((clock() - t0) / 1000)
        return out


async def time_aio_pings(target: str, options: Options, calls: int, warmup: int) -> list[float]:
    """Latencies (µs) of ``calls`` sequential Pings from a grpc.aio stub."""
    async with grpc.aio.insecure_channel(target, options=options) as channel:
        stub = pb_grpc.IndexerServiceStub(channel)
        req = pb.PingRequest()
        for _ in range(warmup):
            await stub.Ping(req)
        out: list[float] = []
        clock = time.perf_counter_ns
        for _ in range(calls):
            t0 = clock()
            await stub.Ping(req)
            out.append((clock() - t0) / 1000)
        return out


def time_pings(client: str, target: str, options: Options, calls: int, warmup: int) -> list[float]:
    """Latencies (µs) of sequential Pings from the given client kind."""
    if client == "sync":
        return time_sync_pings(target, options, calls, warmup)
    if client == "aio-uvloop":
        import uvloop

        return uvloop.run(time_aio_pings(target, options, calls, warmup))
    return asyncio.run(time_aio_pings(target, options, calls, warmup))


@dataclass(slots=True)
class FloorResult:
    """Empty-RPC latency of one variant."""

    variant: FloorVariant
    p50_us: float
    p99_us: float
    rounds: list[float]


def run_floor(
    variants: Sequence[FloorVariant] = VARIANTS, *, calls: int = 3000, rounds: int = 3
) -> list[FloorResult]:
    """Time every variant; each round is a fresh server; p50 is the median of rounds."""
    results: list[FloorResult] = []
    for v in variants:
        p50s: list[float] = []
        p99s: list[float] = []
        for r in range(rounds):
            progress.phase(f"{v.name}: round {r + 1}/{rounds}")
            with ServerProcess(
                v.server, v.transport, v.server_options, {**v.env, **v.server_env}
            ) as srv:
                lat = client_process_pings(
                    v.client, srv.target, v.client_options, calls, {**v.env, **v.client_env}
                )
            p50s.append(percentile(lat, 0.5))
            p99s.append(percentile(lat, 0.99))
        p50s_sorted = sorted(p50s)
        results.append(
            FloorResult(v, p50s_sorted[len(p50s) // 2], sorted(p99s)[len(p99s) // 2], p50s)
        )
    return results


def format_floor(results: Sequence[FloorResult]) -> str:
    """The floor table: p50/p99 per variant and the change against the baseline."""
    base = results[0].p50_us
    lines = [
        f"{'variant':<48} {'p50 µs':>8} {'p99 µs':>8} {'vs base':>8}  rounds (p50 µs)",
        "-" * 100,
    ]
    for r in results:
        delta = (r.p50_us / base - 1.0) * 100
        rounds = " ".join(f"{x:.0f}" for x in r.rounds)
        lines.append(
            f"{r.variant.name:<48} {r.p50_us:>8.1f} {r.p99_us:>8.1f} {delta:>+7.1f}%  {rounds}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the floor table (or, with ``--serve``, be one variant's server)."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench indexer --floor",
        description="The latency of an empty RPC (Ping) under gRPC server and channel "
        "variants, each against the baseline.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--serve", help=argparse.SUPPRESS)
    p.add_argument("--bind", default="tcp", help=argparse.SUPPRESS)
    p.add_argument("--client", help=argparse.SUPPRESS)
    p.add_argument("--target", help=argparse.SUPPRESS)
    p.add_argument("--options", default="[]", help=argparse.SUPPRESS)
    p.add_argument(
        "--only",
        default="",
        help="run only variants whose name contains this (default: every variant)",
    )
    p.add_argument("--calls", type=int, default=3000, help="timed Pings per round")
    p.add_argument("--rounds", type=int, default=3, help="fresh servers per variant")
    p.add_argument("--json", dest="json_path", help="write the rows as JSON here")
    args = p.parse_args(argv)
    opts: Options = [(str(k), v) for k, v in json.loads(args.options)]
    if args.serve:
        _serve(args.serve, args.bind, opts)
        return 0
    if args.client:
        lat = time_pings(args.client, args.target, opts, args.calls, args.calls // 10)
        print(json.dumps(lat))
        return 0
    chosen = [v for v in VARIANTS if args.only in v.name] if args.only else list(VARIANTS)
    if args.only and chosen[0] is not VARIANTS[0]:
        chosen.insert(0, VARIANTS[0])
    results = run_floor(chosen, calls=args.calls, rounds=args.rounds)
    print(f"Empty-RPC (Ping) latency, {args.calls} sequential calls x {args.rounds} rounds")
    print(format_floor(results))
    if args.json_path:
        rows = [
            {"variant": r.variant.name, "p50_us": r.p50_us, "p99_us": r.p99_us} for r in results
        ]
        write_report(args.json_path, None, None, floor=rows, cpus=os.cpu_count())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
