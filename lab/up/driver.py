"""``kvmesh up``'s driver: the rest of a serving fleet, played by this process.

:class:`Driver` runs ``--workers`` simulated engines (:mod:`lab.sim.engine`)
publishing their KV events to the indexer replicas, ``--routers`` routers
(:class:`router_client.Router`) teeing routed prompts to the tee, and every
``--transfer-every``-th request's KV pages through the transfer pair
(:class:`TransferDemo`); it replays the trace in real time and takes the
:class:`~lab.up.view.Snapshot` the live view and the summary show.
:func:`run` is one whole run on a built :class:`~lab.up.cluster.Cluster`:
start, replay, drain, stop, summary.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc.aio
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.api.tee.v1 import tee_pb2, tee_pb2_grpc
from kvmesh.stats import percentile
from kvmesh.tls import ClientTLS
from lab.sim.clock import VirtualClock
from lab.sim.engine import SimEngine, SimRequest
from lab.sim.publish import GrpcPublisher
from lab.sim.replay import ReplaySettings, run_policy, trace_keys
from lab.traces import MOONCAKE_BLOCK_SIZE, load_mooncake
from lab.up.cluster import Cluster, UpPki
from lab.up.settings import AUX_COUNT, AUX_SIZE, HOST, MODEL, PAGE_COUNT, PAGE_SIZE, UpSettings
from lab.up.view import LiveView, Snapshot, TeeCounters, progress_line, summary
from router_client import (
    IndexerClient,
    IndexerClientSettings,
    MatchOutcome,
    MatchStatus,
    Router,
    RouterConfig,
    RouteRequest,
    WorkerLoad,
)
from tee.cachesim.model import HitStats, pooled_cache, worker_cv
from tee.hooks import routed_request_hook
from tee.logic import Tee
from tee.sinks import GrpcSink
from xfer.client import XferClient
from xfer.logic import RoomStatus
from xfer.pool import KVPool, PoolGeometry

#: Most pages one transfer moves (one page per trace block, capped).
MAX_TRANSFER_PAGES = 32
#: Pages per add_transfer_request call: a prefill engine hands pages over in
#: chunks as its chunked prefill completes them.
CHUNK_PAGES = 8
#: Transfers in flight at once (4 x 32 pages fit the 256-page pools).
TRANSFER_CONCURRENCY = 4

#: Match deadline of the routers. The library default (5 ms) suits a router
#: and an indexer on a datacenter network; here seven processes and the
#: driver share the machine's cores, and a Match that misses its deadline is
#: routed on load alone, which would blur the hit rate the view shows.
MATCH_DEADLINE_MS = 50.0


@dataclass(slots=True)
class TransferStats:
    """What the transfer pair did."""

    started: int = 0
    verified: int = 0
    failed: int = 0
    bytes: int = 0
    seconds: list[float] = field(default_factory=list)


class TransferDemo:
    """Plays both engines of a prefill/decode pair for a sample of requests.

    The prefill engine writes fresh random bytes into its pool pages, the
    decode engine registers a room for them, the prefill engine hands the
    pages over in chunks, the decode engine polls until Success, and the bytes
    in the decode pool are compared with what was written. Each transfer runs
    in a worker thread (the engine-side client is blocking, as engines are).
    """

    def __init__(
        self,
        prefill_addr: str,
        decode_addr: str,
        pool_paths: tuple[str, str],
        tls: ClientTLS | None = None,
    ) -> None:
        geo = PoolGeometry(PAGE_SIZE, PAGE_COUNT, AUX_SIZE, AUX_COUNT)
        self.prefill_addr = prefill_addr
        self.src = KVPool.attach(pool_paths[0], geo)
        self.dst = KVPool.attach(pool_paths[1], geo)
        self.pc = XferClient(prefill_addr, tls=tls)
        self.dc = XferClient(decode_addr, tls=tls)
        self.stats = TransferStats()
        self._free_src = collections.deque(range(PAGE_COUNT))
        self._free_dst = collections.deque(range(PAGE_COUNT))
        self._free_aux = collections.deque(range(AUX_COUNT))
        self._rooms = itertools.count(1)
        self._sem = asyncio.Semaphore(TRANSFER_CONCURRENCY)
        self.tasks: set[asyncio.Task[None]] = set()

    def submit(self, n_pages: int, on_error: Callable[[str], None]) -> None:
        """Start one transfer of ``n_pages`` pages in the background."""
        task = asyncio.get_running_loop().create_task(self._run(n_pages, on_error))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, n_pages: int, on_error: Callable[[str], None]) -> None:
        async with self._sem:
            n = max(1, min(n_pages, MAX_TRANSFER_PAGES))
            # Pages are taken and given back on the loop thread only.
            src = [self._free_src.popleft() for _ in range(n)]
            dst = [self._free_dst.popleft() for _ in range(n)]
            aux = self._free_aux.popleft()
            room = next(self._rooms)
            self.stats.started += 1
            try:
                seconds = await asyncio.to_thread(self._transfer, room, src, dst, aux)
            except Exception as e:
                self.stats.failed += 1
                on_error(f"xfer room {room}: {type(e).__name__}: {e}")
            else:
                self.stats.verified += 1
                self.stats.bytes += n * PAGE_SIZE + AUX_SIZE
                self.stats.seconds.append(seconds)
            finally:
                self._free_src.extend(src)
                self._free_dst.extend(dst)
                self._free_aux.append(aux)

    def _transfer(self, room: int, src: list[int], dst: list[int], aux: int) -> float:
        for s in src:
            self.src.page(s)[:] = os.urandom(PAGE_SIZE)
        self.src.aux(aux)[:] = os.urandom(AUX_SIZE)
        t0 = time.perf_counter()
        self.dc.register_room(room, self.prefill_addr, dst, aux_index=aux)
        self._wait(self.dc, room, RoomStatus.WAITING_FOR_INPUT)
        n = len(src)
        for chunk, lo in enumerate(range(0, n, CHUNK_PAGES)):
            hi = min(n, lo + CHUNK_PAGES)
            self.pc.add_transfer_request(room, src[lo:hi], (lo, hi), hi == n, aux, chunk)
        self._wait(self.dc, room, RoomStatus.SUCCESS)
        seconds = time.perf_counter() - t0
        self._wait(self.pc, room, RoomStatus.SUCCESS)
        bad = [d for s, d in zip(src, dst, strict=True) if self.src.page(s) != self.dst.page(d)]
        if bad or self.src.aux(aux) != self.dst.aux(aux):
            raise RuntimeError(f"{len(bad)} of {n} pages (or the aux slot) differ after Success")
        self.dc.clear(room)
        self.pc.clear(room)
        return seconds

    @staticmethod
    def _wait(client: XferClient, room: int, want: RoomStatus, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            status, reason = client.poll(room)
            if status >= want:
                return
            if status == RoomStatus.FAILED:
                raise RuntimeError(f"room failed: {reason}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"room stuck in {status.name} for {timeout_s:.0f} s")
            time.sleep(0.001)

    def close(self) -> None:
        """Close the clients and unmap the pools."""
        self.pc.close()
        self.dc.close()
        self.src.close()
        self.dst.close()


def _histogram_quantiles(buckets: dict[float, float], qs: Sequence[float]) -> list[float | None]:
    """Quantiles (seconds) of a cumulative Prometheus histogram, interpolated within buckets."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    if total <= 0:
        return [None for _ in qs]
    out: list[float | None] = []
    for q in qs:
        rank = q * total
        prev_edge, prev_count = 0.0, 0.0
        value: float | None = None
        for edge in edges:
            count = buckets[edge]
            if count >= rank:
                if edge == float("inf"):
                    value = prev_edge
                else:
                    span = count - prev_count
                    frac = (rank - prev_count) / span if span else 1.0
                    value = prev_edge + (edge - prev_edge) * frac
                break
            prev_edge, prev_count = edge, count
        out.append(value)
    return out


class TimedIndexerClient(IndexerClient):
    """An :class:`~router_client.IndexerClient` that records each Match's latency (seconds),
    as the router sees it, in ``seconds``."""

    def __init__(
        self,
        seconds: list[float],
        *,
        channel: grpc.aio.Channel,
        settings: IndexerClientSettings,
        model: str,
    ) -> None:
        super().__init__(channel=channel, settings=settings, model=model)
        self.seconds = seconds

    async def match(self, keys: Sequence[int], *, include_predicted: bool = False) -> MatchOutcome:
        """:meth:`IndexerClient.match`, timed."""
        t0 = time.perf_counter()
        try:
            return await super().match(keys, include_predicted=include_predicted)
        finally:
            self.seconds.append(time.perf_counter() - t0)


def _p50_p99(values: Sequence[float]) -> tuple[float | None, float | None]:
    """p50 and p99 (:func:`kvmesh.stats.percentile`) of ``values``; None before any."""
    if not values:
        return None, None
    return percentile(values, 0.5), percentile(values, 0.99)


class Driver:
    """The replay in real time: engines publish, routers route and tee, transfers run."""

    def __init__(self, settings: UpSettings, cluster: Cluster, stop: asyncio.Event) -> None:
        self.s = settings
        self.cluster = cluster
        self.stop = stop
        self.trace = load_mooncake(limit=settings.requests)
        self.keys = trace_keys(self.trace)
        self.names = [f"engine-{i:02d}" for i in range(settings.workers)]
        self.clock = VirtualClock()
        self.stats = HitStats()
        self.pooled = pooled_cache([settings.capacity] * settings.workers)
        self.pooled_stats = HitStats()
        self.per_worker: collections.Counter[str] = collections.Counter()
        self.recent: collections.deque[tuple[float, int, int]] = collections.deque()
        self.match_seconds: list[float] = []
        self.errors = 0
        self.recent_errors: collections.deque[str] = collections.deque(maxlen=3)
        self.done = 0
        self.lag_s = 0.0
        self.t0 = time.monotonic()
        self.replay_t0 = self.t0
        self.finished = False
        self.notes: list[str] = []
        # Filled by start().
        self.channels: list[grpc.aio.Channel] = []
        self.router_channels: list[grpc.aio.Channel] = []
        self.publishers: list[GrpcPublisher] = []
        self.routers: list[Router] = []
        self.indexer_clients: list[IndexerClient] = []
        self.tees: list[Tee] = []
        self.engines: dict[str, SimEngine] = {}
        self._finished: dict[int, tuple[Router, RouteRequest]] = {}
        self.xfer: TransferDemo | None = None
        self.tee_stats: TeeCounters | None = None
        self.sim_report: dict[str, Any] | None = None
        self.server_match: tuple[float | None, float | None] = (None, None)
        self._died: set[str] = set()
        self._rr_hit_rate: float | None = None

    def error(self, message: str) -> None:
        """Count an error and remember it for the view."""
        self.errors += 1
        self.recent_errors.append(message)

    async def start(self) -> None:
        """Open channels, register the engines, start the routers' tees."""
        c = self.cluster
        s = self.s
        # Engines publish as the engine identity, routers match as the router
        # identity (one channel each per replica; plaintext without --tls).
        self.channels = [UpPki.channel(c.pki, c.addr(f"indexer-{i}"), "engine") for i in (0, 1)]
        self.router_channels = [
            UpPki.channel(c.pki, c.addr(f"indexer-{i}"), "router") for i in (0, 1)
        ]
        self.publishers = [GrpcPublisher(ch, MODEL) for ch in self.channels]
        config = RouterConfig(
            model=MODEL, indexer=IndexerClientSettings(deadline_ms=MATCH_DEADLINE_MS)
        )
        for i in range(s.routers):
            client = TimedIndexerClient(
                self.match_seconds,
                channel=self.router_channels[i % 2],
                settings=config.indexer,
                model=MODEL,
            )
            self.indexer_clients.append(client)
            sink = GrpcSink(c.addr("tee"), name="tee", tls=UpPki.client_of(c.pki, "router"))
            tee = await Tee([sink], concurrency=4).start()
            self.tees.append(tee)
            self.routers.append(
                Router(
                    config,
                    workers=self.names,
                    # Routers spread over the replicas: both serve one Redis index.
                    indexer=client,
                    block_size=MOONCAKE_BLOCK_SIZE,
                    seed=s.seed * 1000 + i,
                    clock=lambda: self.clock.now,
                    registry=CollectorRegistry(),
                    on_decision=routed_request_hook(tee, MODEL),
                )
            )
        finished = self._finished

        def on_load(worker: str, load: WorkerLoad, at: float) -> None:
            for r in self.routers:
                r.load.report(worker, load, at)

        def on_finish(req: SimRequest, at: float) -> None:
            router, rreq = finished.pop(req.id)
            router.finished(rreq)

        for i, name in enumerate(self.names):
            # Engines spread over the replicas too: a router on replica 0 must
            # see blocks published through replica 1 (the shared Redis index).
            pub = self.publishers[i % 2]
            await pub.register(name)
            self.engines[name] = SimEngine(
                name=name,
                capacity=s.capacity,
                block_size=MOONCAKE_BLOCK_SIZE,
                publish=pub.publish,
                schedule=self.clock.schedule,
                on_load=on_load,
                on_finish=on_finish,
            )
        if s.transfer_every:
            self.xfer = TransferDemo(
                c.addr("xfer-prefill"),
                c.addr("xfer-decode"),
                c.pool_paths,
                tls=UpPki.client_of(c.pki, "engine"),
            )

    async def replay(self) -> None:
        """Send the trace's requests at their (sped-up) times until done or stopped."""
        s = self.s
        rng = random.Random(s.seed)
        self.replay_t0 = start = time.monotonic()
        for i, (treq, keys) in enumerate(zip(self.trace, self.keys, strict=True)):
            if self.stop.is_set():
                return
            t = treq.timestamp / 1000.0
            if s.speed is not None:
                delay = start + t / s.speed - time.monotonic()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.stop.wait(), delay)
                    if self.stop.is_set():
                        return
                    self.lag_s = 0.0
                else:
                    self.lag_s = -delay
            if s.duration is not None and time.monotonic() - start >= s.duration:
                self.notes.append(f"stopped by --duration {s.duration:g} s")
                return
            self.clock.run_until(t)
            ri = rng.randrange(len(self.routers))
            router = self.routers[ri]
            # Keys for the Match; the trace's block ids as "token ids" for the
            # tee, so the cache simulator (block size 1) sees the same blocks.
            rreq = RouteRequest(
                request_id=i,
                input_tokens=treq.input_length,
                max_output_tokens=treq.output_length,
                block_keys=keys,
                token_ids=treq.hash_ids,
            )
            decision = await router.route(rreq, decode=False)
            router.started(rreq, decision.prefill)
            self._finished[i] = (router, rreq)
            worker = decision.prefill.worker
            sreq = SimRequest(i, t, keys, treq.input_length, treq.output_length)
            hits = await self.engines[worker].admit(sreq, t)
            self.stats.add(len(keys), hits)
            self.pooled_stats.add(len(keys), self.pooled.access(keys).hits)
            self.per_worker[worker] += 1
            self.recent.append((time.monotonic(), len(keys), hits))
            self.done = i + 1
            if self.xfer is not None and i % s.transfer_every == 0:
                self.xfer.submit(len(keys), self.error)
            # Let the view and the tees' drain loops run between requests even
            # when no pacing sleep does (--speed max or behind the trace).
            await asyncio.sleep(0)
        self.finished = True

    # -- observing ---------------------------------------------------------------

    async def poll_services(self) -> None:
        """Refresh the tee's counters, the simulator's report and the server Match latency."""
        await asyncio.gather(
            self._poll_tee(), self._poll_sim(), self._poll_indexer_metrics(),
            return_exceptions=True,
        )  # fmt: skip
        for child in self.cluster.children:
            if not child.alive() and not child.stopping and child.name not in self._died:
                self._died.add(child.name)
                self.error(f"{child.name} exited with code {child.exit_code()} (see its log)")

    async def _poll_tee(self) -> None:
        async with UpPki.channel(self.cluster.pki, self.cluster.addr("tee"), "router") as ch:
            resp = await tee_pb2_grpc.TeeServiceStub(ch).GetTeeStats(
                tee_pb2.GetTeeStatsRequest(), timeout=1.0
            )
        t = TeeCounters()
        for lane in resp.sinks:
            t = TeeCounters(
                t.offered + lane.offered,
                t.sent + lane.sent,
                t.dropped + lane.dropped_full + lane.dropped_closed + lane.dropped_invalid,
                t.failed + lane.failed_http + lane.failed_error + lane.failed_timeout,
                t.queued + lane.queued,
                t.in_flight + lane.in_flight,
            )
        self.tee_stats = t

    async def _poll_sim(self) -> None:
        pki = self.cluster.pki
        url = f"{UpPki.scheme(pki)}://{self.cluster.addr('cachesim')}/report?model={MODEL}"
        async with (
            aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=1.0),
                connector=aiohttp.TCPConnector(ssl=UpPki.ssl_context(pki, "router")),
            ) as session,
            session.get(url) as r,
        ):
            if r.status == 200:
                self.sim_report = (await r.json())["models"].get(MODEL)

    async def _poll_indexer_metrics(self) -> None:
        buckets: dict[float, float] = collections.defaultdict(float)
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1.0)) as session:
            for i in (0, 1):
                url = f"http://{self.cluster.addr(f'indexer-{i}.metrics')}/metrics"
                async with session.get(url) as r:
                    text = await r.text()
                for fam in text_string_to_metric_families(text):
                    if fam.name != "kvmesh_indexer_rpc_seconds":
                        continue
                    for sample in fam.samples:
                        if sample.name.endswith("_bucket") and sample.labels.get("method") in (
                            "Match",
                            "/kvmesh.indexer.v1.IndexerService/Match",
                        ):
                            buckets[float(sample.labels["le"])] += sample.value
        p50, p99 = _histogram_quantiles(buckets, (0.5, 0.99))
        self.server_match = (
            None if p50 is None else p50 * 1000.0,
            None if p99 is None else p99 * 1000.0,
        )

    def snapshot(self) -> Snapshot:
        """The current state for the view and the summary."""
        now = time.monotonic()
        while self.recent and now - self.recent[0][0] > 5.0:
            self.recent.popleft()
        rb = sum(b for _, b, _ in self.recent)
        rh = sum(h for _, _, h in self.recent)
        reasons: collections.Counter[str] = collections.Counter()
        calls = failed = late = 0
        for r in self.routers:
            for (stage, why), n in r.decisions.items():
                if stage == "prefill":
                    reasons[why] += n
        for client in self.indexer_clients:
            for status, n in client.calls.items():
                calls += n
                if status in (MatchStatus.UNAVAILABLE, MatchStatus.ERROR):
                    failed += n
                elif status is not MatchStatus.OK:
                    late += n
        router_tee = TeeCounters()
        for tee in self.tees:
            for lane in tee.stats():
                router_tee = TeeCounters(
                    router_tee.offered + lane.offered,
                    router_tee.sent + lane.sent,
                    router_tee.dropped + lane.dropped,
                    router_tee.failed + lane.failed,
                    router_tee.queued + lane.queued,
                    router_tee.in_flight + lane.in_flight,
                )
        sim_hit = None
        sim_requests = 0
        if self.sim_report is not None:
            sim_hit = float(self.sim_report["total"]["routed"]["hit_rate"])
            sim_requests = int(self.sim_report["total"]["requests"])
        x = self.xfer.stats if self.xfer is not None else TransferStats()
        match_p50, match_p99 = _p50_p99([v * 1000.0 for v in self.match_seconds])
        xfer_p50, xfer_p99 = _p50_p99([v * 1000.0 for v in x.seconds])
        trace_total = self.trace[-1].timestamp / 1000.0 if self.trace else 0.0
        published = sum(p.batches for p in self.publishers)
        pub_failed = sum(p.failed + p.dropped for p in self.publishers)
        return Snapshot(
            elapsed_s=now - self.t0,
            requests_done=self.done,
            requests_total=len(self.trace),
            trace_s=self.clock.now,
            trace_total_s=trace_total,
            speed=self.s.speed,
            lag_s=self.lag_s,
            routers=self.s.routers,
            workers=self.s.workers,
            capacity=self.s.capacity,
            blocks=self.stats.blocks,
            hit_blocks=self.stats.hit_blocks,
            recent_hit_rate=rh / rb if rb else None,
            pooled_hit_rate=self.pooled_stats.hit_rate,
            sim_hit_rate=sim_hit,
            sim_requests=sim_requests,
            worker_cv=worker_cv(self.per_worker[n] for n in self.names),
            reasons=dict(reasons),
            match_calls=calls,
            match_failed=failed,
            match_late=late,
            match_p50_ms=match_p50,
            match_p99_ms=match_p99,
            server_match_p50_ms=self.server_match[0],
            server_match_p99_ms=self.server_match[1],
            batches_published=published,
            publish_failed=pub_failed,
            tee=self.tee_stats,
            router_tee=router_tee,
            xfer_transport=self.cluster.transport,
            xfer_started=x.started,
            xfer_verified=x.verified,
            xfer_failed=x.failed,
            xfer_p50_ms=xfer_p50,
            xfer_p99_ms=xfer_p99,
            xfer_bytes=x.bytes,
            errors=self.errors + failed + pub_failed,
            recent_errors=tuple(self.recent_errors),
            processes=tuple(c.state() for c in self.cluster.children),
            finished=self.finished,
            interrupted=self.stop.is_set() and not self.finished,
            round_robin_hit_rate=self._rr_hit_rate,
            notes=tuple(self.notes),
        )

    # -- ending --------------------------------------------------------------------

    async def drain(self) -> None:
        """Finish transfers, drain the routers' tees and the tee, read the final figures."""
        if self.xfer is not None and self.xfer.tasks:
            _, pending = await asyncio.wait(set(self.xfer.tasks), timeout=20.0)
            for task in pending:
                task.cancel()
        for tee in self.tees:
            await tee.close(deadline_s=5.0)
        # The tee service forwards to the simulator on its own schedule: wait
        # until it has settled what the routers sent, so the counters add up.
        sent = sum(lane.sent for tee in self.tees for lane in tee.stats())
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                await self._poll_tee()
            t = self.tee_stats
            if t is not None and t.settled and t.offered >= sent:
                break
            await asyncio.sleep(0.05)
        await self.poll_services()
        self._rr_hit_rate = await self._round_robin_baseline()

    async def _round_robin_baseline(self) -> float | None:
        """Hit rate of round robin on the same requests (in-process replay, under a second)."""
        n = self.done
        if n == 0:
            return None
        settings = ReplaySettings(
            routers=self.s.routers, workers=self.s.workers, capacity=self.s.capacity
        )
        result = await run_policy(
            "round_robin", self.trace[:n], self.keys[:n], settings, pooled_bound=0.0
        )
        return result.hit_rate

    async def close(self) -> None:
        """Close streams and channels (the services keep running until stopped)."""
        for pub in self.publishers:
            await pub.close()
        for r in self.routers:
            r.indexer = None
        for ch in [*self.channels, *self.router_channels]:
            await ch.close()
        if self.xfer is not None:
            self.xfer.close()


# -- one run ---------------------------------------------------------------------------


def _print_banner(cluster: Cluster, settings: UpSettings, ready_s: float) -> None:
    """Where everything listens, once the cluster is ready."""
    p = cluster.ports
    lines = [
        f"kvmesh up: {len(cluster.children)} processes ready in {ready_s:.1f} s "
        f"(logs in {cluster.run_dir})",
        f"  redis         {HOST}:{p['redis']:<6}  {cluster.redis_binary}",
    ]
    for i in (0, 1):
        lines.append(
            f"  indexer-{i}     {HOST}:{p[f'indexer-{i}']:<6}  metrics :{p[f'indexer-{i}.metrics']}"
            "  (--backend redis)"
        )
    lines += [
        f"  tee           {HOST}:{p['tee']:<6}  metrics :{p['tee.metrics']}  -> cachesim HTTP",
        f"  cachesim      {HOST}:{p['cachesim']:<6}  gRPC :{p['cachesim.grpc']}"
        f"  (kvmesh cachesim report --url {UpPki.scheme(cluster.pki)}://{HOST}:{p['cachesim']})",
        f"  xfer-prefill  {HOST}:{p['xfer-prefill']:<6}  metrics :{p['xfer-prefill.metrics']}"
        f"  ({cluster.transport})",
        f"  xfer-decode   {HOST}:{p['xfer-decode']:<6}  metrics :{p['xfer-decode.metrics']}"
        f"  ({cluster.transport})",
        f"  in this process: {settings.workers} simulated engines, {settings.routers} routers",
    ]
    if cluster.pki is not None:
        lines.append(
            f"  mutual TLS everywhere, policy {cluster.pki.policy} (certificates in "
            f"{cluster.pki.root}; report: --url https://... --ca-file/--cert-file/--key-file)"
        )
    speed = "as fast as possible" if settings.speed is None else f"x{settings.speed:g}"
    lines.append(
        f"replaying {settings.requests} requests of the Mooncake conversation trace at {speed}"
        " (Ctrl-C stops everything)"
    )
    print("\n".join(lines), flush=True)


def _json_summary(snap: Snapshot, settings: UpSettings, cluster: Cluster) -> dict[str, Any]:
    """What ``--json`` writes: the last snapshot, the settings, ports, logs and pools."""
    out = dataclasses.asdict(snap)
    out["hit_rate"] = snap.hit_rate
    out["settings"] = dataclasses.asdict(settings)
    out["ports"] = dict(cluster.ports)
    out["log_dir"] = str(cluster.run_dir)
    out["pool_paths"] = list(cluster.pool_paths)
    return out


async def _view_loop(driver: Driver, settings: UpSettings, view: LiveView | None) -> None:
    """Poll the services and redraw about once a second (a line every 5 s without a tty)."""
    last_line = 0.0
    while True:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(driver.poll_services(), 2.0)
        snap = driver.snapshot()
        if view is not None:
            view.draw(snap)
        elif time.monotonic() - last_line >= 5.0:
            last_line = time.monotonic()
            print(progress_line(snap), flush=True)
        await asyncio.sleep(1.0)


async def run(settings: UpSettings, cluster: Cluster) -> int:
    """Start the built cluster, replay, drain, stop it and print the summary; the exit code.

    The first SIGINT, SIGTERM or SIGHUP stops the replay (the run then ends as
    usual); a second one SIGKILLs every child and exits 130 at once.
    """
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    presses = 0

    def on_signal() -> None:
        nonlocal presses
        presses += 1
        if presses == 1:
            stop.set()
        else:  # a second Ctrl-C: no more waiting for drains
            cluster.kill()
            for path in cluster.pool_paths:
                with contextlib.suppress(OSError):
                    os.unlink(path)
            print("\nkvmesh up: killed every process it started", file=sys.stderr)
            os._exit(130)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, on_signal)

    t0 = time.monotonic()
    print(f"kvmesh up: starting {len(cluster.children)} processes ...", flush=True)
    try:
        await cluster.start(stop)
    except asyncio.CancelledError:
        print("kvmesh up: stopped while starting", flush=True)
        return 0
    _print_banner(cluster, settings, time.monotonic() - t0)

    driver = Driver(settings, cluster, stop)
    await driver.start()
    view = LiveView() if settings.tty else None
    viewer = asyncio.create_task(_view_loop(driver, settings, view))
    try:
        await driver.replay()
        if settings.hold and not stop.is_set():
            print("\nkvmesh up: replay done; the cluster keeps running (Ctrl-C stops it)")
            await stop.wait()
    finally:
        await driver.drain()
        viewer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await viewer
        await driver.close()
    if view is not None:
        view.draw(driver.snapshot())
    # Stop the services before the summary so it can report how they ended.
    await asyncio.to_thread(cluster.stop)
    snap = driver.snapshot()
    print()
    print("\n".join(summary(snap)), flush=True)
    if settings.json_path:
        text = json.dumps(_json_summary(snap, settings, cluster), indent=2) + "\n"
        await asyncio.to_thread(Path(settings.json_path).write_text, text)
    failed_children = [p for p in snap.processes if p.exit_code not in (0, None)]
    return 1 if driver._died or failed_children else 0
