"""Closing a TCP transport ends its accept thread.

A listening socket closed from another thread does not wake a thread blocked in
``accept()`` on Linux, so a sidecar that made and closed transports (a restart
of its data plane, every test of the suite) kept one thread per transport
blocked for the life of the process.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from xfer.pool import KVPool, PoolGeometry
from xfer.transport import TcpTransport

GEO = PoolGeometry(page_size=256, page_count=8, aux_size=32, aux_count=2)


def test_close_ends_the_accept_thread(tmp_path: Path) -> None:
    pool = KVPool.create(str(tmp_path / "pool"), GEO)
    try:
        before = set(threading.enumerate())
        tr = TcpTransport(pool)
        tr.start()
        started = [t for t in threading.enumerate() if t not in before]
        assert [t.name for t in started] == ["tcp-accept"]
        time.sleep(0.2)  # blocked in accept()
        tr.close()
        started[0].join(timeout=5)
        assert not started[0].is_alive(), "the accept thread outlived its transport"
    finally:
        pool.close()
