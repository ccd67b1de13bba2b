"""A local HTTP sink speaking the cache-sim wire, with injected latency and faults.

Used by the tests and by ``kvmesh bench tee``. It accepts ``POST /ingest_ids``
and ``/extend_ids``, waits ``latency_s``, answers ``status`` and counts what it
received. :func:`start_garbage_server` answers every connection with bytes
that are not HTTP. Run standalone (``python -m lab.bench.testsink --latency-ms 9``,
a :class:`lab.children.ChildProcess` of ``kvmesh bench tee``) it prints
``READY <port>`` and serves until stdin closes or SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from aiohttp import web

from lab.children import serve_until_told


class TestSink:
    """An aiohttp server on 127.0.0.1 recording events (header names lower-cased) or counting."""

    __test__ = False  # not a pytest class

    def __init__(self, *, latency_s: float = 0.0, status: int = 200, record: bool = True) -> None:
        self.latency_s = latency_s
        self.status = status
        self.record = record
        self.count = 0
        self.received: list[tuple[str, dict[str, Any], dict[str, str]]] = []
        self._runner: web.AppRunner | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """Base URL of the running sink."""
        return f"http://127.0.0.1:{self.port}"

    async def _handle(self, request: web.Request) -> web.Response:
        raw = await request.read()
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        self.count += 1
        if self.record:
            self.received.append(
                (
                    request.path.lstrip("/"),
                    json.loads(raw),
                    {k.lower(): v for k, v in request.headers.items()},
                )
            )
        return web.Response(status=self.status, text="{}", content_type="application/json")

    async def start(self, port: int = 0) -> TestSink:
        """Listen on 127.0.0.1:``port`` (0: a free one)."""
        app = web.Application(client_max_size=64 << 20)
        app.router.add_post("/ingest_ids", self._handle)
        app.router.add_post("/extend_ids", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port)
        await site.start()
        self.port = int(self._runner.addresses[0][1])
        return self

    async def stop(self) -> None:
        """Stop serving."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None


async def start_garbage_server() -> tuple[asyncio.Server, str]:
    """A TCP server answering every connection with non-HTTP bytes; returns (server, url)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.read(65536)
            writer.write(b"\x00\x01 this is not http \xff\r\n\r\n")
            await writer.drain()
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    return server, f"http://127.0.0.1:{port}"


def main(argv: list[str] | None = None) -> int:
    """Serve a counting sink until stdin closes (or SIGTERM)."""
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--latency-ms", type=float, default=9.0)
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args(argv)
    sink = TestSink(latency_s=args.latency_ms / 1000, record=False)
    return serve_until_told(lambda: sink.start(args.port), lambda s: s.stop())


if __name__ == "__main__":
    sys.exit(main())
