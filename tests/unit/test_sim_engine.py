"""The simulated engine: its KV events keep the index equal to its cache; the service model."""

from __future__ import annotations

from collections.abc import Callable

from indexer.memory import MemoryIndex
from indexer.model import InstanceId, Namespace
from lab.sim.engine import ServiceModel, SimEngine, SimRequest
from lab.sim.publish import MemoryPublisher
from router_client import WorkerLoad

MODEL = "m"


async def test_events_mirror_the_lru_cache() -> None:
    index = MemoryIndex()
    pub = MemoryPublisher(index, MODEL)
    await pub.register("e0")
    timers: list[tuple[float, Callable[[float], None]]] = []
    loads: list[WorkerLoad] = []
    eng = SimEngine(
        name="e0",
        capacity=6,
        block_size=4,
        publish=pub.publish,
        schedule=lambda at, fn: timers.append((at, fn)),
        on_load=lambda w, load, at: loads.append(load),
        on_finish=lambda req, at: None,
        model=ServiceModel(prefill_tokens_per_s=4.0, decode_s_per_token=1.0, max_running=1),
    )
    assert await eng.admit(SimRequest(1, 0.0, [1, 2, 3, 4], 16, 2), 0.0) == 0
    assert await eng.admit(SimRequest(2, 0.0, [1, 2, 5, 6], 16, 2), 0.0) == 2
    # capacity 6: the third prompt evicts the least recently used tail blocks
    assert await eng.admit(SimRequest(3, 0.0, [7, 8], 8, 1), 0.0) == 0
    dump = await index.dump()
    held = set(dump.blocks[Namespace(MODEL)].keys())
    assert held == set(eng.cache.keys())
    assert len(held) == 6
    m = index.match_sync(Namespace(MODEL), [1, 2, 5, 6])
    assert m[0].instance == InstanceId("e0") and m[0].depth == eng.cache.lookup_prefix([1, 2, 5, 6])
    # max_running=1: one runs, two wait; prefill 16 tokens at 4 tok/s = 4 s
    assert loads[-1].running_requests == 3
    assert eng.ttfts == [4.0]
    timers.sort(key=lambda x: x[0])
    at, fn = timers[0]
    fn(at)  # prefill of request 1 done
    assert eng.pending_prefill == 16 - 8 + 8  # request 2 (8 uncached) + request 3 (8)
