"""``kvmesh bench xfer``: prefill → decode KV transfer between two sidecar processes.

R concurrent rooms of P pages of S bytes, with fragmented page indices on
both sides (allocations made of runs of 1..``max_run`` pages in shuffled
order, as a busy engine's free list hands them out), each room sent in
chunks. One run measures:

- **serial** (the pre-async shape): one queue, one transfer in flight, and the
  engine waits for each chunk to land (Poll until its bytes show) before
  adding the next;
- **async** (the design): ``queues`` queues, writes pipelined, the engine adds
  every chunk of every room at once and only polls for Success;
- the limits: the transport's own (``nixl_raw_gbps``: a raw transport write of
  the same bytes as R large descriptors between two processes, no sidecar) and
  a plain ``memcpy`` of the same bytes.

Room latency is from the batch start (every room ready) to the decode side
reporting Success; each room is verified byte for byte after every batch.
The first transfer to a new peer is slower (connection setup): it is a
warm-up, reported separately. ``add_request_p99_us`` is the sidecar's own
cost of ``add_transfer_request`` (check + queue), measured in process;
``add_request_rpc_p99_us`` is the blocking gRPC call an engine makes on this
host (measured in the serial run; the async run pipelines its calls).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from kvmesh import progress
from kvmesh.clihelp import HelpFormatter
from kvmesh.stats import percentile
from lab.bench.report import write_report
from lab.bench.xfer_procs import Sidecar
from xfer.client import AddFuture, XferClient
from xfer.config import PoolSettings, XferConfig
from xfer.logic import RoomStatus, XferLogic
from xfer.pool import KVPool, PoolGeometry
from xfer.transport import Transport, make_transport, nixl_available, wait_state
from xfer.wire import merge_runs


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
    serial: bool,
    add_us: list[float],
) -> tuple[list[float], float]:
    """Run one batch; returns (per-room latency ms, wall seconds)."""
    np.frombuffer(pools.decode.view, dtype=np.uint8)[:] = 0
    for r in rooms:
        dc.register_room(r.room, prefill_address, r.dst, r.aux_dst)
    for r in rooms:  # every room bootstrapped before the clock starts
        while dc.poll(r.room)[0] == RoomStatus.BOOTSTRAPPING:
            time.sleep(0.0005)
    per = p.pages // p.chunks
    done: dict[int, float] = {}
    t0 = time.perf_counter()

    def chunk(r: _Room, c: int) -> AddFuture | None:
        lo, hi = c * per, (p.pages if c == p.chunks - 1 else (c + 1) * per)
        args = (r.room, r.src[lo:hi], (lo, hi), c == p.chunks - 1, r.aux_src, c)
        t = time.perf_counter()
        fut = None
        if serial:
            pc.add_transfer_request(*args)
        else:
            fut = pc.add_transfer_request_nowait(*args)
        add_us.append((time.perf_counter() - t) * 1e6)
        return fut

    if serial:
        for r in rooms:
            for c in range(p.chunks):
                chunk(r, c)
                want = min(p.pages, (c + 1) * per) * p.page_size
                while True:  # the old engine blocked here until the chunk landed
                    st, reason, moved = pc.poll_bytes(r.room)
                    if st == RoomStatus.FAILED:
                        raise RuntimeError(f"room {r.room} failed: {reason}")
                    if st == RoomStatus.SUCCESS or moved >= want:
                        break
    else:
        futures = [chunk(r, c) for c in range(p.chunks) for r in rooms]
        for f in futures:
            assert f is not None
            f.result()
    # Rooms finish roughly in queue order: poll the pending ones in order and
    # stop at the first unfinished, so polling itself does not crowd the CPU.
    pending = [r.room for r in rooms]
    while pending:
        while pending:
            st, reason = dc.poll(pending[0])
            if st == RoomStatus.FAILED:
                raise RuntimeError(f"room {pending[0]} failed: {reason}")
            if st != RoomStatus.SUCCESS:
                break
            done[pending.pop(0)] = time.perf_counter()
        if pending:
            time.sleep(0.0005)
    wall = max(done.values()) - t0
    _verify(pools, rooms)
    for r in rooms:
        dc.clear(r.room)
        pc.clear(r.room)
    return [(done[r.room] - t0) * 1e3 for r in rooms], wall


def run_mode(p: BenchParams, pools: _Pools, serial: bool) -> dict[str, Any]:
    """Start two sidecars, warm up, run ``iters`` batches; return latencies and rates."""
    extra = ["--queues", "1", "--max-inflight-per-queue", "1"] if serial else [
        "--queues", str(p.queues)]  # fmt: skip
    extra += ["--nixl-threads", str(p.nixl_threads), "--heartbeat-interval-s", "2"]
    geo = pools.geometry
    rng = random.Random(p.seed)
    out: dict[str, Any] = {"lat_ms": [], "walls": [], "add_us": []}
    with (
        Sidecar("prefill", pools.prefill.path, geo, transport=p.transport, extra=extra) as ps,
        Sidecar("decode", pools.decode.path, geo, transport=p.transport, extra=extra) as ds,
        XferClient(ps.address) as pc,
        XferClient(ds.address) as dc,
    ):
        warm = _plan(p, geo, rng, 1)[:1]
        t = time.perf_counter()
        _run_batch(p, pools, pc, dc, ps.address, warm, False, [])
        out["warmup_ms"] = (time.perf_counter() - t) * 1e3
        for it in range(p.iters):
            rooms = _plan(p, geo, rng, 1000 * (it + 1))
            lat, wall = _run_batch(p, pools, pc, dc, ps.address, rooms, serial, out["add_us"])
            out["lat_ms"] += lat
            out["walls"].append(wall)
    return out


def _raw_target(path: str, geo: PoolGeometry, kind: str, conn: Any) -> None:
    pool = KVPool.attach(path, geo)
    tr = make_transport(kind, pool)
    got: list[bytes] = []
    tr.set_notif_handler(lambda peer, tag: got.append(tag))
    tr.start()
    conn.send((tr.name, tr.metadata()))
    conn.recv()  # until the initiator is done
    tr.close()


def raw_gbps(p: BenchParams, pools: _Pools) -> float:
    """The transport alone: R large writes (one per room's bytes) to another process."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(
        target=_raw_target, args=(pools.decode.path, pools.geometry, p.transport, child)
    )
    proc.start()
    tr: Transport = make_transport(p.transport, pools.prefill, nixl_threads=p.nixl_threads)
    try:
        tr.start()
        name, md = parent.recv()
        tr.add_peer(name, md)
        room_bytes = p.pages * p.page_size
        runs = [(i * room_bytes, i * room_bytes, room_bytes) for i in range(p.rooms)]
        rates = []
        for it in range(p.iters + 1):
            t = time.perf_counter()
            h = tr.post(name, runs, b"raw")
            if wait_state(tr, h, 60) != "DONE":
                raise RuntimeError("raw transfer failed")
            tr.release(h)
            if it:  # the first is the warm-up
                rates.append(room_bytes * p.rooms / (time.perf_counter() - t) / 1e9)
        return statistics.mean(rates)
    finally:
        parent.send("done")
        proc.join(timeout=10)
        tr.close()


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


def run(p: BenchParams) -> dict[str, float]:
    """Run every part; return the figures."""
    with tempfile.TemporaryDirectory(prefix="kvx-bench-", dir=_shm_dir()) as d:
        pools = _Pools(p, d)
        try:
            progress.phase(f"{p.transport}: serial transfers")
            serial = run_mode(p, pools, serial=True)
            progress.phase(f"{p.transport}: async transfers")
            asyn = run_mode(p, pools, serial=False)
            progress.phase(f"{p.transport}: raw transport")
            raw = raw_gbps(p, pools)
        finally:
            pools.close()
    total = p.rooms * p.pages * p.page_size
    progress.phase("memcpy and AddRequest cost")
    mem = memcpy_gbps(p)
    add_us = add_request_cost_us(p)
    plan = _plan(p, PoolGeometry(p.page_size, 2 * p.rooms * p.pages), random.Random(p.seed), 0)
    n_runs = sum(len(merge_runs(r.src, r.dst)) for r in plan)
    mean_run = p.page_size * p.pages * p.rooms / n_runs
    figures = {
        "serial_mean_ms": statistics.mean(serial["lat_ms"]),
        "async_mean_ms": statistics.mean(asyn["lat_ms"]),
        "async_p99_ms": percentile(asyn["lat_ms"], 0.99),
        "speedup": statistics.mean(serial["lat_ms"]) / statistics.mean(asyn["lat_ms"]),
        "async_gbps": statistics.mean(total / w / 1e9 for w in asyn["walls"]),
        "serial_gbps": statistics.mean(total / w / 1e9 for w in serial["walls"]),
        f"{p.transport}_raw_gbps": raw,
        "memcpy_gbps": mem,
        "add_request_p99_us": percentile(add_us, 0.99),
        "add_request_rpc_p99_us": percentile(serial["add_us"], 0.99),
        "warmup_ms": asyn["warmup_ms"],
        "mean_run_kib": mean_run / 1024,
    }
    figures["async_vs_raw"] = figures["async_gbps"] / raw
    return figures


def _shm_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") else None


_TARGETS = {
    "speedup": ">= 4 (16 rooms)",
    "async_vs_raw": ">= 0.8 (runs >= 1 MiB)",
    "add_request_p99_us": "<= 100",
}


def print_table(figures: dict[str, float], p: BenchParams) -> None:
    """The figures as one table."""
    print(
        f"kvmesh bench xfer: transport {p.transport}, {p.rooms} rooms x {p.pages} pages x "
        f"{p.page_size} B in {p.chunks} chunks, runs of 1..{p.max_run} pages, "
        f"{p.queues} queues, {p.iters} batches"
    )
    print(f"{'figure':<26}{'value':>12}  target")
    for k, v in figures.items():
        print(f"{k:<26}{v:>12.3f}  {_TARGETS.get(k, '')}")


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
        "iters": "timed batches",
    }
    for f, what in sizes.items():
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f), help=what)
    ap.add_argument(
        "--nixl-threads",
        type=int,
        default=d.nixl_threads,
        help="NIXL UCX backend worker threads (0: NIXL's default)",
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
    if a.pages % a.chunks or a.pages < a.chunks:
        print("kvmesh bench xfer: --pages must be a multiple of --chunks", file=sys.stderr)
        return 2
    p = BenchParams(
        transport=transport, rooms=a.rooms, pages=a.pages, page_size=a.page_size,
        chunks=a.chunks, max_run=a.max_run, queues=a.queues, iters=a.iters,
        nixl_threads=a.nixl_threads,
    )  # fmt: skip
    figures = run(p)
    print_table(figures, p)
    if a.json_path:
        write_report(a.json_path, figures, asdict(p))
    return 0
