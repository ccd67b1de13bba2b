"""StallWatch tells a stall of the machine from the process's own work.

A blocking ``time.sleep`` holds the loop without using the CPU, as a
descheduled process does: a stall. A busy loop holds it using the CPU, as a
replica that blocks the loop would: not a stall.
"""

from __future__ import annotations

import asyncio
import time

from lab.faults.stalls import STALL_S, StallWatch


async def _watched(hold: str) -> tuple[StallWatch, float, float]:
    w = StallWatch()
    w.start()
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    if hold == "sleep":
        time.sleep(0.4)  # noqa: ASYNC251 - holding the loop is the point
    elif hold == "busy":
        while time.monotonic() - t0 < 0.4:
            pass
    else:
        await asyncio.sleep(0.4)
    t1 = time.monotonic()
    await asyncio.sleep(0.05)
    await w.stop()
    return w, t0, t1


async def test_a_loop_held_without_cpu_is_a_stall() -> None:
    w, t0, t1 = await _watched("sleep")
    assert w.during(t0, t1) >= STALL_S
    assert w.during(t1 + 1, t1 + 2) == 0.0


async def test_a_loop_held_by_its_own_work_is_not() -> None:
    w, t0, t1 = await _watched("busy")
    assert w.during(t0, t1) == 0.0
    assert w.busy >= 1


async def test_a_free_loop_has_no_stall() -> None:
    w, t0, t1 = await _watched("free")
    assert w.during(t0, t1) == 0.0 and w.busy == 0
