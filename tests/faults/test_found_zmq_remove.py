"""After an operator's removal the harness checked a ZMQ instance before its rebuild ran.

Found by the fault harness (``kvmesh bench faults``, target ``standalone``:
``zmq_lost`` right after a ZRemove, not reproduced on replay). Not an
indexer bug: the index is rebuilt, the harness looked too early.

``Driver.wait_converged`` takes ``sub.next_seq == engine.seq`` to mean that
the subscriber has taken every batch. But ``EndpointSubscriber._apply`` moves
``next_seq`` past a batch *before* publishing it, and when that publish finds
the instance gone (the operator's RemoveInstance) the subscriber registers it
again and only then, in ``_rebuild``, sets ``next_seq`` to None and replays
the engine's buffer. So after the removal, for as long as that failing apply
and the registration take (a few Redis round trips, longer on a loaded
machine), ``next_seq`` equals the engine's sequence while the index holds
nothing of the instance; a poll of ``wait_converged`` (every 10 ms) that lands
in that window returns, and the DumpIndex of ``zmq_check`` finds the engine's
cache missing. The memory backend's apply and register do not yield, so the
window exists only on Redis.

Here replica 0's registrations of the ZMQ instance take 50 ms, so every poll
lands in the window: with a harness that waits for the subscriber to be idle
the round passes.
"""

from __future__ import annotations

import asyncio

from indexer.index import Index
from indexer.model import InstanceSpec, InstanceState
from lab.faults.driver import RunParams, format_round, run_round
from lab.faults.faults import StandaloneTarget
from lab.faults.ops import ZMQ_MODEL, Store, ZPublish, ZRemove
from tests.faults.broken import Delegating

SCRIPT = (
    ZPublish(0, (Store(0, 0, 4),)),
    ZPublish(0, (Store(1, 0, 3),)),
    ZRemove(1, 0),
)


class SlowZmqRegister(Delegating):
    """A backend whose registrations of ZMQ-fed instances take 50 ms (a loaded machine)."""

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        if spec.model == ZMQ_MODEL:
            await asyncio.sleep(0.05)
        return await self.inner.register(spec)


def _wrap(index: Index, replica: int) -> Index:
    return SlowZmqRegister(index) if replica == 0 else index


async def test_the_harness_waits_for_the_rebuild_after_an_operator_removal(
    standalone: StandaloneTarget,
) -> None:
    p = RunParams(profile="zmq", replicas=3, script=SCRIPT, wrap=_wrap)
    res = await run_round(standalone, p)
    assert not res.violations, format_round(res)
    assert res.operations == len(SCRIPT)
