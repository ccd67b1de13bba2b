"""Prefetches of a decode sidecar: pull a prefix before the request that needs it arrives.

No grpc here (xfer/server.py asks the source and answers the calls). A
router that knows which sidecar holds a request's prefix asks the decode
sidecar to pull it (:meth:`PrefetchTable.open`); once the source accepted
the read (its OpenRead answer), :meth:`PrefetchTable.start_read` hands the
read to the puller thread, which posts one transport READ (one descriptor
per run of pages contiguous on both sides) and watches it until it is done,
fails, or passes the prefetch's deadline. When the request arrives the
decode engine claims the pages (:meth:`PrefetchTable.claim_begin` …
:meth:`PrefetchTable.claim_end`): at once when they are there, after the
pull in flight, or by pulling again (:meth:`PrefetchTable.restart`) when
the prefetch failed, was cancelled or expired.

States (:class:`PrefetchState`): Pulling -> Ready, or Cancelled, Failed,
Expired. A prefetch holds its destination pages (no other prefetch may name
them) while Pulling or Ready; leaving those states releases them. Bounds:
``prefetch.max_in_flight`` open at once (RESOURCE_EXHAUSTED beyond), a ttl
after which unclaimed pages are released (Expired), a pull deadline. A
finished prefetch stays known (so a late claim learns why it did not
deliver) for one more ttl (at least ``prefetch.default_ttl_s``), then is
forgotten (NOT_FOUND).

Thread-safety: every method may be called from any thread; one lock guards
the table, transport calls run outside it (the puller thread alone checks
and releases read handles).
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import queue
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvmesh.errors import InvalidArgument, NotFound, ResourceExhausted
from xfer.config import PrefetchSettings
from xfer.logic import AlreadyExists, XferMetrics
from xfer.pool import KVPool
from xfer.transport import Transport
from xfer.wire import byte_runs, merge_runs

log = logging.getLogger(__name__)


class PrefetchState(enum.IntEnum):
    """State of a prefetch (values are the proto's ``PrefetchState``)."""

    UNSPECIFIED = 0
    PULLING = 1
    READY = 2
    CANCELLED = 3
    FAILED = 4
    EXPIRED = 5


class ClaimOutcome(enum.IntEnum):
    """How a claim got its pages (values are the proto's ``ClaimOutcome``)."""

    UNSPECIFIED = 0
    READY = 1
    WAITED = 2
    FALLBACK = 3
    FAILED = 4


#: Events of ``kvmesh_xfer_prefetches_total{event}``.
PREFETCH_EVENTS = ("issued", "claimed", "cancelled", "expired", "failed")

_OPEN = (PrefetchState.PULLING, PrefetchState.READY)

#: Finished prefetches remembered per open one allowed (beyond, the oldest is forgotten).
_TOMBSTONES_PER_SLOT = 4


@dataclasses.dataclass(eq=False)
class Prefetch:
    """One prefetch's record."""

    id: int
    source: str
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    ttl_s: float
    deadline_s: float
    created: float
    state: PrefetchState = PrefetchState.PULLING
    reason: str = ""
    bytes: int = 0
    #: When the current pull must be done (``time.monotonic()``).
    pull_deadline: float = 0.0
    #: Unclaimed past this, pages are released (Expired).
    expires: float = 0.0
    #: Finished: forgotten past this.
    forget_at: float = 0.0
    #: Pulls of this record (a claim's fallback is the second); a read of an
    #: earlier attempt that completes late counts for nothing.
    attempt: int = 0
    #: A claim is in progress: the record is not expired meanwhile.
    claiming: bool = False
    #: A read is posted and not yet reaped.
    reading: bool = False
    started: float = 0.0
    watchers: list[Callable[[], None]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(eq=False)
class _Read:
    pf: Prefetch
    attempt: int
    agent: str
    runs: list[tuple[int, int, int]]
    handle: Any = None


_STOP = object()


class PrefetchTable:
    """The prefetches of one decode sidecar and the thread that runs their reads."""

    def __init__(
        self, settings: PrefetchSettings, pool: KVPool, transport: Transport, metrics: XferMetrics
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.transport = transport
        self.metrics = metrics
        self._table: dict[int, Prefetch] = {}
        #: Destination page -> id of the open prefetch that holds it.
        self._held: dict[int, int] = {}
        self._open = 0
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    # -- lifecycle -------------------------------------------------------------------------

    def start(self) -> None:
        """Start the puller thread."""
        self._thread = threading.Thread(target=self._puller, name="xfer-prefetch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the puller thread (reads in flight are released). Idempotent."""
        if self._thread is not None:
            self._jobs.put(_STOP)
            self._thread.join(timeout=2)
            self._thread = None

    # -- calls -----------------------------------------------------------------------------

    def open(
        self,
        prefetch_id: int,
        source: str,
        src_pages: Sequence[int],
        dst_pages: Sequence[int],
        ttl_ms: int = 0,
        deadline_ms: int = 0,
    ) -> Prefetch:
        """Check a Prefetch and record it (Pulling, its pages held); the caller then asks
        the source and calls :meth:`start_read` (or :meth:`fail`)."""
        if not source:
            raise InvalidArgument("source_address is required", field="source_address")
        if not src_pages:
            raise InvalidArgument("no source pages", field="src_page_indices")
        if len(src_pages) != len(dst_pages):
            raise InvalidArgument(
                f"{len(src_pages)} source pages for {len(dst_pages)} destination pages",
                field="dst_page_indices",
            )
        self.pool.check_pages(dst_pages, "dst_page_indices")
        if len(set(dst_pages)) != len(dst_pages):
            raise InvalidArgument("a destination page appears twice", field="dst_page_indices")
        s = self.settings
        ttl = min(ttl_ms / 1000 if ttl_ms else s.default_ttl_s, s.max_ttl_s)
        deadline = min(deadline_ms / 1000 if deadline_ms else s.pull_timeout_s, ttl)
        now = time.monotonic()
        with self._lock:
            if prefetch_id == 0:
                prefetch_id = secrets.randbits(63) or 1
                while prefetch_id in self._table:
                    prefetch_id = secrets.randbits(63) or 1
            elif prefetch_id in self._table:
                raise AlreadyExists(f"prefetch {prefetch_id} is tracked", field="prefetch_id")
            if self._open >= s.max_in_flight:
                raise ResourceExhausted(
                    f"{self._open} prefetches open (prefetch.max_in_flight)",
                    field="prefetch.max_in_flight",
                )
            self._check_free(dst_pages, prefetch_id)
            pf = Prefetch(
                prefetch_id, source, tuple(src_pages), tuple(dst_pages), ttl, deadline, now
            )
            pf.expires = now + ttl
            self._forget_tombstones()
            self._table[prefetch_id] = pf
            self._begin_pull(pf, now + deadline)
        self.metrics.prefetches.labels("issued").inc()
        return pf

    def _check_free(self, dst_pages: Sequence[int], prefetch_id: int) -> None:
        """Lock held: raise unless no open prefetch but ``prefetch_id`` holds a page."""
        for p in dst_pages:
            owner = self._held.get(p)
            if owner is not None and owner != prefetch_id:
                raise InvalidArgument(
                    f"page {p} is the destination of open prefetch {owner}",
                    field="dst_page_indices",
                )

    def _begin_pull(self, pf: Prefetch, pull_deadline: float) -> None:
        """Lock held: ``pf`` becomes Pulling and holds its pages."""
        pf.state = PrefetchState.PULLING
        pf.reason = ""
        pf.bytes = 0
        pf.attempt += 1
        pf.reading = False
        pf.started = time.monotonic()
        pf.pull_deadline = pull_deadline
        for p in pf.dst_pages:
            self._held[p] = pf.id
        self._open += 1
        self.metrics.prefetches_open.set(self._open)

    def _finish(self, pf: Prefetch, state: PrefetchState, reason: str = "") -> bool:
        """Lock held: move an open ``pf`` to ``state``; leaving Pulling/Ready releases its
        pages. Returns whether it moved."""
        if pf.state not in _OPEN or state == pf.state:
            return False
        if state == PrefetchState.READY and pf.state != PrefetchState.PULLING:
            return False
        now = time.monotonic()
        pf.state = state
        pf.reason = reason
        if state != PrefetchState.READY:
            for p in pf.dst_pages:
                if self._held.get(p) == pf.id:
                    del self._held[p]
            self._open -= 1
            self.metrics.prefetches_open.set(self._open)
            # Known for a while yet, so a late claim learns why it did not deliver.
            pf.forget_at = max(pf.expires, now) + max(pf.ttl_s, self.settings.default_ttl_s)
            event = {
                PrefetchState.CANCELLED: "cancelled",
                PrefetchState.FAILED: "failed",
                PrefetchState.EXPIRED: "expired",
            }[state]
            self.metrics.prefetches.labels(event).inc()
            if reason:
                log.info("prefetch %d %s: %s", pf.id, event, reason)
        else:
            self.metrics.prefetch_pull_seconds.observe(now - pf.started)
        watchers, pf.watchers = pf.watchers, []
        for w in watchers:
            w()
        return True

    def start_read(self, pf: Prefetch, attempt: int, agent: str, page_count: int) -> bool:
        """The source accepted the read (its agent ``agent``, its pool of ``page_count``
        pages): queue the READ. False when the prefetch left Pulling meanwhile."""
        for p in pf.src_pages:
            if not 0 <= p < page_count:
                raise InvalidArgument(
                    f"page index {p} outside the source's [0, {page_count})",
                    field="src_page_indices",
                )
        ps = self.pool.geometry.page_size
        # (local = destination, remote = source, length)
        runs = byte_runs(merge_runs(pf.dst_pages, pf.src_pages), ps)
        with self._lock:
            if pf.state != PrefetchState.PULLING or pf.attempt != attempt:
                return False
            pf.reading = True
        self._jobs.put(_Read(pf, attempt, agent, runs))
        return True

    def fail(self, pf: Prefetch, reason: str, attempt: int | None = None) -> bool:
        """Fail ``pf`` if it is still open (and of ``attempt``, when given)."""
        with self._lock:
            if attempt is not None and pf.attempt != attempt:
                return False
            return self._finish(pf, PrefetchState.FAILED, reason)

    def cancel(self, prefetch_id: int) -> PrefetchState:
        """Cancel a prefetch; returns its state before. A read in flight is released by
        the puller (within a millisecond); NOT_FOUND when the id is unknown."""
        with self._lock:
            pf = self._get(prefetch_id)
            prior = pf.state
            self._finish(pf, PrefetchState.CANCELLED, "cancelled")
            return prior

    def watch(self, pf: Prefetch, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from any thread) once ``pf`` is no longer Pulling (at once
        when it is not)."""
        with self._lock:
            if pf.state == PrefetchState.PULLING:
                pf.watchers.append(callback)
                return
        callback()

    def claim_begin(self, prefetch_id: int) -> tuple[Prefetch, PrefetchState]:
        """The record and its state as a claim arrives; it is not expired while claimed.
        NOT_FOUND when unknown (or already claimed, or forgotten)."""
        with self._lock:
            pf = self._get(prefetch_id)
            if pf.claiming:
                raise NotFound(f"prefetch {prefetch_id} is being claimed", field="prefetch_id")
            pf.claiming = True
            return pf, pf.state

    def restart(self, pf: Prefetch, pull_deadline: float) -> int:
        """A claim's fallback: pull ``pf`` again (it must not be open); returns the new
        attempt. InvalidArgument when another prefetch holds one of its pages now."""
        with self._lock:
            if pf.state in _OPEN:
                raise InvalidArgument(f"prefetch {pf.id} is open", field="prefetch_id")
            self._check_free(pf.dst_pages, pf.id)
            self._begin_pull(pf, pull_deadline)
            return pf.attempt

    def claim_end(self, pf: Prefetch, outcome: ClaimOutcome) -> None:
        """The claim is answered: forget ``pf`` (its pages are the engine's now)."""
        with self._lock:
            if pf.state in _OPEN:
                if pf.state == PrefetchState.PULLING:
                    self._finish(pf, PrefetchState.FAILED, "the claim gave up on the pull")
                else:  # Ready: released to the engine, not an event of its own
                    for p in pf.dst_pages:
                        if self._held.get(p) == pf.id:
                            del self._held[p]
                    self._open -= 1
                    self.metrics.prefetches_open.set(self._open)
            if self._table.get(pf.id) is pf:
                del self._table[pf.id]
        self.metrics.prefetches.labels("claimed").inc()
        self.metrics.prefetch_claims.labels(outcome.name.lower()).inc()

    def snapshot(self, prefetch_id: int) -> Prefetch | None:
        """A copy of a record (tests, debugging)."""
        with self._lock:
            pf = self._table.get(prefetch_id)
            return None if pf is None else dataclasses.replace(pf, watchers=[])

    def tick(self, now: float | None = None) -> None:
        """Expire Ready prefetches past their ttl, fail pulls past their deadline that
        have no read posted (the read's own deadline is the puller's), forget old ones."""
        now = time.monotonic() if now is None else now
        with self._lock:
            for pid, pf in list(self._table.items()):
                if pf.claiming:
                    continue
                if pf.state == PrefetchState.READY and now >= pf.expires:
                    self._finish(pf, PrefetchState.EXPIRED, "not claimed within its ttl")
                elif pf.state == PrefetchState.PULLING and not pf.reading:
                    if now >= pf.pull_deadline:
                        self._finish(pf, PrefetchState.FAILED, "the source did not answer in time")
                    elif now >= pf.expires:
                        self._finish(pf, PrefetchState.EXPIRED, "not claimed within its ttl")
                elif pf.state not in _OPEN and now >= pf.forget_at:
                    del self._table[pid]

    def _get(self, prefetch_id: int) -> Prefetch:
        pf = self._table.get(prefetch_id)
        if pf is None:
            raise NotFound(f"unknown prefetch {prefetch_id}", field="prefetch_id")
        return pf

    def _forget_tombstones(self) -> None:
        """Lock held: beyond the records kept, forget the oldest finished ones."""
        cap = _TOMBSTONES_PER_SLOT * self.settings.max_in_flight
        if len(self._table) < cap:
            return
        done = sorted(
            (pf for pf in self._table.values() if pf.state not in _OPEN and not pf.claiming),
            key=lambda pf: pf.forget_at,
        )
        for pf in done[: len(self._table) - cap + 1]:
            del self._table[pf.id]

    # -- the puller thread -----------------------------------------------------------------

    def _puller(self) -> None:
        inflight: list[_Read] = []
        idle = 0.00005
        while True:
            try:
                job = self._jobs.get_nowait() if inflight else self._jobs.get(timeout=0.5)
            except queue.Empty:
                job = None
            if job is _STOP:
                for r in inflight:
                    self.transport.release(r.handle)
                return
            if job is not None:
                self._post(job, inflight)
                idle = 0.00005
                continue
            if inflight and not self._reap(inflight):
                time.sleep(idle)
                idle = min(idle * 2, 0.001)
            else:
                idle = 0.00005

    def _post(self, r: _Read, inflight: list[_Read]) -> None:
        with self._lock:
            live = r.pf.state == PrefetchState.PULLING and r.pf.attempt == r.attempt
            if not live and r.pf.attempt == r.attempt:
                r.pf.reading = False
        if not live:
            return
        try:
            r.handle = self.transport.read(r.agent, r.runs)
        except Exception as e:
            log.warning("prefetch %d: read from %s failed: %s", r.pf.id, r.agent, e)
            with self._lock:
                r.pf.reading = False
                if r.pf.attempt == r.attempt:
                    self._finish(r.pf, PrefetchState.FAILED, f"read failed: {e}")
            return
        inflight.append(r)

    def _reap(self, inflight: list[_Read]) -> bool:
        progressed = False
        now = time.monotonic()
        for r in list(inflight):
            pf = r.pf
            with self._lock:
                live = pf.state == PrefetchState.PULLING and pf.attempt == r.attempt
                late = now > pf.pull_deadline
            try:
                state = self.transport.check(r.handle) if live else "ERR"
            except Exception as e:
                log.warning("prefetch %d: checking its read failed: %s", pf.id, e)
                state = "ERR"
            if state == "PROC" and not late:
                continue
            inflight.remove(r)
            progressed = True
            self.transport.release(r.handle)
            with self._lock:
                if pf.attempt != r.attempt:
                    continue
                pf.reading = False
                if not live:
                    continue
                if state == "DONE":
                    pf.bytes = len(pf.dst_pages) * self.pool.geometry.page_size
                    self._finish(pf, PrefetchState.READY)
                elif state == "ERR":
                    self._finish(pf, PrefetchState.FAILED, "the transport reported a read error")
                else:
                    self._finish(pf, PrefetchState.FAILED, "the read passed its deadline")
        return progressed
