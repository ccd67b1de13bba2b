"""``observe_many`` records what as many ``observe`` calls would, in one step.

The xfer sidecar observes each chunk of a 64-chunk call (and of a write) with
it; a histogram that counted one observation, or put it in the wrong bucket,
would misreport every ``kvmesh_xfer_add_request_seconds`` and stage figure.
"""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from kvmesh.metrics import observe_many

BUCKETS = (1e-6, 5e-6, 1e-5, 1e-4, 1e-3)


def _exposition(r: CollectorRegistry) -> list[str]:
    """The text exposition without the ``_created`` timestamps (when each was made)."""
    return [ln for ln in generate_latest(r).decode().splitlines() if "_created" not in ln]


def _pair(labels: bool) -> tuple[CollectorRegistry, Histogram, CollectorRegistry, Histogram]:
    names = ["stage"] if labels else []
    a, b = CollectorRegistry(), CollectorRegistry()
    ha = Histogram("h_seconds", "h", names, buckets=BUCKETS, registry=a)
    hb = Histogram("h_seconds", "h", names, buckets=BUCKETS, registry=b)
    return a, ha, b, hb


@pytest.mark.parametrize("labels", [False, True])
def test_same_exposition_as_repeated_observe(labels: bool) -> None:
    rng = random.Random(3)
    a, ha, b, hb = _pair(labels)
    ca = ha.labels("submit") if labels else ha
    cb = hb.labels("submit") if labels else hb
    # Values below, between, on and above the bounds (the +Inf bucket).
    values = [0.0, 1e-6, 3e-6, 5e-6, 2e-5, 1e-3, 0.5, *(rng.uniform(0, 2e-3) for _ in range(20))]
    for v in values:
        n = rng.randint(1, 70)
        observe_many(ca, v, n)
        for _ in range(n):
            cb.observe(v)
    # Sums of many equal terms and of their product differ in the last bits.
    ea, eb = _exposition(a), _exposition(b)
    assert len(ea) == len(eb) and any("_bucket" in ln for ln in ea)
    for la, lb in zip(ea, eb, strict=True):
        if "_sum" in la and not la.startswith("#"):
            assert float(la.rsplit(" ", 1)[1]) == pytest.approx(float(lb.rsplit(" ", 1)[1]))
        else:
            assert la == lb


def test_none_is_nothing() -> None:
    a, ha, b, _ = _pair(False)
    observe_many(ha, 1e-4, 0)
    observe_many(ha, 1e-4, -3)
    assert _exposition(a) == _exposition(b)


def test_parent_of_a_labelled_histogram_is_refused() -> None:
    # As observe: the metric with labels is not observable, only its children.
    _, ha, _, _ = _pair(True)
    with pytest.raises(ValueError):
        observe_many(ha, 1e-4, 2)
