"""After an operator's removal, policy ``stale``: the harness checked before the rebuild marked it.

Found by the fault harness (``kvmesh bench faults --targets standalone
--profiles zmq,zmq_stale --seed 505``, round seed 520: ``zmq_lost`` at a
ZRemove, "batches replay could not return are lost, yet the instance is
fresh"; no shrinking step reproduced it). The same window as
``test_found_zmq_remove.py``: the batch after the removal finds the instance
gone, the subscriber registers it again (fresh, empty) and only then
replays the engine's buffer, which here starts after batch 1, so the
rebuild marks the instance stale (an empty batch 0, then a gap). A harness
that takes ``next_seq == engine.seq`` for converged reads the instance
table while the registration is done and the replay is not, and finds it
fresh.

Replica 0's registrations of the ZMQ instance answer 50 ms after Redis ran
them, so every poll of the old harness lands in that window.
"""

from __future__ import annotations

import asyncio

from indexer.index import Index
from indexer.model import InstanceSpec, InstanceState
from lab.faults.driver import RunParams, format_round, run_round
from lab.faults.faults import StandaloneTarget
from lab.faults.ops import ZMQ_MODEL, Store, ZPublish, ZRemove, ZTruncate
from tests.faults.broken import Delegating

# Batches 0 and 1 are gone from the buffer when the instance is rebuilt: it
# must be stale (on_unrecoverable_gap: stale) once the subscriber is idle.
SCRIPT = (
    ZPublish(0, (Store(0, 0, 4),)),
    ZPublish(0, (Store(1, 0, 3),)),
    ZPublish(0, (Store(2, 0, 2),)),
    ZTruncate(0, 1),
    ZRemove(1, 0),
)


class SlowZmqRegister(Delegating):
    """A backend whose registrations of ZMQ-fed instances answer 50 ms after they
    ran (a loaded machine)."""

    async def register(self, spec: InstanceSpec) -> tuple[InstanceState, bool]:
        got = await self.inner.register(spec)
        if spec.model == ZMQ_MODEL:
            await asyncio.sleep(0.05)
        return got


def _wrap(index: Index, replica: int) -> Index:
    return SlowZmqRegister(index) if replica == 0 else index


async def test_the_harness_waits_for_the_stale_rebuild_after_an_operator_removal(
    standalone: StandaloneTarget,
) -> None:
    p = RunParams(profile="zmq_stale", replicas=3, script=SCRIPT, wrap=_wrap)
    res = await run_round(standalone, p)
    assert not res.violations, format_round(res)
    assert res.operations == len(SCRIPT)
