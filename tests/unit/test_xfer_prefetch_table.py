"""The prefetch table without grpc: page holding, bounds, ttl and forgetting.

One :class:`PrefetchTable` over a real pool in a temporary file and a real TCP
transport (which cannot read: a started read fails the prefetch, naming the
transport). Clocks are moved with ``tick(now=...)``; the sidecar paths with
real NIXL reads are tests/integration/test_xfer_prefetch.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvmesh.errors import InvalidArgument, NotFound, ResourceExhausted
from xfer.config import PrefetchSettings
from xfer.logic import AlreadyExists, XferMetrics
from xfer.pool import KVPool, PoolGeometry
from xfer.prefetch import ClaimOutcome, PrefetchState, PrefetchTable
from xfer.transport import TcpTransport

GEO = PoolGeometry(page_size=256, page_count=64, aux_size=32, aux_count=4)


@pytest.fixture
def table(tmp_path: Path) -> Iterator[PrefetchTable]:
    pool = KVPool.create(str(tmp_path / "pool"), GEO)
    tr = TcpTransport(pool)
    t = PrefetchTable(
        PrefetchSettings(max_in_flight=2, default_ttl_s=1.0, pull_timeout_s=0.5),
        pool,
        tr,
        XferMetrics(),
    )
    t.start()
    yield t
    t.stop()
    tr.close()
    pool.close()


def value(t: PrefetchTable, name: str, **labels: str) -> float:
    v = t.metrics.registry.get_sample_value(name, labels)
    return 0.0 if v is None else v


def test_pages_are_held_while_open_and_released_by_a_cancel(table: PrefetchTable) -> None:
    a = table.open(1, "src:1", [5, 6], [10, 11])
    with pytest.raises(InvalidArgument) as e:
        table.open(2, "src:1", [7], [11])
    assert e.value.field == "dst_page_indices"
    with pytest.raises(AlreadyExists):
        table.open(1, "src:1", [7], [12])
    assert table.cancel(1) == PrefetchState.PULLING
    table.open(2, "src:1", [7], [11])  # released
    # A claim's fallback of prefetch 1 cannot take page 11 back from prefetch 2.
    with pytest.raises(InvalidArgument) as e:
        table.restart(a, time.monotonic() + 1)
    assert e.value.field == "dst_page_indices"
    assert value(table, "kvmesh_xfer_prefetches_total", event="cancelled") == 1


def test_the_bound_counts_open_prefetches_only(table: PrefetchTable) -> None:
    table.open(1, "s", [1], [1])
    table.open(2, "s", [2], [2])
    with pytest.raises(ResourceExhausted) as e:
        table.open(3, "s", [3], [3])
    assert e.value.field == "prefetch.max_in_flight"
    assert value(table, "kvmesh_xfer_prefetches_open") == 2
    table.cancel(1)
    table.open(3, "s", [3], [3])
    assert value(table, "kvmesh_xfer_prefetches_open") == 2


def test_an_unanswered_pull_fails_at_its_deadline_then_is_forgotten(
    table: PrefetchTable,
) -> None:
    pf = table.open(7, "s", [1, 2], [3, 4], ttl_ms=2000, deadline_ms=300)
    t0 = pf.created
    table.tick(now=t0 + 0.2)
    assert table.snapshot(7).state == PrefetchState.PULLING  # type: ignore[union-attr]
    table.tick(now=t0 + 0.31)
    snap = table.snapshot(7)
    assert snap is not None and snap.state == PrefetchState.FAILED
    assert "did not answer" in snap.reason
    table.tick(now=snap.forget_at - 0.01)
    assert table.snapshot(7) is not None  # a late claim still learns why
    table.tick(now=snap.forget_at + 0.01)
    with pytest.raises(NotFound):
        table.claim_begin(7)


def test_a_read_the_transport_cannot_do_fails_the_prefetch(table: PrefetchTable) -> None:
    pf = table.open(9, "s", [1], [2])
    done: list[PrefetchState] = []
    table.watch(pf, lambda: done.append(pf.state))
    assert table.start_read(pf, pf.attempt, "holder", GEO.page_count)
    t0 = time.monotonic()
    while not done and time.monotonic() - t0 < 5:
        time.sleep(0.01)
    assert done == [PrefetchState.FAILED]
    assert "transport" in pf.reason
    assert value(table, "kvmesh_xfer_prefetches_total", event="failed") == 1
    _, prior = table.claim_begin(9)
    assert prior == PrefetchState.FAILED
    table.claim_end(pf, ClaimOutcome.FAILED)
    assert value(table, "kvmesh_xfer_prefetch_claims_total", outcome="failed") == 1
    with pytest.raises(NotFound):
        table.claim_begin(9)


def test_source_pages_outside_the_source_are_refused(table: PrefetchTable) -> None:
    pf = table.open(4, "s", [1, 40], [2, 3])
    with pytest.raises(InvalidArgument) as e:
        table.start_read(pf, pf.attempt, "holder", 32)
    assert e.value.field == "src_page_indices"


def test_finished_prefetches_beyond_the_cap_are_forgotten_oldest_first(
    table: PrefetchTable,
) -> None:
    for pid in range(1, 11):  # cap: 4 per open slot, 2 slots
        table.open(pid, "s", [1], [1])
        table.cancel(pid)
    known = [pid for pid in range(1, 11) if table.snapshot(pid) is not None]
    assert len(known) <= 8
    assert known == list(range(11 - len(known), 11))
