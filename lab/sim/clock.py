"""The virtual clock of a simulation: trace time and the engines' event queue.

:class:`lab.sim.engine.SimEngine` schedules what happens later (a prefill
ends, a request finishes) with :meth:`VirtualClock.schedule`; the replay
(``kvmesh replay``) and ``kvmesh up`` advance the clock to each request's
trace time with :meth:`VirtualClock.run_until`, which runs every event due by
then in time order (ties in the order they were scheduled).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable

#: What an event runs: called with the virtual time it was scheduled for.
Event = Callable[[float], None]


class VirtualClock:
    """Virtual seconds and the events scheduled on them (see the module docstring)."""

    def __init__(self) -> None:
        #: The current virtual time, in seconds.
        self.now = 0.0
        self._heap: list[tuple[float, int, Event]] = []
        self._seq = itertools.count()

    def schedule(self, at: float, fn: Event) -> None:
        """Run ``fn(at)`` when the clock passes ``at``."""
        heapq.heappush(self._heap, (at, next(self._seq), fn))

    def run_until(self, t: float) -> None:
        """Advance to ``t``, running every event due by then in order.

        ``t`` may be ``inf`` to drain the queue: the clock then stops at the
        last event's time.
        """
        heap = self._heap
        while heap and heap[0][0] <= t:
            at, _, fn = heapq.heappop(heap)
            self.now = at
            fn(at)
        if not math.isinf(t):
            self.now = max(self.now, t)
