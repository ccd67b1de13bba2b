"""The embeddable tee: ``offer(event)`` on the serving path, bounded fan-out to sinks behind it.

A router embeds :class:`Tee`::

    tee = Tee([HttpSink("http://cachesim:8470")])
    await tee.start()                       # on the router's event loop
    tee.offer(ingest(model, prompt_ids, request_id, worker=chosen))   # never blocks
    ...
    report = await tee.close(deadline_s=5)  # drains within the deadline

Each sink gets its own :class:`SinkLane`: a bounded queue, a drain loop and at
most ``concurrency`` sends in flight, so a slow or dead sink fills only its
own queue and never stalls another sink or the caller.

Counting (per lane, exact at every instant, because each transition happens
without an ``await`` in between)::

    offered = sent + dropped_full + dropped_closed + dropped_invalid
              + failed_http + failed_error + failed_timeout + queued + in_flight

Thread-safety: :meth:`Tee.offer` must be called on the loop the tee was started
on (from another thread use ``loop.call_soon_threadsafe(tee.offer, event)``).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kvmesh.tracing import inject_context, tracing_enabled
from tee.config import DEFAULT_CONCURRENCY, DEFAULT_QUEUE_SIZE, DEFAULT_SEND_TIMEOUT_S
from tee.events import DEFAULT_MAX_INPUT_IDS, RoutedEvent
from tee.metrics import LaneStats, TeeMetrics
from tee.sinks import SendFailed, Sink

log = logging.getLogger(__name__)

#: At most one failure log line per lane and failure kind per this many
#: seconds (a dead sink would otherwise log at the offered rate).
LOG_INTERVAL_S = 10.0


@dataclass(frozen=True, slots=True)
class CloseReport:
    """What :meth:`Tee.close` did per lane: events delivered or abandoned while closing."""

    lanes: tuple[LaneStats, ...]
    abandoned: int
    drained_in_time: bool


class SinkLane:
    """One sink's queue, drain loop and bounded in-flight sends."""

    def __init__(
        self,
        sink: Sink,
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        max_input_ids: int = DEFAULT_MAX_INPUT_IDS,
        metrics: TeeMetrics | None = None,
    ) -> None:
        if queue_size < 1 or concurrency < 1 or send_timeout_s <= 0:
            raise ValueError("queue_size and concurrency must be >= 1, send_timeout_s > 0")
        self.sink = sink
        self.name = sink.name
        self.queue_size = queue_size
        self.concurrency = concurrency
        self.send_timeout_s = send_timeout_s
        self.max_input_ids = max_input_ids
        self.offered = self.sent = 0
        self.dropped_full = self.dropped_closed = self.dropped_invalid = 0
        self.failed_http = self.failed_error = self.failed_timeout = 0
        self.in_flight = 0
        self._queue: collections.deque[RoutedEvent] = collections.deque()
        self._closed = True  # until start()
        self._wakeup: asyncio.Future[None] | None = None
        self._sem = asyncio.BoundedSemaphore(concurrency)
        self._tasks: set[asyncio.Task[None]] = set()
        self._drainer: asyncio.Task[None] | None = None
        self._last_log: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}
        self._latency = metrics.send_seconds.labels(self.name) if metrics else None

    # -- serving path -------------------------------------------------------

    def offer(self, event: RoutedEvent) -> bool:
        """Queue ``event``; ``False`` (a counted drop) when closed, full or oversized."""
        self.offered += 1
        if self._closed:
            self.dropped_closed += 1
            return False
        queue = self._queue
        if len(queue) >= self.queue_size:
            self.dropped_full += 1
            return False
        try:
            if len(event.input_ids) > self.max_input_ids:
                self.dropped_invalid += 1
                return False
        except Exception:  # not an event at all: never raise on the serving path
            self.dropped_invalid += 1
            return False
        queue.append(event)
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        return True

    # -- lifecycle ----------------------------------------------------------

    def start(self) -> None:
        """Start the drain loop on the running loop."""
        if self._drainer is None:
            self._closed = False
            self._drainer = asyncio.get_running_loop().create_task(
                self._drain(), name=f"tee-drain:{self.name}"
            )

    @property
    def queued(self) -> int:
        """Events waiting in the queue."""
        return len(self._queue)

    def stats(self) -> LaneStats:
        """A consistent snapshot of the counters."""
        return LaneStats(
            self.name,
            self.offered,
            self.sent,
            self.dropped_full,
            self.dropped_closed,
            self.dropped_invalid,
            self.failed_http,
            self.failed_error,
            self.failed_timeout,
            len(self._queue),
            self.in_flight,
        )

    async def _drain(self) -> None:
        loop = asyncio.get_running_loop()
        queue = self._queue
        sem = self._sem
        while True:
            if not queue:
                if self._closed:
                    return
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
                continue
            await sem.acquire()
            if not queue:  # abandoned while waiting for a slot
                sem.release()
                continue
            event = queue.popleft()
            self.in_flight += 1
            task = loop.create_task(self._send(event))
            self._tasks.add(task)
            task.add_done_callback(self._on_done)

    def _on_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._sem.release()

    async def _send(self, event: RoutedEvent) -> None:
        start = time.perf_counter()
        kind = ""
        detail = ""
        try:
            async with asyncio.timeout(self.send_timeout_s):
                await self.sink.send(event)
        except TimeoutError:
            kind, detail = "timeout", f"no answer within {self.send_timeout_s}s"
        except SendFailed as e:
            kind, detail = e.kind, str(e)
        except asyncio.CancelledError:
            # Abandoned at the shutdown deadline.
            self.in_flight -= 1
            self.dropped_closed += 1
            raise
        except Exception as e:  # a buggy sink must not stop the lane
            kind, detail = "error", f"{type(e).__name__}: {e}"
        self.in_flight -= 1
        if not kind:
            self.sent += 1
            if self._latency is not None:
                self._latency.observe(time.perf_counter() - start)
            return
        if kind == "timeout":
            self.failed_timeout += 1
        elif kind == "http":
            self.failed_http += 1
        else:
            self.failed_error += 1
        self._log_failure(kind, detail)

    def _log_failure(self, kind: str, detail: str) -> None:
        now = time.monotonic()
        last = self._last_log.get(kind)
        if last is not None and now - last < LOG_INTERVAL_S:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last_log[kind] = now
        more = self._suppressed.pop(kind, 0)
        log.warning(
            "tee sink %s: send failed (%s): %s%s",
            self.name,
            kind,
            detail,
            f" (+{more} more since last report)" if more else "",
        )

    async def close(self, deadline_s: float) -> int:
        """Stop accepting, send what is queued within ``deadline_s``, abandon the rest.

        Returns the number of events abandoned (queued or in flight at the
        deadline); they are counted as ``dropped_closed``.
        """
        self._closed = True
        waiter = self._wakeup
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        drainer = self._drainer
        abandoned = 0
        if drainer is not None:
            try:
                async with asyncio.timeout(deadline_s):
                    await asyncio.shield(drainer)
                    while self._tasks:
                        await asyncio.wait(set(self._tasks))
            except TimeoutError:
                pass
            left = len(self._queue)
            self._queue.clear()
            self.dropped_closed += left
            abandoned = left + len(self._tasks)
            drainer.cancel()
            tasks = list(self._tasks)
            for task in tasks:
                task.cancel()
            await asyncio.gather(drainer, *tasks, return_exceptions=True)
        if abandoned:
            log.warning("tee sink %s: abandoned %d events at shutdown", self.name, abandoned)
        await self.sink.close()
        return abandoned


def _with_trace_context(event: RoutedEvent) -> RoutedEvent:
    """``event`` carrying the current trace context (itself when no span is current)."""
    try:
        ctx = inject_context()
        return dataclasses.replace(event, trace_context=ctx) if ctx else event
    except Exception:  # not an event, or a broken propagator: never raise on the serving path
        return event


class Tee:
    """Offers events to every sink's lane; see the module docstring.

    :meth:`offer` returns ``True`` when every lane queued the event. It never
    blocks and never raises.
    """

    def __init__(
        self,
        sinks: Iterable[Sink],
        *,
        queue_size: int = DEFAULT_QUEUE_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        send_timeout_s: float = DEFAULT_SEND_TIMEOUT_S,
        max_input_ids: int = DEFAULT_MAX_INPUT_IDS,
        metrics: TeeMetrics | None = None,
    ) -> None:
        self.metrics = metrics if metrics is not None else TeeMetrics()
        self.lanes: tuple[SinkLane, ...] = tuple(
            SinkLane(
                s,
                queue_size=queue_size,
                concurrency=concurrency,
                send_timeout_s=send_timeout_s,
                max_input_ids=max_input_ids,
                metrics=self.metrics,
            )
            for s in sinks
        )
        names = [lane.name for lane in self.lanes]
        if len(set(names)) != len(names):
            raise ValueError(f"sink names must be unique: {names}")
        self.metrics.watch(self.stats)
        self._lane0 = self.lanes[0] if len(self.lanes) == 1 else None
        #: Whether :meth:`offer` captures the caller's trace context (decided
        #: at :meth:`start`; tracing off leaves offer() as cheap as before).
        self._propagate = False

    async def start(self) -> Tee:
        """Start every lane's drain loop on the running loop; returns ``self``."""
        self._propagate = tracing_enabled()
        for lane in self.lanes:
            lane.start()
        return self

    def offer(self, event: RoutedEvent) -> bool:
        """Queue ``event`` for every sink without blocking; ``False`` if any lane dropped it.

        With tracing on, the current trace context is captured into the event
        here: the send happens later in another task, whose context is not
        the caller's.
        """
        if self._propagate and not event.trace_context:
            event = _with_trace_context(event)
        lane0 = self._lane0
        if lane0 is not None:  # the common single-sink case, one call cheaper
            return lane0.offer(event)
        ok = True
        for lane in self.lanes:
            if not lane.offer(event):
                ok = False
        return ok

    def stats(self) -> Sequence[LaneStats]:
        """One counter snapshot per lane."""
        return [lane.stats() for lane in self.lanes]

    async def close(self, deadline_s: float = 5.0) -> CloseReport:
        """Stop accepting and drain every lane in parallel within ``deadline_s``."""
        abandoned = await asyncio.gather(*(lane.close(deadline_s) for lane in self.lanes))
        return CloseReport(tuple(self.stats()), sum(abandoned), not any(abandoned))
