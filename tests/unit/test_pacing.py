"""indexer.pacing: event work gives way to the loop, and always gets on itself."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest

from indexer.pacing import FREE_TURNS, Pacer, call_pacer, loop_pacer


def burn(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def _interleave(pacer: Pacer, workers: int, turns: int, piece_s: float = 0.0) -> list[str]:
    """What ran, in order: ``workers`` paced workers' pieces (their names) and
    ``turns`` callbacks of another task, one per loop turn (``"turn"``), as a
    gRPC call's are."""
    pieces: list[str] = []
    stop = False

    async def worker(name: str) -> None:
        while not stop:
            await pacer.pace()
            pieces.append(name)
            burn(piece_s)

    async def other() -> None:
        nonlocal stop
        for _ in range(turns):
            await asyncio.sleep(0)
            pieces.append("turn")
        stop = True

    await asyncio.gather(*(worker(f"w{i}") for i in range(workers)), other())
    return pieces


async def test_each_gate_lets_one_budget_of_work_through() -> None:
    """However many workers wait, a loop turn of its own comes after each budget."""
    # Every piece spends the budget.
    pieces = await _interleave(Pacer(0.0, free_turns=1), 16, 50, piece_s=0.0002)
    turns = [i for i, p in enumerate(pieces) if p == "turn"]
    between = [b - a - 1 for a, b in itertools.pairwise(turns)]
    assert max(between) <= 1, between  # never the 16 workers' pieces in one turn
    assert sum(between) >= 10  # and the workers do get on


async def test_work_gets_on_when_other_callbacks_outlast_the_budget() -> None:
    """A budget charged from the gate's opening would starve event work behind busy turns."""
    pacer = Pacer(0.001, free_turns=1)
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


@pytest.mark.parametrize("free_turns", [1, 3, FREE_TURNS])
async def test_the_gate_stays_shut_for_its_free_turns(free_turns: int) -> None:
    """After each budget, ``free_turns`` loop turns go by without event work, and no more."""
    pieces = await _interleave(Pacer(0.0, free_turns=free_turns), 4, 20 * free_turns + 20)
    last_turn = len(pieces) - 1 - pieces[::-1].index("turn")
    work = [i for i, p in enumerate(pieces[:last_turn]) if p != "turn"]
    between = [b - a - 1 for a, b in itertools.pairwise(work)]
    assert len(between) >= 10, pieces
    # (Waking the gate's waiters takes two turns of its own: a shielded future.)
    assert min(between) >= free_turns, between
    assert max(between) <= free_turns + 2, between


async def test_pacers_free_turns() -> None:
    """Event work leaves the loop its free turns; a stream's inline Matches, one."""
    assert loop_pacer().free_turns == FREE_TURNS > 1
    assert call_pacer().free_turns == 1
    with pytest.raises(ValueError, match="free_turns"):
        Pacer(free_turns=0)
