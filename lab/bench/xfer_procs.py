"""Start sidecars as real processes (tests and the benchmark), or in a thread.

A :class:`Sidecar` runs ``python -m kvmesh.cli xfer serve`` on a free port
as a :class:`lab.children.ChildProcess` and reports its address through a
ready file (its Prometheus metrics only when given a ``metrics_port``); a
:class:`ThreadedSidecar` serves from a thread of the calling process.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
import threading
import urllib.request
from types import TracebackType

from lab.children import ChildExited, ChildNotReady, ChildProcess, python_module
from xfer.config import XferConfig
from xfer.pool import PoolGeometry
from xfer.server import XferServer, start_server


class Sidecar:
    """A sidecar process (a :class:`lab.children.ChildProcess`), started at construction;
    a context manager that waits until it serves and stops it on exit."""

    def __init__(
        self,
        role: str,
        pool_path: str,
        geometry: PoolGeometry,
        *,
        transport: str = "tcp",
        extra: list[str] | None = None,
        log_level: str = "WARNING",
        metrics_port: int = 0,
    ) -> None:
        self.role = role
        #: Where /metrics is served (0: not served).
        self.metrics_port = metrics_port
        self._dir = tempfile.TemporaryDirectory(prefix="kvx-")
        self.ready_file = os.path.join(self._dir.name, "ready")
        self.log_path = os.path.join(self._dir.name, "log")
        args = [
            "xfer", "serve",
            "--role", role, "--port", "0", "--metrics-port", str(metrics_port),
            "--transport", transport, "--pool-path", pool_path,
            "--page-size", str(geometry.page_size), "--page-count", str(geometry.page_count),
            "--aux-size", str(geometry.aux_size), "--aux-count", str(geometry.aux_count),
            "--ready-file", self.ready_file, "--log-level", log_level,
            *(extra or []),
        ]  # fmt: skip
        env = dict(os.environ)
        # UCX and NIXL log to stdout/stderr; keep them quiet unless asked.
        env.setdefault("UCX_LOG_LEVEL", "error")
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        self.child = ChildProcess(
            python_module("kvmesh.cli", *args),
            name=f"{role} sidecar",
            env=env,
            log_path=self.log_path,
        ).start()
        self.address = ""

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The sidecar's process."""
        return self.child.proc

    def wait_ready(self, timeout_s: float = 30.0) -> str:
        """Wait until the sidecar serves (its ready file exists); return its host:port."""
        try:
            self.child.wait_ready(lambda: os.path.exists(self.ready_file), timeout_s)
        except ChildExited:
            raise RuntimeError(f"{self.role} sidecar exited: {self.log()}") from None
        except ChildNotReady:
            raise TimeoutError(
                f"{self.role} sidecar not ready in {timeout_s}s: {self.log()}"
            ) from None
        with open(self.ready_file) as f:
            self.address = f.read().strip()
        return self.address

    def metrics_text(self, timeout_s: float = 10.0) -> str:
        """The sidecar's /metrics page (it must have been started with a ``metrics_port``)."""
        if not self.metrics_port:
            raise RuntimeError(f"{self.role} sidecar was started without a metrics port")
        url = f"http://127.0.0.1:{self.metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:
            text: str = resp.read().decode()
        return text

    def log(self) -> str:
        """The process output so far (last 4 kB)."""
        return self.child.log_text(4096)

    def kill(self) -> None:
        """SIGKILL (a crash: no cleanup)."""
        self.child.kill()

    def stop(self) -> None:
        """SIGTERM and wait (SIGKILL after a grace period); delete the log and ready file."""
        self.child.stop()
        self._dir.cleanup()

    def __enter__(self) -> Sidecar:
        self.wait_ready()
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ThreadedSidecar:
    """A sidecar served from a thread of this process (its own event loop).

    For tests that need to reach into a sidecar (its logic, its transport)
    while calling it with the blocking client from the test thread.
    """

    def __init__(self, config: XferConfig) -> None:
        self.config = config
        self.server: XferServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="xfer-sidecar", daemon=True)

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            self.server = loop.run_until_complete(start_server(self.config))
        except BaseException as e:
            self._error = e
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self.server.stop(0))
        loop.close()

    def start(self) -> XferServer:
        """Start and wait until serving; return the server."""
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise self._error
        assert self.server is not None
        return self.server

    @property
    def address(self) -> str:
        """host:port of the gRPC endpoint."""
        assert self.server is not None
        return self.server.address

    def stop(self) -> None:
        """Stop the server and its thread."""
        if self._loop is not None and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=15)

    def __enter__(self) -> ThreadedSidecar:
        self.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, v: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
