"""``kvmesh bench xfer``: prefill → decode KV transfer between two sidecar processes.

R concurrent rooms of P pages of S bytes, with fragmented page indices on
both sides (allocations made of runs of 1..``max_run`` pages in shuffled
order, as a busy engine's free list hands them out), each room sent in
chunks. One run measures:

- **serial** (the pre-async shape): one queue, one transfer in flight, and the
  engine waits for each chunk to land (Poll until its bytes show) before
  adding the next;
- **async** (the design): ``queues`` queues, writes pipelined, the engine adds
  every chunk of every room at once and only waits for Success: by default one
  PollRooms of its unfinished rooms at a time, which the decode sidecar answers
  when one of them changes (``--poll each``: a Poll per room with 0.5 ms sleeps,
  as engines did before PollRooms; ``<mode>_poll_calls_per_batch`` counts the
  calls). How the
  chunks reach the sidecar is ``--submit``: ``single`` (one
  AddTransferRequest per chunk, pipelined on the channel), ``batched`` (one
  AddTransferRequests per room carrying its chunks) or ``coalesced`` (one
  AddTransferRequest handed to the coalescing client per chunk, which sends
  what gathers within ``coalesce_window_s`` in one call); ``all`` runs the
  three against the same sidecars, batches interleaved;
- the limits: the transport's own (``nixl_raw_gbps``: a raw transport write of
  the same bytes as R large descriptors between two processes, no sidecar) and
  a plain ``memcpy`` of the same bytes.

Room latency is from the batch start (every room ready) to the decode side
reporting Success; each room is verified byte for byte after every batch.
The first transfer to a new peer is slower (connection setup): it is a
warm-up, reported separately. ``add_request_p99_us`` is the sidecar's own
cost of ``add_transfer_request`` (check + queue), measured in process;
``add_request_rpc_p99_us`` is the blocking gRPC call an engine makes on this
host (measured in the serial run; the async run pipelines its calls);
``add_requests_rpc_p50_us``/``_p99_us`` is one blocking AddTransferRequests of
64 one-page chunks (to a room not bootstrapped: checked and held, nothing
moves) on the async sidecars after the timed batches, :data:`RPC_CALLS` of
them, each followed by a Poll of its room (``poll_rpc_p50_us``/``_p99_us``:
what any call to the sidecar costs); ``bare_rpc_p50_us``/``_p99_us`` are as
many empty calls to a server that does nothing else, timed right after with
the sidecars still up (this host's floor for a call), and
``add_requests_rpc_p99_vs_bare`` the 64-chunk call's p99 over that floor's.
``<mode>_handover_ms``
is the engine's side of a batch: from the batch start until the sidecar has
answered every chunk. Figures without a mode prefix are the ``--submit``
mode's (coalesced under ``all``): the coalescing client is the engine path
the sidecar is built for, and with PollRooms the fastest of the three.

After the async run the prefill sidecar's ``kvmesh_xfer_stage_seconds`` is
scraped from its /metrics and printed as one row per stage (chunks or rooms
observed, mean, p50 estimated from the buckets): ``queue`` (queued until a
worker takes the chunk), ``submit`` (the transport's post of the write),
``transport`` (posted until the write is seen done), ``notify`` (per room: its
last write seen done until Success on the prefill side). The timed batches'
means are the figures ``xfer_stage_<stage>_mean_us``; the warm-up transfer is
scraped apart and printed as rows of its own. ``post_gbps`` is the bytes of the
timed writes over the seconds the sidecar's workers spent posting them
(``kvmesh_xfer_posted_bytes`` / ``kvmesh_xfer_post_seconds``; with UCX's CMA the
copy runs inside the post): the transport's rate inside the sidecar, and
``post_vs_raw`` its ratio to the raw post, which says how much of the gap to raw
is the copy itself and how much the hand-offs around it. ``<transport>_raw_fragmented_gbps``
posts the runs of a planned batch instead (its rooms' fragmented pages, one
descriptor per run) in one write: the raw rate of the layout the sidecar moves,
and ``post_vs_raw_fragmented`` the sidecar's copy against it.

**Prefetch** (NIXL only; ``--prefetch`` runs this part alone): the time from
dispatch (the request arrives at decode) to KV-ready, for ``--prefetch-requests``
requests each pulling a prefix of P fragmented pages from a sidecar that holds
it, two ways in one run, requests interleaved: **on demand** (at dispatch the
decode side issues the Prefetch and claims it at once: the pull is all on the
critical path) and **prefetched** (the router's Prefetch was sent
``--prefetch-lead-ms`` earlier, not waited for; at dispatch the engine claims,
after the Prefetch's answer if it has not come yet). KV-ready
is the ClaimPrefetch answer; every request's pages are compared with the
source's. Figures ``prefetch_ondemand_ms_*``, ``prefetch_prefetched_ms_*``
(mean, p50, p99), their ratios ``prefetch_speedup`` (means) and
``prefetch_speedup_p50`` (medians: a shared host's stalls move means), and
``prefetch_ready_share``: the prefetched claims that found the bytes there.

``--sweep`` repeats the async and serial runs over descriptor run sizes
(64 KiB, 1 MiB, 16 MiB: pages of that size, runs of one page)
and room counts (1, 4, 16, and 64 unless ``--quick``), each room carrying
``SWEEP_ROOM_BYTES`` (at least one page), and prints one row per cell next to
the raw transport and ``memcpy`` of the same bytes.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.floor import ServerProcess, time_sync_pings
from lab.bench.report import write_report
from lab.bench.xfer_procs import Sidecar
from lab.redisproc import free_port
from xfer.client import AddFuture, CoalescedAdd, XferClient
from xfer.config import PoolSettings, XferConfig
from xfer.logic import MAX_BATCH_ENTRIES, STAGES, ChunkRequest, RoomStatus, XferLogic
from xfer.pool import KVPool, PoolGeometry
from xfer.transport import Transport, make_transport, nixl_available, wait_state
from xfer.wire import byte_runs, merge_runs


@dataclass(frozen=True)
class BenchParams:
    """What one run moves."""

    transport: str = "nixl"
    rooms: int = 16
    pages: int = 64
    page_size: int = 64 * 1024
    chunks: int = 4
    max_run: int = 8
    queues: int = 4
    iters: int = 5
    nixl_threads: int = 0
    seed: int = 7
    #: How the async run hands chunks over: single, batched, coalesced or all.
    submit: str = "coalesced"
    #: How the decode engine waits for Success: rooms (PollRooms) or each (Poll).
    poll: str = "rooms"


#: Submission modes of the async run (``--submit all`` runs every one).
SUBMIT_MODES = ("single", "batched", "coalesced")

#: Chunks of the AddTransferRequests call whose latency is reported, and calls timed
#: (a p99 of 200 was the second-slowest call: it moved by half from run to run).
RPC_BATCH = 64
RPC_CALLS = 1000


def submit_modes(p: BenchParams) -> tuple[str, ...]:
    """The async submission modes one run measures."""
    return SUBMIT_MODES if p.submit == "all" else (p.submit,)


def primary_mode(p: BenchParams) -> str:
    """The mode whose figures are the unprefixed ``async_*`` ones."""
    return "coalesced" if p.submit == "all" else p.submit


STAGE_METRIC = "kvmesh_xfer_stage_seconds"


@dataclass
class StageHistogram:
    """One stage's ``kvmesh_xfer_stage_seconds`` as scraped: count, sum and the
    cumulative bucket counts by upper bound (the last is ``inf``)."""

    count: float = 0.0
    total: float = 0.0
    buckets: tuple[tuple[float, float], ...] = ()

    def minus(self, before: StageHistogram) -> StageHistogram:
        """What was observed since ``before`` (a scrape of the same histogram)."""
        if not before.buckets:
            return self
        if [le for le, _ in before.buckets] != [le for le, _ in self.buckets]:
            raise ValueError("the two scrapes have different buckets")
        return StageHistogram(
            self.count - before.count,
            self.total - before.total,
            tuple(
                (le, n - m) for (le, n), (_, m) in zip(self.buckets, before.buckets, strict=True)
            ),
        )

    @property
    def mean(self) -> float:
        """Mean seconds (0 without observations)."""
        return self.total / self.count if self.count else 0.0

    def quantile(self, q: float) -> float:
        """Seconds at quantile ``q``, interpolated linearly within its bucket (as
        Prometheus' ``histogram_quantile``); 0 without observations."""
        if not self.count:
            return 0.0
        rank = q * self.count
        lower, below = 0.0, 0.0
        for le, n in self.buckets:
            if n >= rank:
                if le == float("inf"):
                    return lower  # beyond the last finite bound: its bound
                return lower + (le - lower) * (rank - below) / max(n - below, 1e-12)
            lower, below = le, n
        return lower


def parse_stages(text: str) -> dict[str, StageHistogram]:
    """Each stage's histogram from a /metrics page (:data:`STAGES`; one missing
    from the page raises)."""
    raw: dict[str, dict[str, Any]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != STAGE_METRIC:
            continue
        for sample in family.samples:
            st = raw.setdefault(sample.labels.get("stage", ""), {"b": []})
            if sample.name.endswith("_bucket"):
                st["b"].append((float(sample.labels["le"]), float(sample.value)))
            elif sample.name.endswith("_count"):
                st["count"] = float(sample.value)
            elif sample.name.endswith("_sum"):
                st["sum"] = float(sample.value)
    missing = [s for s in STAGES if s not in raw]
    if missing:
        raise ValueError(f"{STAGE_METRIC} has no stage {', '.join(missing)}")
    return {
        s: StageHistogram(
            raw[s].get("count", 0.0), raw[s].get("sum", 0.0), tuple(sorted(raw[s]["b"]))
        )
        for s in STAGES
    }


def parse_posts(text: str) -> tuple[float, float]:
    """``(seconds, bytes)`` the prefill sidecar's workers spent in and handed to the
    transport's posts so far (``kvmesh_xfer_post_seconds``, ``kvmesh_xfer_posted_bytes``)."""
    got: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name in ("kvmesh_xfer_post_seconds", "kvmesh_xfer_posted_bytes"):
            got[family.name] = sum(
                float(x.value) for x in family.samples if x.name.endswith("_total")
            )
    return got.get("kvmesh_xfer_post_seconds", 0.0), got.get("kvmesh_xfer_posted_bytes", 0.0)


def stage_figures(stages: dict[str, StageHistogram]) -> dict[str, float]:
    """``xfer_stage_<stage>_mean_us`` of each stage."""
    return {f"xfer_stage_{s}_mean_us": h.mean * 1e6 for s, h in stages.items()}


def print_stages(stages: dict[str, dict[str, StageHistogram]]) -> None:
    """The stage split of the prefill sidecar: one row per stage of each part
    (``warm-up``, ``timed``)."""
    print(f"prefill stages ({STAGE_METRIC}; notify counts rooms, the others chunks)")
    print(f"{'part':<9}{'stage':<11}{'count':>8}{'mean us':>11}{'p50 us':>11}")
    for part, hs in stages.items():
        for s, h in hs.items():
            mean, p50 = h.mean * 1e6, h.quantile(0.5) * 1e6
            print(f"{part:<9}{s:<11}{h.count:>8.0f}{mean:>11.1f}{p50:>11.1f}")


def fragmented(n: int, total: int, max_run: int, rng: random.Random) -> list[list[int]]:
    """Split pages ``[0, total)`` into runs of 1..max_run, shuffle, deal ``n`` pages at a time."""
    runs: list[list[int]] = []
    i = 0
    while i < total:
        k = rng.randint(1, max_run)
        runs.append(list(range(i, min(total, i + k))))
        i += k
    rng.shuffle(runs)
    flat = [p for r in runs for p in r]
    return [flat[j : j + n] for j in range(0, len(flat) - n + 1, n)]


class _Pools:
    def __init__(self, p: BenchParams, tmpdir: str) -> None:
        # Twice the pages a batch needs, so fragmentation has room on both sides.
        self.geometry = PoolGeometry(p.page_size, 2 * p.rooms * p.pages, 64, 2 * p.rooms)
        self.prefill = KVPool.create(os.path.join(tmpdir, "prefill"), self.geometry)
        self.decode = KVPool.create(os.path.join(tmpdir, "decode"), self.geometry)
        np.frombuffer(self.prefill.view, dtype=np.uint8)[:] = np.random.default_rng(
            p.seed
        ).integers(0, 256, self.geometry.total_bytes, dtype=np.uint8)

    def close(self) -> None:
        for pool in (self.prefill, self.decode):
            pool.close()
            pool.unlink()


@dataclass
class _Room:
    room: int
    src: list[int]
    dst: list[int]
    aux_src: int
    aux_dst: int


def _plan(p: BenchParams, geo: PoolGeometry, rng: random.Random, base: int) -> list[_Room]:
    src = fragmented(p.pages, geo.page_count, p.max_run, rng)[: p.rooms]
    dst = fragmented(p.pages, geo.page_count, p.max_run, rng)[: p.rooms]
    return [_Room(base + i, src[i], dst[i], i, p.rooms + i) for i in range(p.rooms)]


def _verify(pools: _Pools, rooms: Sequence[_Room]) -> None:
    pv = np.frombuffer(pools.prefill.view, dtype=np.uint8)
    dv = np.frombuffer(pools.decode.view, dtype=np.uint8)
    ps = pools.geometry.page_size
    for r in rooms:
        for s, d in zip(r.src, r.dst, strict=True):
            if not np.array_equal(pv[s * ps : (s + 1) * ps], dv[d * ps : (d + 1) * ps]):
                raise AssertionError(f"room {r.room}: page {s} -> {d} differs")
        if bytes(pools.prefill.aux(r.aux_src)) != bytes(pools.decode.aux(r.aux_dst)):
            raise AssertionError(f"room {r.room}: aux differs")


def _run_batch(
    p: BenchParams,
    pools: _Pools,
    pc: XferClient,
    dc: XferClient,
    prefill_address: str,
    rooms: Sequence[_Room],
    mode: str,
    add_us: list[float],
) -> tuple[list[float], float, float, int]:
    """Run one batch (``mode``: serial or a submission mode); returns (per-room
    latency ms, wall seconds, handover seconds, Poll or PollRooms calls)."""
    np.frombuffer(pools.decode.view, dtype=np.uint8)[:] = 0
    for r in rooms:
        dc.register_room(r.room, prefill_address, r.dst, r.aux_dst)
    for r in rooms:  # every room bootstrapped before the clock starts
        while dc.poll(r.room)[0] == RoomStatus.BOOTSTRAPPING:
            time.sleep(0.0005)
    per = p.pages // p.chunks
    done: dict[int, float] = {}

    def args(r: _Room, c: int) -> ChunkRequest:
        lo, hi = c * per, (p.pages if c == p.chunks - 1 else (c + 1) * per)
        return (r.room, r.src[lo:hi], (lo, hi), c == p.chunks - 1, r.aux_src, c)

    t0 = time.perf_counter()
    if mode == "serial":
        for r in rooms:
            for c in range(p.chunks):
                t = time.perf_counter()
                pc.add_transfer_request(*args(r, c))
                add_us.append((time.perf_counter() - t) * 1e6)
                want = min(p.pages, (c + 1) * per) * p.page_size
                while True:  # the old engine blocked here until the chunk landed
                    st, reason, moved = pc.poll_bytes(r.room)
                    if st == RoomStatus.FAILED:
                        raise RuntimeError(f"room {r.room} failed: {reason}")
                    if st == RoomStatus.SUCCESS or moved >= want:
                        break
        handover = time.perf_counter() - t0
        polls = _wait_success(dc, [r.room for r in rooms], done, p.poll)
    else:
        # Two engines, as in a fleet: the prefill engine hands its chunks over (on a
        # thread of its own here) while the decode engine waits for its rooms. With
        # one thread doing both, each room's time held the whole handover and then
        # a PollRooms round trip, which no decode engine waits for.
        box: dict[str, Any] = {}

        def hand_over() -> None:
            try:
                if mode == "batched":
                    for r in rooms:
                        t = time.perf_counter()
                        pc.add_transfer_requests([args(r, c) for c in range(p.chunks)])
                        add_us.append((time.perf_counter() - t) * 1e6)
                else:
                    add: Callable[..., AddFuture | CoalescedAdd] = (
                        pc.add_transfer_request_coalesced
                        if mode == "coalesced"
                        else pc.add_transfer_request_nowait
                    )
                    futures = [add(*args(r, c)) for c in range(p.chunks) for r in rooms]
                    for f in futures:
                        f.result()
                box["handover"] = time.perf_counter() - t0
            except BaseException as e:
                box["error"] = e

        engine = threading.Thread(target=hand_over, name="bench-prefill-engine", daemon=True)
        engine.start()
        try:
            polls = _wait_success(
                dc, [r.room for r in rooms], done, p.poll, failed=lambda: "error" in box
            )
        finally:
            engine.join()
        if "error" in box:
            raise box["error"]
        handover = box["handover"]
    wall = max(done.values()) - t0
    _verify(pools, rooms)
    for r in rooms:
        dc.clear(r.room)
        pc.clear(r.room)
    return [(done[r.room] - t0) * 1e3 for r in rooms], wall, handover, polls


#: Longest wait of one PollRooms call of the bench's decode engine (s).
POLL_WAIT_S = 5.0


def _wait_success(
    dc: XferClient,
    pending: list[int],
    done: dict[int, float],
    how: str,
    failed: Callable[[], bool] = lambda: False,
) -> int:
    """Until every room of ``pending`` (each bootstrapped, waiting for input) is
    Success on decode, record when each was seen so in ``done``; returns the Poll
    or PollRooms calls made. ``how``: ``rooms`` (PollRooms of the unfinished rooms,
    answered when one changes) or ``each`` (a Poll per room, in order, stopping at
    the first unfinished, then 0.5 ms of sleep). Raises once ``failed()`` says the
    rooms' handover failed (they would never finish)."""
    calls = 0
    if how == "rooms":
        known: dict[int, RoomStatus] = {}
        while pending:
            if failed():
                raise RuntimeError("the handover failed")
            states = dc.poll_rooms(
                pending,
                POLL_WAIT_S,
                [known.get(r, RoomStatus.WAITING_FOR_INPUT) for r in pending],
            )
            calls += 1
            now = time.perf_counter()
            for s in states:
                if not s.found or s.status == RoomStatus.FAILED:
                    raise RuntimeError(f"room {s.room} failed: {s.failure_reason or 'gone'}")
                if s.status == RoomStatus.SUCCESS:
                    done[s.room] = now
                known[s.room] = s.status
            pending = [r for r in pending if r not in done]
        return calls
    # Rooms finish roughly in queue order: poll the pending ones in order and
    # stop at the first unfinished, so polling itself does not crowd the CPU.
    while pending:
        if failed():
            raise RuntimeError("the handover failed")
        while pending:
            st, reason = dc.poll(pending[0])
            calls += 1
            if st == RoomStatus.FAILED:
                raise RuntimeError(f"room {pending[0]} failed: {reason}")
            if st != RoomStatus.SUCCESS:
                break
            done[pending.pop(0)] = time.perf_counter()
        if pending:
            time.sleep(0.0005)
    return calls


def batched_rpc_us(
    pc: XferClient, geo: PoolGeometry, calls: int
) -> tuple[list[float], list[float]]:
    """Blocking AddTransferRequests of :data:`RPC_BATCH` one-page chunks, and a
    Poll of the same room after each (the sidecar's cheapest call: what any call
    costs there), in µs.

    Each call opens a room nobody bootstrapped: the sidecar checks and holds
    its chunks (the whole cost of the call, no transfer), then it is cleared."""
    adds, polls = [], []
    for k in range(calls):
        room = 10_000_000 + k
        entries: list[ChunkRequest] = [
            (room, [i % geo.page_count], (i, i + 1), i == RPC_BATCH - 1, 0, i)
            for i in range(RPC_BATCH)
        ]
        t = time.perf_counter()
        pc.add_transfer_requests(entries)
        t1 = time.perf_counter()
        pc.poll(room)
        polls.append((time.perf_counter() - t1) * 1e6)
        adds.append((t1 - t) * 1e6)
        pc.clear(room)
    return adds, polls


def bare_rpc_us(calls: int) -> list[float]:
    """Sequential empty unary calls to a server that does nothing else (grpc.aio on
    uvloop in a child process, as the sidecar; a blocking client, as the bench's
    engine), in µs: this host's floor for any call, measured beside the sidecar's."""
    with ServerProcess("aio-uvloop", "tcp", []) as srv:
        return time_sync_pings(srv.target, [], calls, warmup=100)


def run_mode(
    p: BenchParams,
    pools: _Pools,
    modes: Sequence[str],
    rpc_calls: int = RPC_CALLS,
    bare: bool = True,
) -> dict[str, Any]:
    """Start two sidecars, warm up, run ``iters`` batches of each of ``modes``
    (``("serial",)`` or submission modes, batches interleaved); return each mode's
    latencies and rates, and with submission modes the 64-chunk call's cost (and,
    with ``bare``, as many empty calls to a bare server beside it)."""
    serial = tuple(modes) == ("serial",)
    extra = ["--queues", "1", "--max-inflight-per-queue", "1"] if serial else [
        "--queues", str(p.queues)]  # fmt: skip
    extra += ["--nixl-threads", str(p.nixl_threads), "--heartbeat-interval-s", "2"]
    geo = pools.geometry
    rng = random.Random(p.seed)
    out: dict[str, Any] = {
        m: {"lat_ms": [], "walls": [], "add_us": [], "handover": [], "polls": []} for m in modes
    }
    metrics_port = 0 if serial else free_port()
    with (
        Sidecar(
            "prefill",
            pools.prefill.path,
            geo,
            transport=p.transport,
            extra=extra,
            metrics_port=metrics_port,
        ) as ps,  # fmt: skip
        Sidecar("decode", pools.decode.path, geo, transport=p.transport, extra=extra) as ds,
        XferClient(ps.address) as pc,
        XferClient(ds.address) as dc,
    ):
        warm = _plan(p, geo, rng, 1)[:1]
        t = time.perf_counter()
        _run_batch(p, pools, pc, dc, ps.address, warm, "single", [])
        out["warmup_ms"] = (time.perf_counter() - t) * 1e3
        warm_text = ps.metrics_text() if metrics_port else ""
        warm_stages = parse_stages(warm_text) if metrics_port else {}
        batch = 0
        calls0, chunks0 = pc.coalesced_calls, pc.coalesced_chunks
        for _ in range(p.iters):
            for m in modes:
                batch += 1
                rooms = _plan(p, geo, rng, 1000 * batch)
                o = out[m]
                lat, wall, handover, polls = _run_batch(
                    p, pools, pc, dc, ps.address, rooms, m, o["add_us"]
                )
                o["lat_ms"] += lat
                o["walls"].append(wall)
                o["handover"].append(handover)
                o["polls"].append(polls)
        if "coalesced" in modes:
            out["coalesced"]["calls"] = pc.coalesced_calls - calls0
            out["coalesced"]["chunks"] = pc.coalesced_chunks - chunks0
        if not serial:
            # Before the timed AddTransferRequests calls (held chunks: nothing moves).
            text = ps.metrics_text()
            timed = parse_stages(text)
            (s0, b0), (s1, b1) = parse_posts(warm_text), parse_posts(text)
            out["posts"] = (s1 - s0, b1 - b0)
            out["stages"] = {
                "warm-up": warm_stages,
                "timed": {s: h.minus(warm_stages[s]) for s, h in timed.items()},
            }
            out["rpc_us"], out["poll_us"] = batched_rpc_us(pc, geo, rpc_calls)
            # With the sidecars (and NIXL's threads) still up, as for the calls above.
            out["bare_us"] = bare_rpc_us(rpc_calls) if bare else []
    return out


def _raw_target(path: str, geo: PoolGeometry, kind: str, conn: Any, expecting: bool) -> None:
    pool = KVPool.attach(path, geo)
    tr = make_transport(kind, pool)
    got: list[bytes] = []
    tr.set_notif_handler(lambda peer, tag: got.append(tag))
    # As a decode sidecar with a room unfinished: a resting poller (NIXL's
    # IDLE_POLL_S) leaves a large write waiting for the receiver's progress,
    # about 50 ms a post, which is no limit of the transport.
    tr.set_expecting(expecting)
    tr.start()
    conn.send((tr.name, tr.metadata()))
    conn.recv()  # until the initiator is done
    tr.close()


def raw_gbps(
    p: BenchParams,
    pools: _Pools,
    *,
    target_expecting: bool = True,
    post_s: list[float] | None = None,
) -> tuple[float, float]:
    """The transport alone, to another process, each batch one post: R large writes
    (one descriptor per room's bytes), then the runs of a planned batch (fragmented
    as the sidecar's rooms are, one descriptor per run); GB/s of each. The receiver
    polls as a decode sidecar does while a room is unfinished (``target_expecting``
    False: it rests, as an idle one does). ``post_s`` gets each timed post's seconds."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_raw_target,
        args=(pools.decode.path, pools.geometry, p.transport, child, target_expecting),
    )
    proc.start()
    tr: Transport = make_transport(p.transport, pools.prefill, nixl_threads=p.nixl_threads)
    try:
        tr.start()
        name, md = parent.recv()
        tr.add_peer(name, md)
        room_bytes = p.pages * p.page_size
        large = [(i * room_bytes, i * room_bytes, room_bytes) for i in range(p.rooms)]
        plan = _plan(p, pools.geometry, random.Random(p.seed), 0)
        runs = [r for room in plan for r in byte_runs(merge_runs(room.src, room.dst), p.page_size)]
        return (
            _raw_rate(tr, name, large, p.iters, post_s),
            _raw_rate(tr, name, runs, p.iters, post_s),
        )
    finally:
        parent.send("done")
        proc.join(timeout=10)
        tr.close()


def _raw_rate(
    tr: Transport,
    peer: str,
    runs: list[tuple[int, int, int]],
    iters: int,
    post_s: list[float] | None = None,
) -> float:
    """GB/s of posting ``runs`` as one write, ``iters`` times after a warm-up
    (each post's seconds appended to ``post_s``)."""
    nbytes = sum(n for _, _, n in runs)
    rates = []
    for it in range(iters + 1):
        t = time.perf_counter()
        h = tr.post(peer, runs, b"raw")
        if wait_state(tr, h, 60) != "DONE":
            raise RuntimeError("raw transfer failed")
        tr.release(h)
        if it:  # the first is the warm-up
            took = time.perf_counter() - t
            rates.append(nbytes / took / 1e9)
            if post_s is not None:
                post_s.append(took)
    return statistics.mean(rates)


def memcpy_gbps(p: BenchParams) -> float:
    """A plain copy of the same bytes in one process."""
    n = p.rooms * p.pages * p.page_size
    a = np.ones(n, dtype=np.uint8)
    b = np.empty_like(a)
    np.copyto(b, a)
    rates = []
    for _ in range(p.iters):
        t = time.perf_counter()
        np.copyto(b, a)
        rates.append(n / (time.perf_counter() - t) / 1e9)
    return statistics.mean(rates)


def add_request_cost_us(p: BenchParams, n: int = 20000) -> list[float]:
    """The sidecar's own add_transfer_request (check + queue), in process, in µs."""
    with tempfile.TemporaryDirectory() as d:
        geo = PoolGeometry(p.page_size, 4096, 64, 16)
        pool = KVPool.create(os.path.join(d, "pool"), geo)
        cfg = XferConfig(
            role="prefill",
            transport="tcp",
            pool=PoolSettings(path=pool.path, page_size=geo.page_size, page_count=4096),
        )
        tr = make_transport("tcp", pool)
        logic = XferLogic(cfg, pool, tr)  # workers not started: only the enqueue is timed
        tr.add_peer("peer", tr.metadata())
        per = p.pages // p.chunks
        rng = random.Random(p.seed)
        out = []
        for room in range(n // p.chunks):
            logic.bootstrap(
                room=room, generation=1, dst_pages=rng.sample(range(4096), p.pages),
                aux_index=0, peer_name="peer", peer_address="", metadata=b"",
                geometry=geo, transport_kind="tcp",
            )  # fmt: skip
            src = rng.sample(range(4096), p.pages)
            for c in range(p.chunks):
                t = time.perf_counter()
                logic.add_transfer_request(
                    room, src[c * per : (c + 1) * per], (c * per, (c + 1) * per),
                    c == p.chunks - 1, 0, c,
                )  # fmt: skip
                out.append((time.perf_counter() - t) * 1e6)
        tr.close()
        pool.close()
        return out


#: Requests and lead time of the prefetch part.
PREFETCH_REQUESTS = 24
PREFETCH_LEAD_MS = 50.0


def _same_pages(pools: _Pools, src: Sequence[int], dst: Sequence[int]) -> bool:
    pv = np.frombuffer(pools.prefill.view, dtype=np.uint8)
    dv = np.frombuffer(pools.decode.view, dtype=np.uint8)
    ps = pools.geometry.page_size
    return all(
        np.array_equal(pv[s * ps : (s + 1) * ps], dv[d * ps : (d + 1) * ps])
        for s, d in zip(src, dst, strict=True)
    )


def run_prefetch(p: BenchParams, pools: _Pools, requests: int, lead_ms: float) -> dict[str, float]:
    """Dispatch -> KV-ready of ``requests`` requests on demand and prefetched ``lead_ms``
    earlier, interleaved, against one holder (prefill) and one decode sidecar."""
    from xfer.prefetch import ClaimOutcome

    geo = pools.geometry
    rng = random.Random(p.seed + 1)
    extra = ["--heartbeat-interval-s", "2", "--nixl-threads", str(p.nixl_threads)]
    lat: dict[str, list[float]] = {"ondemand": [], "prefetched": []}
    ready = 0
    with (
        Sidecar("prefill", pools.prefill.path, geo, transport="nixl", extra=extra) as holder,
        Sidecar("decode", pools.decode.path, geo, transport="nixl", extra=extra) as ds,
        XferClient(ds.address) as dc,
    ):
        for i in range(requests + 1):  # the first pair is the warm-up (connection setup)
            for mode in ("ondemand", "prefetched"):
                r = _plan(p, geo, rng, 0)[0]
                for d in r.dst:  # nothing of the source there before the pull
                    pools.decode.page(d)[:] = bytes(geo.page_size)
                pid = 1 + 2 * i + (mode == "prefetched")
                issued = None
                if mode == "prefetched":  # the router issues it, lead_ms before dispatch
                    t_issue = time.perf_counter()
                    issued = dc.prefetch_nowait(holder.address, r.src, r.dst, prefetch_id=pid)
                    time.sleep(max(0.0, t_issue + lead_ms / 1000 - time.perf_counter()))
                t0 = time.perf_counter()  # dispatch: the request arrives at decode
                if mode == "ondemand":
                    dc.prefetch(holder.address, r.src, r.dst, prefetch_id=pid)
                elif issued is not None and not issued.done():
                    # Issued but not yet answered: the claim must come after it.
                    issued.result()
                outcome, _, reason, _ = dc.claim_prefetch(pid, timeout_ms=30_000)
                took = (time.perf_counter() - t0) * 1e3
                if issued is not None:
                    issued.result()  # raises the Prefetch's refusal, if any
                if outcome not in (ClaimOutcome.READY, ClaimOutcome.WAITED):
                    raise RuntimeError(f"request {i} ({mode}): {outcome.name}: {reason}")
                if not _same_pages(pools, r.src, r.dst):
                    raise AssertionError(f"request {i} ({mode}): a page differs from the source")
                if i:
                    lat[mode].append(took)
                    ready += mode == "prefetched" and outcome == ClaimOutcome.READY
    on, pre = lat["ondemand"], lat["prefetched"]
    return {
        "prefetch_lead_ms": lead_ms,
        "prefetch_prefix_mib": p.pages * p.page_size / 2**20,
        "prefetch_ondemand_ms_mean": statistics.mean(on),
        "prefetch_ondemand_ms_p50": percentile(on, 0.5),
        "prefetch_ondemand_ms_p99": percentile(on, 0.99),
        "prefetch_prefetched_ms_mean": statistics.mean(pre),
        "prefetch_prefetched_ms_p50": percentile(pre, 0.5),
        "prefetch_prefetched_ms_p99": percentile(pre, 0.99),
        "prefetch_speedup": statistics.mean(on) / statistics.mean(pre),
        "prefetch_speedup_p50": percentile(on, 0.5) / percentile(pre, 0.5),
        "prefetch_ready_share": ready / len(pre),
    }


def prefetch_only(p: BenchParams, requests: int, lead_ms: float) -> dict[str, float]:
    """The prefetch part alone (``--prefetch``)."""
    with tempfile.TemporaryDirectory(prefix="kvx-bench-", dir=_shm_dir()) as d:
        pools = _Pools(p, d)
        try:
            progress.phase(f"prefetch: {requests} requests, on demand and {lead_ms:g} ms ahead")
            return run_prefetch(p, pools, requests, lead_ms)
        finally:
            pools.close()


def _mode_figures(
    m: str, o: dict[str, Any], serial: dict[str, Any], total: int, raw: float
) -> dict[str, float]:
    """The figures of submission mode ``m``, prefixed with it."""
    gbps = statistics.mean(total / w / 1e9 for w in o["walls"])
    return {
        f"{m}_async_mean_ms": statistics.mean(o["lat_ms"]),
        f"{m}_async_p99_ms": percentile(o["lat_ms"], 0.99),
        f"{m}_async_gbps": gbps,
        f"{m}_speedup": statistics.mean(serial["lat_ms"]) / statistics.mean(o["lat_ms"]),
        f"{m}_vs_raw": gbps / raw,
        f"{m}_handover_ms": statistics.mean(o["handover"]) * 1e3,
        f"{m}_poll_calls_per_batch": statistics.mean(o["polls"]),
    }


def _bare_figures(rpc_us: list[float], bare_us: list[float]) -> dict[str, float]:
    """The bare server's empty calls, and the 64-chunk call's p99 over theirs (none
    without them)."""
    if not bare_us:
        return {}
    p99 = percentile(bare_us, 0.99)
    return {
        "bare_rpc_p50_us": percentile(bare_us, 0.5),
        "bare_rpc_p99_us": p99,
        "add_requests_rpc_p99_vs_bare": percentile(rpc_us, 0.99) / p99,
    }


def run(
    p: BenchParams,
    costs: bool = True,
    stages: dict[str, dict[str, StageHistogram]] | None = None,
    prefetch: tuple[int, float] | None = None,
    rpc_calls: int = RPC_CALLS,
) -> dict[str, float]:
    """Run every part; return the figures (``costs``: also memcpy and the
    in-process AddTransferRequest cost, and ``rpc_calls`` timed 64-chunk
    calls rather than 10). ``stages``, when given, receives the async run's
    prefill stage histograms (``warm-up`` and ``timed``). ``prefetch``: requests
    and lead time of the prefetch part (NIXL only), run after the others."""
    modes = submit_modes(p)
    pf_figures: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="kvx-bench-", dir=_shm_dir()) as d:
        pools = _Pools(p, d)
        try:
            progress.phase(f"{p.transport}: serial transfers")
            serial = run_mode(p, pools, ("serial",))["serial"]
            progress.phase(f"{p.transport}: async transfers ({', '.join(modes)})")
            asyn = run_mode(p, pools, modes, rpc_calls if costs else 10, bare=costs)
            progress.phase(f"{p.transport}: raw transport")
            raw, raw_fragmented = raw_gbps(p, pools)
            if prefetch is not None and p.transport == "nixl":
                requests, lead_ms = prefetch
                progress.phase(f"prefetch: {requests} requests, on demand and {lead_ms:g} ms ahead")
                pf_figures = run_prefetch(p, pools, requests, lead_ms)
        finally:
            pools.close()
    total = p.rooms * p.pages * p.page_size
    plan = _plan(p, PoolGeometry(p.page_size, 2 * p.rooms * p.pages), random.Random(p.seed), 0)
    n_runs = sum(len(merge_runs(r.src, r.dst)) for r in plan)
    mean_run = p.page_size * p.pages * p.rooms / n_runs
    per_mode: dict[str, float] = {}
    for m in modes:
        per_mode.update(_mode_figures(m, asyn[m], serial, total, raw))
    if "coalesced" in modes:
        c = asyn["coalesced"]
        per_mode["coalesced_chunks_per_call"] = c["chunks"] / max(1, c["calls"])
    pm = primary_mode(p)
    post_s, posted = asyn["posts"]
    post_gbps = posted / post_s / 1e9 if post_s > 0 else 0.0
    figures = {
        "serial_mean_ms": statistics.mean(serial["lat_ms"]),
        "async_mean_ms": per_mode[f"{pm}_async_mean_ms"],
        "async_p99_ms": per_mode[f"{pm}_async_p99_ms"],
        "speedup": per_mode[f"{pm}_speedup"],
        "async_gbps": per_mode[f"{pm}_async_gbps"],
        "serial_gbps": statistics.mean(total / w / 1e9 for w in serial["walls"]),
        f"{p.transport}_raw_gbps": raw,
        f"{p.transport}_raw_fragmented_gbps": raw_fragmented,
        "add_request_rpc_p99_us": percentile(serial["add_us"], 0.99),
        "add_requests_rpc_p50_us": percentile(asyn["rpc_us"], 0.5),
        "add_requests_rpc_p99_us": percentile(asyn["rpc_us"], 0.99),
        "poll_rpc_p50_us": percentile(asyn["poll_us"], 0.5),
        "poll_rpc_p99_us": percentile(asyn["poll_us"], 0.99),
        **_bare_figures(asyn["rpc_us"], asyn["bare_us"]),
        "warmup_ms": asyn["warmup_ms"],
        "mean_run_kib": mean_run / 1024,
        "async_vs_raw": per_mode[f"{pm}_vs_raw"],
        # The copy's own rate inside the sidecar (every timed mode's writes).
        "post_gbps": post_gbps,
        "post_vs_raw": post_gbps / raw,
        "post_vs_raw_fragmented": post_gbps / raw_fragmented,
        **per_mode,
        **stage_figures(asyn["stages"]["timed"]),
        **pf_figures,
    }
    if stages is not None:
        stages.update(asyn["stages"])
    if costs:
        progress.phase("memcpy and AddRequest cost")
        figures["memcpy_gbps"] = memcpy_gbps(p)
        figures["add_request_p99_us"] = percentile(add_request_cost_us(p), 0.99)
    return figures


#: Run sizes and room counts of ``--sweep`` (64 rooms only without ``--quick``).
SWEEP_RUNS = (64 * 1024, 1024 * 1024, 16 * 1024 * 1024)
SWEEP_ROOMS = (1, 4, 16, 64)
#: Bytes each room of a sweep cell carries (at least one page of the run size).
SWEEP_ROOM_BYTES = 4 * 1024 * 1024


def sweep_params(p: BenchParams, run_bytes: int, rooms: int) -> BenchParams:
    """One sweep cell: pages of ``run_bytes``, never adjacent (``max_run`` 1), as many
    per room as :data:`SWEEP_ROOM_BYTES` holds, in up to ``p.chunks`` chunks."""
    pages = max(1, SWEEP_ROOM_BYTES // run_bytes)
    chunks = max(c for c in range(1, min(p.chunks, pages) + 1) if pages % c == 0)
    return replace(
        p, rooms=rooms, pages=pages, page_size=run_bytes, chunks=chunks, max_run=1,
        submit=primary_mode(p),
    )  # fmt: skip


def run_sweep(p: BenchParams, quick: bool) -> list[dict[str, float]]:
    """Every cell of the sweep; one row of figures each."""
    rows = []
    for run_bytes in SWEEP_RUNS:
        for rooms in SWEEP_ROOMS if not quick else SWEEP_ROOMS[:-1]:
            c = sweep_params(p, run_bytes, rooms)
            progress.phase(f"sweep: runs of {run_bytes // 1024} KiB, {rooms} rooms")
            t = time.perf_counter()
            f = run(c, costs=False)
            rows.append(
                {
                    "run_kib": run_bytes / 1024,
                    "rooms": rooms,
                    "pages": c.pages,
                    "batch_mib": c.rooms * c.pages * c.page_size / 2**20,
                    "mean_run_kib": f["mean_run_kib"],
                    "async_gbps": f["async_gbps"],
                    "raw_gbps": f[f"{p.transport}_raw_gbps"],
                    "async_vs_raw": f["async_vs_raw"],
                    "speedup": f["speedup"],
                    "memcpy_gbps": memcpy_gbps(c),
                    "seconds": time.perf_counter() - t,
                    **_cell_split(c, f, p.transport),
                }
            )
    return rows


def _cell_split(c: BenchParams, f: dict[str, float], transport: str) -> dict[str, float]:
    """Where a sweep cell's time goes, in ms: a batch on the async path (all its rooms
    ready until the last one's Success reached the engine) against the raw post of the
    same bytes, the engine's handover (until the sidecar answered every chunk), and
    the prefill sidecar's stages (means: a chunk's queue, submit and transport, a
    room's notify)."""
    batch_bytes = c.rooms * c.pages * c.page_size
    mode = primary_mode(c)
    return {
        "batch_ms": batch_bytes / f["async_gbps"] / 1e6,
        "raw_ms": batch_bytes / f[f"{transport}_raw_gbps"] / 1e6,
        "room_ms": f["async_mean_ms"],
        "handover_ms": f[f"{mode}_handover_ms"],
        **{
            f"{stage}_ms": f.get(f"xfer_stage_{stage}_mean_us", 0.0) / 1e3
            for stage in ("queue", "submit", "transport", "notify")
        },
    }


def print_sweep(rows: Sequence[dict[str, float]], p: BenchParams) -> None:
    """The sweep as one table."""
    print(
        f"kvmesh bench xfer --sweep: transport {p.transport}, submit {primary_mode(p)}, "
        f"{p.queues} queues, {p.iters} batches per cell, "
        f"{SWEEP_ROOM_BYTES // 2**20} MiB (at least one page) per room"
    )
    print(
        f"{'run KiB':>8}{'rooms':>6}{'MiB':>7}{'async GB/s':>11}{'raw GB/s':>10}"
        f"{'ratio':>7}{'speedup':>8}{'memcpy':>8}{'s':>6}"
    )
    for r in rows:
        print(
            f"{r['run_kib']:>8.0f}{r['rooms']:>6.0f}{r['batch_mib']:>7.0f}"
            f"{r['async_gbps']:>11.3f}{r['raw_gbps']:>10.3f}{r['async_vs_raw']:>7.2f}"
            f"{r['speedup']:>8.2f}{r['memcpy_gbps']:>8.2f}{r['seconds']:>6.1f}"
        )
    print()
    print(
        "where a batch's time goes, ms: the async batch and the raw post of its bytes; "
        "a room (mean); the engine's handover; the prefill sidecar's stages (means)"
    )
    print(
        f"{'run KiB':>8}{'rooms':>6}{'batch':>8}{'raw':>7}{'room':>8}{'handover':>9}"
        f"{'queue':>7}{'submit':>8}{'transport':>10}{'notify':>7}"
    )
    for r in rows:
        print(
            f"{r['run_kib']:>8.0f}{r['rooms']:>6.0f}{r['batch_ms']:>8.2f}{r['raw_ms']:>7.2f}"
            f"{r['room_ms']:>8.2f}{r['handover_ms']:>9.2f}{r['queue_ms']:>7.2f}"
            f"{r['submit_ms']:>8.2f}{r['transport_ms']:>10.2f}{r['notify_ms']:>7.2f}"
        )


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


_TARGETS = {
    "speedup": ">= 4 (16 rooms)",
    "async_vs_raw": ">= 0.8 (runs >= 1 MiB)",
    "add_request_p99_us": "<= 100",
    "add_requests_rpc_p99_us": "<= 1000 (64 chunks)",
}


def print_table(figures: dict[str, float], p: BenchParams) -> None:
    """The figures as one table."""
    print(
        f"kvmesh bench xfer: transport {p.transport}, {p.rooms} rooms x {p.pages} pages x "
        f"{p.page_size} B in {p.chunks} chunks, runs of 1..{p.max_run} pages, "
        f"{p.queues} queues, {p.iters} batches"
    )
    print(f"{'figure':<30}{'value':>12}  target")
    for k, v in figures.items():
        print(f"{k:<30}{v:>12.3f}  {_TARGETS.get(k, '')}")


def print_prefetch(figures: dict[str, float], p: BenchParams) -> None:
    """The prefetch part: dispatch -> KV-ready both ways and their ratio."""
    f = figures
    print(
        f"prefetch: dispatch -> KV-ready, prefix of {p.pages} pages x {p.page_size} B "
        f"({f['prefetch_prefix_mib']:.1f} MiB), prefetch {f['prefetch_lead_ms']:g} ms ahead"
    )
    print(f"{'':<12}{'mean ms':>10}{'p50 ms':>10}{'p99 ms':>10}")
    for mode in ("ondemand", "prefetched"):
        print(
            f"{mode:<12}{f[f'prefetch_{mode}_ms_mean']:>10.3f}"
            f"{f[f'prefetch_{mode}_ms_p50']:>10.3f}{f[f'prefetch_{mode}_ms_p99']:>10.3f}"
        )
    print(
        f"ratio (on demand / prefetched): means {f['prefetch_speedup']:.2f}, medians "
        f"{f['prefetch_speedup_p50']:.2f}; prefetched claims that found the bytes there: "
        f"{f['prefetch_ready_share']:.0%}"
    )


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``kvmesh bench xfer``."""
    d = BenchParams()
    ap = argparse.ArgumentParser(
        prog="kvmesh bench xfer",
        description=__doc__.split("\n")[0],
        formatter_class=HelpFormatter,
    )
    ap.add_argument(
        "--transport",
        choices=["nixl", "tcp"],
        default=None,
        help="KV transfer transport (default: nixl when installed, else tcp)",
    )
    sizes = {
        "rooms": "rooms (transfers) per batch",
        "pages": "KV pages per room",
        "page_size": "bytes per page",
        "chunks": "chunks each room's pages are sent in",
        "max_run": "longest run of adjacent pages (the pages of a room are fragmented)",
        "queues": "transfer queues of each sidecar",
    }
    for f, what in sizes.items():
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f), help=what)
    ap.add_argument(
        "--iters",
        type=int,
        default=None,
        help=f"timed batches of each mode (default: {d.iters}, 1 with --quick)",
    )
    ap.add_argument(
        "--submit",
        choices=[*SUBMIT_MODES, "all"],
        default=d.submit,
        help="how the async run hands chunks to the sidecar: one AddTransferRequest per "
        "chunk (single), one AddTransferRequests per room (batched), through the "
        "coalescing client (coalesced), or each of them against the same sidecars (all)",
    )
    ap.add_argument(
        "--poll",
        choices=["rooms", "each"],
        default=d.poll,
        help="how the decode engine waits for Success: one PollRooms of its unfinished "
        "rooms, answered when one changes (rooms), or a Poll per room with 0.5 ms sleeps "
        "(each)",
    )
    ap.add_argument(
        "--sweep",
        action="store_true",
        help="run sizes 64 KiB, 1 MiB, 16 MiB x rooms 1, 4, 16, 64 (async in the --submit "
        "mode, coalesced under all; serial, raw transport, memcpy) and print one row per "
        "cell instead of the figures",
    )
    ap.add_argument(
        "--quick", action="store_true", help="1 batch per mode; --sweep without 64 rooms"
    )
    ap.add_argument(
        "--nixl-threads",
        type=int,
        default=d.nixl_threads,
        help="NIXL UCX backend worker threads (0: NIXL's default)",
    )
    ap.add_argument(
        "--prefetch",
        action="store_true",
        help="run only the prefetch part: dispatch to KV-ready on demand and prefetched "
        "(NIXL; the full run includes it when the transport is nixl)",
    )
    ap.add_argument(
        "--prefetch-requests",
        type=int,
        default=PREFETCH_REQUESTS,
        help="requests of the prefetch part, each way",
    )
    ap.add_argument(
        "--prefetch-lead-ms",
        type=float,
        default=PREFETCH_LEAD_MS,
        help="how long before dispatch the prefetch is issued",
    )
    ap.add_argument(
        "--rpc-calls",
        type=int,
        default=RPC_CALLS,
        help="timed 64-chunk AddTransferRequests calls, and as many empty calls to a bare "
        "server beside them",
    )
    ap.add_argument("--json", dest="json_path", help="also write figures and params here")
    return ap


def main(argv: Sequence[str]) -> int:
    """Entry point of ``kvmesh bench xfer``; returns an exit code."""
    a = build_parser().parse_args(list(argv))
    # NIXL logs every agent creation at INFO; keep the table readable.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_LOG_LEVEL", "error")
    transport = a.transport or ("nixl" if nixl_available() else "tcp")
    for f in ("rooms", "pages", "page_size", "chunks", "max_run", "queues", "iters"):
        if getattr(a, f) is not None and getattr(a, f) < 1:
            print(f"kvmesh bench xfer: --{f.replace('_', '-')} must be >= 1", file=sys.stderr)
            return 2
    if a.pages % a.chunks:
        print("kvmesh bench xfer: --pages must be a multiple of --chunks", file=sys.stderr)
        return 2
    if a.chunks > MAX_BATCH_ENTRIES:
        print(
            f"kvmesh bench xfer: --chunks over {MAX_BATCH_ENTRIES}: a room's chunks must fit "
            "one AddTransferRequests call",
            file=sys.stderr,
        )
        return 2
    iters = a.iters if a.iters is not None else (1 if a.quick else BenchParams.iters)
    p = BenchParams(
        transport=transport, rooms=a.rooms, pages=a.pages, page_size=a.page_size,
        chunks=a.chunks, max_run=a.max_run, queues=a.queues, iters=iters,
        nixl_threads=a.nixl_threads, submit=a.submit, poll=a.poll,
    )  # fmt: skip
    if a.rpc_calls < 1:
        print("kvmesh bench xfer: --rpc-calls must be >= 1", file=sys.stderr)
        return 2
    if a.prefetch_requests < 1 or a.prefetch_lead_ms < 0:
        print(
            "kvmesh bench xfer: --prefetch-requests must be >= 1 and --prefetch-lead-ms >= 0",
            file=sys.stderr,
        )
        return 2
    if a.prefetch:
        if transport != "nixl":
            print("kvmesh bench xfer: --prefetch needs NIXL (a READ)", file=sys.stderr)
            return 2
        pf = prefetch_only(p, a.prefetch_requests, a.prefetch_lead_ms)
        print_prefetch(pf, p)
        if a.json_path:
            write_report(a.json_path, pf, asdict(p))
        return 0
    if a.sweep:
        rows = run_sweep(p, a.quick)
        print_sweep(rows, p)
        if a.json_path:
            write_report(a.json_path, None, asdict(p), sweep=rows)
        return 0
    stages: dict[str, dict[str, StageHistogram]] = {}
    figures = run(
        p,
        stages=stages,
        prefetch=(a.prefetch_requests, a.prefetch_lead_ms),
        rpc_calls=a.rpc_calls,
    )
    print_table(figures, p)
    print()
    print_stages(stages)
    if "prefetch_speedup" in figures:
        print()
        print_prefetch(figures, p)
    if a.json_path:
        split = {
            part: {s: {"count": h.count, "mean_us": h.mean * 1e6, "p50_us": h.quantile(0.5) * 1e6}
                   for s, h in hs.items()}
            for part, hs in stages.items()
        }  # fmt: skip
        write_report(a.json_path, figures, asdict(p), stages=split)
    return 0
