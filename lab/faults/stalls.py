"""Stalls of the harness's own process that it did not cause: the machine's.

A round runs its replicas in this process. On an overloaded machine (the test
suite runs two workers on two cores, beside their redis-servers) the process
can be descheduled for longer than a replica's Redis socket timeout
(lab/faults/fleet.py, ``SOCKET_TIMEOUT_S``): the replica's read then times out
although no fault was injected and nothing is wrong with it.

:class:`StallWatch` takes a turn of the event loop every :data:`INTERVAL_S`. A
turn that comes :data:`STALL_S` late while the process used less than half of
that wall time in CPU (every thread counted) was a stall of the machine: the
process was not running. A loop held by the process's own work (a replica
that blocks the loop) used the CPU, and is not such a stall: a call it fails
is still a violation.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

#: How often the watch takes a turn of the loop, seconds.
INTERVAL_S = 0.01
#: How late a turn must be to count as a stall, seconds.
STALL_S = 0.1
#: Most CPU a stall may have used, as a share of its wall time.
STALL_CPU_SHARE = 0.5


class StallWatch:
    """Records the machine's stalls of this process (see the module docstring)."""

    def __init__(self) -> None:
        #: ``(start, end)`` of each stall, ``time.monotonic()`` seconds.
        self.stalls: list[tuple[float, float]] = []
        #: Late turns that used the CPU (the process's own work), not stalls.
        self.busy = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start watching (in the running loop)."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop watching."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            t0, c0 = time.monotonic(), time.process_time()
            await asyncio.sleep(INTERVAL_S)
            t1 = time.monotonic()
            if t1 - t0 - INTERVAL_S < STALL_S:
                continue
            if time.process_time() - c0 < STALL_CPU_SHARE * (t1 - t0):
                self.stalls.append((t0, t1))
            else:
                self.busy += 1

    def during(self, start: float, end: float) -> float:
        """Seconds of stalls within ``[start, end]`` (``time.monotonic()``)."""
        return sum(max(0.0, min(e, end) - max(s, start)) for s, e in self.stalls)
