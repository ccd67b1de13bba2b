"""Per-worker load: what engines report, plus what this router started since.

Two sources, combined exactly:

- **Engine reports** (:meth:`LoadTracker.report`): a snapshot of a worker's
  running requests, total tokens and pending uncached prefill tokens, taken at
  ``at`` seconds on the tracker's clock. The latest snapshot replaces the one
  before it.
- **Router bookkeeping** (:meth:`LoadTracker.start` / :meth:`LoadTracker.finish`):
  every request this router sent, until it finishes. A request started at or
  before a snapshot's ``at`` is counted by the snapshot, so only requests
  started after it are added on top; a request that finishes is removed at
  once (a snapshot taken before the finish may still count it until the next
  report replaces it: load is over-estimated briefly, never lost).

The tracker also counts the requests this router started on each worker
recently (:meth:`LoadTracker.recent_requests`), each weighing less as it ages
(halved every ``spread_half_life_s``): the "ttft" cost tells workers it
predicts equal apart by it, so new conversations spread evenly in number
(:mod:`router_client.cost`).

A report may carry the engine's prefill throughput
(:attr:`WorkerLoad.prefill_tokens_per_s`); the tracker keeps an exponentially
weighted moving average of it per worker (:data:`PREFILL_RATE_ALPHA`), which
:meth:`LoadTracker.load` returns in that field for the "ttft" cost
(:mod:`router_client.cost`). The average outlives staleness: a stale report
no longer says how busy a worker is, but its hardware is as fast as it was.

All methods take one lock and do constant work under it, so the figures stay
exact when many threads (or tasks) start and finish requests at once.

Admission (:meth:`LoadTracker.admits`) reads only the engine's own report:
a missing or stale report *fails open* (the worker is admitted), since a
router that refused work for lack of data would turn a monitoring hiccup into
an outage.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from router_client.config import DEFAULT_SPREAD_HALF_LIFE_S, Limits


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A worker's load figures."""

    running_requests: int = 0
    total_tokens: int = 0
    pending_prefill_tokens: int = 0
    #: Prefill tokens per second: in a report, the engine's measured figure
    #: (0: not reported); from :meth:`LoadTracker.load`, its moving average.
    prefill_tokens_per_s: float = 0.0


#: Weight of the newest reported prefill rate in its moving average. Engines
#: report about once a second: 0.2 averages over the last five or so reports,
#: smoothing the batch-to-batch noise of a throughput figure (one long prompt
#: or a burst of short ones) while following a change of the load mix within
#: seconds.
PREFILL_RATE_ALPHA = 0.2


@dataclass(slots=True)
class _Started:
    worker: str
    at: float
    tokens: int
    prefill_tokens: int


@dataclass(slots=True)
class _Worker:
    reported: WorkerLoad | None = None
    reported_at: float = float("-inf")
    # Sum of this router's requests started after reported_at (not yet in a report).
    extra_running: int = 0
    extra_tokens: int = 0
    extra_prefill: int = 0
    # Moving average of the reported prefill tokens/s (0: none reported yet).
    prefill_rate: float = 0.0
    # Requests this router started here, decayed to ``sent_at`` (recent_requests).
    sent: float = 0.0
    sent_at: float = 0.0


class LoadTracker:
    """Load of every worker as one router sees it. Thread-safe.

    ``stale_after_s``: a report older than this does not count for
    admission. ``clock`` returns seconds (a replay passes its virtual clock).
    ``spread_half_life_s``: the age at which a started request counts half in
    :meth:`recent_requests` (0: only the requests of this instant count).
    """

    def __init__(
        self,
        *,
        stale_after_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        spread_half_life_s: float = DEFAULT_SPREAD_HALF_LIFE_S,
    ) -> None:
        self._lock = threading.Lock()
        self._workers: dict[str, _Worker] = {}
        self._started: dict[object, _Started] = {}
        # The same entries per worker, so a report only walks its own worker's.
        self._by_worker: dict[str, dict[object, _Started]] = {}
        self._stale_after_s = stale_after_s
        self._clock = clock
        self._half_life_s = spread_half_life_s

    def _worker(self, worker: str) -> _Worker:
        w = self._workers.get(worker)
        if w is None:
            w = self._workers[worker] = _Worker()
        return w

    def report(self, worker: str, load: WorkerLoad, at: float | None = None) -> None:
        """Record an engine's load snapshot taken at ``at`` (now by default)."""
        at = self._clock() if at is None else at
        with self._lock:
            w = self._worker(worker)
            if at < w.reported_at:
                return  # an older snapshot arriving late
            w.reported = load
            w.reported_at = at
            rate = load.prefill_tokens_per_s
            if rate > 0:
                old = w.prefill_rate
                w.prefill_rate = rate if old <= 0 else old + PREFILL_RATE_ALPHA * (rate - old)
            running = tokens = prefill = 0
            for s in self._by_worker.get(worker, {}).values():
                if s.at > at:
                    running += 1
                    tokens += s.tokens
                    prefill += s.prefill_tokens
            w.extra_running, w.extra_tokens, w.extra_prefill = running, tokens, prefill

    def start(self, request_id: object, worker: str, tokens: int, prefill_tokens: int) -> None:
        """Count a request this router sent to ``worker``.

        ``tokens``: its input plus expected output tokens; ``prefill_tokens``:
        the uncached input tokens it brings. Starting an id twice is an error.
        """
        now = self._clock()
        with self._lock:
            if request_id in self._started:
                raise ValueError(f"request {request_id!r} already started")
            entry = _Started(worker, now, tokens, prefill_tokens)
            self._started[request_id] = entry
            self._by_worker.setdefault(worker, {})[request_id] = entry
            w = self._worker(worker)
            w.extra_running += 1
            w.extra_tokens += tokens
            w.extra_prefill += prefill_tokens
            w.sent = self._decayed(w, now) + 1.0
            w.sent_at = now

    def _decayed(self, w: _Worker, now: float) -> float:
        """``w.sent`` aged to ``now`` (under the lock)."""
        if w.sent <= 0.0:
            return 0.0
        if self._half_life_s <= 0.0:
            return w.sent if now <= w.sent_at else 0.0
        return w.sent * math.exp2(-max(0.0, now - w.sent_at) / self._half_life_s)

    def raise_recent_requests(self, worker: str, floor: float) -> None:
        """Count at least ``floor`` recent requests on ``worker`` from now on (a worker
        back in the fleet starts level with the others, not as a magnet for every
        new conversation until its count has caught up)."""
        now = self._clock()
        with self._lock:
            w = self._worker(worker)
            current = self._decayed(w, now)
            if floor > current:
                w.sent, w.sent_at = floor, now

    def recent_requests(self, worker: str) -> float:
        """Requests this router started on ``worker``, each weighted
        ``2 ** (-age / spread_half_life_s)``: a count that forgets."""
        now = self._clock()
        with self._lock:
            w = self._workers.get(worker)
            return 0.0 if w is None else self._decayed(w, now)

    def finish(self, request_id: object) -> None:
        """Stop counting a request; unknown ids are ignored (finish is idempotent)."""
        with self._lock:
            s = self._started.pop(request_id, None)
            if s is None:
                return
            del self._by_worker[s.worker][request_id]
            w = self._workers[s.worker]
            if s.at > w.reported_at:
                w.extra_running -= 1
                w.extra_tokens -= s.tokens
                w.extra_prefill -= s.prefill_tokens

    def load(self, worker: str) -> WorkerLoad:
        """Current estimate: the last report plus requests started since, and the
        moving average of the reported prefill rate."""
        with self._lock:
            w = self._workers.get(worker)
            if w is None:
                return WorkerLoad()
            r = w.reported or WorkerLoad()
            return WorkerLoad(
                r.running_requests + w.extra_running,
                r.total_tokens + w.extra_tokens,
                r.pending_prefill_tokens + w.extra_prefill,
                w.prefill_rate,
            )

    def loads(self, workers: Iterable[str]) -> dict[str, WorkerLoad]:
        """:meth:`load` of several workers."""
        return {w: self.load(w) for w in workers}

    def fresh_report(self, worker: str) -> WorkerLoad | None:
        """The engine's last report if younger than ``stale_after_s``, else None."""
        now = self._clock()
        with self._lock:
            w = self._workers.get(worker)
            if w is None or w.reported is None or now - w.reported_at > self._stale_after_s:
                return None
            return w.reported

    def admits(self, worker: str, limits: Limits, prefill_tokens: int = 0) -> bool:
        """Whether ``worker`` may take one more request under ``limits``.

        Judged on the engine's fresh report plus this router's requests started
        since; with no fresh report the worker is admitted (fail open).
        """
        if (
            limits.max_running_requests is None
            and limits.max_total_tokens is None
            and limits.max_pending_prefill_tokens is None
        ):
            return True
        if self.fresh_report(worker) is None:
            return True
        load = self.load(worker)
        if (
            limits.max_running_requests is not None
            and load.running_requests + 1 > limits.max_running_requests
        ):
            return False
        if limits.max_total_tokens is not None and load.total_tokens > limits.max_total_tokens:
            return False
        cap = limits.max_pending_prefill_tokens
        return cap is None or load.pending_prefill_tokens + prefill_tokens <= cap

    def in_flight(self) -> int:
        """Requests started by this router and not finished."""
        with self._lock:
            return len(self._started)
