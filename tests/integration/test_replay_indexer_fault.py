"""The replay against a live gRPC indexer that is stopped mid-replay: it finishes, on load."""

from __future__ import annotations

from indexer.memory import MemoryIndex
from indexer.server import start_server
from lab.sim.replay import ReplaySettings, run_replay
from lab.traces import load_mooncake
from tests.grpc.conftest import make_config


async def test_indexer_killed_mid_replay() -> None:
    trace = load_mooncake(limit=240)
    server = await start_server(
        make_config(block_size=512, limits={"max_match_blocks": 1024}), MemoryIndex()
    )
    stopped = False

    async def kill(policy: str, i: int) -> None:
        nonlocal stopped
        if i == 120 and not stopped:
            stopped = True
            await server.stop(0)

    try:
        settings = ReplaySettings(routers=2, workers=4, capacity=200, indexer=server.address)
        result = await run_replay(trace, settings, ["cache_shared"], on_request=kill)
    finally:
        if not stopped:
            await server.stop(0)
    r = result.results[0]
    assert stopped
    assert sum(r.reasons.values()) == 240 == sum(r.requests_per_worker)
    assert r.reasons.get("indexer_unavailable", 0) >= 100  # every decision after the stop
    assert r.reasons.get("cache_candidate", 0) > 0  # the indexer did answer before it
    assert r.hit_rate > 0
