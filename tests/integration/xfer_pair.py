"""A prefill/decode pair of real ``kvmesh xfer serve`` processes over two pools.

What the tests that move rooms through sidecar processes share
(tests/integration/test_xfer_batch.py, test_xfer_stages.py): the pools (the
prefill one filled with random bytes), the two sidecars on the TCP transport
(optionally serving /metrics), a client to each, the byte-for-byte check, and
waiting for a room's status. The test process plays both engines.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from lab.bench.xfer_procs import Sidecar
from lab.redisproc import free_port
from xfer.client import XferClient
from xfer.logic import ChunkRequest, RoomStatus
from xfer.pool import KVPool, PoolGeometry


class SidecarPair:
    """Two pools and the prefill/decode sidecar processes over them (TCP unless
    ``transport`` says otherwise; ``extra``: more flags for both sidecars)."""

    def __init__(
        self,
        base: Path,
        geo: PoolGeometry,
        *,
        tag: str,
        waiting_timeout_s: float,
        heartbeat_s: float = 0.5,
        metrics: bool = False,
        transport: str = "tcp",
        extra: list[str] | None = None,
    ) -> None:
        self.geo = geo
        name = f"kvx-{tag}-{os.getpid()}-{random.getrandbits(32):x}"
        self.prefill = KVPool.create(str(base / f"{name}-p"), geo)
        self.decode = KVPool.create(str(base / f"{name}-d"), geo)
        self.prefill.view[:] = os.urandom(geo.total_bytes)
        args = ["--heartbeat-interval-s", str(heartbeat_s)]
        args += ["--waiting-timeout-s", str(waiting_timeout_s), *(extra or [])]
        self.ps = Sidecar(
            "prefill", self.prefill.path, geo, transport=transport, extra=args,
            metrics_port=free_port() if metrics else 0,
        )  # fmt: skip
        self.ds = Sidecar(
            "decode", self.decode.path, geo, transport=transport, extra=args,
            metrics_port=free_port() if metrics else 0,
        )  # fmt: skip
        self.ps.wait_ready()
        self.ds.wait_ready()
        self.pc = XferClient(self.ps.address)
        self.dc = XferClient(self.ds.address)

    def same(self, src: list[int], dst: list[int], aux_src: int, aux_dst: int) -> bool:
        """Whether decode's pages ``dst`` and aux slot hold prefill's ``src`` and aux."""
        ok = all(
            bytes(self.prefill.page(s)) == bytes(self.decode.page(d))
            for s, d in zip(src, dst, strict=True)
        )
        return ok and bytes(self.prefill.aux(aux_src)) == bytes(self.decode.aux(aux_dst))

    def register(self, room: int, dst: list[int], aux_dst: int) -> None:
        """Register ``room`` on decode and wait until prefill knows its destination."""
        self.dc.register_room(room, self.ps.address, dst, aux_index=aux_dst)
        wait(self.dc, room, {RoomStatus.WAITING_FOR_INPUT})

    def close(self) -> None:
        self.pc.close()
        self.dc.close()
        self.ps.stop()
        self.ds.stop()
        for p in (self.prefill, self.decode):
            p.close()
            p.unlink()


@contextlib.contextmanager
def sidecar_pair(
    tmp_path_factory: pytest.TempPathFactory,
    geo: PoolGeometry,
    *,
    tag: str,
    waiting_timeout_s: float,
    metrics: bool = False,
    transport: str = "tcp",
    extra: list[str] | None = None,
) -> Iterator[SidecarPair]:
    """A :class:`SidecarPair` (pools in /dev/shm when there is one), closed after;
    ``transport`` and ``extra`` (flags of both sidecars) as :class:`SidecarPair`'s."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path_factory.mktemp("pools")
    p = SidecarPair(
        base, geo, tag=tag, waiting_timeout_s=waiting_timeout_s, metrics=metrics,
        transport=transport, extra=extra,
    )  # fmt: skip
    try:
        yield p
    finally:
        p.close()


def wait(client: XferClient, room: int, want: set[RoomStatus], timeout: float = 10.0) -> None:
    """Wait until ``room`` reaches a status in ``want`` (fails the test otherwise)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st, reason = client.poll(room)
        if st in want:
            return
        if st == RoomStatus.FAILED:
            pytest.fail(f"room {room} failed: {reason}")
        time.sleep(0.002)
    pytest.fail(f"room {room} stuck in {client.poll(room)}")


def chunks(
    room: int, src: list[int], per: int, aux_src: int, first_id: int = 0
) -> list[ChunkRequest]:
    """``src`` cut into chunks of ``per`` pages; the last carries ``aux_src``."""
    n = len(src) // per
    return [
        (room, src[c * per : (c + 1) * per], (c * per, (c + 1) * per), c == n - 1, aux_src, c)
        for c in range(first_id, n)
    ]
