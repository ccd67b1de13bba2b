"""indexer.pacing: event work gives way to the loop, and always gets on itself."""

from __future__ import annotations

import asyncio
import itertools
import time

from indexer.pacing import Pacer, loop_pacer


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def test_each_gate_lets_one_budget_of_work_through() -> None:
    """However many workers wait, a loop turn of its own comes after each budget."""
    pacer = Pacer(0.0)  # every piece spends the budget
    pieces: list[str] = []
    stop = False

    async def worker(name: str) -> None:
        while not stop:
            await pacer.pace()
            pieces.append(name)
            burn(0.0002)

    async def other() -> None:
        # What a gRPC call does: one callback per loop turn.
        nonlocal stop
        for _ in range(50):
            await asyncio.sleep(0)
            pieces.append("turn")
        stop = True

    await asyncio.gather(*(worker(f"w{i}") for i in range(16)), other())
    turns = [i for i, p in enumerate(pieces) if p == "turn"]
    between = [b - a - 1 for a, b in itertools.pairwise(turns)]
    assert max(between) <= 1, between  # never the 16 workers' pieces in one turn
    assert sum(between) >= 10  # and the workers do get on


async def test_work_gets_on_when_other_callbacks_outlast_the_budget() -> None:
    """A budget charged from the gate's opening would starve event work behind busy turns."""
    pacer = Pacer(0.001)
    done = 0
    busy = True

    async def worker() -> None:
        nonlocal done
        while busy:
            await pacer.pace()
            burn(0.0003)
            done += 1

    async def calls() -> None:
        # Each turn, other callbacks take longer than the whole budget, some
        # of them after the gate opened.
        nonlocal busy
        for _ in range(40):
            await asyncio.sleep(0)
            burn(0.0015)
        busy = False

    await asyncio.gather(calls(), calls(), worker(), calls(), calls())
    assert done >= 20, done


async def test_the_loop_has_one_pacer() -> None:
    assert loop_pacer() is loop_pacer()
