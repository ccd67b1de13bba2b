"""A pool mapped with ``populate`` has every page mapped at once (MAP_POPULATE).

The sidecar's copy then never waits for the kernel to map a page on its first
use (docs/benchmarks.md, "The decode engine's polling"). Checked on this
process's own mapping: the resident size /proc/self/smaps gives for the pool
file, all of it with ``populate``, none of it without (nothing touched it).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lab.bench.xfer_procs import ThreadedSidecar
from xfer.config import PoolSettings, XferConfig
from xfer.pool import KVPool, PoolGeometry

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MAP_POPULATE and smaps: Linux")

GEO = PoolGeometry(page_size=64 * 1024, page_count=128, aux_size=64, aux_count=4)


def _resident_bytes(path: str) -> int:
    """Resident bytes of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
                inside = len(head) >= 6 and head[5] == path
            elif inside and head and head[0] == "Rss:":
                total += int(head[1]) * 1024
    return total


@pytest.mark.parametrize("populate", [True, False])
def test_a_pool_is_mapped_whole_only_when_populated(tmp_path: Path, populate: bool) -> None:
    path = str(tmp_path / "pool")
    KVPool.create(path, GEO).close()
    pool = KVPool.attach(path, GEO, populate=populate)
    try:
        resident = _resident_bytes(path)
        if populate:
            assert resident >= GEO.total_bytes - 4096, resident
        else:
            assert resident < GEO.total_bytes // 4, resident
    finally:
        pool.close()


@pytest.mark.parametrize("populate", [True, False])
def test_the_sidecar_maps_its_pool_as_configured(tmp_path: Path, populate: bool) -> None:
    path = str(tmp_path / "pool")
    KVPool.create(path, GEO).close()
    pool = PoolSettings(
        path=path,
        page_size=GEO.page_size,
        page_count=GEO.page_count,
        aux_size=GEO.aux_size,
        aux_count=GEO.aux_count,
        populate=populate,
    )
    side = ThreadedSidecar(
        XferConfig(role="decode", port=0, metrics_port=0, transport="tcp", pool=pool)
    )
    side.start()
    try:
        resident = _resident_bytes(path)
        assert (resident >= GEO.total_bytes - 4096) == populate, resident
    finally:
        side.stop()


def test_populate_is_the_default() -> None:
    assert PoolSettings(path="/p", page_size=1, page_count=1).populate is True
