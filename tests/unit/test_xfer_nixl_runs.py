"""A NIXL write's descriptors, built by columns: every run lands where it should,
and a run outside either pool is refused by name before anything moves.

Two real NIXL agents in this process over two pools; the prefill side writes
fragmented runs of several lengths (the shape a coalesced write has) and the
destination bytes are compared with the source's.
"""

from __future__ import annotations

import os
import random
import time
from pathlib import Path

import pytest

from kvmesh.errors import InvalidArgument
from xfer.pool import KVPool, PoolGeometry
from xfer.transport import NixlTransport, make_transport, nixl_available, wait_state

GEO = PoolGeometry(page_size=4096, page_count=256, aux_size=64, aux_count=1)


@pytest.fixture
def pair(tmp_path: Path):  # type: ignore[no-untyped-def]
    assert nixl_available(), "nixl-cu12 is not importable: run `make setup`"
    src = KVPool.create(str(tmp_path / "src"), GEO)
    dst = KVPool.create(str(tmp_path / "dst"), GEO)
    src.view[:] = os.urandom(GEO.total_bytes)
    a = make_transport("nixl", src)
    b = make_transport("nixl", dst)
    assert isinstance(a, NixlTransport) and isinstance(b, NixlTransport)
    got: list[bytes] = []
    b.set_notif_handler(lambda peer, tag: got.append(tag))
    b.set_expecting(True)
    a.start()
    b.start()
    a.add_peer(b.name, b.metadata())
    try:
        yield a, b, src, dst, got
    finally:
        a.close()
        b.close()
        for p in (src, dst):
            p.close()


def test_fragmented_runs_land_byte_for_byte(pair) -> None:  # type: ignore[no-untyped-def]
    a, b, src, dst, got = pair
    rng = random.Random(11)
    pages = GEO.page_size
    # 60 runs of 1..4 pages, sources and destinations shuffled, none overlapping.
    s_starts = rng.sample(range(0, 240, 4), 60)
    d_starts = rng.sample(range(0, 240, 4), 60)
    runs = [
        (s * pages, d * pages, rng.randint(1, 4) * pages)
        for s, d in zip(s_starts, d_starts, strict=True)
    ]
    handle = a.post(b.name, runs, b"tag-1")
    assert wait_state(a, handle, 10.0) == "DONE"
    a.release(handle)
    deadline = time.monotonic() + 10
    while not got and time.monotonic() < deadline:
        time.sleep(0.001)
    assert got == [b"tag-1"]
    for s, d, n in runs:
        assert bytes(dst.view[d : d + n]) == bytes(src.view[s : s + n])


@pytest.mark.parametrize(
    "bad",
    [
        (-4096, 0, 4096),  # before the source pool
        (0, GEO.total_bytes - 100, 4096),  # past the destination's end
        (GEO.total_bytes, 0, 1),  # past the source's end
        (0, 0, 0),  # empty
        (0, 1 << 70, 4096),  # beyond any integer a descriptor holds
    ],
)
def test_a_run_outside_a_pool_is_refused_by_name(pair, bad) -> None:  # type: ignore[no-untyped-def]
    a, b, _, dst, got = pair
    before = bytes(dst.view)
    good = (0, 8192, 4096)
    with pytest.raises(InvalidArgument) as e:
        a.post(b.name, [good, bad, good], b"tag-2")
    assert e.value.field == "run"
    assert f"run {bad[0]}->{bad[1]} ({bad[2]} bytes)" in str(e.value)
    time.sleep(0.05)
    assert got == [] and bytes(dst.view) == before
