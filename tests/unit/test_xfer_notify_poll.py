"""The NIXL notification poller backs off, when idle, to the configured pause,
and rests while no room is unfinished.

The pause bounds how late a room's first write is seen (and Success reported)
after an idle spell, against the CPU an idle sidecar spends polling. Counted on
a real NIXL agent: its ``get_new_notifs`` calls over an idle half second, with
a short and a long longest pause (0.5 and 50 ms) while a room is unfinished,
and with none (``NixlTransport.IDLE_POLL_S``, woken at once when a room
starts); and the sidecar's setting reaches the poller.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from xfer.config import PoolSettings, XferConfig
from xfer.pool import KVPool, PoolGeometry
from xfer.transport import NixlTransport, make_transport, nixl_available

GEO = PoolGeometry(page_size=4096, page_count=16, aux_size=64, aux_count=1)


def _idle_polls(tmp_path: Path, poll_max_s: float, expecting: bool = True) -> int:
    assert nixl_available(), "nixl-cu12 is not importable: run `make setup`"
    pool = KVPool.create(str(tmp_path / f"pool-{poll_max_s}"), GEO)
    tr = make_transport("nixl", pool, nixl_notify_poll_max_s=poll_max_s)
    assert isinstance(tr, NixlTransport)
    calls = 0
    real = tr._agent.get_new_notifs

    def counted() -> object:
        nonlocal calls
        calls += 1
        return real()

    tr._agent.get_new_notifs = counted
    tr.set_expecting(expecting)
    tr.start()
    try:
        time.sleep(0.1)  # past the backoff's ramp
        before = calls
        time.sleep(0.5)
        return calls - before
    finally:
        tr.close()
        pool.close()


def test_an_idle_poller_waits_at_most_its_longest_pause(tmp_path: Path) -> None:
    short = _idle_polls(tmp_path, 0.0005)
    long = _idle_polls(tmp_path, 0.05)
    assert long <= 0.5 / 0.05 + 5  # about 10: one call per 50 ms
    assert short > 4 * long, (short, long)


def test_with_no_room_unfinished_the_poller_rests_and_a_room_wakes_it(tmp_path: Path) -> None:
    resting = _idle_polls(tmp_path, 0.0005, expecting=False)
    assert resting <= 0.5 / NixlTransport.IDLE_POLL_S + 3, resting  # about 10
    assert _idle_polls(tmp_path, 0.0005) > 4 * resting  # the same pause, a room unfinished

    pool = KVPool.create(str(tmp_path / "pool-wake"), GEO)
    tr = make_transport("nixl", pool)
    assert isinstance(tr, NixlTransport)
    calls: list[float] = []
    real = tr._agent.get_new_notifs

    def stamped() -> object:
        calls.append(time.monotonic())
        return real()

    tr._agent.get_new_notifs = stamped
    tr.start()
    try:
        time.sleep(0.12)  # resting: at most a call every IDLE_POLL_S
        woken = time.monotonic()
        tr.set_expecting(True)
        time.sleep(0.02)
        first = next(t for t in calls if t >= woken)
        assert first - woken < 0.01, first - woken  # not the rest of an idle pause
    finally:
        tr.close()
        pool.close()


def test_the_sidecar_setting_reaches_the_poller(tmp_path: Path) -> None:
    from lab.bench.xfer_procs import ThreadedSidecar

    pool = PoolSettings(path=str(tmp_path / "p"), page_size=4096, page_count=16, create=True)
    side = ThreadedSidecar(
        XferConfig(
            role="decode",
            port=0,
            metrics_port=0,
            transport="nixl",
            pool=pool,
            nixl_notify_poll_max_ms=3.0,
        )
    )
    side.start()
    try:
        assert side.server is not None
        assert isinstance(side.server.transport, NixlTransport)
        assert side.server.transport._poll_max_s == pytest.approx(0.003)
    finally:
        side.stop()
    assert XferConfig.model_fields["nixl_notify_poll_max_ms"].default == 0.5
