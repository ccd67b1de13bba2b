"""A served process takes what it holds at startup out of the collector's walk.

``serve_until_signal`` freezes the objects alive once the server started
(``gc.freeze``): a full collection then walks only what came after, not the
tens of thousands of functions, types and modules of the import (10 ms a full
collection at idle here, 30 to 50 ms while a replica ingests).
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import signal

from kvmesh import runtime


class _Server:
    stopped = False

    async def stop(self) -> None:
        self.stopped = True


def test_a_started_server_freezes_what_it_holds_and_collections_walk_the_rest() -> None:
    gc.unfreeze()
    assert gc.get_freeze_count() == 0
    before = len(gc.get_objects())
    seen: dict[str, float] = {}
    server = _Server()

    async def start() -> _Server:
        return server

    async def main() -> int:
        async def look_then_stop() -> None:
            await asyncio.sleep(0.05)
            seen["frozen"] = gc.get_freeze_count()
            seen["walked"] = len(gc.get_objects())
            os.kill(os.getpid(), signal.SIGTERM)

        task = asyncio.ensure_future(look_then_stop())
        code = await runtime.serve_until_signal(start, errors=(), log=logging.getLogger("test"))
        await task
        return code

    try:
        assert runtime.run_main(main) == 0
    finally:
        gc.unfreeze()
    assert server.stopped
    # What the test process held (pytest, every module imported) is frozen ...
    assert seen["frozen"] >= before // 2, (seen, before)
    # ... and a full collection walks a small remainder of it.
    assert seen["walked"] < before // 4, (seen, before)
