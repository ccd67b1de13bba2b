"""Progress lines on stderr for commands that run longer than a few seconds.

A command names its phases with :func:`phase`; each is printed at once on
stderr (stdout stays the command's report) as
``kvmesh bench tee: [12 s] N=8, saturated``. Under :func:`heartbeat` (the
``kvmesh`` command runs every benchmark and ``kvmesh replay`` under one) the
current phase is printed again whenever :data:`HEARTBEAT_S` seconds pass
without a line, so a long phase still shows that the command is alive and
what it is doing. :func:`tick` is for loops: it prints only when that long
has passed since the last line. Thread-safe; the heartbeat is a daemon thread.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections.abc import Callable, Iterator

__all__ = ["HEARTBEAT_S", "heartbeat", "phase", "tick"]

#: Seconds without a progress line before one is printed: long enough that a
#: run of a few seconds prints none, short enough that a stalled phase shows.
HEARTBEAT_S = 5.0


class _State:
    """What the lines say: the command, its start, the current phase, the last line's time."""

    lock = threading.Lock()
    prog = "kvmesh"
    start = time.monotonic()
    last = start
    current = "running"


def _emit(message: str) -> None:
    with _State.lock:
        now = time.monotonic()
        _State.last = now
        line = f"{_State.prog}: [{now - _State.start:.0f} s] {message}"
        with contextlib.suppress(OSError, ValueError):  # stderr closed: no progress, no failure
            print(line, file=sys.stderr, flush=True)


def phase(message: str) -> None:
    """Start a phase: print ``message`` now, and repeat it in the heartbeat lines."""
    _State.current = message
    _emit(message)


def tick(message: str | Callable[[], str], every_s: float = HEARTBEAT_S) -> None:
    """Print ``message`` (or what it returns) if ``every_s`` seconds passed since the last line."""
    if time.monotonic() - _State.last >= every_s:
        _emit(message() if callable(message) else message)


@contextlib.contextmanager
def heartbeat(prog: str, every_s: float = HEARTBEAT_S) -> Iterator[None]:
    """Run the body as command ``prog``: elapsed times count from now, and a
    line repeats the current phase every ``every_s`` seconds without one."""
    saved = (_State.prog, _State.start, _State.last, _State.current)
    _State.prog, _State.current = prog, "running"
    _State.start = _State.last = time.monotonic()
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(min(0.5, every_s / 4)):
            if time.monotonic() - _State.last >= every_s:
                _emit(_State.current)

    thread = threading.Thread(target=beat, name="progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        _State.prog, _State.start, _State.last, _State.current = saved
