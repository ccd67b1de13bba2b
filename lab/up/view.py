"""What ``kvmesh up`` shows: the live terminal view, the progress line and the summary.

Everything here is a pure function of a :class:`Snapshot` (taken by
:class:`lab.up.driver.Driver` about once a second), so the view can be tested and changed
without a cluster. The live view is plain ANSI: the block is redrawn in place
by moving the cursor up over the previous frame, so the summary printed at the
end stays in the terminal's scrollback with the last frame above it.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TextIO

#: Width of the progress bar, in characters.
BAR_WIDTH = 28


@dataclass(frozen=True, slots=True)
class TeeCounters:
    """One tee's counters, summed over its sink lanes."""

    offered: int = 0
    sent: int = 0
    dropped: int = 0
    failed: int = 0
    queued: int = 0
    in_flight: int = 0

    @property
    def settled(self) -> bool:
        """Nothing queued or in flight: ``sent == offered - dropped - failed`` must hold."""
        return self.queued == 0 and self.in_flight == 0

    @property
    def balanced(self) -> bool:
        """The tee's counting identity (offered = sent + dropped + failed + queued + in flight)."""
        return self.offered == (
            self.sent + self.dropped + self.failed + self.queued + self.in_flight
        )


@dataclass(frozen=True, slots=True)
class ProcessState:
    """One child process as the view shows it."""

    name: str
    pid: int
    ports: tuple[int, ...]
    alive: bool
    exit_code: int | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything the view and the summary show, at one instant."""

    elapsed_s: float
    requests_done: int
    requests_total: int
    trace_s: float
    trace_total_s: float
    speed: float | None
    lag_s: float
    routers: int
    workers: int
    capacity: int
    blocks: int
    hit_blocks: int
    recent_hit_rate: float | None
    pooled_hit_rate: float
    sim_hit_rate: float | None
    sim_requests: int
    worker_cv: float
    reasons: dict[str, int]
    match_calls: int
    match_failed: int
    #: Matches not answered in time (deadline, busy, circuit open): routed on load.
    match_late: int
    match_p50_ms: float | None
    match_p99_ms: float | None
    server_match_p50_ms: float | None
    server_match_p99_ms: float | None
    batches_published: int
    publish_failed: int
    tee: TeeCounters | None
    router_tee: TeeCounters
    xfer_transport: str
    xfer_started: int
    xfer_verified: int
    xfer_failed: int
    xfer_p50_ms: float | None
    xfer_p99_ms: float | None
    xfer_bytes: int
    errors: int
    recent_errors: tuple[str, ...]
    processes: tuple[ProcessState, ...]
    finished: bool = False
    interrupted: bool = False
    round_robin_hit_rate: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def hit_rate(self) -> float:
        """Prompt blocks found on the engine each request was routed to / all prompt blocks."""
        return self.hit_blocks / self.blocks if self.blocks else 0.0


def _pct(x: float | None) -> str:
    return "  -  " if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f} ms" if x < 10 else f"{x:.0f} ms"


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def _speed(s: Snapshot) -> str:
    return "no pacing" if s.speed is None else f"x{s.speed:g}"


def _bar(done: int, total: int) -> str:
    filled = 0 if total <= 0 else min(BAR_WIDTH, round(BAR_WIDTH * done / total))
    return "[" + "#" * filled + "." * (BAR_WIDTH - filled) + "]"


def _reasons(reasons: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(reasons.items(), key=lambda kv: -kv[1])) or "-"


def _tee_line(t: TeeCounters | None) -> str:
    if t is None:
        return "no answer yet"
    return (
        f"offered {t.offered}  sent {t.sent}  dropped {t.dropped}  failed {t.failed}"
        f"  queued {t.queued + t.in_flight}"
    )


def _processes(procs: Sequence[ProcessState]) -> str:
    up = sum(p.alive for p in procs)
    parts = [
        f"{p.name}:{p.ports[0]}" if p.alive else f"{p.name} EXITED({p.exit_code})"
        for p in procs
        if p.ports
    ]
    return f"{up}/{len(procs)} up  " + " ".join(parts)


def render(s: Snapshot, width: int = 100) -> list[str]:
    """The live view of one snapshot, one string per line (no trailing newlines)."""
    rate = s.requests_done / s.elapsed_s if s.elapsed_s > 0 else 0.0
    lag = f"  (behind the trace by {s.lag_s:.1f} s)" if s.lag_s > 1.0 else ""
    sim = (
        f"cache simulator {_pct(s.sim_hit_rate)} ({s.sim_requests} teed)"
        if s.sim_hit_rate is not None
        else "cache simulator -"
    )
    lines = [
        f"kvmesh up  ·  {s.workers} engines x {s.capacity} blocks  ·  {s.routers} routers  ·  "
        f"2 indexers on Redis  ·  trace {_speed(s)}  ·  {s.elapsed_s:5.1f} s",
        "",
        f"progress   {_bar(s.requests_done, s.requests_total)} {s.requests_done}/"
        f"{s.requests_total} requests  {rate:.0f} req/s  trace {s.trace_s:.0f}/"
        f"{s.trace_total_s:.0f} s{lag}",
        f"hit rate   {_pct(s.hit_rate)} of prompt blocks  (last 5 s {_pct(s.recent_hit_rate)})"
        f"   {sim}   pooled bound {_pct(s.pooled_hit_rate)}",
        f"worker CV  {s.worker_cv:.3f} requests per engine   decisions {_reasons(s.reasons)}",
        f"indexer    Match p50 {_ms(s.match_p50_ms)} p99 {_ms(s.match_p99_ms)} at the routers"
        f"  (server p50 {_ms(s.server_match_p50_ms)} p99 {_ms(s.server_match_p99_ms)})"
        f"  {s.match_calls} calls, {s.match_late} late, {s.match_failed} failed",
        f"events     {s.batches_published} KV event batches published over gRPC, "
        f"{s.publish_failed} failed",
        f"tee        {_tee_line(s.tee)}",
        f"xfer       {s.xfer_verified} transfers verified, {s.xfer_failed} failed"
        f"  p50 {_ms(s.xfer_p50_ms)} p99 {_ms(s.xfer_p99_ms)}  {_mib(s.xfer_bytes)} moved"
        f" ({s.xfer_transport})",
        f"errors     {s.errors}" + (f"  last: {s.recent_errors[-1]}" if s.recent_errors else ""),
        f"processes  {_processes(s.processes)}",
    ]
    return [line if len(line) <= width else line[: width - 1] + "…" for line in lines]


def progress_line(s: Snapshot) -> str:
    """One line for a non-interactive run (``--no-tty`` or output not a terminal)."""
    tee = f"tee sent {s.tee.sent}/{s.tee.offered}" if s.tee is not None else "tee -"
    return (
        f"[{s.elapsed_s:6.1f} s] {s.requests_done}/{s.requests_total} requests  "
        f"hit {_pct(s.hit_rate)}  CV {s.worker_cv:.3f}  {tee}  "
        f"xfer {s.xfer_verified} ok/{s.xfer_failed} failed  "
        f"Match p50 {_ms(s.match_p50_ms)}  errors {s.errors}"
    )


def summary(s: Snapshot) -> list[str]:
    """The summary printed at the end of a run."""
    how = "interrupted" if s.interrupted else "finished"
    alive = [p.name for p in s.processes if p.alive]
    bad_exit = [f"{p.name} ({p.exit_code})" for p in s.processes if p.exit_code not in (0, None)]
    procs = f"{len(s.processes)} started ({', '.join(p.name for p in s.processes)})"
    if alive:
        procs += f"; STILL RUNNING: {', '.join(alive)}"
    elif bad_exit:
        procs += f"; all stopped, non-zero exits: {', '.join(bad_exit)}"
    else:
        procs += "; all stopped cleanly"
    bound = f"pooled bound {_pct(s.pooled_hit_rate)}"
    if s.round_robin_hit_rate is not None:
        bound += f"; round robin on the same requests: {_pct(s.round_robin_hit_rate)}"
    tee = "no answer from the tee"
    if s.tee is not None:
        t = s.tee
        ok = t.settled and t.sent == t.offered - t.dropped - t.failed
        tee = (
            f"offered {t.offered}, sent {t.sent}, dropped {t.dropped}, failed {t.failed}"
            f" (sent == offered - dropped - failed: {'yes' if ok else 'NO'});"
            f" routers offered {s.router_tee.offered}"
        )
    lines = [
        f"kvmesh up {how} after {s.elapsed_s:.1f} s",
        f"  processes  {procs}",
        f"  requests   {s.requests_done} of {s.requests_total} routed by {s.routers} routers to "
        f"{s.workers} engines ({s.trace_s:.0f} s of trace, {_speed(s)})",
        f"  hit rate   {_pct(s.hit_rate)} of {s.blocks} prompt blocks ({s.hit_blocks} hits); "
        f"cache simulator {_pct(s.sim_hit_rate)}; {bound}",
        f"  worker CV  {s.worker_cv:.3f}",
        *_verdict(s),
        f"  decisions  {_reasons(s.reasons)}",
        f"  indexer    {s.match_calls} Matches ({s.match_late} past the deadline, "
        f"{s.match_failed} failed), p50 "
        f"{_ms(s.match_p50_ms)} p99 {_ms(s.match_p99_ms)} at the routers; "
        f"{s.batches_published} event batches ({s.publish_failed} failed)",
        f"  tee        {tee}",
        f"  xfer       {s.xfer_verified} of {s.xfer_started} transfers verified byte for byte "
        f"({s.xfer_failed} failed), p50 {_ms(s.xfer_p50_ms)} p99 {_ms(s.xfer_p99_ms)}, "
        f"{_mib(s.xfer_bytes)} over {s.xfer_transport}",
        f"  errors     {s.errors}",
    ]
    lines += [f"             {e}" for e in s.recent_errors]
    lines += [f"  note       {n}" for n in s.notes]
    return lines


def _verdict(s: Snapshot) -> list[str]:
    """One line putting the hit rate in context, when there is context."""
    if not s.blocks or not s.pooled_hit_rate:
        return []
    line = f"  verdict    routing reached {s.hit_rate / s.pooled_hit_rate:.0%} of the pooled bound"
    if s.round_robin_hit_rate:
        line += f", {s.hit_rate / s.round_robin_hit_rate:.1f}x the hits of round robin"
    return [line]


class LiveView:
    """Redraws :func:`render` in place on a terminal (plain ANSI escapes)."""

    def __init__(self, out: TextIO = sys.stdout) -> None:
        self.out = out
        self._lines = 0

    def draw(self, s: Snapshot) -> None:
        """Replace the previous frame with this snapshot's."""
        width = shutil.get_terminal_size((100, 24)).columns
        lines = render(s, width=max(40, width - 1))
        # Cursor up over the previous frame, then clear to the end of the screen.
        head = f"\x1b[{self._lines}F\x1b[J" if self._lines else ""
        self.out.write(head + "\n".join(lines) + "\n")
        self.out.flush()
        self._lines = len(lines)
