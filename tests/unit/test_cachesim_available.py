"""The cache simulator's decision accounting: the hit available to each routed request.

``available`` must be the longest prefix any worker's cache held *before* the
request's own worker took it in; a decision is optimal when its worker hit that
much. Checked on a hand-made fleet and, on random streams, against the caches'
own read-only lookups taken just before each access.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tee.cachesim.model import FleetCache
from tee.cachesim.server import report_to_pb


def test_a_request_routed_away_from_its_prefix_leaves_it_on_the_table() -> None:
    fleet = FleetCache(worker_capacity=8)
    fleet.access([1, 2, 3], "w1", now=0.0)
    away = fleet.access([1, 2, 3, 4], "w2", now=1.0)
    assert (away.available_hits, away.worker_hits) == (3, 0)
    home = fleet.access([1, 2, 3, 5], "w1", now=2.0)
    assert (home.available_hits, home.worker_hits) == (3, 3)
    total = fleet.report(now=2.0)["total"]
    assert isinstance(total, dict)
    assert total["available"]["hit_blocks"] == 0 + 3 + 3
    assert total["routed"]["hit_blocks"] == 0 + 0 + 3
    # the first request (nothing cached anywhere) and the last were optimal
    assert total["optimal_decisions"] == 2
    window = fleet.report(now=2.0)["window"]
    assert isinstance(window, dict)
    assert window["available"]["hit_blocks"] == 6
    assert window["optimal_decisions"] == 2


def test_an_unrouted_request_has_no_available_hit() -> None:
    fleet = FleetCache(worker_capacity=8)
    fleet.access([1, 2], "w1", now=0.0)
    got = fleet.access([1, 2], None, now=1.0)
    assert got.available_hits is None
    assert fleet.available_stats.requests == 1


def test_the_report_carries_the_accounting_over_grpc() -> None:
    sim = {"m": FleetCache(worker_capacity=4)}
    sim["m"].access([7, 8], "a", now=0.0)
    sim["m"].access([7, 8, 9], "b", now=0.5)
    pb = report_to_pb({"m": sim["m"].report(now=1.0)})
    (model,) = pb.models
    assert model.total.available.hit_blocks == 2
    assert model.total.optimal_decisions == 1
    assert model.window.available.blocks == 5


streams = st.lists(
    st.tuples(
        st.lists(st.integers(0, 5), min_size=1, max_size=6),
        st.sampled_from(["a", "b", "c"]),
    ),
    max_size=60,
)


def _chain(raw: list[int]) -> list[int]:
    # Prefix-shaped keys: key i depends on every key before it, as block keys do.
    out, h = [], 0
    for x in raw:
        h = h * 7 + x + 1
        out.append(h)
    return out


def _run(stream: list[tuple[list[int], str]], fleet: FleetCache) -> None:
    optimal = 0
    for t, (raw, worker) in enumerate(stream):
        keys = _chain(raw)
        before = max((c.lookup_prefix(keys) for c in fleet.workers.values()), default=0)
        got = fleet.access(keys, worker, now=float(t))
        assert got.available_hits == before
        assert got.worker_hits is not None and got.worker_hits <= before
        optimal += got.worker_hits == before
    assert fleet.optimal_decisions == optimal


@settings(max_examples=150, deadline=None)
@given(stream=streams, capacity=st.integers(1, 6))
def test_available_is_the_best_cache_before_the_access(
    stream: list[tuple[list[int], str]], capacity: int
) -> None:
    _run(stream, FleetCache(worker_capacity=capacity))


class _LateFleet(FleetCache):
    """Broken on purpose: reads the caches after the worker took the request in."""

    def access(self, keys, worker, now):  # type: ignore[no-untyped-def]
        got = super().access(keys, worker, now)
        late = max(c.lookup_prefix(keys) for c in self.workers.values())
        return type(got)(got.worker_hits, got.pooled_hits, got.infinite_hits, late)


def test_the_property_catches_an_accounting_read_after_the_access() -> None:
    stream = [([1, 2], "a"), ([3], "b")]
    try:
        _run(stream, _LateFleet(worker_capacity=4))
    except AssertionError:
        return
    raise AssertionError("an accounting read after the access passed the property")
