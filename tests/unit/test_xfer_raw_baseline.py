"""The benchmark's raw NIXL baseline is not slowed by a resting receiver.

``kvmesh bench xfer`` reports the sidecar's throughput against a raw NIXL write
of the same bytes to another process (``nixl_raw_gbps``). A NIXL poller with no
room unfinished rests (``NixlTransport.IDLE_POLL_S``, 50 ms), and a 4 MiB write
waits for the receiver's progress: with the raw target resting, a raw post took
about 50 ms (measured: 48-52 ms, now and then 1-2 ms), the baseline fell to
0.09 GB/s for 4 MiB and the sweep's ``async_vs_raw`` rose to 11. The raw target
now polls as a decode sidecar does while a room is unfinished (0.4-1.4 ms a post).
"""

from __future__ import annotations

import statistics
import tempfile

from lab.bench import xfer as bench
from xfer.transport import NixlTransport, nixl_available


def _raw_posts_s(expecting: bool) -> list[float]:
    """Seconds of each timed raw post: 4 MiB (one room of 64 pages of 64 KiB)
    whole, then as the runs of a planned batch."""
    assert nixl_available(), "nixl-cu12 is not importable: run `make setup`"
    p = bench.BenchParams(rooms=1, pages=64, iters=6)
    took: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        pools = bench._Pools(p, d)
        try:
            bench.raw_gbps(p, pools, target_expecting=expecting, post_s=took)
        finally:
            pools.close()
    assert len(took) == 2 * p.iters
    return took


def test_a_raw_post_does_not_wait_for_a_resting_receiver() -> None:
    bound = NixlTransport.IDLE_POLL_S / 5  # 10 ms
    shipped = statistics.median(_raw_posts_s(True))
    assert shipped < bound, f"{shipped * 1e3:.1f} ms a post"
    # The broken model, the target left resting, is slow enough for the bound to see it.
    resting = statistics.median(_raw_posts_s(False))
    assert resting >= bound, f"{resting * 1e3:.1f} ms a post"
