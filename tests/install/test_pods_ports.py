"""The install tests' ports: free, never given twice, and below the kernel's
ephemeral range, so no connection made meanwhile can take one before the
process it is meant for binds it."""

from __future__ import annotations

import socket

from lab.redisproc import ephemeral_range
from tests.install import pods


def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low, _ = ephemeral_range()
    got = [pods.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    assert all(1024 <= p < low and p != 6379 for p in got), got
    for p in got[:20]:
        with socket.socket() as s:
            s.bind((pods.POD_IP, p))


def test_a_port_in_use_is_not_given() -> None:
    low, _ = ephemeral_range()
    taken = []
    try:
        # Occupy a stretch of the range the ports come from; none of it comes back.
        for port in range(low - 200, low):
            s = socket.socket()
            try:
                s.bind((pods.POD_IP, port))
            except OSError:
                s.close()
                continue
            s.listen()
            taken.append(s)
        busy = {s.getsockname()[1] for s in taken}
        assert not busy & {pods.free_port() for _ in range(300)}
    finally:
        for s in taken:
            s.close()
