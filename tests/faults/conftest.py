"""Fixtures of the fault harness tests: one private Redis and one Cluster with replicas.

Both live for the whole folder: the harness gives every round a fresh key
prefix, and the faults it injects (restarts, slot moves, failovers) leave
them serving.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator

import pytest

from indexer.redis.backend import RedisIndex
from lab.faults.faults import ClusterTarget, StandaloneTarget, Target
from lab.redisproc import RedisClusterProcess, RedisProcess


@pytest.fixture(scope="package")
def standalone() -> Iterator[StandaloneTarget]:
    """A private redis-server."""
    with RedisProcess() as proc:
        yield StandaloneTarget(proc)


@pytest.fixture(scope="package")
def cluster() -> Iterator[ClusterTarget]:
    """A private 3-master Redis Cluster with one replica per master."""
    with RedisClusterProcess(replicas=1) as proc:
        yield ClusterTarget(proc)


@pytest.fixture
def memory() -> Target:
    """The memory backend (one replica, its own index)."""
    return Target()


@pytest.fixture(autouse=True)
def _quiet_services() -> Iterator[None]:
    # Gaps, lost batches and retries are what the harness causes on purpose.
    loggers = [logging.getLogger(n) for n in ("indexer", "kvmesh")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    yield
    for lg, level in zip(loggers, levels, strict=True):
        lg.setLevel(level)


def replica_pair(request: pytest.FixtureRequest, target: str) -> tuple[RedisIndex, RedisIndex]:
    """Two RedisIndex replicas over one key prefix on the session's Redis (``standalone``)
    or Cluster (``cluster``). A long cache TTL makes "the other's table is younger than
    the bound" hold for a whole test; the contract's bound for blocks is 0 whatever it is."""
    prefix = f"rp{uuid.uuid4().hex[:8]}"
    if target == "cluster":
        url, cluster = request.getfixturevalue("redis_cluster").url, True
    else:
        url, cluster = request.getfixturevalue("redis_server").url, False
    return tuple(  # type: ignore[return-value]
        RedisIndex(url, prefix=prefix, cluster=cluster, instance_cache_ttl_s=60.0) for _ in range(2)
    )
