"""Route-time predictions in the replay: a request following its prefix within the event lag.

Each pair of requests shares a new prefix and arrives 100 ms apart, well inside
a 5 s event lag: without predictions the second is routed before the engine's
events for the first exist, so it lands on a random engine of the fleet; with
predictions it follows the first. A ttl shorter than the gap must recover
nothing; without lag, a follower arriving after the first's prefill ended
finds the events alone.
"""

from __future__ import annotations

from dataclasses import replace

from lab.sim.replay import ReplaySettings, run_replay
from lab.traces import TraceRequest

PAIRS = 60
BLOCKS = 8


def _pairs(gap_ms: float) -> list[TraceRequest]:
    out = []
    for i in range(PAIRS):
        ids = tuple(1000 * i + j for j in range(BLOCKS))
        t = i * 20_000.0  # 20 s apart: each pair meets an idle fleet
        out.append(TraceRequest(t, BLOCKS * 512, 4, ids))
        out.append(TraceRequest(t + gap_ms, BLOCKS * 512, 4, ids))
    return out


# The blocks cost: the ttft cost sends the follower to an idle engine instead,
# since it waits out the first one's prefill on the predicted one (faster there).
SETTINGS = ReplaySettings(
    routers=2, workers=8, capacity=2000, seed=3, event_lag_s=5.0, cost_model="blocks", predict=False
)


async def _followers_hit(settings: ReplaySettings, gap_ms: float = 100.0) -> float:
    result = await run_replay(_pairs(gap_ms), settings, ["cache_shared"])
    (shared,) = result.results
    hits = shared.request_hits
    followed = sum(1 for i in range(1, len(hits), 2) if hits[i] > 0)
    return followed / PAIRS


async def test_predictions_send_a_request_after_its_prefix_within_the_lag() -> None:
    without = await _followers_hit(SETTINGS)
    with_predictions = await _followers_hit(replace(SETTINGS, predict=True))
    # Blind to the first request, the second finds it on 1 engine of 8 by chance.
    assert without < 0.4
    assert with_predictions == 1.0


async def test_a_prediction_that_expires_before_its_follower_recovers_nothing() -> None:
    short = await _followers_hit(replace(SETTINGS, predict=True, prediction_ttl_s=0.05))
    assert short < 0.4


async def test_without_lag_the_events_alone_suffice() -> None:
    # 4,096 tokens prefill in 0.41 s at the default rate: 1 s later the events are in.
    no_lag = replace(SETTINGS, event_lag_s=0.0)
    assert await _followers_hit(no_lag, gap_ms=1000.0) == 1.0
    # The same gap under the 5 s lag: the events are not in yet.
    assert await _followers_hit(SETTINGS, gap_ms=1000.0) < 0.4
