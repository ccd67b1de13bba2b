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
    # the indexer did answer before it: the first 120 prompts share block 0 alone, which
    # every engine holds by the time its prefills' events arrive, so the answers tie
    # (no_cache_candidate); a Match past its 5 ms deadline on a busy host counts as
    # indexer_unavailable, hence no more than "some answered"
    answered = r.reasons.get("cache_candidate", 0) + r.reasons.get("no_cache_candidate", 0)
    assert answered > 0, r.reasons
    assert r.hit_rate > 0
