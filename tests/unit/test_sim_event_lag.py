"""Simulated engines publish a request's KV events when its prefill ends plus the event lag."""

from __future__ import annotations

from indexer.model import EventBatch
from lab.sim.clock import VirtualClock
from lab.sim.engine import ServiceModel, SimEngine, SimRequest


def _engine(
    clock: VirtualClock, sent: list[tuple[float, EventBatch]], lag: float | None
) -> SimEngine:
    async def publish(batch: EventBatch) -> None:
        sent.append((clock.now, batch))

    return SimEngine(
        name="e0",
        capacity=100,
        block_size=4,
        publish=publish,
        schedule=clock.schedule,
        on_load=lambda w, load, at: None,
        on_finish=lambda req, at: None,
        model=ServiceModel(prefill_tokens_per_s=4.0, decode_s_per_token=1.0, max_running=1),
        event_lag_s=lag,
    )


async def test_events_wait_for_the_prefill_and_the_lag_in_sequence_order() -> None:
    clock = VirtualClock()
    sent: list[tuple[float, EventBatch]] = []
    eng = _engine(clock, sent, lag=0.5)
    await eng.admit(SimRequest(1, 0.0, [1, 2], 8, 2), 0.0)  # prefill 0..2 s, decode to 4 s
    await eng.admit(SimRequest(2, 0.0, [3, 4], 8, 1), 0.0)  # waits for the slot: prefill 4..6 s
    assert sent == [] and not eng.outbox
    clock.run_until(2.4)
    await eng.flush()
    assert sent == []  # prefill over at 2 s, the lag not yet
    clock.run_until(2.5)
    await eng.flush()
    assert [(t, b.sequence, b.timestamp) for t, b in sent] == [(2.5, 1, 2.5)]
    clock.run_until(10.0)
    await eng.flush()
    assert [(b.sequence, b.timestamp) for _, b in sent] == [(1, 2.5), (2, 6.5)]
    # the cache took the blocks at admission all the same: the second prompt's
    # prefill starts only after the first's ended
    assert eng.queue_delays == [0.0, 4.0]
    assert eng.ttfts == [2.0, 6.0]
    assert eng.prefill_busy_s == 4.0
    assert eng.slot_work_s == 2.0 + 2.0 + 2.0 + 1.0


async def test_without_a_lag_events_go_out_at_admission() -> None:
    clock = VirtualClock()
    sent: list[tuple[float, EventBatch]] = []
    eng = _engine(clock, sent, lag=None)
    await eng.admit(SimRequest(1, 0.0, [1, 2], 8, 2), 0.0)
    assert [b.sequence for _, b in sent] == [1]
    clock.run_until(10.0)
    assert not eng.outbox
