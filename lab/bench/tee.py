"""``kvmesh bench tee``: bounded fan-out against a serial sender, on a sink with injected latency.

A counting HTTP sink (lab/bench/testsink.py) runs in a child process with
``--latency-ms`` of injected latency. The sink latency a client
actually sees is measured first with serial sends; the ideal throughput of N
sends in flight is N / that latency. Then, for each N in ``--concurrency``
(N=1 is the baseline, in the same run), the tee is offered events at twice its
ideal rate (saturated: sustained throughput, and ``offer()`` cost while the
sender is saturated), and for N=8 also at fractions of the ideal rate below it
(drops there must be zero).

``--json FILE`` writes ``{"figures": {...}, "params": {...}}`` with the figures
``tee_rps_n1``, ``tee_rps_n8``, ``tee_rps_n32``, ``tee_ideal_rps_n8``,
``tee_drops_below_capacity_n8``, ``tee_offer_p99_us``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from kvmesh.runtime import new_event_loop
from kvmesh.stats import percentile
from lab.bench.report import write_report
from lab.children import ChildProcess, python_module
from tee.config import DEFAULT_QUEUE_SIZE
from tee.events import RoutedEvent, ingest
from tee.logic import Tee
from tee.sinks import HttpSink

#: Offer pacing tick: small enough that a tick's burst (rate x tick) stays far
#: below the queue bound, large enough that sleeping costs little CPU.
TICK_S = 0.002
#: Tokens per benchmark prompt: a short prompt keeps JSON encoding from
#: dominating, as the fan-out (not serialization) is what is measured.
PROMPT_TOKENS = 64


class _TimedSink(HttpSink):
    """An HttpSink that records each successful send's latency."""

    def __init__(self, url: str, max_connections: int) -> None:
        super().__init__(url, max_connections=max_connections)
        self.latencies: list[float] = []

    async def send(self, event: RoutedEvent) -> None:
        t0 = time.perf_counter()
        await super().send(event)
        self.latencies.append(time.perf_counter() - t0)


@dataclass
class Row:
    """One run of the sweep."""

    n: int
    label: str
    offered_rps: float
    sent_rps: float
    ideal_rps: float
    offered: int
    dropped: int
    failed: int
    send_p50_ms: float
    send_p99_ms: float
    offer_p50_us: float
    offer_p99_us: float


async def _measure_latency(url: str, samples: int) -> float:
    sink = HttpSink(url, max_connections=1)
    events = [ingest("bench", list(range(PROMPT_TOKENS)), f"lat{i}") for i in range(samples + 5)]
    lat: list[float] = []
    try:
        for i, ev in enumerate(events):
            t0 = time.perf_counter()
            await sink.send(ev)
            if i >= 5:  # the first sends open the connection
                lat.append(time.perf_counter() - t0)
    finally:
        await sink.close()
    return statistics.median(lat)


async def _run(
    url: str, n: int, rate: float, duration_s: float, warmup_s: float, queue_size: int, label: str
) -> Row:
    sink = _TimedSink(url, max_connections=n)
    tee = await Tee([sink], concurrency=n, queue_size=queue_size).start()
    lane = tee.lanes[0]
    events = [
        ingest("bench", list(range(i, i + PROMPT_TOKENS)), f"r{i}", worker=f"w{i % 8}")
        for i in range(1024)
    ]
    offer = tee.offer
    clock = time.perf_counter_ns
    offer_ns: list[int] = []
    start = time.perf_counter()
    warm_end = start + warmup_s
    end = warm_end + duration_s
    done = 0
    sent_at_warm = dropped_at_warm = failed_at_warm = offered_at_warm = -1
    latencies_at_warm = 0
    loop = asyncio.get_running_loop()
    while True:
        now = time.perf_counter()
        if now >= end:
            break
        if sent_at_warm < 0 and now >= warm_end:
            s = lane.stats()
            sent_at_warm, dropped_at_warm, failed_at_warm = s.sent, s.dropped, s.failed
            offered_at_warm = s.offered
            latencies_at_warm = len(sink.latencies)
        due = int((now - start) * rate)
        measuring = sent_at_warm >= 0
        while done < due:
            ev = events[done & 1023]
            if measuring:
                t0 = clock()
                offer(ev)
                offer_ns.append(clock() - t0)
            else:
                offer(ev)
            done += 1
        await asyncio.sleep(TICK_S)
    elapsed = time.perf_counter() - warm_end
    s = lane.stats()
    lats = sink.latencies[latencies_at_warm:] or [0.0]  # 0 for a run that sent nothing
    offer_us = [x / 1e3 for x in offer_ns] or [0.0]
    await tee.close(0.5)
    del loop
    return Row(
        n=n,
        label=label,
        offered_rps=(s.offered - offered_at_warm) / elapsed,
        sent_rps=(s.sent - sent_at_warm) / elapsed,
        ideal_rps=0.0,
        offered=s.offered - offered_at_warm,
        dropped=s.dropped - dropped_at_warm,
        failed=s.failed - failed_at_warm,
        send_p50_ms=1e3 * percentile(lats, 0.5),
        send_p99_ms=1e3 * percentile(lats, 0.99),
        offer_p50_us=percentile(offer_us, 0.5),
        offer_p99_us=percentile(offer_us, 0.99),
    )


def _sink_child(latency_ms: float) -> ChildProcess:
    """The counting sink (:mod:`lab.bench.testsink`) as a child process, not started yet."""
    argv = python_module("lab.bench.testsink", "--latency-ms", str(latency_ms))
    return ChildProcess(argv, name="test sink", pipes=True)


async def _bench(args: argparse.Namespace, url: str) -> tuple[list[Row], float]:
    progress.phase("measuring the sink latency")
    latency = await _measure_latency(url, args.latency_samples)
    rows: list[Row] = []
    for n in args.concurrency:
        ideal = n / latency
        progress.phase(f"N={n}, saturated")
        row = await _run(
            url, n, 2 * ideal, args.duration, args.warmup, args.queue_size, "saturated"
        )
        row.ideal_rps = ideal
        rows.append(row)
        if n == 8:
            for frac in args.below:
                progress.phase(f"N={n}, {frac:.0%} of ideal")
                row = await _run(
                    url,
                    n,
                    frac * ideal,
                    args.duration,
                    args.warmup,
                    args.queue_size,
                    f"{frac:.0%} of ideal",
                )
                row.ideal_rps = ideal
                rows.append(row)
    return rows, latency


def _table(rows: list[Row], latency: float) -> str:
    head = (
        f"{'N':>3} {'offered at':<15}{'offered/s':>10}{'sent/s':>9}{'ideal/s':>9}{'of ideal':>9}"
        f"{'dropped':>9}{'failed':>7}{'send p50':>10}{'send p99':>10}{'offer p50':>11}"
        f"{'offer p99':>11}"
    )
    lines = [f"sink latency seen by the client (median, serial): {1e3 * latency:.2f} ms", head]
    for r in rows:
        lines.append(
            f"{r.n:>3} {r.label:<15}{r.offered_rps:>10.0f}{r.sent_rps:>9.0f}{r.ideal_rps:>9.0f}"
            f"{r.sent_rps / r.ideal_rps:>9.1%}{r.dropped:>9}{r.failed:>7}"
            f"{r.send_p50_ms:>8.2f}ms{r.send_p99_ms:>8.2f}ms{r.offer_p50_us:>9.2f}us"
            f"{r.offer_p99_us:>9.2f}us"
        )
    return "\n".join(lines)


def _figures(rows: list[Row], latency: float) -> dict[str, float]:
    sat = {r.n: r for r in rows if r.label == "saturated"}
    below = [r for r in rows if r.n == 8 and r.label != "saturated"]
    return {
        "tee_rps_n1": round(sat[1].sent_rps, 1) if 1 in sat else 0.0,
        "tee_rps_n8": round(sat[8].sent_rps, 1) if 8 in sat else 0.0,
        "tee_rps_n32": round(sat[32].sent_rps, 1) if 32 in sat else 0.0,
        "tee_ideal_rps_n8": round(8 / latency, 1),
        "tee_drops_below_capacity_n8": float(sum(r.dropped for r in below)),
        "tee_offer_p99_us": round(max((r.offer_p99_us for r in sat.values()), default=0.0), 2),
    }


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh bench tee``."""
    p = argparse.ArgumentParser(
        prog="kvmesh bench tee", description=__doc__, formatter_class=HelpFormatter
    )
    p.add_argument("--latency-ms", type=float, default=9.0, help="injected sink latency")
    p.add_argument(
        "--concurrency",
        type=int,
        nargs="+",
        default=[1, 8, 32],
        metavar="N",
        help="sends in flight per run (1: the serial baseline)",
    )
    p.add_argument(
        "--below",
        type=float,
        nargs="+",
        default=[0.5, 0.9],
        metavar="FRACTION",
        help="offered rates for N=8 as fractions of its ideal rate",
    )
    p.add_argument("--duration", type=float, default=4.0, metavar="SECONDS", help="per run")
    p.add_argument("--warmup", type=float, default=1.0, metavar="SECONDS", help="per run")
    p.add_argument(
        "--queue-size", type=int, default=DEFAULT_QUEUE_SIZE, help="the tee's queue bound"
    )
    p.add_argument(
        "--latency-samples",
        type=int,
        default=100,
        help="serial sends that measure the sink latency a client sees",
    )
    p.add_argument("--json", metavar="FILE", help="write figures and params as JSON")
    return p


def main(argv: Sequence[str]) -> int:
    """Run ``kvmesh bench tee``; return the exit code."""
    args = build_parser().parse_args(list(argv))
    # Each run ends by abandoning its saturated queue on purpose; that warning is noise here.
    logging.getLogger("tee.logic").setLevel(logging.ERROR)
    with _sink_child(args.latency_ms) as sink:
        url = f"http://127.0.0.1:{int(sink.wait_line())}"
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            rows, latency = runner.run(_bench(args, url))
    print(_table(rows, latency))
    figures = _figures(rows, latency)
    ratios = {
        f"n{r.n}_of_ideal": round(r.sent_rps / r.ideal_rps, 3)
        for r in rows
        if r.label == "saturated"
    }
    if 1 in args.concurrency and 8 in args.concurrency:
        ratios["n8_over_n1"] = round(figures["tee_rps_n8"] / figures["tee_rps_n1"], 2)
    print("figures:", json.dumps(figures))
    print("ratios:", json.dumps(ratios))
    if args.json:
        params: dict[str, Any] = {
            "latency_ms": args.latency_ms,
            "measured_sink_latency_ms": round(1e3 * latency, 3),
            "concurrency": args.concurrency,
            "below_fractions": args.below,
            "duration_s": args.duration,
            "warmup_s": args.warmup,
            "queue_size": args.queue_size,
            "prompt_tokens": PROMPT_TOKENS,
            "ratios": ratios,
            "rows": [r.__dict__ for r in rows],
        }
        write_report(args.json, figures, params)
    return 0
