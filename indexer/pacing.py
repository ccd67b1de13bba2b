"""Sharing the event loop between event work and calls.

Event work does not yield on its own: an awaited ZMQ receive that is ready at
once returns without a loop turn, and the memory backend's apply awaits
nothing. Work of that kind calls :meth:`Pacer.pace` between its pieces, and
every piece of one event loop draws on one budget (:func:`loop_pacer`): the
ZMQ subscribers (between batches, and between the events of one batch as it
is decoded: indexer/kvevents/decode.py, ``decode_batch_paced``), the memory
backend's apply of a long batch (indexer/memory.py); a batch's decoding
and its apply are two pieces whatever the backend. Once the budget is spent,
that work waits :data:`FREE_TURNS` whole loop turns, in which gRPC calls and
health probes run. The Matches of one MatchStream message that the memory
backend answers inline (indexer/server.py) pace the same way on a budget of
their own (:func:`call_pacer`, one free turn): calls give way to calls, and
event work to them.
"""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

#: Longest stretch of event work (decoding and applying batches, every
#: subscriber and long apply of the process together) before the event loop
#: gets a turn of its own for gRPC calls and health probes. A gRPC call needs
#: a few loop turns, so it waits a few budgets instead of the whole backlog:
#: with 64 engines flooding the memory backend (``kvmesh bench indexer``),
#: Match p50 about 8 ms and p99 about 35 ms, against 0.3 to 0.6 s with no
#: budget. A free turn costs tens of microseconds, so the ingest rate does not
#: measurably change; a smaller budget lowers the p50 further but wakes every
#: waiting subscriber that much more often.
YIELD_EVERY_S = 0.002

#: Loop turns without event work once a budget is spent. One is not enough
#: for unary calls: grpc.aio takes new calls one at a time, each a completion
#: event and then a step of its accepting task, two turns at least. With one
#: free turn per budget, a replica whose core is shared (with its Redis, with
#: other pods) took in fewer calls a second than a router's 100 Matches, and
#: they queued for seconds: ``kvmesh bench peer --block-size 512 --backend
#: redis --pin``, Match p99 during ingest 0.65 to 1.4 s with one, 47 ms with
#: four, 24 to 29 with eight or sixteen (one run each, a Redis apply's
#: encoding then paced apart too), ingest the same within the runs' spread.
#: A turn with nothing else to run costs a few microseconds.
FREE_TURNS = 8


class Pacer:
    """Makes the event work of one event loop give way every ``budget_s`` of it.

    The budget is shared: once it is spent, every caller of :meth:`pace`
    waits at a gate that opens ``free_turns`` whole loop turns later, so those
    turns (an I/O poll each and every callback it readied: gRPC calls, health
    probes) run without event work, whatever the number of callers. The gate
    opening starts a new budget.
    """

    def __init__(self, budget_s: float = YIELD_EVERY_S, free_turns: int = FREE_TURNS) -> None:
        if free_turns < 1:
            raise ValueError(f"free_turns must be >= 1, got {free_turns}")
        self.budget_s = budget_s
        #: Loop turns the gate stays shut once the budget is spent.
        self.free_turns = free_turns
        #: When the current budget started; None: since the gate opened, no
        #: caller has gone on (the next one starts a fresh budget).
        self._start: float | None = None
        self._gate: asyncio.Future[None] | None = None

    async def pace(self) -> None:
        """Wait for the next budget when the current one is spent.

        The budget starts when the first caller goes on after a gate opened,
        not when it opened: what else the loop ran in that turn is not
        charged to event work, so it always gets on, one piece per turn at
        the least, however busy the loop is with calls.
        """
        while True:
            gate = self._gate
            if gate is None:
                if self._start is None:
                    self._start = time.perf_counter()
                    return
                if time.perf_counter() - self._start < self.budget_s:
                    return
                loop = asyncio.get_running_loop()
                gate = self._gate = loop.create_future()
                # Waiting on a future, not in the ready queue: the next
                # free_turns turns are the loop's alone. (Yielding with sleep(0)
                # instead keeps every waiting caller ready, and gRPC then
                # barely moves.)
                loop.call_soon(self._turn, loop, self.free_turns)
            # Shielded: a caller cancelled while waiting leaves the gate to the rest.
            await asyncio.shield(gate)

    def _turn(self, loop: asyncio.AbstractEventLoop, left: int) -> None:
        """One free turn has passed: open the gate after the last."""
        if left > 1:
            loop.call_soon(self._turn, loop, left - 1)
        else:
            self._open()

    def _open(self) -> None:
        gate, self._gate = self._gate, None
        self._start = None
        if gate is not None and not gate.done():
            gate.set_result(None)


_PACERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Pacer] = weakref.WeakKeyDictionary()
_TURNS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
    weakref.WeakKeyDictionary()
)


def _of_loop(
    table: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _T], make: Callable[[], _T]
) -> _T:
    loop = asyncio.get_running_loop()
    got = table.get(loop)
    if got is None:
        got = table[loop] = make()
    return got


def loop_pacer() -> Pacer:
    """The pacer every piece of event work on the running loop shares."""
    return _of_loop(_PACERS, Pacer)


_CALL_PACERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Pacer] = (
    weakref.WeakKeyDictionary()
)


def _call_pacer() -> Pacer:
    return Pacer(free_turns=1)


def call_pacer() -> Pacer:
    """The budget of call work that runs inline on the running loop (the
    memory backend's Matches of a MatchStream message): its own, apart from
    event work's, so that such Matches give way to other calls between two of
    them but never wait at event work's gate (:data:`FREE_TURNS` loop turns
    and more each time it is shut, and a turn of ingest lasts up to the
    longest piece of event work). Its own gate opens after one turn: the
    calls it lets by need no more."""
    return _of_loop(_CALL_PACERS, _call_pacer)


def loop_turns() -> asyncio.Lock:
    """The lock the running loop's event work takes turns by, one batch at a
    time (FIFO), where the work is all CPU (the memory backend)."""
    return _of_loop(_TURNS, asyncio.Lock)
