"""Summary statistics every kvmesh part reports the same way.

One definition of a percentile for every latency figure, table and view
(benchmarks, the soak, the replay, ``kvmesh up``), so that a p99 in one
report means what it means in another.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

#: Far below any real fractional rank (n <= 10^9 samples), far above float rounding error.
_RANK_TOLERANCE = 1e-9


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-quantile (``0 <= q <= 1``) of ``values`` by the nearest-rank method.

    The smallest sample that at least a fraction ``q`` of the samples are
    less than or equal to: with the ``n`` samples sorted ascending, the one
    at 1-based rank ``ceil(q * n)`` (rank 1 for ``q == 0``). The answer is
    always one of the samples, never an interpolation between two: a p99 of
    latencies is a latency some call really took, and the p50 of an even
    number of samples is the lower of the middle two.

    Raises ``ValueError`` for no samples or ``q`` outside ``[0, 1]``; a
    caller with nothing measured decides what to report instead.
    """
    if not values:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile: q must lie in [0, 1], got {q}")
    ordered = sorted(values)
    # The tolerance keeps float noise (0.07 * 100 == 7.000000000000001) from
    # moving an exact rank up by one.
    rank = max(1, math.ceil(q * len(ordered) - _RANK_TOLERANCE))
    return ordered[min(rank, len(ordered)) - 1]
