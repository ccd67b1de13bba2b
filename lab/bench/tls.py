"""``kvmesh bench indexer --tls``: what transport security and the guard cost the indexer.

One run, the memory backend, the same trace requests and prompts, three server
modes, each an indexer in a child process of its own
(:class:`lab.bench.indexer_common.ServerChild`):

- ``plaintext``, the baseline: no TLS, authorization off (the local-development
  default);
- ``mtls``: mutual TLS with ECDSA P-256 certificates from
  :mod:`lab.devcerts` and a policy file (an engine identity publishes for
  every instance, a router identity reads), per-client limits at their
  defaults;
- ``mtls+limits``: as ``mtls``, with per-client Match and publish rates far
  above what a replica serves, so they never refuse but the token buckets run
  on every call.

Per mode, the figures of :func:`lab.bench.indexer_common.bench_backend` (streamed ingest,
Ping and 32-block Match latency, concurrent Matches/s and the server's CPU time
per Match during them), published with the engine's certificate and read with
the router's, plus the cost of a new connection: the first Ping of a fresh
channel (TCP connect, the TLS handshake when there is one, HTTP/2 set-up and
the call), each channel with a connection of its own. Modes run in order, then
in reverse order in the next round, and each figure is the median over rounds,
so that slow drift on a shared machine weighs on every mode alike. The table
gives each figure per mode and its ratio to plaintext; ``--json FILE`` writes
``{"figures", "ratios", "rounds", "params"}``.

``--flood`` instead measures what one client's flood of Matches does to
another client's latency (:data:`SCENARIOS`): a mutual-TLS server with two
router identities; router-b, calm, sends sequential Matches (one in flight, at
most :attr:`FloodParams.calm_rps` a second) and its p50/p99 are timed alone,
while router-a keeps :attr:`FloodParams.in_flight` Matches in flight from a
process of its own with per-client limits off, and with them on (an in-flight
cap and a Match rate that the calm client stays under). Per scenario: the calm
client's p50, p99 and p99 over its p99 alone, the flood's accepted Matches/s
and refused (RESOURCE_EXHAUSTED) share, and the CPU the server and the flood
client burnt, in cores. ``--json FILE`` writes ``{"flood", "params"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from kvmesh import progress
from kvmesh.api.indexer.v1 import indexer_pb2 as pb
from kvmesh.api.indexer.v1 import indexer_pb2_grpc as pb_grpc
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from kvmesh.tls import ChannelFactory, ClientTLS
from lab.bench.indexer_common import (
    DEFAULT_PARAMS,
    QUICK_PARAMS,
    BenchParams,
    ServerChild,
    Workload,
    bench_backend,
)
from lab.bench.report import fmt, table, write_report
from lab.children import ChildProcess, announce_ready, python_module
from lab.devcerts import DevIdentity, DevPki
from lab.workload import match_request, publish_plan, register_all


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
#: The two routers of ``--flood``: router-a floods, router-b is the calm neighbour.
ROUTER_A_SAN = "spiffe://kvmesh/router/bench-a"
ROUTER_B_SAN = "spiffe://kvmesh/router/bench-b"
IDENTITIES = {
    "server": DevIdentity(("localhost", "127.0.0.1")),
    "engine": DevIdentity((ENGINE_SAN,), ("engine",)),
    "router": DevIdentity((ROUTER_SAN,), ("router",)),
    "router-a": DevIdentity((ROUTER_A_SAN,), ("router",)),
    "router-b": DevIdentity((ROUTER_B_SAN,), ("router",)),
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
    """The files of one run: server TLS and policy, every client identity's TLS."""

    server_tls: dict[str, str]
    policy_file: str
    engine: ClientTLS
    router: ClientTLS
    router_a: ClientTLS  # the flooding client of ``--flood``
    router_b: ClientTLS  # its calm neighbour

    @classmethod
    def write(cls, folder: Path) -> Credentials:
        """A fresh CA, every identity of :data:`IDENTITIES` and the policy under ``folder``."""
        pki = DevPki(folder, IDENTITIES, ca_name="kvmesh bench CA")
        return cls(
            server_tls=pki.server_tls(),
            policy_file=str(pki.policy_file),
            engine=pki.client("engine"),
            router=pki.client("router"),
            router_a=pki.client("router-a"),
            router_b=pki.client("router-b"),
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
            progress.phase(f"round {r + 1}/{rounds}")
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
        "certificates": "ECDSA P-256 leaf certificates and CA from lab.devcerts",
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
    lines = []
    for label, suffix, unit in ROWS:
        line = f"{label:<31} {unit:<8}"
        for m in modes:
            line += f" {fmt(figures.get(f'{m.key}_{suffix}')):>11}"
            if m is not BASELINE:
                r = rel[m.key].get(suffix)
                line += f" {'-' if r is None else f'{r:.3f}':>6}"
        lines.append(line)
    footer = f"ratio: the mode's figure / {BASELINE.label}'s (for 1/s and blocks/s, < 1 is slower)"
    return table(head, lines, [footer])


# -- a flood from one client ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class FloodParams:
    """Sizes of ``--flood``."""

    #: Sequential Matches of the calm client per scenario: 1,000 give a p99 that
    #: rests on its 10 slowest calls (alone they take 5 s at calm_rps; under a
    #: flood every call waits longer).
    calm_calls: int = 1000
    #: The calm client's pace, one call in flight: a router placing 200 requests
    #: a second, a fraction of what one replica serves (about 1,000-1,500
    #: concurrent Matches/s on the 2-core host of docs/benchmarks.md), so alone
    #: it leaves the server mostly idle.
    calm_rps: float = 200.0
    #: Matches router-a keeps in flight, retrying at once on every answer.
    in_flight: int = 64
    #: Seconds between the flood's start and the calm client's first timed call,
    #: so that the calm client meets the flood in its steady state.
    settle_s: float = 0.5
    #: ``limits.per_client.max_in_flight`` of the limited scenario: the calm
    #: client (one in flight) never comes near it. The guard counts a call in
    #: flight from admission to answer, and a memory-backend Match does not
    #: suspend in between, so this cap refuses none of the flood's Matches
    #: (measured: docs/benchmarks.md); it is set as a deployment would set it.
    limit_in_flight: int = 8
    #: ``limits.per_client.match_rps`` of the limited scenario: 2.5x the calm
    #: pace, so the calm client is never refused, and a third to a half of
    #: what the server gives the flood unlimited, so most of the flood is refused.
    limit_match_rps: float = 500.0
    #: ``match_burst`` of the limited scenario: a tenth of a second's worth, so
    #: the rate bites from the flood's start rather than after a one-second
    #: burst (the default), which would be most of a ``--quick`` window.
    limit_match_burst: int = 50


FLOOD_PARAMS = FloodParams()
#: A few seconds for the whole ``--flood --quick`` run; the figures are only indicative.
QUICK_FLOOD_PARAMS = FloodParams(calm_calls=30, settle_s=0.2)


@dataclass(frozen=True, slots=True)
class Scenario:
    """One server and neighbour configuration the calm client is measured under."""

    key: str
    label: str
    flood: bool  # router-a floods during the calm client's calls
    limits: bool  # per-client in-flight cap and Match rate on
    #: limits.max_streams_per_connection (0: gRPC's default, no limit).
    streams: int = 0


SCENARIOS: tuple[Scenario, ...] = (
    Scenario("alone", "calm alone", flood=False, limits=False),
    Scenario("flood", "flood, limits off", flood=True, limits=False),
    Scenario("flood_limited", "flood, limits on", flood=True, limits=True),
    Scenario("flood_streams", "flood, 8 streams/conn", flood=True, limits=True, streams=8),
)
ALONE = SCENARIOS[0]


def flood_server(creds: Credentials, scenario: Scenario, fp: FloodParams) -> dict[str, Any]:
    """Server config overrides of ``scenario``: mutual TLS, the policy, its per-client limits."""
    per_client: dict[str, Any] = (
        {
            "max_in_flight": fp.limit_in_flight,
            "match_rps": fp.limit_match_rps,
            "match_burst": fp.limit_match_burst,
        }
        if scenario.limits
        else {"max_in_flight": 0}
    )
    limits: dict[str, Any] = {"per_client": per_client}
    if scenario.streams:
        limits["max_streams_per_connection"] = scenario.streams
    return {
        "tls": creds.server_tls,
        "auth": {"policy_file": creds.policy_file},
        "limits": limits,
    }


def calm_latency(
    stub: pb_grpc.IndexerServiceStub, reqs: Sequence[pb.MatchRequest], calls: int, rps: float
) -> tuple[list[float], dict[str, int]]:
    """µs of ``calls`` sequential Matches started at most ``rps`` a second; failures by code.

    One call in flight: the next starts ``1/rps`` after the previous one
    started, or as soon as it ends if it took longer (so a slow call delays
    the ones after it rather than piling them up). Only answered calls are
    timed.
    """
    interval = 1e9 / rps
    clock = time.perf_counter_ns
    lat: list[float] = []
    errors: dict[str, int] = {}
    for i in range(calls):
        t0 = clock()
        try:
            stub.Match(reqs[i % len(reqs)], timeout=30)
            lat.append((clock() - t0) / 1000)
        except grpc.RpcError as e:
            name = e.code().name if isinstance(e, grpc.Call) else type(e).__name__
            errors[name] = errors.get(name, 0) + 1
        pause = t0 + interval - clock()
        if pause > 0:
            time.sleep(pause / 1e9)
    return lat, errors


async def _flood(spec: dict[str, Any]) -> dict[str, Any]:
    """router-a's flood: wait for ``go`` on stdin, keep the Matches in flight until EOF."""
    reqs = [match_request(k) for k in spec["prompts"]]
    n = int(spec["in_flight"])
    tls = ClientTLS.model_validate(spec["tls"])
    loop = asyncio.get_running_loop()
    async with ChannelFactory(spec["target"], tls, what="bench flood").channel() as channel:
        stub = pb_grpc.IndexerServiceStub(channel)
        await stub.Ping(pb.PingRequest(), timeout=30)
        announce_ready()
        await loop.run_in_executor(None, sys.stdin.readline)
        ok = refused = 0
        other: dict[str, int] = {}
        stopping = False

        async def worker(k: int) -> None:
            nonlocal ok, refused
            i = k
            while not stopping:
                try:
                    await stub.Match(reqs[i % len(reqs)], timeout=30)
                    code = grpc.StatusCode.OK
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                if stopping:  # answered after the window closed: not counted
                    break
                if code == grpc.StatusCode.OK:
                    ok += 1
                elif code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    refused += 1
                else:
                    other[code.name] = other.get(code.name, 0) + 1
                i += n

        cpu0, t0 = time.process_time(), time.perf_counter()
        tasks = [asyncio.create_task(worker(k)) for k in range(n)]
        await loop.run_in_executor(None, sys.stdin.readline)  # EOF: the window is over
        stopping = True
        seconds, cpu_s = time.perf_counter() - t0, time.process_time() - cpu0
        await asyncio.gather(*tasks)
    return {"ok": ok, "refused": refused, "other": other, "seconds": seconds, "cpu_s": cpu_s}


def _flood_child(spec_file: str) -> int:
    """Child process of :class:`FloodChild`: flood, then print the counts as one JSON line."""
    spec = json.loads(Path(spec_file).read_text(encoding="utf-8"))
    print(json.dumps(asyncio.run(_flood(spec))), flush=True)
    return 0


#: Seconds the flood client gets to finish its calls in flight and report: a
#: Match answers in milliseconds, but up to ``in_flight`` of them on a loaded
#: machine, each with a 30 s deadline, may still be out.
FLOOD_REPORT_TIMEOUT_S = 60.0


class FloodChild:
    """router-a flooding from a process of its own (context manager).

    A process of its own, so that the flood's grpc.aio loop shares neither the
    event loop nor the interpreter lock of the calm client; it shares the
    machine's cores with the server and the calm client, as a busy
    neighbour on the same host would. ``start()`` begins the flood,
    ``stop()`` ends it and returns its counts: ``ok``, ``refused``
    (RESOURCE_EXHAUSTED), ``other`` (by code), ``seconds``, ``cpu_s`` (the
    process's CPU time, every thread).
    """

    def __init__(self, spec_file: Path) -> None:
        self.child = ChildProcess(
            python_module("lab.bench.tls", "--flood-child", str(spec_file)),
            name="flood client",
            pipes=True,
        )

    def __enter__(self) -> FloodChild:
        self.child.start()
        try:
            self.child.wait_line()
        except BaseException:
            self.child.stop()
            raise
        return self

    def start(self) -> None:
        """Begin the flood."""
        self.child.send_line("go")

    def stop(self) -> dict[str, Any]:
        """End the flood; its counts."""
        self.child.close_stdin()
        line = self.child.read_line(timeout_s=FLOOD_REPORT_TIMEOUT_S)
        if not line.startswith("{"):
            raise RuntimeError(f"flood client did not report (got {line!r})")
        out: dict[str, Any] = json.loads(line)
        return out

    def __exit__(self, *exc: object) -> None:
        self.child.stop()


#: Publish streams of ``--flood``: the engine identity publishes for every
#: instance, and one stream per instance (64) would run into the limited
#: scenario's in-flight cap, which counts an open stream as a call in flight.
FLOOD_PUBLISH_STREAMS = 4


async def _publish(target: str, work: Workload, tls: ClientTLS) -> None:
    async with ChannelFactory(target, tls, what="bench").channel() as channel:
        stub = pb_grpc.IndexerServiceStub(channel)
        await register_all(stub, work.plan.instances)
        await publish_plan(stub, work.plan, streams=FLOOD_PUBLISH_STREAMS)


def flood_scenario(
    scenario: Scenario,
    creds: Credentials,
    work: Workload,
    fp: FloodParams,
    folder: Path,
) -> dict[str, Any]:
    """The calm client's figures under ``scenario``, and the flood's when there is one.

    A fresh server (memory backend, mutual TLS, the scenario's limits) in a
    child process, the workload published with the engine's certificate
    (:data:`FLOOD_PUBLISH_STREAMS` streams); the calm client (router-b,
    blocking stub, in this process) warms up, the flood (router-a,
    :class:`FloodChild`) starts, and after ``settle_s`` the calm client's
    calls are timed. The window from the flood's start (alone: the settle
    pause's) to its end gives the server's and the flood client's CPU in cores.
    """
    reqs = [match_request(k) for k in work.prompts32]
    with ServerChild("memory", overrides=flood_server(creds, scenario, fp)) as srv:
        asyncio.run(_publish(srv.target, work, creds.engine))
        spec = folder / f"flood-{scenario.key}.json"
        spec.write_text(
            json.dumps(
                {
                    "target": srv.target,
                    "tls": creds.router_a.model_dump(),
                    "in_flight": fp.in_flight,
                    "prompts": work.prompts32,
                }
            ),
            encoding="utf-8",
        )
        with (
            ChannelFactory(srv.target, creds.router_b, what="bench").sync_channel() as channel,
            contextlib.ExitStack() as stack,
        ):
            stub = pb_grpc.IndexerServiceStub(channel)
            for i in range(50):
                stub.Match(reqs[i % len(reqs)], timeout=30)
            flood = stack.enter_context(FloodChild(spec)) if scenario.flood else None
            cpu0, t0 = srv.cpu_seconds(), time.perf_counter()
            if flood is not None:
                flood.start()
            time.sleep(fp.settle_s)
            lat, errors = calm_latency(stub, reqs, fp.calm_calls, fp.calm_rps)
            counts = flood.stop() if flood is not None else None
            cpu1, window = srv.cpu_seconds(), time.perf_counter() - t0
    out: dict[str, Any] = {
        "calm_calls": fp.calm_calls,
        "calm_errors": errors,
        "calm_p50_us": percentile(lat, 0.5) if lat else math.nan,
        "calm_p99_us": percentile(lat, 0.99) if lat else math.nan,
        "window_s": window,
    }
    if cpu0 is not None and cpu1 is not None:
        out["server_cores"] = (cpu1 - cpu0) / window
    if counts is not None:
        answered = counts["ok"] + counts["refused"] + sum(counts["other"].values())
        out.update(
            flood_accepted_per_s=counts["ok"] / counts["seconds"],
            flood_refused_per_s=counts["refused"] / counts["seconds"],
            flood_refused_share=counts["refused"] / answered if answered else math.nan,
            flood_other_errors=counts["other"],
            flood_answered=answered,
            flood_client_cores=counts["cpu_s"] / counts["seconds"],
            flood_seconds=counts["seconds"],
        )
    return out


def run_flood(
    params: BenchParams, fp: FloodParams, scenarios: Sequence[Scenario] = SCENARIOS
) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Measure every scenario once, in order; return (figures per scenario key, params)."""
    work = Workload.load(params)
    out: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="kvmesh-bench-flood-") as tmp:
        creds = Credentials.write(Path(tmp))
        for sc in scenarios:
            progress.phase(f"flood scenario: {sc.label}")
            out[sc.key] = flood_scenario(sc, creds, work, fp, Path(tmp))
    alone = out[ALONE.key]["calm_p99_us"]
    for figures in out.values():
        figures["calm_p99_over_alone"] = figures["calm_p99_us"] / alone
    described = work.describe(params)
    run_params = {
        **{k: described[k] for k in _FLOOD_DESCRIBED},
        "scenarios": {sc.key: sc.label for sc in scenarios},
        "backend": "memory",
        "tls": "mutual TLS, ECDSA P-256 certificates from lab.devcerts, policy file",
        "calm_client": "router-b, grpc blocking stub in the parent process, one Match in "
        f"flight, started every 1/{fp.calm_rps:g} s (or when the previous one ends), "
        f"{fp.calm_calls} calls, 50 warm-up calls",
        "flood_client": f"router-a, grpc.aio in a process of its own, {fp.in_flight} Matches "
        "in flight, each answer (accepted or refused) followed at once by the next call",
        "limits_off": {"max_in_flight": 0},
        "limits_on": {
            "max_in_flight": fp.limit_in_flight,
            "match_rps": fp.limit_match_rps,
            "match_burst": fp.limit_match_burst,
        },
        "settle_s": fp.settle_s,
        "order": "scenarios once each, in order, a fresh server each",
        **dataclasses.asdict(fp),
    }
    return out, run_params


_FLOOD_DESCRIBED = (
    "trace",
    "requests",
    "instances",
    "assignment",
    "blocks_published",
    "block_size",
    "prompts_32",
    "server",
    "cpus",
    "python",
    "grpcio",
)

#: Figures of a scenario that must be finite and positive (when present).
FLOOD_POSITIVE = (
    "calm_p50_us",
    "calm_p99_us",
    "calm_p99_over_alone",
    "flood_accepted_per_s",
    "flood_client_cores",
    "server_cores",
)


def format_flood(
    figures: dict[str, dict[str, Any]], scenarios: Sequence[Scenario] = SCENARIOS
) -> str:
    """One line per scenario: the calm client's latency, the flood's fate, CPU in cores."""
    head = (
        f"{'scenario':<18} {'calm p50':>9} {'calm p99':>9} {'p99/alone':>9} "
        f"{'flood ok/s':>10} {'refused':>8} {'unavail.':>8} {'flood cores':>11} "
        f"{'server cores':>12} {'calm failed':>11}"
    )
    lines = []
    for sc in scenarios:
        f = figures[sc.key]
        share = f.get("flood_refused_share")
        other = f.get("flood_other_errors")
        answered = f.get("flood_answered") or 0
        unavailable = (
            "-"
            if other is None or not answered
            else f"{other.get('UNAVAILABLE', 0) / answered:.1%}"
        )
        lines.append(
            f"{sc.label:<18} {fmt(f['calm_p50_us']):>9} {fmt(f['calm_p99_us']):>9} "
            f"{f['calm_p99_over_alone']:>9.2f} {fmt(f.get('flood_accepted_per_s')):>10} "
            f"{'-' if share is None else f'{share:.1%}':>8} {unavailable:>8} "
            f"{_cores(f.get('flood_client_cores')):>11} {_cores(f.get('server_cores')):>12} "
            f"{sum(f['calm_errors'].values()):>11}"
        )
    footer = (
        "calm p50/p99 in µs; refused: share of the flood's answered calls that were "
        "RESOURCE_EXHAUSTED; unavail.: UNAVAILABLE (streams beyond the connection's cap "
        "refused with REFUSED_STREAM, never processed); cores: CPU seconds per second of "
        "the flood window"
    )
    return table(head, lines, [footer])


def _cores(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def flood_bad(figures: dict[str, dict[str, Any]]) -> list[str]:
    """Names of figures that are not finite and positive (refused share: not in [0, 1])."""
    bad: list[str] = []
    for key, f in figures.items():
        for name in FLOOD_POSITIVE:
            v = f.get(name)
            if v is not None and not (math.isfinite(v) and v > 0):
                bad.append(f"{key}.{name}")
        share = f.get("flood_refused_share")
        if share is not None and not 0.0 <= share <= 1.0:
            bad.append(f"{key}.flood_refused_share")
    return bad


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``kvmesh bench indexer --tls``; returns the exit code."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench indexer --tls",
        description="What mutual TLS, authorization and per-client limits cost the indexer: "
        "plaintext vs mtls vs mtls+limits, memory backend, one run.",
        formatter_class=HelpFormatter,
    )
    p.add_argument("--json", dest="json_path", help="also write figures, ratios and params here")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke run, not figures")
    p.add_argument("--requests", type=int, help="trace requests to publish (default: all)")
    p.add_argument(
        "--rounds", type=int, help="times every mode is measured (default: 2; --quick 1)"
    )
    p.add_argument(
        "--connections",
        type=int,
        help=f"new connections timed per mode (default: {CONNECTIONS}; --quick "
        f"{QUICK_CONNECTIONS})",
    )
    p.add_argument(
        "--flood",
        action="store_true",
        help="instead: a calm client's Match latency while another client floods, "
        "per-client limits off and on",
    )
    p.add_argument(
        "--in-flight",
        type=int,
        help="--flood: Matches the flooding client keeps in flight "
        f"(default: {FLOOD_PARAMS.in_flight})",
    )
    p.add_argument(
        "--calm-calls",
        type=int,
        help=f"--flood: timed Matches of the calm client per scenario "
        f"(default: {FLOOD_PARAMS.calm_calls}; --quick {QUICK_FLOOD_PARAMS.calm_calls})",
    )
    p.add_argument("--flood-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.flood_child:
        return _flood_child(args.flood_child)
    params = QUICK_PARAMS if args.quick else DEFAULT_PARAMS
    if args.requests is not None:
        if args.requests < 1:
            p.error("--requests must be >= 1")
        params = dataclasses.replace(params, requests=args.requests)
    if args.flood:
        if args.rounds is not None or args.connections is not None:
            p.error("--rounds and --connections do not apply to --flood")
        return _main_flood(p, args, params)
    if args.in_flight is not None or args.calm_calls is not None:
        p.error("--in-flight and --calm-calls apply to --flood only")
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
        write_report(args.json_path, figures, run_params, ratios=rel, rounds=per_round)
    return 1 if bad else 0


def _main_flood(p: argparse.ArgumentParser, args: argparse.Namespace, params: BenchParams) -> int:
    fp = QUICK_FLOOD_PARAMS if args.quick else FLOOD_PARAMS
    if args.in_flight is not None:
        fp = dataclasses.replace(fp, in_flight=args.in_flight)
    if args.calm_calls is not None:
        fp = dataclasses.replace(fp, calm_calls=args.calm_calls)
    if fp.in_flight < 1 or fp.calm_calls < 1:
        p.error("--in-flight and --calm-calls must be >= 1")
    t0 = time.perf_counter()
    figures, run_params = run_flood(params, fp)
    bad = flood_bad(figures)
    print(
        f"kvmesh bench indexer --tls --flood: {run_params['requests']:,} requests, "
        f"{run_params['blocks_published']:,} blocks, memory backend, mutual TLS; calm router-b "
        f"{fp.calm_calls} Matches at <= {fp.calm_rps:g}/s, flooding router-a {fp.in_flight} in "
        f"flight; limits on: max_in_flight {fp.limit_in_flight}, match_rps "
        f"{fp.limit_match_rps:g} (burst {fp.limit_match_burst}); {run_params['cpus']} cpus, "
        f"{time.perf_counter() - t0:.0f} s"
    )
    print(format_flood(figures))
    if bad:
        print(f"not finite or not positive: {', '.join(sorted(bad))}")
    if args.json_path:
        write_report(args.json_path, None, run_params, flood=figures)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
