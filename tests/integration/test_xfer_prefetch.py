"""Prefetch before dispatch against real ``kvmesh xfer serve`` processes over NIXL.

One prefill/decode pair (tests/integration/xfer_pair.py, NIXL transport, the
decode sidecar allowing two open prefetches) serves the module: the prefill
sidecar holds the prefix (its pool filled with random bytes), the decode
sidecar pulls it with a NIXL READ. Every delivered page is compared with the
source page, and the destination pages are checked to differ from it first,
so a pull that did not happen (or a claim that vouches for stale pages) fails
the test. The stall and crash paths use a third sidecar as the source, stopped
with SIGSTOP (it never answers) or killed, so the pair is left intact.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvmesh.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    KvmeshError,
    NotFound,
    ResourceExhausted,
)
from lab.bench.xfer_procs import Sidecar
from tests.integration.xfer_pair import SidecarPair, sidecar_pair
from xfer.logic import AlreadyExists
from xfer.pool import KVPool, PoolGeometry
from xfer.prefetch import ClaimOutcome, PrefetchState
from xfer.transport import nixl_available


@pytest.fixture(autouse=True)
def _nixl() -> None:
    """These tests need real NIXL: without it they fail (``make setup`` installs it)."""
    assert nixl_available(), "nixl-cu12 is not importable: run `make setup`"


GEO = PoolGeometry(page_size=4096, page_count=256, aux_size=64, aux_count=8)
MAX_OPEN = 2


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarPair]:
    with sidecar_pair(
        tmp_path_factory, GEO, tag="prefetch", waiting_timeout_s=30, metrics=True,
        transport="nixl", extra=["--prefetch-max-in-flight", str(MAX_OPEN)],
    ) as p:  # fmt: skip
        yield p


def events(pair: SidecarPair) -> dict[str, float]:
    """``kvmesh_xfer_prefetches_total`` by event and claims by outcome, from /metrics."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(pair.ds.metrics_text()):
        for s in family.samples:
            if s.name == "kvmesh_xfer_prefetches_total":
                out[s.labels["event"]] = s.value
            elif s.name == "kvmesh_xfer_prefetch_claims_total":
                out["claim_" + s.labels["outcome"]] = s.value
            elif s.name == "kvmesh_xfer_prefetches_open":
                out["open"] = s.value
    return out


def moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)}


def fresh(pair: SidecarPair, dst: list[int]) -> None:
    """Zero decode's pages ``dst`` (the engine's pool: nothing prefetched there yet)."""
    for d in dst:
        pair.decode.page(d)[:] = bytes(GEO.page_size)


def delivered(pool: KVPool, src: list[int], decode: KVPool, dst: list[int]) -> bool:
    return all(bytes(pool.page(s)) == bytes(decode.page(d)) for s, d in zip(src, dst, strict=True))


def test_prefetch_then_claim_delivers_the_source_pages(pair: SidecarPair) -> None:
    src = [3, 4, 5, 9, 17, 18, 40, 41]  # fragmented: several runs
    dst = [200, 201, 7, 8, 9, 60, 61, 62]
    fresh(pair, dst)
    assert not delivered(pair.prefill, src, pair.decode, dst)  # the check can fail
    before = events(pair)
    pid, state = pair.dc.prefetch(pair.ps.address, src, dst, prefetch_id=101)
    assert pid == 101
    assert state in (PrefetchState.PULLING, PrefetchState.READY)
    time.sleep(1.0)  # long past the pull (milliseconds): the claim finds the bytes there
    outcome, prior, reason, nbytes = pair.dc.claim_prefetch(101)
    assert (outcome, prior, reason) == (ClaimOutcome.READY, PrefetchState.READY, "")
    assert nbytes == len(dst) * GEO.page_size
    assert delivered(pair.prefill, src, pair.decode, dst)
    with pytest.raises(NotFound) as e:  # a claimed prefetch is forgotten
        pair.dc.claim_prefetch(101)
    assert e.value.field == "prefetch_id"
    assert moved(before, events(pair)) == {"issued": 1, "claimed": 1, "claim_ready": 1}


def test_a_claim_right_after_the_prefetch_gets_the_bytes(pair: SidecarPair) -> None:
    src = list(range(100, 132))
    dst = list(range(140, 172))
    fresh(pair, dst)
    pid, _ = pair.dc.prefetch(pair.ps.address, src, dst)  # the sidecar picks the id
    assert pid != 0
    outcome, _, _, nbytes = pair.dc.claim_prefetch(pid, timeout_ms=5000)
    assert outcome in (ClaimOutcome.READY, ClaimOutcome.WAITED)
    assert nbytes == 32 * GEO.page_size
    assert delivered(pair.prefill, src, pair.decode, dst)


@pytest.mark.parametrize(
    "case",
    ["dst_outside", "src_outside_source", "lengths", "duplicate_dst", "no_source", "unreachable"],
)
def test_bad_prefetches_are_refused_naming_the_field(pair: SidecarPair, case: str) -> None:
    addr = pair.ps.address
    args: dict[str, tuple[str, list[int], list[int]]] = {
        "dst_outside": (addr, [1], [GEO.page_count]),
        "src_outside_source": (addr, [GEO.page_count], [1]),
        "lengths": (addr, [1, 2], [1]),
        "duplicate_dst": (addr, [1, 2], [5, 5]),
        "no_source": ("", [1], [1]),
        "unreachable": ("127.0.0.1:1", [1], [1]),
    }
    want: dict[str, tuple[type[KvmeshError], str]] = {
        "dst_outside": (InvalidArgument, "dst_page_indices"),
        "src_outside_source": (InvalidArgument, "src_page_indices"),
        "lengths": (InvalidArgument, "dst_page_indices"),
        "duplicate_dst": (InvalidArgument, "dst_page_indices"),
        "no_source": (InvalidArgument, "source_address"),
        "unreachable": (FailedPrecondition, "source_address"),
    }
    exc, field = want[case]
    with pytest.raises(exc) as e:
        pair.dc.prefetch(*args[case])
    assert type(e.value) is exc
    assert e.value.field == field


def test_unknown_ids_wrong_role_and_reused_ids(pair: SidecarPair) -> None:
    for call in (pair.dc.claim_prefetch, pair.dc.cancel_prefetch):
        with pytest.raises(NotFound) as e:
            call(987654321)
        assert e.value.field == "prefetch_id"
    with pytest.raises(FailedPrecondition):  # a prefill sidecar takes no prefetch
        pair.pc.prefetch(pair.ds.address, [1], [1])
    pair.dc.prefetch(pair.ps.address, [1], [230], prefetch_id=55)
    with pytest.raises(AlreadyExists) as e:
        pair.dc.prefetch(pair.ps.address, [2], [231], prefetch_id=55)
    assert e.value.field == "prefetch_id"
    with pytest.raises(InvalidArgument) as e:  # page 230 belongs to prefetch 55
        pair.dc.prefetch(pair.ps.address, [2], [230], prefetch_id=56)
    assert e.value.field == "dst_page_indices"
    assert pair.dc.claim_prefetch(55)[0] in (ClaimOutcome.READY, ClaimOutcome.WAITED)
    # Claimed: the page is the engine's, and the id is free again.
    pair.dc.prefetch(pair.ps.address, [2], [230], prefetch_id=55)
    pair.dc.claim_prefetch(55)


def test_past_the_bound_is_resource_exhausted(pair: SidecarPair) -> None:
    open_ids = [301, 302]
    for i, pid in enumerate(open_ids):
        pair.dc.prefetch(pair.ps.address, [10 + i], [210 + i], prefetch_id=pid)
    with pytest.raises(ResourceExhausted) as e:
        pair.dc.prefetch(pair.ps.address, [12], [212], prefetch_id=303)
    assert e.value.field == "prefetch.max_in_flight"
    assert events(pair)["open"] == MAX_OPEN
    pair.dc.claim_prefetch(301)  # one slot free: the next is accepted
    pair.dc.prefetch(pair.ps.address, [12], [212], prefetch_id=303)
    for pid in (302, 303):
        assert pair.dc.claim_prefetch(pid)[0] in (ClaimOutcome.READY, ClaimOutcome.WAITED)
    assert events(pair)["open"] == 0


def cancel_when_known(pair: SidecarPair, pid: int, timeout_s: float = 10.0) -> PrefetchState:
    """Cancel ``pid`` as soon as the decode sidecar has recorded it."""
    t0 = time.monotonic()
    while True:
        try:
            return pair.dc.cancel_prefetch(pid)
        except NotFound:
            if time.monotonic() - t0 > timeout_s:
                raise
            time.sleep(0.005)


@pytest.fixture
def holder(pair: SidecarPair, tmp_path: Path) -> Iterator[tuple[Sidecar, KVPool]]:
    """A third sidecar holding random pages, to stall or kill."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    pool = KVPool.create(str(base / f"kvx-holder-{os.getpid()}-{time.monotonic_ns()}"), GEO)
    pool.view[:] = os.urandom(GEO.total_bytes)
    s = Sidecar("prefill", pool.path, GEO, transport="nixl")
    s.wait_ready()
    try:
        yield s, pool
    finally:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGCONT)
        s.stop()
        pool.close()
        pool.unlink()


def test_cancel_before_completion_releases_and_the_claim_reports_or_falls_back(
    pair: SidecarPair, holder: tuple[Sidecar, KVPool]
) -> None:
    s, pool = holder
    src, dst = [20, 21, 22, 30], [100, 101, 102, 110]
    fresh(pair, dst)
    before = events(pair)
    s.proc.send_signal(signal.SIGSTOP)  # the source never answers its OpenRead
    call = pair.dc.prefetch_nowait(s.address, src, dst, prefetch_id=401, deadline_ms=20000)
    assert cancel_when_known(pair, 401) == PrefetchState.PULLING
    t0 = time.monotonic()
    assert call.result(timeout=10).state == PrefetchState.CANCELLED  # returns at the cancel
    assert time.monotonic() - t0 < 5
    # Released: another prefetch may name the pages now (the check refuses them above).
    pair.dc.prefetch(pair.ps.address, [1], [dst[0]], prefetch_id=402)
    pair.dc.claim_prefetch(402)
    outcome, prior, reason, nbytes = pair.dc.claim_prefetch(401, fallback=False)
    assert (outcome, prior, nbytes) == (ClaimOutcome.FAILED, PrefetchState.CANCELLED, 0)
    assert "cancelled" in reason
    # Same again, then the source wakes up: the claim's fallback pulls the pages.
    fresh(pair, dst)
    call = pair.dc.prefetch_nowait(s.address, src, dst, prefetch_id=403, deadline_ms=20000)
    assert cancel_when_known(pair, 403) == PrefetchState.PULLING
    assert call.result(timeout=10).state == PrefetchState.CANCELLED
    s.proc.send_signal(signal.SIGCONT)
    time.sleep(0.3)  # the stalled OpenReads are answered now, and ignored
    assert not delivered(pool, src, pair.decode, dst)  # nothing landed for the cancelled ones
    outcome, prior, _, nbytes = pair.dc.claim_prefetch(403, timeout_ms=5000)
    assert (outcome, prior) == (ClaimOutcome.FALLBACK, PrefetchState.CANCELLED)
    assert nbytes == len(dst) * GEO.page_size
    assert delivered(pool, src, pair.decode, dst)
    got = moved(before, events(pair))
    quick = got.pop("claim_ready", 0) + got.pop("claim_waited", 0)  # prefetch 402's claim
    assert quick == 1
    assert got == {
        "issued": 3, "cancelled": 2, "claimed": 3, "claim_failed": 1, "claim_fallback": 1
    }  # fmt: skip


def test_a_stalled_or_killed_source_fails_within_the_deadline(
    pair: SidecarPair, holder: tuple[Sidecar, KVPool]
) -> None:
    s, _ = holder
    src, dst = [1, 2, 3], [120, 121, 122]
    s.proc.send_signal(signal.SIGSTOP)
    # A source that never answers: the Prefetch gives up at its deadline.
    t0 = time.monotonic()
    with pytest.raises(DeadlineExceeded) as e:
        pair.dc.prefetch(s.address, src, dst, prefetch_id=502, deadline_ms=1000)
    assert e.value.field == "deadline_ms"
    assert 0.9 < time.monotonic() - t0 < 4
    # Its claim tries the stalled source again, and gives up at the claim's timeout.
    t0 = time.monotonic()
    outcome, prior, reason, _ = pair.dc.claim_prefetch(502, timeout_ms=1000)
    assert (outcome, prior) == (ClaimOutcome.FAILED, PrefetchState.FAILED)
    assert "fallback" in reason
    assert time.monotonic() - t0 < 1.0 + 1.0
    # Killed while its OpenRead is in flight: the prefetch fails, and so does the
    # claim's fallback pull, within the claim's timeout.
    call = pair.dc.prefetch_nowait(s.address, src, dst, prefetch_id=501, deadline_ms=3000)
    time.sleep(0.3)  # the OpenRead is on its way to the stopped source
    s.kill()
    with pytest.raises(grpc.RpcError) as rpc:
        call.result(timeout=10)
    assert rpc.value.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    t0 = time.monotonic()
    outcome, prior, reason, nbytes = pair.dc.claim_prefetch(501, timeout_ms=2000)
    took = time.monotonic() - t0
    assert (outcome, prior, nbytes) == (ClaimOutcome.FAILED, PrefetchState.FAILED, 0)
    assert "fallback" in reason  # it tried to pull again, and that failed too
    assert took < 2.0 + 1.0, took  # bounded by the claim's timeout: no hang
    assert events(pair)["open"] == 0


def test_an_unclaimed_prefetch_expires_after_its_ttl(pair: SidecarPair) -> None:
    src, dst = [50, 51, 52, 53], [80, 81, 82, 83]
    fresh(pair, dst)
    before = events(pair)
    pair.dc.prefetch(pair.ps.address, src, dst, prefetch_id=601, ttl_ms=400)
    time.sleep(1.2)  # past the ttl and the next timeout sweep
    assert events(pair)["open"] == 0
    outcome, prior, reason, _ = pair.dc.claim_prefetch(601, fallback=False)
    assert (outcome, prior) == (ClaimOutcome.FAILED, PrefetchState.EXPIRED)
    assert "ttl" in reason
    # Expired, then claimed with a fallback: pulled again, byte for byte.
    fresh(pair, dst)
    pair.dc.prefetch(pair.ps.address, src, dst, prefetch_id=602, ttl_ms=400)
    time.sleep(1.2)
    outcome, prior, _, _ = pair.dc.claim_prefetch(602, timeout_ms=5000)
    assert (outcome, prior) == (ClaimOutcome.FALLBACK, PrefetchState.EXPIRED)
    assert delivered(pair.prefill, src, pair.decode, dst)
    got = moved(before, events(pair))
    assert got == {"issued": 2, "expired": 2, "claimed": 2, "claim_failed": 1, "claim_fallback": 1}


def test_a_tcp_sidecar_refuses_prefetch_naming_the_transport(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    with sidecar_pair(tmp_path_factory, GEO, tag="prefetch-tcp", waiting_timeout_s=30) as p:
        with pytest.raises(FailedPrecondition) as e:
            p.dc.prefetch(p.ps.address, [1], [1], prefetch_id=1)
        assert e.value.field == "transport"
        with pytest.raises(NotFound):  # nothing was recorded
            p.dc.claim_prefetch(1)
