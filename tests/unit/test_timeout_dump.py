"""What the suite prints shortly before pytest-timeout ends a test (tests/conftest.py):
every pending asyncio task with its whole await chain, down to the awaited line."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.conftest import _dump_tasks


async def _inner(gate: asyncio.Event) -> None:
    await gate.wait()  # the line a hang would be on


async def _outer(gate: asyncio.Event) -> None:
    await _inner(gate)


async def test_the_dump_names_each_frame_of_a_waiting_task(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gate = asyncio.Event()
    task = asyncio.create_task(_outer(gate), name="stuck-one")
    await asyncio.sleep(0)
    # from another thread, as the timer does while the test's loop is blocked
    t = threading.Thread(target=_dump_tasks, args=("a test",))
    t.start()
    t.join()
    gate.set()
    await task
    err = capsys.readouterr().err
    assert "task stuck-one:" in err
    lines = err.split("task stuck-one:", 1)[1].splitlines()
    frames = [ln.strip().rsplit(" ", 1)[-1] for ln in lines[1:4]]
    assert frames == ["_outer", "_inner", "wait"], err
